"""A draft model with a tokenizer of its own: exact speculative decoding across vocabularies.

The draft reads the row's text, not the target's ids.  Each step, every row's ids (prompt and
emitted tokens, the target's) are decoded to text and encoded with the draft's tokenizer; the
draft's cache keeps the longest prefix of what it holds that this encoding still starts with (at
least the last token is fed again, so the draft's logits come from it), and the rest is fed, all
rows in one batched forward (the first step's is the draft's prefill of the prompts).  Then the
draft drafts K tokens, one forward each, and proposes them in one of two ways:

- ``"string"`` (any pair): the drafts' text is appended to the row's text and encoded with the
  target's tokenizer; the new target tokens, at most K, are the drafts, less the last where text
  that follows may merge into it (its text begins a longer target token) unless it is the only
  one (a proposal only costs acceptance; none at all would leave K = 1 steps, which
  ``num_draft_tokens="auto"`` takes, with nothing to verify).  They are verified as deterministic proposals
  (``draft_probs=None``): whatever proposed them, the verifier accepts x with probability p(x)
  and otherwise samples norm(max(0, p - onehot(x))), so each emitted token is distributed as
  p, at every temperature and with top-k/top-p/min-p.
- ``"intersection"``: the draft samples (or takes the argmax) among the tokens both vocabularies
  write the same way (``token_strings.intersect``), from its warped distribution restricted
  there and renormalised; each draft is one target token, and the verifier gets that whole
  distribution, over the target's ids, as q: exact, and at T > 0 more drafts are accepted than
  when a sample is only matched.  (Its mutant, q left unnormalised over the intersection, is
  caught by the tests' chi-square.)

``vocabulary="auto"``: the string level for a greedy call (a greedy verify takes any
proposal as one-hot, and the target's own tokens of the drafted text are what it emits: a word
the target writes as one token, ``_prime``, is two shared tokens, ``_`` ``prime``, which the
target rejects); when sampling, the intersection when the draft's next-token probability
(T = 1, unwarped) on the shared tokens at the start of a text (after its BOS, else its EOS) is
at least ``AUTO_MIN_MASS``, decided once per drafter from the draft alone (a choice made from a
call's prompts would make a seeded row's tokens depend on the other rows), else the string
level.  What the draft reads never changes the output's law, only how many drafts are
accepted: text its tokenizer cannot write (an unknown character) costs acceptance only.

A row whose text grows past the draft's context stops drafting (the target decodes it alone;
when every row has, the draft retires).

Costs beside the draft's forwards: each step decodes every row's whole text and encodes it
again (O(length) on the host, batched tokenizer calls), and reads the drafts on the host (one
more device-to-host copy a step than a draft over the target's vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from ...ops.kv.cache import compact_dynamic_cache_, crop_cache_, new_cache
from .base import CachedDraftState, Drafter, DraftPicker, Drafts
from .token_strings import Intersection, extendable, intersect, token_keys

__all__ = ["AUTO_MIN_MASS", "CrossDraftState", "CrossVocabDrafter", "VOCABULARIES"]

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodeState

VOCABULARIES = ("auto", "shared", "intersection", "string")
AUTO_MIN_MASS = 0.5  # "auto": the intersection when the draft's mass on it is at least this
_TAIL = 8  # tokens of context decoded around the drafts' text (a word's start, a space marker)
_TEXT = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class CrossDraftState(CachedDraftState):
    """The cross-vocabulary draft's state: its cache (made at its first forward: the loop's
    prefill, which feeds the target's ids, never fills it), each row's draft ids in its columns
    [0, cache_len_b), the way chosen for this call, and what the step fed until after_verify."""

    held: list = field(default_factory=list)  # per row: the draft ids cached
    stopped: list = field(default_factory=list)  # per row: past the draft's context, drafts no more
    vocabulary: Optional[str] = None  # "intersection" | "string" once chosen
    model: Any = None  # the draft model (its cache is made at the first draft)
    fed: Any = None  # (the rows' encodings, the step's draft ids [B, K'] host) until after_verify
    waited: bool = False  # a K = 0 step since the last draft: the next sync feeds what it emitted too

    ROW_LISTS = CachedDraftState.ROW_LISTS + ("held", "stopped")

    def begin(self, st: "DecodeState", columns: int) -> None:
        B = len(st.rows)
        self.cache_len_host = [0] * B
        self.cache_len = torch.zeros(B, dtype=torch.int64, device=st.device)
        self.columns = 0
        self.held = [[] for _ in range(B)]
        self.stopped = [False] * B

    def holds_waiting(self) -> bool:
        return self.waited

    def crop(self) -> None:
        if self.cache is not None and self.cache_len_host:
            self.columns = max(self.cache_len_host)
            crop_cache_(self.cache, self.columns)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CrossVocabDrafter(Drafter):
    """A draft model over its own tokenizer (``runner``: its ``ModelRunner``), drafting for a
    target with another (see the module docstring).  vocabulary: "auto", "intersection" or
    "string"; target_vocab_size: the target model's (its output layer's rows)."""

    name = "model"
    follows_target_cache = False

    def __init__(self, runner, draft_tokenizer, target_tokenizer, vocabulary: str, target_vocab_size: int):
        if vocabulary not in ("auto", "intersection", "string"):
            raise ValueError(f"vocabulary must be 'auto', 'intersection' or 'string' for a draft over another "
                             f"tokenizer, got {vocabulary!r}")
        self.runner, self.draft_tokenizer, self.target_tokenizer = runner, draft_tokenizer, target_tokenizer
        self.vocabulary, self.target_vocab_size = vocabulary, target_vocab_size
        self.intersection: Optional[Intersection] = None
        self._on: dict = {}  # device -> the intersection's tensors there
        keys = token_keys(target_tokenizer, target_vocab_size)
        draft_keys = token_keys(draft_tokenizer, runner.vocab_size)
        if not any(k is not None and k[0] == "text" and k[1] for k in draft_keys):
            raise ValueError(f"draft_tokenizer must write text for the draft's tokens, got a "
                             f"{type(draft_tokenizer).__name__} none of whose {runner.vocab_size} ids is a token "
                             f"with text")
        self.extendable = extendable(keys)  # target ids that text which follows may merge into
        if vocabulary != "string":
            self.intersection = intersect(draft_tokenizer, target_tokenizer, runner.vocab_size, target_vocab_size,
                                          keys, draft_keys)
            if self.intersection.size == 0 and vocabulary == "intersection":
                raise ValueError("vocabulary='intersection' needs tokens that both tokenizers write the same way, "
                                 "got none in common (use vocabulary='string')")
        fallback = [draft_tokenizer.bos_token_id, draft_tokenizer.eos_token_id, 0]
        self.fallback = next(i for i in fallback if i is not None)  # the context of a row with no text
        self._chosen: Optional[str] = None if vocabulary == "auto" else vocabulary

    def chosen(self, device) -> str:
        """The way this drafter proposes: "auto" decided once, from the draft alone (module
        docstring), so that a row's tokens never depend on the other rows of a call."""
        if self._chosen is None:
            if self.intersection.size == 0:
                self._chosen = "string"
            else:
                ids = torch.tensor([[self.fallback]], dtype=torch.int64, device=device)
                pos = torch.zeros((1, 1), dtype=torch.int64, device=device)
                with torch.inference_mode():
                    logits = self.runner.forward(new_cache(self.runner.model), ids, None, pos, 0, 1)[:, -1]
                d_ids = self._tensors(device)[0]
                mass = float(torch.softmax(logits.float(), -1).index_select(1, d_ids).sum())
                self._chosen = "intersection" if mass >= AUTO_MIN_MASS else "string"
        return self._chosen

    def new_state(self, st: "DecodeState", target_only: bool) -> CrossDraftState:
        return CrossDraftState(model=None if target_only else self.runner.model,
                               vocabulary=None if target_only else
                               "string" if self.vocabulary == "auto" and st.settings.temperature == 0 else
                               self.chosen(st.device))

    def describe(self, st: "DecodeState") -> dict:
        size = None if self.intersection is None else self.intersection.size
        return {"vocabulary": getattr(st.draft, "vocabulary", None), "intersection_size": size}

    def _tensors(self, device):
        got = self._on.get(device)
        if got is None:
            i = self.intersection
            got = self._on[device] = (i.draft_ids.to(device), i.target_ids.to(device), i.target_to_draft.to(device))
        return got

    def _encode(self, st: "DecodeState") -> list:
        """Each active row's text (the target's ids decoded) encoded with the draft's tokenizer."""
        texts = self.target_tokenizer.batch_decode([st.seqs[p] for p in st.rows], **_TEXT)
        encs = self.draft_tokenizer(texts, add_special_tokens=True)["input_ids"]
        V = self.runner.vocab_size  # an added token past the draft's embedding reads as the fallback
        return [[i if i < V else self.fallback for i in e] if len(e) else [self.fallback] for e in encs]

    def _sync(self, st: "DecodeState", K: int) -> tuple:
        """Bring each row's cache to its text: keep the longest held prefix (less its last
        token), feed the rest but the last token in one forward, compacted down; returns the
        encodings and the number of forwards run (0 or 1).  A row whose text leaves no room for
        K drafts in the draft's context stops."""
        s, dev = st.draft, st.device
        B = len(st.rows)
        encs = self._encode(st)
        ctx = self.runner.context
        keep, new = [], []
        for b, e in enumerate(encs):
            if s.stopped[b] or (ctx is not None and len(e) + K > ctx):
                s.stopped[b] = True
                keep.append(0)
                new.append([])
                continue
            m = min(_common_prefix(s.held[b][:s.cache_len_host[b]], e), len(e) - 1)
            keep.append(m)
            new.append(e[m:-1])
        s.cache_len_host = keep
        s.cache_len = torch.tensor(keep, dtype=torch.int64, device=dev)
        s.held = [e[:m] for e, m in zip(encs, keep)]
        crop_cache_(s.cache, max(keep))
        s.columns = max(keep)
        C = max(len(x) for x in new)
        if C == 0:
            return encs, 0
        # The rows' new tokens left-aligned at columns T0 .. T0 + C - 1, filler after them (its
        # queries see the row's tokens: never a fully masked one, which would write NaN); a row
        # with nothing before its filler sees its first filler column for this forward only.
        T0 = s.columns
        ids = torch.full((B, C), self.fallback, dtype=torch.int64)
        for b, x in enumerate(new):
            if x:
                ids[b, :len(x)] = torch.tensor(x)
        cnt_host = [len(x) for x in new]
        cnt = torch.tensor(cnt_host, dtype=torch.int64, device=dev)
        col = torch.arange(C, device=dev)[None, :]
        valid = col < cnt[:, None]
        lonely = (cnt == 0) & (s.cache_len == 0)
        valid = valid | (lonely[:, None] & (col == 0))
        mask = torch.cat([torch.arange(T0, device=dev)[None, :] < s.cache_len[:, None], valid], 1)
        pos = s.cache_len[:, None] + col
        if ctx is not None:
            pos = pos.clamp(max=ctx - 1)
        self.runner.forward(s.cache, ids.to(dev), mask, pos, T0, 1)
        compact_dynamic_cache_(s.cache, T0, s.cache_len, cnt)
        s.cache_len = s.cache_len + cnt
        s.cache_len_host = [a + c for a, c in zip(keep, cnt_host)]
        s.held = [h + x for h, x in zip(s.held, new)]
        s.columns = max(s.cache_len_host)
        crop_cache_(s.cache, s.columns)
        return encs, 1

    def draft(self, st: "DecodeState", K: int) -> Drafts:
        s, dev = st.draft, st.device
        B = len(st.rows)
        if s.cache is None:
            s.cache = new_cache(self.runner.model)
        s.waited = False
        # the sync's forward counts as a draft forward: StatsRecorder's time per draft forward
        # (num_draft_tokens="auto") is the step's draft time over all the forwards it ran
        encs, forwards = self._sync(st, K)
        if all(s.stopped):  # every row is past the draft's context: the target alone from here
            st.target_only = True
            s.retire()
            zeros = torch.zeros(B, dtype=torch.int64, device=dev)
            return Drafts(zeros[:, None][:, :0], None, zeros, 0)
        ctx = self.runner.context
        ids = torch.tensor([e[-1] for e in encs], dtype=torch.int64, device=dev)[:, None]  # [B, 1]
        pos0 = s.cache_len.clone()
        picks = None
        d_ids = t_ids = t2d = None
        T = s.columns
        mask = torch.arange(T, device=dev)[None, :] < s.cache_len[:, None]  # [B, T]
        for j in range(K):
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.bool, device=dev)], 1)
            pos = (pos0 + j)[:, None]
            if ctx is not None:
                pos = pos.clamp(max=ctx - 1)
            logits = self.runner.step(s.cache, ids, mask, pos, T, 1)[:, -1]  # [B, Vd]
            T += 1
            forwards += 1
            if picks is None:
                if s.vocabulary == "intersection":
                    d_ids, t_ids, t2d = self._tensors(dev)
                    picks = DraftPicker(st, K, t_ids, self.target_vocab_size)
                else:
                    picks = DraftPicker(st, K, None, logits.shape[-1])
            if d_ids is not None:  # the shared tokens' logits [B, N], in the target's ids t_ids
                logits = logits.index_select(1, d_ids)
                if st.hooks.grammar is not None:  # the shared tokens the rows' grammars allow: q masked
                    logits = st.hooks.grammar.mask_draft(logits, picks.xs, st.rows, st.generated,
                                                         self.target_vocab_size, t_ids)
            cut = picks.add(logits, j)
            x = picks.xs[-1]
            ids = (x if t2d is None else t2d[x])[:, None]  # the draft's own id of its pick
            if cut:
                break
        s.columns = T
        X, Q, kb = picks.result()
        drafted = X if t2d is None else t2d[X]  # [B, K'] the draft's ids
        d_host = drafted.tolist()
        s.fed = (encs, d_host)
        num = kb if kb is not None else torch.full((B,), X.shape[1], dtype=torch.int64, device=dev)
        stop = torch.tensor(s.stopped, device=dev)
        num = torch.where(stop, 0, num)
        if s.vocabulary == "intersection":
            return Drafts(X, Q, num, forwards)
        return self._string_drafts(st, encs, d_host, num.tolist(), K, forwards, Q)

    def _string_drafts(self, st: "DecodeState", encs: list, d_host: list, num: list, K: int, forwards: int,
                       q: Optional[torch.Tensor] = None) -> Drafts:
        """The target's tokens for each row's drafted text (module docstring), as one-hot drafts.
        q [B, K', Vd] (or None when greedy): the distributions the draft's own tokens were drawn
        from; the target's tokens were not drawn from them, so they are not reported (the tests'
        mutant reports them)."""
        dt, tt = self.draft_tokenizer, self.target_tokenizer
        live = [b for b in range(len(st.rows)) if num[b] > 0]
        props: list = [[] for _ in st.rows]
        if live:  # each tokenizer call batched over the rows
            tails = [encs[b][-_TAIL:] for b in live]
            drafts = [d_host[b][:num[b]] for b in live]
            bases = dt.batch_decode(tails, **_TEXT)
            fulls = dt.batch_decode([t + d for t, d in zip(tails, drafts)], **_TEXT)
            texts = [f[len(a):] if f.startswith(a) else dt.decode(d, **_TEXT)
                     for a, f, d in zip(bases, fulls, drafts)]
            texts = [x.rstrip("\ufffd") for x in texts]  # a character the drafts end inside of
            t_tails = [st.seqs[st.rows[b]][-_TAIL:] for b in live]
            t_bases = tt.batch_decode(t_tails, **_TEXT)
            encoded = tt([a + x for a, x in zip(t_bases, texts)], add_special_tokens=False)["input_ids"]
            for b, t_tail, enc, text in zip(live, t_tails, encoded, texts):
                # the tail must encode to itself, else the text alone (a rare boundary case)
                new = (enc[len(t_tail):] if enc[:len(t_tail)] == t_tail
                       else tt(text, add_special_tokens=False)["input_ids"])
                if len(new) > 1 and new[-1] in self.extendable:
                    new = new[:-1]  # text that follows may merge into it (kept when it is the only one)
                new = new[:K]
                bad = [j for j, t in enumerate(new) if t >= self.target_vocab_size]
                props[b] = new[:bad[0]] if bad else new  # a token past the target's rows ends them
        if st.hooks.grammar is not None:  # only what each row's grammar allows
            props = st.hooks.grammar.allowed_proposals(props, st.rows, st.generated)
        width = max(len(x) for x in props)
        X = torch.tensor([x + [0] * (width - len(x)) for x in props], dtype=torch.int64).reshape(len(props), width)
        n = torch.tensor([len(x) for x in props], dtype=torch.int64)
        return Drafts(X.to(st.device), None, n.to(st.device), forwards)

    def after_verify(self, st, out, feats, n, n_host, K) -> None:
        """Keep what the draft fed this step (the last token of its text, its drafts but the
        last), compacted after its held prefix: the next step keeps what the accepted text
        still starts with."""
        s = st.draft
        if s.fed is None:  # the draft retired this step (every row past its context)
            return
        (encs, d_host), s.fed = s.fed, None
        Kd = len(d_host[0]) if d_host else 0
        fed = [0 if stop else Kd for stop in s.stopped]
        count = torch.tensor(fed, dtype=torch.int64, device=st.device)
        compact_dynamic_cache_(s.cache, s.columns - Kd, s.cache_len, count)
        s.cache_len = s.cache_len + count
        s.cache_len_host = [a + c for a, c in zip(s.cache_len_host, fed)]
        s.held = [h if stop else h + [e[-1]] + d[:Kd - 1] for h, e, d, stop in zip(s.held, encs, d_host, s.stopped)]

    def wait(self, st, out, feats) -> None:
        """A K = 0 step feeds nothing: the next step reads the row's text again, and its sync
        feeds what this step emitted (``holds_waiting``: not a typical draft time)."""
        st.draft.waited = True
