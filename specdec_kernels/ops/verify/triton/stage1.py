"""The split verify kernel's stage 1 as device functions (``split_kernel`` claims the work items
and calls them), and the workspace's record fields every stage addresses (``_f_fields``,
``_i_fields``, ``_m_fields``: pointers from ``ops/verify/records.py``'s table).

- ``stage1_item``: item (b, i, g) reduces its chunks of position i to per-chunk records (max,
  first argmax, sum of exponentials, non-finite count, candidate keys; the draft's logits too).
- ``combine_position``: the last item of a position folds its chunks, in chunk order, into the
  position's (m, S, thr, argmax, bad).
- ``acceptance_chain``: the last position of a row runs its K_b tests (and block verification's
  p_i); greedy and invalid rows are written out here.

Memory traffic: ``stage1_item`` reads its chunks of position i (TILES * CHUNK * E bytes; with
DRAFT_LOGITS as many of the draft's logits) and writes 16 bytes a chunk (+ 4 * CAP with a warp);
``combine_position`` reads the position's records (L2) and, only when the candidate lists cannot
decide top-k/top-p/min-p, the position again; ``acceptance_chain`` reads K_b logits, draft ids
and q entries and writes the row's records.  MASKED (a grammar's mask): every read of the
target's logits also reads the mask's words that cover them, one int32 per 32 tokens (1/32 of
fp32 logits' bytes, 1/16 of bf16's).  The whole launch: ``split_kernel``'s header.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..records import field_offset
from .common import masked_mass as _masked_mass, order_key as _order_key, warp_full as _warp_full
from .draw import _draft_q, _draft_uniforms, _emit, _logprob, _masked_score, _scores, _weight
from .candidates import _INT32_MAX, _INT32_MIN, _chunk_candidates, _key_value, _warp_from_candidates
from .candidates import min_p_key as _min_p_key


# Where each record field starts (``records.RECORDS``, the table the launcher's sizes come from too),
# as counts of the launch's units (chunks, positions, rows, row chunks, elements): ``_at``.
_F_CHUNK_MAX = tl.constexpr(field_offset("part_f", "chunk_max"))
_F_CHUNK_SUM = tl.constexpr(field_offset("part_f", "chunk_sum"))
_F_M = tl.constexpr(field_offset("part_f", "m"))
_F_S = tl.constexpr(field_offset("part_f", "S"))
_F_DRAFT_CHUNK_MAX = tl.constexpr(field_offset("part_f", "draft_chunk_max"))
_F_DRAFT_CHUNK_SUM = tl.constexpr(field_offset("part_f", "draft_chunk_sum"))
_F_M_D = tl.constexpr(field_offset("part_f", "m_d"))
_F_S_D = tl.constexpr(field_offset("part_f", "S_d"))
_I_CHUNK_ARGMAX = tl.constexpr(field_offset("part_i", "chunk_argmax"))
_I_CHUNK_BAD = tl.constexpr(field_offset("part_i", "chunk_bad"))
_I_CHUNK_THR = tl.constexpr(field_offset("part_i", "chunk_thr"))
_I_CHUNK_COUNT = tl.constexpr(field_offset("part_i", "chunk_count"))
_I_ARGMAX = tl.constexpr(field_offset("part_i", "argmax"))
_I_BAD = tl.constexpr(field_offset("part_i", "bad"))
_I_THR = tl.constexpr(field_offset("part_i", "thr"))
_I_J = tl.constexpr(field_offset("part_i", "j"))
_I_REJECTED = tl.constexpr(field_offset("part_i", "rejected"))
_I_ROW_BAD = tl.constexpr(field_offset("part_i", "row_bad"))
_I_X_J = tl.constexpr(field_offset("part_i", "x_j"))
_I_Q_BAD = tl.constexpr(field_offset("part_i", "q_bad"))
_I_SCANNED = tl.constexpr(field_offset("part_i", "scanned"))
_I_DRAFT_CHUNK_BAD = tl.constexpr(field_offset("part_i", "draft_chunk_bad"))
_I_BAD_D = tl.constexpr(field_offset("part_i", "bad_d"))
_M_MASSES = tl.constexpr(field_offset("mass", "masses"))
_M_CHUNK_MASS = tl.constexpr(field_offset("mass", "chunk_mass"))
_M_CHUNK_Q_BAD = tl.constexpr(field_offset("mass", "chunk_q_bad"))
_M_P = tl.constexpr(field_offset("mass", "p"))


@triton.jit
def _elements(length: tl.constexpr, B, K1, NC):
    """A length or offset of ``records`` in elements (``records.elements``): its counts of
    chunks [B, K+1, NC], positions [B, K+1], rows [B], row chunks [B, NC] and single elements."""
    return length[0] * (B * K1 * NC) + length[1] * (B * K1) + length[2] * B + length[3] * (B * NC) + length[4]


@triton.jit
def _units(B, K1, NC):
    """The lengths of one unit of ``records``, once: chunks [B, K+1, NC], positions [B, K+1],
    rows [B], row chunks [B, NC] (int32, as the fields' own indices are)."""
    return B * K1 * NC, B * K1, B, B * NC


@triton.jit
def _at(base, offset: tl.constexpr, N1, N2, N3, N4):
    """base + a field's offset of ``records``, one unit's length at a time (the pointer moved as a
    chain of fields would move it; a count of zero adds nothing)."""
    ptr = base
    for _ in tl.static_range(tl.constexpr(offset[0])):
        ptr += N1
    for _ in tl.static_range(tl.constexpr(offset[1])):
        ptr += N2
    for _ in tl.static_range(tl.constexpr(offset[2])):
        ptr += N3
    for _ in tl.static_range(tl.constexpr(offset[3])):
        ptr += N4
    if offset[4] != 0:
        ptr += offset[4]
    return ptr


@triton.jit
def _f_fields(part_f_ptr, B, K1, NC):
    """The fp32 records: per chunk [B, K+1, NC], per position [B, K+1] (DRAFT_LOGITS: the draft's
    four fields after the others, which keep their offsets)."""
    N1, N2, N3, N4 = _units(B, K1, NC)
    return (_at(part_f_ptr, _F_CHUNK_MAX, N1, N2, N3, N4), _at(part_f_ptr, _F_CHUNK_SUM, N1, N2, N3, N4),
            _at(part_f_ptr, _F_M, N1, N2, N3, N4), _at(part_f_ptr, _F_S, N1, N2, N3, N4),
            _at(part_f_ptr, _F_DRAFT_CHUNK_MAX, N1, N2, N3, N4),
            _at(part_f_ptr, _F_DRAFT_CHUNK_SUM, N1, N2, N3, N4),
            _at(part_f_ptr, _F_M_D, N1, N2, N3, N4), _at(part_f_ptr, _F_S_D, N1, N2, N3, N4))


@triton.jit
def _i_fields(part_i_ptr, B, K1, NC):
    """The int32 records: per chunk [B, K+1, NC], per position [B, K+1], per row [B], per row
    chunk [B, NC] (DRAFT_LOGITS: the draft's two fields after the others)."""
    N1, N2, N3, N4 = _units(B, K1, NC)
    return (_at(part_i_ptr, _I_CHUNK_ARGMAX, N1, N2, N3, N4), _at(part_i_ptr, _I_CHUNK_BAD, N1, N2, N3, N4),
            _at(part_i_ptr, _I_CHUNK_THR, N1, N2, N3, N4), _at(part_i_ptr, _I_CHUNK_COUNT, N1, N2, N3, N4),
            _at(part_i_ptr, _I_ARGMAX, N1, N2, N3, N4), _at(part_i_ptr, _I_BAD, N1, N2, N3, N4),
            _at(part_i_ptr, _I_THR, N1, N2, N3, N4), _at(part_i_ptr, _I_J, N1, N2, N3, N4),
            _at(part_i_ptr, _I_REJECTED, N1, N2, N3, N4), _at(part_i_ptr, _I_ROW_BAD, N1, N2, N3, N4),
            _at(part_i_ptr, _I_X_J, N1, N2, N3, N4), _at(part_i_ptr, _I_Q_BAD, N1, N2, N3, N4),
            _at(part_i_ptr, _I_SCANNED, N1, N2, N3, N4), _at(part_i_ptr, _I_DRAFT_CHUNK_BAD, N1, N2, N3, N4),
            _at(part_i_ptr, _I_BAD_D, N1, N2, N3, N4))


@triton.jit
def _m_fields(mass_ptr, B, K1, NC):
    """The float64 masses: token verification's [B, NC] of the stop position; BLOCK's per chunk
    of every position, their unusable-q counts, and p_0..p_K (both forms start at mass_ptr)."""
    N1, N2, N3, N4 = _units(B, K1, NC)
    return (_at(mass_ptr, _M_MASSES, N1, N2, N3, N4), _at(mass_ptr, _M_CHUNK_MASS, N1, N2, N3, N4),
            _at(mass_ptr, _M_CHUNK_Q_BAD, N1, N2, N3, N4), _at(mass_ptr, _M_P, N1, N2, N3, N4))


@triton.jit
def stage1_item(row_logits, row_q, row_mask, stride_lk, stride_qk, stride_mk, cand_ptr, part_f_ptr, part_i_ptr,
                B, K1, NC, V, Vd, pid_bi, i, g, kb, greedy, bad_param, inv_t, warp_on,
                HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, PROBS: tl.constexpr,
                LOGPROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr,
                STAGES: tl.constexpr, CAP: tl.constexpr, MASKED: tl.constexpr):
    """Stage 1, item (b, i, g): its TILES chunks of position i (MASKED: under the position's
    grammar mask), the next chunk's loads issued while this one reduces (software pipelining; one
    chunk per item by default)."""
    cm_ptr, cs_ptr, pm_ptr, pS_ptr, dm_ptr, ds_ptr, pmd_ptr, pSd_ptr = _f_fields(part_f_ptr, B, K1, NC)
    (ca_ptr, cb_ptr, ct_ptr, cn_ptr, pa_ptr, pb_ptr, pt_ptr, rj_ptr, rr_ptr, rbad_ptr, rx_ptr, cq_ptr, pf_ptr, db_ptr,
     pbd_ptr) = _i_fields(part_i_ptr, B, K1, NC)
    offs0 = tl.arange(0, CHUNK)
    row_on = (i <= kb) & (bad_param == 0)
    pos_ptr = row_logits + i * stride_lk
    pos_mask = row_mask + i * stride_mk
    v_read = tl.where(row_on, V, 0)  # a row or position that needs no read reads nothing
    # DRAFT_LOGITS: a sampled row's draft position i < K_b also reduces the draft's logits
    # l_i / T over the chunk (max, sum of exp, NaN/+inf count); chunks past Vd read nothing
    d_on = row_on & (i < kb) & (greedy == 0)
    vd_read = tl.where(d_on, Vd, 0)
    d_pos_ptr = row_q + i * stride_qk
    for tt in tl.range(0, TILES, num_stages=STAGES):
        c = g * TILES + tt
        rec = pid_bi * NC + c
        offs = c * CHUNK + offs0
        mask = offs < V  # false past the last chunk
        s = _scores(pos_ptr, offs, v_read, inv_t, pos_mask, PROBS, MASKED)
        if DRAFT_LOGITS:
            ld = _scores(d_pos_ptr, offs, vd_read, inv_t, pos_mask, False, False)  # -inf past Vd; q unmasked
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


@triton.jit
def combine_position(row_logits, row_mask, stride_lk, stride_mk, cand_ptr, part_f_ptr, part_i_ptr, B, K1, NC, V,
                     pid_bi, i, kb, greedy, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p, warp_on,
                     HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, PROBS: tl.constexpr,
                     LOGPROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr, CHUNK: tl.constexpr, NCB: tl.constexpr,
                     CAP: tl.constexpr, MASKED: tl.constexpr):
    """Position (b, i)'s records from its NC chunks, folded in chunk order (the result does not
    depend on which program arrives last): (m, S, argmax, bad, thr, scanned), with DRAFT_LOGITS
    the draft's (m_d, S_d, bad_d).  Top-k/top-p/min-p from the chunks' candidate keys, or by a
    scan of the whole position when the lists cannot decide."""
    cm_ptr, cs_ptr, pm_ptr, pS_ptr, dm_ptr, ds_ptr, pmd_ptr, pSd_ptr = _f_fields(part_f_ptr, B, K1, NC)
    (ca_ptr, cb_ptr, ct_ptr, cn_ptr, pa_ptr, pb_ptr, pt_ptr, rj_ptr, rr_ptr, rbad_ptr, rx_ptr, cq_ptr, pf_ptr, db_ptr,
     pbd_ptr) = _i_fields(part_i_ptr, B, K1, NC)
    cs_ids = tl.arange(0, NCB)
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
                    S, thr = _warp_full(row_logits + i * stride_lk, V, inv_t,
                                        m_safe, S, key_max, top_k, top_p, k_on, p_on, row_mask + i * stride_mk,
                                        HAS_TOP_K, HAS_TOP_P, CHUNK, MASKED)
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
                            S = _masked_mass(row_logits + i * stride_lk, V, inv_t,
                                             m_safe, thr, row_mask + i * stride_mk, CHUNK, MASKED)
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


@triton.jit
def acceptance_chain(row_logits, row_tokens, row_q, row_mask, stride_lk, stride_tk, stride_qk, stride_mk,
                     uniforms_ptr, stride_ub, stride_uk,
                     param_flags, seed_ptr, seed_stride, seed_scalar,
                     seed_row_step, off_ptr, off_stride, off_scalar,
                     tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, logprobs_ptr, stride_pb, stride_pc,
                     part_f_ptr, part_i_ptr, mass_ptr, b, B, K, V, Vd, NC, kb, greedy, bad_param, inv_t,
                     HAS_DRAFT_PROBS: tl.constexpr, HAS_UNIFORMS: tl.constexpr, PROBS: tl.constexpr,
                     LOGPROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                     MASKED: tl.constexpr):
    """Row b's K_b acceptance tests at once (float64, the Philox counters of
    ``reference.philox_uniforms``), giving the stop position j; block verification's p_0..p_K; a
    greedy or invalid row written out here; the row's records (j, rejected, bad, x_j) for stage 2."""
    K1 = K + 1
    cm_ptr, cs_ptr, pm_ptr, pS_ptr, dm_ptr, ds_ptr, pmd_ptr, pSd_ptr = _f_fields(part_f_ptr, B, K1, NC)
    (ca_ptr, cb_ptr, ct_ptr, cn_ptr, pa_ptr, pb_ptr, pt_ptr, rj_ptr, rr_ptr, rbad_ptr, rx_ptr, cq_ptr, pf_ptr, db_ptr,
     pbd_ptr) = _i_fields(part_i_ptr, B, K1, NC)
    tm_ptr, bm_ptr, bq_ptr, pp_ptr = _m_fields(mass_ptr, B, K1, NC)
    ks = tl.arange(0, BLOCK_K)
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
        x = tl.load(row_tokens + ks * stride_tk, mask=dmask, other=0).to(tl.int64)
        x_ok = (x >= 0) & (x < V)
        x_safe = tl.where(x_ok, x, 0)
        s_x = tl.load(row_logits + ks * stride_lk + x_safe, mask=dmask,
                      other=0.0).to(tl.float32) * inv_t
        s_x = _masked_score(s_x, row_mask + ks * stride_mk, x_safe, dmask, PROBS, MASKED)  # a forbidden x_i: p = 0
        kept_x = _order_key(s_x).to(tl.int64) >= thr_i
        p_x = tl.where(kept_x, _weight(s_x, m_i, PROBS) / S_i, 0.0)
        q_x = tl.full([BLOCK_K], 1.0, tl.float32)
        if HAS_DRAFT_PROBS:
            q_x = tl.load(row_q + ks * stride_qk + x_safe,
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
        _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, row_tokens,
              stride_tk, b, K, j, final, bad_row, BLOCK_K)
    tl.store(rj_ptr + b, j.to(tl.int32))
    tl.store(rr_ptr + b, rejected.to(tl.int32))
    tl.store(rbad_ptr + b, bad_row.to(tl.int32))
    tl.store(rx_ptr + b, x_j.to(tl.int32))
