"""The state of one call (``DecodeState``), its step clock and its result.

A call's state has three parts: ``CallSettings``, what does not change during the call (K, the
sampling parameters, EOS ids, stop strings, the contexts, the device); ``CallHooks``, what the call
reports to or asks (the streamer, stopping criteria, logits processors, the trace, the progress bar,
the statistics and the clock); and ``DecodeState`` itself, what the loop carries from step to step:
the rows still decoding, their host-side sequences, the device tensors of each row (the next token,
the valid cache columns, seeds, budgets), the target's cache, and the drafter's own state
(``draft``: the ``drafters.base.DraftState`` its drafter made, with the draft's cache).  One is made
per call by ``start_state``; the loop (``loop.py``), the prefill, the drafters (``drafters/``) and
tree drafting (``tree.py``) read and update it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import torch

from ..ops.kv.cache import new_cache
from .arguments import check_context, encode_prompts, eos_ids, row_seeds, verbose_stream
from .drafters.sampling import draft_key
from .stats import TARGET_SLOPE_PRIOR, DecodingStats, StatsRecorder, cpu_slope_prior

__all__ = ["CallHooks", "CallSettings", "DecodeState", "GenerationResult", "StepClock", "start_state"]


class StepClock:
    """Wall-clock marks; on CUDA, events recorded before the step's single host sync and
    resolved after it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))  # the models' device, not the current one
            return ev
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a


# ----------------------------------------------------------------------------------------------
# Results and state
# ----------------------------------------------------------------------------------------------
@dataclass
class GenerationResult:
    """texts[p]: the generated text of prompt p (None without a tokenizer); token_ids[p]: its
    generated ids (ending with the EOS or the token that completed a stop string, if any);
    finish_reasons[p]: eos | stop (a stop string or a stopping criterion) | length | context |
    nonfinite (the target's logits, or logit / T, were NaN/inf where the row needed them, which
    includes a verify block whose drafts make the target's forward NaN; a draft's own NaN/inf
    only costs its drafts: the target decodes that position itself); stats: see DecodingStats;
    seeds[p]: row p's seed (the one drawn when ``seed=None``: passing these as ``seed`` repeats
    the run, at a fixed K)."""

    texts: Optional[list]
    token_ids: list
    stats: DecodingStats
    finish_reasons: list
    seeds: list = field(default_factory=list)

    @staticmethod
    def of(st: "DecodeState", tokenizer, stats: DecodingStats) -> "GenerationResult":
        """A finished call's result (the chain loop's and the tree path's)."""
        texts = None if tokenizer is None else [tokenizer.decode(g, skip_special_tokens=True) for g in st.generated]
        return GenerationResult(texts=texts, token_ids=st.generated, stats=stats, finish_reasons=list(st.finish),
                                seeds=list(st.settings.seeds))


@dataclass(frozen=True)
class CallSettings:
    """What does not change during a call."""

    k: Any  # int or "auto"
    k_max: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]  # min-p after top-k/top-p (None: off, or a greedy run)
    eos: frozenset
    stop: list
    max_new: int
    context: Optional[int]  # the longest sequence (prompt + generated) allowed: the target's context
    # the draft's context where it is shorter than the target's (None: not binding): a row drafts
    # only from inputs at positions < draft_context (drafters.base.draft_cap), then the target alone
    draft_context: Optional[int]
    draft_confidence: float  # a row stops drafting below this estimate of acceptance (0: off)
    device: torch.device
    seeds: tuple  # per prompt: its seed (host)
    prompt_lens: tuple


@dataclass
class CallHooks:
    """What a call reports to, or asks, outside the loop."""

    recorder: StatsRecorder  # the call's statistics and "auto"'s cost model
    clock: StepClock
    verbose: Optional[TextIO] = None  # the trace's stream
    pbar: Any = None  # tqdm's bar, or None
    streamer: Any = None  # transformers' BaseStreamer (batch 1): each step's emitted tokens
    criteria: Any = None  # a RowCriteria (transformers_adapter/criteria.py): (prompt, generated, new) -> kept, or None
    procs: Any = None  # a VerifyProcessors (transformers_adapter/processors.py): the verify's processors, or None
    grammar: Any = None  # a grammar.RowGrammars: each row's grammar matcher, or None


@dataclass
class DecodeState:
    """What the loop carries from step to step (``settings`` and ``hooks``: the rest of the call)."""

    settings: CallSettings
    hooks: CallHooks
    rows: list  # prompt index of each active row, in batch order
    seqs: list  # per prompt: prompt + generated token ids (host)
    generated: list  # per prompt: generated ids
    finish: list  # per prompt: None while active
    target_only: bool  # no draft (the baseline, or a draft retired past its context)
    # device tensors, one entry per active row
    last: torch.Tensor = None  # [B] int64: the next token to feed (emitted, not yet cached)
    target_len: torch.Tensor = None  # [B] int64: valid target-cache columns (row b's in [0, target_len_b))
    gen: torch.Tensor = None  # [B] int64: tokens generated so far
    budget: torch.Tensor = None  # [B] int64: tokens the row may generate in total
    seed: torch.Tensor = None  # [B] int64: the verifier's Philox seed
    key_lo: torch.Tensor = None  # [B] int64: the draft's counter-hash key
    key_hi: torch.Tensor = None
    step: torch.Tensor = None  # [B] int64: the row's own step counter
    # host mirrors
    target_len_host: list = field(default_factory=list)
    budget_host: list = field(default_factory=list)
    target_cache: Any = None  # the target's KV cache (a DynamicCache, left-aligned rows)
    target_columns: int = 0  # its columns (the batch's width: the longest row and the masked gaps)
    steps_done: int = 0
    prefill_time: float = 0.0
    row_params: dict = field(default_factory=dict)  # B -> fused_verify's per-row parameter tensors
    draft: Any = None  # what the drafter keeps between steps (a drafters.base.DraftState): set by start_state

    @property
    def device(self) -> torch.device:
        return self.settings.device

    def retire_draft(self) -> None:
        """Every active row is past the draft's context (it never drafts again): the rest is the
        target alone, with no draft state kept (nothing waits for a draft forward)."""
        self.target_only = True
        self.draft.retire()


def start_state(parts, call) -> DecodeState:
    """The state of a call: ``call`` (a ``call.CallArgs``, checked) against the decoder's ``parts``
    (``parts.DecoderParts``), the
    prompts encoded, the budgets and the per-row tensors allocated, the caches empty (no model
    work)."""
    rows = encode_prompts(call.prompts, call.attention_mask, parts.tokenizer, parts.vocab_size)
    context = check_context(rows, (parts.target_runner,))  # the target's: a draft's shorter one only stops drafting
    draft_context = (None if (call.target_only or parts.draft_runner is None or not parts.drafter.follows_target_cache)
                     else parts.draft_runner.context)
    if draft_context is not None and context is not None and draft_context >= context:
        draft_context = None
    B = len(rows)
    seeds = row_seeds(call.seed, B)
    eos = eos_ids(call.eos_token_id, parts.target, parts.tokenizer, parts.vocab_size)

    # Budgets: max_new_tokens, and the context (positions < context; the last emitted
    # token is never fed, so a sequence may reach context + 1 tokens).
    budgets = []
    for r in rows:
        b = call.max_new_tokens
        if context is not None:
            b = min(b, context + 1 - len(r))
        budgets.append(b)
    # no step verifies more drafts than the longest budget leaves room for (the recorder's
    # per-position lists and "auto"'s search are sized by k_max)
    k_max = max(1, min(call.k_max, max(budgets) - 1))
    pbar = None
    if call.progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=sum(budgets), unit="tok", desc="specdec", leave=False)
    dev = parts.device
    temperature = float(call.temperature)
    settings = CallSettings(
        k=call.num_draft_tokens, k_max=k_max, temperature=temperature, top_k=call.top_k,
        top_p=None if call.top_p is None else float(call.top_p),
        # min_p: None when off (0) or greedy (the verify call then skips it)
        min_p=None if not call.min_p or temperature == 0 else float(call.min_p),
        eos=frozenset(eos), stop=call.stop, max_new=call.max_new_tokens, context=context, draft_context=draft_context,
        draft_confidence=float(call.draft_confidence), device=dev, seeds=tuple(seeds),
        prompt_lens=tuple(len(r) for r in rows))
    # K = 0 steps run no draft forward (loop.step)
    recorder = StatsRecorder(k_max, parts.draft_prior if parts.draft_runner is not None else 0.0,
                             target_slope_prior=cpu_slope_prior(B) if dev.type == "cpu" else TARGET_SLOPE_PRIOR,
                             zero_step_draft_forwards=0)
    if call.target_step_s is not None:
        recorder.set_target_step(call.target_step_s)
    grammars = None
    if call.grammar is not None:
        from .grammar import row_grammars

        grammars = row_grammars(call.grammar, parts.tokenizer, parts.vocab_size, B, eos, dev)
    hooks = CallHooks(recorder=recorder, clock=StepClock(dev), verbose=verbose_stream(call.verbose), pbar=pbar,
                      streamer=call.streamer, criteria=call.criteria, procs=call.procs, grammar=grammars)
    st = DecodeState(settings=settings, hooks=hooks, rows=list(range(B)), seqs=[list(r) for r in rows],
                     generated=[[] for _ in rows], finish=[None] * B, target_only=call.target_only)
    keys = [draft_key(s) for s in seeds]
    st.seed = torch.tensor(seeds, dtype=torch.int64, device=dev)
    st.key_lo = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=dev)
    st.key_hi = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=dev)
    st.step = torch.zeros(B, dtype=torch.int64, device=dev)
    st.gen = torch.zeros(B, dtype=torch.int64, device=dev)
    st.budget = torch.tensor(budgets, dtype=torch.int64, device=dev)
    st.budget_host = budgets
    st.target_cache = new_cache(parts.target)
    st.draft = parts.drafter.new_state(st, call.target_only)  # the drafter's own state, its cache included
    # Rows with no budget (prompt already fills the context) finish before any work.
    for i, b in enumerate(budgets):
        if b <= 0:
            st.finish[i] = "context"
    if draft_context is not None and all(len(st.seqs[p]) - 1 >= draft_context for p in st.rows):
        st.retire_draft()  # no prompt leaves the draft a position to draft from
    return st
