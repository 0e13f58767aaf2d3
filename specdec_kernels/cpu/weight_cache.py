"""The fp16 weight copies kept on disk, so that the next process over the same weights maps them
instead of making them again.

``use_skinny_linear`` streams an fp16 copy of every fp32 weight that fp16 holds exactly.  Making
the copies is one read of the weights and one write of the copies (``ops.linear.fp16_exact_copy``),
but the copies are new memory, and the first write to each page of fresh memory is a page fault
(the page zeroed, then mapped; on a virtual machine the host backing it too).  On the 2-core VM
of ``docs/benchmarks.md`` that first touch runs at 0.6-0.7 GB/s, so a Qwen2.5-1.5B/0.5B pair's
4 GB of copies costs ~6 s in every new process (``bench/decoding/bench_first_call.py``).

With a cache directory each copy lives in a file there, named by a fingerprint of its weight
(shape and a sample of its values).  The first process writes the copy straight into the file's
mapping (the same one pass, no second copy); every later one maps the file, which the page cache
usually still holds, and checks it against the weight in full (``fp16_copy_matches``: one read of
both, every value's bits) before using it.  A fingerprint is only a name: a file whose values
differ from the weight in any bit (another weight with the same sample, a weight changed since,
a file damaged) fails the check and is written again, so the tokens never depend on the cache.

Files are replaced by rename, never written in place, so a process mapping one is not disturbed
by another writing the same name.  A weight fp16 does not hold exactly writes nothing (its first
64k values are checked before any file is made).  The directory grows by half of each exact
weight's fp32 bytes per distinct model; ``clear(directory)`` empties it.

Chosen per ``CpuAccelerator(weight_cache=...)``: a directory, ``False`` for none, or ``None`` for
the environment variable ``SPECDEC_WEIGHT_CACHE`` (unset, empty, ``0`` or ``off``: none).
``specdec generate`` uses ``default_directory()`` unless given ``--no-weight-cache``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

from ..ops.linear import fp16_copy_matches, fp16_exact_copy, fp16_exact_copy_into

__all__ = ["ENV", "clear", "default_directory", "fingerprint", "fp16_copy", "resolve"]

ENV = "SPECDEC_WEIGHT_CACHE"
_SUFFIX = ".f16"
_SAMPLES = 4096  # values sampled evenly across the weight for its name, besides its first and last 1024
_PRECHECK = 1 << 16  # values converted before a file is made: a trained weight fails in them
_warned: set = set()


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/specdec-kernels/fp16-weights`` (``~/.cache/...`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "specdec-kernels" / "fp16-weights"


def resolve(weight_cache: Union[str, os.PathLike, bool, None]) -> Optional[Path]:
    """The directory ``weight_cache`` names: a path; ``True``: ``default_directory()``; ``False``:
    none; ``None``: ``$SPECDEC_WEIGHT_CACHE`` (unset, empty, ``0``, ``off`` or ``false``: none)."""
    if weight_cache is None:
        env = os.environ.get(ENV, "").strip()
        if env.lower() in ("", "0", "off", "false", "no"):
            return None
        weight_cache = env
    if weight_cache is True:
        return default_directory()
    if weight_cache is False:
        return None
    if not isinstance(weight_cache, (str, os.PathLike)):
        raise TypeError(f"weight_cache must be a directory (str or os.PathLike), True, False or None, "
                        f"got {type(weight_cache).__name__}")
    return Path(weight_cache).expanduser()


def fingerprint(w: Tensor) -> str:
    """The name of ``w``'s cached copy: a hash of its shape and of its first and last 1024 values
    and 4096 spread evenly between (reads ~24 KB of the weight, whatever its size).  Two weights
    may share it; the full check on use tells them apart."""
    flat = w.detach().reshape(-1)
    n = flat.numel()
    h = hashlib.blake2b(digest_size=20)
    h.update(f"fp16-copy-v1 {tuple(w.shape)} {w.dtype}".encode())
    if n:
        k = min(n, _SAMPLES)
        idx = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)  # 0 .. n-1, in integers
        for part in (flat[:1024], flat[idx], flat[-1024:]):
            h.update(part.contiguous().numpy().tobytes())
    return h.hexdigest()


def fp16_copy(w: Tensor, directory: Union[str, os.PathLike]) -> Optional[Tensor]:
    """``w`` (fp32, CPU) as an fp16 tensor mapped from a file in ``directory`` if fp16 holds every
    value exactly, else None: the cached file when it holds ``w``'s values bit for bit, else a new
    file written in one pass.  Falls back to ``fp16_exact_copy`` (memory, no file) with a warning
    when the directory cannot be written."""
    if not isinstance(w, Tensor) or w.dtype != torch.float32 or w.device.type != "cpu":
        got = f"{w.dtype} on {w.device}" if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"fp16_copy: w must be a float32 CPU tensor, got {got}")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"fp16_copy: directory must be a str or os.PathLike, got {type(directory).__name__}")
    w = w.detach()
    directory = Path(directory)
    n = w.numel()
    if n == 0 or not w.is_contiguous():
        return fp16_exact_copy(w)
    path = directory / (fingerprint(w) + _SUFFIX)
    try:
        if path.is_file() and path.stat().st_size == 2 * n:
            mapped = torch.from_file(str(path), shared=False, size=n, dtype=torch.float16).view(w.shape)
            if fp16_copy_matches(w, mapped):
                return mapped
        if fp16_exact_copy(w.reshape(-1)[:_PRECHECK]) is None:
            return None
        return _write(w, path)
    except OSError as e:
        key = str(directory)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"specdec_kernels: the fp16 weight cache {directory} cannot be used ({e}); "
                          "the copies are kept in memory", RuntimeWarning, stacklevel=2)
        return fp16_exact_copy(w)


def _write(w: Tensor, path: Path) -> Optional[Tensor]:
    """The copy written into a new file's mapping, then renamed to ``path`` if exact."""
    n = w.numel()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # the blocks reserved now: a full disk is an error here, not a SIGBUS while writing
            os.posix_fallocate(fd, 0, 2 * n) if hasattr(os, "posix_fallocate") else os.ftruncate(fd, 2 * n)
        finally:
            os.close(fd)
        mapped = torch.from_file(str(tmp), shared=True, size=n, dtype=torch.float16).view(w.shape)
        if not fp16_exact_copy_into(w, mapped):
            return None
        os.replace(tmp, path)
        return mapped
    finally:
        if tmp.exists():
            tmp.unlink()


def clear(directory: Union[str, os.PathLike, None] = None) -> int:
    """Delete the cached copies in ``directory`` (default: ``default_directory()``); returns how
    many.  Processes that map one keep their mapping (a file is unlinked, not truncated)."""
    d = Path(directory).expanduser() if directory is not None else default_directory()
    n = 0
    if d.is_dir():
        for f in d.iterdir():
            if f.name.endswith(_SUFFIX) or f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)
                n += 1
    return n
