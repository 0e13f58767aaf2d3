"""What each drafter network does in a step of ``SpeculativeDecoder``, and its cache bookkeeping.

The decoder's loop (``decoder.py``) chooses K, calls one of these to draft, verifies, rolls the
target's cache back and then calls the drafter's own bookkeeping here.  Both drafters keep a
left-aligned ``DynamicCache`` (row b's tokens in columns [0, ld_b); see the decoder's module
docstring) and never feed a token twice:

- *a draft model* (``draft_with_model``): each step feeds ``model_block`` (tokens that waited
  through K = 0 steps, the catch-up token, ``last``, right-aligned) and then one draft per
  forward; after the verify (``model_after_verify_``) a row keeps its block and the drafts it
  accepted among those it fed, one contiguous run moved down to ld_b.  A K = 0 step
  (``model_wait_``) feeds nothing: the block waits.
- *a feature draft* (``draft_with_features``, EAGLE's idea): each step feeds its pending pairs
  (the target's feature at column c - 1, the token at c) for the columns the last verify made
  true, then pairs of its own; after the verify (``feature_after_verify_``) it keeps the
  pending pairs and drops its chain, and the next pending pairs are the verified columns'.  A
  K = 0 step (``feature_wait_``) feeds nothing: the step's one new pair joins the pending ones.

``_Drafts`` picks each position's draft (greedy argmax, or the warped distribution sampled by
inverse CDF with the row's counter-based uniforms), applies ``draft_confidence`` and cuts a
row's K_b before a position whose distribution is not finite (a NaN/inf draft logit).

Internal to ``SpeculativeDecoder``: every function takes the decoder's own ``_State``, whose
parameters ``generate`` has checked, so none of them checks its arguments again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .draft_sampling import _draft_uniforms_k, _sample_inverse_cdf, warp_probs
from .kv_cache import compact_dynamic_cache_

__all__: list = []  # nothing public: see the module docstring

if TYPE_CHECKING:  # pragma: no cover
    from .decoder import _State
    from .verify import VerifyOutput


def _append_right(block: torch.Tensor, cnt: torch.Tensor, x: torch.Tensor, valid: torch.Tensor) -> tuple:
    """Append x [B] to the rows of a right-aligned block [B, W] (row b's cnt[b] tokens end at
    its last column) where ``valid``; other rows shift right by a filler column instead.
    Returns ([B, W + 1], cnt + valid)."""
    col = x[:, None]
    grown = torch.where(valid[:, None], torch.cat([block, col], 1), torch.cat([torch.zeros_like(col), block], 1))
    return grown, cnt + valid.to(cnt.dtype)


class _Drafts:
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

    def __init__(self, st: "_State", K: int, rows: Optional[torch.Tensor], Vd: int):
        self.st, self.K, self.rows, self.Vd = st, K, rows, Vd
        B, dev = len(st.rows), st.device
        self.xs: list = []
        sampling = st.temperature != 0
        # when sampling, the distributions of all K positions, written in place (zero outside a
        # draft vocabulary): one allocation a step, no stacking; and their uniforms, drawn at once
        self.Q = torch.zeros((B, K, Vd), dtype=torch.float32, device=dev) if sampling else None
        self.u = _draft_uniforms_k(st.key_lo, st.key_hi, st.step, K) if sampling else None  # [B, K]
        on = st.draft_confidence > 0
        self.cum = torch.ones(B, dtype=torch.float32, device=dev) if on else None  # P(all accepted)
        self.kb = torch.full((B,), K, dtype=torch.int64, device=dev) if (on or sampling) else None

    def add(self, logits: torch.Tensor, j: int) -> bool:
        """Pick draft j from ``logits`` [B, Vd] (or [B, N] over the draft vocabulary).  True when
        every row's K_b is cut to j + 1 or less (checked on the CPU only: no host sync elsewhere)."""
        st, rows = self.st, self.rows
        if st.temperature == 0:
            x = logits.argmax(-1)
            if self.cum is not None:  # the draft's own probability of its argmax
                self.cum = self.cum * torch.softmax(logits.float(), -1).gather(1, x[:, None])[:, 0]
        else:
            q = warp_probs(logits, st.temperature, st.top_k, st.top_p, min_p=st.min_p)  # [B, Vd] (or [B, N]) fp32
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
            self.kb = torch.where((self.cum < st.draft_confidence) & (self.kb == self.K), j + 1, self.kb)
        return j + 1 < self.K and st.device.type == "cpu" and bool((self.kb <= j + 1).all())

    def result(self) -> tuple:
        """(X [B, K'] int64, Q [B, K', Vd] or None, K_b [B] or None)."""
        X = torch.stack(self.xs, 1)
        Q = None if self.Q is None else self.Q[:, :X.shape[1]]
        return X, Q, None if self.kb is None else self.kb.clamp(max=X.shape[1])


def _pos_limit(st: "_State") -> Optional[int]:
    """The largest position a draft forward is given (inputs past it are clamped to it: their
    drafts are cut by ``draft_cap`` or past the row's budget); None: no limit."""
    c = st.draft_context if st.draft_context is not None else st.context
    return None if c is None else c - 1


def draft_cap(st: "_State", kb: Optional[torch.Tensor], pos_last: torch.Tensor) -> Optional[torch.Tensor]:
    """K_b [B] (or None: no cut) cut where the draft's context is shorter than the target's: draft
    j comes from the draft's input at position ``pos_last + j`` ([B]: its first draft's input), so
    a row keeps the drafts whose input lies below ``st.draft_context``.  It depends on the row's
    own length only (batch-invariant) and on the draft side alone (exact)."""
    if st.draft_context is None:
        return kb
    cap = (st.draft_context - pos_last).clamp(min=0)
    return cap if kb is None else torch.minimum(kb, cap)


def model_block(st: "_State") -> tuple:
    """What a draft model must take before drafting: its waiting tokens, the catch-up token
    (rows that accepted all K last step) and ``last``, right-aligned in [B, C] (row b's cnt[b]
    tokens end at column C - 1; masked filler before them).  Returns (block, cnt [B], cnt
    host list)."""
    B = len(st.rows)
    dev = st.device
    if st.wait is None:
        blk = torch.zeros((B, 0), dtype=torch.int64, device=dev)
        cnt = torch.zeros(B, dtype=torch.int64, device=dev)
        host = [0] * B
    else:
        blk, cnt, host = st.wait, st.wait_cnt, st.wait_host
    if any(st.catch_host):
        blk, cnt = _append_right(blk, cnt, st.catch.clamp(min=0), st.catch >= 0)
    blk, cnt = _append_right(blk, cnt, st.last, torch.ones(B, dtype=torch.bool, device=dev))
    host = [h + (1 if c else 0) + 1 for h, c in zip(host, st.catch_host)]
    return blk[:, blk.shape[1] - max(host):], cnt, host  # no column of filler only


def draft_with_model(d, st: "_State", K: int):
    """The draft model ``d`` (a ``_Runner``) drafts: up to K forwards, the first over the block of ``model_block`` (usually
    [last], or [catch-up, last]), then one per draft.  Returns (X [B, K'] int64, Q [B, K', Vd]
    fp32 or None, the block (block, cnt, cnt host list), K_b [B] int64 or None): K' = K
    unless ``_Drafts`` cut every row sooner (CPU only); a row's K_b is where its confidence
    stopped it or before its first position without a distribution (None when greedy without
    ``st.draft_confidence``: nothing cuts).  With a draft vocabulary the draft picks among its
    tokens (logits [B, N]) and Q is zero on the others.  The target's sequence logits processors
    (``st.procs``) are applied to each draft's logits with its prefix (the row's ids, the drafts
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
    pos = st.ld[:, None] + (col - first).clamp(min=0)  # [B, C]; the filler's position is unused
    new_valid = col >= first
    pos_last = st.ld + cnt - 1
    # [B, Td] valid columns; None when nothing is padding (every row's cache is full and no
    # row's block has filler), and then none is built
    dense = min(st.ld_host) == st.Td and min(cnt_host) == C
    mask = None if dense else torch.arange(st.Td, device=dev)[None, :] < st.ld[:, None]
    T = st.Td
    limit = _pos_limit(st)
    picks = _Drafts(st, K, rows, Vd)
    # the sequence processors, where the draft scores the target's whole vocabulary (else the
    # draft proposes without them: the verify does not need it to see them)
    procs = st.procs if (st.procs is not None and rows is None and Vd == st.procs.vocab_size) else None
    for j in range(K):
        if j > 0:
            ids = picks.xs[-1][:, None]
            pos = (pos_last + j)[:, None]
            new_valid = torch.ones((B, 1), dtype=torch.bool, device=dev)
        if limit is not None:
            pos = pos.clamp(max=limit)  # drafts past a row's budget or draft_cap are discarded anyway
        if mask is not None:
            mask = torch.cat([mask, new_valid], 1)
        logits = d.step(st.dc, ids, mask, pos, T, 1)[:, -1]  # [B, Vd], or [B, N] over rows
        T += ids.shape[1]
        if procs is not None:  # the target's sequence processors, at this draft's prefix
            logits = procs.draft_scores(logits, picks.xs, st.rows, st.generated)
        if picks.add(logits, j):
            break  # every row's K_b is cut before here
    st.Td = T
    st.wait = st.wait_cnt = st.wait_host = None  # taken
    X, Q, kb = picks.result()
    return X, Q, block, draft_cap(st, kb, pos_last)


def draft_with_features(f, st: "_State", K: int):
    """The feature draft ``f`` (a ``_FeatureRunner``): first the pending pairs (what the last verify made true, with the
    target's features), whose last output gives the first draft; then K - 1 pairs of its own
    (its predicted feature, its draft).  Returns (X [B, K'] int64, Q [B, K', Vd] or None,
    K_b [B] or None) as ``draft_with_model`` does; with K = 0 it only takes the pairs (the
    decoder's K = 0 steps do not call it: their pairs wait for the next step with drafts)."""
    rows = f.vocab_rows
    dev = st.device
    B = len(st.rows)
    Vd = f.vocab_size
    C = max(st.pend_cnt_host)
    cnt = st.pend_cnt
    pos = st.ld[:, None] + torch.arange(C, device=dev)[None, :]  # the draft's column = the target's
    limit = _pos_limit(st)
    if limit is not None:
        pos = pos.clamp(max=limit)
    dense = min(st.ld_host) == st.Td and min(st.pend_cnt_host) == C
    mask = None
    if not dense:
        mask = torch.cat([torch.arange(st.Td, device=dev)[None, :] < st.ld[:, None],
                          torch.arange(C, device=dev)[None, :] < cnt[:, None]], 1)  # [B, Td + C]
    st.block_start = st.Td
    h = f.step(st.dc, st.pend_tok[:, :C], st.pend_feat[:, :C], mask, pos, C)  # [B, C, H]
    fh = h.gather(1, (cnt - 1)[:, None, None].expand(B, 1, h.shape[-1]))[:, 0]  # [B, H]: each row's last
    T = st.Td + C
    picks = _Drafts(st, K, rows, Vd)
    for j in range(K):
        if j > 0:  # the pair (f^, x_j) at column ld + cnt + j - 1
            p = (st.ld + cnt + (j - 1))[:, None]
            if limit is not None:
                p = p.clamp(max=limit)
            if mask is not None:
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.bool, device=dev)], 1)
            fh = f.step(st.dc, picks.xs[-1][:, None], fh[:, None], mask, p, 1)[:, -1]
            T += 1
        if picks.add(f.head(fh), j):  # logits [B, N] over the draft vocabulary (or [B, V])
            break
    st.Td = T
    if not picks.xs:
        return None, None, None
    X, Q, kb = picks.result()
    return X, Q, draft_cap(st, kb, st.ld + cnt - 1)  # draft j from the input at ld + cnt - 1 + j


def model_wait_(st: "_State") -> None:
    """A draft model's K = 0 step: the target alone takes it and the draft runs nothing; what
    the draft has not taken ([catch-up, last] after any earlier waiting tokens) waits for its
    next step (``model_block`` puts it first)."""
    st.wait, st.wait_cnt, st.wait_host = model_block(st)
    st.catch = torch.full_like(st.catch, -1)
    st.catch_host = [False] * len(st.rows)


def model_after_verify_(st: "_State", block: tuple, Xd: torch.Tensor, n: torch.Tensor, n_host: list) -> None:
    """Roll the draft model's cache back after a verify that accepted n [B] of the drafts Xd
    [B, Kd] it fed this step (``block``: what ``draft_with_model`` returned), and note the rows
    that must catch up (they accepted all Kd, and x_Kd was drafted but never fed)."""
    Kd = Xd.shape[1]  # >= 1: the decoder calls this after a step whose draft model drafted
    # The draft fed its block (row b's cnt_b tokens ending at column T0 + C - 1), then
    # x_1 .. x_{Kd - 1} from T0 + C on: a row keeps its block and the drafts it accepted
    # among those, one contiguous run, moved down to ld_b; one move per block length.
    blk, cnt, cnt_host = block
    C = blk.shape[1]
    T0 = st.Td - (C + Kd - 1)  # the draft cache's length before this step
    total = cnt + n.clamp(min=0, max=Kd - 1)  # [B]
    for v in sorted(set(cnt_host)):
        compact_dynamic_cache_(st.dc, T0 + C - v, st.ld, torch.where(cnt == v, total, 0))
    st.ld = st.ld + total
    st.ld_host = [a + c + min(max(m, 0), Kd - 1) for a, c, m in zip(st.ld_host, cnt_host, n_host)]
    st.catch = torch.where(n == Kd, Xd[:, Kd - 1], -1)  # x_K was drafted, never fed
    st.catch_host = [m == Kd for m in n_host]


def feature_wait_(st: "_State", out: "VerifyOutput", feats: torch.Tensor) -> None:
    """A feature draft's K = 0 step: no draft forward ran, so the step's one new pair (the
    target's feature at the verified column ``feats[:, 0]``, its token) joins the row's pending
    pairs, which the next draft forward takes all at once (they are ragged across rows after
    ragged steps before)."""
    B = len(st.rows)
    C = max(st.pend_cnt_host)
    at = st.pend_cnt[:, None]  # [B, 1]: each row's first free pending slot
    tok = torch.cat([st.pend_tok[:, :C], st.pend_tok.new_zeros((B, 1))], 1)
    st.pend_tok = tok.scatter_(1, at, out.tokens[:, :1].clamp(min=0))
    fe = torch.cat([st.pend_feat[:, :C], st.pend_feat.new_zeros((B, 1, st.pend_feat.shape[2]))], 1)
    st.pend_feat = fe.scatter_(1, at[:, :, None].expand(B, 1, fe.shape[2]), feats[:, :1].to(fe.dtype))
    st.pend_cnt = st.pend_cnt + 1
    st.pend_cnt_host = [c + 1 for c in st.pend_cnt_host]
    st.waited = True


def feature_after_verify_(st: "_State", out: "VerifyOutput", feats: torch.Tensor, n: torch.Tensor,
                          n_host: list, K: int) -> None:
    """After a step with drafts, the feature draft keeps the pending pairs it took this step
    (true ones) and drops its chain; the next pending pairs are (feature at column lt + j, token
    at lt + j + 1) for j = 0 .. n_b: the accepted drafts and the target's own token (``feats``
    [B, K + 1, H]: the target's features at the K + 1 verified columns)."""
    st.waited = False
    compact_dynamic_cache_(st.dc, st.block_start, st.ld, st.pend_cnt)
    st.ld = st.ld + st.pend_cnt
    st.ld_host = [a + c for a, c in zip(st.ld_host, st.pend_cnt_host)]
    st.pend_tok = out.tokens[:, : K + 1].clamp(min=0)  # past n_b: a filler (masked), not an id
    st.pend_feat = feats.to(st.pend_feat.dtype)
    st.pend_cnt = (n + 1).clamp(min=1)
    st.pend_cnt_host = [max(m + 1, 1) for m in n_host]
