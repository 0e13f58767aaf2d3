"""Reading tensor values on the host, where that is free and safe: the CPU routes' guard
(``host_readable``), the warp's sort through NumPy (``sort_descending_cpu``), host lists to
the device without a sync (``to_device``) and a tensor's version counter (``tensor_version``,
for caches of weight copies).  Not references: ``reference.py`` stays pure PyTorch, and takes
the sort as an argument."""

from __future__ import annotations

from typing import Optional

import torch


def host_readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values may be read on the host (``.tolist()``, ``bool()``, ``.numpy()``):
    a plain CPU tensor outside any tracing or transform.  Not on a GPU (a sync), not while
    torch.compile, make_fx or another dispatch mode traces (a value read would be baked into the
    graph as a constant, or fail on a fake tensor), not under vmap/grad transforms (wrapped
    tensors have no data).  The CPU routes that read values check this and take their tensor
    path otherwise."""
    if t.device.type != "cpu" or type(t) is not torch.Tensor or torch.compiler.is_compiling():
        return False
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None or torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    except (ImportError, AttributeError):  # pragma: no cover - torch's private API moved
        pass
    return True


def sort_descending_cpu(s: torch.Tensor) -> torch.Tensor:
    """``torch.sort(s, dim=-1, descending=True).values`` of an fp32 tensor, through NumPy's sort
    on CPU tensors (its SIMD sort is many times faster than torch's on a CPU: docs/history/measurements.md).
    The same values in the same places, but for the order among equal values that are told
    apart by their bits only: -0.0 and +0.0, which every use here treats alike, and NaNs (first
    in both, as NumPy sorts them last and the order is reversed; their signs and payloads may
    land in another order, and a NaN row is invalid anyway).  torch's sort where the values may
    not be read on the host (``host_readable``) or the tensor requires grad."""
    # imported here: the verify family imports this module while it initialises
    from .verify.reference.warp import torch_sort_descending

    if not host_readable(s) or s.requires_grad or s.dtype != torch.float32:
        return torch_sort_descending(s)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with transformers
        return torch_sort_descending(s)
    ascending = np.sort(s.contiguous().numpy(), axis=-1)
    return torch.from_numpy(ascending[..., ::-1].copy())


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list) as a tensor on ``device`` without a host sync: on CUDA through pinned
    memory and a non-blocking copy (a copy from pageable memory waits for the stream's queued
    work first: a second sync in a decoding step)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_version(t: torch.Tensor) -> Optional[int]:
    """``t._version`` (bumped by every in-place update), or None for an inference tensor (one
    made under ``torch.inference_mode``, e.g. a model loaded there), which has no version counter:
    a copy of it cannot be known to be current, so callers re-make it."""
    return None if t.is_inference() else t._version
