"""The Triton device functions that fused_verify's split kernel and fused_verify_tree's kernel
share: the order key of an fp32 logit (``order_key``), a grammar's bit of a token (``allowed``),
one tile of a position's scaled logits (``scaled_tile``, masked by a grammar with MASKED), the
mass of the tokens above an order key (``masked_mass``), top-k and top-p by bisection over a
whole position (``warp_full``), and a position's softmax statistics after the warp in one
program (``position_stats``: the tree kernel's per-node pass, with no grammar mask).

They read a position tile by tile, ``BLOCK_V`` logits at a time, accumulate the softmax in fp32,
and take 1 / T from the caller (``inv_t``).  Public names: the kernels that call them live in
other folders (``ops/verify/triton/``, ``ops/tree/``).

Memory traffic: a tile reads BLOCK_V * E bytes of logits and, MASKED, BLOCK_V / 8 bytes of its
position's mask (one int32 word per 32 tokens); ``masked_mass`` is one pass over the position,
``warp_full`` about 32 per bisection.
"""

from __future__ import annotations

import triton
import triton.language as tl

_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def order_key(s):
    """fp32 -> int32 with the same order; -0.0 is taken as +0.0 (s + 0.0)."""
    bits = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def allowed(mask_row, offs, ok):
    """Whether a grammar allows tokens offs at the position whose mask (xgrammar's layout: int32
    words, bit v % 32 of word v // 32) starts at mask_row; False where not ok (nothing read)."""
    w = tl.load(mask_row + offs // 32, mask=ok, other=0)
    return ((w >> (offs % 32)) & 1) != 0


@triton.jit
def scaled_tile(row_ptr, start, V, inv_t, mask_row, BLOCK_V: tl.constexpr, MASKED: tl.constexpr):
    """Logits [start, start + BLOCK_V) of one position in fp32, times 1/T; -inf past V and, MASKED,
    at the tokens the position's grammar mask (``mask_row``) forbids."""
    offs = start + tl.arange(0, BLOCK_V)
    mask = offs < V
    s = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    if MASKED:
        s = tl.where(allowed(mask_row, offs, mask), s, float("-inf"))
    return offs, mask, s


@triton.jit
def masked_mass(row_ptr, V, inv_t, m, thr, mask_row, BLOCK_V: tl.constexpr, MASKED: tl.constexpr):
    """sum of exp(s - m) over the tokens with order key >= thr (int64 scalar)."""
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs, mask, s = scaled_tile(row_ptr, start, V, inv_t, mask_row, BLOCK_V, MASKED)
        keep = mask & (order_key(s).to(tl.int64) >= thr)
        acc += tl.where(keep, tl.exp(s - m), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def warp_full(row_ptr, V, inv_t, m_safe, S, key_max, top_k, top_p, k_on, p_on, mask_row,
              HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK_V: tl.constexpr, MASKED: tl.constexpr):
    """(S, thr) of one position after top-k (when k_on) then top-p (when p_on), by bisection on
    the order keys over the whole position (about 32 passes each): p(v) = exp(s_v - m_safe) / S
    for the tokens whose key is >= thr.  S comes in as the untruncated mass."""
    thr = tl.full([], -2147483648, tl.int64)  # every int32 order key is >= this: keep all
    if HAS_TOP_K:
        # The k-th largest key: the largest t with count(key >= t) >= k, by bisection on keys.
        if k_on:
            lo = thr
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                cnt = tl.zeros([BLOCK_V], dtype=tl.int32)
                for start in range(0, V, BLOCK_V):
                    offs, mask, s = scaled_tile(row_ptr, start, V, inv_t, mask_row, BLOCK_V, MASKED)
                    cnt += (mask & (order_key(s).to(tl.int64) >= mid)).to(tl.int32)
                enough = tl.sum(cnt, axis=0) >= top_k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            thr = lo
            S = masked_mass(row_ptr, V, inv_t, m_safe, thr, mask_row, BLOCK_V, MASKED)
    if HAS_TOP_P:
        # The smallest key c whose strictly-greater mass is < top_p * S: keep key >= c.
        if p_on:
            limit = top_p * S
            lo = thr
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo) // 2
                above = masked_mass(row_ptr, V, inv_t, m_safe, mid + 1, mask_row, BLOCK_V, MASKED)
                small = above < limit
                hi = tl.where(small, mid, hi)
                lo = tl.where(small, lo, mid + 1)
            thr = lo
            S = masked_mass(row_ptr, V, inv_t, m_safe, thr, mask_row, BLOCK_V, MASKED)
    return S, thr


@triton.jit
def position_stats(
    row_ptr, V, inv_t, top_k, top_p,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Softmax statistics of one verify position after temperature, top-k and top-p.

    Returns (m, S, thr, argmax, bad): p(v) = exp(s_v - m) / S for the tokens whose order key is
    >= thr and 0 elsewhere; argmax is the first index of the largest logit; bad is 1 when the
    position holds a NaN or +inf, or nothing finite.
    """
    # Pass 1, online over tiles: max, first argmax, the running sum of exp(s - max), and the
    # non-finite check. Without top-k/top-p this is the whole softmax of the position.
    m = float("-inf")
    amax = 0
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_bad = 0
    for start in range(0, V, BLOCK_V):
        offs, mask, s = scaled_tile(row_ptr, start, V, inv_t, row_ptr, BLOCK_V, False)
        n_bad += tl.sum(((s != s) | (s == float("inf"))).to(tl.int32), axis=0)
        s = tl.where(s != s, float("-inf"), s)
        tile_max = tl.max(s, axis=0)
        tile_arg = tl.min(tl.where(s == tile_max, offs, _INT32_MAX), axis=0)
        amax = tl.where(tile_max > m, tile_arg, amax)
        m_new = tl.maximum(m, tile_max)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_ref) + tl.exp(s - m_ref)
        m = m_new
    bad = (n_bad > 0) | (m == float("-inf")) | (m == float("inf"))
    m_safe = tl.where(bad, 0.0, m)
    S = tl.sum(acc, axis=0)
    key_max = order_key(m_safe).to(tl.int64)
    k_on = (top_k > 0) & (top_k < V) & (bad == 0)
    p_on = (top_p < 1.0) & (bad == 0)
    S, thr = warp_full(row_ptr, V, inv_t, m_safe, S, key_max, top_k, top_p, k_on, p_on, row_ptr,
                       HAS_TOP_K, HAS_TOP_P, BLOCK_V, False)
    return m_safe, S, thr, amax, bad
