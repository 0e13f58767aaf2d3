"""Sequence-dependent logits processors in the speculative loop: transformers'
``RepetitionPenaltyLogitsProcessor``, ``NoRepeatNGramLogitsProcessor``,
``NoBadWordsLogitsProcessor``, ``PrefixConstrainedLogitsProcessor`` (``prefix_allowed_tokens_fn``)
and processors of yours marked stateless.

Exactness: the target's scores at verify position i of row b (the logits after
``last, x_1 .. x_i``) are processed with the ids the target alone would have seen when sampling
that token: the row's ids as ``generate`` holds them (the input row as given, padding included,
then the generated tokens) followed by this step's drafts x_1 .. x_i.  The processed scores go to
``fused_verify``, which then applies temperature, top-k and top-p: the processors come before the
warpers, as in transformers' ``generate``.  The emitted tokens then follow ``generate``'s law with
those processors (greedy: its tokens).

The draft: a draft model that scores the target's whole vocabulary applies the same processors to
each of its drafts' logits, with that draft's prefix (the row's ids, its drafts before it), and
picks or samples from the processed scores, so its q is the processed distribution (more of its
drafts are accepted).  Prompt lookup, a feature draft and a draft with a draft vocabulary (or
another vocabulary size) propose without them: the verify only needs q to be what the draft
sampled from, so the output is exact either way.

Calls: one per verify position (and per draft model position) and per group of rows of equal
length (``input_ids`` [G, L + i], no padding added: a processor sees exactly the rows ``generate``
would show it), rows whose K_b is below i left out (their position i is not read).  A
``PrefixConstrainedLogitsProcessor`` gets each row's index in the batch as ``batch_id`` (as in
``generate``), and a repetition penalty's per-row ``prompt_ignore_length`` (transformers'
left-padding lengths) is taken for the rows of the call.

Which processors: the four transformers classes above (exact classes, not subclasses), and a
processor whose class or instance has ``specdec_stateless = True``: its owner vouches that it keeps
no state between calls, treats each row on its own whatever the other rows of the call are (a
call holds any subset of the batch), and may be called several times for one generated token.
Anything else is refused by its class name (it may count its calls, or read the batch as a whole).
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch

__all__ = ["STATELESS_ATTR", "VerifyProcessors", "check_sequence_processor", "processors_from_arguments",
           "sampling_from_processors", "split_processors"]

STATELESS_ATTR = "specdec_stateless"  # set True on a LogitsProcessor class or instance to opt in


def _vouched() -> tuple:
    from transformers import (NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                              PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor)

    return (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
            PrefixConstrainedLogitsProcessor)


def _warpers() -> tuple:
    from transformers import (LogitNormalization, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    return (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, LogitNormalization)


def sampling_from_processors(processors, do_sample: bool) -> tuple:
    """(temperature, top_k, top_p, min_p) from the logits processors ``generate`` prepared (from
    the config and the caller's ``logits_processor``): temperature, top-k, top-p and min-p warpers,
    in that order, and a final ``LogitNormalization`` (it changes no token).  Any other processor
    is refused by its class name.  Without sampling the warpers change no argmax: (0.0, None,
    None, None)."""
    order = _warpers()
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, _ = order
    t, top_k, top_p, min_p, last = 1.0, None, None, None, -1
    for proc in processors or ():
        kind = type(proc)
        if kind not in order:
            raise ValueError(f"logits_processor {kind.__name__} is not supported by specdec_kernels (it applies "
                             f"temperature, top-k, top-p and min-p only): remove it, or the generate argument that "
                             f"made it")
        pos = order.index(kind)
        if pos <= last:
            seen = ", ".join(type(p).__name__ for p in processors)
            raise ValueError(f"logits_processor must apply at most one of each warper, in the order temperature, "
                             f"top-k, top-p, min-p, got {seen}")
        last = pos
        if (kind in (TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
                and getattr(proc, "filter_value", -math.inf) != -math.inf):
            raise ValueError(f"logits_processor {kind.__name__} must have filter_value=-inf, got {proc.filter_value}")
        if kind is TemperatureLogitsWarper:
            t = float(proc.temperature)
        elif kind is TopKLogitsWarper:
            top_k = int(proc.top_k) or None
        elif kind is TopPLogitsWarper:
            if getattr(proc, "min_tokens_to_keep", 1) != 1:
                raise ValueError(f"logits_processor TopPLogitsWarper must have min_tokens_to_keep=1, got "
                                 f"{proc.min_tokens_to_keep}")
            top_p = float(proc.top_p) if proc.top_p < 1 else None
        elif kind is MinPLogitsWarper:
            # the verifier keeps at least the maximum (and its ties) only
            if getattr(proc, "min_tokens_to_keep", 1) != 1:
                raise ValueError(f"logits_processor MinPLogitsWarper must have min_tokens_to_keep=1, got "
                                 f"{proc.min_tokens_to_keep}")
            min_p = float(proc.min_p) or None
    if not do_sample:
        return 0.0, None, None, None
    return t, top_k, top_p, min_p


def check_sequence_processor(proc) -> None:
    """Refuse, by class name, a processor that cannot be applied per verify position."""
    from transformers import PrefixConstrainedLogitsProcessor

    kind = type(proc)
    if kind in _vouched():
        if kind is PrefixConstrainedLogitsProcessor and (getattr(proc, "_num_beams", 1) != 1 or not callable(
                getattr(proc, "_prefix_allowed_tokens_fn", None))):
            raise ValueError("logits_processor PrefixConstrainedLogitsProcessor must have num_beams=1 (no beam "
                             "search here)")
        return
    if getattr(proc, STATELESS_ATTR, False) is True and callable(proc):
        return
    names = ", ".join(k.__name__ for k in _vouched())
    raise ValueError(f"logits_processor {kind.__name__} is not supported by specdec_kernels: it applies the "
                     f"temperature, top-k and top-p warpers, {names}, and processors marked "
                     f"{STATELESS_ATTR} = True (no state between calls, each row on its own); remove it, or the "
                     f"generate argument that made it")


def _never_fires(proc, input_length: Optional[int]) -> bool:
    """A minimum-length processor that masks nothing for inputs of width ``input_length``: its
    minimum is already reached (``generate`` builds one for ``min_new_tokens=0``)."""
    from transformers import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    if input_length is None:
        return False
    if type(proc) is MinLengthLogitsProcessor:
        return proc.min_length <= input_length
    if type(proc) is MinNewTokensLengthLogitsProcessor:
        return proc.min_new_tokens <= 0
    return False


def split_processors(processors, do_sample: bool, input_length: Optional[int] = None) -> tuple:
    """(the sequence processors, in order; (temperature, top_k, top_p, min_p)) from the processors
    ``generate`` prepared: the sequence processors first, then the temperature / top-k / top-p / min-p
    warpers and a final ``LogitNormalization`` (``sampling_from_processors``).  Minimum
    lengths already reached by inputs of width ``input_length`` are dropped (they mask nothing)."""
    warpers, seq, rest = _warpers(), [], []
    for proc in processors or ():
        if _never_fires(proc, input_length):
            continue
        if type(proc) in warpers:
            rest.append(proc)
            continue
        check_sequence_processor(proc)
        if rest:
            seen = ", ".join(type(p).__name__ for p in processors)
            raise ValueError(f"logits_processor {type(proc).__name__} comes after a warper: the loop applies the "
                             f"processors, then temperature, top-k and top-p (generate's order), got {seen}")
        seq.append(proc)
    return seq, sampling_from_processors(rest, do_sample)


def _padding_lengths(attention_mask) -> Optional[torch.Tensor]:
    if attention_mask is None:
        return None
    return (torch.as_tensor(attention_mask) != 0).int().argmax(dim=1)


def _generate_skips_padding() -> bool:
    """Whether this transformers' ``generate`` gives its repetition penalty the rows' left-padding
    lengths (``prompt_ignore_length``, 5.24; 5.17 penalises the padding tokens too)."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    try:
        return "prompt_ignore_length" in inspect.getsource(GenerationMixin._get_logits_processor)
    except (OSError, TypeError):  # no source: the class's own signature says whether it could
        from transformers import RepetitionPenaltyLogitsProcessor

        ann = str(inspect.signature(RepetitionPenaltyLogitsProcessor).parameters.get("prompt_ignore_length", ""))
        return "Tensor" in ann


def processors_from_arguments(repetition_penalty=None, no_repeat_ngram_size=None, bad_words_ids=None,
                              prefix_allowed_tokens_fn=None, logits_processor=None, eos=None,
                              attention_mask=None) -> list:
    """The sequence processors ``generate``'s ``_get_logits_processor`` builds from these
    arguments, in its order (repetition penalty, n-gram blocking, banned words, the prefix
    constraint), then ``logits_processor``'s (one of the same class as a built one takes its place,
    as transformers does).  Warpers in ``logits_processor`` are refused: pass temperature, top_k,
    top_p.  eos: the EOS ids (banned words never hold a lone EOS, as in transformers);
    attention_mask: the [B, T] mask of left-padded input rows (the repetition penalty skips the
    padding where this transformers' ``generate`` does: 5.24, not 5.17)."""
    from transformers import (NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                              PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor)

    built = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        kw = {}
        pad = _padding_lengths(attention_mask)
        if pad is not None and _generate_skips_padding():
            kw["prompt_ignore_length"] = pad
        built.append(RepetitionPenaltyLogitsProcessor(float(repetition_penalty), **kw))
    if no_repeat_ngram_size is not None and no_repeat_ngram_size > 0:
        built.append(NoRepeatNGramLogitsProcessor(int(no_repeat_ngram_size)))
    if bad_words_ids is not None:
        built.append(NoBadWordsLogitsProcessor(bad_words_ids, sorted(eos) if eos else None))
    if prefix_allowed_tokens_fn is not None:
        built.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, 1))
    custom = list(logits_processor or ())
    for proc in custom:
        if type(proc) in _warpers():
            raise ValueError(f"logits_processor {type(proc).__name__}: pass temperature=, top_k=, top_p= (or a "
                             f"generation_config) instead")
        check_sequence_processor(proc)
    out = []
    for proc in built:
        same = [c for c in custom if type(c) is type(proc)]
        out.append(same[0] if same else proc)
    out += [c for c in custom if not any(c is o for o in out)]
    return out


def _position_ids(base: torch.Tensor, drafts: torch.Tensor, i: int) -> torch.Tensor:
    """The ids the target saw before verify position i: the rows' accepted ids, then x_1 .. x_i."""
    return torch.cat([base, drafts[:, :i]], 1)


class VerifyProcessors:
    """The sequence processors of one ``generate`` call, applied to each step's verify logits.

    procs: the processors, in order; prefixes[p]: prompt p's ids before its generated ones as
    ``generate`` holds them (the input row as given, padding included).  The draft model applies
    them too (``draft_scores``) where it scores the same vocabulary."""

    def __init__(self, procs: Sequence, prefixes: Sequence[Sequence[int]], device: torch.device,
                 vocab_size: Optional[int] = None):
        for proc in procs:
            check_sequence_processor(proc)
        self.procs = list(procs)
        self.vocab_size = vocab_size  # the target's logits' width (a draft of another width: not processed)
        self.prefixes = [list(p) for p in prefixes]
        self.device = device

    def _call(self, proc, ids: torch.Tensor, scores: torch.Tensor, prompts: list) -> torch.Tensor:
        from transformers import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

        kind = type(proc)
        if kind is PrefixConstrainedLogitsProcessor:  # batch_id: the row's index in the batch, as in generate
            fn = proc._prefix_allowed_tokens_fn
            proc = copy.copy(proc)
            proc._prefix_allowed_tokens_fn = lambda j, sent: fn(prompts[j], sent)
            return proc(ids, scores)
        if kind is RepetitionPenaltyLogitsProcessor and isinstance(getattr(proc, "prompt_ignore_length", None),
                                                                   torch.Tensor):
            proc = copy.copy(proc)  # its per-row lengths, for the rows of this call
            rows = torch.tensor(prompts, dtype=torch.int64, device=proc.prompt_ignore_length.device)
            proc.prompt_ignore_length = proc.prompt_ignore_length.index_select(0, rows)
        return proc(ids, scores)

    def _groups(self, rows: list, generated: list) -> list:
        """[(the batch rows, their ids [G, L])] for each length L of the rows' ids."""
        groups: dict = {}
        for b, p in enumerate(rows):
            groups.setdefault(len(self.prefixes[p]) + len(generated[p]), []).append(b)
        return [(bs, torch.tensor([self.prefixes[rows[b]] + generated[rows[b]] for b in bs], dtype=torch.int64,
                                  device=self.device)) for bs in groups.values()]

    def _position(self, out: torch.Tensor, i: int, groups: list, drafts: torch.Tensor, kb_host: Optional[list],
                  rows: list) -> None:
        """Process ``out`` [B, V] (a view, written in place) with the rows' ids and drafts
        x_1 .. x_i (rows whose K_b is below i left out; kb_host None: every row)."""
        for bs, base in groups:
            sel = [j for j, b in enumerate(bs) if kb_host is None or kb_host[b] >= i]
            if not sel:
                continue
            at = torch.tensor([bs[j] for j in sel], dtype=torch.int64, device=out.device)
            pick = torch.tensor(sel, dtype=torch.int64, device=self.device)
            ids = _position_ids(base.index_select(0, pick), drafts.index_select(0, at), i)
            scores = out.index_select(0, at)  # [G, V] (a copy)
            prompts = [rows[bs[j]] for j in sel]
            for proc in self.procs:
                scores = self._call(proc, ids, scores, prompts)
            out[at] = scores.to(out.dtype)

    def __call__(self, logits: torch.Tensor, drafts: torch.Tensor, kb_host: list, rows: list,
                 generated: list) -> torch.Tensor:
        """logits [B, K+1, V] -> the processed fp32 scores [B, K+1, V] (positions past a row's
        K_b as they were).  drafts [B, K]; kb_host[b]: row b's K_b; rows[b]: its prompt index;
        generated[p]: prompt p's generated ids."""
        out = logits.to(torch.float32, copy=True)
        groups = self._groups(rows, generated)
        for i in range(logits.shape[1]):
            if all(k < i for k in kb_host):
                break
            self._position(out[:, i], i, groups, drafts, kb_host, rows)
        return out

    def draft_scores(self, logits: torch.Tensor, drafts: list, rows: list, generated: list) -> torch.Tensor:
        """The draft model's logits [B, V] for its draft j + 1 (after drafts x_1 .. x_j, each [B])
        processed as the target's are at that position: the fp32 scores it then picks or samples
        from (its q is that distribution)."""
        B = logits.shape[0]
        x = torch.stack(drafts, 1) if drafts else torch.zeros((B, 0), dtype=torch.int64, device=logits.device)
        out = logits.to(torch.float32, copy=True)
        self._position(out, x.shape[1], self._groups(rows, generated), x, None, rows)
        return out
