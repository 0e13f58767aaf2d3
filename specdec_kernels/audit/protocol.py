"""The verifier protocol the audit calls: one verification step of speculative sampling.

A verifier is a callable

    verify(target_logits, draft_tokens, draft_probs, params) -> (tokens, num_accepted)

- ``target_logits`` [B, K+1, V] float32: the target's raw logits at the K draft positions and the
  bonus position (the verifier applies the row's temperature and warp itself);
- ``draft_tokens`` [B, K] int64: the drafted ids (row b reads its first ``num_draft_tokens[b]``;
  the rest are padding, any value);
- ``draft_probs`` [B, K, Vd] float32 with Vd <= V, or None: the law each draft was sampled from
  (zero beyond Vd); None means deterministic proposals (a one-hot q);
- ``params``: a ``SamplingParams`` of [B] tensors (temperature, top_k, top_p, min_p,
  num_draft_tokens, seed) and ``method``: "token" (token-by-token verification, Leviathan et al.
  2023) or "block" (block verification, Sun et al. 2025), for every row of the call.

It returns ``tokens`` [B, K+1] int64, row b's emitted tokens first (its accepted drafts, then the
recovered or bonus token), -1 after them, and ``num_accepted`` [B] int64 in [0, K_b] (-1 for a row
it refuses as unusable input).  It may raise: ``NotImplementedError`` for a parameter it does not
support (the case is reported "n/a"), any other exception for input it refuses (reported as an
error raised; for the bad-input cases that is a pass).  Attribute ``supports_seed`` (default
False): whether ``params.seed`` fixes each row's random numbers; ``supports_block`` (default
False): whether it verifies by block verification when ``params.method`` is "block" (the block
cases run only for verifiers that set it; the others ignore ``method``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

__all__ = ["AdapterUnavailable", "SamplingParams", "Call", "Verifier", "make_params"]


class AdapterUnavailable(RuntimeError):
    """A verifier's package is not installed (or cannot run here): one line, for the CLI's exit 2."""


@dataclass
class SamplingParams:
    """Per-row sampling parameters, each a [B] tensor: temperature float64 (0 = greedy), top_k int64
    (0 = off), top_p float64 (1 = off), min_p float64 (0 = off), num_draft_tokens int64 in [0, K],
    seed int64 or None (no per-row seeds: the verifier's own random state)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    num_draft_tokens: torch.Tensor
    seed: Optional[torch.Tensor] = None
    method: str = "token"

    def select(self, rows) -> "SamplingParams":
        return SamplingParams(*(None if t is None else t[rows] for t in
                                (self.temperature, self.top_k, self.top_p, self.min_p, self.num_draft_tokens,
                                 self.seed)), method=self.method)

    def uses(self) -> set:
        """The features this batch uses: 'top_k', 'top_p', 'min_p', 'greedy', 'sampled', 'seed'."""
        out = set()
        if bool((self.top_k > 0).any()):
            out.add("top_k")
        if bool((self.top_p < 1).any()):
            out.add("top_p")
        if bool((self.min_p > 0).any()):
            out.add("min_p")
        if bool((self.temperature == 0).any()):
            out.add("greedy")
        if bool((self.temperature > 0).any()):
            out.add("sampled")
        if self.seed is not None:
            out.add("seed")
        return out


def make_params(B: int, K: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, num_draft_tokens=None,
                seed=None, method: str = "token") -> SamplingParams:
    """``SamplingParams`` of B rows from scalars or per-row sequences (num_draft_tokens None = K);
    ``method``: "token" or "block"."""
    if method not in ("token", "block"):
        raise ValueError(f"method must be 'token' or 'block', got {method!r}")
    def col(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.expand(B).clone() if t.dim() == 0 else t.clone()

    p = SamplingParams(col(temperature, torch.float64), col(top_k, torch.int64), col(top_p, torch.float64),
                       col(min_p, torch.float64), col(K if num_draft_tokens is None else num_draft_tokens, torch.int64),
                       None if seed is None else col(seed, torch.int64), method)
    for name in ("temperature", "top_k", "top_p", "min_p", "num_draft_tokens"):
        if getattr(p, name).shape != (B,):
            raise ValueError(f"{name} must be a scalar or {B} values, got shape {tuple(getattr(p, name).shape)}")
    return p


@dataclass
class Call:
    """One verification step of a case: the verifier's four arguments."""

    target_logits: torch.Tensor  # [B, K+1, V] fp32
    draft_tokens: torch.Tensor  # [B, K] int64
    draft_probs: Optional[torch.Tensor]  # [B, K, Vd] fp32 or None
    params: SamplingParams

    def with_seeds(self, seed: Optional[torch.Tensor]) -> "Call":
        return replace(self, params=replace(self.params, seed=seed))


Verifier = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], SamplingParams],
                    tuple[torch.Tensor, torch.Tensor]]
