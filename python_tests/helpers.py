"""Shared helpers of the tests: the tolerance policy and the input generators."""

from __future__ import annotations

import torch

# Tolerance policy (STYLE item 15): per-dtype (atol, rtol) for comparing floating-point values
# computed by two implementations. Token ids and counts are always compared exactly.
TOLERANCES = {
    torch.float32: (1e-5, 1.3e-6),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_step(B: int, K: int, V: int, dtype=torch.float32, device="cpu", seed: int = 0,
              Vd: int | None = None, scale: float = 3.0, draft_noise: float = 0.5):
    """Target logits [B, K+1, V], draft probabilities [B, K, Vd] close to the target (so that
    drafts are often but not always accepted) and drafts sampled from them [B, K]."""
    g = torch.Generator().manual_seed(seed)
    Vd = V if Vd is None else Vd
    logits = torch.randn(B, K + 1, V, generator=g) * scale
    draft_logits = logits[:, :K, :Vd] + torch.randn(B, K, Vd, generator=g) * draft_noise * scale
    q = torch.softmax(draft_logits, dim=-1)
    if B * K:
        x = torch.multinomial(q.reshape(-1, Vd), 1, generator=g).view(B, K)
    else:
        x = torch.zeros(B, K, dtype=torch.int64)
    return (logits.to(dtype).to(device), x.to(device), q.to(device))
