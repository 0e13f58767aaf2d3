"""The arguments of ``fused_verify`` and ``fused_verify_packed`` checked at the boundary (every
error names the argument, the expected and the actual value) and normalised.

``normalize_arguments`` (the padded layout) and ``_normalize_packed`` (the packed one) return an
``_Args``: the tensors checked for shape, dtype and device, each per-row parameter kept as given
(a Python scalar, a float one rounded to float32, or a [B] tensor of an accepted dtype, read by
the split kernel as it is) or, with ``materialize`` (``_materialize``), as a [B] tensor of the
op's dtype.  Values are range-checked only where reading them is free (CPU tensors, not tracing,
unless ``host_value_checks(False)``); elsewhere a bad value makes its row invalid in-kernel, no
sync.  ``tree.api`` checks its arguments with the same functions.
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import NamedTuple, Optional, Union

import torch

from ..host import host_readable
from .reference.chain import FLT_MIN

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


# The per-row parameters' types: a Python scalar for every row, or a [B] tensor.
IntArg = Union[int, torch.Tensor]
FloatArg = Union[float, torch.Tensor]


def shape_of(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def check_tensor(name: str, t, dtypes, shape: list[int], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if shape_of(t) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {shape_of(t)}")
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


def per_row_spec(name: str, value, B: int, dtype: torch.dtype, device: torch.device, kind: type):
    """A per-row parameter as given and checked: a Python scalar (a float already rounded to
    float32), or a [B] tensor of an accepted dtype on ``device`` (not converted: the kernel reads
    it as it is; ``_materialize`` makes the [B] tensor of ``dtype`` for the torch path)."""
    if isinstance(value, torch.Tensor):
        ok = (torch.float32, torch.float64, torch.bfloat16, torch.float16) if kind is float else INDEX_DTYPES
        check_tensor(name, value, ok, [B], device)
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
            raise ValueError(f"{name} must fit in {str(dtype).replace('torch.', '')} "
                             f"([{info.min:.6g}, {info.max:.6g}]), got {value!r}")
        if value != 0 and out == 0:
            raise ValueError(f"{name} must be representable in float32 (a value that rounds to 0 or to inf there is "
                             f"refused), got {value!r}")
        return out
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise ValueError(f"{name} must fit in {str(dtype).replace('torch.', '')} ([{info.min}, {info.max}]), "
                         f"got {value!r}")
    return int(value)


def _check_fp32_representable(name: str, src: torch.Tensor, out: torch.Tensor) -> None:
    # A value that fp32 rounds to 0 or to inf (a float64 1e-50 or 1e39) is refused as given,
    # before the range checks, which would otherwise see (and name) the rounded one.
    lost = ((src != 0) & (out == 0)) | (torch.isfinite(src) & ~torch.isfinite(out))
    if bool(lost.any()):
        raise ValueError(f"{name} must be representable in float32 (a value that rounds to 0 or to inf there is "
                         f"refused), got {listed(src)}")


def _per_row(name: str, value, B: int, dtype: torch.dtype, device: torch.device, kind: type) -> torch.Tensor:
    """A python scalar or a [B] tensor as a [B] tensor of ``dtype`` on ``device``."""
    return as_tensor(per_row_spec(name, value, B, dtype, device, kind), B, dtype, device)


def as_tensor(value, B: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A checked per-row parameter (``per_row_spec``) as a contiguous [B] tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).contiguous()  # the old kernel reads row b at ptr + b
    if isinstance(value, _RowSeeds):
        return value.base + torch.arange(B, dtype=torch.int64, device=device)
    return torch.full((B,), value, dtype=dtype, device=device)


def range_fails(value, bad) -> bool:
    """Whether a checked per-row parameter holds a value for which ``bad`` (a predicate on a
    tensor or on a Python scalar) is true: scalars always, tensors only where their values may
    be read (``_check_values``), floating ones as the fp32 values the kernel reads."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0 or not _check_values(value):
            return False
        return bool(bad(value.float() if value.is_floating_point() else value).any())
    return bool(bad(value))


def listed(value):
    """A parameter's value(s) as given, for an error message."""
    return value.tolist() if isinstance(value, torch.Tensor) else value


_HOST_VALUE_CHECKS = [True]  # a module global, not a ContextVar: torch.compile traces fused_verify


@contextlib.contextmanager
def host_value_checks(enabled: bool):
    """Within the block, whether ``fused_verify(_packed)`` range-checks tensor values on the host where
    reading is free (True, the default: CPU tensors, not tracing; a bad value raises) or leaves them to
    the op (False: its row is made invalid, as on a GPU or under ``torch.compile``).  Process-wide."""
    if not isinstance(enabled, bool):
        raise TypeError(f"host_value_checks: enabled must be a bool, got {type(enabled).__name__}")
    before, _HOST_VALUE_CHECKS[0] = _HOST_VALUE_CHECKS[0], enabled
    try:
        yield
    finally:
        _HOST_VALUE_CHECKS[0] = before


def _check_values(t: torch.Tensor) -> bool:
    """Whether a tensor's values may be read for validation: where reading is free (CPU, not
    tracing) unless ``host_value_checks(False)``; else a bad value makes its row invalid in-op."""
    return host_readable(t) and _HOST_VALUE_CHECKS[0]


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


def normalize_arguments(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
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
        raise ValueError(f"{name} must have 3 dims [B, K+1, V], got {target_logits.dim()}: {shape_of(target_logits)}")
    if target_logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, "
                        f"got {str(target_logits.dtype).replace('torch.', '')}")
    B, K1, V = target_logits.shape
    K = K1 - 1
    if K1 < 1:
        raise ValueError(f"{name} must have K+1 >= 1 positions (dim 1: the K drafts and the bonus), got "
                         f"shape {shape_of(target_logits)}")
    if V < 1:
        raise ValueError(f"{name} must have a vocabulary V >= 1, got shape {shape_of(target_logits)}")
    dev = target_logits.device
    if not isinstance(draft_tokens, torch.Tensor):
        raise TypeError(f"draft_tokens must be a torch.Tensor, got {type(draft_tokens).__name__}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have 2 dims [B, K], got {draft_tokens.dim()}: {shape_of(draft_tokens)}")
    check_tensor("draft_tokens", draft_tokens, INDEX_DTYPES, [B, K], dev)
    check_draft_probs(draft_probs, [B, K], "[B, K, Vd]", V, dev, q_name)
    if num_draft_tokens is None:
        kb = K
    else:
        kb = per_row_spec("num_draft_tokens", num_draft_tokens, B, torch.int64, dev, int)
        if B > 0 and range_fails(kb, lambda v: (v < 0) | (v > K)):
            raise ValueError(f"num_draft_tokens must be in [0, K] = [0, {K}], got {listed(kb)}")
    temp, top_k, top_p, seed, offset, min_p = normalize_rows(B, K, dev, temperature, top_k, top_p, seed, offset,
                                                              uniforms, target_is_probs, min_p)
    if draft_probs is not None and not logits_q and K > 0 and B > 0 and _check_values(draft_probs) \
            and range_fails(temp, lambda v: v != 0):
        # Read where the row reads q: sampled rows, j < K_b (a greedy row never reads q).
        kb_t = as_tensor(kb, B, torch.int64, dev)
        sampled = as_tensor(temp, B, torch.float32, dev) != 0
        read = (torch.arange(K, device=dev)[None, :] < kb_t[:, None]) & sampled[:, None]  # [B, K]
        check_draft_sums(draft_probs.reshape(B * K, -1), read.reshape(-1), lambda n: f"[{n // K}, {n % K}]",
                          lambda n: f"draft {n % K}")
    a = _Args(target_logits, draft_tokens, draft_probs, kb, temp, top_k, top_p, seed, offset, uniforms, min_p)
    return _materialize(a) if materialize else a


def check_draft_probs(draft_probs, lead: list, layout: str, V: int, dev: torch.device,
                       name: str = "draft_probs") -> None:
    """draft_probs (or, name "draft_logits", the draft's logits) None, or a tensor of shape
    lead + [Vd] (layout: the dims' names, for the message), 1 <= Vd <= V, fp32/bf16/fp16, on dev."""
    if draft_probs is None:
        return
    if not isinstance(draft_probs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(draft_probs).__name__}")
    if draft_probs.dim() != len(lead) + 1:
        raise ValueError(f"{name} must have {len(lead) + 1} dims {layout}, got {draft_probs.dim()}: "
                         f"{shape_of(draft_probs)}")
    Vd = draft_probs.shape[-1]
    if not 1 <= Vd <= V:
        raise ValueError(f"{name} must have a vocabulary 1 <= Vd <= V = {V}, got Vd = {Vd}")
    check_tensor(name, draft_probs, LOGIT_DTYPES, lead + [Vd], dev)


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


def normalize_rows(B: int, K: int, dev: torch.device, temperature, top_k, top_p, seed, offset, uniforms,
                    target_is_probs: bool, min_p=None):
    """The per-row parameters checked (both layouts): (temperature, top_k, top_p, seed, offset,
    min_p) as ``per_row_spec`` keeps them; uniforms [B, K+1] checked in place."""
    temp = per_row_spec("temperature", temperature, B, torch.float32, dev, float)
    if B > 0 and range_fails(temp, _not_finite_nonnegative):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {listed(temperature)}")
    if B > 0 and range_fails(temp, lambda v: (v > 0) & (v < FLT_MIN)):
        raise ValueError(f"temperature must be 0 (greedy) or >= {FLT_MIN:.8g} (the smallest normal fp32), "
                         f"got {listed(temperature)}")
    if target_is_probs:
        # The probabilities are the caller's warped distribution: nothing is applied to them again.
        if B > 0 and range_fails(temp, lambda v: (v != 0) & (v != 1)):
            raise ValueError(f"temperature must be 0 (greedy) or 1 (sample the probabilities as given) with "
                             f"target_is_probs=True, got {listed(temperature)}")
        for pname, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if value is not None:
                raise ValueError(f"{pname} must be None with target_is_probs=True (the probabilities are used as "
                                 f"given: apply the warp before taking them), got {listed(value)}")
    if top_k is not None:
        top_k = per_row_spec("top_k", top_k, B, torch.int64, dev, int)
        if B > 0 and range_fails(top_k, lambda v: v < 0):
            raise ValueError(f"top_k must be >= 0 (0 = off), got {listed(top_k)}")
    if top_p is not None:
        top_p_in = top_p
        top_p = per_row_spec("top_p", top_p, B, torch.float32, dev, float)
        if B > 0 and range_fails(top_p, _outside_top_p_range):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {listed(top_p_in)}")
    if min_p is not None:
        min_p_in = min_p
        min_p = per_row_spec("min_p", min_p, B, torch.float32, dev, float)
        if B > 0 and range_fails(min_p, _outside_min_p_range):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {listed(min_p_in)}")
    if seed is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph a host draw would be frozen into every replay: draw on the device
            # (its generator advances per replay).
            seed = torch.randint(0, 2**62, (B,), dtype=torch.int64, device=dev)
        else:
            seed = _RowSeeds(int(torch.randint(0, 2**62, (1,), dtype=torch.int64)))  # host: no device sync
    else:
        seed = per_row_spec("seed", seed, B, torch.int64, dev, int)
    offset = per_row_spec("offset", offset, B, torch.int64, dev, int)
    if uniforms is not None:
        check_tensor("uniforms", uniforms, (torch.float64, torch.float32), [B, K + 1], dev)
        if _check_values(uniforms) and uniforms.numel():
            out = ~((uniforms >= 0) & (uniforms < 1))
            if bool(out.any()):
                b, j = (int(i) for i in out.nonzero()[0])
                raise ValueError(f"uniforms must lie in [0, 1), got {uniforms[b, j].item()!r} at [{b}, {j}]")
    return temp, top_k, top_p, seed, offset, min_p


def check_draft_sums(q: torch.Tensor, read: torch.Tensor, where, what) -> None:
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
        return None if v is None else as_tensor(v, B, dtype, dev)
    u = a.uniforms.to(torch.float64) if a.uniforms is not None else None  # the tests and the draw compute in float64
    return _Args(a.target_logits, a.draft_tokens, a.draft_probs, t(a.num_draft_tokens, torch.int64),
                 t(a.temperature, torch.float32), t(a.top_k, torch.int64), t(a.top_p, torch.float32),
                 t(a.seed, torch.int64), t(a.offset, torch.int64), u, t(a.min_p, torch.float32))


def _normalize_packed(logits, draft_tokens, cu, draft_probs, max_num_draft_tokens, temperature, top_k, top_p,
                      seed, offset, uniforms, target_is_probs: bool, draft_logits=None,
                      min_p=None) -> tuple[_Args, int, int]:
    """``fused_verify_packed``'s arguments checked: (args, B, K = max_b K_b); ``draft_logits`` as
    in ``normalize_arguments`` (returned in the draft_probs field)."""
    draft_probs, logits_q = _draft_input(draft_probs, draft_logits)
    name = "target_probs" if target_is_probs else "logits"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"{name} must have 2 dims [sum_b (K_b + 1), V], got {logits.dim()}: {shape_of(logits)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, "
                        f"got {str(logits.dtype).replace('torch.', '')}")
    N, V = logits.shape
    if V < 1:
        raise ValueError(f"{name} must have a vocabulary V >= 1, got shape {shape_of(logits)}")
    dev = logits.device
    for arg, t in (("cu_num_draft_tokens", cu), ("draft_tokens", draft_tokens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{arg} must have 1 dim, got {t.dim()}: {shape_of(t)}")
    if cu.numel() < 1:
        raise ValueError(f"cu_num_draft_tokens must have B + 1 >= 1 entries (cu[0] = 0), got shape {shape_of(cu)}")
    B = cu.numel() - 1
    check_tensor("cu_num_draft_tokens", cu, INDEX_DTYPES, [B + 1], dev)
    nd = draft_tokens.numel()
    check_tensor("draft_tokens", draft_tokens, INDEX_DTYPES, [nd], dev)
    if N != nd + B:
        raise ValueError(f"{name} must have sum_b (K_b + 1) = {nd} + {B} = {nd + B} rows (each row's drafts and its "
                         f"bonus position), got {N}")
    check_draft_probs(draft_probs, [nd], "[sum_b K_b, Vd]", V, dev, "draft_logits" if logits_q else "draft_probs")
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
    temp, top_k, top_p, seed, offset, min_p = normalize_rows(B, K, dev, temperature, top_k, top_p, seed, offset,
                                                              uniforms, target_is_probs, min_p)
    if draft_probs is not None and not logits_q and nd and kb is not None and _check_values(draft_probs) \
            and range_fails(temp, lambda v: v != 0):
        row = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(kb, device=dev))  # [nd]
        sampled = as_tensor(temp, B, torch.float32, dev) != 0
        check_draft_sums(draft_probs, sampled[row], lambda n: f"[{n}]",
                          lambda n: f"draft {n - c[int(row[n])]} of row {int(row[n])}")
    a = _Args(logits, draft_tokens, draft_probs, None, temp, top_k, top_p, seed, offset, uniforms, min_p)
    return a, B, K
