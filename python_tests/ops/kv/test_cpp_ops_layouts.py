"""The C++ ops where the suite had not looked (mutation testing of csrc/, 2026-12-02: 12 of 52
mutants survived, 5 of them harmful): the CUDA kernel body's access width for every address
(rows of 24 bytes: the 8-byte path; a base one element past an aligned address; a cache cropped
on its last dim), no silent backward through any skinny_linear variant, and opcheck for the
portable and per-ISA variants."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.ops.reference import compact_kv_reference

from test_compact_kv_emulated import GPU_THREADS, _expected_access, emulated  # noqa: F401  (fixture)
from test_kv_cache import _idx, _indices

pytestmark = pytest.mark.skipif(not HAS_EXT, reason="needs the C++ extension")


def _layouts(dtype, device="cpu"):
    """Caches whose access width is 8 (rows of 24 bytes), 4 only because of the base address
    (a view one element into its buffer) or only because of the row's bytes (a cache cropped on
    its last dim: D = 5 of 8, so stride_t = 32 but rows are 20 bytes).  The buffers are moved to
    ``device`` before the views are taken, so the layouts hold there too."""
    g = torch.Generator().manual_seed(0)
    B, H, T = 3, 2, 12
    e = torch.tensor([], dtype=dtype).element_size()
    D8 = 24 // e  # row of 24 bytes: gcd with 16 is 8
    eight = torch.randn(B, H, T, D8, generator=g).to(device, dtype)
    D = 64 // e  # 64-byte rows, every stride a multiple of 16 ...
    flat = torch.randn(B * H * T * D + 1, generator=g).to(device, dtype)
    shifted = flat[1:].view(B, H, T, D)  # ... but the base is e bytes past an aligned address
    cropped_d = torch.randn(B, H, T, 32 // e, generator=g).to(device, dtype)[..., : 20 // e]
    return {"row24": [eight], "base_offset": [shifted], "cropped_last_dim": [cropped_d]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["row24", "base_offset", "cropped_last_dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_dim", [GPU_THREADS, 3])
def test_emulated_kernel_access_width_follows_every_address(emulated, layout, dtype, block_dim):  # noqa: F811
    caches = _layouts(dtype)[layout]
    src_start, dst, cnt = _indices("mixed", 3)
    expected = [c.clone() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    cpu_op = [c.clone() for c in caches]
    torch.ops.specdec.compact_kv_(cpu_op, src_start, _idx(dst), _idx(cnt))
    want_width = {"row24": 8, "base_offset": caches[0].element_size(), "cropped_last_dim": 4}[layout]
    assert _expected_access(caches) == want_width
    launches = emulated.compact_kv_emulated(caches, src_start, _idx(dst), _idx(cnt), block_dim, False)
    assert launches == [[want_width, 1]]
    for got, want, op in zip(caches, expected, cpu_op):
        assert torch.equal(got, want)
        assert torch.equal(op, want)


@pytest.mark.parametrize("op", ["skinny_linear", "skinny_linear_portable", "skinny_linear_isa"])
def test_every_skinny_linear_variant_has_no_silent_backward(op):
    x = torch.randn(3, 20, requires_grad=True)
    args = (x, torch.randn(5, 20), None) + (("auto",) if op == "skinny_linear_isa" else ())
    y = getattr(torch.ops.specdec, op)(*args)
    with pytest.raises(RuntimeError, match=f"derivative for specdec::{op} is not implemented"):
        y.sum().backward()


@pytest.mark.parametrize("op", ["skinny_linear_portable", "skinny_linear_isa"])
@pytest.mark.parametrize("grad", [False, True])
def test_opcheck_every_skinny_linear_variant(op, grad):
    # (skinny_linear_portable had no opcheck; skinny_linear_isa only without grad; with inputs
    # that require grad opcheck also checks the Autograd registration)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 24, generator=g), torch.randn(17, 24, generator=g), torch.randn(17, generator=g)
    x.requires_grad_(grad)
    args = (x, w, b) + (("portable",) if op == "skinny_linear_isa" else ())
    # (no derivative by design: with grad, skip the AOT test, which runs a backward)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") if grad else None
    kwargs = {"test_utils": utils} if utils else {}
    torch.library.opcheck(getattr(torch.ops.specdec, op).default, args, **kwargs)


def test_import_specdec_kernels_registers_every_fake():
    """A plain ``import specdec_kernels`` registers the fakes of every op (the skinny_linear
    ones lived in cpu_linear, which nothing imported: FakeTensorMode and torch.compile failed on
    them in a fresh process before)."""
    import subprocess
    import sys

    code = ("import torch, specdec_kernels\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    x, w = torch.empty(2, 8), torch.empty(4, 8)\n"
            "    for op in ('skinny_linear', 'skinny_linear_portable'):\n"
            "        assert getattr(torch.ops.specdec, op)(x, w, None).shape == (2, 4)\n"
            "    assert torch.ops.specdec.skinny_linear_isa(x, w, None, 'auto').shape == (2, 4)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the CUDA op on the layouts above")
@pytest.mark.parametrize("layout", ["row24", "base_offset", "cropped_last_dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_op_on_every_address_layout(layout, dtype):
    caches = _layouts(dtype, "cuda")[layout]
    src_start, dst, cnt = _indices("mixed", 3)
    expected = [c.cpu() for c in caches]
    compact_kv_reference(expected, src_start, _idx(dst), _idx(cnt))
    torch.ops.specdec.compact_kv_(caches, src_start, _idx(dst).cuda(), _idx(cnt).cuda())
    for got, want in zip(caches, expected):
        assert torch.equal(got.cpu(), want)
