"""The state of one ``generate`` call (``DecodeState``), its step clock and its result.

``DecodeState`` holds what the loop carries from step to step: the rows still decoding, their
host-side sequences, the device tensors of each row (the next token, the valid cache columns,
seeds, budgets), the target's cache, and the drafter's own state (``draft``: the
``drafters.base.DraftState`` its drafter made, with the draft's cache).  One is made per call by
``SpeculativeDecoder._start``; the loop (``decoder``), the prefill, the drafters
(``drafters/model.py``, ``drafters/feature.py``) and tree drafting (``tree``) read and update it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import torch

from ..ops.kv.cache import new_cache
from .arguments import (as_float, as_int, check_context, check_generate_args, encode_prompts, eos_ids, row_seeds,
                        verbose_stream)
from .drafters.sampling import draft_key
from .stats import TARGET_SLOPE_PRIOR, DecodingStats, StatsRecorder, cpu_slope_prior

__all__ = ["DecodeState", "GenerationResult", "StepClock", "start_state"]


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


@dataclass
class DecodeState:
    rows: list  # prompt index of each active row, in batch order
    seqs: list  # per prompt: prompt + generated token ids (host)
    prompt_lens: list
    generated: list  # per prompt: generated ids
    finish: list  # per prompt: None while active
    k: Any  # int or "auto"
    k_max: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    eos: set
    stop: list
    max_new: int
    context: Optional[int]  # the longest sequence (prompt + generated) allowed: the target's context
    target_only: bool  # no draft (the baseline, or a draft retired past its context)
    recorder: StatsRecorder
    clock: StepClock
    verbose: Optional[TextIO]
    pbar: Any
    device: torch.device
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
    draft_confidence: float = 0.0  # a row stops drafting below this estimate of acceptance (0: off)
    # the draft's context where it is shorter than the target's (None: not binding): a row drafts
    # only from inputs at positions < draft_context (drafters.base.draft_cap), then the target alone
    draft_context: Optional[int] = None
    seeds: list = field(default_factory=list)  # per prompt: its seed (host)
    row_params: dict = field(default_factory=dict)  # B -> fused_verify's per-row parameter tensors
    streamer: Any = None  # transformers' BaseStreamer (batch 1): each step's emitted tokens
    criteria: Any = None  # transformers_rows.RowCriteria: (prompt, generated, new) -> new tokens kept, or None
    procs: Any = None  # logits_processors.VerifyProcessors: the verify logits' sequence processors, or None
    min_p: Optional[float] = None  # min-p after top-k/top-p (None: off, or a greedy run)
    draft: Any = None  # what the drafter keeps between steps (a drafters.base.DraftState): set by start_state


def start_state(dec, prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed, stop,
                verbose, attention_mask, max_draft_tokens, eos_token_id, progress, target_only,
                draft_confidence: float = 0.0, min_p: Optional[float] = None) -> DecodeState:
    """The state of a ``generate`` call of decoder ``dec``: every argument validated, the prompts
    encoded, the budgets and the per-row tensors allocated, the caches empty (no model work)."""
    # NumPy (or other Integral / Real) scalars as Python ones; anything else is refused below
    max_new_tokens, num_draft_tokens, top_k, max_draft_tokens = (
        as_int(v) for v in (max_new_tokens, num_draft_tokens, top_k, max_draft_tokens))
    temperature, top_p, draft_confidence, min_p = (as_float(v) for v in (temperature, top_p, draft_confidence,
                                                                         min_p))
    k_max, stop = check_generate_args(max_new_tokens, num_draft_tokens, temperature, top_k, top_p, stop,
                                      max_draft_tokens, draft_confidence, drafter=dec.drafter,
                                      has_draft=dec._d is not None, has_tokenizer=dec.tokenizer is not None,
                                      min_p=min_p)
    rows = encode_prompts(prompts, attention_mask, dec.tokenizer, dec._t.vocab_size)
    context = check_context(rows, (dec._t,))  # the target's: a draft's shorter one only stops drafting
    draft_context = (None if (target_only or dec._d is None or not dec._drafter.follows_target_cache)
                     else dec._d.context)
    if draft_context is not None and context is not None and draft_context >= context:
        draft_context = None
    B = len(rows)
    seeds = row_seeds(seed, B)
    verbose = verbose_stream(verbose)
    eos = eos_ids(eos_token_id, dec.target, dec.tokenizer, dec._t.vocab_size)

    # Budgets: max_new_tokens, and the context (positions < context; the last emitted
    # token is never fed, so a sequence may reach context + 1 tokens).
    budgets = []
    for r in rows:
        b = max_new_tokens
        if context is not None:
            b = min(b, context + 1 - len(r))
        budgets.append(b)
    # no step verifies more drafts than the longest budget leaves room for (the recorder's
    # per-position lists and "auto"'s search are sized by k_max)
    k_max = max(1, min(k_max, max(budgets) - 1))
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=sum(budgets), unit="tok", desc="specdec", leave=False)
    dev = dec.device
    keys = [draft_key(s) for s in seeds]
    st = DecodeState(
        rows=list(range(B)), seqs=[list(r) for r in rows], prompt_lens=[len(r) for r in rows],
        generated=[[] for _ in rows], finish=[None] * B,
        k=num_draft_tokens, k_max=k_max, temperature=float(temperature), top_k=top_k,
        top_p=None if top_p is None else float(top_p), eos=eos,
        # min_p: None when off (0) or greedy (the verify call then skips it)
        min_p=None if not min_p or temperature == 0 else float(min_p),
        stop=stop,
        max_new=max_new_tokens, context=context, target_only=target_only,
        # K = 0 steps run no draft forward (see _step)
        recorder=StatsRecorder(k_max, dec._t_draft_prior if dec._d is not None else 0.0,
                               target_slope_prior=cpu_slope_prior(B) if dev.type == "cpu" else TARGET_SLOPE_PRIOR,
                               zero_step_draft_forwards=0),
        clock=StepClock(dev), verbose=verbose, pbar=pbar, device=dev, draft_confidence=float(draft_confidence),
        draft_context=draft_context, seeds=seeds,
    )
    st.seed = torch.tensor(seeds, dtype=torch.int64, device=dev)
    st.key_lo = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=dev)
    st.key_hi = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=dev)
    st.step = torch.zeros(B, dtype=torch.int64, device=dev)
    st.gen = torch.zeros(B, dtype=torch.int64, device=dev)
    st.budget = torch.tensor(budgets, dtype=torch.int64, device=dev)
    st.budget_host = budgets
    st.target_cache = new_cache(dec.target)
    st.draft = dec._drafter.new_state(st, target_only)  # the drafter's own state, its cache included
    # Rows with no budget (prompt already fills the context) finish before any work.
    for i, b in enumerate(budgets):
        if b <= 0:
            st.finish[i] = "context"
    return st
