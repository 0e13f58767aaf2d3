"""The verification step as a lean batched PyTorch program: what an engineer writes without a
kernel (the shape of vLLM's first rejection sampler; written here from the algorithm, not taken
from any package). Every row at once, no host synchronisation, no Python loop over rows:
softmax of the target's logits, the acceptance tests ``u * q(x) < p(x)``, the first rejection
from a cumulative product, the clamped residual (or p at the bonus position) gathered at each
row's stop, and a draw by the exponential race (argmax of dist / Exp(1), as gpt-fast samples
without torch.multinomial's host sync). It exists as a fair baseline: the eager reference
also checks its inputs for NaN/inf and works in float64, work a production sampler skips.

No top-k/top-p (the benchmark marks warped rows n/a for it, as for the HF-style loop). Every
row verifies all K drafts; temperature is one float for the batch.
"""

from __future__ import annotations

import torch


def torch_batched_verify(target_logits: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                         temperature: float, uniforms: torch.Tensor | None = None):
    """[B, K+1, V] logits, [B, K, Vd] draft probabilities (Vd <= V), [B, K] drafts ->
    (tokens [B, K+1] with -1 after each row's last, num_accepted [B]). ``uniforms`` [B, K]:
    the acceptance tests' random numbers (torch.rand when None)."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    cols = torch.arange(K1, device=target_logits.device)
    if temperature == 0:  # accept while the draft is the argmax; then the argmax
        am = target_logits.argmax(-1)
        n = (draft_tokens == am[:, :K]).int().cumprod(1).sum(1)
        return torch.where(cols <= n[:, None], am, -1), n
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, K+1, V]
    q = draft_probs.float()
    if q.shape[-1] < V:  # a target vocabulary padded beyond the draft's: q = 0 there
        q = torch.nn.functional.pad(q, (0, V - q.shape[-1]))
    x = draft_tokens[..., None]
    p_x, q_x = p[:, :K].gather(-1, x)[..., 0], q.gather(-1, x)[..., 0]
    u = torch.rand(B, K, device=p.device) if uniforms is None else uniforms
    n = (u * q_x < p_x).int().cumprod(1).sum(1)  # [B] accepted drafts
    at = n[:, None, None].expand(-1, 1, V)
    p_n = p.gather(1, at)[:, 0]  # p at each row's stop (position K: the bonus)
    if K > 0:
        q_n = q.gather(1, at.clamp(max=K - 1))[:, 0]
        residual = torch.where((n < K)[:, None], (p_n - q_n).clamp(min=0), p_n)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)  # zero residual: p
    else:  # nothing to verify: the bonus alone
        residual = p_n
    t = (residual / torch.empty_like(residual).exponential_(1)).argmax(-1)
    drafts = torch.cat([draft_tokens, draft_tokens.new_zeros((B, 1))], 1)  # [B, K+1], column K unused
    tokens = torch.where(cols < n[:, None], drafts, torch.where(cols == n[:, None], t[:, None], -1))
    return tokens, n
