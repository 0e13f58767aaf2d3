"""The ground truth of ``cpu.skinny_linear``: the product accumulated in float64."""

from __future__ import annotations

import torch

__all__ = ["skinny_linear_reference"]


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
