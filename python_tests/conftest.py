"""Test set-up: without a GPU the Triton kernels run on CPU tensors under the interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set here,
before the package's kernel module is imported (the launcher imports it lazily).
"""

import os

import pytest

from helpers import DEVICE, HAS_CUDA  # noqa: E402  (helpers imports torch only, not the package)

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device():
    return DEVICE
