"""Exact tests: with the same random numbers the Triton kernel and the PyTorch reference emit
the same tokens and counts.  On a machine without a GPU the kernel runs under
TRITON_INTERPRET=1; the reference always runs on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import make_step
from specdec_kernels import fused_verify
from specdec_kernels.ops import verify as verify_mod
from specdec_kernels.ops.verify import launch as _verify_launch, torch_path as _verify_torch
from specdec_kernels.ops.verify.reference.philox import philox_uniforms_host
from specdec_kernels.ops.reference import philox_uniforms, verify_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _row_params(B: int, K: int, V: int, warp: bool):
    kb = torch.tensor([K, K // 2, max(K - 1, 0)][:B])
    temperature = torch.tensor([1.0, 0.0, 0.7][:B])
    top_k = torch.tensor([min(5, V), 0, max(1, V // 3)][:B]) if warp else None
    top_p = torch.tensor([0.9, 1.0, 0.6][:B]) if warp else None
    return kb, temperature, top_k, top_p


def _greedy_friendly(logits, x):
    """Make the greedy row's first drafts the argmax, so greedy acceptance happens too."""
    if x.shape[0] > 1:
        n = max(1, x.shape[1] // 2)
        x[1, :n] = logits[1, :n].float().argmax(-1)[:n]
    return x


def _run_both(logits, x, q, kb, temperature, top_k, top_p, seed, offset, device):
    out = fused_verify(logits.to(device), x.to(device), None if q is None else q.to(device),
                       num_draft_tokens=kb.to(device), temperature=temperature.to(device),
                       top_k=None if top_k is None else top_k.to(device),
                       top_p=None if top_p is None else top_p.to(device),
                       seed=seed.to(device), offset=offset.to(device), backend="triton")
    u = philox_uniforms(seed, offset, x.shape[1])
    ref_tokens, ref_num = verify_reference(logits.cpu(), x.cpu(), None if q is None else q.cpu(), kb,
                                           temperature, top_k, top_p, u)
    return out, ref_tokens, ref_num


@pytest.mark.slow
@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("V", [1, 2, 111, 1271, 32001])
@pytest.mark.parametrize("K", [1, 4, 8])
@pytest.mark.parametrize("B", [1, 3])
def test_kernel_matches_reference(B, K, V, dtype, warp, device, split_settings):
    if V == 1271:
        split_settings(chunk=128)  # 10 vocabulary chunks
    logits, x, q = make_step(B, K, V, dtype, seed=1000 * B + 10 * K + V % 97)
    x = _greedy_friendly(logits, x)
    kb, temperature, top_k, top_p = _row_params(B, K, V, warp)
    seed = torch.arange(B, dtype=torch.int64) * 7919 + V
    offset = torch.full((B,), 3, dtype=torch.int64)
    out, ref_tokens, ref_num = _run_both(logits, x, q, kb, temperature, top_k, top_p, seed, offset, device)
    assert torch.equal(out.num_accepted.cpu(), ref_num), (out.num_accepted, ref_num)
    assert torch.equal(out.tokens.cpu(), ref_tokens), (out.tokens, ref_tokens)
    assert (ref_num >= 0).all(), "these inputs are finite: no row may be marked invalid"


@pytest.mark.parametrize("V,Vd", [(111, 100), (1271, 1000)])
def test_padded_target_vocabulary_matches_reference(V, Vd, device):
    logits, x, q = make_step(3, 4, V, Vd=Vd, seed=V)
    kb, temperature, top_k, top_p = _row_params(3, 4, V, warp=True)
    seed, offset = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    out, ref_tokens, ref_num = _run_both(logits, x, q, kb, temperature, top_k, top_p, seed, offset, device)
    assert torch.equal(out.tokens.cpu(), ref_tokens) and torch.equal(out.num_accepted.cpu(), ref_num)


@pytest.mark.parametrize("K", [1, 5])
def test_deterministic_drafter_matches_reference(K, device):
    """draft_probs=None: q is one-hot at the drafted token."""
    logits, _, _ = make_step(3, K, 257, seed=K)
    x = logits[:, :K].float().argmax(-1)  # a greedy drafter
    x[0, -1] = (x[0, -1] + 1) % 257  # one disagreement
    kb, temperature, top_k, top_p = _row_params(3, K, 257, warp=False)
    seed, offset = torch.tensor([1, 2, 3]), torch.tensor([9, 9, 9])
    out, ref_tokens, ref_num = _run_both(logits, x, None, kb, temperature, top_k, top_p, seed, offset, device)
    assert torch.equal(out.tokens.cpu(), ref_tokens) and torch.equal(out.num_accepted.cpu(), ref_num)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow), "torch"])
def test_no_drafts_gives_the_bonus_token(backend, device):
    """K = 0 (and K_b = 0 rows): the step only samples the bonus token from p_0."""
    logits, x, q = make_step(3, 0, 50, seed=4)
    seed = torch.tensor([1, 2, 3])
    dev = device if backend == "triton" else "cpu"
    out = fused_verify(logits.to(dev), x.to(dev), q.to(dev), temperature=torch.tensor([1.0, 0.0, 0.5]).to(dev),
                       seed=seed.to(dev), backend=backend)
    ref_tokens, ref_num = verify_reference(logits, x, q, torch.zeros(3, dtype=torch.int64),
                                           torch.tensor([1.0, 0.0, 0.5]), None, None,
                                           philox_uniforms(seed, torch.zeros(3, dtype=torch.int64), 0))
    assert torch.equal(out.tokens.cpu(), ref_tokens) and torch.equal(out.num_accepted.cpu(), ref_num)
    assert out.tokens.shape == (3, 1) and (out.num_accepted == 0).all()
    assert int(out.tokens[1, 0]) == int(logits[1, 0].argmax())


def test_explicit_uniforms_match_seeded_draws(device):
    """uniforms = philox_uniforms(seed, offset) gives the kernel's own draws exactly."""
    logits, x, q = make_step(3, 4, 111, seed=3)
    seed, offset = torch.tensor([11, 12, 2**40 + 13]), torch.tensor([0, 5, 2**33 + 1])
    u = philox_uniforms(seed, offset, 4)
    a = fused_verify(logits.to(device), x.to(device), q.to(device), seed=seed.to(device),
                     offset=offset.to(device), backend="triton")
    b = fused_verify(logits.to(device), x.to(device), q.to(device), uniforms=u.to(device), backend="triton")
    c = fused_verify(logits, x, q, uniforms=u, backend="torch")
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.tokens.cpu(), c.tokens) and torch.equal(a.num_accepted.cpu(), c.num_accepted)


def test_host_philox_equals_tensor_philox():
    """philox_uniforms_host (Python ints, the CPU path's small batches) gives philox_uniforms'
    values exactly: random and extreme int64 seeds and offsets, K = 0..8, B = 0..6."""
    rng = random.Random(17)
    extremes = [0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**62 + 5, 2**63 - 1, -(2**63)]
    for _ in range(300):
        B, K = rng.randint(0, 6), rng.randint(0, 8)
        seed = [rng.choice([rng.randint(-(2**63), 2**63 - 1), rng.choice(extremes)]) for _ in range(B)]
        offset = [rng.choice([rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 100), rng.choice(extremes)])
                  for _ in range(B)]
        a = philox_uniforms(torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64), K)
        b = philox_uniforms_host(seed, offset, K)
        assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape == (B, K + 1)
        assert torch.equal(a, b), (seed, offset, K)


@pytest.mark.parametrize("B", [1, 40])  # 1 x 5 draws on the host, 40 x 5 with tensor ops
def test_seeded_torch_path_equals_explicit_uniforms(B, monkeypatch):
    """The CPU path's seeded draws (host Philox for small batches, tensor Philox for large ones)
    equal passing uniforms = philox_uniforms(seed, offset) explicitly."""
    calls = []
    orig = _verify_torch.philox_uniforms_host
    monkeypatch.setattr(_verify_torch, "philox_uniforms_host", lambda *a: calls.append(1) or orig(*a))
    logits, x, q = make_step(B, 4, 97, seed=B)
    seed = torch.arange(B, dtype=torch.int64) * 7919 - 3
    offset = torch.arange(B, dtype=torch.int64) + 2**33
    a = fused_verify(logits, x, q, temperature=0.9, seed=seed, offset=offset, backend="torch")
    b = fused_verify(logits, x, q, temperature=0.9, uniforms=philox_uniforms(seed, offset, 4), backend="torch")
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert len(calls) == (1 if B * 5 <= _verify_torch._HOST_PHILOX_MAX else 0)


@pytest.mark.slow
def test_philox_uniforms_match_triton_rand(device):
    """The reference's Philox reproduces Triton's bit for bit: the acceptance tests' numbers are
    ``tl.rand`` (fp32), the final draw's are 53 bits of ``tl.randint4x``'s first two words."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rand_kernel(seed_ptr, offset_ptr, out_ptr, words_ptr, N):
        b = tl.program_id(0)
        seed = tl.load(seed_ptr + b)
        base = tl.load(offset_ptr + b) << 32
        for c in range(0, N):
            tl.store(out_ptr + b * N + c, tl.rand(seed, base | c))
            r0, r1, _, _ = tl.randint4x(seed, base | c)
            tl.store(words_ptr + (b * N + c) * 2, r0.to(tl.int64))
            tl.store(words_ptr + (b * N + c) * 2 + 1, r1.to(tl.int64))

    seed = torch.tensor([0, 1, -7, 2**62 + 5, 123456789], dtype=torch.int64)
    offset = torch.tensor([0, 1, 2, 2**31 + 3, 77], dtype=torch.int64)
    out = torch.empty(5, 6, dtype=torch.float32, device=device)
    words = torch.empty(5, 6, 2, dtype=torch.int64, device=device)
    _rand_kernel[(5,)](seed.to(device), offset.to(device), out, words, 6)
    u = philox_uniforms(seed, offset, 5)  # counters 1..5 then 0
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    assert torch.equal(out.cpu()[:, 1:].double(), u[:, :5])  # the acceptance tests: tl.rand's values
    w = words.cpu()[:, 0]  # counter 0: the final draw
    assert ((w >= 0) & (w < 2**32)).all()
    want = ((w[:, 0] >> 5) * 2**26 + (w[:, 1] >> 6)).double() / 2**53
    assert torch.equal(u[:, 5], want)
    # 53 bits, not an fp32 value widened: the final draws are off fp32's grid
    assert not torch.equal(u[:, 5].float().double(), u[:, 5])


@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
@pytest.mark.parametrize("K", [0, 1, 3])
@pytest.mark.parametrize("greedy", [False, True], ids=["mixed", "all_greedy"])
def test_checked_entry_equals_fused_verify(K, warp, greedy):
    """The decoder's entry without per-call argument checks (``verify_prechecked``) computes what
    ``fused_verify`` computes from the same normalised arguments (CPU routes: mixed, all
    greedy, with and without top-k/top-p), the reference included."""
    B, V = 3, 97
    logits, x, q = make_step(B, K, V, seed=K + 10 * warp)
    x = _greedy_friendly(logits, x)
    kb, temperature, top_k, top_p = _row_params(B, K, V, warp)
    kb = kb.clamp(max=K)
    if greedy:
        temperature = torch.zeros(B)
    seed, offset = torch.tensor([5, 6, 7]), torch.tensor([0, 3, 1])
    want = fused_verify(logits, x, q, num_draft_tokens=kb, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, offset=offset)
    got = verify_mod.verify_prechecked(logits, x, q, kb, temperature, top_k, top_p, seed, offset)
    ref = verify_reference(logits, x, q, kb, temperature, top_k, top_p, philox_uniforms(seed, offset, K))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.tokens, ref[0]) and torch.equal(got.num_accepted, ref[1])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in another layout: a transposed copy seen through its transpose ([B, K]),
    or every other element of a twice-as-long tensor ([B])."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    wide = torch.stack([t, torch.zeros_like(t)], 1)  # [B, 2]
    return wide[:, 0]  # stride 2


@pytest.mark.parametrize("layout", ["draft_tokens", "per_row_strided", "per_row_expanded", "logits_permuted"])
@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
def test_input_layouts_do_not_change_the_result(layout, warp, device):
    """Strided, expanded and permuted inputs give what contiguous ones give, through both backends
    (seen wrong before: the kernel read draft tokens and [B] parameters at ptr + index, whatever
    their strides; the torch path's sampling route could not view permuted logits)."""
    B, K, V = 3, 3, 40
    logits, x, q = make_step(B, K, V, seed=17)
    x = _greedy_friendly(logits, x)
    kb, temperature, top_k, top_p = _row_params(B, K, V, warp)
    seed, offset = torch.tensor([3, 4, 5]), torch.tensor([0, 7, 1])
    if layout == "per_row_expanded":  # one value for every row, as a [1] tensor expanded to [B]
        kb, temperature, seed = kb[:1], temperature[:1], seed[:1]
        top_k, top_p = (None, None) if not warp else (top_k[:1], top_p[:1])
        kb, temperature, seed, offset = (t.expand(B) for t in (kb, temperature, seed, offset[:1]))
        top_k, top_p = (None, None) if not warp else (top_k.expand(B), top_p.expand(B))
    kw = dict(num_draft_tokens=kb, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)
    want = {be: fused_verify(logits.to(device), x.to(device), q.to(device), backend=be,
                             **{k: None if v is None else v.contiguous().to(device) for k, v in kw.items()})
            for be in ("triton", "torch")}
    args = [logits, x, q]
    if layout == "draft_tokens":
        args[1] = _strided(x)
    elif layout == "per_row_strided":
        kw = {k: None if v is None else _strided(v) for k, v in kw.items()}
    elif layout == "logits_permuted":
        args[0] = logits.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    for be in ("triton", "torch"):
        moved = [a.to(device) if device != "cpu" else a for a in args]  # .to(cpu) keeps the layout
        got = fused_verify(*moved, backend=be, **{k: None if v is None else (v.to(device) if device != "cpu" else v)
                                                   for k, v in kw.items()})
        assert torch.equal(got.tokens, want[be].tokens) and torch.equal(got.num_accepted, want[be].num_accepted), (
            be, got, want[be])
    assert torch.equal(want["triton"].tokens, want["torch"].tokens)
