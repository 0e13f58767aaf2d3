"""Transformers' generation arguments on ``SpeculativeDecoder``: a ``GenerationConfig``, the logits
processors and stopping criteria that ``generate`` builds from it, streamers and chat messages
(their per-row forms in ``criteria.py``, the processors in ``processors.py``), each mapped onto the
decoder's own arguments (``call.CallArgs``) or refused by name.  ``hf.py`` (the ``custom_generate``
entry point) and ``SpeculativeDecoder.generate`` call these; the table of ``GenerationConfig``
fields is in ``docs/api.md``.

Only what transformers 5.17 to 5.24 all have is used (the tests pass on 5.17.0, 5.19.0 and 5.24.0):
``GenerationConfig`` fields are read with ``getattr`` (a field one version lacks reads as unset), the warpers'
and criteria's public attributes (``TopKLogitsWarper.top_k``, ``MaxLengthCriteria.max_length``,
``EosTokenCriteria.eos_token_id``, ...), ``StoppingCriteriaList``, ``StopStringCriteria``, ``MaxTimeCriteria``
and ``apply_chat_template(..., tokenize=True, return_dict=False)``.
Transformers is imported inside the functions: ``import specdec_kernels`` does not import it.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Optional

import torch

from ..arguments import encode_prompts, eos_ids
from ..call import CallArgs, GenerateArgs
from .criteria import RowCriteria, chat_prompts
from .processors import VerifyProcessors, processors_from_arguments, sampling_from_processors

__all__ = ["check_generation_config", "draft_settings", "fold_arguments", "resolve_generation_config",
           "sampling_from_config", "sampling_from_processors"]

# GenerationConfig fields refused when set to anything but "off": field -> (is it on?, what it is).
# Each is a logits processor, a decoding mode or an output that the loop does not have.
_REFUSED = {
    "num_beams": (lambda v: v is not None and v > 1, "beam search"),
    "num_beam_groups": (lambda v: v is not None and v > 1, "group beam search"),
    "diversity_penalty": (lambda v: v not in (None, 0, 0.0), "group beam search"),
    "penalty_alpha": (lambda v: v not in (None, 0, 0.0), "contrastive search"),
    "dola_layers": (lambda v: v is not None, "DoLa decoding"),
    "constraints": (lambda v: v is not None, "constrained beam search"),
    "force_words_ids": (lambda v: v is not None, "constrained beam search"),
    "num_return_sequences": (lambda v: v is not None and v > 1, "several sequences per prompt (repeat the prompt)"),
    "encoder_repetition_penalty": (lambda v: v not in (None, 1, 1.0), "an encoder repetition penalty"),
    "encoder_no_repeat_ngram_size": (lambda v: v not in (None, 0), "encoder n-gram blocking"),
    "sequence_bias": (lambda v: v is not None, "sequence biases"),
    "min_new_tokens": (lambda v: v not in (None, 0), "a minimum length (an EOS mask)"),
    "min_length": (lambda v: v not in (None, 0), "a minimum length (an EOS mask)"),
    "forced_bos_token_id": (lambda v: v is not None, "a forced first token"),
    "forced_eos_token_id": (lambda v: v is not None, "a forced last token"),
    "suppress_tokens": (lambda v: v is not None, "suppressed tokens"),
    "begin_suppress_tokens": (lambda v: v is not None, "suppressed first tokens"),
    "exponential_decay_length_penalty": (lambda v: v is not None, "a length penalty on EOS"),
    "remove_invalid_values": (lambda v: bool(v), "replacing NaN/inf logits"),
    "guidance_scale": (lambda v: v not in (None, 1, 1.0), "classifier-free guidance"),
    "watermarking_config": (lambda v: v is not None, "watermarking"),
    "output_scores": (lambda v: bool(v), "per-step scores"),
    "output_logits": (lambda v: bool(v), "per-step logits"),
    "output_attentions": (lambda v: bool(v), "attention weights"),
    "output_hidden_states": (lambda v: bool(v), "hidden states"),
    "use_cache": (lambda v: v is False, "decoding without a KV cache"),
    "cache_implementation": (lambda v: v not in (None, "dynamic"), "a cache other than DynamicCache"),
    "cache_config": (lambda v: v is not None, "a cache other than DynamicCache"),
    "max_cache_len": (lambda v: v is not None, "a cache other than DynamicCache"),
    "prefill_chunk_size": (lambda v: v is not None, "a chunked prefill"),
    "continuous_batching_config": (lambda v: v is not None, "continuous batching"),
    "token_healing": (lambda v: bool(v), "token healing"),
    "assistant_early_exit": (lambda v: v is not None, "a self-speculative (early exit) draft"),
    "assistant_ensemble_weight": (lambda v: v is not None, "verifying against a target-draft mixture (not exact)"),
    "speculation_type": (lambda v: v is not None, "another speculation type"),
    "use_mtp": (lambda v: bool(v), "multi-token prediction heads"),
}
# Applied by transformers only when sampling (its "warpers"): refused with do_sample=True only.
_REFUSED_WHEN_SAMPLING = {
    "top_h": (lambda v: v is not None, "top-H sampling"),
    "typical_p": (lambda v: v not in (None, 1, 1.0), "typical sampling"),
    "epsilon_cutoff": (lambda v: v not in (None, 0, 0.0), "epsilon sampling"),
    "eta_cutoff": (lambda v: v not in (None, 0, 0.0), "eta sampling"),
}
# Fields that are used, or have no effect here as in transformers' greedy/sampling modes.
_MAPPED = {
    "max_new_tokens", "max_length", "max_time", "stop_strings", "do_sample", "temperature", "top_k", "top_p", "min_p",
    "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
    "max_matching_ngram_size", "assistant_lookbehind", "target_lookbehind", "is_assistant",
    "return_dict_in_generate", "renormalize_logits", "early_stopping", "length_penalty", "low_memory",
    "compile_config", "disable_compile", "transformers_version", "repetition_penalty", "no_repeat_ngram_size",
    "bad_words_ids",
}


def _default_params() -> dict:
    """transformers' global defaults of unset fields (5.x: ``_get_default_generation_params``)."""
    from transformers import GenerationConfig

    get = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(get()) if get is not None else {}


def resolve_generation_config(generation_config, target):
    """A copy of ``generation_config`` whose unset (None) fields take the target's
    ``generation_config``'s values, then transformers' global defaults: the values
    ``target.generate(generation_config=...)`` would decode with."""
    from transformers import GenerationConfig

    if not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers.GenerationConfig, got "
                        f"{type(generation_config).__name__}")
    gc = copy.deepcopy(generation_config)
    model_gc = getattr(target, "generation_config", None)
    for source in ((model_gc.to_dict() if model_gc is not None else {}), _default_params()):
        for name, value in source.items():
            if not name.startswith("_") and hasattr(gc, name) and getattr(gc, name) is None:
                setattr(gc, name, copy.deepcopy(value))
    if getattr(gc, "cache_implementation", None) == "hybrid":
        gc.cache_implementation = None  # a model default that transformers unsets too (dynamic caches)
    return gc


def check_generation_config(gc, input_length: Optional[int] = None) -> None:
    """Refuse, by name, every field that asks for something the loop does not do (see the table
    in ``hf.py``), and any transformers field this module does not know that is set.
    ``input_length``: the width T of the input ids where known; a ``min_length`` <= T asks for
    nothing (``generate`` turns ``min_new_tokens=0`` into ``min_length = T``)."""
    from transformers import GenerationConfig

    for name, (on, what) in _REFUSED.items():
        v = getattr(gc, name, None)
        if name == "min_length" and input_length is not None and v is not None and v <= input_length:
            continue
        if on(v):
            raise ValueError(f"generation_config.{name} asks for {what}, which specdec_kernels does not do: it must "
                             f"be unset, got {v!r}")
    if getattr(gc, "do_sample", None):
        for name, (on, what) in _REFUSED_WHEN_SAMPLING.items():
            v = getattr(gc, name, None)
            if on(v):
                raise ValueError(f"generation_config.{name} asks for {what}, which specdec_kernels does not do: it "
                                 f"must be unset with do_sample=True, got {v!r}")
    fresh, defaults = GenerationConfig().to_dict(), _default_params()
    known = set(_REFUSED) | set(_REFUSED_WHEN_SAMPLING) | _MAPPED
    for name, v in gc.to_dict().items():
        if name.startswith("_") or name in known or name not in fresh:
            continue  # private, mapped, or a custom entry (not a transformers field)
        if v is not None and v != fresh[name] and v != defaults.get(name, fresh[name]):
            raise ValueError(f"generation_config.{name} is not supported by specdec_kernels: it must be unset, "
                             f"got {v!r}")


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def sampling_from_config(gc) -> tuple:
    """(temperature, top_k, top_p, min_p) for the decoder from a resolved config: (0.0, None, None,
    None) when ``do_sample`` is not True (greedy, as transformers)."""
    if not getattr(gc, "do_sample", None):
        return 0.0, None, None, None
    t = gc.temperature
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"generation_config.temperature must be a finite float > 0 with do_sample=True, got {t!r}")
    top_k = gc.top_k
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
        raise ValueError(f"generation_config.top_k must be an int >= 0 (0 = off), got {top_k!r}")
    top_p = gc.top_p
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"generation_config.top_p must be in (0, 1] (1 = off), got {top_p!r}")
    min_p = getattr(gc, "min_p", None)
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0 <= min_p <= 1):
        raise ValueError(f"generation_config.min_p must be in [0, 1] (0 = off), got {min_p!r}")
    return (float(t), int(top_k) if top_k else None,
            float(top_p) if top_p is not None and top_p < 1 else None, float(min_p) if min_p else None)


def draft_settings(gc, drafter: str, has_draft_probs: bool) -> dict:
    """The decoder's draft arguments from a resolved config: ``prompt_lookup_num_tokens`` (prompt
    lookup) or ``num_assistant_tokens`` (a draft network) as K, a "heuristic" schedule as
    ``num_draft_tokens="auto"`` up to it, ``assistant_confidence_threshold`` as
    ``draft_confidence``.  These change the speed only, never the output's law."""
    out = {}
    if drafter == "prompt_lookup":
        n = getattr(gc, "prompt_lookup_num_tokens", None)
        if n is not None:
            out["num_draft_tokens"] = _positive_int("generation_config.prompt_lookup_num_tokens", n)
        return out
    n = getattr(gc, "num_assistant_tokens", None)
    schedule = getattr(gc, "num_assistant_tokens_schedule", None) or "constant"
    if n is not None:
        n = _positive_int("generation_config.num_assistant_tokens", n)
        if schedule == "constant":
            out["num_draft_tokens"] = n
        elif schedule in ("heuristic", "heuristic_transient"):
            out["num_draft_tokens"], out["max_draft_tokens"] = "auto", n
        else:
            raise ValueError(f"generation_config.num_assistant_tokens_schedule must be 'constant', 'heuristic' or "
                             f"'heuristic_transient', got {schedule!r}")
    thr = getattr(gc, "assistant_confidence_threshold", None)
    if thr and has_draft_probs:
        if isinstance(thr, bool) or not isinstance(thr, numbers.Real) or not 0 <= thr < 1:
            raise ValueError(f"generation_config.assistant_confidence_threshold must be in [0, 1), got {thr!r}")
        out["draft_confidence"] = float(thr)
    return out


def fold_arguments(parts, given: GenerateArgs) -> CallArgs:
    """``SpeculativeDecoder.generate``'s arguments (``given``), transformers' folded into the
    decoder's own: the prompts (``input_ids``, chat messages), a ``GenerationConfig``'s sampling,
    length, EOS and draft fields, ``do_sample``, the stopping criteria (a ``RowCriteria``) and the
    sequence-dependent logits processors (a ``VerifyProcessors``).  parts: the decoder's
    ``DecoderParts``.  Returns the unchecked ``CallArgs`` (``CallArgs.checked`` checks it)."""
    from transformers import MaxTimeCriteria, StopStringCriteria

    procs_given = {n: getattr(given, n) for n in _PROCESSOR_ARGS}
    prompts, input_ids = given.prompts, given.input_ids
    if input_ids is not None and prompts is not None:
        raise ValueError("pass the prompts as prompts or as input_ids, not both")
    if input_ids is None and prompts is None:
        raise TypeError("generate needs prompts (or input_ids=...), got neither")
    prompts = input_ids if input_ids is not None else prompts
    chat = chat_prompts(prompts, parts.tokenizer)
    if chat is not None:
        prompts = chat
    gc, do_sample = given.generation_config, given.do_sample
    args = {n: getattr(given, n) for n in _OWN_ARGS}
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool or None, got {type(do_sample).__name__}")
    extra = []  # stopping criteria made from the config
    if gc is not None:
        gc = resolve_generation_config(gc, parts.target)
        check_generation_config(gc)
        if do_sample is not None:
            raise ValueError(f"do_sample={do_sample} and generation_config.do_sample={gc.do_sample}: pass it in one "
                             f"place")
        from_config = {}
        temperature, top_k, top_p, min_p = sampling_from_config(gc)
        from_config.update(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        if gc.max_new_tokens is not None:
            from_config["max_new_tokens"] = gc.max_new_tokens
        elif gc.max_length is not None:
            width = max(len(r) for r in _rows_as_given(prompts, parts))  # T: rows left-padded to the longest
            if gc.max_length <= width:
                raise ValueError(f"generation_config.max_length must exceed the prompt length ({width} tokens, the "
                                 f"longest), got {gc.max_length} (or set max_new_tokens)")
            from_config["max_new_tokens"] = gc.max_length - width
        if gc.eos_token_id is not None:
            from_config["eos_token_id"] = gc.eos_token_id
        if getattr(gc, "stop_strings", None) is not None:
            if parts.tokenizer is None:
                raise ValueError("generation_config.stop_strings needs a tokenizer to detokenise the output, got "
                                 "tokenizer=None")
            extra.append(StopStringCriteria(tokenizer=parts.tokenizer, stop_strings=gc.stop_strings))
        if getattr(gc, "max_time", None) is not None:
            extra.append(MaxTimeCriteria(max_time=gc.max_time))
        if getattr(gc, "prompt_lookup_num_tokens", None) is not None and parts.drafter_name != "prompt_lookup":
            raise ValueError(f"generation_config.prompt_lookup_num_tokens needs a decoder that drafts by prompt "
                             f"lookup (SpeculativeDecoder(target=...)), got drafter={parts.drafter_name!r}")
        ngram = getattr(gc, "max_matching_ngram_size", None)
        if ngram is not None and parts.drafter_name == "prompt_lookup" and ngram != parts.lookup.max_ngram:
            raise ValueError(f"generation_config.max_matching_ngram_size must equal the decoder's max_ngram "
                             f"({parts.lookup.max_ngram}), got {ngram!r}")
        from_config.update(draft_settings(gc, parts.drafter_name, parts.has_draft_network))
        for name in ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids"):
            v = getattr(gc, name, None)
            if v is None or (name == "repetition_penalty" and v == 1.0) or (name == "no_repeat_ngram_size" and v == 0):
                continue
            if procs_given[name] is not None:
                raise ValueError(f"{name}={procs_given[name]!r} and generation_config (which sets it to {v!r}): pass "
                                 f"{name} in one place")
            procs_given[name] = v
        for name, value in from_config.items():
            if not given.is_default(name):
                raise ValueError(f"{name}={args[name]!r} and generation_config (which sets it to {value!r}): pass "
                                 f"{name} in one place")
            args[name] = value
    elif do_sample is False:
        args["temperature"] = 0.0
    elif do_sample is True and args["temperature"] == 0:
        args["temperature"] = 1.0  # transformers' default temperature
    criteria = given.stopping_criteria
    if criteria is not None:
        criteria = list(criteria) if isinstance(criteria, (list, tuple)) else [criteria]
        for c in criteria:
            if not callable(c):
                raise TypeError(f"stopping_criteria must hold StoppingCriteria (callables), got {type(c).__name__}")
    criteria = (criteria or []) + extra
    row_criteria = RowCriteria(criteria, _rows_as_given(prompts, parts), parts.device) if criteria else None
    verify_procs = None
    if any(v is not None for v in procs_given.values()):
        eos = eos_ids(args["eos_token_id"], parts.target, parts.tokenizer, parts.vocab_size)
        procs = processors_from_arguments(eos=eos, attention_mask=given.attention_mask, **procs_given)
        if procs:
            verify_procs = VerifyProcessors(procs, _rows_as_given(prompts, parts), parts.device, parts.vocab_size)
    return CallArgs(prompts=prompts, attention_mask=given.attention_mask, seed=given.seed, stop=given.stop,
                    verbose=given.verbose, progress=given.progress, streamer=given.streamer, criteria=row_criteria,
                    procs=verify_procs, baseline_tokens_per_s=given.baseline_tokens_per_s,
                    target_step_s=given.target_step_s, grammar=given.grammar, **args)


# generate's own arguments that a GenerationConfig or do_sample may set
_OWN_ARGS = ("max_new_tokens", "num_draft_tokens", "temperature", "top_k", "top_p", "min_p", "eos_token_id",
             "max_draft_tokens", "draft_confidence")


# SpeculativeDecoder.generate's arguments that make sequence-dependent logits processors
_PROCESSOR_ARGS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "prefix_allowed_tokens_fn",
                   "logits_processor")


def _rows_as_given(prompts, parts) -> list:
    """Each row's ids before its generated ones, as ``generate`` holds them: the [B, T] row as
    given (padding included), else the prompt's ids."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() in (1, 2):
        return (prompts[None] if prompts.dim() == 1 else prompts).cpu().tolist()
    return encode_prompts(prompts, None, parts.tokenizer, parts.vocab_size)
