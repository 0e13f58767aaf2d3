"""Tests of specdec::fp16_exact_copy and specdec::fp16_copy_matches (csrc/fp16_copy.cpp): the one-pass
preparation of skinny_linear's fp16 weights.  Their verdicts are compared with torch's own
(``torch.equal(w.half().float(), w)``) and with the pure-PyTorch references, on the values where
fp16 is exact and those where it is not, at every place an inexact value can sit (the first block,
a later one, the last, the tail past the last 8 values), on one thread and two.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.ops.linear import fp16_copy_matches, fp16_exact_copy, fp16_exact_copy_into
from specdec_kernels.ops.linear.reference import fp16_copy_matches_reference, fp16_exact_copy_reference

needs_ext = pytest.mark.skipif(not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e .")

BLOCK = 1 << 16  # the kernel's block (kBlock), the unit of its early exit and of its split over threads

# fp16 holds these exactly: zeros of both signs, infinities, the largest finite value, the smallest
# subnormal and normal, a subnormal's negative
EXACT = [0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14,
         3 * 2.0**-24, 1023.5]
# and not these: NaN (never equal to itself), just past fp16's range (rounds to inf), between two fp16
# values, fp32 subnormals (fp16 flushes them to 0), half the smallest fp16 subnormal, 2049 (11 bits past
# the leading one)
INEXACT = [float("nan"), 65520.0, 65505.0, -65520.0, 1 / 3, 1e-40, -1e-45, 2.0**-25, 2049.0, 1 + 2.0**-11]


def _into(op):
    """An ``*_into`` form as (w16, exact) like the others; ``out`` starts as garbage (NaN bits)."""
    def run(w):
        out = torch.full(w.shape, float("nan"), dtype=torch.float16)
        return out, torch.tensor(op(w, out))
    return run


def _ops():
    out = [("reference", fp16_exact_copy_reference), ("wrapper_into", _into(fp16_exact_copy_into))]
    if HAS_EXT:
        out += [("native", torch.ops.specdec.fp16_exact_copy), ("portable", torch.ops.specdec.fp16_exact_copy_portable),
                ("native_into", _into(lambda w, o: bool(torch.ops.specdec.fp16_exact_copy_into(w, o))))]
    return out


@pytest.mark.parametrize("name,op", _ops())
@pytest.mark.parametrize("bad", [None] + INEXACT)
def test_the_verdict_is_torchs(name, op, bad):
    w = torch.tensor(EXACT + ([] if bad is None else [bad]), dtype=torch.float32)
    w16, exact = op(w)
    assert exact.dtype == torch.bool and exact.shape == ()
    assert bool(exact) == torch.equal(w.half().float(), w) == (bad is None)
    if bad is None:  # the copy is w.half(), bit for bit, -0.0 included
        assert torch.equal(w16.view(torch.int16), w.half().view(torch.int16))


@pytest.mark.parametrize("name,op", _ops())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, BLOCK - 1, BLOCK, BLOCK + 9, 3 * BLOCK + 5])
def test_an_inexact_value_anywhere_is_found(name, op, threads, n):
    """Every position class: the first value, the last 8-value group, the tail after it, each
    block's start and end; the copy equals w.half() whenever the verdict is yes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n)
        w = torch.randn(n, generator=g).half().float()
        w16, exact = op(w)
        assert bool(exact) and torch.equal(w16.view(torch.int16), w.half().view(torch.int16))
        places = {0, n - 1, n // 2, max(n - 9, 0), (n // 8) * 8 - 1}
        places |= {p for b in range(0, n, BLOCK) for p in (b, min(b + BLOCK, n) - 1)}
        for p in sorted(q for q in places if 0 <= q < n):
            for bad in (1 / 3, float("nan"), 1e-40):
                v = w.clone()
                v[p] = bad
                assert not bool(op(v)[1]), (p, bad)
    finally:
        torch.set_num_threads(before)


@needs_ext
def test_shapes_and_strides():
    """Any shape; a non-contiguous weight is read in its logical order; a copy large enough for the
    2 MiB-page hint (csrc/fp16_copy.cpp, new_copy) is still w.half()."""
    g = torch.Generator().manual_seed(0)
    for w in (torch.randn(3, 4, 5, generator=g), torch.randn(64, 48, generator=g).T,
              torch.randn(1536, 2304, generator=g), torch.empty(0, 7), torch.tensor(2.0)):
        w = w.half().float() if w.is_contiguous() else w.contiguous().half().float().T.contiguous().T
        w16, exact = torch.ops.specdec.fp16_exact_copy(w)
        assert bool(exact) and w16.shape == w.shape and torch.equal(w16, w.half())
        assert bool(torch.ops.specdec.fp16_copy_matches(w, w16))


@needs_ext
def test_flushing_subnormals_does_not_make_them_exact():
    """With denormals flushed to zero on the calling thread a compare of values would find 1e-40
    equal to the 0 fp16 makes of it; the kernel compares bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    w = torch.tensor([1.0] * 15 + [1e-40])  # made before: flushing also flushes the conversion from Python's float
    assert w[15].view(torch.int32).item() != 0
    assert torch.set_flush_denormal(True) or pytest.skip("this CPU cannot flush denormals")
    try:
        assert w[15] == 0  # flushed on this thread: a compare of values calls the subnormal 0
        assert not bool(torch.ops.specdec.fp16_exact_copy(w)[1])
        assert not bool(torch.ops.specdec.fp16_exact_copy_portable(w)[1])
        assert not bool(torch.ops.specdec.fp16_copy_matches(w, torch.zeros(16, dtype=torch.float16)))
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)


@pytest.mark.parametrize("impl", ["wrapper", "reference"])
def test_copy_matches_sees_any_change(impl):
    match = fp16_copy_matches if impl == "wrapper" else (lambda a, b: bool(fp16_copy_matches_reference(a, b)))
    n = 2 * BLOCK + 11
    w = torch.randn(n, generator=torch.Generator().manual_seed(1)).half().float()
    w16 = w.half()
    assert match(w, w16)
    assert not match(w.view(1, n), w16)  # another shape
    for p in (0, BLOCK, n - 1, n - 5):
        for new in (w[p].item() * 2 + 1, -w[p].item() if w[p] != 0 else 1.0, float("nan")):
            v = w.clone()
            v[p] = new
            assert not match(v, w16), (p, new)
    zero = torch.zeros(16)
    assert match(zero, zero.half()) and not match(zero.neg(), zero.half())  # -0.0 is another weight's bits


def test_wrappers():
    w = torch.randn(5, 9).half().float()
    w16 = fp16_exact_copy(w)
    assert w16 is not None and torch.equal(w16, w.half()) and fp16_copy_matches(w, w16)
    assert fp16_exact_copy(w + 1e-3) is None
    with pytest.raises(ValueError,
                       match=r"^fp16_exact_copy: w must be a float32 CPU tensor, got torch.float16 on cpu$"):
        fp16_exact_copy(w16)
    with pytest.raises(TypeError, match=r"^fp16_exact_copy: w must be a tensor, got list$"):
        fp16_exact_copy([1.0])
    with pytest.raises(ValueError, match=r"^fp16_copy_matches: w16 must be a float16 CPU tensor$"):
        fp16_copy_matches(w, w)
    with pytest.raises(ValueError, match=r"^fp16_exact_copy_into: out must be a float16 CPU tensor, "
                                         r"got torch.float32 on cpu$"):
        fp16_exact_copy_into(w, w)
    with pytest.raises(ValueError, match=r"out must be contiguous with w's shape \(5, 9\), got \(9, 5\)"):
        fp16_exact_copy_into(w, w16.T.contiguous())
    with pytest.raises(ValueError, match=r"out must be contiguous with w's shape \(5, 9\), "
                                         r"got \(5, 9\) \(contiguous: False\)"):
        fp16_exact_copy_into(w, w16.T.contiguous().T)


@needs_ext
def test_cpp_checks_too():
    with pytest.raises(RuntimeError, match="fp16_exact_copy: w must be float32, got Half"):
        torch.ops.specdec.fp16_exact_copy(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="fp16_copy_matches: w16 must be float16, got Float"):
        torch.ops.specdec.fp16_copy_matches(torch.zeros(3), torch.zeros(3))
    with pytest.raises(RuntimeError, match="fp16_exact_copy_into: out must have w's shape"):
        torch.ops.specdec.fp16_exact_copy_into(torch.zeros(3), torch.zeros(4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="fp16_exact_copy_into: out must be contiguous"):
        torch.ops.specdec.fp16_exact_copy_into(torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float16).T)


@needs_ext
@pytest.mark.parametrize("op", ["fp16_exact_copy", "fp16_exact_copy_portable"])
def test_opcheck(op):
    w = torch.randn(33, 17).half().float()
    torch.library.opcheck(getattr(torch.ops.specdec, op).default, (w,))
    torch.library.opcheck(torch.ops.specdec.fp16_copy_matches.default, (w, w.half()))
    torch.library.opcheck(torch.ops.specdec.fp16_exact_copy_into.default, (w, torch.empty(33, 17, dtype=torch.float16)))
