"""The audit's own speculative sampler in float64, written from the definitions (``laws``), and its
mutants: the same sampler with one deliberate mistake each.  The cases use the mutants to show
their power (a mutant must fail the case it belongs to); the audit's tests use the sampler itself
to show that every case holds on a correct verifier.

The rule (Leviathan et al. 2023; Chen et al. 2023): p_j = warp64(target_logits[b, j]) and q_j the
draft's law (one-hot without draft probabilities); draft x_j is accepted when u_j q_j(x_j) < p_j(x_j);
at the first rejection the token is drawn from norm(max(0, p_j - q_j)) (p_j if that is 0); after
K_b acceptances the bonus is drawn from p_{K_b}.  A greedy row (temperature 0) accepts while x_j is
the argmax of the logits, then emits the argmax.  A row with a NaN or +inf logit, a position with
no finite logit, or a draft id outside [0, V) at a position it reads emits nothing (-1).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .laws import _mass_above, warp64
from .protocol import SamplingParams

__all__ = ["MUTATIONS", "reference_verify", "mutant"]

# name -> what the mutant gets wrong
MUTATIONS = {
    "accept_p": "accepts draft x with probability p(x), ignoring q",
    "accept_inverted": "accepts with probability min(1, q(x)/p(x)) (the ratio inverted)",
    "residual_from_p_after_first": "draws the token after a rejection at positions >= 1 from p, not the residual",
    "residual_from_p": "draws the token after a rejection from p instead of norm(max(0, p - q))",
    "temperature_ignored": "samples at temperature 1 whatever the row's temperature",
    "one_temperature": "uses the first sampled row's temperature for every sampled row of the batch",
    "top_k_ignored": "ignores top-k",
    "topk_after_topp": "applies top-p to the full distribution, then top-k",
    "top_p_exclusive": "top-p drops the token whose mass crosses top_p",
    "min_p_before_temperature": "applies min-p to softmax(logits) before the temperature",
    "ignore_num_draft_tokens": "verifies all K drafts of every row, ignoring num_draft_tokens",
    "target_truncated": "restricts the target to the draft's vocabulary (tokens >= Vd never emitted)",
    "no_input_check": "checks nothing: NaN logits win the argmax, draft ids >= V are taken as accepted",
    "shared_stream": "draws every row's numbers from one stream seeded by row 0's seed (batch-dependent)",
    "bonus_from_previous": "draws the bonus token (after K_b acceptances) from p_{K_b - 1}, the last draft's "
                           "position, instead of p_{K_b}",
    "bonus_unwarped": "draws the bonus token of a sampled row from softmax(logits): no temperature or warp there",
    "bonus_reuses_uniform": "draws the bonus token with the last acceptance's uniform (conditioned below its "
                            "ratio) instead of a fresh one",
    "greedy_bonus_sampled": "a greedy row that accepts every draft samples its bonus token from softmax(logits) "
                            "instead of taking the argmax",
}


def _warp(logits: torch.Tensor, T: float, top_k: int, top_p: float, min_p: float, mutation: Optional[str]):
    """p [n, K+1, V] float64 for rows sharing one set of parameters, with the warp's mutations."""
    if T == 0 or mutation not in ("temperature_ignored", "top_k_ignored", "topk_after_topp", "top_p_exclusive",
                                  "min_p_before_temperature"):
        return warp64(logits, T, top_k, top_p, min_p)
    if mutation == "temperature_ignored":
        return warp64(logits, 1.0, top_k, top_p, min_p)
    if mutation == "top_k_ignored":
        return warp64(logits, T, 0, top_p, min_p)
    if mutation == "min_p_before_temperature":
        p1 = torch.softmax(logits.double(), -1)
        keep = p1 >= min_p * p1.amax(-1, keepdim=True)
        return warp64(logits.double().masked_fill(~keep, -math.inf), T, top_k, top_p, 0.0)
    s = logits.double() / T
    V = s.shape[-1]
    all_kept = torch.ones_like(s, dtype=torch.bool)
    if mutation == "top_p_exclusive":  # keeps v iff the mass up to and including v is <= top_p
        keep = warp64(logits, T, top_k, 1.0, 0.0) > 0
        P = torch.softmax(s.masked_fill(~keep, -math.inf), -1)
        keep = keep & (_mass_above(s, keep) + P <= top_p)
        keep |= s == s.amax(-1, keepdim=True)  # the top token stays
        return torch.softmax(s.masked_fill(~keep, -math.inf), -1)
    # topk_after_topp
    keep = _mass_above(s, all_kept) < top_p if top_p < 1 else all_kept
    if 0 < top_k < V:
        kth = s.masked_fill(~keep, -math.inf).sort(-1, descending=True).values[..., top_k - 1:top_k]
        keep = keep & (s >= kth)
    return torch.softmax(s.masked_fill(~keep, -math.inf), -1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; logical shifts by masking)."""
    def shr(z, n):
        return (z >> n) & ((1 << (64 - n)) - 1)

    x = x + (0x9E3779B97F4A7C15 - (1 << 64))
    x = (x ^ shr(x, 30)) * (0xBF58476D1CE4E5B9 - (1 << 64))
    x = (x ^ shr(x, 27)) * (0x94D049BB133111EB - (1 << 64))
    return x ^ shr(x, 31)


def _uniforms(params: SamplingParams, B: int, K1: int, mutation: Optional[str], generator) -> torch.Tensor:
    """[B, K+1] float64 in [0, 1): row b's numbers a function of its seed alone (a counter-based
    hash, splitmix64 of (seed, column)) when it has one, else from ``generator``."""
    if params.seed is None:
        return torch.rand(B, K1, dtype=torch.float64, generator=generator)
    seed = params.seed.long()
    if mutation == "shared_stream":  # one stream for the batch, seeded by row 0: row b gets numbers b * (K+1) ...
        seed = seed[:1].expand(B)
        cols = torch.arange(B * K1).reshape(B, K1)
    else:
        cols = torch.arange(K1).expand(B, K1)
    z = _mix64(_mix64(seed[:, None]) ^ cols)
    return ((z >> 11) & ((1 << 53) - 1)).double() * 2.0 ** -53


def _draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws [n] from weights w [n, V] (not necessarily normalised) with u [n]."""
    c = w.cumsum(-1)
    idx = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp(max=w.shape[-1] - 1)


def reference_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     params: SamplingParams, *, mutation: Optional[str] = None,
                     generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier protocol's call (``protocol``), exact in float64, with an optional ``mutation``
    (a key of ``MUTATIONS``).  Rows without seeds draw from ``generator`` (default: torch's)."""
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"mutation must be None or one of {sorted(MUTATIONS)}, got {mutation!r}")
    B, K1, V = target_logits.shape
    K = K1 - 1
    x = draft_tokens.long()
    T = params.temperature.double()
    if mutation == "one_temperature" and bool((T > 0).any()):
        T = torch.where(T > 0, T[T > 0][0], T)
    K_b = params.num_draft_tokens.long()
    if mutation == "ignore_num_draft_tokens":
        K_b = torch.full_like(K_b, K)
    logits = target_logits.double()
    if mutation == "target_truncated" and draft_probs is not None:
        logits = logits.clone()
        logits[..., draft_probs.shape[-1]:] = -math.inf
    # invalid rows: a NaN/+inf logit, a position without a finite logit, a draft id out of range
    j_read = torch.arange(K)[None, :] < K_b[:, None]  # [B, K]
    bad = torch.isnan(logits).any(-1) | (logits == math.inf).any(-1) | ~torch.isfinite(logits).any(-1)  # [B, K+1]
    bad_id = j_read & ((x < 0) | (x >= V))
    invalid = bad.any(-1) | bad_id.any(-1)
    if mutation == "no_input_check":
        invalid = torch.zeros_like(invalid)
    safe = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=-1e30) if mutation != "no_input_check" else logits
    p = torch.zeros(B, K1, V, dtype=torch.float64)
    combos = torch.stack([T, params.top_k.double(), params.top_p.double(), params.min_p.double()], -1)
    for combo in torch.unique(combos, dim=0):
        rows = (combos == combo).all(-1)
        t, k, tp, mp = combo.tolist()
        if mutation == "no_input_check" and t == 0:
            p[rows] = torch.nn.functional.one_hot(logits[rows].argmax(-1), V).double()  # NaN is the max
        else:  # identical rows (a case repeats one row) are warped once
            uniq, inv = torch.unique(safe[rows].reshape(int(rows.sum()), -1), dim=0, return_inverse=True)
            p[rows] = _warp(uniq.reshape(-1, K1, V), t, int(k), tp, mp, mutation)[inv]
    p = torch.nan_to_num(p, nan=0.0)
    xs = x.clamp(0, V - 1)
    if draft_probs is None:
        q = torch.nn.functional.one_hot(xs, V).double()
    else:
        q = torch.zeros(B, K, V, dtype=torch.float64)
        q[..., :draft_probs.shape[-1]] = draft_probs.double()
    greedy = T == 0
    q = torch.where(greedy[:, None, None], torch.nn.functional.one_hot(xs, V).double(), q)
    u = _uniforms(params, B, K1, mutation, generator)
    tokens = torch.full((B, K1), -1, dtype=torch.int64)
    alive = torch.ones(B, dtype=torch.bool)
    n_acc = torch.zeros(B, dtype=torch.int64)
    rows = torch.arange(B)
    for j in range(K):
        reading = alive & (j < K_b)
        pj, qj = p[rows, j, xs[:, j]], q[rows, j, xs[:, j]]
        out_of_range = (x[:, j] < 0) | (x[:, j] >= V)
        if mutation == "accept_p":
            acc = u[:, j] < pj
        elif mutation == "accept_inverted":
            acc = u[:, j] * pj < qj
        else:
            acc = u[:, j] * qj < pj
        acc = torch.where(greedy, p[rows, j].argmax(-1) == xs[:, j], acc)
        if mutation == "no_input_check":
            acc = acc | out_of_range
        acc &= reading
        tokens[acc, j] = x[acc, j]
        n_acc += acc.long()
        rej = reading & ~acc
        if bool(rej.any()):
            from_p = mutation == "residual_from_p" or (mutation == "residual_from_p_after_first" and j >= 1)
            r = p[rej, j] if from_p else torch.clamp(p[rej, j] - q[rej, j], min=0)
            empty = r.sum(-1) <= 0
            r[empty] = p[rej, j][empty]
            tokens[rej, j] = _draw(r, u[rej, K])
        alive = acc | (alive & ~reading)
    done = alive & (n_acc == K_b)
    if bool(done.any()):
        at = K_b[done]
        if mutation == "bonus_from_previous":
            at = (at - 1).clamp(min=0)
        bonus_p = p[done, at]
        if mutation in ("bonus_unwarped", "greedy_bonus_sampled"):  # softmax(logits) for the rows it hits
            hit = ~greedy[done] if mutation == "bonus_unwarped" else greedy[done]
            raw = torch.softmax(safe[done, K_b[done]], -1)
            bonus_p = torch.where(hit[:, None], raw, bonus_p)
        u_bonus = u[done, K]
        if mutation == "bonus_reuses_uniform":  # u_{K_b - 1}: accepted, so below that draft's ratio
            u_bonus = torch.where(K_b[done] > 0, u[done, (K_b[done] - 1).clamp(min=0)], u_bonus)
        tokens[done, K_b[done]] = _draw(bonus_p, u_bonus)
    tokens[invalid] = -1
    n_acc[invalid] = -1
    return tokens, n_acc


def mutant(mutation: str):
    """The reference sampler with ``mutation``: a verifier (the protocol's callable) that supports seeds."""
    if mutation not in MUTATIONS:
        raise ValueError(f"mutation must be one of {sorted(MUTATIONS)}, got {mutation!r}")

    def verify(target_logits, draft_tokens, draft_probs, params):
        return reference_verify(target_logits, draft_tokens, draft_probs, params, mutation=mutation)

    verify.supports_seed = True
    verify.__name__ = f"mutant[{mutation}]"
    return verify
