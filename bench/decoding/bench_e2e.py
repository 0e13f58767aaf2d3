"""End-to-end benchmark: what speculative decoding is for (STYLE item 17).

On the same prompts, seeds, max_new_tokens, dtype and device, for one draft/target pair:

  target_hf            the target alone with its KV cache: Hugging Face ``target.generate``
                       (greedy: do_sample=False; sampling: do_sample=True, temperature=T,
                       top_k=0, top_p=--top-p (1 by default), so no hidden warp)
  assisted_hf          Hugging Face assisted generation, ``target.generate(assistant_model=draft)``;
                       batch 1 only (transformers refuses batches).  Fixed K: the assistant's
                       num_assistant_tokens=K, num_assistant_tokens_schedule="constant",
                       assistant_confidence_threshold=0 (no early stop, so every step drafts K).
                       K="auto": transformers' own default dynamic schedule, untouched.
  hook_hf              ``target.generate(assistant_model=draft, custom_generate=specdec_kernels.hf.generate)``:
                       transformers' own call with this package's hook (batch 1 and 8); fixed K:
                       num_assistant_tokens=K, schedule "constant", assistant_confidence_threshold=0;
                       K="auto": transformers' default schedule, which the hook maps to K="auto"
  specdec              ``SpeculativeDecoder.generate`` with K in --ks (fixed K or "auto")
  specdec_feature      the same with ``drafter="feature"`` (a draft that reads the target's hidden
                       states; the embedded one, or --feature-draft DIR) at K in --feature-ks
                       (none by default; plotted at the K values --ks shares)
  specdec_target_only  ``SpeculativeDecoder.generate_target_only``: the decoder's own loop with
                       no drafts, which separates the loop's overhead from speculation

for greedy and temperature 1, at batch 1 (each prompt alone, one after the other) and batch 8
(the 8 prompts as one batch).  EOS is ignored by default (--eos ignore) so every method
generates exactly max_new_tokens per prompt; --eos stop lets rows end at EOS.

Reported per configuration: tokens/s (generated tokens / wall time, the median over --repeats
timed runs after one untimed warm-up, methods interleaved run by run so that load on a shared
machine falls on all of them alike), the speed-ups over the target alone and over assisted
generation at the same K (ratios of tokens/s measured in this run, STYLE item 18), alpha, mean
tokens per target call, the accepted-length histogram, and the speed-up the model of
``specdec_kernels.decoding.stats`` predicts from the measured alpha and step times,
E(K) * T_target(0) / (K * T_draft + T_target(K)), E(K) = (1 - alpha^(K+1)) / (1 - alpha), with
T_target(K) the decoder's line fitted to its verify steps per verified length
(predicted_speedup: each generate call's ``stats.predicted_speedup``, averaged over the calls
weighted by their tokens), and the same from this run's direct measurements,
E(K) * T_1 / (K * T_draft + T_verify) with T_1 the one-token step of specdec_target_only and
T_verify the run's mean verify step (predicted_speedup_t1).

Greedy check: at temperature 0 the token ids of every method must equal the target alone's,
prompt by prompt.  Where they do not, the differing prompts are printed and no speed-up is
reported for that (batch, K) configuration: its speed-up cells read REFUSED.

    python bench/decoding/bench_e2e.py                                  # the embedded pair
    python bench/decoding/bench_e2e.py --ks 2,auto --feature-ks 2,auto  # + its feature draft
    python bench/decoding/bench_e2e.py --draft D --target T --out bench/results/gpu
    python bench/decoding/bench_e2e.py --quick --out /tmp/e2e           # smoke run, tiny random pair
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
# The repository root, for a checkout whose package is not pip-installed (an installed one wins).
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from harness import append_csv, device_name, now, print_table, versions  # noqa: E402

from specdec_kernels import SpeculativeDecoder  # noqa: E402
from specdec_kernels.cli import parse_k  # noqa: E402  (the same K syntax as `specdec -k`)
from specdec_kernels.cpu.skinny_linear import use_skinny_linear  # noqa: E402
from specdec_kernels.decoding.stats import predicted_speedup  # noqa: E402

# Eight distinct prompts of varied length (a few tokens to about 150), plain text (no chat
# template), the same for every method.
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Question: If a train travels at 60 miles per hour for 2.5 hours, how far does it go?\nAnswer:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n',
    "Here is a list of the planets of the solar system, in order from the Sun:\n1.",
    "Explain to a ten-year-old, in simple words, why the sky is blue during the day and red at sunset.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never left the valley. Every morning he opened his shop, wound the hundred clocks on its "
    "walls, and waited for the travellers who came to have their watches mended. One winter evening, "
    "a stranger knocked at his door carrying a clock that had no hands.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy "
    "into chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light. The "
    "energy splits water molecules, releasing oxygen, and drives the production of ATP and NADPH. In "
    "the Calvin cycle these carriers are used to fix carbon dioxide from the air into sugars, which "
    "the plant uses to grow and to store energy. Nearly all life on Earth depends on this process, "
    "directly or indirectly, for food and for the oxygen in the atmosphere.\n\n"
    "Summarise the passage above in one sentence:",
]

METHODS = ["target_hf", "assisted_hf", "hook_hf", "specdec", "specdec_target_only"]
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
NA_BATCH = "n/a (batch 1 only)"
REFUSED = "REFUSED"
SPECDEC = ("specdec", "specdec_feature", "specdec_block", "specdec_tree")  # the speculative methods (a draft
#                                          model; the feature draft; block verification; tree drafting)


# ----------------------------------------------------------------------------------------------
# The pair
# ----------------------------------------------------------------------------------------------
def load_pair(args, device: torch.device, dtype: torch.dtype):
    """(draft, target, tokenizer, pair name), both models on ``device`` in ``dtype``, eval mode."""
    if args.tiny_random:
        from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair

        draft, target, tok = build_tiny_random_pair(seed=0)
        name = "tiny-random (2-layer Llama, char tokenizer; draft = target + noise 0.02)"
    elif args.draft or args.target:
        if not (args.draft and args.target):
            raise SystemExit("--draft and --target go together (or neither: the embedded pair)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype)
        name = (f"{os.path.basename(os.path.normpath(args.target))} + draft "
                f"{os.path.basename(os.path.normpath(args.draft))}")
    else:
        try:
            from specdec_kernels.models.embedded import TARGET_NAME, default_pair
        except ImportError as e:
            raise SystemExit(f"the embedded pair is not available ({e}); pass --draft/--target or --tiny-random")
        draft, target, tok = default_pair(device=device, dtype=dtype)
        name = f"embedded: {TARGET_NAME} + shipped distilled draft"
    draft.to(device=device, dtype=dtype)
    target.to(device=device, dtype=dtype)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return draft.eval(), target.eval(), tok, name


def model_size(model) -> str:
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e6:.1f}M params, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"


# ----------------------------------------------------------------------------------------------
# One run of a method over the prompts
# ----------------------------------------------------------------------------------------------
@dataclass
class RunOut:
    token_ids: list  # per prompt: the generated ids
    seconds: float  # wall time of the whole run (all prompts)
    stats: Optional[list] = None  # DecodingStats per generate call (SpeculativeDecoder only)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trim(ids: list, eos: set) -> list:
    """HF pads finished rows after EOS; keep the ids up to and including the first EOS."""
    for j, t in enumerate(ids):
        if t in eos:
            return ids[: j + 1]
    return ids


@contextlib.contextmanager
def generation_settings(model, **values):
    """Set fields of ``model.generation_config`` for the duration (restored after)."""
    gc = model.generation_config
    old = {k: getattr(gc, k, None) for k in values}
    for k, v in values.items():
        setattr(gc, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(gc, k, v)


class Bench:
    def __init__(self, draft, target, tok, device, prompt_ids, max_new, eos_mode, seed, linear="auto",
                 lean_forward=True, top_p=1.0):
        self.draft, self.target, self.tok, self.device = draft, target, tok, device
        self.prompt_ids = prompt_ids  # list of list of ints
        self.max_new = max_new
        self.seed = seed
        self.top_p = float(top_p)  # every sampling method's nucleus (1 = off); greedy ignores it
        self.batch1_prompts = None  # batch 1 decodes the first N prompts only (None: all)
        self.pad = tok.pad_token_id
        self.dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok, cpu_linear=linear,
                                      lean_forward=lean_forward)
        # Every method runs the models' linear layers the same way: the decoder's choice
        # ("skinny" on fp32 CPU by default) is applied to the Hugging Face methods too, and
        # target_hf_torch_linear times the target alone with torch's own linear besides.
        self.linear = self.dec.cpu_linear
        gc_eos = target.generation_config.eos_token_id
        if gc_eos is None:
            gc_eos = tok.eos_token_id
        self.eos_ids = set([gc_eos] if isinstance(gc_eos, int) else list(gc_eos or []))
        self.ignore_eos = eos_mode == "ignore"
        # SpeculativeDecoder: an empty EOS set never stops a row; None uses the model's EOS.
        self.dec_eos = [] if self.ignore_eos else None
        self.fdec = None  # SpeculativeDecoder(drafter="feature"), when a feature draft is benchmarked

    def use_feature_draft(self, directory, linear="auto", lean_forward=True) -> None:
        """Also benchmark the feature draft in ``directory`` (trained for this target)."""
        self.fdec = SpeculativeDecoder(draft=str(directory), target=self.target, tokenizer=self.tok,
                                       drafter="feature", cpu_linear=linear, lean_forward=lean_forward)

    # -- Hugging Face -------------------------------------------------------------------------
    def _hf_kwargs(self, temperature: float) -> dict:
        kw = dict(max_new_tokens=self.max_new, min_new_tokens=0, pad_token_id=self.pad, num_beams=1,
                  repetition_penalty=1.0)
        if temperature == 0:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=self.top_p, min_p=None,
                      typical_p=1.0)
        return kw

    def _hf_eos(self):
        """While timing HF with --eos ignore, no EOS on either model (restored after)."""
        if not self.ignore_eos:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(generation_settings(self.target, eos_token_id=None))
        stack.enter_context(generation_settings(self.draft, eos_token_id=None))
        return stack

    def _linear_layers(self, stock: bool):
        if stock or self.linear != "skinny":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for m in (self.target, self.draft):
            stack.enter_context(use_skinny_linear(m))
        return stack

    def hf(self, batch: int, temperature: float, assistant_cfg: Optional[dict], stock_linear: bool = False,
           hook: bool = False) -> RunOut:
        """target.generate: alone (assistant_cfg None), HF assisted generation, or with
        ``custom_generate=specdec_kernels.hf.generate`` (hook: the assistant's K passed as
        generate's own num_assistant_tokens fields)."""
        kw = self._hf_kwargs(temperature)
        out_ids = []
        with torch.inference_mode(), self._hf_eos(), self._linear_layers(stock_linear), (
                generation_settings(self.draft, **assistant_cfg) if assistant_cfg is not None and not hook
                else contextlib.nullcontext()):
            if assistant_cfg is not None:
                kw["assistant_model"] = self.draft
            if hook:
                from specdec_kernels import hf as hf_hook

                kw.update(custom_generate=hf_hook.generate, **(assistant_cfg or {}))
            _sync(self.device)
            t0 = time.perf_counter()
            for chunk in self._chunks(batch):
                ids, mask = self._left_padded(chunk)
                torch.manual_seed(self.seed + chunk[0])  # batch 1: prompt p gets seed + p
                out = self.target.generate(input_ids=ids, attention_mask=mask, **kw)
                for r in range(len(chunk)):
                    out_ids.append(out[r, ids.shape[1]:].tolist())
            _sync(self.device)
            seconds = time.perf_counter() - t0
        if not self.ignore_eos:
            out_ids = [_trim(x, self.eos_ids) for x in out_ids]
        return RunOut(out_ids, seconds)

    def _chunks(self, batch: int) -> list:
        idx = list(range(len(self.prompt_ids)))
        if batch == 1 and self.batch1_prompts is not None:
            idx = idx[: self.batch1_prompts]
        return [idx[i: i + batch] for i in range(0, len(idx), batch)]

    def _left_padded(self, chunk: list):
        rows = [self.prompt_ids[p] for p in chunk]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(rows), T), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, T - len(r):] = torch.tensor(r)
            mask[i, T - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    # -- SpeculativeDecoder --------------------------------------------------------------------
    def _top_p(self):
        return None if self.top_p >= 1.0 else self.top_p

    def specdec(self, batch: int, temperature: float, k, target_only: bool = False, feature: bool = False,
                block: bool = False, tree: Optional[str] = None) -> RunOut:
        """SpeculativeDecoder's loop (``block``: with verification="block"; ``tree``: with that tree
        shape, ``decoding.tree.parse_tree``'s spelling; the same decoder)."""
        import dataclasses

        from specdec_kernels.decoding.tree import parse_tree

        dec = self.fdec if feature else self.dec
        dec.parts = dataclasses.replace(dec.parts, verification="block" if block else "token", tree=parse_tree(tree))
        out_ids, stats = [], []
        _sync(self.device)
        t0 = time.perf_counter()
        for chunk in self._chunks(batch):
            prompts = [self.prompt_ids[p] for p in chunk]
            seeds = [self.seed + p for p in chunk]  # the same row seeds at batch 1 and batch 8
            if target_only:
                res = self.dec.generate_target_only(prompts, max_new_tokens=self.max_new, temperature=temperature,
                                                    top_p=self._top_p(), seed=seeds, eos_token_id=self.dec_eos)
            else:
                kk, conf = split_k(k)
                res = dec.generate(prompts, max_new_tokens=self.max_new, num_draft_tokens=kk,
                                   temperature=temperature, top_p=self._top_p(), seed=seeds,
                                   eos_token_id=self.dec_eos, max_draft_tokens=8, draft_confidence=conf)
            out_ids.extend(res.token_ids)
            stats.append(res.stats)
        _sync(self.device)
        return RunOut(out_ids, time.perf_counter() - t0, stats)


def assistant_config(k) -> dict:
    """The assistant's generation-config fields set for assisted generation at K ({}: HF's
    defaults, the assistant still used; ``hf`` runs the target alone only for None).
    'K@c': K tokens at most, and HF's own confidence stop at c (``assistant_confidence_threshold``:
    it stops when one draft's probability is below c; ours when the product of them is)."""
    k, conf = split_k(k)
    if k == "auto":  # (returned None before 2026-12-01: "HF auto" was the target alone)
        return {} if conf == 0 else dict(assistant_confidence_threshold=conf)
    return dict(num_assistant_tokens=int(k), num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=conf)


def hf_config_text(k) -> str:
    k, conf = split_k(k)
    if conf:
        return (f"num_assistant_tokens={k}, schedule=constant, " if k != "auto" else "defaults but ") + \
            f"assistant_confidence_threshold={conf} (per draft; ours: draft_confidence={conf}, on the product)"
    if k == "auto":
        return ("transformers defaults: num_assistant_tokens=20, schedule=constant, "
                "assistant_confidence_threshold=0.4 (no sklearn: fixed)" if not _has_sklearn() else
                "transformers defaults: num_assistant_tokens=20, schedule=constant, "
                "assistant_confidence_threshold=0.4 (adapted by ROC, sklearn present)")
    return f"num_assistant_tokens={k}, schedule=constant, assistant_confidence_threshold=0"


def _has_sklearn() -> bool:
    import importlib.util

    return importlib.util.find_spec("sklearn") is not None


# ----------------------------------------------------------------------------------------------
# Statistics of several generate calls, merged
# ----------------------------------------------------------------------------------------------
def merge_stats(stats: list) -> dict:
    """alpha, histogram, tokens per target call, step times and the predicted speed-up of the
    generate calls of one run (batch 1 makes one call per prompt)."""
    reached = accepted = row_steps = generated = iterations = k_sum = draft_fwd = 0
    t_draft = t_target = t_prefill = 0.0
    hist: list = []
    for s in stats:
        for h in s.history:
            k_sum += h["k"]
            for kb, n in zip(h["num_draft"], h["accepted"]):
                if n >= 0:
                    reached += min(n + 1, kb)
                    accepted += n
        for n, c in enumerate(s.accepted_length_histogram):
            hist += [0] * (n + 1 - len(hist))
            hist[n] += c
        row_steps += s.row_steps
        generated += s.generated_tokens
        iterations += s.iterations
        draft_fwd += s.draft_forwards
        t_draft += s.draft_time_s
        t_target += s.target_time_s
        t_prefill += s.prefill_time_s
    alpha = accepted / reached if reached else None
    mean_k = k_sum / iterations if iterations else None
    td = t_draft / draft_fwd if draft_fwd else None
    tt = t_target / iterations if iterations else None
    # The decoder's own prediction per call (its fitted verify cost per verified length, the
    # one-token step for the target alone), averaged over the calls weighted by their tokens.
    # (Until 2026-12-01 this was recomputed here with the mean verify step standing in for
    # both, which ignored how the verify grows with K: batch 8, K = 4 read 1.58x for a 0.53x.)
    weighted = [(s.predicted_speedup, s.generated_tokens) for s in stats
                if s.predicted_speedup is not None and s.generated_tokens]
    pred = (sum(p * w for p, w in weighted) / sum(w for _, w in weighted)) if weighted else None
    return dict(alpha=alpha, mean_k=mean_k, tokens_per_target_call=generated / row_steps if row_steps else None,
                hist=hist, draft_ms_per_forward=None if td is None else td * 1e3,
                target_ms_per_step=None if tt is None else tt * 1e3, predicted_speedup=pred,
                draft_s=t_draft, target_s=t_target, prefill_s=t_prefill)


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------
def _k_list(s: str) -> list:
    """--ks: comma-separated K values, each parsed like the CLI's -k (a positive int or 'auto'),
    optionally with '@c': the same K with draft_confidence c (e.g. '4@0.3', 'auto@0.3')."""
    out = []
    for part in s.split(","):
        k, _, c = part.strip().partition("@")
        parse_k(k)
        if c:
            try:
                conf = float(c)
            except ValueError:
                raise argparse.ArgumentTypeError(f"the confidence after '@' must be a float, got {c!r}") from None
            if not 0.0 < conf < 1.0:
                raise argparse.ArgumentTypeError(f"the confidence after '@' must be in (0, 1), got {conf}")
        out.append(part.strip() if c else parse_k(k))
    return out


def split_k(k):
    """(K, draft_confidence) of a --ks entry: 4 -> (4, 0.0), '4@0.3' -> (4, 0.3)."""
    if isinstance(k, str) and "@" in k:
        kk, c = k.split("@")
        return parse_k(kk), float(c)
    return k, 0.0


def _int_list(s: str) -> list:
    return [int(x) for x in s.split(",") if x.strip()]


def _float_list(s: str) -> list:
    return [float(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/local")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per method (median), after one warm-up")
    ap.add_argument("--batch", type=_int_list, default=[1, 8], help="batch sizes, e.g. 1,8")
    ap.add_argument("--temperatures", type=_float_list, default=[0.0, 1.0], help="0 = greedy")
    ap.add_argument("--ks", type=_k_list, default=[1, 2, 4, 8, "auto"], help="K values, e.g. 1,2,4,8,auto")
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                    help=f"use the first N of the {len(PROMPTS)} prompts (batch 8 needs 8)")
    ap.add_argument("--batch1-prompts", type=int, default=None,
                    help="batch 1 decodes only the first N prompts, one by one (default: all); a cheaper run")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: the machine's)")
    ap.add_argument("--draft", help="draft model path (with --target)")
    ap.add_argument("--target", help="target model path (with --draft)")
    ap.add_argument("--tokenizer", help="tokenizer path (default: the target's)")
    ap.add_argument("--tiny-random", action="store_true", help="the in-memory random tiny pair (smoke run)")
    ap.add_argument("--feature-ks", type=_k_list, default=[],
                    help="also time SpeculativeDecoder with the feature draft (drafter='feature') at these K, "
                         "e.g. 2,auto (method specdec_feature)")
    ap.add_argument("--block-ks", type=_k_list, default=[],
                    help="also time SpeculativeDecoder with verification='block' at these K, e.g. 2,4,8 "
                         "(method specdec_block, beside specdec's token verification at --ks)")
    ap.add_argument("--tree-shapes", type=lambda v: [x for x in v.split(";") if x], default=[],
                    help="also time SpeculativeDecoder(tree=SHAPE) for these shapes, ';'-separated, e.g. "
                         "'2,2;4,2,1;dynamic:16,4,4' (method specdec_tree; its K column is the shape)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset of the methods to time (default: all), e.g. "
                         "specdec,specdec_block,specdec_target_only; target_hf always runs (the reference)")
    ap.add_argument("--feature-draft", default=None,
                    help="the feature draft's directory (default with the embedded pair: the embedded one)")
    ap.add_argument("--eos", choices=["ignore", "stop"], default="ignore",
                    help="ignore: every row generates max_new_tokens (default); stop: rows end at EOS")
    ap.add_argument("--seed", type=int, default=0, help="prompt p uses seed + p")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling for every method at T > 0 (default 1: off)")
    ap.add_argument("--linear", choices=["auto", "skinny", "torch"], default="auto",
                    help="how every method runs the linear layers: SpeculativeDecoder's cpu_linear "
                         "(auto: skinny_linear on fp32 CPU)")
    ap.add_argument("--no-lean-forward", action="store_true",
                    help="SpeculativeDecoder's decode steps through the models' own forward (default: "
                         "the lean Llama step where the model qualifies)")
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="max_new_tokens of the untimed warm-up run (default: --max-new-tokens)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny pair, 8 tokens, 1 repeat")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tiny_random, args.max_new_tokens, args.repeats = True, 8, 1
    if args.repeats < 1 or args.max_new_tokens < 1:
        raise SystemExit("--repeats and --max-new-tokens must be >= 1")
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    prompts = PROMPTS[: args.num_prompts]
    batches = [b for b in args.batch if b <= len(prompts)]
    if batches != args.batch:
        print(f"# skipping batch sizes above the {len(prompts)} prompts: {sorted(set(args.batch) - set(batches))}")

    t_load = time.perf_counter()
    draft, target, tok, pair = load_pair(args, device, dtype)
    t_load = time.perf_counter() - t_load
    prompt_ids = [list(tok(p)["input_ids"]) for p in prompts]
    bench = Bench(draft, target, tok, device, prompt_ids, args.max_new_tokens, args.eos, args.seed, args.linear,
                  lean_forward=not args.no_lean_forward, top_p=args.top_p)
    bench.batch1_prompts = args.batch1_prompts
    if args.feature_ks:
        fdir = args.feature_draft
        if fdir is None:
            if args.tiny_random or args.draft or args.target:
                raise SystemExit("--feature-ks with --tiny-random or --draft/--target needs --feature-draft DIR "
                                 "(a feature draft trained for that target)")
            from specdec_kernels.decoding.drafters.feature_model import embedded_feature_draft_dir

            fdir = embedded_feature_draft_dir()  # FileNotFoundError naming it when missing
        bench.use_feature_draft(fdir, args.linear, lean_forward=not args.no_lean_forward)
    elif args.feature_draft:
        raise SystemExit("--feature-draft needs --feature-ks (the K values to time it at)")

    dev_name, ver, stamp = device_name(device), versions(), now()
    header = [
        f"# bench_e2e {stamp}: python bench/decoding/bench_e2e.py {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"# device: {dev_name}; torch threads: {torch.get_num_threads()} "
        f"({'--threads' if args.threads else 'machine default'}); os.cpu_count {os.cpu_count()}; "
        f"niceness {os.nice(0)}; load average at start {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"# pair: {pair}; target {model_size(target)}; draft {model_size(draft)}; loaded in {t_load:.1f}s",
        f"# dtype {dtype}; both models eval(), every method under torch.inference_mode()",
        f"# prompts: {len(prompts)}, token lengths {[len(p) for p in prompt_ids]}; max_new_tokens "
        f"{args.max_new_tokens}; EOS {args.eos}; seeds: prompt p uses {args.seed} + p"
        + (f"; batch 1 decodes the first {args.batch1_prompts} prompts only" if args.batch1_prompts else ""),
        f"# timing: tokens/s = generated tokens / wall time of the whole run (batch 1: the prompts one "
        f"after the other); median of {args.repeats} timed run(s) after 1 warm-up"
        f"{f' of {args.warmup_tokens} tokens' if args.warmup_tokens else ''}; methods interleaved",
        f"# target_hf: target.generate (greedy do_sample=False; T>0: do_sample=True, top_k=0, top_p={args.top_p:g})"
        + (f"; SpeculativeDecoder: top_p={args.top_p:g}" if args.top_p < 1 else ""),
        "# assisted_hf: target.generate(assistant_model=draft); fixed K: " + hf_config_text(1).replace("=1,", "=K,")
        + "; K=auto: " + hf_config_text("auto"),
        "# specdec: SpeculativeDecoder.generate(num_draft_tokens=K, max_draft_tokens=8; K@c: and "
        "draft_confidence=c); "
        "specdec_target_only: its generate_target_only"
        + (f"; specdec_feature: the same with drafter='feature', the feature draft {args.feature_draft or 'embedded'}"
           if args.feature_ks else "")
        + ("; specdec_tree: SpeculativeDecoder(tree=K) (K = the shape), the models' own forwards with 4D tree masks "
           "(no lean step), one row at a time, children sampled without replacement (T > 0) or the draft's top-k"
           if args.tree_shapes else ""),
        f"# linear layers: {bench.linear} for every method (--linear {args.linear})"
        + ("; target_hf_torch_linear: the target alone with torch's linear; speed-ups over the target "
           "are over the faster of target_hf and target_hf_torch_linear" if bench.linear == "skinny" else ""),
        "# decode steps of SpeculativeDecoder (specdec and specdec_target_only): "
        + "; ".join(f"{m}: {'lean Llama step' if why is None else 'its own forward (' + why + ')'}"
                    for m, why in bench.dec.lean_status().items())
        + "; Hugging Face methods: the models' own forward",
        "# draft vocabulary of SpeculativeDecoder: "
        + ("the whole vocabulary" if bench.dec.draft_vocab is None else
           f"{bench.dec.draft_vocab.numel()} tokens (draft_vocab='auto'); HF assisted: the whole vocabulary"),
        "# prefill: SpeculativeDecoder prefills prompts of similar lengths together (one forward per "
        "group), HF generate pads every prompt to the longest; decode_speedup_vs_target_only = specdec's "
        "tokens/s after its prefill over specdec_target_only's (same loop and prefill, no draft)",
        f"# versions: {ver}",
    ]
    print("\n".join(header), flush=True)

    rows, notes = [], []
    interrupted = False
    try:
        for temperature in args.temperatures:
            for batch in batches:
                r, n = run_config(bench, batch, temperature, args.ks, args.repeats, args.warmup_tokens,
                                  feature_ks=args.feature_ks, block_ks=args.block_ks, tree_shapes=args.tree_shapes,
                                  only=None if args.methods is None else set(args.methods.split(",")))
                rows += r
                notes += n
    except KeyboardInterrupt:  # a time limit (gpu_check.sh's SIGINT): keep the configurations done
        interrupted = True
        print(f"# interrupted: writing the {len(rows)} rows of the configurations completed", flush=True)
        notes.append("# interrupted at a time limit: the configurations after these were not measured")
        if not rows:
            return 130
    for r in rows:
        r.update(pair=pair, device=dev_name, dtype=args.dtype, threads=torch.get_num_threads(), top_p=args.top_p,
                 max_new_tokens=args.max_new_tokens, repeats=args.repeats, eos=args.eos, date=stamp,
                 linear=bench.linear, lean_forward=not args.no_lean_forward, prompts=len(prompts),
                 batch1_prompts=args.batch1_prompts, warmup_tokens=args.warmup_tokens,
                 draft_vocab=None if bench.dec.draft_vocab is None else bench.dec.draft_vocab.numel(), **ver)

    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "bench_e2e.csv")
    append_csv(csv_path, rows)
    cols = ["method", "K", "batch", "temperature", "tokens", "tokens_per_s", "speedup_vs_target",
            "speedup_vs_assisted", "decode_speedup_vs_target_only", "prefill_s", "predicted_speedup",
            "predicted_speedup_t1", "alpha", "tokens_per_target_call", "mean_k",
            "accepted_length_hist", "draft_ms_per_forward", "target_ms_per_step", "greedy_check"]
    print()
    text = print_table(rows, cols)
    hf_lines = sorted({f"#   assisted_hf K={r['K']}: {r['hf_config']}" for r in rows
                       if r["method"] == "assisted_hf" and r["hf_config"]})
    footer = ["# HF assisted-generation configs:"] + hf_lines + notes
    print("\n".join(footer))
    with open(os.path.join(args.out, "bench_e2e.txt"), "w") as f:
        f.write("\n".join(header) + "\n" + text + "\n" + "\n".join(footer) + "\n")
    plot(rows, os.path.join(args.out, "bench_e2e.png"), pair, dev_name, args)
    print(f"wrote {csv_path}, bench_e2e.txt and bench_e2e.png in {args.out}")
    return 130 if interrupted else 0


def run_config(bench: Bench, batch: int, temperature: float, ks: list, repeats: int,
               warmup_tokens: Optional[int] = None, feature_ks: Sequence = (), block_ks: Sequence = (),
               only: Optional[set] = None, tree_shapes: Sequence = ()):
    """All methods at one (batch, temperature): rows and printed notes."""
    greedy = temperature == 0
    label = f"batch {batch}, temperature {temperature:g}"
    methods: dict[tuple, Callable[[], RunOut]] = {("target_hf", "-"): lambda: bench.hf(batch, temperature, None)}
    if getattr(bench, "linear", "torch") == "skinny":  # the target alone with torch's linear too
        methods[("target_hf_torch_linear", "-")] = lambda: bench.hf(batch, temperature, None, stock_linear=True)
    if batch == 1:
        for k in ks:
            methods[("assisted_hf", k)] = (lambda k=k: bench.hf(batch, temperature, assistant_config(k)))
    for k in ks:
        methods[("hook_hf", k)] = (lambda k=k: bench.hf(batch, temperature, assistant_config(k), hook=True))
    for k in ks:
        methods[("specdec", k)] = (lambda k=k: bench.specdec(batch, temperature, k))
    for k in feature_ks:
        methods[("specdec_feature", k)] = (lambda k=k: bench.specdec(batch, temperature, k, feature=True))
    for k in block_ks:
        methods[("specdec_block", k)] = (lambda k=k: bench.specdec(batch, temperature, k, block=True))
    for shape in tree_shapes:
        methods[("specdec_tree", shape)] = (lambda shape=shape: bench.specdec(batch, temperature, 1, tree=shape))
    methods[("specdec_target_only", "-")] = lambda: bench.specdec(batch, temperature, None, target_only=True)
    if only is not None:
        methods = {key: fn for key, fn in methods.items() if key[0] in only or key[0] == "target_hf"}

    t0 = time.perf_counter()
    print(f"\n## {label}: warm-up", flush=True)
    saved = bench.max_new if warmup_tokens else None
    if warmup_tokens:  # a shorter warm-up: allocations and first calls, not the whole run
        bench.max_new = warmup_tokens
    try:
        for fn in methods.values():
            fn()
    finally:
        if warmup_tokens:
            bench.max_new = saved
    runs = {key: [] for key in methods}
    for rep in range(repeats):
        for key, fn in methods.items():  # interleaved: background load falls on every method alike
            runs[key].append(fn())
        print(f"## {label}: repeat {rep + 1}/{repeats} done ({time.perf_counter() - t0:.0f}s)", flush=True)

    med = {}
    for key, rs in runs.items():
        order = sorted(range(len(rs)), key=lambda i: rs[i].seconds)
        mid = rs[order[(len(rs) - 1) // 2]]  # the (lower) median run: its stats go with its time
        secs = mid.seconds  # that run's own time (with an even count the mean of the middle two was mixed in)
        tokens = sum(len(x) for x in mid.token_ids)
        med[key] = (tokens / secs, tokens, secs, mid)

    # The greedy check: every method's ids equal the target alone's, prompt by prompt, in every
    # timed run.
    notes, failed, stock_differs = [], {}, set()
    if greedy:
        ref = runs[("target_hf", "-")][0].token_ids

        def differ(ids) -> set:  # prompts whose ids differ from the reference, or are missing on one side
            return {p for p in range(max(len(ids), len(ref)))
                    if p >= len(ids) or p >= len(ref) or ids[p] != ref[p]}

        for key in methods:
            bad = set()
            for r in runs[key]:
                bad |= differ(r.token_ids)
            if key != ("target_hf", "-"):
                bad |= {p for r in runs[("target_hf", "-")] for p in differ(r.token_ids)}
            if bad and key[0] == "target_hf_torch_linear":
                stock_differs.update(bad)
                # other rounding in the linear layers (not our code path): noted, refuses nothing
                notes.append(f"# note ({label}): target_hf_torch_linear differs from target_hf (skinny "
                             f"linear) on prompts {sorted(bad)}: fp32 rounding differences at near-ties")
                continue
            if bad:
                failed[key] = sorted(bad)
                for p in sorted(bad):
                    a, b = runs[key][0].token_ids[p], ref[p]
                    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    msg = (f"# GREEDY CHECK FAILED ({label}): {key[0]} K={key[1]} prompt {p} differs from "
                           f"target_hf at generated token {j}: {a[j:j + 5]} vs {b[j:j + 5]}")
                    notes.append(msg)
                    print(msg, flush=True)
        if not failed:
            notes.append(f"# greedy check ({label}): all methods gave the target's token ids for every prompt")
    refused_ks = set()
    for key in failed:
        if key[0] in ("target_hf",):
            refused_ks |= {k for (_, k) in methods} | {"-"}
        else:
            refused_ks.add(key[1])
    if ("specdec_target_only", "-") in failed:
        refused_ks.add("-")

    # The baseline is the faster target alone: with the skinny linear or with torch's.
    base = max(med[("target_hf", "-")][0], med.get(("target_hf_torch_linear", "-"), (0.0,))[0])
    rows = []
    for key, (tps, tokens, secs, mid) in med.items():
        method, k = key
        row = dict(method=method, K=k, batch=batch, temperature=temperature, tokens=tokens, seconds=secs,
                   tokens_per_s=tps, speedup_vs_target=None, speedup_vs_assisted=None,
                   hf_config=hf_config_text(k) if method == "assisted_hf" else "")
        if method != "target_hf":
            row["speedup_vs_target"] = tps / base

        if method in ("specdec", "hook_hf") and ("assisted_hf", k) in med:
            row["speedup_vs_assisted"] = tps / med[("assisted_hf", k)][0]
        elif method in ("specdec", "hook_hf") and batch != 1:
            row["speedup_vs_assisted"] = NA_BATCH
        if greedy:
            row["greedy_check"] = ("FAIL: prompts " + ",".join(map(str, failed[key])) + " differ") if key in failed \
                else "pass"
            if method == "target_hf_torch_linear" and stock_differs:
                row["greedy_check"] = "differs (rounding, see notes)"
            if k in refused_ks or key in failed:
                row["speedup_vs_target"] = REFUSED if method != "target_hf" else None
                if method in ("specdec", "hook_hf"):
                    row["speedup_vs_assisted"] = REFUSED
        else:
            row["greedy_check"] = "n/a (sampling)"
        if mid.stats is not None:
            m = merge_stats(mid.stats)
            if method == "specdec_target_only":
                m.update(alpha=None, mean_k=None, hist=[], predicted_speedup=None)
            row.update(alpha=m["alpha"], tokens_per_target_call=m["tokens_per_target_call"], mean_k=m["mean_k"],
                       accepted_length_hist=" ".join(map(str, m["hist"])) if m["hist"] else None,
                       draft_ms_per_forward=m["draft_ms_per_forward"], target_ms_per_step=m["target_ms_per_step"],
                       predicted_speedup=m["predicted_speedup"], prefill_s=m["prefill_s"],
                       draft_s=m["draft_s"], target_s=m["target_s"])
        rows.append(row)
    # predicted_speedup is the decoder's own (stats: T_target(K) fitted per verified length within
    # the run).  predicted_speedup_t1 uses this run's direct measurements instead: the one-token
    # step T_1 of specdec_target_only and the run's mean verify step T_verify:
    # E(mean K) * T_1 / (mean K * T_draft + T_verify).
    t1 = next((r.get("target_ms_per_step") for r in rows if r["method"] == "specdec_target_only"), None)
    for r in rows:
        if (r["method"] in SPECDEC and t1 and r.get("target_ms_per_step") and r.get("alpha") is not None
                and r.get("mean_k")):
            r["predicted_speedup_t1"] = predicted_speedup(r["alpha"], r["mean_k"], r.get("draft_ms_per_forward") or 0.0,
                                                          t1, r["target_ms_per_step"])
    # Decode only: tokens per second after the prefill, specdec against specdec_target_only (the
    # same loop, prefill and sampler without a draft): the speculation's own gain, apart from how
    # the prompts are prefilled (the decoder groups prompts of similar lengths; HF pads them all).
    to = next((r for r in rows if r["method"] == "specdec_target_only"), None)
    if to is not None and to.get("prefill_s") is not None and to["seconds"] > to["prefill_s"]:
        to_decode = to["tokens"] / (to["seconds"] - to["prefill_s"])
        for r in rows:
            if r["method"] in SPECDEC and r.get("prefill_s") is not None and r["seconds"] > r["prefill_s"]:
                r["decode_speedup_vs_target_only"] = r["tokens"] / (r["seconds"] - r["prefill_s"]) / to_decode
                if r["K"] in refused_ks or (r["method"], r["K"]) in failed:
                    r["decode_speedup_vs_target_only"] = REFUSED
    if batch != 1:  # transformers' assisted generation refuses batches: say so in the table
        rows.insert(1, dict(method="assisted_hf", K="-", batch=batch, temperature=temperature, tokens=None,
                            seconds=None, tokens_per_s=NA_BATCH, speedup_vs_target=NA_BATCH,
                            speedup_vs_assisted=None, hf_config="",
                            greedy_check=NA_BATCH if greedy else "n/a (sampling)"))
    keys = ["method", "K", "batch", "temperature", "tokens", "seconds", "tokens_per_s", "speedup_vs_target",
            "speedup_vs_assisted", "decode_speedup_vs_target_only", "predicted_speedup", "predicted_speedup_t1",
            "alpha", "tokens_per_target_call", "mean_k", "accepted_length_hist", "draft_ms_per_forward",
            "target_ms_per_step", "prefill_s", "draft_s", "target_s", "greedy_check", "hf_config"]
    rows = [{c: r.get(c) for c in keys} for r in rows]
    for r in rows:
        r["K"] = str(r["K"])
    print(f"## {label}: done in {time.perf_counter() - t0:.0f}s", flush=True)
    return rows, notes


def plot(rows, path, pair, dev_name, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    ks = [str(k) for k in args.ks]
    x = list(range(len(ks)))
    # room for the legend
    fig, axes = plt.subplots(1, len(temps), figsize=(max(6 * len(temps), 10), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, t in zip(axes[0], temps):
        for ci, b in enumerate(sorted({r["batch"] for r in rows})):
            c = colors[ci % len(colors)]
            sel = [r for r in rows if r["temperature"] == t and r["batch"] == b]

            def tps(method, k):
                v = next((r["tokens_per_s"] for r in sel if r["method"] == method and r["K"] == k), None)
                return v if isinstance(v, float) else None

            ys = [tps("specdec", k) for k in ks]
            ax.plot(x, ys, marker="o", color=c, label=f"SpeculativeDecoder, batch {b}")
            yf = [tps("specdec_feature", k) for k in ks]
            if any(v is not None for v in yf):
                ax.plot(x, yf, marker="s", color=c, linestyle="--",
                        label=f"SpeculativeDecoder, feature draft, batch {b}")
            base = tps("target_hf", "-")
            if base:
                ax.axhline(base, color=c, linestyle="--", linewidth=1.2, label=f"target alone (HF), batch {b}")
            stock = tps("target_hf_torch_linear", "-")
            if stock:
                ax.axhline(stock, color=c, linestyle="-.", linewidth=1.0,
                           label=f"target alone (HF, torch linear), batch {b}")
            ya = [tps("assisted_hf", k) for k in ks]
            if any(v is not None for v in ya):
                # Assisted generation was measured at each K (num_assistant_tokens = K): one
                # horizontal segment per K, so it reads against the decoder at the same K.
                for xi, v in zip(x, ya):
                    if v is not None:
                        ax.hlines(v, xi - 0.3, xi + 0.3, color=c, linestyle=":", linewidth=2.2)
                ax.plot([], [], color=c, linestyle=":", linewidth=2.2, label=f"HF assisted (same K), batch {b}")
        ax.set_xticks(x, ks)
        ax.set_xlabel("K (draft tokens per step)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title("greedy" if t == 0 else f"temperature {t:g}", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    # One legend under the panels (the same lines in each), clear of the data.
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7, frameon=False)
    fig.suptitle(f"end to end: {pair}\n{dev_name}, {args.dtype}, {args.max_new_tokens} new tokens, "
                 f"median of {args.repeats}", fontsize=9)
    n_rows = -(-len(labels) // min(4, max(len(labels), 1)))
    fig.tight_layout(rect=(0, 0.05 * n_rows + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
