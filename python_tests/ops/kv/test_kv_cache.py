"""Tests of KV-cache compaction: specdec::compact_kv_ (C++ op), its wrapper and its fallback.

Every case is compared exactly (torch.equal: a move must not change a single bit) with
``compact_kv_reference``, itself checked on a worked example.  Each case also checks that
positions outside the moved ranges are untouched.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import specdec_kernels
from specdec_kernels.ops.kv import cache as kv_cache
from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.ops.kv.cache import compact_dynamic_cache_, compact_kv_
from specdec_kernels.ops.reference import compact_kv_reference

HAS_CUDA = torch.cuda.is_available()
needs_ext = pytest.mark.skipif(
    not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e ."
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Layers with different H, T and D (D = 5: rows not a multiple of 16 bytes).
LAYER_SHAPES = [(2, 12, 8), (1, 12, 5), (3, 14, 16)]  # (H, T, D) per cache
T_MIN = min(t for _, t, _ in LAYER_SHAPES)


def _indices(case: str, B: int) -> tuple[int, list[int], list[int]]:
    """(src_start, dst_start [B], count [B]) for a named case; all valid for T_MIN = 12."""
    if case == "overlap":  # src - dst in {1, 2, 3} < count = 4: ranges overlap
        return 6, [6 - 1 - b % 3 for b in range(B)], [4] * B
    if case == "disjoint":  # src - dst >= 6 > count
        return 8, [b % 3 for b in range(B)], [3 + b % 2 for b in range(B)]
    if case == "count_zero":
        return 5, [2] * B, [0] * B
    if case == "noop":  # dst == src: nothing moves
        return 5, [5] * B, [3] * B
    if case == "mixed":  # per-row: overlap, no-op, zero count, disjoint, ...
        return 7, [(0, 7, 3, 6, 1)[b % 5] for b in range(B)], [(5, 2, 0, 4, 3)[b % 5] for b in range(B)]
    if case == "to_end":  # moves exactly up to T_MIN
        return 4, [b % 4 for b in range(B)], [T_MIN - 4] * B
    if case == "src_at_end":  # src_start == T is legal when nothing is kept
        return T_MIN, [T_MIN - 1 - b % 2 for b in range(B)], [0] * B
    raise ValueError(case)


CASES = ["overlap", "disjoint", "count_zero", "noop", "mixed", "to_end", "src_at_end"]


def _make_caches(B, dtype, device, layout, seed=0, shapes=LAYER_SHAPES):
    """One cache [B, H, T, D] per shape, with distinct values everywhere."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for H, T, D in shapes:
        if layout == "contiguous":
            c = torch.randn(B, H, T, D, generator=g).to(dtype).to(device)  # [B, H, T, D]
        elif layout == "transposed":  # a [B, T, H, D] buffer seen as [B, H, T, D]
            c = torch.randn(B, T, H, D, generator=g).to(dtype).to(device).transpose(1, 2)
        elif layout == "cropped":  # the first T positions of a longer buffer (DynamicLayer.crop)
            c = torch.randn(B, H, T + 3, D, generator=g).to(dtype).to(device)[:, :, :T, :]
        else:
            raise ValueError(layout)
        caches.append(c)
    return caches


def _idx(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int64, device=device)  # [B] int64


def _run_op(caches, src_start, dst_start, count):
    torch.ops.specdec.compact_kv_(caches, src_start, dst_start, count)


def _run_fallback(caches, src_start, dst_start, count, monkeypatch):
    monkeypatch.setattr(kv_cache, "HAS_EXT", False)
    compact_kv_(caches, src_start, dst_start, count)


def _check_untouched(before, after, src_start, dst, cnt):
    """Every position outside [dst_start[b], dst_start[b] + count[b]) keeps its old value."""
    for old, new in zip(before, after):
        keep = torch.ones(old.shape[0], old.shape[2], dtype=torch.bool)  # [B, T]
        for b, (d, n) in enumerate(zip(dst, cnt)):
            keep[b, d : d + n] = False
        keep = keep[:, None, :, None].expand_as(old).to(old.device)  # [B, H, T, D]
        assert torch.equal(new[keep], old[keep])


# ------------------------------------------------------------------------------------------
# Loading the extension
# ------------------------------------------------------------------------------------------
def _load_ext_module_afresh():
    """Executes specdec_kernels/ops/extension.py as a new module, recording its warnings."""
    path = Path(specdec_kernels.__file__).parent / "ops" / "extension.py"
    spec = importlib.util.spec_from_file_location("specdec_kernels.ops._extension_probe", path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.loader.exec_module(module)
    return module, caught


def _no_gpu_query(*args, **kwargs):
    raise AssertionError("the package must not query the GPU at import time")


def test_ext_missing_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "specdec_kernels.ops._C", None)  # makes the import fail
    monkeypatch.delattr(specdec_kernels.ops, "_C", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", _no_gpu_query)
    monkeypatch.setattr(torch.cuda, "device_count", _no_gpu_query)
    module, caught = _load_ext_module_afresh()
    assert module.HAS_EXT is False
    assert isinstance(module.EXT_IMPORT_ERROR, ImportError)
    assert len(caught) == 1
    assert issubclass(caught[0].category, RuntimeWarning)
    message = str(caught[0].message)
    assert "C++ extension specdec_kernels.ops._C is not loaded" in message
    assert "pure-PyTorch fallbacks" in message
    assert "pip install --no-build-isolation -e ." in message


@needs_ext
def test_ext_present_loads_quietly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", _no_gpu_query)
    monkeypatch.setattr(torch.cuda, "device_count", _no_gpu_query)
    module, caught = _load_ext_module_afresh()
    assert module.HAS_EXT is True and module.EXT_IMPORT_ERROR is None
    assert caught == []
    assert hasattr(torch.ops.specdec, "compact_kv_")


# ------------------------------------------------------------------------------------------
# The reference itself, on a worked example
# ------------------------------------------------------------------------------------------
def test_reference_worked_example():
    c = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).reshape(2, 1, 6, 2)  # [B=2, H=1, T=6, D=2]
    compact_kv_reference([c], 3, _idx([1, 3]), _idx([2, 1]))
    # row 0: positions 3, 4 move to 1, 2 (overlapping ranges); row 1: dst == src, unchanged
    expected0 = torch.tensor([[0, 1], [6, 7], [8, 9], [6, 7], [8, 9], [10, 11]], dtype=torch.float32)
    assert torch.equal(c[0, 0], expected0)
    assert torch.equal(c[1, 0], torch.arange(12, 24, dtype=torch.float32).reshape(6, 2))


def test_reference_overlap_is_memmove():
    # shift 1 < count 4: a naive "write then read" order would smear position src into all rows
    c = torch.arange(10, dtype=torch.float64).reshape(1, 1, 10, 1)  # [1, 1, T=10, 1]
    compact_kv_reference([c], 5, _idx([4]), _idx([4]))
    assert c.flatten().tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 8, 9]


# ------------------------------------------------------------------------------------------
# Exactness against the reference
# ------------------------------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "cropped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("B", [1, 3, 5])
def test_op_matches_reference(B, case, dtype, layout):
    src_start, dst, cnt = _indices(case, B)
    caches = _make_caches(B, dtype, "cpu", layout, seed=B)
    before = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    _run_op(caches, src_start, _idx(dst), _idx(cnt))
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    _check_untouched(before, caches, src_start, dst, cnt)
    if case in ("noop", "count_zero", "src_at_end"):
        assert all(torch.equal(a, b) for a, b in zip(before, caches))


@pytest.mark.parametrize("path", ["wrapper", "fallback"])
@pytest.mark.parametrize("case", ["overlap", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_wrapper_and_fallback_match_reference(path, case, dtype, monkeypatch):
    B = 5
    src_start, dst, cnt = _indices(case, B)
    caches = _make_caches(B, dtype, "cpu", "transposed", seed=7)
    before = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    if path == "wrapper":
        compact_kv_(caches, src_start, _idx(dst), _idx(cnt))
    else:
        _run_fallback(caches, src_start, _idx(dst), _idx(cnt), monkeypatch)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    _check_untouched(before, caches, src_start, dst, cnt)


@needs_ext
def test_op_many_layers_and_views_of_one_buffer():
    # keys and values as two halves of one [2, B, H, T, D] buffer: views of one storage that do
    # not overlap are accepted; 40 layers x 2 exercise the parallel path.
    B, H, T, D = 3, 2, 12, 8
    bufs = [torch.randn(2, B, H, T, D) for _ in range(40)]
    caches = [half for buf in bufs for half in (buf[0], buf[1])]
    src_start, dst, cnt = _indices("mixed", B)
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    _run_op(caches, src_start, _idx(dst), _idx(cnt))
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@needs_ext
def test_op_large_rows_parallel():
    # big enough (a few MiB) for at::parallel_for to split the work across threads
    B, H, T, D = 4, 8, 64, 128
    caches = [torch.randn(B, H, T, D) for _ in range(4)]
    src_start, dst, cnt = 40, [30, 39, 0, 40], [20, 24, 10, 5]
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    _run_op(caches, src_start, _idx(dst), _idx(cnt))
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@needs_ext
def test_op_empty_batch_and_empty_heads():
    caches = [torch.randn(0, 2, 6, 4), torch.randn(0, 0, 6, 4)]
    compact_kv_(caches, 3, _idx([]), _idx([]))  # nothing to do, nothing to raise
    caches = [torch.randn(2, 0, 6, 4)]
    compact_kv_(caches, 3, _idx([1, 2]), _idx([3, 1]))


# ------------------------------------------------------------------------------------------
# torch.library.opcheck and torch.compile
# ------------------------------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("case", ["overlap", "mixed"])
def test_opcheck(case):
    B = 3
    src_start, dst, cnt = _indices(case, B)
    caches = _make_caches(B, torch.float32, "cpu", "contiguous")
    torch.library.opcheck(torch.ops.specdec.compact_kv_.default, (caches, src_start, _idx(dst), _idx(cnt)))


@needs_ext
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(caches, src_start, dst_start, count):
        compact_kv_(caches, src_start, dst_start, count)
        return caches[0].sum(dim=(1, 3))  # [B, T]: the graph keeps computing after the move

    for case in ("overlap", "mixed", "disjoint"):  # different src_start values: re-traced dynamic
        src_start, dst, cnt = _indices(case, 3)
        compiled = _make_caches(3, torch.float32, "cpu", "contiguous", seed=3)
        eager = [c.clone() for c in compiled]
        out = step(compiled, src_start, _idx(dst), _idx(cnt))
        compact_kv_(eager, src_start, _idx(dst), _idx(cnt))
        assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
        assert torch.equal(out, eager[0].sum(dim=(1, 3)))


# ------------------------------------------------------------------------------------------
# Error messages: name the argument, the expected and the actual value
# ------------------------------------------------------------------------------------------
def _c(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


# (id, args builder, exception type raised by the Python wrapper, regex for both paths)
META_ERRORS = [
    ("empty", lambda: ([], 0, _idx([0]), _idx([0])), ValueError,
     r"caches must be a non-empty list of \[B, H, T, D\] tensors, got an empty list"),
    ("rank", lambda: ([_c(2, 1, 12, 4), _c(2, 12, 4)], 0, _idx([0, 0]), _idx([0, 0])), ValueError,
     r"caches\[1\] must have 4 dims \[B, H, T, D\], got 3"),
    ("batch", lambda: ([_c(2, 1, 12, 4), _c(2, 1, 12, 4), _c(3, 1, 12, 4)], 0, _idx([0, 0]), _idx([0, 0])),
     ValueError, r"caches\[2\] must have B = dst_start.size\(0\) = 2 rows \(dim 0\), got 3"),
    ("count_batch", lambda: ([_c(2, 1, 12, 4)], 0, _idx([0, 0]), _idx([0, 0, 0])), ValueError,
     r"count must have B = dst_start.size\(0\) = 2 entries, got 3"),
    ("dst_rank", lambda: ([_c(2, 1, 12, 4)], 0, _idx([[0, 0]]), _idx([0, 0])), ValueError,
     r"dst_start must have 1 dim \[B\], got 2"),
    ("dst_dtype", lambda: ([_c(2, 1, 12, 4)], 0, _idx([0, 0]).int(), _idx([0, 0])), TypeError,
     r"dst_start must be int64 \(Long\), got (Int|torch.int32)"),
    ("count_dtype", lambda: ([_c(2, 1, 12, 4)], 0, _idx([0, 0]), _idx([0, 0]).float()), TypeError,
     r"count must be int64 \(Long\), got (Float|torch.float32)"),
    ("cache_dtype", lambda: ([_c(2, 1, 12, 4, dtype=torch.int64)], 0, _idx([0, 0]), _idx([0, 0])), TypeError,
     r"caches\[0\] must have a floating-point dtype, got (Long|torch.int64)"),
    ("last_dim_stride", lambda: ([_c(2, 1, 4, 12).transpose(2, 3)], 0, _idx([0, 0]), _idx([0, 0])), ValueError,
     r"caches\[0\] must have a contiguous last dim \(stride\(3\) == 1\), got stride\(3\) = 12"),
    ("src_negative", lambda: ([_c(2, 1, 12, 4)], -1, _idx([0, 0]), _idx([0, 0])), ValueError,
     r"src_start must be in \[0, T\] = \[0, 12\] \(T = caches\[0\].size\(2\)\), got -1"),
    ("src_past_end", lambda: ([_c(2, 1, 12, 4), _c(2, 1, 9, 4)], 10, _idx([0, 0]), _idx([0, 0])), ValueError,
     r"src_start must be in \[0, T\] = \[0, 9\] \(T = caches\[1\].size\(2\)\), got 10"),
]

# Checked by the C++ op only (they need data pointers, which the Python checks leave alone).
ALIAS_ERRORS = [
    ("same_tensor_twice", lambda c=_c(2, 1, 12, 4): ([c, c], 0, _idx([0, 0]), _idx([0, 0])),
     r"caches\[0\] and caches\[1\] must not share memory, got the same memory"),
    ("overlapping_views", lambda b=_c(2 * 1 * 13 * 4): (
        [b[:96].view(2, 1, 12, 4), b[8:104].view(2, 1, 12, 4)], 0, _idx([0, 0]), _idx([0, 0])),
     r"caches\[0\] and caches\[1\] must not share memory, got overlapping memory"),
    ("expanded", lambda: ([_c(2, 1, 12, 4).expand(2, 3, 12, 4)], 0, _idx([0, 0]), _idx([0, 0])),
     r"caches\[0\] must not have internally overlapping memory"),
    # non-dense views torch cannot judge, and two storages over one memory (accepted and moved
    # twice before; the decoder's caches are cropped views of one buffer each)
    ("cropped_views_of_one_buffer",
     lambda b=_c(2, 1, 14, 4): ([b[:, :, :12], b[:, :, :12]], 6, _idx([3, 4]), _idx([4, 4])),
     r"caches\[0\] and caches\[1\] must not share memory, got views whose memory ranges meet \(not both dense\)"),
    ("shifted_cropped_views", lambda b=_c(2, 1, 14, 4): ([b[:, :, :12], b[:, :, 1:13]], 6, _idx([3, 4]), _idx([4, 4])),
     r"caches\[0\] and caches\[1\] must not share memory, got views whose memory ranges meet"),
    ("two_storages_one_memory", lambda a=np.zeros((2, 1, 12, 4), np.float32): (
        [_c(2, 1, 12, 4), torch.from_numpy(a), torch.from_numpy(a)], 6, _idx([3, 4]), _idx([4, 4])),
     r"caches\[1\] and caches\[2\] must not share memory, got overlapping memory"),
    ("overlapping_heads", lambda: ([_c(100).as_strided((1, 2, 8, 2), (999, 1, 2, 1))], 6, _idx([3]), _idx([2])),
     r"caches\[0\] must not have internally overlapping memory .*got strides \[999, 1, 2, 1\]"),
]

# Checked by the CPU op and the reference (they read the index values).
VALUE_ERRORS = [
    ("dst_past_src", (5, [2, 6], [1, 1]), r"dst_start\[1\] must be <= src_start = 5, got 6"),
    ("dst_negative", (5, [-1, 0], [1, 1]), r"dst_start\[0\] must be >= 0, got -1"),
    ("count_negative", (5, [0, 0], [1, -2]), r"count\[1\] must be >= 0, got -2"),
    ("count_past_end", (5, [0, 3], [7, 8]),
     r"src_start \+ count\[1\] must be <= T = 12 \(T = caches\[0\].size\(2\)\), got 5 \+ 8"),
]


@needs_ext
@pytest.mark.parametrize("name,build,_exc,pattern", META_ERRORS, ids=[e[0] for e in META_ERRORS])
def test_op_meta_errors(name, build, _exc, pattern):
    with pytest.raises(RuntimeError, match=r"^compact_kv_: " + pattern):
        _run_op(*build())


@pytest.mark.parametrize("name,build,exc,pattern", META_ERRORS, ids=[e[0] for e in META_ERRORS])
def test_wrapper_meta_errors(name, build, exc, pattern):
    with pytest.raises(exc, match=r"^compact_kv_: " + pattern):
        compact_kv_(*build())


@needs_ext
@pytest.mark.parametrize("name,build,pattern", ALIAS_ERRORS, ids=[e[0] for e in ALIAS_ERRORS])
def test_op_alias_errors(name, build, pattern):
    with pytest.raises(RuntimeError, match=r"^compact_kv_: " + pattern):
        compact_kv_(*build())


@needs_ext
def test_op_accepts_separate_views():
    """Cropped and transposed caches, each over its own buffer, and the two halves of one
    [2, B, H, T, D] buffer pass the memory checks and move as the reference does."""
    kv = torch.randn(2, 2, 3, 14, 4)
    caches = [torch.randn(2, 3, 14, 4)[:, :, :12], torch.randn(2, 12, 3, 4).transpose(1, 2), kv[0], kv[1]]
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, 6, _idx([3, 4]), _idx([4, 2]))
    compact_kv_(caches, 6, _idx([3, 4]), _idx([4, 2]))
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@needs_ext
def test_op_tells_autograd_it_wrote():
    """The op bumps its caches' version counters (a backward through a saved cache then fails as
    after any in-place op; it silently used the moved values before), refuses a cache that
    requires grad while grad mode is on (a leaf, by torch's fallback; before, a non-leaf kept its grad_fn
    and a backward ran through the values before the move), and writes
    inference tensors (no version counter) inside inference mode only, as torch's own ops."""
    w = torch.arange(1.0, 7.0).view(1, 1, 6, 1).requires_grad_()
    y = w * 1.0
    z = (y * y).sum()  # saves y
    v = y._version
    with pytest.raises(RuntimeError, match=r"compact_kv_: caches\[0\] must not require grad \(the op has no "
                                           r"derivative; run it under torch.no_grad\(\)"):
        torch.ops.specdec.compact_kv_([y], 3, _idx([0]), _idx([3]))
    assert y._version == v and y.flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    with torch.no_grad():
        torch.ops.specdec.compact_kv_([y], 3, _idx([0]), _idx([3]))
    assert y._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place operation"):
        torch.ops.specdec.compact_kv_([torch.zeros(1, 1, 6, 1, requires_grad=True)], 3, _idx([0]), _idx([3]))
    with torch.inference_mode():
        c = torch.arange(6.0).view(1, 1, 6, 1)
        torch.ops.specdec.compact_kv_([c], 3, _idx([0]), _idx([3]))
    assert c.flatten().tolist() == [3.0, 4.0, 5.0, 3.0, 4.0, 5.0]
    with pytest.raises(RuntimeError, match=r"caches\[0\] is an inference tensor: it may be updated inside "
                                           r"torch.inference_mode\(\) only"):
        torch.ops.specdec.compact_kv_([c], 3, _idx([0]), _idx([3]))


@needs_ext
def test_op_refuses_indices_that_share_memory_with_a_cache():
    # (before: count as an int64 view of a cache's memory was rewritten by the move of the
    # first cache, and the second was moved with an unchecked count: a segfault)
    buf = torch.zeros(8, dtype=torch.int64)
    count = buf[0:1]
    buf[0], buf[4] = 2, 100_000_000
    c0, c1 = buf.view(torch.float64).view(1, 1, 8, 1), torch.zeros(1, 1, 8, 1)
    with pytest.raises(RuntimeError, match=r"compact_kv_: count must not share memory with caches\[0\] \(it is "
                                           r"read while the caches are written\)"):
        torch.ops.specdec.compact_kv_([c0, c1], 4, _idx([0]), count)
    assert buf[0] == 2 and buf[4] == 100_000_000
    dst = buf[6:7]
    with pytest.raises(RuntimeError, match=r"compact_kv_: dst_start must not share memory with caches\[1\]"):
        torch.ops.specdec.compact_kv_([c1, c0], 4, dst, _idx([1]))


@pytest.mark.parametrize("path", ["op", "fallback"])
@pytest.mark.parametrize("name,args,pattern", VALUE_ERRORS, ids=[e[0] for e in VALUE_ERRORS])
def test_value_errors_leave_caches_untouched(name, args, pattern, path, monkeypatch):
    if path == "op" and not HAS_EXT:
        pytest.skip("needs the C++ extension: pip install --no-build-isolation -e .")
    src_start, dst, cnt = args
    caches = _make_caches(2, torch.float32, "cpu", "contiguous", shapes=[(1, 12, 4), (2, 13, 4)])
    before = [c.clone() for c in caches]
    exc = RuntimeError if path == "op" else ValueError
    with pytest.raises(exc, match=r"^compact_kv_: " + pattern):
        if path == "op":
            _run_op(caches, src_start, _idx(dst), _idx(cnt))
        else:
            _run_fallback(caches, src_start, _idx(dst), _idx(cnt), monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


def test_wrapper_type_errors():
    with pytest.raises(TypeError, match=r"caches must be a list of \[B, H, T, D\] tensors, got Tensor"):
        compact_kv_(_c(2, 1, 12, 4), 0, _idx([0, 0]), _idx([0, 0]))
    with pytest.raises(TypeError, match=r"src_start must be an int, got Tensor"):
        compact_kv_([_c(2, 1, 12, 4)], torch.tensor(0), _idx([0, 0]), _idx([0, 0]))
    with pytest.raises(TypeError, match=r"count must be a \[B\] int64 tensor, got list"):
        compact_kv_([_c(2, 1, 12, 4)], 0, _idx([0, 0]), [0, 0])
    with pytest.raises(TypeError, match=r"caches\[1\] must be a tensor, got NoneType"):
        compact_kv_([_c(2, 1, 12, 4), None], 0, _idx([0, 0]), _idx([0, 0]))


def test_wrapper_device_errors():
    # "meta" tensors stand in for a second device on a CPU-only machine
    cpu = _c(2, 1, 12, 4)
    meta = torch.empty(2, 1, 12, 4, device="meta")
    with pytest.raises(ValueError, match=r"caches\[1\] must be on caches\[0\]'s device cpu, got meta"):
        compact_kv_([cpu, meta], 0, _idx([0, 0]), _idx([0, 0]))
    with pytest.raises(ValueError, match=r"dst_start must be on the caches' device cpu, got meta"):
        compact_kv_([cpu], 0, _idx([0, 0]).to("meta"), _idx([0, 0]))


# ------------------------------------------------------------------------------------------
# Hugging Face DynamicCache
# ------------------------------------------------------------------------------------------
def _tiny_llama_cache(B=3, prompt=7, step=4):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.DynamicCache(config=config)
    # transformers 5.24 renamed past_key_values to cache; 5.17 (the GPU image) knows only the old name
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (B, prompt)), use_cache=True, **{kw: cache})
        model(input_ids=torch.randint(0, 64, (B, step)), use_cache=True, **{kw: cache})  # K + 1 = 4
    return cache


def test_compact_dynamic_cache_matches_reference(monkeypatch):
    cache = _tiny_llama_cache()  # keys/values [3, 1, 11, 16] per layer, positions 7..10 new
    layers = cache.layers
    assert len(layers) == 2 and all(layer.keys.shape == (3, 1, 11, 16) for layer in layers)
    expected = [t.clone() for layer in layers for t in (layer.keys, layer.values)]
    src_start, dst, cnt = 7, [5, 7, 6], [3, 2, 4]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))

    calls = []
    real = kv_cache.compact_kv_

    def spy(caches, *args):
        calls.append(list(caches))
        real(caches, *args)

    monkeypatch.setattr(kv_cache, "compact_kv_", spy)
    compact_dynamic_cache_(cache, src_start, _idx(dst), _idx(cnt))
    # one op call, with every layer's own keys and values, in layer order
    assert len(calls) == 1
    assert all(a is b for a, b in zip(calls[0], [t for layer in layers for t in (layer.keys, layer.values)]))
    got = [t for layer in layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_compact_dynamic_cache_errors():
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicSlidingWindowLayer

    with pytest.raises(TypeError, match=r"cache must be a transformers Cache with a .layers list .* got list"):
        compact_dynamic_cache_([], 0, _idx([0]), _idx([0]))
    with pytest.raises(ValueError, match=r"cache must hold at least one initialised layer, got 0 layers"):
        compact_dynamic_cache_(transformers.DynamicCache(), 0, _idx([0]), _idx([0]))
    cache = transformers.DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    cache.layers[0].update(_c(1, 1, 3, 4), _c(1, 1, 3, 4))
    with pytest.raises(ValueError, match=r"cache.layers\[0\] must be a full-attention layer, got a sliding-window"):
        compact_dynamic_cache_(cache, 0, _idx([0]), _idx([0]))


# ------------------------------------------------------------------------------------------
# CUDA (same cases on CUDA tensors; index values are never read on the host there)
# ------------------------------------------------------------------------------------------
@needs_cuda
@needs_ext
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "cropped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("B", [1, 3, 5])
def test_cuda_op_matches_reference(B, case, dtype, layout):
    src_start, dst, cnt = _indices(case, B)
    caches = _make_caches(B, dtype, "cuda", layout, seed=B)
    before = [c.clone() for c in caches]
    expected = [c.cpu() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    # torch.tensor(..., device="cuda") is a synchronising host-to-device copy: made before the check
    dst_c, cnt_c = _idx(dst, "cuda"), _idx(cnt, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the op raises
    try:
        _run_op(caches, src_start, dst_c, cnt_c)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(caches, expected):
        assert torch.equal(got.cpu(), want)
    _check_untouched([c.cpu() for c in before], [c.cpu() for c in caches], src_start, dst, cnt)


@needs_cuda
@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("D", [1, 3, 5, 6, 12, 64, 128])
def test_cuda_op_alignments_and_many_layers(dtype, D):
    # 70 caches: two launch groups (64 + 6); odd D: 1-, 2-, 4-byte accesses instead of 16; rows
    # of 24 bytes (D = 6 fp32, 12 fp16): 8-byte accesses (no case reached them before 2026-12-02)
    B = 5
    shapes = [(1 + i % 3, 12 + i % 2, D) for i in range(70)]
    caches = _make_caches(B, torch.float32, "cuda", "contiguous", seed=D, shapes=shapes)
    caches = [c.to(dtype) for c in caches]
    src_start, dst, cnt = _indices("mixed", B)
    expected = [c.cpu() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    _run_op(caches, src_start, _idx(dst, "cuda"), _idx(cnt, "cuda"))
    for got, want in zip(caches, expected):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@needs_cuda
@needs_ext
def test_cuda_out_of_range_values_are_skipped_or_clamped():
    # rows: dst > src (skipped), dst < 0 (skipped), count < 0 (nothing), count past T (clamped)
    B, T = 4, 12
    caches = _make_caches(B, torch.float32, "cuda", "contiguous", shapes=[(2, T, 8)])
    src_start = 8
    expected = [c.cpu() for c in caches]
    compact_kv_reference(expected, src_start, _idx([0, 0, 0, 3]), _idx([0, 0, 0, T - src_start]))
    _run_op(caches, src_start, _idx([9, -1, 2, 3], "cuda"), _idx([2, 2, -5, 100], "cuda"))
    assert torch.equal(caches[0].cpu(), expected[0])


@needs_cuda
@needs_ext
def test_cuda_device_mismatch_errors():
    c = torch.zeros(2, 1, 12, 4, device="cuda")
    with pytest.raises(RuntimeError, match=r"^compact_kv_: dst_start must be on the caches' device cuda:0, got cpu"):
        _run_op([c], 0, _idx([0, 0]), _idx([0, 0], "cuda"))
    with pytest.raises(RuntimeError, match=r"^compact_kv_: caches\[1\] must be on caches\[0\]'s device cuda:0, "
                                           r"got cpu"):
        _run_op([c, torch.zeros(2, 1, 12, 4)], 0, _idx([0, 0], "cuda"), _idx([0, 0], "cuda"))
    with pytest.raises(ValueError, match=r"^compact_kv_: count must be on the caches' device cuda:0, got cpu"):
        compact_kv_([c], 0, _idx([0, 0], "cuda"), _idx([0, 0]))


@needs_cuda
@needs_ext
def test_cuda_opcheck_and_compile():
    src_start, dst, cnt = _indices("overlap", 3)
    caches = _make_caches(3, torch.float16, "cuda", "contiguous")
    torch.library.opcheck(
        torch.ops.specdec.compact_kv_.default, (caches, src_start, _idx(dst, "cuda"), _idx(cnt, "cuda"))
    )
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def step(caches, src_start, dst_start, count):
        compact_kv_(caches, src_start, dst_start, count)
        return caches[0].float().sum(dim=(1, 3))

    compiled = _make_caches(3, torch.float16, "cuda", "contiguous", seed=1)
    eager = [c.clone() for c in compiled]
    out = step(compiled, src_start, _idx(dst, "cuda"), _idx(cnt, "cuda"))
    compact_kv_(eager, src_start, _idx(dst, "cuda"), _idx(cnt, "cuda"))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert torch.equal(out, eager[0].float().sum(dim=(1, 3)))


def test_src_start_at_the_end_without_the_extension(monkeypatch):
    """src_start == T (nothing after it) with count 0 is valid in the pure-PyTorch fallback too."""
    c = [torch.randn(2, 1, 6, 4)]
    before = c[0].clone()
    monkeypatch.setattr(kv_cache, "HAS_EXT", False)
    kv_cache.compact_kv_(c, 6, torch.tensor([5, 6]), torch.tensor([0, 0]))
    assert torch.equal(c[0], before)
