"""``fused_verify(..., token_bitmask=)``: a grammar's allowed tokens per verify position, in
xgrammar's layout (int32 words, bit v % 32 of word v // 32; ``ops/verify/bitmask.py``).

1. The torch path and the Triton kernel (interpreted on a CPU) equal the reference
   (``verify_reference(token_bitmask=)``, whose unpacking of the bits is written apart) token for
   token: padded and packed, token and block verification, greedy and sampled rows, top-k, top-p
   and min-p after the mask (also where the kernel's candidate lists cannot decide them and it
   scans the masked position), probabilities and draft logits in, logprobs of the masked law.
   The kernel applies the mask inside its launch: no masked copy of the logits is made first.
2. Invariants: every emitted token is allowed at its position; a position that allows nothing with
   a finite logit makes its row invalid (-1), a NaN at a forbidden token is masked away, one at an
   allowed token still makes the row invalid; the op's unpacking equals xgrammar's own.
3. Law: the first emitted token against the masked target's law (chi-square, significance 1e-4,
   60,000 trials), and a mutant (the mask of position 0 applied at every position) that the same
   statistic rejects.
4. Bad masks are refused in one line naming token_bitmask; seeded calls repeat.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_close, chi_square_pvalue, make_step, random_bitmask
from specdec_kernels import fused_verify, fused_verify_packed
from specdec_kernels.ops.reference import block_verify_reference, draft_softmax, verify_reference
from specdec_kernels.ops.verify.bitmask import allowed_tokens, apply_token_bitmask, bitmask_width
from test_verify_packed import _pack

BACKENDS = [pytest.param("triton", marks=pytest.mark.slow), "torch"]  # the kernel, interpreted on a CPU: slow
SIGNIFICANCE = 1e-4


def _row_params(g, B):
    temperature = torch.where(torch.rand(B, generator=g) < 0.3, 0.0, 0.5 + torch.rand(B, generator=g))
    top_k = torch.randint(0, 6, (B,), generator=g)
    top_p = torch.where(torch.rand(B, generator=g) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(B, generator=g))
    min_p = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, 0.2 * torch.rand(B, generator=g))
    return temperature.float(), top_k, top_p.float(), min_p.float()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_equals_the_reference(backend, method, seed):
    B, K, V = 6, 3, 70
    logits, x, q = make_step(B, K, V, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    mask = random_bitmask(g, (B, K + 1), V)
    kb = torch.randint(0, K + 1, (B,), generator=g)
    T, top_k, top_p, min_p = _row_params(g, B)
    u = torch.rand(B, K + 1, generator=g, dtype=torch.float64)
    out = fused_verify(logits, x, q, num_draft_tokens=kb, temperature=T, top_k=top_k, top_p=top_p, min_p=min_p,
                       uniforms=u, backend=backend, method=method, token_bitmask=mask)
    ref = (block_verify_reference if method == "block" else verify_reference)(
        logits, x, q, kb, T, top_k, top_p, u, min_p=min_p, token_bitmask=mask)
    assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1])
    assert (out.num_accepted >= 0).all()
    keep = allowed_tokens(mask, V)
    for b in range(B):
        for i in range(int(out.num_accepted[b]) + 1):
            assert keep[b, i, out.tokens[b, i]], (b, i)  # every emitted token is allowed where it stands


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend):
    B, K, V = 4, 3, 40
    logits, x, q = make_step(B, K, V, seed=5)
    g = torch.Generator().manual_seed(6)
    mask = random_bitmask(g, (B, K + 1), V)
    kb = torch.tensor([3, 0, 2, 1])
    padded = fused_verify(logits, x, q, num_draft_tokens=kb, seed=9, offset=2, backend=backend, token_bitmask=mask)
    flat_logits, flat_x, cu, flat_q = _pack(logits, x, q, kb)
    flat_mask = torch.cat([mask[b, :int(kb[b]) + 1] for b in range(B)])
    packed = fused_verify_packed(flat_logits, flat_x, cu, flat_q, max_num_draft_tokens=K, seed=9, offset=2,
                                 backend=backend, token_bitmask=flat_mask)
    assert torch.equal(packed.num_accepted, padded.num_accepted)
    for b in range(B):
        n = int(padded.num_accepted[b]) + 1
        assert torch.equal(packed.tokens[b, :n], padded.tokens[b, :n])


@pytest.mark.parametrize("backend", BACKENDS)
def test_probabilities_in_and_logprobs_follow_the_masked_law(backend):
    B, K, V = 3, 2, 30
    logits, x, q = make_step(B, K, V, seed=7)
    mask = random_bitmask(torch.Generator().manual_seed(8), (B, K + 1), V)
    u = torch.rand(B, K + 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    p = torch.softmax(logits, -1)
    for method in ("token", "block"):
        from_probs = fused_verify(p, x, q, uniforms=u, target_is_probs=True, token_bitmask=mask, backend=backend,
                                  method=method)
        ref = (block_verify_reference if method == "block" else verify_reference)(
            p, x, q, torch.full((B,), K), torch.ones(B), None, None, u, target_is_probs=True, token_bitmask=mask)
        assert torch.equal(from_probs.tokens, ref[0]) and torch.equal(from_probs.num_accepted, ref[1])
    out = fused_verify(logits, x, q, uniforms=u, token_bitmask=mask, return_logprobs=True, backend=backend)
    want = torch.log_softmax(apply_token_bitmask(logits, mask), -1)
    for b in range(B):
        for i in range(int(out.num_accepted[b]) + 1):
            torch.testing.assert_close(out.logprobs[b, i], want[b, i, out.tokens[b, i]])


def test_the_unpacking_is_the_references_and_xgrammars():
    V = 100
    mask = random_bitmask(torch.Generator().manual_seed(3), (2, 3), V)
    from specdec_kernels.ops.verify.reference.warp import mask_target

    ref_keep = torch.isfinite(mask_target(torch.zeros(2, 3, V), mask))
    assert torch.equal(allowed_tokens(mask, V), ref_keep)
    xgr = pytest.importorskip("xgrammar")
    want = torch.zeros(2 * 3, V, dtype=torch.bool)
    flat = mask.view(-1, mask.shape[-1]).clone()
    logits = torch.zeros(6, V)
    xgr.apply_token_bitmask_inplace(logits, flat)  # xgrammar's own reading of the layout: -inf where forbidden
    want = torch.isfinite(logits)
    assert torch.equal(allowed_tokens(mask, V).view(6, V), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_position_allowing_nothing_finite_makes_the_row_invalid(backend):
    B, K, V = 3, 2, 33
    logits, x, q = make_step(B, K, V, seed=11)
    mask = torch.full((B, K + 1, bitmask_width(V)), -1, dtype=torch.int32)  # everything allowed
    mask[0, 0] = 0  # row 0: nothing allowed at its first position
    logits[1, 0, :] = float("-inf")
    logits[1, 0, 5] = 0.0
    mask[1, 0] = 0
    mask[1, 0, 0] = 1 << 7  # row 1: only token 7 allowed, whose logit is -inf
    logits[2, :, 4] = float("nan")
    mask[2, :, 0] &= ~(1 << 4)  # row 2: a NaN at a forbidden token
    for temperature in (1.0, 0.0):
        out = fused_verify(logits, x, q, seed=1, backend=backend, token_bitmask=mask, temperature=temperature)
        assert out.num_accepted.tolist()[:2] == [-1, -1] and (out.tokens[:2] == -1).all()
        assert out.num_accepted[2] >= 0 and (out.tokens[2, :int(out.num_accepted[2]) + 1] != 4).all()
    mask[2, :, 0] |= 1 << 4  # the NaN's token allowed: the row is invalid as without a mask
    assert fused_verify(logits, x, q, seed=1, token_bitmask=mask, backend=backend).num_accepted[2] == -1


@pytest.mark.slow
@pytest.mark.parametrize("seed", [31, 35])
def test_the_kernel_scans_the_masked_position_where_its_candidates_cannot_decide(seed, split_settings):
    """Chunks of 16 tokens and 2 candidate keys a chunk: top-k 5, top-p and min-p are decided by
    the kernel's scans of the whole position (bisection, masked mass), every read under the mask;
    NaN logits at forbidden tokens (masked away)."""
    split_settings(chunk=16, top_k_cap=2)
    B, K, V = 5, 2, 70
    logits, x, q = make_step(B, K, V, seed=seed, scale=2.0)
    g = torch.Generator().manual_seed(seed + 1)
    mask = random_bitmask(g, (B, K + 1), V, density=0.7)
    logits = logits.masked_fill(~allowed_tokens(mask, V) & (torch.rand(B, K + 1, V, generator=g) < 0.3),
                                float("nan"))
    # rows: top-k over the lists, top-p, greedy, top-k with min-p, min-p alone keeping more than the lists
    T = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0])
    top_k, top_p = torch.tensor([5, 0, 0, 7, 0]), torch.tensor([0.9, 0.75, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.02])
    u = torch.rand(B, K + 1, generator=g, dtype=torch.float64)
    for method in ("token", "block"):
        out = fused_verify(logits, x, q, temperature=T, top_k=top_k, top_p=top_p, min_p=min_p, uniforms=u,
                           backend="triton", method=method, token_bitmask=mask, return_logprobs=True)
        ref = (block_verify_reference if method == "block" else verify_reference)(
            logits, x, q, torch.full((B,), K), T, top_k, top_p, u, min_p=min_p, token_bitmask=mask)
        assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1]), method
        assert (out.num_accepted >= 0).all()
        torch_lp = fused_verify(logits, x, q, temperature=T, top_k=top_k, top_p=top_p, min_p=min_p, uniforms=u,
                                backend="torch", method=method, token_bitmask=mask, return_logprobs=True).logprobs
        assert_close(out.logprobs, torch_lp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_logits_under_the_mask_equal_their_softmax(backend):
    """q = softmax(draft_logits / T) as given (the mask is the target's): the reference's tokens
    with that q passed as draft_probs."""
    B, K, V = 3, 3, 50
    logits, x, q = make_step(B, K, V, seed=41)
    mask = random_bitmask(torch.Generator().manual_seed(42), (B, K + 1), V)
    T = torch.tensor([1.0, 0.7, 0.0])
    u = torch.rand(B, K + 1, generator=torch.Generator().manual_seed(43), dtype=torch.float64)
    d_logits = torch.log(q) * 1.3
    from_logits = fused_verify(logits, x, draft_logits=d_logits, temperature=T, uniforms=u, backend=backend,
                               token_bitmask=mask)
    q_soft = draft_softmax(d_logits, 1.0 / torch.where(T > 0, T, torch.ones(B)))  # each row's 1 / T (greedy: 1)
    ref = verify_reference(logits, x, q_soft, torch.full((B,), K), T, None, None, u, token_bitmask=mask)
    assert torch.equal(from_logits.tokens, ref[0]) and torch.equal(from_logits.num_accepted, ref[1])


def test_the_kernel_masks_inside_its_launch(monkeypatch):
    """The Triton backend makes no masked copy of the logits: with the torch path's masking
    function made to fail, its calls still equal the reference."""
    from specdec_kernels.ops.verify import api

    def no_copy(*args, **kwargs):
        raise AssertionError("the logits were masked outside the launch")

    monkeypatch.setattr(api, "apply_token_bitmask", no_copy)
    B, K, V = 2, 2, 40
    logits, x, q = make_step(B, K, V, seed=51)
    mask = random_bitmask(torch.Generator().manual_seed(52), (B, K + 1), V)
    u = torch.rand(B, K + 1, generator=torch.Generator().manual_seed(53), dtype=torch.float64)
    out = fused_verify(logits, x, q, uniforms=u, backend="triton", token_bitmask=mask)
    ref = verify_reference(logits, x, q, torch.full((B,), K), torch.ones(B), None, None, u, token_bitmask=mask)
    assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1])
    with pytest.raises(AssertionError, match="masked outside the launch"):  # the torch path does mask first
        fused_verify(logits, x, q, uniforms=u, backend="torch", token_bitmask=mask)


def test_bad_masks_are_refused_by_name():
    logits, x, q = make_step(2, 2, 40, seed=0)
    good = torch.zeros(2, 3, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"token_bitmask must be int32 \(xgrammar's bitmask\), got torch.int64"):
        fused_verify(logits, x, q, token_bitmask=good.long())
    with pytest.raises(ValueError, match=r"token_bitmask must have shape \[2, 3, 2\] .* got \[2, 3, 1\]"):
        fused_verify(logits, x, q, token_bitmask=good[..., :1])
    with pytest.raises(TypeError, match="token_bitmask must be an int32 tensor, got list"):
        fused_verify(logits, x, q, token_bitmask=[[1]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_calls_repeat(backend):
    """The same seed gives the same tokens, and the kernel's Philox draws are the torch path's."""
    logits, x, q = make_step(4, 3, 50, seed=2)
    mask = random_bitmask(torch.Generator().manual_seed(4), (4, 4), 50)
    a = fused_verify(logits, x, q, seed=13, offset=1, temperature=0.8, token_bitmask=mask, backend=backend)
    b = fused_verify(logits, x, q, seed=13, offset=1, temperature=0.8, token_bitmask=mask, backend=backend)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    c = fused_verify(logits, x, q, seed=13, offset=1, temperature=0.8, token_bitmask=mask, backend="torch")
    assert torch.equal(a.tokens, c.tokens) and torch.equal(a.num_accepted, c.num_accepted)


# --- the law -------------------------------------------------------------------------------------
N_TRIALS = 60_000


def _law_case():
    """K = 1, V = 12: masks that differ between position 0 and the bonus position; q unmasked."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(2, 12, generator=g) * 1.5
    q = torch.softmax(torch.randn(12, generator=g), -1)
    allowed = [torch.tensor([1, 2, 3, 5, 8, 9]), torch.tensor([0, 2, 4, 6, 7, 8, 10])]
    mask = torch.zeros(2, 1, dtype=torch.int64)
    for i, a in enumerate(allowed):
        mask[i, 0] = int(sum(1 << int(v) for v in a))
    return logits, q, mask.to(torch.int32)


def _first_two(mask):
    logits, q, _ = _law_case()
    g = torch.Generator().manual_seed(5)
    x = torch.multinomial(q, N_TRIALS, replacement=True, generator=g)[:, None]
    out = fused_verify(logits[None].expand(N_TRIALS, -1, -1), x, q[None, None].expand(N_TRIALS, 1, -1),
                       seed=torch.arange(N_TRIALS), offset=1, token_bitmask=mask[None].expand(N_TRIALS, -1, -1))
    assert (out.num_accepted >= 0).all()
    return out.tokens.numpy(), out.num_accepted.numpy()


def _masked_law(row: torch.Tensor, mask_word: int) -> np.ndarray:
    keep = np.array([(mask_word >> v) & 1 for v in range(row.shape[0])], dtype=bool)
    e = np.where(keep, np.exp(row.double().numpy() - row.double().numpy()[keep].max()), 0.0)
    return e / e.sum()


def test_first_and_bonus_tokens_follow_the_masked_law():
    logits, q, mask = _law_case()
    tokens, n = _first_two(mask)
    p0, p1 = _masked_law(logits[0], int(mask[0, 0])), _masked_law(logits[1], int(mask[1, 0]) & 0xFFFFFFFF)
    assert chi_square_pvalue(tokens[:, 0], p0) > SIGNIFICANCE
    assert chi_square_pvalue(tokens[n == 1, 1], p1) > SIGNIFICANCE  # the bonus position: its own mask


def test_the_mask_of_position_zero_everywhere_is_caught():
    """The mutant: position 0's mask applied at the bonus position too."""
    logits, q, mask = _law_case()
    wrong = mask.clone()
    wrong[1] = mask[0]
    tokens, n = _first_two(wrong)
    p1 = _masked_law(logits[1], int(mask[1, 0]) & 0xFFFFFFFF)
    assert chi_square_pvalue(tokens[n == 1, 1], p1) < SIGNIFICANCE
