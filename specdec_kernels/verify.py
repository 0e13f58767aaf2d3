"""``fused_verify``: the verification step of exact speculative decoding in one launch.

Three layers (see shared STYLE.md item 1): the Triton kernel (``_verify_kernel.py``), the
launcher here (validates, allocates, picks the grid and launches), and the public op
``fused_verify``, registered with ``torch.library`` as ``specdec::fused_verify`` so that
``torch.compile(fullgraph=True)`` traces through it.

Dtypes are decided here: logits fp32/bf16/fp16 (read as they are, the softmax accumulated in
fp32), draft probabilities or draft logits (``draft_logits=``) fp32/bf16/fp16 (read as fp32),
temperature, top-p and min-p fp32, seeds/offsets/top-k int64, explicit uniforms float64 (fp32 accepted
and widened), tokens int64 out; the acceptance test and the final draw's masses and cumulative
sums compute in float64.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct
from typing import NamedTuple, Optional, Union

import torch

try:  # loads the C++ op namespace first, when built
    from . import _ext  # noqa: F401
except ImportError:  # pragma: no cover - _ext is part of the package
    pass
from . import reference as _ref
from ._host import host_readable, sort_descending_cpu
from .reference import (FLT_MIN, _drafts, _final_token, _outputs, _per_position, _philox_uniforms_host,
                        _row_parameters, _stop_position, philox_uniforms, verify_reference, warp_logits)

__all__ = ["VerifyOutput", "VerifyOutputWithLogprobs", "check_sampling_scalars", "fused_verify", "fused_verify_packed"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_BACKENDS = ("auto", "triton", "torch")
# The vocabulary tile. 4096 fp32 logits per tile keep 8 warps streaming; the tests lower it to
# cross tile boundaries on small vocabularies.
_MAX_BLOCK_V = 4096


# The per-row parameters' types: a Python scalar for every row, or a [B] tensor.
IntArg = Union[int, torch.Tensor]
FloatArg = Union[float, torch.Tensor]


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


# ----------------------------------------------------------------------------------------------
# Validation at the boundary: name the argument, the expected and the actual value
# ----------------------------------------------------------------------------------------------
def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_tensor(name: str, t, dtypes, shape: list[int], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if _shape(t) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of target_logits), got {t.device}")


# How far from 1 a draft distribution's sum may be (checked on the CPU): an fp32 softmax sums to
# 1 within ~1e-6, one rounded through bf16 within a few 1e-3; a q off by more was not normalised
# (logits, a truncated distribution without its renormalisation, ...).
DRAFT_PROBS_SUM_TOL = 1e-2


class _RowSeeds(NamedTuple):
    """seed=None: row b's seed is ``base + b``, base drawn on the host from torch's default
    generator (no device op; the Triton launch takes base as a scalar)."""

    base: int


def _fp32_value(value: float) -> float:
    """A Python float rounded to float32 (round to nearest even), as ``torch.full(..., float32)``
    stores it."""
    if math.isfinite(value) and abs(value) < 3.4e38:
        return struct.unpack("f", struct.pack("f", value))[0]
    return float(torch.tensor(value, dtype=torch.float64).float())  # near fp32's largest: torch's rounding


def _per_row_spec(name: str, value, B: int, dtype: torch.dtype, device: torch.device, kind: type):
    """A per-row parameter as given and checked: a Python scalar (a float already rounded to
    float32), or a [B] tensor of an accepted dtype on ``device`` (not converted: the kernel reads
    it as it is; ``_materialize`` makes the [B] tensor of ``dtype`` for the torch path)."""
    if isinstance(value, torch.Tensor):
        ok = (torch.float32, torch.float64, torch.bfloat16, torch.float16) if kind is float else _INDEX_DTYPES
        _check_tensor(name, value, ok, [B], device)
        if kind is float and B > 0 and value.dtype == torch.float64 and _check_values(value):
            _check_fp32_representable(name, value, value.to(dtype))
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        article = "an" if kind is int else "a"
        raise TypeError(f"{name} must be {article} {kind.__name__} or a [B] = [{B}] tensor, got {type(value).__name__}")
    if kind is float:
        out = _fp32_value(float(value))
        if math.isfinite(value) and not math.isfinite(out):
            info = torch.finfo(dtype)
            raise ValueError(f"{name} must fit in {str(dtype).replace('torch.', '')} ([{info.min:.6g}, {info.max:.6g}]), "
                             f"got {value!r}")
        if value != 0 and out == 0:
            raise ValueError(f"{name} must be representable in float32 (a value that rounds to 0 or to inf there is "
                             f"refused), got {value!r}")
        return out
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise ValueError(f"{name} must fit in {str(dtype).replace('torch.', '')} ([{info.min}, {info.max}]), got {value!r}")
    return int(value)


def _check_fp32_representable(name: str, src: torch.Tensor, out: torch.Tensor) -> None:
    # A value that fp32 rounds to 0 or to inf (a float64 1e-50 or 1e39) is refused as given,
    # before the range checks, which would otherwise see (and name) the rounded one.
    lost = ((src != 0) & (out == 0)) | (torch.isfinite(src) & ~torch.isfinite(out))
    if bool(lost.any()):
        raise ValueError(f"{name} must be representable in float32 (a value that rounds to 0 or to inf there is "
                         f"refused), got {_listed(src)}")


def _per_row(name: str, value, B: int, dtype: torch.dtype, device: torch.device, kind: type) -> torch.Tensor:
    """A python scalar or a [B] tensor as a [B] tensor of ``dtype`` on ``device``."""
    return _as_tensor(_per_row_spec(name, value, B, dtype, device, kind), B, dtype, device)


def _as_tensor(value, B: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A checked per-row parameter (``_per_row_spec``) as a contiguous [B] tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).contiguous()  # the old kernel reads row b at ptr + b
    if isinstance(value, _RowSeeds):
        return value.base + torch.arange(B, dtype=torch.int64, device=device)
    return torch.full((B,), value, dtype=dtype, device=device)


def _range_fails(value, bad) -> bool:
    """Whether a checked per-row parameter holds a value for which ``bad`` (a predicate on a
    tensor or on a Python scalar) is true: scalars always, tensors only where their values may
    be read (``_check_values``), floating ones as the fp32 values the kernel reads."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0 or not _check_values(value):
            return False
        return bool(bad(value.float() if value.is_floating_point() else value).any())
    return bool(bad(value))


def _listed(value):
    """A parameter's value(s) as given, for an error message."""
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _check_values(t: torch.Tensor) -> bool:
    """Whether a tensor's values may be read for validation: only where reading is free (CPU,
    not while tracing). On CUDA a bad value makes its row invalid in-kernel instead of a sync."""
    return host_readable(t)


class _Args(NamedTuple):
    target_logits: torch.Tensor  # [B, K+1, V]
    draft_tokens: torch.Tensor  # [B, K] int32/int64
    draft_probs: Optional[torch.Tensor]  # [B, K, Vd] fp32
    num_draft_tokens: torch.Tensor  # [B] int64
    temperature: torch.Tensor  # [B] fp32
    top_k: Optional[torch.Tensor]  # [B] int64
    top_p: Optional[torch.Tensor]  # [B] fp32
    seed: torch.Tensor  # [B] int64
    offset: torch.Tensor  # [B] int64
    uniforms: Optional[torch.Tensor]  # [B, K+1] float64
    min_p: Optional[torch.Tensor] = None  # [B] fp32 (last: the fields before it keep their places)


def _normalize(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
               top_p, seed, offset, uniforms, materialize: bool = True, target_is_probs: bool = False,
               draft_logits=None, min_p=None) -> _Args:
    """The arguments checked (errors name the argument, the expected and the actual value).
    With ``materialize`` every per-row parameter becomes a [B] tensor of the op's dtype; without,
    scalars stay Python scalars and tensors stay as given (the Triton launch reads both as they
    are: no device op per call).  ``draft_logits`` (exclusive with draft_probs) is checked as
    draft_probs is, under its own name, and returned in the draft_probs field (the caller's
    ``_Layout(draft_logits=True)`` says what it holds); no sum is checked."""
    draft_probs, logits_q = _draft_input(draft_probs, draft_logits)
    q_name = "draft_logits" if logits_q else "draft_probs"
    name = "target_probs" if target_is_probs else "target_logits"
    if not isinstance(target_logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(target_logits).__name__}")
    if target_logits.dim() != 3:
        raise ValueError(f"{name} must have 3 dims [B, K+1, V], got {target_logits.dim()}: {_shape(target_logits)}")
    if target_logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {str(target_logits.dtype).replace('torch.', '')}")
    B, K1, V = target_logits.shape
    K = K1 - 1
    if K1 < 1:
        raise ValueError(f"{name} must have K+1 >= 1 positions (dim 1: the K drafts and the bonus), got "
                         f"shape {_shape(target_logits)}")
    if V < 1:
        raise ValueError(f"{name} must have a vocabulary V >= 1, got shape {_shape(target_logits)}")
    dev = target_logits.device
    if not isinstance(draft_tokens, torch.Tensor):
        raise TypeError(f"draft_tokens must be a torch.Tensor, got {type(draft_tokens).__name__}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have 2 dims [B, K], got {draft_tokens.dim()}: {_shape(draft_tokens)}")
    _check_tensor("draft_tokens", draft_tokens, _INDEX_DTYPES, [B, K], dev)
    _check_draft_probs(draft_probs, [B, K], "[B, K, Vd]", V, dev, q_name)
    if num_draft_tokens is None:
        kb = K
    else:
        kb = _per_row_spec("num_draft_tokens", num_draft_tokens, B, torch.int64, dev, int)
        if B > 0 and _range_fails(kb, lambda v: (v < 0) | (v > K)):
            raise ValueError(f"num_draft_tokens must be in [0, K] = [0, {K}], got {_listed(kb)}")
    temp, top_k, top_p, seed, offset, min_p = _normalize_rows(B, K, dev, temperature, top_k, top_p, seed, offset,
                                                              uniforms, target_is_probs, min_p)
    if draft_probs is not None and not logits_q and K > 0 and B > 0 and _check_values(draft_probs) \
            and _range_fails(temp, lambda v: v != 0):
        # Read where the row reads q: sampled rows, j < K_b (a greedy row never reads q).
        kb_t = _as_tensor(kb, B, torch.int64, dev)
        sampled = _as_tensor(temp, B, torch.float32, dev) != 0
        read = (torch.arange(K, device=dev)[None, :] < kb_t[:, None]) & sampled[:, None]  # [B, K]
        _check_draft_sums(draft_probs.reshape(B * K, -1), read.reshape(-1), lambda n: f"[{n // K}, {n % K}]",
                          lambda n: f"draft {n % K}")
    a = _Args(target_logits, draft_tokens, draft_probs, kb, temp, top_k, top_p, seed, offset, uniforms, min_p)
    return _materialize(a) if materialize else a


def _check_draft_probs(draft_probs, lead: list, layout: str, V: int, dev: torch.device,
                       name: str = "draft_probs") -> None:
    """draft_probs (or, name "draft_logits", the draft's logits) None, or a tensor of shape
    lead + [Vd] (layout: the dims' names, for the message), 1 <= Vd <= V, fp32/bf16/fp16, on dev."""
    if draft_probs is None:
        return
    if not isinstance(draft_probs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(draft_probs).__name__}")
    if draft_probs.dim() != len(lead) + 1:
        raise ValueError(f"{name} must have {len(lead) + 1} dims {layout}, got {draft_probs.dim()}: "
                         f"{_shape(draft_probs)}")
    Vd = draft_probs.shape[-1]
    if not 1 <= Vd <= V:
        raise ValueError(f"{name} must have a vocabulary 1 <= Vd <= V = {V}, got Vd = {Vd}")
    _check_tensor(name, draft_probs, _LOGIT_DTYPES, lead + [Vd], dev)


def _draft_input(draft_probs, draft_logits):
    """(the draft tensor, whether it holds logits) of a call: draft_probs and draft_logits are
    exclusive (each may be None: a one-hot q)."""
    if draft_logits is None:
        return draft_probs, False
    if draft_probs is not None:
        raise ValueError("draft_probs and draft_logits are exclusive: pass the draft's probabilities or its logits, "
                         f"not both (got a {type(draft_probs).__name__} for draft_probs and a "
                         f"{type(draft_logits).__name__} for draft_logits)")
    return draft_logits, True


def _normalize_rows(B: int, K: int, dev: torch.device, temperature, top_k, top_p, seed, offset, uniforms,
                    target_is_probs: bool, min_p=None):
    """The per-row parameters checked (both layouts): (temperature, top_k, top_p, seed, offset,
    min_p) as ``_per_row_spec`` keeps them; uniforms [B, K+1] checked in place."""
    temp = _per_row_spec("temperature", temperature, B, torch.float32, dev, float)
    if B > 0 and _range_fails(temp, _not_finite_nonnegative):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {_listed(temperature)}")
    if B > 0 and _range_fails(temp, lambda v: (v > 0) & (v < FLT_MIN)):
        raise ValueError(f"temperature must be 0 (greedy) or >= {FLT_MIN:.8g} (the smallest normal fp32), "
                         f"got {_listed(temperature)}")
    if target_is_probs:
        # The probabilities are the caller's warped distribution: nothing is applied to them again.
        if B > 0 and _range_fails(temp, lambda v: (v != 0) & (v != 1)):
            raise ValueError(f"temperature must be 0 (greedy) or 1 (sample the probabilities as given) with "
                             f"target_is_probs=True, got {_listed(temperature)}")
        for pname, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if value is not None:
                raise ValueError(f"{pname} must be None with target_is_probs=True (the probabilities are used as "
                                 f"given: apply the warp before taking them), got {_listed(value)}")
    if top_k is not None:
        top_k = _per_row_spec("top_k", top_k, B, torch.int64, dev, int)
        if B > 0 and _range_fails(top_k, lambda v: v < 0):
            raise ValueError(f"top_k must be >= 0 (0 = off), got {_listed(top_k)}")
    if top_p is not None:
        top_p_in = top_p
        top_p = _per_row_spec("top_p", top_p, B, torch.float32, dev, float)
        if B > 0 and _range_fails(top_p, _outside_top_p_range):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {_listed(top_p_in)}")
    if min_p is not None:
        min_p_in = min_p
        min_p = _per_row_spec("min_p", min_p, B, torch.float32, dev, float)
        if B > 0 and _range_fails(min_p, _outside_min_p_range):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {_listed(min_p_in)}")
    if seed is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph a host draw would be frozen into every replay: draw on the device
            # (its generator advances per replay).
            seed = torch.randint(0, 2**62, (B,), dtype=torch.int64, device=dev)
        else:
            seed = _RowSeeds(int(torch.randint(0, 2**62, (1,), dtype=torch.int64)))  # host: no device sync
    else:
        seed = _per_row_spec("seed", seed, B, torch.int64, dev, int)
    offset = _per_row_spec("offset", offset, B, torch.int64, dev, int)
    if uniforms is not None:
        _check_tensor("uniforms", uniforms, (torch.float64, torch.float32), [B, K + 1], dev)
        if _check_values(uniforms) and uniforms.numel():
            out = ~((uniforms >= 0) & (uniforms < 1))
            if bool(out.any()):
                b, j = (int(i) for i in out.nonzero()[0])
                raise ValueError(f"uniforms must lie in [0, 1), got {uniforms[b, j].item()!r} at [{b}, {j}]")
    return temp, top_k, top_p, seed, offset, min_p


def _check_draft_sums(q: torch.Tensor, read: torch.Tensor, where, what) -> None:
    """Each q [N, Vd] row that is read (read [N] bool) must sum to 1: the distribution its draft was
    sampled from (a q that does not sum to 1 biases the output; NaN/inf/negative q make their row
    invalid instead, as on CUDA, where nothing here is read).  where(n) / what(n): row n's index
    and name in the caller's layout, for the message."""
    sums = q.sum(-1).float()  # [N]
    off = read & torch.isfinite(sums) & ((sums - 1).abs() > DRAFT_PROBS_SUM_TOL)
    if bool(off.any()):  # a negative entry makes its row invalid instead (the documented rule)
        off &= q.amin(-1) >= 0
    if bool(off.any()):
        n = int(off.nonzero()[0, 0])
        raise ValueError(f"draft_probs{where(n)} must sum to 1 (to within {DRAFT_PROBS_SUM_TOL:g}: the "
                         f"distribution {what(n)} was sampled from), got {sums[n].item():.6g}")


def _not_finite_nonnegative(v):
    if isinstance(v, torch.Tensor):
        return ~(torch.isfinite(v) & (v >= 0))
    return not (math.isfinite(v) and v >= 0)


def _outside_top_p_range(v):
    if isinstance(v, torch.Tensor):
        return ~((v > 0) & (v <= 1))
    return not 0 < v <= 1  # NaN included


def _outside_min_p_range(v):
    if isinstance(v, torch.Tensor):
        return ~((v >= 0) & (v <= 1))
    return not 0 <= v <= 1  # NaN included


def _materialize(a: _Args) -> _Args:
    """Checked arguments (scalars kept as given) as the [B] tensors of the op's dtypes that the
    torch path, the old kernel and the registered op take: num_draft_tokens, seed and offset
    int64, temperature, top-p and min-p fp32, top-k int64, uniforms float64."""
    B = a.target_logits.shape[0]
    dev = a.target_logits.device
    def t(v, dtype):
        return None if v is None else _as_tensor(v, B, dtype, dev)
    u = a.uniforms.to(torch.float64) if a.uniforms is not None else None  # the tests and the draw compute in float64
    return _Args(a.target_logits, a.draft_tokens, a.draft_probs, t(a.num_draft_tokens, torch.int64),
                 t(a.temperature, torch.float32), t(a.top_k, torch.int64), t(a.top_p, torch.float32),
                 t(a.seed, torch.int64), t(a.offset, torch.int64), u, t(a.min_p, torch.float32))


# ----------------------------------------------------------------------------------------------
# The launcher and the torch path
# ----------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _interpreter_problem(triton_version: Optional[str] = None, numpy_version: Optional[str] = None) -> Optional[str]:
    """Why Triton's interpreter cannot run the kernel here, or None.

    Triton 3.6's interpreter turns one-element arrays into Python ints with ``int()``, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars", at the
    kernel's first loop over the vocabulary); Triton 3.7 squeezes them first. Seen 2026-12-01
    with triton 3.6.0 and numpy 2.4.6 (the GPU image's Triton; the compiled kernel is unaffected)."""
    if triton_version is None or numpy_version is None:
        import numpy
        import triton

        triton_version, numpy_version = triton_version or triton.__version__, numpy_version or numpy.__version__
    from packaging.version import Version

    if Version(triton_version).release[:2] < (3, 7) and Version(numpy_version).release[:2] >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run with NumPy {numpy_version}: "
                f"install 'triton>=3.7' or 'numpy<2.4'")
    return None


# Private: the one-program-per-row kernel, reachable for side-by-side measurements on a GPU.
_PRIVATE_BACKENDS = ("_triton_rows",)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS + _PRIVATE_BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend in ("triton", "_triton_rows") and device.type != "cuda":
        if not _interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got tensors on {device}")
        problem = _interpreter_problem()
        if problem is not None:
            raise RuntimeError(f"backend='triton' on CPU tensors: {problem}")
    return backend


# The split kernel's chunk: a fixed number of tokens per work item (never a function of B: a
# row's arithmetic is the same in any batch); 4096 fp32 logits a chunk keep 8 warps' loads in
# flight at once. The tests lower it to cross chunk boundaries on small vocabularies.
_CHUNK_V = 4096
# Candidate keys kept per chunk for top-k/top-p (see _verify_split_kernel's header): top-k up to
# _TOP_K_CAP - 1 (and most top-p sets) is decided from them in one read of the logits.
_TOP_K_CAP = 64
# Programs per multiprocessor of the split kernel's persistent grid (a tuning value: any grid is
# correct, the items are claimed in order). ptxas gives the kernel 214-255 registers at 8 warps
# for sm_90 (scripts/gpu_compile_check.py), so one program fits a multiprocessor at a time.
_PROGRAMS_PER_SM = 1
# A register cap for the split kernel on CUDA (None: ptxas's choice). 128 fits two programs a
# multiprocessor at 8 warps, at 92-528 bytes of spills (sm_90, Triton 3.9): one of the settings
# a GPU run compares, with _PROGRAMS_PER_SM = 2, for the loads in flight at large B.
_MAXNREG: Optional[int] = None
# Chunks per work item of the split kernel, streamed with software pipelining (STAGES deep): more
# bytes in flight per program at large B, fewer items at small B. 1 until a GPU run has compared.
_TILES_PER_ITEM = 1
_STAGES = 2


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class _Workspace:
    """The split kernel's scratch on one device and stream: arrival counters (zero between
    launches: every launch resets what it used) and partial records, grown as needed, never
    shrunk or freed.  Under CUDA-graph capture the capture stream's workspace is used when it
    exists and fits (warm up on the capture stream to get it: the graph then has no memset, and
    its replays must not overlap other calls that use that stream's workspace); otherwise the
    captured call makes a temporary one, zeroed inside the graph (one memset node per replay)."""

    def __init__(self):
        self.counters = self.part_f = self.part_i = self.cand = self.mass = None
        self.retired: list = []

    @staticmethod
    def _fits(t: Optional[torch.Tensor], n: int) -> bool:
        return t is not None and t.numel() >= n

    @staticmethod
    def sizes(B: int, K1: int, NC: int, cap: int, draft_logits: bool = False, block: bool = False) -> dict:
        """Elements of each tensor a launch uses; ``draft_logits``: the draft's per-chunk max, sum
        and NaN/+inf count and its per-position (m_d, S_d, bad_d), after the other fields;
        ``block``: the float64 chunk masses and q counts of every position, and the rule's p_i."""
        N1 = B * K1 * NC
        d = 1 if draft_logits else 0
        return dict(counters=2 + B * K1 + 3 * B, part_f=(2 * N1 + 2 * B * K1) * (1 + d),
                    part_i=4 * N1 + 4 * B * K1 + 4 * B + B * NC + d * (N1 + B * K1), cand=max(1, N1 * cap),
                    mass=2 * N1 + B * K1 if block else B * NC)

    def fits(self, sizes: dict) -> bool:
        return all(self._fits(getattr(self, k), n) for k, n in sizes.items())

    def ensure(self, dev: torch.device, sizes: dict) -> None:
        """Grow what is too small (counters zeroed: a device op, once per growth, not per call).
        A replaced tensor is kept alive (``retired``): a CUDA graph captured with it replays into
        it (doubling keeps all of them under twice the largest)."""
        for k, n in sizes.items():
            old = getattr(self, k)
            if self._fits(old, n):
                continue
            if old is not None:
                self.retired.append(old)
            n = max(n, 2 * old.numel() if old is not None else 0)
            if k == "counters":
                t = torch.zeros(n, dtype=torch.int32, device=dev)
            else:
                t = torch.empty(n, dtype={"part_f": torch.float32, "mass": torch.float64}.get(k, torch.int32),
                                device=dev)
            setattr(self, k, t)

    def records(self, B: int, K1: int, NC: int, draft_logits: bool = False) -> dict:
        """The last launch's per-position records as [B, K+1] views (tests and diagnostics):
        m (max), S (kept mass), argmax, bad, thr (the smallest kept order key), scanned (1 where
        top-k/top-p fell back to bisecting the whole position), in the kernel's layout; with
        ``draft_logits`` (a launch with draft logits) also m_d, S_d, bad_d (the draft's max, sum
        and unusable flag, written at the positions i < K_b of sampled rows)."""
        N1, P = B * K1 * NC, B * K1
        f, i = self.part_f, self.part_i
        c = 4 * N1  # the position records follow the four per-chunk arrays
        rows = c + 3 * P + 4 * B + B * NC  # where `scanned` starts
        out = dict(m=f[2 * N1:2 * N1 + P].view(B, K1), S=f[2 * N1 + P:2 * N1 + 2 * P].view(B, K1),
                   argmax=i[c:c + P].view(B, K1), bad=i[c + P:c + 2 * P].view(B, K1),
                   thr=i[c + 2 * P:c + 3 * P].view(B, K1), scanned=i[rows:rows + P].view(B, K1))
        if draft_logits:
            fd = 2 * N1 + 2 * P + 2 * N1  # after the target's fields and the draft's two per-chunk arrays
            idd = rows + P + N1  # after `scanned` and the draft's per-chunk counts
            out.update(m_d=f[fd:fd + P].view(B, K1), S_d=f[fd + P:fd + 2 * P].view(B, K1),
                       bad_d=i[idd:idd + P].view(B, K1))
        return out


_WORKSPACES: dict = {}


def _workspace(dev: torch.device) -> _Workspace:
    stream = torch.cuda.current_stream(dev).stream_id if dev.type == "cuda" else 0
    key = (dev.type, dev.index, stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _Workspace()
    return ws


def _split_meta(V: int, K1: int, has_draft_probs: bool, has_top_k: bool, has_top_p: bool, has_uniforms: bool,
                has_order: bool = False, packed: bool = False, probs: bool = False, logprobs: bool = False,
                draft_logits: bool = False, has_min_p: bool = False, block: bool = False) -> dict:
    """The split kernel's compile-time parameters for V tokens and K + 1 = K1 positions: its
    constexprs, num_warps and enable_fp_fusion (pinned off, as ``_kernel_meta`` says).  The launch
    and the ahead-of-time compile check (``scripts/gpu_compile_check.py``) both take them here.
    ``draft_logits``: the draft tensor holds logits (DRAFT_LOGITS; with has_draft_probs);
    ``has_min_p``: a min_p argument was given (HAS_MIN_P); ``block``: block verification (BLOCK)."""
    import triton

    chunk = max(16, min(triton.next_power_of_2(V), _CHUNK_V))
    nc = triton.cdiv(V, chunk)
    return dict(HAS_DRAFT_PROBS=has_draft_probs, HAS_TOP_K=has_top_k, HAS_TOP_P=has_top_p, HAS_MIN_P=has_min_p,
                HAS_UNIFORMS=has_uniforms, HAS_ORDER=has_order, PACKED=packed, PROBS=probs, LOGPROBS=logprobs,
                DRAFT_LOGITS=bool(draft_logits and has_draft_probs), BLOCK=bool(block), CHUNK=chunk, TILES=_TILES_PER_ITEM,
                STAGES=_STAGES, NCB=triton.next_power_of_2(nc),
                CAP=_TOP_K_CAP, BLOCK_K=triton.next_power_of_2(K1),
                num_warps=8 if chunk >= 2048 else 4, enable_fp_fusion=False)


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
    and the verification method (``block``: ``method="block"``)."""

    B: int
    K: int
    cu: Optional[torch.Tensor] = None
    probs: bool = False
    logprobs: bool = False
    out: Optional[tuple] = None
    draft_logits: bool = False
    block: bool = False  # method="block": block verification


def _padded_layout(a: _Args) -> _Layout:
    B, K1, _ = a.target_logits.shape
    return _Layout(B, K1 - 1)


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
        dtypes = (torch.float32,) if name == "logprobs" else _INDEX_DTYPES
        _check_tensor(f"out.{name}", t, dtypes, shape, dev)
    return tuple(out)


def _kernel_inputs(a: _Args, lay: _Layout):
    """(logits, draft_probs, tokens, num_accepted, logprobs) for either Triton kernel: the two
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
    """The split kernel (``_verify_split_kernel.py``): one launch, and on the device no op but the
    outputs' allocation (scalars go by value, tensors are read as they are; none with ``out=``).
    Returns (tokens, num_accepted, logprobs or None).
    ``order`` (tests only): int32 [N] permutation of the work items, stage-1 items among themselves
    and stage-2 items among themselves, to prove that arrival order does not change the result.
    ``local_workspace``: a workspace of this call only (the registered op's path: torch.compile's
    CUDA graphs allocate from pools whose memory they recycle, where a cached one could end up)."""
    from ._verify_split_kernel import _verify_split_kernel  # lazily: the torch path needs no Triton

    logits, q, tokens, num_accepted, logprobs = _kernel_inputs(a, lay)
    B, K = lay.B, lay.K
    K1, V = K + 1, logits.shape[-1]
    packed = lay.cu is not None
    dev = logits.device
    if B == 0:
        return tokens, num_accepted, logprobs
    x, u = a.draft_tokens, a.uniforms
    warp = a.top_k is not None or a.top_p is not None or a.min_p is not None
    meta = _split_meta(V, K1, q is not None, a.top_k is not None, a.top_p is not None, u is not None, order is not None,
                       packed=packed, probs=lay.probs, logprobs=lay.logprobs, draft_logits=lay.draft_logits,
                       has_min_p=a.min_p is not None, block=lay.block)
    nc = -(-V // meta["CHUNK"])
    sizes = _Workspace.sizes(B, K1, nc, _TOP_K_CAP if warp else 0, meta["DRAFT_LOGITS"], lay.block)
    ws = _workspace(dev)
    if local_workspace or (not ws.fits(sizes) and dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        ws = _Workspace()  # this call's own (under capture: of the graph's pool, zeroed by a captured memset)
    ws.ensure(dev, sizes)
    ni = -(-nc // meta["TILES"])  # work items per position
    n1 = B * K1 * ni
    n_items = n1 + B * ni * (K1 if lay.block else 1)  # stage 2: per row (block: per row and position)
    grid = 1 if dev.type != "cuda" else min(n_items, _sm_count(dev.index) * _PROGRAMS_PER_SM)
    if n_items + grid >= 2**31:  # the kernel's int32 ticket
        raise ValueError(f"fused_verify: {n_items} work items (B = {B}, K + 1 = {K1}, {ni} a position) must stay "
                         f"below 2^31 - {grid}")
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
    flags, nd_p, nd_s, nd_v = _param_args(nd, 1, dummy, flags)
    flags, t_p, t_s, t_v = _param_args(a.temperature, 2, dummy, flags)
    flags, k_p, k_s, k_v = _param_args(a.top_k, 4, dummy, flags)
    flags, p_p, p_s, p_v = _param_args(1.0 if a.top_p is None else a.top_p, 8, dummy, flags)
    flags, mp_p, mp_s, mp_v = _param_args(0.0 if a.min_p is None else a.min_p, 64, dummy, flags)
    seed, seed_step = (a.seed.base, 1) if isinstance(a.seed, _RowSeeds) else (a.seed, 0)
    flags, s_p, s_s, s_v = _param_args(seed, 16, dummy, flags)
    flags, o_p, o_s, o_v = _param_args(a.offset, 32, dummy, flags)
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
    lp = logprobs if logprobs is not None else dummy
    lp_strides = (logprobs.stride(0), logprobs.stride(1)) if logprobs is not None else (0, 0)
    # Triton launches on the current device's current stream: make it the tensors'. Nothing to
    # do for the interpreter.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        try:
            _verify_split_kernel[(grid,)](
                logits, *l_strides, x, *x_strides, q if q is not None else dummy, *q_strides, cu, cu_stride,
                u if u is not None else dummy, u.stride(0) if u is not None else 0, u.stride(1) if u is not None else 0,
                flags, nd_p, nd_s, nd_v, t_p, t_s, float(t_v), k_p, k_s, k_v, p_p, p_s, float(p_v),
                mp_p, mp_s, float(mp_v), s_p, s_s, s_v, o_p, o_s, o_v, seed_step,
                tokens, tokens.stride(0), tokens.stride(1), num_accepted, num_accepted.stride(0), lp, *lp_strides,
                ws.counters, ws.part_f, ws.part_i, ws.cand, ws.mass, order if order is not None else dummy,
                B, K, V, q.shape[-1] if q is not None else V, nc, grid,
                **meta, **({"maxnreg": _MAXNREG} if _MAXNREG is not None and dev.type == "cuda" else {}),
            )
        except BaseException:
            # An interpreted launch that did not finish (an error, an interrupt) may leave counters
            # set: drop the workspaces so that the next call starts from zeros. On CUDA an error
            # comes before the kernel is enqueued, and a captured graph may hold the workspace.
            if dev.type != "cuda":
                _WORKSPACES.clear()
            raise
    return tokens, num_accepted, logprobs


def _launch_rows(a: _Args) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-program-per-row kernel (``_verify_kernel.py``, private backend ``"_triton_rows"``),
    kept until a GPU run has measured it beside the split kernel. Takes materialized arguments."""
    from ._verify_kernel import _verify_kernel  # imported lazily: the torch path needs no Triton

    logits, q, tokens, num_accepted, _ = _kernel_inputs(a, _padded_layout(a))
    if q is not None:
        q = q.float()  # this kernel reads fp32 q
    B, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    if B == 0:
        return tokens, num_accepted
    uniforms = a.uniforms.contiguous() if a.uniforms is not None else None  # float64 (_normalize)
    x = a.draft_tokens if a.draft_tokens.stride(-1) == 1 else a.draft_tokens.contiguous()  # read at + j
    dummy = num_accepted  # stands in for absent optional pointers; never dereferenced
    # Triton launches on the current device's current stream: make it the tensors' (cuda:1 while
    # cuda:0 is current ran in the wrong context before). Nothing to do for the interpreter.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _verify_kernel[(B,)](
            logits, logits.stride(0), logits.stride(1),
            x, x.stride(0),
            q if q is not None else dummy, q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            a.num_draft_tokens, a.temperature,
            a.top_k if a.top_k is not None else dummy,
            a.top_p if a.top_p is not None else dummy,
            a.seed, a.offset,
            uniforms if uniforms is not None else dummy,
            tokens, num_accepted,
            K, V, q.shape[-1] if q is not None else V,
            **_kernel_meta(V, K1, q is not None, a.top_k is not None, a.top_p is not None, uniforms is not None),
        )
    return tokens, num_accepted


def _kernel_meta(V: int, K1: int, has_draft_probs: bool, has_top_k: bool, has_top_p: bool,
                 has_uniforms: bool) -> dict:
    """The verify kernel's compile-time parameters for a launch over V tokens and K + 1 = K1
    positions: its constexprs, num_warps and enable_fp_fusion.  The launch and the
    ahead-of-time compile check (``scripts/gpu_compile_check.py``) both take them from here.

    enable_fp_fusion is pinned off: a multiply and an add stay two roundings, as in the
    interpreter and the torch reference (the online softmax's ``acc * exp(m - m') + exp(s - m')``
    would otherwise become one FMA), and the bits do not change with Triton's default (on in
    3.6-3.9, off from 3.10)."""
    import triton  # imported lazily, as above

    block_v = max(16, min(triton.next_power_of_2(V), _MAX_BLOCK_V))
    return dict(HAS_DRAFT_PROBS=has_draft_probs, HAS_TOP_K=has_top_k, HAS_TOP_P=has_top_p,
                HAS_UNIFORMS=has_uniforms, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(K1),
                num_warps=8 if block_v >= 2048 else 4, enable_fp_fusion=False)


def _all_greedy(a: _Args) -> bool:
    """Whether the CPU torch path may take the greedy route: every row has temperature 0 (the
    reference's definition of a greedy row: ``temperature.float() == 0``, so -0.0 counts).
    CPU only: on CUDA the test would be a host sync."""
    t = a.temperature
    return host_readable(t) and t.numel() > 0 and bool((t == 0).all())


# The chunk of _max_and_first_argmax: small enough that argmax over one chunk per row is cheap.
_ARGMAX_CHUNK = 256


def _max_and_first_argmax(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s.amax(-1), s.argmax(-1)) of s [N, V], the argmax exact wherever the maximum is a
    number (rows holding a NaN get some index).  torch's argmax is a scalar loop on CPU, about
    ten times slower than its vectorised amax; so: the maximum of each chunk of _ARGMAX_CHUNK
    tokens (vectorised), the first chunk whose maximum is the row's, and argmax within that
    chunk only.  The first index of the maximum overall lies in the first chunk holding it, so
    this is the first index of the maximum, as argmax (and -0.0 == +0.0 in both)."""
    N, V = s.shape
    if s.stride(-1) != 1:
        s = s.contiguous()
    C = _ARGMAX_CHUNK
    nc = V // C
    Vm = nc * C
    chunks = s[:, :Vm].view(N, nc, C) if nc else None  # a view: the rows' last dim is dense
    tail = s[:, Vm:] if Vm < V else None
    parts = ([chunks.amax(-1)] if nc else []) + ([tail.amax(-1, keepdim=True)] if tail is not None else [])
    gmax = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # [N, chunks (+ tail)]
    m = gmax.amax(-1)  # [N]
    g = (gmax == m[:, None]).int().argmax(-1)  # the first chunk holding the maximum
    idx = None
    if nc:
        gc = g.clamp(max=nc - 1)
        rows = chunks.gather(1, gc[:, None, None].expand(N, 1, C))[:, 0]  # [N, C]
        idx = gc * C + rows.argmax(-1)
    if tail is not None:
        in_tail = Vm + tail.argmax(-1)
        idx = in_tail if idx is None else torch.where(g == nc, in_tail, idx)
    return m, idx


def _verify_greedy(a: _Args) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` when every row is greedy, without the work greedy rows discard.

    At temperature 0 the reference uses, per position, only s = logits.float() (scaled by
    1 / T = 1, an exact no-op), its argmax (first index of the maximum) and whether the
    position is usable; p, q, top-k/top-p, the uniforms and the final draw only reach rows that
    sample.  top-k/top-p still matter through their range checks (``bad_param``), which are
    repeated here.  Usable positions: no NaN, no +inf, not all -inf, i.e. a finite maximum
    (``amax`` propagates NaN; it is +inf if any +inf, -inf only if all are -inf).  The rest is
    the reference's own code for the stop position j and the outputs, so it is bit-identical
    to it (tests: test_verify_greedy_fast_path.py).
    """
    logits = a.target_logits
    B, K1, V = logits.shape
    K = K1 - 1
    kb = a.num_draft_tokens.to(torch.int64)
    # Maxima and their first indices in the logits' own dtype: a bf16/fp16 -> fp32 conversion
    # is exact and monotone, so both are those of the reference's s = logits.float().
    m, argmax = _max_and_first_argmax(logits.reshape(B * K1, V))
    if B * K1 <= _HOST_GREEDY_MAX and host_readable(logits):
        # (CPU only: reading device tensors on the host would be a sync per call)
        return _greedy_host(a, m, argmax, B, K, V)
    _, bad_param, _ = _row_parameters(kb, a.temperature, a.top_k, a.top_p, K, a.min_p)
    argmax = argmax.view(B, K1)  # [B, K+1]: first index of the maximum, as the reference
    bad_pos = ~torch.isfinite(m).view(B, K1)  # [B, K+1]

    x = a.draft_tokens.to(torch.int64)  # [B, K]
    bad_x = (x < 0) | (x >= V)  # a greedy row checks only the draft id, never q
    accept = x == argmax[:, :K]
    j, _, bad_row = _stop_position(accept, bad_x, bad_pos, bad_param, kb)
    final = argmax.gather(1, j[:, None])[:, 0]
    return _outputs(x, j, final, bad_row)


# Up to this many verified positions (B * (K+1)) the greedy route finishes on the host, in
# Python ints, after the maxima, instead of the reference's some forty small tensor ops for the
# stop position and outputs (Zen 5 VM, 1 thread, B = 1, K = 2, V = 49,152: the whole call 168 ->
# 79 us hot; inside the decoder's loop, where it runs cold, 0.63 -> 0.51 ms).
_HOST_GREEDY_MAX = 64


def _greedy_host(a: _Args, m: torch.Tensor, argmax: torch.Tensor, B: int, K: int, V: int):
    """The rest of ``_verify_greedy`` for a small CPU batch, row by row in Python: the same
    decisions as ``_row_parameters`` (its checks that can fail here: every temperature is 0 on
    this route, ``_all_greedy``), ``_stop_position`` and ``_outputs``, so the same outputs (the
    tests compare both with the reference)."""
    K1 = K + 1
    kb = a.num_draft_tokens.tolist()
    x = a.draft_tokens.tolist()
    am = argmax.view(B, K1).tolist()
    fin = torch.isfinite(m).view(B, K1).tolist()  # usable position: a finite maximum
    top_k = a.top_k.tolist() if a.top_k is not None else None
    top_p = a.top_p.tolist() if a.top_p is not None else None
    min_p = a.min_p.tolist() if a.min_p is not None else None
    tokens = [[-1] * K1 for _ in range(B)]
    num = [-1] * B
    for b in range(B):
        k_b = kb[b]
        bad_param = k_b < 0 or k_b > K
        if top_k is not None:
            bad_param |= top_k[b] < 0
        if top_p is not None:
            bad_param |= not (top_p[b] > 0) or top_p[b] > 1
        if min_p is not None:
            bad_param |= not (min_p[b] >= 0) or min_p[b] > 1
        xb, ab, fb = x[b], am[b], fin[b]
        bad_x = [not 0 <= v < V for v in xb]
        j = 0
        while j < K and j < k_b and xb[j] == ab[j] and fb[j] and not bad_x[j]:
            j += 1
        rejected = j < k_b
        bad_row = bad_param or not fb[j] or (rejected and K > 0 and bad_x[min(j, K - 1)])
        if bad_row:
            continue
        tokens[b][:j] = xb[:j]
        tokens[b][j] = ab[j]
        num[b] = j
    dev = a.target_logits.device
    return (torch.tensor(tokens, dtype=torch.int64, device=dev).view(B, K1),
            torch.tensor(num, dtype=torch.int64, device=dev))


def _verify_untruncated(a: _Args, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` when no row has top-k or top-p (``_verify_sampled``)."""
    return _verify_sampled(a, u, warped=False)


def _verify_warped(a: _Args, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` with top-k / top-p / min-p rows (``_verify_sampled``)."""
    return _verify_sampled(a, u, warped=True)


def _verify_sampled(a: _Args, u: torch.Tensor, warped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` when not every row is greedy, with fewer passes over the [B, K+1, V]
    logits; bit-identical to it (tests: test_verify_sampling_fast_path.py).

    Without a warp the keep mask is all true, so the reference's masked max, masked exp and
    ``where`` are plain ``amax`` and ``exp``; its three scans for unusable positions (a NaN, a +inf,
    all -inf) are one test of the maximum (``amax`` propagates NaN; it is +inf if any +inf, -inf
    only if all are -inf); its argmax comes with the maximum (``_max_and_first_argmax``); and
    p = e / sum(e) is divided out only where it is read: at the drafts (p(x_i)) and at the stop
    position (p_j), which are the same quotients e / sum(e) the reference gathers.  The sums are
    the same reductions over the same [B, K+1, V] tensor.  The rest (stop position, residual,
    final draw, outputs) is the reference's own code.

    With a warp (``warped``), the keep mask is the reference's own ``warp_logits`` (through
    NumPy's sort), and e is zeroed outside it, as the reference's ``where``.  The maximum stays
    the unmasked one: top-k keeps every token >= the k-th largest, top-p at least the most
    likely ones and min-p every token >= fl32(m + ln(min_p)) <= m, so at a usable position (no
    NaN or +inf, not all -inf) the maximum is kept and the masked maximum is the same number; at
    an unusable position the row is invalid as soon as the position is reached, and its values
    are never read.  The reference's scans for unusable positions are over the unmasked s too.
    """
    logits = a.target_logits
    B, K1, V = logits.shape
    K = K1 - 1
    kb = a.num_draft_tokens.to(torch.int64)
    greedy, bad_param, inv_t = _row_parameters(kb, a.temperature, a.top_k, a.top_p, K, a.min_p)
    keep = None
    if warped:
        s, keep = warp_logits(logits, inv_t[:, None].expand(B, K1), _per_position(a.top_k, K1),
                              _per_position(a.top_p, K1), sort_descending_cpu,
                              min_p=_per_position(a.min_p, K1))  # s fresh, keep [B, K+1, V] bool
    else:
        s = logits.float() * inv_t[:, None].expand(B, K1)[..., None]  # [B, K+1, V], as warp_logits
    m, argmax = _max_and_first_argmax(s.reshape(B * K1, V))  # a copy only for permuted logits
    m = m.view(B, K1, 1)
    argmax = argmax.view(B, K1)
    bad_pos = ~torch.isfinite(m[..., 0])  # [B, K+1]
    # In place: s is a fresh tensor read no more.  Each [B, K+1, V] temporary not allocated is
    # one fewer fresh block from malloc, whose page faults can cost more than the arithmetic
    # (B = 4, V = 32,000: 4.2 ms a call with the temporaries, against 2.0 with malloc told to
    # keep its memory).
    e = s.sub_(m).exp_()  # [B, K+1, V]
    if keep is not None:
        e.masked_fill_(~keep, 0.0)  # the reference's where(keep, exp(s - m), 0)
    total = e.sum(-1, keepdim=True)  # [B, K+1, 1]

    x, x_safe, q_x, bad_x = _drafts(a.draft_tokens, a.draft_probs, greedy, V)
    p_x = e[:, :K].gather(-1, x_safe[..., None])[..., 0] / total[:, :K, 0]  # [B, K]
    # The acceptance rule through the reference module, so that a mutant of it (the tests'
    # monkeypatched reference._accept) reaches this route too.
    accept = torch.where(greedy[:, None], x == argmax[:, :K], _ref._accept(u[:, :K], p_x, q_x))  # [B, K]
    j, rejected, bad_row = _stop_position(accept, bad_x, bad_pos, bad_param, kb)
    p_j = e.gather(1, j[:, None, None].expand(B, 1, V))[:, 0].div_(total.gather(1, j[:, None, None])[:, 0])  # [B, V]
    final, bad_row = _final_token_rows(p_j, x_safe, a.draft_probs, j, rejected, bad_row, greedy, argmax, u[:, K])
    return _outputs(x, j, final, bad_row)


# The untruncated route makes its final draw row by row (below) for up to this many rows, or for
# any number of rows over a vocabulary of at least _ROW_DRAW_MIN_V tokens, rather than through the
# reference's batched passes.  Measured on the Zen 5 VM, 1 thread, K = 2 (fused_verify, batched
# against row by row): B = 16 / 64 at V = 32,000: 22.0 / 85.8 ms against 7.7 / 44.7; B = 16 at V =
# 128,256: 69.2 against 18.9; but B = 64 at V = 1,000: 2.25 against 2.97, B = 256 at V = 100: 1.71
# against 6.91 (the per-row Python costs more than a small vocabulary's passes).
_ROW_DRAW_MAX = 8
_ROW_DRAW_MIN_V = 4096


def _final_token_rows(p_j, x_safe, draft_probs, j, rejected, bad_row, greedy, argmax, u_final):
    """``reference._final_token`` (same arguments, the same tokens and bad_row) on the CPU, one row
    at a time (few rows, or a large vocabulary), so that a row pays only for what it uses: a greedy row nothing, a
    bonus row one cumulative sum, a rejected row its residual and one cumulative sum, where the
    batched reference makes about fifteen passes over [B, V] for every row (0.5-0.7 ms at V =
    49,152, B = 1).  The inverse CDF is the reference's: the first v with cumsum(w)[v] > u *
    sum(w), found by binary search in the float64 cumsum (a sequential sum of non-negative
    weights, so non-decreasing, and flat exactly where w[v] = 0: the first index past the target
    has w > 0, as the reference requires); the last positive weight if none."""
    B, V = p_j.shape
    if (B > _ROW_DRAW_MAX and V < _ROW_DRAW_MIN_V) or not host_readable(p_j):  # it reads values on the host
        return _final_token(p_j, x_safe, draft_probs, j, rejected, bad_row, greedy, argmax, u_final)
    K = x_safe.shape[1]
    j_h, rej, gr, u = j.tolist(), rejected.tolist(), greedy.tolist(), u_final.tolist()
    final = argmax.gather(1, j[:, None])[:, 0].tolist()  # greedy rows keep it
    bad = bad_row.tolist()
    for b in range(B):
        if gr[b]:
            continue
        p = p_j[b]  # [V] fp32
        w = None
        if rej[b]:  # K > 0 here: j < K_b <= K
            jq = min(j_h[b], K - 1)
            if draft_probs is None:  # q one-hot at the rejected draft
                r = p.clamp(min=0.0)  # p - 0 elsewhere, as the reference's p - q_j
                x = int(x_safe[b, jq])
                r[x] = (p[x] - 1.0).clamp(min=0.0)
            else:
                q = draft_probs[b, jq].float()  # [Vd]
                Vd = q.shape[0]
                if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
                    bad[b] = True
                r = p.clamp(min=0.0)
                torch.sub(p[:Vd], q, out=r[:Vd]).clamp_(min=0.0)  # (p - q).clamp(min=0), no temporaries
            w = r.nan_to_num_(nan=0.0)
            cdf = torch.cumsum(w, 0, dtype=torch.float64)  # = cumsum(w.double()), bit for bit
            if not cdf[-1] > 0:  # the residual sums to zero: p itself
                w = None
        if w is None:
            w = torch.nan_to_num(p, nan=0.0)
            cdf = torch.cumsum(w, 0, dtype=torch.float64)
            if not cdf[-1] > 0:  # only invalid rows: a dummy draw, discarded by _outputs
                w = torch.ones_like(p)
                cdf = torch.cumsum(w, 0, dtype=torch.float64)
        target = u[b] * float(cdf[-1])
        idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
        if idx >= V:
            pos = (w > 0).nonzero()
            idx = int(pos[-1, 0]) if len(pos) else -1
        final[b] = idx
    dev = p_j.device
    return torch.tensor(final, dtype=torch.int64, device=dev), torch.tensor(bad, dtype=torch.bool, device=dev)


# Up to this many Philox evaluations (B * (K+1)) the CPU path draws them in Python ints
# (``reference._philox_uniforms_host``, about 4 us each) rather than with ~360 elementwise tensor ops
# (about 0.5 ms whatever the batch); the two give the same values.
_HOST_PHILOX_MAX = 128


def _uniforms(a: _Args, K: int) -> torch.Tensor:
    if a.uniforms is not None:
        return a.uniforms
    if (host_readable(a.seed)
            and a.seed.shape[0] * (K + 1) <= _HOST_PHILOX_MAX):
        return _philox_uniforms_host(a.seed.tolist(), a.offset.tolist(), K)  # CPU: no device sync
    return philox_uniforms(a.seed, a.offset, K)


def _run_torch(a: _Args) -> tuple[torch.Tensor, torch.Tensor]:
    if _all_greedy(a):
        return _verify_greedy(a)
    K = a.target_logits.shape[1] - 1
    u = _uniforms(a, K)
    if a.target_logits.shape[0] == 0:
        return verify_reference(a.target_logits, a.draft_tokens, a.draft_probs, a.num_draft_tokens,
                                a.temperature, a.top_k, a.top_p, u, min_p=a.min_p)
    if a.top_k is None and a.top_p is None and a.min_p is None:
        return _verify_untruncated(a, u)
    return _verify_warped(a, u)


def _verify_impl(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
                 top_p, seed, offset, uniforms, min_p, backend: str,
                 local_workspace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    a = _Args(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p,
              seed, offset, uniforms, min_p)
    resolved = _resolve_backend(backend, target_logits.device)
    if resolved == "triton":
        return _launch_triton(a, local_workspace=local_workspace)
    if resolved == "_triton_rows" and min_p is not None:
        raise NotImplementedError("backend '_triton_rows' does not take min_p (the one-program-per-row kernel "
                                  "warps with top-k/top-p only): use backend 'triton' or 'torch'")
    a = _materialize(a)
    if resolved == "_triton_rows":
        return _launch_rows(a)
    with torch.no_grad():  # integer outputs; its in-place and out= temporaries must not meet autograd
        return _run_torch(a)


def _pad_packed(a: _Args, lay: _Layout) -> _Args:
    """Packed arguments in the padded layout, for the torch path (CPU): one gather of the logits
    (positions past a row's K_b repeat its bonus position and its drafts are another row's; no
    padded step reads either)."""
    cu = lay.cu.to(torch.int64)
    B, K = lay.B, lay.K
    dev = a.target_logits.device
    kb = cu[1:] - cu[:-1]  # [B]
    i = torch.arange(K + 1, device=dev)
    rows = (cu[:-1] + torch.arange(B, device=dev))[:, None] + torch.minimum(i[None, :], kb[:, None])  # [B, K+1]
    logits = a.target_logits[rows]  # [B, K+1, V]
    nd = a.draft_tokens.shape[0]
    if nd:
        d = (cu[:-1, None] + i[None, :K]).clamp(max=nd - 1)  # [B, K]
        x = a.draft_tokens[d]
        q = None if a.draft_probs is None else a.draft_probs[d]  # [B, K, Vd]
    else:
        x = a.draft_tokens.new_zeros((B, K))
        q = None if a.draft_probs is None else a.draft_probs.new_zeros((B, K, a.draft_probs.shape[-1]))
    return a._replace(target_logits=logits, draft_tokens=x, draft_probs=q, num_draft_tokens=kb)


def _run_torch_layout(a: _Args, lay: _Layout):
    """The torch path of a call with a layout: (tokens, num_accepted, logprobs or None), written
    into ``lay.out`` when given."""
    if lay.cu is not None:
        a = _pad_packed(a, lay)
    a = _materialize(a)
    with torch.no_grad():
        if lay.draft_logits and a.draft_probs is not None:
            # q = softmax(l / T) with each row's 1 / T (the reference's own function: a mutant of
            # it reaches this path too), then the draft_probs computation
            _, _, inv_t = _row_parameters(a.num_draft_tokens, a.temperature, a.top_k, a.top_p, lay.K, a.min_p)
            a = a._replace(draft_probs=_ref.draft_softmax(a.draft_probs, inv_t))
        if lay.block and not _all_greedy(a):  # (greedy rows: block verification is token verification)
            u = _uniforms(a, lay.K)
            tokens, num = _ref.block_verify_reference(
                a.target_logits, a.draft_tokens, a.draft_probs, a.num_draft_tokens, a.temperature, a.top_k,
                a.top_p, u, sort_descending=sort_descending_cpu, target_is_probs=lay.probs, min_p=a.min_p)
        elif lay.probs:
            u = _uniforms(a, lay.K)
            tokens, num = verify_reference(a.target_logits, a.draft_tokens, a.draft_probs, a.num_draft_tokens,
                                           a.temperature, None, None, u, target_is_probs=True)
        else:
            tokens, num = _run_torch(a)
        lp = None
        if lay.logprobs:
            lp = _ref.emitted_logprobs(a.target_logits, tokens, num, a.temperature, a.top_k, a.top_p,
                                       target_is_probs=lay.probs, sort_descending=sort_descending_cpu,
                                       min_p=a.min_p)
    if lay.out is None:
        return tokens, num, lp
    outs = (tokens, num, lp)[:len(lay.out)]
    for dst, src in zip(lay.out, outs):
        dst.copy_(src)
    return tuple(lay.out) + ((None,) if len(lay.out) == 2 else ())


def _verify_layout(a: _Args, lay: _Layout, backend: str):
    """``fused_verify`` / ``fused_verify_packed`` with a layout (packed, probabilities in,
    log-probabilities, ``out=``, draft logits): eager only."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("fused_verify_packed, and fused_verify with draft_logits, target_is_probs, out=, "
                                  "return_logprobs or method='block', are eager ops: call them outside torch.compile")
    resolved = _resolve_backend(backend, a.target_logits.device)
    if resolved == "_triton_rows" and a.min_p is not None:
        raise NotImplementedError("backend '_triton_rows' does not take min_p (the one-program-per-row kernel "
                                  "warps with top-k/top-p only): use backend 'triton' or 'torch'")
    if resolved == "_triton_rows" and lay.draft_logits:
        raise NotImplementedError("backend '_triton_rows' does not take draft_logits (the one-program-per-row kernel "
                                  "reads draft probabilities only): use backend 'triton' or 'torch', or pass "
                                  "draft_probs")
    if resolved == "_triton_rows":
        raise ValueError("backend '_triton_rows' takes only fused_verify's padded logits, without "
                         "target_is_probs, out=, return_logprobs or method='block'")
    if resolved == "triton":
        tokens, num, lp = _launch(a, lay)
    else:
        tokens, num, lp = _run_torch_layout(a, lay)
    if lay.logprobs:
        return VerifyOutputWithLogprobs(tokens, num, lp)
    return VerifyOutput(tokens, num)


def _verify_checked(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p,
                    seed, offset, uniforms=None, min_p=None, backend: str = "auto") -> VerifyOutput:
    """``fused_verify`` from arguments that are already what ``_normalize`` returns ([B] tensors
    of its dtypes on the logits' device, in range), without the per-call checks: the tail of
    ``fused_verify``, and ``SpeculativeDecoder``'s entry (it checks its parameters once per
    ``generate``; inside its CPU loop the checks cost about 0.2 ms a step, Zen 5 VM, 1 thread,
    B = 1, about 1% of a step of the embedded target).  The same computation either way."""
    a = _Args(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k, top_p, seed, offset,
              uniforms, min_p)
    if torch.compiler.is_compiling():
        fn, a = _fused_verify_op, _materialize(a)  # the registered op's schema takes [B] tensors
    else:
        fn = _verify_impl
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
    return _verify_impl(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature,
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
    _normalize_rows(1, 0, torch.device("cpu"), temperature, top_k, top_p, 0, 0, None, False, min_p)


METHODS = ("token", "block")


def _check_method(method) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


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
    min_p: Optional[FloatArg] = None,  # None, float or [B] in [0, 1] (0 = off): keep p(v) >= min_p * max p, after top-k/top-p
    seed: Optional[IntArg] = None,  # None (torch's default generator), int, or [B] int64
    offset: IntArg = 0,  # int or [B] int64: a step counter (its low 32 bits enter Philox's counter)
    uniforms: Optional[torch.Tensor] = None,  # [B, K+1] float64 (or fp32) in [0, 1): explicit random numbers
    backend: str = "auto",  # "auto" | "triton" | "torch"
    target_is_probs: bool = False,  # target_logits holds probabilities [B, K+1, V], used as given
    out: Optional[tuple] = None,  # (tokens [B, K+1], num_accepted [B]) int32/int64 (+ logprobs [B, K+1] fp32)
    return_logprobs: bool = False,  # also return each emitted token's target log-probability
    method: str = "token",  # "token" (token by token) | "block" (block verification, Sun et al. 2025)
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
    Eager-only too; the private ``"_triton_rows"`` backend refuses it (NotImplementedError).

    ``method="block"``: block verification (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025; ``reference.block_verify_reference`` defines it): the K_b drafts are
    accepted or rejected jointly, the emitted tokens still distributed exactly as the target's,
    at least as many drafts accepted on average as token by token.  Every other argument and
    output is the same (greedy rows are verified token by token: the same tokens).  It reads the
    full q at every draft position, not only at a rejection, and every position's p twice
    (``_verify_split_kernel``'s header).  Eager-only, as ``out=``.
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
    if backend not in _BACKENDS + _PRIVATE_BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    a = _normalize(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
                   top_p, seed, offset, uniforms, materialize=False, target_is_probs=bool(target_is_probs),
                   draft_logits=draft_logits, min_p=min_p)
    if target_is_probs or out is not None or return_logprobs or draft_logits is not None or method == "block":
        B, K1, _ = target_logits.shape
        if out is not None:
            out = _check_out(out, B, K1, target_logits.device, bool(return_logprobs))
        lay = _Layout(B, K1 - 1, None, bool(target_is_probs), bool(return_logprobs), out,
                      draft_logits=draft_logits is not None, block=method == "block")
        return _verify_layout(a, lay, backend)
    return _verify_checked(*a, backend=backend)


def _normalize_packed(logits, draft_tokens, cu, draft_probs, max_num_draft_tokens, temperature, top_k, top_p,
                      seed, offset, uniforms, target_is_probs: bool, draft_logits=None,
                      min_p=None) -> tuple[_Args, int, int]:
    """``fused_verify_packed``'s arguments checked: (args, B, K = max_b K_b); ``draft_logits`` as
    in ``_normalize`` (returned in the draft_probs field)."""
    draft_probs, logits_q = _draft_input(draft_probs, draft_logits)
    name = "target_probs" if target_is_probs else "logits"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"{name} must have 2 dims [sum_b (K_b + 1), V], got {logits.dim()}: {_shape(logits)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {str(logits.dtype).replace('torch.', '')}")
    N, V = logits.shape
    if V < 1:
        raise ValueError(f"{name} must have a vocabulary V >= 1, got shape {_shape(logits)}")
    dev = logits.device
    for arg, t in (("cu_num_draft_tokens", cu), ("draft_tokens", draft_tokens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{arg} must have 1 dim, got {t.dim()}: {_shape(t)}")
    if cu.numel() < 1:
        raise ValueError(f"cu_num_draft_tokens must have B + 1 >= 1 entries (cu[0] = 0), got shape {_shape(cu)}")
    B = cu.numel() - 1
    _check_tensor("cu_num_draft_tokens", cu, _INDEX_DTYPES, [B + 1], dev)
    nd = draft_tokens.numel()
    _check_tensor("draft_tokens", draft_tokens, _INDEX_DTYPES, [nd], dev)
    if N != nd + B:
        raise ValueError(f"{name} must have sum_b (K_b + 1) = {nd} + {B} = {nd + B} rows (each row's drafts and its "
                         f"bonus position), got {N}")
    _check_draft_probs(draft_probs, [nd], "[sum_b K_b, Vd]", V, dev, "draft_logits" if logits_q else "draft_probs")
    if max_num_draft_tokens is not None and (isinstance(max_num_draft_tokens, bool)
                                             or not isinstance(max_num_draft_tokens, int) or max_num_draft_tokens < 0):
        raise ValueError(f"max_num_draft_tokens must be None or an int >= 0, got {max_num_draft_tokens!r}")
    kb = None
    if host_readable(cu):
        c = cu.tolist()
        kb = [c[b + 1] - c[b] for b in range(B)]
        if c[0] != 0 or any(k < 0 for k in kb) or c[-1] != nd:
            raise ValueError(f"cu_num_draft_tokens must rise from 0 to the number of drafts {nd} (cu[b + 1] >= cu[b]), "
                             f"got {c}")
        k_max = max(kb, default=0)
        if max_num_draft_tokens is not None and max_num_draft_tokens < k_max:
            raise ValueError(f"max_num_draft_tokens must be >= max_b K_b = {k_max}, got {max_num_draft_tokens}")
        K = k_max if max_num_draft_tokens is None else max_num_draft_tokens
    elif max_num_draft_tokens is not None:
        K = max_num_draft_tokens  # a row with more drafts is marked invalid in the kernel
    else:
        K = int((cu[1:] - cu[:-1]).max()) if B else 0  # a host sync: pass max_num_draft_tokens to avoid it
    temp, top_k, top_p, seed, offset, min_p = _normalize_rows(B, K, dev, temperature, top_k, top_p, seed, offset,
                                                              uniforms, target_is_probs, min_p)
    if draft_probs is not None and not logits_q and nd and kb is not None and _check_values(draft_probs) \
            and _range_fails(temp, lambda v: v != 0):
        row = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(kb, device=dev))  # [nd]
        sampled = _as_tensor(temp, B, torch.float32, dev) != 0
        _check_draft_sums(draft_probs, sampled[row], lambda n: f"[{n}]",
                          lambda n: f"draft {n - c[int(row[n])]} of row {int(row[n])}")
    a = _Args(logits, draft_tokens, draft_probs, None, temp, top_k, top_p, seed, offset, uniforms, min_p)
    return a, B, K


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
) -> Union[VerifyOutput, VerifyOutputWithLogprobs]:
    """``fused_verify`` in the packed (ragged) layout engines hold: the rows back to back, row b's
    K_b = cu[b + 1] - cu[b] verify positions followed by its bonus position, no padding.  The
    same kernel, indexed through cu: no copy of the logits, one launch (the CPU torch path gathers
    them into the padded layout).  Every keyword is ``fused_verify``'s (``draft_logits`` [sum_b K_b,
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
    if backend not in _BACKENDS + _PRIVATE_BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    a, B, K = _normalize_packed(logits, draft_tokens, cu_num_draft_tokens, draft_probs, max_num_draft_tokens,
                                temperature, top_k, top_p, seed, offset, uniforms, bool(target_is_probs),
                                draft_logits=draft_logits, min_p=min_p)
    if out is not None:
        out = _check_out(out, B, K + 1, logits.device, bool(return_logprobs))
    lay = _Layout(B, K, cu_num_draft_tokens, bool(target_is_probs), bool(return_logprobs), out,
                  draft_logits=draft_logits is not None, block=method == "block")
    return _verify_layout(a, lay, backend)
