"""The Triton kernel of ``fused_verify``: one launch, one program per batch row.

Memory traffic, per batch row b that stops at position j (its first rejection, or K_b when it
accepts everything), with V the vocabulary and E the logit element size (4, or 2 for bf16/fp16):

- reads (j + 1) * V * E bytes of target logits in the softmax pass, once per position: the
  online max/argmax/sum of a position needs every logit of it, and nothing after the first
  rejection is read at all;
- reads V * E bytes of position j twice more for the final draw (the residual mass, then the
  inverse-CDF scan, which stops at the sampled token: on average half a row), and V_d * 4 bytes
  of draft probabilities there (the residual needs the whole q_j, the acceptance tests only
  q_i(x_i));
- with top-k or top-p, each bisection step re-reads the position (about 32 steps each): that
  path costs up to ~65x the reads of the plain path and is meant for rows that ask for it;
- writes (K + 2) * 8 bytes (tokens and the accepted count).

The floor for one step is the (j + 1) * V * E bytes of logits that a correct verification must
look at; the plain path reads about (j + 2.5) * V * E.  The softmax is accumulated in fp32; the
acceptance tests and the final draw's masses and cumulative sums in float64 (see below).

Parallelism: one program per batch row, so at small B the step is bound by one streaming
multiprocessor per row, not by the device's bandwidth. Splitting the vocabulary across programs
needs a grid-wide barrier between the softmax statistics and the final draw (the residual
max(0, e/S - q) is not decomposable before S is known); that variant is future work, to be
measured against this one on a GPU.

Randomness is counter-based: the numbers of row b come from Philox at counter
``(offset_b << 32) | c``: ``tl.rand`` (fp32, 24 bits) with c = i + 1 for the acceptance test of
draft i, and 53 bits of ``tl.randint4x`` with c = 0 for the final draw, whose inverse CDF sums
in float64: a token is drawn with its probability to within ~2^-53 of the total (a total
variation of at most ~V * 2^-54), not only to within fp32's 2^-24.  A row's numbers never
depend on the other rows, on B or on K, and the kernel can be captured in a CUDA graph.  ``reference.philox_uniforms`` reproduces them.
"""

from __future__ import annotations

import triton
import triton.language as tl

_INT32_MAX = tl.constexpr(2147483647)
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126, reference.FLT_MIN: the smallest temperature


@triton.jit
def order_key(s):
    """fp32 -> int32 with the same order; -0.0 is taken as +0.0 (s + 0.0)."""
    bits = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def scaled_tile(row_ptr, start, V, inv_t, BLOCK_V: tl.constexpr):
    """Logits [start, start + BLOCK_V) of one position in fp32, times 1/T; -inf past V."""
    offs = start + tl.arange(0, BLOCK_V)
    mask = offs < V
    s = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    return offs, mask, s


@triton.jit
def _draw_tile(pos_ptr, q_ptr, start, V, q_len, x_j, inv_t, m, S, thr, subtract_q,
               HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One tile of the final draw: p, q and the weights r = max(0, p - q) when subtract_q
    (the residual after a rejection), else r = p. q is read up to q_len (0 = not at all), or is
    one-hot at x_j for a deterministic drafter."""
    offs, mask, s = scaled_tile(pos_ptr, start, V, inv_t, BLOCK_V)
    p = tl.where(mask & (order_key(s).to(tl.int64) >= thr), tl.exp(s - m) / S, 0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(q_ptr + offs, mask=offs < q_len, other=0.0)
    else:
        q = tl.where(offs == x_j, 1.0, 0.0)
    r = tl.where(subtract_q, tl.maximum(p - q, 0.0), p)
    return offs, mask, p, q, r


@triton.jit
def masked_mass(row_ptr, V, inv_t, m, thr, BLOCK_V: tl.constexpr):
    """sum of exp(s - m) over the tokens with order key >= thr (int64 scalar)."""
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs, mask, s = scaled_tile(row_ptr, start, V, inv_t, BLOCK_V)
        keep = mask & (order_key(s).to(tl.int64) >= thr)
        acc += tl.where(keep, tl.exp(s - m), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def warp_full(row_ptr, V, inv_t, m_safe, S, key_max, top_k, top_p, k_on, p_on,
               HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK_V: tl.constexpr):
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
                    offs, mask, s = scaled_tile(row_ptr, start, V, inv_t, BLOCK_V)
                    cnt += (mask & (order_key(s).to(tl.int64) >= mid)).to(tl.int32)
                enough = tl.sum(cnt, axis=0) >= top_k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            thr = lo
            S = masked_mass(row_ptr, V, inv_t, m_safe, thr, BLOCK_V)
    if HAS_TOP_P:
        # The smallest key c whose strictly-greater mass is < top_p * S: keep key >= c.
        if p_on:
            limit = top_p * S
            lo = thr
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo) // 2
                above = masked_mass(row_ptr, V, inv_t, m_safe, mid + 1, BLOCK_V)
                small = above < limit
                hi = tl.where(small, mid, hi)
                lo = tl.where(small, lo, mid + 1)
            thr = lo
            S = masked_mass(row_ptr, V, inv_t, m_safe, thr, BLOCK_V)
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
        offs, mask, s = scaled_tile(row_ptr, start, V, inv_t, BLOCK_V)
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
    S, thr = warp_full(row_ptr, V, inv_t, m_safe, S, key_max, top_k, top_p, k_on, p_on,
                        HAS_TOP_K, HAS_TOP_P, BLOCK_V)
    return m_safe, S, thr, amax, bad


@triton.jit
def _verify_kernel(
    logits_ptr, stride_lb, stride_lk,  # [B, K+1, V] fp32/bf16/fp16, last dim contiguous
    draft_tokens_ptr, stride_tb,  # [B, K] int32/int64
    draft_probs_ptr, stride_qb, stride_qk,  # [B, K, Vd] fp32, last dim contiguous
    num_draft_ptr,  # [B] int64
    temperature_ptr,  # [B] fp32, 0 = greedy
    top_k_ptr,  # [B] int64, 0 = off
    top_p_ptr,  # [B] fp32, 1 = off
    seed_ptr, offset_ptr,  # [B] int64 each
    uniforms_ptr,  # [B, K+1] float64, contiguous
    tokens_ptr,  # out [B, K+1] int64, contiguous
    num_accepted_ptr,  # out [B] int64
    K, V, Vd,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_UNIFORMS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kb = tl.load(num_draft_ptr + b)
    temp = tl.load(temperature_ptr + b)
    greedy = temp == 0.0
    # (0, 2^-126): 1 / T overflows, or a subnormal T is flushed to 0
    bad_param = ((temp != temp) | (temp < 0.0) | (temp == float("inf")) | ((temp > 0.0) & (temp < _FLT_MIN))
                 | (kb < 0) | (kb > K))
    top_k = 0
    top_p = 1.0
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + b)
        bad_param = bad_param | (top_k < 0)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + b)
        bad_param = bad_param | ~(top_p > 0.0) | (top_p > 1.0)
    # Greedy rows need only the argmax: no temperature, no warp.
    inv_t = tl.where(greedy | bad_param, 1.0, 1.0 / tl.where(greedy | bad_param, 1.0, temp))
    top_k = tl.where(greedy, 0, top_k)
    top_p = tl.where(greedy, 1.0, top_p)
    seed = tl.load(seed_ptr + b)
    counter_base = tl.load(offset_ptr + b) << 32

    row_logits = logits_ptr + b * stride_lb
    # Walk the drafts until the first rejection (or unusable input); later positions are not read.
    j = kb * 0
    rejected = tl.full([], 0, tl.int32)
    bad = bad_param
    m_j = tl.full([], 0.0, tl.float32)
    S_j = tl.full([], 1.0, tl.float32)
    thr_j = kb * 0
    amax_j = tl.full([], 0, tl.int32)
    while (j < kb) & (rejected == 0) & (bad == 0):
        pos_ptr = row_logits + j * stride_lk
        m, S, thr, amax, bad_pos = position_stats(
            pos_ptr, V, inv_t, top_k, top_p, HAS_TOP_K, HAS_TOP_P, BLOCK_V)
        x = tl.load(draft_tokens_ptr + b * stride_tb + j).to(tl.int64)
        x_ok = (x >= 0) & (x < V)
        x_safe = tl.where(x_ok, x, 0)
        s_x = tl.load(pos_ptr + x_safe).to(tl.float32) * inv_t
        p_x = tl.where(order_key(s_x).to(tl.int64) >= thr, tl.exp(s_x - m) / S, 0.0)
        q_x = tl.full([], 1.0, tl.float32)
        if HAS_DRAFT_PROBS:
            q_x = tl.load(draft_probs_ptr + b * stride_qb + j * stride_qk + x_safe,
                          mask=x_safe < Vd, other=0.0)
        if HAS_UNIFORMS:
            u = tl.load(uniforms_ptr + b * (K + 1) + j)
        else:
            u = tl.rand(seed, counter_base | (j + 1)).to(tl.float64)
        bad_q = ~greedy & ((q_x != q_x) | (q_x < 0.0) | (q_x == float("inf")))
        bad = bad_pos | ~x_ok | bad_q
        # in float64: u * q(x) of a 24-bit u and an fp32 q is exact
        accept = tl.where(greedy, x == amax, u * q_x.to(tl.float64) < p_x.to(tl.float64))
        rejected = (~accept & ~bad).to(tl.int32)
        j = tl.where(accept & ~bad, j + 1, j)
        m_j, S_j, thr_j, amax_j = m, S, thr, amax
    if (rejected == 0) & (bad == 0):
        # Every draft accepted: the bonus token comes from position K_b.
        m_j, S_j, thr_j, amax_j, bad = position_stats(
            row_logits + j * stride_lk, V, inv_t, top_k, top_p, HAS_TOP_K, HAS_TOP_P, BLOCK_V)

    final = amax_j
    rejected = rejected != 0
    if (greedy == 0) & (bad == 0):
        pos_ptr = row_logits + j * stride_lk
        q_ptr = draft_probs_ptr + b * stride_qb + j * stride_qk
        # q_j is read only after a rejection; q_len = 0 otherwise reads nothing.
        q_len = tl.where(rejected, Vd, 0)
        x_j = tl.load(draft_tokens_ptr + b * stride_tb + j, mask=j < K, other=-1).to(tl.int64)
        x_j = tl.where(rejected, x_j, -1)
        # Pass A: the residual mass R = sum max(0, p - q) and a check of q_j, summed in float64
        # per lane, then across lanes.  The scan below sums per tile instead, so the total and the
        # last cumulative sum agree to ~V * 2^-53 relative, not bit for bit: a uniform within that
        # of 1 may find no hit and take the last positive weight, where the reference's sequential
        # sums may pick the token before it (a probability of ~1e-15 a draw; summing per tile here
        # too would cost a cross-warp reduction per tile).
        acc_r = tl.zeros([BLOCK_V], dtype=tl.float64)
        n_bad_q = 0
        for start in range(0, V, BLOCK_V):
            offs, mask, p, q, r = _draw_tile(pos_ptr, q_ptr, start, V, q_len, x_j, inv_t, m_j, S_j, thr_j,
                                             rejected, HAS_DRAFT_PROBS, BLOCK_V)
            n_bad_q += tl.sum(((q != q) | (q < 0.0) | (q == float("inf"))).to(tl.int32), axis=0)
            acc_r += tl.where(r == r, r, 0.0).to(tl.float64)
        bad = n_bad_q > 0
        total = tl.sum(acc_r, axis=0)
        use_p = total <= 0.0
        if use_p:
            # The residual sums to zero (q >= p everywhere in floating point): draw from p itself,
            # its mass summed the same way.  Rare, so it is a pass of its own rather than a second
            # float64 accumulator in Pass A (registers: one accumulator keeps the kernel near the
            # fp32 version's count).
            acc_p = tl.zeros([BLOCK_V], dtype=tl.float64)
            for start in range(0, V, BLOCK_V):
                offs, mask, p, q, r = _draw_tile(pos_ptr, q_ptr, start, V, 0, -1, inv_t, m_j, S_j, thr_j,
                                                 False, HAS_DRAFT_PROBS, BLOCK_V)
                acc_p += p.to(tl.float64)
            total = tl.sum(acc_p, axis=0)
        if HAS_UNIFORMS:
            u_final = tl.load(uniforms_ptr + b * (K + 1) + K)
        else:
            # 53 random bits (27 of Philox's first word, 26 of its second) on the 2^-53 grid: with
            # fp32's 24, a token of probability below ~2^-24 would be drawn with probability 0
            # or 2^-24, not its own
            r0, r1, _, _ = tl.randint4x(seed, counter_base)
            u_final = ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64)) * 1.1102230246251565e-16
        target = u_final * total
        # Pass B: inverse CDF, stopping at the first token whose cumulative weight passes target.
        carry = tl.full([], 0.0, tl.float64)
        found = tl.full([], -1, tl.int32)
        last_nz = tl.full([], -1, tl.int32)
        start = tl.full([], 0, tl.int32)
        while (start < V) & (found < 0):
            offs, mask, p, q, r = _draw_tile(pos_ptr, q_ptr, start, V, q_len, x_j, inv_t, m_j, S_j, thr_j,
                                             rejected & ~use_p, HAS_DRAFT_PROBS, BLOCK_V)
            r64 = r.to(tl.float64)
            cdf = carry + tl.cumsum(r64, axis=0)  # float64: tiny weights keep their intervals
            # r > 0: a token of weight 0 is never the hit, whatever order tl.cumsum adds in (a
            # tree order may round cdf[v] above cdf[v - 1] where r[v] = 0; a sequential sum,
            # the reference's, cannot, so the two pick the same token)
            hit = tl.min(tl.where(mask & (r > 0.0) & (cdf > target), offs, _INT32_MAX), axis=0)
            found = tl.where(hit < _INT32_MAX, hit, found)
            last_nz = tl.maximum(last_nz, tl.max(tl.where(mask & (r > 0.0), offs, -1), axis=0))
            carry += tl.sum(r64, axis=0)
            start += BLOCK_V
        final = tl.where(found >= 0, found, last_nz)
        bad = bad | (final < 0)

    cols = tl.arange(0, BLOCK_K)
    x_all = tl.load(draft_tokens_ptr + b * stride_tb + cols, mask=cols < K, other=-1).to(tl.int64)
    out = tl.where(cols < j, x_all, -1)
    out = tl.where(cols == j, final, out)
    out = tl.where(bad, -1, out)
    tl.store(tokens_ptr + b * (K + 1) + cols, out, mask=cols < K + 1)
    tl.store(num_accepted_ptr + b, tl.where(bad, -1, j))
