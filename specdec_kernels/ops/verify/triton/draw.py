"""The split kernel's per-row and per-chunk device functions: a row's parameters (``_row_params``,
as the reference's ``row_parameters``) and where its data start (``_row_offsets``), its random
numbers (``_draft_uniforms``, ``_final_uniform``: ``reference.philox_uniforms``'s), a chunk's
scores and final-draw weights (``_scores``, ``_weight``, ``_chunk_weights``, with the draft's
softmax ``_draft_q``; under a grammar's mask with MASKED, and ``_masked_score`` for single
tokens), log-probabilities (``_logprob``), the inverse-CDF draw (``_draw``) and the row's
outputs (``_emit``).

Memory traffic, with E-byte logits and Ed-byte draft probabilities or logits: ``_param`` reads
one element of a [B] parameter (nothing for a scalar, passed by value), ``_row_offsets`` cu[b]
(PACKED); ``_scores`` reads CHUNK * E bytes (MASKED: CHUNK / 8 more, the mask's words),
``_chunk_weights`` CHUNK * E and, where q is read (after a rejection; at every draft position
with BLOCK), up to CHUNK * Ed more; ``_draw``
re-reads the one chunk that holds the sampled token (L2-hot), and ``_p_masses`` the whole
position (V * E bytes) only when the residual sums to zero; given uniforms are 8 bytes each
(4 for fp32; without them Philox runs in registers); ``_emit`` reads up to K draft ids and
writes (K + 2) * 8 bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..row_params import PARAM_FLAG
from .common import allowed, order_key
from .candidates import _INT32_MAX

_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126, reference.FLT_MIN: the smallest temperature

# Bits of ``param_flags``: which per-row parameters are [B] tensors (else a scalar argument);
# the table is ``row_params.PARAM_FLAG``, which the launcher sets them from.
_P_NUM_DRAFT = tl.constexpr(PARAM_FLAG["num_draft"])
_P_TEMPERATURE = tl.constexpr(PARAM_FLAG["temperature"])
_P_TOP_K = tl.constexpr(PARAM_FLAG["top_k"])
_P_TOP_P = tl.constexpr(PARAM_FLAG["top_p"])
_P_SEED = tl.constexpr(PARAM_FLAG["seed"])
_P_OFFSET = tl.constexpr(PARAM_FLAG["offset"])
_P_MIN_P = tl.constexpr(PARAM_FLAG["min_p"])


@triton.jit
def _param(flags, bit, ptr, stride, scalar, b, DTYPE: tl.constexpr):
    """Row b's value of a parameter given either as a [B] tensor (its bit set in flags) or as a
    scalar kernel argument (no device tensor made for it by the launcher), as DTYPE."""
    v = (tl.zeros([], DTYPE) + scalar).to(DTYPE)
    if (flags & bit) != 0:
        v = tl.load(ptr + b * stride).to(DTYPE)
    return v


@triton.jit
def _philox_key(b, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar):
    """Row b's Philox seed and counter base (offset_b << 32; the low word is the draw's index)."""
    seed = _param(flags, _P_SEED, seed_ptr, seed_stride, seed_scalar, b, tl.int64) + b * seed_row_step
    counter_base = _param(flags, _P_OFFSET, off_ptr, off_stride, off_scalar, b, tl.int64) << 32
    return seed, counter_base


@triton.jit
def _row_params(b, K, V, flags,
                nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, PACKED: tl.constexpr,
                PROBS: tl.constexpr):
    """(kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p) of row b, as the
    reference's ``row_parameters``; k_on / p_on / mp_on: the row's top-k / top-p / min-p is
    applied (min_p > 0 on a sampled row: min-p may change its distribution).  PACKED:
    K_b = cu[b + 1] - cu[b], and a row whose drafts are not within [0, nd_scalar) is unusable.
    PROBS (probabilities in): a temperature other than 0 or 1 is an unusable parameter, and
    1 / T = 1."""
    if PACKED:
        c0 = tl.load(cu_ptr + b * cu_stride).to(tl.int64)
        kb = tl.load(cu_ptr + (b + 1) * cu_stride).to(tl.int64) - c0
        out_of_bounds = (c0 < 0) | (c0 + kb > nd_scalar)  # nd_scalar: the number of drafts, sum_b K_b
    else:
        kb = _param(flags, _P_NUM_DRAFT, nd_ptr, nd_stride, nd_scalar, b, tl.int64)
        out_of_bounds = kb < 0
    temp = _param(flags, _P_TEMPERATURE, t_ptr, t_stride, t_scalar, b, tl.float32)
    greedy = temp == 0.0
    # (0, 2^-126): 1 / T overflows, or a subnormal T is flushed to 0; a packed row outside the
    # drafts reads nothing
    bad_param = ((temp != temp) | (temp < 0.0) | (temp == float("inf")) | ((temp > 0.0) & (temp < _FLT_MIN))
                 | (kb < 0) | (kb > K) | out_of_bounds)
    if PROBS:
        bad_param = bad_param | ((temp != 0.0) & (temp != 1.0))
    top_k = tl.full([], 0, tl.int64)
    top_p = tl.full([], 1.0, tl.float32)
    if HAS_TOP_K:
        top_k = _param(flags, _P_TOP_K, k_ptr, k_stride, k_scalar, b, tl.int64)
        bad_param = bad_param | (top_k < 0)
    if HAS_TOP_P:
        top_p = _param(flags, _P_TOP_P, p_ptr, p_stride, p_scalar, b, tl.float32)
        bad_param = bad_param | ~(top_p > 0.0) | (top_p > 1.0)
    min_p = tl.full([], 0.0, tl.float32)
    if HAS_MIN_P:
        min_p = _param(flags, _P_MIN_P, mp_ptr, mp_stride, mp_scalar, b, tl.float32)
        bad_param = bad_param | ~(min_p >= 0.0) | (min_p > 1.0)  # NaN fails the first test
    # IEEE division (div.full.f32, Triton's `/` on a GPU, may be 2 ulp off): 1 / T as the
    # reference computes it, once per row
    inv_t = tl.where(greedy | bad_param, 1.0, tl.math.div_rn(1.0, tl.where(greedy | bad_param, 1.0, temp)))
    k_on = ~greedy & (top_k > 0) & (top_k < V)
    p_on = ~greedy & (top_p < 1.0)
    mp_on = ~greedy & (min_p > 0.0)
    return kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p


@triton.jit
def _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb, stride_tk, stride_qb, stride_qk,
                 stride_mb, stride_mk, PACKED: tl.constexpr):
    """Element offsets of row b's first position in the logits, its first draft token, its first
    draft distribution and its first position's grammar mask.  Padded: row b at b * stride.
    PACKED: the rows back to back, row b's K_b + 1 positions (and masks) from row cu[b] + b, its
    drafts from cu[b]."""
    if PACKED:
        c0 = tl.load(cu_ptr + b * cu_stride).to(tl.int64)
        l_off = (c0 + b) * stride_lk
        t_off = c0 * stride_tk
        q_off = c0 * stride_qk
        m_off = (c0 + b) * stride_mk
    else:
        l_off = b * stride_lb
        t_off = b * stride_tb
        q_off = b * stride_qb
        m_off = b * stride_mb
    return l_off, t_off, q_off, m_off


@triton.jit
def _scores(ptr, offs, n, inv_t, mask_row, PROBS: tl.constexpr, MASKED: tl.constexpr):
    """A chunk's scores as fp32: the logits times 1 / T, -inf at offs >= n; or, PROBS, the
    probabilities as given, 0 at offs >= n.  MASKED: -inf (PROBS: 0) too where the position's
    grammar mask (``mask_row``) forbids the token, whatever its logit (a NaN there is masked away)."""
    if PROBS:
        s = tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    else:
        s = tl.load(ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32) * inv_t
    return _masked_score(s, mask_row, offs, offs < n, PROBS, MASKED)


@triton.jit
def _masked_score(s, mask_row, x, ok, PROBS: tl.constexpr, MASKED: tl.constexpr):
    """Scores s of tokens x (a chunk of one position, or a draft per position, the final token),
    -inf (PROBS: 0) where the grammar mask of each one's position (``mask_row``) forbids it
    (MASKED; nothing read where not ok)."""
    if MASKED:
        if PROBS:
            s = tl.where(allowed(mask_row, x, ok), s, 0.0)
        else:
            s = tl.where(allowed(mask_row, x, ok), s, float("-inf"))
    return s


@triton.jit
def _weight(s, m, PROBS: tl.constexpr):
    """The unnormalised target weight of a score: exp(s - m) for logits, s itself for PROBS."""
    if PROBS:
        w = s
    else:
        w = tl.exp(s - m)
    return w


@triton.jit
def _logprob(s, m, S, kept, PROBS: tl.constexpr):
    """log p(v) = (s - m) - log S (PROBS: log s - log S), -inf where the warp drops v."""
    if PROBS:
        pos = s > 0.0
        lp = tl.where(pos, tl.log(tl.where(pos, s, 1.0)) - tl.log(S), float("-inf"))
    else:
        lp = (s - m) - tl.log(S)
    return tl.where(kept, lp, float("-inf"))


@triton.jit
def _draft_q(ld, m_d, S_d):
    """q(v) = exp(l_v / T - m_d) / S_d of scaled draft logits ld = l * (1 / T) (DRAFT_LOGITS), with
    the position's max m_d and sum S_d = sum_v exp(ld_v - m_d): the reference's e / sum(e), the
    division IEEE-rounded (``/`` may be 2 ulp off on a GPU)."""
    return tl.math.div_rn(tl.exp(ld - m_d), tl.zeros_like(ld) + S_d)


@triton.jit
def _chunk_weights(pos_ptr, q_ptr, offs, V, q_len, x_j, inv_t, m, S, thr, subtract_q, m_d, S_d, scale, pos_mask,
                   HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr,
                   BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """One chunk's final-draw weights (fp32): r = max(0, p - q) when subtract_q (the residual
    after a rejection), else r = p; with the non-finite/negative q count.  BLOCK (block
    verification): r = max(0, scale * p - q) in float64, scale the float64 p_i of the position
    (``reference.block_verify_reference``), else r = p in float64.  q (fp32, bf16 or fp16,
    read as fp32) is read up to q_len (0 = not at all), or is one-hot at x_j for a deterministic
    drafter; DRAFT_LOGITS: q_ptr holds the draft's logits, q = exp(l / T - m_d) / S_d (m_d, S_d:
    the position's draft max and sum, from its stage-1 records).  MASKED: p under the position's
    grammar mask (``pos_mask``); q as given."""
    mask = offs < V
    s = _scores(pos_ptr, offs, V, inv_t, pos_mask, PROBS, MASKED)
    p = tl.where(mask & (order_key(s).to(tl.int64) >= thr), _weight(s, m, PROBS) / S, 0.0)
    if HAS_DRAFT_PROBS:
        if DRAFT_LOGITS:
            ld = tl.load(q_ptr + offs, mask=offs < q_len, other=float("-inf")).to(tl.float32) * inv_t
            q = tl.where(offs < q_len, _draft_q(ld, m_d, S_d), 0.0)
        else:
            q = tl.load(q_ptr + offs, mask=offs < q_len, other=0.0).to(tl.float32)
    else:
        q = tl.where(offs == x_j, 1.0, 0.0)
    if BLOCK:
        p64 = p.to(tl.float64)
        r = tl.where(subtract_q, tl.maximum(scale * p64 - q.to(tl.float64), 0.0), p64)
    else:
        r = tl.where(subtract_q, tl.maximum(p - q, 0.0), p)
    r = tl.where(r == r, r, 0.0)
    n_bad_q = tl.sum(((q != q) | (q < 0.0) | (q == float("inf"))).to(tl.int32), axis=0)
    return r, mask, n_bad_q


@triton.jit
def _draft_uniforms(b, ks, dmask, uniforms_ptr, stride_ub, stride_uk, flags, seed_ptr, seed_stride, seed_scalar,
                    seed_row_step, off_ptr, off_stride, off_scalar, HAS_UNIFORMS: tl.constexpr):
    """Row b's acceptance-test uniforms [BLOCK_K] (float64) of drafts ks: uniforms[b, ks], or
    24-bit ``tl.rand`` at Philox counter ks + 1 (``reference.philox_uniforms``)."""
    if HAS_UNIFORMS:
        u = tl.load(uniforms_ptr + b * stride_ub + ks * stride_uk, mask=dmask, other=0.0).to(tl.float64)
    else:
        seed, counter_base = _philox_key(b, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr,
                                         off_stride, off_scalar)
        u = tl.rand(seed, counter_base | (ks + 1).to(tl.int64)).to(tl.float64)
    return u


@triton.jit
def _final_uniform(b, uniforms_ptr, stride_ub, stride_uk, K, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step,
                   off_ptr, off_stride, off_scalar, HAS_UNIFORMS: tl.constexpr):
    """Row b's uniform of the final draw (float64): uniforms[b, K], or 53 random bits (27 of
    Philox's first word at counter 0, 26 of its second) on the 2^-53 grid: with fp32's 24, a
    token of probability below ~2^-24 would be drawn with probability 0 or 2^-24, not its own."""
    if HAS_UNIFORMS:
        u_final = tl.load(uniforms_ptr + b * stride_ub + K * stride_uk).to(tl.float64)
    else:
        seed, counter_base = _philox_key(b, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr,
                                         off_stride, off_scalar)
        r0, r1, _, _ = tl.randint4x(seed, counter_base)
        u_final = ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64)) * 1.1102230246251565e-16
    return u_final


@triton.jit
def _p_masses(pos_ptr, q_ptr, V, NC, inv_t, m_j, S_j, thr_j, m_dj, S_dj, cs_ids, offs0, pos_mask, NCB: tl.constexpr,
              HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
              CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """The float64 chunk masses [NCB] of p itself at one position: the final draw's weights when
    the residual sums to zero (q >= p everywhere in floating point; rare: one pass of its own)."""
    W = tl.zeros([NCB], dtype=tl.float64)
    for cc in range(0, NC):
        r, _, _ = _chunk_weights(pos_ptr, q_ptr, cc * CHUNK + offs0, V, 0, -1, inv_t, m_j, S_j, thr_j, False,
                                 m_dj, S_dj, 1.0, pos_mask, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK, MASKED)
        W = tl.where(cs_ids == cc, tl.sum(r.to(tl.float64), axis=0), W)
    return W


@triton.jit
def _draw(W, u_final, cmask, cs_ids, offs0, pos_ptr, q_ptr, V, q_len, x_j, inv_t, m_j, S_j, thr_j, subtract_q,
          m_dj, S_dj, scale, pos_mask, HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr,
          DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """The inverse-CDF draw from one position's weights, given their float64 chunk masses W [NCB]
    (chunk order): the chunk holding u_final * sum(W) is the first chunk of positive mass whose
    cumulative mass passes it (the last one if rounding leaves none); that chunk's weights are
    recomputed (L2-hot) and summed on in float64 (tiny weights keep their intervals; a token of
    weight 0 is never the hit, whatever order tl.cumsum adds in).  Returns the token (-1 if the
    weights are all zero)."""
    target = u_final * tl.sum(W, axis=0)
    cdf = tl.cumsum(W, axis=0)
    c_hit = tl.min(tl.where(cmask & (W > 0.0) & (cdf > target), cs_ids, _INT32_MAX), axis=0)
    c_last = tl.max(tl.where(cmask & (W > 0.0), cs_ids, -1), axis=0)
    c_star = tl.where(c_hit < _INT32_MAX, c_hit, c_last)
    carry = tl.sum(tl.where(cs_ids == c_star, cdf - W, 0.0), axis=0)
    offs = tl.maximum(c_star, 0) * CHUNK + offs0
    r, mask, _ = _chunk_weights(pos_ptr, q_ptr, offs, V, q_len, x_j, inv_t, m_j, S_j, thr_j, subtract_q, m_dj, S_dj,
                                scale, pos_mask, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK, MASKED)
    cdf_v = carry + tl.cumsum(r.to(tl.float64), axis=0)
    hit = tl.min(tl.where(mask & (r > 0.0) & (cdf_v > target), offs, _INT32_MAX), axis=0)
    last_nz = tl.max(tl.where(mask & (r > 0.0), offs, -1), axis=0)
    final = tl.where(hit < _INT32_MAX, hit, last_nz).to(tl.int64)
    return tl.where(c_star < 0, -1, final)


@triton.jit
def _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, row_tokens_ptr, stride_tk, b, K, j,
          final, bad, BLOCK_K: tl.constexpr):
    """Row b's outputs (stored as the outputs' dtype, int32 or int64): the accepted drafts, the
    final token at j, then -1 (all -1 if bad).  row_tokens_ptr: the row's first draft token."""
    cols = tl.arange(0, BLOCK_K)
    x_all = tl.load(row_tokens_ptr + cols * stride_tk, mask=cols < j, other=-1).to(tl.int64)
    out = tl.where(cols < j, x_all, -1)
    out = tl.where(cols == j, final, out)
    out = tl.where(bad, -1, out)
    tl.store(tokens_ptr + b * stride_ob + cols * stride_oc, out, mask=cols < K + 1)
    tl.store(num_accepted_ptr + b * stride_on, tl.where(bad, -1, j))
