"""vLLM V1's rejection sampler replaced by ``fused_verify_packed`` (written against vLLM 0.32.0).

Use: install this package into vLLM's environment and set ``SPECDEC_VLLM=1``.  vLLM calls the
``vllm.general_plugins`` entry point ``specdec_kernels = specdec_kernels.integrations.vllm:register``
in each of its processes; ``register`` then replaces ``RejectionSampler.forward``
(``vllm/v1/sample/rejection_sampler.py``) by ``fused_forward``, so ``vllm serve`` and ``vllm.LLM``
with any ``speculative_config`` (draft model, n-gram, EAGLE, ...) verify through one fused call,
without code changes.  Unset or ``SPECDEC_VLLM=0``: nothing is patched.  ``patch()`` and
``unpatch()`` do the same by hand.  Only the V1 model runner's sampler
(``vllm.v1.worker.gpu_model_runner``, which the CPU runner subclasses) is replaced; the
experimental V2 runner (``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``) is left alone.

What vLLM hands the sampler, and how it maps onto the op:

- ``logits`` [num_tokens + B, V]: the target's logits, packed per request exactly as
  ``fused_verify_packed`` reads them: request b's K_b draft positions, then its bonus position,
  requests back to back (``GPUModelRunner._calc_spec_decode_metadata``:
  ``bonus_logits_indices = cu_num_sampled_tokens - 1``, ``target_logits_indices`` the rows before
  it).  They are passed as they are, in their dtype (fp32/bf16/fp16): no copy, no softmax.  vLLM's
  own sampler gathers ``logits[target_logits_indices]`` and ``logits[bonus_logits_indices]``
  (two copies), casts the first to fp32 and clones it again before its in-place warp.
- ``metadata.cu_num_draft_tokens`` [B]: *inclusive* prefix sums (no leading 0), int32.  The op
  wants the exclusive form [B + 1]: the one thing copied is this, into a new [B + 1] tensor
  (B + 1 integers).  ``metadata.draft_token_ids`` [num_tokens] int32 and ``draft_probs``
  ([num_tokens, V] or None: n-gram, and the default greedy draft sampling, whose draft is a point
  mass) go in as they are; ``metadata.max_spec_len`` (a host int) is ``max_num_draft_tokens``, so
  the op reads nothing back from the device.
- ``sampling_metadata``: ``temperature`` [B] (0.0 for greedy requests, None when all are greedy),
  ``top_k`` [B] int32 (the vocabulary size where off; None when no request uses it) and ``top_p``
  [B] (1.0 where off; None) are the op's per-row tensors as they are.
- Randomness: the op draws from Philox keyed by a per-row seed.  Each call gives row b the seed
  ``torch.randint(0, 2**62)`` drawn from that request's own ``torch.Generator``
  (``sampling_metadata.generators[b]``: requests with ``SamplingParams.seed``) and, for the other
  rows, from the device's default generator (which vLLM's ``seed`` sets), with offset 0.  A seeded
  request's generator thus advances by one draw per step, and its output depends only on its seed
  and its own tokens, never on the other requests of the batch.  An all-greedy batch draws nothing.
- The result: ``tokens`` [B, max_spec_len + 1] int32 written by the op in place (``out=``), -1
  after the emitted tokens, which is vLLM's ``PLACEHOLDER_TOKEN_ID``: that tensor is
  ``SamplerOutput.sampled_token_ids``.  A row whose logits hold NaN/+inf emits nothing in that step
  (the op's ``num_accepted = -1``; all placeholders), where vLLM's sampler would emit a token.

The output law: every row emits its tokens from the target's distribution after temperature,
top-k and top-p, exactly (the bonus too: the op samples it from the bonus row, as vLLM's sampler
does with the same warp).  Greedy rows emit the target's argmax, token for token what vLLM's
greedy path emits.

What falls back to vLLM's own ``forward`` (unchanged behaviour, per call): requested logprobs
(``max_num_logprobs`` or ``logprob_token_ids``), penalties, ``allowed_token_ids``, bad words, an
active logits processor (``min_p``, ``logit_bias``, ``min_tokens``, or any custom one), a thinking
budget, the synthetic acceptance mode, and a negative draft id (vLLM pads rejected drafts of async
steps with -1 and forces a rejection there; finding one reads ``draft_token_ids`` on the host).
``fallback_reason`` says which applies.

Found in vLLM 0.32.0 on CPU: without Triton's CPU backend, vLLM replaces its Triton kernels by
C++ ones (``vllm/platforms/cpu.py``, ``register_triton_kernel_overrides``).  The replacement of
``expand_kernel`` (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) passes
``_ensure_int64(output)``: for the fp32 per-token temperatures that ``expand_batch_to_tokens``
builds (``output = x.new_empty(num_tokens)``) this is a new int64 copy, written and discarded, so
``apply_sampling_constraints`` divides the target logits by uninitialised memory (and the
temperatures it would have written are truncated to integers: 0.7 becomes 0).  A greedy request
batched with sampled ones then takes the argmax of those garbage-scaled logits, and sampled
requests are drawn at a garbage temperature.  ``python_tests/integrations/vllm_side/test_sampler.py`` shows it;
this module never calls that path.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..ops.verify import fused_verify_packed

__all__ = ["ENV_VAR", "fallback_reason", "fused_forward", "fused_rejection_sample", "is_patched", "patch",
           "original_forward", "register", "row_seeds", "sampling_metadata", "spec_decode_metadata", "unpatch"]

ENV_VAR = "SPECDEC_VLLM"
_SEED_BOUND = 2**62
_log = logging.getLogger(__name__)
_ORIGINAL_FORWARD = None  # RejectionSampler.forward as vLLM defines it, kept while patched


def _env_enabled() -> bool:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{ENV_VAR} must be 0 or 1 (unset: off), got {os.environ[ENV_VAR]!r}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``patch()`` when ``SPECDEC_VLLM=1``; otherwise,
    or when vLLM cannot be imported, nothing.  Safe to call any number of times."""
    if not _env_enabled():
        return
    try:
        import vllm.v1.sample.rejection_sampler  # noqa: F401
    except ImportError as e:
        _log.warning("specdec_kernels: %s=1 but vLLM's rejection sampler cannot be imported (%s): not patched",
                     ENV_VAR, e)
        return
    patch()


def patch() -> None:
    """Replace ``vllm.v1.sample.rejection_sampler.RejectionSampler.forward`` by ``fused_forward``
    (idempotent; existing samplers are affected too, the method being the class's)."""
    global _ORIGINAL_FORWARD
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if RejectionSampler.forward is fused_forward:
        return
    _ORIGINAL_FORWARD = RejectionSampler.forward
    RejectionSampler.forward = fused_forward
    try:  # vLLM's own logger prints where vLLM's messages go
        from vllm.logger import init_logger

        init_logger("vllm.specdec_kernels").info("specdec_kernels: RejectionSampler.forward now runs "
                                                 "fused_verify_packed")
    except ImportError:
        _log.info("specdec_kernels: vLLM's RejectionSampler.forward now runs fused_verify_packed")


def unpatch() -> None:
    """Restore vLLM's own ``RejectionSampler.forward``."""
    global _ORIGINAL_FORWARD
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if RejectionSampler.forward is fused_forward and _ORIGINAL_FORWARD is not None:
        RejectionSampler.forward = _ORIGINAL_FORWARD
    _ORIGINAL_FORWARD = None


def is_patched() -> bool:
    try:
        from vllm.v1.sample.rejection_sampler import RejectionSampler
    except ImportError:
        return False
    return RejectionSampler.forward is fused_forward


def original_forward():
    """vLLM's own ``RejectionSampler.forward`` (whether or not it is patched)."""
    if _ORIGINAL_FORWARD is not None:
        return _ORIGINAL_FORWARD
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    return RejectionSampler.forward


def _active_logits_processors(logitsprocs) -> list:
    """The names of the logits processors in ``logitsprocs`` that would change this batch's logits
    (vLLM's built-ins are inert while no request uses them; any other kind counts as active)."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                          MinTokensLogitsProcessor)

    active = []
    for proc in getattr(logitsprocs, "all", ()):
        if isinstance(proc, MinPLogitsProcessor):
            if getattr(proc, "min_p_count", 1):
                active.append("min_p")
        elif isinstance(proc, LogitBiasLogitsProcessor):
            if getattr(proc, "biases", True):
                active.append("logit_bias")
        elif isinstance(proc, MinTokensLogitsProcessor):
            if getattr(proc, "min_toks", True):
                active.append("min_tokens")
        else:
            active.append(type(proc).__name__)
    return active


def fallback_reason(sampler, metadata, draft_probs, logits, sampling_metadata) -> Optional[str]:
    """Why this call must go to vLLM's own sampler (a feature the op does not implement), or None."""
    sm = sampling_metadata
    if getattr(sampler, "synthetic_mode", False):
        return "rejection_sample_method='synthetic'"
    if sm.max_num_logprobs is not None or getattr(sm, "logprob_token_ids", None):
        return "logprobs requested"
    if not sm.no_penalties:
        return "penalties"
    if sm.allowed_token_ids_mask is not None:
        return "allowed_token_ids"
    if sm.bad_words_token_ids:
        return "bad_words"
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return "thinking token budget"
    active = _active_logits_processors(sm.logitsprocs)
    if active:
        return f"logits processors {active}"
    d = metadata.draft_token_ids
    if d.numel() and bool((d < 0).any()):
        return "padded (negative) draft token ids"
    return None


def row_seeds(batch_size: int, generators: dict, device) -> torch.Tensor:
    """[B] int64 Philox seeds on ``device``: row b's drawn from ``generators[b]`` when the request
    has one, the others from ``device``'s default generator (one draw per row per call)."""
    seeds = torch.randint(0, _SEED_BOUND, (batch_size,), dtype=torch.int64, device=device)
    for b, gen in generators.items():
        if 0 <= b < batch_size:
            seeds[b:b + 1].random_(0, _SEED_BOUND, generator=gen)
    return seeds


def fused_rejection_sample(metadata, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                           sampling_metadata, *, backend: str = "auto") -> torch.Tensor:
    """vLLM's rejection sampling of one step in one ``fused_verify_packed`` call: the
    [B, metadata.max_spec_len + 1] int32 token ids (``PLACEHOLDER_TOKEN_ID`` = -1 after each
    row's emitted tokens), as ``RejectionSampler.forward`` returns them in ``sampled_token_ids``.
    The arguments are ``RejectionSampler.forward``'s (see the module's docstring for the layout)."""
    num_draft = metadata.num_draft_tokens
    B = len(num_draft)
    K = int(metadata.max_spec_len)
    device = logits.device
    cu_in = metadata.cu_num_draft_tokens
    if cu_in.dim() != 1 or cu_in.numel() != B:
        raise ValueError(f"metadata.cu_num_draft_tokens must be [B] = [{B}] inclusive prefix sums (vLLM's layout), "
                         f"got shape {list(cu_in.shape)}")
    n_tok = metadata.draft_token_ids.numel()
    if logits.dim() != 2 or logits.shape[0] != n_tok + B:
        raise ValueError(f"logits must be [num_tokens + B, V] = [{n_tok} + {B}, V] (each request's draft positions, "
                         f"then its bonus position), got shape {list(logits.shape)}")
    cu = cu_in.new_zeros(B + 1)
    cu[1:] = cu_in
    sm = sampling_metadata
    if sm.all_greedy or sm.temperature is None:
        temperature, top_k, top_p, seed = 0.0, None, None, 0
    else:
        temperature, top_k, top_p = sm.temperature[:B], sm.top_k, sm.top_p
        if top_k is not None:
            top_k = top_k[:B]
        if top_p is not None:
            top_p = top_p[:B]
        seed = row_seeds(B, sm.generators, device)
    tokens = torch.empty((B, K + 1), dtype=torch.int32, device=device)
    accepted = torch.empty((B,), dtype=torch.int32, device=device)
    fused_verify_packed(logits, metadata.draft_token_ids, cu, draft_probs, max_num_draft_tokens=K,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, backend=backend,
                        out=(tokens, accepted))
    return tokens


def fused_forward(self, metadata, draft_probs, logits, sampling_metadata):
    """``RejectionSampler.forward`` through ``fused_rejection_sample``; calls that need a feature
    the op does not implement (``fallback_reason``) run vLLM's own ``forward``."""
    reason = fallback_reason(self, metadata, draft_probs, logits, sampling_metadata)
    if reason is not None:
        _log.debug("specdec_kernels: vLLM's own rejection sampler for this step (%s)", reason)
        return original_forward()(self, metadata, draft_probs, logits, sampling_metadata)
    from vllm.v1.outputs import SamplerOutput

    tokens = fused_rejection_sample(metadata, draft_probs, logits, sampling_metadata)
    return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)


def spec_decode_metadata(drafts: list, device="cpu"):
    """vLLM's ``SpecDecodeMetadata`` of one step whose request b drafted the token ids
    ``drafts[b]`` (a list, possibly empty), with the indices ``GPUModelRunner`` computes for it
    (``_calc_spec_decode_metadata``: logits packed per request, its draft positions then its bonus
    position).  For calling a ``RejectionSampler`` outside an engine (tests, benchmarks)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    if not isinstance(drafts, (list, tuple)) or not all(
            isinstance(d, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in d)
            for d in drafts):
        raise TypeError(f"drafts must be a list of token-id lists (ints >= 0), one per request, got {drafts!r:.200}")
    num_draft = [len(d) for d in drafts]
    cu_draft = torch.tensor(num_draft, dtype=torch.int64).cumsum(0).to(torch.int32)  # [B] inclusive
    cu_sampled = (torch.tensor(num_draft, dtype=torch.int64) + 1).cumsum(0).to(torch.int32)  # [B] inclusive
    starts = cu_sampled - torch.tensor(num_draft, dtype=torch.int32) - 1
    target = [torch.arange(int(s), int(s) + n, dtype=torch.int32) for s, n in zip(starts, num_draft)]
    target = torch.cat(target) if target else torch.zeros(0, dtype=torch.int32)
    flat = [int(t) for d in drafts for t in d]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=cu_draft.to(device),
        cu_num_sampled_tokens=cu_sampled.to(device),
        target_logits_indices=target.to(device),
        bonus_logits_indices=(cu_sampled - 1).to(device),
        logits_indices=torch.arange(int(cu_sampled[-1]) if len(drafts) else 0, dtype=torch.int32, device=device),
    )


def sampling_metadata(temperature, top_k=None, top_p=None, generators=None, vocab_size=None, device="cpu"):
    """vLLM's ``SamplingMetadata`` as its ``InputBatch`` fills it for requests without penalties,
    logprobs or logits processors: ``temperature`` [B] (0.0 = greedy) or None (all greedy),
    ``top_k`` [B] (<= 0 = off, stored as ``vocab_size`` when given) or None, ``top_p`` [B]
    (1.0 = off) or None, ``generators`` {row: torch.Generator} of seeded requests."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    if temperature is None:
        B, all_greedy, all_random = None, True, False
    else:
        temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device)
        if temperature.dim() != 1 or bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all()):
            raise ValueError(f"temperature must be None or [B] finite values >= 0 (0 = greedy), got "
                             f"{temperature.tolist()!r:.200}")
        B = temperature.numel()
        all_greedy = bool((temperature == 0).all())
        all_random = bool((temperature != 0).all())
        if all_greedy:
            temperature = None
    n = B or 1
    if top_k is not None:
        top_k = torch.as_tensor(top_k, dtype=torch.int32, device=device)
        if vocab_size is not None:
            top_k = torch.where(top_k <= 0, torch.full_like(top_k, vocab_size), top_k)
    if top_p is not None:
        top_p = torch.as_tensor(top_p, dtype=torch.float32, device=device)
    return SamplingMetadata(
        temperature=temperature, all_greedy=all_greedy, all_random=all_random, top_p=top_p, top_k=top_k,
        generators=generators or {}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n, device=device), presence_penalties=torch.zeros(n, device=device),
        repetition_penalties=torch.ones(n, device=device), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
