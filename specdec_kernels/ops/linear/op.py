"""``skinny_linear``: the batch-invariant fp32 CPU linear op (``torch.ops.specdec.skinny_linear``,
csrc/skinny_linear.cpp), its argument checks and its fakes (so ``torch.compile`` and
``FakeTensorMode`` trace through it), and which SIMD paths of it this CPU runs.

The op streams the weights once for all rows of a few-row input (a decode step's K + 1
positions) and sums each output element in one fixed order, so row i of the result does not
depend on the other rows or the thread count.  ``specdec_kernels.cpu.skinny_linear`` patches it
into a model's ``nn.Linear`` layers.

Memory traffic: reads x [M, K] and the weight [N, K] once (4, 2 or 1 bytes per weight element:
fp32, fp16 or int8), writes [M, N] fp32; the weight's bytes dominate for M <= 24, so the floor
is one pass over it, which is what a one-row decode step already pays.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..extension import HAS_EXT
from .reference import fp16_copy_matches_reference, fp16_exact_copy_reference, skinny_linear_reference

__all__ = ["auto_isa", "fp16_copy_matches", "fp16_exact_copy", "fp16_exact_copy_into", "skinny_linear",
           "supported_isas"]


@functools.lru_cache(maxsize=None)
def supported_isas() -> tuple:
    """The SIMD paths of the kernel this CPU runs, of ("avx2", "avx512") (the portable path
    always runs; all give the same bits); () without the C++ extension.  Asked of the extension
    itself (``skinny_linear_isa`` refuses a path the CPU lacks), once."""
    if not HAS_EXT:
        return ()
    out = []
    for isa in ("avx2", "avx512"):
        try:
            torch.ops.specdec.skinny_linear_isa(torch.ones(1, 8), torch.ones(1, 8), None, isa)
        except RuntimeError:
            continue
        out.append(isa)
    return tuple(out)


def auto_isa(rows: int) -> str:
    """The SIMD path ("portable", "avx2" or "avx512") the kernel takes on this CPU for ``rows``
    rows of x: AVX-512 from 7 rows, or from 1 on Intel cores (where it streams the weights
    faster than the AVX2 path at every row count: csrc/skinny_linear.cpp, min_rows_avx512).  The
    paths give the same bits, so the choice changes the time only.  ``"none"`` without the C++
    extension."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"auto_isa: rows must be an int >= 1, got {rows!r}")
    if not HAS_EXT:
        return "none"
    if not hasattr(torch.ops.specdec, "skinny_linear_auto_isa"):
        raise RuntimeError("auto_isa: the loaded C++ extension has no skinny_linear_auto_isa (it was built from an "
                           "older source): rebuild it with pip install --no-build-isolation -e .")
    return torch.ops.specdec.skinny_linear_auto_isa(rows)


def _check(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        raise TypeError(
            f"skinny_linear: x and weight must be tensors, got {type(x).__name__} and "
            f"{type(weight).__name__}"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"skinny_linear: weight must have 2 dims [N, K], got {weight.dim()} "
            f"(shape {list(weight.shape)})"
        )
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear: x must be [..., K] with K = weight.shape[1] = {weight.shape[1]}, "
            f"got shape {list(x.shape)}"
        )
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != torch.float32 and not (name == "weight" and t.dtype in (torch.float16, torch.int8)):
            want = "float32, float16 or int8" if name == "weight" else "float32"
            raise ValueError(f"skinny_linear: {name} must be {want}, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"skinny_linear: {name} must be a CPU tensor, got device {t.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"skinny_linear: bias must be [N] = [{weight.shape[0]}], got {list(bias.shape)}"
        )


def skinny_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias`` for fp32 CPU tensors, batch-invariant (see the module doc).

    x: ``[..., K]`` fp32 CPU; weight: ``[N, K]`` fp32, fp16 or int8 CPU (fp16 and int8 are
    widened exactly to fp32 as they are loaded: half or a quarter of the bytes, the same
    arithmetic over their values; int8 carries no scale, the caller applies one); bias: ``[N]``
    fp32 CPU or None.
    Returns ``[..., N]`` fp32.  Without the C++ extension it falls back to
    ``reference.skinny_linear_reference`` (float64 accumulation, not batch-invariant-fast).
    """
    _check(x, weight, bias)
    if HAS_EXT:
        return torch.ops.specdec.skinny_linear(x, weight, bias)
    return skinny_linear_reference(x, weight, bias)


if HAS_EXT:

    @torch.library.register_fake("specdec::skinny_linear")
    def _skinny_linear_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        _check(x, weight, bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("specdec::skinny_linear_portable")
    def _skinny_linear_portable_fake(
        x: Tensor, weight: Tensor, bias: Optional[Tensor] = None
    ) -> Tensor:
        _check(x, weight, bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("specdec::skinny_linear_isa")
    def _skinny_linear_isa_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], isa: str) -> Tensor:
        _check(x, weight, bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _check_fp32_cpu(name: str, w: Tensor) -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"{name}: w must be a tensor, got {type(w).__name__}")
    if w.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError(f"{name}: w must be a float32 CPU tensor, got {w.dtype} on {w.device}")


def fp16_exact_copy(w: Tensor) -> Optional[Tensor]:
    """``w`` (fp32, CPU) as fp16 if fp16 holds every value exactly (each comes back with its bits,
    none is NaN), else None: ``skinny_linear`` then gives the same bits from the copy, half the
    bytes.  One pass over ``w`` (``torch.ops.specdec.fp16_exact_copy``, csrc/fp16_copy.cpp: read
    once, the copy written once, stopping at the first inexact block); without the C++ extension,
    ``reference.fp16_exact_copy_reference``."""
    _check_fp32_cpu("fp16_exact_copy", w)
    w = w.detach()
    w16, exact = torch.ops.specdec.fp16_exact_copy(w) if HAS_EXT else fp16_exact_copy_reference(w)
    return w16 if bool(exact) else None


def fp16_exact_copy_into(w: Tensor, out: Tensor) -> bool:
    """``fp16_exact_copy`` written into ``out``, a contiguous fp16 CPU tensor of ``w``'s shape the
    caller allocated (a file mapping, for the copies kept on disk: ``cpu.weight_cache``); returns
    whether fp16 holds every value of ``w`` exactly (``out``'s contents are unspecified if not).
    One pass (``torch.ops.specdec.fp16_exact_copy_into``); without the C++ extension, the reference."""
    _check_fp32_cpu("fp16_exact_copy_into", w)
    if not isinstance(out, Tensor) or out.dtype != torch.float16 or out.device.type != "cpu":
        got = f"{out.dtype} on {out.device}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"fp16_exact_copy_into: out must be a float16 CPU tensor, got {got}")
    if out.shape != w.shape or not out.is_contiguous():
        raise ValueError(f"fp16_exact_copy_into: out must be contiguous with w's shape {tuple(w.shape)}, got "
                         f"{tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    w = w.detach()
    if HAS_EXT:
        return bool(torch.ops.specdec.fp16_exact_copy_into(w, out))
    w16, exact = fp16_exact_copy_reference(w)
    out.copy_(w16)
    return bool(exact)


def fp16_copy_matches(w: Tensor, w16: Tensor) -> bool:
    """Whether the fp16 copy ``w16`` still widens to ``w``'s bits (same shape, no NaN): the check
    that a copy made by ``fp16_exact_copy`` is current, in one read of both."""
    _check_fp32_cpu("fp16_copy_matches", w)
    if not isinstance(w16, Tensor) or w16.dtype != torch.float16 or w16.device.type != "cpu":
        raise ValueError("fp16_copy_matches: w16 must be a float16 CPU tensor")
    w = w.detach()
    return bool(torch.ops.specdec.fp16_copy_matches(w, w16) if HAS_EXT else fp16_copy_matches_reference(w, w16))


if HAS_EXT:

    def _exact_copy_fake(w: Tensor):
        return w.new_empty(w.shape, dtype=torch.float16), w.new_empty((), dtype=torch.bool)

    torch.library.register_fake("specdec::fp16_exact_copy")(_exact_copy_fake)
    torch.library.register_fake("specdec::fp16_exact_copy_portable")(_exact_copy_fake)

    @torch.library.register_fake("specdec::fp16_exact_copy_into")
    def _exact_copy_into_fake(w: Tensor, out: Tensor) -> Tensor:
        return w.new_empty((), dtype=torch.bool)

    @torch.library.register_fake("specdec::fp16_copy_matches")
    def _copy_matches_fake(w: Tensor, w16: Tensor) -> Tensor:
        return w.new_empty((), dtype=torch.bool)
