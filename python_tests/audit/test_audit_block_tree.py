"""The audit of block verification and tree drafting: the block cases' law (``audit.block``) is
exact (completed by the target's distributions it is their product) and the mutant's is not; the
block cases pass on ``fused_verify(method="block")`` (padded and packed) and on the audit's own
block sampler, fail on its mutant and on a token verifier that claims block verification, and
are ``n/a`` for a verifier without ``supports_block``; the generators ``ours-block`` and
``ours-tree`` pass at T = 1 and 0.6 and greedy (exactly), and each one's mutant fails; the
audit's own simulations pass unmutated (the mutants' failures are their mutations').

Sizes: the block cases at 5,000 trials (the quick size), ``ours-block`` at 100,000 continuations
(its quick size: its mutant moves the law little), ``ours-tree`` at 1,000 (its rows run one
after the other); the p-values of the correct samplers are seeded, so the tests are reproducible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec_kernels.audit import block, tree
from specdec_kernels.audit.adapters import ours
from specdec_kernels.audit.block_cases import BLOCK_CASES
from specdec_kernels.audit.chains import (LENGTH, PROMPT, VG, chain_tables, continuation_counts, continuation_law,
                                          greedy_path)
from specdec_kernels.audit.generators import GREEDY_MUTANT, MUTANTS, TREE, greedy_outcome, run_generator_audit, simulate
from specdec_kernels.audit.laws import chi2_pvalue, sequence_index, sequence_space, warp64
from specdec_kernels.audit.protocol import make_params
from specdec_kernels.audit.run import run_verifier_audit
from specdec_kernels.audit.sampler import reference_verify

from decoder_setup import _one_thread  # noqa: F401  (autouse fixture)

NAMES = [c.name for c in BLOCK_CASES]
TRIALS = 5_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step(V=10, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(K + 1, V, generator=g)
    q = torch.softmax(0.5 * logits[:K] + torch.randn(K, V, generator=g), -1).double()
    return warp64(logits, 1.0), q / q.sum(-1, keepdim=True)


def _completed(law, P):
    """[V^(K+1)]: the law of the emitted sequences, each continued by the target's P_{m+2}.. P_{K+1}."""
    K1, V = P.shape
    offsets = sequence_space(V, K1 - 1)
    full = torch.zeros(V ** K1, dtype=torch.float64)
    for m in range(K1):
        part = law[offsets[m]:offsets[m + 1]]
        for j in range(m + 1, K1):
            part = (part[:, None] * P[j][None, :]).flatten()
        full += part
    return full


def _product(P):
    out = P[0]
    for j in range(1, P.shape[0]):
        out = (out[:, None] * P[j][None, :]).flatten()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_step_keeps_the_target_and_the_wrong_residual_does_not(seed):
    P, Q = _step(seed=seed)
    drafts = torch.tensor([int(Q[i].argmax()) for i in range(3)])
    target = _product(P)
    law = block.block_step_law(P, Q)
    assert abs(float(law.sum()) - 1) < 1e-12
    assert torch.allclose(_completed(law, P), target, atol=1e-12, rtol=0)
    # the law of drafts drawn from Q is the Q-weighted sum of the laws of each fixed draft sequence
    mix = sum(float(Q[0, a] * Q[1, b] * Q[2, c]) * block.block_step_law(P, Q, torch.tensor([a, b, c]))
              for a in range(10) for b in range(10) for c in range(10))
    assert torch.allclose(mix, law, atol=1e-12, rtol=0)
    wrong = block.block_step_law(P, Q, mutation="block_residual_token")
    assert float((_completed(wrong, P) - target).abs().sum()) / 2 > 1e-3
    # deterministic drafts (one-hot Q, the law they were drawn from): the target again
    one_hot = torch.nn.functional.one_hot(drafts, 10).double()
    assert torch.allclose(_completed(block.block_step_law(P, one_hot, drafts), P), target, atol=1e-12, rtol=0)


def test_sequence_index_numbers_each_emitted_sequence_once():
    V, K = 3, 2
    assert sequence_space(V, K) == [0, 3, 12, 39]
    tokens = torch.tensor([[2, -1, -1], [0, 1, -1], [2, 2, 2], [0, 0, 0]])
    num = torch.tensor([0, 1, 2, 2])
    assert sequence_index(tokens, num, V).tolist() == [2, 3 + 1, 12 + 26, 12]


def test_block_sampler_draws_what_block_step_computes():
    """The audit's block sampler (and its mutant) against block_step_law, drafts drawn from q."""
    P, Q = _step(seed=3)
    logits = P.log().float()
    n, g = 20_000, torch.Generator().manual_seed(4)
    X = torch.stack([torch.multinomial(Q[i], n, replacement=True, generator=g) for i in range(3)], 1)
    args = (logits.expand(n, -1, -1).contiguous(), X, Q.float().expand(n, -1, -1).contiguous(),
            make_params(n, 3, seed=torch.arange(n), method="block"))
    for mutation in (None, "block_residual_token"):
        tokens, num = block.block_verify(*args, mutation=mutation)
        law = block.block_step_law(warp64(logits, 1.0), Q.float(), mutation=mutation)
        idx = sequence_index(tokens, num, 10)
        assert chi2_pvalue(torch.bincount(idx, minlength=len(law)), law)[1] > 1e-4, mutation
    token_rows = reference_verify(*args[:3], make_params(n, 3, seed=torch.arange(n)))
    assert torch.equal(block.block_verify(*args[:3], make_params(n, 3, seed=torch.arange(n)))[0], token_rows[0])


def test_block_greedy_rows_take_the_argmax_path():
    P, Q = _step(seed=5)
    logits = P.log().float()[None]
    best = logits[0].argmax(-1)
    drafts = best[:3].clone()[None]
    drafts[0, 2] = (drafts[0, 2] + 1) % 10  # the third draft is not the argmax
    tokens, num = block.block_verify(logits, drafts, Q.float()[None], make_params(1, 3, temperature=0.0,
                                                                                  method="block"))
    assert num.tolist() == [2] and tokens[0].tolist() == best[:3].tolist() + [-1]


def test_sampling_params_carry_the_method():
    p = make_params(4, 3, method="block")
    assert p.method == "block" and p.select(torch.tensor([0, 2])).method == "block"
    assert make_params(2, 3).method == "token"
    with pytest.raises(ValueError, match="method must be 'token' or 'block', got 'tree'"):
        make_params(2, 3, method="tree")


@pytest.mark.parametrize("packed", [False, True])
def test_block_cases_hold_on_ours_and_their_wrong_sampler_fails(packed):
    rows = run_verifier_audit(ours("torch", packed=packed), TRIALS, cases=NAMES)
    for r in rows:
        assert r["verdict"] == "pass", r
        assert r["mutant"] == "block_residual_token" and r["mutant_verdict"] == "FAIL" and r["mutant_pvalue"] < 1e-4, r


def test_block_cases_hold_on_the_audits_own_block_sampler():
    rows = run_verifier_audit(block.block_verifier(), TRIALS, cases=NAMES, mutants=False)
    assert [r["verdict"] for r in rows] == ["pass"] * len(NAMES), rows


def test_token_verification_claiming_block_fails_the_block_cases():
    """Token verification is exact but has another law of the emitted sequence: an adapter that
    ignores params.method is caught."""
    def token_only(target_logits, draft_tokens, draft_probs, params):
        return reference_verify(target_logits, draft_tokens, draft_probs, params)

    token_only.supports_seed = token_only.supports_block = True
    rows = run_verifier_audit(token_only, TRIALS, cases=NAMES, mutants=False)
    assert [r["verdict"] for r in rows] == ["FAIL"] * len(NAMES), rows


def test_a_verifier_without_block_gets_n_a():
    def token_only(target_logits, draft_tokens, draft_probs, params):
        return reference_verify(target_logits, draft_tokens, draft_probs, params)

    token_only.supports_seed = True
    rows = run_verifier_audit(token_only, 500, cases=NAMES)
    for r in rows:
        assert r["verdict"] == "n/a" and "has no block verification (supports_block not set)" in r["detail"], r
        assert r["mutant_verdict"] == "FAIL", r  # the mutant still shows the case's power


def test_generators_name_their_own_wrong_twin():
    assert MUTANTS["ours"] == "accept_p" and MUTANTS["ours-block"] in block.MUTATIONS
    assert MUTANTS["ours-tree"] in tree.MUTATIONS
    with pytest.raises(ValueError, match="temperature must be > 0 \\(or 0, greedy, for"):
        run_generator_audit("transformers", 100, temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_audits_own_simulations_pass_unmutated(temperature):
    target, draft = chain_tables()
    law = continuation_law(target, PROMPT[-1], LENGTH, temperature)
    runs = [simulate(target, draft, 60_000, LENGTH, 2, temperature, seed=7, method="block"),
            tree.simulate_tree(target, draft, 20_000, LENGTH, TREE, PROMPT[-1], temperature, seed=7)]
    for seqs in runs:
        p = chi2_pvalue(continuation_counts(seqs, VG, LENGTH), law)[1]
        assert p > 1e-4
    assert tree.simulate_tree(target, draft, 3, LENGTH, TREE, PROMPT[-1], 0.0) == [greedy_path(target, 2, LENGTH)] * 3


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_generator_audit_of_ours_block(temperature):
    (r,) = run_generator_audit("ours-block", 100_000, temperature=temperature)
    assert r["verdict"] == "pass" and "block verification" in r["shows"] and "accepted" in r["detail"], r
    assert r["mutant"] == "block_residual_token" and r["mutant_verdict"] == "FAIL", r


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_generator_audit_of_ours_tree(temperature):
    (r,) = run_generator_audit("ours-tree", 1_000, temperature=temperature)
    assert r["verdict"] == "pass" and "tree (2, 2)" in r["shows"], r
    assert r["mutant"] == "tree_siblings_unchanged" and r["mutant_verdict"] == "FAIL", r


@pytest.mark.parametrize("name", ["ours", "ours-block", "ours-tree"])
def test_generator_greedy_is_the_targets_path(name):
    (r,) = run_generator_audit(name, 300, temperature=0.0)
    assert r["case"] == "continuations_L3_greedy" and r["verdict"] == "pass" and r["statistic"] == 0, r
    assert r["mutant"] == GREEDY_MUTANT and r["mutant_verdict"] == "FAIL", r


def test_generator_greedy_counts_a_wrong_row():
    """The exact greedy case fails on one row that differs from the greedy path, and refuses an id
    outside the vocabulary."""
    path = greedy_path(chain_tables()[0], PROMPT[-1], LENGTH)
    seqs = [list(path) for _ in range(50)]
    assert greedy_outcome(seqs, path)["verdict"] == "pass"
    seqs[7] = [(path[0] + 1) % VG] + path[1:]
    r = greedy_outcome(seqs, path, ", a note")
    assert r["verdict"] == "FAIL" and r["statistic"] == 1 and r["pvalue"] == 0.0, r
    assert "50 continuations, a note: 1 differ from the greedy path" in r["detail"], r
    with pytest.raises(ValueError, match=r"a continuation must be 3 ids in \[0, 6\)"):
        greedy_outcome([path[:-1] + [VG]], path)


def test_a_generator_run_that_verified_nothing_is_an_error(monkeypatch):
    from specdec_kernels.decoding.decoder import SpeculativeDecoder

    real = SpeculativeDecoder.generate

    def nothing_drafted(self, *a, **k):
        res = real(self, *a, **k)
        res.stats.drafted_tokens = 0
        return res

    monkeypatch.setattr(SpeculativeDecoder, "generate", nothing_drafted)
    (r,) = run_generator_audit("ours-tree", 20, mutants=False)
    assert r["verdict"] == "error" and "nothing was verified" in r["detail"], r


def test_cli_generator_ours_block_runs_greedy_too():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "specdec_kernels", "audit", "--generator", "ours-block", "--trials",
                        "3000", "--no-mutants", "--json"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert [c["case"] for c in doc["cases"]] == ["continuations_L3_T1", "continuations_L3_T0.6",
                                                  "continuations_L3_greedy"]
