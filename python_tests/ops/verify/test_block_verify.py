"""Block verification (``block_verify_reference``; Sun et al., arXiv 2403.10444, Algorithm 2).

The exact laws below are derived from the rule by enumeration over the drafts, in float64, with
no sampling: given drafts x, P(tau = i | x) = h_i * prod_{j > i} (1 - h_j) (h_0 = 1), and the
extra token's law is P_{K+1} after tau = K, else norm(max(0, p_tau P_{tau+1} - Q_{tau+1})).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from helpers import chi_square_pvalue

from specdec_kernels import fused_verify
from specdec_kernels.ops import reference
from specdec_kernels.ops.verify.reference import block as block_reference, warp as warp_reference
from specdec_kernels.ops.reference import inverse_cdf, block_verify_reference, verify_reference

D = torch.float64


def _t(v):
    return torch.tensor(v, dtype=D)


def _block_law(Ps, Qs):
    """[(w, x, tau_law [K+1], extra [K+1, V])] over the drafts x (prob w = prod Q_i(x_i) > 0).
    Ps: K+1 target distributions [V]; Qs: K draft distributions [V] (prefix-independent)."""
    K, V = len(Qs), Ps[0].shape[0]
    out = []
    for x in itertools.product(range(V), repeat=K):
        w = 1.0
        for i in range(K):
            w *= float(Qs[i][x[i]])
        if w == 0.0:
            continue
        pp = [1.0]
        for i in range(K):
            pp.append(min(1.0, pp[-1] * float(Ps[i][x[i]]) / float(Qs[i][x[i]])))
        h = [1.0]  # h_0: stop at 0 when no later test stops
        res = []
        for i in range(K):
            rv = (pp[i] * Ps[i] - Qs[i]).clamp(min=0.0)
            res.append(rv)
            if i > 0:
                den = float(rv.sum()) + 1.0 - pp[i]
                h.append(float(rv.sum()) / den if den > 0 else 0.0)
        h.append(pp[K])
        tau_law = torch.zeros(K + 1, dtype=D)
        for i in range(K + 1):
            pr = h[i]
            for j in range(i + 1, K + 1):
                pr *= 1.0 - h[j]
            tau_law[i] = pr
        extra = torch.zeros(K + 1, V, dtype=D)
        for i in range(K):
            extra[i] = res[i] / res[i].sum() if res[i].sum() > 0 else Ps[i]
        extra[K] = Ps[K]
        out.append((w, x, tau_law, extra))
    return out


def _tau_law(Ps, Qs):
    law = torch.zeros(len(Qs) + 1, dtype=D)
    for w, _, tl, _ in _block_law(Ps, Qs):
        law += w * tl
    return law


def _one_block_then_target(Ps, Qs):
    """Law [V]^(K+1) of one block's emission followed by target tokens at positions tau+2..K+1."""
    K, V = len(Qs), Ps[0].shape[0]
    law = torch.zeros([V] * (K + 1), dtype=D)
    for w, x, tl, extra in _block_law(Ps, Qs):
        for tau in range(K + 1):
            if tl[tau] == 0:
                continue
            tail = _outer(Ps[tau + 1:]) if tau < K else torch.ones((), dtype=D)
            for y in range(V):
                law[x[:tau] + (y,)] += w * tl[tau] * extra[tau, y] * tail
    return law


def _first_n_repeated(P, Q, K, n):
    """Law [V]^n of the first n tokens of repeated block iterations, P_i = P, Q_i = Q throughout."""
    V = P.shape[0]
    emissions = {}  # emitted tuple -> probability, for one iteration
    for w, x, tl, extra in _block_law([P] * (K + 1), [Q] * K):
        for tau in range(K + 1):
            for y in range(V):
                c = w * float(tl[tau]) * float(extra[tau, y])
                if c != 0:
                    e = x[:tau] + (y,)
                    emissions[e] = emissions.get(e, 0.0) + c
    laws = [torch.ones((), dtype=D)]
    for m in range(1, n + 1):
        law = torch.zeros([V] * m, dtype=D)
        for e, c in emissions.items():
            if len(e) >= m:
                law[e[:m]] += c
            else:
                law[e] += c * laws[m - len(e)]
        laws.append(law)
    return laws[n]


def _outer(Ps):
    t = Ps[0]
    for P in Ps[1:]:
        t = t.unsqueeze(-1) * P
    return t


def _rand(V):
    return torch.distributions.Dirichlet(torch.ones(V, dtype=D)).sample()


torch.manual_seed(11)
_R1, _R2, _R3, _R4 = (_rand(4) for _ in range(4))
CASES = {  # name -> (P, Q), the same at every position
    "q_equals_p": (_R1, _R1.clone()),
    "disjoint": (_t([0.5, 0.5, 0.0, 0.0]), _t([0.0, 0.0, 0.3, 0.7])),
    "q_zero_where_p_positive": (_t([0.4, 0.3, 0.2, 0.1]), _t([0.7, 0.3, 0.0, 0.0])),
    "one_hot_q": (_R2, _t([0.0, 1.0, 0.0, 0.0])),
    "near_deterministic_p": (_t([1 - 3e-9, 1e-9, 1e-9, 1e-9]), _R3),
    "random": (_R4, _rand(4)),
    "p_one_hot_off_q_mode": (_t([0.0, 0.0, 0.0, 1.0]), _t([0.6, 0.2, 0.1, 0.1])),
}


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_law_repeated_iterations(case, K):
    P, Q = CASES[case]
    for n in (2, 3):
        law = _first_n_repeated(P, Q, K, n)
        assert torch.allclose(law, _outer([P] * n), rtol=0, atol=1e-12), (case, K, n)


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_exact_law_per_position(K, seed):
    """Different (P_i, Q_i) at each position, mixing the adversarial cases: one block then the
    target has the target's joint law of K+1 tokens."""
    torch.manual_seed(100 + seed)
    names = list(CASES)
    picks = torch.randint(len(names), (K + 1,)).tolist()
    Ps = [CASES[names[c]][0] for c in picks]
    Qs = [CASES[names[c]][1] for c in picks[:K]]
    law = _one_block_then_target(Ps, Qs)
    assert torch.allclose(law, _outer(Ps), rtol=0, atol=1e-12)


def _token_expected_tau(Ps, Qs):
    e, acc = 0.0, 1.0
    for P, Q in zip(Ps, Qs):
        acc *= float(torch.minimum(P, Q).sum())
        e += acc
    return e


def test_paper_example():
    """Sun et al.'s two-token example: E[tau] = 10/9 for token verification, 11/9 for block."""
    P, Q = _t([1 / 3, 2 / 3]), _t([2 / 3, 1 / 3])
    law = _tau_law([P] * 3, [Q] * 2)
    assert abs(float((law * torch.arange(3, dtype=D)).sum()) - 11 / 9) < 1e-12
    assert abs(_token_expected_tau([P] * 3, [Q] * 2) - 10 / 9) < 1e-12


def test_never_worse_than_token_verification():
    torch.manual_seed(5)
    gaps = []
    for K in (1, 2, 3):
        for _ in range(8):
            V = int(torch.randint(2, 5, ()))
            Ps = [_rand(V) for _ in range(K + 1)]
            Qs = [_rand(V) for _ in range(K)]
            block = float((_tau_law(Ps, Qs) * torch.arange(K + 1, dtype=D)).sum())
            gaps.append(block - _token_expected_tau(Ps, Qs))
    assert min(gaps) >= -1e-12
    assert max(gaps) > 1e-2


# ------------------------------------------------------------------------------------------------
# The reference against the rule
# ------------------------------------------------------------------------------------------------
def _sampled_step(Ps, Qs, N, seed):
    """N rows of one step with drafts x_i ~ Q_i; returns the reference's inputs."""
    g = torch.Generator().manual_seed(seed)
    K = len(Qs)
    logits = torch.stack([P.float().log() for P in Ps])[None].expand(N, K + 1, -1).contiguous()
    q = torch.stack([Q.float() for Q in Qs])[None].expand(N, K, -1).contiguous()
    x = torch.stack([torch.multinomial(Q.float(), N, replacement=True, generator=g) for Q in Qs], dim=1)
    u = torch.rand(N, K + 1, dtype=D, generator=g)
    return logits, x, q, torch.full((N,), K), torch.ones(N), u


def _p_as_used(Ps):
    return [torch.softmax(P.float().log(), -1).double() for P in Ps]


def _chi2_pvalue(obs, exp_prob):
    n = obs.sum()
    exp = exp_prob * n
    assert (obs[exp_prob == 0] == 0).all()
    m = exp_prob > 0
    stat = float(((obs[m] - exp[m]) ** 2 / exp[m]).sum())
    return chi2.sf(stat, int(m.sum()) - 1)


SAMPLED = {
    "random": ([_t([0.1, 0.2, 0.3, 0.4]), _t([0.4, 0.3, 0.2, 0.1]), _t([0.25, 0.25, 0.25, 0.25]),
                _t([0.7, 0.1, 0.1, 0.1])],
               [_t([0.4, 0.4, 0.1, 0.1]), _t([0.1, 0.2, 0.3, 0.4]), _t([0.6, 0.2, 0.2, 0.0])]),
}


def _stats(Ps, Qs, N=100_000, seed=0):
    logits, x, q, kb, temp, u = _sampled_step(Ps, Qs, N, seed)
    tokens, tau = block_verify_reference(logits, x, q, kb, temp, None, None, u)
    Pu = _p_as_used(Ps)
    g = torch.Generator().manual_seed(seed + 1)
    cont = torch.multinomial(Pu[1].float(), N, replacement=True, generator=g)
    second = torch.where(tau >= 1, tokens[:, 1], cont)  # the target continues after tau = 0
    V = Pu[0].shape[0]
    pv_first = _chi2_pvalue(torch.bincount(tokens[:, 0], minlength=V).double(), Pu[0])
    pv_two = _chi2_pvalue(torch.bincount(tokens[:, 0] * V + second, minlength=V * V).double(),
                          _outer(Pu[:2]).reshape(-1))
    pv_tau = _chi2_pvalue(torch.bincount(tau, minlength=len(Qs) + 1).double(),
                          _tau_law(Pu, [Q.float().double() for Q in Qs]))
    return pv_first, pv_two, pv_tau


@pytest.mark.slow
def test_sampled_matches_exact_laws():
    Ps, Qs = SAMPLED["random"]
    pv_first, pv_two, pv_tau = _stats(Ps, Qs)
    assert min(pv_first, pv_two, pv_tau) > 1e-4, (pv_first, pv_two, pv_tau)


@pytest.mark.slow
def test_sampled_rejects_stop_weight_mutant(monkeypatch):
    # h_i = r_i / r_i: the 1 - p_i term left out
    monkeypatch.setattr(block_reference, "_block_stop_weights", lambda pp, r: (r > 0).double())
    Ps, Qs = SAMPLED["random"]
    pv_first, pv_two, pv_tau = _stats(Ps, Qs)
    assert pv_two < 1e-4 and pv_tau < 1e-4, (pv_first, pv_two, pv_tau)


@pytest.mark.slow
def test_sampled_rejects_token_residual_mutant(monkeypatch):
    # the extra token from the token rule's residual max(0, P - Q)
    monkeypatch.setattr(block_reference, "_block_residual", lambda p_tau, P, Q: (P - Q).clamp(min=0.0))
    Ps, Qs = SAMPLED["random"]
    pv_first, pv_two, pv_tau = _stats(Ps, Qs)
    assert pv_two < 1e-4, (pv_first, pv_two, pv_tau)


def _loop_rule(P, Q, x, kb, u):
    """One row by the paper's backward loop: for i = K_b down to 1, stop at the first i with
    u[i-1] < h_i; the extra token's weights.  P [K+1, V], Q [K, V] float64."""
    pp = [1.0]
    for i in range(kb):
        pp.append(min(1.0, pp[-1] * float(P[i, x[i]]) / float(Q[i, x[i]])) if Q[i, x[i]] > 0
                  else float(pp[-1] * float(P[i, x[i]]) > 0))
    tau = 0
    for i in range(kb, 0, -1):
        if i == kb:
            h = pp[kb]
        else:
            r = float((pp[i] * P[i] - Q[i]).clamp(min=0).sum())
            den = r + 1.0 - pp[i]
            h = r / den if den > 0 else 0.0
        if float(u[i - 1]) < h:
            tau = i
            break
    w = P[tau] if tau == kb else (pp[tau] * P[tau] - Q[tau]).clamp(min=0)
    return tau, (w if w.sum() > 0 else P[tau])


@pytest.mark.parametrize("one_hot", [False, True])
def test_reference_equals_backward_loop_ragged(one_hot):
    torch.manual_seed(3)
    B, K, V = 200, 4, 6
    logits = torch.randn(B, K + 1, V) * 2
    logits[torch.rand(B, K + 1, V) < 0.2] = float("-inf")
    logits[..., 0] = 0.0  # every position keeps a token
    q = torch.softmax(torch.randn(B, K, V) * 2, -1)
    x = torch.multinomial(q.reshape(-1, V), 1).view(B, K)
    kb = torch.randint(0, K + 1, (B,))
    temp = torch.rand(B) + 0.5
    u = torch.rand(B, K + 1, dtype=D)
    dp = None if one_hot else q
    tokens, na = block_verify_reference(logits, x, dp, kb, temp, None, None, u)
    P = torch.softmax(logits * (1 / temp)[:, None, None], -1).double()
    for b in range(B):
        Qb = torch.nn.functional.one_hot(x[b], V).double() if one_hot else q[b].double()
        tau, w = _loop_rule(P[b], Qb, x[b], int(kb[b]), u[b])
        assert int(na[b]) == tau
        assert tokens[b, :tau].tolist() == x[b, :tau].tolist()
        assert int(tokens[b, tau]) == int(inverse_cdf(w[None], u[b, K:])[0])
        assert (tokens[b, tau + 1:] == -1).all()


def test_ragged_row_equals_its_own_k():
    torch.manual_seed(4)
    B, K, V = 64, 4, 5
    logits = torch.randn(B, K + 1, V)
    q = torch.softmax(torch.randn(B, K, V), -1)
    x = torch.multinomial(q.reshape(-1, V), 1).view(B, K)
    kb = torch.randint(0, K + 1, (B,))
    temp = torch.ones(B)
    u = torch.rand(B, K + 1, dtype=D)
    tokens, na = block_verify_reference(logits, x, q, kb, temp, None, None, u)
    for b in range(B):
        k = int(kb[b])
        t1, n1 = block_verify_reference(logits[b:b + 1, :k + 1], x[b:b + 1, :k], q[b:b + 1, :k], kb[b:b + 1],
                                        temp[b:b + 1], None, None, torch.cat([u[b:b + 1, :k], u[b:b + 1, K:]], 1))
        assert int(n1[0]) == int(na[b])
        assert t1[0].tolist() == tokens[b, :k + 1].tolist()
        assert (tokens[b, k + 1:] == -1).all()


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_rows_equal_token_verification(with_q):
    torch.manual_seed(6)
    B, K, V = 128, 5, 12
    logits = torch.randn(B, K + 1, V)
    x = torch.randint(0, V, (B, K))
    am = logits.argmax(-1)[:, :K]
    lead = torch.rand(B, K) < 0.7  # mostly matching drafts, so long acceptances happen
    x = torch.where(lead, am, x)
    q = torch.softmax(torch.randn(B, K, V), -1) if with_q else None
    kb = torch.randint(0, K + 1, (B,))
    temp = torch.where(torch.arange(B) % 2 == 0, 0.0, 0.8)
    u = torch.rand(B, K + 1, dtype=D)
    t_b, n_b = block_verify_reference(logits, x, q, kb, temp, None, None, u)
    t_v, n_v = verify_reference(logits, x, q, kb, temp, None, None, u)
    g = temp == 0
    assert torch.equal(t_b[g], t_v[g]) and torch.equal(n_b[g], n_v[g])
    assert (n_b[g] == kb[g]).any()


def test_invalid_rows():
    B, K, V = 4, 2, 3
    logits = torch.randn(B, K + 1, V)
    logits[1, 2, 0] = float("nan")  # read by block verification whatever the drafts
    x = torch.zeros(B, K, dtype=torch.int64)
    x[2, 1] = V  # draft id out of range
    temp = torch.tensor([1.0, 1.0, 1.0, -1.0])
    tokens, na = block_verify_reference(logits, x, None, torch.full((B,), K), temp, None, None,
                                        torch.rand(B, K + 1, dtype=D))
    assert na.tolist()[1:] == [-1, -1, -1] and na[0] >= 0
    assert (tokens[1:] == -1).all()


def test_draft_with_zero_p_and_zero_q_never_accepted():
    B, K, V = 256, 2, 3
    logits = torch.zeros(B, K + 1, V)
    logits[:, 0, 2] = float("-inf")  # P_1(2) = 0
    q = torch.full((B, K, V), 0.5)
    q[:, 0, 2] = 0.0  # Q_1(2) = 0: a draft the drafter could not have made
    x = torch.full((B, K), 2)
    tokens, na = block_verify_reference(logits, x, q, torch.full((B,), K), torch.ones(B), None, None,
                                        torch.rand(B, K + 1, dtype=D))
    assert (na == 0).all() and (tokens[:, 0] != 2).all()


# ------------------------------------------------------------------------------------------------
# The op's law: fused_verify(method="block") (its CPU torch path) in adversarial cases
# ------------------------------------------------------------------------------------------------
NEG = float("-inf")
# name -> (target logits [K+1, V], q [K, Vd], warp keywords); K = 2 drafts, the same q at both
OP_CASES = {
    "q_equals_p": (torch.tensor([[0.3, -0.2, 1.1, 0.0, -1.0]] * 3), None, {}),
    "disjoint": (torch.tensor([[0.0, 0.5, NEG, NEG, NEG]] * 3), torch.tensor([[0.0, 0.0, 0.3, 0.7, 0.0]] * 2), {}),
    "q_zero_where_p_positive": (torch.tensor([[0.4, 0.0, -0.3, 0.2, -1.0]] * 3),
                                torch.tensor([[0.7, 0.3, 0.0, 0.0, 0.0]] * 2), {}),
    "top_k": (torch.tensor([[1.0, 0.2, 0.9, -0.4, 0.5], [0.1, 0.6, -0.2, 0.8, 0.0], [0.3, 0.3, 0.1, -1.0, 0.9]]),
              torch.tensor([[0.1, 0.4, 0.3, 0.1, 0.1], [0.3, 0.1, 0.2, 0.2, 0.2]]), {"top_k": 3}),
    "top_p_temperature": (torch.tensor([[1.0, 0.2, 0.9, -0.4, 0.5], [0.1, 0.6, -0.2, 0.8, 0.0],
                                        [0.3, 0.3, 0.1, -1.0, 0.9]]),
                          torch.tensor([[0.3, 0.1, 0.4, 0.1, 0.1], [0.1, 0.2, 0.1, 0.5, 0.1]]),
                          {"top_p": 0.7, "temperature": 0.7}),
    "min_p": (torch.tensor([[1.0, 0.2, 0.9, -0.4, 0.5]] * 3), torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2]] * 2),
              {"min_p": 0.5}),
    "padded_vocabulary": (torch.tensor([[0.2, -0.1, 0.4, 0.0, 0.6, 0.3]] * 3),  # Vd = 4 < V = 6
                          torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.4, 0.3, 0.2, 0.1]]), {}),
    "one_hot_drafts": (torch.tensor([[0.5, 1.0, -0.5, 0.0, 0.2]] * 3), "one-hot", {}),
}


def _op_case(name):
    L, q, warp = OP_CASES[name]
    if q is None:
        q = torch.softmax(L[:2], -1)
    return L, q, warp


def _warped(L, warp):
    """The target's warped law at each position [K+1, V] float64, as the op defines it."""
    K1 = L.shape[0]
    t = warp.get("temperature", 1.0)
    kw = {k: torch.full((K1,), v) for k, v in warp.items() if k in ("top_k", "top_p", "min_p")}
    s, keep = reference.warp_logits(L, torch.full((K1,), 1.0 / t), kw.get("top_k"), kw.get("top_p"),
                                    min_p=kw.get("min_p"))
    return warp_reference._target_probs(s, keep).double()


def _op_emissions(name, N=100_000, seed=0):
    """N rows of one block step: the emitted tokens, continued by target draws at the positions
    after the emission; returns (first three tokens [N, 3], tau [N], warped P [3, V])."""
    L, q, warp = _op_case(name)
    K1, V = L.shape
    K = K1 - 1
    g = torch.Generator().manual_seed(seed)
    one_hot = isinstance(q, str)
    if one_hot:
        x = torch.tensor([[1, 3]]).expand(N, K)  # a deterministic drafter's fixed proposals
        qb = None
    else:
        x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
        qb = q[None].expand(N, K, q.shape[-1])
    logits = L[None].expand(N, K1, V)
    kw = {k: v for k, v in warp.items()}
    out = fused_verify(logits, x, qb, seed=torch.arange(N) + seed * N, backend="torch", method="block", **kw)
    P = _warped(L, warp)
    tokens, tau = out.tokens, out.num_accepted
    assert (tau >= 0).all()
    cont = torch.stack([torch.multinomial(P[i].float(), N, replacement=True, generator=g) for i in range(K1)], 1)
    cols = torch.arange(K1)
    first3 = torch.where(cols[None] <= tau[:, None], tokens, cont)  # [N, 3]
    return first3, tau, P


def _joint_pvalues(first3, P):
    V = P.shape[1]
    two = (first3[:, 0] * V + first3[:, 1]).numpy()
    three = (first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]).numpy()
    p2 = _outer([P[0], P[1]]).reshape(-1)
    p3 = _outer([P[0], P[1], P[2]]).reshape(-1)
    p2, p3 = (p2 / p2.sum()).numpy(), (p3 / p3.sum()).numpy()  # fp32 laws, summed to 1 in float64
    return chi_square_pvalue(two, p2), chi_square_pvalue(three, p3)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_joint_law_of_two_and_three_tokens(name):
    """The joint law of the first two and of the first three tokens equals the warped target's:
    chi-square over 100,000 rows, each p-value > 1e-4 (a correct rule fails one case with
    probability about 2e-4 per test)."""
    first3, _, P = _op_emissions(name)
    p2, p3 = _joint_pvalues(first3, P)
    assert min(p2, p3) > 1e-4, (name, p2, p3)


# The cases where each mutant changes the law (where p_i = 1 or the residuals agree it does not)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["q_zero_where_p_positive", "top_p_temperature", "padded_vocabulary",
                                  "one_hot_drafts"])
def test_op_law_rejects_stop_weight_mutant(name, monkeypatch):
    # h_i = r_i / r_i: the 1 - p_i term left out
    monkeypatch.setattr(block_reference, "_block_stop_weights", lambda pp, r: (r > 0).double())
    first3, _, P = _op_emissions(name)
    assert min(_joint_pvalues(first3, P)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["padded_vocabulary"])
def test_op_law_rejects_token_residual_mutant(name, monkeypatch):
    # the extra token from the token rule's residual max(0, P - Q)
    monkeypatch.setattr(block_reference, "_block_residual", lambda p_tau, P, Q: (P - Q).clamp(min=0.0))
    first3, _, P = _op_emissions(name)
    assert min(_joint_pvalues(first3, P)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("chain", range(4))
def test_sampled_means_agree_with_exact_expectations(chain):
    """On random (p, q) chains (K = 3), the op's mean number accepted, block and token, lies
    within 5 standard errors of the exact expectation computed from the probabilities, and the
    exact block expectation is >= the token one."""
    g = torch.Generator().manual_seed(40 + chain)
    K, V, N = 3, 5, 100_000
    L = torch.randn(K + 1, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    Ps = [P for P in _warped(L, {})]
    Qs = [Q.double() for Q in q]
    exact_block = float((_tau_law(Ps, Qs) * torch.arange(K + 1, dtype=D)).sum())
    exact_token = _token_expected_tau(Ps, Qs)
    assert exact_block >= exact_token - 1e-12
    x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
    for method, exact in (("block", exact_block), ("token", exact_token)):
        n = fused_verify(L[None].expand(N, K + 1, V), x, q[None].expand(N, K, V), seed=torch.arange(N), backend="torch",
                         method=method).num_accepted.double()
        se = float(n.std()) / N ** 0.5
        assert abs(float(n.mean()) - exact) < 5 * se, (method, float(n.mean()), exact, se)
