"""``specdec_kernels.integrations.flashinfer.chain_speculative_sampling``: FlashInfer's contract on
``fused_verify(target_is_probs=True)``.

1. Contract: int32 [B, K+1] tokens, -1 after the emitted ones, the counters (int32 [B], added to
   in place when given, the same tensors returned), FlashInfer's docstring example.
2. Exact: the tokens of ``verify_reference(..., target_is_probs=True)`` with the Philox uniforms of
   ``row_keys(seed, offset)``, and those of ``fused_verify`` drawing its own numbers from the same
   keys (torch path; the Triton kernel under the interpreter on small cases).
3. The independent-acceptance counter equals a direct float64 count from the same uniforms, and
   the op's prefix equals the first failing test of that count.
4. Law: chi-square (significance 1e-4, 100,000 rows of one call with one int seed, bins of
   expected count < 5 merged) of the first emitted token against a0 [x0] + (1 - a0)
   norm(max(0, p0 - q0)) for a fixed draft x0, and against p0 for x0 ~ q0; a mutant that draws
   the recovered token from p instead of the residual must be rejected by the same statistic.
5. Determinism: a seed, or a generator, gives reproducible output; a row's output does not
   depend on the other rows.
6. Against the real FlashInfer, in law, where it and a GPU are present (skipped otherwise).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from helpers import HAS_CUDA
from helpers import make_step
from specdec_kernels import fused_verify
from specdec_kernels.ops.verify.reference import chain as chain_reference
from specdec_kernels.integrations.flashinfer import chain_speculative_sampling, row_keys
from specdec_kernels.ops.reference import philox_uniforms, verify_reference
from helpers import chi_square_pvalue

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.slow)]  # the kernel, interpreted on a CPU: slow
SIGNIFICANCE = 1e-4
N = 100_000


def _dev(t):
    return None if t is None else t.to(DEV)


def _step(B, K, V, seed, noise=1.5):
    """target_probs [B, K+1, V], draft_token_ids [B, K], draft_probs [B, K, V] on DEV, with q far
    enough from p that rows reject at various positions."""
    logits, x, q = make_step(B, K, V, seed=seed, draft_noise=noise)
    return _dev(torch.softmax(logits, -1)), _dev(x), _dev(q)


def _reference(p, x, q, u):
    """verify_reference's (tokens, num_accepted) on CPU for target probabilities."""
    B, K = x.shape
    return verify_reference(p.cpu(), x.cpu(), q.cpu(), torch.full((B,), K), torch.ones(B), None, None, u.cpu(),
                            target_is_probs=True)


# ---------------------------------------------------------------------------------------------
# 1. Contract
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_counters_and_padding(backend):
    B, K, V = (6, 4, 24) if backend == "torch" else (3, 3, 16)
    p, x, q = _step(B, K, V, seed=1)
    tokens, acc, emi = chain_speculative_sampling(q, x, p, seed=3, offset=5, backend=backend)
    assert tokens.dtype == torch.int32 and list(tokens.shape) == [B, K + 1]
    assert acc.dtype == torch.int32 and emi.dtype == torch.int32 and list(acc.shape) == list(emi.shape) == [B]
    t, a, e = tokens.cpu(), acc.cpu(), emi.cpu()
    cols = torch.arange(K + 1)[None, :]
    assert torch.equal(t >= 0, cols <= e[:, None])  # emitted tokens, then -1 to the end
    assert torch.equal(e, (t >= 0).sum(1).int() - 1)  # the counter = tokens emitted - 1
    assert torch.equal(t[:, :K][cols[:, :K] < e[:, None]], x.cpu().int()[cols[:, :K] < e[:, None]])  # accepted drafts
    assert (a >= e).all() and (a <= K).all()
    # the emitted counter is the op's num_accepted (the op drawing its own numbers from the same keys)
    op = fused_verify(p, x, q, target_is_probs=True, seed=row_keys(3, 5, B, p.device)[0], offset=5, backend=backend)
    assert torch.equal(e.long(), op.num_accepted.cpu())
    assert 0 < int(e.sum()) < B * K  # the case does reject and accept


def test_counters_are_added_to_in_place_and_returned():
    B, K, V = 5, 3, 20
    p, x, q = _step(B, K, V, seed=2)
    _, acc1, emi1 = chain_speculative_sampling(q, x, p, seed=9)
    for dtype in (torch.int32, torch.int64):  # int64 too (FlashInfer's op would drop its increment)
        acc0 = _dev(torch.tensor([100, 0, 7, 3, 1], dtype=dtype))
        emi0 = _dev(torch.tensor([5, 6, 7, 8, 9], dtype=dtype))
        start_a, start_e = acc0.clone(), emi0.clone()
        tokens, acc, emi = chain_speculative_sampling(q, x, p, acc0, emi0, seed=9)
        assert acc is acc0 and emi is emi0 and acc.dtype == dtype
        assert torch.equal(acc.cpu(), (start_a + acc1.to(dtype)).cpu())
        assert torch.equal(emi.cpu(), (start_e + emi1.to(dtype)).cpu())
        chain_speculative_sampling(q, x, p, acc0, emi0, seed=9)  # accumulates again
        assert torch.equal(emi.cpu(), (start_e + 2 * emi1.to(dtype)).cpu())


def test_flashinfer_docstring_example():
    """FlashInfer's own example: draft 2 is accepted (p = 0.6 > q = 0.3), draft 1 is rejected
    (p = 0), and the residual max(0, p - q) at position 1 has all its mass on token 0: the output
    is the same for every seed."""
    draft_probs = _dev(torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]]))
    draft_token_ids = _dev(torch.tensor([[2, 1]], dtype=torch.int32))
    target_probs = _dev(torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]]))
    for kw in (dict(seed=0), dict(seed=123, offset=4), dict(generator=torch.Generator(DEV).manual_seed(0)), {}):
        tokens, acc, emi = chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, **kw)
        assert tokens.cpu().tolist() == [[2, 0, -1]]
        assert acc.cpu().tolist() == [1] and emi.cpu().tolist() == [1]


def test_no_drafts_emit_the_bonus_token():
    B, V = 3, 10
    p = _dev(torch.softmax(torch.randn(B, 1, V, generator=torch.Generator().manual_seed(4)), -1))
    q, x = torch.empty(B, 0, V), torch.empty(B, 0, dtype=torch.int64)
    tokens, acc, emi = chain_speculative_sampling(_dev(q), _dev(x), p, seed=1)
    assert list(tokens.shape) == [B, 1] and (tokens >= 0).all()
    assert acc.cpu().tolist() == [0] * B and emi.cpu().tolist() == [0] * B
    u = philox_uniforms(*row_keys(1, None, B, "cpu"), 0)
    assert torch.equal(tokens.cpu().long(), _reference(p, x, q, u)[0])


def test_an_unusable_row_emits_nothing_and_counts_nothing():
    B, K, V = 4, 3, 16
    p, x, q = _step(B, K, V, seed=5)
    p = p.clone()
    p[1, 0, 3] = float("nan")
    p[2, 0] = 0.0  # no mass
    acc0, emi0 = _dev(torch.full((B,), 10, dtype=torch.int32)), _dev(torch.full((B,), 10, dtype=torch.int32))
    tokens, acc, emi = chain_speculative_sampling(q, x, p, acc0, emi0, seed=2)
    assert (tokens[1:3] == -1).all() and acc.cpu().tolist()[1:3] == [10, 10] and emi.cpu().tolist()[1:3] == [10, 10]
    assert (tokens[[0, 3], 0] >= 0).all()


def test_float64_inputs_are_read_as_float32_and_half_inputs_as_they_are():
    B, K, V = 3, 2, 12
    p, x, q = _step(B, K, V, seed=6)
    base = chain_speculative_sampling(q, x, p, seed=4)
    wide = chain_speculative_sampling(q.double(), x.int(), p.double(), seed=4)
    for a, b in zip(base, wide):
        assert torch.equal(a, b)
    tokens, _, _ = chain_speculative_sampling(q.bfloat16(), x, p.bfloat16(), seed=4)
    u = philox_uniforms(*row_keys(4, 0, B, "cpu"), K)
    assert torch.equal(tokens.cpu().long(), _reference(p.bfloat16(), x, q.bfloat16(), u)[0])


@pytest.mark.parametrize("case, error, match", [
    ("target_list", TypeError, r"target_probs must be a torch.Tensor, got list"),
    ("target_2d", ValueError, r"target_probs must have 3 dims \[B, K\+1, V\], got 2"),
    ("target_int", TypeError, r"target_probs must have dtype float32 or bfloat16 or float16 or float64, got int64"),
    ("draft_probs_shape", ValueError, r"draft_probs must have shape \[B, K, V\] = \[2, 3, 8\], got \[2, 3, 7\]"),
    ("draft_probs_dims", ValueError, r"draft_probs must have 3 dims \[B, K, V\], got 2"),
    ("ids_shape", ValueError, r"draft_token_ids must have shape \[B, K\] = \[2, 3\], got \[2, 2\]"),
    ("ids_dtype", TypeError, r"draft_token_ids must have dtype int32 or int64, got float32"),
    ("ids_numpy", TypeError, r"draft_token_ids must be a torch.Tensor, got ndarray"),
    ("counter_shape", ValueError, r"maybe_output_accepted_token_num must have shape \[B\] = \[2\], got \[3\]"),
    ("counter_dtype", TypeError, r"maybe_output_emitted_draft_token_num must have dtype int32 or int64, got float32"),
    ("seed_float", TypeError, r"seed must be an int or a 1-D int64 tensor of length 1 or B = 2, got float"),
    ("seed_len", ValueError, r"seed must be an int or a 1-D tensor of length 1 or B = 2, got shape \[3\]"),
    ("offset_dtype", TypeError, r"offset must have dtype int32 or int64"),
    ("seed_range", ValueError, r"seed must fit in 64 bits"),
    ("generator", TypeError, r"generator must be a torch.Generator or None, got int"),
    ("draft_sum", ValueError, r"draft_probs\[0, 0\] must sum to 1"),
])
def test_errors_name_flashinfer_arguments(case, error, match):
    B, K, V = 2, 3, 8
    p, x, q = (t.cpu() for t in _step(B, K, V, seed=7))
    args = dict(draft_probs=q, draft_token_ids=x, target_probs=p)
    kw = {}
    if case == "target_list":
        args["target_probs"] = p.tolist()
    elif case == "target_2d":
        args["target_probs"] = p[0]
    elif case == "target_int":
        args["target_probs"] = p.long()
    elif case == "draft_probs_shape":
        args["draft_probs"] = q[..., :7]
    elif case == "draft_probs_dims":
        args["draft_probs"] = q[0]
    elif case == "ids_shape":
        args["draft_token_ids"] = x[:, :2]
    elif case == "ids_dtype":
        args["draft_token_ids"] = x.float()
    elif case == "ids_numpy":
        args["draft_token_ids"] = x.numpy()
    elif case == "counter_shape":
        kw["maybe_output_accepted_token_num"] = torch.zeros(3, dtype=torch.int32)
    elif case == "counter_dtype":
        kw["maybe_output_emitted_draft_token_num"] = torch.zeros(2)
    elif case == "seed_float":
        kw["seed"] = 1.5
    elif case == "seed_len":
        kw["seed"] = torch.zeros(3, dtype=torch.int64)
    elif case == "offset_dtype":
        kw.update(seed=1, offset=torch.zeros(2))
    elif case == "seed_range":
        kw["seed"] = 2**64
    elif case == "generator":
        kw["generator"] = 5
    elif case == "draft_sum":
        args["draft_probs"] = q * 2
    with pytest.raises(error, match=match):
        chain_speculative_sampling(**args, **kw)


# ---------------------------------------------------------------------------------------------
# 2. Exact: the reference's tokens with the same uniforms
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_equal_the_reference_and_the_op_with_the_same_keys(backend):
    cases = ([(5, 4, 37, 10), (1, 1, 2, 11), (7, 6, 111, 12)] if backend == "torch" else [(3, 2, 16, 13)])
    for B, K, V, seed in cases:
        p, x, q = _step(B, K, V, seed=seed)
        for s, o in [(0, 0), (2**40 + 3, 7), (torch.arange(B) * 977, torch.arange(B)),
                     (torch.tensor([2**63 - 5]), torch.tensor([3])), (2**64 - 1, None)]:
            s_d = _dev(s) if isinstance(s, torch.Tensor) else s
            o_d = _dev(o) if isinstance(o, torch.Tensor) else o
            tokens, acc, emi = chain_speculative_sampling(q, x, p, seed=s_d, offset=o_d, backend=backend)
            keys = row_keys(s, o, B, "cpu")
            rows = torch.arange(B, dtype=torch.int64) << 32  # the documented key: seed_b XOR (b << 32)
            s_b = torch.full((B,), s if s < 2**63 else s - 2**64) if isinstance(s, int) else s.expand(B)
            assert torch.equal(keys[0], s_b ^ rows)
            rt, rn = _reference(p, x, q, philox_uniforms(*keys, K))
            assert torch.equal(tokens.cpu().long(), rt) and torch.equal(emi.cpu().long(), rn)
            op = fused_verify(p, x, q, target_is_probs=True, seed=_dev(keys[0]), offset=_dev(keys[1]), backend=backend)
            assert torch.equal(tokens.cpu().long(), op.tokens.cpu())
            if backend == "triton":
                break  # one draw per case under the interpreter: it is slow


# ---------------------------------------------------------------------------------------------
# 3. The independent-acceptance counter
# ---------------------------------------------------------------------------------------------
def _direct_counts(p, x, q, u):
    """(first failing test [B], number of passing tests [B]) of u_i * q_i(x_i) < p_i(x_i), with
    p_i normalised, computed in float64 from the definitions."""
    p64 = p.cpu().double()
    p64 = p64 / p64.sum(-1, keepdim=True)
    B, K = x.shape
    xi = x.cpu().long()[..., None]
    p_x = p64[:, :K].gather(-1, xi)[..., 0]
    q_x = q.cpu().double().gather(-1, xi)[..., 0]
    passes = u.cpu()[:, :K].double() * q_x < p_x  # [B, K]
    first_fail = torch.where(~passes, torch.arange(K), K).amin(-1) if K else torch.zeros(B, dtype=torch.int64)
    return first_fail, passes.sum(-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accepted_counter_is_the_independent_count_of_the_same_uniforms(backend):
    cases = [(16, 6, 50, s) for s in range(20, 26)] if backend == "torch" else [(4, 4, 16, 20)]
    total_after = 0
    for B, K, V, seed in cases:
        p, x, q = _step(B, K, V, seed=seed, noise=2.0)
        for mode in ("seed", "generator"):
            if mode == "seed":
                tokens, acc, emi = chain_speculative_sampling(q, x, p, seed=seed, offset=1, backend=backend)
                u = philox_uniforms(*row_keys(seed, 1, B, "cpu"), K)
            else:
                g = torch.Generator(DEV).manual_seed(seed)
                tokens, acc, emi = chain_speculative_sampling(q, x, p, generator=g, backend=backend)
                # the documented draw: one torch.rand((B, K+1), float64) from the generator
                u = torch.rand((B, K + 1), dtype=torch.float64, generator=torch.Generator(DEV).manual_seed(seed),
                               device=DEV)
            first_fail, n_pass = _direct_counts(p, x, q, u)
            assert torch.equal(emi.cpu().long(), first_fail)  # the op's prefix is the tests' prefix
            assert torch.equal(acc.cpu().long(), n_pass)
            # the same with the op's own rule (p normalised in fp32, u * q(x) < p(x) in float64)
            p_x = (p.cpu() / p.cpu().sum(-1, keepdim=True))[:, :K].gather(-1, x.cpu().long()[..., None])[..., 0]
            q_x = q.cpu().gather(-1, x.cpu().long()[..., None])[..., 0]
            assert torch.equal(acc.cpu().long(), chain_reference.acceptance_test(u.cpu()[:, :K], p_x, q_x).sum(-1))
            total_after += int((acc - emi).sum())
            if backend == "triton":
                break
    assert total_after > 0  # drafts after a rejection were counted


# ---------------------------------------------------------------------------------------------
# 4. The law of the first emitted token
# ---------------------------------------------------------------------------------------------
def _law_case():
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], dtype=torch.float64)
    q0 = torch.tensor([0.05, 0.05, 0.40, 0.30, 0.10, 0.10], dtype=torch.float64)
    p1 = torch.tensor([0.10, 0.20, 0.30, 0.20, 0.10, 0.10], dtype=torch.float64)
    q1 = torch.tensor([0.20, 0.20, 0.20, 0.20, 0.10, 0.10], dtype=torch.float64)
    p2 = torch.full((6,), 1 / 6, dtype=torch.float64)
    return torch.stack([p0, p1, p2]), torch.stack([q0, q1])


def _first_tokens(p, q, x, mode):
    B, K = x.shape
    target = p.float()[None].expand(B, -1, -1)
    draft = q.float()[None].expand(B, -1, -1)
    kw = dict(seed=2024, offset=3) if mode == "seed" else dict(generator=torch.Generator().manual_seed(2024))
    tokens, _, _ = chain_speculative_sampling(draft, x, target, backend="torch", **kw)
    return tokens[:, 0].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["seed", "generator"])
def test_first_token_follows_the_speculative_law_and_a_mutant_fails(mode, monkeypatch):
    """One call of N = 100,000 rows with the same inputs (one int seed: the rows differ by their
    keys), torch path.  Fixed draft x0 = 2 (p0 = 0.2, q0 = 0.4, a0 = 0.5): the first token
    follows 0.5 [2] + 0.5 norm(max(0, p0 - q0)); drafts x0 ~ q0: it follows p0.  Chi-square
    p-values must exceed 1e-4; the mutant (recovered token drawn from p) must fall below it."""
    p, q = _law_case()
    g = torch.Generator().manual_seed(5)
    x_fixed = torch.tensor([2, 1])[None].expand(N, -1)
    x_sampled = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(2)], 1)
    a0 = float(torch.clamp(p[0, 2] / q[0, 2], max=1.0))
    residual = torch.clamp(p[0] - q[0], min=0.0)
    law = (a0 * torch.eye(6, dtype=torch.float64)[2] + (1 - a0) * residual / residual.sum()).numpy()
    assert chi_square_pvalue(_first_tokens(p, q, x_fixed, mode), law) > SIGNIFICANCE
    assert chi_square_pvalue(_first_tokens(p, q, x_sampled, mode), p[0].numpy()) > SIGNIFICANCE
    monkeypatch.setattr(chain_reference, "_residual", lambda p_, q_: p_)  # mutant: the recovered token from p
    assert chi_square_pvalue(_first_tokens(p, q, x_fixed, mode), law) < SIGNIFICANCE
    assert chi_square_pvalue(_first_tokens(p, q, x_sampled, mode), p[0].numpy()) < SIGNIFICANCE


# ---------------------------------------------------------------------------------------------
# 5. Determinism
# ---------------------------------------------------------------------------------------------
def _same(a, b):
    return all(torch.equal(s, t) for s, t in zip(a, b))


def test_a_seed_gives_the_same_output_and_a_row_ignores_the_others():
    B, K, V = 8, 4, 30
    p, x, q = _step(B, K, V, seed=30)
    a = chain_speculative_sampling(q, x, p, seed=77, offset=4)
    assert _same(a, chain_speculative_sampling(q, x, p, seed=77, offset=4, deterministic=False))
    assert _same(a, chain_speculative_sampling(q, x, p, seed=_dev(torch.tensor([77])), offset=_dev(torch.tensor([4]))))
    assert _same(a, chain_speculative_sampling(q, x, p, seed=_dev(torch.full((B,), 77)), offset=4))
    assert _same(chain_speculative_sampling(q, x, p, seed=77), chain_speculative_sampling(q, x, p, seed=77, offset=0))
    outs = [chain_speculative_sampling(q, x, p, seed=77, offset=o)[0] for o in range(5)]
    assert len({tuple(t.flatten().tolist()) for t in outs}) > 1  # other offsets, other numbers
    # rows 0..3 with the other rows' inputs changed: the same outputs
    p2, x2, q2 = _step(B, K, V, seed=31)
    p2[:4], x2[:4], q2[:4] = p[:4], x[:4], q[:4]
    b = chain_speculative_sampling(q2, x2, p2, seed=77, offset=4)
    assert torch.equal(a[0][:4], b[0][:4]) and torch.equal(a[1][:4], b[1][:4]) and torch.equal(a[2][:4], b[2][:4])
    # an int seed gives every row its own numbers: identical rows do not all emit the same
    same_rows = chain_speculative_sampling(q[:1].expand(64, -1, -1), x[:1].expand(64, -1), p[:1].expand(64, -1, -1),
                                           seed=77)
    assert len({tuple(r) for r in same_rows[0].tolist()}) > 1


def test_a_generator_gives_reproducible_output():
    B, K, V = 8, 4, 30
    p, x, q = _step(B, K, V, seed=32)
    g1, g2 = torch.Generator(DEV).manual_seed(11), torch.Generator(DEV).manual_seed(11)
    first = chain_speculative_sampling(q, x, p, generator=g1)
    assert _same(first, chain_speculative_sampling(q, x, p, generator=g2))
    second = chain_speculative_sampling(q, x, p, generator=g1)  # the generator has advanced
    assert _same(second, chain_speculative_sampling(q, x, p, generator=g2))
    assert not _same(first, second)
    # a given seed takes precedence over the generator, which is then not drawn from
    state = g1.get_state()
    assert _same(chain_speculative_sampling(q, x, p, seed=5), chain_speculative_sampling(q, x, p, generator=g1, seed=5))
    assert torch.equal(state, g1.get_state())
    # generator None: the device's default generator
    torch.manual_seed(3)
    d1 = chain_speculative_sampling(q, x, p)
    torch.manual_seed(3)
    assert _same(d1, chain_speculative_sampling(q, x, p))


# ---------------------------------------------------------------------------------------------
# 6. Against FlashInfer
# ---------------------------------------------------------------------------------------------
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_FLASHINFER and HAS_CUDA),
                    reason="needs the flashinfer package and a CUDA GPU (FlashInfer's sampling kernels are CUDA-only)")
def test_same_law_as_flashinfer():
    """Both on the same 100,000 rows: the first token passes the same chi-square against the
    exact law, the emitted counts' histograms agree (two-sample chi-square, 1e-4), and both
    keep accepted >= emitted.  (FlashInfer's accepted counter re-draws the rejected position,
    so its law differs from ours: it is not compared.)"""
    import flashinfer
    from scipy import stats

    p, q = _law_case()
    g = torch.Generator().manual_seed(6)
    x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(2)], 1)
    target = p.float()[None].expand(N, -1, -1).contiguous().cuda()
    draft = q.float()[None].expand(N, -1, -1).contiguous().cuda()
    ids = x.int().cuda()
    ours = chain_speculative_sampling(draft, ids, target, seed=1)
    theirs = flashinfer.sampling.chain_speculative_sampling(draft, ids, target, seed=1, offset=0)
    for tokens, acc, emi in (ours, theirs):
        assert chi_square_pvalue(tokens[:, 0].cpu().numpy(), p[0].numpy()) > SIGNIFICANCE
        assert (acc >= emi).all()
    h1 = np.bincount(ours[2].cpu().numpy(), minlength=3)
    h2 = np.bincount(theirs[2].cpu().numpy(), minlength=3)
    assert stats.chi2_contingency(np.stack([h1, h2])).pvalue > SIGNIFICANCE
