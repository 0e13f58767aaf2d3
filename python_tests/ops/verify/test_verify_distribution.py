"""Distributional tests: speculative sampling through fused_verify emits the target's
distribution, whatever the draft.

Each case runs N = 100,000 independent trials (rows with distinct seeds) of one verification
step with K = 2 drafts sampled from q, and checks:
  1. the first emitted token follows p_1,
  2. given that x_1 was accepted, the second emitted token follows p_2,
  3. given that both drafts were accepted, the bonus token follows p_3,
  4. the acceptance rate of x_1 matches sum_v min(p_1(v), q_1(v)).
1-3 are chi-square goodness-of-fit tests that must not reject at significance 1e-4 (bins
with expected count < 5 merged; any draw of a token with p = 0 fails outright); 3 is a z-test
with bound |z| < 5 (two-sided p ~ 6e-7); 2 and 3 are tested where at least 50 rows reach them.  The
seeds are fixed, so each run is deterministic: the bounds state how unlikely a correct
implementation is to fail with a fresh seed.

The expected distributions are computed here, independently of the package (float64, sorting,
written from the definitions).  On CPU the torch path runs these 100,000-row batches; the Triton
kernel equals it token for token (test_verify_exact.py), and on a GPU it runs these tests itself.
Two mutants prove the tests have teeth: the residual written as max(0, p - p) (the article's
bug) and an acceptance test that ignores q must both be rejected.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from helpers import HAS_CUDA
from specdec_kernels import fused_verify
from specdec_kernels.ops.verify.reference import chain as chain_reference

N = 100_000
SIGNIFICANCE = 1e-4
Z_BOUND = 5.0
V = 12
K = 2
NEG_INF = float("-inf")

from helpers import chi_square_pvalue, expected_probs  # noqa: E402  (shared with other law tests)

pytestmark = pytest.mark.slow  # chi-square over 1e5 draws per case

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="100,000-row kernel runs need a GPU; on CPU the kernel is checked exactly "
                         "against the torch path"))]


def run_case(backend, logits, q, x=None, temperature=1.0, top_k=None, top_p=None, seed0=0):
    """N trials of one step. logits [K+1, V]; q [K, Vd] (drafts sampled from it) or None with
    fixed drafts x [K]. Returns (tokens [N, K+1], num_accepted [N]) as numpy."""
    dev = torch.device("cuda" if backend == "triton" else "cpu")
    g = torch.Generator().manual_seed(12345 + seed0)
    if q is not None:
        x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], dim=1)
        draft_probs = q.float()[None].expand(N, -1, -1).to(dev)
    else:
        x = x[None].expand(N, -1)
        draft_probs = None
    out = fused_verify(logits.float()[None].expand(N, -1, -1).to(dev), x.to(dev), draft_probs,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=torch.arange(N, dtype=torch.int64, device=dev) + 10**6 * seed0,
                       offset=seed0, backend=backend)
    return out.tokens.cpu().numpy(), out.num_accepted.cpu().numpy()


def check(backend, logits, q, x=None, temperature=1.0, top_k=None, top_p=None, seed0=0):
    """Assert the four properties; returns the p-values and z for the mutant tests."""
    tokens, n_acc = run_case(backend, logits, q, x, temperature, top_k, top_p, seed0)
    assert (n_acc >= 0).all() and (n_acc <= K).all()
    p1 = expected_probs(logits[0], temperature, top_k, top_p)
    p2 = expected_probs(logits[1], temperature, top_k, top_p)
    pv1 = chi_square_pvalue(tokens[:, 0], p1)
    accepted = n_acc >= 1
    pv2 = chi_square_pvalue(tokens[accepted, 1], p2) if accepted.sum() >= 50 else 1.0
    both = n_acc == K
    p3 = expected_probs(logits[2], temperature, top_k, top_p)
    pv3 = chi_square_pvalue(tokens[both, 2], p3) if both.sum() >= 50 else 1.0
    if q is not None:
        q1 = np.zeros(len(p1))
        q1[: q.shape[1]] = q[0].double().numpy()
    else:
        q1 = np.eye(len(p1))[int(x[0])]
    alpha = float(np.minimum(p1, q1).sum())
    rate = accepted.mean()
    if alpha in (0.0, 1.0) or min(alpha, 1 - alpha) < 1e-9:
        z = 0.0 if abs(rate - alpha) < 1e-12 else math.inf
    else:
        z = (rate - alpha) / math.sqrt(alpha * (1 - alpha) / N)
    return pv1, pv2, pv3, z


def assert_exact(pv1, pv2, pv3, z):
    assert pv1 > SIGNIFICANCE, f"first token does not follow p_1: chi-square p = {pv1:.3g}"
    assert pv2 > SIGNIFICANCE, f"second token given acceptance does not follow p_2: chi-square p = {pv2:.3g}"
    assert pv3 > SIGNIFICANCE, f"bonus token does not follow p_3: chi-square p = {pv3:.3g}"
    assert abs(z) < Z_BOUND, f"acceptance rate of x_1 is off sum min(p, q): z = {z:.2f}"


def _logits(seed, scale=1.5, support=None):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(K + 1, V, generator=g, dtype=torch.float64) * scale
    if support is not None:
        lg[:, [v for v in range(V) if v not in support]] = NEG_INF
    return lg


def _probs(logits, temperature=1.0):
    return torch.softmax(logits / temperature, -1)[:K]


CASES = {
    # name: (logits, q or None, x or None, temperature, top_k, top_p)
    "generic": lambda: (_logits(1), _probs(_logits(2)), None, 1.0, None, None),
    "q_equals_p": lambda: (_logits(3), _probs(_logits(3)), None, 1.0, None, None),
    "disjoint_supports": lambda: (_logits(4, support=range(0, 6)), _probs(_logits(5, support=range(6, 12))),
                                  None, 1.0, None, None),
    "q_zero_where_p_positive": lambda: (_logits(6), _probs(_logits(7, support=range(0, 4))), None, 1.0, None, None),
    "one_hot_p": lambda: (_logits(8, support=[3]), _probs(_logits(9)), None, 1.0, None, None),
    "one_hot_q": lambda: (_logits(10), _probs(_logits(11, support=[2])), None, 1.0, None, None),
    "temperature_0.5": lambda: (_logits(12), _probs(_logits(13), 0.5), None, 0.5, None, None),
    "temperature_2": lambda: (_logits(14), _probs(_logits(15), 2.0), None, 2.0, None, None),
    "top_k": lambda: (_logits(16), _probs(_logits(17)), None, 1.0, 4, None),
    "top_p": lambda: (_logits(18), _probs(_logits(19)), None, 1.0, None, 0.7),
    "top_k_and_top_p": lambda: (_logits(20), _probs(_logits(21)), None, 0.8, 6, 0.8),
    "padded_target_vocab": lambda: (_logits(22), _probs(_logits(23)[:, :9]), None, 1.0, None, None),
    "deterministic_drafter": lambda: (_logits(24), None, torch.tensor([5, 1]), 1.0, None, None),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_emits_target_distribution(case, backend):
    logits, q, x, temperature, top_k, top_p = CASES[case]()
    if case == "q_equals_p":  # q is the warped target itself: everything is accepted
        q = torch.from_numpy(np.stack([expected_probs(logits[i], 1.0, None, None) for i in range(K)]))
    assert_exact(*check(backend, logits, q, x, temperature, top_k, top_p, seed0=list(CASES).index(case)))


def test_bonus_token_test_has_power():
    """Every row of q_equals_p accepts both drafts, so the bonus is drawn 100,000 times: read
    against the previous position's distribution (a bonus drawn from p_2) it must be rejected."""
    logits = _logits(3)
    q = torch.from_numpy(np.stack([expected_probs(logits[i], 1.0, None, None) for i in range(K)]))
    tokens, n_acc = run_case("torch", logits, q, seed0=list(CASES).index("q_equals_p"))
    both = n_acc == K
    assert both.sum() > 0.99 * N
    assert chi_square_pvalue(tokens[both, 2], expected_probs(logits[2], 1.0, None, None)) > SIGNIFICANCE
    assert chi_square_pvalue(tokens[both, 2], expected_probs(logits[1], 1.0, None, None)) < SIGNIFICANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_emit_the_argmax(backend):
    """Temperature 0: x_i is accepted iff it is the argmax of p_i, and every emitted token is
    the argmax of its position, whatever the draft sampled."""
    logits = _logits(30, scale=0.3)  # flat, so the sampled drafts often differ from the argmax
    q = _probs(_logits(30, scale=0.3))
    g = torch.Generator().manual_seed(7)
    x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], dim=1)
    dev = torch.device("cuda" if backend == "triton" else "cpu")
    out = fused_verify(logits.float()[None].expand(N, -1, -1).to(dev), x.to(dev),
                       q.float()[None].expand(N, -1, -1).to(dev),
                       temperature=0.0, seed=0, backend=backend)
    tokens, n_acc = out.tokens.cpu(), out.num_accepted.cpu()
    argmax = logits.argmax(-1)
    expected_n = torch.where(x[:, 0] != argmax[0], 0, torch.where(x[:, 1] != argmax[1], 1, 2))
    assert torch.equal(n_acc, expected_n)
    cols = torch.arange(K + 1)[None, :]
    emitted = cols <= n_acc[:, None]
    assert torch.equal(tokens[emitted], argmax[None].expand(N, -1)[emitted])
    assert 0.05 < (n_acc == 0).float().mean() < 0.95, "the case must exercise both outcomes"


def test_mutant_residual_p_minus_p_is_caught(monkeypatch):
    """The article's residual max(0, p - p) (zero, so our fallback samples p) must fail."""
    monkeypatch.setattr(chain_reference, "_residual", lambda p, q: (p - p).clamp(min=0.0))
    logits, q, _, _, _, _ = CASES["generic"]()
    pv1, _, _, _ = check("torch", logits, q, seed0=1)
    assert pv1 < SIGNIFICANCE, f"the mutant residual was not detected (p = {pv1:.3g})"


def test_mutant_acceptance_ignoring_q_is_caught(monkeypatch):
    """Accepting with probability p(x) instead of min(1, p(x)/q(x)) must fail."""
    monkeypatch.setattr(chain_reference, "acceptance_test", lambda u, p_x, q_x: u < p_x)
    logits, q, _, _, _, _ = CASES["generic"]()
    pv1, _, _, z = check("torch", logits, q, seed0=2)
    assert pv1 < SIGNIFICANCE or abs(z) > Z_BOUND, "the mutant acceptance test was not detected"
