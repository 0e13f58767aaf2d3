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


# The `slow` marker (registered in pyproject.toml): `pytest python_tests -m "not slow" -n 2` is
# the quick subset for someone changing code; CI (.ci/run) runs everything. Chosen centrally here,
# by file and by test name, from the suite's durations on a 2-core CPU machine (pytest --durations):
# the distributional tests (chi-square over >= 1e5 draws), every case that runs a Triton kernel
# (under the interpreter without a GPU), the CUDA kernels' CPU emulation, the build of an sdist
# and a wheel, the ahead-of-time GPU compile, the end-to-end benchmark's runs, and the vLLM
# plugin's tests (which need .venv-vllm, from scripts/bootstrap_vllm.sh).
SLOW_FILES = {
    "bench/test_bench_verify_interpreter.py",
    "decoding/test_decoder_triton_verify.py",
    "integrations/test_integration_vllm.py",
    "ops/test_block_verify_kernel.py",
    "ops/test_compact_kv_emulated.py",
    "ops/test_gpu_compile.py",
    "ops/test_tree_verify_kernel.py",
    "ops/test_tree_verify_law.py",
    "ops/test_verify_distribution.py",
    "ops/test_verify_split.py",
    "test_packaging.py",
}
# A test whose name or parameters hold one of these: a law, a distribution or a mutant checked by
# sampling; a Triton kernel (a backend, the kernel against the reference, its thresholds, its work
# items' arrival order); the CUDA kernels emulated on the CPU (a C++ build per worker); sweeps of
# random cases; the end-to-end benchmark's runs; a tree's acceptance measured; the audit's vLLM
# adapter (a subprocess in .venv-vllm).
SLOW_WORDS = ("law", "distribution", "matches_target", "mutant", "caught", "sampled_means", "triton",
              "kernel_matches_reference", "kernel_threshold", "arrival_order", "emulated", "random_cases",
              "bench_e2e_quick", "time_limit", "wider_tree", "audit_vllm")


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``python_tests/ops/test_x.py::test_y[params]``) is slow."""
    path, _, name = nodeid.partition("::")
    rel = path.split("python_tests/", 1)[-1]
    return rel in SLOW_FILES or any(w in name for w in SLOW_WORDS)


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(slow)
