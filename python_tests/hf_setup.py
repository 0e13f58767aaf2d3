"""Shared set-up of the transformers-integration tests (test_hf_generate.py,
test_hf_logits_processors.py, test_decoder_min_p.py): transformers' warnings silenced, left
padding, and ``generate`` through the hook."""

from __future__ import annotations

import warnings

import pytest
import torch

from specdec_kernels import hf

PAD = 0


@pytest.fixture(autouse=True)
def _quiet():
    """transformers warns about flags its own loop would ignore; the warnings are not under test."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(level)


def _left_padded(prompts, pad: int = PAD):
    """input_ids [B, T] left-padded with ``pad`` and its attention_mask [B, T]."""
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _hook(target, *args, **kwargs):
    """``target.generate`` with ``custom_generate=specdec_kernels.hf.generate``."""
    return target.generate(*args, custom_generate=hf.generate, **kwargs)
