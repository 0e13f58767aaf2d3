"""Fixtures of the op tests."""

from __future__ import annotations

import contextlib

import pytest

from specdec_kernels.ops.kernels import launch_settings, tree_launch_settings


@pytest.fixture
def split_settings():
    """``split_settings(chunk=16, ...)``: the split kernel's launch settings changed from then to
    the end of the test (``ops.kernels.launch_settings``); calls stack, each on top of the last."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(launch_settings(**changes))


@pytest.fixture
def tree_settings():
    """``tree_settings(block_v=16)``: the tree kernel's vocabulary tile changed to the end of the
    test (``ops.kernels.tree_launch_settings``)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tree_launch_settings(**changes))
