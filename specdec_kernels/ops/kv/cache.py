"""KV-cache compaction (and gathering) after a speculative-decoding step.

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

After tree verification the kept entries of a row are not one range but the columns of its
accepted path, scattered over the tree's block.  ``gather_kv_`` moves them to the row's
prefix end:

    for every cache c ([B, H, T, D]), row b, j in [0, count[b]):
        c[b, :, dst_start[b] + j, :] = old c[b, :, src_index[b, j], :]

(every read as if before any write), where ``src_index[b, :count[b]]`` is strictly increasing
and ``src_index[b, 0] >= dst_start[b]``.  It is ``torch.ops.specdec.gather_kv_`` (CPU and
CUDA kernels; ``reference.gather_kv_reference`` without the extension).  On CPU the op checks
the index values; on CUDA a row whose values break a rule is left unchanged (see
``gather_kv_``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..extension import HAS_EXT
from .reference import compact_kv_reference, gather_kv_reference

__all__ = ["compact_kv_", "compact_dynamic_cache_", "gather_kv_", "gather_dynamic_cache_"]


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
    _check_index_tensors("compact_kv_", (("dst_start", dst_start, 1, "[B]"), ("count", count, 1, "[B]")))
    B = dst_start.shape[0]
    if count.shape[0] != B:
        raise ValueError(
            f"compact_kv_: count must have B = dst_start.size(0) = {B} entries, got {count.shape[0]}"
        )
    _check_caches(
        "compact_kv_", caches, (("dst_start", dst_start), ("count", count)), B, "dst_start.size(0)",
        lambda i, c: _check_src_start(i, c, src_start),
    )


def _check_src_start(i: int, c: Tensor, src_start: int) -> None:
    if not 0 <= src_start <= c.shape[2]:
        raise ValueError(
            f"compact_kv_: src_start must be in [0, T] = [0, {c.shape[2]}] "
            f"(T = caches[{i}].size(2)), got {src_start}"
        )


def _check_index_tensors(op: str, indices: Sequence[tuple[str, Any, int, str]]) -> None:
    """Type, rank and dtype of each (name, tensor, dims, shape) index argument."""
    for name, t, dims, shape in indices:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a {shape} int64 tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(
                f"{op}: {name} must have {dims} {'dim' if dims == 1 else 'dims'} {shape}, got {t.dim()} "
                f"(shape {list(t.shape)})"
            )
        if t.dtype != torch.int64:
            raise TypeError(f"{op}: {name} must be int64 (Long), got {t.dtype}")


def _check_caches(
    op: str,
    caches: Sequence[Tensor],  # L x [B, H, T, D]
    indices: Sequence[tuple[str, Tensor]],  # the index arguments, by name
    B: int,
    b_source: str,  # how the messages name B ("dst_start.size(0)")
    per_cache: Callable[[int, Tensor], None],  # the op's own check of caches[i]
) -> None:
    """The checks of the cache list shared by compact_kv_ and gather_kv_ (the C++ op's order)."""
    first = caches[0]
    if not isinstance(first, Tensor):
        raise TypeError(f"{op}: caches[0] must be a tensor, got {type(first).__name__}")
    device = first.device
    for name, t in indices:
        if t.device != device:
            raise ValueError(f"{op}: {name} must be on the caches' device {device}, got {t.device}")
    for i, c in enumerate(caches):
        if not isinstance(c, Tensor):
            raise TypeError(f"{op}: caches[{i}] must be a tensor, got {type(c).__name__}")
        if c.dim() != 4:
            raise ValueError(
                f"{op}: caches[{i}] must have 4 dims [B, H, T, D], got {c.dim()} "
                f"(shape {list(c.shape)})"
            )
        if c.device != device:
            raise ValueError(f"{op}: caches[{i}] must be on caches[0]'s device {device}, got {c.device}")
        if not c.dtype.is_floating_point:
            raise TypeError(f"{op}: caches[{i}] must have a floating-point dtype, got {c.dtype}")
        if c.shape[0] != B:
            raise ValueError(
                f"{op}: caches[{i}] must have B = {b_source} = {B} rows (dim 0), "
                f"got {c.shape[0]} (shape {list(c.shape)})"
            )
        if c.stride(3) != 1 and c.shape[3] > 1:
            raise ValueError(
                f"{op}: caches[{i}] must have a contiguous last dim (stride(3) == 1), "
                f"got stride(3) = {c.stride(3)} (strides {list(c.stride())})"
            )
        per_cache(i, c)

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
        # Python checks cost about twice the op on a 32-layer model (docs/history/measurements.md), so
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
    compact_kv_(_dynamic_cache_tensors("compact_dynamic_cache_", cache), src_start, dst_start, count)


def _check_gather_kv_args(
    caches: Sequence[Tensor],  # L x [B, H, T, D] floating, one T
    src_index: Tensor,  # [B, M] int64
    count: Tensor,  # [B] int64
    dst_start: Tensor,  # [B] int64
) -> None:
    """Everything gather_kv_ checks that needs no tensor values, as TypeError/ValueError."""
    if not isinstance(caches, (list, tuple)):
        raise TypeError(
            f"gather_kv_: caches must be a list of [B, H, T, D] tensors, got {type(caches).__name__}"
        )
    if len(caches) == 0:
        raise ValueError(
            "gather_kv_: caches must be a non-empty list of [B, H, T, D] tensors, got an empty list"
        )
    _check_index_tensors(
        "gather_kv_",
        (("src_index", src_index, 2, "[B, M]"), ("count", count, 1, "[B]"), ("dst_start", dst_start, 1, "[B]")),
    )
    B = src_index.shape[0]
    for name, t in (("count", count), ("dst_start", dst_start)):
        if t.shape[0] != B:
            raise ValueError(
                f"gather_kv_: {name} must have B = src_index.size(0) = {B} entries, got {t.shape[0]}"
            )

    def same_t(i: int, c: Tensor) -> None:  # caches[0] has passed every check at i = 0
        if c.shape[2] != caches[0].shape[2]:
            raise ValueError(
                f"gather_kv_: caches[{i}] must have T = caches[0].size(2) = {caches[0].shape[2]} "
                f"positions (dim 2), got {c.shape[2]} (shape {list(c.shape)})"
            )

    _check_caches(
        "gather_kv_", caches, (("src_index", src_index), ("count", count), ("dst_start", dst_start)), B,
        "src_index.size(0)", same_t,
    )


def gather_kv_(
    caches: Sequence[Tensor],  # L x [B, H, T, D] floating, stride(3) == 1, one T; modified in place
    src_index: Tensor,  # [B, M] int64: row b's kept columns; the first count[b] strictly increasing
    count: Tensor,  # [B] int64, in [0, M]: how many columns row b keeps
    dst_start: Tensor,  # [B] int64, >= 0: where row b's kept columns go (its prefix end)
) -> None:
    """Move, for every row b, the columns ``src_index[b, :count[b]]`` of every cache to
    ``dst_start[b], dst_start[b] + 1, ...``, in place, all layers in one op call.

    For every cache c, row b and j in [0, count[b]):

        c[b, :, dst_start[b] + j, :] = old c[b, :, src_index[b, j], :]

    where every read happens as if before any write: sources may overlap destinations (e.g.
    ``src_index[b] = [5, 7, 8]`` with ``dst_start[b] = 5`` leaves column 5, moves 7 to 6 and 8
    to 7).  After tree verification this keeps each row's accepted path: the path's columns,
    scattered over the tree's block of the cache, move to the row's prefix end.  Columns outside
    ``[dst_start[b], dst_start[b] + count[b])`` are left untouched, and so is the cache's length
    (crop afterwards, as after ``compact_kv_``).

    Ordering rule: the used indices ``src_index[b, :count[b]]`` must be strictly increasing
    and ``src_index[b, 0] >= dst_start[b]`` (a tree path's columns are increasing, and sit past
    the prefix), i.e. columns only move towards the prefix, or stay; then a copy in increasing
    j reads every source before a write reaches it, with no temporary.  Entries
    ``src_index[b, j]`` for ``j >= count[b]`` are never read (they may be -1 padding).

    ``caches`` is every layer's keys and values ([B, H, T, D], sequence on dim 2; the tensors
    may differ in H, D and dtype, must share B and T, and may be strided as long as D is
    contiguous).  Value rules: ``0 <= count[b] <= M``, ``dst_start[b] >= 0``,
    ``dst_start[b] + count[b] <= T``, every used index in ``[0, T)``, plus the ordering rule.
    On CPU the op checks them and raises RuntimeError (ValueError from the fallback) before
    touching any data.  On CUDA it never reads them on the host (no sync): a row that breaks
    any of them is left unchanged (the other rows are moved).

    Raises TypeError/ValueError (before touching any data) naming the argument, the expected
    and the actual value for everything that needs no index values (types, ranks, dtypes,
    shapes, devices, strides).  Without the C++ extension this runs ``gather_kv_reference``
    (plain loops; on CUDA tensors it reads the indices on the host, i.e. synchronises).
    """
    if not HAS_EXT:
        _check_gather_kv_args(caches, src_index, count, dst_start)
        gather_kv_reference(list(caches), src_index, count, dst_start)
    elif torch.compiler.is_compiling():
        # Traced once: the checks become guards and cost nothing per call.
        _check_gather_kv_args(caches, src_index, count, dst_start)
        torch.ops.specdec.gather_kv_(list(caches), src_index, count, dst_start)
    else:
        # Eager: the op checks every argument itself, in C++, before it touches any data; the
        # Python checks run only when it refuses, to raise TypeError/ValueError as compact_kv_.
        try:
            torch.ops.specdec.gather_kv_(caches, src_index, count, dst_start)
        except (RuntimeError, TypeError):
            _check_gather_kv_args(caches, src_index, count, dst_start)
            raise


def gather_dynamic_cache_(
    cache: Any,  # transformers.DynamicCache (5.x: .layers[i].keys/.values, [B, H, T, D])
    src_index: Tensor,  # [B, M] int64
    count: Tensor,  # [B] int64
    dst_start: Tensor,  # [B] int64
) -> None:
    """``gather_kv_`` on every layer of a Hugging Face ``DynamicCache``, in one op call.

    The op sees ``caches[2 * i] = cache.layers[i].keys`` and ``caches[2 * i + 1] =
    cache.layers[i].values`` (layers that hold nothing are skipped), so an error about
    ``caches[n]`` refers to layer ``n // 2``.  The cache's length is not changed: call
    ``cache.crop(new_length)`` afterwards, and mask each row's positions past its own length.

    Sliding-window layers are rejected: they store a rolling window, not absolute positions.
    """
    gather_kv_(_dynamic_cache_tensors("gather_dynamic_cache_", cache), src_index, count, dst_start)


def _dynamic_cache_tensors(op: str, cache: Any) -> list[Tensor]:
    """[keys_0, values_0, keys_1, ...] ([B, H, T, D] each) of every initialised layer of a
    transformers ``DynamicCache``; ``op`` names the caller in the errors."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise TypeError(
            f"{op}: cache must be a transformers Cache with a .layers list "
            f"(transformers >= 5, e.g. DynamicCache), got {type(cache).__name__}"
        )
    tensors: list[Tensor] = []
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_initialized", True):
            continue
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                f"{op}: cache.layers[{i}] must be a full-attention layer, got a "
                f"sliding-window {type(layer).__name__} (its positions are not absolute)"
            )
        keys = getattr(layer, "keys", None)  # [B, H, T, D]
        values = getattr(layer, "values", None)  # [B, H, T, D]
        if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
            raise TypeError(
                f"{op}: cache.layers[{i}].keys and .values must be [B, H, T, D] "
                f"tensors, got {type(keys).__name__} and {type(values).__name__}"
            )
        tensors += [keys, values]
    if not tensors:
        raise ValueError(
            f"{op}: cache must hold at least one initialised layer, got "
            f"{len(layers)} layers and none initialised (run the model on the prompt first)"
        )
    return tensors


if HAS_EXT:

    @torch.library.register_fake("specdec::compact_kv_")
    def _compact_kv_fake(
        caches: list[Tensor], src_start: int, dst_start: Tensor, count: Tensor
    ) -> None:
        # In place and returns nothing, so there is no output to describe; the argument checks
        # run here too, so tracing (and the Meta device) refuses what the real kernels refuse.
        _check_compact_kv_args(caches, src_start, dst_start, count)
        return None

    @torch.library.register_fake("specdec::gather_kv_")
    def _gather_kv_fake(
        caches: list[Tensor], src_index: Tensor, count: Tensor, dst_start: Tensor
    ) -> None:
        # As compact_kv_'s fake: no output, and the checks that need no index values.
        _check_gather_kv_args(caches, src_index, count, dst_start)
        return None


# ----------------------------------------------------------------------------------------------
# DynamicCache helpers of SpeculativeDecoder (new caches, the prefill's stacking, cropping)
# ----------------------------------------------------------------------------------------------
def crop_cache_(cache, length: int) -> None:
    """Crop every layer to ``length`` columns.  A negative ``crop`` argument (columns to drop)
    means the same in transformers 4.x and 5.x."""
    cur = cache.get_seq_length()
    if length < cur:
        cache.crop(length - cur)


def new_cache(model):
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


def stack_caches_(cache, parts: list, B: int, P: int) -> None:
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
