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

__all__ = ["warp64", "row_laws", "step_weights", "sequence_law", "sequence_index", "sequence_space",
           "pooled_bins", "chi2_pvalue", "detectable_tv", "boundary_margin"]


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


# -- the law of a whole step: every token it emits -------------------------------------------------
#
# A step emits a sequence s = (x_0, .., x_{m-1}, y): m accepted drafts, then the token drawn at
# position m (from the residual after a rejection, or from p_{K_b} after m = K_b acceptances).  Its
# law factorises over positions: P(s) = A_0(x_0) ... A_{m-1}(x_{m-1}) S_m(y), where A_j(x) is the
# probability, on reaching position j, that x is emitted there as an accepted draft, and S_j(y) that
# the step stops there emitting y (sum_x A_j(x) + sum_y S_j(y) = 1; S_{K_b} = p_{K_b}, the bonus).
# With a fixed draft d_j: A_j = a_j [d_j], S_j = (1 - a_j) norm(max(0, p_j - q_j)).  With drafts
# drawn per trial from q_j and q_j given to the verifier: A_j = min(p_j, q_j), S_j = max(0, p_j - q_j)
# (summing the fixed-draft law over d_j ~ q_j).  With drafts drawn from r_j but not given (one-hot q:
# deterministic proposals): A_j = r_j p_j, S_j = p_j (1 - r_j).  A greedy row is the last form with p
# the point mass on the argmax (it accepts x iff x is the argmax, then emits the argmax).


def sequence_space(V: int, K: int) -> list:
    """offsets [K + 2]: a sequence of length m + 1 (m accepted drafts, m <= K) has index
    offsets[m] + sum_i s_i V^(m - i) (``sequence_index``); offsets[K + 1] outcomes in all."""
    out = [0]
    for m in range(K + 1):
        out.append(out[-1] + V ** (m + 1))
    return out


def sequence_index(tokens: torch.Tensor, num_accepted: torch.Tensor, V: int) -> torch.Tensor:
    """[B] int64: each row's emitted sequence (tokens [B, K+1] of checked output, num_accepted [B] >= 0)
    as an index of ``sequence_space(V, K)``."""
    K = tokens.shape[1] - 1
    off = torch.tensor(sequence_space(V, K), dtype=torch.int64)
    idx = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for i in range(K + 1):
        inside = i <= num_accepted
        idx = torch.where(inside, idx * V + tokens[:, i].clamp(min=0), idx)
    return idx + off[num_accepted]


def step_weights(logits: torch.Tensor, q: torch.Tensor | None, K_b: int, temperature: float, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, drafts: torch.Tensor | None = None,
                 draft_law: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [K_b, V], S [K_b + 1, V]) float64 of one row (the block comment above): logits [K+1, V],
    q [K, Vd] (the draft probabilities given to the verifier) or None.  Either ``drafts`` [K] (fixed
    for every trial) or drafts drawn per trial: from q when it is given, else from ``draft_law``
    [K, Vd] (deterministic proposals whose law the verifier does not see)."""
    V = logits.shape[-1]
    p = warp64(logits, temperature, top_k, top_p, min_p)  # [K+1, V]
    if drafts is not None:
        qf = _q_full(None if temperature == 0 else q, drafts, V)
        A = torch.zeros(K_b, V, dtype=torch.float64)
        S = torch.zeros(K_b + 1, V, dtype=torch.float64)
        for j in range(K_b):
            x = int(drafts[j])
            if temperature == 0:
                a = 1.0 if int(p[j].argmax()) == x else 0.0
            else:
                a = min(1.0, float(p[j, x]) / float(qf[j, x])) if float(qf[j, x]) > 0 else 1.0
            A[j, x] = a
            S[j] = (1 - a) * (p[j] if temperature == 0 else _residual(p[j], qf[j]))
    elif q is not None and temperature > 0:
        qf = _q_full(q, torch.zeros(q.shape[0], dtype=torch.long), V)
        A = torch.minimum(p[:K_b], qf[:K_b])
        S = torch.cat([(p[:K_b] - qf[:K_b]).clamp(min=0), torch.zeros(1, V, dtype=torch.float64)])
    else:
        law = q if draft_law is None else draft_law
        if law is None:
            raise ValueError("step_weights: drafts drawn per trial need q or draft_law")
        r = _q_full(law, torch.zeros(law.shape[0], dtype=torch.long), V)
        A = r[:K_b] * p[:K_b]
        S = torch.cat([p[:K_b] * (1 - r[:K_b]), torch.zeros(1, V, dtype=torch.float64)])
    S[K_b] = p[K_b]
    return A, S


def sequence_law(A: torch.Tensor, S: torch.Tensor, K: int) -> torch.Tensor:
    """[sequence_space(V, K)[-1]] float64: the law of the emitted sequence from ``step_weights``'
    (A [K_b, V], S [K_b + 1, V]); sequences longer than K_b + 1 have probability 0."""
    V = S.shape[-1]
    off = sequence_space(V, K)
    law = torch.zeros(off[-1], dtype=torch.float64)
    prefix = torch.ones(1, dtype=torch.float64)  # [V^m]: the prefixes' weights, lexicographic
    for m in range(S.shape[0]):
        law[off[m]:off[m + 1]] = (prefix[:, None] * S[m][None, :]).flatten()
        if m < A.shape[0]:
            prefix = (prefix[:, None] * A[m][None, :]).flatten()
    return law


def pooled_bins(law: torch.Tensor, n: float) -> torch.Tensor:
    """[len(law)] int64: the bin of each outcome when n trials are tested against ``law`` (bins of
    expected count < 5 pooled, from the most likely down; the remainder joins the last bin), -1 for
    an outcome of probability <= 1e-12 (forbidden: any count there fails outright)."""
    law = law.double().flatten()
    exp = law * n
    bins = torch.full(law.shape, -1, dtype=torch.int64)
    b, acc, open_ = 0, 0.0, []
    for i in exp.argsort(descending=True).tolist():
        if float(law[i]) <= 1e-12:
            continue
        open_.append(i)
        acc += float(exp[i])
        if acc >= 5:
            bins[open_] = b
            b, acc, open_ = b + 1, 0.0, []
    if open_:
        bins[open_] = max(b - 1, 0)
    return bins


def chi2_pvalue(observed: torch.Tensor, law: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of Pearson's chi-square of counts ``observed`` [n]
    against the probabilities ``law`` [n].  Bins of expected count < 5 are pooled (``pooled_bins``);
    a count in a bin of probability <= 1e-12 fails outright (statistic inf, p-value 0): the law
    forbids it.  Fewer than two pooled bins: (0, 1, 0)."""
    from scipy import stats

    obs = observed.double().flatten()
    law = law.double().flatten()
    n = float(obs.sum())
    if n == 0:
        return 0.0, 1.0, 0
    if bool((obs[law <= 1e-12] > 0).any()):
        return math.inf, 0.0, 0
    bins = pooled_bins(law, n)
    nb = int(bins.max()) + 1 if bool((bins >= 0).any()) else 0
    if nb < 2:
        return 0.0, 1.0, 0
    keep = bins >= 0
    obs_b = torch.zeros(nb, dtype=torch.float64).index_add_(0, bins[keep], obs[keep])
    exp_b = torch.zeros(nb, dtype=torch.float64).index_add_(0, bins[keep], law[keep] * n)
    exp_b = exp_b * obs_b.sum() / exp_b.sum()
    r = stats.chisquare(obs_b.tolist(), exp_b.tolist())
    return float(r.statistic), float(r.pvalue), nb - 1


def detectable_tv(dof: int, n: float, tests: int = 1, alpha: float = 1e-4, power: float = 0.5) -> float:
    """The total-variation distance from the tested law (over its pooled bins) beyond which every
    departure, whatever its direction, is detected with probability >= ``power`` by a chi-square of
    ``dof`` degrees of freedom on n trials at level alpha / tests (Bonferroni), in the noncentral
    chi-square approximation.  A departure delta of TV t has noncentrality n sum delta^2 / p >= 4 n t^2
    (Cauchy-Schwarz, equality for delta proportional to p on two halves of the mass), so
    t = sqrt(lambda* / (4 n)) with lambda* the noncentrality that reaches ``power``."""
    from scipy import optimize, stats

    if dof < 1 or n <= 0:
        return math.inf
    crit = stats.chi2.isf(alpha / tests, dof)
    lam = optimize.brentq(lambda lm: stats.ncx2.sf(crit, dof, lm) - power, 1e-9, 1e7)
    return math.sqrt(lam / (4 * n))
