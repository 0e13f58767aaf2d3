"""The one-program-per-row verify kernel: ``fused_verify``'s step in one launch, one program per batch row.

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
max(0, e/S - q) is not decomposable before S is known): the package's split kernel
(``specdec_kernels/ops/verify/triton/split_kernel.py``) does that, and this kernel is its
benchmark baseline.

Randomness is counter-based: the numbers of row b come from Philox at counter
``(offset_b << 32) | c``: ``tl.rand`` (fp32, 24 bits) with c = i + 1 for the acceptance test of
draft i, and 53 bits of ``tl.randint4x`` with c = 0 for the final draw, whose inverse CDF sums
in float64: a token is drawn with its probability to within ~2^-53 of the total (a total
variation of at most ~V * 2^-54), not only to within fp32's 2^-24.  A row's numbers never
depend on the other rows, on B or on K, and the kernel can be captured in a CUDA graph.
``reference.philox_uniforms`` reproduces them.

Not part of the package: the benchmarks' provider ``fused_triton_rows`` (``bench_verify.py``) and
kernel ``rows`` (``bench_verify_interpreter.py``), the split kernel's comparison on a GPU
(``test_verify_split.py``), and the ahead-of-time compile check (``scripts/gpu_compile_check.py``).
It takes top-k and top-p but no min-p, draft logits, packed rows, probabilities in, log-probabilities
out or ``out=``; ``verify_rows`` checks its arguments with ``fused_verify``'s own
``normalize_arguments``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from specdec_kernels.ops.verify import VerifyOutput, normalize_arguments
from specdec_kernels.ops.verify.triton.common import order_key, position_stats, scaled_tile

__all__ = ["launch_rows", "rows_kernel_meta", "verify_rows"]

_INT32_MAX = tl.constexpr(2147483647)
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126, reference.FLT_MIN: the smallest temperature
# The vocabulary tile. 4096 fp32 logits per tile keep 8 warps streaming.
_MAX_BLOCK_V = 4096


@triton.jit
def _draw_tile(pos_ptr, q_ptr, start, V, q_len, x_j, inv_t, m, S, thr, subtract_q,
               HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One tile of the final draw: p, q and the weights r = max(0, p - q) when subtract_q
    (the residual after a rejection), else r = p. q is read up to q_len (0 = not at all), or is
    one-hot at x_j for a deterministic drafter."""
    offs, mask, s = scaled_tile(pos_ptr, start, V, inv_t, pos_ptr, BLOCK_V, False)  # no grammar mask
    p = tl.where(mask & (order_key(s).to(tl.int64) >= thr), tl.exp(s - m) / S, 0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(q_ptr + offs, mask=offs < q_len, other=0.0)
    else:
        q = tl.where(offs == x_j, 1.0, 0.0)
    r = tl.where(subtract_q, tl.maximum(p - q, 0.0), p)
    return offs, mask, p, q, r


@triton.jit
def _verify_rows_kernel(
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
    inv_t = tl.where(greedy | bad_param, 1.0, tl.math.div_rn(1.0, tl.where(greedy | bad_param, 1.0, temp)))
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


def rows_kernel_meta(V: int, K1: int, has_draft_probs: bool, has_top_k: bool, has_top_p: bool,
                     has_uniforms: bool) -> dict:
    """The kernel's compile-time parameters for a launch over V tokens and K + 1 = K1
    positions: its constexprs, num_warps and enable_fp_fusion.  The launch and the
    ahead-of-time compile check (``scripts/gpu_compile_check.py``) both take them from here.

    enable_fp_fusion is pinned off: a multiply and an add stay two roundings, as in the
    interpreter and the torch reference (the online softmax's ``acc * exp(m - m') + exp(s - m')``
    would otherwise become one FMA), and the bits do not change with Triton's default (on in
    3.6-3.9, off from 3.10)."""
    block_v = max(16, min(triton.next_power_of_2(V), _MAX_BLOCK_V))
    return dict(HAS_DRAFT_PROBS=has_draft_probs, HAS_TOP_K=has_top_k, HAS_TOP_P=has_top_p,
                HAS_UNIFORMS=has_uniforms, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(K1),
                num_warps=8 if block_v >= 2048 else 4, enable_fp_fusion=False)


def launch_rows(a) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the kernel on ``normalize_arguments(..., materialize=True)``'s result (every
    per-row parameter a [B] tensor): (tokens [B, K+1] int64, num_accepted [B] int64)."""
    logits = a.target_logits if a.target_logits.stride(-1) == 1 else a.target_logits.contiguous()
    q = a.draft_probs
    if q is not None:
        q = q.float()  # this kernel reads fp32 q
        q = q if q.stride(-1) == 1 else q.contiguous()
    B, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    tokens = torch.empty((B, K1), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, num_accepted
    uniforms = a.uniforms.contiguous() if a.uniforms is not None else None  # float64 (normalize_arguments)
    x = a.draft_tokens if a.draft_tokens.stride(-1) == 1 else a.draft_tokens.contiguous()  # read at + j
    dummy = num_accepted  # stands in for absent optional pointers; never dereferenced
    # Triton launches on the current device's current stream: make it the tensors'. Nothing to do
    # for the interpreter.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _verify_rows_kernel[(B,)](
            logits, logits.stride(0), logits.stride(1),
            x, x.stride(0),
            q if q is not None else dummy, q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            a.num_draft_tokens, a.temperature,
            a.top_k if a.top_k is not None else dummy,
            a.top_p if a.top_p is not None else dummy,
            a.seed, a.offset,
            uniforms if uniforms is not None else dummy,
            tokens, num_accepted,
            K, V, q.shape[-1] if q is not None else V,
            **rows_kernel_meta(V, K1, q is not None, a.top_k is not None, a.top_p is not None, uniforms is not None),
        )
    return tokens, num_accepted


def verify_rows(target_logits, draft_tokens, draft_probs=None, *, num_draft_tokens=None, temperature=1.0, top_k=None,
                top_p=None, seed=None, offset=0, uniforms=None) -> VerifyOutput:
    """``fused_verify``'s padded call (its arguments checked by its own ``normalize_arguments``)
    on this kernel: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.  The same tokens
    as ``fused_verify(backend="triton")`` for the same seeds or uniforms."""
    if target_logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"verify_rows needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got tensors on "
                         f"{target_logits.device}")
    a = normalize_arguments(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p,
                            seed, offset, uniforms, materialize=True)
    return VerifyOutput(*launch_rows(a))
