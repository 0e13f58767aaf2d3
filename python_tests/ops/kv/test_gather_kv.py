"""Tests of KV-cache gathering: specdec::gather_kv_ (C++ op), its wrapper, its fallback, its
DynamicCache helper and its CUDA kernel's code (run on the CPU, as compact_kv_'s is).

Every case is compared exactly (torch.equal: a move must not change a single bit) with
``gather_kv_reference``, itself checked on worked examples, including the columns outside the
moved ranges.  A tiny random Llama checks the point of the op: the cache of a tree step,
gathered to each row's accepted path, gives the logits of a fresh forward over the prompt and
the accepted tokens.
"""

from __future__ import annotations

import inspect
import math
import random
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from specdec_kernels.ops.kv import cache as kv_cache
from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.ops.kv.cache import gather_dynamic_cache_, gather_kv_
from specdec_kernels.ops.reference import gather_kv_reference

HAS_CUDA = torch.cuda.is_available()
needs_ext = pytest.mark.skipif(
    not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e ."
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[3]
EMULATED_SOURCE = Path(__file__).resolve().parent / "cuda_emulation" / "gather_kv_emulated.cpp"
GPU_THREADS = 256  # kThreads in compact_kv_kernel.cuh (gather_kv_ launches as compact_kv_ does)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _idx(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int64, device=device)  # [B] or [B, M] int64


def _make_caches(B, T, shapes, dtype, layout, seed=0, device="cpu"):
    """One cache [B, H, T, D] per (H, D) in ``shapes``, with distinct values everywhere."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for H, D in shapes:
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


def _random_case(seed: int):
    """(caches, src_index [B, M], count [B], dst_start [B]) drawn at random, all valid: B 1..4,
    1..3 layers (keys and values of one (H, D) each, H and D differing between layers), one of
    three dtypes and layouts, ragged counts (0 and M included), sources that overlap the
    destinations, spread over the rest of the cache or already in place, and the unused
    entries of src_index -1, 0 or far out of range (they must never be read)."""
    rng = random.Random(seed)
    B, L, T, M = rng.randint(1, 4), rng.randint(1, 3), 16, rng.choice([1, 4, 6])
    dtype, layout = rng.choice(DTYPES), rng.choice(["contiguous", "transposed", "cropped"])
    shapes = []
    for _ in range(L):
        H, D = rng.randint(1, 3), rng.choice([1, 4, 5, 8, 16])
        shapes += [(H, D), (H, D)]  # keys, values
    caches = _make_caches(B, T, shapes, dtype, layout, seed=seed)
    pad = rng.choice([-1, 0, 10**6])
    src, cnt, dst = [], [], []
    for _ in range(B):
        n = rng.choice([0, M, rng.randint(0, M)])
        d = rng.randint(0, T - n)
        mode = rng.choice(["overlap", "spread", "in_place", "partly_in_place"])
        if mode == "overlap":  # sources within two columns of the destinations: they overlap
            s = sorted(rng.sample(range(d, min(T, d + n + 2)), n))
        elif mode == "spread":
            s = sorted(rng.sample(range(d, T), n))
        elif mode == "in_place":
            s = list(range(d, d + n))
        else:  # the first k columns already in place, the rest further on
            k = rng.randint(0, n)
            s = list(range(d, d + k)) + sorted(rng.sample(range(d + k, T), n - k))
        src.append(s + [pad] * (M - n))
        cnt.append(n)
        dst.append(d)
    return caches, _idx(src).view(B, M), _idx(cnt), _idx(dst)


def _check_untouched(before, after, count, dst_start):
    """Every position outside [dst_start[b], dst_start[b] + count[b]) keeps its old value."""
    for old, new in zip(before, after):
        keep = torch.ones(old.shape[0], old.shape[2], dtype=torch.bool)  # [B, T]
        for b, (d, n) in enumerate(zip(dst_start.tolist(), count.tolist())):
            keep[b, d : d + n] = False
        keep = keep[:, None, :, None].expand_as(old).to(old.device)  # [B, H, T, D]
        assert torch.equal(new[keep], old[keep])


# ------------------------------------------------------------------------------------------
# The reference itself, on worked examples
# ------------------------------------------------------------------------------------------
def test_reference_worked_example():
    # row 0: [5, 7, 8] -> 5, 6, 7 (5 stays, 7 moves to 6, 8 to 7; sources overlap destinations);
    # row 1: [2, 9] -> 1, 2 (reading 2 before writing it); padding -1 past count is not read
    c = torch.arange(2 * 10, dtype=torch.float32).reshape(2, 1, 10, 1)  # [B=2, H=1, T=10, D=1]
    gather_kv_reference([c], _idx([[5, 7, 8], [2, 9, -1]]), _idx([3, 2]), _idx([5, 1]))
    assert c[0].flatten().tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 8, 9]
    assert c[1].flatten().tolist() == [10, 12, 19, 13, 14, 15, 16, 17, 18, 19]


def test_reference_reads_before_it_writes():
    # every source at or past its destination, each shift different: a write-then-read order
    # (column by column without the ordering argument) would be wrong somewhere; this one is not
    c = torch.arange(12, dtype=torch.float64).reshape(1, 1, 12, 1)  # [1, 1, T=12, 1]
    gather_kv_reference([c], _idx([[3, 4, 6, 9, 10, 11]]), _idx([6]), _idx([2]))
    assert c.flatten().tolist() == [0, 1, 3, 4, 6, 9, 10, 11, 8, 9, 10, 11]


# ------------------------------------------------------------------------------------------
# Exactness against the reference
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_ext
@pytest.mark.parametrize("seed", range(40))
def test_op_matches_reference_random_cases(seed):
    caches, src, cnt, dst = _random_case(seed)
    before = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    torch.ops.specdec.gather_kv_(caches, src, cnt, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    _check_untouched(before, caches, cnt, dst)


@pytest.mark.slow
def test_random_cases_cover_what_they_claim():
    """The random cases include every dtype, layout-independent H/D per layer, counts 0 and M
    on some row, and sources that overlap their destinations without being in place."""
    dtypes, zero, full, overlap, several_layers = set(), False, False, False, False
    for seed in range(40):
        caches, src, cnt, dst = _random_case(seed)
        dtypes.add(caches[0].dtype)
        M = src.shape[1]
        several_layers |= len({(c.shape[1], c.shape[3]) for c in caches}) > 1
        for b in range(src.shape[0]):
            n, d = int(cnt[b]), int(dst[b])
            zero |= n == 0
            full |= n == M
            used = src[b, :n].tolist()
            overlap |= any(d + j != s and s < d + n for j, s in enumerate(used))
    assert dtypes == set(DTYPES) and zero and full and overlap and several_layers


@pytest.mark.parametrize("path", ["wrapper", "fallback"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_wrapper_and_fallback_match_reference(path, seed, monkeypatch):
    caches, src, cnt, dst = _random_case(100 + seed)
    before = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    if path == "fallback":
        monkeypatch.setattr(kv_cache, "HAS_EXT", False)
    gather_kv_(caches, src, cnt, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    _check_untouched(before, caches, cnt, dst)


@needs_ext
def test_op_strided_index_tensors_and_views_of_one_buffer():
    # src_index as the transpose of an [M, B] tensor, count and dst_start as strided views;
    # keys and values as the two halves of one [2, B, H, T, D] buffer (views that do not meet)
    B, H, T, D = 3, 2, 12, 8
    bufs = [torch.randn(2, B, H, T, D) for _ in range(3)]
    caches = [half for buf in bufs for half in (buf[0], buf[1])]
    src = _idx([[4, 3, 9], [6, 4, 10], [7, -1, 11]]).t()  # [B, M] = [3, 3], non-contiguous
    cnt = _idx([3, 0, 2, 0, 1, 0])[::2]  # [3, 2, 1]
    dst = _idx([3, 0, 3, 0, 9, 0])[::2]  # [3, 3, 9]
    assert not src.is_contiguous() and not cnt.is_contiguous()
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    torch.ops.specdec.gather_kv_(caches, src, cnt, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@needs_ext
def test_op_large_rows_parallel():
    # big enough (a few MiB) for at::parallel_for to split the work across threads
    B, H, T, D = 4, 8, 48, 128
    caches = [torch.randn(B, H, T, D) for _ in range(4)]
    src = _idx([[30, 31, 33, 40, 47], [20, 21, 22, 23, 24], [0, 1, 2, 3, 4], [10, 12, -1, -1, -1]])
    cnt, dst = _idx([5, 5, 5, 2]), _idx([30, 10, 0, 5])
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    torch.ops.specdec.gather_kv_(caches, src, cnt, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@needs_ext
def test_op_empty_batch_heads_and_paths():
    gather_kv_([torch.randn(0, 2, 6, 4), torch.randn(0, 0, 6, 4)], _idx([]).view(0, 3), _idx([]), _idx([]))
    c = [torch.randn(2, 0, 6, 4)]  # no heads: nothing to move, the values are still checked
    gather_kv_(c, _idx([[3, 4], [5, -1]]), _idx([2, 1]), _idx([1, 2]))
    c = [torch.randn(2, 1, 6, 4)]
    before = c[0].clone()
    gather_kv_(c, _idx([]).view(2, 0), _idx([0, 0]), _idx([6, 0]))  # M = 0: nothing kept
    assert torch.equal(c[0], before)


# ------------------------------------------------------------------------------------------
# torch.library.opcheck and torch.compile
# ------------------------------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("seed", [0, 5])
def test_opcheck(seed):
    caches, src, cnt, dst = _random_case(seed)
    torch.library.opcheck(torch.ops.specdec.gather_kv_.default, (caches, src, cnt, dst))


@needs_ext
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(caches, src_index, count, dst_start):
        gather_kv_(caches, src_index, count, dst_start)
        return caches[0].sum(dim=(1, 3))  # [B, T]: the graph keeps computing after the move

    src, cnt, dst = _idx([[5, 7, 8], [2, 9, -1], [4, 5, 6]]), _idx([3, 2, 0]), _idx([5, 1, 4])
    compiled = _make_caches(3, 10, [(2, 4), (2, 4)], torch.float32, "contiguous", seed=3)
    eager = [c.clone() for c in compiled]
    out = step(compiled, src, cnt, dst)
    gather_kv_(eager, src, cnt, dst)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert torch.equal(out, eager[0].sum(dim=(1, 3)))


# ------------------------------------------------------------------------------------------
# Error messages: name the argument, the expected and the actual value
# ------------------------------------------------------------------------------------------
def _c(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


_S, _N, _D = _idx([[5, 6], [7, -1]]), _idx([2, 1]), _idx([5, 4])  # valid for T = 12, B = 2

# (id, args builder, exception type raised by the Python wrapper, regex for both paths)
META_ERRORS = [
    ("empty", lambda: ([], _S, _N, _D), ValueError,
     r"caches must be a non-empty list of \[B, H, T, D\] tensors, got an empty list"),
    ("src_rank", lambda: ([_c(2, 1, 12, 4)], _idx([5, 7]), _N, _D), ValueError,
     r"src_index must have 2 dims \[B, M\], got 1 \(shape \[2\]\)"),
    ("count_rank", lambda: ([_c(2, 1, 12, 4)], _S, _N.view(1, 2), _D), ValueError,
     r"count must have 1 dim \[B\], got 2 \(shape \[1, 2\]\)"),
    ("dst_rank", lambda: ([_c(2, 1, 12, 4)], _S, _N, _idx(5)), ValueError,
     r"dst_start must have 1 dim \[B\], got 0"),
    ("src_dtype", lambda: ([_c(2, 1, 12, 4)], _S.int(), _N, _D), TypeError,
     r"src_index must be int64 \(Long\), got (Int|torch.int32)"),
    ("count_dtype", lambda: ([_c(2, 1, 12, 4)], _S, _N.float(), _D), TypeError,
     r"count must be int64 \(Long\), got (Float|torch.float32)"),
    ("dst_dtype", lambda: ([_c(2, 1, 12, 4)], _S, _N, _D.int()), TypeError,
     r"dst_start must be int64 \(Long\), got (Int|torch.int32)"),
    ("count_batch", lambda: ([_c(2, 1, 12, 4)], _S, _idx([2, 1, 0]), _D), ValueError,
     r"count must have B = src_index.size\(0\) = 2 entries, got 3"),
    ("dst_batch", lambda: ([_c(2, 1, 12, 4)], _S, _N, _idx([5])), ValueError,
     r"dst_start must have B = src_index.size\(0\) = 2 entries, got 1"),
    ("cache_rank", lambda: ([_c(2, 1, 12, 4), _c(2, 12, 4)], _S, _N, _D), ValueError,
     r"caches\[1\] must have 4 dims \[B, H, T, D\], got 3"),
    ("cache_batch", lambda: ([_c(2, 1, 12, 4), _c(2, 1, 12, 4), _c(3, 1, 12, 4)], _S, _N, _D), ValueError,
     r"caches\[2\] must have B = src_index.size\(0\) = 2 rows \(dim 0\), got 3"),
    ("cache_dtype", lambda: ([_c(2, 1, 12, 4, dtype=torch.int64)], _S, _N, _D), TypeError,
     r"caches\[0\] must have a floating-point dtype, got (Long|torch.int64)"),
    ("last_dim_stride", lambda: ([_c(2, 1, 4, 12).transpose(2, 3)], _S, _N, _D), ValueError,
     r"caches\[0\] must have a contiguous last dim \(stride\(3\) == 1\), got stride\(3\) = 12"),
    ("cache_length", lambda: ([_c(2, 1, 12, 4), _c(2, 2, 12, 8), _c(2, 1, 9, 4)], _S, _N, _D), ValueError,
     r"caches\[2\] must have T = caches\[0\].size\(2\) = 12 positions \(dim 2\), got 9 \(shape \[2, 1, 9, 4\]\)"),
]

# Checked by the C++ op only (they need data pointers, which the Python checks leave alone).
ALIAS_ERRORS = [
    ("same_tensor_twice", lambda c=_c(2, 1, 12, 4): ([c, c], _S, _N, _D),
     r"caches\[0\] and caches\[1\] must not share memory, got the same memory"),
    ("expanded", lambda: ([_c(2, 1, 12, 4).expand(2, 3, 12, 4)], _S, _N, _D),
     r"caches\[0\] must not have internally overlapping memory"),
    ("cropped_views_of_one_buffer", lambda b=_c(2, 1, 14, 4): ([b[:, :, :12], b[:, :, 1:13]], _S, _N, _D),
     r"caches\[0\] and caches\[1\] must not share memory, got views whose memory ranges meet"),
]

# Checked by the CPU op and the reference (they read the index values); caches of T = 12.
VALUE_ERRORS = [
    ("dst_negative", ([[5, 6], [7, -1]], [2, 1], [-1, 4]), r"dst_start\[0\] must be >= 0, got -1"),
    ("count_negative", ([[5, 6], [7, -1]], [2, -1], [5, 4]),
     r"count\[1\] must be in \[0, M\] = \[0, 2\] \(M = src_index.size\(1\)\), got -1"),
    ("count_past_m", ([[5, 6], [7, -1]], [3, 1], [5, 4]),
     r"count\[0\] must be in \[0, M\] = \[0, 2\] \(M = src_index.size\(1\)\), got 3"),
    ("dst_plus_count_past_t", ([[10, 11], [7, -1]], [2, 1], [11, 4]),
     r"dst_start\[0\] \+ count\[0\] must be <= T = 12 \(T = caches\[0\].size\(2\)\), got 11 \+ 2"),
    ("src_negative", ([[5, 6], [-1, -1]], [2, 1], [5, 4]),
     r"src_index\[1, 0\] must be in \[0, T\) = \[0, 12\) \(T = caches\[0\].size\(2\)\), got -1"),
    ("src_past_end", ([[5, 12], [7, -1]], [2, 1], [5, 4]),
     r"src_index\[0, 1\] must be in \[0, T\) = \[0, 12\) \(T = caches\[0\].size\(2\)\), got 12"),
    ("src_below_dst", ([[5, 6], [3, -1]], [2, 1], [5, 4]),
     r"src_index\[1, 0\] must be >= dst_start\[1\] = 4 \(columns move towards the prefix only\), got 3"),
    ("src_repeated", ([[6, 6], [7, -1]], [2, 1], [5, 4]),
     r"src_index\[0, 1\] must be > src_index\[0, 0\] = 6 \(the used indices must be strictly increasing\), got 6"),
    ("src_decreasing", ([[8, 7], [7, -1]], [2, 1], [5, 4]),
     r"src_index\[0, 1\] must be > src_index\[0, 0\] = 8 \(the used indices must be strictly increasing\), got 7"),
]


@needs_ext
@pytest.mark.parametrize("name,build,_exc,pattern", META_ERRORS, ids=[e[0] for e in META_ERRORS])
def test_op_meta_errors(name, build, _exc, pattern):
    with pytest.raises(RuntimeError, match=r"^gather_kv_: " + pattern):
        torch.ops.specdec.gather_kv_(*build())


@pytest.mark.parametrize("path", ["wrapper", "fallback"])
@pytest.mark.parametrize("name,build,exc,pattern", META_ERRORS, ids=[e[0] for e in META_ERRORS])
def test_wrapper_meta_errors(name, build, exc, pattern, path, monkeypatch):
    if path == "fallback":
        monkeypatch.setattr(kv_cache, "HAS_EXT", False)
    with pytest.raises(exc, match=r"^gather_kv_: " + pattern):
        gather_kv_(*build())


@needs_ext
@pytest.mark.parametrize("name,build,pattern", ALIAS_ERRORS, ids=[e[0] for e in ALIAS_ERRORS])
def test_op_alias_errors(name, build, pattern):
    with pytest.raises(RuntimeError, match=r"^gather_kv_: " + pattern):
        gather_kv_(*build())


@needs_ext
def test_op_refuses_indices_that_share_memory_with_a_cache():
    buf = torch.zeros(16, dtype=torch.int64)
    c0 = buf.view(torch.float64).view(1, 1, 16, 1)
    for name, args in [("src_index", (buf[2:4].view(1, 2), _idx([0]), _idx([0]))),
                       ("count", (_idx([[3]]), buf[5:6], _idx([0]))),
                       ("dst_start", (_idx([[3]]), _idx([0]), buf[7:8]))]:
        with pytest.raises(RuntimeError, match=rf"^gather_kv_: {name} must not share memory with caches\[1\] "
                                               r"\(it is read while the caches are written\)"):
            torch.ops.specdec.gather_kv_([torch.zeros(1, 1, 16, 1), c0], *args)


@pytest.mark.parametrize("path", ["op", "wrapper", "fallback"])
@pytest.mark.parametrize("name,args,pattern", VALUE_ERRORS, ids=[e[0] for e in VALUE_ERRORS])
def test_value_errors_leave_caches_untouched(name, args, pattern, path, monkeypatch):
    if path != "fallback" and not HAS_EXT:
        pytest.skip("needs the C++ extension: pip install --no-build-isolation -e .")
    src, cnt, dst = args
    caches = _make_caches(2, 12, [(1, 4), (2, 4)], torch.float32, "contiguous")
    before = [c.clone() for c in caches]
    exc = ValueError if path == "fallback" else RuntimeError
    with pytest.raises(exc, match=r"^gather_kv_: " + pattern):
        if path == "op":
            torch.ops.specdec.gather_kv_(caches, _idx(src), _idx(cnt), _idx(dst))
        else:
            if path == "fallback":
                monkeypatch.setattr(kv_cache, "HAS_EXT", False)
            gather_kv_(caches, _idx(src), _idx(cnt), _idx(dst))
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


def test_wrapper_type_and_device_errors():
    with pytest.raises(TypeError, match=r"^gather_kv_: caches must be a list of \[B, H, T, D\] tensors, got Tensor"):
        gather_kv_(_c(2, 1, 12, 4), _S, _N, _D)
    with pytest.raises(TypeError, match=r"^gather_kv_: src_index must be a \[B, M\] int64 tensor, got list"):
        gather_kv_([_c(2, 1, 12, 4)], [[5, 6], [7, -1]], _N, _D)
    with pytest.raises(TypeError, match=r"^gather_kv_: dst_start must be a \[B\] int64 tensor, got int"):
        gather_kv_([_c(2, 1, 12, 4)], _S, _N, 5)
    with pytest.raises(TypeError, match=r"^gather_kv_: caches\[1\] must be a tensor, got NoneType"):
        gather_kv_([_c(2, 1, 12, 4), None], _S, _N, _D)
    # "meta" tensors stand in for a second device on a CPU-only machine
    meta = torch.empty(2, 1, 12, 4, device="meta")
    with pytest.raises(ValueError, match=r"^gather_kv_: caches\[1\] must be on caches\[0\]'s device cpu, got meta"):
        gather_kv_([_c(2, 1, 12, 4), meta], _S, _N, _D)
    with pytest.raises(ValueError, match=r"^gather_kv_: count must be on the caches' device cpu, got meta"):
        gather_kv_([_c(2, 1, 12, 4)], _S, _N.to("meta"), _D)


@needs_ext
def test_op_tells_autograd_it_wrote():
    """As compact_kv_: the version counters are bumped, a cache that requires grad is refused
    while grad mode is on, and an inference tensor is written inside inference mode only."""
    y = torch.arange(1.0, 7.0).view(1, 1, 6, 1).requires_grad_() * 1.0
    z = (y * y).sum()  # saves y
    v = y._version
    with pytest.raises(RuntimeError, match=r"^gather_kv_: caches\[0\] must not require grad"):
        torch.ops.specdec.gather_kv_([y], _idx([[3, 5]]), _idx([2]), _idx([1]))
    assert y._version == v
    with torch.no_grad():
        torch.ops.specdec.gather_kv_([y], _idx([[3, 5]]), _idx([2]), _idx([1]))
    assert y._version > v and y.flatten().tolist() == [1.0, 4.0, 6.0, 4.0, 5.0, 6.0]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    with torch.inference_mode():
        c = torch.arange(6.0).view(1, 1, 6, 1)
        torch.ops.specdec.gather_kv_([c], _idx([[3, 5]]), _idx([2]), _idx([1]))
    assert c.flatten().tolist() == [0.0, 3.0, 5.0, 3.0, 4.0, 5.0]
    with pytest.raises(RuntimeError, match=r"caches\[0\] is an inference tensor: it may be updated inside "
                                           r"torch.inference_mode\(\) only"):
        torch.ops.specdec.gather_kv_([c], _idx([[3, 5]]), _idx([2]), _idx([1]))


# ------------------------------------------------------------------------------------------
# Hugging Face: DynamicCache, and the logits after a tree step
# ------------------------------------------------------------------------------------------
def _kw(model):
    # transformers 5.24 renamed past_key_values to cache; 5.17 (the GPU image) knows only the old name
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_from(model, tensors):
    """A DynamicCache holding ``tensors`` ([keys_0, values_0, keys_1, ...], [B, H, T, D])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for li in range(len(tensors) // 2):
        cache.update(tensors[2 * li], tensors[2 * li + 1], li)
    return cache


def _layer_tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.fixture(scope="module")
def tiny_llama():
    pytest.importorskip("transformers")
    from decoder_setup import _llama  # the decoder tests' small random Llama (CPU, fp32)

    return _llama(32, 32, 2, 0.2, seed=0)


def test_gather_dynamic_cache_matches_reference(tiny_llama, monkeypatch):
    from transformers import DynamicCache

    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(input_ids=torch.randint(0, 32, (3, 9)), use_cache=True, **{_kw(tiny_llama): cache})
    assert all(t.shape == (3, 2, 9, 8) for t in _layer_tensors(cache))
    src, cnt, dst = _idx([[5, 7, 8], [4, 6, -1], [6, 7, 8]]), _idx([3, 2, 0]), _idx([5, 4, 6])
    expected = [t.clone() for t in _layer_tensors(cache)]
    gather_kv_reference(expected, src, cnt, dst)

    calls = []
    real = kv_cache.gather_kv_

    def spy(caches, *args):
        calls.append(list(caches))
        real(caches, *args)

    monkeypatch.setattr(kv_cache, "gather_kv_", spy)
    gather_dynamic_cache_(cache, src, cnt, dst)
    # one op call, with every layer's own keys and values, in layer order
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], _layer_tensors(cache)))
    assert all(torch.equal(a, b) for a, b in zip(_layer_tensors(cache), expected))


def test_gather_dynamic_cache_errors():
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicSlidingWindowLayer

    with pytest.raises(TypeError, match=r"^gather_dynamic_cache_: cache must be a transformers Cache with a "
                                        r".layers list .* got list"):
        gather_dynamic_cache_([], _S, _N, _D)
    with pytest.raises(ValueError, match=r"^gather_dynamic_cache_: cache must hold at least one initialised layer"):
        gather_dynamic_cache_(transformers.DynamicCache(), _S, _N, _D)
    cache = transformers.DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    cache.layers[0].update(_c(2, 1, 3, 4), _c(2, 1, 3, 4))
    with pytest.raises(ValueError, match=r"^gather_dynamic_cache_: cache.layers\[0\] must be a full-attention layer"):
        gather_dynamic_cache_(cache, _S, _N, _D)


def test_gathered_tree_cache_gives_the_fresh_forward_logits(tiny_llama):
    """A tree step's cache, gathered to each row's accepted path and cropped, gives the
    next-token logits of a fresh forward over the prompt and the accepted tokens.

    The tree's block of the cache is built from two linear forwards instead of one
    tree-masked one: the path's columns come from a forward over prompt + path (each path
    token at position P + depth, attending to the prompt and its ancestors, which is exactly
    what a tree attention mask gives the path's nodes), and decoy columns (the keys and values
    of a forward over prompt + other tokens, standing for the tree's rejected nodes) are
    interleaved around them, the path's columns increasing as a tree's are.  The op must then
    bring each row's first count[b] path columns to the prompt's end; the gathered columns are
    compared bit for bit with the linear forward's, and the logits of one more token after
    them with a fresh forward over prompt + accepted + that token (the cache tests' tolerance,
    decoder_setup.CACHE_ATOL/CACHE_RTOL).  Without the gather the logits differ (the test can
    fail)."""
    from decoder_setup import CACHE_ATOL, CACHE_RTOL

    model, kw = tiny_llama, _kw(tiny_llama)
    g = torch.Generator().manual_seed(1)
    B, P, A, N = 3, 5, 4, 5  # rows, prompt, path length, decoys: a tree block of A + N columns
    prompt = torch.randint(0, 32, (B, P), generator=g)
    path = torch.randint(0, 32, (B, A), generator=g)
    decoys = torch.randint(0, 32, (B, N), generator=g)
    nxt = torch.randint(0, 32, (B, 1), generator=g)
    count = [0, 2, 4]  # ragged: nothing accepted, part of the path, all of it
    where = [[1, 3, 4, 7], [0, 2, 5, 6], [2, 3, 6, 8]]  # the path's places in the tree block

    with torch.no_grad():
        linear = _cache_from(model, [])
        model(input_ids=torch.cat([prompt, path], 1), use_cache=True, **{kw: linear})
        other = _cache_from(model, [])
        model(input_ids=torch.cat([prompt, decoys], 1), use_cache=True, **{kw: other})
    tree = []  # [B, H, P + A + N, D] per layer's keys and values
    for lin, dec in zip(_layer_tensors(linear), _layer_tensors(other)):
        t = torch.cat([lin[:, :, :P], torch.empty_like(lin[:, :, :A]), dec[:, :, P:]], 2)
        for b in range(B):
            cols = [P + w for w in where[b]]
            rest = [P + w for w in range(A + N) if w not in where[b]]
            t[b][:, cols] = lin[b, :, P:]  # [H, A, D]
            t[b][:, rest] = dec[b, :, P:]  # [H, N, D]
        tree.append(t)
    src = _idx([[P + w for w in where[b][: count[b]]] + [-1] * (A - count[b]) for b in range(B)])  # [B, A]
    ungathered = [t.clone() for t in tree]
    cache = _cache_from(model, tree)
    gather_dynamic_cache_(cache, src, _idx(count), _idx([P] * B))

    for b in range(B):
        n = count[b]
        for got, lin in zip(_layer_tensors(cache), _layer_tensors(linear)):
            assert torch.equal(got[b, :, : P + n], lin[b, :, : P + n])
        with torch.no_grad():
            row = _cache_from(model, [t[b : b + 1, :, : P + n].clone() for t in _layer_tensors(cache)])
            got = model(input_ids=nxt[b : b + 1], use_cache=True, **{kw: row}).logits[0, -1]  # [V]
            ids = torch.cat([prompt[b], path[b, :n], nxt[b]])[None]  # [1, P + n + 1]
            want = model(input_ids=ids).logits[0, -1]  # [V]
            torch.testing.assert_close(got, want, atol=CACHE_ATOL, rtol=CACHE_RTOL)
            if n > 0:  # the tree block as it was, cropped: other keys, other logits
                row = _cache_from(model, [t[b : b + 1, :, : P + n].clone() for t in ungathered])
                wrong = model(input_ids=nxt[b : b + 1], use_cache=True, **{kw: row}).logits[0, -1]
                assert (wrong - want).abs().max() > 100 * CACHE_ATOL


# ------------------------------------------------------------------------------------------
# The CUDA kernel's code, run on the CPU (as test_compact_kv_emulated.py does for compact_kv_)
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated():
    """gather_kv_kernel.cuh compiled for the host (a build failure fails the tests that use it)."""
    if not cpp_extension.is_ninja_available():
        pytest.skip("needs ninja to build the emulated kernel with torch.utils.cpp_extension.load (pip install ninja)")
    return cpp_extension.load(
        name="specdec_gather_kv_emulated",
        sources=[str(EMULATED_SOURCE)],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O1"],
        verbose=False,
    )


def _expected_access(caches) -> int:
    """The access width the CUDA op chooses (compact_kv_'s rule): the largest power of two <= 16
    dividing the base address, the byte strides of B, H, T and the row's bytes of every cache."""
    g = 16
    for c in caches:
        if c.numel() == 0:
            continue
        e = c.element_size()
        for x in (c.data_ptr(), c.stride(0) * e, c.stride(1) * e, c.stride(2) * e, c.size(3) * e):
            g = math.gcd(g, x)
    return g


@pytest.mark.slow
@needs_ext
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("block_dim", [GPU_THREADS, 3])
@pytest.mark.parametrize("seed", range(12))
def test_emulated_kernel_matches_reference_and_cpu_op(emulated, seed, block_dim, reverse):
    caches, src, cnt, dst = _random_case(seed)
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    cpu_op = [c.clone() for c in caches]
    torch.ops.specdec.gather_kv_(cpu_op, src, cnt, dst)
    launches = emulated.gather_kv_emulated(caches, src, cnt, dst, block_dim, reverse)
    assert launches == [[_expected_access(caches), len(caches)]]
    for got, want, op in zip(caches, expected, cpu_op):
        assert torch.equal(got, want)  # every element, including untouched positions
        assert torch.equal(got, op)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [1, 3, 6, 64])
def test_emulated_alignments_and_many_layers(emulated, dtype, D):
    # 70 caches: two launches (64 + 6); odd D: 1-, 2-, 4-byte accesses; rows of 24 bytes: 8
    B, T = 3, 12
    shapes = [(1 + i % 3, D) for i in range(70)]
    caches = [c.to(dtype) for c in _make_caches(B, T, shapes, torch.float32, "contiguous", seed=D)]
    src, cnt, dst = _idx([[5, 7, 8, 11], [2, 3, 4, 9], [6, -1, -1, -1]]), _idx([4, 4, 1]), _idx([4, 0, 6])
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    launches = emulated.gather_kv_emulated(caches, src, cnt, dst, GPU_THREADS, False)
    assert launches == [[_expected_access(caches[:64]), 64], [_expected_access(caches[64:]), 6]]
    for got, want in zip(caches, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("block_dim", [GPU_THREADS, 1])
def test_emulated_rows_with_bad_values_are_left_unchanged(emulated, block_dim):
    # The CPU op refuses these values; the kernel cannot read them on the host, so a row that
    # breaks any rule is left as it was, and every other row is moved.
    T = 12
    rows = [  # (src_index[b], count[b], dst_start[b])
        ([5, 7, 8], 3, 5),     # valid
        ([5, 7, 8], 4, 5),     # count > M
        ([5, 7, 8], -1, 5),    # count < 0
        ([5, 7, 8], 2, -1),    # dst_start < 0
        ([10, 11, -1], 2, 11),  # dst_start + count > T (and a source below dst_start)
        ([5, 12, -1], 2, 4),   # a source past the end
        ([-1, 6, -1], 2, 4),   # a negative source
        ([3, 6, 7], 3, 4),     # a source below dst_start
        ([6, 6, 7], 3, 4),     # repeated
        ([8, 7, 9], 3, 4),     # decreasing
        ([4, 6, 10**9], 2, 4),  # valid: the padding past count is never read
    ]
    src = _idx([r[0] for r in rows])
    cnt, dst = _idx([r[1] for r in rows]), _idx([r[2] for r in rows])
    caches = _make_caches(len(rows), T, [(2, 8), (1, 4)], torch.float32, "contiguous")
    expected = [c.clone() for c in caches]
    valid = [0, len(rows) - 1]
    for c in expected:  # the valid rows moved, the others as they were
        moved = c[valid].clone()
        gather_kv_reference([moved], src[valid], cnt[valid], dst[valid])
        c[valid] = moved
    emulated.gather_kv_emulated(caches, src, cnt, dst, block_dim, False)
    assert all(torch.equal(g, w) for g, w in zip(caches, expected))


@pytest.mark.slow
def test_emulated_empty_caches_are_not_launched(emulated):
    caches = _make_caches(2, 12, [(2, 8), (0, 8), (2, 0), (1, 4)], torch.float32, "contiguous")
    src, cnt, dst = _idx([[5, 7, 8], [3, 4, -1]]), _idx([3, 2]), _idx([5, 1])
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    assert emulated.gather_kv_emulated(caches, src, cnt, dst, GPU_THREADS, False) == [[16, 2]]
    assert all(torch.equal(g, w) for g, w in zip(caches, expected))
    assert emulated.gather_kv_emulated(caches[1:3], src, cnt, dst, GPU_THREADS, False) == []
    assert emulated.gather_kv_emulated(caches, src[:0], cnt[:0], dst[:0], GPU_THREADS, False) == []  # B = 0


# ------------------------------------------------------------------------------------------
# CUDA (the same cases on CUDA tensors; index values are never read on the host there)
# ------------------------------------------------------------------------------------------
@needs_cuda
@needs_ext
@pytest.mark.parametrize("seed", range(12))
def test_cuda_op_matches_reference(seed):
    caches, src, cnt, dst = _random_case(seed)
    expected = [c.clone() for c in caches]
    gather_kv_reference(expected, src, cnt, dst)
    gpu = [c.cuda() for c in caches]
    src_c, cnt_c, dst_c = src.cuda(), cnt.cuda(), dst.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the op raises
    try:
        torch.ops.specdec.gather_kv_(gpu, src_c, cnt_c, dst_c)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(gpu, expected):
        assert torch.equal(got.cpu(), want)


@needs_cuda
@needs_ext
def test_cuda_rows_with_bad_values_are_left_unchanged():
    src = _idx([[5, 7, 8], [5, 12, -1], [8, 7, 9], [3, 6, 7]])
    cnt, dst = _idx([3, 2, 3, 3]), _idx([5, 4, 4, 4])
    caches = _make_caches(4, 12, [(2, 8)], torch.float32, "contiguous", device="cuda")
    expected = [c.cpu() for c in caches]
    moved = expected[0][:1].clone()
    gather_kv_reference([moved], src[:1], cnt[:1], dst[:1])
    expected[0][:1] = moved
    torch.ops.specdec.gather_kv_(caches, src.cuda(), cnt.cuda(), dst.cuda())
    assert torch.equal(caches[0].cpu(), expected[0])


@needs_cuda
@needs_ext
def test_cuda_opcheck():
    caches, src, cnt, dst = _random_case(3)
    torch.library.opcheck(
        torch.ops.specdec.gather_kv_.default, ([c.cuda() for c in caches], src.cuda(), cnt.cuda(), dst.cuda())
    )
