"""Tests of SpeculativeDecoder on small random-weight Llama models built here (CPU, fp32).

What is checked, and how:
- greedy output equals ``target.generate(do_sample=False)`` token for token (batch 1 and a
  ragged batch, K in {1, 3, 8} and "auto", model and prompt-lookup drafters);
- sampling is exact: the joint distribution of the first two generated tokens over many seeds
  matches the target's closed-form distribution (chi-square, significance level 1e-3), and the
  same test rejects the draft's own distribution (so it has the power to see a mistake);
- batch invariance (greedy and seeded sampling): a row of a batch equals its prompt alone;
- cache rollback: after each step both caches equal a fresh forward over each row's prefix;
- nothing is recomputed: every forward is wrapped and its fed tokens counted;
- EOS, stop strings, max_new_tokens, bad input (each error with ``match=``), stats, the CLI.
"""

from __future__ import annotations

import copy
import functools
import inspect
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from scipy import stats as sps
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdec_kernels import reference
from specdec_kernels.cli import build_tiny_random_pair, main as cli_main, tiny_char_tokenizer
from specdec_kernels.decoder import _PREFILL_GROUP_COST, SpeculativeDecoder, _prefill_groups
from specdec_kernels.draft_sampling import _draft_key, _draft_uniforms, _sample_inverse_cdf, warp_probs
from specdec_kernels.drafters import PromptLookupDrafter, prompt_lookup
from specdec_kernels.stats import choose_num_draft_tokens, expected_tokens_per_step, predicted_speedup

# Cache comparisons are fp32 values computed by two different call patterns (batched, masked,
# appended step by step vs one fresh forward): helpers.TOLERANCES[torch.float32] plus headroom
# for the different reduction orders of sdpa over padded vs unpadded keys.
CACHE_ATOL, CACHE_RTOL = 1e-5, 1e-4
# Chi-square tests: fail when the p-value is below this (fixed seeds, so the outcome is fixed).
SIGNIFICANCE = 1e-3

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The machine is shared; one intra-op thread is also the fastest for these tiny models."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _llama(V: int, hidden: int, layers: int, init: float, seed: int, max_pos: int = 128) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=init, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


def _perturbed(model, noise: float, seed: int):
    """A draft: the target with Gaussian noise on every weight."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return d


@pytest.fixture(scope="module")
def pair():
    """V = 32; init std 0.2 makes the logits peaked (no near-ties for greedy); noise 0.01 gives
    alpha around 0.7 under greedy decoding."""
    target = _llama(32, 32, 2, 0.2, seed=0)
    return _perturbed(target, 0.01, seed=1), target


@pytest.fixture(scope="module")
def greedy_refs(pair):
    """target.generate(do_sample=False) for each prompt alone: 24 new tokens."""
    _, target = pair
    with torch.inference_mode():
        return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


class _Recorder:
    """Records (input_ids, attention_mask, position_ids) of forwards.  A call without an
    attention mask (the decoder omits it when no column is padding) is recorded with the
    all-valid mask it stands for, over the cache's columns plus the new ones, and counted in
    ``unmasked``."""

    def __init__(self):
        self.calls = []
        self.unmasked = 0

    def record(self, cache, ids, mask, positions):
        if mask is None:
            mask = torch.ones((ids.shape[0], cache.get_seq_length() + ids.shape[1]), dtype=torch.long)
            self.unmasked += 1
        self.calls.append((ids.clone(), mask.to(torch.long, copy=True), positions.clone()))


class _CountingForward(_Recorder):
    """Every forward the decoder runs on one of its models (``which``: "target" or "draft"),
    recorded at the boundary where it hands them to the model: ``_Runner.forward`` (the model's
    own forward: the prefill, and the steps when the lean path is off) and ``LeanLlamaStep.step``
    (the decode steps of a Llama on the CPU, which test_lean_forward.py proves equal to the
    model's forward, bit for bit); ``lean`` counts the calls that took the lean path."""

    def __init__(self, dec, which: str):
        super().__init__()
        self.runner = r = dec._t if which == "target" else dec._d
        self.lean = 0
        dec._refresh_lean()  # what generate() does first: the lean step object it will use
        orig_forward = r.forward

        def forward(cache, ids, mask, positions, start, keep):
            self.record(cache, ids, mask, positions)
            return orig_forward(cache, ids, mask, positions, start, keep)

        r.forward = forward
        self.lean_step = r.lean
        if r.lean is not None:
            orig_step = r.lean.step

            def step(cache, ids, mask, positions, keep, head=None):
                self.record(cache, ids, mask, positions)
                self.lean += 1
                return orig_step(cache, ids, mask, positions, keep, head=head)

            r.lean.step = step

    def restore(self):
        del self.runner.forward
        if self.lean_step is not None:
            del self.lean_step.step


class _CountingModelForward(_Recorder):
    """Wraps model.forward itself (for the path without the lean step, where every call
    reaches the model's forward)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        orig = model.forward

        @functools.wraps(orig)
        def forward(*args, **kwargs):
            self.record(kwargs.get("cache", kwargs.get("past_key_values")), kwargs["input_ids"],
                        kwargs.get("attention_mask"), kwargs["position_ids"])
            return orig(*args, **kwargs)

        model.forward = forward

    def restore(self):
        del self.model.forward


# ----------------------------------------------------------------------------------------------
# 1. Greedy equals target.generate
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_greedy_matches_generate_ragged_batch(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, max_draft_tokens=6)
    assert res.token_ids == greedy_refs
    assert res.finish_reasons == ["length"] * len(PROMPTS)
    s = res.stats
    assert 0.2 < s.alpha < 0.95, s.alpha  # the draft is neither useless nor perfect
    # Ragged acceptance really happened: some step's rows accepted different numbers.
    assert any(len(set(h["accepted"])) > 1 for h in s.history)
    assert sum(s.accepted_length_histogram) == s.row_steps
    assert s.generated_tokens == 24 * len(PROMPTS)
    if k == "auto":
        # K in 1..6, less only where every row's budget is nearly spent (K_b <= budget - 1).
        assert all(1 <= h["k"] <= 6 or h["num_draft"] == [0] * len(h["rows"]) for h in s.history)


def _synthetic_times(monkeypatch, slope: float, seen: list):
    """Replace the decoder's measured times by T_draft = 0.02 per forward and a target step of
    1 + slope * K for K drafts (no timing in tests); ``seen`` collects (K, first_step)."""
    import specdec_kernels.stats as stats_mod

    orig = stats_mod.StatsRecorder.record_times

    def record_times(self, t_draft_total, n_draft_forwards, t_target, first_step, k=None, draft_typical=True):
        seen.append((k, first_step))
        orig(self, 0.02 * n_draft_forwards, n_draft_forwards, 1.0 + slope * k, first_step, k=k,
             draft_typical=draft_typical)

    monkeypatch.setattr(stats_mod.StatsRecorder, "record_times", record_times)


def test_greedy_auto_k_follows_the_verify_cost(pair, greedy_refs, monkeypatch):
    """K="auto" with a flat verify cost drafts more than with a steep one; where verifying one
    draft costs as much as two plain steps it mostly takes K = 0 (the target alone; the draft's
    tokens wait), with a step at K >= 1 at least every ZERO_REFRESH + 1; all reproduce
    target.generate exactly; the recorder receives each step's K."""
    from specdec_kernels.stats import ZERO_REFRESH

    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    mean_k = {}
    for slope in (0.0, 0.3, 1.0):
        seen = []
        with monkeypatch.context() as m:
            _synthetic_times(m, slope, seen)
            res = dec.generate(PROMPTS, max_new_tokens=40, num_draft_tokens="auto", max_draft_tokens=6)
        assert res.token_ids == [dec.generate_target_only([p], max_new_tokens=40).token_ids[0] for p in PROMPTS]
        assert [r[:24] for r in res.token_ids] == greedy_refs, slope
        ks = [h["k"] for h in res.stats.history]
        assert [k for k, _ in seen] == ks  # record_times gets the step's own K
        mean_k[slope] = res.stats.mean_num_draft_tokens
        if slope == 0.0:
            assert max(ks) == 6, ks
        elif slope == 0.3:  # T(K) = 1 + 0.3 K: drafts pay, so K = 0 is never even tried
            assert ks[:-2] and all(k >= 1 for k in ks[:-2]), ks
        else:  # T(K) = 1 + K: one draft costs a step and returns 0.6-0.7 of a token: K = 0
            zeros = ks[4:-2]
            assert zeros.count(0) >= 0.8 * len(zeros) and len(zeros) > ZERO_REFRESH, ks
            runs = "".join("0" if k == 0 else "x" for k in ks[4:]).split("x")
            assert max(len(r) for r in runs) <= ZERO_REFRESH and "x" in "".join(
                "0" if k == 0 else "x" for k in ks[4:]), ks  # refreshed
    assert mean_k[0.0] > mean_k[0.3] + 2 > mean_k[1.0] + 2, mean_k


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_matches_generate_batch1(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    for i in (0, 2):
        res = dec.generate([PROMPTS[i]], max_new_tokens=24, num_draft_tokens=k)
        assert res.token_ids == [greedy_refs[i]]


def test_greedy_tensor_prompts_with_left_padding_mask(pair, greedy_refs):
    """[B, T] ids with an attention mask (HF's left padding) are taken row by row."""
    draft, target = pair
    T = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(PROMPTS), T), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    res = SpeculativeDecoder(draft=draft, target=target).generate(ids, attention_mask=mask, max_new_tokens=24)
    assert res.token_ids == greedy_refs


def test_target_only_baseline_matches_generate(pair, greedy_refs):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    base = dec.generate_target_only(PROMPTS, max_new_tokens=24)
    assert base.token_ids == greedy_refs
    assert base.stats.iterations == 24 and base.stats.drafted_tokens == 0
    res = dec.generate(PROMPTS, max_new_tokens=24, baseline_tokens_per_s=base.stats.tokens_per_s)
    assert res.stats.measured_speedup == pytest.approx(res.stats.tokens_per_s / base.stats.tokens_per_s)
    assert res.stats.predicted_speedup is not None and res.stats.predicted_speedup > 0


def test_padded_target_vocabulary(pair):
    """A target whose vocabulary is padded beyond the draft's (Vd < V): drafts pass [B, K, Vd]."""
    _, target = pair
    big = _llama(40, 32, 2, 0.2, seed=0)
    with torch.no_grad():  # the target's weights; padded ids 32..39 embed to 0 and get logit 0
        big_params = dict(big.named_parameters())
        for name, p in target.named_parameters():
            q = big_params[name]
            q.zero_()
            q[: p.shape[0]].copy_(p)
    draft = _perturbed(target, 0.01, seed=1)
    with torch.inference_mode():
        refs = [big.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                             pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    dec = SpeculativeDecoder(draft=draft, target=big)
    assert dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=3).token_ids == refs
    res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=3, temperature=1.0, seed=3)
    assert all(len(t) == 16 for t in res.token_ids)
    # Padded ids were sampled, and fed back to a draft that cannot embed them (it sees id 31).
    assert any(t >= 32 for row in res.token_ids for t in row)


# ----------------------------------------------------------------------------------------------
# 2. Sampling is exact: chi-square against the target's closed-form distribution
# ----------------------------------------------------------------------------------------------
def _naive_warp(logits: list, temperature: float, top_k, top_p) -> list:
    """The warp written out by hand in float64 (independent of the package's code)."""
    V = len(logits)
    s = [x / temperature for x in logits]
    keep = set(range(V))
    if top_k:
        kth = sorted(s, reverse=True)[top_k - 1]
        keep = {v for v in keep if s[v] >= kth}
    m = max(s[v] for v in keep)
    w = {v: math.exp(s[v] - m) for v in keep}
    if top_p is not None and top_p < 1:
        z = sum(w.values())
        keep = {v for v in keep if sum(w[u] for u in keep if s[u] > s[v]) / z < top_p}
    z = sum(w[v] for v in keep)
    return [w[v] / z if v in keep else 0.0 for v in range(V)]


def _first_two_joint(model, prompt, temperature, top_k, top_p) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1): [V, V] float64, in closed form."""
    with torch.inference_mode():
        l1 = model(torch.tensor([prompt])).logits[0, -1].double().tolist()
        V = len(l1)
        ext = torch.tensor([prompt + [t] for t in range(V)])
        l2 = model(ext).logits[:, -1].double().tolist()
    p1 = _naive_warp(l1, temperature, top_k, top_p)
    return torch.tensor([[p1[a] * q for q in _naive_warp(l2[a], temperature, top_k, top_p)] for a in range(V)],
                        dtype=torch.float64)


def _chisquare_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of counts against probabilities; cells expected < 5 are pooled.
    Cells of probability 0 must be empty (asserted by the caller)."""
    n = observed.sum().item()
    exp = probs.flatten() * n
    obs = observed.flatten().double()
    pos = exp > 0
    exp, obs = exp[pos], obs[pos]
    small = exp < 5
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
    assert exp.numel() >= 2, "a chi-square test needs at least two cells"
    return float(sps.chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item()).pvalue)


@pytest.mark.parametrize("temperature,top_k,top_p,k,vocab", [
    (1.0, None, None, 2, None),
    (0.7, 4, None, 1, None),
    (1.0, 6, 0.9, 3, None),
    # a draft vocabulary: the draft never proposes 1, 4 or 7; the residual must supply them
    (1.0, None, None, 2, [0, 2, 3, 5, 6]),
    (0.7, 4, None, 3, [0, 2, 3, 5, 6]),
    # rows stop drafting on the draft's confidence (different K_b per row)
    (1.0, None, None, "conf", None),
    # "auto" choosing K = 0 (no draft forward: its tokens wait), then K = 1, which feeds them
    (1.0, None, None, "zero", None),
])
def test_sampling_matches_target_distribution(temperature, top_k, top_p, k, vocab):
    V, N = 8, 4000
    target = _llama(V, 16, 2, 0.3, seed=0, max_pos=64)
    draft = _perturbed(target, 0.05, seed=1)  # alpha ~ 0.5: rejections, recoveries and bonuses
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(draft=draft, target=target, draft_vocab=vocab)
    # "conf": K = 3 with the confidence rule, 4 new tokens (so K is not cut by the budget) of which
    # the first two are tested
    conf = dict(num_draft_tokens=3, draft_confidence=0.1) if k == "conf" else dict(num_draft_tokens=k)
    if k == "zero":
        from specdec_kernels.stats import StatsRecorder

        conf = dict(num_draft_tokens="auto")
        chosen = iter([0, 1, 1])
        orig_choose = StatsRecorder.choose_k
        StatsRecorder.choose_k = lambda self, k_max, allow_zero=False: next(chosen)
    # One batch of N copies of the prompt: row p samples with seed 1000 + p.
    try:
        res = dec.generate([prompt] * N, max_new_tokens={"conf": 4, "zero": 3}.get(k, 2),
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=1000, **conf)
    finally:
        if k == "zero":
            StatsRecorder.choose_k = orig_choose
    if k == "conf":  # in the first step, rows verified 1, 2 and 3 drafts
        assert set(res.stats.history[0]["num_draft"]) == {1, 2, 3}
    if k == "zero":  # a K = 0 step (no draft forward), then steps that verified a draft
        ks = [h["k"] for h in res.stats.history]
        assert ks[:2] == [0, 1] and res.stats.draft_forwards == sum(ks) >= 1
    toks = torch.tensor([t[:2] for t in res.token_ids])  # [N, 2]
    assert toks.shape == (N, 2)
    assert 0.1 < res.stats.alpha < 0.95
    observed = torch.zeros((V, V), dtype=torch.int64)
    observed.index_put_((toks[:, 0], toks[:, 1]), torch.ones(N, dtype=torch.int64), accumulate=True)

    joint = _first_two_joint(target, prompt, temperature, top_k, top_p)  # [V, V]
    assert observed[joint == 0].sum() == 0  # tokens removed by top-k/top-p never appear
    if vocab is not None:  # the tokens the draft cannot propose are emitted (from the residual)
        outside = torch.ones(V, dtype=torch.bool)
        outside[vocab] = False
        assert joint.sum(1)[outside].sum() > 0.05
        assert observed.sum(1)[outside].sum() > 0
    p_first = _chisquare_pvalue(observed.sum(1), joint.sum(1))
    p_joint = _chisquare_pvalue(observed, joint)
    assert p_first > SIGNIFICANCE, p_first
    assert p_joint > SIGNIFICANCE, p_joint

    # Power: had the decoder emitted the draft's samples, the same test would reject them.
    q_joint = _first_two_joint(draft, prompt, temperature, top_k, top_p)
    pseudo = (q_joint * N).round().to(torch.int64)
    pseudo[joint == 0] = 0
    assert _chisquare_pvalue(pseudo, joint) < SIGNIFICANCE


def test_prompt_lookup_sampling_first_token_distribution():
    """Deterministic drafts (draft_probs=None) with sampling: the first token is still p."""
    V, N = 8, 3000
    target = _llama(V, 16, 2, 0.3, seed=0, max_pos=64)
    prompt = [3, 3, 3, 3]  # lookup proposes 3, 3, ...: a frequent token here, so some are accepted
    res = SpeculativeDecoder(target=target).generate([prompt] * N, max_new_tokens=1, num_draft_tokens=2,
                                                     temperature=1.0, seed=7)
    first = torch.tensor([t[0] for t in res.token_ids])
    observed = torch.bincount(first, minlength=V)
    p1 = torch.tensor(_first_two_joint(target, prompt, 1.0, None, None).sum(1).tolist())
    assert _chisquare_pvalue(observed, p1) > SIGNIFICANCE


# ----------------------------------------------------------------------------------------------
# 3. Batch invariance
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_equals_prompt_decoded_alone(pair, temperature):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, top_k=20 if temperature else None)
    batch = dec.generate(PROMPTS, seed=50, **kw)
    for i, p in enumerate(PROMPTS):
        alone = dec.generate([p], seed=50 + i, **kw)  # row i of a call uses seed + i
        assert alone.token_ids[0] == batch.token_ids[i], i
    if temperature:  # the seed matters
        assert dec.generate(PROMPTS, seed=51, **kw).token_ids != batch.token_ids


# ----------------------------------------------------------------------------------------------
# 4. Cache rollback
# ----------------------------------------------------------------------------------------------
def _fresh_cache(model, ids: list) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    # transformers >= 5.2x names the argument cache; earlier 5.x past_key_values.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), use_cache=True, **{kw: cache})
    return cache


def _assert_row_equals(cache, b: int, length: int, ref) -> None:
    """Row b's first ``length`` columns of every layer of ``cache`` = the one row of ``ref``."""
    for layer, ref_layer in zip(cache.layers, ref.layers):
        torch.testing.assert_close(layer.keys[b, :, :length], ref_layer.keys[0], atol=CACHE_ATOL, rtol=CACHE_RTOL)
        torch.testing.assert_close(layer.values[b, :, :length], ref_layer.values[0], atol=CACHE_ATOL,
                                   rtol=CACHE_RTOL)


def _assert_row_cache(cache, b: int, length: int, model, ids: list):
    assert len(ids) == length
    _assert_row_equals(cache, b, length, _fresh_cache(model, ids))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_equal_fresh_forward_after_each_step(pair, temperature):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    st = dec._start(PROMPTS, 30, 4, temperature, None, None, 0, None, False, None, 4, None, False,
                    target_only=False)
    caught_up = 0
    with torch.inference_mode():
        dec._prefill(st)
        for _ in range(5):
            dec._step(st)
            assert st.tc.get_seq_length() == max(st.lt_host)
            assert st.dc.get_seq_length() == max(st.ld_host)
            for b, p in enumerate(st.rows):
                seq = st.seqs[p]
                # The target caches everything but the last emitted token; the draft also lacks
                # x_K when the row accepted all K drafts (it catches up next step).
                assert st.lt_host[b] == len(seq) - 1
                assert st.ld_host[b] == len(seq) - 1 - int(st.catch_host[b])
                caught_up += int(st.catch_host[b])
                _assert_row_cache(st.tc, b, st.lt_host[b], target, seq[: st.lt_host[b]])
                _assert_row_cache(st.dc, b, st.ld_host[b], draft, seq[: st.ld_host[b]])
    assert caught_up > 0  # the catch-up path was exercised


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_steps_without_drafts(pair, temperature):
    """K = 0 steps chosen by "auto" run no draft forward: the tokens the draft has not taken
    (catch-up included) wait, right-aligned, and its next step with drafts feeds them in one
    block before its drafts.  After each step both caches equal a fresh forward over the prefix,
    and what waits, the catch-up token and ``last`` are exactly the rest of the row."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    st = dec._start(PROMPTS, 30, "auto", temperature, None, None, 0, None, False, None, 4, None, False,
                    target_only=False)
    pattern = [4, 0, 0, 3, 0, 4, 0, 2, 0, 0, 0, 1]
    ks = iter(pattern)
    st.recorder.choose_k = lambda k_max, allow_zero=False: next(ks)
    fed = []
    orig = dec._d.step
    dec._d.step = lambda *a, **kw: fed.append(1) or orig(*a, **kw)
    zero_after_catch = waited_most = 0
    with torch.inference_mode():
        dec._prefill(st)
        for k in pattern:
            catch_before = any(st.catch_host)
            fed.clear()
            dec._step(st)
            assert st.recorder.stats.history[-1]["k"] == k
            if k == 0:
                assert not fed  # no draft forward at all
                zero_after_catch += int(catch_before)
                assert not any(st.catch_host)  # the catch-up token waits with the rest
            else:
                assert len(fed) == k and st.wait is None  # one block, then a forward per draft
            for b, p in enumerate(st.rows):
                seq = st.seqs[p]
                assert st.lt_host[b] == len(seq) - 1
                ld = st.ld_host[b]
                w = 0 if st.wait is None else st.wait_host[b]
                waiting = [] if w == 0 else st.wait[b, -w:].tolist()
                catch = [int(st.catch[b])] if st.catch_host[b] else []
                assert waiting + catch + [int(st.last[b])] == seq[ld:]
                waited_most = max(waited_most, w)
                _assert_row_cache(st.tc, b, st.lt_host[b], target, seq[: st.lt_host[b]])
                _assert_row_cache(st.dc, b, ld, draft, seq[:ld])
    assert zero_after_catch > 0  # a K = 0 step came after a row's catch-up token
    assert waited_most >= 3  # tokens waited through several K = 0 steps


# Prompts whose lengths differ enough for the prefill to run in groups (tokens to cache: 1, 29,
# 0, 11, 11 -> groups [1, 11, 11], [29] at the CPU's fixed cost of 12 tokens per forward).
SKEWED = [[1, 2], list(range(1, 31)), [3], list(range(2, 14)), list(range(5, 17))]


def test_prefill_groups_are_optimal_partitions():
    """_prefill_groups against brute force over every partition of the rows (not only runs of
    consecutive lengths): same cost; each row with tokens in exactly one group, the others in none."""
    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for i in range(len(part)):
                yield part[:i] + [[first] + part[i]] + part[i + 1:]
            yield [[first]] + part

    def cost(groups, lens, fixed):
        return sum(fixed + len(g) * max(lens[i] for i in g) for g in groups)

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 7, (), generator=g))
        lens = torch.randint(0, 40, (n,), generator=g).tolist()
        fixed = [0, 1, 8, 30, 4096][trial % 5]
        groups = _prefill_groups(lens, fixed)
        rows = sorted(i for grp in groups for i in grp)
        assert rows == [i for i in range(n) if lens[i] > 0], (lens, groups)
        nonzero = [i for i in range(n) if lens[i] > 0]
        best = min(cost(p, lens, fixed) for p in partitions(nonzero)) if nonzero else 0
        assert cost(groups, lens, fixed) == best, (lens, fixed, groups)
    assert _prefill_groups([1, 29, 0, 12, 11], 8) == [[0], [3, 4], [1]]
    assert _prefill_groups([1, 29, 0, 12, 11], 4096) == [[0, 1, 3, 4]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grouped_prefill_caches_and_outputs(pair, temperature):
    """Skewed prompt lengths: the prefill runs one forward per group, the stacked caches equal a
    fresh forward over each row's prefix (after the prefill and after every step), and every
    row's output equals the prompt decoded alone (greedy: equals target.generate)."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    st = dec._start(SKEWED, 12, 3, temperature, None, None, 7, None, False, None, 3, None, False,
                    target_only=False)
    tc = _CountingForward(dec, "target")
    try:
        with torch.inference_mode():
            dec._prefill(st)
    finally:
        tc.restore()
    groups = _prefill_groups([len(p) - 1 for p in SKEWED], _PREFILL_GROUP_COST["cpu"])
    assert len(groups) > 1
    assert [tuple(c[0].shape) for c in tc.calls] == [(len(g), max(len(SKEWED[i]) - 1 for i in g)) for g in groups]
    with torch.inference_mode():
        for b, p in enumerate(st.rows):
            if st.lt_host[b]:
                _assert_row_cache(st.tc, b, st.lt_host[b], target, st.seqs[p][: st.lt_host[b]])
                _assert_row_cache(st.dc, b, st.ld_host[b], draft, st.seqs[p][: st.ld_host[b]])
        for _ in range(4):
            dec._step(st)
            for b, p in enumerate(st.rows):
                _assert_row_cache(st.tc, b, st.lt_host[b], target, st.seqs[p][: st.lt_host[b]])
                _assert_row_cache(st.dc, b, st.ld_host[b], draft, st.seqs[p][: st.ld_host[b]])
    kw = dict(max_new_tokens=12, num_draft_tokens=3, temperature=temperature)
    batch = dec.generate(SKEWED, seed=7, **kw)
    for i, p in enumerate(SKEWED):
        alone = dec.generate([p], seed=7 + i, **kw)
        assert alone.token_ids[0] == batch.token_ids[i], i
        if temperature == 0:
            with torch.inference_mode():
                ref = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=0)
            assert batch.token_ids[i] == ref[0, len(p):].tolist(), i


# ----------------------------------------------------------------------------------------------
# 5. Nothing is recomputed: count what each model is fed
# ----------------------------------------------------------------------------------------------

def test_a_batch_without_padding_runs_without_a_mask(pair, greedy_refs):
    """One prompt: no cache column is ever padding, so after the prefill the decoder calls both
    models without an attention mask (their causal mask alone, the same logits), and the output
    still equals target.generate."""
    draft, target = pair
    i = max(range(len(PROMPTS)), key=lambda j: len(PROMPTS[j]))  # a prompt with a prefill
    dec = SpeculativeDecoder(draft=draft, target=target)
    tc, dc = _CountingForward(dec, "target"), _CountingForward(dec, "draft")
    try:
        res = dec.generate([PROMPTS[i]], max_new_tokens=24, num_draft_tokens=3)
    finally:
        tc.restore()
        dc.restore()
    assert res.token_ids == [greedy_refs[i]]
    assert len(tc.calls) > 2 and tc.unmasked == len(tc.calls) - 1  # all but the prefill
    assert len(dc.calls) > 2 and dc.unmasked == len(dc.calls) - 1
    assert tc.lean == len(tc.calls) - 1 and dc.lean == len(dc.calls) - 1  # the steps took the lean path


@pytest.mark.parametrize("path", ["lean", "model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_token_is_fed_once(pair, temperature, path):
    """Counted where the decoder hands tokens to each model (path "lean": the default, decode
    steps through LeanLlamaStep) and at the models' own forward (path "model": lean_forward=False)."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target, lean_forward=path == "lean")
    if path == "lean":
        tc, dc = _CountingForward(dec, "target"), _CountingForward(dec, "draft")
    else:
        tc, dc = _CountingModelForward(target), _CountingModelForward(draft)
    try:
        res = dec.generate(PROMPTS, max_new_tokens=20, num_draft_tokens=4, temperature=temperature, seed=3)
    finally:
        tc.restore()
        dc.restore()
    if path == "lean":
        assert tc.lean == len(tc.calls) - 1 and dc.lean == len(dc.calls) - 1  # all but the prefill
    hist = res.stats.history
    lens = {p: len(x) for p, x in enumerate(PROMPTS)}
    P = max(lens.values()) - 1
    # Prefill: every prompt token but the last, once, in both models.
    for calls in (tc.calls, dc.calls):
        ids, mask, pos = calls[0]
        assert ids.shape == (len(PROMPTS), P)
        assert mask.sum(1).tolist() == [max(lens[p] - 1, 1) for p in range(len(PROMPTS))]  # col 0 stands in
    assert len(tc.calls) == 1 + len(hist)
    assert len(dc.calls) == 1 + sum(h["k"] for h in hist)

    cached = {p: lens[p] - 1 for p in lens}  # tokens in the target cache
    d_cached = dict(cached)  # tokens in the draft cache
    prev_all = {p: False for p in lens}  # row accepted all K last step (draft must catch up)
    di = 1
    fed_t = fed_d = catch_ups = 0
    for s, h in enumerate(hist):
        K, rows = h["k"], h["rows"]
        # Draft: K forwards; the first feeds [x_K, last] for rows catching up, else [last].
        for j in range(K):
            ids, mask, pos = dc.calls[di + j]
            T = mask.shape[1] - ids.shape[1]
            if j == 0:
                assert ids.shape[1] == (2 if any(prev_all[p] for p in rows) else 1)
                catch_ups += sum(prev_all[p] for p in rows)
            else:
                assert ids.shape[1] == 1
            for b, p in enumerate(rows):
                new = mask[b, T:].bool()
                if j == 0:
                    assert mask[b, :T].sum().item() == d_cached[p]  # the cache holds each token once
                    assert new.sum().item() == 1 + prev_all[p]
                    assert pos[b, new][0].item() == d_cached[p]  # the first new token is the next position
                fed_d += new.sum().item()
        di += K
        # Target: exactly [last, x_1 .. x_K] at the positions after the cached tokens.
        ids, mask, pos = tc.calls[1 + s]
        T = mask.shape[1] - ids.shape[1]
        assert ids.shape == (len(rows), K + 1)
        for b, p in enumerate(rows):
            assert mask[b, :T].sum().item() == cached[p]
            assert mask[b, T:].all()
            assert pos[b].tolist() == list(range(cached[p], cached[p] + K + 1))
            n = h["accepted"][b]
            cached[p] += n + 1
            d_cached[p] += int(prev_all[p]) + min(n + 1, K)
            prev_all[p] = n == K
            fed_t += K + 1
    # Totals: the target saw each kept token once plus each rejected draft once.
    rejected = res.stats.drafted_tokens - res.stats.accepted_tokens
    steps_rows = res.stats.row_steps
    assert fed_t == sum(h["k"] * len(h["rows"]) for h in hist) + steps_rows
    assert fed_t == res.stats.accepted_tokens + steps_rows + rejected + sum(
        (h["k"] - kb) for h in hist for kb in h["num_draft"])
    assert fed_d > 0 and catch_ups > 0  # the two-column catch-up forward happened


# ----------------------------------------------------------------------------------------------
# Prompt lookup
# ----------------------------------------------------------------------------------------------
def test_prompt_lookup_function():
    assert prompt_lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # 3-gram match
    assert prompt_lookup([1, 2, 3, 4, 9, 9, 3], 2) == [4, 9]  # falls back to a 1-gram
    assert prompt_lookup([7, 1, 2, 8, 1, 2], 4) == [8, 1, 2]  # most recent match; stops at the end
    assert prompt_lookup([5, 5, 5], 4) == [5]  # a repeat proposes its own continuation
    assert prompt_lookup([1, 2, 3], 4) == []
    assert prompt_lookup([1], 4) == []
    assert PromptLookupDrafter().propose([[1, 2, 1], [3]], [2, 2]) == [[2, 1], []]


@pytest.mark.parametrize("k", [4, "auto"])
def test_prompt_lookup_greedy_matches_generate(pair, k):
    _, target = pair
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9], [5, 6, 5, 6, 5]]
    with torch.inference_mode():
        refs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=30,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    dec = SpeculativeDecoder(target=target)  # draft=None: prompt lookup
    assert dec.drafter == "prompt_lookup"
    res = dec.generate(prompts, max_new_tokens=30, num_draft_tokens=k)
    assert res.token_ids == refs
    assert res.stats.accepted_tokens > 0  # greedy random models repeat themselves: lookup pays off
    assert res.stats.mean_tokens_per_target_call > 1.0


# ----------------------------------------------------------------------------------------------
# Stopping: EOS, stop strings, max_new_tokens
# ----------------------------------------------------------------------------------------------
def test_eos_stops_only_its_row(pair, greedy_refs):
    draft, target = pair
    eos = greedy_refs[2][5]
    first = [r.index(eos) if eos in r else None for r in greedy_refs]
    res = SpeculativeDecoder(draft=draft, target=target).generate(PROMPTS, max_new_tokens=24, eos_token_id=eos)
    for i, r in enumerate(greedy_refs):
        if first[i] is None:
            assert res.token_ids[i] == r and res.finish_reasons[i] == "length"
        else:
            assert res.token_ids[i] == r[: first[i] + 1] and res.finish_reasons[i] == "eos"
    assert res.finish_reasons[2] == "eos"


@pytest.mark.parametrize("k", [1, 8])
def test_max_new_tokens_is_never_exceeded(pair, greedy_refs, k):
    draft, target = pair
    for m in (1, 2, 5):
        res = SpeculativeDecoder(draft=draft, target=target).generate(PROMPTS, max_new_tokens=m, num_draft_tokens=k)
        assert res.token_ids == [r[:m] for r in greedy_refs]
        assert res.stats.generated_tokens == m * len(PROMPTS)


@pytest.fixture(scope="module")
def tiny():
    draft, target, tok = build_tiny_random_pair(seed=0, noise=0.005)
    return SpeculativeDecoder(draft=draft, target=target, tokenizer=tok), tok


def test_stop_strings(tiny):
    dec, tok = tiny
    prompts = ["hello world", "the cat"]
    free = dec.generate(prompts, max_new_tokens=30, eos_token_id=[])
    text = free.texts[0]
    stop = text[6:9]
    ids = free.token_ids[0]
    end = next(j for j in range(len(ids) + 1) if stop in tok.decode(ids[:j], skip_special_tokens=True))
    res = dec.generate(prompts, max_new_tokens=30, stop=[stop, "will never appear ~"], eos_token_id=[])
    assert res.token_ids[0] == ids[:end]
    assert res.texts[0].endswith(stop) and stop not in res.texts[0][:-1]
    assert res.finish_reasons[0] == "stop"
    if stop not in free.texts[1]:
        assert res.token_ids[1] == free.token_ids[1]


def test_text_prompts_and_verbose(tiny):
    dec, tok = tiny
    buf = io.StringIO()
    res = dec.generate("The Capital of France is", max_new_tokens=12, num_draft_tokens=4, verbose=buf)
    ids = tok("The Capital of France is")["input_ids"]
    assert res.token_ids == dec.generate([ids], max_new_tokens=12, num_draft_tokens=4).token_ids
    out = buf.getvalue()
    assert "Drafted:  '" in out and "Accepted: '" in out
    assert " tokens)" in out and ("+ bonus: " in out or "+ recovered: " in out)


def test_verbose_tells_a_step_without_drafts(tiny, monkeypatch):
    """A K = 0 step ("auto") prints the target's own token as such, with no Drafted line."""
    from specdec_kernels.stats import StatsRecorder

    dec, _ = tiny
    ks = iter([0, 3, 0, 3, 3, 3, 3, 3])
    monkeypatch.setattr(StatsRecorder, "choose_k", lambda self, k_max, allow_zero=False: next(ks))
    buf = io.StringIO()
    res = dec.generate("The Capital of France is", max_new_tokens=8, num_draft_tokens="auto", verbose=buf)
    lines = buf.getvalue().splitlines()
    assert [h["k"] for h in res.stats.history][:3] == [0, 3, 0]
    step1 = [ln for ln in lines if ln.startswith("[step 1 |")]
    assert len(step1) == 1 and "+ target, no drafts: '" in step1[0]
    assert any(ln.startswith("[step 2 |") and "Drafted:  '" in ln for ln in lines)


# ----------------------------------------------------------------------------------------------
# Bad input: ValueError/TypeError naming the argument, before any model work
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(prompts=""), ValueError, r"prompts\[0\] must not be empty, got ''"),
    (dict(prompts=[]), ValueError, "prompts must hold at least one prompt"),
    (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\] must not be empty, got 0 tokens"),
    (dict(prompts=[[1, 99]]), ValueError, r"prompts\[0\] token ids must be in \[0, 32\), got 99"),
    (dict(prompts=["text"]), TypeError, "prompts given as text need a tokenizer"),
    (dict(prompts=[[1], [2, "x"]]), TypeError,
     r"prompts\[1\] must be a str or a list of int token ids, got a list holding a str \('x'\)"),
    (dict(prompts=[[1], 2.5]), TypeError, r"prompts\[1\] must be a str or a list of int token ids, got float"),
    (dict(prompts=[[1]] , max_new_tokens=0), ValueError, "max_new_tokens must be > 0, got 0"),
    (dict(prompts=[[1]], max_new_tokens=2.0), TypeError, "max_new_tokens must be an int, got float"),
    (dict(prompts=[[1]], num_draft_tokens=0), ValueError, "num_draft_tokens must be a positive int or 'auto', got 0"),
    (dict(prompts=[[1]], num_draft_tokens="fast"), ValueError, "num_draft_tokens must be a positive int or 'auto', got 'fast'"),
    (dict(prompts=[[1]], temperature=-0.5), ValueError, r"temperature must be finite and >= 0 \(0 = greedy\), got -0.5"),
    (dict(prompts=[[1]], top_k=-1), ValueError, r"top_k must be >= 0 \(0 = off\), got -1"),
    (dict(prompts=[[1]], top_p=0.0), ValueError, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    (dict(prompts=[[1]], stop="x"), ValueError, "stop strings need a tokenizer"),
    (dict(prompts=[[1], [2]], seed=[1]), ValueError, r"seed as a list must have one entry per prompt \(2\), got 1"),
    (dict(prompts=[list(range(30)) * 5]), ValueError,
     r"prompts\[0\] must fit the target's context \(max_position_embeddings = 128\), got 150 tokens"),
])
def test_bad_generate_arguments(pair, kwargs, exc, match):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    tc, dc = _CountingForward(dec, "target"), _CountingForward(dec, "draft")
    try:
        with pytest.raises(exc, match=match):
            dec.generate(**kwargs)
    finally:
        tc.restore()
        dc.restore()
    assert tc.calls == [] and dc.calls == []  # refused before any generation work


def test_bad_constructor_arguments(pair, tmp_path):
    draft, target = pair
    with pytest.raises(TypeError, match=r"target must be a model name/path or a PreTrainedModel, got None \(pass neither"):
        SpeculativeDecoder(draft=draft)
    with pytest.raises(ValueError, match="drafter must be one of"):
        SpeculativeDecoder(draft=draft, target=target, drafter="medusa")
    with pytest.raises(ValueError, match="draft and target must be on the same device, got draft on meta"):
        SpeculativeDecoder(draft=copy.deepcopy(draft).to("meta"), target=target)
    with pytest.raises(ValueError, match="the draft vocabulary must not exceed the target's: draft vocab_size = 40"):
        SpeculativeDecoder(draft=_llama(40, 32, 1, 0.2, seed=0), target=target)
    # Tokenizers from paths: a different vocabulary is refused before any weights load.
    tok = tiny_char_tokenizer()
    tok.save_pretrained(tmp_path / "target")
    other = tiny_char_tokenizer()
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="draft and target tokenizers must have the same vocabulary, got 52 vs 51"):
        SpeculativeDecoder(draft=str(tmp_path / "draft"), target=str(tmp_path / "target"))


def test_unusable_devices_are_refused_by_name(pair, capsys, monkeypatch):
    # a CUDA device on a machine (or a torch) without one: a ValueError naming it, not the
    # AssertionError from deep inside Module.to; a misspelt device: the same kind of error
    draft, target = pair
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device 'cuda' is not available: torch .* finds no CUDA GPU$"):
        SpeculativeDecoder(draft=draft, target=target, device="cuda")
    with pytest.raises(ValueError, match=r"^device must be a torch.device or a device name such as 'cpu' or "
                                         r"'cuda:0', got 'gpu0'$"):
        SpeculativeDecoder(draft=draft, target=target, device="gpu0")
    assert next(target.parameters()).device.type == "cpu"  # nothing moved
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--tiny-random", "--device", "cuda:1"])
    assert e.value.code == 2
    assert "device 'cuda:1' is not available" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^device 'cuda:1' is not available: torch finds 1 CUDA GPU\(s\)$"):
        SpeculativeDecoder(draft=draft, target=target, device="cuda:1")


def test_load_pair_from_paths(tiny, tmp_path):
    dec, tok = tiny
    for name, model in (("draft", dec.draft), ("target", dec.target)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    loaded = SpeculativeDecoder(draft=str(tmp_path / "draft"), target=str(tmp_path / "target"), dtype="float32")
    a = loaded.generate(["hello"], max_new_tokens=10)
    b = dec.generate(["hello"], max_new_tokens=10)
    assert a.texts == b.texts and a.token_ids == b.token_ids


# ----------------------------------------------------------------------------------------------
# Pieces: warp, draft random numbers, stats
# ----------------------------------------------------------------------------------------------
def test_warp_probs_matches_the_verifier_semantics():
    g = torch.Generator().manual_seed(0)
    B, V = 64, 17
    logits = (torch.randn(B, V, generator=g) * 2).round(decimals=0)  # many ties
    temp = torch.rand(B, generator=g) + 0.3
    top_k = torch.randint(0, V + 3, (B,), generator=g)
    top_p = torch.rand(B, generator=g).clamp(min=0.05)
    top_p[::4] = 1.0
    ours = warp_probs(logits, temp, top_k, top_p)
    s, keep = reference.warp_logits(logits, 1.0 / temp, top_k, top_p)
    m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    e = torch.where(keep, torch.exp(s - m), 0.0)
    torch.testing.assert_close(ours, e / e.sum(-1, keepdim=True))
    for b in range(8):  # and the hand-written float64 warp
        want = _naive_warp((logits[b] / 1.0).tolist(), float(temp[b]), int(top_k[b]) if 0 < top_k[b] <= V else None,
                           float(top_p[b]))
        torch.testing.assert_close(ours[b].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5)
    # Temperature 0: one-hot at the first maximum.
    tied = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert warp_probs(tied, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_nan_draft_logits_with_top_p_end_the_row_cleanly(pair):
    """A draft that emits NaN logits (top-p on, so the warp's sort/cumsum sees NaN) must not crash
    the warp (it gathered index -1 before) nor emit a token: its rows end as 'nonfinite'."""
    nan_logits = torch.tensor([[float("nan"), 1.0, 2.0], [0.5, 1.0, 2.0]])
    probs = warp_probs(nan_logits, 1.0, None, 0.9)  # no IndexError
    assert bool(probs[0].isnan().all()) and torch.allclose(probs[1].sum(), torch.tensor(1.0))
    draft, target = pair
    bad = copy.deepcopy(draft)
    with torch.no_grad():
        bad.lm_head.weight[3, 0] = float("nan")  # token 3's logit is NaN at every position
    res = SpeculativeDecoder(bad, target).generate(PROMPTS[:2], max_new_tokens=8, num_draft_tokens=3,
                                                   temperature=1.0, top_p=0.9, seed=0)
    assert res.finish_reasons == ["nonfinite", "nonfinite"]
    assert res.token_ids == [[], []]


def test_draft_sampler_is_uniform_and_exact():
    B = 20000
    keys = [_draft_key(s) for s in range(B)]
    lo = torch.tensor([k[0] for k in keys])
    hi = torch.tensor([k[1] for k in keys])
    u = _draft_uniforms(lo, hi, torch.full((B,), 3), 2)
    assert ((u >= 0) & (u < 1)).all()
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert sps.chisquare(counts.numpy()).pvalue > SIGNIFICANCE
    # Different draft positions and steps give unrelated numbers.
    u2 = _draft_uniforms(lo, hi, torch.full((B,), 3), 3)
    assert abs(float(torch.corrcoef(torch.stack([u, u2]))[0, 1])) < 0.05
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2]).expand(B, 4)
    x = _sample_inverse_cdf(probs, u)
    observed = torch.bincount(x, minlength=4)
    assert observed[1] == 0
    assert _chisquare_pvalue(observed, probs[0].double()) > SIGNIFICANCE


def test_speedup_model():
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert predicted_speedup(0.8, 4, 0.0, 1.0) == pytest.approx(expected_tokens_per_step(0.8, 4))
    assert choose_num_draft_tokens(0.9, 0.01, 1.0, 8) == 8
    assert choose_num_draft_tokens(0.1, 0.5, 1.0, 8) == 1
    k = choose_num_draft_tokens(0.7, 0.1, 1.0, 16)
    rate = lambda k: expected_tokens_per_step(0.7, k) / (k * 0.1 + 1.0)  # noqa: E731
    assert all(rate(k) >= rate(j) for j in range(1, 17))


def test_stats_are_consistent(pair):
    draft, target = pair
    res = SpeculativeDecoder(draft=draft, target=target).generate(PROMPTS, max_new_tokens=20, num_draft_tokens=4)
    s = res.stats
    assert s.iterations == len(s.history)
    assert s.row_steps == sum(len(h["rows"]) for h in s.history)
    assert s.generated_tokens == sum(len(t) for t in res.token_ids)
    assert s.accepted_tokens == sum(n * c for n, c in enumerate(s.accepted_length_histogram))
    assert s.drafted_tokens == sum(sum(h["num_draft"]) for h in s.history)
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)
    assert 0 < s.acceptance_per_position[0] <= 1
    assert s.mean_tokens_per_target_call == pytest.approx(s.generated_tokens / s.row_steps)
    assert s.draft_time_s > 0 and s.target_time_s > 0 and s.tokens_per_s > 0
    assert s.measured_speedup is None  # no baseline given
    d = s.to_dict()
    assert "history" not in d and json.dumps(d)


# ----------------------------------------------------------------------------------------------
# 6. CLI
# ----------------------------------------------------------------------------------------------
def test_cli_tiny_random_json(capsys):
    assert cli_main(["generate", "hello world", "the cat", "--tiny-random", "--json", "-k", "auto",
                     "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "10", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["texts"]) == 2 and all(len(t) <= 12 for t in out["token_ids"])
    assert out["stats"]["iterations"] > 0 and "alpha" in out["stats"]


def test_cli_requires_models(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--draft", "some/path"])
    assert e.value.code == 2
    assert "--draft needs --target (without both, the embedded default pair is used)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["generate", "hello", "--tiny-random", "-k", "0"])
    assert "must be a positive int or 'auto', got 0" in capsys.readouterr().err


def test_cli_chat(capsys):
    from specdec_kernels.cli import chat_ids

    tok = tiny_char_tokenizer()
    with pytest.raises(ValueError, match=r"^--chat needs a tokenizer with a chat template, got \w+ without one$"):
        chat_ids(tok, "hi")
    with pytest.raises(ValueError, match="--chat needs a tokenizer with a chat template, got no tokenizer"):
        chat_ids(None, "hi")
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert chat_ids(tok, "ab") == tok("[ab]>", add_special_tokens=False)["input_ids"]
    with pytest.raises(SystemExit) as e:  # the tiny random pair's tokenizer has no template
        cli_main(["generate", "hello", "--tiny-random", "--chat"])
    assert e.value.code == 2 and "--chat needs a tokenizer with a chat template" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "specdec_kernels", "generate", "abc", "--tiny-random", "--json",
                        "--max-new-tokens", "5", "--verbose"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["generated_tokens"] <= 5
    assert "Drafted:" in r.stderr  # --verbose goes to stderr when --json owns stdout


# ----------------------------------------------------------------------------------------------
# 7. Draft vocabulary: the draft proposes only some tokens; the output is still the target's
# ----------------------------------------------------------------------------------------------
VOCAB = [0, 1, 2, 3, 5, 8, 13, 21, 30]  # 9 of the pair's 32 tokens


class _DraftRecorder:
    """Records (X, Q) of every ``_draft_with_model`` call of a decoder, and in ``calls`` its K
    and the K_b it returned."""

    def __init__(self, dec):
        self.dec, self.out, self.calls = dec, [], []
        orig = dec._draft_with_model

        def wrapped(st, K):
            X, Q, catch_up, kb = orig(st, K)
            self.out.append((X.clone(), None if Q is None else Q.clone()))
            self.calls.append((K, None if kb is None else kb.clone()))
            return X, Q, catch_up, kb

        dec._draft_with_model = wrapped


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_draft_vocab_greedy_matches_generate(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k)
    assert res.token_ids == greedy_refs
    assert res.stats.accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_vocab_restricts_drafts_and_q(pair, temperature):
    draft, target = pair
    inside = torch.zeros(32, dtype=torch.bool)
    inside[VOCAB] = True
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, seed=5)
    full = _DraftRecorder(SpeculativeDecoder(draft=draft, target=target))
    full.dec.generate(PROMPTS, **kw)
    assert not all(inside[X].all() for X, _ in full.out)  # unrestricted, the draft proposes other tokens
    rec = _DraftRecorder(SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB))
    rec.dec.generate(PROMPTS, **kw)
    for X, Q in rec.out:
        assert inside[X].all()
        if temperature == 0:
            assert Q is None
            continue
        assert Q.shape == X.shape + (32,)
        assert (Q[..., ~inside] == 0).all()  # exactly zero where the draft cannot propose
        torch.testing.assert_close(Q.sum(-1), torch.ones(X.shape), atol=1e-5, rtol=0)
        assert (Q.gather(-1, X[..., None]) > 0).all()  # a sampled token had probability


def test_draft_vocab_greedy_drafts_are_the_restricted_argmax(pair):
    """At temperature 0 the draft proposes the argmax of its logits over the vocabulary: the
    first draft of a step (fed the prompt, nothing else) checked against the draft's own forward."""
    draft, target = pair
    rec = _DraftRecorder(SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB))
    rec.dec.generate(PROMPTS, max_new_tokens=2, num_draft_tokens=1)
    X = rec.out[0][0]  # the first step's drafts
    with torch.inference_mode():
        for b, p in enumerate(PROMPTS):
            logits = draft(torch.tensor([p])).logits[0, -1]
            assert X[b, 0].item() == VOCAB[int(logits[VOCAB].argmax())]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_vocab_paths_and_batch_invariance(pair, temperature):
    draft, target = pair
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, top_k=20 if temperature else None)
    lean = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB)
    model = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB, lean_forward=False)
    batch = lean.generate(PROMPTS, seed=50, **kw)
    assert lean.lean_status()["draft"] is None and lean._d.head is not None  # the subset output layer ran
    assert model._d.head is None
    assert model.generate(PROMPTS, seed=50, **kw).token_ids == batch.token_ids
    for i, p in enumerate(PROMPTS):
        assert lean.generate([p], seed=50 + i, **kw).token_ids[0] == batch.token_ids[i], i


@pytest.mark.parametrize("cpu_linear", ["skinny", "torch"])
def test_draft_vocab_logits_are_the_output_layer_rows(pair, cpu_linear):
    """The lean step with the vocabulary's rows of the output layer gives the full logits'
    columns, bit for bit (skinny_linear sums each output in a fixed order; torch's linear
    within a tolerance)."""
    from specdec_kernels._ext import HAS_EXT
    from specdec_kernels.kv_cache import _new_cache

    if cpu_linear == "skinny" and not HAS_EXT:
        pytest.skip("cpu_linear='skinny' needs the C++ extension (not built)")
    draft, target = pair
    sub = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB, cpu_linear=cpu_linear)
    full = SpeculativeDecoder(draft=draft, target=target, cpu_linear=cpu_linear)
    ids = torch.tensor([[4, 9, 17, 2, 6]])
    outs = []
    with torch.inference_mode():
        for dec in (sub, full):
            cache = _new_cache(draft)
            dec._d.forward(cache, ids[:, :4], None, torch.arange(4)[None], 0, 1)
            with dec._linear_layers():
                outs.append(dec._d.step(cache, ids[:, 4:], None, torch.tensor([[4]]), 4, 1))
    assert outs[0].shape == (1, 1, len(VOCAB))
    if cpu_linear == "skinny":
        assert torch.equal(outs[0], outs[1][..., VOCAB])
    else:
        torch.testing.assert_close(outs[0], outs[1][..., VOCAB], atol=1e-6, rtol=1e-6)


def test_draft_vocab_follows_the_weights(pair):
    """The output layer's rows are taken again at each generate: a change to the draft's weights
    between calls is used."""
    draft, target = pair
    d = copy.deepcopy(draft)
    dec = SpeculativeDecoder(draft=d, target=target, draft_vocab=VOCAB)
    dec.generate([[1, 2]], max_new_tokens=2)
    with torch.no_grad():
        d.lm_head.weight.mul_(2.0)
    dec.generate([[1, 2]], max_new_tokens=2)
    assert torch.equal(dec._d.head.weight, d.lm_head.weight[VOCAB])


def test_draft_vocab_choices_and_errors(pair, tmp_path):
    from specdec_kernels import draft_vocab as dv

    draft, target = pair
    mk = functools.partial(SpeculativeDecoder, draft=draft, target=target)
    assert mk(draft_vocab=None).draft_vocab is None
    assert mk(draft_vocab=list(range(32))).draft_vocab is None  # the whole vocabulary: nothing to restrict
    assert mk(draft_vocab=[30, 2, 5]).draft_vocab.tolist() == [2, 5, 30]  # sorted
    assert mk(draft_vocab=torch.tensor([7, 1], dtype=torch.int32)).draft_vocab.tolist() == [1, 7]
    # "auto": the file in the directory the draft was loaded from, if any
    d = copy.deepcopy(draft)
    d.save_pretrained(tmp_path / "draft")
    assert mk(draft=LlamaForCausalLM.from_pretrained(tmp_path / "draft")).draft_vocab is None
    dv.save_draft_vocab(tmp_path / "draft", torch.tensor(VOCAB), 32, source="a test")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "draft")
    assert mk(draft=loaded).draft_vocab.tolist() == VOCAB
    assert mk(draft=loaded, draft_vocab=None).draft_vocab is None
    assert mk(draft_vocab=str(tmp_path / "draft")).draft_vocab.tolist() == VOCAB  # a directory
    assert mk(draft_vocab=tmp_path / "draft" / dv.FILE_NAME).draft_vocab.tolist() == VOCAB  # the file
    assert SpeculativeDecoder(target=target).draft_vocab is None  # prompt lookup: "auto" is nothing
    with pytest.raises(ValueError, match="draft_vocab restricts a draft model's proposals; "
                                         "drafter='prompt_lookup' has no draft model, got draft_vocab=\\[1, 2\\]"):
        SpeculativeDecoder(target=target, draft_vocab=[1, 2])
    with pytest.raises(ValueError, match=r"draft_vocab ids must be in \[0, 32\) \(the draft's vocab_size\), "
                                         r"got min 0, max 32"):
        mk(draft_vocab=[0, 32])
    with pytest.raises(ValueError, match="draft_vocab ids must be unique, got 3 more than once"):
        mk(draft_vocab=[3, 1, 3])
    with pytest.raises(ValueError, match=r"draft_vocab must be a non-empty 1-D tensor of token ids, got shape \(0,\)"):
        mk(draft_vocab=[])
    with pytest.raises(ValueError, match=r"got shape \(2, 1\)"):
        mk(draft_vocab=torch.tensor([[1], [2]]))
    with pytest.raises(TypeError, match="draft_vocab must hold integer token ids, got dtype torch.float32"):
        mk(draft_vocab=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="draft_vocab must be a 1-D integer tensor or a list of ints, got dict"):
        mk(draft_vocab={1: 2})
    with pytest.raises(FileNotFoundError, match="no draft vocabulary at"):
        mk(draft_vocab=str(tmp_path / "nowhere"))
    from safetensors.torch import save_file

    save_file({"ids": torch.tensor([1])}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match=r"must hold a tensor 'token_ids', got \['ids'\]"):
        mk(draft_vocab=str(tmp_path / "wrong.safetensors"))


def test_frequent_tokens_and_the_file():
    from specdec_kernels import draft_vocab as dv

    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert dv.frequent_tokens(counts, 1).tolist() == [2]  # 9 at ids 2 and 5: the lower id first
    assert dv.frequent_tokens(counts, 3).tolist() == [0, 2, 5]  # then 5 at ids 0 and 3: id 0
    assert dv.frequent_tokens(counts, 6).tolist() == list(range(6))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"vocab_size must be an int >= 1, got {bad!r}"):
            dv.check_draft_vocab([1], bad)
        with pytest.raises(ValueError, match=f"vocab_size must be an int >= 1, got {bad!r}"):
            dv.save_draft_vocab(".", [1], bad)
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 6\], got 7"):
        dv.frequent_tokens(counts, 7)
    with pytest.raises(ValueError, match="counts must be a 1-D integer tensor"):
        dv.frequent_tokens(counts.float(), 2)


def test_cli_draft_vocab(capsys, tmp_path):
    from specdec_kernels import draft_vocab as dv

    base = ["generate", "hello", "--tiny-random", "--json", "--max-new-tokens", "6", "-k", "2"]
    assert cli_main(base) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] is None  # no file beside a built model
    dv.save_draft_vocab(tmp_path, torch.arange(0, 40, 2), 51)
    assert cli_main(base + ["--draft-vocab", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] == 20
    assert cli_main(base + ["--draft-vocab", "full"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] is None
    with pytest.raises(SystemExit) as e:
        cli_main(base + ["--draft-vocab", str(tmp_path / "missing")])
    assert e.value.code == 2 and "no draft vocabulary at" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 8. Stopping drafts on the draft's confidence
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("conf,k", [(0.5, 4), (0.9, 8), (0.3, "auto")])
def test_draft_confidence_greedy_matches_generate(pair, greedy_refs, conf, k, monkeypatch):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    if k == "auto":  # times for which drafting pays (these tiny models' own favour K = 0)
        _synthetic_times(monkeypatch, 0.05, [])
    rec = _DraftRecorder(dec)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, draft_confidence=conf)
    assert res.token_ids == greedy_refs
    # the rule acted: some row stopped before K, and some step drafted fewer than K for every row
    assert any((kb < K).any() for K, kb in rec.calls)
    assert any(X.shape[1] < K for (X, _), (K, _) in zip(rec.out, rec.calls))


def test_draft_confidence_rule(pair):
    """K_b is the first draft at which the product of the drafts' probabilities (under the
    distribution each was sampled from) falls below the threshold, else K; the drafting stops
    once every row has stopped."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    rec = _DraftRecorder(dec)
    res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=5, temperature=1.0, seed=3, draft_confidence=0.2)
    assert rec.calls and any((kb < K).any() for K, kb in rec.calls)
    for h, (K, kb) in zip(res.stats.history, rec.calls):  # the verifier saw each row's K_b (or less: budget)
        assert all(n <= kb[i].item() for i, n in enumerate(h["num_draft"]))
    for (X, Q), (K, kb) in zip(rec.out, rec.calls):
        cum = Q.gather(-1, X[..., None])[..., 0].cumprod(-1)  # [B, K']
        below = cum < 0.2
        want = torch.where(below.any(-1), below.int().argmax(-1) + 1, torch.full_like(kb, K)).clamp(max=X.shape[1])
        assert torch.equal(kb, want)
        if X.shape[1] < K:
            assert (kb <= X.shape[1]).all() and below[:, -1].any()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_confidence_batch_invariance(pair, temperature):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    kw = dict(max_new_tokens=16, num_draft_tokens=4, temperature=temperature, draft_confidence=0.4)
    batch = dec.generate(PROMPTS, seed=70, **kw)
    for i, p in enumerate(PROMPTS):
        assert dec.generate([p], seed=70 + i, **kw).token_ids[0] == batch.token_ids[i], i


def test_draft_confidence_errors(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    with pytest.raises(ValueError, match=r"draft_confidence must be in \[0, 1\) \(0 = off\), got 1.0"):
        dec.generate([[1]], draft_confidence=1.0)
    with pytest.raises(ValueError, match=r"draft_confidence must be in \[0, 1\) \(0 = off\), got -0.1"):
        dec.generate([[1]], draft_confidence=-0.1)
    with pytest.raises(TypeError, match="draft_confidence must be a float, got str"):
        dec.generate([[1]], draft_confidence="0.5")
    with pytest.raises(ValueError, match="draft_confidence needs a draft model's probabilities; "
                                         "drafter='prompt_lookup' has none, got draft_confidence=0.5"):
        SpeculativeDecoder(target=target).generate([[1]], draft_confidence=0.5)
