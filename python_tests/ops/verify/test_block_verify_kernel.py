"""``fused_verify(..., method="block")`` and ``fused_verify_packed(..., method="block")``: the
split Triton kernel (interpreted on a machine without a GPU) and the CPU torch path against
``reference.block_verify_reference`` on the same random numbers, token for token.

The grid is the token tests' (test_verify_packed.py): fp32/bf16/fp16 logits, V around and across
chunk boundaries (the chunk lowered to cross them), q as fp32/bf16/fp16 probabilities, one-hot
(None) and draft logits, top-k/top-p/min-p, ragged K_b with 0, mixed greedy and sampled rows,
the padded and the packed layout, probabilities in, log-probabilities out, and unusable values
at positions that block verification reads but token verification does not."""

from __future__ import annotations

import pytest
import torch

from helpers import HAS_CUDA
from helpers import assert_close, make_step
from specdec_kernels import fused_verify, fused_verify_packed
from specdec_kernels.ops.verify import launch as _verify_launch
from specdec_kernels.ops.reference import (block_verify_reference, emitted_logprobs, philox_uniforms,
                                       verify_reference)
from test_verify_packed import _pack

pytestmark = pytest.mark.slow  # the block kernel, interpreted on a CPU

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["triton", "torch"]


def _dev(t):
    return None if t is None else t.to(DEV)


def _params(B, K, V, warp):
    kb = torch.tensor([K, K, 0, K // 2, 1, K][:B])
    temperature = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.3, 1.0][:B])
    top_k = top_p = min_p = None
    if warp in ("top_k", "all"):
        top_k = torch.tensor([min(5, V), 0, 3, V, 2, 4][:B])
    if warp in ("top_p", "all"):
        top_p = torch.tensor([0.9, 0.6, 1.0, 0.8, 0.95, 0.7][:B])
    if warp in ("min_p", "all"):
        min_p = torch.tensor([0.05, 0.0, 0.2, 0.1, 0.01, 0.3][:B])
    return kb, temperature, top_k, top_p, min_p


CONFIGS = [  # (B, K, V, logits dtype, warp, q kind, chunk)
    (6, 3, 37, torch.float32, None, "fp32", 16),
    (6, 3, 37, torch.float32, None, "none", 16),
    (6, 3, 37, torch.float32, None, "logits", 16),
    (6, 4, 111, torch.float32, "top_k", "fp32", 32),
    (6, 2, 111, torch.float32, "top_p", "fp32", 4096),
    (6, 3, 97, torch.float32, "min_p", "none", 32),
    (6, 3, 97, torch.float32, "all", "logits", 32),
    (5, 3, 257, torch.bfloat16, None, "bf16", 64),
    (4, 2, 300, torch.float16, "all", "fp16", 128),
    (1, 1, 15, torch.float32, None, "fp32", 16),
]


def _ids(c):
    return f"B{c[0]}K{c[1]}V{c[2]}-{str(c[3])[6:]}-{c[4] or 'plain'}-q{c[5]}-c{c[6]}"


def _step(cfg):
    B, K, V, dtype, warp, qkind, _ = cfg
    logits, x, q = make_step(B, K, V, dtype, seed=B * 100 + K * 10 + V % 7, draft_noise=0.3)
    dl = None
    if qkind == "logits":
        g = torch.Generator().manual_seed(V)
        dl = logits[:, :K].float() + torch.randn(B, K, V, generator=g)
        q = None
        x = torch.multinomial(torch.softmax(dl, -1).reshape(-1, V), 1, generator=g).view(B, K)
    else:
        q = {"none": None, "fp32": q, "bf16": q.bfloat16(), "fp16": q.half()}[qkind]
    return logits, x, q, dl, _params(B, K, V, warp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_block_equals_reference(cfg, backend, split_settings):
    """Padded and packed, seeded (the kernel's own Philox numbers) and with uniforms passed in,
    with log-probabilities: equal to the reference token for token."""
    split_settings(chunk=cfg[6])
    B, K = cfg[0], cfg[1]
    logits, x, q, dl, (kb, temperature, top_k, top_p, min_p) = _step(cfg)
    seed = torch.arange(B) * 31 + 5
    offset = torch.arange(B) + 2
    kw = dict(temperature=_dev(temperature), top_k=_dev(top_k), top_p=_dev(top_p), min_p=_dev(min_p),
              seed=_dev(seed), offset=_dev(offset), backend=backend, method="block")
    u = philox_uniforms(seed, offset, K)
    ref_t, ref_n = block_verify_reference(logits, x, q, kb, temperature, top_k, top_p, u, draft_logits=dl,
                                          min_p=min_p)
    assert (ref_n >= 0).all()
    out = fused_verify(_dev(logits), _dev(x), _dev(q), draft_logits=_dev(dl), num_draft_tokens=_dev(kb),
                       return_logprobs=True, **kw)
    assert torch.equal(out.tokens.cpu(), ref_t) and torch.equal(out.num_accepted.cpu(), ref_n)
    ref_lp = emitted_logprobs(logits, ref_t, ref_n, temperature, top_k, top_p, min_p=min_p)
    assert_close(out.logprobs.cpu(), ref_lp, torch.float32)
    pl, px, cu, pq = _pack(logits, x, q if dl is None else dl, kb)
    packed = fused_verify_packed(_dev(pl), _dev(px), _dev(cu), None if dl is not None else _dev(pq),
                                 draft_logits=_dev(pq) if dl is not None else None, max_num_draft_tokens=K, **kw)
    assert torch.equal(packed.tokens.cpu(), ref_t) and torch.equal(packed.num_accepted.cpu(), ref_n)
    # explicit uniforms: the same numbers, the same tokens
    kw.pop("seed"), kw.pop("offset")
    given = fused_verify(_dev(logits), _dev(x), _dev(q), draft_logits=_dev(dl), num_draft_tokens=_dev(kb),
                         uniforms=_dev(u), **kw)
    assert torch.equal(given.tokens.cpu(), ref_t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_invariants_and_greedy_rows(backend):
    """Invariants of a block step: the accepted tokens are the drafts, the extra token is in the
    vocabulary, -1 after it; greedy rows equal token verification's."""
    B, K, V = 64, 4, 23
    logits, x, q = make_step(B, K, V, seed=9, draft_noise=0.3)
    temperature = torch.where(torch.arange(B) % 4 == 0, 0.0, 1.0)
    kw = dict(temperature=_dev(temperature), seed=3, backend=backend)
    blk = fused_verify(_dev(logits), _dev(x), _dev(q), method="block", **kw)
    tok = fused_verify(_dev(logits), _dev(x), _dev(q), **kw)
    t, n = blk.tokens.cpu(), blk.num_accepted.cpu()
    assert (n >= 0).all() and (n <= K).all()
    cols = torch.arange(K + 1)
    assert torch.equal(torch.where(cols[None, :K] < n[:, None], t[:, :K], -1),
                       torch.where(cols[None, :K] < n[:, None], x, -1))  # accepted = the drafts
    assert (t.gather(1, n[:, None]) >= 0).all() and (t.gather(1, n[:, None]) < V).all()
    assert (torch.where(cols[None] > n[:, None], t, -1) == -1).all()  # -1 after the extra token
    g = temperature == 0
    assert torch.equal(t[g], tok.tokens.cpu()[g]) and torch.equal(n[g], tok.num_accepted.cpu()[g])


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_reads_every_position(backend, split_settings):
    """A NaN at the bonus position (or an unusable q at a draft after an early rejection) makes a
    sampled row invalid under block verification, which reads every position; a greedy row keeps
    token verification's rule (it stops before the NaN)."""
    split_settings(chunk=16)
    B, K, V = 4, 2, 20
    logits, x, q = make_step(B, K, V, seed=2)
    x[:, 0] = (logits[:, 0].argmax(-1) + 1) % V  # greedy rows reject the first draft
    logits[:, K, 3] = float("nan")  # rows 0, 1 (sampled), 2 (greedy)
    q[3, 1, 4] = float("nan")  # row 3's second draft distribution
    temperature = torch.tensor([1.0, 0.8, 0.0, 1.0])
    u = torch.zeros(B, K + 1, dtype=torch.float64)
    out = fused_verify(_dev(logits), _dev(x), _dev(q), temperature=_dev(temperature), uniforms=_dev(u),
                       backend=backend, method="block")
    ref = block_verify_reference(logits, x, q, torch.full((B,), K), temperature, None, None, u)
    assert out.num_accepted.cpu().tolist() == ref[1].tolist() == [-1, -1, 0, -1]
    assert (out.tokens.cpu()[[0, 1, 3]] == -1).all()
    tok = verify_reference(logits, x, q, torch.full((B,), K), temperature, None, None, u)
    assert torch.equal(out.tokens.cpu()[2], tok[0][2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_probabilities_in_and_out(backend, split_settings):
    """target_is_probs and out= (int32) with method="block": equal to the reference."""
    split_settings(chunk=16)
    B, K, V = 5, 3, 40
    logits, x, q = make_step(B, K, V, seed=4, draft_noise=0.3)
    probs = torch.softmax(logits, -1)
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    kb = torch.tensor([3, 1, 2, 0, 3])
    u = torch.rand(B, K + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = block_verify_reference(probs, x, q, kb, temperature, None, None, u, target_is_probs=True)
    tokens = torch.empty(B, K + 1, dtype=torch.int32, device=DEV)
    num = torch.empty(B, dtype=torch.int32, device=DEV)
    res = fused_verify(_dev(probs), _dev(x), _dev(q), num_draft_tokens=_dev(kb), temperature=_dev(temperature),
                       uniforms=_dev(u), target_is_probs=True, out=(tokens, num), backend=backend, method="block")
    assert res.tokens is tokens
    assert torch.equal(tokens.cpu().long(), ref[0]) and torch.equal(num.cpu().long(), ref[1])


def test_method_errors():
    logits, x, q = make_step(1, 2, 8)
    with pytest.raises(ValueError, match=r"method must be one of \('token', 'block'\), got 'blocks'"):
        fused_verify(logits, x, q, method="blocks")
    cu = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="method must be one of"):
        fused_verify_packed(logits[0], x[0], cu, q[0], method=None)
    with pytest.raises(ValueError, match="_triton_rows"):
        fused_verify(logits, x, q, method="block", backend="_triton_rows")
