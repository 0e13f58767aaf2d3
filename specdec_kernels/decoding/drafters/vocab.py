"""A draft vocabulary: the tokens a draft model may propose.

A small draft spends much of a decode step in its output layer: the embedded draft's 49,152 x 192
layer is about half of its time per token on a CPU (docs/history/measurements.md).  Its
correct guesses are frequent tokens, so its logits are computed only for the ``N`` tokens the
target emits most often (the idea of FR-Spec, Zhao et al. 2025, "frequency-ranked speculative
sampling"): the draft proposes the argmax (or a sample) over those ``N`` tokens, and its
distribution ``q`` is zero elsewhere.

Exactness does not depend on the choice.  Verification accepts a drafted token with probability
min(1, p/q) and otherwise samples the residual max(0, p - q), whose mass includes every token the
draft cannot propose: the output is distributed as the target's whatever set is used (the tests
check it with a chi-square).  The set only changes how often drafts are accepted.

A draft vocabulary travels with the draft as ``draft_vocab.json`` in its directory: an object
with ``"token_ids"`` (sorted, unique ints), ``"vocab_size"`` (the draft's), ``"size"`` and string
``"metadata"`` (how it was chosen).  It is JSON, not safetensors, because engines that load every
``*.safetensors`` of a model directory as weights (vLLM) refuse a directory holding a tensor that
is not one; ``from_pretrained`` ignores the file either way.  Directories written before hold
``draft_vocab.safetensors`` (one int64 tensor ``token_ids``, the same metadata): they are still
read, and ``save_draft_vocab`` replaces that file by the JSON one.
``SpeculativeDecoder(draft_vocab="auto")`` (the default) uses the file when the draft was loaded
from a directory that holds one.
"""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["FILE_NAME", "LEGACY_FILE_NAME", "check_draft_vocab", "directory_vocab_file", "frequent_tokens",
           "load_draft_vocab", "model_directory_vocab", "resolve_draft_vocab", "save_draft_vocab"]

FILE_NAME = "draft_vocab.json"
LEGACY_FILE_NAME = "draft_vocab.safetensors"  # the earlier form, still read
_FORMAT = "specdec_kernels.draft_vocab"  # the files' format name (not a module path)


def check_draft_vocab(token_ids: Union[Tensor, Sequence[int]], vocab_size: int, name: str = "draft_vocab") -> Tensor:
    """``token_ids`` as a sorted int64 CPU tensor, after checking it: 1-D, integer, non-empty,
    unique, every id in [0, vocab_size).  A ``ValueError`` or ``TypeError`` names what is wrong."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if isinstance(token_ids, Tensor):
        t = token_ids.detach()
        if t.is_meta:
            raise ValueError(f"{name} must hold token ids, got a tensor on the meta device (no data)")
    elif isinstance(token_ids, (list, tuple, range)) and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in token_ids):
        t = torch.tensor([int(v) for v in token_ids], dtype=torch.int64)
    else:
        what = type(token_ids).__name__
        if isinstance(token_ids, (list, tuple)):  # say which element is not an int
            bad = next(v for v in token_ids if not isinstance(v, numbers.Integral) or isinstance(v, bool))
            what = f"a {what} holding a {type(bad).__name__} ({bad!r:.40})"
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {what}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor of token ids, got shape {tuple(t.shape)}")
    t = t.to(device="cpu", dtype=torch.int64)
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} ids must be in [0, {vocab_size}) (the draft's vocab_size), got min {lo}, max {hi}")
    t = t.sort().values
    if t.numel() > 1 and bool((t[1:] == t[:-1]).any()):
        dup = int(t[1:][t[1:] == t[:-1]][0])
        raise ValueError(f"{name} ids must be unique, got {dup} more than once")
    return t


def frequent_tokens(counts: Tensor, n: int) -> Tensor:
    """The ``n`` token ids with the largest ``counts`` (a [V] integer tensor of occurrences; ties
    go to the lower id), sorted ascending.  ``n`` must be in [1, V]."""
    if not isinstance(counts, Tensor) or counts.dim() != 1 or counts.dtype.is_floating_point \
            or counts.dtype.is_complex or counts.dtype == torch.bool:
        got = (f"shape {tuple(counts.shape)}, dtype {counts.dtype}" if isinstance(counts, Tensor)
               else type(counts).__name__)
        raise ValueError(f"counts must be a 1-D integer tensor [V], got {got}")
    V = counts.numel()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= V:
        raise ValueError(f"n must be an int in [1, {V}], got {n!r}")
    order = torch.argsort(-counts.to(torch.int64), stable=True)  # descending counts, lower id first on ties
    return order[:n].sort().values


def directory_vocab_file(directory: Union[str, os.PathLike]) -> Optional[Path]:
    """The draft vocabulary file in ``directory``: ``draft_vocab.json``, else the earlier
    ``draft_vocab.safetensors``, else None."""
    d = Path(directory)
    for name in (FILE_NAME, LEGACY_FILE_NAME):
        if (d / name).is_file():
            return d / name
    return None


def save_draft_vocab(directory: Union[str, os.PathLike], token_ids: Tensor, vocab_size: int,
                     **metadata: str) -> Path:
    """Write ``token_ids`` (checked against ``vocab_size``) to ``directory/draft_vocab.json`` with
    string ``metadata`` (how it was chosen), removing an earlier ``draft_vocab.safetensors`` there;
    returns the file's path."""
    t = check_draft_vocab(token_ids, vocab_size)
    d = Path(directory)
    path = d / FILE_NAME
    doc = {"format": _FORMAT, "vocab_size": vocab_size, "size": t.numel(),
           "metadata": {str(k): str(v) for k, v in metadata.items()}, "token_ids": t.tolist()}
    tmp = d / (FILE_NAME + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    legacy = d / LEGACY_FILE_NAME
    if legacy.is_file():
        legacy.unlink()
    return path


def _read_json(p: Path) -> tuple[dict, object]:
    try:
        doc = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p} must be a JSON draft vocabulary (an object with 'token_ids'), got a file it cannot "
                         f"read ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or "token_ids" not in doc:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{p} must hold an object with 'token_ids', got {got}")
    recorded = doc.get("vocab_size")
    return {"vocab_size": str(recorded) if recorded is not None else None}, doc["token_ids"]


def _read_safetensors(p: Path) -> tuple[dict, object]:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            data = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error types: a file that is not one
        raise ValueError(f"{p} must be a safetensors draft vocabulary (a tensor 'token_ids'), got a file it "
                         f"cannot read ({type(e).__name__}: {e})") from None
    if "token_ids" not in data:
        raise ValueError(f"{p} must hold a tensor 'token_ids', got {sorted(data)}")
    return meta, data["token_ids"]


def load_draft_vocab(path: Union[str, os.PathLike], vocab_size: Optional[int]) -> Tensor:
    """The token ids of a draft vocabulary file (``.json``, or the earlier ``.safetensors``), or of
    the one in a directory (``directory_vocab_file``), checked against ``vocab_size`` (also the one
    the file records; None: the file's form only, as the CLI checks before any model loads).
    ``FileNotFoundError`` names the path when there is none."""
    p = Path(path)
    if p.is_dir():
        found = directory_vocab_file(p)
        p = found if found is not None else p / FILE_NAME
    if not p.is_file():
        raise FileNotFoundError(f"no draft vocabulary at {p}")
    meta, ids = _read_json(p) if p.suffix == ".json" else _read_safetensors(p)
    recorded = meta.get("vocab_size")
    if vocab_size is not None and recorded is not None and recorded.isdigit() and int(recorded) != vocab_size:
        raise ValueError(f"{p} must be a draft vocabulary for vocab_size {vocab_size} (the draft's), got one "
                         f"saved for vocab_size {recorded}")
    return check_draft_vocab(ids, 2**62 if vocab_size is None else vocab_size, name=f"token_ids of {p}")


def model_directory_vocab(model) -> Optional[Path]:
    """The draft vocabulary file in the local directory ``model`` was loaded from, or None."""
    where = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not where:
        return None
    return directory_vocab_file(Path(str(where)))


def resolve_draft_vocab(spec, runner, drafter: str, draft, feature, feature_vocab) -> Optional[torch.Tensor]:
    """``SpeculativeDecoder(draft_vocab=spec)`` resolved for its draft network (``runner``, or
    None without one): "auto" is the draft directory's saved vocabulary (a feature draft's own,
    saved with it), None the whole vocabulary, a path a file or directory, else the ids
    themselves; the whole vocabulary is returned as None."""
    if spec is None or (isinstance(spec, str) and spec == "auto" and runner is None):
        return None
    if runner is None:
        raise ValueError(f"draft_vocab restricts a draft model's proposals; drafter={drafter!r} has "
                         f"no draft model, got draft_vocab={spec!r}")
    V = runner.vocab_size
    if isinstance(spec, str) and spec == "auto" and feature is not None:
        ids = feature_vocab  # the one saved with the feature draft, if any
    elif isinstance(spec, str) and spec == "auto":
        path = model_directory_vocab(draft)
        ids = None if path is None else load_draft_vocab(path, V)
    elif isinstance(spec, (str, os.PathLike)):
        ids = load_draft_vocab(spec, V)
    else:
        ids = check_draft_vocab(spec, V)
    return None if ids is None or ids.numel() == V else ids
