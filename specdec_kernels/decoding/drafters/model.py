"""The draft-model drafter: a small causal LM with its own KV cache.

Each step feeds ``model_block`` (tokens that waited through K = 0 steps, the catch-up token,
``last``, right-aligned) and then one draft per forward (``draft_with_model``); after the
verify (``model_after_verify_``) a row keeps its block and the drafts it accepted among those it
fed, one contiguous run moved down to ld_b.  A K = 0 step (``model_wait_``) feeds nothing: the
block waits.  The cache is left-aligned (row b's tokens in columns [0, ld_b); see the decoder's
module docstring) and no token is fed twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...ops.kv.cache import compact_dynamic_cache_, new_cache
from .base import CachedDraftState, Drafter, DraftPicker, Drafts, append_right, draft_cap, position_limit

__all__ = ["ModelDraftState", "ModelDrafter", "draft_with_model", "model_after_verify_", "model_block",
           "model_wait_"]

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodeState


@dataclass
class ModelDraftState(CachedDraftState):
    """A draft model's state: its cache (``CachedDraftState``), the catch-up token of each row
    that accepted all its drafts, and the tokens that waited through K = 0 steps."""

    catch_up: torch.Tensor = None  # [B] int64: the token the draft must catch up on, or -1
    catch_up_host: list = field(default_factory=list)  # [B] bool: a row has a catch-up token
    # the tokens waiting through K = 0 steps (right-aligned: row b's waiting_count_host[b] tokens
    # end at the last column), fed before the next step's [catch-up, last]; None: none
    waiting: torch.Tensor = None  # [B, W] int64
    waiting_count: torch.Tensor = None  # [B] int64
    waiting_count_host: list = None
    fed: Any = None  # this step's (block, drafts) fed to the cache, until after_verify

    ROW_TENSORS = CachedDraftState.ROW_TENSORS + ("catch_up", "waiting", "waiting_count")
    ROW_LISTS = CachedDraftState.ROW_LISTS + ("catch_up_host", "waiting_count_host")

    def begin(self, st: "DecodeState", columns: int) -> None:
        super().begin(st, columns)
        B = len(st.rows)
        self.catch_up = torch.full((B,), -1, dtype=torch.int64, device=st.device)
        self.catch_up_host = [False] * B

    def retire(self) -> None:
        super().retire()
        self.waiting = self.waiting_count = self.waiting_count_host = None

    def holds_waiting(self) -> bool:
        return self.waiting is not None


class ModelDrafter(Drafter):
    """A draft model (``runner``: its ``ModelRunner``) as a ``Drafter``."""

    name = "model"

    def __init__(self, runner):
        self.runner = runner

    def new_state(self, st: "DecodeState", target_only: bool) -> ModelDraftState:
        return ModelDraftState(cache=None if target_only else new_cache(self.runner.model))

    def draft(self, st: "DecodeState", K: int) -> Drafts:
        X, Q, block, kb = draft_with_model(self.runner, st, K)
        st.draft.fed = (block, X)  # what this step fed the draft's cache, for after_verify
        return Drafts(X, Q, kb, X.shape[1])

    def describe(self, st) -> dict:
        return {"vocabulary": "shared"}

    def after_verify(self, st, out, feats, n, n_host, K) -> None:
        (block, X), st.draft.fed = st.draft.fed, None
        model_after_verify_(st, block, X, n, n_host)

    def wait(self, st, out, feats) -> None:
        model_wait_(st)


def model_block(st: "DecodeState") -> tuple:
    """What a draft model must take before drafting: its waiting tokens, the catch-up token
    (rows that accepted all K last step) and ``last``, right-aligned in [B, C] (row b's cnt[b]
    tokens end at column C - 1; masked filler before them).  Returns (block, cnt [B], cnt
    host list)."""
    B = len(st.rows)
    dev = st.device
    if st.draft.waiting is None:
        blk = torch.zeros((B, 0), dtype=torch.int64, device=dev)
        cnt = torch.zeros(B, dtype=torch.int64, device=dev)
        host = [0] * B
    else:
        blk, cnt, host = st.draft.waiting, st.draft.waiting_count, st.draft.waiting_count_host
    if any(st.draft.catch_up_host):
        blk, cnt = append_right(blk, cnt, st.draft.catch_up.clamp(min=0), st.draft.catch_up >= 0)
    blk, cnt = append_right(blk, cnt, st.last, torch.ones(B, dtype=torch.bool, device=dev))
    host = [h + (1 if c else 0) + 1 for h, c in zip(host, st.draft.catch_up_host)]
    return blk[:, blk.shape[1] - max(host):], cnt, host  # no column of filler only


def draft_with_model(d, st: "DecodeState", K: int):
    """The draft model ``d`` (a ``ModelRunner``) drafts: up to K forwards, the first over the block of ``model_block``
    (usually [last], or [catch-up, last]), then one per draft.  Returns (X [B, K'] int64, Q [B, K', Vd]
    fp32 or None, the block (block, cnt, cnt host list), K_b [B] int64 or None): K' = K
    unless ``DraftPicker`` cut every row sooner (CPU only); a row's K_b is where its confidence
    stopped it or before its first position without a distribution (None when greedy without
    ``st.settings.draft_confidence``: nothing cuts).  With a draft vocabulary the draft picks among its
    tokens (logits [B, N]) and Q is zero on the others.  The target's sequence logits processors
    (``st.hooks.procs``) are applied to each draft's logits with its prefix (the row's ids, the drafts
    before it) when the draft scores the target's whole vocabulary (no draft vocabulary, the same
    size): its q is then the processed distribution it sampled from."""
    rows = d.vocab_rows  # [N] or None
    dev = st.device
    B = len(st.rows)
    Vd = d.vocab_size
    block = model_block(st)
    blk, cnt, cnt_host = block
    C = blk.shape[1]
    col = torch.arange(C, device=dev)[None, :]
    first = (C - cnt)[:, None]  # [B, 1]: each row's first valid block column
    ids = blk.clamp(max=Vd - 1)  # a padded-vocabulary target token the draft cannot embed
    pos = st.draft.cache_len[:, None] + (col - first).clamp(min=0)  # [B, C]; the filler's position is unused
    new_valid = col >= first
    pos_last = st.draft.cache_len + cnt - 1
    # [B, Td] valid columns; None when nothing is padding (every row's cache is full and no
    # row's block has filler), and then none is built
    dense = min(st.draft.cache_len_host) == st.draft.columns and min(cnt_host) == C
    mask = None if dense else torch.arange(st.draft.columns, device=dev)[None, :] < st.draft.cache_len[:, None]
    T = st.draft.columns
    limit = position_limit(st)
    picks = DraftPicker(st, K, rows, Vd)
    # the sequence processors, where the draft scores the target's whole vocabulary (else the
    # draft proposes without them: the verify does not need it to see them)
    procs = st.hooks.procs
    procs = procs if (procs is not None and rows is None and Vd == procs.vocab_size) else None
    grammar = st.hooks.grammar
    for j in range(K):
        if j > 0:
            ids = picks.xs[-1][:, None]
            pos = (pos_last + j)[:, None]
            new_valid = torch.ones((B, 1), dtype=torch.bool, device=dev)
        if limit is not None:
            pos = pos.clamp(max=limit)  # drafts past a row's budget or draft_cap are discarded anyway
        if mask is not None:
            mask = torch.cat([mask, new_valid], 1)
        logits = d.step(st.draft.cache, ids, mask, pos, T, 1)[:, -1]  # [B, Vd], or [B, N] over rows
        T += ids.shape[1]
        if procs is not None:  # the target's sequence processors, at this draft's prefix
            logits = procs.draft_scores(logits, picks.xs, st.rows, st.generated)
        if grammar is not None:  # the rows' grammars at this draft's prefix: q is the masked draft law
            logits = grammar.mask_draft(logits, picks.xs, st.rows, st.generated, Vd, rows)
        if picks.add(logits, j):
            break  # every row's K_b is cut before here
    st.draft.columns = T
    st.draft.waiting = st.draft.waiting_count = st.draft.waiting_count_host = None  # taken
    X, Q, kb = picks.result()
    return X, Q, block, draft_cap(st, kb, pos_last)


def model_wait_(st: "DecodeState") -> None:
    """A draft model's K = 0 step: the target alone takes it and the draft runs nothing; what
    the draft has not taken ([catch-up, last] after any earlier waiting tokens) waits for its
    next step (``model_block`` puts it first)."""
    st.draft.waiting, st.draft.waiting_count, st.draft.waiting_count_host = model_block(st)
    st.draft.catch_up = torch.full_like(st.draft.catch_up, -1)
    st.draft.catch_up_host = [False] * len(st.rows)


def model_after_verify_(st: "DecodeState", block: tuple, Xd: torch.Tensor, n: torch.Tensor, n_host: list) -> None:
    """Roll the draft model's cache back after a verify that accepted n [B] of the drafts Xd
    [B, Kd] it fed this step (``block``: what ``draft_with_model`` returned), and note the rows
    that must catch up (they accepted all Kd, and x_Kd was drafted but never fed)."""
    Kd = Xd.shape[1]  # >= 1: the decoder calls this after a step whose draft model drafted
    # The draft fed its block (row b's cnt_b tokens ending at column T0 + C - 1), then
    # x_1 .. x_{Kd - 1} from T0 + C on: a row keeps its block and the drafts it accepted
    # among those, one contiguous run, moved down to ld_b; one move per block length.
    blk, cnt, cnt_host = block
    C = blk.shape[1]
    T0 = st.draft.columns - (C + Kd - 1)  # the draft cache's length before this step
    total = cnt + n.clamp(min=0, max=Kd - 1)  # [B]
    for v in sorted(set(cnt_host)):
        compact_dynamic_cache_(st.draft.cache, T0 + C - v, st.draft.cache_len, torch.where(cnt == v, total, 0))
    st.draft.cache_len = st.draft.cache_len + total
    st.draft.cache_len_host = [a + c + min(max(m, 0), Kd - 1)
                               for a, c, m in zip(st.draft.cache_len_host, cnt_host, n_host)]
    st.draft.catch_up = torch.where(n == Kd, Xd[:, Kd - 1], -1)  # x_K was drafted, never fed
    st.draft.catch_up_host = [m == Kd for m in n_host]
