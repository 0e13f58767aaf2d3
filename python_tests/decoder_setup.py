"""Models, fixtures and recorders shared by the decoder's tests (test_decoder*.py,
test_feature_draft.py, test_compact_kv_emulated.py): small random-weight Llama models built here
(CPU, fp32), the ragged prompts, the forward recorders that count what each model is fed, the
closed-form distribution of the first two tokens with its chi-square, and the cache comparisons.
"""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch
from scipy import stats as sps
from transformers import DynamicCache

from specdec_kernels.models.tiny import perturbed, tiny_llama


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


# the package's tiny random Llama and its perturbed draft, under the names the tests use
_llama, _perturbed = tiny_llama, perturbed


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
    recorded at the boundary where it hands them to the model: ``ModelRunner.forward`` (the model's
    own forward: the prefill, and the steps when the lean path is off) and ``LeanLlamaStep.step``
    (the decode steps of a Llama on the CPU, which test_lean_forward.py proves equal to the
    model's forward, bit for bit); ``lean`` counts the calls that took the lean path."""

    def __init__(self, dec, which: str):
        super().__init__()
        self.runner = r = dec.parts.target_runner if which == "target" else dec.parts.draft_runner
        self.lean = 0
        dec.parts.refresh()  # what generate() does first: the lean step object it will use
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



def _synthetic_times(monkeypatch, slope: float, seen: list):
    """Replace the decoder's measured times by T_draft = 0.02 per forward and a target step of
    1 + slope * K for K drafts (no timing in tests); ``seen`` collects (K, first_step)."""
    import specdec_kernels.decoding.stats as stats_mod

    orig = stats_mod.StatsRecorder.record_times

    def record_times(self, t_draft_total, n_draft_forwards, t_target, first_step, k=None, draft_typical=True):
        seen.append((k, first_step))
        orig(self, 0.02 * n_draft_forwards, n_draft_forwards, 1.0 + slope * k, first_step, k=k,
             draft_typical=draft_typical)

    monkeypatch.setattr(stats_mod.StatsRecorder, "record_times", record_times)



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



# Prompts whose lengths differ enough for the prefill to run in groups (tokens to cache: 1, 29,
# 0, 11, 11 -> groups [1, 11, 11], [29] at the CPU's fixed cost of 12 tokens per forward).
SKEWED = [[1, 2], list(range(1, 31)), [3], list(range(2, 14)), list(range(5, 17))]
