"""``draft_logits=``: the draft's raw logits in place of its probabilities, q = softmax(l / T) with
each row's own temperature, computed by the kernel at the positions it reads.

Exact: the reference with draft_logits equals the reference with draft_probs = softmax(l / T);
the torch path and the Triton kernel (interpreted on CPU tensors here) equal the reference token
for token, padded and packed (token ids and counts compared exactly, as test_verify_exact.py and
test_verify_packed.py compare the kernel with the reference: the kernel's sums round in another
order than torch's, and no decision of these seeds falls between the two).  Distribution: a
chi-square of the first emitted token against its exact law (float64), with a mutant (q at T = 1
instead of the row's T) that the same statistic rejects.  Argument errors name draft_logits, the
expected and the actual value.  On a machine without a GPU the kernel runs under
TRITON_INTERPRET=1 (small shapes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from helpers import HAS_CUDA
from helpers import make_step
from specdec_kernels import fused_verify, fused_verify_packed
from specdec_kernels.ops.verify import args as _verify_args, launch as _verify_launch
from specdec_kernels.ops.verify.reference import chain as chain_reference
from specdec_kernels.ops.kernels import split_workspace
from specdec_kernels.ops.reference import draft_softmax, emitted_logprobs, philox_uniforms, verify_reference
from helpers import chi_square_pvalue, expected_probs
from test_verify_distribution import Z_BOUND
from test_verify_packed import _pack

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = [pytest.param("triton", marks=pytest.mark.slow), "torch"]  # the kernel, interpreted on a CPU: slow


def _dev(t):
    return None if t is None else t.to(DEV)


def _inv_t(temperature: torch.Tensor) -> torch.Tensor:
    """1 / T per row (1 for greedy rows), as the op computes it."""
    t = temperature.float()
    return torch.where(t == 0, 1.0, 1.0 / t.masked_fill(t == 0, 1.0))


def _step(B, K, V, Vd, seed, dtype=torch.float32, scale=3.0, neg_inf=True):
    """Target logits [B, K+1, V] (dtype), draft logits [B, K, Vd] fp32 close to the target's (so
    that drafts are often but not always accepted), with a few -inf entries when Vd > 2."""
    logits, _, _ = make_step(B, K, V, dtype, seed=seed, scale=scale)
    g = torch.Generator().manual_seed(seed + 1)
    L = logits[:, :K, :Vd].float() + torch.randn(B, K, Vd, generator=g) * 0.5 * scale
    if neg_inf and Vd > 2 and B * K:
        L.view(-1, Vd)[:, -1] = float("-inf")  # q = 0 there
    return logits, L, g


def _drafts(L, temperature, g):
    """Drafts sampled from q = softmax(l / T) (float64; greedy rows at T = 1)."""
    B, K, Vd = L.shape
    if B * K == 0:
        return torch.zeros(B, K, dtype=torch.int64)
    q = torch.softmax(L.double() * _inv_t(temperature).double()[:, None, None], -1)
    return torch.multinomial(q.reshape(-1, Vd), 1, generator=g).view(B, K)


def _softmax_probs(L, temperature):
    """draft_probs = softmax(L.float() / T) per row, in fp32 (greedy rows at T = 1: they read no q)."""
    t = temperature.float()
    return torch.softmax(L.float() / torch.where(t == 0, 1.0, t)[:, None, None], -1)


# ---------------------------------------------------------------------------------------------
# 1. The reference: draft_logits == draft_probs of their softmax
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
@pytest.mark.parametrize("temps", ["scalar", "per_row"])
def test_reference_draft_logits_equal_draft_probs_of_their_softmax(temps, warp):
    B, K, V, Vd = 4, 3, 60, 50
    for s in range(6):
        logits, L, g = _step(B, K, V, Vd, seed=40 + s)
        if temps == "scalar":
            temperature = torch.full((B,), [0.6, 1.0, 1.7][s % 3])
        else:
            temperature = torch.tensor([0.7, 0.0, 1.3, 1.0])  # a greedy row among sampling ones
        x = _drafts(L, temperature, g)
        if temps == "per_row":
            x[1, :2] = logits[1, :2].float().argmax(-1)  # the greedy row accepts its first drafts
        kb = torch.tensor([3, 3, 2, 1])
        top_k = torch.tensor([10, 0, 5, 0]) if warp else None
        top_p = torch.tensor([0.9, 1.0, 0.8, 0.7]) if warp else None
        u = philox_uniforms(torch.arange(B) + 10 * s, torch.full((B,), s), K)
        a = verify_reference(logits, x, None, kb, temperature, top_k, top_p, u, draft_logits=L)
        b = verify_reference(logits, x, _softmax_probs(L, temperature), kb, temperature, top_k, top_p, u)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (s, a, b)
        assert (a[1] >= 0).all()
    # draft_softmax is that softmax (to fp32 rounding) with q = 0 at -inf
    q = draft_softmax(L, _inv_t(temperature))
    torch.testing.assert_close(q, _softmax_probs(L, temperature), atol=1e-6, rtol=1e-5)
    assert (q[..., -1] == 0).all()


def test_reference_unusable_draft_rows_are_nan():
    L = torch.zeros(4, 1, 5)
    L[0, 0, 1] = float("nan")
    L[1, 0, 2] = float("inf")
    L[2, 0] = float("-inf")
    L[3, 0, 0] = float("-inf")  # usable: q = 0 there
    q = draft_softmax(L, torch.ones(4))
    assert torch.isnan(q[:3]).all()
    assert q[3, 0, 0] == 0 and torch.allclose(q[3, 0, 1:], torch.full((4,), 0.25))


# ---------------------------------------------------------------------------------------------
# 2. The torch path and the Triton kernel == the reference, padded and packed
# ---------------------------------------------------------------------------------------------
CONFIGS = [  # (B, K, V, Vd, target dtype, draft-logits dtype, warp, chunk)
    (2, 2, 1, 1, torch.float32, torch.float32, False, None),
    (3, 3, 37, 37, torch.float32, torch.bfloat16, True, None),
    (3, 2, 37, 30, torch.bfloat16, torch.float32, False, None),
    (4, 3, 300, 250, torch.float32, torch.float32, True, None),
    (4, 3, 300, 260, torch.bfloat16, torch.bfloat16, False, 64),  # 5 chunks, Vd ends inside the 5th
    (3, 2, 300, 100, torch.float16, torch.float16, True, 64),  # chunks past Vd read no draft logits
]


def _cfg_id(c):
    B, K, V, Vd, dt, qdt, warp, chunk = c
    return (f"B{B}K{K}V{V}Vd{Vd}-{str(dt)[6:]}-L{str(qdt)[6:]}-{'warp' if warp else 'plain'}"
            f"{'-chunk' + str(chunk) if chunk else ''}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_backends_equal_the_reference_padded_and_packed(cfg, backend, split_settings):
    B, K, V, Vd, dtype, qdtype, warp, chunk = cfg
    if chunk:
        split_settings(chunk=chunk)
    logits, L, g = _step(B, K, V, Vd, seed=B * 100 + K * 10 + V % 7 + Vd, dtype=dtype)
    L = L.to(qdtype)
    temperature = torch.tensor([0.8, 0.0, 1.3, 1.0][:B])
    x = _drafts(L.float(), temperature, g)
    if B > 1 and K:
        x[1, :1] = logits[1, :1].float().argmax(-1)  # the greedy row accepts its first draft
    kb = torch.tensor([K, K, K - 1, 1][:B])
    top_k = torch.tensor([min(5, V), 0, 3, V][:B]) if warp else None
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.7][:B]) if warp else None
    for s in range(2):
        seed = torch.arange(B) * 31 + 5 + s
        offset = torch.arange(B) + 2
        kw = dict(temperature=_dev(temperature), top_k=_dev(top_k), top_p=_dev(top_p), seed=_dev(seed),
                  offset=_dev(offset), backend=backend)
        padded = fused_verify(_dev(logits), _dev(x), draft_logits=_dev(L), num_draft_tokens=_dev(kb), **kw)
        pl, px, cu, pL = _pack(logits, x, L, kb)
        packed = fused_verify_packed(_dev(pl), _dev(px), _dev(cu), draft_logits=_dev(pL), max_num_draft_tokens=K,
                                     **kw)
        u = philox_uniforms(seed, offset, K)
        rt, rn = verify_reference(logits, x, None, kb, temperature, top_k, top_p, u, draft_logits=L)
        assert (rn >= 0).all()
        for out in (padded, packed):
            assert torch.equal(out.num_accepted.cpu(), rn), (out.num_accepted, rn)
            assert torch.equal(out.tokens.cpu(), rt), (out.tokens, rt)


def test_cases_exercise_acceptance_and_rejection():
    """The configurations above see sampled rows that accept and rows that reject (a check of the
    inputs, on the reference)."""
    seen = set()
    for cfg in CONFIGS[1:]:
        B, K, V, Vd, dtype, qdtype, warp, _ = cfg
        logits, L, g = _step(B, K, V, Vd, seed=B * 100 + K * 10 + V % 7 + Vd, dtype=dtype)
        temperature = torch.tensor([0.8, 0.0, 1.3, 1.0][:B])
        x = _drafts(L.to(qdtype).float(), temperature, g)
        kb = torch.tensor([K, K, K - 1, 1][:B])
        for s in range(2):
            u = philox_uniforms(torch.arange(B) * 31 + 5 + s, torch.arange(B) + 2, K)
            _, n = verify_reference(logits, x, None, kb, temperature, None, None, u, draft_logits=L.to(qdtype))
            for b in (0, 2):
                seen.add("rejects" if n[b] < kb[b] else "accepts all")
    assert seen == {"rejects", "accepts all"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_equals_draft_probs_of_the_softmax(backend):
    """draft_logits=L gives the tokens of draft_probs=softmax(L / T) through the same backend."""
    B, K, V = 3, 4, 90
    logits, L, g = _step(B, K, V, V, seed=7)
    temperature = torch.tensor([0.5, 1.0, 2.0])
    x = _drafts(L, temperature, g)
    for s in range(3):
        kw = dict(temperature=_dev(temperature), seed=_dev(torch.tensor([s, s + 10, s + 20])), backend=backend)
        a = fused_verify(_dev(logits), _dev(x), draft_logits=_dev(L), **kw)
        b = fused_verify(_dev(logits), _dev(x), _dev(_softmax_probs(L, temperature)), **kw)
        assert torch.equal(a.tokens.cpu(), b.tokens.cpu()) and torch.equal(a.num_accepted.cpu(), b.num_accepted.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_unusable_draft_logits_mark_the_row_that_reads_them(backend):
    """A NaN, a +inf, a logit whose l / T overflows fp32, or a position without a finite logit:
    q is NaN there (the reference's softmax of it), so a sampling row whose drafts read the position
    is invalid; a greedy row ignores q; a position past the row's stop or K_b is not read."""
    B, K, V = 6, 2, 20
    logits, L, _ = _step(B, K, V, V, seed=21, neg_inf=False)
    x = logits[:, :K].argmax(-1)  # likely accepted at T = 1
    L[0, 0, 3] = float("nan")
    L[1, 0, 4] = float("inf")
    L[2, 1, 5] = 3e38  # finite, but l / T = 6e38 overflows at T = 0.5
    L[3, 0] = float("-inf")  # no finite logit
    L[4, 1, 6] = float("nan")  # row 4: the greedy one
    L[5, 1, 7] = float("nan")  # row 5: K_b = 1, position 1 is not read
    temperature = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.0, 1.0])
    kb = torch.tensor([2, 2, 2, 2, 2, 1])
    u = torch.full((B, K + 1), 0.3, dtype=torch.float64)
    out = fused_verify(_dev(logits), _dev(x), draft_logits=_dev(L), num_draft_tokens=_dev(kb),
                       temperature=_dev(temperature), uniforms=_dev(u), backend=backend)
    rt, rn = verify_reference(logits, x, None, kb, temperature, None, None, u, draft_logits=L)
    assert torch.equal(out.num_accepted.cpu(), rn) and torch.equal(out.tokens.cpu(), rt)
    n = rn.tolist()
    assert n[0] == n[1] == n[3] == -1 and (rt[[0, 1, 3]] == -1).all()
    assert n[4] >= 0 and n[5] >= 0
    # row 2 reads position 1 only if it accepts draft 0
    assert n[2] == -1 or n[2] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rejected_draft_past_vd_reads_its_unusable_row_in_the_final_draw(backend):
    """x >= Vd has q(x) = 0 whatever the row holds (so the test accepts when p(x) > 0); a rejected
    one (p(x) = 0) then draws from the residual p - q_j, whose unusable q_j makes the row invalid,
    as with a NaN row of draft_probs."""
    V, Vd = 8, 5
    logits = torch.zeros(3, 2, V)
    logits[:, 0, 6] = float("-inf")  # p(6) = 0: draft 6 is rejected
    L = torch.zeros(3, 1, Vd)
    L[0, 0, 2] = float("nan")
    L[1, 0] = float("-inf")  # no finite logit (its q_j would otherwise read as zeros)
    x = torch.tensor([[6], [6], [6]])
    u = torch.full((3, 2), 0.5, dtype=torch.float64)
    out = fused_verify(_dev(logits), _dev(x), draft_logits=_dev(L), uniforms=_dev(u), backend=backend)
    rt, rn = verify_reference(logits, x, None, torch.ones(3, dtype=torch.int64), torch.ones(3), None, None, u,
                              draft_logits=L)
    assert rn.tolist() == [-1, -1, 0]
    assert torch.equal(out.num_accepted.cpu(), rn) and torch.equal(out.tokens.cpu(), rt)
    logits[:, 0, 6] = 0.0  # p(6) > 0 = q(6): accepted, the unusable rows are never drawn from
    out = fused_verify(_dev(logits), _dev(x), draft_logits=_dev(L), uniforms=_dev(u), backend=backend)
    assert out.num_accepted.tolist() == [1, 1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_probabilities_in_logprobs_and_out_take_draft_logits(backend):
    """target_is_probs, return_logprobs and out= with draft_logits: the reference's tokens, and the
    reference's log-probabilities of them."""
    B, K, V = 3, 3, 40
    logits, L, g = _step(B, K, V, 30, seed=33)
    temperature = torch.tensor([1.0, 0.0, 1.0])
    x = _drafts(L, temperature, g)
    p = torch.softmax(logits, -1)
    kb = torch.tensor([3, 2, 1])
    u = philox_uniforms(torch.tensor([4, 5, 6]), torch.zeros(3, dtype=torch.int64), K)
    for probs in (False, True):
        target = p if probs else logits
        buf = (torch.empty(B, K + 1, dtype=torch.int32, device=DEV), torch.empty(B, dtype=torch.int32, device=DEV),
               torch.empty(B, K + 1, device=DEV))
        out = fused_verify(_dev(target), _dev(x), draft_logits=_dev(L), num_draft_tokens=_dev(kb),
                           temperature=_dev(temperature), uniforms=_dev(u), backend=backend, target_is_probs=probs,
                           return_logprobs=True, out=buf)
        rt, rn = verify_reference(target, x, None, kb, temperature, None, None, u, target_is_probs=probs,
                                  draft_logits=L)
        assert out.tokens is buf[0] and torch.equal(buf[0].long().cpu(), rt) and torch.equal(buf[1].long().cpu(), rn)
        want = emitted_logprobs(target, rt, rn, temperature, None, None, target_is_probs=probs)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(buf[2].cpu())) and fin[:, 0].all()
        torch.testing.assert_close(buf[2].cpu()[fin], want[fin], atol=1e-5, rtol=1.3e-6)


@pytest.mark.slow
def test_arrival_order_does_not_change_the_draft_records(split_settings):
    """Work items claimed in three random orders: the draft's position records (m_d, S_d, bad_d)
    and the tokens are bit-identical to the in-order launch's (the combine sums in chunk order)."""
    from test_verify_split import _permuted_order

    split_settings(chunk=32)
    B, K, V, Vd = 3, 3, 150, 140  # 5 chunks a position
    logits, L, g = _step(B, K, V, Vd, seed=9)
    temperature = torch.tensor([1.0, 0.0, 0.8])
    x = _drafts(L, temperature, g)
    kb = torch.tensor([3, 1, 2])
    args, _, _ = _verify_args._normalize_packed(*(_dev(t) for t in _pack(logits, x, None, kb)[:3]), None, K,
                                              _dev(temperature), None, None, _dev(torch.tensor([4, 5, 6])), 0,
                                              None, False, draft_logits=_dev(_pack(logits, x, L, kb)[3]))
    lay = _verify_launch._Layout(B, K, _dev(torch.cat([torch.zeros(1, dtype=torch.int64), kb.cumsum(0)])),
                             draft_logits=True)
    NC = 5

    def run(order=None):
        tokens, num, _ = _verify_launch._launch(args, lay, None if order is None else _dev(order))
        rec = split_workspace(DEV).records(B, K + 1, NC, draft_logits=True)
        return tokens.cpu(), num.cpu(), {k: rec[k].cpu().clone() for k in ("m_d", "S_d", "bad_d")}

    want_t, want_n, want_rec = run()
    u = philox_uniforms(torch.tensor([4, 5, 6]), torch.zeros(3, dtype=torch.int64), K)
    rt, rn = verify_reference(logits, x, None, kb, temperature, None, None, u, draft_logits=L)
    assert torch.equal(want_t, rt) and torch.equal(want_n, rn)
    # the records are the draft's softmax statistics of the sampled rows' draft positions
    inv_t = _inv_t(temperature)
    for b, i in ((0, 0), (0, 2), (2, 1)):
        s = L[b, i].float() * inv_t[b]
        assert want_rec["m_d"][b, i] == s.max() and want_rec["bad_d"][b, i] == 0
        torch.testing.assert_close(want_rec["S_d"][b, i], torch.exp(s - s.max()).sum(), atol=0, rtol=1e-5)
    rng = random.Random(5)
    for _ in range(3):
        order, _ = _permuted_order(rng, B, K + 1, NC)
        t, n, rec = run(order)
        assert torch.equal(t, want_t) and torch.equal(n, want_n)
        for b in range(B):
            for i in range(int(kb[b])):
                if temperature[b] == 0:
                    continue
                for k in ("m_d", "S_d", "bad_d"):
                    assert rec[k][b, i].view(torch.int32) == want_rec[k][b, i].view(torch.int32), (k, b, i)


# ---------------------------------------------------------------------------------------------
# 3. Distribution: the first emitted token's law, and a mutant that takes q at T = 1
# ---------------------------------------------------------------------------------------------
N_TRIALS = 100_000
SIGNIFICANCE = 1e-4  # test_verify_distribution's
DIST_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_CUDA,
    reason="100,000-row kernel runs need a GPU; on CPU the kernel is checked exactly against the torch path"))]


def first_token_law(p: np.ndarray, q_sample: np.ndarray, q_verify: np.ndarray) -> np.ndarray:
    """The law (float64) of the first emitted token when x ~ q_sample is verified against p with
    q_verify: accepted with min(1, p(x) / q_verify(x)), else a draw from norm(max(0, p - q_verify))
    (p itself if that is zero).  With q_verify = q_sample it is p."""
    ratio = np.where(q_verify > 0, np.minimum(1.0, p / np.where(q_verify > 0, q_verify, 1.0)), 1.0)
    accepted = q_sample * ratio
    residual = np.maximum(p - q_verify, 0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return accepted + (1.0 - accepted.sum()) * residual


def _dist_case():
    """K = 2, V = 12, T = 0.5: target and draft logits (float64), q_T = softmax(l / 0.5)."""
    g = torch.Generator().manual_seed(101)
    logits = torch.randn(3, 12, generator=g, dtype=torch.float64) * 1.5
    L = torch.randn(2, 12, generator=g, dtype=torch.float64) * 1.5
    return logits, L, 0.5


def _first_tokens(backend, logits, L, T):
    dev = torch.device("cuda" if backend == "triton" else "cpu")
    g = torch.Generator().manual_seed(2024)
    q = torch.softmax(L / T, -1)
    x = torch.stack([torch.multinomial(q[i], N_TRIALS, replacement=True, generator=g) for i in range(2)], 1)
    out = fused_verify(logits.float()[None].expand(N_TRIALS, -1, -1).to(dev), x.to(dev),
                       draft_logits=L.float()[None].expand(N_TRIALS, -1, -1).to(dev),
                       temperature=torch.full((N_TRIALS,), T, device=dev),
                       seed=torch.arange(N_TRIALS, dtype=torch.int64, device=dev), offset=3, backend=backend)
    n = out.num_accepted.cpu().numpy()
    assert (n >= 0).all()
    return out.tokens[:, 0].cpu().numpy(), x[:, 0].numpy(), n


@pytest.mark.slow
@pytest.mark.parametrize("backend", DIST_BACKENDS)
def test_first_token_follows_its_exact_law(backend):
    """Chi-square (significance 1e-4, 100,000 trials, bins of expected count < 5 merged) of the
    first emitted token against its exact law from p_1 and q_1 = softmax(l_1 / T) (float64; it is
    p_1), and a z-test (|z| < 5) of x_1's acceptance rate against sum_v min(p_1, q_1)."""
    logits, L, T = _dist_case()
    p1 = expected_probs(logits[0], T, None, None)
    q1 = torch.softmax(L[0] / T, -1).numpy()
    law = first_token_law(p1, q1, q1)
    assert np.abs(law - p1).max() < 1e-12
    tokens, _, n = _first_tokens(backend, logits, L, T)
    pv = chi_square_pvalue(tokens, law)
    assert pv > SIGNIFICANCE, f"first token does not follow its law: chi-square p = {pv:.3g}"
    alpha = float(np.minimum(p1, q1).sum())
    z = ((n >= 1).mean() - alpha) / np.sqrt(alpha * (1 - alpha) / N_TRIALS)
    assert abs(z) < Z_BOUND, f"acceptance rate of x_1 is off sum min(p, q): z = {z:.2f}"


@pytest.mark.slow
def test_mutant_q_at_temperature_1_is_caught(monkeypatch):
    """q computed at T = 1 instead of the row's T (the drafts still sampled at T): the same
    statistic rejects the first token's law (its total variation from p_1 is ~0.09 here), and
    the mutant's tokens follow the law predicted for it (so the test sees what it should)."""
    orig = chain_reference.draft_softmax
    monkeypatch.setattr(chain_reference, "draft_softmax", lambda logits, inv_t: orig(logits, torch.ones_like(inv_t)))
    logits, L, T = _dist_case()
    p1 = expected_probs(logits[0], T, None, None)
    q1 = torch.softmax(L[0] / T, -1).numpy()
    law_mutant = first_token_law(p1, q1, torch.softmax(L[0], -1).numpy())
    assert 0.5 * np.abs(law_mutant - p1).sum() > 0.05
    tokens, _, _ = _first_tokens("torch", logits, L, T)
    pv = chi_square_pvalue(tokens, first_token_law(p1, q1, q1))
    assert pv < SIGNIFICANCE, f"the mutant (q at T = 1) was not detected (p = {pv:.3g})"
    assert chi_square_pvalue(tokens, law_mutant) > SIGNIFICANCE


# ---------------------------------------------------------------------------------------------
# 4. Argument errors
# ---------------------------------------------------------------------------------------------
def test_argument_errors_name_draft_logits():
    logits, L, g = _step(2, 2, 16, 16, seed=50)
    x = _drafts(L, torch.ones(2), g)
    q = torch.softmax(L, -1)
    with pytest.raises(ValueError, match="draft_probs and draft_logits are exclusive.*got a Tensor for draft_probs "
                                         "and a Tensor for draft_logits"):
        fused_verify(logits, x, q, draft_logits=L)
    with pytest.raises(ValueError, match=r"draft_logits must have shape \[2, 2, 16\], got \[2, 1, 16\]"):
        fused_verify(logits, x, draft_logits=L[:, :1])
    with pytest.raises(ValueError, match=r"draft_logits must have 3 dims \[B, K, Vd\], got 2: \[2, 16\]"):
        fused_verify(logits, x, draft_logits=L[0])
    with pytest.raises(ValueError, match=r"draft_logits must have a vocabulary 1 <= Vd <= V = 16, got Vd = 17"):
        fused_verify(logits, x, draft_logits=torch.cat([L, L[..., :1]], -1))
    with pytest.raises(TypeError, match="draft_logits must have dtype float32 or bfloat16 or float16, got float64"):
        fused_verify(logits, x, draft_logits=L.double())
    with pytest.raises(TypeError, match="draft_logits must have dtype float32 or bfloat16 or float16, got int64"):
        fused_verify(logits, x, draft_logits=L.long())
    with pytest.raises(ValueError, match=r"draft_logits must be on cpu \(the device of target_logits\), got meta"):
        fused_verify(logits, x, draft_logits=L.to("meta"))
    with pytest.raises(TypeError, match="draft_logits must be a torch.Tensor or None, got list"):
        fused_verify(logits, x, draft_logits=L.tolist())
    with pytest.raises(ValueError, match="draft_probs and draft_logits are exclusive"):
        verify_reference(logits, x, q, torch.full((2,), 2), torch.ones(2), None, None, torch.zeros(2, 3),
                         draft_logits=L)


def test_packed_argument_errors_name_draft_logits():
    logits, L, g = _step(2, 2, 16, 12, seed=51)
    x = _drafts(L, torch.ones(2), g)
    pl, px, cu, pL = _pack(logits, x, L, torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="draft_probs and draft_logits are exclusive"):
        fused_verify_packed(pl, px, cu, torch.softmax(pL, -1), draft_logits=pL)
    with pytest.raises(ValueError, match=r"draft_logits must have shape \[3, 12\], got \[2, 12\]"):
        fused_verify_packed(pl, px, cu, draft_logits=pL[:2])
    with pytest.raises(TypeError, match="draft_logits must have dtype float32 or bfloat16 or float16, got float64"):
        fused_verify_packed(pl, px, cu, draft_logits=pL.double())
    with pytest.raises(ValueError, match=r"draft_logits must be on cpu \(the device of target_logits\), got meta"):
        fused_verify_packed(pl, px, cu, draft_logits=pL.to("meta"))


def test_draft_logits_need_not_sum_to_anything():
    """The host's sum check is draft_probs' only: logits of any scale are accepted."""
    logits, L, g = _step(2, 2, 16, 16, seed=52)
    x = _drafts(L, torch.ones(2), g)
    out = fused_verify(logits, x, draft_logits=torch.full_like(L, 100.0), seed=1, backend="torch")
    assert (out.num_accepted >= 0).all()


def test_torch_compile_refuses_draft_logits(monkeypatch):
    logits, L, g = _step(2, 2, 16, 16, seed=53)
    x = _drafts(L, torch.ones(2), g)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(NotImplementedError, match="with draft_logits, .* are eager ops"):
        fused_verify(logits, x, draft_logits=L, seed=1, backend="torch")
    monkeypatch.undo()
    # through torch.compile itself: the same error, as dynamo reports it
    step = torch.compile(lambda lg, x_, l_: fused_verify(lg, x_, draft_logits=l_, seed=1), fullgraph=True,
                         backend="aot_eager")
    with pytest.raises(Exception, match="NotImplementedError.*with draft_logits, .* are eager ops"):
        step(logits, x, L)


# ---------------------------------------------------------------------------------------------
# 5. Seeded determinism
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_seed_same_tokens(backend):
    B, K, V = 4, 3, 50
    logits, L, g = _step(B, K, V, 45, seed=60, scale=1.0)
    temperature = torch.tensor([1.0, 0.9, 1.2, 0.0])
    x = _drafts(L, temperature, g)
    kw = dict(draft_logits=_dev(L), temperature=_dev(temperature), offset=7, backend=backend)
    a = fused_verify(_dev(logits), _dev(x), seed=123, **kw)
    b = fused_verify(_dev(logits), _dev(x), seed=123, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    others = [fused_verify(_dev(logits), _dev(x), seed=s, **kw).tokens.cpu() for s in (124, 125, 126)]
    assert any(not torch.equal(o, a.tokens.cpu()) for o in others), "the seed must matter"
