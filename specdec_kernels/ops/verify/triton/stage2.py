"""The split verify kernel's stage 2 as device functions: ``stage2_item`` (item (b, g); BLOCK:
(b, position, g)) writes the float64 masses of its chunks' final-draw weights at the row's stop
position j, and ``final_draw`` (the row's last stage-2 item) draws the final token by inverse CDF
over the chunk masses, then within one chunk, and writes the row.

Memory traffic: ``stage2_item`` reads its chunks of position j (TILES * CHUNK * E bytes, L2-hot
when its row's stage 1 was claimed just before) and of q_j after a rejection, and writes 12 bytes
a chunk; ``final_draw`` reads the row's NC masses, rescans one chunk (CHUNK * (E + 4) bytes) and
the whole position only when the residual sums to zero, and writes (K + 2) * 8 bytes.  MASKED:
each read of position j's logits reads its grammar mask's words too (CHUNK / 8 bytes a chunk).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import order_key as _order_key
from .draw import _chunk_weights, _draft_uniforms, _draw, _emit, _final_uniform, _logprob, _masked_score, _p_masses
from .stage1 import _f_fields, _i_fields, _m_fields
from .candidates import _INT32_MIN


@triton.jit
def stage2_item(row_logits, row_tokens, row_q, row_mask, stride_lk, stride_tk, stride_qk, stride_mk, part_f_ptr,
                part_i_ptr, mass_ptr, b, B, K1, NC, V, Vd, pos, g, kb, greedy, inv_t,
                HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
                CHUNK: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, MASKED: tl.constexpr):
    """Stage 2, item (b, g) (BLOCK: (b, pos, g)): the float64 masses of its chunks' final-draw
    weights, max(0, p - q) at the stop position j after a rejection, p for the bonus (BLOCK:
    max(0, p_pos P - Q) below K_b, P at K_b).  Returns what the row's final draw needs."""
    cm_ptr, cs_ptr, pm_ptr, pS_ptr, dm_ptr, ds_ptr, pmd_ptr, pSd_ptr = _f_fields(part_f_ptr, B, K1, NC)
    (ca_ptr, cb_ptr, ct_ptr, cn_ptr, pa_ptr, pb_ptr, pt_ptr, rj_ptr, rr_ptr, rbad_ptr, rx_ptr, cq_ptr, pf_ptr, db_ptr,
     pbd_ptr) = _i_fields(part_i_ptr, B, K1, NC)
    tm_ptr, bm_ptr, bq_ptr, pp_ptr = _m_fields(mass_ptr, B, K1, NC)
    offs0 = tl.arange(0, CHUNK)
    bad_row = tl.load(rbad_ptr + b, cache_modifier=".cg") != 0
    sampled = (greedy == 0) & (bad_row == 0)
    if BLOCK:
        # position pos's weights: max(0, p_pos * P - Q) (float64) below K_b, P at K_b
        j = pos.to(tl.int64)
        rejected = j < kb
        x_j = tl.load(row_tokens + j * stride_tk, mask=rejected, other=-1).to(tl.int64)
        pp_j = tl.load(pp_ptr + b * K1 + j, cache_modifier=".cg")
        m_rec = bm_ptr + (b * K1 + j) * NC  # this position's chunk masses
        active = sampled & (j <= kb)
    else:
        j = tl.load(rj_ptr + b, cache_modifier=".cg").to(tl.int64)
        rejected = tl.load(rr_ptr + b, cache_modifier=".cg") != 0
        x_j = tl.load(rx_ptr + b, cache_modifier=".cg").to(tl.int64)
        pp_j = tl.full([], 1.0, tl.float64)
        m_rec = tm_ptr + b * NC
        active = sampled
    pos_ptr = row_logits + j * stride_lk
    pos_mask = row_mask + j * stride_mk
    q_ptr = row_q + j * stride_qk
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
                                           S_j, thr_j, rejected, m_dj, S_dj, pp_j, pos_mask, HAS_DRAFT_PROBS,
                                           PROBS, DRAFT_LOGITS, BLOCK, MASKED)
            tl.store(m_rec + c, tl.sum(r.to(tl.float64), axis=0), mask=c < NC)
            if BLOCK:
                tl.store(bq_ptr + (b * K1 + j) * NC + c, n_bad_q.to(tl.float64), mask=c < NC)
            else:
                tl.store(cq_ptr + b * NC + c, n_bad_q, mask=c < NC)
    return sampled, bad_row, j, rejected, x_j, pp_j, m_j, S_j, thr_j, m_dj, S_dj


@triton.jit
def final_draw(row_logits, row_tokens, row_q, row_mask, stride_lk, stride_tk, stride_qk, stride_mk,
               uniforms_ptr, stride_ub, stride_uk,
               param_flags, seed_ptr, seed_stride, seed_scalar,
               seed_row_step, off_ptr, off_stride, off_scalar,
               tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, logprobs_ptr, stride_pb, stride_pc,
               part_f_ptr, part_i_ptr, mass_ptr, b, B, K, NC, V, Vd, kb, inv_t,
               bad_row, j, rejected, x_j, pp_j, m_j, S_j, thr_j, m_dj, S_dj,
               HAS_DRAFT_PROBS: tl.constexpr, HAS_UNIFORMS: tl.constexpr, PROBS: tl.constexpr, LOGPROBS: tl.constexpr,
               DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, NCB: tl.constexpr,
               BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """Row b's final token (recovered or bonus; BLOCK: tau first, from the positions' masses),
    drawn by inverse CDF over the chunk masses and then within one chunk; the row written out."""
    K1 = K + 1
    cm_ptr, cs_ptr, pm_ptr, pS_ptr, dm_ptr, ds_ptr, pmd_ptr, pSd_ptr = _f_fields(part_f_ptr, B, K1, NC)
    (ca_ptr, cb_ptr, ct_ptr, cn_ptr, pa_ptr, pb_ptr, pt_ptr, rj_ptr, rr_ptr, rbad_ptr, rx_ptr, cq_ptr, pf_ptr, db_ptr,
     pbd_ptr) = _i_fields(part_i_ptr, B, K1, NC)
    tm_ptr, bm_ptr, bq_ptr, pp_ptr = _m_fields(mass_ptr, B, K1, NC)
    offs0 = tl.arange(0, CHUNK)
    cs_ids = tl.arange(0, NCB)
    ks = tl.arange(0, BLOCK_K)
    pos_ptr = row_logits + j * stride_lk
    pos_mask = row_mask + j * stride_mk
    q_ptr = row_q + j * stride_qk
    q_len = tl.where(rejected, Vd, 0)
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
        x_j = tl.load(row_tokens + j * stride_tk, mask=rejected, other=-1).to(tl.int64)
        pp_j = tl.load(pp_ptr + b * K1 + j, cache_modifier=".cg")
        W = tl.load(bm_ptr + (b * K1 + j) * NC + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
        pos_ptr = row_logits + j * stride_lk
        pos_mask = row_mask + j * stride_mk
        q_ptr = row_q + j * stride_qk
        q_len = tl.where(rejected, Vd, 0)
        m_j = tl.load(pm_ptr + b * K1 + j, cache_modifier=".cg")
        S_j = tl.load(pS_ptr + b * K1 + j, cache_modifier=".cg")
        thr_j = tl.load(pt_ptr + b * K1 + j, cache_modifier=".cg").to(tl.int64)
        if DRAFT_LOGITS:
            m_dj = tl.load(pmd_ptr + b * K1 + j, cache_modifier=".cg")
            S_dj = tl.load(pSd_ptr + b * K1 + j, cache_modifier=".cg")
    else:
        W = tl.load(tm_ptr + b * NC + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
        n_bad_q = tl.sum(tl.load(cq_ptr + b * NC + cs_ids, mask=cmask, other=0,
                                 cache_modifier=".cg"), axis=0)
        bad_row = n_bad_q > 0
        if DRAFT_LOGITS:  # an unusable q_j after a rejection (its m_d, S_d are placeholders)
            bad_row = bad_row | (rejected & (tl.load(pbd_ptr + b * K1 + j, cache_modifier=".cg") != 0))
    use_p = tl.sum(W, axis=0) <= 0.0
    if use_p:
        W = _p_masses(pos_ptr, q_ptr, V, NC, inv_t, m_j, S_j, thr_j, m_dj, S_dj, cs_ids, offs0, pos_mask, NCB,
                      HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK, CHUNK, MASKED)
    u_final = _final_uniform(b, uniforms_ptr, stride_ub, stride_uk, K, param_flags, seed_ptr,
                             seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                             HAS_UNIFORMS)
    final = _draw(W, u_final, cmask, cs_ids, offs0, pos_ptr, q_ptr, V, q_len, x_j, inv_t, m_j, S_j,
                  thr_j, rejected & ~use_p, m_dj, S_dj, pp_j, pos_mask, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS,
                  BLOCK, CHUNK, MASKED)
    bad_row = bad_row | (final < 0)
    if LOGPROBS:
        s_f = tl.load(pos_ptr + tl.maximum(final, 0)).to(tl.float32) * inv_t
        s_f = _masked_score(s_f, pos_mask, tl.maximum(final, 0), final >= 0, PROBS, MASKED)
        lp_f = _logprob(s_f, m_j, S_j, _order_key(s_f).to(tl.int64) >= thr_j, PROBS)
        lp = tl.where(ks == j, lp_f, float("-inf"))
        if BLOCK:  # the accepted drafts' log p_i(x_i), known only now
            am = ks < j
            x_a = tl.load(row_tokens + ks * stride_tk, mask=am, other=0).to(tl.int64)
            s_a = tl.load(row_logits + ks * stride_lk + x_a, mask=am,
                          other=0.0).to(tl.float32) * inv_t
            s_a = _masked_score(s_a, row_mask + ks * stride_mk, x_a, am, PROBS, MASKED)
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
    _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, row_tokens,
          stride_tk, b, K, j, final, bad_row, BLOCK_K)
