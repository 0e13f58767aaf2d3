"""The feature drafter (EAGLE's idea): a small network that reads the target's hidden states.

Each step feeds its pending pairs (the target's feature at column c - 1, the token at c) for
the columns the last verify made true, then pairs of its own (``draft_with_features``); after
the verify (``feature_after_verify_``) it keeps the pending pairs and drops its chain, and the
next pending pairs are the verified columns'.  A K = 0 step (``feature_wait_``) feeds nothing:
the step's one new pair joins the pending ones.  Its network and files are in
``feature_model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...ops.kv.cache import compact_dynamic_cache_, new_cache
from .base import CachedDraftState, Drafter, DraftPicker, Drafts, draft_cap, position_limit

__all__ = ["FeatureDraftState", "FeatureDrafter", "draft_with_features", "feature_after_verify_", "feature_wait_"]

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodeState
    from ...ops.verify import VerifyOutput


@dataclass
class FeatureDraftState(CachedDraftState):
    """A feature draft's state: its cache (``CachedDraftState``) and its pending pairs (the
    target's feature at column c - 1, the token at column c) for the columns c the target has
    made true and the draft has not taken yet."""

    hidden_size: int = 0  # H, the features' width
    feature_dtype: Any = torch.float32  # the dtype the draft takes its features in
    pending_tokens: torch.Tensor = None  # [B, C] int64
    pending_features: torch.Tensor = None  # [B, C, H]
    pending_count: torch.Tensor = None  # [B] int64 in [1, C]
    pending_count_host: list = field(default_factory=list)
    block_start: int = 0  # the draft cache column where this step's pending pairs went
    waited: bool = False  # the pending pairs include some that waited through K = 0 steps

    ROW_TENSORS = CachedDraftState.ROW_TENSORS + ("pending_tokens", "pending_features", "pending_count")
    ROW_LISTS = CachedDraftState.ROW_LISTS + ("pending_count_host",)

    def begin(self, st: "DecodeState", columns: int) -> None:
        super().begin(st, columns)
        if self.cache is None:
            return
        # the first pending pair: (the target's feature at the prompt's second-to-last token,
        # or 0 for a one-token prompt, as at column 0; the last token), filled in by the prefill
        B = len(st.rows)
        self.pending_tokens = st.last[:, None]
        self.pending_features = torch.zeros((B, 1, self.hidden_size), dtype=self.feature_dtype, device=st.device)
        self.pending_count = torch.ones(B, dtype=torch.int64, device=st.device)
        self.pending_count_host = [1] * B

    def retire(self) -> None:
        super().retire()
        self.pending_tokens = self.pending_features = self.pending_count = None
        self.pending_count_host = []

    def holds_waiting(self) -> bool:
        return self.pending_tokens is not None and self.waited


class FeatureDrafter(Drafter):
    """A feature draft (``runner``: its ``FeatureRunner``) as a ``Drafter``."""

    name = "feature"
    reads_features = True

    def __init__(self, runner):
        self.runner = runner

    def new_state(self, st: "DecodeState", target_only: bool) -> FeatureDraftState:
        fd = self.runner.fd  # the FeatureDraft
        return FeatureDraftState(cache=None if target_only else new_cache(self.runner.model),
                                 hidden_size=fd.hidden_size, feature_dtype=fd.fc.weight.dtype)

    def draft(self, st: "DecodeState", K: int) -> Drafts:
        X, Q, kb = draft_with_features(self.runner, st, K)  # K >= 1: at least one draft
        return Drafts(X, Q, kb, X.shape[1])

    def after_verify(self, st, out, feats, n, n_host, K) -> None:
        feature_after_verify_(st, out, feats, n, n_host, K)

    def wait(self, st, out, feats) -> None:
        feature_wait_(st, out, feats)


def draft_with_features(f, st: "DecodeState", K: int):
    """The feature draft ``f`` (a ``FeatureRunner``): first the pending pairs (what the last verify made true, with the
    target's features), whose last output gives the first draft; then K - 1 pairs of its own
    (its predicted feature, its draft).  Returns (X [B, K'] int64, Q [B, K', Vd] or None,
    K_b [B] or None) as ``draft_with_model`` does; with K = 0 it only takes the pairs (the
    decoder's K = 0 steps do not call it: their pairs wait for the next step with drafts)."""
    rows = f.vocab_rows
    dev = st.device
    B = len(st.rows)
    Vd = f.vocab_size
    C = max(st.draft.pending_count_host)
    cnt = st.draft.pending_count
    pos = st.draft.cache_len[:, None] + torch.arange(C, device=dev)[None, :]  # the draft's column = the target's
    limit = position_limit(st)
    if limit is not None:
        pos = pos.clamp(max=limit)
    dense = min(st.draft.cache_len_host) == st.draft.columns and min(st.draft.pending_count_host) == C
    mask = None
    if not dense:
        mask = torch.cat([torch.arange(st.draft.columns, device=dev)[None, :] < st.draft.cache_len[:, None],
                          torch.arange(C, device=dev)[None, :] < cnt[:, None]], 1)  # [B, Td + C]
    st.draft.block_start = st.draft.columns
    # h: [B, C, H]
    h = f.step(st.draft.cache, st.draft.pending_tokens[:, :C], st.draft.pending_features[:, :C], mask, pos, C)
    fh = h.gather(1, (cnt - 1)[:, None, None].expand(B, 1, h.shape[-1]))[:, 0]  # [B, H]: each row's last
    T = st.draft.columns + C
    picks = DraftPicker(st, K, rows, Vd)
    grammar = st.hooks.grammar
    for j in range(K):
        if j > 0:  # the pair (f^, x_j) at column ld + cnt + j - 1
            p = (st.draft.cache_len + cnt + (j - 1))[:, None]
            if limit is not None:
                p = p.clamp(max=limit)
            if mask is not None:
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.bool, device=dev)], 1)
            fh = f.step(st.draft.cache, picks.xs[-1][:, None], fh[:, None], mask, p, 1)[:, -1]
            T += 1
        logits = f.head(fh)  # [B, N] over the draft vocabulary (or [B, V])
        if grammar is not None:  # the rows' grammars at this draft's prefix: q is the masked draft law
            logits = grammar.mask_draft(logits, picks.xs, st.rows, st.generated, Vd, rows)
        if picks.add(logits, j):
            break
    st.draft.columns = T
    if not picks.xs:
        return None, None, None
    X, Q, kb = picks.result()
    return X, Q, draft_cap(st, kb, st.draft.cache_len + cnt - 1)  # draft j from the input at ld + cnt - 1 + j


def feature_wait_(st: "DecodeState", out: "VerifyOutput", feats: torch.Tensor) -> None:
    """A feature draft's K = 0 step: no draft forward ran, so the step's one new pair (the
    target's feature at the verified column ``feats[:, 0]``, its token) joins the row's pending
    pairs, which the next draft forward takes all at once (they are ragged across rows after
    ragged steps before)."""
    B = len(st.rows)
    C = max(st.draft.pending_count_host)
    at = st.draft.pending_count[:, None]  # [B, 1]: each row's first free pending slot
    tok = torch.cat([st.draft.pending_tokens[:, :C], st.draft.pending_tokens.new_zeros((B, 1))], 1)
    st.draft.pending_tokens = tok.scatter_(1, at, out.tokens[:, :1].clamp(min=0))
    fe = torch.cat([st.draft.pending_features[:, :C],
                    st.draft.pending_features.new_zeros((B, 1, st.draft.pending_features.shape[2]))], 1)
    st.draft.pending_features = fe.scatter_(1, at[:, :, None].expand(B, 1, fe.shape[2]), feats[:, :1].to(fe.dtype))
    st.draft.pending_count = st.draft.pending_count + 1
    st.draft.pending_count_host = [c + 1 for c in st.draft.pending_count_host]
    st.draft.waited = True


def feature_after_verify_(st: "DecodeState", out: "VerifyOutput", feats: torch.Tensor, n: torch.Tensor,
                          n_host: list, K: int) -> None:
    """After a step with drafts, the feature draft keeps the pending pairs it took this step
    (true ones) and drops its chain; the next pending pairs are (feature at column lt + j, token
    at lt + j + 1) for j = 0 .. n_b: the accepted drafts and the target's own token (``feats``
    [B, K + 1, H]: the target's features at the K + 1 verified columns)."""
    st.draft.waited = False
    compact_dynamic_cache_(st.draft.cache, st.draft.block_start, st.draft.cache_len, st.draft.pending_count)
    st.draft.cache_len = st.draft.cache_len + st.draft.pending_count
    st.draft.cache_len_host = [a + c for a, c in zip(st.draft.cache_len_host, st.draft.pending_count_host)]
    st.draft.pending_tokens = out.tokens[:, : K + 1].clamp(min=0)  # past n_b: a filler (masked), not an id
    st.draft.pending_features = feats.to(st.draft.pending_features.dtype)
    st.draft.pending_count = (n + 1).clamp(min=1)
    st.draft.pending_count_host = [max(m + 1, 1) for m in n_host]
