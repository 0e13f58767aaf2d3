"""The feature drafter (EAGLE's idea): a small network that reads the target's hidden states.

Each step feeds its pending pairs (the target's feature at column c - 1, the token at c) for
the columns the last verify made true, then pairs of its own (``draft_with_features``); after
the verify (``feature_after_verify_``) it keeps the pending pairs and drops its chain, and the
next pending pairs are the verified columns'.  A K = 0 step (``feature_wait_``) feeds nothing:
the step's one new pair joins the pending ones.  Its network and files are in
``feature_model.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...ops.kv.cache import compact_dynamic_cache_
from .base import Drafter, DraftPicker, Drafts, draft_cap, position_limit

__all__ = ["FeatureDrafter", "draft_with_features", "feature_after_verify_", "feature_wait_"]

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodeState
    from ...ops.verify import VerifyOutput


class FeatureDrafter(Drafter):
    """A feature draft (``runner``: its ``FeatureRunner``) as a ``Drafter``."""

    reads_features = True

    def __init__(self, runner):
        self.runner = runner

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
    C = max(st.draft.pend_cnt_host)
    cnt = st.draft.pend_cnt
    pos = st.draft.ld[:, None] + torch.arange(C, device=dev)[None, :]  # the draft's column = the target's
    limit = position_limit(st)
    if limit is not None:
        pos = pos.clamp(max=limit)
    dense = min(st.draft.ld_host) == st.draft.Td and min(st.draft.pend_cnt_host) == C
    mask = None
    if not dense:
        mask = torch.cat([torch.arange(st.draft.Td, device=dev)[None, :] < st.draft.ld[:, None],
                          torch.arange(C, device=dev)[None, :] < cnt[:, None]], 1)  # [B, Td + C]
    st.draft.block_start = st.draft.Td
    h = f.step(st.draft.dc, st.draft.pend_tok[:, :C], st.draft.pend_feat[:, :C], mask, pos, C)  # [B, C, H]
    fh = h.gather(1, (cnt - 1)[:, None, None].expand(B, 1, h.shape[-1]))[:, 0]  # [B, H]: each row's last
    T = st.draft.Td + C
    picks = DraftPicker(st, K, rows, Vd)
    for j in range(K):
        if j > 0:  # the pair (f^, x_j) at column ld + cnt + j - 1
            p = (st.draft.ld + cnt + (j - 1))[:, None]
            if limit is not None:
                p = p.clamp(max=limit)
            if mask is not None:
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.bool, device=dev)], 1)
            fh = f.step(st.draft.dc, picks.xs[-1][:, None], fh[:, None], mask, p, 1)[:, -1]
            T += 1
        if picks.add(f.head(fh), j):  # logits [B, N] over the draft vocabulary (or [B, V])
            break
    st.draft.Td = T
    if not picks.xs:
        return None, None, None
    X, Q, kb = picks.result()
    return X, Q, draft_cap(st, kb, st.draft.ld + cnt - 1)  # draft j from the input at ld + cnt - 1 + j


def feature_wait_(st: "DecodeState", out: "VerifyOutput", feats: torch.Tensor) -> None:
    """A feature draft's K = 0 step: no draft forward ran, so the step's one new pair (the
    target's feature at the verified column ``feats[:, 0]``, its token) joins the row's pending
    pairs, which the next draft forward takes all at once (they are ragged across rows after
    ragged steps before)."""
    B = len(st.rows)
    C = max(st.draft.pend_cnt_host)
    at = st.draft.pend_cnt[:, None]  # [B, 1]: each row's first free pending slot
    tok = torch.cat([st.draft.pend_tok[:, :C], st.draft.pend_tok.new_zeros((B, 1))], 1)
    st.draft.pend_tok = tok.scatter_(1, at, out.tokens[:, :1].clamp(min=0))
    fe = torch.cat([st.draft.pend_feat[:, :C], st.draft.pend_feat.new_zeros((B, 1, st.draft.pend_feat.shape[2]))], 1)
    st.draft.pend_feat = fe.scatter_(1, at[:, :, None].expand(B, 1, fe.shape[2]), feats[:, :1].to(fe.dtype))
    st.draft.pend_cnt = st.draft.pend_cnt + 1
    st.draft.pend_cnt_host = [c + 1 for c in st.draft.pend_cnt_host]
    st.draft.waited = True


def feature_after_verify_(st: "DecodeState", out: "VerifyOutput", feats: torch.Tensor, n: torch.Tensor,
                          n_host: list, K: int) -> None:
    """After a step with drafts, the feature draft keeps the pending pairs it took this step
    (true ones) and drops its chain; the next pending pairs are (feature at column lt + j, token
    at lt + j + 1) for j = 0 .. n_b: the accepted drafts and the target's own token (``feats``
    [B, K + 1, H]: the target's features at the K + 1 verified columns)."""
    st.draft.waited = False
    compact_dynamic_cache_(st.draft.dc, st.draft.block_start, st.draft.ld, st.draft.pend_cnt)
    st.draft.ld = st.draft.ld + st.draft.pend_cnt
    st.draft.ld_host = [a + c for a, c in zip(st.draft.ld_host, st.draft.pend_cnt_host)]
    st.draft.pend_tok = out.tokens[:, : K + 1].clamp(min=0)  # past n_b: a filler (masked), not an id
    st.draft.pend_feat = feats.to(st.draft.pend_feat.dtype)
    st.draft.pend_cnt = (n + 1).clamp(min=1)
    st.draft.pend_cnt_host = [max(m + 1, 1) for m in n_host]
