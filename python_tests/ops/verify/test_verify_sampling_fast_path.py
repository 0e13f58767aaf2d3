"""The untruncated-sampling route of fused_verify's torch path (``_verify_torch._verify_untruncated``).

When no row has top-k or top-p (and not every row is greedy) the torch path skips the keep mask,
finds unusable positions from the maximum, and divides p = e / sum(e) out only where it is read.
These tests run many randomised batches (sampling and greedy rows mixed, temperatures from 0.05
to 20, NaN/+inf/all--inf positions, -inf entries, draft ids outside the vocabulary, NaN/negative
q, ragged K, K = 0, a padded target vocabulary, draft_probs None or not, fp32/bf16/fp16,
non-contiguous logits, near-certain acceptances and rejections) and require its outputs to equal
``verify_reference`` exactly, with the route counted; and check the route is not taken where a
warp is asked for.
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


def _count_calls(monkeypatch, route: str) -> list:
    """The shapes of the logits each call of _verify_torch.<route> saw, in order."""
    calls = []
    orig = getattr(_verify_torch, route)

    def wrapped(a, u):
        calls.append(a.target_logits.shape)
        return orig(a, u)

    monkeypatch.setattr(_verify_torch, route, wrapped)
    return calls


@pytest.fixture
def counted(monkeypatch):
    return _count_calls(monkeypatch, "_verify_untruncated")


@pytest.fixture
def counted_warped(monkeypatch):
    return _count_calls(monkeypatch, "_verify_warped")


def _random_case(rng: random.Random, g: torch.Generator) -> dict:
    B = rng.randint(1, 6)
    K = rng.choice([0, 1, 2, 3, 4, 6])
    V = rng.choice([1, 2, 3, 7, 50, 301, 1000])
    dtype = rng.choice(DTYPES)
    if rng.random() < 0.3:  # few distinct values: ties
        logits = torch.randint(-2, 3, (B, K + 1, V), generator=g).float()
    else:
        logits = torch.randn(B, K + 1, V, generator=g) * rng.choice([0.3, 3.0, 12.0])
    if rng.random() < 0.3:
        logits[torch.rand(B, K + 1, V, generator=g) < 0.2] = float("-inf")
        logits[torch.rand(B, K + 1, V, generator=g) < 0.1] = -0.0
    inject_unusable_positions(logits, rng)
    logits = logits.to(dtype)
    if rng.random() < 0.3:
        wide = torch.zeros(B, K + 3, V + 2, dtype=dtype)
        wide[:, 1:K + 2, 1:V + 1] = logits
        logits = wide[:, 1:K + 2, 1:V + 1]
    # Drafts: likely tokens (accepted often), then anything.
    probs = torch.softmax(torch.nan_to_num(logits.float(), nan=0.0, posinf=0.0), -1)[:, :K]
    x = torch.randint(0, V, (B, K), generator=g)
    if K and rng.random() < 0.7:
        x = torch.multinomial(torch.nan_to_num(probs.reshape(B * K, V), nan=1.0) + 1e-6, 1,
                              generator=g).view(B, K)
    for _ in range(rng.choice([0, 0, 1])):
        if K:
            x[rng.randrange(B), rng.randrange(K)] = rng.choice([-1, V, V + 5])
    x = x.to(rng.choice([torch.int64, torch.int32]))
    draft_probs = None
    if rng.random() < 0.7:
        Vd = rng.randint(1, V)
        draft_probs = torch.softmax(torch.randn(B, K, Vd, generator=g) * rng.choice([0.5, 3.0]), -1)
        if rng.random() < 0.2 and K:
            b, j, v = rng.randrange(B), rng.randrange(K), rng.randrange(Vd)
            draft_probs[b, j, v] = rng.choice([float("nan"), -1.0, float("inf")] + ([0.0] if Vd > 1 else []))
            if draft_probs[b, j, v] == 0:  # a zero in a distribution: renormalised (fused_verify checks sums)
                draft_probs[b, j] /= draft_probs[b, j].sum()
    kw = dict(target_logits=logits, draft_tokens=x, draft_probs=draft_probs, backend="torch")
    t = torch.empty(B).uniform_(0.05, 2.0, generator=g) if rng.random() < 0.8 else torch.full((B,), 20.0)
    if rng.random() < 0.4:  # greedy rows mixed in
        t[torch.rand(B, generator=g) < 0.4] = 0.0
    if not bool((t > 0).any()):
        t[0] = 1.0  # at least one sampling row (else the greedy route is taken)
    kw["temperature"] = t.to(rng.choice([torch.float32, torch.float64, torch.bfloat16])) if rng.random() < 0.8 \
        else float(t[0])
    if isinstance(kw["temperature"], float) and kw["temperature"] == 0:
        kw["temperature"] = 1.0
    r = rng.random()
    if r < 0.3:
        kw["num_draft_tokens"] = torch.randint(0, K + 1, (B,), generator=g)
    elif r < 0.5:
        kw["num_draft_tokens"] = rng.randint(0, K)
    kw.update(random_randomness(rng, g, B, K))
    return kw


def _reference(kw) -> tuple[torch.Tensor, torch.Tensor]:
    logits = kw["target_logits"]
    B, K1, _ = logits.shape
    K = K1 - 1
    t = kw["temperature"]
    t = t.float() if isinstance(t, torch.Tensor) else torch.full((B,), float(t))
    kb = kw.get("num_draft_tokens", K)
    kb = kb if isinstance(kb, torch.Tensor) else torch.full((B,), kb, dtype=torch.int64)
    if "uniforms" in kw:
        u = kw["uniforms"]
    else:
        seed = kw["seed"]
        seed = seed if isinstance(seed, torch.Tensor) else torch.full((B,), seed, dtype=torch.int64)
        u = philox_uniforms(seed, torch.full((B,), kw["offset"], dtype=torch.int64), K)
    per_row = lambda v, dt: None if v is None else (v.to(dt) if isinstance(v, torch.Tensor)  # noqa: E731
                                                    else torch.full((B,), v, dtype=dt))
    return verify_reference(logits, kw["draft_tokens"], kw["draft_probs"], kb, t,
                            per_row(kw.get("top_k"), torch.int64), per_row(kw.get("top_p"), torch.float32), u)


@pytest.mark.slow
def test_untruncated_route_equals_reference_on_random_cases(counted, torch_routes):
    rng = random.Random(4321)
    g = torch.Generator().manual_seed(4321)
    n_invalid = n_rejected = n_all = n_greedy_rows = 0
    N = 700
    for case in range(N):
        kw = _random_case(rng, g)
        torch_routes(argmax_chunk=rng.choice([1, 3, 16, 256]))
        # the final draw row by row (up to 8 rows) or batched (0: never row by row)
        torch_routes(row_draw_max=rng.choice([0, 8]))
        out = fused_verify(**kw)
        tokens, n_acc = _reference(kw)
        assert out.tokens.dtype == tokens.dtype and out.tokens.shape == tokens.shape, case
        assert torch.equal(out.tokens, tokens) and torch.equal(out.num_accepted, n_acc), (case, out, tokens, n_acc)
        K = kw["target_logits"].shape[1] - 1
        n_invalid += int((n_acc < 0).sum())
        n_rejected += int(((n_acc >= 0) & (n_acc < K)).sum())
        n_all += int(((n_acc == K) & (K > 0)).sum())
        t = kw["temperature"]
        n_greedy_rows += int((t == 0).sum()) if isinstance(t, torch.Tensor) else 0
    assert len(counted) == N, "every batch without top-k/top-p that is not all greedy takes the route"
    assert n_invalid > 50 and n_rejected > 300 and n_all > 50 and n_greedy_rows > 100, \
        (n_invalid, n_rejected, n_all, n_greedy_rows)


@pytest.mark.parametrize("warped", [False, True], ids=["untruncated", "warped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_sampling_routes_on_large_vocabulary(dtype, warped, counted, counted_warped):
    """V = 49,152 (the default pair's), B = 8, K = 4, against verify_reference itself; warped:
    per-row top-k and top-p, some off."""
    g = torch.Generator().manual_seed(11 + warped)
    B, K, V = 8, 4, 49152
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(dtype)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 4, -1)
    x = torch.multinomial(q.view(B * K, V), 1, generator=g).view(B, K)
    logits[5, 3, 17] = float("nan")
    t = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 1.0, 0.0, 2.0])
    top_k = torch.tensor([0, 50, 5, 0, 1000, 2, 0, 40000]) if warped else None
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1.0, 0.8, 0.99]) if warped else None
    out = fused_verify(logits, x, q, temperature=t, top_k=top_k, top_p=top_p, seed=torch.arange(B), offset=3,
                       backend="torch")
    u = philox_uniforms(torch.arange(B), torch.full((B,), 3), K)
    ref = verify_reference(logits, x, q, torch.full((B,), K), t, top_k, top_p, u)
    assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1])
    assert (len(counted), len(counted_warped)) == ((0, 1) if warped else (1, 0))
    assert int((ref[1] >= 0).sum()) >= 6


def test_route_not_taken_with_a_warp_or_all_greedy(counted):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 3, 40, generator=g)
    x = torch.randint(0, 40, (3, 2), generator=g)
    fused_verify(logits, x, temperature=1.0, top_k=5, seed=1, backend="torch")
    fused_verify(logits, x, temperature=1.0, top_p=0.9, seed=1, backend="torch")
    fused_verify(logits, x, temperature=1.0, top_k=0, seed=1, backend="torch")  # given (off): the reference route
    fused_verify(logits, x, temperature=0.0, seed=1, backend="torch")  # all greedy: the greedy route
    assert counted == []
    fused_verify(logits, x, temperature=torch.tensor([0.0, 1.0, 0.0]), seed=1, backend="torch")
    assert len(counted) == 1


def _ref_probs(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The reference's p = softmax(logits / T) [B, K+1, V], from its own building blocks."""
    from specdec_kernels.ops.reference import warp_logits
    from specdec_kernels.ops.verify.reference.warp import _target_probs

    B, K1, _ = logits.shape
    inv_t = 1.0 / t
    s, keep = warp_logits(logits, inv_t[:, None].expand(B, K1), None, None)
    return _target_probs(s, keep)


@pytest.mark.parametrize("row_draw", [False, True], ids=["batched_draw", "row_draw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_knife_edge_acceptance_and_draw(dtype, row_draw, counted, torch_routes):
    """Uniforms placed exactly on the reference's decision boundaries, so that a p(x) or a p_j one
    ulp away from the reference's flips an outcome: with q one-hot, x is accepted iff u < p(x), so
    u = p(x) rejects and the next float below accepts; the bonus draw returns the first v with
    cdf(v) > u * cdf(V-1), so a u for which u * cdf(V-1) equals cdf(v) exactly lands on v + 1 and
    the float below lands at or before v (the first index whose cdf exceeds it: a flat cdf ties).
    The uniforms, the test u * q(x) < p(x) and the cdf are float64 (the reference's)."""
    torch_routes(row_draw_max=64 if row_draw else 0)
    g = torch.Generator().manual_seed(21)
    B, K, V = 64, 1, 3000
    logits = (torch.randn(B, K + 1, V, generator=g) * 2.5).to(dtype)
    t = torch.empty(B).uniform_(0.5, 1.5, generator=g)
    p = _ref_probs(logits, t)
    # the 5th likeliest token: p(x) well inside (0, 1), and not the maximum (whose e = exp(0) = 1
    # would make e / sum and e * (1 / sum) agree)
    x = p[:, 0].topk(5, -1).indices[:, 4:5]
    p_x = p[:, 0].gather(-1, x)[:, 0].double()
    cdf = torch.cumsum(p[:, 1].double(), -1)
    total = cdf[:, -1]
    below = lambda v: torch.nextafter(v, torch.zeros_like(v))  # noqa: E731
    # a u with u * total == cdf[v] exactly, for a v in the middle of each row
    v = torch.full((B,), V // 2)
    target = cdf.gather(1, v[:, None])[:, 0]
    u_draw = target / total
    for _ in range(4):  # walk one ulp at a time to an exact hit where there is one
        low = u_draw * total < target
        u_draw = torch.where(low, torch.nextafter(u_draw, torch.ones_like(u_draw)), u_draw)
        high = u_draw * total > target
        u_draw = torch.where(high, below(u_draw), u_draw)
    exact = u_draw * total == target
    assert exact.sum() > B // 2, "enough rows with an exact boundary"
    for u0, u1 in ((p_x, u_draw), (below(p_x), u_draw), (below(p_x), below(u_draw))):
        u = torch.stack([u0, u1], 1)
        assert u.dtype == torch.float64
        out = fused_verify(logits, x, None, temperature=t, uniforms=u, backend="torch")
        ref = verify_reference(logits, x, None, torch.full((B,), K), t, None, None, u)
        assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1])
        assert out.num_accepted.tolist() == ([0] * B if u0 is p_x else [1] * B)  # the edge itself
        if u0 is not p_x:
            bonus = out.tokens[:, 1]
            # the first index whose cdf exceeds u * total (ties of a flat cdf counted)
            want = (cdf <= (u1 * total)[:, None]).sum(-1)
            assert torch.equal(bonus[exact], want[exact])
            assert bool((want[exact] >= v[exact] + 1).all() if u1 is u_draw else (want[exact] <= v[exact]).all())
    assert len(counted) == 3


@pytest.mark.parametrize("row_draw", [False, True], ids=["batched_draw", "row_draw"])
def test_final_draw_edges_equal_the_reference(row_draw, counted, torch_routes):
    """The final draw's edges on the untruncated route, row by row and batched, against the
    reference: a residual that sums to zero (q >= p everywhere: q = p * (1 + 2^-20), a draft
    rejected by u = 1 - 2^-53) falls back to p; a rejected one-hot draft; a rejected draft past
    a draft vocabulary Vd < V; a NaN q at the rejected position (the row is invalid); final
    uniforms 0 and 1 - 2^-53; K_b = 0 (the bonus from position 0)."""
    torch_routes(row_draw_max=64 if row_draw else 0)
    g = torch.Generator().manual_seed(5)
    V, B = 37, 6
    logits = torch.randn(B, 2, V, generator=g) * 2
    p0 = torch.softmax(logits[:, 0], -1)
    x = p0.argmax(-1, keepdim=True)  # [B, 1]
    q = torch.softmax(torch.randn(B, 1, V, generator=g), -1)
    q[0, 0] = p0[0] * (1 + 2.0 ** -20)  # row 0: q >= p everywhere
    q[3, 0, x[3, 0]] = 1.0  # row 3: rejected (q(x) > p(x)), with an unusable q elsewhere, read then
    q[3, 0, (int(x[3, 0]) + 1) % V] = float("nan")
    near_one = 1 - 2.0 ** -53
    for u_final in (0.0, 0.37, near_one):
        u = torch.tensor([[near_one, u_final]] * B, dtype=torch.float64)
        q20 = q[:, :, :20].clone()  # a draft vocabulary of 20 (renormalised: fused_verify checks the sums)
        s20 = q20.sum(-1, keepdim=True)
        q20 = torch.where(torch.isfinite(s20), q20 / s20, q20)
        cases = ((q, None), (None, None), (q20, None), (q, torch.tensor([1, 0, 1, 1, 0, 1])))
        for draft_probs, kb in cases:
            kw = dict(num_draft_tokens=kb) if kb is not None else {}
            out = fused_verify(logits, x, draft_probs, temperature=1.0, uniforms=u, backend="torch", **kw)
            ref = verify_reference(logits, x, draft_probs, kb if kb is not None else torch.ones(B, dtype=torch.int64),
                                   torch.ones(B), None, None, u)
            assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1]), (u_final, kb)
            if draft_probs is q and kb is None:
                assert out.num_accepted[0] == 0 and out.num_accepted[3] == -1  # rejected; invalid
                # row 0's residual is empty: its token is drawn from p_0 (which has no zero)
                assert 0 <= int(out.tokens[0, 0]) < V
    assert len(counted) == 12


@pytest.mark.parametrize("V", [4095, 4096])
def test_row_draw_takes_large_vocabularies_at_any_batch(V, counted, monkeypatch):
    """B = 12 rows (above Routes.row_draw_max): row by row from V = 4,096 on (Routes.row_draw_min_v), batched
    below it; either way the reference's tokens, rejections and an invalid row included."""
    rows = []
    orig = _verify_torch.final_token
    monkeypatch.setattr(_verify_torch, "final_token", lambda *a: rows.append("batched") or orig(*a))
    g = torch.Generator().manual_seed(V)
    B, K = 12, 2
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    q[5, 1, 7] = float("nan")
    x = torch.randint(0, V, (B, K), generator=g)
    x[:, 0] = logits[:, 0].argmax(-1)  # accepted often
    seed = torch.arange(B) + 100
    out = fused_verify(logits, x, q, temperature=0.9, seed=seed, offset=3, backend="torch")
    ref = verify_reference(logits, x, q, torch.full((B,), K), torch.full((B,), 0.9), None, None,
                           philox_uniforms(seed, torch.full((B,), 3), K))
    assert torch.equal(out.tokens, ref[0]) and torch.equal(out.num_accepted, ref[1])
    assert rows == ([] if V >= _verify_torch.Routes().row_draw_min_v else ["batched"])
    assert len(counted) == 1 and (out.num_accepted < K).any()


# ----------------------------------------------------------------------------------------------
# Rows with top-k / top-p: the reference's computation with NumPy's sort on the CPU
# ----------------------------------------------------------------------------------------------
def test_sort_descending_cpu_equals_torchs_sort():
    """The same values in the same places as torch.sort(descending=True), NaN first, over ties,
    signed zeros, +-inf and NaN, in 1 to 49,152 tokens; torch's own sort off the fast path."""
    from specdec_kernels.ops.host import sort_descending_cpu

    g = torch.Generator().manual_seed(5)
    for V in (1, 2, 7, 300, 49152):
        for case in range(6):
            s = torch.randint(-3, 4, (3, 2, V), generator=g).float() if case % 2 else torch.randn(3, 2, V, generator=g)
            s[0, 0, ::3] = 0.0
            s[0, 1, ::5] = -0.0
            s[1, 0, V // 2] = float("nan")
            s[2, 1, : V // 2] = float("-inf")
            s[2, 0, 0] = float("inf")
            want = torch.sort(s, dim=-1, descending=True).values
            got = sort_descending_cpu(s)
            assert got.shape == s.shape and got.is_contiguous()
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(torch.nan_to_num(got, nan=0.5), torch.nan_to_num(want, nan=0.5))
            view = s[:, :, : V // 2 + 1].transpose(0, 1)  # not contiguous
            got, want = sort_descending_cpu(view), torch.sort(view, dim=-1, descending=True).values
            assert torch.equal(got.nan_to_num(nan=0.5), want.nan_to_num(nan=0.5))
    s = torch.randn(2, 50, generator=g, requires_grad=True)
    assert torch.equal(sort_descending_cpu(s), torch.sort(s, -1, descending=True).values)


@pytest.mark.slow
def test_warped_rows_equal_the_reference_on_random_cases(counted, counted_warped, torch_routes):
    """fused_verify's torch path with top-k / top-p (``_verify_torch._verify_warped``: the reference's
    warp through NumPy's sort, the unmasked maximum, in place, the row-by-row or batched draw)
    against verify_reference with torch's sort: the same tokens and counts on 600 random batches
    (ties, signed zeros, NaN/inf positions, bad ids and q, ragged K, greedy rows, fp32/bf16/fp16,
    top-k and top-p alone and together, per row or shared)."""
    rng = random.Random(97)
    g = torch.Generator().manual_seed(97)
    n_kept_few = 0
    N = 600
    for case in range(N):
        kw = _random_case(rng, g)
        torch_routes(argmax_chunk=rng.choice([1, 3, 16, 256]))
        torch_routes(row_draw_max=rng.choice([0, 8]))
        logits = kw["target_logits"]
        B, K1, V = logits.shape
        top_k = top_p = None
        if rng.random() < 0.7:
            top_k = torch.randint(0, V + 2, (B,), generator=g) if rng.random() < 0.7 else rng.randint(1, V)
        if top_k is None or rng.random() < 0.6:
            top_p = torch.empty(B).uniform_(0.05, 1.0, generator=g) if rng.random() < 0.7 else rng.choice([0.3, 0.9])
        kw.update(top_k=top_k, top_p=top_p)
        out = fused_verify(**kw)
        tokens, n_acc = _reference(kw)  # torch's sort
        assert torch.equal(out.tokens, tokens) and torch.equal(out.num_accepted, n_acc), (case, kw)
        n_kept_few += int(isinstance(top_p, float) and top_p < 0.5)
    assert counted == [] and len(counted_warped) == N, "every batch with a warp takes the warped route"
    assert n_kept_few > 20
