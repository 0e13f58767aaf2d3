"""``verify_reference``: token-by-token verification of a chain of drafts (Leviathan et al. 2023;
Chen et al. 2023), the ground truth of ``fused_verify``, and ``emitted_logprobs``, that of its
``return_logprobs=True``.

The pieces the other references and the CPU path share with it are here too: the per-row
parameters (``row_parameters``), the draft and target distributions, the acceptance test
(``acceptance_test``), the residual (``_residual``), the inverse-CDF draw (``inverse_cdf``), the stop
position and the outputs.  The terms (accepted, recovered, residual, bonus, invalid row) and the
random numbers are defined in ``reference``'s docstring.
"""

from __future__ import annotations

import torch

from .warp import _target_probs, mask_target, torch_sort_descending, warp_logits

__all__ = ["FLT_MIN", "draft_softmax", "emitted_logprobs", "inverse_cdf", "verify_reference"]

# The smallest positive temperature accepted: the smallest normal fp32 (2^-126).
FLT_MIN = 2.0 ** -126


def draft_softmax(draft_logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """The draft distributions of ``draft_logits=``: q = softmax(draft_logits / T) per row, fp32.

    draft_logits [B, K, Vd] (any float dtype, read as fp32); inv_temperature [B] fp32, each row's
    1 / T (``row_parameters``: the target's own, 1 for greedy and invalid rows).  Computed as
    the target's p: s = logits.float() * (1 / T), m = max s, e = exp(s - m), q = e / sum(e); no
    top-k/top-p (q is the law the draft sampled from).  A row holding a NaN or +inf scaled logit,
    or no finite one, gets q all NaN (an unusable draft distribution, as such a softmax gives):
    a sampling row that reads it is invalid.  -inf logits have q = 0."""
    s = draft_logits.float() * inv_temperature.float()[:, None, None]  # [B, K, Vd]
    bad = torch.isnan(s).any(-1, keepdim=True) | torch.isposinf(s).any(-1, keepdim=True) | torch.isneginf(s).all(
        -1, keepdim=True)
    m = s.amax(-1, keepdim=True).masked_fill(bad, 0.0)
    e = torch.exp(s - m)
    q = e / e.sum(-1, keepdim=True)
    return q.masked_fill(bad, float("nan"))


def acceptance_test(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p(x) / q(x)): u * q(x) < p(x), with no division, in
    float64 (u float64; p(x), q(x) fp32, so the product of a 24-bit u and q is exact)."""
    return u.double() * q_x.double() < p_x.double()


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The unnormalised residual max(0, p - q) of the whole distributions [N, V]."""
    return (p - q).clamp(min=0.0)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first v with w[v] > 0 and cumsum(w)[v] > u * sum(w), summed in float64 (each
    addition rounds by at most ~2^-53 of the running sum: a weight below ~2^-54 of it still
    vanishes, a total variation of at most ~V * 2^-54 in all, against ~2^-24-sized errors of an
    fp32 sum); the last v with w > 0 if rounding leaves none (-1 if there is none).  A weight
    of 0 is never the pick, however the sum is ordered (the kernel tests w > 0 the same way).
    weights [N, V] >= 0 with a positive sum, u [N] float64 in [0, 1).  Returns [N] int64."""
    w = weights.double()
    cdf = torch.cumsum(w, dim=-1)  # [N, V]
    target = u.double() * cdf[:, -1]  # [N]
    V = weights.shape[-1]
    ar = torch.arange(V, device=weights.device)
    idx = torch.where((cdf > target[:, None]) & (w > 0), ar, V).amin(-1)
    last_nonzero = torch.where(w > 0, ar, -1).amax(-1)
    return torch.where(idx >= V, last_nonzero, idx)


def _draft_distributions(draft_probs, draft_logits, kb, temperature, top_k, top_p, K: int, min_p):
    """q [B, K, Vd]: draft_probs, or with ``draft_logits`` its softmax at each row's temperature
    (``draft_softmax``); None stays None (one-hot q)."""
    if draft_logits is None:
        return draft_probs
    if draft_probs is not None:
        raise ValueError("draft_probs and draft_logits are exclusive: pass one of them, got both")
    _, _, inv_t_d = row_parameters(kb, temperature, top_k, top_p, K, min_p)
    return draft_softmax(draft_logits, inv_t_d)


def target_distributions(target_logits, kb, temperature, top_k, top_p, min_p, target_is_probs: bool,
                          sort_descending):
    """(greedy [B], bad_param [B], p [B, K+1, V] fp32, bad_pos [B, K+1], argmax [B, K+1]): the
    warped target distributions of every verify position (``verify_reference``'s definitions),
    whether a position is unusable, and the first index of the maximum of each scaled row."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    if target_is_probs:
        if top_k is not None or top_p is not None or min_p is not None:
            raise ValueError("top_k, top_p and min_p must be None with target_is_probs=True")
        greedy, bad_param, _ = row_parameters(kb, temperature, None, None, K)
        bad_param = bad_param | (~greedy & (temperature.float() != 1))
        s = target_logits.float()  # [B, K+1, V]
        bad_pos = torch.isnan(s).any(-1) | torch.isinf(s).any(-1) | (s < 0).any(-1) | ~(s > 0).any(-1)
        p = s / s.sum(-1, keepdim=True)
    else:
        greedy, bad_param, inv_t = row_parameters(kb, temperature, top_k, top_p, K, min_p)
        s, keep = warp_logits(target_logits, inv_t[:, None].expand(B, K1), per_position(top_k, K1),
                              per_position(top_p, K1), sort_descending, min_p=per_position(min_p, K1))
        # A position is unusable if any logit is NaN or +inf, or if nothing has a finite logit.
        bad_pos = torch.isnan(s).any(-1) | torch.isposinf(s).any(-1) | torch.isneginf(s).all(-1)  # [B, K+1]
        p = _target_probs(s, keep)  # [B, K+1, V]
    return greedy, bad_param, p, bad_pos, s.argmax(-1)


def verify_reference(
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
    """One speculative-decoding verification step. Returns (tokens [B, K+1] int64,
    num_accepted [B] int64); row b emits tokens[b, :num_accepted[b] + 1].

    The target's warp is temperature, top-k, top-p, then min-p (``warp_logits``, which defines
    each; min-p keeps v iff s_v >= fl32(max s + fl32(ln min_p))).  Greedy rows use none of them
    (the argmax of the logits), but a parameter out of range (top_k < 0, top_p outside (0, 1],
    min_p outside [0, 1] or NaN) makes any row invalid.  The warp applies to p only, never to q.

    ``draft_logits`` (draft_probs None): q = ``draft_softmax(draft_logits, 1 / T)``, the row's own
    temperature, no top-k/top-p; then exactly the draft_probs computation with that q.

    ``target_is_probs``: p_i = target_logits[b, i] / its sum (fp32), no temperature or warp
    (top_k, top_p and min_p must be None); temperature 0 is a greedy row (the argmax of p), 1 samples,
    any other value makes the row invalid.  A position is unusable if an entry is NaN, inf or
    negative, or if none is positive.

    ``token_bitmask``: a grammar's allowed tokens per position (``warp.mask_target``), applied before
    everything else: the masked law, renormalised."""
    target_logits = mask_target(target_logits, token_bitmask, target_is_probs)  # a grammar: the first warp
    B, K1, V = target_logits.shape
    K = K1 - 1
    kb = num_draft_tokens.to(torch.int64)  # [B]
    draft_probs = _draft_distributions(draft_probs, draft_logits, kb, temperature, top_k, top_p, K, min_p)
    greedy, bad_param, p, bad_pos, argmax = target_distributions(
        target_logits, kb, temperature, top_k, top_p, min_p, target_is_probs, sort_descending)

    x, x_safe, q_x, bad_x = drafts(draft_tokens, draft_probs, greedy, V)
    p_x = p[:, :K].gather(-1, x_safe[..., None])[..., 0]  # [B, K]
    u = uniforms.double()
    accept = torch.where(greedy[:, None], x == argmax[:, :K], acceptance_test(u[:, :K], p_x, q_x))  # [B, K]

    j, rejected, bad_row = stop_position(accept, bad_x, bad_pos, bad_param, kb)

    # The final draw at position j: the residual after a rejection, p itself for the bonus.
    p_j = p.gather(1, j[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    final, bad_row = final_token(p_j, x_safe, draft_probs, j, rejected, bad_row, greedy, argmax, u[:, K])
    return verify_outputs(x, j, final, bad_row)


def emitted_logprobs(
    target_logits: torch.Tensor,  # [B, K+1, V]: what verify_reference was given
    tokens: torch.Tensor,  # [B, K+1] int: its output
    num_accepted: torch.Tensor,  # [B] int: its output
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] fp32, 1 = off
    *,
    target_is_probs: bool = False,
    sort_descending=torch_sort_descending,
    min_p: torch.Tensor | None = None,  # [B] fp32, 0 = off
) -> torch.Tensor:
    """[B, K+1] fp32: the target log-probability of each emitted token, log p_i(tokens[b, i]) for
    i <= num_accepted[b], under the row's warped distribution ((s - m) - log sum exp(s - m) over the
    kept tokens; with target_is_probs, log p - log sum p); a greedy row's under softmax(logits)
    (T = 1, no warp); -inf where nothing is emitted (and on invalid rows)."""
    B, K1, V = target_logits.shape
    temp = temperature.float()
    greedy = temp == 0
    if target_is_probs:
        s = target_logits.float()
        lp_all = torch.log(s) - torch.log(s.sum(-1, keepdim=True))
    else:
        inv_t = torch.where(greedy | ~(temp > 0), 1.0, 1.0 / temp.masked_fill(~(temp > 0), 1.0))
        k = None if top_k is None else torch.where(greedy, 0, top_k.to(torch.int64))
        p_ = None if top_p is None else torch.where(greedy, 1.0, top_p.float())
        mp = None if min_p is None else torch.where(greedy, 0.0, min_p.float())
        s, keep = warp_logits(target_logits, inv_t[:, None].expand(B, K1), per_position(k, K1),
                              per_position(p_, K1), sort_descending, min_p=per_position(mp, K1))
        m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        lse = torch.log(torch.where(keep, torch.exp(s - m), 0.0).sum(-1, keepdim=True))
        lp_all = torch.where(keep, (s - m) - lse, float("-inf"))
    lp = lp_all.gather(-1, tokens.to(torch.int64).clamp(min=0)[..., None])[..., 0]  # [B, K+1]
    cols = torch.arange(K1, device=tokens.device)[None, :]
    emitted = (cols <= num_accepted.to(torch.int64)[:, None]) & (tokens >= 0)
    return torch.where(emitted, lp, float("-inf"))


def per_position(t: torch.Tensor | None, K1: int) -> torch.Tensor | None:
    """A per-row parameter [B] as one per verify position [B, K+1] (a view); None stays None."""
    return None if t is None else t[:, None].expand(t.shape[0], K1)


def row_parameters(
    kb: torch.Tensor,  # [B] int64: K_b
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor | None,  # [B] int
    top_p: torch.Tensor | None,  # [B] fp32
    K: int,
    min_p: torch.Tensor | None = None,  # [B] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(greedy, bad_param, inv_t), each [B]: temperature 0 (-0.0 too); a parameter out of range
    (temperature NaN, inf, negative or in (0, FLT_MIN); top_k < 0; top_p outside (0, 1]; min_p
    outside [0, 1]; NaN); 1 / T (1 for greedy and bad rows)."""
    temp = temperature.float()
    greedy = temp == 0
    # A positive temperature below the smallest normal fp32 (2^-126) is refused: its reciprocal
    # overflows (or, subnormal, may be flushed to 0 on a GPU) and no logit survives the scaling.
    bad_param = ~torch.isfinite(temp) | (temp < 0) | ((temp > 0) & (temp < FLT_MIN)) | (kb < 0) | (kb > K)
    if top_k is not None:
        bad_param |= top_k < 0
    if top_p is not None:
        bad_param |= ~(top_p > 0) | (top_p > 1)  # NaN fails the first test
    if min_p is not None:
        bad_param |= ~(min_p >= 0) | (min_p > 1)
    inv_t = torch.where(greedy | bad_param, 1.0, 1.0 / temp.masked_fill(temp == 0, 1.0))
    return greedy, bad_param, inv_t


def drafts(
    draft_tokens: torch.Tensor,  # [B, K] int
    draft_probs: torch.Tensor | None,  # [B, K, Vd] or None
    greedy: torch.Tensor,  # [B] bool
    V: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, x_safe, q_x, bad_x), each [B, K]: the drafts as int64; with ids outside [0, V) replaced
    by 0; q_i(x_i) (1 for a deterministic drafter, 0 for an id past the draft vocabulary Vd); and
    whether draft i is unusable (its id out of range, or, for a sampling row, its q not a
    finite non-negative number)."""
    x = draft_tokens.to(torch.int64)
    x_ok = (x >= 0) & (x < V)
    x_safe = torch.where(x_ok, x, 0)
    if draft_probs is None:
        q_x = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    else:
        Vd = draft_probs.shape[-1]
        q_x = draft_probs.float().gather(-1, x_safe.clamp(max=Vd - 1)[..., None])[..., 0]
        q_x = torch.where(x_safe < Vd, q_x, 0.0)
    bad_x = ~x_ok | (~greedy[:, None] & (~torch.isfinite(q_x) | (q_x < 0)))
    return x, x_safe, q_x, bad_x


def final_token(
    p_j: torch.Tensor,  # [B, V] fp32: the target distribution at the stop position j
    x_safe: torch.Tensor,  # [B, K] int64 drafts, out-of-range ids replaced by 0
    draft_probs: torch.Tensor | None,  # [B, K, Vd] or None (one-hot q)
    j: torch.Tensor,  # [B] int64 stop position
    rejected: torch.Tensor,  # [B] bool: j < K_b
    bad_row: torch.Tensor,  # [B] bool
    greedy: torch.Tensor,  # [B] bool
    argmax: torch.Tensor,  # [B, K+1] int64: first index of the maximum of s
    u_final: torch.Tensor,  # [B] float64: the final draw's uniform
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recovered (after a rejection: residual norm(max(0, p_j - q_j))) or bonus (p_j) token
    of each row, its argmax for greedy rows; and bad_row, extended by an unusable q_j."""
    B, V = p_j.shape
    K = x_safe.shape[1]
    if draft_probs is None:
        q_j = torch.zeros_like(p_j)
        if K > 0:
            x_j = x_safe.gather(1, j.clamp(max=K - 1)[:, None])  # [B, 1]
            q_j.scatter_(1, x_j, 1.0)
    else:
        q_j = torch.zeros_like(p_j)
        if K > 0:
            Vd = draft_probs.shape[-1]
            q_rows = draft_probs.float().gather(1, j.clamp(max=K - 1)[:, None, None].expand(B, 1, Vd))[:, 0]
            q_j[:, :Vd] = q_rows
            bad_q = ~torch.isfinite(q_rows).all(-1) | (q_rows < 0).any(-1)
            bad_row |= rejected & ~greedy & bad_q
    residual = torch.where(rejected[:, None], _residual(p_j, q_j), p_j)
    residual = torch.nan_to_num(residual, nan=0.0)  # only on rows already marked invalid
    empty = residual.sum(-1) <= 0
    weights = torch.where(empty[:, None], torch.nan_to_num(p_j, nan=0.0), residual)
    # Only invalid rows can still sum to zero here; they get a dummy draw that is discarded below.
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, 1.0)
    sampled = inverse_cdf(weights, u_final)
    final = torch.where(greedy, argmax.gather(1, j[:, None])[:, 0], sampled)
    return final, bad_row


def stop_position(
    accept: torch.Tensor,  # [B, K] bool: draft i passes its test
    bad_x: torch.Tensor,  # [B, K] bool: draft i (its id, or for sampling rows its q) is unusable
    bad_pos: torch.Tensor,  # [B, K+1] bool: position i's logits are unusable
    bad_param: torch.Tensor,  # [B] bool: the row's parameters are out of range
    kb: torch.Tensor,  # [B] int64: the row's number of drafts K_b
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(j, rejected, bad_row): j [B] = the position where the row stops (its first rejection,
    its first unusable position, or K_b when it accepts everything: then position K_b gives the
    bonus token); rejected = j < K_b; bad_row = the row read something unusable."""
    K = accept.shape[1]
    i = torch.arange(K, device=accept.device)
    stops = (~accept | bad_pos[:, :K] | bad_x) & (i[None, :] < kb[:, None])  # [B, K]
    j = torch.minimum((~stops).int().cumprod(-1).sum(-1), kb).clamp(0, K)  # [B]: leading non-stops
    rejected = j < kb
    bad_row = bad_param | bad_pos.gather(1, j[:, None])[:, 0]
    bad_row |= torch.where(rejected, bad_x.gather(1, j.clamp(max=K - 1)[:, None])[:, 0] if K > 0 else False, False)
    return j, rejected, bad_row


def verify_outputs(
    x: torch.Tensor,  # [B, K] int64 drafts
    j: torch.Tensor,  # [B] int64 stop position
    final: torch.Tensor,  # [B] int64 the recovered or bonus token
    bad_row: torch.Tensor,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, K+1] (accepted drafts, the final token at j, then -1; all -1 for a bad row)
    and num_accepted [B] (j, or -1 for a bad row)."""
    B, K = x.shape
    cols = torch.arange(K + 1, device=x.device)[None, :]
    x_pad = torch.cat([x, x.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    tokens = torch.where(cols < j[:, None], x_pad, -1)
    tokens = torch.where(cols == j[:, None], final[:, None], tokens)
    tokens = torch.where(bad_row[:, None], -1, tokens)
    num_accepted = torch.where(bad_row, -1, j)
    return tokens, num_accepted
