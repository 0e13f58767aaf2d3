"""The Triton kernel of ``fused_verify``: one launch, the vocabulary split across programs.

This module is long for one reason: the kernel is one ``@triton.jit`` function whose two stages
and three combines run in one persistent loop over tickets and share the workspace's field
offsets, the row's parameters and the constexpr flags (PACKED, PROBS, LOGPROBS, DRAFT_LOGITS,
BLOCK, ...); cut into device functions, each piece would take and return dozens of these values,
and the order of the arrivals that makes the launch deadlock-free (below) would no longer read in
one place.  Its device functions are in ``_verify_split_stats.py`` (the chunks' candidate keys,
top-k and top-p from the candidates, min-p's threshold key) and ``_verify_split_draw.py`` (a
row's parameters and random numbers, a chunk's final-draw weights, the inverse-CDF draw, the
row's outputs); this module holds the design and the memory traffic of the whole launch.

Work decomposition.  Position i of row b is cut into NC = ceil(V / CHUNK) chunks of CHUNK
tokens (a constant of the launcher, never a function of B, so a row's arithmetic does not
depend on the batch).  A work item covers TILES consecutive chunks (1 by default; NI =
ceil(NC / TILES) items a position), streamed with software pipelining.  The launch holds two
kinds of work item, numbered in this order (written below for TILES = 1):

- stage 1, item (b, i, c) for every row, position i <= K and chunk c (B * (K+1) * NI items):
  the chunk's max, first argmax, sum of exp(s - chunk max) and non-finite count (greedy rows:
  max and argmax only, no exponential), and with top-k/top-p/min-p the chunk's CAP largest order
  keys; written to a partial record;
- stage 2, item (b, c) for every row and chunk (B * NI items): the float64 mass of chunk c's
  final-draw weights (residual max(0, p - q) after a rejection, p for the bonus) at the row's
  stop position j.

Each program claims items from a ticket counter (atomic add) until none is left, so items are
*started* in number order whatever the grid and the hardware's scheduling.  Combines happen
without a second launch, by the last program to arrive (an arrival counter, acq_rel):

- the last stage-1 item of position (b, i) combines its NC chunk partials **in chunk order** (the
  result does not depend on which program arrives last) into the position's (m, S, thr, argmax,
  bad): top-k and top-p from the chunks' candidate keys (below);
- the last position of row b to be combined runs the acceptance chain (all K_b tests at once,
  float64, the same Philox counters as before), giving j; a greedy or invalid row is written out
  here, then the row's ready flag is released;
- a stage-2 item waits (spins, acquire) on its row's ready flag; the last stage-2 item of a row
  locates the chunk holding the sampled token from the NC chunk masses (float64, chunk order),
  rescans that one chunk (hot in L2) for the inverse CDF, and writes the row.

No deadlock under any scheduling: stage-1 items never wait; a stage-2 item waits only for its
row's stage-1 items, which all have smaller numbers, so each was claimed by a program that is
already running and that finishes it without waiting; hence every flag is set.  This holds for
any grid size and any number of co-resident programs (one program doing every item in order
included: Triton's interpreter).  Every counter and flag is reset by the last program to use it
in the launch (the ticket by the last program to leave), so no host memset is needed and the
launch can be captured in a CUDA graph and replayed: the workspace is persistent per device and
stream (see ``_verify_workspace._workspace``).

top-k / top-p in one pass: stage 1 writes, per chunk, its largest order keys: every key above
t_c, the top of the 16-bit key bucket (sign, exponent, 7 mantissa bits) that holds the chunk's
CAP-th largest key, found by radix select (two 256-bin histograms of the keys in registers);
fewer than CAP keys lie above it (the whole chunk when it has at most CAP tokens, t_c =
INT32_MIN).  Every token with a key above t_sat = max_c t_c is then in the lists, so a threshold
found among the candidates and lying above t_sat is the position's own: the k-th largest
candidate (radix select, four histograms) when it is above t_sat, and the top-p cut then over
the top-k set (each kept key's strictly-greater mass at once, in one CAP x CAP block), or, with
top-p alone, bisected over the candidates' masses from t_sat up.  That decides top-k 50 on
logits without a tie across t_sat and top-p sets of fewer than ~CAP tokens of any chunk.
Otherwise (k above what the lists hold, ties at t_sat, a large top-p set) the position's last
program bisects over the whole position as the one-program-per-row kernel does (up to ~65 reads
of it): exact, slow, and said in the README.  The semantics are the reference's: ties at the
top-k boundary kept, top-p's strict boundary, the smallest key whose strictly-greater mass is <
top_p * S over the top-k set.

min-p (HAS_MIN_P; after top-k and top-p, transformers' order) keeps the tokens with s >= T,
T = fl32(m + fl32(ln min_p)) (``reference.min_p_threshold``; the float64 log by the steps of
``reference.min_p_log``, ``_min_p_key``): a threshold on the order key from the position's max m
alone, known at the combine, so no pass over the logits finds it.  Its kept set is an upper set
holding the maximum, so it composes with top-k/top-p's as the higher of the two thresholds.  The
kept mass S comes from the candidate lists when that threshold lies above t_sat (the lists hold
every kept token: the usual case, a min-p set of fewer than ~CAP tokens of any chunk); otherwise
the combining program sums exp(s - m) over the position's keys >= it in one pass (``scanned``),
one read where top-p's fallback bisects.

Memory traffic per row b with K_b drafts, V tokens, E-byte logits (4 fp32, 2 bf16/fp16), Vd
draft-vocabulary entries of 4 bytes, and NC chunks:

- stage 1 reads (K_b + 1) * V * E bytes once: every position a row uses, in parallel (positions
  past K_b are not read).  This is the floor: each decision needs the softmax of its position,
  and the positions are read in parallel rather than stopping at the first rejection, which a
  split launch cannot know in advance.  It writes 16 bytes per chunk (+ 4 * CAP with a warp);
- stage 2 reads position j's V * E bytes again (L2-hot on a GPU: it was read microseconds
  before) and, after a rejection with a full q, q_j's Vd * 4 bytes; it writes 12 bytes per chunk;
- the final draw rescans one chunk (CHUNK * (E + 4) bytes, L2-hot) and writes (K + 2) * 8 bytes;
- with top-k/top-p: no more reads of the logits when the candidate lists decide (above), the
  top-k set through CAP * 4 bytes of the workspace;
- min-p adds no read of the logits when its kept set lies in the candidate lists (a scalar min_p
  is passed by value; a [B] tensor's element is read once per item, as top_p's), the lists' 4 *
  CAP bytes a chunk as with top-k/top-p; one more read of a position (V * E bytes, by its
  combining program) only when its kept set overflows the lists;
- the combines read the partial records (16 bytes per chunk, 4 * CAP with a warp), L2-resident.

The engine-facing forms change no pass: the packed layout (PACKED) reads row b's positions from
logits row cu[b] + b and its drafts from cu[b] (two 4-8 byte reads of cu per item, the same bytes
of logits); probabilities in (PROBS) read the same V * E bytes, with no exponential; fp16/bf16
draft probabilities read Vd * 2 bytes instead of 4; log-probabilities (LOGPROBS) add one logit
read for the final token, 4 * (K + 1) bytes written per row, and the exponentials of greedy rows.

Draft logits in (DRAFT_LOGITS: ``draft_logits=``; draft_probs_ptr holds the draft's logits, Vd
entries of Ed bytes, 4 fp32 or 2 bf16/fp16), the one form that adds reads to a pass: q_i =
softmax(l_i / T) with the row's temperature, no top-k/top-p.  Each stage-1 item (b, i, c) of a
sampled row's draft position i < K_b also reduces chunk c of l_i / T (the same chunks as the
target's; a chunk past Vd reads nothing): its max, sum of exp(l / T - chunk max) and NaN/+inf
count, to three more per-chunk records; the position's combine makes (m_d, S_d, bad_d) in chunk
order as it does (m, S) for the target (bad_d: a NaN or +inf scaled logit, or none finite: q_i
is then NaN, as the reference's softmax of such a row, and makes the row invalid where it is
read).  The acceptance chain reads l_i(x_i) and takes q_i(x_i) = exp(l_i(x_i) / T - m_d) / S_d;
stage 2 computes q_j per token the same way from position j's draft logits.  Added traffic per
sampled row: K_b * Vd * Ed bytes read in stage 1 (every draft position, in parallel with the
target's positions: where draft_probs reads K_b entries, the logits' softmax needs the whole
row), 12 bytes written per draft-position chunk and read back by the combine (L2), 12 * (K + 1)
bytes of position records; after a rejection stage 2 reads q_j's Vd * Ed bytes of logits
(instead of Vd * 4 or 2 bytes of probabilities; L2-hot).  Greedy rows read no draft logits.

So a step reads about (K_b + 2) * V * E bytes of logits (+ Vd * 4 of q after a rejection; with
draft logits + K_b * Vd * Ed, and Vd * Ed after a rejection), all but (K_b + 1) * V * E (+ K_b *
Vd * Ed) of it from L2.  Greedy rows skip stage 2 and compute no exponential.

Block verification (BLOCK: ``method="block"``, Sun et al. 2025; ``reference.block_verify_reference``
defines it): the row's chain also computes p_0..p_K (float64, 8 * (K + 1) bytes written); stage
2 has an item per row, position i <= K_b and chunk (B * (K+1) * NI items), each writing the float64
mass of chunk c of max(0, p_i P_i - Q_i) (P at i = K_b) and its unusable-q count (16 bytes a
chunk); the row's last item reads those (16 * (K_b + 1) * NC bytes, L2), forms h_i and tau, and
draws the extra token from position tau's masses (one chunk rescanned).  Added traffic per sampled
row: every position's V * E bytes read a second time in stage 2 (K_b * V * E more than token
verification's one position, L2-hot) and q at every draft position, K_b * Vd * 4 bytes (2 for
bf16/fp16; with draft logits K_b * Vd * Ed more), where token verification reads q_j only after a
rejection.  So a block step reads about 2 (K_b + 1) V E + K_b Vd 4 bytes, half of the logits from
L2.  Greedy rows are verified token by token and read nothing more.

Randomness is counter-based, as in ``reference.philox_uniforms``: row b's numbers come from
Philox at counter ``(offset_b << 32) | c``: ``tl.rand`` (24 bits) with c = i + 1 for draft i's
test, and 53 bits of ``tl.randint4x`` at c = 0 for the final draw, whose inverse CDF sums in
float64 (chunk masses, then the chunk's cumulative sum).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import masked_mass as _masked_mass, order_key as _order_key, warp_full as _warp_full
from .draw import (_chunk_weights, _draft_q, _draft_uniforms, _draw, _emit, _final_uniform, _logprob,
                                 _p_masses, _row_offsets, _row_params, _scores, _weight)
from .stats import (_INT32_MAX, _INT32_MIN, _chunk_candidates, _key_value, _warp_from_candidates,
                                  min_p_key as _min_p_key)


@triton.jit
def verify_split_kernel(
    logits_ptr, stride_lb, stride_lk,  # [B, K+1, V] (PACKED: [sum_b (K_b + 1), V]) fp32/bf16/fp16, last dim contiguous
    draft_tokens_ptr, stride_tb, stride_tk,  # [B, K] (PACKED: [sum_b K_b]) int32/int64
    draft_probs_ptr, stride_qb, stride_qk,  # [B, K, Vd] (PACKED: [sum_b K_b, Vd]) fp32/bf16/fp16, last dim contiguous
    #                                        (DRAFT_LOGITS: the draft's logits, same layout and dtypes)
    cu_ptr, cu_stride,  # PACKED: [B + 1] int32/int64, cu[b] = K_0 + ... + K_{b-1}
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
    counters_ptr,  # int32 [2 + B * (K+1) + 3 * B], zero between launches
    part_f_ptr,  # fp32 [2 * B * (K+1) * NC + 2 * B * (K+1)] (DRAFT_LOGITS: twice that)
    part_i_ptr,  # int32 [4 * B * (K+1) * NC + 4 * B * (K+1) + 4 * B + B * NC] (DRAFT_LOGITS: + B * (K+1) * (NC + 1))
    cand_ptr,  # int32 [B * (K+1) * NC * CAP] (with a warp)
    mass_ptr,  # float64 [B * NC] (BLOCK: [2 * B * (K+1) * NC + B * (K+1)])
    order_ptr,  # int32 [T1 + T2]: the item each ticket stands for (tests only, HAS_ORDER)
    B, K, V, Vd, NC, G,
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
    CHUNK: tl.constexpr,
    TILES: tl.constexpr,  # chunks per work item
    STAGES: tl.constexpr,  # software-pipelining depth over an item's chunks
    NCB: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    K1 = K + 1
    N1 = B * K1 * NC  # per-chunk records
    NI = (NC + TILES - 1) // TILES  # work items per position (TILES chunks each)
    T1 = B * K1 * NI  # stage-1 tickets
    T2 = B * NI  # stage-2 tickets
    if BLOCK:
        T2 = B * K1 * NI
    # The workspace's fields (element offsets into its four tensors).
    ticket_ptr = counters_ptr
    exit_ptr = counters_ptr + 1
    pos_cnt_ptr = counters_ptr + 2  # [B * (K+1)]
    row_cnt_ptr = pos_cnt_ptr + B * K1  # [B]
    ready_ptr = row_cnt_ptr + B  # [B]
    s2_cnt_ptr = ready_ptr + B  # [B]
    cm_ptr = part_f_ptr  # [B, K+1, NC] chunk max
    cs_ptr = cm_ptr + N1  # [B, K+1, NC] chunk sum of exp(s - chunk max)
    pm_ptr = cs_ptr + N1  # [B, K+1] position max (0 if unusable)
    pS_ptr = pm_ptr + B * K1  # [B, K+1] position kept mass
    ca_ptr = part_i_ptr  # [B, K+1, NC] chunk first argmax
    cb_ptr = ca_ptr + N1  # [B, K+1, NC] chunk non-finite count
    ct_ptr = cb_ptr + N1  # [B, K+1, NC] chunk t_c (every key above it is in the chunk's list)
    cn_ptr = ct_ptr + N1  # [B, K+1, NC] chunk candidate count
    pa_ptr = cn_ptr + N1  # [B, K+1] position argmax
    pb_ptr = pa_ptr + B * K1  # [B, K+1] position unusable
    pt_ptr = pb_ptr + B * K1  # [B, K+1] position threshold key
    rj_ptr = pt_ptr + B * K1  # [B] stop position j
    rr_ptr = rj_ptr + B  # [B] rejected
    rbad_ptr = rr_ptr + B  # [B] invalid row
    rx_ptr = rbad_ptr + B  # [B] the rejected draft x_j (-1 if none)
    cq_ptr = rx_ptr + B  # [B, NC] chunk count of non-finite/negative q_j entries
    pf_ptr = cq_ptr + B * NC  # [B, K+1] 1 where the warp fell back to scanning the whole position
    # DRAFT_LOGITS only (after the fields above, which keep their offsets):
    dm_ptr = pS_ptr + B * K1  # [B, K+1, NC] chunk max of the draft's scaled logits
    ds_ptr = dm_ptr + N1  # [B, K+1, NC] chunk sum of exp(l / T - chunk max)
    pmd_ptr = ds_ptr + N1  # [B, K+1] position draft max m_d (0 if unusable)
    pSd_ptr = pmd_ptr + B * K1  # [B, K+1] position draft sum S_d
    db_ptr = pf_ptr + B * K1  # [B, K+1, NC] chunk count of NaN/+inf draft logits
    pbd_ptr = db_ptr + N1  # [B, K+1] position draft unusable (q_i not a distribution)
    # BLOCK only, in mass_ptr (float64):
    bm_ptr = mass_ptr  # [B, K+1, NC] chunk mass of max(0, p_i P_i - Q_i) below K_b, of P at K_b
    bq_ptr = bm_ptr + N1  # [B, K+1, NC] chunk count of non-finite/negative q_i entries
    pp_ptr = bq_ptr + N1  # [B, K+1] p_0..p_K of the block rule

    offs0 = tl.arange(0, CHUNK)
    cs_ids = tl.arange(0, NCB)
    ks = tl.arange(0, BLOCK_K)

    t = tl.atomic_add(ticket_ptr, 1)
    while t < T1 + T2:
        item = t
        if HAS_ORDER:
            item = tl.load(order_ptr + t)
        if item < T1:
            # ---------------------------------------------------------- stage 1 (b, i, chunks g)
            b = (item // (K1 * NI)).to(tl.int64)
            i = (item // NI) % K1
            g = item % NI
            kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p = _row_params(
                b, K, V, param_flags, nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PACKED, PROBS)
            l_off, t_off, q_off = _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb, stride_tk,
                                               stride_qb, stride_qk, PACKED)
            warp_on = k_on | p_on | mp_on
            pid_bi = b * K1 + i
            row_on = (i <= kb) & (bad_param == 0)
            pos_ptr = logits_ptr + l_off + i * stride_lk
            # The item's TILES chunks, the next one's loads issued while this one reduces
            # (software pipelining; one chunk per item by default)
            v_read = tl.where(row_on, V, 0)  # a row or position that needs no read reads nothing
            # DRAFT_LOGITS: a sampled row's draft position i < K_b also reduces the draft's logits
            # l_i / T over the chunk (max, sum of exp, NaN/+inf count); chunks past Vd read nothing
            d_on = row_on & (i < kb) & (greedy == 0)
            vd_read = tl.where(d_on, Vd, 0)
            d_pos_ptr = draft_probs_ptr + q_off + i * stride_qk
            for tt in tl.range(0, TILES, num_stages=STAGES):
                c = g * TILES + tt
                rec = pid_bi * NC + c
                offs = c * CHUNK + offs0
                mask = offs < V  # false past the last chunk
                s = _scores(pos_ptr, offs, v_read, inv_t, PROBS)
                if DRAFT_LOGITS:
                    ld = _scores(d_pos_ptr, offs, vd_read, inv_t, False)  # -inf past Vd
                    if d_on & (c < NC):
                        n_bad_d = tl.sum(((ld != ld) | (ld == float("inf"))).to(tl.int32), axis=0)
                        ld = tl.where(ld != ld, float("-inf"), ld)
                        md_c = tl.max(ld, axis=0)
                        md_ref = tl.where(md_c == float("-inf"), 0.0, md_c)
                        tl.store(dm_ptr + rec, md_c)
                        tl.store(ds_ptr + rec, tl.sum(tl.exp(ld - md_ref), axis=0))
                        tl.store(db_ptr + rec, n_bad_d)
                if row_on & (c < NC):
                    if PROBS:  # a probability must be a finite number >= 0
                        n_bad = tl.sum(((s != s) | (s == float("inf")) | (s < 0.0)).to(tl.int32), axis=0)
                        s = tl.where((s != s) | (s < 0.0), 0.0, s)
                    else:
                        n_bad = tl.sum(((s != s) | (s == float("inf"))).to(tl.int32), axis=0)
                        s = tl.where(s != s, float("-inf"), s)
                    m_c = tl.max(s, axis=0)
                    a_c = tl.min(tl.where(s == m_c, offs, _INT32_MAX), axis=0)
                    sum_c = tl.full([], 0.0, tl.float32)
                    if (greedy == 0) | LOGPROBS:  # greedy rows need no exponential (but for log-probabilities)
                        m_ref = tl.where(m_c == float("-inf"), 0.0, m_c)
                        sum_c = tl.sum(_weight(s, m_ref, PROBS), axis=0)
                    tl.store(cm_ptr + rec, m_c)
                    tl.store(cs_ptr + rec, sum_c)
                    tl.store(ca_ptr + rec, a_c)
                    tl.store(cb_ptr + rec, n_bad)
                    if HAS_TOP_K | HAS_TOP_P | HAS_MIN_P:
                        if warp_on:
                            keys = tl.where(mask, _order_key(s), _INT32_MIN)
                            t_c, n_c = _chunk_candidates(keys, offs0, tl.minimum(V - c * CHUNK, CHUNK),
                                                         cand_ptr + rec * CAP, CAP)
                            tl.store(ct_ptr + rec, t_c.to(tl.int32))
                            tl.store(cn_ptr + rec, n_c)
            # Arrive at the position: the last of its NI items combines its NC chunks.
            tl.debug_barrier()
            arrived = tl.atomic_add(pos_cnt_ptr + pid_bi, 1, sem="acq_rel")
            if arrived == NI - 1:
                tl.atomic_xchg(pos_cnt_ptr + pid_bi, 0)
                if (i <= kb) & (bad_param == 0):
                    cmask = cs_ids < NC
                    base = pid_bi * NC
                    m_cs = tl.load(cm_ptr + base + cs_ids, mask=cmask, other=float("-inf"), cache_modifier=".cg")
                    a_cs = tl.load(ca_ptr + base + cs_ids, mask=cmask, other=_INT32_MAX, cache_modifier=".cg")
                    b_cs = tl.load(cb_ptr + base + cs_ids, mask=cmask, other=0, cache_modifier=".cg")
                    m = tl.max(m_cs, axis=0)
                    amax = tl.min(tl.where(m_cs == m, a_cs, _INT32_MAX), axis=0)
                    bad = (tl.sum(b_cs, axis=0) > 0) | (m == float("-inf")) | (m == float("inf"))
                    if PROBS:
                        bad = bad | (m <= 0.0)  # no mass at all
                    m_safe = tl.where(bad, 0.0, m)
                    S = tl.full([], 1.0, tl.float32)
                    thr = tl.full([], _INT32_MIN, tl.int64)
                    scanned = tl.full([], 0, tl.int32)
                    if ((greedy == 0) | LOGPROBS) & (bad == 0):
                        s_cs = tl.load(cs_ptr + base + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                        if PROBS:
                            S = tl.sum(tl.where(cmask, s_cs, 0.0), axis=0)
                        else:
                            S = tl.sum(tl.where(cmask, s_cs * tl.exp(m_cs - m_safe), 0.0), axis=0)
                        if HAS_TOP_K | HAS_TOP_P | HAS_MIN_P:
                            if warp_on:
                                # slot s of chunk s // CAP holds a key if s % CAP < that chunk's count
                                cids = tl.arange(0, NCB * CAP)
                                c_n = tl.load(cn_ptr + base + cids // CAP, mask=(cids // CAP) < NC, other=0,
                                              cache_modifier=".cg")
                                cand = tl.load(cand_ptr + base * CAP + cids, mask=(cids % CAP) < c_n,
                                               other=_INT32_MIN, cache_modifier=".cg")
                                t_cs = tl.load(ct_ptr + base + cs_ids, mask=cmask, other=_INT32_MIN,
                                               cache_modifier=".cg").to(tl.int64)
                                t_sat = tl.max(t_cs, axis=0)
                                key_max = _order_key(m_safe).to(tl.int64)
                                # room for the top-k set: the position's first chunk list, read above
                                thr, S_w, exact = _warp_from_candidates(cand, t_sat, m_safe, S, key_max,
                                                                        top_k, top_p, k_on, p_on,
                                                                        cand_ptr + base * CAP, CAP)
                                if exact:
                                    S = S_w
                                else:  # the lists cannot decide: bisect over the whole position
                                    scanned = tl.full([], 1, tl.int32)
                                    S, thr = _warp_full(logits_ptr + l_off + i * stride_lk, V, inv_t,
                                                        m_safe, S, key_max, top_k, top_p, k_on, p_on,
                                                        HAS_TOP_K, HAS_TOP_P, CHUNK)
                                if HAS_MIN_P:
                                    # min-p after top-k/top-p: a threshold key from m alone, the
                                    # higher of the two kept (an intersection of upper sets)
                                    thr_mp = _min_p_key(m_safe, min_p)
                                    if mp_on & (thr_mp > thr):
                                        thr = thr_mp
                                        if thr > t_sat:  # every kept token is a candidate: no read
                                            e_c = tl.exp(_key_value(cand) - m_safe)
                                            S = tl.sum(tl.where(cand.to(tl.int64) >= thr, e_c, 0.0), axis=0)
                                        else:  # kept tokens below the lists: one pass for the mass
                                            scanned = tl.full([], 1, tl.int32)
                                            S = _masked_mass(logits_ptr + l_off + i * stride_lk, V, inv_t,
                                                             m_safe, thr, CHUNK)
                    if DRAFT_LOGITS:
                        # the draft's (m_d, S_d) of position i, its chunks in chunk order; defaults
                        # where q_i is not read (greedy rows, the bonus position)
                        m_d = tl.full([], 0.0, tl.float32)
                        S_d = tl.full([], 1.0, tl.float32)
                        bad_d = tl.full([], 0, tl.int1)
                        if (i < kb) & (greedy == 0):
                            md_cs = tl.load(dm_ptr + base + cs_ids, mask=cmask, other=float("-inf"),
                                            cache_modifier=".cg")
                            db_cs = tl.load(db_ptr + base + cs_ids, mask=cmask, other=0, cache_modifier=".cg")
                            sd_cs = tl.load(ds_ptr + base + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                            md = tl.max(md_cs, axis=0)
                            # a NaN or +inf logit, or none finite: q_i is no distribution
                            bad_d = (tl.sum(db_cs, axis=0) > 0) | (md == float("-inf")) | (md == float("inf"))
                            m_d = tl.where(bad_d, 0.0, md)
                            S_d = tl.sum(tl.where(cmask, sd_cs * tl.exp(md_cs - m_d), 0.0), axis=0)
                            S_d = tl.where(bad_d, 1.0, S_d)
                        tl.store(pmd_ptr + pid_bi, m_d)
                        tl.store(pSd_ptr + pid_bi, S_d)
                        tl.store(pbd_ptr + pid_bi, bad_d.to(tl.int32))
                    tl.store(pm_ptr + pid_bi, m_safe)
                    tl.store(pS_ptr + pid_bi, S)
                    tl.store(pa_ptr + pid_bi, amax)
                    tl.store(pb_ptr + pid_bi, bad.to(tl.int32))
                    tl.store(pt_ptr + pid_bi, thr.to(tl.int32))
                    tl.store(pf_ptr + pid_bi, scanned)
                # Arrive at the row: the last of its K + 1 positions runs the acceptance chain.
                tl.debug_barrier()
                rows_done = tl.atomic_add(row_cnt_ptr + b, 1, sem="acq_rel")
                if rows_done == K1 - 1:
                    tl.atomic_xchg(row_cnt_ptr + b, 0)
                    j = kb * 0
                    rejected = tl.full([], 0, tl.int1)
                    bad_row = bad_param
                    x_j = tl.full([], -1, tl.int64)
                    final = tl.full([], 0, tl.int64)
                    if bad_param == 0:
                        pmask = ks <= kb
                        dmask = ks < kb
                        m_i = tl.load(pm_ptr + b * K1 + ks, mask=pmask, other=0.0, cache_modifier=".cg")
                        S_i = tl.load(pS_ptr + b * K1 + ks, mask=pmask, other=1.0, cache_modifier=".cg")
                        a_i = tl.load(pa_ptr + b * K1 + ks, mask=pmask, other=0, cache_modifier=".cg").to(tl.int64)
                        bad_i = tl.load(pb_ptr + b * K1 + ks, mask=pmask, other=0, cache_modifier=".cg") != 0
                        thr_i = tl.load(pt_ptr + b * K1 + ks, mask=pmask, other=_INT32_MIN,
                                        cache_modifier=".cg").to(tl.int64)
                        x = tl.load(draft_tokens_ptr + t_off + ks * stride_tk, mask=dmask, other=0).to(tl.int64)
                        x_ok = (x >= 0) & (x < V)
                        x_safe = tl.where(x_ok, x, 0)
                        s_x = tl.load(logits_ptr + l_off + ks * stride_lk + x_safe, mask=dmask,
                                      other=0.0).to(tl.float32) * inv_t
                        kept_x = _order_key(s_x).to(tl.int64) >= thr_i
                        p_x = tl.where(kept_x, _weight(s_x, m_i, PROBS) / S_i, 0.0)
                        q_x = tl.full([BLOCK_K], 1.0, tl.float32)
                        if HAS_DRAFT_PROBS:
                            q_x = tl.load(draft_probs_ptr + q_off + ks * stride_qk + x_safe,
                                          mask=dmask & (x_safe < Vd), other=0.0).to(tl.float32)
                            if DRAFT_LOGITS:
                                # q_i(x_i) from the draft's logit at x_i; an unusable q_i is NaN (as
                                # the reference's softmax of such a row), 0 past Vd all the same
                                md_i = tl.load(pmd_ptr + b * K1 + ks, mask=dmask, other=0.0, cache_modifier=".cg")
                                Sd_i = tl.load(pSd_ptr + b * K1 + ks, mask=dmask, other=1.0, cache_modifier=".cg")
                                bd_i = tl.load(pbd_ptr + b * K1 + ks, mask=dmask, other=0, cache_modifier=".cg") != 0
                                q_x = tl.where(bd_i, float("nan"), _draft_q(q_x * inv_t, md_i, Sd_i))
                                q_x = tl.where(dmask & (x_safe < Vd), q_x, 0.0)
                        u = _draft_uniforms(b, ks, dmask, uniforms_ptr, stride_ub, stride_uk, param_flags, seed_ptr,
                                            seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                                            HAS_UNIFORMS)
                        bad_q = ((q_x != q_x) | (q_x < 0.0) | (q_x == float("inf"))) & (greedy == 0)
                        bad_x = ~x_ok | bad_q
                        # in float64: u * q(x) of a 24-bit u and an fp32 q is exact
                        accept = tl.where(greedy, x == a_i, u * q_x.to(tl.float64) < p_x.to(tl.float64))
                        stop = (~accept | bad_i | bad_x) & dmask
                        j = tl.min(tl.where(stop, ks, kb), axis=0).to(tl.int64)
                        rejected = j < kb
                        at_j = ks == j
                        bad_row = (tl.sum((at_j & bad_i).to(tl.int32), axis=0) > 0) | (
                            rejected & (tl.sum((at_j & bad_x).to(tl.int32), axis=0) > 0))
                        final = tl.sum(tl.where(at_j, a_i, 0), axis=0)
                        x_j = tl.where(rejected, tl.sum(tl.where(at_j, x, 0), axis=0), -1)
                        block_row = tl.full([], 0, tl.int1)
                        if BLOCK:
                            if greedy == 0:
                                # block verification reads every position 0..K_b and every draft
                                block_row = tl.full([], 1, tl.int1)
                                bad_row = (tl.sum((pmask & bad_i).to(tl.int32), axis=0) > 0) | (
                                    tl.sum((dmask & bad_x).to(tl.int32), axis=0) > 0)
                                # p_0 = 1, p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i)) in float64 (p_i = 1
                                # with no division when p_{i-1} P_i(x_i) >= Q_i(x_i) and is > 0)
                                px64 = tl.where(dmask & (p_x == p_x), p_x.to(tl.float64), 0.0)
                                qx64 = tl.where(dmask & (q_x == q_x) & (q_x > 0.0) & (q_x < float("inf")),
                                                q_x.to(tl.float64), 0.0)
                                pp = tl.where(ks == 0, 1.0, 0.0).to(tl.float64)
                                prev = tl.full([], 1.0, tl.float64)
                                for ii in tl.static_range(BLOCK_K - 1):
                                    num = prev * tl.sum(tl.where(ks == ii, px64, 0.0), axis=0)
                                    qi = tl.sum(tl.where(ks == ii, qx64, 0.0), axis=0)
                                    prev = tl.where((num >= qi) & (num > 0.0), 1.0, num / tl.where(qi > 0.0, qi, 1.0))
                                    pp = tl.where(ks == ii + 1, prev, pp)
                                tl.store(pp_ptr + b * K1 + ks, pp, mask=ks < K1)
                        if LOGPROBS:
                            # the accepted drafts' log p_i(x_i); a greedy row's argmax at j: s = m_j
                            lp = tl.where(ks < j, _logprob(s_x, m_i, S_i, kept_x, PROBS), float("-inf"))
                            lp = tl.where(at_j & (greedy != 0), _logprob(m_i, m_i, S_i, at_j, PROBS), lp)
                            lp = tl.where(bad_row != 0, float("-inf"), lp)
                            # a sampled row's position j is written with its final token (stage 2)
                            later = (at_j | block_row) & (greedy == 0) & (bad_row == 0)
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc, lp, mask=(ks < K1) & (later == 0))
                    if LOGPROBS:
                        if bad_param != 0:
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc,
                                     tl.full([BLOCK_K], float("-inf"), tl.float32), mask=ks < K1)
                    if greedy | bad_row:
                        _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, draft_tokens_ptr + t_off,
                              stride_tk, b, K, j, final, bad_row, BLOCK_K)
                    tl.store(rj_ptr + b, j.to(tl.int32))
                    tl.store(rr_ptr + b, rejected.to(tl.int32))
                    tl.store(rbad_ptr + b, bad_row.to(tl.int32))
                    tl.store(rx_ptr + b, x_j.to(tl.int32))
                    tl.debug_barrier()
                    tl.atomic_xchg(ready_ptr + b, 1, sem="release")
        else:
            # ------------------------------------------- stage 2 (b, chunks g; BLOCK: b, position, chunks g)
            if BLOCK:
                b = ((item - T1) // (K1 * NI)).to(tl.int64)
                pos = ((item - T1) // NI) % K1
            else:
                b = ((item - T1) // NI).to(tl.int64)
            g = (item - T1) % NI
            # Wait for the row's acceptance chain (stage-1 items only: all numbered before this one).
            ready = tl.atomic_add(ready_ptr + b, 0, sem="acquire")
            while ready == 0:
                ready = tl.atomic_add(ready_ptr + b, 0, sem="acquire")
            kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p = _row_params(
                b, K, V, param_flags, nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PACKED, PROBS)
            l_off, t_off, q_off = _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb, stride_tk,
                                               stride_qb, stride_qk, PACKED)
            bad_row = tl.load(rbad_ptr + b, cache_modifier=".cg") != 0
            sampled = (greedy == 0) & (bad_row == 0)
            if BLOCK:
                # position pos's weights: max(0, p_pos * P - Q) (float64) below K_b, P at K_b
                j = pos.to(tl.int64)
                rejected = j < kb
                x_j = tl.load(draft_tokens_ptr + t_off + j * stride_tk, mask=rejected, other=-1).to(tl.int64)
                pp_j = tl.load(pp_ptr + b * K1 + j, cache_modifier=".cg")
                m_rec = bm_ptr + (b * K1 + j) * NC  # this position's chunk masses
                active = sampled & (j <= kb)
            else:
                j = tl.load(rj_ptr + b, cache_modifier=".cg").to(tl.int64)
                rejected = tl.load(rr_ptr + b, cache_modifier=".cg") != 0
                x_j = tl.load(rx_ptr + b, cache_modifier=".cg").to(tl.int64)
                pp_j = tl.full([], 1.0, tl.float64)
                m_rec = mass_ptr + b * NC
                active = sampled
            pos_ptr = logits_ptr + l_off + j * stride_lk
            q_ptr = draft_probs_ptr + q_off + j * stride_qk
            q_len = tl.where(rejected, Vd, 0)  # q_j is read only after a rejection (BLOCK: below K_b)
            m_j = tl.load(pm_ptr + b * K1 + j, cache_modifier=".cg")
            S_j = tl.load(pS_ptr + b * K1 + j, cache_modifier=".cg")
            thr_j = tl.load(pt_ptr + b * K1 + j, cache_modifier=".cg").to(tl.int64)
            m_dj = tl.full([], 0.0, tl.float32)
            S_dj = tl.full([], 1.0, tl.float32)
            if DRAFT_LOGITS:
                m_dj = tl.load(pmd_ptr + b * K1 + j, cache_modifier=".cg")
                S_dj = tl.load(pSd_ptr + b * K1 + j, cache_modifier=".cg")
            if active:
                # no `if` around the loads (the pipeliner leaves loads under one alone): a chunk
                # past the last (c >= NC) is masked off by offs >= V and q_len <= Vd <= V
                for tt in tl.range(0, TILES, num_stages=STAGES):
                    c = g * TILES + tt
                    r, _, n_bad_q = _chunk_weights(pos_ptr, q_ptr, c * CHUNK + offs0, V, q_len, x_j, inv_t, m_j,
                                                   S_j, thr_j, rejected, m_dj, S_dj, pp_j, HAS_DRAFT_PROBS, PROBS,
                                                   DRAFT_LOGITS, BLOCK)
                    tl.store(m_rec + c, tl.sum(r.to(tl.float64), axis=0), mask=c < NC)
                    if BLOCK:
                        tl.store(bq_ptr + (b * K1 + j) * NC + c, n_bad_q.to(tl.float64), mask=c < NC)
                    else:
                        tl.store(cq_ptr + b * NC + c, n_bad_q, mask=c < NC)
            tl.debug_barrier()
            arrived = tl.atomic_add(s2_cnt_ptr + b, 1, sem="acq_rel")
            if arrived == NI * (K1 if BLOCK else 1) - 1:
                tl.atomic_xchg(s2_cnt_ptr + b, 0)
                tl.atomic_xchg(ready_ptr + b, 0)
                if sampled:
                    cmask = cs_ids < NC
                    if BLOCK:
                        # h_i = r_i / (r_i + 1 - p_i) below K_b, h_{K_b} = p_{K_b} (Sun et al.,
                        # Algorithm 2), as a vector over the draft index ks = i - 1, tested with
                        # draft ks's uniform; tau = the largest i whose test passes, 0 if none
                        dmask = ks < kb
                        i1 = ks + 1
                        rm = (i1[:, None] < kb) & (cs_ids[None, :] < NC)
                        rec2 = (b * K1 + i1[:, None]) * NC + cs_ids[None, :]
                        r_i = tl.sum(tl.load(bm_ptr + rec2, mask=rm, other=0.0, cache_modifier=".cg"), axis=1)
                        qm = (ks[:, None] < kb) & (cs_ids[None, :] < NC)
                        qrec = (b * K1 + ks[:, None]) * NC + cs_ids[None, :]
                        n_bad = tl.sum(tl.sum(tl.load(bq_ptr + qrec, mask=qm, other=0.0, cache_modifier=".cg"),
                                              axis=1), axis=0)
                        bad_row = n_bad > 0.0
                        pp_i = tl.load(pp_ptr + b * K1 + i1, mask=i1 <= kb, other=0.0, cache_modifier=".cg")
                        den = r_i + (1.0 - pp_i)
                        h = tl.where(den > 0.0, r_i / tl.where(den > 0.0, den, 1.0), 0.0)
                        h = tl.where(i1 == kb, pp_i, h)
                        u = _draft_uniforms(b, ks, dmask, uniforms_ptr, stride_ub, stride_uk, param_flags, seed_ptr,
                                            seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                                            HAS_UNIFORMS)
                        j = tl.max(tl.where(dmask & (u < h), i1, 0), axis=0).to(tl.int64)
                        rejected = j < kb
                        x_j = tl.load(draft_tokens_ptr + t_off + j * stride_tk, mask=rejected, other=-1).to(tl.int64)
                        pp_j = tl.load(pp_ptr + b * K1 + j, cache_modifier=".cg")
                        W = tl.load(bm_ptr + (b * K1 + j) * NC + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                        pos_ptr = logits_ptr + l_off + j * stride_lk
                        q_ptr = draft_probs_ptr + q_off + j * stride_qk
                        q_len = tl.where(rejected, Vd, 0)
                        m_j = tl.load(pm_ptr + b * K1 + j, cache_modifier=".cg")
                        S_j = tl.load(pS_ptr + b * K1 + j, cache_modifier=".cg")
                        thr_j = tl.load(pt_ptr + b * K1 + j, cache_modifier=".cg").to(tl.int64)
                        if DRAFT_LOGITS:
                            m_dj = tl.load(pmd_ptr + b * K1 + j, cache_modifier=".cg")
                            S_dj = tl.load(pSd_ptr + b * K1 + j, cache_modifier=".cg")
                    else:
                        W = tl.load(mass_ptr + b * NC + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                        n_bad_q = tl.sum(tl.load(cq_ptr + b * NC + cs_ids, mask=cmask, other=0,
                                                 cache_modifier=".cg"), axis=0)
                        bad_row = n_bad_q > 0
                        if DRAFT_LOGITS:  # an unusable q_j after a rejection (its m_d, S_d are placeholders)
                            bad_row = bad_row | (rejected & (tl.load(pbd_ptr + b * K1 + j, cache_modifier=".cg") != 0))
                    use_p = tl.sum(W, axis=0) <= 0.0
                    if use_p:
                        W = _p_masses(pos_ptr, q_ptr, V, NC, inv_t, m_j, S_j, thr_j, m_dj, S_dj, cs_ids, offs0, NCB,
                                      HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK, CHUNK)
                    u_final = _final_uniform(b, uniforms_ptr, stride_ub, stride_uk, K, param_flags, seed_ptr,
                                             seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                                             HAS_UNIFORMS)
                    final = _draw(W, u_final, cmask, cs_ids, offs0, pos_ptr, q_ptr, V, q_len, x_j, inv_t, m_j, S_j,
                                  thr_j, rejected & ~use_p, m_dj, S_dj, pp_j, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS,
                                  BLOCK, CHUNK)
                    bad_row = bad_row | (final < 0)
                    if LOGPROBS:
                        s_f = tl.load(pos_ptr + tl.maximum(final, 0)).to(tl.float32) * inv_t
                        lp_f = _logprob(s_f, m_j, S_j, _order_key(s_f).to(tl.int64) >= thr_j, PROBS)
                        lp = tl.where(ks == j, lp_f, float("-inf"))
                        if BLOCK:  # the accepted drafts' log p_i(x_i), known only now
                            am = ks < j
                            x_a = tl.load(draft_tokens_ptr + t_off + ks * stride_tk, mask=am, other=0).to(tl.int64)
                            s_a = tl.load(logits_ptr + l_off + ks * stride_lk + x_a, mask=am,
                                          other=0.0).to(tl.float32) * inv_t
                            m_a = tl.load(pm_ptr + b * K1 + ks, mask=am, other=0.0, cache_modifier=".cg")
                            S_a = tl.load(pS_ptr + b * K1 + ks, mask=am, other=1.0, cache_modifier=".cg")
                            thr_a = tl.load(pt_ptr + b * K1 + ks, mask=am, other=_INT32_MIN,
                                            cache_modifier=".cg").to(tl.int64)
                            lp = tl.where(am, _logprob(s_a, m_a, S_a, _order_key(s_a).to(tl.int64) >= thr_a, PROBS),
                                          lp)
                            lp = tl.where(bad_row, float("-inf"), lp)
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc, lp, mask=ks < K1)
                        else:
                            # a row found bad here (its q_j) emits nothing: every slot -inf
                            lp = tl.where(bad_row, float("-inf"), lp)
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc, lp,
                                     mask=(ks < K1) & ((ks == j) | ((ks * 0 + bad_row.to(tl.int32)) != 0)))
                    _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, draft_tokens_ptr + t_off,
                          stride_tk, b, K, j, final, bad_row, BLOCK_K)
        t = tl.atomic_add(ticket_ptr, 1)
    # Leave: the last program to leave resets the ticket for the next launch on this stream.
    left = tl.atomic_add(exit_ptr, 1)
    if left == G - 1:
        tl.atomic_xchg(ticket_ptr, 0)
        tl.atomic_xchg(exit_ptr, 0)
