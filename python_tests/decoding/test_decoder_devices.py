"""SpeculativeDecoder on each device this machine has: the CPU always, CUDA where present.

The decoder's other tests run on the CPU (the torch path of ``fused_verify``, the lean forward,
``skinny_linear``).  On a GPU the same loop takes other paths: the Triton kernel of
``fused_verify``, the models' own forwards, the CUDA cache-compaction op, cuBLAS.  These cases
run the properties that must hold whatever the path — greedy output equals
``target.generate(do_sample=False)`` on a ragged batch, and a seeded row of a batch equals its
prompt decoded alone — for each drafter (the draft model, the feature draft, prompt lookup) on
each device; the CPU cases also show that the test bodies themselves work where no GPU is.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdec_kernels.decoding.decoder import SpeculativeDecoder

from helpers import HAS_CUDA
from decoder_setup import PROMPTS, _llama, _one_thread, _perturbed  # noqa: F401  (_one_thread: fixture)
from feature_setup import _damped_llama, _feature_draft, _fit

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (the decoder's CUDA paths)"))]
DRAFTERS = ["model", "feature", "prompt_lookup"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def models():
    """CPU models: a V = 32 target whose attention is damped (so that a feature draft fits it in
    100 steps), a draft model (the target with noise on every weight) and a fitted feature draft.
    Init std 0.2 keeps the logits peaked (no near-ties for greedy on any device)."""
    target = _damped_llama(32, 32, 0.2, seed=0)
    return {"target": target, "model": _perturbed(target, 0.01, seed=1),
            "feature": _fit(_feature_draft(target), target, steps=100)}


def _decoder(models, drafter: str, device: str) -> tuple:
    target = copy.deepcopy(models["target"]).to(device)
    draft = None if drafter == "prompt_lookup" else copy.deepcopy(models[drafter]).to(device)
    return SpeculativeDecoder(draft=draft, target=target, drafter=drafter), target


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_matches_generate_on_device(models, drafter, device):
    dec, target = _decoder(models, drafter, device)
    with torch.inference_mode():
        refs = [target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=NEW_TOKENS,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    for k in (1, 3):
        res = dec.generate(PROMPTS, max_new_tokens=NEW_TOKENS, num_draft_tokens=k)
        assert res.token_ids == refs, (drafter, device, k)
        s = res.stats
        assert s.generated_tokens == NEW_TOKENS * len(PROMPTS)
        assert s.row_steps < s.generated_tokens  # drafts were accepted: the verify path ran
        if drafter != "prompt_lookup":
            assert 0.3 < s.alpha <= 1.0, (drafter, device, k, s.alpha)
        if k == 3 and drafter != "prompt_lookup":
            assert any(len(set(h["accepted"])) > 1 for h in s.history)  # ragged acceptance happened


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_seeded_row_equals_prompt_decoded_alone_on_device(models, drafter, device):
    dec, _ = _decoder(models, drafter, device)
    kw = dict(max_new_tokens=12, num_draft_tokens=3, temperature=1.0, top_k=20)
    batch = dec.generate(PROMPTS, seed=70, **kw)
    for i, p in enumerate(PROMPTS):
        assert dec.generate([p], seed=70 + i, **kw).token_ids[0] == batch.token_ids[i], (drafter, device, i)
    assert dec.generate(PROMPTS, seed=71, **kw).token_ids != batch.token_ids  # the seed matters


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 2, 1), "dynamic:8,3,3"])
def test_tree_drafting_on_device(models, shape, device):
    """SpeculativeDecoder(tree=...) on each device (on CUDA: the tree kernel of fused_verify_tree,
    the CUDA gather_kv_, 4D masks in the models' own attention): greedy output equals
    ``target.generate``; a seeded sampling run repeats itself and depends on its seed."""
    target = copy.deepcopy(models["target"]).to(device)
    draft = copy.deepcopy(models["model"]).to(device)
    dec = SpeculativeDecoder(draft=draft, target=target, tree=shape)
    with torch.inference_mode():
        refs = [target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=NEW_TOKENS,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    res = dec.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert res.token_ids == refs, (shape, device)
    assert res.stats.mean_tokens_per_target_call > 1.5
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=20)
    a, b = dec.generate(PROMPTS, seed=70, **kw), dec.generate(PROMPTS, seed=70, **kw)
    assert a.token_ids == b.token_ids and dec.generate(PROMPTS, seed=71, **kw).token_ids != a.token_ids
