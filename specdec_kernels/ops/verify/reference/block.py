"""``block_verify_reference``: block verification (Sun et al., "Block Verification Accelerates
Speculative Decoding", ICLR 2025), the ground truth of ``fused_verify(method="block")``.

The drafts are accepted or rejected jointly; the target distributions, the drafts' checks, the
inverse-CDF draw and the outputs are ``verify.reference.chain``'s, and greedy rows are its token
verification.
"""

from __future__ import annotations

import torch

from .chain import (_draft_distributions, drafts, verify_outputs, target_distributions, inverse_cdf,
                              verify_reference)
from .warp import mask_target, torch_sort_descending

__all__ = ["block_verify_reference"]


def _block_stop_weights(pp: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """h_i = r_i / (r_i + 1 - p_i) [B, K] float64 for i = 0..K-1 (Sun et al., Algorithm 2): the
    weight of stopping after i accepted drafts, given the stop comes at i or earlier; 0 where
    r_i + 1 - p_i is 0 (p_i = 1 and an empty residual: the row never stops there)."""
    den = r + (1.0 - pp)
    return torch.where(den > 0, r / den.masked_fill(den <= 0, 1.0), 0.0)


def _block_residual(p_tau: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """The unnormalised residual max(0, p_tau * P - Q) [B, V] float64 of the extra token after a
    stop before K_b (p_tau [B], P and Q [B, V])."""
    return (p_tau[:, None] * P - Q).clamp(min=0.0)


def block_verify_reference(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16
    draft_tokens: torch.Tensor,  # [B, K] int
    draft_probs: torch.Tensor | None,  # [B, K, Vd] fp32, Vd <= V; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64 in [0, K]
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] fp32, 1 = off
    uniforms: torch.Tensor,  # [B, K+1] float64 (or fp32) in [0, 1)
    *,
    sort_descending=torch_sort_descending,  # the warp's sort (see warp_logits)
    target_is_probs: bool = False,  # target_logits holds the target's probabilities, used as given
    draft_logits: torch.Tensor | None = None,  # [B, K, Vd], Vd <= V: the draft's logits instead of draft_probs
    min_p: torch.Tensor | None = None,  # [B] fp32 in [0, 1], 0 = off
    token_bitmask: torch.Tensor | None = None,  # [B, K+1, ceil(V/32)] int32: a grammar's allowed tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding",
    ICLR 2025, arXiv 2403.10444, Algorithm 2): the drafts are accepted or rejected jointly, with
    the target's law kept and at least as many drafts accepted on average as ``verify_reference``.
    Same inputs, warps (temperature, top-k, top-p, min-p), ``target_is_probs`` and
    ``draft_logits`` as ``verify_reference``, and the same outputs: tokens [B, K+1] int64 (the
    accepted drafts, the extra token, then -1), num_accepted [B] int64.

    Indices (1-based as in the paper; position i of the tensors is the paper's i + 1): x_i =
    draft_tokens[b, i-1], P_i = the warped target distribution at position i-1, Q_i =
    draft_probs[b, i-1] (one-hot at x_i when None), K = K_b.  With p_0 = 1,

        p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i))                       i = 1..K
        r_i = sum_v max(0, p_i P_{i+1}(v) - Q_{i+1}(v))                  i = 0..K-1
        h_i = r_i / (r_i + 1 - p_i)   (0 if the denominator is 0),  h_K = p_K

    (p_i is computed as 1 if p_{i-1} P_i(x_i) >= Q_i(x_i) > 0 or >= Q_i(x_i) = 0 with P_i(x_i) > 0,
    with no division there; a draft the target gives probability 0 has p_i = 0 even where
    Q_i(x_i) = 0.)  The number of
    accepted drafts tau is the largest i in 1..K with ``uniforms[b, i-1] < h_i``, 0 if none (the
    paper's test eta <= h_i, taken strictly so that h_i = 0 never stops on a uniform of exactly 0:
    on the uniforms' grid in [0, 1), u < h has probability h up to the grid's resolution).  The
    extra token is drawn with ``uniforms[b, K]`` (as in ``verify_reference``, whatever K_b) by the
    inverse CDF: from P_{K+1} when tau = K, else from norm(max(0, p_tau P_{tau+1} - Q_{tau+1}))
    (from P_{tau+1} if that residual sums to zero in floating point).  uniforms[b, i] for i >= K_b
    and i < K are not read.  All of it is computed in float64 from the fp32 p and q.

    Greedy rows (temperature 0) are token verification, invalid-row rules included: their
    outputs are ``verify_reference``'s.

    Invalid sampling rows (num_accepted -1, tokens all -1): as ``verify_reference``'s parameters,
    plus any unusable value the rule reads, which is every position 0..K_b of the logits, every
    draft id, every q_i(x_i) and draft distribution of positions below K_b (block verification
    reads all of them, not only those up to the first rejection).
    """
    target_logits = mask_target(target_logits, token_bitmask, target_is_probs)  # a grammar: the first warp
    B, K1, V = target_logits.shape
    K = K1 - 1
    kb = num_draft_tokens.to(torch.int64)  # [B]
    draft_probs = _draft_distributions(draft_probs, draft_logits, kb, temperature, top_k, top_p, K, min_p)
    greedy, bad_param, p, bad_pos, _ = target_distributions(
        target_logits, kb, temperature, top_k, top_p, min_p, target_is_probs, sort_descending)
    x, x_safe, q_x, bad_x = drafts(draft_tokens, draft_probs, greedy, V)
    cols = torch.arange(K1, device=target_logits.device)
    used_pos = cols[None, :] <= kb[:, None]  # [B, K+1]: positions 0..K_b
    used_x = cols[None, :K] < kb[:, None]  # [B, K]: drafts 0..K_b-1
    bad_row = bad_param | (bad_pos & used_pos).any(-1) | (bad_x & used_x).any(-1)

    P = torch.nan_to_num(p.double(), nan=0.0)  # [B, K+1, V]
    Q = torch.zeros(B, K, V, dtype=torch.float64, device=p.device)
    if draft_probs is None:
        Q.scatter_(-1, x_safe[..., None], 1.0)
    else:
        Q[..., :draft_probs.shape[-1]] = draft_probs.double()
        bad_q = ~torch.isfinite(Q).all(-1) | (Q < 0).any(-1)  # [B, K]
        bad_row |= (bad_q & used_x).any(-1)
        Q = torch.nan_to_num(Q, nan=0.0, posinf=0.0).clamp(min=0.0)
    Q_x = torch.nan_to_num(q_x.double(), nan=0.0, posinf=0.0).clamp(min=0.0)  # [B, K]
    P_x = P[:, :K].gather(-1, x_safe[..., None])[..., 0]  # [B, K]

    # p_0..p_K [B, K+1]; row b's values past K_b are not read.
    pp = [torch.ones(B, dtype=torch.float64, device=p.device)]
    for i in range(K):
        num = pp[-1] * P_x[:, i]
        one = (num >= Q_x[:, i]) & (num > 0)  # else Q_x > 0 or num = 0 (then p_i = 0)
        pp.append(torch.where(one, 1.0, num / Q_x[:, i].masked_fill(Q_x[:, i] <= 0, 1.0)))
    pp = torch.stack(pp, dim=1)  # [B, K+1]
    r = (pp[:, :K, None] * P[:, :K] - Q).clamp(min=0.0).sum(-1)  # [B, K]: r_0..r_{K-1}
    h = _block_stop_weights(pp[:, :K], r)  # [B, K]: h_0..h_{K-1}
    h = torch.cat([h, torch.zeros(B, 1, dtype=torch.float64, device=p.device)], dim=1)  # [B, K+1]
    h = torch.where(cols[None, :] == kb[:, None], pp, h)  # h_{K_b} = p_{K_b}
    u = uniforms.double()
    i1 = cols[1:]  # [K]: i = 1..K, its uniform uniforms[:, i-1]
    stop = (u[:, :K] < h[:, 1:]) & (i1[None, :] <= kb[:, None])  # [B, K]
    tau = torch.where(stop, i1[None, :], 0).amax(-1) if K > 0 else torch.zeros(B, dtype=torch.int64)
    tau = tau.clamp(0, K)

    P_t = P.gather(1, tau[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]: P_{tau+1}
    Q_t = Q.gather(1, tau.clamp(max=K - 1)[:, None, None].expand(B, 1, V))[:, 0] if K > 0 else torch.zeros_like(P_t)
    p_t = pp.gather(1, tau[:, None])[:, 0]  # [B]
    residual = torch.where((tau < kb)[:, None], _block_residual(p_t, P_t, Q_t), P_t)
    weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, P_t)
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, 1.0)  # invalid rows only
    tokens, num = verify_outputs(x, tau, inverse_cdf(weights, u[:, K]), bad_row)

    # Greedy rows: token verification against the argmax, as verify_reference has it.
    t_tok, n_tok = verify_reference(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
                                    top_p, uniforms, sort_descending=sort_descending,
                                    target_is_probs=target_is_probs, min_p=min_p)
    return torch.where(greedy[:, None], t_tok, tokens), torch.where(greedy, n_tok, num)
