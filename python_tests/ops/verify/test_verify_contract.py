"""Where the exactness core's tests had not looked (mutation testing of verify.py, reference.py,
_host.py, draft_sampling.py and the kernel, 2026-12-02: 10 of 49 mutants survived, 7 harmful):
argument checks the docstring promises on CPU (a negative top_k tensor, NaN uniforms,
draft_probs on another device, the 1% sum tolerance itself), the kernel's first argmax across
tile boundaries and its q(x) = 0 past the draft vocabulary, a negative q entry off the draft
making a rejected row invalid on the row-by-row draw, the draft warp's strict top-p boundary,
and independent counters for the draft's uniforms at consecutive positions."""

from __future__ import annotations

import pytest
import torch

from helpers import HAS_CUDA
from specdec_kernels import fused_verify
from specdec_kernels.ops.verify import launch as _verify_launch, torch_path as _verify_torch
from specdec_kernels.ops.reference import verify_reference

KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# the kernel, interpreted on a CPU: slow
BACKENDS = [pytest.param("triton", KERNEL_DEVICE, marks=pytest.mark.slow), ("torch", "cpu")]


def _args(B=2, K=2, V=10):
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(B, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    x = torch.randint(0, V, (B, K), generator=g)
    return lg, x, q


def test_negative_top_k_tensor_is_refused_on_cpu():
    """The docstring: tensor-valued top_k is range-checked on CPU (a ValueError, not a row
    silently marked invalid). The int form is checked in fused_verify itself; this is the
    tensor check in normalize_arguments."""
    lg, x, q = _args()
    with pytest.raises(ValueError, match=r"^top_k must be >= 0 \(0 = off\), got \[2, -1\]$"):
        fused_verify(lg, x, q, top_k=torch.tensor([2, -1]), seed=0, backend="torch")


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nan_uniforms_are_refused(bad):
    """A NaN uniform compares False everywhere: every draft would be rejected and the final
    draw would fall back to one fixed token, silently. It must be refused like 1.0."""
    lg, x, q = _args()
    u = torch.full((2, 3), 0.5, dtype=torch.float64)
    u[1, 0] = bad
    with pytest.raises(ValueError, match=r"^uniforms must lie in \[0, 1\), got (nan|-inf) at \[1, 0\]$"):
        fused_verify(lg, x, q, uniforms=u, backend="torch")


def test_draft_probs_on_another_device_is_refused():
    lg, x, q = _args()
    with pytest.raises(ValueError, match=r"^draft_probs must be on cpu \(the device of target_logits\), got meta$"):
        fused_verify(lg, x, q.to("meta"), seed=0, backend="torch")


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_greedy_argmax_tie_across_tiles_takes_the_first(backend, dev, split_settings):
    """The maximum tied in several vocabulary tiles (16 tokens each here): the first index wins,
    as in the reference (bf16 logits tie often). A later tile with an equal maximum must not
    replace the argmax."""
    split_settings(chunk=16)
    B, K, V = 3, 2, 70
    logits = torch.zeros(B, K + 1, V)
    for b, hits in enumerate([(5, 20, 37), (17, 33, 69), (0, 16, 64)]):
        logits[b, :, list(hits)] = 2.0
    x = torch.tensor([[5, 20], [17, 17], [16, 0]])  # row 0 accepts x_0 and rejects x_1 (20 != 5)
    out = fused_verify(logits.to(dev), x.to(dev), temperature=0.0, seed=0, backend=backend)
    ref = verify_reference(logits, x, None, torch.full((B,), K), torch.zeros(B), None, None,
                           torch.zeros(B, K + 1, dtype=torch.float64))
    assert out.num_accepted.cpu().tolist() == [1, 2, 0] == ref[1].tolist()
    assert torch.equal(out.tokens.cpu(), ref[0])
    assert out.tokens.cpu().tolist() == [[5, 5, -1], [17, 17, 17], [0, -1, -1]]


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_draft_past_the_draft_vocabulary_reads_no_other_q(backend, dev):
    """x in [Vd, V) has q(x) = 0 (accepted whenever p(x) > 0), whatever lies in memory after the
    q row: here the next position's q, large at its first token, sits where q[b, 0, Vd] would be."""
    B, K, V, Vd = 2, 2, 6, 3
    logits = torch.zeros(B, K + 1, V)
    logits[:, :, 3] = -1.0  # p(3) ~ 0.07
    q = torch.tensor([[0.2, 0.3, 0.5], [0.98, 0.01, 0.01]]).expand(B, K, Vd).contiguous()
    x = torch.tensor([[3, 0], [3, 0]])
    u = torch.full((B, K + 1), 0.5, dtype=torch.float64)
    out = fused_verify(logits.to(dev), x.to(dev), q.to(dev), uniforms=u.to(dev), backend=backend)
    ref = verify_reference(logits, x, q, torch.full((B,), K), torch.ones(B), None, None, u)
    assert torch.equal(out.tokens.cpu(), ref[0]) and torch.equal(out.num_accepted.cpu(), ref[1])
    assert (out.num_accepted.cpu() >= 1).all() and (out.tokens.cpu()[:, 0] == 3).all()


def test_warp_probs_top_p_boundary_is_strict():
    """The draft's warp has the verifier's strict top-p: p = [1/2, 1/4, 1/4], top_p = 0.5 keeps
    token 0 alone (the mass before token 1 is exactly 0.5, not < 0.5)."""
    from specdec_kernels.decoding.drafters.sampling import warp_probs
    from specdec_kernels.ops.reference import warp_logits

    logits = torch.log(torch.tensor([[2.0, 1.0, 1.0]]))
    assert warp_probs(logits, 1.0, None, 0.5).tolist() == [[1.0, 0.0, 0.0]]
    assert warp_logits(logits, torch.ones(1), None, torch.tensor([0.5]))[1].tolist() == [[True, False, False]]
    assert warp_probs(logits, 1.0, None, 0.5000001).tolist() == [[0.5, 0.25, 0.25]]


def test_draft_uniforms_of_consecutive_positions_use_distinct_hashes():
    """Each draft position j draws its 53 bits from two hashes of its own (counters 2j, 2j + 1):
    the fine bits of u_j must not be the coarse bits of u_{j+1} (a shared counter would make
    consecutive drafts dependent)."""
    from specdec_kernels.decoding.drafters import sampling as ds

    B = 4000
    keys = [ds.draft_key(s) for s in range(B)]
    lo = torch.tensor([k[0] for k in keys])
    hi = torch.tensor([k[1] for k in keys])
    for host_max in (ds._HOST_HASH_MAX, 10**9):  # tensor ops, then Python ints
        ds_u = None
        old = ds._HOST_HASH_MAX
        ds._HOST_HASH_MAX = host_max
        try:
            ds_u = ds._draft_uniforms_k(lo, hi, torch.full((B,), 5), 3)  # [B, 3]
        finally:
            ds._HOST_HASH_MAX = old
        for j in range(2):
            fine = torch.remainder(ds_u[:, j] * 2.0 ** 27, 1.0)  # bits 28..53 of u_j
            coarse = ds_u[:, j + 1]
            assert abs(float(torch.corrcoef(torch.stack([fine, coarse]))[0, 1])) < 0.1, (host_max, j)


@pytest.mark.parametrize("scale,refused", [(1.02, True), (0.98, True), (1.005, False)])
def test_draft_probs_sum_tolerance_is_one_percent(scale, refused):
    """A q off by 2% is refused (it would bias the output); 0.5% passes (bf16 rounding)."""
    lg, x, q = _args()
    q = q.clone()
    q[1, 0] *= scale
    if refused:
        with pytest.raises(ValueError, match=r"^draft_probs\[1, 0\] must sum to 1"):
            fused_verify(lg, x, q, seed=0, backend="torch")
    else:
        fused_verify(lg, x, q, seed=0, backend="torch")


@pytest.mark.parametrize("row_draw", [False, True], ids=["batched_draw", "row_draw"])
@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_negative_q_off_the_draft_makes_a_rejected_row_invalid(backend, dev, row_draw, torch_routes):
    """A negative q entry at a token other than the draft is read by the residual after a
    rejection: the row is invalid (num_accepted -1), on every route."""
    torch_routes(row_draw_max=8 if row_draw else 0)
    B, K, V = 2, 1, 5
    logits = torch.zeros(B, K + 1, V)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]).expand(B, K, V).contiguous()
    q[0, 0, 1] = -0.25  # row 0: a negative entry off the draft (the row still sums to 1 with q[0, 0, 0] below)
    q[0, 0, 0] = 0.75
    x = torch.zeros(B, K, dtype=torch.int64)  # row 0: 0.9 * 0.75 >= p(x) = 0.2, row 1: 0.9 * 0.25 >= 0.2: both rejected
    u = torch.full((B, K + 1), 0.9, dtype=torch.float64)
    out = fused_verify(logits.to(dev), x.to(dev), q.to(dev), uniforms=u.to(dev), backend=backend)
    ref = verify_reference(logits, x, q, torch.full((B,), K), torch.ones(B), None, None, u)
    assert out.num_accepted.cpu().tolist() == [-1, 0] == ref[1].tolist()
    assert torch.equal(out.tokens.cpu(), ref[0])
