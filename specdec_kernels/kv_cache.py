"""KV-cache compaction after a speculative-decoding step.

In a batched step every row b appends the keys/values of its K drafted tokens (plus the
bonus/recovered position) at the same positions ``src_start .. src_start + K`` of every
layer's cache, but rows accept different numbers of drafts.  Before the next step each row's
kept entries must sit right after that row's own prefix.  ``compact_kv_`` moves them there:

    for every cache c ([B, H, T, D]), row b, j in [0, count[b]):
        c[b, :, dst_start[b] + j, :] = c[b, :, src_start + j, :]

with memmove semantics: ``dst_start[b] <= src_start``, so the ranges may overlap and the copy
still reads every source row before it is overwritten.  One call moves all layers (keys and
values) at once; positions outside the moved ranges are left untouched.

The op is ``torch.ops.specdec.compact_kv_`` (schema in ``csrc/ops.cpp``; CPU and CUDA
kernels) when the C++ extension is built; otherwise ``reference.compact_kv_reference``.

Index values: on CPU the op checks ``0 <= dst_start[b] <= src_start``, ``count[b] >= 0`` and
``src_start + count[b] <= T`` (reading them is free there).  On CUDA it never reads them on
the host (no sync): a row whose ``dst_start`` lies outside ``[0, src_start]`` is left
unchanged, and ``count[b]`` is clamped to ``[0, T - src_start]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._ext import HAS_EXT
from .reference import compact_kv_reference

__all__ = ["compact_kv_", "compact_dynamic_cache_"]


def _check_compact_kv_args(
    caches: Sequence[Tensor],  # L x [B, H, T, D] floating
    src_start: int,
    dst_start: Tensor,  # [B] int64
    count: Tensor,  # [B] int64
) -> None:
    """Everything the op checks that needs no tensor values, as TypeError/ValueError."""
    if not isinstance(caches, (list, tuple)):
        raise TypeError(
            f"compact_kv_: caches must be a list of [B, H, T, D] tensors, got {type(caches).__name__}"
        )
    if len(caches) == 0:
        raise ValueError(
            "compact_kv_: caches must be a non-empty list of [B, H, T, D] tensors, got an empty list"
        )
    if isinstance(src_start, bool) or not isinstance(src_start, (int, torch.SymInt)):
        raise TypeError(f"compact_kv_: src_start must be an int, got {type(src_start).__name__}")
    for name, t in (("dst_start", dst_start), ("count", count)):
        if not isinstance(t, Tensor):
            raise TypeError(f"compact_kv_: {name} must be a [B] int64 tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(
                f"compact_kv_: {name} must have 1 dim [B], got {t.dim()} (shape {list(t.shape)})"
            )
        if t.dtype != torch.int64:
            raise TypeError(f"compact_kv_: {name} must be int64 (Long), got {t.dtype}")
    B = dst_start.shape[0]
    if count.shape[0] != B:
        raise ValueError(
            f"compact_kv_: count must have B = dst_start.size(0) = {B} entries, got {count.shape[0]}"
        )
    first = caches[0]
    if not isinstance(first, Tensor):
        raise TypeError(f"compact_kv_: caches[0] must be a tensor, got {type(first).__name__}")
    device = first.device
    for name, t in (("dst_start", dst_start), ("count", count)):
        if t.device != device:
            raise ValueError(
                f"compact_kv_: {name} must be on the caches' device {device}, got {t.device}"
            )
    for i, c in enumerate(caches):
        if not isinstance(c, Tensor):
            raise TypeError(f"compact_kv_: caches[{i}] must be a tensor, got {type(c).__name__}")
        if c.dim() != 4:
            raise ValueError(
                f"compact_kv_: caches[{i}] must have 4 dims [B, H, T, D], got {c.dim()} "
                f"(shape {list(c.shape)})"
            )
        if c.device != device:
            raise ValueError(
                f"compact_kv_: caches[{i}] must be on caches[0]'s device {device}, got {c.device}"
            )
        if not c.dtype.is_floating_point:
            raise TypeError(
                f"compact_kv_: caches[{i}] must have a floating-point dtype, got {c.dtype}"
            )
        if c.shape[0] != B:
            raise ValueError(
                f"compact_kv_: caches[{i}] must have B = dst_start.size(0) = {B} rows (dim 0), "
                f"got {c.shape[0]} (shape {list(c.shape)})"
            )
        if c.stride(3) != 1 and c.shape[3] > 1:
            raise ValueError(
                f"compact_kv_: caches[{i}] must have a contiguous last dim (stride(3) == 1), "
                f"got stride(3) = {c.stride(3)} (strides {list(c.stride())})"
            )
        if not 0 <= src_start <= c.shape[2]:
            raise ValueError(
                f"compact_kv_: src_start must be in [0, T] = [0, {c.shape[2]}] "
                f"(T = caches[{i}].size(2)), got {src_start}"
            )


def compact_kv_(
    caches: Sequence[Tensor],  # L x [B, H, T, D] floating, stride(3) == 1; modified in place
    src_start: int,  # first position written by this step, in [0, T]
    dst_start: Tensor,  # [B] int64, in [0, src_start]: where row b's kept entries go
    count: Tensor,  # [B] int64, in [0, T - src_start]: how many entries row b keeps
) -> None:
    """Move ``count[b]`` positions of every cache from ``src_start`` down to ``dst_start[b]``.

    ``caches`` is every layer's keys and values ([B, H, T, D], sequence on dim 2; the tensors
    may differ in H, T, D and dtype, and may be strided as long as D is contiguous).  All of
    them are moved in one op call.  See the module docstring for the exact semantics and for
    how out-of-range index values are treated on CPU and on CUDA.

    Raises TypeError/ValueError (before touching any data) naming the argument, the expected
    and the actual value; index values out of range raise RuntimeError from the CPU op (and
    ValueError from the fallback).  Without the C++ extension this runs
    ``compact_kv_reference`` (plain loops; on CUDA tensors it reads the indices on the host,
    i.e. synchronises).
    """
    if isinstance(src_start, bool) or not isinstance(src_start, (int, torch.SymInt)):
        raise TypeError(f"compact_kv_: src_start must be an int, got {type(src_start).__name__}")
    if not HAS_EXT:
        _check_compact_kv_args(caches, src_start, dst_start, count)
        compact_kv_reference(list(caches), src_start, dst_start, count)
    elif torch.compiler.is_compiling():
        # Traced once: the checks become guards and cost nothing per call.
        _check_compact_kv_args(caches, src_start, dst_start, count)
        torch.ops.specdec.compact_kv_(list(caches), src_start, dst_start, count)
    else:
        # Eager: the op checks every argument itself, in C++, before it touches any data.  The
        # Python checks cost ~2 us per cache (~110 us for a 32-layer model, twice the op), so
        # they run only when the op refuses, to turn its RuntimeError into the TypeError or
        # ValueError they raise; errors they do not cover (index values, aliasing) re-raise.
        try:
            torch.ops.specdec.compact_kv_(caches, src_start, dst_start, count)
        except (RuntimeError, TypeError):
            _check_compact_kv_args(caches, src_start, dst_start, count)
            raise


def compact_dynamic_cache_(
    cache: Any,  # transformers.DynamicCache (5.x: .layers[i].keys/.values, [B, H, T, D])
    src_start: int,
    dst_start: Tensor,  # [B] int64
    count: Tensor,  # [B] int64
) -> None:
    """``compact_kv_`` on every layer of a Hugging Face ``DynamicCache``, in one op call.

    The op sees ``caches[2 * i] = cache.layers[i].keys`` and ``caches[2 * i + 1] =
    cache.layers[i].values`` (layers that hold nothing, e.g. KV-sharing consumers, are skipped),
    so an error about ``caches[n]`` refers to layer ``n // 2``.  The cache's length is not
    changed: call ``cache.crop(new_length)`` afterwards to drop the positions past the longest
    row, and mask each row's positions past its own length.

    Sliding-window layers are rejected: they store a rolling window, not absolute positions.
    """
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise TypeError(
            "compact_dynamic_cache_: cache must be a transformers Cache with a .layers list "
            f"(transformers >= 5, e.g. DynamicCache), got {type(cache).__name__}"
        )
    tensors: list[Tensor] = []
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_initialized", True):
            continue
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                f"compact_dynamic_cache_: cache.layers[{i}] must be a full-attention layer, got a "
                f"sliding-window {type(layer).__name__} (its positions are not absolute)"
            )
        keys = getattr(layer, "keys", None)  # [B, H, T, D]
        values = getattr(layer, "values", None)  # [B, H, T, D]
        if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
            raise TypeError(
                f"compact_dynamic_cache_: cache.layers[{i}].keys and .values must be [B, H, T, D] "
                f"tensors, got {type(keys).__name__} and {type(values).__name__}"
            )
        tensors += [keys, values]
    if not tensors:
        raise ValueError(
            "compact_dynamic_cache_: cache must hold at least one initialised layer, got "
            f"{len(layers)} layers and none initialised (run the model on the prompt first)"
        )
    compact_kv_(tensors, src_start, dst_start, count)


if HAS_EXT:

    @torch.library.register_fake("specdec::compact_kv_")
    def _compact_kv_fake(
        caches: list[Tensor], src_start: int, dst_start: Tensor, count: Tensor
    ) -> None:
        # In place and returns nothing, so there is no output to describe; the argument checks
        # run here too, so tracing (and the Meta device) refuses what the real kernels refuse.
        _check_compact_kv_args(caches, src_start, dst_start, count)
        return None


# ----------------------------------------------------------------------------------------------
# DynamicCache helpers of SpeculativeDecoder (new caches, the prefill's stacking, cropping)
# ----------------------------------------------------------------------------------------------
def _crop_(cache, length: int) -> None:
    """Crop every layer to ``length`` columns.  A negative ``crop`` argument (columns to drop)
    means the same in transformers 4.x and 5.x."""
    cur = cache.get_seq_length()
    if length < cur:
        cache.crop(length - cur)


def _new_cache(model):
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False) or not getattr(layer, "is_croppable", True):
            raise ValueError(
                f"model {type(model).__name__} uses a {type(layer).__name__} cache layer; the speculative "
                "decoder needs plain full-attention DynamicCache layers (no sliding window or linear attention)")
    return cache


def _stack_caches_(cache, parts: list, B: int, P: int) -> None:
    """Fill the empty ``cache`` with the [B, H, P, D] stack of the group caches in ``parts``
    ((row indices [n] int64, cache of those rows with at most P columns)); the columns past a
    group's length and the rows in no group are zeros (they are masked by every later step)."""
    first = parts[0][1]
    for li in range(len(first.layers)):
        k0, v0 = first.layers[li].keys, first.layers[li].values
        keys = k0.new_zeros((B, k0.shape[1], P, k0.shape[3]))
        values = v0.new_zeros((B, v0.shape[1], P, v0.shape[3]))
        for rows, c in parts:
            k, v = c.layers[li].keys, c.layers[li].values
            keys[rows, :, : k.shape[2]] = k
            values[rows, :, : v.shape[2]] = v
        cache.update(keys, values, li)
