"""Invariants, determinism, batch invariance, unusable input, bad arguments, and the op's
registration (opcheck, torch.compile, one launch, no host synchronisation)."""

from __future__ import annotations

import pytest
import torch

from helpers import HAS_CUDA
from helpers import make_step
from specdec_kernels import fused_verify
from specdec_kernels.ops import verify as verify_mod
from specdec_kernels.ops.verify import launch as _verify_launch

# The kernel runs for real on a GPU and interpreted on CPU tensors; the torch path runs on CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# the kernel, interpreted on a CPU: slow
BACKENDS = [pytest.param("triton", KERNEL_DEVICE, marks=pytest.mark.slow), ("torch", "cpu")]


def _call(backend, dev, logits, x, q, **kw):
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = fused_verify(logits.to(dev), x.to(dev), None if q is None else q.to(dev), backend=backend, **kw)
    return out.tokens.cpu(), out.num_accepted.cpu()


# ----------------------------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,dev", BACKENDS)
@pytest.mark.parametrize("drafter", ["probabilistic", "deterministic"])
def test_invariants(backend, dev, drafter):
    B, K, V = 6, 5, 97
    logits, x, q = make_step(B, K, V, seed=42, draft_noise=0.3)
    if drafter == "deterministic":
        q = None
    kb = torch.tensor([5, 0, 3, 5, 1, 2])
    temperature = torch.tensor([1.0, 1.0, 0.0, 0.5, 2.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 10, 0, 3])
    tokens, n = _call(backend, dev, logits, x, q, num_draft_tokens=kb, temperature=temperature,
                      top_k=top_k, seed=torch.arange(B), offset=1)
    assert tokens.shape == (B, K + 1) and tokens.dtype == torch.int64 and n.dtype == torch.int64
    for b in range(B):
        nb = int(n[b])
        assert 0 <= nb <= int(kb[b])
        assert torch.equal(tokens[b, :nb], x[b, :nb]), "the accepted tokens are a prefix of the drafts"
        assert 0 <= int(tokens[b, nb]) < V, "the recovered/bonus token is in the vocabulary"
        assert (tokens[b, nb + 1:] == -1).all(), "padding is -1"
        assert int((tokens[b] >= 0).sum()) == nb + 1, "the count agrees with the tokens"
        if top_k[b] > 0 and temperature[b] > 0:
            allowed = torch.topk(logits[b, nb].float(), int(top_k[b])).indices
            assert int(tokens[b, nb]) in allowed.tolist(), "a token removed by top-k is never emitted"
        if q is None and nb < int(kb[b]) and temperature[b] > 0:
            assert int(tokens[b, nb]) != int(x[b, nb]), "the residual of a one-hot q excludes the rejected draft"
        if temperature[b] == 0:
            assert int(tokens[b, nb]) == int(logits[b, nb].float().argmax())


@pytest.mark.parametrize("backend,dev", BACKENDS)
@pytest.mark.parametrize("route", ["greedy", "untruncated", "untruncated_one_hot", "warped", "row_draw", "nan"])
def test_the_inputs_are_left_as_they_were(backend, dev, route):
    """The op writes only its outputs: the CPU routes compute in place on their own temporaries
    (to spare malloc's page faults), never on the caller's logits, drafts or q."""
    B, K, V = (3, 2, 5000) if route == "row_draw" else (6, 3, 97)
    logits, x, q = make_step(B, K, V, seed=7, draft_noise=0.3)
    if route == "untruncated_one_hot":
        q = None
    if route == "nan":
        logits[1, 0, 3] = float("nan")
        q[2, 1, 5] = float("nan")
    kw = dict(temperature=0.0 if route == "greedy" else torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0, 2.0][:B]),
              seed=torch.arange(B), offset=1)
    if route == "warped":
        kw.update(top_k=5, top_p=0.9)
    logits, x = logits.to(dev), x.to(dev)
    q = None if q is None else q.to(dev)
    before = [t.clone() for t in (logits, x, q) if t is not None]
    fused_verify(logits, x, q, backend=backend, **kw)
    for got, want in zip([t for t in (logits, x, q) if t is not None], before):
        assert torch.equal(got.view(torch.int32) if got.is_floating_point() else got,
                           want.view(torch.int32) if want.is_floating_point() else want)  # NaNs too


@pytest.mark.parametrize("warp", [None, "top_p"])
@pytest.mark.parametrize("grad_on", ["draft_probs", "logits"])
def test_inputs_that_require_grad(grad_on, warp):
    """Logits or q straight from a model, outside no_grad: the torch path gives the tokens it
    gives without grad (its in-place temporaries never meet autograd; an out=
    argument raised there before)."""
    B, K, V = 3, 3, 50
    logits, x, q = make_step(B, K, V, seed=5, draft_noise=2.0)  # noisy drafts: rejections
    kw = dict(temperature=torch.tensor([1.0, 0.8, 1.3]), seed=torch.arange(B), offset=4, backend="torch",
              top_p=0.9 if warp else None)
    want = fused_verify(logits, x, q, **kw)
    assert bool((want.num_accepted < K).any()), "a rejection, so the residual is computed"
    got = fused_verify(logits.clone().requires_grad_(grad_on == "logits"), x,
                       q.clone().requires_grad_(grad_on == "draft_probs"), **kw)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)


def test_traced_and_vmapped_calls_read_no_values_on_the_host():
    """Under make_fx (real and fake tensors) and vmap the CPU routes that read values on the host
    (the NumPy sort, the row-by-row draw, the host Philox) step aside for their tensor paths, so
    a traced graph gives the eager result on new inputs instead of the tracing input's baked-in
    values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from specdec_kernels.decoding.drafters.sampling import warp_probs

    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(2, 4, 300, generator=g), torch.randn(2, 4, 300, generator=g)
    f = lambda t: warp_probs(t, 0.7, 5, 0.9)  # noqa: E731
    for mode in ("real", "fake", "symbolic"):
        gm = make_fx(f, tracing_mode=mode)(x1)
        assert torch.equal(gm(x2), f(x2)), mode
    assert torch.equal(torch.vmap(f)(x2), f(x2))

    B, K, V = 3, 2, 5000  # V >= 4,096: the row-by-row draw, when the values may be read
    l1, d1, q1 = make_step(B, K, V, seed=1, draft_noise=2.0)
    l2, d2, q2 = make_step(B, K, V, seed=2, draft_noise=2.0)
    seed = torch.arange(B)

    def verify(lg, x, q, top_p):
        out = fused_verify(lg, x, q, temperature=1.0, top_p=top_p, seed=seed, offset=1, backend="torch")
        return out.tokens, out.num_accepted

    for top_p in (None, 0.9):
        gm = make_fx(lambda a, b, c: verify(a, b, c, top_p))(l1, d1, q1)
        for got, want in zip(gm(l2, d2, q2), verify(l2, d2, q2, top_p)):
            assert torch.equal(got, want), top_p


# ----------------------------------------------------------------------------------------------
# Determinism and batch invariance
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_same_seed_and_offset_same_output(backend, dev):
    logits, x, q = make_step(4, 4, 111, seed=5, draft_noise=0.3)
    kw = dict(seed=torch.tensor([1, 2, 3, 4]), offset=torch.tensor([0, 0, 7, 7]), top_p=0.9)
    a = _call(backend, dev, logits, x, q, **kw)
    b = _call(backend, dev, logits, x, q, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    outs = {tuple(_call(backend, dev, logits, x, q, seed=torch.tensor([1, 2, 3, 4]), offset=o)[0].flatten().tolist())
            for o in range(8)}
    assert len(outs) > 1, "different offsets must draw different numbers"


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_row_output_does_not_depend_on_the_batch(backend, dev):
    """A row's result depends on its own inputs, seed and offset only."""
    B, K, V = 5, 6, 111
    logits, x, q = make_step(B, K, V, seed=9, draft_noise=0.3)
    kw = dict(num_draft_tokens=torch.tensor([6, 2, 0, 4, 5]), temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0]),
              top_k=torch.tensor([0, 0, 20, 0, 7]), top_p=torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0]),
              seed=torch.tensor([10, 20, 30, 40, 50]), offset=torch.tensor([3, 1, 4, 1, 5]))
    tokens, n = _call(backend, dev, logits, x, q, **kw)
    for b in range(B):
        solo = {k: v[b:b + 1] for k, v in kw.items()}
        t1, n1 = _call(backend, dev, logits[b:b + 1], x[b:b + 1], q[b:b + 1], **solo)
        assert torch.equal(t1[0], tokens[b]) and n1[0] == n[b]
    # Inside a batch padded to a larger K, with the row's own K_b, the row is unchanged too.
    pad = torch.zeros(B, 2, dtype=x.dtype)
    lg2 = torch.cat([logits, torch.randn(B, 2, V)], dim=1)
    q2 = torch.cat([q, torch.softmax(torch.randn(B, 2, V), -1)], dim=1)
    t2, n2 = _call(backend, dev, lg2, torch.cat([x, pad], 1), q2, **kw)
    assert torch.equal(n2, n) and torch.equal(t2[:, :K + 1], tokens) and (t2[:, K + 1:] == -1).all()


# ----------------------------------------------------------------------------------------------
# Unusable input: never a token outside the vocabulary, never a silent garbage token
# ----------------------------------------------------------------------------------------------
def _nan_cases():
    B, K, V = 1, 3, 50
    logits, x, q = make_step(B, K, V, seed=11)
    greedy_reject = x.clone()
    greedy_reject[0, 0] = (logits[0, 0].argmax() + 1) % V  # a greedy row rejects at position 0

    def with_logit(pos, tok, val):
        lg = logits.clone()
        lg[0, pos, tok] = val
        return lg

    all_neg_inf = logits.clone()
    all_neg_inf[0, 0] = float("-inf")
    some_neg_inf = logits.clone()
    some_neg_inf[0, :, : V - 1] = float("-inf")  # one finite token left: valid
    q_nan = q.clone()
    q_nan[0, 0, 7] = float("nan")
    q_late_nan = q.clone()
    q_late_nan[0, 2, :] = float("nan")
    bad_x = x.clone()
    bad_x[0, 0] = V + 5
    neg_x = x.clone()
    neg_x[0, 0] = -3
    t0 = dict(temperature=0.0)
    # name: (logits, x, q, kwargs, expect_valid)
    return {
        "nan_at_first_position": (with_logit(0, 3, float("nan")), x, q, {}, False),
        "nan_after_the_rejection_is_never_read": (with_logit(2, 3, float("nan")), greedy_reject, q, t0, True),
        "nan_at_greedy_position": (with_logit(0, 3, float("nan")), greedy_reject, q, t0, False),
        "pos_inf_logit": (with_logit(0, 3, float("inf")), x, q, {}, False),
        "all_neg_inf_position": (all_neg_inf, x, q, {}, False),
        "some_neg_inf_is_fine": (some_neg_inf, x, q, {}, True),
        "nan_draft_probs_at_rejection": (logits, greedy_reject, q_nan, dict(uniforms=torch.full((1, K + 1), 0.999)),
                                         False),
        "nan_draft_probs_never_read": (logits, greedy_reject, q_late_nan, t0, True),
        "draft_token_beyond_vocab": (logits, bad_x, q, {}, False),
        "negative_draft_token": (logits, neg_x, q, {}, False),
        "overflow_after_temperature": (with_logit(0, 3, 3e38), x, q, dict(temperature=0.01), False),
    }


@pytest.mark.parametrize("backend,dev", BACKENDS)
@pytest.mark.parametrize("case", list(_nan_cases()))
def test_unusable_input_marks_the_row_invalid(backend, dev, case):
    logits, x, q, kw, expect_valid = _nan_cases()[case]
    if case == "nan_draft_probs_at_rejection":
        x = x.clone()
        x[0, 0] = 7  # the NaN sits at the drafted token: the row must stop there as invalid
    # A healthy second row shares the batch and must be unaffected.
    h_logits, h_x, h_q = make_step(1, x.shape[1], logits.shape[-1], seed=99)
    if "uniforms" in kw:
        kw = dict(kw, uniforms=torch.cat([kw["uniforms"], torch.full_like(kw["uniforms"], 0.5)]))
    kw = dict(kw, seed=torch.tensor([1, 2]))
    tokens, n = _call(backend, dev, torch.cat([logits, h_logits]), torch.cat([x, h_x]), torch.cat([q, h_q]), **kw)
    if expect_valid:
        assert n[0] >= 0 and 0 <= tokens[0, n[0]] < logits.shape[-1]
    else:
        assert n[0] == -1 and (tokens[0] == -1).all()
    solo = {k: (v[1:] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    t1, n1 = _call(backend, dev, h_logits, h_x, h_q, **solo)
    assert torch.equal(t1[0], tokens[1]) and n1[0] == n[1]


def test_both_backends_agree_on_unusable_input():
    for name, (logits, x, q, kw, _) in _nan_cases().items():
        if name == "nan_draft_probs_at_rejection":
            x = x.clone()
            x[0, 0] = 7
        a = _call("triton", KERNEL_DEVICE, logits, x, q, seed=3, **kw)
        b = _call("torch", "cpu", logits, x, q, seed=3, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), name


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_bad_tensor_values_mark_rows_invalid_where_not_checked_on_host(backend, dev, device_value_checks):
    """On CUDA tensor-valued parameters are not read on the host (no sync): a bad value marks
    its row invalid in-kernel. Emulated here by switching the host check off."""
    logits, x, q = make_step(5, 3, 40, seed=2)
    tokens, n = _call(backend, dev, logits, x, q,
                      num_draft_tokens=torch.tensor([3, 4, -1, 3, 3]),
                      temperature=torch.tensor([1.0, 1.0, 1.0, float("nan"), -1.0]), seed=1)
    assert n.tolist()[1:] == [-1, -1, -1, -1] and (tokens[1:] == -1).all() and n[0] >= 0
    tokens, n = _call(backend, dev, logits[:3], x[:3], q[:3], top_k=torch.tensor([2, -1, 0]),
                      top_p=torch.tensor([0.5, 0.5, 1.5]), seed=1)
    assert n.tolist()[1:] == [-1, -1] and n[0] >= 0
    # A positive temperature below the smallest normal fp32: 1 / T overflows (a subnormal may be
    # flushed to 0 on a GPU), so the row is refused rather than sampled; 1e-30 is still a temperature.
    tokens, n = _call(backend, dev, logits[:3], x[:3], q[:3], temperature=torch.tensor([1.0, 1e-39, 1e-30]), seed=1)
    assert n[1] == -1 and (tokens[1] == -1).all() and n[0] >= 0 and n[2] >= 0


# ----------------------------------------------------------------------------------------------
# Bad arguments: a clear error naming the argument, the expected and the actual value
# ----------------------------------------------------------------------------------------------
def _bad_argument_cases():
    lg, x, q = make_step(2, 3, 10)
    return [
        ("rank", dict(target_logits=lg[0]), ValueError, r"target_logits must have 3 dims \[B, K\+1, V\], got 2"),
        ("logit_dtype", dict(target_logits=lg.double()), TypeError,
         r"target_logits must have dtype float32, bfloat16 or float16, got float64"),
        ("tokens_rank", dict(draft_tokens=x[0]), ValueError, r"draft_tokens must have 2 dims \[B, K\], got 1"),
        ("tokens_B", dict(draft_tokens=x[:1]), ValueError, r"draft_tokens must have shape \[2, 3\], got \[1, 3\]"),
        ("tokens_K", dict(draft_tokens=x[:, :2]), ValueError, r"draft_tokens must have shape \[2, 3\], got \[2, 2\]"),
        ("tokens_dtype", dict(draft_tokens=x.float()), TypeError,
         r"draft_tokens must have dtype int32 or int64, got float32"),
        ("probs_B", dict(draft_probs=q[:1]), ValueError, r"draft_probs must have shape \[2, 3, 10\], got \[1, 3, 10\]"),
        ("probs_K", dict(draft_probs=q[:, :2]), ValueError,
         r"draft_probs must have shape \[2, 3, 10\], got \[2, 2, 10\]"),
        ("probs_Vd_gt_V", dict(draft_probs=torch.cat([q, q], -1)), ValueError,
         r"draft_probs must have a vocabulary 1 <= Vd <= V = 10, got Vd = 20"),
        ("probs_dtype", dict(draft_probs=q.double()), TypeError,
         r"draft_probs must have dtype float32 or bfloat16 or float16, got float64"),
        ("kb_gt_K", dict(num_draft_tokens=torch.tensor([3, 4])), ValueError,
         r"num_draft_tokens must be in \[0, K\] = \[0, 3\], got \[3, 4\]"),
        ("kb_negative", dict(num_draft_tokens=torch.tensor([-1, 2])), ValueError,
         r"num_draft_tokens must be in \[0, K\] = \[0, 3\], got \[-1, 2\]"),
        ("kb_int_gt_K", dict(num_draft_tokens=5), ValueError,
         r"num_draft_tokens must be in \[0, K\] = \[0, 3\], got 5"),
        ("kb_shape", dict(num_draft_tokens=torch.tensor([1, 2, 3])), ValueError,
         r"num_draft_tokens must have shape \[2\], got \[3\]"),
        ("temperature_nan", dict(temperature=float("nan")), ValueError,
         r"temperature must be finite and >= 0 \(0 = greedy\), got nan"),
        ("temperature_inf", dict(temperature=float("inf")), ValueError,
         r"temperature must be finite and >= 0 \(0 = greedy\), got inf"),
        ("temperature_negative_tensor", dict(temperature=torch.tensor([1.0, -0.5])), ValueError,
         r"temperature must be finite and >= 0 \(0 = greedy\), got \[1.0, -0.5\]"),
        ("temperature_subnormal", dict(temperature=1e-39), ValueError,
         r"temperature must be 0 \(greedy\) or >= 1.1754944e-38 \(the smallest normal fp32\), got 1e-39"),
        ("temperature_below_fp32", dict(temperature=1e-46), ValueError,
         r"temperature must be 0 \(greedy\) or >= 1.1754944e-38 \(the smallest normal fp32\), got 1e-46"),
        ("temperature_subnormal_tensor", dict(temperature=torch.tensor([1.0, 1e-39])), ValueError,
         r"temperature must be 0 \(greedy\) or >= 1.1754944e-38 \(the smallest normal fp32\), got \[1.0, 1.0\d*e-39\]"),
        ("temperature_type", dict(temperature="hot"), TypeError,
         r"temperature must be a float or a \[B\] = \[2\] tensor, got str"),
        ("top_p_zero", dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
        ("top_p_above_one", dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
        ("top_p_tensor", dict(top_p=torch.tensor([0.5, 2.0])), ValueError,
         r"top_p must be in \(0, 1\] \(1 = off\), got \[0.5, 2.0\]"),
        ("top_k_negative", dict(top_k=-2), ValueError, r"top_k must be >= 0 \(0 = off\), got -2"),
        ("seed_type", dict(seed=1.5), TypeError, r"seed must be an int or a \[B\] = \[2\] tensor, got float"),
        ("seed_overflow", dict(seed=2**64), ValueError,
         r"^seed must fit in int64 \(\[-9223372036854775808, 9223372036854775807\]\), got 18446744073709551616$"),
        ("offset_overflow", dict(offset=2**63), ValueError,
         r"^offset must fit in int64 \(\[-9223372036854775808, 9223372036854775807\]\), got 9223372036854775808$"),
        ("top_k_overflow", dict(top_k=2**63), ValueError, r"^top_k must fit in int64 .*, got 9223372036854775808$"),
        ("temperature_overflow", dict(temperature=1e39), ValueError,
         r"^temperature must fit in float32 \(\[-3.40282e\+38, 3.40282e\+38\]\), got 1e\+39$"),
        ("uniforms_shape", dict(uniforms=torch.rand(2, 3)), ValueError,
         r"uniforms must have shape \[2, 4\], got \[2, 3\]"),
        ("uniforms_range", dict(uniforms=torch.full((2, 4), 1.0)), ValueError,
         r"uniforms must lie in \[0, 1\), got 1.0 at \[0, 0\]"),
        # (before: the value and where it is were not said; a float64 parameter was
        # rounded to fp32 first, so a 1e-50 temperature ran greedy and errors named the rounded value)
        ("uniforms_range_where", dict(uniforms=torch.tensor([[0.5] * 4, [0.5, 0.5, 1.5, 0.5]], dtype=torch.float64)),
         ValueError, r"^uniforms must lie in \[0, 1\), got 1.5 at \[1, 2\]$"),
        ("temperature_float64_underflow", dict(temperature=torch.tensor([1e-50, 1.0], dtype=torch.float64)), ValueError,
         r"^temperature must be representable in float32 \(a value that rounds to 0 or to inf there is refused\), "
         r"got \[1e-50, 1.0\]$"),
        ("temperature_float64_overflow", dict(temperature=torch.tensor([1e39, 1.0], dtype=torch.float64)), ValueError,
         r"^temperature must be representable in float32 .*, got \[1e\+39, 1.0\]$"),
        ("draft_probs_sum", dict(draft_probs=torch.cat([q[:1], q[1:] * torch.tensor([1.0, 1.5, 1.0])[:, None]])),
         ValueError, r"^draft_probs\[1, 1\] must sum to 1 \(to within 0.01: "
                     r"the distribution draft 1 was sampled from\), got 1.5$"),
        ("top_p_underflow", dict(top_p=1e-50), ValueError, r"^top_p must be representable in float32 .*, got 1e-50$"),
        ("no_positions", dict(target_logits=torch.zeros(2, 0, 10), draft_tokens=torch.zeros(2, 0, dtype=torch.long),
                              draft_probs=None), ValueError,
         r"^target_logits must have K\+1 >= 1 positions \(dim 1: the K drafts and the bonus\), "
         r"got shape \[2, 0, 10\]$"),
        ("backend", dict(backend="cuda"), ValueError,
         r"backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"),
        ("device_mix", dict(draft_tokens=x.to("meta")), ValueError,
         r"draft_tokens must be on cpu \(the device of target_logits\), got meta"),
    ]


@pytest.mark.parametrize("name,override,exc,match", _bad_argument_cases(), ids=[c[0] for c in _bad_argument_cases()])
def test_bad_arguments_raise_clear_errors(name, override, exc, match):
    lg, x, q = make_step(2, 3, 10)
    args = dict(target_logits=lg, draft_tokens=x, draft_probs=q)
    kwargs = {"backend": "torch"}
    for k, v in override.items():
        (args if k in args else kwargs)[k] = v
    with pytest.raises(exc, match=match):
        fused_verify(args["target_logits"], args["draft_tokens"], args["draft_probs"], **kwargs)


def test_draft_probs_sums_are_checked_only_where_read():
    # (before: q = 1.5 * softmax was taken, and the output was not the target's)
    # A greedy row, a position past K_b, a negative entry (its row invalid) are not refused.
    lg, x, q = make_step(2, 3, 10)
    bad = q.clone()
    bad[0, 2] *= 1.5
    out = fused_verify(lg, x, bad, temperature=torch.tensor([1.0, 1.0]), num_draft_tokens=torch.tensor([2, 3]),
                       seed=0, backend="torch")
    want = fused_verify(lg, x, q, temperature=torch.tensor([1.0, 1.0]), num_draft_tokens=torch.tensor([2, 3]),
                        seed=0, backend="torch")
    # row 0 verifies K_b = 2 drafts: it never reads q[0, 2], so the same output
    assert torch.equal(out.tokens, want.tokens) and torch.equal(out.num_accepted, want.num_accepted)
    fused_verify(lg, x, bad, temperature=torch.tensor([0.0, 1.0]), seed=0, backend="torch")
    fused_verify(lg, x, bad, temperature=0.0, seed=0, backend="torch")  # all greedy: nothing summed
    neg = q.clone()
    neg[0, 1, 0] = -1.0
    fused_verify(lg, x, neg, seed=0, backend="torch")  # invalid if its row reaches q[0, 1]'s residual
    with pytest.raises(ValueError, match=r"draft_probs\[0, 2\] must sum to 1"):
        fused_verify(lg, x, bad, seed=0, backend="torch")


@pytest.mark.slow
def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(_verify_launch, "interpreting", lambda: False)
    lg, x, q = make_step(1, 2, 10)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors .* got tensors on cpu"):
        fused_verify(lg, x, q, backend="triton")


@pytest.mark.parametrize("triton_v,numpy_v,refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.4.0rc1", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.9.0", "2.4.6", False), ("3.6.0+git4f7a3b", "2.5.0", True), ("3.5.1", "1.26.4", False)])
def test_interpreter_version_problem(triton_v, numpy_v, refused):
    """Triton 3.6's interpreter cannot run with NumPy >= 2.4 (seen: TypeError "only 0-dimensional
    arrays can be converted to Python scalars" in every kernel launch); the pair is named."""
    problem = verify_mod.interpreter_problem(triton_v, numpy_v)
    if refused:
        assert problem == (f"Triton {triton_v}'s interpreter (TRITON_INTERPRET=1) cannot run with NumPy {numpy_v}: "
                           f"install 'triton>=3.7' or 'numpy<2.4'")
    else:
        assert problem is None


@pytest.mark.slow
def test_triton_backend_on_cpu_with_a_broken_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(_verify_launch, "interpreting", lambda: True)
    monkeypatch.setattr(_verify_launch, "interpreter_problem", lambda: "Triton 3.6.0's interpreter ... NumPy 2.4.6")
    lg, x, q = make_step(1, 2, 10)
    with pytest.raises(RuntimeError, match=r"^backend='triton' on CPU tensors: Triton 3.6.0's interpreter"):
        fused_verify(lg, x, q, backend="triton")
    assert fused_verify(lg, x, q, backend="torch").tokens.shape == (1, 3)  # the torch path does not care


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU to mix devices")
def test_cpu_cuda_mix_is_refused():
    lg, x, q = make_step(1, 2, 10)
    with pytest.raises(ValueError, match=r"draft_tokens must be on cuda:0 \(the device of target_logits\), got cpu"):
        fused_verify(lg.cuda(), x, q.cuda())


# ----------------------------------------------------------------------------------------------
# The op: registration, torch.compile, one launch and no host synchronisation
# ----------------------------------------------------------------------------------------------
def _op_args(backend, dev):
    lg, x, q = make_step(3, 4, 64, seed=1)
    B = 3
    return (lg.to(dev), x.to(dev), q.to(dev), torch.tensor([4, 2, 3], device=dev),
            torch.tensor([1.0, 0.0, 0.8], device=dev), torch.tensor([0, 5, 10], device=dev),
            torch.tensor([0.9, 1.0, 0.95], device=dev),
            torch.arange(B, device=dev), torch.zeros(B, dtype=torch.int64, device=dev), None,
            torch.tensor([0.0, 0.05, 0.3], device=dev), backend)


@pytest.mark.parametrize("backend,dev", BACKENDS)
def test_opcheck(backend, dev):
    torch.library.opcheck(torch.ops.specdec.fused_verify.default, _op_args(backend, dev))


def test_compiled_call_matches_eager():
    lg, x, q = make_step(3, 4, 64, seed=1)

    def step(logits, drafts, probs, seed):
        out = fused_verify(logits, drafts, probs, temperature=0.8, top_k=10, seed=seed, backend="torch")
        return out.tokens, out.num_accepted

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    seed = torch.tensor([1, 2, 3])
    a, b = step(lg, x, q, seed), compiled(lg, x, q, seed)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU for graph capture")
def test_cuda_graph_capture_and_replay():
    """The op captures in a CUDA graph; replays with new offsets draw new numbers, as eager does."""
    lg, x, q = make_step(4, 4, 1000, seed=3)
    lg, x, q = lg.cuda(), x.cuda(), q.cuda()
    seed = torch.arange(4, device="cuda")
    offset = torch.zeros(4, dtype=torch.int64, device="cuda")
    fused_verify(lg, x, q, seed=seed, offset=offset)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_verify(lg, x, q, seed=seed, offset=offset)
    for step in range(3):
        offset.fill_(step)
        graph.replay()
        eager = fused_verify(lg, x, q, seed=seed, offset=step)
        assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.num_accepted, eager.num_accepted)
