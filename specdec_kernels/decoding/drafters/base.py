"""The drafters' one interface, and what the network drafters share.

A drafter proposes each step's drafts and keeps its own bookkeeping across steps.  The loop
(``decoder.py``) calls, per step: ``draft(st, K)`` (K >= 1) for the step's ``Drafts``, or, on
a K = 0 step, nothing before the verify; then, after the verify and the target's roll-back,
``after_verify`` (a step with drafts) or ``wait`` (a K = 0 step); and
``select_rows`` when rows finish.  What a drafter keeps between steps is the state it makes
with ``new_state`` at the start of each call, ``st.draft``: a ``DraftState`` of its own class (a
draft model's ``ModelDraftState``: its cache, ``cache_len``, ``catch_up``, ``waiting``; a feature
draft's ``FeatureDraftState``: its cache, ``cache_len``, ``pending_*``; prompt lookup's the empty
base); the drafter object itself holds only its network and settings, so one drafter serves
many calls.  Every method takes the call's state, whose parameters ``generate`` has checked, so
none of them checks its arguments again.

``DraftPicker`` picks each position's draft for the network drafters (greedy argmax, or the
warped distribution sampled by inverse CDF with the row's counter-based uniforms), applies
``draft_confidence`` and cuts a row's K_b before a position whose distribution is not finite
(a NaN/inf draft logit); ``draft_cap`` cuts it where the draft's context ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from ...ops.kv.cache import crop_cache_
from .sampling import _draft_uniforms_k, _sample_inverse_cdf, warp_probs

__all__ = ["CachedDraftState", "DraftPicker", "DraftState", "Drafter", "Drafts", "append_right", "draft_cap",
           "position_limit"]

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodeState
    from ...ops.verify import VerifyOutput


class DraftState:
    """What a drafter keeps of a ``generate`` call between steps (``DecodeState.draft``), made by
    its ``Drafter.new_state``.  This base keeps nothing per row (prompt lookup: no network, no
    cache); a network drafter's state is a ``CachedDraftState``.  The loop calls ``begin`` at the
    prefill, ``select_rows`` when rows finish, ``crop`` after each step, ``retire`` when every row
    is past the draft's context, and reads ``holds_waiting`` and ``cache``."""

    cache: Any = None  # the draft's own KV cache (a DynamicCache), or None: it keeps none

    def begin(self, st: "DecodeState", columns: int) -> None:
        """The prefill starts: each row's target length (``st.target_len``) and ``st.last`` are
        set; ``columns``: the cache columns the prefill writes."""

    def select_rows(self, idx: torch.Tensor, keep: list, prefilled: bool) -> None:
        """Keep the per-row state of rows ``keep`` (host indices; ``idx`` on the device), and
        after the prefill (``prefilled``) its cache's rows."""

    def crop(self) -> None:
        """Drop the cache columns past the longest row (rejected drafts, finished rows)."""

    def retire(self) -> None:
        """The draft never drafts again in this call: keep nothing that waits for a forward."""

    def holds_waiting(self) -> bool:
        """True when the next draft forward also takes what waited through K = 0 steps (that
        step's draft time is not a typical one)."""
        return False


@dataclass
class CachedDraftState(DraftState):
    """A network drafter's state: its left-aligned cache and, per active row, how many of its
    columns are valid (row b's in [0, cache_len_b))."""

    cache: Any = None  # the draft's KV cache (a DynamicCache); None: retired, or a target-only call
    columns: int = 0  # its columns (the batch's width)
    cache_len: torch.Tensor = None  # [B] int64: valid draft-cache columns
    cache_len_host: list = field(default_factory=list)

    # the per-row device tensors and host lists ``select_rows`` keeps (subclasses add theirs)
    ROW_TENSORS = ("cache_len",)
    ROW_LISTS = ("cache_len_host",)

    def begin(self, st: "DecodeState", columns: int) -> None:
        self.cache_len_host = list(st.target_len_host)  # the prefill caches what the target caches
        self.cache_len = st.target_len.clone()
        self.columns = columns

    def select_rows(self, idx: torch.Tensor, keep: list, prefilled: bool) -> None:
        for name in self.ROW_TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))
        for name in self.ROW_LISTS:
            h = getattr(self, name)
            if h:
                setattr(self, name, [h[i] for i in keep])
        if prefilled and self.cache is not None:
            self.cache.batch_select_indices(idx)

    def crop(self) -> None:
        if self.cache is not None:
            self.columns = max(self.cache_len_host)
            crop_cache_(self.cache, self.columns)

    def retire(self) -> None:
        self.cache = None


class Drafts(NamedTuple):
    """A step's drafts: tokens [B, K] int64 (full-vocabulary ids; a row's drafts past its K_b
    are filler), probs [B, K, Vd] fp32 (the distributions they were drawn from) or None (greedy,
    or a drafter without one: one-hot), num [B] int64 (each row's K_b where the drafter set it)
    or None (every row K, within its budget), forwards: the draft forwards it took (for the
    cost model)."""

    tokens: torch.Tensor
    probs: Optional[torch.Tensor]
    num: Optional[torch.Tensor]
    forwards: int


class Drafter:
    """The interface the loop drafts through (see the module docstring).  A subclass passed as
    ``SpeculativeDecoder(drafter=<instance>)`` drafts for the target alone: it brings whatever it
    drafts with (``draft=`` stays None), and its drafts are target token ids."""

    name = "custom"  # what ``SpeculativeDecoder.drafter`` says (the registered name of the built-in ones)
    reads_features = False  # the verify must also return the target's features ([B, K + 1, H])
    network = True  # a draft network: its K_b is clamped to each row's budget by the loop
    # its cache follows the target's: the loop's prefill fills it with the target's ids, and its
    # context is counted in the target's positions (``CallSettings.draft_context``); False: the
    # drafter syncs its own (a draft over another tokenizer)
    follows_target_cache = True

    def new_state(self, st: "DecodeState", target_only: bool) -> DraftState:
        """This drafter's state for a new ``generate`` call (``st``: its state, the rows encoded,
        nothing prefilled; ``target_only``: the target alone decodes, the draft runs nothing)."""
        return DraftState()

    def draft(self, st: "DecodeState", K: int) -> Drafts:
        """The step's drafts (K >= 1; a row may propose fewer, a lookup none)."""
        raise NotImplementedError

    def describe(self, st: "DecodeState") -> dict:
        """What the call's stats say of this drafter (``DecodingStats`` fields): {} by default."""
        return {}

    def after_verify(self, st: "DecodeState", out: "VerifyOutput", feats: Optional[torch.Tensor],
                     n: torch.Tensor, n_host: list, K: int) -> None:
        """Roll the drafter's own state back to what each row accepted: n [B] of K drafts."""

    def wait(self, st: "DecodeState", out: "VerifyOutput", feats: Optional[torch.Tensor]) -> None:
        """A step without a draft forward (K = 0): keep what the drafter has not taken."""

    def select_rows(self, st: "DecodeState", idx: torch.Tensor, keep: list) -> None:
        """Keep the drafter's per-row state of rows ``keep`` (host indices; ``idx`` on the device):
        its state's (``st.draft``) per-row tensors and lists, and after the prefill its cache's rows."""
        st.draft.select_rows(idx, keep, bool(st.target_len_host))


def position_limit(st: "DecodeState") -> Optional[int]:
    """The largest position a draft forward is given (inputs past it are clamped to it: their
    drafts are cut by ``draft_cap`` or past the row's budget); None: no limit."""
    c = st.settings.draft_context if st.settings.draft_context is not None else st.settings.context
    return None if c is None else c - 1


def draft_cap(st: "DecodeState", kb: Optional[torch.Tensor], pos_last: torch.Tensor) -> Optional[torch.Tensor]:
    """K_b [B] (or None: no cut) cut where the draft's context is shorter than the target's: draft
    j comes from the draft's input at position ``pos_last + j`` ([B]: its first draft's input), so
    a row keeps the drafts whose input lies below ``st.settings.draft_context``.  It depends on the row's
    own length only (batch-invariant) and on the draft side alone (exact)."""
    if st.settings.draft_context is None:
        return kb
    cap = (st.settings.draft_context - pos_last).clamp(min=0)
    return cap if kb is None else torch.minimum(kb, cap)


def append_right(block: torch.Tensor, cnt: torch.Tensor, x: torch.Tensor, valid: torch.Tensor) -> tuple:
    """Append x [B] to the rows of a right-aligned block [B, W] (row b's cnt[b] tokens end at
    its last column) where ``valid``; other rows shift right by a filler column instead.
    Returns ([B, W + 1], cnt + valid)."""
    col = x[:, None]
    grown = torch.where(valid[:, None], torch.cat([block, col], 1), torch.cat([torch.zeros_like(col), block], 1))
    return grown, cnt + valid.to(cnt.dtype)


class DraftPicker:
    """A step's drafts as they are picked: each position's token ids [B] (full-vocabulary ids),
    when sampling the distribution each was drawn from (zero outside a draft vocabulary), and
    each row's K_b where the draft cut it short: under ``draft_confidence`` where the running
    product of its probabilities fell below the threshold, and when sampling at the first
    position whose distribution is not finite.

    A draft whose distribution at position j is not finite (``warp_probs`` gives NaN where a
    NaN or +inf logit survives the warp, or where logit / T overflows; top-k or top-p may drop
    such a logit, and the q then reported is the one sampled from) has none there, so the row
    verifies only its drafts before j: the target samples position j itself, from its own
    distribution, and the row goes on (decoded by the target alone while its draft stays
    broken).  Whether a position is usable depends on the draft alone, never on the target or on
    the verifier's random numbers, so the output stays exactly the target's distribution.  (A
    draft that writes NaN into its cache can make a row's later drafts NaN in a batch and not
    alone: a rejected column stays in the batch's cache, masked, until the longest row moves
    past it, and masked attention still multiplies its NaN by 0; the tokens then differ from the
    row decoded alone, in distribution they do not.  With temperature 0 the draft's argmax is
    verified against the target's whatever it is: a broken greedy draft is only rejected.)"""

    def __init__(self, st: "DecodeState", K: int, rows: Optional[torch.Tensor], Vd: int):
        self.st, self.K, self.rows, self.Vd = st, K, rows, Vd
        B, dev = len(st.rows), st.device
        self.xs: list = []
        sampling = st.settings.temperature != 0
        # when sampling, the distributions of all K positions, written in place (zero outside a
        # draft vocabulary): one allocation a step, no stacking; and their uniforms, drawn at once
        self.Q = torch.zeros((B, K, Vd), dtype=torch.float32, device=dev) if sampling else None
        self.u = _draft_uniforms_k(st.key_lo, st.key_hi, st.step, K) if sampling else None  # [B, K]
        on = st.settings.draft_confidence > 0
        self.cum = torch.ones(B, dtype=torch.float32, device=dev) if on else None  # P(all accepted)
        self.kb = torch.full((B,), K, dtype=torch.int64, device=dev) if (on or sampling) else None

    def add(self, logits: torch.Tensor, j: int) -> bool:
        """Pick draft j from ``logits`` [B, Vd] (or [B, N] over the draft vocabulary).  True when
        every row's K_b is cut to j + 1 or less (checked on the CPU only: no host sync elsewhere)."""
        st, rows = self.st, self.rows
        if st.settings.temperature == 0:
            x = logits.argmax(-1)
            if self.cum is not None:  # the draft's own probability of its argmax
                self.cum = self.cum * torch.softmax(logits.float(), -1).gather(1, x[:, None])[:, 0]
        else:
            s = st.settings
            q = warp_probs(logits, s.temperature, s.top_k, s.top_p, min_p=s.min_p)  # [B, Vd] (or [B, N]) fp32
            x = _sample_inverse_cdf(q, self.u[:, j])
            if self.cum is not None:
                self.cum = self.cum * q.gather(1, x[:, None])[:, 0]
            unusable = ~torch.isfinite(q.sum(-1))  # [B]: no distribution at this position
            self.kb = torch.where(unusable, self.kb.clamp(max=j), self.kb)
            if rows is not None:
                self.Q[:, j].index_copy_(1, rows, q)
            else:
                self.Q[:, j] = q
        self.xs.append(x if rows is None else rows[x])
        if self.kb is None:
            return False
        if self.cum is not None:  # a NaN product (an unusable position, already cut) compares False
            self.kb = torch.where((self.cum < st.settings.draft_confidence) & (self.kb == self.K), j + 1, self.kb)
        return j + 1 < self.K and st.device.type == "cpu" and bool((self.kb <= j + 1).all())

    def result(self) -> tuple:
        """(X [B, K'] int64, Q [B, K', Vd] or None, K_b [B] or None)."""
        X = torch.stack(self.xs, 1)
        Q = None if self.Q is None else self.Q[:, :X.shape[1]]
        return X, Q, None if self.kb is None else self.kb.clamp(max=X.shape[1])
