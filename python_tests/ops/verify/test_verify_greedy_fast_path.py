"""The greedy fast path of fused_verify's CPU torch path (``_verify_torch._verify_greedy``).

When every row has temperature 0 the torch path skips the softmax, top-k/top-p, residual and
final draw of the reference.  These tests run many randomised all-greedy batches (argmax ties,
unusable rows, ragged K, K = 0, a padded target vocabulary, top-k/top-p given, draft_probs None
or not, fp32/bf16/fp16, non-contiguous logits) and require the fast path's outputs to equal
the full reference path's exactly (values, dtype, shape), and check the fast path is taken.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import inject_unusable_positions, random_randomness
from specdec_kernels import fused_verify
from specdec_kernels.ops.verify import torch_path as _verify_torch
from specdec_kernels.ops.reference import philox_uniforms, verify_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of the greedy route."""
    calls = []
    orig = _verify_torch._verify_greedy

    def wrapped(a):
        calls.append(a.target_logits.shape)
        return orig(a)

    monkeypatch.setattr(_verify_torch, "_verify_greedy", wrapped)
    return calls


def _full_path(monkeypatch, **kw):
    """fused_verify with the fast path switched off: the reference route of _run_torch."""
    with monkeypatch.context() as m:
        m.setattr(_verify_torch, "_all_greedy", lambda a: False)
        return fused_verify(**kw)


def _random_case(rng: random.Random, g: torch.Generator) -> dict:
    B = rng.randint(1, 5)
    K = rng.choice([0, 1, 2, 3, 4, 6])
    V = rng.choice([1, 2, 3, 7, 50, 301])
    dtype = rng.choice(DTYPES)
    # Few distinct values: many argmax ties (the reference takes the first index of the maximum).
    if rng.random() < 0.5:
        logits = torch.randint(-2, 3, (B, K + 1, V), generator=g).float()
    else:
        logits = torch.randn(B, K + 1, V, generator=g) * 3
    if rng.random() < 0.3:  # some -inf entries (still usable), and -0.0 beside +0.0
        logits[torch.rand(B, K + 1, V, generator=g) < 0.2] = float("-inf")
        logits[torch.rand(B, K + 1, V, generator=g) < 0.1] = -0.0
    # Unusable positions: NaN, +inf, all -inf.
    inject_unusable_positions(logits, rng)
    logits = logits.to(dtype)
    if rng.random() < 0.3:  # a non-contiguous view, as a slice of a model's output would be
        wide = torch.zeros(B, K + 3, V + 2, dtype=dtype)
        wide[:, 1:K + 2, 1:V + 1] = logits
        logits = wide[:, 1:K + 2, 1:V + 1]
    # Drafts: the target's argmax for a random prefix (acceptance happens), then anything.
    am = logits.float().argmax(-1)[:, :K]
    x = torch.randint(0, V, (B, K), generator=g)
    n_match = torch.randint(0, K + 1, (B,), generator=g)
    x = torch.where(torch.arange(K)[None, :] < n_match[:, None], am, x)
    for _ in range(rng.choice([0, 0, 1])):  # draft ids outside [0, V)
        if K:
            x[rng.randrange(B), rng.randrange(K)] = rng.choice([-1, V, V + 5])
    x = x.to(rng.choice([torch.int64, torch.int32]))
    draft_probs = None
    if rng.random() < 0.6:
        Vd = rng.randint(1, V)  # a padded target vocabulary when Vd < V
        draft_probs = torch.softmax(torch.randn(B, K, Vd, generator=g), -1)
        if rng.random() < 0.2 and K:  # q values a sampling row would reject; greedy rows ignore q
            draft_probs[0, 0, 0] = rng.choice([float("nan"), -1.0, float("inf")])
    kw = dict(target_logits=logits, draft_tokens=x, draft_probs=draft_probs, backend="torch")
    r = rng.random()
    if r < 0.3:
        kw["temperature"] = 0.0
    elif r < 0.4:
        kw["temperature"] = 0  # an int
    else:
        t = torch.zeros(B, dtype=rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
        if rng.random() < 0.5:
            t[rng.randrange(B)] = -0.0
        kw["temperature"] = t
    r = rng.random()
    if r < 0.3:
        kw["num_draft_tokens"] = torch.randint(0, K + 1, (B,), generator=g)  # ragged K_b
    elif r < 0.5:
        kw["num_draft_tokens"] = rng.randint(0, K)
    if rng.random() < 0.5:
        kw["top_k"] = rng.choice([0, 1, 3, torch.randint(0, V + 2, (B,), generator=g)])
    if rng.random() < 0.5:
        kw["top_p"] = rng.choice([1.0, 0.5, 0.01, torch.rand(B, generator=g) * 0.99 + 0.01])
    kw.update(random_randomness(rng, g, B, K))
    return kw


def _assert_identical(a, b, msg=""):
    for name, x, y in (("tokens", a.tokens, b.tokens), ("num_accepted", a.num_accepted, b.num_accepted)):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, (name, msg)
        assert torch.equal(x, y), (name, msg, x, y)


@pytest.mark.slow
@pytest.mark.parametrize("host", [True, False], ids=["host", "tensors"])
def test_fast_path_equals_full_path_on_random_cases(counted, monkeypatch, host, torch_routes):
    """host: small batches finish on the host (``_greedy_host``); tensors: the same cases with
    that switched off, through the tensor ops larger batches take."""
    if not host:
        torch_routes(host_greedy_max=0)
    host_calls = []
    orig_host = _verify_torch._greedy_host
    monkeypatch.setattr(_verify_torch, "_greedy_host", lambda *args: host_calls.append(1) or orig_host(*args))
    rng = random.Random(1234)
    g = torch.Generator().manual_seed(1234)
    n_invalid = n_ties = n_accepted_all = 0
    N = 600
    for case in range(N):
        kw = _random_case(rng, g)
        # Chunks of the first-argmax search down to single tokens: ties across chunk borders.
        torch_routes(argmax_chunk=rng.choice([1, 2, 3, 4, 16, 256]))
        fast = fused_verify(**kw)
        full = _full_path(monkeypatch, **kw)
        _assert_identical(fast, full, f"case {case}")
        n_invalid += int((full.num_accepted < 0).sum())
        lg = kw["target_logits"].float()
        n_ties += int((lg == lg.amax(-1, keepdim=True)).sum(-1).gt(1).sum())
        K = lg.shape[1] - 1
        n_accepted_all += int(((full.num_accepted == K) & (K > 0)).sum())
    assert len(counted) == N, "every all-greedy CPU batch takes the fast path"
    assert len(host_calls) == (N if host else 0)
    # The cases exercised what they are meant to.
    assert n_invalid > 50 and n_ties > 500 and n_accepted_all > 20, (n_invalid, n_ties, n_accepted_all)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_fast_path_equals_reference_on_large_vocabulary(dtype, counted):
    """V = 49,152 (the default pair's), ties at the maximum, against verify_reference itself."""
    g = torch.Generator().manual_seed(5)
    B, K, V = 4, 4, 49152
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(dtype)
    logits[:, :, 1000] = 50.0
    logits[:, :, 30000] = 50.0  # a tie across chunks: the first index wins
    logits[3, 4, 1001] = 60.0
    logits[3, 4, 1003] = 60.0  # a tie within a chunk
    logits[3, 4, 49151] = 60.0  # and in the last one
    logits[1, 2, 7] = float("nan")
    x = torch.full((B, K), 1000)
    x[2, 1] = 30000  # the tie's second index is a rejection
    kb = torch.tensor([4, 4, 4, 2])
    out = fused_verify(logits, x, None, num_draft_tokens=kb, temperature=0.0, top_k=50, top_p=0.9, seed=3,
                       backend="torch")
    u = philox_uniforms(torch.full((B,), 3), torch.zeros(B, dtype=torch.int64), K)
    ref = verify_reference(logits, x, None, kb, torch.zeros(B), torch.full((B,), 50), torch.full((B,), 0.9), u)
    assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1])
    assert out.num_accepted.tolist() == [4, -1, 1, 2] and out.tokens[2, 1] == 1000
    assert out.tokens[0, 4] == 1000
    assert len(counted) == 1


def test_bad_parameter_values_match_reference(counted, monkeypatch, device_value_checks):
    """Where values are not range-checked on the host (emulated: torch.compile or CUDA), a bad
    num_draft_tokens, top_k or top_p marks a greedy row invalid on both routes alike."""
    g = torch.Generator().manual_seed(9)
    B, K, V = 5, 3, 20
    logits = torch.randn(B, K + 1, V, generator=g)
    x = logits[:, :K].argmax(-1)
    kw = dict(target_logits=logits, draft_tokens=x, temperature=torch.zeros(B), seed=1, backend="torch",
              num_draft_tokens=torch.tensor([3, 4, -1, 2, 3]), top_k=torch.tensor([0, 1, 2, -1, 3]),
              top_p=torch.tensor([1.0, 0.5, 0.5, 0.5, 1.5]))
    fast = fused_verify(**kw)
    full = _full_path(monkeypatch, **kw)
    _assert_identical(fast, full)
    assert fast.num_accepted.tolist() == [3, -1, -1, -1, -1] and len(counted) == 1


def test_mixed_and_empty_batches_keep_the_full_path(counted):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 3, 30, generator=g)
    x = torch.randint(0, 30, (3, 2), generator=g)
    fused_verify(logits, x, temperature=torch.tensor([0.0, 0.7, 0.0]), seed=1, backend="torch")
    fused_verify(logits, x, temperature=0.5, seed=1, backend="torch")
    out = fused_verify(logits[:0], x[:0], temperature=0.0, seed=1, backend="torch")
    assert out.tokens.shape == (0, 3) and out.num_accepted.shape == (0,)
    assert counted == []
    fused_verify(logits, x, temperature=0.0, seed=1, backend="torch")
    assert len(counted) == 1


def test_fast_path_reads_no_random_numbers(monkeypatch):
    """Greedy outputs do not depend on the uniforms, and the route draws none (philox unused)."""
    def boom(*a, **k):
        raise AssertionError("the greedy route must not draw random numbers")

    monkeypatch.setattr(_verify_torch, "philox_uniforms", boom)
    monkeypatch.setattr(_verify_torch, "philox_uniforms_host", boom)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 64, generator=g)
    x = logits[:, :4].argmax(-1)
    a = fused_verify(logits, x, temperature=0.0, seed=1, backend="torch")
    b = fused_verify(logits, x, temperature=0.0, seed=2, offset=9, backend="torch")
    assert torch.equal(a.tokens, b.tokens) and a.num_accepted.tolist() == [4, 4]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unusable_positions_with_top_p_mark_rows_invalid(temperature, device):
    """A NaN, +inf or all -inf position under top-p marks its row invalid on the torch path (the
    reference's top-p cut once indexed -1 there and raised) as in the kernel."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 3, 40, generator=g)
    logits[0, 0, 5] = float("nan")
    logits[1, 0, 9] = float("inf")
    logits[2, 0] = float("-inf")
    x = logits[:, :2].argmax(-1)
    kw = dict(temperature=temperature, top_p=torch.tensor([0.9, 0.5, 1.0, 0.8]), seed=1)
    a = fused_verify(logits, x, **kw, backend="torch")
    b = fused_verify(logits.to(device), x.to(device), **{**kw, "top_p": kw["top_p"].to(device)}, backend="triton")
    assert a.num_accepted.tolist()[:3] == [-1, -1, -1] and a.num_accepted[3] >= 0
    assert torch.equal(a.tokens, b.tokens.cpu()) and torch.equal(a.num_accepted, b.num_accepted.cpu())


@pytest.mark.parametrize("chunk", [1, 3, 256])
@pytest.mark.parametrize("V", [1, 5, 256, 257, 1000])
def test_max_and_first_argmax_equal_torch(V, chunk, torch_routes):
    torch_routes(argmax_chunk=chunk)
    g = torch.Generator().manual_seed(V + chunk)
    s = torch.randint(-3, 2, (40, V), generator=g).float()  # many ties
    s[0] = float("-inf")
    s[1, -1] = float("inf")
    s[2, 0] = -0.0
    s[3] = -0.0
    s[3, V // 2] = 0.0
    for dtype in DTYPES:
        x = s.to(dtype)
        for view in (x, x.t().contiguous().t()):  # dense rows, and a last dim with stride 40
            m, idx = _verify_torch._max_and_first_argmax(view)
            assert torch.equal(m, x.amax(-1)) and torch.equal(idx, x.float().argmax(-1)), (dtype, view.stride())


def test_routes_are_checked_and_restored():
    """``torch_path.routes``: the public seam the route tests use; settings named and checked, the
    previous ones back on leaving the block."""
    before = _verify_torch.current_routes()
    with _verify_torch.routes(argmax_chunk=3, row_draw_max=0):
        assert (_verify_torch.current_routes().argmax_chunk, _verify_torch.current_routes().row_draw_max) == (3, 0)
        with _verify_torch.routes(argmax_chunk=1):
            assert _verify_torch.current_routes().argmax_chunk == 1 and _verify_torch.current_routes().row_draw_max == 0
        assert _verify_torch.current_routes().argmax_chunk == 3
    assert _verify_torch.current_routes() == before == _verify_torch.Routes()
    with pytest.raises(TypeError, match=r"routes: unknown setting 'chunk', expected one of \['argmax_chunk'"):
        with _verify_torch.routes(chunk=2):
            pass
    with pytest.raises(ValueError, match=r"routes: argmax_chunk must be an int >= 1, got 0"):
        with _verify_torch.routes(argmax_chunk=0):
            pass
