"""The checks and normalisation of ``SpeculativeDecoder``'s arguments, before any model work:
each error names the argument, what it must be and what it got (STYLE.md item 11), and a
call that fails leaves nothing half-done.  ``decoder.py`` calls these; they hold no state.
"""

from __future__ import annotations

import numbers
import sys
from typing import Optional, Sequence, TextIO

import torch

from ..ops.verify import check_sampling_scalars

__all__ = ["MODEL_DTYPES", "as_float", "as_int", "check_context", "check_generate_args", "encode_prompts", "eos_ids",
           "load_tokenizer", "resolve_dtype", "row_seeds", "verbose_stream", "vocab_mismatch"]

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT64_MAX = 2**63 - 1


def as_int(x):
    """An Integral that is not a bool (a NumPy integer, say) as a Python int; anything else as it is."""
    return int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else x


def as_float(x):
    """A Real that is not a bool (a NumPy float, an int) as a Python float; anything else as it is."""
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else x


def resolve_dtype(dtype):
    """None, or one of the model dtypes (float32, float16, bfloat16), given as a dtype or a name."""
    if dtype is None:
        return None
    d = dtype
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
        d = getattr(torch, aliases.get(name, name), None)
    if d in MODEL_DTYPES:
        return d
    raise ValueError(f"dtype must be float32, float16 or bfloat16 (a torch.dtype or its name), got {dtype!r}")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(path, argument: str):
    """``AutoTokenizer.from_pretrained(path)``, refusing in one line a local directory that holds no
    tokenizer files (transformers' own error names neither the argument nor the directory).
    ``argument``: the argument the path came from ("tokenizer", "target" or "draft")."""
    import os

    from transformers import AutoTokenizer

    local = os.path.isdir(os.path.expanduser(str(path)))
    if local and not any(os.path.exists(os.path.join(os.path.expanduser(str(path)), f)) for f in _TOKENIZER_FILES):
        hint = "" if argument == "tokenizer" else " (pass tokenizer= / --tokenizer DIR with them)"
        raise ValueError(f"{argument} directory {path!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, "
                         f"...){hint}")
    return AutoTokenizer.from_pretrained(path)


def vocab_mismatch(a: dict, b: dict) -> Optional[str]:
    """None when two tokenizer vocabularies (token -> id) are equal, else what differs."""
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} entries"
    for tok, i in a.items():
        if b.get(tok) != i:
            return f"token {tok!r} has id {i} in the draft's and {b.get(tok)} in the target's"
    return "different entries"  # pragma: no cover


def check_generate_args(max_new_tokens, num_draft_tokens, temperature, top_k, top_p, stop, max_draft_tokens,
                        draft_confidence, *, drafter: str, has_draft: bool, has_tokenizer: bool,
                        min_p=None) -> tuple:
    """``generate``'s scalar arguments checked, in this order (each error names the argument,
    what it must be and what it got): returns (k_max, the stop strings as a list).
    ``has_draft``: a draft network gives probabilities (``draft_confidence`` needs them)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if max_new_tokens > _INT64_MAX:
        raise ValueError(f"max_new_tokens must fit in int64 (<= {_INT64_MAX}), got {max_new_tokens}")
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int):
        raise TypeError(f"max_draft_tokens must be an int, got {type(max_draft_tokens).__name__}")
    if max_draft_tokens <= 0:
        raise ValueError(f"max_draft_tokens must be > 0, got {max_draft_tokens}")

    if isinstance(draft_confidence, bool) or not isinstance(draft_confidence, (int, float)):
        raise TypeError(f"draft_confidence must be a float, got {type(draft_confidence).__name__}")
    if not 0.0 <= draft_confidence < 1.0:
        raise ValueError(f"draft_confidence must be in [0, 1) (0 = off), got {draft_confidence}")
    if draft_confidence > 0 and not has_draft:
        raise ValueError(f"draft_confidence needs a draft model's probabilities; drafter={drafter!r} "
                         f"has none, got draft_confidence={draft_confidence}")
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"num_draft_tokens must be a positive int or 'auto', got {num_draft_tokens!r}")
        k_max = max_draft_tokens
    elif isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
        raise TypeError(f"num_draft_tokens must be a positive int or 'auto', got {type(num_draft_tokens).__name__}")
    elif num_draft_tokens <= 0:
        raise ValueError(f"num_draft_tokens must be a positive int or 'auto', got {num_draft_tokens}")
    else:
        k_max = num_draft_tokens
    check_sampling_scalars(temperature, top_k, top_p, min_p)
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty, got ''")
    if stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer to detokenise the output, got tokenizer=None")
    return k_max, list(stop)


def row_seeds(seed, B: int) -> list:
    """Row p's seed: ``seed + p``, ``seed[p]``, or (None) ``seed + p`` from a random ``seed``."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    seed = as_int(seed)
    if isinstance(seed, bool) or (isinstance(seed, (list, tuple)) and any(isinstance(s, bool) for s in seed)):
        raise TypeError(f"seed must be an int, a list of ints or None, got a bool ({seed!r:.40})")
    if isinstance(seed, int):
        seeds = [seed + p for p in range(B)]
        what = "seed + {p} (row {p}'s seed)"
    elif isinstance(seed, (list, tuple)) and all(isinstance(as_int(s), int) for s in seed):
        if len(seed) != B:
            raise ValueError(f"seed as a list must have one entry per prompt ({B}), got {len(seed)}")
        seeds = [as_int(s) for s in seed]
        what = "seed[{p}]"
    else:
        raise TypeError(f"seed must be an int, a list of ints or None, got {type(seed).__name__}")
    for p, s in enumerate(seeds):
        if not -(2**63) <= s < 2**63:
            name = "seed" if what.startswith("seed +") and p == 0 else what.format(p=p)
            raise ValueError(f"{name} must fit in int64 [-2**63, 2**63), got {s}")
    return seeds


def verbose_stream(verbose) -> Optional[TextIO]:
    """Where the trace goes: None (off), stdout (True), or the text stream given."""
    if verbose is True:
        verbose = sys.stdout
    elif verbose is False or verbose is None:
        verbose = None
    elif not callable(getattr(verbose, "write", None)):
        raise TypeError(f"verbose must be a bool or a text stream (with .write), got {type(verbose).__name__}")
    return verbose


def encode_prompts(prompts, attention_mask, tokenizer, vocab_size: int) -> list:
    """prompts (``generate``'s forms) -> list of token-id lists, each checked to be non-empty
    and within [0, vocab_size); text needs ``tokenizer``."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype.is_floating_point or prompts.dtype == torch.bool:
            raise TypeError(f"prompts as a tensor must hold integer token ids, got dtype {prompts.dtype}")
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"prompts as a tensor must be [B, T] token ids, got shape {list(prompts.shape)}")
        if prompts.shape[0] == 0:
            raise ValueError("prompts must hold at least one prompt, got a [0, T] tensor")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or list(attention_mask.shape) != list(prompts.shape):
                got = (list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                       else type(attention_mask).__name__)
                raise ValueError(f"attention_mask must be [B, T] = {list(prompts.shape)} like prompts, got {got}")
            m = attention_mask.cpu()
            if m.dtype != torch.bool:
                if m.dtype.is_complex:
                    raise TypeError(f"attention_mask must hold 0 and 1 (bool, integer or float), got dtype {m.dtype}")
                odd = m[(m != 0) & (m != 1)]
                if odd.numel():
                    raise ValueError(f"attention_mask must hold only 0 and 1, got {odd[0].item()}")
                m = m != 0
            for i, row in enumerate(m):
                on = row.nonzero()[:, 0]
                if on.numel() and int(on[-1] - on[0]) + 1 != on.numel():
                    raise ValueError(f"attention_mask[{i}] must mark one contiguous run of tokens (left or right "
                                     f"padding), got a gap between columns {int(on[0])} and {int(on[-1])}")
            rows = [row[mi].tolist() for row, mi in zip(prompts.cpu(), m)]
        else:
            rows = prompts.cpu().tolist()
    elif isinstance(prompts, (list, tuple)):
        if len(prompts) == 0:
            raise ValueError("prompts must hold at least one prompt, got an empty list")
        if attention_mask is not None:
            raise ValueError("attention_mask is only taken with prompts given as a [B, T] tensor")
        rows = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if p == "":
                    raise ValueError(f"prompts[{i}] must not be empty, got ''")
                if tokenizer is None:
                    raise TypeError("prompts given as text need a tokenizer: pass tokenizer=... to "
                                    "SpeculativeDecoder, or give token ids")
                rows.append(list(tokenizer(p)["input_ids"]))
            elif isinstance(p, torch.Tensor):
                if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool or p.dim() != 1:
                    raise TypeError(f"prompts[{i}] as a tensor must be 1-D integer token ids, got dtype "
                                    f"{str(p.dtype).replace('torch.', '')} shape {list(p.shape)}")
                rows.append(p.tolist())
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                rows.append(list(p))
            else:
                what = type(p).__name__
                if isinstance(p, (list, tuple)):  # say which element is not an int id
                    bad = next(t for t in p if not isinstance(t, int) or isinstance(t, bool))
                    what = f"a {what} holding a {type(bad).__name__} ({bad!r:.40})"
                raise TypeError(f"prompts[{i}] must be a str or a list of int token ids, got {what}")
    else:
        raise TypeError(f"prompts must be a str, a list of str, a list of token-id lists or a [B, T] "
                        f"tensor, got {type(prompts).__name__}")
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompts[{i}] must not be empty, got 0 tokens")
        bad = [t for t in r if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] token ids must be in [0, {vocab_size}), got {bad[0]}")
    return rows


def check_context(rows: list, runners: Sequence) -> Optional[int]:
    """The longest sequence allowed (the smallest ``context``, max_position_embeddings, of the
    runners given; None: no limit); prompts above it are refused."""
    limits = [(r.name, r.context, getattr(r, "context_source", "max_position_embeddings"))
              for r in runners if r is not None and r.context]
    if not limits:
        return None
    for i, r in enumerate(rows):
        for name, ctx, source in limits:
            if len(r) > ctx:
                raise ValueError(f"prompts[{i}] must fit the {name}'s context ({source} = {ctx}), got "
                                 f"{len(r)} tokens")
    return min(c for _, c, _ in limits)


def eos_ids(eos_token_id, target, tokenizer, vocab_size: int) -> set:
    """The EOS ids: ``eos_token_id`` (an int, ints, or a 0/1-D integer tensor; each in [0,
    vocab_size), else it could never match), else the target's generation config's, its
    config's, or the tokenizer's; an empty set when none says."""
    given = eos_token_id is not None
    if eos_token_id is None:
        gc = getattr(target, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(target.config, "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor) and eos_token_id.dim() <= 1 and not (
            eos_token_id.dtype.is_floating_point or eos_token_id.dtype == torch.bool):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    eos_token_id = as_int(eos_token_id)
    if isinstance(eos_token_id, (list, tuple, set)):
        eos_token_id = [as_int(e) for e in eos_token_id]
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if isinstance(eos_token_id, (str, bool)) or not isinstance(ids, (list, tuple, set)) or any(
            isinstance(e, bool) or not isinstance(e, int) for e in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {type(eos_token_id).__name__}"
                        f" ({eos_token_id!r:.40})")
    bad = [e for e in ids if not 0 <= e < vocab_size]
    if given and bad:
        raise ValueError(f"eos_token_id must be in [0, {vocab_size}) (the target's vocabulary), got {bad[0]}")
    return set(ids)
