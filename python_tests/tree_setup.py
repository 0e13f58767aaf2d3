"""Random trees of drafts for ``fused_verify_tree``'s tests (``ops/tree/``) and its kernel's
interleaving test (``ops/verify/test_verify_interleaved.py``)."""

from __future__ import annotations

import torch

D64 = torch.float64


def random_tree(N: int, g: torch.Generator) -> list[int]:
    """parents of N nodes in topological order (each node's parent is the root or an earlier node),
    siblings contiguous or not."""
    return [int(torch.randint(-1, n, (1,), generator=g)) if n > 0 else -1 for n in range(N)]


def tree_case(B, N, V, Vd, g, sampled=True, greedy_frac=0.25, warp=False):
    logits = torch.randn(B, N + 1, V, generator=g) * 2
    logits[torch.rand(B, N + 1, V, generator=g) < 0.15] = float("-inf")
    logits[..., 0] = 0.0  # every position keeps a token
    parents = torch.tensor([random_tree(N, g) for _ in range(B)], dtype=torch.int64).view(B, N)
    q = torch.softmax(torch.randn(B, N + 1, Vd, generator=g) * 2, -1) if sampled else None
    # children: mostly drawn from q (or likely under p), sometimes anything
    tokens = torch.randint(0, Vd, (B, N), generator=g)
    if sampled:
        par_pos = parents + 1
        qq = q.gather(1, par_pos[..., None].expand(B, N, Vd))  # q at each node's parent
        tokens = torch.multinomial(qq.reshape(-1, Vd), 1, generator=g).view(B, N)
    likely = logits.argmax(-1).gather(1, parents + 1).clamp(max=Vd - 1)  # the parent's argmax: often accepted
    tokens = torch.where(torch.rand(B, N, generator=g) < 0.4, likely, tokens)
    nb = torch.randint(0, N + 1, (B,), generator=g)
    temp = torch.rand(B, generator=g) + 0.5
    temp[torch.rand(B, generator=g) < greedy_frac] = 0.0
    kw = {}
    if warp:
        kw = {"top_k": torch.randint(0, V + 1, (B,), generator=g),
              "top_p": torch.where(torch.rand(B, generator=g) < 0.5, 1.0, 0.8),
              "min_p": torch.where(torch.rand(B, generator=g) < 0.5, 0.0, 0.05)}
    u = torch.rand(B, N + 1, dtype=D64, generator=g)
    return logits, tokens, parents, q, nb, temp, kw, u
