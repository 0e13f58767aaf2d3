"""The Triton kernel of ``fused_verify``: one launch, the vocabulary split across programs.

Work items, claimed in ticket order by a persistent grid: stage 1, item (b, i, g) for every row,
position i <= K and group of TILES chunks (CHUNK tokens each, never a function of B); stage 2,
item (b, g) (BLOCK: (b, i, g)).  The last stage-1 item of a position combines its chunks in chunk
order, the last position of a row runs the acceptance chain and releases the row's ready flag,
stage-2 items wait on it, and the last one draws the final token (``stage1``, ``stage2``).

Memory traffic per row with K_b drafts, V tokens of E bytes: stage 1 reads (K_b + 1) * V * E
bytes from HBM, every position once and in parallel (the floor: each decision needs its
position's softmax); stage 2 reads position j again, V * E (+ q_j's Vd * 4 after a rejection),
from L2 when ``stage2_lag`` numbers it close to its stage 1; the draw rescans one chunk; records
are 16 bytes a chunk (+ 4 * CAP with top-k/top-p/min-p).  Block verification reads every
position twice; draft logits add K_b * Vd * Ed; a grammar's mask (MASKED) adds V / 8 bytes to
each read of a position (its int32 words), in the same pass: no pass of its own.  Per-form
details: docs/verify_kernel.md.

Ordering and progress: items publish records, then an acq_rel arrival; the last arrival combines.
The chain publishes with a release of the ready flag; stage 2 acquires it.  A stage-2 item waits
only for items with smaller tickets, each held by a running program that finishes it without
waiting (also when a program has prefetched its next ticket: that one is larger), so no order of
scheduling deadlocks, on any grid.  The launcher zeroes the counters before each launch and a
captured graph has its own workspace, so nothing an earlier launch left can reach this one.

Randomness: Philox at counter (offset_b << 32) | c, as ``reference.philox_uniforms``: c = i + 1
for draft i's test (24 bits), c = 0 for the final draw (53 bits, float64 inverse CDF).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..records import LINE, counter_index, counter_lengths
from .draw import _row_offsets, _row_params
from .stage1 import _elements, acceptance_chain, combine_position, stage1_item
from .stage2 import final_draw, stage2_item

# The counters' layout (``records.COUNTERS``, the table the launcher's sizes come from too): each
# field's length, in order, and each field's place in that order.
_LINE = tl.constexpr(LINE)  # int32 counters per 128-byte line
_COUNTER_LENGTHS = tl.constexpr(counter_lengths())
_C_TICKET = tl.constexpr(counter_index("ticket"))
_C_POS = tl.constexpr(counter_index("pos"))
_C_ROW = tl.constexpr(counter_index("row"))
_C_READY = tl.constexpr(counter_index("ready"))
_C_S2 = tl.constexpr(counter_index("s2"))


@triton.jit
def _line_up(n):
    return (n + _LINE - 1) // _LINE * _LINE


@triton.jit
def _counter(counters_ptr, FIELD: tl.constexpr, B, K1, NC):
    """Where counter FIELD starts (``records.counter_layout``): each field on a 128-byte line of
    its own, after the fields before it."""
    off = 0
    for f in tl.static_range(FIELD):
        off = _line_up(off + _elements(_COUNTER_LENGTHS[f], B, K1, NC))
    return counters_ptr + off


@triton.jit
def _claim(ticket_ptr, TICKET: tl.constexpr):
    """The next ticket.  Its order carries nothing (the records are published by the arrival
    counters), so relaxed suffices; TICKET = 0 keeps an acq_rel claim for comparison."""
    if TICKET == 0:
        t = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    else:
        t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    return t


@triton.jit
def _ticket_item(t, B, A, C, T1, LAG):
    """The work item of ticket t, numbered as when every stage-1 item comes first (stage 1:
    item = b * A + r, r < A; stage 2: item = T1 + b * C + r, r < C), with row b's stage-2 items
    claimed right after row b + LAG's stage-1 items: rows 0..LAG-1's stage-1 items, then for
    s = LAG..B-1 row s's stage-1 items and row s - LAG's stage-2 items, then the last LAG rows'
    stage-2 items.  Every stage-2 item still follows its row's stage-1 items; LAG = B is the
    plain order."""
    head = LAG * A
    mid = (B - LAG) * (A + C)
    item = t  # t < head: rows 0..LAG-1's stage-1 items, in the plain order
    if (t >= head) & (t < head + mid):
        s = LAG + (t - head) // (A + C)
        r = (t - head) % (A + C)
        item = tl.where(r < A, s * A + r, T1 + (s - LAG) * C + (r - A))
    elif t >= head + mid:
        item = T1 + (B - LAG) * C + (t - head - mid)
    return item


@triton.jit
def _sleep(ns: tl.constexpr):
    """``nanosleep`` (sm_70+) for about ``ns`` nanoseconds: fewer polls of a hot line."""
    tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [tl.full([], ns, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_ready(flag_ptr, POLL: tl.constexpr, SLEEP_NS: tl.constexpr):
    """Spin until the row's ready flag is set (released by the program that ran its acceptance
    chain), then hold an acquire of it: the row's records read afterwards are that program's."""
    if POLL == 0:
        ready = tl.atomic_add(flag_ptr, 0, sem="acquire")
        while ready == 0:
            if SLEEP_NS > 0:
                _sleep(SLEEP_NS)
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire")
    else:
        ready = tl.load(flag_ptr, volatile=True)
        while ready == 0:
            if SLEEP_NS > 0:
                _sleep(SLEEP_NS)
            ready = tl.load(flag_ptr, volatile=True)
        tl.atomic_add(flag_ptr, 0, sem="acquire")  # reads the released 1: synchronises with it


@triton.jit
def verify_split_kernel(
    logits_ptr, stride_lb, stride_lk,  # [B, K+1, V] (PACKED: [sum_b (K_b + 1), V]) fp32/bf16/fp16, last dim contiguous
    draft_tokens_ptr, stride_tb, stride_tk,  # [B, K] (PACKED: [sum_b K_b]) int32/int64
    draft_probs_ptr, stride_qb, stride_qk,  # [B, K, Vd] (PACKED: [sum_b K_b, Vd]) fp32/bf16/fp16, last dim contiguous
    #                                        (DRAFT_LOGITS: the draft's logits, same layout and dtypes)
    cu_ptr, cu_stride,  # PACKED: [B + 1] int32/int64, cu[b] = K_0 + ... + K_{b-1}
    mask_ptr, stride_mb, stride_mk,  # MASKED: [B, K+1, W] (PACKED: [sum_b (K_b + 1), W]) int32, W = ceil(V/32),
    #                                  last dim contiguous
    uniforms_ptr, stride_ub, stride_uk,  # [B, K+1] float64/fp32
    param_flags,  # bit set: that parameter is a [B] tensor (ptr, stride), else the scalar
    nd_ptr, nd_stride, nd_scalar,  # num_draft_tokens: int
    t_ptr, t_stride, t_scalar,  # temperature: float, 0 = greedy
    k_ptr, k_stride, k_scalar,  # top_k: int, 0 = off
    p_ptr, p_stride, p_scalar,  # top_p: float, 1 = off
    mp_ptr, mp_stride, mp_scalar,  # min_p: float, 0 = off
    seed_ptr, seed_stride, seed_scalar,  # seed: int64
    off_ptr, off_stride, off_scalar,  # offset: int64
    seed_row_step,  # row b's seed is seed + b * seed_row_step (1 for seed=None's base seed, else 0)
    tokens_ptr, stride_ob, stride_oc,  # out [B, K+1] int32/int64
    num_accepted_ptr, stride_on,  # out [B] int32/int64
    logprobs_ptr, stride_pb, stride_pc,  # out [B, K+1] fp32 (LOGPROBS)
    counters_ptr,  # int32 [records.counter_layout(B, K+1)["total"]], zeroed before the launch
    part_f_ptr,  # fp32 [records.tensor_size("part_f", ...)]: 2 * B * (K+1) * (NC + 1) (DRAFT_LOGITS: twice that)
    part_i_ptr,  # int32 [records.tensor_size("part_i", ...)]: 4 * B * (K+1) * (NC + 1) + 4 * B + B * NC (+ draft's)
    cand_ptr,  # int32 [B * (K+1) * NC * CAP] (with a warp)
    mass_ptr,  # float64 [records.tensor_size("mass", ...)]: B * NC (BLOCK: 2 * B * (K+1) * NC + B * (K+1))
    order_ptr,  # int32 [T1 + T2]: the item each ticket stands for (tests only, HAS_ORDER)
    B, K, V, Vd, NC,
    LAG,  # row b's stage-2 items are numbered after row b + LAG's stage-1 items (LAG = B: after all)
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,  # a min_p argument (tensor or scalar) was given
    HAS_UNIFORMS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    PACKED: tl.constexpr,  # the ragged layout: rows back to back, K_b from cu
    PROBS: tl.constexpr,  # the target given as probabilities (no temperature, no warp)
    LOGPROBS: tl.constexpr,  # also write each emitted token's target log-probability
    DRAFT_LOGITS: tl.constexpr,  # draft_probs_ptr holds the draft's logits: q = softmax(logits / T), per row's T
    BLOCK: tl.constexpr,  # block verification (Sun et al. 2025) instead of token by token
    MASKED: tl.constexpr,  # a grammar's token mask (xgrammar's bitmask) applied to every read of the target's logits
    CHUNK: tl.constexpr,
    TILES: tl.constexpr,  # chunks per work item
    STAGES: tl.constexpr,  # software-pipelining depth over an item's chunks
    NCB: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TICKET: tl.constexpr,  # 0: acq_rel claim after an item; 1: relaxed; 2: relaxed, prefetched
    POLL: tl.constexpr,  # 0: an acquire atomic per poll; 1: volatile loads, then one acquire
    SLEEP_NS: tl.constexpr,  # nanosleep between polls (CUDA only; 0: none)
):
    K1 = K + 1
    NI = (NC + TILES - 1) // TILES  # work items per position (TILES chunks each)
    T1 = B * K1 * NI  # stage-1 tickets
    T2 = B * NI  # stage-2 tickets
    if BLOCK:
        T2 = B * K1 * NI
    # The counters' fields, each on a 128-byte line of its own (``records.COUNTERS``).
    ticket_ptr = _counter(counters_ptr, _C_TICKET, B, K1, NC)  # [1] the next ticket
    pos_cnt_ptr = _counter(counters_ptr, _C_POS, B, K1, NC)  # [B * (K+1)] position arrivals
    row_cnt_ptr = _counter(counters_ptr, _C_ROW, B, K1, NC)  # [B] row arrivals
    ready_ptr = _counter(counters_ptr, _C_READY, B, K1, NC)  # [B] the row's chain is done
    s2_cnt_ptr = _counter(counters_ptr, _C_S2, B, K1, NC)  # [B] stage-2 arrivals

    t = _claim(ticket_ptr, TICKET)
    # t >= 0: a ticket is never negative (the counters are zeroed before the launch); checked
    # all the same before it indexes anything
    while (t >= 0) & (t < T1 + T2):
        if TICKET == 2:
            t_next = _claim(ticket_ptr, TICKET)  # its round trip overlaps this item's loads
        if HAS_ORDER:
            item = tl.load(order_ptr + t)
        else:
            item = _ticket_item(t, B, K1 * NI, T2 // B, T1, LAG)
        if item < T1:  # stage 1, item (b, i, g)
            b = (item // (K1 * NI)).to(tl.int64)
            i = (item // NI) % K1
            g = item % NI
            kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p = _row_params(
                b, K, V, param_flags, nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PACKED, PROBS)
            l_off, t_off, q_off, m_off = _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb,
                                                      stride_tk, stride_qb, stride_qk, stride_mb, stride_mk, PACKED)
            pid_bi = b * K1 + i
            warp_on = k_on | p_on | mp_on
            stage1_item(logits_ptr + l_off, draft_probs_ptr + q_off, mask_ptr + m_off, stride_lk, stride_qk, stride_mk,
                        cand_ptr, part_f_ptr, part_i_ptr, B, K1, NC, V, Vd, pid_bi, i, g, kb, greedy, bad_param,
                        inv_t, warp_on, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PROBS, LOGPROBS, DRAFT_LOGITS, CHUNK, TILES,
                        STAGES, CAP, MASKED)
            # Arrive at the position (release this item's records); the last of its NI items
            # (acquiring every other's) combines its NC chunks.
            tl.debug_barrier()
            arrived = tl.atomic_add(pos_cnt_ptr + pid_bi, 1, sem="acq_rel")
            if arrived == NI - 1:
                if (i <= kb) & (bad_param == 0):
                    combine_position(logits_ptr + l_off, mask_ptr + m_off, stride_lk, stride_mk, cand_ptr, part_f_ptr,
                                     part_i_ptr, B, K1, NC, V, pid_bi, i, kb, greedy, inv_t, k_on, p_on, top_k, top_p,
                                     mp_on, min_p, warp_on, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PROBS, LOGPROBS,
                                     DRAFT_LOGITS, CHUNK, NCB, CAP, MASKED)
                # Arrive at the row: the last of its K + 1 positions runs the acceptance chain.
                tl.debug_barrier()
                rows_done = tl.atomic_add(row_cnt_ptr + b, 1, sem="acq_rel")
                if rows_done == K1 - 1:
                    acceptance_chain(logits_ptr + l_off, draft_tokens_ptr + t_off, draft_probs_ptr + q_off,
                                     mask_ptr + m_off, stride_lk, stride_tk, stride_qk, stride_mk, uniforms_ptr,
                                     stride_ub, stride_uk, param_flags, seed_ptr, seed_stride, seed_scalar,
                                     seed_row_step, off_ptr, off_stride, off_scalar,
                                     tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, logprobs_ptr,
                                     stride_pb, stride_pc, part_f_ptr, part_i_ptr, mass_ptr, b, B, K, V, Vd, NC, kb,
                                     greedy, bad_param, inv_t, HAS_DRAFT_PROBS, HAS_UNIFORMS, PROBS, LOGPROBS,
                                     DRAFT_LOGITS, BLOCK, BLOCK_K, MASKED)
                    tl.debug_barrier()
                    tl.atomic_xchg(ready_ptr + b, 1, sem="release")
        else:  # stage 2, item (b, g) (BLOCK: (b, position, g))
            if BLOCK:
                b = ((item - T1) // (K1 * NI)).to(tl.int64)
                pos = ((item - T1) // NI) % K1
            else:
                b = ((item - T1) // NI).to(tl.int64)
                pos = 0
            g = (item - T1) % NI
            # Wait for the row's acceptance chain (stage-1 items only: all numbered before this one).
            _wait_ready(ready_ptr + b, POLL, SLEEP_NS)
            kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p = _row_params(
                b, K, V, param_flags, nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PACKED, PROBS)
            l_off, t_off, q_off, m_off = _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb,
                                                      stride_tk, stride_qb, stride_qk, stride_mb, stride_mk, PACKED)
            sampled, bad_row, j, rejected, x_j, pp_j, m_j, S_j, thr_j, m_dj, S_dj = stage2_item(
                logits_ptr + l_off, draft_tokens_ptr + t_off, draft_probs_ptr + q_off, mask_ptr + m_off, stride_lk,
                stride_tk, stride_qk, stride_mk, part_f_ptr, part_i_ptr, mass_ptr, b, B, K1, NC, V, Vd, pos, g, kb,
                greedy, inv_t, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK, CHUNK, TILES, STAGES, MASKED)
            tl.debug_barrier()
            arrived = tl.atomic_add(s2_cnt_ptr + b, 1, sem="acq_rel")
            if arrived == NI * (K1 if BLOCK else 1) - 1:
                if sampled:
                    final_draw(logits_ptr + l_off, draft_tokens_ptr + t_off, draft_probs_ptr + q_off, mask_ptr + m_off,
                               stride_lk, stride_tk, stride_qk, stride_mk, uniforms_ptr, stride_ub, stride_uk,
                               param_flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride,
                               off_scalar,
                               tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, logprobs_ptr,
                               stride_pb, stride_pc, part_f_ptr, part_i_ptr, mass_ptr, b, B, K, NC, V, Vd, kb, inv_t,
                               bad_row, j, rejected, x_j, pp_j, m_j, S_j, thr_j, m_dj, S_dj,
                               HAS_DRAFT_PROBS, HAS_UNIFORMS, PROBS, LOGPROBS, DRAFT_LOGITS, BLOCK, CHUNK, NCB,
                               BLOCK_K, MASKED)
        if TICKET == 2:
            t = t_next
        else:
            t = _claim(ticket_ptr, TICKET)
