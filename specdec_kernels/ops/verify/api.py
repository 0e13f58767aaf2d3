"""``fused_verify``: the verification step of exact speculative decoding in one launch.

Three layers (see shared STYLE.md item 1): the Triton kernel (``verify/triton/split_kernel.py``), the
launcher (``verify/launch.py``: picks the grid and launches, with the arguments checked by
``verify/args.py`` and the kernel's scratch from ``verify/workspace.py``), and the public ops
here: ``fused_verify``, registered with ``torch.library`` as ``specdec::fused_verify`` so that
``torch.compile(fullgraph=True)`` traces through it, and ``fused_verify_packed``.  On CPU tensors
the default backend is the torch path (``verify/torch_path.py``), bit-identical to
``reference.verify_reference``.

Dtypes are decided here: logits fp32/bf16/fp16 (read as they are, the softmax accumulated in
fp32), draft probabilities or draft logits (``draft_logits=``) fp32/bf16/fp16 (read as fp32),
temperature, top-p and min-p fp32, seeds/offsets/top-k int64, explicit uniforms float64 (fp32 accepted
and widened), tokens int64 out; the acceptance test and the final draw's masses and cumulative
sums compute in float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

try:  # loads the C++ op namespace first, when built
    from .. import extension  # noqa: F401
except ImportError:  # pragma: no cover - extension is part of the package
    pass
from .args import (INDEX_DTYPES, FloatArg, IntArg, _Args, _materialize, _normalize_packed, check_tensor,
                   normalize_arguments, normalize_rows)
from .bitmask import apply_token_bitmask, check_token_bitmask
from .launch import _BACKENDS, _Layout, _launch, _launch_triton, resolve_backend
from .reference.chain import FLT_MIN
from .torch_path import _run_torch, _run_torch_layout
# Public names of the layers below that the decoding loop, the scripts and the benchmarks import from here.
from .args import DRAFT_PROBS_SUM_TOL  # noqa: F401
from .launch import interpreter_problem, interpreting, split_kernel_meta  # noqa: F401

__all__ = ["VerifyOutput", "VerifyOutputWithLogprobs", "check_sampling_scalars", "fused_verify", "fused_verify_packed"]


class VerifyOutput(NamedTuple):
    """tokens [B, K+1] int64: the accepted drafts, then the recovered or bonus token, then -1.
    num_accepted [B] int64 in [0, K_b]; row b emits tokens[b, :num_accepted[b] + 1].
    A row whose inputs were unusable (NaN/inf logits, ...) has num_accepted -1 and emits nothing."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


class VerifyOutputWithLogprobs(NamedTuple):
    """``VerifyOutput`` and, with ``return_logprobs=True``, logprobs [B, K+1] fp32: the target
    log-probability of each emitted token under the row's warped distribution (temperature,
    top-k, top-p, min-p; a greedy row's under softmax(logits), T = 1 and no warp), -inf in every slot
    that emits nothing."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    logprobs: torch.Tensor


def verify_normalized(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
                 top_p, seed, offset, uniforms, min_p, backend: str,
                 local_workspace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    a = _Args(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p,
              seed, offset, uniforms, min_p)
    resolved = resolve_backend(backend, target_logits.device)
    if resolved == "triton":
        return _launch_triton(a, local_workspace=local_workspace)
    a = _materialize(a)
    with torch.no_grad():  # integer outputs; its in-place and out= temporaries must not meet autograd
        return _run_torch(a)


def _verify_layout(a: _Args, lay: _Layout, backend: str):
    """``fused_verify`` / ``fused_verify_packed`` with a layout (packed, probabilities in,
    log-probabilities, ``out=``, draft logits): eager only."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("fused_verify_packed, and fused_verify with draft_logits, target_is_probs, out=, "
                                  "return_logprobs or method='block', are eager ops: call them outside torch.compile")
    resolved = resolve_backend(backend, a.target_logits.device)
    if resolved == "triton":
        tokens, num, lp = _launch(a, lay)  # a grammar's mask applied in the launch
    else:
        if lay.mask is not None:  # the torch path: the mask applied to the logits first
            a = a._replace(target_logits=apply_token_bitmask(a.target_logits, lay.mask, lay.probs))
            lay = lay._replace(mask=None)
        tokens, num, lp = _run_torch_layout(a, lay)
    if lay.logprobs:
        return VerifyOutputWithLogprobs(tokens, num, lp)
    return VerifyOutput(tokens, num)


def verify_prechecked(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p,
                    seed, offset, uniforms=None, min_p=None, backend: str = "auto") -> VerifyOutput:
    """``fused_verify`` from arguments that are already what ``normalize_arguments`` returns ([B] tensors
    of its dtypes on the logits' device, in range), without the per-call checks: the tail of
    ``fused_verify``, and ``SpeculativeDecoder``'s entry (it checks its parameters once per
    ``generate``; inside its CPU loop the checks would cost about 1% of a step of the embedded
    target: docs/history/measurements.md).  The same computation either way."""
    a = _Args(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p, seed, offset,
              uniforms, min_p)
    if torch.compiler.is_compiling():
        fn, a = _fused_verify_op, _materialize(a)  # the registered op's schema takes [B] tensors
    else:
        fn = verify_normalized
    tokens, num_accepted = fn(*a, backend)
    return VerifyOutput(tokens, num_accepted)


# The registered op: opaque to torch.compile, with a fake for tracing.  Eager calls skip the
# dispatcher (it costs tens of microseconds at batch 1, a decode step's scale; see bench/).
@torch.library.custom_op("specdec::fused_verify", mutates_args=())
def _fused_verify_op(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    num_draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    seed: torch.Tensor,
    offset: torch.Tensor,
    uniforms: Optional[torch.Tensor],
    min_p: Optional[torch.Tensor],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return verify_normalized(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature,
                        top_k, top_p, seed, offset, uniforms, min_p, backend, local_workspace=True)


@_fused_verify_op.register_fake
def _(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p, seed,
      offset, uniforms, min_p, backend):
    B, K1, _ = target_logits.shape
    return (target_logits.new_empty((B, K1), dtype=torch.int64),
            target_logits.new_empty((B,), dtype=torch.int64))


def check_temperature(temperature: float) -> None:
    """A scalar temperature's range (``fused_verify`` and ``SpeculativeDecoder.generate``): 0
    (greedy) or finite and at least 2^-126, the smallest normal fp32 (below it 1 / T overflows)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if 0 < temperature < FLT_MIN:
        raise ValueError(f"temperature must be 0 (greedy) or >= {FLT_MIN:.8g} (the smallest normal fp32), "
                         f"got {temperature}")


def check_sampling_scalars(temperature, top_k=None, top_p=None, min_p=None) -> None:
    """The sampling parameters as Python scalars, checked by the very code ``fused_verify`` checks
    them with (so ``generate``, the CLI and the op refuse the same values with the same words):
    the type, then a value that float32 (temperature, top-p, min-p) or int64 (top-k) cannot hold
    (1e39, 1e-50, 10**19), then the range.  Raises TypeError/ValueError naming the argument."""
    for name, value, kind in (("temperature", temperature, float), ("top_k", top_k, int), ("top_p", top_p, float),
                              ("min_p", min_p, float)):
        if value is None and name != "temperature":
            continue
        ok = (int, float) if kind is float else int
        if isinstance(value, bool) or not isinstance(value, ok):
            what = {"temperature": "a float", "top_k": "an int or None", "top_p": "a float or None",
                    "min_p": "a float in [0, 1] or None"}[name]
            raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    check_temperature(temperature)
    normalize_rows(1, 0, torch.device("cpu"), temperature, top_k, top_p, 0, 0, None, False, min_p)


METHODS = ("token", "block")


def _check_method(method) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _check_out(out, B: int, K1: int, dev: torch.device, logprobs: bool) -> tuple:
    """``out=``: (tokens [B, K+1], num_accepted [B]) int32/int64 (+ logprobs [B, K+1] fp32 with
    return_logprobs=True), on the logits' device, any strides; written in place."""
    n = 3 if logprobs else 2
    names = ("tokens", "num_accepted", "logprobs")[:n]
    if not isinstance(out, (tuple, list)) or len(out) != n:
        raise TypeError(f"out must be a tuple ({', '.join(names)}) of {n} tensors"
                        f"{' (return_logprobs=True)' if logprobs else ''}, got "
                        f"{type(out).__name__}{f' of length {len(out)}' if isinstance(out, (tuple, list)) else ''}")
    shapes = ([B, K1], [B], [B, K1])
    for name, t, shape in zip(names, out, shapes):
        dtypes = (torch.float32,) if name == "logprobs" else INDEX_DTYPES
        check_tensor(f"out.{name}", t, dtypes, shape, dev)
    return tuple(out)


def fused_verify(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16: raw target logits
    draft_tokens: torch.Tensor,  # [B, K] int32/int64
    draft_probs: Optional[torch.Tensor] = None,  # [B, K, Vd] fp32, Vd <= V; None = one-hot q
    *,
    draft_logits: Optional[torch.Tensor] = None,  # [B, K, Vd] instead of draft_probs: q = softmax(l / T)
    num_draft_tokens: Optional[IntArg] = None,  # None, int or [B] int: row b uses its first K_b <= K drafts
    temperature: FloatArg = 1.0,  # float or [B]: 0 = greedy verification for that row, else >= 2^-126
    top_k: Optional[IntArg] = None,  # None, int or [B] int (0 = off)
    top_p: Optional[FloatArg] = None,  # None, float or [B] (1.0 = off)
    # min_p: None, float or [B] in [0, 1] (0 = off): keep p(v) >= min_p * max p, after top-k/top-p
    min_p: Optional[FloatArg] = None,
    seed: Optional[IntArg] = None,  # None (torch's default generator), int, or [B] int64
    offset: IntArg = 0,  # int or [B] int64: a step counter (its low 32 bits enter Philox's counter)
    uniforms: Optional[torch.Tensor] = None,  # [B, K+1] float64 (or fp32) in [0, 1): explicit random numbers
    backend: str = "auto",  # "auto" | "triton" | "torch"
    target_is_probs: bool = False,  # target_logits holds probabilities [B, K+1, V], used as given
    out: Optional[tuple] = None,  # (tokens [B, K+1], num_accepted [B]) int32/int64 (+ logprobs [B, K+1] fp32)
    return_logprobs: bool = False,  # also return each emitted token's target log-probability
    method: str = "token",  # "token" (token by token) | "block" (block verification, Sun et al. 2025)
    token_bitmask: Optional[torch.Tensor] = None,  # [B, K+1, ceil(V/32)] int32: a grammar's allowed tokens
) -> Union[VerifyOutput, VerifyOutputWithLogprobs]:
    """Verify K drafted tokens against the target in one step (Leviathan et al. 2023; Chen et al. 2023).

    For each row b and verify position i, p_i = softmax(warp(target_logits[b, i] / T)), where the
    warp is top-k, then top-p, then min-p (transformers' order in ``generate``: temperature,
    top-k, top-p, min-p; ``reference.warp_logits`` defines each).  min-p keeps token v iff
    s_v >= fl32(m + fl32(ln min_p)), s = logits / T and m = max s: p(v) >= min_p * max p with
    ties kept or dropped together (min_p = 1 keeps the argmax and its ties, 0 is off; the log is
    ``reference.min_p_log``'s, the same bits on every backend).  Draft x_i is *accepted* with
    probability min(1, p_i(x_i)/q_i(x_i)) (as ``u_i * q_i(x_i) < p_i(x_i)``, no division).  At
    the first rejection the *recovered* token is drawn from the residual norm(max(0, p_i - q_i))
    (from p_i if that sums to zero in floating point); if all K_b drafts are accepted, the
    *bonus* token is drawn from p_{K_b}.
    Rows with temperature 0 are verified greedily: accept while x_i == argmax p_i, then emit the
    argmax.  The emitted tokens are distributed exactly as sampling from the target alone.

    Randomness: the numbers of row b depend only on (seed[b], offset[b]) (Philox, counter-based),
    never on the other rows of the batch; an int seed is used by every row.  ``uniforms``
    replaces them: ``uniforms[b, i]`` (i < K) tests draft i and ``uniforms[b, K]`` drives the
    final draw.  The CPU torch path and the Triton kernel draw the same numbers
    (``reference.philox_uniforms``): 24-bit ones for the tests, 53 bits for the final draw, whose
    inverse CDF sums in float64, so that a token of probability far below fp32's 2^-24 is
    still drawn with its own probability (to within ~2^-53 of the total).

    Unusable input never yields a token: a row that meets a NaN or +inf logit, a position with
    no finite logit, a logit whose logit / T overflows fp32 (at T = 2^-126, any logit above ~4),
    a NaN/inf/negative draft probability or a draft id outside [0, V) at a position it reads
    gets ``num_accepted = -1`` and ``tokens = -1``.  Shapes, dtypes, devices
    and scalar arguments are checked here and raise ValueError/TypeError; tensor-valued
    parameters (num_draft_tokens, temperature, top_k, top_p, min_p) are range-checked on CPU, where
    that is free; on CUDA an out-of-range value marks its row invalid instead (no host sync).
    Each ``draft_probs[b, j]`` a row reads must sum to 1 (checked on CPU to within 1e-2; not on
    CUDA, where a q that does not sum to 1 biases the output, as in every rejection sampler).
    ``draft_probs`` may be fp32, bf16 or fp16 (read as it is, computed in fp32).

    ``target_is_probs=True``: ``target_logits`` holds the target's probabilities (already
    warped, as FlashInfer's and SGLang's pipelines hold them): p_i = target_logits[b, i] / its
    sum, no temperature or warp applied again (top_k, top_p and min_p must be None; temperature 0 verifies
    the row greedily against the argmax of p, 1 samples); a position with a NaN, inf or negative
    entry, or none positive, makes its row invalid.
    ``out=``: preallocated outputs written in place (no allocation: capturable in a CUDA graph);
    the call returns them.  ``return_logprobs=True`` returns ``VerifyOutputWithLogprobs``, whose
    logprobs [B, K+1] fp32 hold log p_i(token) of each emitted token under the row's warped
    target distribution (a greedy row's under softmax(logits)), -inf where nothing is emitted.
    These three are eager-only (not under torch.compile).

    ``draft_logits=``: the draft's raw logits [B, K, Vd] (fp32, bf16 or fp16, Vd <= V) in place of
    ``draft_probs`` (passing both is a ValueError): q_i = softmax(draft_logits[b, i] / T), T the
    row's own temperature (the target's), computed in the kernel at the positions it reads, in
    fp32 as the target's softmax.  No top-k, top-p or min-p is applied to q: q must be the law the draft
    sampled from, so a draft that sampled with its own warp must pass its warped probabilities as
    ``draft_probs``.  Greedy rows ignore q.  A draft position whose logits hold a NaN or a +inf
    (after the scaling by 1 / T), or no finite one, has no distribution: q is taken as NaN
    there (what the softmax gives), so a sampling row whose drafts read it gets
    ``num_accepted = -1`` as with a NaN in ``draft_probs`` (nothing is refused on the host);
    -inf logits are allowed (q = 0).  The result equals ``draft_probs=reference.draft_softmax(
    draft_logits, 1 / T)`` (fp32; the kernel's sums round in another order, as for p).
    Eager-only too.

    ``method="block"``: block verification (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025; ``reference.block_verify_reference`` defines it): the K_b drafts are
    accepted or rejected jointly, the emitted tokens still distributed exactly as the target's,
    at least as many drafts accepted on average as token by token.  Every other argument and
    output is the same (greedy rows are verified token by token: the same tokens).  It reads the
    full q at every draft position, not only at a rejection, and every position's p twice
    (``verify.triton.split_kernel``'s header).  Eager-only, as ``out=``.

    ``token_bitmask=``: a grammar's allowed tokens at each position, in xgrammar's layout (int32,
    bit v % 32 of word v // 32 set when token v is allowed; ``ops/verify/bitmask.py``), each
    position's mask for its own prefix.  The mask comes first (a forbidden token's logit is -inf),
    then the temperature and the warps: the output follows the target's law restricted to the
    allowed tokens and renormalised.  A position that allows no token with a finite logit makes
    its row invalid (``num_accepted = -1``).  The Triton backend applies it inside its one launch
    (no masked copy of the logits); the torch path masks a copy first.  Eager-only, as ``out=``
    (under torch.compile the mask is applied to a copy before the registered op).
    """
    _check_method(method)
    if isinstance(temperature, float):
        check_temperature(temperature)
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if isinstance(top_p, float) and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if isinstance(min_p, float) and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if isinstance(num_draft_tokens, int) and isinstance(target_logits, torch.Tensor) and target_logits.dim() == 3:
        K = target_logits.shape[1] - 1
        if not 0 <= num_draft_tokens <= K:
            raise ValueError(f"num_draft_tokens must be in [0, K] = [0, {K}], got {num_draft_tokens}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if token_bitmask is not None:
        if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
            raise ValueError("token_bitmask needs target_logits [B, K+1, V]")
        check_token_bitmask(token_bitmask, tuple(target_logits.shape[:2]), target_logits.shape[-1],
                            target_logits.device)
        if torch.compiler.is_compiling():  # the registered op takes no mask: applied before it
            target_logits = apply_token_bitmask(target_logits, token_bitmask, bool(target_is_probs))
            token_bitmask = None
    a = normalize_arguments(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
                   top_p, seed, offset, uniforms, materialize=False, target_is_probs=bool(target_is_probs),
                   draft_logits=draft_logits, min_p=min_p)
    if (target_is_probs or out is not None or return_logprobs or draft_logits is not None or method == "block"
            or token_bitmask is not None):
        B, K1, _ = target_logits.shape
        if out is not None:
            out = _check_out(out, B, K1, target_logits.device, bool(return_logprobs))
        lay = _Layout(B, K1 - 1, None, bool(target_is_probs), bool(return_logprobs), out,
                      draft_logits=draft_logits is not None, block=method == "block", mask=token_bitmask)
        return _verify_layout(a, lay, backend)
    return verify_prechecked(*a, backend=backend)


def fused_verify_packed(
    logits: torch.Tensor,  # [sum_b (K_b + 1), V] fp32/bf16/fp16: row b's K_b verify positions, then its bonus
    draft_tokens: torch.Tensor,  # [sum_b K_b] int32/int64
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] int32/int64: cu[0] = 0, row b's drafts at cu[b]:cu[b + 1]
    draft_probs: Optional[torch.Tensor] = None,  # [sum_b K_b, Vd] fp32/bf16/fp16, Vd <= V; None = one-hot q
    *,
    draft_logits: Optional[torch.Tensor] = None,  # [sum_b K_b, Vd] fp32/bf16/fp16, instead of draft_probs
    max_num_draft_tokens: Optional[int] = None,  # max_b K_b (None: read from cu, a host sync on CUDA)
    temperature: FloatArg = 1.0,
    top_k: Optional[IntArg] = None,
    top_p: Optional[FloatArg] = None,
    min_p: Optional[FloatArg] = None,
    seed: Optional[IntArg] = None,
    offset: IntArg = 0,
    uniforms: Optional[torch.Tensor] = None,  # [B, K+1], K = max_num_draft_tokens
    backend: str = "auto",
    target_is_probs: bool = False,
    out: Optional[tuple] = None,
    return_logprobs: bool = False,
    method: str = "token",
    token_bitmask: Optional[torch.Tensor] = None,  # [sum_b (K_b + 1), ceil(V/32)] int32
) -> Union[VerifyOutput, VerifyOutputWithLogprobs]:
    """``fused_verify`` in the packed (ragged) layout engines hold: the rows back to back, row b's
    K_b = cu[b + 1] - cu[b] verify positions followed by its bonus position, no padding.  The
    same kernel, indexed through cu: no copy of the logits, one launch (the CPU torch path gathers
    them into the padded layout).  Every keyword is ``fused_verify``'s (``token_bitmask``
    [sum_b (K_b + 1), W] in the logits' layout; ``draft_logits`` [sum_b K_b,
    Vd] the draft's logits, in the draft_probs layout); outputs are padded to
    K = ``max_num_draft_tokens`` (tokens [B, K+1] with -1, num_accepted [B]), and row b's
    results equal ``fused_verify``'s on the same row padded, for the same seeds and uniforms
    (the random numbers depend on (seed[b], offset[b]) only).

    On CUDA, cu is trusted as far as its values go (not read on the host unless
    ``max_num_draft_tokens`` is None): a row with K_b > K or drafts outside [0, sum_b K_b) gets
    ``num_accepted = -1`` and reads nothing.  On CPU, cu is checked and must rise from 0 to
    ``len(draft_tokens)``.
    """
    _check_method(method)
    if isinstance(temperature, float):
        check_temperature(temperature)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if token_bitmask is not None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise ValueError("token_bitmask needs logits [sum_b (K_b + 1), V]")
        check_token_bitmask(token_bitmask, (logits.shape[0],), logits.shape[-1], logits.device)
    a, B, K = _normalize_packed(logits, draft_tokens, cu_num_draft_tokens, draft_probs, max_num_draft_tokens,
                                temperature, top_k, top_p, seed, offset, uniforms, bool(target_is_probs),
                                draft_logits=draft_logits, min_p=min_p)
    if out is not None:
        out = _check_out(out, B, K + 1, logits.device, bool(return_logprobs))
    lay = _Layout(B, K, cu_num_draft_tokens, bool(target_is_probs), bool(return_logprobs), out,
                  draft_logits=draft_logits is not None, block=method == "block", mask=token_bitmask)
    return _verify_layout(a, lay, backend)
