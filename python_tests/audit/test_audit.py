"""``specdec audit`` (``specdec_kernels.audit``): every case holds on ``fused_verify`` (torch
backend) and on the audit's own sampler, and fails on the wrong sampler it names; the exact laws
agree with the package's warp; the protocol's checks; the generator audit on the Markov-chain
models; the CLI (``--verifier ours --quick`` as a subprocess, exit statuses 0, 1 and 2).

Sizes are small (2,000 rows per call): the wrong samplers' p-values are far below the threshold
at that size, and a correct sampler's fixed draws pass.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from specdec_kernels.audit import make_params
from specdec_kernels.audit.adapters import AdapterUnavailable, load_verifier, ours
from specdec_kernels.audit.block import MUTATIONS as BLOCK_MUTATIONS, block_verifier
from specdec_kernels.audit.run import ALL_CASES as CASES, case_names
from specdec_kernels.audit.checks import FormatError, emitted
from specdec_kernels.audit.chains import chain_tables, continuation_law, markov_llama
from specdec_kernels.audit.generators import run_generator_audit
from specdec_kernels.audit.laws import chi2_pvalue, row_laws, warp64
from specdec_kernels.audit.run import run_verifier_audit
from specdec_kernels.audit.sampler import MUTATIONS, reference_verify
from specdec_kernels.ops.reference import warp_logits

from decoder_setup import _one_thread  # noqa: F401  (autouse fixture)

N = 2_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reference(target_logits, draft_tokens, draft_probs, params):
    return reference_verify(target_logits, draft_tokens, draft_probs, params)


_reference.supports_seed = True


@pytest.fixture(scope="module")
def ours_rows():
    return {r["case"]: r for r in run_verifier_audit(ours("torch"), N)}


@pytest.mark.parametrize("name", case_names())
def test_case_holds_on_ours_and_its_wrong_sampler_fails(ours_rows, name):
    r = ours_rows[name]
    assert r["verdict"] == "pass", r
    assert r["mutant_verdict"] == "FAIL" and r["mutant_pvalue"] < 1e-4, r


@pytest.mark.parametrize("name", case_names())
def test_case_holds_on_the_audits_own_sampler(name):
    needs = next(c.needs for c in CASES if c.name == name)
    (r,) = run_verifier_audit(block_verifier() if "block" in needs else _reference, N, cases=[name], mutants=False)
    assert r["verdict"] == "pass", r


def test_packed_layout_passes_the_ragged_and_seeded_cases():
    rows = run_verifier_audit(ours("torch", packed=True), N, cases=["ragged_k", "seeded_determinism", "first_token"],
                              mutants=False)
    assert [r["verdict"] for r in rows] == ["pass"] * 3, rows


def test_every_case_names_a_known_wrong_sampler():
    assert {c.mutation for c in CASES if "block" not in c.needs} <= set(MUTATIONS)
    assert {c.mutation for c in CASES if "block" in c.needs} <= set(BLOCK_MUTATIONS)
    assert len(set(case_names())) == len(CASES)


def test_warp64_keeps_the_packages_sets():
    """The audit's float64 warp, written from the definitions, keeps the tokens the package's own
    reference keeps (away from boundaries: random logits)."""
    g = torch.Generator().manual_seed(0)
    for T, k, p, mp in ((0.7, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 6, 0.7, 0.0), (2.0, 0, 1.0, 0.3),
                        (0.5, 4, 0.9, 0.1)):
        logits = 2 * torch.randn(16, 32, generator=g)
        mine = warp64(logits, T, k, p, mp) > 0
        _, keep = warp_logits(logits, torch.full((16,), 1 / T), torch.full((16,), k), torch.full((16,), p),
                              min_p=torch.full((16,), mp))
        assert torch.equal(mine, keep), (T, k, p, mp)


@pytest.mark.slow
def test_row_laws_sum_to_one_and_match_a_hand_case():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    q = torch.tensor([[0.2, 0.6, 0.2]])
    laws = row_laws(logits, torch.tensor([1]), q, 1, 1.0)
    a = 0.3 / 0.6  # accept draft 1
    resid = torch.tensor([0.3, 0.0, 0.0]) / 0.3  # max(0, p - q), normalised
    want = (1 - a) * resid
    want[1] += a
    assert torch.allclose(laws["first"], want.double())
    assert torch.allclose(laws["num_accepted"], torch.tensor([1 - a, a], dtype=torch.float64))
    assert math.isclose(float(laws["first"].sum()), 1.0)


def test_chi2_counts_in_a_forbidden_bin_fail_outright():
    assert chi2_pvalue(torch.tensor([10, 0, 1]), torch.tensor([0.5, 0.5, 0.0]))[1] == 0.0
    assert chi2_pvalue(torch.tensor([500, 500]), torch.tensor([0.5, 0.5]))[1] == pytest.approx(1.0)


def test_emitted_names_what_breaks_the_protocol():
    kb = torch.tensor([2, 2])
    with pytest.raises(FormatError, match=r"num_accepted must be in \[0, K_b\]: row 1 has 3"):
        emitted((torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 3])), kb, 5)
    with pytest.raises(FormatError, match="tokens after the emitted ones must be -1"):
        emitted((torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 0])), kb, 5)
    with pytest.raises(FormatError, match=r"emitted tokens must be in \[0, V = 5\)"):
        emitted((torch.tensor([[7, -1, -1], [0, -1, -1]]), torch.tensor([0, 0])), kb, 5)


def test_a_verifier_that_breaks_the_protocol_or_refuses_a_feature_is_reported():
    def wrong_shape(target_logits, draft_tokens, draft_probs, params):
        return torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)

    def no_top_k(target_logits, draft_tokens, draft_probs, params):
        if bool((params.top_k > 0).any()):
            raise NotImplementedError("no top-k here")
        return reference_verify(target_logits, draft_tokens, draft_probs, params)

    (r,) = run_verifier_audit(wrong_shape, 200, cases=["first_token"], mutants=False)
    assert r["verdict"] == "FAIL" and r["detail"].startswith("protocol:"), r
    rows = run_verifier_audit(no_top_k, 200, cases=["top_k", "seeded_determinism"], mutants=False)
    assert [r["verdict"] for r in rows] == ["n/a", "n/a"], rows
    assert "no top-k here" in rows[0]["detail"] and "seeds" in rows[1]["detail"]


def test_make_params_names_a_bad_length():
    with pytest.raises(ValueError, match=r"temperature must be a scalar or 4 values, got shape \(3,\)"):
        make_params(4, 2, temperature=[1.0, 1.0, 1.0])


def test_transformers_verifier_on_two_cases():
    rows = run_verifier_audit(load_verifier("transformers"), 1_000, cases=["first_token", "top_k_top_p"],
                              mutants=False)
    assert [r["verdict"] for r in rows] == ["pass", "pass"], rows


def test_unavailable_adapters_say_so():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(AdapterUnavailable, match="flashinfer is not installed"):
            load_verifier("flashinfer")
    with pytest.raises(AdapterUnavailable, match="cannot import 'no_such_module_xyz'"):
        load_verifier("no_such_module_xyz:verify")
    with pytest.raises(ValueError, match="or module:function, got 'nonsense'"):
        load_verifier("nonsense")


def test_markov_llama_logits_are_the_table():
    target, _ = chain_tables()
    m = markov_llama(target)
    ids = torch.tensor([[2, 0, 5, 5, 1]])
    with torch.no_grad():
        got = m(ids).logits[0].double()
    assert torch.allclose(got, target[ids[0]], atol=1e-5)
    law = continuation_law(target, 2, 3, 1.0)
    assert law.shape == (216,) and math.isclose(float(law.sum()), 1.0)


def test_generator_audit_of_ours():
    (r,) = run_generator_audit("ours", 1_500)
    assert r["verdict"] == "pass", r
    assert r["mutant_verdict"] == "FAIL", r
    with pytest.raises(ValueError, match=r"K = 0 \(the target alone\) is the vLLM engine.s control only"):
        run_generator_audit("ours", 10, K=0)


def _cli(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "specdec_kernels", "audit", *argv], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_cli_audit_ours_quick():
    r = _cli("--verifier", "ours", "--quick", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert [c["case"] for c in doc["cases"]] == case_names()
    assert all(c["verdict"] == "pass" and c["mutant_verdict"] == "FAIL" for c in doc["cases"])
    assert doc["header"]["versions"]["torch"] == torch.__version__


def test_cli_audit_exit_statuses(tmp_path):
    bad = tmp_path / "bad_verifier.py"
    bad.write_text("from specdec_kernels.audit.sampler import mutant\nverify = mutant('accept_p')\n")
    r = _cli("--verifier", f"{bad}:verify", "--cases", "first_token,num_accepted", "--trials", "500",
             "--no-mutants", "--save", str(tmp_path / "rep"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first_token" in r.stdout and "FAIL" in r.stdout
    assert json.loads((tmp_path / "rep.json").read_text())["cases"][0]["verdict"] == "FAIL"
    r = _cli("--verifier", "flashinfer", "--quick")
    if "flashinfer" in r.stderr:
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _cli("--verifier", "ours", "--cases", "nope")
    assert r.returncode == 2 and "--cases: unknown ['nope']" in r.stderr


@pytest.mark.slow
def test_audit_vllm_bridge_runs_the_worker():
    """The vLLM adapter end to end where an interpreter with vLLM is found (else skipped): vLLM's own
    RejectionSampler in its environment, with the CPU expand fixed, passes the first-token case and
    emits the NaN logit's index on greedy rows (what bench/results/audit/ reports)."""
    from specdec_kernels.audit.vllm_bridge import vllm_verifier

    try:
        v = vllm_verifier(fix_expand=True)
    except AdapterUnavailable as e:
        pytest.skip(str(e))
    rows = {r["case"]: r for r in run_verifier_audit(v, 1_000, cases=["first_token", "nan_inf_logits", "min_p"],
                                                     mutants=False)}
    assert rows["first_token"]["verdict"] == "pass", rows
    assert rows["min_p"]["verdict"] == "n/a", rows
    assert rows["nan_inf_logits"]["verdict"] == "FAIL" and "NaN at draft 0, greedy: 1000 bad" in \
        rows["nan_inf_logits"]["detail"], rows
    assert v.versions["vllm"]
