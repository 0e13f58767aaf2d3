"""Test set-up: without a GPU the Triton kernels run on CPU tensors under the interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set here,
before the package's kernel module is imported (the launcher imports it lazily).
"""

import os

import pytest

from helpers import DEVICE, HAS_CUDA  # noqa: E402  (helpers imports torch only, not the package)

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import interpreter_calls  # noqa: E402

    interpreter_calls.install()  # device-function calls without a second language patch
# The tests never write the user's fp16 weight cache (specdec generate's default): those that test
# the cache name their own directory.
os.environ.setdefault("SPECDEC_WEIGHT_CACHE", "off")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def torch_routes():
    """``set(**changes)``: the CPU torch path's routes (``ops.verify.torch_path.routes``: the argmax
    chunk, the host greedy route, the row-by-row final draw) changed for the rest of the test."""
    import contextlib

    from specdec_kernels.ops.verify.torch_path import routes

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(routes(**changes))


@pytest.fixture
def device_value_checks():
    """``fused_verify`` as on a device: no host range checks of tensor values, a bad value makes its
    row invalid in the op (``specdec_kernels.ops.verify.host_value_checks(False)``)."""
    from specdec_kernels.ops.verify import host_value_checks

    with host_value_checks(False):
        yield


# The `slow` marker (registered in pyproject.toml) is set in the test files themselves: a
# module's `pytestmark`, a test's `@pytest.mark.slow`, a parameter's `pytest.param(..., marks=...)`.
# `pytest python_tests -m "not slow" -n 2` is the quick subset for someone changing code; CI
# (.ci/run) runs everything.
