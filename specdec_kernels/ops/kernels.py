"""The package's Triton kernels by name, for tools that compile them ahead of time
(``scripts/gpu_compile_check.py``: registers, spills, shared memory per variant), and the split
verify kernel's launch settings and workspace records, for the benchmarks that tune and inspect
it (``bench_verify_knobs.py``, ``bench_verify_interpreter.py``).

Importing this module imports Triton and defines the kernels; the ops themselves import their
kernel lazily, on the first launch, so the torch paths run without Triton.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

# The launcher's public facts, from their stable place here (``specdec env``, the scripts).
from .verify.launch import interpreter_problem, split_kernel_meta  # noqa: F401

__all__ = ["current_settings", "interpreter_problem", "launch_settings", "split_kernel_meta", "split_workspace",
           "split_workspace_records", "tree_launch_settings", "triton_kernels"]


def triton_kernels() -> dict:
    """{"verify_split": the split-vocabulary verify kernel (``fused_verify``'s ``"triton"``
    backend), "tree_verify": ``fused_verify_tree``'s kernel}: the ``@triton.jit`` functions."""
    from .tree.kernel import tree_verify_kernel as _tree_verify_kernel
    from .verify.triton.split_kernel import verify_split_kernel as _verify_split_kernel

    return {"verify_split": _verify_split_kernel, "tree_verify": _tree_verify_kernel}


@contextlib.contextmanager
def launch_settings(**changes):
    """Within the block, the split kernel launches with these settings changed (the fields of
    ``SplitSettings``: chunk, top_k_cap, tiles_per_item, stages, programs_per_sm, num_warps,
    maxnreg, ticket, stage2_lag, poll, poll_sleep_ns); the previous ones are restored on exit.
    The tokens do not depend on them (batch invariance).  An unknown name or a value the kernel
    cannot launch with is refused, naming it."""
    from .verify import launch

    fields = {f.name for f in dataclasses.fields(launch.SplitSettings)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ValueError(f"launch_settings: unknown setting {unknown[0]!r}; the settings are {sorted(fields)}")
    old = launch.SETTINGS
    launch.SETTINGS = dataclasses.replace(old, **changes)  # checked in SplitSettings.__post_init__
    try:
        yield launch.SETTINGS
    finally:
        launch.SETTINGS = old


@contextlib.contextmanager
def tree_launch_settings(*, block_v: int):
    """Within the block, ``fused_verify_tree``'s kernel reads the vocabulary in tiles of
    ``block_v`` tokens (a power of two >= 16; 4096 by default); restored on exit.  The tokens do
    not depend on it."""
    from .tree import api

    if isinstance(block_v, bool) or not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"tree_launch_settings: block_v must be an int >= 16, a power of two, got {block_v!r}")
    old = api.TREE_BLOCK_V
    api.TREE_BLOCK_V = block_v
    try:
        yield
    finally:
        api.TREE_BLOCK_V = old


def current_settings():
    """The split kernel's launch settings in force (a frozen ``SplitSettings``)."""
    from .verify import launch

    return launch.SETTINGS


def split_workspace(device, stream: Optional[int] = None):
    """The split kernel's workspace on ``device`` and a stream (its ``stream_id``; None: the
    current stream), a ``SplitWorkspace``: ``.tensors()`` names its tensors, ``.reset()`` zeroes
    them, ``.records(B, K + 1, num_chunks)`` reads the last launch's position records.  Each
    launch zeroes the counters it uses, so no reset is needed between calls."""
    from .verify.workspace import workspace

    return workspace(torch.device(device), stream)


def split_workspace_records(device: torch.device, B: int, K1: int, num_chunks: int) -> dict:
    """The split kernel's per-position records of its last launch on ``device`` with these
    sizes (e.g. ``"scanned"``: the positions whose top-k/top-p bisected the whole position)."""
    return split_workspace(device).records(B, K1, num_chunks)
