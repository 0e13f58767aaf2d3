"""The audit's own block verification (Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025, Algorithm 2) in float64, written from the paper's definitions (never from
the package's op), its mutants, and the exact law of one block-verification step.

Definitions (1-based, as in the paper): x_i the i-th draft, P_i the warped target distribution
at draft position i (``laws.warp64`` of the logits at column i - 1; P_{K+1} at the bonus
column), Q_i the law x_i was drawn from (one-hot at x_i without draft probabilities, and for
greedy rows), K = K_b the row's draft count.  With p_0 = 1,

    p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i))                   i = 1..K
    r_i = sum_v max(0, p_i P_{i+1}(v) - Q_{i+1}(v))              i = 0..K-1
    h_i = r_i / (r_i + 1 - p_i)  (0 where r_i + 1 - p_i = 0),  h_K = p_K

(p_i = 1 where p_{i-1} P_i(x_i) >= Q_i(x_i) and p_{i-1} P_i(x_i) > 0; p_i = 0 where
p_{i-1} P_i(x_i) = 0).  The number accepted tau is the largest i in 1..K with eta_i < h_i
(eta_i uniform in [0, 1)), 0 if none: P(tau = i) = h_i prod_{j > i} (1 - h_j), with h_0 = 1.
The step emits x_1..x_tau and one extra token: from P_{K+1} when tau = K, else from
norm(max(0, p_tau P_{tau+1} - Q_{tau+1})) (P_{tau+1} if that residual is 0).  A greedy row has
P_i one-hot at the argmax and Q_i one-hot at x_i, and the same formulas give token verification's
argmax path (accept while x_i is the argmax, then emit the argmax).

``block_verify``: the verifier protocol's call by these rules (``params.method`` "token" goes to
``sampler.reference_verify``); ``block_step_law``: the exact law of the emitted sequence of one
step whose P_i do not depend on the prefix (the verifier cases'), the drafts drawn from Q or
fixed; ``MUTATIONS``: the block mutants (``mutant``).
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch

from .laws import sequence_space, warp64
from .protocol import SamplingParams
from .sampler import _draw, _uniforms, reference_verify

__all__ = ["MUTATIONS", "block_verify", "block_step_law", "block_verifier", "mutant"]

# name -> what the mutant gets wrong
MUTATIONS = {
    "block_residual_token": "after a stop before K_b, draws the extra token from the token method's "
                            "norm(max(0, P - Q)) instead of block verification's norm(max(0, p_tau P - Q))",
}


def _check_mutation(mutation: Optional[str]) -> None:
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"mutation must be None or one of {sorted(MUTATIONS)}, got {mutation!r}")


def _chain_weights(P: torch.Tensor, Q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [M, K+1], h [M, K+1]) float64 of the module docstring for M rows of K drafts each:
    P [M, K+1, V], Q [M, K, V], x [M, K] int64 in [0, V).  h[:, K] is p_K (the stop weight when
    every draft is read); a row with fewer drafts sets its own h_{K_b} = p_{K_b}."""
    M, K1, _ = P.shape
    K = K1 - 1
    Px = P[:, :K].gather(-1, x[..., None])[..., 0]  # [M, K]
    Qx = Q.gather(-1, x[..., None])[..., 0]  # [M, K]
    p = [torch.ones(M, dtype=torch.float64)]
    for i in range(K):
        num = p[-1] * Px[:, i]
        p.append(torch.where((num >= Qx[:, i]) & (num > 0), 1.0, num / Qx[:, i].masked_fill(Qx[:, i] <= 0, 1.0)))
    p = torch.stack(p, 1)  # [M, K+1]
    r = (p[:, :K, None] * P[:, :K] - Q).clamp(min=0).sum(-1)  # [M, K]: r_0..r_{K-1}
    den = r + 1 - p[:, :K]
    h = torch.where(den > 0, r / den.masked_fill(den <= 0, 1.0), 0.0)
    return p, torch.cat([h, p[:, K:]], 1)


def _extra_weights(P_t: torch.Tensor, Q_t: torch.Tensor, p_t: torch.Tensor, stopped: torch.Tensor,
                   mutation: Optional[str]) -> torch.Tensor:
    """[M, V] unnormalised weights of the extra token: the residual max(0, p_tau P_{tau+1} -
    Q_{tau+1}) where ``stopped`` (tau < K_b; P_{tau+1} where it is 0), P_{tau+1} elsewhere.  P_t,
    Q_t [M, V], p_t [M] float64, stopped [M] bool; mutation ``block_residual_token``: p_tau taken
    as 1."""
    scale = torch.ones_like(p_t) if mutation == "block_residual_token" else p_t
    res = (scale[:, None] * P_t - Q_t).clamp(min=0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, P_t)
    return torch.where(stopped[:, None], res, P_t)


def block_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                 params: SamplingParams, *, mutation: Optional[str] = None,
                 generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier protocol's call (``protocol``) by block verification (module docstring),
    exact in float64, with an optional ``mutation`` (a key of ``MUTATIONS``); ``params.method``
    "token" is the audit's token sampler (``sampler.reference_verify``, unmutated).  target_logits
    [B, K+1, V], draft_tokens [B, K], draft_probs [B, K, Vd] or None; returns (tokens [B, K+1]
    int64, num_accepted [B] int64).  Row b's numbers are ``sampler._uniforms``' (a function of its
    seed when it has one, else from ``generator``, default torch's): column i - 1 tests the stop at
    i, column K draws the extra token.  A row with a NaN or +inf logit, a position without a finite
    logit, or a draft id outside [0, V) among the positions it reads emits nothing (-1)."""
    _check_mutation(mutation)
    if params.method == "token":
        return reference_verify(target_logits, draft_tokens, draft_probs, params, generator=generator)
    B, K1, V = target_logits.shape
    K = K1 - 1
    x = draft_tokens.long()
    K_b = params.num_draft_tokens.long()
    logits = target_logits.double()
    cols = torch.arange(K1)
    read_pos = cols[None, :] <= K_b[:, None]  # [B, K+1]
    bad_pos = torch.isnan(logits).any(-1) | (logits == math.inf).any(-1) | ~torch.isfinite(logits).any(-1)
    invalid = (bad_pos & read_pos).any(-1) | ((cols[None, :K] < K_b[:, None]) & ((x < 0) | (x >= V))).any(-1)
    safe = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=-1e30)
    T = params.temperature.double()
    P = torch.zeros(B, K1, V, dtype=torch.float64)
    combos = torch.stack([T, params.top_k.double(), params.top_p.double(), params.min_p.double()], -1)
    for combo in torch.unique(combos, dim=0):
        rows = (combos == combo).all(-1)
        t, k, tp, mp = combo.tolist()
        P[rows] = warp64(safe[rows], t, int(k), tp, mp)
    xs = x.clamp(0, V - 1)
    one_hot = torch.nn.functional.one_hot(xs, V).double()  # [B, K, V]
    if draft_probs is None:
        Q = one_hot
    else:
        Q = torch.zeros(B, K, V, dtype=torch.float64)
        Q[..., :draft_probs.shape[-1]] = draft_probs.double()
    Q = torch.where((T == 0)[:, None, None], one_hot, Q)
    p, h = _chain_weights(P, Q, xs)
    h = torch.where(cols[None, :] == K_b[:, None], p, h)  # h_{K_b} = p_{K_b}
    u = _uniforms(params, B, K1, None, generator)
    i1 = cols[1:]  # the stops i = 1..K, tested with u[:, i - 1]
    stop = (u[:, :K] < h[:, 1:]) & (i1[None, :] <= K_b[:, None])  # [B, K]
    tau = torch.where(stop, i1[None, :], 0).amax(-1) if K > 0 else torch.zeros(B, dtype=torch.int64)
    rows = torch.arange(B)
    Q_t = Q[rows, tau.clamp(max=K - 1)] if K > 0 else torch.zeros(B, V, dtype=torch.float64)
    w = _extra_weights(P[rows, tau], Q_t, p[rows, tau], tau < K_b, mutation)
    tokens = torch.full((B, K1), -1, dtype=torch.int64)
    keep = cols[None, :K] < tau[:, None]
    tokens[:, :K] = torch.where(keep, x, -1)
    tokens[rows, tau] = _draw(w, u[:, K])
    tokens[invalid] = -1
    return tokens, torch.where(invalid, -1, tau)


def block_verifier(mutation: Optional[str] = None):
    """``block_verify`` (with ``mutation``) as a verifier: supports seeds and block verification."""
    _check_mutation(mutation)

    def verify(target_logits, draft_tokens, draft_probs, params):
        return block_verify(target_logits, draft_tokens, draft_probs, params, mutation=mutation)

    verify.supports_seed = True
    verify.supports_block = True
    verify.__name__ = "audit block_verify" if mutation is None else f"mutant[{mutation}]"
    return verify


def mutant(mutation: str):
    """The audit's block sampler with ``mutation`` (a key of ``MUTATIONS``), as a verifier."""
    if mutation not in MUTATIONS:
        raise ValueError(f"mutation must be one of {sorted(MUTATIONS)}, got {mutation!r}")
    return block_verifier(mutation)


def block_step_law(P: torch.Tensor, Q: torch.Tensor, drafts: Optional[torch.Tensor] = None,
                   mutation: Optional[str] = None) -> torch.Tensor:
    """[offset_{K+1}] float64 (``sequence_offsets``): the exact law of the emitted sequence
    (accepted drafts, then the extra token; index ``sequence_index``) of one block-verification
    step whose target distributions P [K+1, V] do not depend on the prefix, the draft laws Q [K, V].
    ``drafts`` None: x_1..x_K drawn independently from Q_1..Q_K (every one of the V^K sequences
    enumerated, weighted by prod_i Q_i(x_i)); else the fixed drafts [K].  ``mutation``: the law of
    that block mutant instead."""
    _check_mutation(mutation)
    P, Q = P.double(), Q.double()
    K1, V = P.shape
    K = K1 - 1
    if drafts is None:
        X = torch.tensor(list(itertools.product(range(V), repeat=K)), dtype=torch.int64).reshape(-1, K)  # [V^K, K]
        Qn = Q / Q.sum(-1, keepdim=True)  # the law a sampler draws from an fp32 q
        w = Qn.gather(-1, X.T).prod(0) if K else torch.ones(1, dtype=torch.float64)  # [V^K]
    else:
        X = drafts.long().reshape(1, K)
        w = torch.ones(1, dtype=torch.float64)
    M = X.shape[0]
    p, h = _chain_weights(P.expand(M, -1, -1), Q.expand(M, -1, -1), X)
    tau_law = torch.empty(M, K1, dtype=torch.float64)  # P(tau = i) = h_i prod_{j > i} (1 - h_j), h_0 = 1
    tail = torch.ones(M, dtype=torch.float64)
    for i in range(K, -1, -1):
        tau_law[:, i] = (h[:, i] if i > 0 else 1.0) * tail
        tail = tail * (1 - h[:, i])
    offsets = sequence_space(V, K)
    law = torch.zeros(offsets[-1], dtype=torch.float64)
    for m in range(K1):
        e = _extra_weights(P[m].expand(M, -1), Q[min(m, K - 1)].expand(M, -1) if K else torch.zeros(M, V),
                           p[:, m], torch.full((M,), m < K), mutation)
        e = e / e.sum(-1, keepdim=True)
        prefix = torch.zeros(M, dtype=torch.int64)
        for i in range(m):
            prefix = prefix * V + X[:, i]
        idx = offsets[m] + prefix[:, None] * V + torch.arange(V)[None, :]  # [M, V]
        law.index_add_(0, idx.flatten(), ((w * tau_law[:, m])[:, None] * e).flatten())
    return law
