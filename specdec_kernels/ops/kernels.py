"""The package's Triton kernels by name, for tools that compile them ahead of time
(``scripts/gpu_compile_check.py``: registers, spills, shared memory per variant), and the split
verify kernel's launch settings and workspace records, for the benchmarks that tune and inspect
it (``bench_verify_knobs.py``, ``bench_verify_interpreter.py``).

Importing this module imports Triton and defines the kernels; the ops themselves import their
kernel lazily, on the first launch, so the torch paths run without Triton.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .verify.launch import split_kernel_meta

__all__ = ["launch_settings", "split_kernel_meta", "split_workspace_records", "triton_kernels"]


def triton_kernels() -> dict:
    """{"verify_split": the split-vocabulary verify kernel (``fused_verify``'s ``"triton"``
    backend), "tree_verify": ``fused_verify_tree``'s kernel}: the ``@triton.jit`` functions."""
    from .tree.kernel import tree_verify_kernel as _tree_verify_kernel
    from .verify.triton.split_kernel import verify_split_kernel as _verify_split_kernel

    return {"verify_split": _verify_split_kernel, "tree_verify": _tree_verify_kernel}


@contextlib.contextmanager
def launch_settings(tiles_per_item: int, programs_per_sm: int, maxnreg: Optional[int]):
    """Within the block, the split kernel launches with these settings: vocabulary tiles per
    work item, persistent programs per SM, and a register cap (None: Triton's choice).  The
    defaults are restored on exit.  The tokens do not depend on them (batch invariance)."""
    for name, v in (("tiles_per_item", tiles_per_item), ("programs_per_sm", programs_per_sm)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"launch_settings: {name} must be an int >= 1, got {v!r}")
    if maxnreg is not None and (isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or maxnreg < 1):
        raise ValueError(f"launch_settings: maxnreg must be None or an int >= 1, got {maxnreg!r}")
    from .verify import launch

    old = launch._TILES_PER_ITEM, launch._PROGRAMS_PER_SM, launch._MAXNREG
    launch._TILES_PER_ITEM, launch._PROGRAMS_PER_SM, launch._MAXNREG = tiles_per_item, programs_per_sm, maxnreg
    try:
        yield
    finally:
        launch._TILES_PER_ITEM, launch._PROGRAMS_PER_SM, launch._MAXNREG = old


def split_workspace_records(device: torch.device, B: int, K1: int, num_chunks: int) -> dict:
    """The split kernel's per-position records of its last launch on ``device`` with these
    sizes (e.g. ``"scanned"``: the positions whose top-k/top-p bisected the whole position)."""
    from .verify.workspace import device_workspace as _workspace

    return _workspace(device).records(B, K1, num_chunks)
