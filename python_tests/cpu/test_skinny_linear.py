"""Tests of specdec::skinny_linear (csrc/skinny_linear.cpp) and ``use_skinny_linear``.

The kernel sums in fp32 in its own fixed order, so it is compared with the float64 reference
(``reference.skinny_linear_reference``) under the standard floating-point summation bound
(stated in ``_bound``), and *bit for bit* with itself where it promises batch invariance:
a row alone vs. inside any batch, 1 thread vs. 2, each SIMD path (AVX2, AVX-512) vs. the portable
C++ path.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.ops.reference import skinny_linear_reference

pytestmark = pytest.mark.skipif(
    not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e ."
)

if HAS_EXT:
    from specdec_kernels.cpu.skinny_linear import skinny_linear, use_skinny_linear

U32 = 2.0**-24  # fp32 unit roundoff


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """|kernel - exact| <= (n + 2) * u * (|x| @ |w|.T + |b|) + u * |exact|, with n the longest
    chain of roundings one output sees: K/16 fused multiply-adds per lane, 4 levels of the lane
    reduction, K % 16 tail FMAs, the bias add, then the float64 reference's own final rounding.
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1.)"""
    k = w.shape[1]
    n = k // 16 + 4 + k % 16 + 1
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        mag = mag + b.double().abs()
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    return (n + 2) * U32 * mag + U32 * exact.abs()


def _case(m, n, k, bias, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    shape = (*(lead or (m,)), k)
    x = torch.randn(shape, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


ROWS = [1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 25]
COLS = [1, 2, 3, 4, 5, 7, 49, 576]
DEPTH = [1, 7, 15, 16, 17, 33, 576, 1537]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", COLS)
@pytest.mark.parametrize("k", DEPTH)
def test_matches_float64_reference_within_bound(m, n, k):
    x, w, b = _case(m, n, k, bias=(m + n + k) % 2 == 0, seed=m * 1000 + n * 10 + k)
    y = skinny_linear(x, w, b)
    ref = skinny_linear_reference(x, w, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    err = (y.double() - x.double() @ w.double().T - (b.double() if b is not None else 0)).abs()
    bound = _bound(x, w, b)
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"
    # and the reference itself is the exact product rounded once
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * (k**0.5))


@pytest.mark.parametrize("m", [2, 3, 5, 6, 7, 12, 13, 16, 25])
@pytest.mark.parametrize("k", [9, 576])
def test_batch_invariant_bitwise(m, k):
    """Row i of a batch equals, bit for bit, row i computed alone or in any sub-batch."""
    x, w, b = _case(m, 577, k, bias=True, seed=m + k)
    y = skinny_linear(x, w, b)
    for i in range(m):
        assert torch.equal(y[i : i + 1], skinny_linear(x[i : i + 1], w, b)), f"row {i}"
    for lo, hi in [(0, m // 2), (m // 3, m)]:
        if hi > lo:
            assert torch.equal(y[lo:hi], skinny_linear(x[lo:hi].clone(), w, b))


def test_thread_count_and_portable_path_give_same_bits():
    x, w, b = _case(7, 4099, 576, bias=True, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = skinny_linear(x, w, b)
        torch.set_num_threads(2)
        y2 = skinny_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)
    yp = torch.ops.specdec.skinny_linear_portable(x, w, b)
    assert torch.equal(y1, yp)


def test_the_extension_runs_on_torchs_threads():
    """``at::parallel_for`` is a header template: compiled without the OpenMP that torch's
    threads use, it runs everything on the calling thread, and the kernels ignored
    ``torch.set_num_threads`` (as they did until setup.py passed -fopenmp)."""
    assert torch.ops.specdec.intra_op_parallel(), (
        "specdec_kernels.ops._C was built without torch's intra-op parallelism (at::parallel_for is "
        f"serial); torch: {torch.__config__.parallel_info().splitlines()[-1]}")


@pytest.mark.parametrize("isa", ["avx2", "avx2_1row", "avx512"])
def test_every_simd_path_gives_the_portable_bits(isa):
    """Each SIMD path (forced through skinny_linear_isa) equals the portable C++ path bit for bit,
    fp32, fp16 and int8 weights, over row counts on both sides of the AVX-512 switch (7 rows), of the
    AVX2 path's passes of 6 rows and the AVX-512 path's of 12, of the fp16 tiles of 4 and 2
    weight rows (M = 1, M = 2-6; ``avx2_1row`` forces one-row tiles), odd numbers of weight rows
    (the AVX-512 path pairs them) and every K tail (K % 16)."""
    from specdec_kernels.cpu.skinny_linear import supported_isas

    if isa.split("_")[0] not in supported_isas():  # avx2_1row: the AVX2 path, one-row fp16 tiles
        with pytest.raises(RuntimeError, match=f"isa '{isa}' is not supported by this CPU"):
            torch.ops.specdec.skinny_linear_isa(torch.ones(1, 8), torch.ones(1, 8), None, isa)
        pytest.skip(f"this CPU has no {isa} path (it has: {supported_isas()}); refusal checked")
    op = torch.ops.specdec.skinny_linear_isa
    g = torch.Generator().manual_seed(11)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 25, 33):
        for n in (1, 2, 3, 577):
            for k in (1, 7, 8, 9, 15, 16, 17, 24, 31, 45, 576):
                x = torch.randn(m, k, generator=g)
                w = torch.randn(n, k, generator=g)
                b = torch.randn(n, generator=g) if (m + n) % 2 else None
                w8 = (w * 40).round().clamp(-127, 127).to(torch.int8)
                for weight in (w, w.half(), w8):
                    want = op(x, weight, b, "portable")
                    assert torch.equal(op(x, weight, b, isa), want), (m, n, k, weight.dtype)
                    assert torch.equal(op(x, weight, b, "auto"), want), (m, n, k, weight.dtype)


def test_isa_names_are_checked():
    x, w, b = _case(2, 3, 8, bias=False)
    with pytest.raises(RuntimeError, match="isa must be 'auto', 'portable', 'avx2', 'avx2_1row' or 'avx512', "
                                           "got 'sse'"):
        torch.ops.specdec.skinny_linear_isa(x, w, b, "sse")
    assert torch.equal(torch.ops.specdec.skinny_linear_isa(x, w, b, "portable"),
                       torch.ops.specdec.skinny_linear_portable(x, w, b))


def test_opcheck_isa():
    x, w, b = _case(10, 17, 24, bias=True)
    torch.library.opcheck(torch.ops.specdec.skinny_linear_isa.default, (x, w, b, "auto"))


def test_leading_dims_and_non_contiguous_inputs():
    x, w, b = _case(0, 33, 20, bias=True, lead=(2, 3))
    y = skinny_linear(x, w, b)
    assert y.shape == (2, 3, 33)
    assert torch.equal(y.reshape(6, 33), skinny_linear(x.reshape(6, 20), w, b))
    xt = torch.randn(20, 5).t()  # [5, 20], not contiguous
    wt = torch.randn(20, 33).t()  # [33, 20], not contiguous
    assert torch.equal(skinny_linear(xt, wt, b), skinny_linear(xt.contiguous(), wt.contiguous(), b))


def test_empty_shapes():
    assert skinny_linear(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert skinny_linear(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    b = torch.randn(4)
    y = skinny_linear(torch.randn(3, 0), torch.randn(4, 0), b)  # empty sum: the bias
    assert torch.equal(y, b.expand(3, 4))


def test_nan_and_inf_stay_in_their_row():
    x, w, b = _case(5, 64, 40, bias=False, seed=9)
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    y = skinny_linear(x, w, b)
    assert bool(y[1].isnan().all())
    assert not bool(y[3].isfinite().any())
    for i in (0, 2, 4):
        assert bool(y[i].isfinite().all())
        assert torch.equal(y[i : i + 1], skinny_linear(x[i : i + 1], w, b))


def test_nan_results_have_the_same_bits_on_every_path():
    """A NaN result is the one quiet NaN (0x7fc00000) whatever the path, the row count and the
    NaN's sign and payload in x, the weight or the bias (x86 FMAs pass on one operand's NaN, which
    one depending on the tile's instruction forms: the bits differed across row counts and paths
    before)."""
    from specdec_kernels.cpu.skinny_linear import supported_isas

    op = torch.ops.specdec.skinny_linear_isa
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    payload = lambda bits: torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]  # noqa: E731
    for m in (1, 3, 6, 7, 12, 13):
        x = torch.randn(m, 40, generator=torch.Generator().manual_seed(m))
        w = torch.randn(5, 40, generator=torch.Generator().manual_seed(99))
        b = torch.randn(5)
        x[0, 3] = payload(-0x00400000)  # -NaN (0xffc00000)
        w[1, 7] = payload(0x7FC01234)  # a NaN with a payload
        b[2] = payload(0x7FC0BEEF)
        for isa in ["portable", *supported_isas()]:
            for weight in (w, w.half()):
                y = op(x, weight, b, isa)
                nan = y.isnan()
                assert nan[0].all() and nan[:, 1].all() and nan[:, 2].all(), (m, isa)
                assert torch.equal(y[nan].view(torch.int32), quiet.view(torch.int32).expand(int(nan.sum()))), (m, isa)
                assert torch.equal(y[~nan], op(x, weight, b, "portable")[~nan])


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(2, 8, dtype=torch.float64), torch.randn(3, 8), None), "x must be float32"),
        ((torch.randn(2, 8), torch.randn(3, 8).bfloat16(), None), "weight must be float32, float16 or int8"),
        ((torch.randn(2, 8), torch.randn(3, 7), None), r"K = weight.shape\[1\] = 7, got shape \[2, 8\]"),
        ((torch.randn(2, 8), torch.randn(3, 8, 1), None), "weight must have 2 dims"),
        ((torch.randn(2, 8), torch.randn(3, 8), torch.randn(4)), r"bias must be \[N\] = \[3\], got \[4\]"),
        ((torch.randn(2, 8, device="meta"), torch.randn(3, 8), None), "x must be a CPU tensor"),
    ],
)
def test_bad_input_names_the_tensor(args, match):
    with pytest.raises(ValueError, match=match):
        skinny_linear(*args)


def test_cpp_checks_too():
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.specdec.skinny_linear(torch.randn(2, 8).double(), torch.randn(3, 8), None)
    with pytest.raises(RuntimeError, match=r"K = weight.size\(1\) = 7"):
        torch.ops.specdec.skinny_linear(torch.randn(2, 8), torch.randn(3, 7), None)


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(bias):
    x, w, b = _case(5, 17, 24, bias=bias)
    torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, w, b))


def test_torch_compile_fullgraph_matches_eager():
    x, w, b = _case(4, 33, 24, bias=True)

    def f(x, w, b):
        return torch.ops.specdec.skinny_linear(x, w, b) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, w, b), f(x, w, b))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 13])
@pytest.mark.parametrize("k", [9, 576])
def test_fp16_weights_give_the_fp32_bits_when_exact(m, k):
    """fp16 weights are widened exactly, so on fp16-representable weights the result is the fp32
    kernel's, bit for bit; on other weights it is the fp32 kernel on the rounded weights."""
    x, w, b = _case(m, 67, k, bias=True, seed=m * k)
    w_exact = w.half().float()
    assert torch.equal(skinny_linear(x, w.half(), b), skinny_linear(x, w_exact, b))
    assert torch.equal(torch.ops.specdec.skinny_linear_portable(x, w.half(), b), skinny_linear(x, w_exact, b))
    err = (skinny_linear(x, w.half(), b).double() - x.double() @ w_exact.double().T - b.double()).abs()
    assert bool((err <= _bound(x, w_exact, b)).all())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 13])
@pytest.mark.parametrize("k", [9, 576])
def test_int8_weights_give_the_fp32_bits_of_their_values(m, k):
    """int8 weights are widened exactly too: the result is the fp32 kernel's on the same integer
    values (every path, so batch-invariant as well), within the fp32 bound of the float64 sum;
    no scale is applied (the feature draft's int8 output layer scales afterwards)."""
    x, w, b = _case(m, 67, k, bias=True, seed=m * k + 1)
    w8 = (w * 60).round().clamp(-127, 127).to(torch.int8)
    want = skinny_linear(x, w8.float(), b)
    assert torch.equal(skinny_linear(x, w8, b), want)
    assert torch.equal(torch.ops.specdec.skinny_linear_portable(x, w8, b), want)
    assert torch.equal(skinny_linear(x[:1], w8, b), want[:1])
    err = (skinny_linear(x, w8, b).double() - x.double() @ w8.double().T - b.double()).abs()
    assert bool((err <= _bound(x, w8.float(), b)).all())
    torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, w8, b))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 7, bias=False)
        self.c = nn.Linear(24, 3).double()  # not fp32: left alone

    def forward(self, x):
        return self.b(torch.relu(self.a(x))), self.c(x.double())


def test_use_skinny_linear_patches_counts_and_restores():
    torch.manual_seed(0)
    m = _Tiny()
    x = torch.randn(2, 3, 24)  # 6 rows
    with torch.no_grad():
        y0, z0 = m(x)
        with use_skinny_linear(m, max_rows=8) as h:
            assert len(h.modules) == 2  # the fp64 layer is skipped
            y1, z1 = m(x)
            assert h.calls == 2
            big = torch.randn(9, 24)  # 9 rows > max_rows: torch's linear
            yb, _ = m(big)
            assert h.calls == 2
            assert torch.equal(yb, m.b(torch.relu(F.linear(big, m.a.weight, m.a.bias))))
        y2, _ = m(x)
    assert torch.allclose(y1, y0, rtol=1e-5, atol=1e-5)
    assert torch.equal(z1, z0)
    assert torch.equal(y2, y0)  # restored: torch's linear again, same bits as before
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_default_max_rows_follows_the_cpu():
    """Without max_rows the kernel takes inputs of up to default_max_rows() rows: 24 where its
    AVX-512 path runs (which beats torch's SGEMM up to there), 16 elsewhere."""
    from specdec_kernels.cpu.skinny_linear import AVX512_MAX_ROWS, DEFAULT_MAX_ROWS, default_max_rows, supported_isas

    # torch's own reading of the CPU, independent of ours: what it can run, we must offer
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        assert "avx2" in supported_isas(), (cap, supported_isas())
    if cap == "AVX512":
        assert "avx512" in supported_isas(), (cap, supported_isas())
    want = AVX512_MAX_ROWS if "avx512" in supported_isas() else DEFAULT_MAX_ROWS
    assert default_max_rows() == want
    m = _Tiny()
    with torch.no_grad(), use_skinny_linear(m) as h:
        assert h.max_rows == want
        m(torch.randn(want, 24))
        assert h.calls == 2
        m(torch.randn(want + 1, 24))
        assert h.calls == 2


def test_use_skinny_linear_streams_exact_fp16_weights():
    torch.manual_seed(1)
    m = _Tiny()
    with torch.no_grad():
        m.a.weight.copy_(m.a.weight.half().float())  # exactly representable: streamed as fp16
    x = torch.randn(5, 24)
    with torch.no_grad():
        with use_skinny_linear(m, fp16_weights=False) as h32:
            y32, _ = m(x)
            assert h32.fp16 == []
        with use_skinny_linear(m) as h16:
            assert h16.fp16 == [m.a]  # m.b's random fp32 weights are not fp16-exact
            y16, _ = m(x)
            assert h16.calls == 2
        with torch.no_grad():
            m.a.weight.add_(1e-4)  # changed in place: the cached copy is no longer used
        with use_skinny_linear(m) as h:
            assert h.fp16 == []
    assert torch.equal(y16, y32)


def test_use_skinny_linear_int8_weights():
    """int8_weights (a draft's layers only): each layer's output is the kernel over its per-row
    int8 copy times the row scales (+ bias), exactly; within half a quantisation step of the
    fp32 layer (|y - y32| <= sum_k |x_k| * scale_j / 2 + fp32 rounding); row-invariant; the copy
    is cached until the weight changes; a layer with a non-finite weight keeps fp32; leaving the
    block restores the layers."""
    from specdec_kernels.cpu.skinny_linear import int8_copy

    torch.manual_seed(3)
    m = _Tiny()
    x = torch.randn(6, 24)
    with torch.no_grad():
        want32, _ = m(x)
        with use_skinny_linear(m, int8_weights=True) as h:
            assert h.int8 == [m.a, m.b] and h.fp16 == []
            y = m.a(x)
            assert h.calls == 1
            got, _ = m(x)
            y1 = m.a(x[2:3])
        w8, scale = int8_copy(m.a)
        assert w8.dtype == torch.int8 and int(w8.abs().max()) == 127
        assert torch.equal(y, torch.ops.specdec.skinny_linear(x, w8, None) * scale + m.a.bias)
        assert torch.equal(y1, y[2:3])
        bound = x.abs().sum(-1, keepdim=True) * scale / 2 + 1e-5 * (1 + y.abs())
        assert bool(((y - F.linear(x, m.a.weight, m.a.bias)).abs() <= bound).all())
        assert (got - want32).abs().max() > 0  # an approximation, not the fp32 layer
        assert int8_copy(m.a)[0] is w8  # cached
        m.a.weight.add_(1e-3)
        assert int8_copy(m.a)[0] is not w8  # re-made after an in-place change
        m.b.weight[0, 0] = float("nan")
        with use_skinny_linear(m, int8_weights=True) as h:
            assert h.int8 == [m.a]
    assert "forward" not in m.a.__dict__ and "forward" not in m.b.__dict__


def test_use_skinny_linear_takes_inference_tensors():
    """Weights made under inference mode (a model loaded there) have no version counter: the fp16
    copy is then re-checked on every patch instead of cached, and a later in-place change (in
    inference mode) is seen."""
    torch.manual_seed(2)
    with torch.inference_mode():
        m = _Tiny()
        assert m.a.weight.is_inference()
        m.a.weight.copy_(m.a.weight.half().float())
        x = torch.randn(5, 24)
        with use_skinny_linear(m, fp16_weights=False):
            want, _ = m(x)
        for _ in range(2):
            with use_skinny_linear(m) as h:
                assert h.fp16 == [m.a]
                got, _ = m(x)
            assert torch.equal(got, want)
        m.a.weight.add_(1e-4)  # no version counter to see this: the check is redone
        with use_skinny_linear(m) as h:
            assert h.fp16 == []


def test_use_skinny_linear_keeps_autograd_path():
    m = _Tiny()
    x = torch.randn(3, 24, requires_grad=True)
    with use_skinny_linear(m) as h:
        y, _ = m(x)
        y.sum().backward()
        assert h.calls == 0
    assert x.grad is not None


def test_skinny_linear_has_no_silent_backward():
    # (before: an output that required grad gave x and weight no gradient, silently)
    x = torch.randn(3, 20, requires_grad=True)
    y = torch.ops.specdec.skinny_linear(x, torch.randn(5, 20), None)
    with pytest.raises(RuntimeError, match="derivative for specdec::skinny_linear is not implemented"):
        y.sum().backward()
    with torch.no_grad():
        assert not torch.ops.specdec.skinny_linear(x, torch.randn(5, 20), None).requires_grad


def test_skinny_linear_empty_sum_gives_the_canonical_nan():
    # K = 0: y = bias, whose NaN is written as 0x7fc00000 like every other NaN result
    nan = torch.tensor([0xFFC00001 - 2**32], dtype=torch.int32).view(torch.float32)
    for isa in ["portable", "auto"]:
        y = torch.ops.specdec.skinny_linear_isa(torch.zeros(2, 0), torch.zeros(1, 0), nan, isa)
        assert (y.view(torch.int32) == 0x7FC00000).all()


def test_use_skinny_linear_bad_max_rows():
    with pytest.raises(ValueError, match="max_rows must be an int >= 1, got 0"):
        use_skinny_linear(_Tiny(), max_rows=0)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        use_skinny_linear({})
    with pytest.raises(TypeError, match="int8_weights must be a bool, got str"):
        use_skinny_linear(_Tiny(), int8_weights="yes")
    with pytest.raises(TypeError, match="fp16_weights must be a bool, got int"):
        use_skinny_linear(_Tiny(), fp16_weights=1)


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def test_auto_takes_avx512_from_the_row_count_of_the_cpus_maker():
    """"auto" takes the AVX-512 path from 7 rows, and from 1 on an Intel core (measured faster there
    at every row count: csrc/skinny_linear.cpp, min_rows_avx512); the AVX2 path below that where
    the CPU has it, else the portable one.  The vendor is read here from /proc/cpuinfo, apart from
    the kernel's own CPUID check; and whatever path auto takes, its bits are the portable path's."""
    from specdec_kernels.cpu.skinny_linear import auto_isa, supported_isas

    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the CPU's vendor is read from /proc/cpuinfo (Linux)")
    intel = _cpu_vendor() == "GenuineIntel"
    for rows in range(1, 20):
        if "avx512" in supported_isas() and (rows >= 7 or intel):
            want = "avx512"
        else:
            want = "avx2" if "avx2" in supported_isas() else "portable"
        assert auto_isa(rows) == want, (rows, _cpu_vendor(), supported_isas())
        g = torch.Generator().manual_seed(rows)
        x, w = torch.randn(rows, 45, generator=g), torch.randn(33, 45, generator=g)
        assert torch.equal(torch.ops.specdec.skinny_linear(x, w), torch.ops.specdec.skinny_linear_portable(x, w))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"rows must be an int >= 1, got {bad!r}"):
            auto_isa(bad)
