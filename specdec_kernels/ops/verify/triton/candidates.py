"""The warp's candidates: the split kernel's device functions for top-k, top-p and min-p
(``verify.triton.split_kernel``'s header gives the design): each chunk's candidate keys
(``_chunk_candidates``, by radix select on 8-bit digits, ``_radix_select``), top-k and top-p
decided from a position's candidates (``_warp_from_candidates``), and min-p's threshold as an
order key (``min_p_key``, by ``reference.min_p_log``'s float64 steps, with the reference's
constants bit for bit).

Memory traffic: none of them reads the logits (the kernel hands them a chunk's keys or a
position's candidates in registers).  ``_chunk_candidates`` writes a chunk's list, at most
CAP * 4 bytes; ``_warp_from_candidates`` stores and reloads the top-k set through at most
CAP * 4 bytes of scratch when it decides top-p over it; the radix select and ``min_p_key`` work
in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import order_key

_INT32_MAX = tl.constexpr(2147483647)
_INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def _key_value(key):
    """The fp32 value of an order key (the inverse of ``order_key``)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


# reference.min_p_log's constants: 2 / (2k + 1), k = 0..11 (ln f = 2 atanh z), ln 2, sqrt(2)
_LC0 = tl.constexpr(2.0)
_LC1 = tl.constexpr(0.6666666666666666)
_LC2 = tl.constexpr(0.4)
_LC3 = tl.constexpr(0.2857142857142857)
_LC4 = tl.constexpr(0.2222222222222222)
_LC5 = tl.constexpr(0.18181818181818182)
_LC6 = tl.constexpr(0.15384615384615385)
_LC7 = tl.constexpr(0.13333333333333333)
_LC8 = tl.constexpr(0.11764705882352941)
_LC9 = tl.constexpr(0.10526315789473684)
_LC10 = tl.constexpr(0.09523809523809523)
_LC11 = tl.constexpr(0.08695652173913043)
_LN2 = tl.constexpr(0.6931471805599453)
_SQRT2 = tl.constexpr(1.4142135623730951)


@triton.jit
def _f64(c):
    """A Python float as a float64 scalar, all 53 bits of it (not rounded through fp32)."""
    return tl.full([], c, tl.float64)


@triton.jit
def min_p_key(m, min_p):
    """The order key of min-p's threshold T = fl32(m + L), L = fl32(ln(min_p)) (``reference.
    min_p_threshold``): min-p keeps the tokens whose key is >= it.  L by ``reference.min_p_log``'s
    float64 steps, one for one (no fused multiply-add: enable_fp_fusion is off; IEEE division),
    so the bits are the reference's on every backend.  m: the position's max scaled logit; min_p
    in (0, 1] (another value gives some key: its row is invalid anyway)."""
    bits = min_p.to(tl.float64).to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023
    f = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).to(tl.float64, bitcast=True)
    big = f > _f64(_SQRT2)
    f = tl.where(big, f * _f64(0.5), f)
    e = tl.where(big, e + 1, e).to(tl.float64)
    z = (f - _f64(1.0)) / (f + _f64(1.0))  # float64 `/` is IEEE (div.rn.f64 on a GPU)
    w = z * z
    acc = _f64(_LC11)
    acc = acc * w + _f64(_LC10)
    acc = acc * w + _f64(_LC9)
    acc = acc * w + _f64(_LC8)
    acc = acc * w + _f64(_LC7)
    acc = acc * w + _f64(_LC6)
    acc = acc * w + _f64(_LC5)
    acc = acc * w + _f64(_LC4)
    acc = acc * w + _f64(_LC3)
    acc = acc * w + _f64(_LC2)
    acc = acc * w + _f64(_LC1)
    acc = acc * w + _f64(_LC0)
    L = (e * _f64(_LN2) + z * acc).to(tl.float32)
    return order_key(m + L).to(tl.int64)


@triton.jit
def _radix_round(digit, in_set, n_in, n_out, need, LAST: tl.constexpr):
    """One round of radix select on 8-bit digits (0..255, in key order) of the n_in keys in_set
    (n_out elements of the block are not): the digit d of the bucket holding the need-th largest
    key of the set, and (unless LAST) the number of keys of the set in higher buckets and in
    bucket d (one packed sum)."""
    bins = tl.arange(0, 256)
    # tl.histogram counts every element: the ones outside the set go to bin 0 and come off it
    hist = tl.histogram(tl.where(in_set, digit, 0), 256) - tl.where(bins == 0, n_out, 0)
    suffix = n_in - tl.cumsum(hist, axis=0) + hist  # keys of the set with a digit >= d
    d = tl.max(tl.where(suffix >= need, bins, -1), axis=0)
    above = n_in * 0
    n_d = n_in * 0
    if not LAST:
        h64 = hist.to(tl.int64)
        packed = tl.sum(tl.where(bins > d, h64, tl.where(bins == d, h64 << 32, 0)), axis=0)
        above = (packed & 0xFFFFFFFF).to(tl.int32)
        n_d = (packed >> 32).to(tl.int32)
    return d, above, n_d


@triton.jit
def _radix_select(keys, valid, k, n_valid, ROUNDS: tl.constexpr):
    """Radix select over the int32 keys where valid (n_valid of them, 1 <= k <= n_valid), on
    8-bit digits from the top, ROUNDS (1-4) histograms: returns hi, the largest key of the
    bucket (the keys sharing the chosen top 8 * ROUNDS bits) that holds the k-th largest key.
    Fewer than k valid keys are above hi; with ROUNDS = 4, hi is the k-th largest key."""
    n = keys.shape[0]
    need = k
    in_set = valid
    n_in = n_valid
    prefix = tl.full([], 0, tl.int64)
    for r in tl.static_range(ROUNDS):
        if r == 0:
            digit = (keys >> 24) + 128  # the signed top byte, as 0..255 in key order
        else:
            digit = (keys >> (24 - 8 * r)) & 255
        d, above, n_d = _radix_round(digit, in_set, n_in, n - n_in, need, r == ROUNDS - 1)
        need = need - above
        n_in = n_d
        in_set = in_set & (digit == d)
        if r == 0:
            prefix = (d - 128).to(tl.int64)
        else:
            prefix = prefix * 256 + d
    return prefix * (1 << (32 - 8 * ROUNDS)) + ((1 << (32 - 8 * ROUNDS)) - 1)


@triton.jit
def _chunk_candidates(keys, offs, n_valid, cand_ptr, CAP: tl.constexpr):
    """Store the largest keys of one chunk of n_valid tokens at cand_ptr[0:CAP]: all of them when
    n_valid <= CAP, else every key above t_c, the top of the 16-bit bucket (sign, exponent and 7
    mantissa bits) holding the chunk's CAP-th largest key (fewer than CAP keys). Returns (t_c,
    count): every key of the chunk above t_c is in the list (t_c = INT32_MIN: the whole chunk)."""
    if n_valid <= CAP:
        tl.store(cand_ptr + offs, keys.to(tl.int32), mask=offs < n_valid)
        t_c = tl.full([], _INT32_MIN, tl.int64)
        count = n_valid
    else:
        t_c = _radix_select(keys, offs < n_valid, CAP, n_valid, 2)
        gt = keys > t_c
        slot = tl.cumsum(gt.to(tl.int32), axis=0) - 1
        count = tl.max(tl.where(gt, slot + 1, 0), axis=0)
        tl.store(cand_ptr + slot, keys.to(tl.int32), mask=gt)
    return t_c, count


@triton.jit
def _warp_from_candidates(cand, t_sat, m, S, key_max, top_k, top_p, k_on, p_on, scratch_ptr,
                          CAP: tl.constexpr):
    """(thr, S_kept, exact) of a position from its candidate keys cand [NCB * CAP] int32 (-2^31:
    no key; every key of the position above t_sat is among them; see ``verify.triton.split_kernel``'s
    header): thr the smallest kept key, S_kept the kept mass sum exp(s - m); exact is false when
    the candidates cannot decide (the caller then scans the whole position).  scratch_ptr: CAP
    int32 of room."""
    valid = cand > _INT32_MIN
    e = tl.where(valid, tl.exp(_key_value(cand) - m), 0.0)
    c32 = cand
    cand = cand.to(tl.int64)
    thr = tl.full([], _INT32_MIN, tl.int64)
    S_kept = S
    exact = tl.full([], 1, tl.int1)
    complete = tl.full([], 0, tl.int1)  # the kept set so far lies wholly in the lists
    n_kept = tl.full([], 0, tl.int32)
    if k_on:
        n_cand = tl.sum(valid.to(tl.int32), axis=0)
        if top_k <= n_cand:
            T = _radix_select(c32, valid, top_k.to(tl.int32), n_cand, 4)  # the k-th largest candidate
            if T > t_sat:  # then it is the k-th largest key of the position
                thr = T
                kept = cand >= thr
                n_kept = tl.sum(kept.to(tl.int32), axis=0)
                S_kept = tl.sum(tl.where(kept, e, 0.0), axis=0)
                complete = tl.full([], 1, tl.int1)
            else:
                exact = tl.full([], 0, tl.int1)
        else:
            exact = tl.full([], 0, tl.int1)
    if p_on & exact:
        limit = top_p * S_kept
        if complete & (n_kept <= CAP):
            # The top-k set in one block of CAP (through memory: a register block cannot be
            # compacted): each kept key's strictly-greater mass at once, no bisection.
            kept = cand >= thr
            slot = tl.cumsum(kept.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + slot, c32, mask=kept)
            tl.debug_barrier()
            sl = tl.arange(0, CAP)
            kk = tl.load(scratch_ptr + sl, mask=sl < n_kept, other=_INT32_MIN, cache_modifier=".cg").to(tl.int64)
            ek = tl.where(sl < n_kept, tl.exp(_key_value(kk.to(tl.int32)) - m), 0.0)
            above = tl.sum(tl.where(kk[None, :] > kk[:, None], ek[None, :], 0.0), axis=1)  # [CAP]
            cut = tl.min(tl.where((sl < n_kept) & (above < limit), kk, _INT32_MAX), axis=0)
            thr = cut
            S_kept = tl.sum(tl.where(kk >= cut, ek, 0.0), axis=0)
        else:
            lo = tl.maximum(thr, t_sat)  # an answer at or below t_sat is not decided here
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo) // 2
                above = tl.sum(tl.where(cand >= mid + 1, e, 0.0), axis=0)
                small = above < limit
                hi = tl.where(small, mid, hi)
                lo = tl.where(small, lo, mid + 1)
            if complete | (lo > t_sat):
                thr = lo
                S_kept = tl.sum(tl.where(cand >= thr, e, 0.0), axis=0)
            else:
                exact = tl.full([], 0, tl.int1)
    return thr, S_kept, exact
