"""The Triton kernel of ``fused_verify_tree``: one launch, one program per batch row.

Row b walks its nodes n = 0..num_nodes[b]-1 in order, as ``tree.reference.tree_verify_reference``
does (its docstring holds the rules, the layouts and the proof): node n is examined when its parent
is the current node; a greedy row follows the first child equal to the current position's argmax;
a sampling row tests the child against the current (residual) target distribution p_cur, under
the sampled rule (u_n * q_cur(c) < p_cur(c), float64) or the deterministic one (u_n < p_cur(c)),
updates p_cur and q_cur after a rejection and starts afresh at node n's position after an
acceptance.  Then one final token: the argmax (greedy) or the inverse CDF of the unnormalised
weights p_w at the current position.

State.  p_cur is p (computed from the logits and the position's softmax statistics) until the
first rejection at a position; after it the residual lives in a float32 workspace [B, 2, V]:
slot ``p_slot`` holds the unnormalised residual r = max(0, p_cur - q_cur) of the last rejection
whose r summed to more than 0 (the reference's p_w, what the final draw samples), and p_cur = r /
max(sum r, FLT_MIN), one IEEE division per entry where it is read, the reference's rounding.  Two
slots because sum r is known only after the pass that writes r: a residual that sums to 0 is not
taken, and the previous one must still be there.  q_cur (sampled rule) is draft_probs at the
position until the first rejection there, then q_cur with the rejected child removed, kept in a
float32 workspace [B, Vd] as q_w with q_cur = q_w / max(sum q_w, FLT_MIN) (q is 0 past Vd).  The
launcher allocates both workspaces (no initialisation: a slot is read only after this row wrote it).

Memory traffic per row, V the vocabulary, Vd the draft vocabulary, E the logit element size (4,
or 2 for bf16/fp16), I the node-id size (4 or 8):

- the tree: num_nodes * I bytes of parents for the depth check, and again in the walk, where an
  examined node also costs its token (I) and, given, its uniform (8);
- each position the walk stands on (the root and every accepted node): one softmax pass over its
  V * E bytes of logits (the floor: a child's test needs the position's normaliser), and with
  top-k / top-p about 32 passes more each, with min-p (when it cuts deeper) one more
  (``warp_full``, ``masked_mass``);
- each examined child: E bytes of logits (or 4 of the residual slot) and, sampled rule, 4 bytes of
  q; at the first child tested at a position the sampled rule also reads that position's Vd * 4
  bytes of q to check them (a NaN, an inf or a negative entry makes the row invalid);
- each rejected child: one pass that reads p_cur (V * E bytes of logits at the position's first
  rejection, V * 4 of the residual slot at a later one) and, sampled rule, q_cur (Vd * 4), and
  writes r (V * 4) and, sampled rule, q_w (Vd * 4): V * (E + 4) or 8 * V bytes, plus 8 * Vd for
  the sampled rule.  A child passed over (current probability 0) or accepted costs only its test;
- the final draw (sampling rows): two passes over the weights (their float64 mass, then the
  inverse CDF, which stops at the sampled token: about half a pass on average), from the logits
  (V * E bytes) or from the residual slot (V * 4);
- writes (2 D + 2) * 8 bytes of tokens, path and count, reading the path's D * I token ids.

So a row that accepts a path of depth d without a rejection reads about (d + 2.5) * V * E bytes
(the chain kernel's figure, the floor being (d + 1) * V * E), and each rejection adds at most
8 * V + 8 * Vd bytes, read and written once each.  The residual state needs the whole vocabulary,
hence the workspaces: B * (2 * V + Vd) * 4 bytes, of which a row touches only what its
rejections write.

Parallelism: one program per row, as the chain's row kernel (``bench/ops/rows_kernel.py``), whose
helpers in ``verify.triton.common`` this kernel calls: at small B the step is bound by one
streaming multiprocessor per row.

Randomness as the chain's (``reference.philox_uniforms(seed, offset, N)``): node n's test is
``tl.rand`` at counter ``(offset << 32) | (n + 1)``, the final draw 53 bits of ``tl.randint4x``
at counter ``offset << 32``; or ``uniforms[b, n]`` and ``uniforms[b, N]`` when given.  The host
reads nothing back (the launcher reads the output width D only when max_depth is None), so the
launch can be captured in a CUDA graph.

Numerics as the reference's: p, q, the residuals and their normalisations in fp32, the tests in
float64 without a division, the final draw's mass and cumulative sums in float64 (per lane and
then across lanes for the total, per tile for the scan: the row kernel's final draw).  The
fp32 sums (the softmax's S, sum r, sum q_w) add in another order than torch's, so p_cur and q_cur
agree with the reference's to about an ulp, and the tokens agree but where a uniform falls within
that of a decision's boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..verify.triton.common import masked_mass, order_key, position_stats
from ..verify.triton.candidates import min_p_key

_INT32_MAX = tl.constexpr(2147483647)
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126: the reference's clamp of a residual's sum


@triton.jit
def _tree_position(pos_ptr, V, inv_t, top_k, top_p, min_p, mp_on,
                   HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """(m, S, thr, argmax, bad) of one position after temperature, top-k, top-p and min-p:
    p(v) = exp(s_v - m) / S for the tokens whose order key is >= thr.  min-p's threshold comes
    from m alone; its kept set is an upper set holding the maximum, so it composes with the
    top-k/top-p set as the higher threshold, whose mass is summed once more."""
    m, S, thr, amax, bad = position_stats(pos_ptr, V, inv_t, top_k, top_p, HAS_TOP_K, HAS_TOP_P, BLOCK_V)
    if HAS_MIN_P:
        thr_mp = min_p_key(m, min_p)
        if mp_on & (bad == 0) & (thr_mp > thr):
            thr = thr_mp
            S = masked_mass(pos_ptr, V, inv_t, m, thr, pos_ptr, BLOCK_V, False)  # no grammar mask
    return m, S, thr, amax, bad


@triton.jit
def _p_cur(pos_ptr, slot_ptr, offs, V, p_mat, s_div, inv_t, m, S, thr):
    """(p_cur, w) at offs (a tile, or one token id in [0, V)): p from the logits while p_mat == 0,
    else the residual slot's r / s_div; w = the final draw's weights (p, or r itself); 0 past V.
    Only the source in use is read."""
    use_r = p_mat != 0
    s = tl.load(pos_ptr + offs, mask=offs < tl.where(use_r, 0, V), other=float("-inf")).to(tl.float32) * inv_t
    p = tl.where(order_key(s).to(tl.int64) >= thr, tl.exp(s - m) / S, 0.0)
    r = tl.load(slot_ptr + offs, mask=offs < tl.where(use_r, V, 0), other=0.0)
    return tl.where(use_r, tl.math.div_rn(r, s_div), p), tl.where(use_r, r, p)


@triton.jit
def _q_cur(q_pos_ptr, q_ws_ptr, offs, Vd, q_mat, s_q):
    """q_cur at offs: draft_probs at the position while q_mat == 0, else q_w / s_q; 0 past Vd."""
    use_w = q_mat != 0
    q = tl.load(q_pos_ptr + offs, mask=offs < tl.where(use_w, 0, Vd), other=0.0)
    w = tl.load(q_ws_ptr + offs, mask=offs < tl.where(use_w, Vd, 0), other=0.0)
    return tl.where(use_w, tl.math.div_rn(w, s_q), q)


@triton.jit
def _q_unusable(q_pos_ptr, Vd, BLOCK_V: tl.constexpr):
    """Whether a position's q [Vd] holds a NaN, an inf or a negative entry."""
    n_bad = tl.zeros([BLOCK_V], dtype=tl.int32)
    for start in range(0, Vd, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        q = tl.load(q_pos_ptr + offs, mask=offs < Vd, other=0.0)
        n_bad += ((q != q) | (q < 0.0) | (q == float("inf"))).to(tl.int32)
    return tl.sum(n_bad, axis=0) > 0


@triton.jit
def _reject(pos_ptr, src_ptr, dst_ptr, q_pos_ptr, q_ws_ptr, c, V, Vd, inv_t, m, S, thr, p_mat, s_div, q_mat, s_q,
            HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """After child c is rejected: r = max(0, p_cur - q_cur) written to dst (q_cur = the point mass
    at c for the deterministic rule) and, sampled rule, q_w = q_cur with c removed, in place.
    Returns (sum r, sum q_w), fp32."""
    tl.debug_barrier()  # every thread has read q_w[c] for the test before it is overwritten
    acc_r = tl.zeros([BLOCK_V], dtype=tl.float32)
    acc_q = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        p, w = _p_cur(pos_ptr, src_ptr, offs, V, p_mat, s_div, inv_t, m, S, thr)
        if HAS_DRAFT_PROBS:
            q = _q_cur(q_pos_ptr, q_ws_ptr, offs, Vd, q_mat, s_q)
            q_next = tl.where(offs == c, 0.0, q)
            tl.store(q_ws_ptr + offs, q_next, mask=offs < Vd)
            acc_q += q_next
        else:
            q = tl.where(offs == c, 1.0, 0.0)
        r = tl.maximum(p - q, 0.0)
        tl.store(dst_ptr + offs, r, mask=mask)
        acc_r += r
    tl.debug_barrier()  # the workspaces are read next by other threads
    return tl.sum(acc_r, axis=0), tl.sum(acc_q, axis=0)


@triton.jit
def tree_verify_kernel(
    logits_ptr, stride_lb, stride_ln,  # [B, N+1, V] fp32/bf16/fp16, last dim contiguous
    node_tokens_ptr, stride_xb,  # [B, N] int32/int64, last dim contiguous
    parents_ptr, stride_pb,  # [B, N] int32/int64, last dim contiguous
    draft_probs_ptr, stride_qb, stride_qn,  # [B, N+1, Vd] fp32, last dim contiguous
    num_nodes_ptr,  # [B] int64
    temperature_ptr,  # [B] fp32, 0 = greedy
    top_k_ptr,  # [B] int64, 0 = off
    top_p_ptr,  # [B] fp32, 1 = off
    min_p_ptr,  # [B] fp32, 0 = off
    seed_ptr, offset_ptr,  # [B] int64 each
    uniforms_ptr,  # [B, N+1] float64, contiguous
    p_ws_ptr,  # workspace [B, 2, V] fp32: the residual's two slots
    q_ws_ptr,  # workspace [B, Vd] fp32: q_w
    tokens_ptr,  # out [B, D+1] int64, contiguous
    path_ptr,  # out [B, D] int64, contiguous
    num_accepted_ptr,  # out [B] int64
    N, V, Vd, D,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    HAS_UNIFORMS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= N
    BLOCK_D: tl.constexpr,  # >= D + 1
):
    b = tl.program_id(0).to(tl.int64)
    nb = tl.load(num_nodes_ptr + b)
    temp = tl.load(temperature_ptr + b)
    greedy = temp == 0.0
    # the reference's row_parameters; (0, 2^-126): 1 / T overflows, or a subnormal T is flushed to 0
    bad = ((temp != temp) | (temp < 0.0) | (temp == float("inf")) | ((temp > 0.0) & (temp < _FLT_MIN))
           | (nb < 0) | (nb > N))
    top_k = tl.full([], 0, tl.int64)
    top_p = tl.full([], 1.0, tl.float32)
    min_p = tl.full([], 0.0, tl.float32)
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + b)
        bad = bad | (top_k < 0)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + b)
        bad = bad | ~(top_p > 0.0) | (top_p > 1.0)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + b)
        bad = bad | ~(min_p >= 0.0) | (min_p > 1.0)  # NaN fails the first test
    # Greedy rows need only the argmax: no temperature, no warp.  IEEE division, as the reference.
    inv_t = tl.where(greedy | bad, 1.0, tl.math.div_rn(1.0, tl.where(greedy | bad, 1.0, temp)))
    top_k = tl.where(greedy, 0, top_k)
    top_p = tl.where(greedy, 1.0, top_p)
    mp_on = ~greedy & (min_p > 0.0)
    nb_c = tl.minimum(tl.maximum(nb, 0), N)

    # The tree: every used node's parent in [-1, n), its depth <= D (depth in registers).
    par_row = parents_ptr + b * stride_pb
    ids = tl.arange(0, BLOCK_N)
    depth = tl.zeros([BLOCK_N], dtype=tl.int64)
    for n in range(0, nb_c):
        pn = tl.load(par_row + n).to(tl.int64)
        d = tl.where(pn >= 0, tl.sum(tl.where(ids == pn, depth, 0), axis=0) + 1, 1)
        depth = tl.where(ids == n, d, depth)
        bad = bad | (pn < -1) | (pn >= n) | (d > D)

    row_logits = logits_ptr + b * stride_lb
    tok_row = node_tokens_ptr + b * stride_xb
    q_row = draft_probs_ptr + b * stride_qb
    p_ws_row = p_ws_ptr + b * (2 * V)
    q_ws_row = q_ws_ptr + b * Vd
    counter_base = tl.load(offset_ptr + b) << 32
    seed = tl.load(seed_ptr + b)

    # The walk, from the root (position 0).
    cur = tl.full([], -1, tl.int64)  # the current node (-1 = the root); its position is cur + 1
    m = tl.full([], 0.0, tl.float32)
    S = tl.full([], 1.0, tl.float32)
    thr = tl.full([], -2147483648, tl.int64)
    amax = tl.full([], 0, tl.int32)
    if bad == 0:
        m, S, thr, amax, bad_pos = _tree_position(row_logits, V, inv_t, top_k, top_p, min_p, mp_on,
                                                  HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, BLOCK_V)
        bad = bad | bad_pos
    p_mat = tl.full([], 0, tl.int32)  # p_cur comes from the residual slot (else from the logits)
    p_slot = tl.full([], 0, tl.int64)
    s_div = tl.full([], 1.0, tl.float32)
    q_mat = tl.full([], 0, tl.int32)  # q_cur comes from q_w (else from draft_probs)
    s_q = tl.full([], 1.0, tl.float32)
    q_checked = tl.full([], 0, tl.int32)  # this position's q has been checked
    n_acc = tl.full([], 0, tl.int64)
    cols = tl.arange(0, BLOCK_D)
    path = tl.full([BLOCK_D], -1, tl.int64)
    for n in range(0, nb_c):
        pn = tl.load(par_row + n).to(tl.int64)
        if (bad == 0) & (pn == cur):
            pos_ptr = row_logits + (cur + 1) * stride_ln
            q_pos_ptr = q_row + (cur + 1) * stride_qn
            c = tl.load(tok_row + n).to(tl.int64)
            c_ok = (c >= 0) & (c < V)
            bad = ~c_ok
            c_safe = tl.where(c_ok, c, 0)
            accept = greedy & (c == amax)
            if HAS_DRAFT_PROBS:
                if (greedy == 0) & (bad == 0) & (q_checked == 0):
                    bad = _q_unusable(q_pos_ptr, Vd, BLOCK_V)
                    q_checked = tl.full([], 1, tl.int32)
            if (greedy == 0) & (bad == 0):
                src_ptr = p_ws_row + p_slot * V
                p_c, w_c = _p_cur(pos_ptr, src_ptr, c_safe, V, p_mat, s_div, inv_t, m, S, thr)
                if HAS_UNIFORMS:
                    u = tl.load(uniforms_ptr + b * (N + 1) + n)
                else:
                    u = tl.rand(seed, counter_base | (n + 1)).to(tl.float64)
                if HAS_DRAFT_PROBS:
                    q_c = _q_cur(q_pos_ptr, q_ws_row, c_safe, Vd, q_mat, s_q)
                    live = q_c > 0.0
                    # in float64: u * q(c) of a 24-bit u and an fp32 q is exact
                    passes = u * q_c.to(tl.float64) < p_c.to(tl.float64)
                else:
                    live = p_c > 0.0
                    passes = u < p_c.to(tl.float64)
                accept = live & passes
                if live & ~passes:
                    dst_ptr = p_ws_row + (1 - p_slot) * V
                    s_r, s_qn = _reject(pos_ptr, src_ptr, dst_ptr, q_pos_ptr, q_ws_row, c_safe, V, Vd, inv_t,
                                        m, S, thr, p_mat, s_div, q_mat, s_q, HAS_DRAFT_PROBS, BLOCK_V)
                    if s_r > 0.0:  # a residual that sums to 0 is not taken
                        p_slot = 1 - p_slot
                        p_mat = tl.full([], 1, tl.int32)
                        s_div = tl.maximum(s_r, _FLT_MIN)
                    if HAS_DRAFT_PROBS:
                        q_mat = tl.full([], 1, tl.int32)
                        s_q = tl.maximum(s_qn, _FLT_MIN)
            if accept & (bad == 0):
                path = tl.where(cols == n_acc, n, path)
                n_acc += 1
                cur = n + cur * 0
                m, S, thr, amax, bad_pos = _tree_position(row_logits + (n + 1) * stride_ln, V, inv_t, top_k,
                                                          top_p, min_p, mp_on, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P,
                                                          BLOCK_V)
                bad = bad_pos
                p_mat = tl.full([], 0, tl.int32)
                s_div = tl.full([], 1.0, tl.float32)
                q_mat = tl.full([], 0, tl.int32)
                s_q = tl.full([], 1.0, tl.float32)
                q_checked = tl.full([], 0, tl.int32)

    # The final token: the argmax, or the inverse CDF of w (p, or the last residual taken).
    final = amax.to(tl.int64)
    if (greedy == 0) & (bad == 0):
        pos_ptr = row_logits + (cur + 1) * stride_ln
        src_ptr = p_ws_row + p_slot * V
        # Pass A: the mass, in float64 per lane, then across lanes.  The scan below sums per tile
        # instead (the row kernel's final draw: the two agree to ~V * 2^-53 relative; a
        # uniform within that of 1 may take the last positive weight).
        acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            p, w = _p_cur(pos_ptr, src_ptr, offs, V, p_mat, s_div, inv_t, m, S, thr)
            acc += w.to(tl.float64)
        total = tl.sum(acc, axis=0)
        if HAS_UNIFORMS:
            u_final = tl.load(uniforms_ptr + b * (N + 1) + N)
        else:
            # 53 random bits (27 of Philox's first word, 26 of its second) on the 2^-53 grid
            r0, r1, _, _ = tl.randint4x(seed, counter_base)
            u_final = ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64)) * 1.1102230246251565e-16
        target = u_final * total
        # Pass B: inverse CDF, stopping at the first token whose cumulative weight passes target.
        carry = tl.full([], 0.0, tl.float64)
        found = tl.full([], -1, tl.int32)
        last_nz = tl.full([], -1, tl.int32)
        start = tl.full([], 0, tl.int32)
        while (start < V) & (found < 0):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            p, w = _p_cur(pos_ptr, src_ptr, offs, V, p_mat, s_div, inv_t, m, S, thr)
            w64 = w.to(tl.float64)
            cdf = carry + tl.cumsum(w64, axis=0)
            # w > 0: a token of weight 0 is never the hit, whatever order tl.cumsum adds in
            hit = tl.min(tl.where(mask & (w > 0.0) & (cdf > target), offs, _INT32_MAX), axis=0)
            found = tl.where(hit < _INT32_MAX, hit, found)
            last_nz = tl.maximum(last_nz, tl.max(tl.where(mask & (w > 0.0), offs, -1), axis=0))
            carry += tl.sum(w64, axis=0)
            start += BLOCK_V
        final = tl.where(found >= 0, found, last_nz).to(tl.int64)
        bad = bad | (final < 0)

    on_path = cols < n_acc
    x_path = tl.load(tok_row + tl.where(on_path, path, 0), mask=on_path, other=-1).to(tl.int64)
    out = tl.where(on_path, x_path, -1)
    out = tl.where(cols == n_acc, final, out)
    out = tl.where(bad, -1, out)
    tl.store(tokens_ptr + b * (D + 1) + cols, out, mask=cols < D + 1)
    tl.store(path_ptr + b * D + cols, tl.where(bad, -1, path), mask=cols < D)
    tl.store(num_accepted_ptr + b, tl.where(bad, -1, n_acc))
