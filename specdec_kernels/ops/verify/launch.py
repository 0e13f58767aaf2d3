"""The launcher of ``fused_verify``'s Triton kernel, its launch settings, and the choice of backend.

``_launch``: one launch of the split kernel (``triton/split_kernel.py``, the ``"triton"``
backend), its compile-time parameters from ``split_kernel_meta`` under the current
``SplitSettings``, its scratch from ``workspace``.  The arguments come checked (``args``); a
launch allocates the outputs (none with ``out=``), zeroes the workspace's counters, picks the
grid, passes scalars by value and [B] tensors as they are, and refuses only what depends on the
grid.  The kernel is imported on the first launch, so the torch path runs without Triton.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import NamedTuple, Optional

import torch

from .args import _Args, _RowSeeds
from .row_params import PARAM_FLAG
from .workspace import SplitWorkspace, captured_workspace, workspace

_BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def interpreter_problem(triton_version: Optional[str] = None, numpy_version: Optional[str] = None) -> Optional[str]:
    """Why Triton's interpreter cannot run the kernel here, or None.

    Triton 3.6's interpreter turns one-element arrays into Python ints with ``int()``, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars", at the
    kernel's first loop over the vocabulary); Triton 3.7 squeezes them first (triton 3.6.0 with
    numpy 2.4.6; the compiled kernel is unaffected)."""
    if triton_version is None or numpy_version is None:
        import numpy
        import triton

        triton_version, numpy_version = triton_version or triton.__version__, numpy_version or numpy.__version__
    from packaging.version import Version

    if Version(triton_version).release[:2] < (3, 7) and Version(numpy_version).release[:2] >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run with NumPy {numpy_version}: "
                f"install 'triton>=3.7' or 'numpy<2.4'")
    return None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        if not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got tensors on {device}")
        problem = interpreter_problem()
        if problem is not None:
            raise RuntimeError(f"backend='triton' on CPU tensors: {problem}")
    return backend


@dataclasses.dataclass(frozen=True)
class SplitSettings:
    """The split kernel's launch settings.  None of them changes a token (batch invariance: the
    tests run the kernel under several and compare); they trade bytes in flight, atomics and
    occupancy, and a GPU run compares them (``bench/ops/bench_verify_knobs.py``).

    chunk: tokens per vocabulary chunk, a power of two >= 16 (never a function of B: a row's
    arithmetic is the same in any batch); 4096 fp32 logits keep 8 warps' loads in flight. Tests
    lower it to cross chunk boundaries on small vocabularies.
    top_k_cap: candidate keys kept per chunk for top-k/top-p/min-p (a power of two >= 2): top-k
    up to top_k_cap - 1 and most top-p sets are decided from them in one read of the logits.
    tiles_per_item: chunks per work item, streamed with software pipelining ``stages`` deep.
    programs_per_sm: the persistent grid (any grid is correct: items are claimed in order).
    num_warps: per program (None: 8 for chunks of >= 2048 tokens, else 4).
    maxnreg: a register cap on CUDA (None: ptxas's choice).
    ticket: how a program claims its next work item: "acq_rel" (an acq_rel atomic add after the
    current item), "relaxed" (relaxed order), "prefetch" (relaxed, claimed at the start of the
    current item so the round trip overlaps its loads).
    stage2_lag: None numbers every stage-1 item before any stage-2 item; L >= 0 numbers row b's
    stage-2 items right after row b + L's stage-1 items, so a row's second read of position j
    finds it in L2.
    poll: how a stage-2 item waits for its row's acceptance chain: "acquire" (an acquire atomic
    per poll), "relaxed" (volatile loads, then one acquire atomic once the flag is seen).
    poll_sleep_ns: a ``nanosleep`` between polls on CUDA (0: none; ignored by the interpreter).
    """

    chunk: int = 4096
    top_k_cap: int = 64
    tiles_per_item: int = 1
    stages: int = 2
    programs_per_sm: int = 1
    num_warps: Optional[int] = None
    maxnreg: Optional[int] = None
    ticket: str = "acq_rel"
    stage2_lag: Optional[int] = None
    poll: str = "acquire"
    poll_sleep_ns: int = 0

    def __post_init__(self):
        def want_int(name, lo, optional=False, power_of_two=False):
            v = getattr(self, name)
            if optional and v is None:
                return
            ok = not isinstance(v, bool) and isinstance(v, int) and v >= lo
            if ok and power_of_two:
                ok = v & (v - 1) == 0
            if not ok:
                what = f"{'None or ' if optional else ''}an int >= {lo}{', a power of two' if power_of_two else ''}"
                raise ValueError(f"launch_settings: {name} must be {what}, got {v!r}")

        want_int("chunk", 16, power_of_two=True)
        want_int("top_k_cap", 2, power_of_two=True)
        want_int("tiles_per_item", 1)
        want_int("stages", 1)
        want_int("programs_per_sm", 1)
        want_int("num_warps", 1, optional=True, power_of_two=True)
        want_int("maxnreg", 1, optional=True)
        want_int("stage2_lag", 0, optional=True)
        want_int("poll_sleep_ns", 0)
        if self.poll_sleep_ns > 1_000_000:  # nanosleep's limit
            raise ValueError(f"launch_settings: poll_sleep_ns must be at most 1,000,000, got {self.poll_sleep_ns}")
        for name, choices in (("ticket", _TICKETS), ("poll", _POLLS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"launch_settings: {name} must be one of {choices}, got {getattr(self, name)!r}")


_TICKETS = ("acq_rel", "relaxed", "prefetch")
_POLLS = ("acquire", "relaxed")
# The settings every launch uses; ``ops.kernels.launch_settings`` changes them within a block.
SETTINGS = SplitSettings()
# The grid of a launch on CPU tensors (Triton's interpreter, which runs a grid's programs one after
# another: the first claims every ticket); ``interpreter_grid`` changes it within a block.
_INTERPRETER_GRID = 1


@contextlib.contextmanager
def interpreter_grid(programs: int):
    """Within the block, a launch on CPU tensors (Triton's interpreter) runs ``programs`` programs
    instead of 1, restored on exit.  For ``ops.interleave``, which runs them as interleaved
    threads; under the plain interpreter the first program claims every ticket and the others
    find none left.  CUDA launches keep their grid."""
    global _INTERPRETER_GRID
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"interpreter_grid: programs must be an int >= 1, got {programs!r}")
    old = _INTERPRETER_GRID
    _INTERPRETER_GRID = programs
    try:
        yield programs
    finally:
        _INTERPRETER_GRID = old


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_kernel_meta(V: int, K1: int, has_draft_probs: bool, has_top_k: bool, has_top_p: bool, has_uniforms: bool,
                      has_order: bool = False, packed: bool = False, probs: bool = False, logprobs: bool = False,
                      draft_logits: bool = False, has_min_p: bool = False, block: bool = False,
                      cuda: bool = True, masked: bool = False) -> dict:
    """The split kernel's compile-time parameters for V tokens and K + 1 = K1 positions under the
    current ``SETTINGS``: its constexprs, num_warps, enable_fp_fusion (pinned off: a
    multiply and an add stay two roundings) and maxnreg (CUDA only).  The launch and the ahead-of-time compile
    check (``scripts/gpu_compile_check.py``) both take them here.  ``draft_logits``: the draft
    tensor holds logits (DRAFT_LOGITS; with has_draft_probs); ``has_min_p``: a min_p argument was
    given (HAS_MIN_P); ``block``: block verification (BLOCK); ``cuda``: compiled for a GPU (the
    poll's nanosleep is CUDA inline assembly, which the interpreter cannot run); ``masked``: a
    grammar's token mask applied in the launch (MASKED)."""
    import triton

    st = SETTINGS
    chunk = max(16, min(triton.next_power_of_2(V), st.chunk))
    nc = triton.cdiv(V, chunk)
    meta = dict(HAS_DRAFT_PROBS=has_draft_probs, HAS_TOP_K=has_top_k, HAS_TOP_P=has_top_p, HAS_MIN_P=has_min_p,
                HAS_UNIFORMS=has_uniforms, HAS_ORDER=has_order, PACKED=packed, PROBS=probs, LOGPROBS=logprobs,
                DRAFT_LOGITS=bool(draft_logits and has_draft_probs), BLOCK=bool(block), MASKED=bool(masked),
                CHUNK=chunk,
                TILES=st.tiles_per_item, STAGES=st.stages, NCB=triton.next_power_of_2(nc),
                CAP=st.top_k_cap, BLOCK_K=triton.next_power_of_2(K1),
                TICKET=_TICKETS.index(st.ticket), POLL=_POLLS.index(st.poll),
                SLEEP_NS=st.poll_sleep_ns if cuda else 0,
                num_warps=st.num_warps or (8 if chunk >= 2048 else 4), enable_fp_fusion=False)
    if cuda and st.maxnreg is not None:
        meta["maxnreg"] = st.maxnreg
    return meta


def _param_args(value, bit: int, dummy: torch.Tensor, flags: int):
    """(flags, ptr, stride, scalar) of one per-row parameter for the split kernel: a [B] tensor is
    read in place (any dtype the checks accept, any stride), a scalar is passed by value."""
    if isinstance(value, torch.Tensor):
        return flags | bit, value, value.stride(0), 0
    return flags, dummy, 0, (0 if value is None else value)


class _Layout(NamedTuple):
    """What a call asks beyond ``_Args``: the batch (B rows, K = max_b K_b), the packed layout's
    cu [B + 1] (None: padded), probabilities in, log-probabilities out, preallocated outputs, and
    whether ``_Args.draft_probs`` holds the draft's logits (``draft_logits=``: q = softmax(l / T)),
    the verification method (``block``: ``method="block"``) and a grammar's token mask (``mask``:
    ``token_bitmask=``, int32 [B, K+1, W] or packed [sum_b (K_b + 1), W], checked)."""

    B: int
    K: int
    cu: Optional[torch.Tensor] = None
    probs: bool = False
    logprobs: bool = False
    out: Optional[tuple] = None
    draft_logits: bool = False
    block: bool = False  # method="block": block verification
    mask: Optional[torch.Tensor] = None  # token_bitmask=: applied in the launch (the torch path: before it)


def _padded_layout(a: _Args) -> _Layout:
    B, K1, _ = a.target_logits.shape
    return _Layout(B, K1 - 1)


def _kernel_inputs(a: _Args, lay: _Layout):
    """(logits, draft_probs, tokens, num_accepted, logprobs) for the split kernel: the two
    inputs with a contiguous last dim (the kernels read a row at ptr + v; a copy only when it is
    not) and the outputs: ``lay.out``'s, or allocated ([B, K+1] and [B] int64, [B, K+1] fp32)."""
    logits = a.target_logits if a.target_logits.stride(-1) == 1 else a.target_logits.contiguous()
    B, K1 = lay.B, lay.K + 1
    q = a.draft_probs
    if q is not None and q.stride(-1) != 1:
        q = q.contiguous()
    if lay.out is not None:
        tokens, num_accepted = lay.out[0], lay.out[1]
        logprobs = lay.out[2] if lay.logprobs else None
    else:
        tokens = torch.empty((B, K1), dtype=torch.int64, device=logits.device)
        num_accepted = torch.empty((B,), dtype=torch.int64, device=logits.device)
        logprobs = torch.empty((B, K1), dtype=torch.float32, device=logits.device) if lay.logprobs else None
    return logits, q, tokens, num_accepted, logprobs


def _launch_triton(a: _Args, order: Optional[torch.Tensor] = None,
                   local_workspace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``_launch`` of the padded layout: (tokens, num_accepted)."""
    return _launch(a, _padded_layout(a), order, local_workspace)[:2]


def _launch(a: _Args, lay: _Layout, order: Optional[torch.Tensor] = None,
            local_workspace: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The split kernel (``triton/split_kernel.py``): one launch, and on the device no op but the
    outputs' allocation (none with ``out=``) and the memset of the counters the launch uses
    (scalars go by value, tensors are read as they are).
    Returns (tokens, num_accepted, logprobs or None).
    ``order`` (tests only): int32 [N] permutation of the work items, stage-1 items among themselves
    and stage-2 items among themselves, to prove that arrival order does not change the result.
    ``local_workspace``: a workspace of this call only (the registered op's path: torch.compile's
    CUDA graphs allocate from pools whose memory they recycle, where a cached one could end up).
    Under CUDA-graph capture the call takes a workspace of the graph's own, kept alive with it."""
    from .triton.split_kernel import verify_split_kernel  # lazily: the torch path needs no Triton

    logits, q, tokens, num_accepted, logprobs = _kernel_inputs(a, lay)
    B, K = lay.B, lay.K
    K1, V = K + 1, logits.shape[-1]
    packed = lay.cu is not None
    dev = logits.device
    if B == 0:
        return tokens, num_accepted, logprobs
    x, u = a.draft_tokens, a.uniforms
    warp = a.top_k is not None or a.top_p is not None or a.min_p is not None
    meta = split_kernel_meta(V, K1, q is not None, a.top_k is not None, a.top_p is not None, u is not None,
                             order is not None, packed=packed, probs=lay.probs, logprobs=lay.logprobs,
                             draft_logits=lay.draft_logits, has_min_p=a.min_p is not None, block=lay.block,
                             cuda=dev.type == "cuda", masked=lay.mask is not None)
    nc = -(-V // meta["CHUNK"])
    sizes = SplitWorkspace.sizes(B, K1, nc, meta["CAP"] if warp else 0, meta["DRAFT_LOGITS"], lay.block)
    if local_workspace:
        ws = SplitWorkspace()
    elif dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        ws = captured_workspace()  # the graph's own: no replay shares it with another call
    else:
        ws = workspace(dev)
    ws.ensure(dev, sizes)
    # The counters this launch uses start at zero whatever an earlier launch left (one that
    # overlapped it, one killed mid-way): one memset, a node of its own in a captured graph.
    ws.counters.zero_()
    ni = -(-nc // meta["TILES"])  # work items per position
    n1 = B * K1 * ni
    n_items = n1 + B * ni * (K1 if lay.block else 1)  # stage 2: per row (block: per row and position)
    grid = _INTERPRETER_GRID if dev.type != "cuda" else min(n_items, _sm_count(dev.index) * SETTINGS.programs_per_sm)
    if n_items + 2 * grid >= 2**31:  # the kernel's int32 ticket (a prefetching program claims two)
        raise ValueError(f"fused_verify: {n_items} work items (B = {B}, K + 1 = {K1}, {ni} a position) must stay "
                         f"below 2^31 - {2 * grid}")
    lag = B if SETTINGS.stage2_lag is None else min(SETTINGS.stage2_lag, B)
    if order is not None:
        # a stage-2 item before its row's stage-1 items would wait for ever: refuse such orders
        o = order.cpu().tolist()
        if sorted(o[:n1]) != list(range(n1)) or sorted(o[n1:]) != list(range(n1, n_items)):
            raise ValueError(f"order must hold a permutation of the {n1} stage-1 items, then one of the "
                             f"{n_items - n1} stage-2 items, got {o}")
    dummy = num_accepted  # stands in for absent tensors; never dereferenced
    flags = 0
    # packed: the kernel takes K_b from cu, and the number of drafts (a row's bound) in nd's scalar
    nd = x.shape[0] if packed else (K if a.num_draft_tokens is None else a.num_draft_tokens)
    flags, nd_p, nd_s, nd_v = _param_args(nd, PARAM_FLAG["num_draft"], dummy, flags)
    flags, t_p, t_s, t_v = _param_args(a.temperature, PARAM_FLAG["temperature"], dummy, flags)
    flags, k_p, k_s, k_v = _param_args(a.top_k, PARAM_FLAG["top_k"], dummy, flags)
    flags, p_p, p_s, p_v = _param_args(1.0 if a.top_p is None else a.top_p, PARAM_FLAG["top_p"], dummy, flags)
    flags, mp_p, mp_s, mp_v = _param_args(0.0 if a.min_p is None else a.min_p, PARAM_FLAG["min_p"], dummy, flags)
    seed, seed_step = (a.seed.base, 1) if isinstance(a.seed, _RowSeeds) else (a.seed, 0)
    flags, s_p, s_s, s_v = _param_args(seed, PARAM_FLAG["seed"], dummy, flags)
    flags, o_p, o_s, o_v = _param_args(a.offset, PARAM_FLAG["offset"], dummy, flags)
    if packed:  # row b at logits row cu[b] + b, its drafts at cu[b]: the kernel takes the row strides
        l_strides = (0, logits.stride(0))
        x_strides = (0, x.stride(0) if x.numel() else 1)
        q_strides = (0, q.stride(0)) if q is not None else (0, 0)
        cu, cu_stride = lay.cu, lay.cu.stride(0)
    else:
        l_strides = (logits.stride(0), logits.stride(1))
        x_strides = (x.stride(0), x.stride(1) if K > 0 else 1)
        q_strides = (q.stride(0), q.stride(1)) if q is not None else (0, 0)
        cu, cu_stride = dummy, 0
    mask = lay.mask
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()  # the kernel reads a position's words at ptr + v // 32
    if mask is None:
        m_strides = (0, 0)
    elif packed:
        m_strides = (0, mask.stride(0))
    else:
        m_strides = (mask.stride(0), mask.stride(1))
    lp = logprobs if logprobs is not None else dummy
    lp_strides = (logprobs.stride(0), logprobs.stride(1)) if logprobs is not None else (0, 0)
    # Triton launches on the current device's current stream: make it the tensors'. Nothing to
    # do for the interpreter.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        verify_split_kernel[(grid,)](
            logits, *l_strides, x, *x_strides, q if q is not None else dummy, *q_strides, cu, cu_stride,
            mask if mask is not None else dummy, *m_strides,
            u if u is not None else dummy, u.stride(0) if u is not None else 0, u.stride(1) if u is not None else 0,
            flags, nd_p, nd_s, nd_v, t_p, t_s, float(t_v), k_p, k_s, k_v, p_p, p_s, float(p_v),
            mp_p, mp_s, float(mp_v), s_p, s_s, s_v, o_p, o_s, o_v, seed_step,
            tokens, tokens.stride(0), tokens.stride(1), num_accepted, num_accepted.stride(0), lp, *lp_strides,
            ws.counters, ws.part_f, ws.part_i, ws.cand, ws.mass, order if order is not None else dummy,
            B, K, V, q.shape[-1] if q is not None else V, nc, lag,
            **meta,
            )
    return tokens, num_accepted, logprobs

