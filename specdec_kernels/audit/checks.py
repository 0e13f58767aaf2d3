"""What the cases read from a verifier's outputs, and how they turn them into a p-value.

``emitted``: the outputs checked against the protocol's format (shapes, num_accepted in [0, K_b],
emitted tokens in [0, V), -1 after them); ``counts``: a histogram; ``combine``: several p-values
of one case into one (Bonferroni: the smallest times their number, capped at 1), so that the
case's threshold holds for the case as a whole.
"""

from __future__ import annotations

import torch

__all__ = ["ALPHA", "FormatError", "emitted", "counts", "combine"]

# A case fails when its p-value is below ALPHA.  The draws are seeded, so a run is reproducible;
# over the ~15 cases a correct verifier fails somewhere with probability below ~2e-3.
ALPHA = 1e-4


class FormatError(Exception):
    """A verifier's output that breaks the protocol (a wrong shape, num_accepted out of range, an
    emitted token outside [0, V), a value after the emitted ones that is not -1)."""


def emitted(out, K_b: torch.Tensor, V: int, allow_invalid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, K+1] int64, num_accepted [B] int64) of an output checked against the protocol;
    K_b [B] the rows' draft counts.  Raises FormatError saying what is wrong; rows with
    num_accepted -1 (refused input) pass only with ``allow_invalid``."""
    try:
        tokens, num = out
    except (TypeError, ValueError):
        raise FormatError(f"a verifier returns (tokens, num_accepted), got {type(out).__name__}") from None
    tokens, num = torch.as_tensor(tokens).long().cpu(), torch.as_tensor(num).long().cpu()
    B = K_b.shape[0]
    if tokens.dim() != 2 or tokens.shape[0] != B or num.shape != (B,):
        raise FormatError(f"tokens must be [B, K+1] and num_accepted [B] with B = {B}, got {tuple(tokens.shape)} "
                          f"and {tuple(num.shape)}")
    refused = num == -1
    if refused.any() and not allow_invalid:
        raise FormatError(f"{int(refused.sum())} of {B} rows of valid input were refused (num_accepted -1)")
    bad = ~refused & ((num < 0) | (num > K_b))
    if bad.any():
        b = int(bad.nonzero()[0])
        raise FormatError(f"num_accepted must be in [0, K_b]: row {b} has {int(num[b])} with K_b = {int(K_b[b])} "
                          f"({int(bad.sum())} rows)")
    cols = torch.arange(tokens.shape[1])[None, :]
    n_emit = torch.where(refused, 0, num + 1)[:, None]
    inside = cols < n_emit
    if (inside & ((tokens < 0) | (tokens >= V))).any():
        b = int((inside & ((tokens < 0) | (tokens >= V))).any(-1).nonzero()[0])
        raise FormatError(f"emitted tokens must be in [0, V = {V}): row {b} emits "
                          f"{tokens[b, :int(n_emit[b])].tolist()}")
    if (~inside & (tokens != -1)).any():
        b = int((~inside & (tokens != -1)).any(-1).nonzero()[0])
        raise FormatError(f"tokens after the emitted ones must be -1: row {b} is {tokens[b].tolist()} with "
                          f"num_accepted {int(num[b])}")
    return tokens, num


def counts(values: torch.Tensor, n: int) -> torch.Tensor:
    """A histogram [n] of int values in [0, n)."""
    return torch.bincount(values.long(), minlength=n)[:n]


def combine(pvalues: list) -> float:
    """One p-value for several tests of a case: min(1, m * min p) (Bonferroni)."""
    return min(1.0, len(pvalues) * min(pvalues)) if pvalues else 1.0
