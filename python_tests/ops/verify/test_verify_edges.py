"""Edge cases of fused_verify's decisions, each on both backends (the Triton kernel: compiled on a
GPU, interpreted on CPU tensors here; the torch path on the CPU) and against the reference where
it applies.  Mutation testing (2026-12-01) of the torch routes and the reference: each test
kills a mutant that the other verify tests let through (top-p's strict boundary and its mass over
the top-k set, the fallback to p when the residual is zero, q unread past a row's K_b, a negative
or subnormal temperature beside greedy rows, top_p = 1 as off, q = 0 past the draft vocabulary,
the inverse CDF's fallback, top-k's ties)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import HAS_CUDA
from specdec_kernels import fused_verify
from specdec_kernels.ops.reference import verify_reference

KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# the kernel, interpreted on a CPU: slow
BACKENDS = [pytest.param("triton", KERNEL_DEVICE, marks=pytest.mark.slow), ("torch", "cpu")]

U_GRID = [0.0, 0.1, 0.25, 0.4999, 0.5, 0.6, 0.75, 0.9, 1 - 2**-24]


def _verify(backend, dev, logits, x, q=None, **kw):
    """fused_verify on ``backend`` with every tensor on ``dev``; the outputs back on the CPU."""
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = fused_verify(logits.to(dev), x.to(dev), None if q is None else q.to(dev), backend=backend, **kw)
    return out.tokens.cpu(), out.num_accepted.cpu()


def _bonus_tokens(backend, dev, logits_row, **kw):
    """The bonus token (K = 0) of one position for every u in U_GRID."""
    V = logits_row.shape[-1]
    lg = logits_row.reshape(1, 1, V).expand(len(U_GRID), 1, V).contiguous()
    x = torch.zeros(len(U_GRID), 0, dtype=torch.int64)
    u = torch.tensor(U_GRID, dtype=torch.float32)[:, None]
    tokens, n = _verify(backend, dev, lg, x, uniforms=u, **kw)
    assert (n == 0).all()
    return set(tokens[:, 0].tolist())


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_top_p_boundary_is_strict(backend, dev):
    """p = [1/2, 1/4, 1/4] (exact in fp32): top_p = 0.5 is reached by token 0 alone, so the mass
    before token 1 (exactly 0.5) is not < top_p and only token 0 is kept (kills `<=`)."""
    logits = torch.log(torch.tensor([2.0, 1.0, 1.0]))
    p = torch.softmax(logits, -1)
    assert p.tolist() == [0.5, 0.25, 0.25]
    assert _bonus_tokens(backend, dev, logits, top_p=0.5) == {0}
    assert _bonus_tokens(backend, dev, logits, top_p=0.5000001) == {0, 1, 2}  # ties kept together


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_top_p_mass_is_renormalised_over_the_top_k_set(backend, dev):
    """p ∝ [4, 2, 1, 1]; top-k 2 leaves [2/3, 1/3]; top_p 0.6 is reached by token 0 alone.
    (Measured over the whole vocabulary, 4/8 < 0.6 would keep token 1 too.)"""
    logits = torch.log(torch.tensor([4.0, 2.0, 1.0, 1.0]))
    assert _bonus_tokens(backend, dev, logits, top_k=2, top_p=0.6) == {0}
    assert _bonus_tokens(backend, dev, logits, top_k=2) == {0, 1}


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_residual_summing_to_zero_falls_back_to_p(backend, dev):
    """q = p, and the draft x has p(x) = q(x) = 0 (removed by top-k): it is rejected, the residual
    max(0, p - q) is all zero, and the recovered token is drawn from p (tokens 0, 1 only)."""
    V = 4
    logits = torch.tensor([1.0, 1.0, 0.0, 0.0])
    n = len(U_GRID)
    lg = logits.expand(n, 2, V).contiguous()
    q = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(n, 1, V).contiguous()
    x = torch.full((n, 1), 2, dtype=torch.int64)
    u = torch.tensor(U_GRID, dtype=torch.float32)[:, None].expand(n, 2).contiguous()
    tokens, n = _verify(backend, dev, lg, x, q, top_k=2, uniforms=u)
    assert (n == 0).all()
    assert set(tokens[:, 0].tolist()) == {0, 1}


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_unusable_q_at_an_unread_position_is_ignored(backend, dev):
    """Row 0 uses K_b = 1 of K = 2 drafts and accepts it (q = p at an argmax draft); its q row 1,
    never read, is NaN: the row is valid (bonus from p_1). Row 1 reads q row 0 after a rejection:
    a NaN there makes it invalid."""
    K, V = 2, 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, K + 1, V, generator=g)
    p = torch.softmax(logits[:, :K], -1)
    q = p.clone()
    x = logits[:, :K].argmax(-1)
    q[0, 1] = float("nan")
    x[1, 0] = logits[1, 0].argmin()  # q(x) = 2 p(x) there: u = 0.9 rejects it
    q[1, 0, x[1, 0]] = 2 * p[1, 0, x[1, 0]]
    q[1, 0, (x[1, 0] + 1) % V] = float("nan")
    u = torch.full((2, K + 1), 0.9)
    kw = dict(num_draft_tokens=torch.tensor([1, 2]), uniforms=u)
    tokens, n = _verify(backend, dev, logits, x, q, **kw)
    ref = verify_reference(logits, x, q, torch.tensor([1, 2]), torch.ones(2), None, None, u)
    assert n.tolist() == [1, -1] == ref[1].tolist()
    assert torch.equal(tokens, ref[0])


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_greedy_route_keeps_a_negative_temperature_row_invalid(backend, dev, device_value_checks):
    """Where tensor values are not range-checked on the host (torch.compile, CUDA; emulated), a
    row with temperature < 0 beside greedy rows is invalid, as in the reference: the all-greedy
    route must not take it for a greedy row."""
    g = torch.Generator().manual_seed(3)
    B, K, V = 3, 2, 10
    logits = torch.randn(B, K + 1, V, generator=g)
    x = logits[:, :K].argmax(-1)
    temp = torch.tensor([0.0, -1.0, -0.0])
    u = torch.full((B, K + 1), 0.5)
    tokens, n = _verify(backend, dev, logits, x, temperature=temp, uniforms=u)
    ref = verify_reference(logits, x, None, torch.full((B,), K), temp, None, None, u)
    assert n.tolist() == [K, -1, K] == ref[1].tolist()
    assert torch.equal(tokens, ref[0])


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_subnormal_temperature_marks_the_row_invalid(backend, dev, device_value_checks):
    """A temperature in (0, 2^-126) whose reciprocal is still finite (here 2^-127: 1/T = 2^127)
    leaves finite scaled logits for small logits, yet the row is invalid (not a sampled token)."""
    B, K = 2, 1
    logits = torch.tensor([[[0.5, 0.25, 0.125, 0.0625]] * (K + 1)] * B)
    x = torch.zeros(B, K, dtype=torch.int64)
    temp = torch.tensor([2.0 ** -127, 1.0])
    assert math.isfinite(float((1.0 / temp[0]) * logits[0, 0, 0]))
    u = torch.full((B, K + 1), 0.5)
    tokens, n = _verify(backend, dev, logits, x, temperature=temp, uniforms=u)
    assert n[0] == -1 and (tokens[0] == -1).all() and n[1] >= 0
    ref = verify_reference(logits, x, None, torch.full((B,), K), temp, None, None, u)
    assert torch.equal(n, ref[1]) and torch.equal(tokens, ref[0])


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_top_p_one_is_off_even_for_negligible_tokens(backend, dev):
    """top_p = 1 must equal no top-p: tokens so unlikely that the mass before them rounds to the
    total (p ~ 1e-13) keep p > 0. A one-hot draft of such a token with u = 0 is accepted
    (0 * 1 < p(x)); were top_p = 1 applied as a cut, p(x) = 0 and it would be rejected."""
    logits = torch.tensor([[[0.0, -30.0, -30.0]] * 2])
    x = torch.tensor([[1]])
    u = torch.zeros(1, 2)
    off = _verify(backend, dev, logits, x, uniforms=u)
    one = _verify(backend, dev, logits, x, top_p=1.0, uniforms=u)
    assert off[1].tolist() == [1]
    assert torch.equal(one[0], off[0]) and torch.equal(one[1], off[1])


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_draft_past_the_draft_vocabulary_has_q_zero(backend, dev):
    """A draft id in [Vd, V) has q(x) = 0, so it is accepted whenever p(x) > 0 (not tested
    against q[Vd - 1])."""
    V = 6
    logits = torch.zeros(1, 2, V)
    logits[0, :, 4] = -2.0  # p(4) ~ 0.03
    q = torch.tensor([[[0.2, 0.3, 0.5]]])  # Vd = 3
    x = torch.tensor([[4]])
    u = torch.full((1, 2), 0.5)
    tokens, n = _verify(backend, dev, logits, x, q, uniforms=u)
    assert n.tolist() == [1] and tokens[0, 0] == 4


def test_the_kernel_and_the_reference_share_the_smallest_temperature():
    from specdec_kernels.ops.verify.triton.draw import _FLT_MIN
    from specdec_kernels.ops.reference import FLT_MIN

    assert getattr(_FLT_MIN, "value", _FLT_MIN) == FLT_MIN == 2.0 ** -126


def test_inverse_cdf_fallback_is_the_last_positive_weight():
    """When no cdf entry exceeds u * total, the draw falls back to the last token with weight
    > 0, never to a zero-weight token.  In the reference's float64 sum that cannot happen for
    u < 1 (u * total then rounds below the total, and the first entry past it has w > 0); the
    kernel's blockwise total and scan can round apart, which is what the branch is for.  So the
    branch is driven here with u = 1 (target = total).  (Until 2026-12-02 this test used a
    subnormal fp32 case that the float64 sum resolves through its main branch: it could not
    fail.)"""
    from specdec_kernels.ops.reference import inverse_cdf

    w = torch.tensor([[2.0 ** -140, 2.0 ** -140, 0.0, 0.0], [0.0, 0.25, 0.0, 0.75]])
    u = torch.tensor([1.0, 1.0], dtype=torch.float64)
    cdf = torch.cumsum(w.double(), -1)
    assert bool((cdf <= u[:, None] * cdf[:, -1:]).all())  # the fallback case, in the sum it uses
    assert inverse_cdf(w, u).tolist() == [1, 3]
    assert inverse_cdf(w, torch.tensor([1 - 2.0 ** -53] * 2, dtype=torch.float64)).tolist() == [1, 3]


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_top_k_keeps_all_ties_at_the_boundary(backend, dev):
    """top_k = 2 over s = [2, 1, 1, 0]: the 2nd largest value 1 is tied, both tokens are kept
    (p = [e, 1, 1, 0] / (e + 2)): token 2 is drawn for some u, token 3 never."""
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    assert _bonus_tokens(backend, dev, logits, top_k=2) == {0, 1, 2}
    assert _bonus_tokens(backend, dev, logits, top_k=2, top_p=0.99) == {0, 1, 2}


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_recovered_draw_resolves_weights_below_fp32s_grid(backend, dev):
    """The final draw's uniform has 53 bits and its inverse CDF sums in float64, so a token of
    weight far below fp32's resolution is drawn with its own probability.  Built so that every
    weight is exact on both backends: V = 2^15 equal logits give p = 2^-15 exactly (exp(0) = 1,
    a sum of ones); q makes the residual max(0, p - q) = 2^-15 on 10 tokens, then j * 2^-39
    (j = 1..7, exact differences) on 64 tokens, 0 elsewhere.  The tiny tokens sit at a CDF of
    about 10 * 2^-15, where fp32's spacing is 2^-35: an fp32 running sum does not move over them,
    so an fp32 CDF never drew them (before: an fp32 uniform and CDF).  A uniform in the middle of each one's
    interval draws it.  (A rejected draft x with q(x) = 2 p(x) leaves the residual.)"""
    V, n_big, n_tiny = 2**15, 10, 64
    p = 2.0 ** -15
    q = torch.full((V,), p)
    q[:n_big] = 0.0
    d = torch.tensor([(j % 7 + 1) * 2.0 ** -39 for j in range(n_tiny)])
    q[n_big:n_big + n_tiny] = p - d
    x = V - 1
    q[x] = 2 * p  # rejected: u * q(x) >= p(x) for u near 1
    w = torch.clamp(torch.full((V,), p) - q, min=0.0)  # the residual, as the verifier computes it
    assert torch.equal(w[n_big:n_big + n_tiny], d) and float(w.double().sum()) == n_big * p + float(d.double().sum())
    cdf = torch.cumsum(w.double(), 0)
    total = float(cdf[-1])
    tiny = torch.arange(n_big, n_big + n_tiny)
    run32 = torch.from_numpy(np.cumsum(w.numpy(), dtype=np.float32))  # an fp32 running sum
    assert bool((run32[tiny] == run32[n_big - 1]).all())  # does not move over them
    u_final = (cdf[tiny - 1] + w[tiny].double() / 2) / total
    u_final = torch.floor(u_final * 2.0 ** 53) / 2.0 ** 53  # on the Philox draw's grid
    u = torch.stack([torch.full((n_tiny,), 1 - 2.0 ** -53, dtype=torch.float64), u_final], 1)
    logits = torch.zeros(n_tiny, 2, V)
    qs = q.reshape(1, 1, V).expand(n_tiny, 1, V).contiguous()
    tokens, num = _verify(backend, dev, logits, torch.full((n_tiny, 1), x), qs, temperature=1.0, uniforms=u)
    assert num.tolist() == [0] * n_tiny
    assert tokens[:, 0].tolist() == tiny.tolist()


def test_bonus_draw_resolves_the_tail_of_a_large_vocabulary():
    """The same for the bonus from a 49,152-token softmax with a long tail (torch path = the
    reference): tokens of p in (2^-29, 2^-25) past the middle of the CDF, whose intervals are
    empty in fp32, are each drawn by a uniform in the middle of their interval.  (Before: an fp32
    uniform and an fp32 CDF, which drew such a token with probability 0 or 2^-24: over such a
    softmax a total variation of ~4.5e-4, the floor measured for the draft's sampler.)
    The kernel computes its own fp32 p, a last bit away from the reference's here and there, so
    which tiny token a given uniform hits is defined by its p, which a test cannot see; the
    kernel's float64 draw is checked on exact weights above."""
    from specdec_kernels.ops.reference import warp_logits
    from specdec_kernels.ops.verify.reference.warp import _target_probs

    g = torch.Generator().manual_seed(1)
    V, n = 49152, 16
    logits = torch.randn(1, 2, V, generator=g) * 3.0
    s, keep = warp_logits(logits, torch.ones(1, 2), None, None)
    w = _target_probs(s, keep)[0, 1]  # the bonus position's p
    cdf = torch.cumsum(w.double(), 0)
    total = float(cdf[-1])
    cdf32 = cdf.float()
    empty32 = cdf32 == torch.roll(cdf32, 1)
    tail = ((w > 2.0 ** -29) & (w < 2.0 ** -25) & (torch.roll(cdf, 1) > 0.5 * total) & empty32).nonzero()[:, 0]
    assert len(tail) > 200  # the tail this is about
    picked = tail[torch.randperm(len(tail), generator=g)[:n]]
    u_final = (cdf[picked - 1] + w[picked].double() / 2) / total  # the middle of each one's interval
    u_final = torch.floor(u_final * 2.0 ** 53) / 2.0 ** 53
    x = int(logits[0, 0].argmax())  # accepted with u = 0 (q one-hot): the bonus comes from position 1
    u = torch.stack([torch.zeros(n, dtype=torch.float64), u_final], 1)
    tokens, num = _verify("torch", "cpu", logits.expand(n, 2, V).contiguous(), torch.full((n, 1), x),
                          temperature=1.0, uniforms=u)
    assert num.tolist() == [1] * n
    assert tokens[:, 1].tolist() == picked.tolist()


def test_host_value_checks_leaves_bad_values_to_the_op_within_its_block():
    """The public seam of the tests above: CPU values are checked on the host (an error) except
    within ``host_value_checks(False)``, where the row is made invalid as on a device; the setting
    is restored on leaving the block, nested or after an error."""
    from specdec_kernels.ops.verify import host_value_checks

    logits = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(0))
    x, temp = logits[:, :1].argmax(-1), torch.tensor([0.0, -1.0])
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0"):
        fused_verify(logits, x, temperature=temp)
    with host_value_checks(False):
        assert fused_verify(logits, x, temperature=temp).num_accepted.tolist() == [1, -1]
        with host_value_checks(True), pytest.raises(ValueError, match="temperature"):
            fused_verify(logits, x, temperature=temp)
        assert fused_verify(logits, x, temperature=temp).num_accepted.tolist() == [1, -1]
    with pytest.raises(ValueError, match="temperature"):
        fused_verify(logits, x, temperature=temp)
    with pytest.raises(TypeError, match="host_value_checks: enabled must be a bool, got int"):
        with host_value_checks(0):
            pass
