"""``generate``: a decoding method for transformers' ``generate(custom_generate=...)``, which runs
this package's batched speculative loop (``SpeculativeDecoder``, ``fused_verify``)::

    out = target.generate(**tok(prompts, return_tensors="pt", padding=True),
                          custom_generate=specdec_kernels.hf.generate, assistant_model=draft,
                          do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64)

transformers prepares the call as for its own loop (the ``GenerationConfig`` with the model's and
its defaults, the logits processors and stopping criteria built from it, the prompt already put to
the streamer), then calls ``generate(model, input_ids, logits_processor=, stopping_criteria=,
generation_config=, **model_kwargs)``.  It returns what transformers returns: [B, T + N] ids (the
input rows as given, padding included, then the new tokens; a row that ended early is filled
with ``pad_token_id``), or a ``GenerateDecoderOnlyOutput`` with ``sequences`` when
``return_dict_in_generate=True``.  The emitted tokens follow the target's law exactly (greedy:
its argmax at every position), whatever the draft (Leviathan et al. 2023; Chen et al. 2023).

The draft: ``assistant_model=`` (a causal LM over the target's vocabulary, or over another one with
``tokenizer=`` and ``assistant_tokenizer=``, as for transformers' Universal Assisted Generation:
see ``generate``; batched and exact at every temperature), or, without one,
``prompt_lookup_num_tokens=`` (drafts copied from the row's own text).  transformers 5.17 to 5.25
pass neither ``assistant_model`` nor ``streamer`` to a callable ``custom_generate`` (it keeps
only the arguments of the callable's signature that are still in its ``**kwargs``), so
``generate`` reads them from the calling ``GenerationMixin.generate``'s frame; they may also be
passed directly when ``generate`` is called as a function.  ``tokenizer=`` does not reach it
either, so transformers itself refuses ``stop_strings`` with a ``custom_generate`` callable: pass
``stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, [...])])`` instead.

Seeds: row p samples with seed ``seed + p`` (``SpeculativeDecoder``'s counter-based random numbers,
independent of the other rows).  ``seed=`` passes through ``generate``'s keyword arguments; by
default the seed is drawn from torch's global generator (one ``torch.randint``), so
``torch.manual_seed(s)`` before the call reproduces it, token for token at a fixed K (a
"heuristic" schedule picks K from measured times: reproducible in law only).

Per-token stopping: the stopping criteria other than max length and EOS (``MaxTimeCriteria``,
``StopStringCriteria``, yours) are called after each emitted token on that row alone, a [1, T]
batch holding the row as transformers holds it (the input row as given, then its new tokens),
with ``scores=None``; the row ends at the first token where one fires.  A streamer takes one
prompt (batch size 1, as transformers' ``TextStreamer``): after the prompt it gets each step's
emitted tokens (1-D), then ``end()``.

The ``GenerationConfig`` fields (used, of no effect, or refused by name) and the logits processors
that are applied at every verified position: ``docs/api.md``, "transformers".

Model keyword arguments: ``attention_mask`` (left or right padding; the new tokens follow the
valid ones, where transformers would continue a right-padded row from its pad column),
``position_ids`` equal to the mask's, an empty cache; any other is refused by name.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

import torch

from .decoding.call import GenerateArgs
from .decoding.transformers_adapter.config import (check_generation_config, draft_settings,
                                                   resolve_generation_config, sampling_from_config)
from .decoding.transformers_adapter.criteria import RowCriteria, check_streamer, split_criteria
from .decoding.transformers_adapter.processors import VerifyProcessors, processors_from_arguments, split_processors

__all__ = ["generate"]

# model keyword arguments transformers prepares for its own loop; the loop makes its own
_PREPARED = ("attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache",
             "cache_position")
_PROMPT_LOOKUP_NGRAM = 2  # transformers' PromptLookupCandidateGenerator default max_matching_ngram_size


def _calling_generate_locals() -> dict:
    """The local variables of transformers' ``GenerationMixin.generate`` when it is the caller of
    ``generate`` (the ``custom_generate`` path), else {}."""
    frame = sys._getframe(2)
    code = frame.f_code
    path = code.co_filename.replace("\\", "/")
    if code.co_name == "generate" and path.endswith("transformers/generation/utils.py"):
        return frame.f_locals
    return {}


@functools.lru_cache(maxsize=8)
def _saved_tokenizer(path: str):
    """The tokenizer saved with a model (a local directory, or a hub id already in the local
    cache: nothing is downloaded), or None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def _pair_tokenizers(model, assistant_model, tokenizer, assistant_tokenizer) -> tuple:
    """(tokenizer, assistant_tokenizer): as given; one not given is the one saved with its model
    (``name_or_path``), looked up where the other is given or where the models' vocabulary sizes
    differ.  Models of different vocabulary sizes whose tokenizers cannot be found are refused in
    one line (their ids cannot be compared)."""
    sizes = [m.config.get_text_config().vocab_size for m in (model, assistant_model)]
    if tokenizer is None and assistant_tokenizer is None and sizes[0] == sizes[1]:
        return None, None  # one vocabulary (a padded one is told by the decoder's own checks)
    found = [t if t is not None else _saved_tokenizer(str(getattr(m, "name_or_path", "") or "")) if
             getattr(m, "name_or_path", None) else None
             for t, m in ((tokenizer, model), (assistant_tokenizer, assistant_model))]
    if None in found and (sizes[0] != sizes[1] or found != [None, None]):
        which = " and ".join(n for n, t in zip(("tokenizer=", "assistant_tokenizer="), found) if t is None)
        raise ValueError(f"a draft over another vocabulary needs both tokenizers, got none for {which} (none is "
                         f"saved with the model, name_or_path: target {getattr(model, 'name_or_path', None)!r}, "
                         f"draft {getattr(assistant_model, 'name_or_path', None)!r}); transformers' generate drops "
                         f"tokenizer= and assistant_tokenizer= before a custom_generate callable: call "
                         f"specdec_kernels.hf.generate(model, input_ids, assistant_model=..., tokenizer=..., "
                         f"assistant_tokenizer=...) directly")
    return found[0], found[1]


def _check_model_kwargs(model_kwargs: dict, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The attention mask ([B, T] or None); refuses the model keyword arguments the loop cannot honour."""
    for name, v in model_kwargs.items():
        if name not in _PREPARED and v is not None:
            raise ValueError(f"generate's {name}= is not supported by specdec_kernels.hf.generate (it takes "
                             f"input_ids and attention_mask), got {type(v).__name__}")
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise ValueError(f"{name} must be empty (the loop prefills its own caches from input_ids), got one "
                             f"holding {cache.get_seq_length()} tokens")
    if model_kwargs.get("use_cache") is False:
        raise ValueError("use_cache must be True (the loop decodes with its KV caches), got False")
    mask = model_kwargs.get("attention_mask")
    pos = model_kwargs.get("position_ids")
    if pos is not None:
        m = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.to(input_ids.device) != 0
        want = m.long().cumsum(-1) - 1  # [B, T]: each valid token's position
        if pos.shape != input_ids.shape or not torch.equal(pos.to(want.device)[m], want[m]):
            raise ValueError("position_ids must be the attention mask's (0, 1, ... over each row's valid tokens), "
                             "got others")
    return mask


def generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None, generation_config=None,
             synced_gpus: bool = False, streamer=None, *, assistant_model=None, seed=None, tokenizer=None,
             assistant_tokenizer=None, grammar=None, **model_kwargs) -> Any:
    """Speculative decoding of ``model`` (the target) as transformers' ``generate`` decodes; see the
    module docstring.  model, input_ids [B, T], logits_processor, stopping_criteria,
    generation_config: as transformers' ``generate`` prepares them for ``custom_generate``.
    assistant_model: the draft (default: the calling ``generate``'s).  seed: an int (row p uses
    seed + p), a list of one int per row, or None (drawn from torch's global generator).
    tokenizer, assistant_tokenizer: the target's and the draft's tokenizers, for a draft over
    another vocabulary (``SpeculativeDecoder(draft_tokenizer=...)``); transformers 5.17 to 5.25
    drop both before calling a ``custom_generate`` callable, so one not passed here is the one
    saved with its model (``name_or_path``: a directory, or a hub id in the local cache), looked
    up where the models' vocabulary sizes differ or the other tokenizer is given.
    grammar: structured output, as ``SpeculativeDecoder.generate``'s (a JSON schema, a regex or EBNF
    from ``specdec_kernels.decoding.grammar``, or an xgrammar ``CompiledGrammar``); one to compile
    needs the target's tokenizer: ``tokenizer=``, else the one saved with the model.
    Returns [B, T + N] int64 ids on ``input_ids``' device, or a ``GenerateDecoderOnlyOutput``."""
    from transformers import GenerationConfig, MaxTimeCriteria
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from .decoding.decoder import SpeculativeDecoder

    outer = _calling_generate_locals()
    if assistant_model is None:
        assistant_model = outer.get("assistant_model")
    if streamer is None:
        streamer = outer.get("streamer")
    if grammar is None:  # transformers keeps it in its own **kwargs
        grammar = (outer.get("kwargs") or {}).get("grammar")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model must be a decoder-only causal LM, got an encoder-decoder "
                         f"({type(model).__name__})")
    if synced_gpus:
        raise ValueError("synced_gpus must be False (one process decodes its whole batch), got True")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be [B, T] token ids with T >= 1 (inputs_embeds are not supported), got {got}")
    gc = resolve_generation_config(generation_config if generation_config is not None else GenerationConfig(), model)
    check_generation_config(gc, input_length=input_ids.shape[1])
    mask = _check_model_kwargs(model_kwargs, input_ids)
    lookup_k = getattr(gc, "prompt_lookup_num_tokens", None)
    if assistant_model is not None and lookup_k is not None:
        raise ValueError(f"pass a draft as assistant_model or prompt_lookup_num_tokens, not both, got "
                         f"prompt_lookup_num_tokens={lookup_k}")
    if assistant_model is None and lookup_k is None:
        raise ValueError("specdec_kernels.hf.generate needs a draft: assistant_model=<a causal LM> or "
                         "prompt_lookup_num_tokens=<K>, got neither")
    # called by transformers' generate: the processors and criteria it built from the config (and
    # the caller's); called directly without them: the config's fields themselves
    procs = []
    if logits_processor is None:
        temperature, top_k, top_p, min_p = sampling_from_config(gc)
        procs = processors_from_arguments(getattr(gc, "repetition_penalty", None),
                                          getattr(gc, "no_repeat_ngram_size", None),
                                          getattr(gc, "bad_words_ids", None),
                                          eos=None if gc.eos_token_id is None else
                                          torch.as_tensor(gc.eos_token_id).reshape(-1).tolist(),
                                          attention_mask=model_kwargs.get("attention_mask"))
    else:
        procs, (temperature, top_k, top_p, min_p) = split_processors(logits_processor, bool(gc.do_sample),
                                                                     input_ids.shape[1])
    max_length, eos, rest = split_criteria(stopping_criteria)
    if stopping_criteria is None:
        if getattr(gc, "stop_strings", None) is not None:
            raise ValueError("generation_config.stop_strings needs a tokenizer: pass stopping_criteria="
                             "StoppingCriteriaList([StopStringCriteria(tokenizer, stop_strings)]) instead")
        if getattr(gc, "max_time", None) is not None:
            rest.append(MaxTimeCriteria(max_time=gc.max_time))
        if gc.eos_token_id is not None:
            eos = torch.as_tensor(gc.eos_token_id).reshape(-1).tolist()
    B, T = input_ids.shape
    if max_length is None:
        max_length = T + gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length
    if max_length <= T:
        raise ValueError(f"max_length must exceed the input length T = {T}, got {max_length} (set max_new_tokens)")
    check_streamer(streamer, B)
    pad = getattr(gc, "_pad_token_tensor", None)
    pad = gc.pad_token_id if pad is None else pad
    if isinstance(pad, torch.Tensor):
        pad = int(pad.reshape(-1)[0])
    if B > 1 and pad is None:
        raise ValueError("pad_token_id must be set to fill rows that end early when B > 1, got None")

    modes = [(m, m.training) for m in (model, assistant_model) if m is not None]
    try:
        if grammar is not None and tokenizer is None and getattr(model, "name_or_path", None):
            tokenizer = _saved_tokenizer(str(model.name_or_path))  # a grammar is compiled over its text
        if assistant_model is not None:
            tokenizer, assistant_tokenizer = _pair_tokenizers(model, assistant_model, tokenizer, assistant_tokenizer)
            dec = SpeculativeDecoder(draft=assistant_model, target=model, tokenizer=tokenizer,
                                     draft_tokenizer=assistant_tokenizer)
        else:
            ngram = getattr(gc, "max_matching_ngram_size", None) or _PROMPT_LOOKUP_NGRAM
            dec = SpeculativeDecoder(target=model, max_ngram=ngram, tokenizer=tokenizer)
        draft = {n: GenerateArgs.default(n) for n in ("num_draft_tokens", "max_draft_tokens", "draft_confidence")}
        draft.update(draft_settings(gc, dec.drafter, dec.has_draft_network))
        with torch.inference_mode():
            st = dec.start(input_ids, max_length - T, draft["num_draft_tokens"], temperature, top_k, top_p, seed,
                           attention_mask=mask, max_draft_tokens=draft["max_draft_tokens"],
                           draft_confidence=draft["draft_confidence"], eos_token_id=[] if eos is None else eos,
                           min_p=min_p, streamer=streamer,  # transformers' generate put the prompt
                           criteria=RowCriteria(rest, input_ids.tolist(), dec.device) if len(rest) else None,
                           procs=VerifyProcessors(procs, input_ids.tolist(), dec.device, dec.vocab_size)
                           if procs else None, grammar=grammar)
            res = dec.decode(st)
    finally:
        for m, training in modes:
            m.train(training)
    new = res.token_ids
    out = torch.full((B, T + max(len(g) for g in new)), 0 if pad is None else pad, dtype=torch.long)  # [B, T + N]
    out[:, :T] = input_ids.cpu()
    for b, g in enumerate(new):
        out[b, T:T + len(g)] = torch.tensor(g, dtype=torch.long)
    out = out.to(input_ids.device)
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=out)
    return out
