"""The verification step as Hugging Face transformers writes it for assisted generation with a
sampling draft (`_speculative_sampling` in generation/utils.py): one sequence at a time, softmax
of both models' logits, the ratio, torch.rand, the cumsum of rejections, the clamped and
renormalised residual, torch.multinomial. Written here from that description, not imported from
transformers' private functions, and looped over the rows since it takes one sequence at a time.
No top-k/top-p: transformers applies its logits processors before this step, so the benchmark
marks warped rows n/a for this provider.
"""

from __future__ import annotations

import torch


def hf_style_verify_row(target_logits: torch.Tensor, draft_logits_or_probs: torch.Tensor,
                        draft_tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """target_logits [K+1, V], draft probs [K, V], draft_tokens [K] -> the emitted tokens."""
    K = draft_tokens.shape[0]
    if temperature == 0:
        p_argmax = target_logits.argmax(-1)  # greedy: accept while equal to the argmax
        agree = (draft_tokens == p_argmax[:K]).int()
        n = int((agree.cumprod(0)).sum())  # a host sync, as in transformers
        return torch.cat([draft_tokens[:n], p_argmax[n:n + 1]])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [K+1, V]
    q = draft_logits_or_probs  # [K, V]
    idx = torch.arange(K, device=p.device)
    p_i = p[idx, draft_tokens]
    q_i = q[idx, draft_tokens]
    ratio = p_i / q_i
    r = torch.rand_like(ratio)
    is_accepted = r <= ratio
    n = int(((~is_accepted).cumsum(dim=-1) < 1).sum())  # .item() in transformers
    if n < K:
        residual = torch.clamp(p[n] - q[n], min=0)
        residual = residual / residual.sum()
        t = torch.multinomial(residual, num_samples=1)
    else:
        t = torch.multinomial(p[K], num_samples=1)
    return torch.cat([draft_tokens[:n], t])


def hf_style_verify(target_logits, draft_probs, draft_tokens, temperature: float) -> list[torch.Tensor]:
    """[B, K+1, V], [B, K, V], [B, K] -> a list of B emitted-token tensors (loop over rows)."""
    return [hf_style_verify_row(target_logits[b], draft_probs[b], draft_tokens[b], temperature)
            for b in range(target_logits.shape[0])]
