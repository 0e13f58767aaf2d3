"""The CUDA kernel of compact_kv_, run on the CPU.

``csrc/compact_kv_kernel.cuh`` holds the kernel's body (what one thread does) and the host
code that plans the launches (groups of up to 64 caches, the widest access their addresses
allow); ``csrc/compact_kv_cuda.cu`` only launches it.  Here the same header is compiled with
the host compiler (``python_tests/ops/kv/cuda_emulation/compact_kv_emulated.cpp``) and every thread
of every block of every launch runs serially on CPU tensors.  The kernel's threads share no
memory and never wait on one another, so every serial order must give the result a GPU
gives: each case runs with the threads in order and reversed, with the GPU's 256 threads a
block and with fewer (a thread then walks several columns), and must equal
``compact_kv_reference`` and the CPU op bit for bit.  The same cases as the CUDA tests in
test_kv_cache.py, which need a GPU and also check the launch itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from specdec_kernels.ops.reference import compact_kv_reference

from test_kv_cache import CASES, _idx, _indices, _make_caches

ROOT = Path(__file__).resolve().parents[3]
SOURCE = Path(__file__).resolve().parent / "cuda_emulation" / "compact_kv_emulated.cpp"
GPU_THREADS = 256  # kThreads in compact_kv_kernel.cuh


@pytest.fixture(scope="module")
def emulated():
    """The kernel compiled for the host (a build failure fails the tests that use it)."""
    if not cpp_extension.is_ninja_available():  # requirements.txt installs it; a bare image may lack it
        pytest.skip("needs ninja to build the emulated kernel with torch.utils.cpp_extension.load (pip install ninja)")
    return cpp_extension.load(
        name="specdec_compact_kv_emulated",
        sources=[str(SOURCE)],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O1"],
        verbose=False,
    )


def _expected_access(caches) -> int:
    """The access width compact_kv_cuda chooses: the largest power of two <= 16 dividing the
    base address, the byte strides of B, H, T and the row's bytes of every cache with elements."""
    g = 16
    for c in caches:
        if c.numel() == 0:
            continue
        e = c.element_size()
        for x in (c.data_ptr(), c.stride(0) * e, c.stride(1) * e, c.stride(2) * e, c.size(3) * e):
            g = math.gcd(g, x)
    return g


def _run(emulated, caches, src_start, dst, cnt, block_dim, reverse):
    return emulated.compact_kv_emulated(caches, src_start, _idx(dst), _idx(cnt), block_dim, reverse)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("block_dim", [GPU_THREADS, 3])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "cropped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("B", [1, 3, 5])
def test_emulated_kernel_matches_reference_and_cpu_op(emulated, B, case, dtype, layout, block_dim, reverse):
    src_start, dst, cnt = _indices(case, B)
    caches = _make_caches(B, dtype, "cpu", layout, seed=B)
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    cpu_op = [c.clone() for c in caches]
    torch.ops.specdec.compact_kv_(cpu_op, src_start, _idx(dst), _idx(cnt))
    launches = _run(emulated, caches, src_start, dst, cnt, block_dim, reverse)
    assert launches == [[_expected_access(caches), len(caches)]]
    for got, want, op in zip(caches, expected, cpu_op):
        assert torch.equal(got, want)  # compares every element, including untouched positions
        assert torch.equal(got, op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("D", [1, 3, 5, 64, 128])
def test_emulated_alignments_and_many_layers(emulated, dtype, D):
    # 70 caches: two launches (64 + 6); odd D: 1-, 2-, 4-byte accesses instead of 16
    B = 5
    shapes = [(1 + i % 3, 12 + i % 2, D) for i in range(70)]
    caches = [c.to(dtype) for c in _make_caches(B, torch.float32, "cpu", "contiguous", seed=D, shapes=shapes)]
    src_start, dst, cnt = _indices("mixed", B)
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    launches = _run(emulated, caches, src_start, dst, cnt, GPU_THREADS, False)
    assert launches == [[_expected_access(caches[:64]), 64], [_expected_access(caches[64:]), 6]]
    assert {a for a, _ in launches} == {min(16, D * caches[0].element_size() & -(D * caches[0].element_size()))}
    for got, want in zip(caches, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_emulated_empty_caches_are_not_launched(emulated):
    # a cache with H = 0 or D = 0 has no elements: it takes no slot in a launch group
    B = 3
    caches = _make_caches(B, torch.float32, "cpu", "contiguous",
                          shapes=[(2, 12, 8), (0, 12, 8), (2, 12, 0), (1, 12, 4)])
    src_start, dst, cnt = _indices("overlap", B)
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    assert _run(emulated, caches, src_start, dst, cnt, GPU_THREADS, False) == [[16, 2]]
    assert all(torch.equal(g, w) for g, w in zip(caches, expected))
    assert _run(emulated, caches[1:3], src_start, dst, cnt, GPU_THREADS, False) == []
    assert _run(emulated, caches, src_start, [], [], GPU_THREADS, False) == []  # B = 0


@pytest.mark.parametrize("block_dim", [GPU_THREADS, 1])
def test_emulated_out_of_range_values_are_skipped_or_clamped(emulated, block_dim):
    # rows: dst > src (skipped), dst < 0 (skipped), count < 0 (nothing), count past T (clamped),
    # dst == src (nothing moves).  The CPU op refuses these values; the kernel cannot read them
    # on the host, so it skips or clamps them in the kernel.
    B, T = 5, 12
    caches = _make_caches(B, torch.float32, "cpu", "contiguous", shapes=[(2, T, 8), (1, T + 2, 4)])
    src_start = 8
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected[:1], src_start, _idx([0, 0, 0, 3, 0]), _idx([0, 0, 0, T - src_start, 0]))
    compact_kv_reference(expected[1:], src_start, _idx([0, 0, 0, 3, 0]), _idx([0, 0, 0, T + 2 - src_start, 0]))
    _run(emulated, caches, src_start, [9, -1, 2, 3, 8], [2, 2, -5, 100, 3], block_dim, False)
    assert all(torch.equal(g, w) for g, w in zip(caches, expected))


# ------------------------------------------------------------------------------------------
# The decoder's loop with its cache rollback through the emulated kernel
# ------------------------------------------------------------------------------------------
from decoder_setup import PROMPTS, _one_thread, greedy_refs, pair  # noqa: E402,F401  (fixtures)
from feature_setup import fgreedy_refs, fpair  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.slow  # the CUDA kernels emulated on the CPU (a C++ build per worker)


def _route_through_emulation(monkeypatch, emulated, calls: list):
    """Every compact_kv_ the decoder makes (both caches, every step) runs the CUDA kernel's code."""
    from specdec_kernels.ops.kv import cache as kv_cache

    def compact(caches, src_start, dst_start, count):
        calls.append(len(caches))
        emulated.compact_kv_emulated(list(caches), src_start, dst_start, count, GPU_THREADS, False)

    monkeypatch.setattr(kv_cache, "compact_kv_", compact)


@pytest.mark.parametrize("drafter", ["model", "feature"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoder_with_the_emulated_kernel(emulated, pair, greedy_refs, fpair, fgreedy_refs, monkeypatch,
                                          drafter, temperature):
    """A ragged batch decoded with the caches rolled back by the CUDA kernel's code gives the
    tokens, step by step, of the CPU op (greedy: the target's own greedy decoding)."""
    from specdec_kernels import SpeculativeDecoder

    draft, target = fpair if drafter == "feature" else pair
    refs = fgreedy_refs if drafter == "feature" else greedy_refs
    dec = SpeculativeDecoder(draft=draft, target=target, drafter=drafter)
    kw = dict(max_new_tokens=20, num_draft_tokens=3, temperature=temperature, seed=5)
    want = dec.generate(PROMPTS, **kw)
    calls = []
    with monkeypatch.context() as m:
        _route_through_emulation(m, emulated, calls)
        got = dec.generate(PROMPTS, **kw)
    # each step compacts the target's cache (2 layers: 4 tensors) and the draft's (the model's 4,
    # the feature draft's one layer: 2)
    assert len(calls) >= 2 * got.stats.iterations - 2 and set(calls) == ({4, 2} if drafter == "feature" else {4})
    assert got.token_ids == want.token_ids
    assert [h["accepted"] for h in got.stats.history] == [h["accepted"] for h in want.stats.history]
    if temperature == 0:
        assert got.token_ids == [r[:20] for r in refs]
