"""The engine-facing forms of the op: ``fused_verify_packed`` (the ragged layout), probabilities
in (``target_is_probs``), fp16/bf16 draft probabilities, preallocated outputs (``out=``) and the
emitted tokens' log-probabilities (``return_logprobs``).

Exact: the packed op equals the padded op row for row, and both equal the reference, on the same
seeds (token ids and counts compared exactly); log-probabilities equal the reference's
``emitted_logprobs`` within the fp32 tolerance (helpers.TOLERANCES).  On a machine without a GPU
the Triton kernel runs under TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import HAS_CUDA
from helpers import assert_close, make_step
from specdec_kernels import fused_verify, fused_verify_packed
from specdec_kernels.ops.verify import args as _verify_args, launch as _verify_launch
from specdec_kernels.ops.reference import emitted_logprobs, philox_uniforms, verify_reference
from helpers import chi_square_pvalue

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = [pytest.param("triton", marks=pytest.mark.slow), "torch"]  # the kernel, interpreted on a CPU: slow


def _pack(logits, x, q, kb):
    """The padded step [B, K+1, V] / [B, K] / [B, K, Vd] as the packed layout of K_b = kb[b]."""
    B, K1, V = logits.shape
    K = K1 - 1
    rows = torch.cat([torch.arange(int(k) + 1) + b * K1 for b, k in enumerate(kb.tolist())])
    drafts = torch.cat([torch.arange(int(k)) + b * K for b, k in enumerate(kb.tolist())]).long()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), kb.cumsum(0)])
    pq = None if q is None else q.reshape(B * K, -1)[drafts]
    return logits.reshape(B * K1, V)[rows], x.reshape(-1)[drafts], cu, pq


def _dev(t):
    return None if t is None else t.to(DEV)


def _params(B, K, V, warp):
    kb = torch.tensor([K, 0, K // 2, 1][:B])
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3][:B])
    top_k = torch.tensor([min(5, V), 0, 3, V][:B]) if warp else None
    top_p = torch.tensor([0.9, 0.6, 1.0, 0.8][:B]) if warp else None
    return kb, temperature, top_k, top_p


CONFIGS = [  # (B, K, V, logits dtype, warp, draft_probs kind)
    (1, 1, 111, torch.float32, False, "fp32"),
    (4, 4, 111, torch.float32, True, "fp32"),
    (3, 3, 257, torch.bfloat16, False, "none"),
    (4, 2, 1271, torch.float16, True, "bf16"),
    (2, 5, 300, torch.float32, True, "fp16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS,
                         ids=lambda c: f"B{c[0]}K{c[1]}V{c[2]}-{str(c[3])[6:]}-{'warp' if c[4] else 'plain'}-q{c[5]}")
def test_packed_equals_padded_and_reference(cfg, backend, split_settings):
    B, K, V, dtype, warp, qkind = cfg
    if V == 1271:
        split_settings(chunk=128)  # 10 chunks
    logits, x, q = make_step(B, K, V, dtype, seed=B * 100 + K * 10 + V % 7)
    q = {"none": None, "fp32": q, "bf16": q.bfloat16(), "fp16": q.half()}[qkind]
    kb, temperature, top_k, top_p = _params(B, K, V, warp)
    seed = torch.arange(B) * 31 + 5
    offset = torch.arange(B) + 2
    kw = dict(temperature=_dev(temperature), top_k=_dev(top_k), top_p=_dev(top_p), seed=_dev(seed),
              offset=_dev(offset), backend=backend)
    padded = fused_verify(_dev(logits), _dev(x), _dev(q), num_draft_tokens=_dev(kb), **kw)
    pl, px, cu, pq = _pack(logits, x, q, kb)
    packed = fused_verify_packed(_dev(pl), _dev(px), _dev(cu), _dev(pq), max_num_draft_tokens=K, **kw)
    assert torch.equal(packed.tokens.cpu(), padded.tokens.cpu())
    assert torch.equal(packed.num_accepted.cpu(), padded.num_accepted.cpu())
    u = philox_uniforms(seed, offset, K)
    ref_t, ref_n = verify_reference(logits, x, q, kb, temperature, top_k, top_p, u)
    assert torch.equal(packed.tokens.cpu(), ref_t) and torch.equal(packed.num_accepted.cpu(), ref_n)
    assert (ref_n >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_without_max_reads_it_from_cu_and_takes_int32(backend):
    logits, x, q = make_step(3, 3, 64, seed=4)
    kb = torch.tensor([2, 0, 1])
    pl, px, cu, pq = _pack(logits, x, q, kb)
    out = fused_verify_packed(_dev(pl), _dev(px.int()), _dev(cu.int()), _dev(pq), seed=3, backend=backend)
    assert out.tokens.shape == (3, 3)  # K = max_b K_b = 2
    want = fused_verify(_dev(logits[:, :3]), _dev(x[:, :2]), _dev(q[:, :2]), num_draft_tokens=_dev(kb), seed=3,
                        backend=backend)
    assert torch.equal(out.tokens.cpu(), want.tokens.cpu()) and torch.equal(out.num_accepted.cpu(),
                                                                             want.num_accepted.cpu())


def test_packed_rows_outside_the_drafts_read_nothing_in_the_kernel():
    """On a GPU cu is not read on the host: a row whose cu runs past the drafts, or whose K_b
    exceeds max_num_draft_tokens, is marked invalid by the kernel (and reads nothing)."""
    logits, x, q = make_step(3, 2, 40, seed=5)
    pl, px, cu, pq = _pack(logits, x, q, torch.tensor([2, 2, 2]))
    args, B, K = _verify_args._normalize_packed(_dev(pl), _dev(px), _dev(cu), _dev(pq), 2, 1.0, None, None, 1, 0,
                                              None, False)
    good = _verify_launch._launch(args, _verify_launch._Layout(B, K, _dev(cu)))
    # row 1: K_b = 3 > K = 2; row 2: drafts 5..6, past the 6 drafts; row 0 as before
    tokens, num, _ = _verify_launch._launch(args, _verify_launch._Layout(B, K, _dev(torch.tensor([0, 2, 5, 7]))))
    assert num.tolist() == [int(good[1][0]), -1, -1] and (tokens[1:] == -1).all()
    assert torch.equal(tokens[0].cpu(), good[0][0].cpu())


def test_packed_argument_errors_name_the_argument():
    logits, x, q = make_step(2, 2, 16, seed=6)
    pl, px, cu, pq = _pack(logits, x, q, torch.tensor([2, 1]))
    with pytest.raises(ValueError, match=r"logits must have sum_b \(K_b \+ 1\) = 3 \+ 2 = 5 rows .* got 6"):
        fused_verify_packed(torch.cat([pl, pl[:1]]), px, cu, pq)
    with pytest.raises(ValueError, match=r"cu_num_draft_tokens must rise from 0 to the number of drafts 3 .* "
                                         r"got \[1, 2, 3\]"):
        fused_verify_packed(pl, px, cu + torch.tensor([1, 0, 0]), pq)
    with pytest.raises(ValueError, match="max_num_draft_tokens must be >= max_b K_b = 2, got 1"):
        fused_verify_packed(pl, px, cu, pq, max_num_draft_tokens=1)
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[3, 16\], got \[2, 16\]"):
        fused_verify_packed(pl, px, cu, pq[:2])
    with pytest.raises(ValueError, match=r"draft_probs\[2\] must sum to 1 .*draft 0 of row 1.* got 2"):
        fused_verify_packed(pl, px, cu, torch.cat([pq[:2], 2 * pq[2:]]))
    with pytest.raises(TypeError, match="cu_num_draft_tokens must have dtype int32 or int64, got float32"):
        fused_verify_packed(pl, px, cu.float(), pq)


# ---------------------------------------------------------------------------------------------
# Probabilities in
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qkind", ["fp32", "none"])
def test_target_probs_equal_logits_in_on_log_p(backend, qkind):
    """p as given == the logits log(p) at T = 1 (the same draws; the two compute p by different
    roundings, which no decision of these seeds falls between), and == the reference."""
    B, K, V = 4, 3, 200
    logits, x, q = make_step(B, K, V, seed=7)
    q = q if qkind == "fp32" else None
    p = torch.softmax(logits, -1)
    p[1, :, 50:] = 0.0  # zeros in p: their log is -inf
    p[1] /= p[1].sum(-1, keepdim=True)
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0])
    kb = torch.tensor([3, 2, 3, 0])
    for s in range(4):
        kw = dict(num_draft_tokens=_dev(kb), temperature=_dev(temperature), seed=s, offset=1, backend=backend)
        a = fused_verify(_dev(p), _dev(x), _dev(q), target_is_probs=True, **kw)
        b = fused_verify(_dev(torch.log(p)), _dev(x), _dev(q), **kw)
        assert torch.equal(a.tokens.cpu(), b.tokens.cpu()) and torch.equal(a.num_accepted.cpu(), b.num_accepted.cpu())
        u = philox_uniforms(torch.full((B,), s), torch.ones(B, dtype=torch.int64), K)
        rt, rn = verify_reference(p, x, q, kb, temperature, None, None, u, target_is_probs=True)
        assert torch.equal(a.tokens.cpu(), rt) and torch.equal(a.num_accepted.cpu(), rn)
        assert (rn >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_probs_unusable_positions_mark_their_row(backend):
    B, K, V = 4, 2, 32
    logits, x, q = make_step(B, K, V, seed=8)
    p = torch.softmax(logits, -1)
    p[0, 0, 3] = -0.01  # negative
    p[1, 0, 4] = float("nan")
    p[2, 0] = 0.0  # no mass
    out = fused_verify(_dev(p), _dev(x), _dev(q), target_is_probs=True, seed=1, backend=backend)
    assert out.num_accepted.tolist()[:3] == [-1, -1, -1] and (out.tokens[:3] == -1).all()
    assert int(out.num_accepted[3]) >= 0


def test_target_probs_refuse_a_warp_and_other_temperatures():
    logits, x, q = make_step(2, 2, 16, seed=9)
    p = torch.softmax(logits, -1)
    with pytest.raises(ValueError, match="top_k must be None with target_is_probs=True"):
        fused_verify(p, x, q, target_is_probs=True, top_k=5)
    with pytest.raises(ValueError, match="top_p must be None with target_is_probs=True"):
        fused_verify(p, x, q, target_is_probs=True, top_p=0.9)
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or 1 .* got 0.7"):
        fused_verify(p, x, q, target_is_probs=True, temperature=0.7)
    with pytest.raises(ValueError, match=r"target_probs must have 3 dims"):
        fused_verify(p[0], x, q, target_is_probs=True)


@pytest.mark.slow
def test_target_probs_emit_their_distribution():
    """Chi-square (significance 1e-4, 100,000 trials, bins of expected count < 5 merged) of the
    first emitted token against p_1 (normalised), with q far from p, on the torch path (the
    kernel equals it token for token above); and a mutant that draws the final token from p
    instead of the residual must fail it."""
    N, K, V = 100_000, 2, 10
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(K + 1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    p = 3.0 * p  # unnormalised probabilities are renormalised
    q = torch.softmax(torch.randn(K, V, generator=g, dtype=torch.float64) * 1.5, -1)
    x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
    want = (p[0] / p[0].sum()).numpy()

    def first_tokens():
        out = fused_verify(p.float()[None].expand(N, -1, -1), x, q.float()[None].expand(N, -1, -1),
                           target_is_probs=True, seed=torch.arange(N), backend="torch")
        return out.tokens[:, 0].numpy()

    assert chi_square_pvalue(first_tokens(), want) > 1e-4
    import specdec_kernels.ops.verify.reference.chain as ref
    orig = ref._residual
    try:
        ref._residual = lambda p_, q_: p_  # mutant: the recovered token from p
        assert chi_square_pvalue(first_tokens(), want) < 1e-4
    finally:
        ref._residual = orig


# ---------------------------------------------------------------------------------------------
# Draft probabilities in bf16 / fp16
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
def test_half_draft_probs_are_read_as_they_are(qdtype, backend):
    logits, x, q = make_step(3, 3, 150, seed=12)
    qh = q.to(qdtype)
    kw = dict(temperature=torch.tensor([1.0, 0.8, 1.0]).to(DEV), seed=torch.tensor([1, 2, 3]).to(DEV),
              backend=backend)
    a = fused_verify(_dev(logits), _dev(x), _dev(qh), **kw)
    b = fused_verify(_dev(logits), _dev(x), _dev(qh.float()), **kw)
    assert torch.equal(a.tokens.cpu(), b.tokens.cpu()) and torch.equal(a.num_accepted.cpu(), b.num_accepted.cpu())


# ---------------------------------------------------------------------------------------------
# out= and log-probabilities
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("odtype", [torch.int32, torch.int64])
def test_out_is_written_in_place(odtype, backend):
    logits, x, q = make_step(3, 3, 70, seed=13)
    want = fused_verify(_dev(logits), _dev(x), _dev(q), seed=4, backend=backend)
    buf = torch.full((5, 4), 7, dtype=odtype, device=DEV)  # an engine's larger buffer, rows 0-2 used
    num = torch.full((3,), 7, dtype=odtype, device=DEV)
    got = fused_verify(_dev(logits), _dev(x), _dev(q), seed=4, backend=backend, out=(buf[:3], num))
    assert got.tokens.data_ptr() == buf.data_ptr() and got.num_accepted is num
    assert (torch.equal(buf[:3].long().cpu(), want.tokens.cpu())
            and torch.equal(num.long().cpu(), want.num_accepted.cpu()))
    assert (buf[3:] == 7).all()
    lp = torch.empty((3, 4), device=DEV)
    got = fused_verify(_dev(logits), _dev(x), _dev(q), seed=4, backend=backend, out=(buf[:3], num, lp),
                       return_logprobs=True)
    assert got.logprobs is lp and torch.equal(buf[:3].long().cpu(), want.tokens.cpu())


def test_out_errors_name_the_tensor():
    logits, x, q = make_step(2, 2, 16, seed=14)
    with pytest.raises(ValueError, match=r"out.tokens must have shape \[2, 3\], got \[2, 2\]"):
        fused_verify(logits, x, q, out=(torch.empty(2, 2, dtype=torch.int64), torch.empty(2, dtype=torch.int64)))
    with pytest.raises(TypeError, match="out.num_accepted must have dtype int32 or int64, got float32"):
        fused_verify(logits, x, q, out=(torch.empty(2, 3, dtype=torch.int64), torch.empty(2)))
    with pytest.raises(TypeError, match=r"out must be a tuple \(tokens, num_accepted, logprobs\) of 3 tensors"):
        fused_verify(logits, x, q, return_logprobs=True,
                     out=(torch.empty(2, 3, dtype=torch.int64), torch.empty(2, dtype=torch.int64)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("probs", [False, True], ids=["logits", "probs"])
def test_logprobs_equal_the_reference(probs, backend, split_settings):
    split_settings(chunk=64)  # several chunks
    B, K, V = 4, 3, 200
    logits, x, q = make_step(B, K, V, seed=15)
    kb = torch.tensor([3, 1, 2, 0])
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0]) if probs else torch.tensor([0.8, 0.0, 1.0, 1.3])
    top_k = None if probs else torch.tensor([10, 0, 0, 40])
    top_p = None if probs else torch.tensor([0.9, 1.0, 0.7, 1.0])
    target = torch.softmax(logits, -1) if probs else logits
    x[1, :1] = target[1, :1].argmax(-1)  # the greedy row accepts its first draft
    for s in range(3):
        out = fused_verify(_dev(target), _dev(x), _dev(q), num_draft_tokens=_dev(kb), temperature=_dev(temperature),
                           top_k=_dev(top_k), top_p=_dev(top_p), seed=s, backend=backend, target_is_probs=probs,
                           return_logprobs=True)
        want = emitted_logprobs(target, out.tokens.cpu(), out.num_accepted.cpu(), temperature, top_k, top_p,
                                target_is_probs=probs)
        lp = out.logprobs.cpu()
        assert torch.equal(torch.isinf(lp), torch.isinf(want)), (lp, want)
        fin = torch.isfinite(want)
        assert fin[:, 0].all()  # every row emits a token
        assert_close(lp[fin], want[fin])
        assert (lp[fin] <= 0).all()
    # a greedy row's log-probabilities are log_softmax(logits)'s
    gl = torch.log_softmax(target[1].double() if not probs else torch.log(target[1].double()), -1)
    n = int(out.num_accepted[1])
    for i in range(n + 1):
        assert abs(float(lp[1, i]) - float(gl[i, out.tokens[1, i]])) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_of_an_invalid_row_are_all_minus_inf(backend):
    logits, x, q = make_step(2, 2, 30, seed=16)
    logits[0, 0, 5] = float("nan")
    out = fused_verify(_dev(logits), _dev(x), _dev(q), seed=2, backend=backend, return_logprobs=True)
    assert int(out.num_accepted[0]) == -1 and torch.isneginf(out.logprobs[0]).all()
    n = int(out.num_accepted[1])
    assert torch.isfinite(out.logprobs[1, :n + 1]).all() and torch.isneginf(out.logprobs[1, n + 1:]).all()


def test_packed_logprobs_equal_padded(monkeypatch):
    B, K, V = 3, 3, 90
    logits, x, q = make_step(B, K, V, seed=17)
    kb = torch.tensor([3, 0, 2])
    pl, px, cu, pq = _pack(logits, x, q, kb)
    for backend in ("triton", "torch"):
        a = fused_verify(_dev(logits), _dev(x), _dev(q), num_draft_tokens=_dev(kb), temperature=0.9, top_k=20,
                         seed=5, backend=backend, return_logprobs=True)
        b = fused_verify_packed(_dev(pl), _dev(px), _dev(cu), _dev(pq), temperature=0.9, top_k=20, seed=5,
                                backend=backend, return_logprobs=True)
        assert torch.equal(a.tokens.cpu(), b.tokens.cpu())
        np.testing.assert_array_equal(a.logprobs.cpu().numpy(), b.logprobs.cpu().numpy())


@pytest.mark.parametrize("with_out", [False, True], ids=["allocates", "out"])
def test_packed_call_is_one_launch_and_copies_nothing(with_out, monkeypatch, device_value_checks):
    """fused_verify_packed with max_num_draft_tokens and [B] parameters on the device: one kernel
    launch, and no other aten op than the outputs' allocation (``empty``; none with ``out=``) and
    the memset of the workspace's counters: no copy of the logits, no padding, no conversion of
    the fp16 draft probabilities."""
    import specdec_kernels.ops.verify.triton.split_kernel as kmod
    from test_verify_split import _CountLaunches, _memset_op, _RecordOps

    monkeypatch.setattr(_verify_args, "host_readable", lambda t: False)
    logits, x, q = make_step(3, 3, 64, torch.bfloat16, seed=18)
    pl, px, cu, pq = _pack(logits, x, q.half(), torch.tensor([3, 0, 2]))
    pl, px, cu, pq = _dev(pl), _dev(px.int()), _dev(cu.int()), _dev(pq)
    kw = dict(max_num_draft_tokens=3, temperature=torch.tensor([1.0, 0.0, 0.5], device=DEV), top_k=8,
              seed=torch.tensor([1, 2, 3], device=DEV), offset=4, backend="triton", return_logprobs=True)
    out = (torch.empty(3, 4, dtype=torch.int32, device=DEV), torch.empty(3, dtype=torch.int32, device=DEV),
           torch.empty(3, 4, device=DEV)) if with_out else None
    want = fused_verify_packed(pl, px, cu, pq, **kw)  # warm-up: the workspace is made once per device
    rec = _RecordOps()
    counter = _CountLaunches(kmod.verify_split_kernel, rec)
    monkeypatch.setattr(kmod, "verify_split_kernel", counter)
    with rec:
        got = fused_verify_packed(pl, px, cu, pq, out=out, **kw)
    assert counter.launches == 1
    dev = torch.device(DEV).type
    expect = [_memset_op()] + ([] if with_out else [("aten.empty", dev, 12), ("aten.empty", dev, 3),
                                                     ("aten.empty", dev, 12)])
    assert sorted(rec.ops, key=str) == sorted(expect, key=str), rec.ops
    assert torch.equal(got.tokens.long().cpu(), want.tokens.cpu())
