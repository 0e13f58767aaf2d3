"""The arguments of one call, as one object: ``GenerateArgs`` (``SpeculativeDecoder.generate``'s, as
given) -> ``CallArgs`` (the loop's own, checked).

``generate`` takes transformers' arguments beside its own (a ``GenerationConfig``, ``do_sample``,
``input_ids``, logits processors, stopping criteria); ``integrations.transformers.fold_arguments``
folds them into a ``CallArgs``, and ``generate_target_only``, ``start`` and ``hf.generate`` build one
directly.  ``CallArgs.checked`` converts NumPy-like scalars to Python ones and checks every value
(the errors name the argument, the expected and the actual value), so ``state.start_state`` starts
from values it can trust.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .arguments import as_float, as_int, check_generate_args

__all__ = ["CallArgs", "GenerateArgs"]


@dataclass(frozen=True)
class GenerateArgs:
    """``SpeculativeDecoder.generate``'s arguments as the caller gave them (their defaults are
    generate's: ``python_tests/decoding/test_call_args.py`` keeps the two equal)."""

    prompts: Any = None
    max_new_tokens: int = 64
    num_draft_tokens: Any = 4
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Any = 0
    stop: Any = None
    verbose: Any = False
    min_p: Optional[float] = None
    input_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    generation_config: Any = None
    do_sample: Optional[bool] = None
    streamer: Any = None
    stopping_criteria: Any = None
    logits_processor: Any = None
    repetition_penalty: Optional[float] = None
    no_repeat_ngram_size: Optional[int] = None
    bad_words_ids: Any = None
    prefix_allowed_tokens_fn: Any = None
    max_draft_tokens: int = 8
    draft_confidence: float = 0.0
    eos_token_id: Any = None
    baseline_tokens_per_s: Optional[float] = None
    target_step_s: Optional[float] = None
    progress: bool = False
    grammar: Any = None

    def is_default(self, name: str) -> bool:
        """True when ``name`` was left at generate's default (the same object, or an equal value of
        the same type)."""
        value, default = getattr(self, name), _GENERATE_DEFAULTS[name]
        return value is default or (type(value) is type(default) and value == default)

    @staticmethod
    def default(name: str):
        """generate's default for ``name``."""
        return _GENERATE_DEFAULTS[name]


_GENERATE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerateArgs)}


@dataclass(frozen=True)
class CallArgs:
    """One call's arguments in the loop's own terms.  prompts: what ``arguments.encode_prompts``
    takes (str, token ids, [B, T] ids with ``attention_mask``); streamer: a ``BaseStreamer`` that
    gets each step's tokens (the caller has put the prompt); criteria: a
    ``transformers_adapter.criteria.RowCriteria`` or None; procs: a
    ``transformers_adapter.processors.VerifyProcessors`` or None; target_only: the baseline (no
    drafts).  After ``checked``: k_max is the largest K a step may verify, stop a list of strings,
    the numbers Python ones."""

    prompts: Any
    max_new_tokens: int = 64
    num_draft_tokens: Any = 4
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    seed: Any = 0
    stop: Any = None
    verbose: Any = False
    attention_mask: Optional[torch.Tensor] = None
    max_draft_tokens: int = 8
    draft_confidence: float = 0.0
    eos_token_id: Any = None
    progress: bool = False
    target_only: bool = False
    streamer: Any = None
    criteria: Any = None
    procs: Any = None
    baseline_tokens_per_s: Optional[float] = None
    target_step_s: Optional[float] = None
    grammar: Any = None  # grammar.py: a JSON schema, GrammarSpec, CompiledGrammar, or one per row
    k_max: int = 0  # set by checked

    def checked(self, parts) -> "CallArgs":
        """A copy with NumPy-like scalars as Python ones, every value checked against the decoder's
        parts (``DecoderParts``: a stop string needs a tokenizer, ``draft_confidence`` a draft
        network, ...), ``stop`` as a list and ``k_max`` set."""
        max_new, k, top_k, max_draft = (as_int(v) for v in (self.max_new_tokens, self.num_draft_tokens, self.top_k,
                                                            self.max_draft_tokens))
        temperature, top_p, confidence, min_p = (as_float(v) for v in (self.temperature, self.top_p,
                                                                       self.draft_confidence, self.min_p))
        k_max, stop = check_generate_args(max_new, k, temperature, top_k, top_p, self.stop, max_draft, confidence,
                                          drafter=parts.drafter_name, has_draft=parts.has_draft_network,
                                          has_tokenizer=parts.tokenizer is not None, min_p=min_p)
        rates = {}
        for name in ("baseline_tokens_per_s", "target_step_s"):
            v = as_float(getattr(self, name))
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"{name} must be None or a number, got {type(v).__name__}")
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"{name} must be finite and > 0, got {v}")
            rates[name] = v
        return dataclasses.replace(self, max_new_tokens=max_new, num_draft_tokens=k, top_k=top_k,
                                   max_draft_tokens=max_draft, temperature=temperature, top_p=top_p,
                                   draft_confidence=confidence, min_p=min_p, stop=stop, k_max=k_max, **rates)
