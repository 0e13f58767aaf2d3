"""A call's arguments as one object (``decoding/call.py``) and a decoder's parts as one frozen object
(``decoding/parts.py``): generate's defaults written once, the checks naming the argument, the
parts shared by the loop, the tree path and the transformers adapter."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

from decoder_setup import PROMPTS, pair  # noqa: F401  (fixtures)
from specdec_kernels import SpeculativeDecoder
from specdec_kernels.decoding import loop
from specdec_kernels.decoding.call import CallArgs, GenerateArgs
from specdec_kernels.decoding.parts import DecoderParts


def test_generate_args_hold_generates_signature():
    """Every argument of ``SpeculativeDecoder.generate`` is a field of ``GenerateArgs`` with the same
    default, and nothing else is (the adapter tells a passed argument from a default by them)."""
    sig = {n: p.default for n, p in inspect.signature(SpeculativeDecoder.generate).parameters.items() if n != "self"}
    fields = {f.name: f.default for f in dataclasses.fields(GenerateArgs)}
    assert sig == fields


def test_a_default_is_told_from_a_passed_value():
    assert GenerateArgs().is_default("temperature") and GenerateArgs(temperature=0.0).is_default("temperature")
    assert not GenerateArgs(temperature=0).is_default("temperature")  # an int is not generate's 0.0
    assert not GenerateArgs(max_new_tokens=65).is_default("max_new_tokens")
    assert GenerateArgs.default("max_draft_tokens") == 8


def test_checked_converts_numpy_scalars_and_names_a_bad_value(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    call = CallArgs(PROMPTS[:1], max_new_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3),
                    target_step_s=np.float64(0.01)).checked(dec.parts)
    assert (type(call.max_new_tokens), type(call.temperature), type(call.top_k), type(call.target_step_s)) == (
        int, float, int, float)
    assert call.k_max == 4 and call.stop == []
    with pytest.raises(ValueError, match=r"target_step_s must be finite and > 0, got -1"):
        CallArgs(PROMPTS[:1], target_step_s=-1).checked(dec.parts)
    with pytest.raises(TypeError, match=r"baseline_tokens_per_s must be None or a number, got str"):
        CallArgs(PROMPTS[:1], baseline_tokens_per_s="fast").checked(dec.parts)
    with pytest.raises(ValueError, match="draft_confidence"):
        CallArgs(PROMPTS[:1], draft_confidence=2.0).checked(dec.parts)


def test_the_parts_are_frozen_and_shared(pair):
    """The decoder's public attributes read its parts; the parts cannot be changed in place (a new
    one is made with ``dataclasses.replace``), and a decoder's attributes cannot be assigned."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    assert isinstance(dec.parts, DecoderParts)
    assert dec.target is dec.parts.target and dec.drafter == dec.parts.drafter_name == "model"
    assert dec.vocab_size == dec.parts.target_runner.vocab_size and dec.has_draft_network
    with pytest.raises(dataclasses.FrozenInstanceError):
        dec.parts.verification = "block"
    with pytest.raises(AttributeError):
        dec.verification = "block"


def test_the_loop_driven_step_by_step_gives_generates_tokens(pair):
    """``loop.prefill`` and ``loop.step`` (the seams the cache tests drive) give the tokens that
    ``generate`` gives for the same call."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    want = dec.generate(PROMPTS, max_new_tokens=10, num_draft_tokens=3, temperature=1.0, seed=5).token_ids
    st = dec.start(PROMPTS, max_new_tokens=10, num_draft_tokens=3, temperature=1.0, seed=5)
    steps = 0
    with torch.inference_mode(), dec.parts.linear_layers():
        loop.prefill(dec.parts, st)
        while st.rows:
            loop.step(dec.parts, st)
            steps += 1
    assert st.generated == want and steps > 1
