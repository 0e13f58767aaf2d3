"""vLLM 0.32.0's sampler inputs built as its V1 model runner builds them."""

from __future__ import annotations

import numpy as np
import torch

from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

# The engine registers the C++ replacements of vLLM's Triton kernels where Triton has no CPU
# backend (vllm/v1/worker/worker_base.py); a sampler used outside an engine needs them too.
current_platform.register_triton_kernel_overrides()


def spec_metadata(drafts: list[list[int]], device="cpu") -> SpecDecodeMetadata:
    """The metadata of one step whose request b drafted ``drafts[b]``, with the indices that
    ``GPUModelRunner._calc_spec_decode_metadata`` computes (logits packed per request: its draft
    positions, then its bonus position)."""
    num_draft = np.array([len(d) for d in drafts], dtype=np.int32)
    num_sampled = num_draft + 1
    cu_sampled = np.cumsum(num_sampled, dtype=np.int32)
    cu_draft = np.cumsum(num_draft, dtype=np.int32)
    starts = cu_sampled - num_sampled
    target = np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, num_draft)] +
                            [np.zeros(0, np.int32)])
    flat = [t for d in drafts for t in d]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
        num_draft_tokens=num_draft.tolist(),
        cu_num_draft_tokens=t(cu_draft),
        cu_num_sampled_tokens=t(cu_sampled),
        target_logits_indices=t(target),
        bonus_logits_indices=t(cu_sampled - 1),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32, device=device),
    )


def sampling_metadata(temperature, top_k=None, top_p=None, generators=None, vocab_size=None) -> SamplingMetadata:
    """``SamplingMetadata`` as ``InputBatch`` fills it: temperature [B] (0.0 = greedy) or None
    (all greedy), top_k [B] int32 with ``vocab_size`` where off, top_p [B] with 1.0 where off."""
    if temperature is None:
        B, all_greedy, all_random = None, True, False
    else:
        temperature = torch.as_tensor(temperature, dtype=torch.float32)
        B = temperature.numel()
        all_greedy = bool((temperature == 0).all())
        all_random = bool((temperature != 0).all())
        if all_greedy:
            temperature = None
    n = B or 1
    if top_k is not None:
        top_k = torch.as_tensor(top_k, dtype=torch.int32)
        if vocab_size is not None:
            top_k = torch.where(top_k <= 0, torch.full_like(top_k, vocab_size), top_k)
    if top_p is not None:
        top_p = torch.as_tensor(top_p, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temperature, all_greedy=all_greedy, all_random=all_random, top_p=top_p, top_k=top_k,
        generators=generators or {}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def expand_batch_to_tokens_fixed(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` as its docstring defines it
    (x [B] repeated per token, ``replace_from`` replaced by ``replace_to``), in plain torch: what
    vLLM's CPU override of ``expand_kernel`` fails to compute for float inputs."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    y = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(y == replace_from, torch.full_like(y, replace_to), y)
