"""The exact laws the audit tests against, computed in float64 from the logits by the definitions
(never by a verifier), and the two tests it applies: a chi-square of counts against a law, and an
exact count of forbidden outcomes.

The warp (``warp64``), in transformers' order: temperature, top-k, top-p, min-p.

- temperature T: s = logits / T (float64).
- top-k (k > 0 and k < V): keep the tokens whose s is >= the k-th largest s (ties kept).
- top-p (< 1): with P the softmax of s over the top-k set, keep v iff the mass of the kept tokens
  whose s is strictly greater than s_v is < top_p (the smallest most-likely set reaching top_p).
- min-p (> 0): keep v iff P(v) >= min_p * max P.

p = the softmax of s over the kept tokens.  For a draft x_j proposed from q_j (one-hot when the
draft has no probabilities), a_j = min(1, p_j(x_j) / q_j(x_j)); the first emitted token has law
a_0 [x_0] + (1 - a_0) norm(max(0, p_0 - q_0)) (p_0 if the residual is 0), the number accepted
P(n = m) = a_0 ... a_{m-1} (1 - a_m) for m < K_b and a_0 ... a_{K_b-1} for m = K_b.
"""

from __future__ import annotations

import math

import torch

__all__ = ["warp64", "row_laws", "chi2_pvalue", "boundary_margin"]


def warp64(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> torch.Tensor:
    """p [..., V] float64: the warped target distribution of ``logits`` [..., V] (module docstring).
    temperature 0 is greedy: a point mass on the first argmax."""
    x = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).double()
    s = x / temperature
    V = s.shape[-1]
    keep = torch.ones_like(s, dtype=torch.bool)
    if 0 < top_k < V:
        kth = s.sort(-1, descending=True).values[..., top_k - 1:top_k]  # [..., 1]
        keep = s >= kth
    if top_p < 1:
        keep = keep & (_mass_above(s, keep) < top_p)
    if min_p > 0:
        P = torch.softmax(s.masked_fill(~keep, -math.inf), -1)
        keep = keep & (P >= min_p * P.amax(-1, keepdim=True))
    return torch.softmax(s.masked_fill(~keep, -math.inf), -1)


def _mass_above(s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[..., V]: for each token, the mass (softmax of s over ``keep``) of the kept tokens whose s is
    strictly greater than its own (in chunks of rows: the comparison is [rows, V, V])."""
    P = torch.softmax(s.masked_fill(~keep, -math.inf), -1)
    P2, s2 = P.reshape(-1, s.shape[-1]), s.reshape(-1, s.shape[-1])
    out = torch.empty_like(P2)
    for i in range(0, P2.shape[0], 1024):
        sl = slice(i, i + 1024)
        out[sl] = (P2[sl, None, :] * (s2[sl, None, :] > s2[sl, :, None])).sum(-1)
    return out.reshape(s.shape)


def boundary_margin(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> float:
    """How far ``logits`` [..., V] sit from a boundary of the warp (a tie at the top-k threshold,
    a cumulative mass equal to top_p, a ratio equal to min_p), so that a case can refuse logits
    where an fp32 verifier may legitimately keep another set: the smallest gap found, float64."""
    if temperature == 0:
        top = logits.double().sort(-1, descending=True).values
        return float((top[..., 0] - top[..., 1]).min())
    s = logits.double() / temperature
    gaps = [math.inf]
    srt = s.sort(-1, descending=True).values
    V = s.shape[-1]
    if 0 < top_k < V:
        gaps.append(float((srt[..., top_k - 1] - srt[..., top_k]).min()))
    if top_p < 1:
        P = torch.softmax(srt[..., :top_k] if 0 < top_k < V else srt, -1)
        before = P.cumsum(-1) - P
        gaps.append(float((before - top_p).abs().min()))
    if min_p > 0:
        p = warp64(logits, temperature, top_k, top_p, 0.0)
        ratio = p / p.amax(-1, keepdim=True)
        gaps.append(float((ratio[p > 0] - min_p).abs().min()))
    return min(gaps)


def _q_full(q: torch.Tensor | None, drafts: torch.Tensor, V: int) -> torch.Tensor:
    """q [K, V] float64: the draft's probabilities padded with zeros to V, or one-hot on the drafts."""
    if q is None:
        return torch.nn.functional.one_hot(drafts.long(), V).double()
    out = torch.zeros(q.shape[0], V, dtype=torch.float64)
    out[:, :q.shape[-1]] = q.double()
    return out


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = torch.clamp(p - q, min=0)
    return r / r.sum() if float(r.sum()) > 0 else p


def row_laws(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, K_b: int, temperature: float,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> dict:
    """The exact laws of one row: logits [K+1, V], drafts [K], q [K, Vd] or None, K_b <= K drafts
    used.  Returns float64 tensors: ``first`` [V] (the first emitted token), ``num_accepted``
    [K_b + 1], and ``second_given_accept`` [V] (the second emitted token given that draft 0 was
    accepted; None when K_b = 0).  A greedy row (temperature 0) gets point masses."""
    V = logits.shape[-1]
    p = warp64(logits, temperature, top_k, top_p, min_p)  # [K+1, V]
    if temperature == 0:
        qf = torch.nn.functional.one_hot(drafts.long(), V).double()
    else:
        qf = _q_full(q, drafts, V)
    a = []
    for j in range(K_b):
        x = int(drafts[j])
        if temperature == 0:
            a.append(1.0 if int(p[j].argmax()) == x else 0.0)
        else:
            a.append(min(1.0, float(p[j, x]) / float(qf[j, x])) if float(qf[j, x]) > 0 else 1.0)

    def emitted_at(j: int) -> torch.Tensor:
        """The law of the token emitted at position j given drafts 0..j-1 accepted."""
        if j == K_b:
            return p[j].clone()
        out = (1 - a[j]) * (p[j] if temperature == 0 else _residual(p[j], qf[j]))
        out[int(drafts[j])] += a[j]
        return out

    n_law = torch.empty(K_b + 1, dtype=torch.float64)
    run = 1.0
    for m in range(K_b):
        n_law[m] = run * (1 - a[m])
        run *= a[m]
    n_law[K_b] = run
    return {"first": emitted_at(0), "num_accepted": n_law, "second_given_accept": emitted_at(1) if K_b >= 1 else None,
            "accept": a}


def chi2_pvalue(observed: torch.Tensor, law: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of Pearson's chi-square of counts ``observed`` [n]
    against the probabilities ``law`` [n].  Bins of expected count < 5 are pooled (from the least
    likely up); a count in a bin of probability <= 1e-12 fails outright (statistic inf, p-value 0):
    the law forbids it.  Fewer than two pooled bins: (0, 1, 0)."""
    from scipy import stats

    obs = observed.double().flatten()
    law = law.double().flatten()
    n = float(obs.sum())
    if n == 0:
        return 0.0, 1.0, 0
    if bool((obs[law <= 1e-12] > 0).any()):
        return math.inf, 0.0, 0
    exp = law * n
    order = exp.argsort(descending=True).tolist()
    obs_b, exp_b, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        if float(law[i]) <= 1e-12:
            continue
        acc_o += float(obs[i])
        acc_e += float(exp[i])
        if acc_e >= 5:
            obs_b.append(acc_o)
            exp_b.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        if obs_b:
            obs_b[-1] += acc_o
            exp_b[-1] += acc_e
        else:
            obs_b.append(acc_o)
            exp_b.append(acc_e)
    if len(obs_b) < 2:
        return 0.0, 1.0, 0
    total_e = sum(exp_b)
    exp_b = [e * sum(obs_b) / total_e for e in exp_b]
    r = stats.chisquare(obs_b, exp_b)
    return float(r.statistic), float(r.pvalue), len(obs_b) - 1
