"""A batch-invariant fp32 linear layer for the CPU, for the target's verify forward.

Verifying K drafted tokens runs the target over K+1 positions at once.  On a GPU that costs
about one decode step; on a CPU, torch's fp32 ``linear`` hands 2-16 rows to an SGEMM that takes
2-3x the one-row time (docs/benchmarks.md, "Linear layers on CPU"), which wipes out what
speculation saves.  ``skinny_linear``
(``torch.ops.specdec.skinny_linear``, csrc/skinny_linear.cpp) streams the weights once for all
rows instead, so K+1 rows cost little more than one.

It is also batch-invariant: row i of the result is bit-identical whether x holds 1 row or 16
and whatever the thread count, because each output element is summed in one fixed order (see
the C++ header).  So with it the target's logits for a verified position equal, bit for bit,
the logits the same position gets in a one-token decode step (the linear layers' share; the
attention kernel is torch's).  It is not bit-identical to ``torch.nn.functional.linear``
(whose order is MKL's): the difference is bounded against a float64 reference in the tests.

``use_skinny_linear(model)`` routes a model's fp32 CPU ``nn.Linear`` layers through it for
inputs of at most ``max_rows`` rows (larger inputs, e.g. the prompt, keep torch's SGEMM, which
wins there) and returns a handle whose ``remove()`` (or ``with`` block) restores them.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.extension import HAS_EXT
from ..ops.host import tensor_version
from ..ops.linear import auto_isa, fp16_copy_matches, fp16_exact_copy, skinny_linear, supported_isas

__all__ = ["AVX512_MAX_ROWS", "DEFAULT_MAX_ROWS", "SkinnyLinearHandle", "auto_isa", "default_max_rows",
           "forget_weight_copies", "revalidate_weight_copies", "skinny_linear", "supported_isas", "use_skinny_linear"]

# Up to this many rows (the product of x's leading dims) the kernel's AVX2 path beats torch's
# linear in bench/cpu/bench_skinny_linear.py (docs/benchmarks.md, "Linear layers on CPU"); above it
# torch's SGEMM, which wins on larger inputs, is used.
DEFAULT_MAX_ROWS = 16
# Where the CPU has AVX-512 the kernel takes its AVX-512 path from 7 rows (from 1 on Intel cores:
# auto_isa), and stays ahead of torch's SGEMM up to 24 rows and beyond
# (bench/cpu/bench_skinny_linear.py --isa on the embedded target's layers: docs/benchmarks.md,
# "Linear layers on CPU").
AVX512_MAX_ROWS = 24


def default_max_rows() -> int:
    """The row count up to which ``use_skinny_linear`` routes a layer through the kernel by
    default on this CPU: ``AVX512_MAX_ROWS`` where the kernel's AVX-512 path runs, else
    ``DEFAULT_MAX_ROWS``."""
    return AVX512_MAX_ROWS if "avx512" in supported_isas() else DEFAULT_MAX_ROWS


_MISSING = object()


def _cached_copy(m: nn.Module, key: str, w: Tensor, version: Optional[int]):
    """The copy of ``w`` cached on ``m`` under ``key`` if it was made from ``w`` as it is now (the
    same tensor, its version counter unchanged by in-place updates, the same storage: ``p.data =
    ...`` keeps the object and the version), else _MISSING."""
    c = m.__dict__.get(key)
    if version is not None and c is not None and c[0]() is w and c[1] == version and c[2] == w.data_ptr():
        return c[3]
    return _MISSING


def forget_weight_copies(model: nn.Module) -> int:
    """Drop the fp16/int8 copies of ``model``'s linear weights that ``use_skinny_linear`` keeps
    on the modules, and a feature draft's copy of its output layer (returns how many).  A new
    ``SpeculativeDecoder`` calls it.  Needed only after writing weights through ``.data``
    (``p.data.copy_(...)``), which torch's version counter does not see; in-place updates of the
    parameters themselves (an optimizer, ``load_state_dict``) and new tensors are noticed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"forget_weight_copies: model must be a torch.nn.Module, got {type(model).__name__}")
    n = 0
    for mod in model.modules():
        for key in ("_specdec_fp16", "_specdec_int8", "_specdec_head"):  # _specdec_head: runners.FeatureRunner
            n += mod.__dict__.pop(key, None) is not None
    return n


def _exact_fp16_copy(m: nn.Linear, cache_dir=None) -> Optional[Tensor]:
    """``m.weight`` as fp16 if fp16 holds every value exactly (then the kernel's products are the
    same bits, from half the bytes), else None.  Cached on the module (``_specdec_fp16``) while
    the weight is the same tensor at the same version, so a model patched for every
    ``generate`` pays the check once; ``cache_dir``: made or mapped through
    ``weight_cache.fp16_copy`` there, for the next process."""
    w = m.weight
    version = tensor_version(w)
    cached = _cached_copy(m, "_specdec_fp16", w, version)
    if cached is not _MISSING:
        return cached
    if cache_dir is not None:
        from .weight_cache import fp16_copy

        w16 = fp16_copy(w.detach(), cache_dir)
    else:
        w16 = _fp16_if_exact(w.detach())
    if version is not None:  # an inference tensor has no version counter: checked on every call
        m.__dict__["_specdec_fp16"] = (weakref.ref(w), version, w.data_ptr(), w16)
    return w16


def _fp16_if_exact(w: Tensor) -> Optional[Tensor]:
    """w as fp16 if fp16 holds every value exactly, else None: one pass over w
    (``ops.linear.fp16_exact_copy``: each value read once, converted, written once and checked in
    registers; stops at the first inexact block, which a trained fp32 or bf16 weight almost always
    has at its start)."""
    return fp16_exact_copy(w)


def _copy_is_current(w: Tensor, w16: Tensor) -> bool:
    """Whether an fp16 copy still holds its fp32 weight's bits (one read of both,
    ``ops.linear.fp16_copy_matches``)."""
    return fp16_copy_matches(w, w16)


def revalidate_weight_copies(model: nn.Module) -> int:
    """Keep the fp16 copies of ``model``'s linear weights that still equal their weights, drop the
    others, and drop the int8 and output-layer copies (small: made again on use); returns how many
    were dropped.  A new ``SpeculativeDecoder`` calls it instead of ``forget_weight_copies``: the
    copies are made once per model, not once per decoder, and a write through ``.data`` in place
    (which torch's version counter does not see) is still noticed, for the price of reading
    each copied weight once (a weight fp16 does not hold has no copy and costs nothing)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"revalidate_weight_copies: model must be a torch.nn.Module, got {type(model).__name__}")
    n = 0
    mods = [m for m in model.modules() if m.__dict__.get("_specdec_fp16") is not None
            or "_specdec_int8" in m.__dict__ or "_specdec_head" in m.__dict__]
    for mod in _progress(mods, "checking the fp16 weight copies"):
        for key in ("_specdec_int8", "_specdec_head"):
            n += mod.__dict__.pop(key, None) is not None
        c = mod.__dict__.get("_specdec_fp16")
        if c is not None and c[3] is not None:
            w = c[0]()
            if w is None or w is not getattr(mod, "weight", None) or not _copy_is_current(w, c[3]):
                del mod.__dict__["_specdec_fp16"]
                n += 1
    return n


def _progress(items: list, what: str):
    """tqdm over ``items`` that shows itself only once it has run for a second."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"specdec_kernels: {what}", unit="layer", delay=1.0, leave=False)


def int8_copy(m: nn.Linear) -> Optional[tuple]:
    """(``m.weight`` rounded per output row to int8 [N, K], the rows' scales [N] fp32): row j is
    ``scale[j] * w8[j]`` with ``scale[j] = max |w[j]| / 127`` (1 for a zero row), symmetric,
    round to nearest.  None when a weight is not finite.  Cached on the module as the fp16 copy
    is (``_specdec_int8``)."""
    w = m.weight
    version = tensor_version(w)
    cached = _cached_copy(m, "_specdec_int8", w, version)
    if cached is not _MISSING:
        return cached
    wd = w.detach().float()
    out = None
    if bool(torch.isfinite(wd).all()):
        amax = wd.abs().amax(1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        out = ((wd / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous())
    if version is not None:
        m.__dict__["_specdec_int8"] = (weakref.ref(w), version, w.data_ptr(), out)
    return out


def _make_forward(m: nn.Linear, max_rows: int, calls: list, w16: Optional[Tensor], q8: Optional[tuple] = None):
    """``m``'s patched forward: the kernel for fp32 CPU inputs of at most ``max_rows`` rows with
    grad off, torch's linear otherwise.  Written for a low per-call cost (a 135M model makes
    ~200 of these calls per token): bound locals, no attribute lookups beyond the module's.
    ``w16``: the exact fp16 copy to stream; ``q8``: (int8 weights, row scales): the kernel over
    the int8 values, then the scales and the bias."""
    op = torch.ops.specdec.skinny_linear.default
    f32 = torch.float32
    linear = F.linear
    grad_enabled = torch.is_grad_enabled
    streamed, scale = q8 if q8 is not None else (w16, None)

    def forward(x: Tensor) -> Tensor:
        w = m.weight
        if (x.dtype is f32 and w.dtype is f32 and x.is_cpu and w.is_cpu
                and x.numel() <= max_rows * x.shape[-1] and not grad_enabled()):
            calls[0] += 1
            if scale is None:
                return op(x, w if streamed is None else streamed, m.bias)
            y = op(x, streamed, None).mul_(scale)
            return y if m.bias is None else y.add_(m.bias)
        return linear(x, w, m.bias)

    return forward


class SkinnyLinearHandle:
    """What ``use_skinny_linear`` patched; ``remove()`` (or leaving the ``with`` block) undoes it.

    ``calls`` counts the forwards that went through the kernel (for tests and statistics).
    """

    def __init__(self, modules: list, max_rows: int, fp16_weights: bool, int8_weights: bool = False,
                 weight_cache=None):
        self.modules = modules
        self.max_rows = max_rows
        self._calls = [0]
        # per layer (by id) what it streams instead of its fp32 weight: (fp16 copy, None) or
        # (None, (int8 copy, row scales)); taken once here (a weight made under inference mode
        # has no version counter, so its copies are not cached on the module)
        self._copies = {}
        for m in _progress(modules, "preparing the linear layers' weights"):
            q8 = int8_copy(m) if int8_weights else None
            w16 = _exact_fp16_copy(m, weight_cache) if fp16_weights and q8 is None else None
            if q8 is not None or w16 is not None:
                self._copies[id(m)] = (w16, q8)
        # the layers whose weights stream as int8 copies with row scales (int8_weights)
        self.int8 = [m for m in modules if self._copies.get(id(m), (None, None))[1] is not None]
        # the layers whose weights stream as exact fp16 copies
        self.fp16 = [m for m in modules if self._copies.get(id(m), (None, None))[0] is not None]

    @property
    def calls(self) -> int:
        return self._calls[0]

    def _install(self) -> None:
        for m in self.modules:
            w16, q8 = self._copies.get(id(m), (None, None))
            m.forward = _make_forward(m, self.max_rows, self._calls, w16, q8)

    def remove(self) -> None:
        for m in self.modules:
            if "forward" in m.__dict__:
                del m.forward
        self.modules = []

    def __enter__(self) -> "SkinnyLinearHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def use_skinny_linear(model: nn.Module, max_rows: Optional[int] = None,
                      fp16_weights: bool = True, int8_weights: bool = False, weight_cache=None) -> SkinnyLinearHandle:
    """Route ``model``'s fp32 CPU ``nn.Linear`` layers through ``skinny_linear`` for inputs of at
    most ``max_rows`` rows (inference only: with grad enabled they keep ``F.linear``); None:
    ``default_max_rows()``, where the kernel beats torch's linear on this CPU.

    fp16_weights: a layer whose fp32 weights fp16 represents exactly (a model saved in fp16 and
    loaded as fp32, like the embedded draft) streams an fp16 copy instead: half the bytes and
    bit-identical results.  Other layers keep fp32.  The copy is taken when the handle is made;
    do not change the weights while it is installed.  weight_cache: a directory in which the
    copies are kept for the next process over the same weights (``cpu.weight_cache``: mapped from
    there when a file holds the weight's values bit for bit, else written there); None: memory only.

    int8_weights: every layer streams an int8 copy of its weights instead, rounded per output row
    (``scale = max |w| / 127``), a quarter of the fp32 bytes, and its outputs are the kernel's
    over the int8 values times the row scales (+ bias): an *approximation* of the layer, for a
    draft's layers only, whose outputs may be anything (``SpeculativeDecoder`` uses it for the
    feature draft's output layer; never for a target).  Layers with non-finite weights keep
    fp32/fp16.

    Returns a handle; ``handle.remove()`` or ``with use_skinny_linear(m): ...`` restores the
    layers.  Layers already patched, or whose ``forward`` was replaced by someone else, are
    left alone.  Requires the C++ extension (``RuntimeError`` otherwise).
    """
    if not HAS_EXT:
        raise RuntimeError(
            "use_skinny_linear needs the C++ extension specdec_kernels.ops._C; build it with "
            "`pip install --no-build-isolation -e .`"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_skinny_linear: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, flag in (("fp16_weights", fp16_weights), ("int8_weights", int8_weights)):
        if not isinstance(flag, bool):
            raise TypeError(f"use_skinny_linear: {name} must be a bool, got {type(flag).__name__}")
    if max_rows is None:
        max_rows = default_max_rows()
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise ValueError(f"use_skinny_linear: max_rows must be an int >= 1, got {max_rows!r}")
    mods = [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and "forward" not in m.__dict__
        and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    ]
    if weight_cache is not None:
        from .weight_cache import resolve

        weight_cache = resolve(weight_cache)
    handle = SkinnyLinearHandle(mods, max_rows, fp16_weights, int8_weights, weight_cache)
    handle._install()
    return handle
