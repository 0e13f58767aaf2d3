"""FlashInfer's ``flashinfer.sampling.chain_speculative_sampling`` on ``fused_verify``.

``chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, ...)`` takes FlashInfer's
arguments, in its order and under its names, and returns what FlashInfer returns, so that code
written for FlashInfer can call it unchanged.  It runs one
``fused_verify(..., target_is_probs=True)`` call (Leviathan et al. 2023; Chen et al. 2023): draft
x_i is *accepted* when ``u_i * q_i(x_i) < p_i(x_i)``; at the first rejection the *recovered* token
is drawn from the residual norm(max(0, p_i - q_i)); when all K drafts are accepted, the *bonus*
token is drawn from p_K.  Here p_i = target_probs[b, i] and q_i = draft_probs[b, i].

The contract, as FlashInfer states it (``flashinfer/sampling.py``, ``chain_speculative_sampling``
and the op it registers, ``flashinfer::chain_speculative_sampling``; the kernel
``ChainSpeculativeSampling`` in ``include/flashinfer/sampling.cuh``):

- draft_probs [B, K, V], draft_token_ids [B, K], target_probs [B, K+1, V].
- Returns the tuple ``(output_token_ids, output_accepted_token_num, output_emitted_draft_token_num)``:
  output_token_ids [B, K+1] int32 holds the accepted drafts, then the recovered or bonus token,
  then -1 in every later slot.
- output_emitted_draft_token_num [B]: the number of drafts emitted (the accepted prefix; the row
  emits that many + 1 tokens).  output_accepted_token_num [B]: the number of drafts that pass
  their acceptance test when each position is tested on its own, not stopping at the first
  rejection (a measure of how well the draft matches the target).
- The two counters are *added to*, in place: ``maybe_output_accepted_token_num`` and
  ``maybe_output_emitted_draft_token_num``, when given, are incremented by this call's counts and
  returned as they are (the same tensor objects); when None, fresh int32 zeros are allocated, so
  the returned counters hold this call's counts.
- Randomness: ``seed`` and ``offset`` (an int, or a 1-D int64/uint64 tensor of length 1 or B);
  without them, numbers come from ``generator`` (the device's default generator if None).
  ``deterministic`` selects FlashInfer's deterministic scan.

How it maps onto ``fused_verify``:

- Random numbers.  The call computes the uniforms [B, K+1] (float64 in [0, 1)) itself and hands
  them to ``fused_verify(uniforms=...)``, so that the independent-acceptance counter is computed
  with exactly the numbers the verification used:

  * ``seed`` given (``offset`` defaults to 0): row b's numbers are ``reference.philox_uniforms``
    at seed ``seed_b XOR (b << 32)`` and offset ``offset_b`` (``row_keys`` returns them), i.e.
    exactly what ``fused_verify(seed=..., offset=...)`` would draw in its kernel.  The row index
    in the key's high word stands in for the per-row Philox subsequence of FlashInfer's
    ``curand_init(seed, row, offset)``: rows of one call never share numbers, even with an int
    seed.  A row's numbers depend on (seed_b, offset_b, b) only, never on B, K or the other
    rows.  Offsets that agree modulo 2^32 give the same numbers (only the low 32 bits enter
    Philox's counter).  This computes Philox with about 360 elementwise tensor ops on [B, K+1]
    (no host synchronisation, but a few milliseconds of launches on a GPU in eager mode).
  * ``seed`` None: ``torch.rand((B, K+1), dtype=torch.float64, generator=generator)`` on the
    generator's device (the target's device when ``generator`` is None: that device's default
    generator, as in FlashInfer), moved to the target's device.  One launch; ``offset`` is not
    used (FlashInfer also ignores an offset given without a seed).
  * The *independent-acceptance counter*: the drafts before the row's first rejection count
    (the op's own decisions, read from its ``num_accepted``); the rejected draft does not;
    each draft after it counts when ``u_i * q_i(x_i) < p_i(x_i)`` holds with its own uniform u_i,
    computed as the op's torch path computes it (``reference.verify_reference``: p_i(x_i) =
    target_probs[b, i, x_i] / the fp32 sum of target_probs[b, i], the product and comparison in
    float64).  Cost: that sum reads target_probs once more ([B, K+1, V]; bf16/fp16 through a
    temporary fp32 copy, as the torch path makes one), plus a few gathers of B * K values.  The
    Triton kernel sums target_probs in its own order: its p_i(x_i) may differ from this one in the
    last bit, which could change a decision after the first rejection only when u_i * q_i(x_i) lies
    within ~1e-7 (relative) of p_i(x_i).
- ``deterministic`` is accepted and has no effect: ``fused_verify`` is deterministic (the same
  inputs and random numbers give the same tokens, on either backend, in any batch).
- ``backend`` (keyword only, not in FlashInfer): ``fused_verify``'s "auto" | "triton" | "torch".

Where this differs from FlashInfer:

- Dtypes: draft_probs and target_probs may be float32, bfloat16 or float16 (read as they are,
  computed in fp32); float64 is converted to float32 first (FlashInfer converts every input to
  float32).  draft_token_ids must be int32 or int64 (FlashInfer converts any dtype to int32).
  The counters may be int32 or int64 and are incremented in place either way (FlashInfer's
  op converts an int64 counter to an int32 copy, which it increments and drops, so the tensor
  returned to the caller keeps its old value).
- Shapes, dtypes and devices raise ValueError/TypeError naming the argument, the expected and
  the actual value (FlashInfer's C++ op checks dims, sizes and devices with TORCH_CHECK, a
  RuntimeError, and wants contiguous CUDA tensors; here any strides, and CPU tensors, work).
  A draft id outside [0, V) makes its row unusable (below); FlashInfer reads out of bounds.
- target_probs[b, i] is divided by its sum (a distribution that sums to 1 up to rounding
  is unchanged); FlashInfer uses the values as given.  On CPU each draft_probs[b, i] that a
  row reads must sum to 1 within 1e-2 (ValueError otherwise); FlashInfer does not check.
- Unusable input never yields a token: a row that reads a position with a NaN, inf or negative
  target probability, or none positive, or a NaN/inf/negative draft probability, or a draft id
  outside [0, V), emits nothing: its output_token_ids are all -1 and both counters are
  incremented by 0 (``fused_verify``'s num_accepted = -1).  FlashInfer samples from whatever
  such values give.  A value after the row's first rejection is never read by the verification;
  the counter counts a draft whose test cannot be evaluated there (NaN) as not accepted.
- The acceptance test's uniforms lie in [0, 1); FlashInfer's ``curand_uniform`` draws from
  (0, 1].  The residual draw is an inverse CDF summed in float64 (FlashInfer: fp32).
- The independent-acceptance counter re-uses each position's own uniform, so the rejected
  draft is never counted.  FlashInfer's Philox kernel (``include/flashinfer/sampling.cuh``,
  ``ChainSpeculativeSampling``, in the versions examined) tests the positions from the first
  rejection on with fresh draws, the rejected draft included, so its counter can count the
  rejected draft; its earlier kernel, which took explicit uniforms, tested each position with
  its own uniform, as here.
- Random streams: the same seed and offset give different numbers here and in FlashInfer
  (Triton's Philox keyed as above, against cuRAND's); only the law of the output is the same.
  ``seed`` alone is used with offset 0 (FlashInfer then ignores the seed and draws both from
  the generator); seed and offset may mix an int and a tensor (FlashInfer refuses that), and
  int32 tensors are accepted.  With ``generator=None`` on CPU tensors, numbers come from torch's
  default CPU generator.
- Eager only (``fused_verify`` with ``out=`` and ``target_is_probs`` is not traced by
  torch.compile).
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

from ..ops.reference import philox_uniforms
from ..ops.verify import fused_verify

__all__ = ["chain_speculative_sampling", "row_keys"]

_PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_UINT64 = getattr(torch, "uint64", None)
_KEY_DTYPES = tuple(d for d in (torch.int32, torch.int64, _UINT64) if d is not None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _names(dtypes) -> str:
    return " or ".join(_dtype_name(d) for d in dtypes)


def _check_tensor(name: str, t, dims: str, shape: Optional[list], dtypes, dev: Optional[torch.device]) -> None:
    """``t`` is a tensor of one of ``dtypes`` with ``shape`` (``dims`` names its dimensions) on
    ``dev``; errors name the argument, the expected and the actual value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and t.dim() != len(shape):
        raise ValueError(f"{name} must have {len(shape)} dims {dims}, got {t.dim()}: {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_names(dtypes)}, got {_dtype_name(t.dtype)}")
    if shape is not None and list(t.shape) != shape:
        raise ValueError(f"{name} must have shape {dims} = {shape}, got {list(t.shape)}")
    if dev is not None and t.device != dev:
        raise ValueError(f"{name} must be on {dev} (the device of target_probs), got {t.device}")


def _key(name: str, value, B: int, dev: torch.device) -> torch.Tensor:
    """FlashInfer's seed or offset (an int, or a 1-D int tensor of length 1 or B) as a [B] int64
    tensor on ``dev``; an int in [2^63, 2^64) and uint64 values keep their 64 bits."""
    if isinstance(value, torch.Tensor):
        _check_tensor(name, value, "", None, _KEY_DTYPES, dev)
        if value.dim() != 1 or value.shape[0] not in (1, B):
            raise ValueError(f"{name} must be an int or a 1-D tensor of length 1 or B = {B}, got shape "
                             f"{list(value.shape)}")
        if value.dtype == _UINT64:
            value = value.view(torch.int64)  # the same 64 bits
        return value.to(torch.int64).expand(B)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or a 1-D int64 tensor of length 1 or B = {B}, "
                        f"got {type(value).__name__}")
    v = int(value)
    if not -2**63 <= v < 2**64:
        raise ValueError(f"{name} must fit in 64 bits ([-2^63, 2^64)), got {v}")
    return torch.full((B,), v - 2**64 if v >= 2**63 else v, dtype=torch.int64, device=dev)


def row_keys(seed, offset, batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The Philox keys ``chain_speculative_sampling`` gives ``reference.philox_uniforms`` for
    FlashInfer's ``seed`` and ``offset`` (offset None = 0): (seed [B] int64, offset [B] int64) on
    ``device``, row b's seed being ``seed_b XOR (b << 32)``.  Its uniforms are then
    ``philox_uniforms(*row_keys(seed, offset, B, device), K)``."""
    dev = torch.device(device)
    s = _key("seed", seed, batch_size, dev)
    o = _key("offset", 0 if offset is None else offset, batch_size, dev)
    rows = torch.arange(batch_size, dtype=torch.int64, device=dev) << 32
    return s ^ rows, o


def _uniforms(seed, offset, generator, B: int, K: int, dev: torch.device) -> torch.Tensor:
    """[B, K+1] float64 in [0, 1): Philox at ``row_keys`` with a seed, else ``torch.rand`` from the
    generator (see the module's docstring)."""
    if seed is not None:
        return philox_uniforms(*row_keys(seed, offset, B, dev), K)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    gen_dev = generator.device if generator is not None else dev
    u = torch.rand((B, K + 1), dtype=torch.float64, generator=generator, device=gen_dev)
    return u if gen_dev == dev else u.to(dev)


def _counter(name: str, t, B: int, dev: torch.device) -> torch.Tensor:
    if t is None:
        return torch.zeros(B, dtype=torch.int32, device=dev)
    _check_tensor(name, t, "[B]", [B], _ID_DTYPES, dev)
    return t


def _independent_accepts(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                         u: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """[B] int64: the drafts before the first rejection (num_accepted, the op's own decisions),
    plus those after it that pass ``u_i * q_i(x_i) < p_i(x_i)`` with their own uniform (p_i
    normalised as ``verify_reference`` does); 0 for a row the op marked invalid (-1)."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    j = num_accepted.to(torch.int64)  # [B], -1 for an invalid row
    if K == 0:
        return torch.zeros_like(j)
    x = draft_token_ids.to(torch.int64)  # [B, K]
    x_ok = (x >= 0) & (x < V)
    xs = torch.where(x_ok, x, 0)[..., None]  # [B, K, 1]
    t = target_probs.float()  # [B, K+1, V]
    S = t.sum(-1)  # [B, K+1] fp32: the reference's normaliser, summed the same way
    p_x = t[:, :K].gather(-1, xs)[..., 0] / S[:, :K]  # [B, K] fp32, bit for bit the reference's p_i(x_i)
    q_x = draft_probs.float().gather(-1, xs)[..., 0]  # [B, K] fp32
    passes = (u[:, :K].double() * q_x.double() < p_x.double()) & x_ok  # [B, K]: NaN compares False
    i = torch.arange(K, device=j.device)[None, :]
    counted = (i < j[:, None]) | ((i > j[:, None]) & passes)  # [B, K]
    return torch.where(j >= 0, counted.sum(-1), 0)


def chain_speculative_sampling(
    draft_probs: torch.Tensor,  # [B, K, V] fp32/bf16/fp16 (fp64 converted to fp32)
    draft_token_ids: torch.Tensor,  # [B, K] int32/int64
    target_probs: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16 (fp64 converted to fp32)
    maybe_output_accepted_token_num: Optional[torch.Tensor] = None,  # [B] int32/int64, added to in place
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,  # [B] int32/int64, added to in place
    deterministic: bool = True,  # accepted; fused_verify is always deterministic
    generator: Optional[torch.Generator] = None,  # used when seed is None
    seed: Optional[Union[int, torch.Tensor]] = None,  # int, or [1] / [B] int tensor
    offset: Optional[Union[int, torch.Tensor]] = None,  # int, or [1] / [B] int tensor (None = 0 with a seed)
    *,
    backend: str = "auto",  # fused_verify's backend: "auto" | "triton" | "torch"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chain speculative sampling with FlashInfer's arguments and outputs (see the module's
    docstring for the contract and where it differs from FlashInfer's).

    Returns (output_token_ids [B, K+1] int32: the accepted drafts, the recovered or bonus token,
    then -1; output_accepted_token_num [B]: the drafts that pass their test when every position
    is tested on its own; output_emitted_draft_token_num [B]: the drafts emitted).  The counters
    are ``maybe_output_*`` incremented in place by this call's counts when given, else new int32
    tensors holding them."""
    if not isinstance(target_probs, torch.Tensor):
        raise TypeError(f"target_probs must be a torch.Tensor, got {type(target_probs).__name__}")
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must have 3 dims [B, K+1, V], got {target_probs.dim()}: "
                         f"{list(target_probs.shape)}")
    _check_tensor("target_probs", target_probs, "[B, K+1, V]", list(target_probs.shape),
                  _PROB_DTYPES + (torch.float64,), None)
    B, K1, V = target_probs.shape
    if K1 < 1:
        raise ValueError(f"target_probs must have K+1 >= 1 positions (dim 1: the K drafts and the bonus), got "
                         f"shape {list(target_probs.shape)}")
    K = K1 - 1
    dev = target_probs.device
    _check_tensor("draft_probs", draft_probs, "[B, K, V]", [B, K, V], _PROB_DTYPES + (torch.float64,), dev)
    _check_tensor("draft_token_ids", draft_token_ids, "[B, K]", [B, K], _ID_DTYPES, dev)
    accepted = _counter("maybe_output_accepted_token_num", maybe_output_accepted_token_num, B, dev)
    emitted = _counter("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, B, dev)
    if target_probs.dtype == torch.float64:
        target_probs = target_probs.float()
    if draft_probs.dtype == torch.float64:
        draft_probs = draft_probs.float()
    del deterministic  # fused_verify is deterministic whatever this says

    with torch.no_grad():
        u = _uniforms(seed, offset, generator, B, K, dev)  # [B, K+1] float64
        tokens = torch.empty((B, K1), dtype=torch.int32, device=dev)
        num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
        # seed=0: the op draws no seed of its own (the uniforms replace its numbers)
        fused_verify(target_probs, draft_token_ids, draft_probs, uniforms=u, seed=0, offset=0, backend=backend,
                     target_is_probs=True, out=(tokens, num_accepted))
        n_acc = _independent_accepts(target_probs, draft_probs, draft_token_ids, u, num_accepted)
        accepted.add_(n_acc.to(accepted.dtype))
        emitted.add_(num_accepted.clamp(min=0).to(emitted.dtype))
    return tokens, accepted, emitted
