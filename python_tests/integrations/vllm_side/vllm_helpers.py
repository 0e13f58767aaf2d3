"""vLLM 0.32.0's sampler inputs built as its V1 model runner builds them."""

from __future__ import annotations

import torch

from vllm.platforms import current_platform

from specdec_kernels.integrations.vllm import sampling_metadata, spec_decode_metadata  # noqa: F401

# The engine registers the C++ replacements of vLLM's Triton kernels where Triton has no CPU
# backend (vllm/v1/worker/worker_base.py); a sampler used outside an engine needs them too.
current_platform.register_triton_kernel_overrides()


spec_metadata = spec_decode_metadata  # the package's builders, as the tests name them


def expand_batch_to_tokens_fixed(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` as its docstring defines it
    (x [B] repeated per token, ``replace_from`` replaced by ``replace_to``), in plain torch: what
    vLLM's CPU override of ``expand_kernel`` fails to compute for float inputs."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    y = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(y == replace_from, torch.full_like(y, replace_to), y)
