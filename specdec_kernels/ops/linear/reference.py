"""The ground truth of ``cpu.skinny_linear``: the product accumulated in float64; and of the
preparation of its fp16 weights (``fp16_exact_copy``, ``fp16_copy_matches``), from torch ops."""

from __future__ import annotations

import torch

__all__ = ["fp16_copy_matches_reference", "fp16_exact_copy_reference", "skinny_linear_reference"]


def skinny_linear_reference(
    x: torch.Tensor,  # [..., K] fp32
    weight: torch.Tensor,  # [N, K] fp32
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in float64, rounded once to fp32: the ground truth
    ``skinny_linear`` is compared with.  (The kernel sums in fp32 in a fixed order, so the two
    differ by fp32 rounding error; the tests bound it.)"""
    y = x.double() @ weight.double().T  # [..., N] fp64
    if bias is not None:
        y = y + bias.double()
    return y.float()


def fp16_exact_copy_reference(w: torch.Tensor) -> tuple:
    """(``w`` as fp16, whether fp16 holds every value of ``w`` exactly): the verdict of
    ``torch.ops.specdec.fp16_exact_copy``, from torch ops: every value comes back from fp16 with its
    bits and none is NaN (a NaN never equals itself: ``torch.equal(w.half().float(), w)`` says the
    same).  The copy's contents matter only when the verdict is yes."""
    w16 = w.detach().to(torch.float16)
    return w16, _same_bits(w.detach(), w16)


def fp16_copy_matches_reference(w: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """Whether the fp16 tensor ``w16`` widens to ``w``'s bits, no value NaN (0-dim bool): the
    verdict of ``torch.ops.specdec.fp16_copy_matches``."""
    if w16.shape != w.shape:
        return torch.tensor(False)
    return _same_bits(w.detach(), w16)


def _same_bits(w: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    w = w.contiguous()
    same = torch.equal(w16.float().contiguous().view(torch.int32), w.view(torch.int32))
    return torch.tensor(same and not bool(torch.isnan(w).any()))
