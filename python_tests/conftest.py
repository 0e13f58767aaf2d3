"""Test set-up: without a GPU the Triton kernels run on CPU tensors under the interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set here,
before the package's kernel module is imported (the launcher imports it lazily).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (this case times or graphs the real kernel)")


@pytest.fixture
def device():
    return DEVICE
