"""The split-vocabulary kernel's own properties (``verify/triton/split_kernel.py``), on the real kernel
(interpreted on CPU tensors here): results that do not depend on which program arrives last,
one launch with no other device op, counters that reset themselves, vocabularies on both sides
of the chunk size, and top-k/top-p decided from the chunks' candidate keys or by the whole-
position fallback, each equal to the reference token for token."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import HAS_CUDA, needs_cuda
from helpers import make_step
from specdec_kernels import fused_verify
from specdec_kernels.ops import verify as verify_mod
from specdec_kernels.ops.verify import args as _verify_args, launch as _verify_launch
from specdec_kernels.ops.kernels import launch_settings, split_workspace
from specdec_kernels.ops.verify.triton.split_kernel import _ticket_item
from specdec_kernels.ops.reference import philox_uniforms, verify_reference

pytestmark = pytest.mark.slow  # the split kernel, interpreted on a CPU

DEV = "cuda" if HAS_CUDA else "cpu"


def _reference(logits, x, q, kb, temperature, top_k, top_p, seed, offset):
    u = philox_uniforms(seed, offset, x.shape[1])
    return verify_reference(logits, x, q, kb, temperature, top_k, top_p, u)


def _call(logits, x, q, kb, temperature, top_k, top_p, seed, offset, order=None):
    """The split kernel through the launcher (``order``: the work items' claim order)."""
    a = verify_mod.normalize_arguments(logits.to(DEV), x.to(DEV), None if q is None else q.to(DEV), kb.to(DEV),
                              temperature.to(DEV), None if top_k is None else top_k.to(DEV),
                              None if top_p is None else top_p.to(DEV), seed.to(DEV), offset.to(DEV), None,
                              materialize=False)
    tokens, num = _verify_launch._launch_triton(a, order=None if order is None else order.to(DEV))
    return tokens.cpu(), num.cpu()


def _chunks(V: int) -> int:
    chunk = verify_mod.split_kernel_meta(V, 1, True, False, False, False)["CHUNK"]
    return -(-V // chunk)


def _records(B, K1, V):
    ws = split_workspace(DEV)
    return {k: v.cpu().clone() for k, v in ws.records(B, K1, _chunks(V)).items()}


def _assert_same_records(rec: dict, want: dict, kb: torch.Tensor) -> None:
    """The position records the rows use (positions 0..K_b) bit for bit: max, kept mass, argmax,
    unusable, threshold."""
    for b in range(kb.shape[0]):
        for i in range(int(kb[b]) + 1):
            for name in ("m", "S", "argmax", "bad", "thr"):
                a, w = rec[name][b, i], want[name][b, i]
                assert a.view(torch.int32) == w.view(torch.int32), (name, b, i, a, w)


def _permuted_order(rng: random.Random, B: int, K1: int, NI: int) -> tuple[torch.Tensor, dict]:
    """A claim order that permutes stage-1 items among themselves and stage-2 items among
    themselves (the only constraint: stage 2 after stage 1), and for each position (b, i) the
    item (its chunks' index g) that comes last (the one that combines it). NI: items a position."""
    n1, n2 = B * K1 * NI, B * NI
    first = list(range(n1))
    rng.shuffle(first)
    second = list(range(n1, n1 + n2))
    rng.shuffle(second)
    last = {}
    for item in first:  # in claim order: the final assignment is the last arrival
        last[(item // (K1 * NI), (item // NI) % K1)] = item % NI
    return torch.tensor(first + second, dtype=torch.int32), last


@pytest.mark.parametrize("tiles", [1, 2], ids=["1_chunk_an_item", "2_chunks_an_item"])
@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
def test_arrival_order_does_not_change_the_result(warp, tiles, split_settings):
    """Work items claimed in five random orders: the position records (max, kept mass,
    argmax, threshold) and the tokens are bit-identical to those of the in-order launch, while
    the program that combines a position (the last to arrive) differs between the orders."""
    split_settings(chunk=32)
    split_settings(tiles_per_item=tiles)
    B, K, V = 3, 3, 150  # 5 chunks a position
    logits, x, q = make_step(B, K, V, seed=5)
    kb = torch.tensor([3, 1, 2])
    temperature = torch.tensor([1.0, 0.0, 0.8])
    top_k = torch.tensor([7, 0, 0]) if warp else None
    top_p = torch.tensor([0.9, 1.0, 0.5]) if warp else None
    seed, offset = torch.tensor([4, 5, 6]), torch.tensor([0, 2, 9])
    args = (logits, x, q, kb, temperature, top_k, top_p, seed, offset)
    want = _call(*args)
    want_rec = _records(B, K + 1, V)
    ref = _reference(*args)
    assert torch.equal(want[0], ref[0]) and torch.equal(want[1], ref[1])
    NC = _chunks(V)
    assert NC == 5
    NI = -(-NC // tiles)  # work items a position
    rng = random.Random(11)
    combiners = set()
    for _ in range(5):
        order, last = _permuted_order(rng, B, K + 1, NI)
        combiners.add(tuple(sorted(last.items())))
        got = _call(*args, order=order)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _assert_same_records(_records(B, K + 1, V), want_rec, kb)
    assert len(combiners) == 5, "the orders must make different programs combine the positions"


class _RecordOps(TorchDispatchMode):
    """Records (op, device, numel) of every aten op dispatched while not paused."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            t = out if isinstance(out, torch.Tensor) else None
            self.ops.append((str(func.overloadpacket), None if t is None else t.device.type,
                             None if t is None else t.numel()))
        return out


def _memset_op():
    """The one op a launch adds to the outputs' allocations: the memset of the workspace's
    counters (its size: what the workspace has grown to so far)."""
    return ("aten.zero_", torch.device(DEV).type, split_workspace(DEV).counters.numel())


class _CountLaunches:
    """Stands in for the kernel object: counts launches and hides the interpreter's own tensor
    handling from the op recorder."""

    def __init__(self, kernel, recorder):
        self.kernel, self.recorder, self.launches = kernel, recorder, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            self.recorder.paused = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.recorder.paused = False
        return launch


@pytest.mark.parametrize("case", ["scalars", "tensors", "seed_none"])
def test_one_launch_and_no_other_device_op(case, monkeypatch, device_value_checks):
    """A call is one kernel launch, and the only aten ops it dispatches are the outputs' allocations
    (``empty``) and the memset of the workspace's counters (``zero_``): no fill for a scalar temperature,
    top-k, top-p, offset or num_draft_tokens=None, no dtype conversion of [B] parameters (int32 / float64
    ones included), no copy of strided ones, no softmax, sort or cumsum.  With seed=None, one more op:
    the host draw of one base seed from torch's default generator (a one-element CPU tensor)."""
    import specdec_kernels.ops.verify.triton.split_kernel as kmod

    lg, x, q = make_step(3, 4, 64, seed=1)
    lg, x, q = lg.to(DEV), x.to(DEV), q.to(DEV)
    if case == "tensors":
        kw = dict(num_draft_tokens=torch.tensor([4, 1, 3], dtype=torch.int32, device=DEV),
                  temperature=torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64, device=DEV),
                  top_k=torch.tensor([8, 0, 3], dtype=torch.int32, device=DEV),
                  top_p=torch.tensor([0.9, 1.0, 0.7], device=DEV),
                  seed=torch.arange(6, device=DEV)[::2], offset=torch.tensor([1, 2, 3], device=DEV))
        x = x.t().contiguous().t()  # strided draft tokens
    else:
        kw = dict(temperature=0.7, top_k=8, top_p=0.9, offset=2, seed=None if case == "seed_none" else 3)
    fused_verify(lg, x, q, backend="triton", **kw)  # warm-up: the workspace is made once per device
    rec = _RecordOps()
    counter = _CountLaunches(kmod.verify_split_kernel, rec)
    monkeypatch.setattr(kmod, "verify_split_kernel", counter)
    if HAS_CUDA:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with rec:
            out = fused_verify(lg, x, q, backend="triton", **kw)
    finally:
        if HAS_CUDA:
            torch.cuda.set_sync_debug_mode("default")
    assert counter.launches == 1
    dev = torch.device(DEV).type
    # the memset of the workspace's counters (its size: what the workspace grew to so far)
    want = [("aten.empty", dev, 15), ("aten.empty", dev, 3), _memset_op()]
    if case == "seed_none":  # one base seed drawn and read on the host (no device sync)
        want += [("aten.randint", "cpu", 1), ("aten._local_scalar_dense", None, None)]
    assert sorted(rec.ops, key=str) == sorted(want, key=str), rec.ops
    assert out.tokens.shape == (3, 5) and (out.num_accepted >= 0).all()
    assert out.tokens.device.type == torch.device(DEV).type


@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
def test_chunks_per_item_do_not_change_the_result(warp, split_settings):
    """1, 2, 3 or 7 chunks a work item (the last item of a position short of chunks, or holding
    all of them): the same position records and tokens, equal to the reference's."""
    split_settings(chunk=16)
    B, K, V = 3, 3, 100  # 7 chunks a position
    logits, x, q = make_step(B, K, V, seed=8)
    kb = torch.tensor([3, 2, 1])
    temperature = torch.tensor([1.0, 0.0, 0.6])
    top_k = torch.tensor([9, 0, 0]) if warp else None
    top_p = torch.tensor([0.8, 1.0, 0.5]) if warp else None
    seed, offset = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    args = (logits, x, q, kb, temperature, top_k, top_p, seed, offset)
    ref = _reference(*args)
    want_rec = None
    for tiles in (1, 2, 3, 7):
        split_settings(tiles_per_item=tiles)
        got = _call(*args)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (tiles, got, ref)
        rec = _records(B, K + 1, V)
        want_rec = rec if want_rec is None else want_rec
        _assert_same_records(rec, want_rec, kb)


def _junk_cases():
    """What a launch that overlapped another, or was killed mid-way, can leave in the integer
    tensors: small values, -1, every counter one ahead or at its target."""
    return ["1", "7", "-1", "one_ahead", "at_target"]


def _poison(ws, how: str, B: int, K1: int, NI: int) -> None:
    from specdec_kernels.ops.verify.workspace import counter_layout

    for name, t in ws.tensors().items():
        if t.dtype == torch.int32:
            t.fill_({"1": 1, "7": 7, "-1": -1}.get(how, 3))
    if how in ("one_ahead", "at_target"):
        lay = counter_layout(B, K1)
        c = ws.counters
        step = 1 if how == "one_ahead" else 0
        c[lay["ticket"]] = step
        c[lay["pos"]:lay["pos"] + B * K1] = NI - 1 + step  # a position combined before its chunks arrive
        c[lay["row"]:lay["row"] + B] = K1 - 1 + step
        c[lay["ready"]:lay["ready"] + B] = 1  # stage 2 would not wait for the chain
        c[lay["s2"]:lay["s2"] + B] = NI - 1 + step


@pytest.mark.parametrize("how", _junk_cases())
@pytest.mark.parametrize("method", ["token", "block"])
def test_junk_left_in_the_workspace_never_reaches_the_next_call(how, method, split_settings):
    """Junk written into every integer tensor of the workspace between two calls (as a launch
    that overlapped another or was killed would leave it): the next call equals the torch
    backend on the same seeds, and so does the one after it; the counters it used read zero
    before it (the launcher's memset) whatever they held."""
    split_settings(chunk=32)
    B, K, V = 3, 3, 100  # 4 chunks a position
    logits, x, q = make_step(B, K, V, seed=21)
    kw = dict(num_draft_tokens=torch.tensor([3, 1, 2]), temperature=torch.tensor([1.0, 0.0, 0.8]),
              top_k=torch.tensor([0, 0, 7]), top_p=torch.tensor([1.0, 1.0, 0.9]), seed=torch.tensor([5, 6, 7]),
              method=method)
    args = [t.to(DEV) for t in (logits, x, q)]
    kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    want = fused_verify(*args, backend="torch", **kw)
    fused_verify(*args, backend="triton", **kw)  # the workspace exists and fits
    for _ in range(2):
        _poison(split_workspace(DEV), how, B, K + 1, 4)
        got = fused_verify(*args, backend="triton", **kw)
        assert torch.equal(got.tokens.cpu(), want.tokens.cpu()), (how, got.tokens, want.tokens)
        assert torch.equal(got.num_accepted.cpu(), want.num_accepted.cpu())


def test_the_launch_zeroes_its_counters_and_resets_nothing_itself(monkeypatch):
    """The counters are zeroed by the launcher before the launch (the kernel itself no longer
    resets anything): the kernel sees zeros, and after it the ready flags of the rows stay set."""
    import specdec_kernels.ops.verify.triton.split_kernel as kmod
    from specdec_kernels.ops.verify.workspace import counter_layout

    seen = {}
    real = kmod.verify_split_kernel

    class _Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counters = args[[i for i, a in enumerate(args) if a is split_workspace(DEV).counters][0]]
                seen["before"] = counters.clone()
                return real[grid](*args, **kwargs)
            return launch

    logits, x, q = make_step(2, 3, 100, seed=4)
    args = [t.to(DEV) for t in (logits, x, q)]
    fused_verify(*args, seed=1, backend="triton")
    split_workspace(DEV).counters.fill_(5)
    monkeypatch.setattr(kmod, "verify_split_kernel", _Spy())
    out = fused_verify(*args, seed=1, backend="triton")
    assert int(seen["before"].abs().sum()) == 0
    lay = counter_layout(2, 4)
    ready = split_workspace(DEV).counters[lay["ready"]:lay["ready"] + 2].cpu()
    assert ready.tolist() == [1, 1] and (out.num_accepted >= 0).all()


def test_a_workspace_made_under_inference_mode_serves_calls_outside_it(monkeypatch):
    """The first call inside ``torch.inference_mode()`` (a decoding loop's) makes the workspace;
    its tensors are normal tensors, so a later call outside inference mode can zero the counters
    (an inference tensor refuses an in-place update there), and the reverse order works too."""
    from specdec_kernels.ops.verify import workspace as workspace_mod

    logits, x, q = make_step(2, 2, 50, seed=5)
    args = [t.to(DEV) for t in (logits, x, q)]
    want = fused_verify(*args, seed=3, backend="torch")
    for first_inside in (True, False):
        monkeypatch.setattr(workspace_mod, "_WORKSPACES", {})  # a fresh workspace for this device
        for inside in (first_inside, not first_inside, first_inside):
            with torch.inference_mode(inside):
                got = fused_verify(*args, seed=3, backend="triton")
            assert torch.equal(got.tokens.cpu(), want.tokens.cpu())
        assert not any(t.is_inference() for t in split_workspace(DEV).tensors().values())


def test_workspace_tensors_by_name_and_reset():
    """``ops.kernels.split_workspace``: the workspace's tensors by name, and ``reset()`` zeroes
    every one of them; a call after a reset is exact."""
    logits, x, q = make_step(2, 2, 50, seed=9)
    args = [t.to(DEV) for t in (logits, x, q)]
    fused_verify(*args, seed=3, top_k=4, backend="triton")
    ws = split_workspace(DEV)
    tensors = ws.tensors()
    assert set(tensors) == {"counters", "part_f", "part_i", "cand", "mass"}
    assert tensors["counters"].dtype == torch.int32 and tensors["mass"].dtype == torch.float64
    ws.reset()
    assert all(int((t != 0).sum()) == 0 for t in ws.tensors().values())
    got = fused_verify(*args, seed=3, top_k=4, backend="triton")
    want = fused_verify(*args, seed=3, top_k=4, backend="torch")
    assert torch.equal(got.tokens.cpu(), want.tokens.cpu())


@triton.jit
def _ticket_map(out_ptr, n, B, A, C, T1, LAG):
    for t in range(0, n):
        tl.store(out_ptr + t, _ticket_item(t, B, A, C, T1, LAG))


def test_ticket_order_with_stage2_lag():
    """The claim order with ``stage2_lag`` L, computed by the kernel's own ``_ticket_item``: a
    permutation of every item in which row b's stage-2 items come right after row b + L's
    stage-1 items (the last L rows' at the end), so each stage-2 item follows its row's stage-1
    items; L = B is the plain order."""
    for B, A, C in [(4, 6, 2), (3, 5, 5), (1, 3, 1)]:
        T1, n = B * A, B * (A + C)
        for lag in range(0, B + 1):
            out = torch.full((n,), -9, dtype=torch.int32)
            _ticket_map[(1,)](out, n, B, A, C, T1, lag)
            want = []
            for s in range(B + lag):
                if s < B:
                    want += [s * A + r for r in range(A)]
                if 0 <= s - lag < B:
                    want += [T1 + (s - lag) * C + r for r in range(C)]
            assert out.tolist() == want, (B, A, C, lag)


@pytest.mark.parametrize("method", ["token", "block"])
def test_launch_settings_do_not_change_the_tokens(method, split_settings):
    """Every ticket form, poll form, stage-2 lag and chunks per item gives the torch backend's
    tokens (the settings the GPU run compares)."""
    split_settings(chunk=16)
    B, K, V = 4, 3, 60
    logits, x, q = make_step(B, K, V, seed=13)
    kw = dict(num_draft_tokens=torch.tensor([3, 2, 1, 0]), temperature=torch.tensor([1.0, 0.0, 0.7, 1.0]),
              top_k=torch.tensor([0, 0, 5, 0]), seed=torch.arange(B), method=method)
    want = fused_verify(logits, x, q, backend="torch", **kw)
    for st in (dict(ticket="relaxed"), dict(ticket="prefetch", stage2_lag=0), dict(stage2_lag=1, poll="relaxed"),
               dict(ticket="prefetch", stage2_lag=2, tiles_per_item=3, poll="relaxed"), dict(stage2_lag=7),
               dict(poll_sleep_ns=100, programs_per_sm=2, num_warps=4, maxnreg=128)):
        with launch_settings(**st):
            got = fused_verify(*(t.to(DEV) for t in (logits, x, q)), backend="triton",
                               **{k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
        assert torch.equal(got.tokens.cpu(), want.tokens) and torch.equal(got.num_accepted.cpu(), want.num_accepted), st


def test_grown_workspace_keeps_the_old_tensors_and_the_op_path_uses_its_own():
    """A larger shape grows the workspace and keeps the replaced tensors alive (a CUDA graph
    captured with them replays into them); a call through the registered op (torch.compile's
    path) uses a workspace of its own and leaves the cached one as it was."""
    ws = split_workspace(DEV)
    logits, x, q = make_step(1, 1, 10, seed=1)
    fused_verify(logits.to(DEV), x.to(DEV), q.to(DEV), seed=1, backend="triton")
    before = ws.counters
    big = make_step(9, 7, 20000, seed=2)
    fused_verify(*(t.to(DEV) for t in big), seed=1, backend="triton")
    if ws.counters is not before:
        assert any(t is before for t in ws.retired)
    fields = ws.tensors()
    a = _verify_args._materialize(
        verify_mod.normalize_arguments(*(t.to(DEV) for t in big), None, 1.0, 5, None, 1, 0, None))
    out = torch.ops.specdec.fused_verify(*a, "triton")
    assert all(ws.tensors()[k] is t for k, t in fields.items())
    assert (out[1] >= 0).all()


def test_an_order_that_could_wait_for_ever_is_refused():
    """The test hook's claim order must keep stage 2 after stage 1 (else a stage-2 item would
    spin on a row whose stage-1 items come after it): refused before the launch."""
    logits, x, q = make_step(1, 1, 40, seed=1)
    a = verify_mod.normalize_arguments(logits.to(DEV), x.to(DEV), q.to(DEV), None, 1.0, None, None, 1, 0, None,
                              materialize=False)
    # one chunk: stage-1 items 0 and 1 (the two positions), then stage-2 item 2
    with pytest.raises(ValueError, match="order must hold a permutation"):
        _verify_launch._launch_triton(a, order=torch.tensor([2, 0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="order must hold a permutation"):
        _verify_launch._launch_triton(a, order=torch.tensor([0, 0, 2], dtype=torch.int32))
    tokens, num = _verify_launch._launch_triton(a, order=torch.tensor([1, 0, 2], dtype=torch.int32))
    assert int(num[0]) in (0, 1)


@pytest.mark.parametrize("V", [15, 16, 17, 31, 32, 33, 97])
@pytest.mark.parametrize("warp", [False, True], ids=["plain", "topk_topp"])
def test_vocabularies_around_the_chunk_size(V, warp, split_settings):
    """V on both sides of one and two chunks (16 tokens here) and of the candidate cap (4 here):
    the kernel equals the reference, the bonus and residual draws included."""
    split_settings(chunk=16)
    split_settings(top_k_cap=4)
    B, K = 4, 3
    logits, x, q = make_step(B, K, V, seed=V)
    kb = torch.tensor([3, 2, 0, 3])
    temperature = torch.tensor([1.0, 0.0, 0.9, 1.3])
    top_k = torch.tensor([3, 0, min(4, V), 0]) if warp else None
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.7]) if warp else None
    seed, offset = torch.tensor([1, 2, 3, 4]) + V, torch.tensor([0, 1, 2, 3])
    args = (logits, x, q, kb, temperature, top_k, top_p, seed, offset)
    got, ref = _call(*args), _reference(*args)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (got, ref)


def _case(top_ids: list, V: int, K: int, tie_value=None):
    """Logits [1, K+1, V]: small noise, the tokens ``top_ids`` far above it (in decreasing
    order), or all equal to ``tie_value`` when given."""
    g = torch.Generator().manual_seed(len(top_ids) + V)
    logits = torch.randn(1, K + 1, V, generator=g) * 0.1
    for r, v in enumerate(top_ids):
        logits[0, :, v] = 8.0 - 0.25 * r if tie_value is None else tie_value
    return logits


@pytest.mark.parametrize("k", [3, 7, 8, 9])
def test_top_k_set_inside_one_chunk_and_around_the_cap(k, split_settings):
    """The top-k set concentrated in one chunk (tokens 40..49 of chunk 2, 16 tokens a chunk), k
    below, at and above the candidate cap (8): below it the candidate lists decide (no scan),
    at and above it the kernel falls back to bisecting the whole position; every case equals the
    reference, drafts and bonus tokens alike."""
    split_settings(chunk=16)
    split_settings(top_k_cap=8)
    K, V = 2, 100
    logits = _case(list(range(40, 50)), V, K)
    x = torch.tensor([[41, 47]])
    q = torch.softmax(logits[:, :K] * 0.5, -1)
    args = (logits, x, q, torch.tensor([K]), torch.tensor([1.0]), torch.tensor([k]), None)
    for s in range(6):
        seed, offset = torch.tensor([s]), torch.tensor([s])
        got, ref = _call(*args, seed, offset), _reference(*args, seed, offset)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (k, s, got, ref)
    scanned = _records(1, K + 1, V)["scanned"][0]
    assert scanned.tolist() == [int(k >= 8)] * (K + 1), scanned


@pytest.mark.parametrize("top_p,scans", [(0.5, 0), (0.999999, 1)])
def test_top_p_decided_by_candidates_or_by_the_scan(top_p, scans, split_settings):
    """top-p alone: a kept set of a few tokens lies above every chunk's 8th key (candidates
    decide); one that needs most of the vocabulary does not (the whole-position scan). Both equal
    the reference."""
    split_settings(chunk=16)
    split_settings(top_k_cap=8)
    K, V = 1, 90
    logits = _case([3, 20, 37, 38, 60], V, K)
    x = torch.tensor([[20]])
    q = torch.softmax(logits[:, :K], -1)
    args = (logits, x, q, torch.tensor([K]), torch.tensor([1.0]), None, torch.tensor([top_p]))
    for s in range(6):
        seed, offset = torch.tensor([s + 10]), torch.tensor([s])
        got, ref = _call(*args, seed, offset), _reference(*args, seed, offset)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (top_p, s, got, ref)
    assert _records(1, K + 1, V)["scanned"][0].tolist() == [scans] * (K + 1)


@pytest.mark.parametrize("k", [2, 5, 6])
def test_top_k_ties_across_chunk_boundaries(k, split_settings):
    """Five tokens tied at the maximum in three chunks (15, 16, 31, 32, 64 with 16 tokens a
    chunk): top-k keeps all five ties for any k <= 5, one more token for k = 6; the draw over
    them equals the reference's for every uniform of a grid."""
    split_settings(chunk=16)
    split_settings(top_k_cap=4)
    V = 80
    ties = [15, 16, 31, 32, 64]
    logits = _case(ties, V, 0, tie_value=3.0)[0, 0]
    n = 16
    lg = logits.expand(n, 1, V).contiguous()
    x = torch.zeros(n, 0, dtype=torch.int64)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    want = verify_reference(lg, x, None, torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.full((n,), k), None,
                            u[:, None])
    out = fused_verify(lg.to(DEV), x.to(DEV), top_k=k, uniforms=u[:, None].to(DEV), backend="triton")
    assert torch.equal(out.tokens.cpu(), want[0])
    drawn = set(out.tokens[:, 0].tolist())
    assert set(ties) <= drawn and len(drawn) <= max(k, 5), drawn


def test_first_argmax_across_chunks_and_greedy_reads_no_exponential(split_settings):
    """Greedy rows: the maximum tied in several chunks gives the first index (chunk order in the
    combine), and their positions' kept mass is never computed (the record holds 1, the value a
    greedy position keeps: no exponential was taken)."""
    split_settings(chunk=16)
    B, K, V = 2, 2, 70
    logits = torch.zeros(B, K + 1, V)
    logits[0, :, [20, 37, 69]] = 2.0
    logits[1, :, [33, 48]] = 2.0
    x = torch.tensor([[20, 37], [33, 33]])
    out = fused_verify(logits.to(DEV), x.to(DEV), temperature=0.0, seed=0, backend="triton")
    assert out.tokens.cpu().tolist() == [[20, 20, -1], [33, 33, 33]]
    S = _records(B, K + 1, V)["S"]
    assert (S == 1.0).all(), S


@needs_cuda
@pytest.mark.parametrize("warm_up_on", ["capture_stream", "default_stream"])
def test_cuda_graph_replays_with_and_without_a_warm_workspace(warm_up_on):
    """Captured after a warm-up on the capture stream or on another: the graph replays into a
    workspace of its own (the memset of its counters a node of the graph), so replays with new
    offsets equal eager calls, and eager calls between replays do not disturb them."""
    lg, x, q = make_step(4, 4, 9000, seed=3)
    lg, x, q = lg.cuda(), x.cuda(), q.cuda()
    seed = torch.arange(4, device="cuda")
    offset = torch.zeros(4, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    warm = stream if warm_up_on == "capture_stream" else torch.cuda.current_stream()
    with torch.cuda.stream(warm):
        fused_verify(lg, x, q, seed=seed, offset=offset, top_k=20)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fused_verify(lg, x, q, seed=seed, offset=offset, top_k=20)
    for step in range(4):
        offset.fill_(step)
        graph.replay()
        eager = fused_verify(lg, x, q, seed=seed, offset=step, top_k=20)
        assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.num_accepted, eager.num_accepted)


@needs_cuda
def test_two_graphs_replayed_on_two_streams_then_eager_calls():
    """Two graphs captured on the same capture stream (each after a warm-up on it) replayed at
    once on two streams, again and again, then eager calls on each stream: every output equals
    the torch backend's on the same seeds (no two launches ever share a workspace)."""
    B, K, V = 8, 4, 50000
    lg, x, q = make_step(B, K, V, dtype=torch.bfloat16, seed=11)
    lg, x, q = lg.cuda(), x.cuda(), q.cuda()
    seeds = [torch.arange(B, device="cuda") + 100 * g for g in range(2)]
    kw = dict(top_k=50, top_p=0.9, temperature=0.8)
    want = [fused_verify(lg, x, q, seed=s, backend="torch", **kw) for s in seeds]
    capture = torch.cuda.Stream()
    graphs, outs = [], []
    for s in seeds:
        with torch.cuda.stream(capture):
            fused_verify(lg, x, q, seed=s, **kw)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture):
            outs.append(fused_verify(lg, x, q, seed=s, **kw))
        graphs.append(g)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(20):
        for g, st in zip(graphs, streams):
            with torch.cuda.stream(st):
                g.replay()
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o.tokens, w.tokens) and torch.equal(o.num_accepted, w.num_accepted)
    for st in streams + [capture, torch.cuda.current_stream()]:
        with torch.cuda.stream(st):
            eager = [fused_verify(lg, x, q, seed=s, **kw) for s in seeds]
        torch.cuda.synchronize()
        for e, w in zip(eager, want):
            assert torch.equal(e.tokens, w.tokens) and torch.equal(e.num_accepted, w.num_accepted)


def _rows_kernel():
    """bench/ops/rows_kernel.py, the one-program-per-row kernel (a benchmark's, not the package's)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "ops" / "rows_kernel.py"
    spec = importlib.util.spec_from_file_location("rows_kernel_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_cuda
def test_split_kernel_equals_the_row_kernel_on_a_large_batch():
    """B = 64, V = 128,256, bf16, every path at once (greedy, sampled, top-k, top-p rows): the split
    kernel and the one-program-per-row kernel (bench/ops/rows_kernel.py) give the same tokens (the GPU
    run's check that the two measured side by side compute the same step)."""
    B, K, V = 64, 4, 128256
    lg, x, q = make_step(B, K, V, dtype=torch.bfloat16, seed=7)
    lg, x, q = lg.cuda(), x.cuda(), q.cuda()
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0] * 16, device="cuda")
    top_k = torch.tensor([0, 0, 50, 0] * 16, device="cuda")
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8] * 16, device="cuda")
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=torch.arange(B, device="cuda"), offset=5)
    a = fused_verify(lg, x, q, backend="triton", **kw)
    b = _rows_kernel().verify_rows(lg, x, q, **kw)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.tokens, b.tokens)


def test_launch_settings_are_checked_and_restored():
    from specdec_kernels.ops.kernels import current_settings

    before = current_settings()
    with launch_settings(tiles_per_item=4, programs_per_sm=2, maxnreg=128, ticket="prefetch") as st:
        assert (st.tiles_per_item, st.programs_per_sm, st.maxnreg, st.ticket) == (4, 2, 128, "prefetch")
        assert current_settings() is st
        with launch_settings(chunk=64):
            assert current_settings().chunk == 64 and current_settings().ticket == "prefetch"
    assert current_settings() == before
    for bad, msg in ((dict(tiles_per_item=0), "tiles_per_item must be an int >= 1, got 0"),
                     (dict(programs_per_sm=1.5), "programs_per_sm must be an int >= 1, got 1.5"),
                     (dict(maxnreg=0), "maxnreg must be None or an int >= 1, got 0"),
                     (dict(chunk=48), "chunk must be an int >= 16, a power of two, got 48"),
                     (dict(top_k_cap=1), "top_k_cap must be an int >= 2, a power of two, got 1"),
                     (dict(stage2_lag=-1), "stage2_lag must be None or an int >= 0, got -1"),
                     (dict(ticket="fast"), "ticket must be one of ('acq_rel', 'relaxed', 'prefetch'), got 'fast'"),
                     (dict(poll="spin"), "poll must be one of ('acquire', 'relaxed'), got 'spin'"),
                     (dict(poll_sleep_ns=2_000_000), "poll_sleep_ns must be at most 1,000,000, got 2000000"),
                     (dict(chunks=4), "unknown setting 'chunks'")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            with launch_settings(**bad):
                pass
    assert current_settings() == before
