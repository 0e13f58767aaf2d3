"""min_p through the decoding loop: ``SpeculativeDecoder.generate(min_p=)``, the baseline, the
draft's warp, transformers' ``MinPLogitsWarper`` (the hook and generation configs), and
``specdec generate --min-p``.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                          TopPLogitsWarper)

from specdec_kernels.ops import reference
from specdec_kernels.cli import main as cli_main
from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.drafters.sampling import warp_probs
from specdec_kernels.decoding.transformers_adapter.config import sampling_from_config, sampling_from_processors

from decoder_setup import PROMPTS, SIGNIFICANCE, _chisquare_pvalue, _llama
from decoder_setup import _one_thread, pair  # noqa: F401  (fixtures; _one_thread: autouse)
from hf_setup import _quiet  # noqa: F401  (autouse fixture)
from hf_setup import PAD, _hook





def _target_greedy(target, prompt, n):
    with torch.inference_mode():
        out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def test_greedy_ignores_min_p(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    prompts = [list(p) for p in PROMPTS]
    plain = dec.generate(prompts, max_new_tokens=10, num_draft_tokens=3).token_ids
    assert dec.generate(prompts, max_new_tokens=10, num_draft_tokens=3, min_p=0.5).token_ids == plain
    assert dec.generate_target_only(prompts, max_new_tokens=10, min_p=0.5).token_ids == plain
    assert plain == [_target_greedy(target, p, 10) for p in prompts]


def test_min_p_one_samples_the_greedy_tokens(pair):
    """min_p = 1 keeps the maximum (and its ties) only: at T = 1 every row is the target's greedy
    path (the tiny pair's logits have no near-ties), whatever the seed and K, the baseline too."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    prompts = [list(p) for p in PROMPTS]
    ref = [_target_greedy(target, p, 10) for p in prompts]
    for seed, k in ((0, 3), (5, 1)):
        assert dec.generate(prompts, max_new_tokens=10, num_draft_tokens=k, temperature=1.0, min_p=1.0,
                            seed=seed).token_ids == ref
    assert dec.generate_target_only(prompts, max_new_tokens=10, temperature=1.0, min_p=1.0).token_ids == ref


def test_min_p_zero_is_off(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    prompts = [list(p) for p in PROMPTS]
    kw = dict(max_new_tokens=8, num_draft_tokens=3, temperature=0.9, seed=11)
    assert dec.generate(prompts, min_p=0.0, **kw).token_ids == dec.generate(prompts, **kw).token_ids


@pytest.mark.parametrize("value,error,says", [
    (1.5, ValueError, r"min_p must be in \[0, 1\] \(0 = off\), got 1.5"),
    (-0.1, ValueError, r"min_p must be in \[0, 1\] \(0 = off\), got -0.1"),
    ("x", TypeError, r"min_p must be a float in \[0, 1\] or None, got str"),
    (True, TypeError, r"min_p must be a float in \[0, 1\] or None, got bool"),
])
def test_min_p_errors_are_named(pair, value, error, says):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    with pytest.raises(error, match=says):
        dec.generate([[1, 2, 3]], max_new_tokens=2, temperature=1.0, min_p=value)
    with pytest.raises(error, match=says):
        dec.generate_target_only([[1, 2, 3]], max_new_tokens=2, temperature=1.0, min_p=value)


def test_draft_warp_applies_the_verifiers_min_p_rule():
    """warp_probs(min_p=) keeps exactly reference.warp_logits's set (ties and the threshold's
    rounding included), after temperature and top-p; 0 is off."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[0, :5] = logits[0].max()  # a tied maximum
    logits[1, 7] = logits[1, 3] = logits[1].max() + torch.log(torch.tensor(0.25))  # near the threshold
    for t, top_p, mp in ((1.0, None, 0.25), (0.7, 0.9, 0.1), (1.3, None, 1.0), (0.5, 0.95, 0.0)):
        q = warp_probs(logits, t, None, top_p, min_p=mp)
        inv_t = 1.0 / torch.full((6,), t, dtype=torch.float32)
        _, keep = reference.warp_logits(logits, inv_t, None, None if top_p is None else torch.full((6,), top_p),
                                        min_p=torch.full((6,), mp))
        assert torch.equal(q > 0, keep), (t, top_p, mp)
        if mp == 0.0:
            assert torch.equal(q, warp_probs(logits, t, None, top_p))
    assert torch.equal(warp_probs(logits, 0.0, min_p=0.5), warp_probs(logits, 0.0))  # greedy: one-hot


def test_sampling_from_processors_reads_min_p():
    procs = [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9), MinPLogitsWarper(0.2)]
    assert sampling_from_processors(procs, True) == (0.7, None, 0.9, 0.2)
    assert sampling_from_processors(procs, False) == (0.0, None, None, None)
    assert sampling_from_processors([MinPLogitsWarper(0.0)], True) == (1.0, None, None, None)
    with pytest.raises(ValueError, match=r"MinPLogitsWarper must have min_tokens_to_keep=1, got 2"):
        sampling_from_processors([MinPLogitsWarper(0.2, min_tokens_to_keep=2)], True)
    with pytest.raises(ValueError, match=r"in the order temperature, top-k, top-p, min-p, got MinPLogitsWarper, "
                                         r"TopPLogitsWarper"):
        sampling_from_processors([MinPLogitsWarper(0.2), TopPLogitsWarper(0.9)], True)
    with pytest.raises(ValueError, match=r"MinPLogitsWarper must have filter_value=-inf"):
        sampling_from_processors([MinPLogitsWarper(0.2, filter_value=-1e4)], True)


def test_generation_config_min_p(pair):
    assert sampling_from_config(GenerationConfig(do_sample=True, temperature=0.7, min_p=0.2))[3] == 0.2
    assert sampling_from_config(GenerationConfig(do_sample=False, min_p=0.2)) == (0.0, None, None, None)
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    prompts = [list(p) for p in PROMPTS]
    via_config = dec.generate(prompts, generation_config=GenerationConfig(do_sample=True, temperature=1.0, min_p=1.0,
                                                                          max_new_tokens=6))
    assert via_config.token_ids == [_target_greedy(target, p, 6) for p in prompts]
    with pytest.raises(ValueError, match=r"min_p=0.5 and generation_config .*: pass min_p in one place"):
        dec.generate(prompts, min_p=0.5, generation_config=GenerationConfig(do_sample=True, min_p=0.2,
                                                                            max_new_tokens=2))


def _hf_joint(model, prompt, temperature, min_p) -> torch.Tensor:
    """P(t1, t2) [V, V] float64 under transformers' own warpers (temperature, then min-p when
    given) on the model's fp32 logits, as its sampling draws them."""
    procs = [TemperatureLogitsWarper(temperature)] + ([MinPLogitsWarper(min_p)] if min_p else [])
    procs = LogitsProcessorList(procs)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(procs(ids, model(ids).logits[:, -1].float()), -1).double()[0]  # [V]
        V = p1.numel()
        ext = torch.tensor([prompt + [t] for t in range(V)])  # [V, T+1]
        p2 = torch.softmax(procs(ext, model(ext).logits[:, -1].float()), -1).double()  # [V, V]
    return p1[:, None] * p2


@pytest.mark.slow
def test_sampling_law_of_the_first_two_tokens_with_min_p(pair):
    """20,000 rows of one prompt through the hook (do_sample, temperature 0.7, min_p 0.2): the
    counts of (t1, t2) against transformers' law (chi-square, p > SIGNIFICANCE = 1e-3, fixed
    seed), nothing outside min-p's support; the law without min-p is rejected (p < 1e-3)."""
    _, target = pair
    draft = _llama(32, 32, 2, 0.2, seed=7)  # unrelated to the target: every rejection path runs
    prompt, n, t, mp = [3, 1, 4], 20_000, 0.7, 0.2
    torch.manual_seed(4321)
    out = _hook(target, torch.tensor([prompt] * n), do_sample=True, temperature=t, min_p=mp,
                max_new_tokens=2, pad_token_id=PAD, assistant_model=draft)
    assert out.shape == (n, 5)
    V = 32
    counts = torch.bincount(out[:, 3] * V + out[:, 4], minlength=V * V).reshape(V, V)
    law = _hf_joint(target, prompt, t, mp)
    assert counts[law == 0].sum() == 0  # nothing outside the warped support
    assert _chisquare_pvalue(counts, law) > SIGNIFICANCE
    assert _chisquare_pvalue(counts, _hf_joint(target, prompt, t, None)) < SIGNIFICANCE  # min-p not applied


def test_cli_min_p_reaches_generate(capsys, monkeypatch):
    calls = []
    for name in ("generate", "generate_target_only"):
        real = getattr(SpeculativeDecoder, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            calls.append((_name, kw.get("min_p")))
            return _real(self, *a, **kw)
        monkeypatch.setattr(SpeculativeDecoder, name, spy)
    assert cli_main(["generate", "hello world", "--tiny-random", "--json", "--baseline", "--max-new-tokens", "4",
                     "--temperature", "0.8", "--min-p", "0.3"]) == 0
    json.loads(capsys.readouterr().out)
    assert calls and all(v == 0.3 for _, v in calls)
    assert {n for n, _ in calls} == {"generate", "generate_target_only"}
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--tiny-random", "--min-p", "1.5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --min-p must be in [0, 1] (0 = off), got 1.5" in err, err


@pytest.mark.slow
def test_triton_verify_backend_gives_the_torch_tokens_with_min_p(pair):
    """The loop through the split kernel (Triton's interpreter on the CPU: conftest.py sets
    TRITON_INTERPRET=1) draws the torch path's tokens with min_p, seeded."""
    from specdec_kernels.ops.verify import interpreting

    if not interpreting():
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 (conftest.py sets it)")
    draft, target = pair
    prompts = [list(p) for p in PROMPTS[:3]]
    kw = dict(max_new_tokens=8, num_draft_tokens=3, temperature=0.8, top_k=10, min_p=0.2, seed=3)
    out = {b: SpeculativeDecoder(draft=draft, target=target, verify_backend=b).generate(prompts, **kw).token_ids
           for b in ("torch", "triton")}
    assert out["triton"] == out["torch"]
