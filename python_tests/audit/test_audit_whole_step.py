"""The audit reads every token a step emits: the exact law of the whole emitted sequence
(``laws.step_weights`` / ``sequence_law``) against an enumeration of the fixed-draft laws; the
detection threshold (``laws.detectable_tv``) against simulated chi-square tests; a plain verifier
(``plain_verifier.py``) passes and each of its one-line slips (``slips.py``) fails at --quick size;
every built-in mutant fails its own case at the quick and the full size."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from specdec_kernels.audit.adapters import user_verifier
from specdec_kernels.audit.cli import FULL, QUICK
from specdec_kernels.audit.laws import (chi2_pvalue, detectable_tv, row_laws, sequence_index, sequence_law,
                                        sequence_space, step_weights)
from specdec_kernels.audit.run import ALL_CASES, run_verifier_audit
from specdec_kernels.audit.sampler import reference_verify

from decoder_setup import _one_thread  # noqa: F401  (autouse fixture)
from slips import SLIPS

HERE = os.path.dirname(os.path.abspath(__file__))
PLAIN = os.path.join(HERE, "plain_verifier.py")
V, K = 5, 2


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(K + 1, V, generator=g)
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    return logits, q


def _enumerated(logits, q, K_b, T, given_q: bool):
    """The law of the sequence with drafts drawn from q: the fixed-draft laws summed over every
    draft sequence, weighted by its probability."""
    law = torch.zeros(sequence_space(V, K)[-1], dtype=torch.float64)
    for d in itertools.product(range(V), repeat=K):
        w = math.prod(float(q[j, d[j]]) for j in range(K_b))
        if w == 0:
            continue
        A, S = step_weights(logits, q if given_q else None, K_b, T, drafts=torch.tensor(d))
        law += w * sequence_law(A, S, K) / (V ** (K - K_b))  # drafts past K_b are not read
    return law


@pytest.mark.parametrize("T", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("K_b", [0, 1, 2])
def test_drawn_draft_forms_sum_the_fixed_draft_forms(T, K_b):
    logits, q = _setup(int(10 * T) + K_b)
    A, S = step_weights(logits, q, K_b, T)
    assert torch.allclose(sequence_law(A, S, K), _enumerated(logits, q, K_b, T, True), atol=1e-12)
    A, S = step_weights(logits, None, K_b, T, draft_law=q)  # deterministic proposals drawn from q
    assert torch.allclose(sequence_law(A, S, K), _enumerated(logits, q, K_b, T, False), atol=1e-12)


@pytest.mark.slow
def test_sequence_law_marginals_are_row_laws():
    logits, q = _setup(3)
    drafts = torch.tensor([1, 4])
    A, S = step_weights(logits, q, K, 1.0, drafts=drafts)
    law = sequence_law(A, S, K)
    assert math.isclose(float(law.sum()), 1.0, rel_tol=1e-12)
    off = sequence_space(V, K)
    want = row_laws(logits, drafts, q, K, 1.0)
    first = torch.zeros(V, dtype=torch.float64)
    for m in range(K + 1):  # token 0 of every sequence of length m + 1
        first += law[off[m]:off[m + 1]].reshape(V, -1).sum(-1)
    assert torch.allclose(first, want["first"], atol=1e-12)
    lengths = torch.stack([law[off[m]:off[m + 1]].sum() for m in range(K + 1)])
    assert torch.allclose(lengths, want["num_accepted"], atol=1e-12)


def test_sequence_index_numbers_every_sequence_once():
    seqs = [s for m in range(K + 1) for s in itertools.product(range(V), repeat=m + 1)]
    tokens = torch.full((len(seqs), K + 1), -1, dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    idx = sequence_index(tokens, torch.tensor([len(s) - 1 for s in seqs]), V)
    assert sorted(idx.tolist()) == list(range(sequence_space(V, K)[-1]))


@pytest.mark.slow
def test_reference_sampler_fits_the_whole_step_law():
    """The audit's exact sampler against the closed form with drafts drawn per trial (and the
    form catches a sampler whose bonus is drawn from the previous position's law)."""
    logits, q = _setup(5)
    n = 20_000
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(K)], 1)
    from specdec_kernels.audit.protocol import make_params

    params = make_params(n, K, seed=torch.arange(n))
    A, S = step_weights(logits, q, K, 1.0)
    law = sequence_law(A, S, K)
    for mutation, passes in ((None, True), ("bonus_from_previous", False)):
        tokens, num = reference_verify(logits.expand(n, -1, -1), drafts, q.expand(n, -1, -1), params,
                                       mutation=mutation)
        p = chi2_pvalue(torch.bincount(sequence_index(tokens, num, V), minlength=law.shape[0]), law)[1]
        assert (p >= 1e-4) == passes, (mutation, p)


def test_detectable_tv_is_the_power_it_states():
    """A departure of the threshold's total variation in the worst direction (delta proportional to
    the law on two halves of its mass) is detected in about half of 400 simulated tests."""
    law = torch.full((10,), 0.1, dtype=torch.float64)
    n = 5_000
    t = detectable_tv(9, n)
    moved = law * torch.tensor([1 + 2 * t] * 5 + [1 - 2 * t] * 5, dtype=torch.float64)  # TV t
    assert math.isclose(float((moved - law).abs().sum()) / 2, t, rel_tol=1e-9)
    g = torch.Generator().manual_seed(1)
    hits = sum(chi2_pvalue(torch.bincount(torch.multinomial(moved, n, replacement=True, generator=g),
                                          minlength=10), law)[1] < 1e-4 for _ in range(400))
    assert 0.4 <= hits / 400 <= 0.6, hits  # binomial(400, 0.5): outside +-0.1 with probability < 1e-4


def test_plain_verifier_passes():
    rows = run_verifier_audit(user_verifier(f"{PLAIN}:verify"), QUICK["verifier"], mutants=False)
    assert all(r["verdict"] in ("pass", "n/a") for r in rows), [r for r in rows if r["verdict"] != "pass"]
    assert sum(r["verdict"] == "pass" for r in rows) >= len(rows) - 3  # n/a: seeds and block verification


@pytest.mark.parametrize("name,line,slip", SLIPS, ids=[s[0] for s in SLIPS])
def test_one_line_slip_fails_the_quick_audit(tmp_path, name, line, slip):
    src = open(PLAIN).read()
    assert src.count(line) == 1, line
    path = tmp_path / f"{name}.py"
    path.write_text(src.replace(line, slip))
    rows = run_verifier_audit(user_verifier(f"{path}:verify"), QUICK["verifier"], mutants=False)
    assert any(r["verdict"] == "FAIL" for r in rows), [(r["case"], r["pvalue"]) for r in rows]


def _reference(target_logits, draft_tokens, draft_probs, params):
    return reference_verify(target_logits, draft_tokens, draft_probs, params)


_reference.supports_seed = True


@pytest.mark.slow
@pytest.mark.parametrize("size", ["quick", "full"])
def test_every_builtin_mutant_fails_its_case(size):
    n = (QUICK if size == "quick" else FULL)["verifier"]
    cases = [c.name for c in ALL_CASES if "block" not in c.needs]
    rows = run_verifier_audit(_reference, n, cases=cases)
    assert all(r["verdict"] == "pass" for r in rows), [(r["case"], r["pvalue"]) for r in rows if r["verdict"] != "pass"]
    assert all(r["mutant_verdict"] == "FAIL" for r in rows), [(r["case"], r["mutant_pvalue"]) for r in rows]


def test_a_case_of_several_calls_tests_the_ones_a_verifier_supports():
    """step_warps runs one call per warp: a verifier without min-p is tested on the other three
    (and a wrong sampler without min-p still fails them); min_p itself is n/a."""
    def no_min_p(mutation=None):
        def verify(target_logits, draft_tokens, draft_probs, params):
            if bool((params.min_p > 0).any()):
                raise NotImplementedError("no min-p here")
            return reference_verify(target_logits, draft_tokens, draft_probs, params, mutation=mutation)
        return verify

    rows = {r["case"]: r for r in run_verifier_audit(no_min_p(), 2_000, cases=["step_warps", "min_p"],
                                                     mutants=False)}
    assert rows["min_p"]["verdict"] == "n/a", rows
    assert rows["step_warps"]["verdict"] == "pass" and len(rows["step_warps"]["tests"]) == 3, rows
    assert "min_p: not supported" in rows["step_warps"]["detail"]
    (bad,) = run_verifier_audit(no_min_p("bonus_unwarped"), 2_000, cases=["step_warps"], mutants=False)
    assert bad["verdict"] == "FAIL", bad
