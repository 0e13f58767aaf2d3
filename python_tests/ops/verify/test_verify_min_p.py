"""``min_p=``: min-p sampling in the target's warp, after temperature, top-k and top-p (the order
transformers' ``generate`` applies them in).

Definition (``reference.warp_logits``): with s = logits / T and m = max s, min-p keeps token v iff
s_v >= T_mp = fl32(m + L), L = fl32(ln(min_p)) (``reference.min_p_log``: a fixed sequence of
float64 IEEE steps that the kernel repeats, so every backend gets the same bits), i.e. p(v) >=
min_p * max p up to rounding at the boundary; min_p = 0 is off, min_p = 1 keeps the maximum and
its ties.

1. The reference against a direct float64 definition (random logits, ties, the boundary itself),
   against transformers' TopK/TopP/MinP warpers, and the extremes 0 and 1.
2. The torch path and the Triton kernel (interpreted on CPU tensors here) equal the reference
   token for token, padded and packed, fp32/bf16, scalar and per-row min_p, with top-k/top-p and
   greedy rows mixed in, over several chunks (the kept set decided from the candidate lists and
   by the one-pass fallback); the kernel's threshold key is the reference's bit for bit.
3. Distribution: a chi-square (significance 1e-4, 100,000 trials, torch path; the kernel equals
   it token for token above) of the first emitted token against its exact law from p = warp(min_p)
   and q, and a mutant (min-p applied before the temperature) that the same statistic rejects.
4. Argument errors name min_p, the expected and the actual value; a bad per-row value that is not
   read on the host (a device tensor) makes its row invalid; seeded calls are deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import HAS_CUDA
from helpers import assert_close, make_step
from specdec_kernels import fused_verify, fused_verify_packed
from specdec_kernels.ops.verify.reference import chain as chain_reference, warp as warp_reference
from specdec_kernels.ops import reference as ref
from specdec_kernels.ops import verify as verify_mod
from specdec_kernels.ops.kernels import split_workspace
from specdec_kernels.ops.reference import (emitted_logprobs, min_p_log, min_p_threshold, order_key, philox_uniforms,
                                       verify_reference, warp_logits)
from helpers import chi_square_pvalue
from test_verify_draft_logits import first_token_law
from test_verify_packed import _pack

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = [pytest.param("triton", marks=pytest.mark.slow), "torch"]  # the kernel, interpreted on a CPU: slow


def _dev(t):
    return t.to(DEV) if isinstance(t, torch.Tensor) else t


def _fl32_ln(x: float) -> float:
    """fl32(ln x) through the host's libm (float64), an independent route to min_p_log's value."""
    return float(np.float32(math.log(x)))


def _keep_exact_fp32(s: np.ndarray, min_p: float) -> np.ndarray:
    """The min-p keep rule written independently in NumPy fp32: s >= fl32(max s + fl32(ln min_p))."""
    s = s.astype(np.float32)
    if min_p == 0:
        return np.ones(s.shape, dtype=bool)
    T = np.float32(s.max()) + np.float32(_fl32_ln(float(np.float32(min_p))))
    return s >= T


# ---------------------------------------------------------------------------------------------
# 1. The reference's semantics
# ---------------------------------------------------------------------------------------------
def test_min_p_log_is_ln_rounded_to_fp32():
    """min_p_log(x) = fl32(ln x) (libm's, float64, rounded) on 400,000 fp32 values spread over (0, 1]
    (uniform and log-uniform down to ~1e-45), and exactly 0 at 1, -fl32(ln 2) at 1/2."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(200_000, generator=g), torch.exp(-torch.rand(200_000, generator=g) * 103),
                   torch.tensor([1.0, 0.5, 0.05, 0.1, 0.3, 2.0 ** -24, 1.17549435e-38, 1.4e-45])]).float()
    x = x[x > 0]
    want = torch.tensor([math.log(v) for v in x.double().tolist()], dtype=torch.float64).float()
    got = min_p_log(x)
    assert torch.equal(got, want), int((got != want).sum())
    assert min_p_log(torch.tensor([1.0, 0.5])).tolist() == [0.0, _fl32_ln(0.5)]


def test_kernel_holds_the_reference_log_constants():
    """The kernel's float64 constants of min_p_log (series coefficients, ln 2, sqrt 2) are the
    reference's, bit for bit (the kernel's threshold test below checks the result as well)."""
    import specdec_kernels.ops.verify.triton.candidates as kmod

    def value(c):
        return getattr(c, "value", c)

    assert [value(getattr(kmod, f"_LC{k}")) for k in range(12)] == list(ref.LOG_SERIES)
    assert value(kmod._LN2) == ref.LN2 == math.log(2) and value(kmod._SQRT2) == ref.SQRT2 == math.sqrt(2)


@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_reference_keep_set_equals_the_float64_definition(min_p, ties):
    """On random logits (some rounded to a coarse grid: many ties), T in {0.5, 1, 1.7}: the kept set
    is {v : exp(s_v - m) >= min_p} in float64 for every token not within rounding of the boundary
    (|s_v - m - ln min_p| > 1e-5 (1 + |m|); at most 2 of the 12,800 are not), the exact fp32 rule
    written independently everywhere,
    tied tokens are kept or dropped together, and the maximum is always kept."""
    g = torch.Generator().manual_seed(int(min_p * 1000) + ties)
    B, V = 64, 200
    logits = torch.randn(B, V, generator=g) * torch.linspace(0.5, 6.0, B)[:, None]
    if ties:
        logits = (logits * 2).round() / 2  # steps of 0.5
    inv_t = torch.tensor([2.0, 1.0, 1 / 1.7])[torch.arange(B) % 3].float()
    mp = torch.full((B,), min_p)
    s, keep = warp_logits(logits, inv_t, None, None, min_p=mp)
    s64 = s.double()
    m64 = s64.amax(-1, keepdim=True)
    keep64 = torch.exp(s64 - m64) >= min_p
    margin = (s64 - m64 - math.log(min_p)).abs() > 1e-5 * (1 + m64.abs())
    assert torch.equal(keep[margin], keep64[margin])
    near = ~margin & (s64 != m64)  # the maximum is on the boundary itself when min_p = 1
    assert int(near.sum()) <= 2, int(near.sum())
    for b in range(B):
        assert np.array_equal(keep[b].numpy(), _keep_exact_fp32(s[b].numpy(), min_p)), b
        for value in s[b].unique():
            group = keep[b][s[b] == value]
            assert bool(group.all()) or not bool(group.any())
    assert keep.gather(-1, s.argmax(-1, keepdim=True)).all()


def test_boundary_is_inclusive_in_fp32():
    """Logits placed at T_mp = fl32(m + fl32(ln min_p)) itself (kept, with a tie of it), one fp32
    ulp below (dropped) and one above (kept), at several m and min_p (T = 1: s = logits)."""
    for m in (0.0, 3.25, -17.5, 1000.0):
        for min_p in (0.05, 0.1, 0.3, 0.77, 1.0):
            T = float(min_p_threshold(torch.tensor([m]), torch.tensor([min_p]))[0])
            mp32 = float(np.float32(min_p))  # the fp32 value the op holds
            assert T == float(np.float32(np.float32(m) + np.float32(_fl32_ln(mp32))))
            below = float(np.nextafter(np.float32(T), np.float32(-np.inf)))
            above = float(np.nextafter(np.float32(T), np.float32(np.inf)))
            row = torch.tensor([[m, T, T, below, above if above <= m else m, -50.0 + min(m, 0) * 3]])
            _, keep = warp_logits(row, torch.ones(1), None, None, min_p=torch.tensor([min_p]))
            assert keep[0].tolist() == [True, True, True, False, True, False], (m, min_p, row, keep)


def test_min_p_zero_is_off_and_one_keeps_the_argmax_ties():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[1, [4, 17, 33]] = logits[1].max() + 1.0  # a three-way tie at the maximum
    logits[2, 5] = float("-inf")
    inv_t = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.3, 0.7])
    for top_k, top_p in ((None, None), (torch.full((6,), 7), None), (None, torch.full((6,), 0.8)),
                         (torch.full((6,), 7), torch.full((6,), 0.8))):
        s0, k0 = warp_logits(logits, inv_t, top_k, top_p)
        s1, k1 = warp_logits(logits, inv_t, top_k, top_p, min_p=torch.zeros(6))
        assert torch.equal(s0, s1) and torch.equal(k0, k1)
        _, k_one = warp_logits(logits, inv_t, top_k, top_p, min_p=torch.ones(6))
        assert torch.equal(k_one, s0 == s0.amax(-1, keepdim=True))
    assert k_one[1].nonzero()[:, 0].tolist() == [4, 17, 33]


def test_min_p_intersects_top_k_and_top_p():
    """warp(top-k, top-p, min-p) = warp(top-k, top-p) & warp(min-p): top-p's mass is over the
    top-k set, not over the min-p set."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(40, 30, generator=g) * 2.5
    inv_t = torch.rand(40, generator=g) + 0.5
    top_k = torch.randint(0, 30, (40,), generator=g)
    top_p = torch.rand(40, generator=g) * 0.9 + 0.1
    mp = torch.rand(40, generator=g) * 0.5
    _, kp = warp_logits(logits, inv_t, top_k, top_p)
    _, m_only = warp_logits(logits, inv_t, None, None, min_p=mp)
    _, both = warp_logits(logits, inv_t, top_k, top_p, min_p=mp)
    assert torch.equal(both, kp & m_only)
    assert (both.sum(-1) < kp.sum(-1)).any() and (both.sum(-1) < m_only.sum(-1)).any()


def test_order_and_kept_sets_are_transformers():
    """transformers' generate() order: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    then MinPLogitsWarper (``GenerationMixin._get_logits_processor``); on 400 random positions the
    kept sets equal that chain's (tokens within 1e-4 of a top-p or min-p boundary left out), while
    min-p before top-p would keep other sets on some of them (the order matters and is checked)."""
    gen = pytest.importorskip("transformers.generation.logits_process")
    import inspect

    from transformers.generation import utils as gen_utils

    src = inspect.getsource(gen_utils.GenerationMixin._get_logits_processor)
    order = [src.index(name) for name in ("TemperatureLogitsWarper(", "TopKLogitsWarper(", "TopPLogitsWarper(",
                                          "MinPLogitsWarper(")]
    assert order == sorted(order)
    g = torch.Generator().manual_seed(5)
    differs_if_reversed = 0
    for case in range(400):
        V = 40
        logits = torch.randn(1, V, generator=g) * float(torch.rand(1, generator=g) * 4 + 0.5)
        T = float(torch.rand(1, generator=g) * 1.5 + 0.3)
        k = int(torch.randint(0, V + 5, (1,), generator=g))
        p = float(torch.rand(1, generator=g) * 0.7 + 0.3)
        mp = float(torch.rand(1, generator=g) * 0.4)
        scores = gen.TemperatureLogitsWarper(T)(None, logits.clone())
        if k:
            scores = gen.TopKLogitsWarper(top_k=k)(None, scores)
        scores = gen.TopPLogitsWarper(top_p=p)(None, scores)
        scores = gen.MinPLogitsWarper(min_p=mp)(None, scores)
        hf = torch.isfinite(scores[0])
        s, keep = warp_logits(logits, torch.tensor([1.0 / T]), torch.tensor([k]), torch.tensor([p]),
                              min_p=torch.tensor([mp]))
        # boundaries in float64: min-p's ratio, and top-p's mass strictly ahead over the top-k set
        s64 = s[0].double()
        _, kk = warp_logits(logits, torch.tensor([1.0 / T]), torch.tensor([k]), None)
        e = torch.where(kk[0], torch.exp(s64 - s64.max()), 0.0)
        pk = e / e.sum()
        ahead = torch.stack([pk[s64 > s64[v]].sum() for v in range(V)])
        clear = ((s64 - s64.max() - math.log(mp)).abs() > 1e-4 if mp > 0 else torch.ones(V, dtype=torch.bool)) & (
            (ahead - p).abs() > 1e-4)
        assert torch.equal(keep[0][clear], hf[clear]), (case, keep, hf)
        # min-p first, then top-p over the min-p set
        e_m = torch.where(kk[0] & (torch.exp(s64 - s64.max()) >= mp), torch.exp(s64 - s64.max()), 0.0)
        pm = e_m / e_m.sum()
        rev = (e_m > 0) & (torch.stack([pm[s64 > s64[v]].sum() for v in range(V)]) < p)
        differs_if_reversed += int(not torch.equal(rev[clear], keep[0][clear]))
    assert differs_if_reversed >= 5, differs_if_reversed


def test_reference_greedy_rows_ignore_min_p_and_refuse_it_with_probabilities():
    logits, x, q = make_step(3, 2, 30, seed=9)
    kb = torch.full((3,), 2)
    temperature = torch.zeros(3)
    u = torch.rand(3, 3, generator=torch.Generator().manual_seed(1)).double()
    a = verify_reference(logits, x, q, kb, temperature, None, None, u)
    b = verify_reference(logits, x, q, kb, temperature, None, None, u, min_p=torch.tensor([1.0, 0.5, 0.0]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="min_p must be None with target_is_probs=True"):
        verify_reference(torch.softmax(logits, -1), x, q, kb, torch.ones(3), None, None, u, target_is_probs=True,
                         min_p=torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# 2. Backends == reference
# ---------------------------------------------------------------------------------------------
CONFIGS = [  # (B, K, V, logits dtype, min_p form, top_k/top_p, chunk)
    (4, 3, 111, torch.float32, "per_row", False, None),
    (4, 3, 111, torch.float32, "scalar", True, None),
    (4, 2, 257, torch.bfloat16, "per_row", True, None),
    (3, 4, 97, torch.float32, "per_row", True, 16),
    (4, 2, 300, torch.bfloat16, "scalar", False, 32),
]


def _cfg_id(c):
    B, K, V, dt, form, warp, chunk = c
    warp_id = "topk_topp" if warp else "min_p_only"
    return f"B{B}K{K}V{V}-{str(dt)[6:]}-{form}-{warp_id}{'-chunk' + str(chunk) if chunk else ''}"


def _row_params(B, V, form, warp):
    """Mixed rows: min_p 0 / 0.05 / 0.3 / 1.0 (per row) or 0.1 (scalar); a greedy row (T = 0)."""
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3][:B])
    mp = torch.tensor([0.0, 0.05, 0.3, 1.0][:B]) if form == "per_row" else 0.1
    top_k = torch.tensor([min(6, V), 0, 0, 4][:B]) if warp else None
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.95][:B]) if warp else None
    return temperature, mp, top_k, top_p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_backends_equal_the_reference_padded_and_packed(cfg, backend, split_settings):
    B, K, V, dtype, form, warp, chunk = cfg
    if chunk:
        split_settings(chunk=chunk)
        split_settings(top_k_cap=8)
    logits, x, q = make_step(B, K, V, dtype, seed=B * 100 + K * 10 + V % 7, scale=2.0)
    kb = torch.tensor([K, K, K - 1, 1][:B])
    temperature, mp, top_k, top_p = _row_params(B, V, form, warp)
    mp_t = mp if isinstance(mp, torch.Tensor) else torch.full((B,), mp)
    for s in range(2):
        seed = torch.arange(B) * 31 + 5 + s
        offset = torch.arange(B) + 2
        kw = dict(temperature=_dev(temperature), top_k=_dev(top_k), top_p=_dev(top_p), min_p=_dev(mp),
                  seed=_dev(seed), offset=_dev(offset), backend=backend)
        padded = fused_verify(_dev(logits), _dev(x), _dev(q), num_draft_tokens=_dev(kb), **kw)
        pl, px, cu, pq = _pack(logits, x, q, kb)
        packed = fused_verify_packed(_dev(pl), _dev(px), _dev(cu), _dev(pq), max_num_draft_tokens=K, **kw)
        u = philox_uniforms(seed, offset, K)
        rt, rn = verify_reference(logits, x, q, kb, temperature, top_k, top_p, u, min_p=mp_t)
        assert (rn >= 0).all()
        for out in (padded, packed):
            assert torch.equal(out.num_accepted.cpu(), rn), (out.num_accepted, rn)
            assert torch.equal(out.tokens.cpu(), rt), (out.tokens, rt)


def test_cases_exercise_min_p():
    """The configurations above keep fewer tokens with min-p than without it at the positions they
    use, and their sampled rows both accept and reject (a check of the inputs, on the reference)."""
    seen = set()
    for B, K, V, dtype, form, warp, _ in CONFIGS:
        logits, x, q = make_step(B, K, V, dtype, seed=B * 100 + K * 10 + V % 7, scale=2.0)
        temperature, mp, top_k, top_p = _row_params(B, V, form, warp)
        mp_t = mp if isinstance(mp, torch.Tensor) else torch.full((B,), mp)
        inv_t = torch.where(temperature == 0, 1.0, 1 / temperature.masked_fill(temperature == 0, 1.0))
        K1 = K + 1
        _, k0 = warp_logits(logits, inv_t[:, None].expand(B, K1), chain_reference.per_position(top_k, K1),
                            chain_reference.per_position(top_p, K1))
        _, k1 = warp_logits(logits, inv_t[:, None].expand(B, K1), chain_reference.per_position(top_k, K1),
                            chain_reference.per_position(top_p, K1), min_p=chain_reference.per_position(mp_t, K1))
        assert (k1.sum(-1) < k0.sum(-1))[temperature != 0].any()
        kb = torch.tensor([K, K, K - 1, 1][:B])
        for s in range(2):
            u = philox_uniforms(torch.arange(B) * 31 + 5 + s, torch.arange(B) + 2, K)
            _, n = verify_reference(logits, x, q, kb, temperature, top_k, top_p, u, min_p=mp_t)
            for b in range(B):
                if temperature[b] != 0:
                    seen.add("rejects" if n[b] < kb[b] else "accepts all")
    assert seen == {"rejects", "accepts all"}


def _records(B, K1, V):
    chunk = verify_mod.split_kernel_meta(V, K1, True, False, False, False)["CHUNK"]
    ws = split_workspace(DEV)
    return {k: v.cpu().clone() for k, v in ws.records(B, K1, -(-V // chunk)).items()}


@pytest.mark.slow
def test_kernel_threshold_key_is_the_reference_bit_for_bit():
    """64 rows of one position, min_p spread over (0, 1] (log-uniform down to 1e-30, powers of two,
    1, the smallest fp32 values), logits of several scales, T in {0.5, 1, 1.7}: the kernel's
    threshold record equals order_key(min_p_threshold(m, min_p)) of the reference in every row."""
    B, V = 64, 16
    g = torch.Generator().manual_seed(8)
    mp = torch.exp(-torch.rand(B, generator=g) * 69)
    mp[:8] = torch.tensor([1.0, 0.5, 0.25, 2.0 ** -20, 1.4e-45, 1.17549435e-38, 0.05, 0.999999])
    logits = torch.randn(B, 1, V, generator=g) * torch.logspace(-2, 2, B)[:, None, None]
    temperature = torch.tensor([0.5, 1.0, 1.7])[torch.arange(B) % 3]
    fused_verify(_dev(logits), _dev(torch.zeros(B, 0, dtype=torch.int64)), temperature=_dev(temperature),
                 min_p=_dev(mp), seed=1, backend="triton")
    rec = _records(B, 1, V)
    m = (logits[:, 0] * (1 / temperature)[:, None]).amax(-1)
    want = order_key(min_p_threshold(m, mp))
    assert torch.equal(rec["thr"][:, 0], want.to(rec["thr"].dtype))


@pytest.mark.slow
@pytest.mark.parametrize("kept,scans", [("few", 0), ("most", 1)])
def test_kernel_threshold_from_the_lists_or_one_pass(kept, scans, split_settings):
    """Eight chunks of 16 tokens, 4 candidates a chunk: a min-p set of a few tokens (far above the
    rest) lies in the candidate lists (no scan); one of most of the vocabulary (flat logits, min_p
    0.01) does not (one pass of the position). Either way the position's threshold key is the
    reference's order_key(min_p_threshold(m, min_p)) bit for bit, its kept mass matches the
    reference's, and the tokens equal the reference's."""
    split_settings(chunk=16)
    split_settings(top_k_cap=4)
    B, K, V = 2, 2, 120
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(B, K + 1, V, generator=g) * (0.3 if kept == "most" else 0.1)
    if kept == "few":
        for r, v in enumerate([7, 40, 41, 90]):
            logits[:, :, v] = 6.0 - 0.4 * r
    temperature = torch.tensor([1.0, 0.6])
    mp = torch.tensor([0.01, 0.01]) if kept == "most" else torch.tensor([0.2, 0.05])
    q = torch.softmax(logits[:, :K] * 0.7, -1)
    x = torch.stack([torch.multinomial(q[:, i], 1, generator=g)[:, 0] for i in range(K)], 1)
    for s in range(3):
        seed, offset = torch.tensor([s, s + 7]), torch.tensor([1, 2])
        out = fused_verify(_dev(logits), _dev(x), _dev(q), temperature=_dev(temperature), min_p=_dev(mp),
                           seed=_dev(seed), offset=_dev(offset), backend="triton")
        rt, rn = verify_reference(logits, x, q, torch.full((B,), K), temperature, None, None,
                                  philox_uniforms(seed, offset, K), min_p=mp)
        assert torch.equal(out.tokens.cpu(), rt) and torch.equal(out.num_accepted.cpu(), rn), (s, out, rt, rn)
    rec = _records(B, K + 1, V)
    s_ = logits * (1 / temperature)[:, None, None]
    m = s_.amax(-1)
    want_thr = order_key(min_p_threshold(m, mp[:, None].expand(B, K + 1)))
    kept_mask = s_ >= min_p_threshold(m, mp[:, None].expand(B, K + 1))[..., None]
    n_kept = kept_mask.sum(-1)
    for b in range(B):
        for i in range(int(rn[b]) + 1 if rn[b] >= 0 else 0):
            assert int(rec["thr"][b, i]) == int(want_thr[b, i]), (b, i)
            assert int(rec["scanned"][b, i]) == scans, (b, i, rec["scanned"])
            S_ref = torch.where(kept_mask[b, i], torch.exp(s_[b, i] - m[b, i]), 0.0).sum()
            assert_close(rec["S"][b, i], S_ref)
    assert (n_kept > 40).all() if kept == "most" else (n_kept <= 4).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_p_zero_equals_no_min_p_exactly(backend):
    """min_p = 0 (a scalar, or a [B] tensor of zeros) gives the call without min_p token for token,
    with and without top-k/top-p, and the same log-probabilities bit for bit."""
    B, K, V = 4, 3, 80
    logits, x, q = make_step(B, K, V, seed=12, scale=2.5)
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.4])
    for warp in (False, True):
        w = dict(top_k=_dev(torch.tensor([5, 0, 9, 0]))) if warp else {}
        for s in range(2):
            kw = dict(temperature=_dev(temperature), seed=_dev(torch.arange(B) + 10 * s), backend=backend,
                      return_logprobs=True, **w)
            base = fused_verify(_dev(logits), _dev(x), _dev(q), **kw)
            for mp in (0.0, torch.zeros(B)):
                got = fused_verify(_dev(logits), _dev(x), _dev(q), min_p=_dev(mp), **kw)
                assert torch.equal(got.tokens, base.tokens) and torch.equal(got.num_accepted, base.num_accepted)
                assert torch.equal(got.logprobs, base.logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_p_one_emits_only_argmax_ties(backend):
    """min_p = 1 on sampled rows: p is uniform over the maximum's ties, so every emitted token is one
    of them (drafts outside are rejected, the final draw lands on a tie), and all ties appear."""
    n, K, V = 64, 2, 40
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(n, K + 1, V, generator=g)
    ties = [3, 19, 38]
    logits[:, :, ties] = 6.0
    q = torch.softmax(logits[:, :K] * 0.3, -1)
    x = torch.stack([torch.multinomial(q[:, i], 1, generator=g)[:, 0] for i in range(K)], 1)
    out = fused_verify(_dev(logits), _dev(x), _dev(q), temperature=0.8, min_p=1.0, seed=_dev(torch.arange(n)),
                       backend=backend)
    tokens, num = out.tokens.cpu(), out.num_accepted.cpu()
    assert (num >= 0).all()
    emitted = torch.cat([tokens[b, :int(num[b]) + 1] for b in range(n)])
    assert set(emitted.tolist()) == set(ties)
    rt, rn = verify_reference(logits, x, q, torch.full((n,), K), torch.full((n,), 0.8), None, None,
                              philox_uniforms(torch.arange(n), torch.zeros(n, dtype=torch.int64), K),
                              min_p=torch.ones(n))
    assert torch.equal(tokens, rt) and torch.equal(num, rn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_are_under_the_min_p_warp(backend):
    """return_logprobs=True: log p of each emitted token under the min-p-warped target (the
    reference's emitted_logprobs(min_p=...)), finite where a token is emitted."""
    B, K, V = 4, 3, 70
    logits, x, q = make_step(B, K, V, seed=14, scale=2.0)
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.2])
    mp = torch.tensor([0.05, 0.5, 0.3, 0.0])
    seed = torch.arange(B) + 3
    out = fused_verify(_dev(logits), _dev(x), _dev(q), temperature=_dev(temperature), min_p=_dev(mp),
                       top_p=0.99, seed=_dev(seed), backend=backend, return_logprobs=True)
    want = emitted_logprobs(logits, out.tokens.cpu(), out.num_accepted.cpu(), temperature, None,
                            torch.full((B,), 0.99), min_p=mp)
    assert torch.isfinite(want[:, 0]).all()
    assert_close(out.logprobs.cpu(), want)
    # the sampled min-p rows' log-probabilities are those of their smaller kept sets (renormalised)
    without = emitted_logprobs(logits, out.tokens.cpu(), out.num_accepted.cpu(), temperature, None,
                               torch.full((B,), 0.99))
    rows = torch.isfinite(want[[0, 2]])
    assert (want[[0, 2]][rows] > without[[0, 2]][rows]).all()


@pytest.mark.parametrize("B", [3, 40], ids=["host_route", "tensor_route"])
def test_all_greedy_rows_ignore_min_p_but_not_its_range(B, device_value_checks):
    """The torch path's all-greedy route (row by row on the host for small batches, tensors for
    larger ones): min_p changes nothing, and a bad value not read on the host makes its row invalid."""
    K, V = 2, 25
    logits, x, q = make_step(B, K, V, seed=B)
    x[:, 0] = logits[:, 0].argmax(-1)  # accepted
    kw = dict(temperature=0.0, seed=1, backend="torch")
    base = fused_verify(logits, x, q, **kw)
    mp = torch.rand(B, generator=torch.Generator().manual_seed(B))
    got = fused_verify(logits, x, q, min_p=mp, **kw)
    assert torch.equal(got.tokens, base.tokens) and torch.equal(got.num_accepted, base.num_accepted)
    mp[1] = 1.5
    got = fused_verify(logits, x, q, min_p=mp, **kw)
    assert int(got.num_accepted[1]) == -1 and (got.tokens[1] == -1).all()
    keep = torch.arange(B) != 1
    assert torch.equal(got.tokens[keep], base.tokens[keep])


@pytest.mark.parametrize("case", ["scalar", "tensor"])
def test_min_p_adds_no_device_op(case, monkeypatch, device_value_checks):
    """min_p as a scalar goes to the kernel by value and as a [B] tensor (float64 and strided here)
    is read in place: the call is still one launch whose only other ops are the outputs' two
    allocations and the memset of the workspace's counters."""
    import specdec_kernels.ops.verify.triton.split_kernel as kmod
    from test_verify_split import _CountLaunches, _memset_op, _RecordOps

    lg, x, q = make_step(3, 4, 64, seed=1)
    lg, x, q = lg.to(DEV), x.to(DEV), q.to(DEV)
    mp = 0.1 if case == "scalar" else torch.tensor([0.1, 0.0, 0.2, 0.4, 0.3, 0.6], dtype=torch.float64,
                                                   device=DEV)[::2]
    kw = dict(temperature=0.7, top_k=8, min_p=mp, seed=3, backend="triton")
    fused_verify(lg, x, q, **kw)  # warm-up: the workspace is made once per device
    rec = _RecordOps()
    counter = _CountLaunches(kmod.verify_split_kernel, rec)
    monkeypatch.setattr(kmod, "verify_split_kernel", counter)
    with rec:
        out = fused_verify(lg, x, q, **kw)
    assert counter.launches == 1
    dev = torch.device(DEV).type
    want = [("aten.empty", dev, 15), ("aten.empty", dev, 3), _memset_op()]
    assert sorted(rec.ops, key=str) == sorted(want, key=str), rec.ops
    assert (out.num_accepted >= 0).all()


def test_compiled_call_takes_min_p():
    """Under torch.compile (the registered op, whose schema takes min_p) the call equals eager."""
    lg, x, q = make_step(3, 4, 64, seed=1)

    def step(logits, drafts, probs, seed, min_p):
        out = fused_verify(logits, drafts, probs, temperature=0.8, top_k=10, min_p=min_p, seed=seed, backend="torch")
        return out.tokens, out.num_accepted

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    seed, mp = torch.tensor([1, 2, 3]), torch.tensor([0.0, 0.2, 0.6])
    a, b = step(lg, x, q, seed, mp), compiled(lg, x, q, seed, mp)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = step(lg, x, q, seed, None)
    assert not torch.equal(a[0], c[0])  # min-p changed something on these seeds


# ---------------------------------------------------------------------------------------------
# 3. Distribution: the first emitted token, and a mutant (min-p before the temperature)
# ---------------------------------------------------------------------------------------------
N_TRIALS = 100_000
SIGNIFICANCE = 1e-4  # test_verify_distribution's
TEMP = 0.5
MIN_P = 0.2
DIST_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_CUDA,
    reason="100,000-row kernel runs need a GPU; on CPU the kernel is checked exactly against the torch path"))]


def _law(logits: torch.Tensor, T: float, min_p: float, top_p: float | None = None, before_temperature=False):
    """p = warp(l / T) from the definition, float64: top-p (mass strictly ahead < top_p), then
    min-p exp(s - max s) >= min_p (``before_temperature``: the mutant's exp(l - max l) >= min_p)."""
    s = logits.double().numpy() / T
    e = np.exp(s - s.max())
    p = e / e.sum()
    keep = np.ones(len(s), dtype=bool)
    if top_p is not None:
        keep &= np.array([p[s > s[v]].sum() for v in range(len(s))]) < top_p
    ratio = np.exp(logits.double().numpy() - logits.double().numpy().max()) if before_temperature else e
    keep &= ratio >= min_p
    w = np.where(keep, e, 0.0)
    return w / w.sum()


def _dist_case():
    """K = 2, V = 12: target logits whose scaled values 2 l keep 3 tokens under min_p = 0.2 at T = 0.5
    (within ln 5 of the maximum) and 5 under the mutant (within 2 ln 5), and a draft q."""
    base = torch.tensor([3.0, 2.6, 2.3, 2.0, 1.6, 1.2, 0.8, 0.2, -0.5, -1.0, -2.0, -3.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(77)
    logits = torch.stack([base[torch.randperm(12, generator=g)] + 0.05 * i for i in range(3)])
    q = torch.softmax(logits[:2] * 0.8 + torch.randn(2, 12, generator=g, dtype=torch.float64) * 0.5, -1)
    return logits, q


def _first_tokens(backend, logits, q, top_p=None):
    dev = torch.device("cuda" if backend == "triton" else "cpu")
    g = torch.Generator().manual_seed(2025)
    x = torch.stack([torch.multinomial(q[i], N_TRIALS, replacement=True, generator=g) for i in range(2)], 1)
    out = fused_verify(logits.float()[None].expand(N_TRIALS, -1, -1).to(dev), x.to(dev),
                       q.float()[None].expand(N_TRIALS, -1, -1).to(dev), temperature=TEMP, min_p=MIN_P, top_p=top_p,
                       seed=torch.arange(N_TRIALS, dtype=torch.int64, device=dev), offset=5, backend=backend)
    n = out.num_accepted.cpu().numpy()
    assert (n >= 0).all()
    return out.tokens[:, 0].cpu().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("backend", DIST_BACKENDS)
@pytest.mark.parametrize("top_p", [None, 0.7], ids=["min_p", "top_p_then_min_p"])
def test_first_token_follows_its_exact_law(backend, top_p):
    """Chi-square (significance 1e-4, 100,000 trials, bins of expected count < 5 merged; a token of
    p = 0 emitted fails outright) of the first emitted token against its exact law from p_1 =
    warp(min_p) and q_1 (which is p_1)."""
    logits, q = _dist_case()
    p1 = _law(logits[0], TEMP, MIN_P, top_p)
    assert 2 <= (p1 > 0).sum() < 12
    law = first_token_law(p1, q[0].numpy(), q[0].numpy())
    assert np.abs(law - p1).max() < 1e-12
    pv = chi_square_pvalue(_first_tokens(backend, logits, q, top_p), law)
    assert pv > SIGNIFICANCE, f"first token does not follow its law: chi-square p = {pv:.3g}"


@pytest.mark.slow
def test_mutant_min_p_before_temperature_is_caught(monkeypatch):
    """min-p applied to the logits before the temperature (threshold m + ln(min_p) / T on s = l / T):
    the same statistic rejects the first token's law (total variation from p_1 > 0.05 here), and
    the mutant's tokens follow the law predicted for it (the test sees what it should)."""
    orig = warp_reference.min_p_threshold
    monkeypatch.setattr(warp_reference, "min_p_threshold", lambda m, min_p: m + orig(torch.zeros_like(m), min_p) / TEMP)
    logits, q = _dist_case()
    p1 = _law(logits[0], TEMP, MIN_P)
    p_mut = _law(logits[0], TEMP, MIN_P, before_temperature=True)
    assert 0.5 * np.abs(p_mut - p1).sum() > 0.05
    tokens = _first_tokens("torch", logits, q)
    pv = chi_square_pvalue(tokens, p1)
    assert pv < SIGNIFICANCE, f"the mutant (min-p before temperature) was not detected (p = {pv:.3g})"
    assert chi_square_pvalue(tokens, p_mut) > SIGNIFICANCE


# ---------------------------------------------------------------------------------------------
# 4. Arguments, invalid rows, determinism
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_argument_errors_name_min_p(packed):
    B, K, V = 3, 2, 20
    logits, x, q = make_step(B, K, V, seed=1)
    kb = torch.full((B,), K)
    pl, px, cu, pq = _pack(logits, x, q, kb)

    def call(**kw):
        if packed:
            return fused_verify_packed(pl, px, cu, pq, seed=1, **kw)
        return fused_verify(logits, x, q, seed=1, **kw)

    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] \(0 = off\), got "):
            call(min_p=bad)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] \(0 = off\), got \[0.0, 1.25, 0.5\]"):
        call(min_p=torch.tensor([0.0, 1.25, 0.5]))
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] \(0 = off\), got \[0.0, nan, 0.5\]"):
        call(min_p=torch.tensor([0.0, float("nan"), 0.5]))
    with pytest.raises(ValueError, match=r"min_p must have shape \[3\], got \[2\]"):
        call(min_p=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"min_p must have shape \[3\], got \[3, 1\]"):
        call(min_p=torch.full((3, 1), 0.1))
    with pytest.raises(TypeError, match=r"min_p must have dtype float32 or float64 or bfloat16 or float16, got int64"):
        call(min_p=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"min_p must be a float or a \[B\] = \[3\] tensor, got str"):
        call(min_p="0.1")
    with pytest.raises(ValueError, match=r"min_p must be representable in float32"):
        call(min_p=1e-50)
    with pytest.raises(ValueError, match=r"min_p must be None with target_is_probs=True .*got 0.1"):
        if packed:
            fused_verify_packed(torch.softmax(pl, -1), px, cu, pq, seed=1, target_is_probs=True, min_p=0.1)
        else:
            fused_verify(torch.softmax(logits, -1), x, q, seed=1, target_is_probs=True, min_p=0.1)
    call(min_p=0)  # an int in range is a float
    call(min_p=1)


def test_the_row_kernel_is_not_a_backend():
    """The one-program-per-row kernel (no min-p) is a benchmark's (bench/ops/rows_kernel.py), not a
    backend of the op."""
    logits, x, q = make_step(2, 2, 20, seed=1)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\), got '_triton_rows'"):
        fused_verify(logits, x, q, min_p=0.1, seed=1, backend="_triton_rows")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_per_row_value_on_a_device_makes_its_row_invalid(backend, device_value_checks):
    """Where tensor values are not read on the host (a GPU's: simulated here), a min_p outside [0, 1]
    or NaN makes its row invalid (num_accepted -1, tokens -1), greedy rows included (as a bad
    top_p does); the other rows are what they are without the bad rows."""
    B, K, V = 5, 2, 30
    logits, x, q = make_step(B, K, V, seed=2)
    temperature = torch.tensor([1.0, 1.0, 0.0, 0.8, 1.0])
    mp = torch.tensor([0.1, 1.5, -0.5, float("nan"), 0.3])
    seed = torch.arange(B) + 4
    out = fused_verify(_dev(logits), _dev(x), _dev(q), temperature=_dev(temperature), min_p=_dev(mp),
                       seed=_dev(seed), backend=backend)
    num = out.num_accepted.cpu()
    assert num[1:4].tolist() == [-1, -1, -1] and (out.tokens.cpu()[1:4] == -1).all()
    good = [0, 4]
    alone = fused_verify(_dev(logits[good]), _dev(x[good]), _dev(q[good]), temperature=_dev(temperature[good]),
                         min_p=_dev(mp[good]), seed=_dev(seed[good]), backend=backend)
    assert torch.equal(out.tokens.cpu()[good], alone.tokens.cpu())
    assert torch.equal(num[good], alone.num_accepted.cpu()) and (num[good] >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_calls_are_deterministic(backend):
    """The same (seed, offset) gives the same tokens call after call; a row's tokens do not depend
    on the other rows of the batch; another offset draws other numbers."""
    B, K, V = 4, 3, 60
    logits, x, q = make_step(B, K, V, seed=21, scale=2.0)
    mp = torch.tensor([0.05, 0.2, 0.0, 0.5])
    kw = dict(temperature=0.9, min_p=_dev(mp), top_k=12, backend=backend)
    a = fused_verify(_dev(logits), _dev(x), _dev(q), seed=_dev(torch.arange(B) + 1), offset=3, **kw)
    b = fused_verify(_dev(logits), _dev(x), _dev(q), seed=_dev(torch.arange(B) + 1), offset=3, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    kw1 = dict(kw, min_p=_dev(mp[2:3]))
    row = fused_verify(_dev(logits[2:3]), _dev(x[2:3]), _dev(q[2:3]), seed=3, offset=3, **kw1)
    assert torch.equal(row.tokens.cpu()[0], a.tokens.cpu()[2])
    others = [fused_verify(_dev(logits), _dev(x), _dev(q), seed=_dev(torch.arange(B) + 1), offset=o, **kw).tokens
              for o in (4, 5, 6)]
    assert any(not torch.equal(o, a.tokens) for o in others)
