"""Model-free drafters.

Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; HF ``prompt_lookup_num_tokens``): the
last n tokens of a row (n from ``max_ngram`` down to ``min_ngram``) are searched for earlier
in the row's own text (prompt and generated tokens); the tokens that followed the most recent
earlier match are proposed as drafts.  The drafter is deterministic, so the verifier treats
its distribution as one-hot (``draft_probs=None``) and the output is still exactly the
target's.  Lookup runs on the host over Python lists: the rows are already there for stop
strings and detokenisation, and a match is a few list comparisons.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...ops.host import to_device
from .base import Drafter, Drafts

__all__ = ["prompt_lookup", "PromptLookupDrafter"]


def prompt_lookup(tokens: Sequence[int], num_tokens: int, max_ngram: int = 3,
                  min_ngram: int = 1) -> list[int]:
    """Up to ``num_tokens`` drafts for the sequence ``tokens`` (empty when nothing matches).

    For n = max_ngram .. min_ngram, find the most recent earlier occurrence of the last n
    tokens whose continuation is non-empty and return up to ``num_tokens`` tokens of that
    continuation.  The continuation may run into the suffix itself (a repeating pattern
    proposes its own continuation).
    """
    if num_tokens <= 0:
        return []
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
    t = list(tokens)
    L = len(t)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = t[L - n:]
        # Candidate starts i < L - n (the suffix itself excluded), most recent first.
        for i in range(L - n - 1, -1, -1):
            if t[i:i + n] == suffix:
                follow = t[i + n:i + n + num_tokens]
                if follow:
                    return follow
    return []


class PromptLookupDrafter(Drafter):
    """Batched prompt lookup: one list of drafts per row, padded into a [B, K] block."""

    name = "prompt_lookup"
    network = False  # it proposes within each row's budget itself

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, rows: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        """Drafts for each row, at most ``max_tokens[b]`` of them (possibly none)."""
        return [prompt_lookup(r, k, self.max_ngram, self.min_ngram) for r, k in zip(rows, max_tokens)]

    def draft(self, st, K: int) -> Drafts:
        """Each row's proposals (at most K, and at most its budget leaves room for), padded into
        [B, K'] with K' the longest; K_b [B]: how many each row proposed."""
        want = [min(K, st.budget_host[p] - len(st.generated[p]) - 1) for p in st.rows]
        props = self.propose([st.seqs[p] for p in st.rows], want)
        if st.hooks.grammar is not None:  # only what each row's grammar allows
            props = st.hooks.grammar.allowed_proposals(props, st.rows, st.generated)
        K = max(len(x) for x in props)
        X = to_device([x + [0] * (K - len(x)) for x in props], torch.int64, st.device).reshape(len(props), K)
        return Drafts(X, None, to_device([len(x) for x in props], torch.int64, st.device), 0)
