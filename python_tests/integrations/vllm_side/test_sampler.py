"""vLLM 0.32.0's own ``RejectionSampler.forward`` against ``specdec_kernels.integrations.vllm`` on
the same inputs, laid out as vLLM's V1 model runner lays them out.

- Greedy: token for token equal on ragged batches (K_b from 0 to 5, drafts half right).
- Sampled: one request repeated in a batch of TRIALS rows (each row an independent trial, 3 fixed
  drafts, V = 12); the first emitted token and the number of accepted drafts are tested by
  chi-square against the exact laws computed in float64 from p (the warped target) and q (the
  draft's distribution): first token ~ a_0 [d_0] + (1 - a_0) norm(max(0, p_0 - q_0)), and
  P(n = m) = a_0 ... a_{m-1} (1 - a_m), with a_j = min(1, p_j(d_j) / q_j(d_j)).  Each statistic is
  tested at significance ALPHA = 1e-4 with TRIALS = 40,000 trials; with 4 cases x 2 samplers x 2
  statistics the chance that a correct sampler fails anywhere is below 2e-3 (the seeds are fixed:
  the run is deterministic).  A test-only sampler with a wrong acceptance rule (accept with
  probability p(d), ignoring q) must fail the same test.

vLLM's sampled path is run with ``expand_batch_to_tokens`` replaced by a correct torch version:
on CPU its C++ override of ``expand_kernel`` loses float outputs (``test_vllm_cpu_expand_bug``).
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import vllm.v1.sample.rejection_sampler as vrs
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from vllm.v1.sample.sampler import Sampler

from specdec_kernels.integrations import vllm as sv
from vllm_helpers import expand_batch_to_tokens_fixed, sampling_metadata, spec_metadata

ALPHA = 1e-4
TRIALS = 40_000
V = 12
DRAFTS = [2, 5, 7]


@pytest.fixture(scope="module")
def sampler():
    return RejectionSampler(Sampler())


@pytest.fixture
def fixed_expand(monkeypatch):
    monkeypatch.setattr(vrs, "expand_batch_to_tokens", expand_batch_to_tokens_fixed)


def run_vllm(sampler, md, draft_probs, logits, sm):
    return sv.original_forward()(sampler, md, draft_probs, logits.clone(), sm).sampled_token_ids


def run_ours(sampler, md, draft_probs, logits, sm):
    return sv.fused_forward(sampler, md, draft_probs, logits, sm).sampled_token_ids


def ragged_case(seed: int, dtype=torch.float32, with_q: bool = False, B: int = 9, Vr: int = 50):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, 6, (B,), generator=g).tolist()
    ks[0] = 0
    logits = (3 * torch.randn(sum(ks) + B, Vr, generator=g)).to(dtype)
    drafts, row = [], 0
    for k in ks:
        d = []
        for j in range(k):
            best = int(logits[row + j].float().argmax())
            d.append(best if torch.rand((), generator=g) < 0.7 else int(torch.randint(0, Vr, (), generator=g)))
        drafts.append(d)
        row += k + 1
    q = torch.softmax(torch.randn(sum(ks), Vr, generator=g), -1) if with_q else None
    return spec_metadata(drafts), q, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_ragged_equal(sampler, dtype, with_q):
    for seed in range(6):
        md, q, logits = ragged_case(seed, dtype, with_q)
        sm = sampling_metadata(None)
        want = run_vllm(sampler, md, q, logits, sm)
        got = run_ours(sampler, md, q, logits, sm)
        assert got.dtype == want.dtype == torch.int32
        assert got.shape == want.shape == (len(md.num_draft_tokens), md.max_spec_len + 1)
        assert torch.equal(got, want), (seed, got, want)
        assert PLACEHOLDER_TOKEN_ID == -1


def test_greedy_rows_of_a_mixed_batch_equal(sampler, fixed_expand):
    """Greedy rows (temperature 0) beside sampled ones emit what vLLM's greedy path emits."""
    for seed in range(4):
        md, q, logits = ragged_case(seed, with_q=True)
        B = len(md.num_draft_tokens)
        temp = torch.tensor([0.0 if b % 2 == 0 else 0.8 for b in range(B)])
        sm = sampling_metadata(temp, top_k=[0 if b % 3 else 7 for b in range(B)], vocab_size=50)
        want = run_vllm(sampler, md, q, logits, sm)
        got = run_ours(sampler, md, q, logits, sm)
        greedy = temp == 0
        assert torch.equal(got[greedy], want[greedy])
        assert torch.equal(got[greedy], run_vllm(sampler, md, q, logits, sampling_metadata(None))[greedy])


def test_no_copy_of_the_logits(sampler, monkeypatch):
    seen = {}
    real = sv.fused_verify_packed

    def spy(logits, draft_tokens, cu, draft_probs=None, **kw):
        seen.update(ptr=logits.data_ptr(), shape=tuple(logits.shape), drafts=draft_tokens.data_ptr(),
                    q=None if draft_probs is None else draft_probs.data_ptr(), cu=cu.tolist(),
                    K=kw["max_num_draft_tokens"])
        return real(logits, draft_tokens, cu, draft_probs, **kw)

    monkeypatch.setattr(sv, "fused_verify_packed", spy)
    md, q, logits = ragged_case(3, with_q=True)
    run_ours(sampler, md, q, logits, sampling_metadata(torch.ones(len(md.num_draft_tokens))))
    assert seen["ptr"] == logits.data_ptr() and seen["shape"] == tuple(logits.shape)
    assert seen["drafts"] == md.draft_token_ids.data_ptr() and seen["q"] == q.data_ptr()
    assert seen["cu"] == [0] + md.cu_num_draft_tokens.tolist() and seen["K"] == md.max_spec_len


def test_vllm_cpu_expand_bug():
    """vLLM 0.32.0 on CPU: ``expand_batch_to_tokens`` of float values (the per-token temperatures
    of ``apply_sampling_constraints``) does not return them.  Its C++ override
    (vllm/utils/cpu_triton_utils.py, ``_expand_kernel_impl``) writes into ``_ensure_int64(output)``,
    a new int64 copy of the float output, and discards it.  When this fails, vLLM has fixed it:
    the note in specdec_kernels/integrations/vllm.py is then out of date."""
    x = torch.tensor([0.7, 1.0, 0.0, 2.5])
    cu = torch.tensor([2, 3, 6, 8], dtype=torch.int32)
    want = expand_batch_to_tokens_fixed(x, cu, 8, replace_from=0, replace_to=1)
    assert want.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.0, 2.5, 2.5])
    bad = 0
    for _ in range(5):
        got = vrs.expand_batch_to_tokens(x, cu, 8, replace_from=0, replace_to=1)
        bad += not torch.allclose(got, want)
    assert bad > 0, "vLLM's CPU expand_batch_to_tokens now returns the expanded floats"


# The exact laws -------------------------------------------------------------------------------

def warp64(logits: torch.Tensor, T: float, top_k: int, top_p: float) -> torch.Tensor:
    """p [.., V] float64: softmax(logits / T), then the top_k largest (0: all), then the smallest
    prefix of the sorted rest whose mass reaches top_p (1: all)."""
    p = torch.softmax(logits.double() / T, -1)
    order = p.argsort(-1, descending=True)
    ps = p.gather(-1, order)
    keep = torch.ones_like(ps, dtype=torch.bool)
    if top_k:
        keep[..., top_k:] = False
    if top_p < 1:
        ps_k = torch.where(keep, ps, 0)
        ps_k = ps_k / ps_k.sum(-1, keepdim=True)
        before = ps_k.cumsum(-1) - ps_k
        keep &= before < top_p
        margin = (before - top_p).abs().min()
        assert margin > 1e-3, "the case sits on a top-p boundary: pick other logits"
    out = torch.zeros_like(p).scatter(-1, order, torch.where(keep, ps, 0))
    return out / out.sum(-1, keepdim=True)


def exact_laws(logits, q, T, top_k, top_p):
    """(law of the first emitted token [V], law of the number accepted [K + 1]) for the fixed
    DRAFTS, from p = warp64(logits) [K + 1, V] and q [K, V] (None: a point mass on each draft)."""
    K = len(DRAFTS)
    p = warp64(logits, T, top_k, top_p)
    q = torch.nn.functional.one_hot(torch.tensor(DRAFTS), V).double() if q is None else q.double()
    a = torch.stack([torch.clamp(p[j, d] / q[j, d], max=1.0) for j, d in enumerate(DRAFTS)])
    r0 = torch.clamp(p[0] - q[0], min=0)
    r0 = r0 / r0.sum() if r0.sum() > 0 else torch.zeros_like(r0)
    first = (1 - a[0]) * r0
    first[DRAFTS[0]] += a[0]
    n_law = torch.empty(K + 1, dtype=torch.float64)
    run = torch.tensor(1.0, dtype=torch.float64)
    for m in range(K):
        n_law[m] = run * (1 - a[m])
        run = run * a[m]
    n_law[K] = run
    return first, n_law


def chi2_pvalue(observed: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square p-value of counts against a law, bins of expected count < 5 pooled; a count in a
    bin of probability 0 is a failure outright (p-value 0)."""
    n = int(observed.sum())
    if bool((observed[law <= 1e-15] > 0).any()):
        return 0.0
    exp = law * n
    order = exp.argsort(descending=True)
    obs_b, exp_b, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        if exp[i] <= 1e-9:
            continue
        acc_o += float(observed[i])
        acc_e += float(exp[i])
        if acc_e >= 5:
            obs_b.append(acc_o), exp_b.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        if obs_b:
            obs_b[-1] += acc_o
            exp_b[-1] += acc_e
        else:
            obs_b.append(acc_o), exp_b.append(acc_e)
    if len(obs_b) < 2:
        return 1.0
    return float(stats.chisquare(obs_b, exp_b).pvalue)


def statistics(tokens: torch.Tensor):
    """(counts of the first emitted token [V], counts of the number accepted [K + 1]) of a
    [TRIALS, K + 1] vLLM output."""
    K = len(DRAFTS)
    emitted = (tokens != PLACEHOLDER_TOKEN_ID).sum(-1)
    assert bool((emitted >= 1).all())
    first = torch.bincount(tokens[:, 0].long(), minlength=V)
    n = torch.bincount(emitted - 1, minlength=K + 1)
    return first, n


CASES = {  # name: (temperature, top_k, top_p, with draft_probs)
    "T=1": (1.0, 0, 1.0, True),
    "T=0.7,top_k=5": (0.7, 5, 1.0, True),
    "top_p=0.9": (1.0, 0, 0.9, True),
    "draft_probs=None": (1.0, 0, 1.0, False),
}


def sampled_case(name: str):
    T, top_k, top_p, with_q = CASES[name]
    g = torch.Generator().manual_seed(1234)
    K = len(DRAFTS)
    base = 1.5 * torch.randn(K + 1, V, generator=g)
    if with_q:
        q = torch.softmax(torch.randn(K, V, generator=g), -1)
        for j, d in enumerate(DRAFTS):  # a draft that proposed d gives it some mass
            q[j, d] += 0.3
        q = q / q.sum(-1, keepdim=True)
    else:
        q = None
    md = spec_metadata([DRAFTS] * TRIALS)
    logits = base.repeat(TRIALS, 1)
    qq = None if q is None else q.repeat(TRIALS, 1).contiguous()
    sm = sampling_metadata(torch.full((TRIALS,), T), top_k=None if not top_k else torch.full((TRIALS,), top_k),
                           top_p=None if top_p == 1 else torch.full((TRIALS,), top_p), vocab_size=V)
    laws = exact_laws(base, q, T, top_k, top_p)
    return md, qq, logits, sm, laws


def assert_law(tokens, laws, what):
    first, n = statistics(tokens)
    p_first = chi2_pvalue(first, laws[0])
    p_n = chi2_pvalue(n, laws[1])
    assert p_first > ALPHA and p_n > ALPHA, (
        f"{what}: chi-square p-values first token {p_first:.3g}, number accepted {p_n:.3g} (significance {ALPHA}, "
        f"{TRIALS} trials); first {first.tolist()} vs {(laws[0] * TRIALS).round().tolist()}, "
        f"n {n.tolist()} vs {(laws[1] * TRIALS).round().tolist()}")


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_law_ours(sampler, name):
    md, q, logits, sm, laws = sampled_case(name)
    torch.manual_seed(7)
    assert_law(run_ours(sampler, md, q, logits, sm), laws, f"ours, {name}")


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_law_vllm(sampler, fixed_expand, name):
    md, q, logits, sm, laws = sampled_case(name)
    torch.manual_seed(7)
    assert_law(run_vllm(sampler, md, q, logits, sm), laws, f"vLLM, {name}")


def mutant_sample(logits, q, T, top_k, top_p, gen):
    """A test-only sampler with the wrong acceptance rule: accept draft d with probability p(d)
    (q ignored), otherwise sample the right residual.  [TRIALS, K + 1] like vLLM's output."""
    K = len(DRAFTS)
    p = warp64(logits, T, top_k, top_p)
    qd = torch.nn.functional.one_hot(torch.tensor(DRAFTS), V).double() if q is None else q.double()
    out = torch.full((TRIALS, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    alive = torch.ones(TRIALS, dtype=torch.bool)
    for j, d in enumerate(DRAFTS):
        u = torch.rand(TRIALS, generator=gen, dtype=torch.float64)
        acc = alive & (u < p[j, d])
        r = torch.clamp(p[j] - qd[j], min=0)
        rec = torch.multinomial(r.float() / r.sum(), TRIALS, replacement=True, generator=gen)
        rej = alive & ~acc
        out[acc, j] = d
        out[rej, j] = rec[rej].int()
        alive = acc
    bonus = torch.multinomial(p[K].float(), TRIALS, replacement=True, generator=gen)
    out[alive, K] = bonus[alive].int()
    return out


@pytest.mark.parametrize("name", ["T=1", "T=0.7,top_k=5"])
def test_chi_square_catches_a_wrong_acceptance_rule(name):
    T, top_k, top_p, _ = CASES[name]
    md, q, logits, sm, laws = sampled_case(name)
    tokens = mutant_sample(logits[:len(DRAFTS) + 1], q[:len(DRAFTS)], T, top_k, top_p, torch.Generator().manual_seed(3))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_law(tokens, laws, f"mutant, {name}")


def test_seeded_requests_are_reproducible_and_batch_invariant(sampler):
    """A request's generator gives its row the same tokens whatever the other rows are."""
    md, q, logits, sm, _ = sampled_case("T=1")
    n = 64
    md = spec_metadata([DRAFTS] * n)
    logits, q = logits[:n * (len(DRAFTS) + 1)], q[:n * len(DRAFTS)]

    def run(other_seed):
        gens = {5: torch.Generator().manual_seed(99)}
        torch.manual_seed(other_seed)
        return run_ours(sampler, md, q, logits, sampling_metadata(torch.ones(n), generators=gens))

    a, b = run(0), run(1)
    assert torch.equal(a[5], b[5])
    assert not torch.equal(a, b)


@pytest.mark.parametrize("reason", ["logprobs", "penalties", "negative draft"])
def test_unsupported_features_fall_back_to_vllm(sampler, reason, monkeypatch):
    md, q, logits = ragged_case(1)
    sm = sampling_metadata(None)
    if reason == "logprobs":
        sm.max_num_logprobs = 0
    elif reason == "penalties":
        sm.no_penalties = False
    else:
        md.draft_token_ids[0] = -1
    assert sv.fallback_reason(sampler, md, q, logits, sm) is not None
    called = []
    monkeypatch.setattr(sv, "fused_rejection_sample", lambda *a, **k: called.append(1))
    if reason == "penalties":
        return  # the reason is enough: vLLM's penalties need prompt tensors this case does not build
    sv.fused_forward(sampler, md, q, logits.clone(), sm)
    assert not called


def test_bad_layout_is_named(sampler):
    md, q, logits = ragged_case(2)
    with pytest.raises(ValueError, match=r"logits must be \[num_tokens \+ B, V\]"):
        sv.fused_rejection_sample(md, q, logits[:-1], sampling_metadata(None))


def test_bench_verify_vllm_providers_agree():
    """bench/ops/bench_verify.py's vllm_sampler and vllm_plugin providers time the same step: on a
    greedy case they emit the same tokens, and those are fused_packed's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "ops" / "bench_verify.py"
    spec = importlib.util.spec_from_file_location("bench_verify_for_vllm", path)
    bv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bv)
    logits, x, q = bv.make_inputs(3, 2, 40, torch.float32, torch.device("cpu"), drafts="sampled")
    prov = bv.build_providers(logits, x, q, 0.0, False, torch.device("cpu"), {"fn": None})
    theirs = prov["vllm_sampler"]().sampled_token_ids
    ours = prov["vllm_plugin"]().sampled_token_ids
    packed = prov["fused_packed"]()
    assert torch.equal(theirs, ours)
    assert torch.equal(ours.long(), packed.tokens.long())


def test_metadata_builders_name_bad_arguments():
    with pytest.raises(TypeError, match=r"drafts must be a list of token-id lists"):
        sv.spec_decode_metadata([[1, "a"]])
    with pytest.raises(TypeError, match=r"drafts must be a list of token-id lists .* got \[\[-1\]\]"):
        sv.spec_decode_metadata([[-1]])
    with pytest.raises(ValueError, match=r"temperature must be None or \[B\] finite values >= 0"):
        sv.sampling_metadata([1.0, -1.0])
