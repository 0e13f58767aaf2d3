"""``specdec generate "prompt" ...``: speculative decoding from the command line.

    specdec generate "The capital of France is" --draft DRAFT --target TARGET -k 4
    specdec generate "def fib(n):" --target TARGET --drafter prompt_lookup -k auto --json
    python -m specdec_kernels generate "hello" --tiny-random --json
    specdec env                  # versions, extension, device, Triton: for a bug report
    specdec audit --verifier ours --quick   # the exactness audit (docs/audit.md)

``--tiny-random`` builds a small random-weight Llama pair and a character-level tokenizer in
memory (no download), for smoke tests; its text is gibberish by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional, Sequence

__all__ = ["main", "build_parser", "build_tiny_random_pair", "tiny_char_tokenizer"]

from .models.tiny import tiny_char_tokenizer, tiny_random_pair as build_tiny_random_pair

# With neither --target nor --tiny-random, the embedded default pair (specdec_kernels.models).


def parse_k(s: str):
    if s == "auto":
        return s
    try:
        k = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int or 'auto', got {s!r}") from None
    if k <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int or 'auto', got {k}")
    return k


class _ShortUsageParser(argparse.ArgumentParser):
    """Errors as two lines: a short usage and the error (the full usage of ``generate`` wraps
    over a dozen lines; ``--help`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} PROMPT [PROMPT ...] [options]  ({self.prog} --help lists them)\n"
                     f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from .decoding.drafters.registry import drafter_names  # --drafter's choices: every registered drafter

    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding of Hugging Face models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ShortUsageParser)
    e = sub.add_parser("env", help="print the versions, the C++ extension's state, the device and whether the "
                                   "Triton kernels run on it (paste it into a bug report)")
    e.add_argument("--json", action="store_true", help="as JSON")
    e.add_argument("--no-kernel-check", action="store_true", help="do not launch the split kernel once")
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="+", help="prompt text (several prompts are decoded as one batch)")
    g.add_argument("--draft", help="draft model name or path")
    g.add_argument("--target", help="target model name or path")
    g.add_argument("--tokenizer", help="tokenizer name or path (default: the target's)")
    g.add_argument("--drafter", choices=drafter_names(), default=None,
                   help="'prompt_lookup' drafts by n-gram lookup without a draft model; 'feature': a draft that "
                        "reads the target's hidden states (--draft: its directory; default with the embedded "
                        "target: the embedded one)")
    g.add_argument("--tiny-random", action="store_true",
                   help="use a small random-weight Llama pair built in memory (offline smoke test)")
    g.add_argument("-k", "--num-draft-tokens", type=parse_k, default=4, help="K, or 'auto' (default 4)")
    g.add_argument("--max-draft-tokens", type=int, default=8, help="the largest K 'auto' may pick (default 8)")
    g.add_argument("--draft-confidence", type=float, default=0.0,
                   help="a row stops drafting once the product of its drafts' probabilities under the draft "
                        "falls below this (0 = off, default; the output distribution is unchanged)")
    g.add_argument("--verification", choices=("token", "block"), default="token",
                   help="verify the drafts token by token (default) or as a block (Sun et al. 2025: the same "
                        "output distribution, at least as many drafts accepted on average)")
    g.add_argument("--tree", default=None, metavar="SHAPE",
                   help="draft a tree instead of a chain: branching factors per depth (4,2,2,1) or "
                        "dynamic:NODES,DEPTH,BRANCH (the most probable paths under the draft), verified exactly "
                        "in one target forward (fused_verify_tree); needs a draft model")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens, and any tied with the k-th (default: off)")
    g.add_argument("--top-p", type=float, default=None,
                   help="keep the smallest set of most likely tokens reaching this mass (default: off)")
    g.add_argument("--min-p", type=float, default=None,
                   help="keep the tokens at least this fraction as likely as the most likely one, after "
                        "--top-k/--top-p (default: off)")
    g.add_argument("--seed", type=int, default=0, help="prompt p samples with seed + p (default 0)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default 64)")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the tokenizer's chat template (an "
                        "instruct model such as the embedded target answers it; default: plain text)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the CPU, or where the "
                                                   "given models are)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    g.add_argument("--cpu-linear", choices=["auto", "skinny", "torch"], default="auto",
                   help="fp32 CPU linear layers: skinny_linear (auto: when the models are fp32 on the "
                        "CPU) or torch's own")
    g.add_argument("--weight-cache", default=None, metavar="DIR",
                   help="where the fp16 copies of fp16-exact fp32 weights are kept for the next run, each "
                        "checked in full before use (default: $SPECDEC_WEIGHT_CACHE, else "
                        "~/.cache/specdec-kernels/fp16-weights)")
    g.add_argument("--no-weight-cache", action="store_true",
                   help="keep the fp16 weight copies in memory only (made again by every run)")
    g.add_argument("--no-lean-forward", action="store_true",
                   help="run every decode step through the models' own forward (default: a Llama on the "
                        "CPU takes the lean step, the same logits with less Python per call)")
    g.add_argument("--draft-vocab", default="auto", metavar="auto|full|PATH",
                   help="the tokens the draft may propose: 'auto' (default: the draft_vocab.json "
                        "shipped in the draft's directory, if any), 'full' (the whole vocabulary) or a file")
    g.add_argument("--draft-tokenizer", default=None, metavar="PATH",
                   help="the draft's tokenizer, where it differs from the target's (default: the --draft "
                        "directory's own)")
    g.add_argument("--vocabulary", choices=("auto", "shared", "intersection", "string"), default="auto",
                   help="how a draft over another tokenizer proposes: 'auto' (default: 'shared' when the "
                        "vocabularies are equal, else 'string' when greedy, and when sampling 'intersection' when the "
                        "tokens both write hold most of the draft's probability, else 'string'), 'intersection' (the "
                        "shared tokens, with the draft's renormalised distribution) or 'string' (its text, re-encoded "
                        "by the target's tokenizer)")
    g.add_argument("--baseline", action="store_true",
                   help="also decode with the target alone, to report the measured speed-up (both sides warmed "
                        "up untimed first, the side timed first alternating; greedy: the token ids compared)")
    g.add_argument("--repeats", type=int, default=1,
                   help="with --baseline: decode N times with the target alone and N times speculatively, "
                        "alternating, and report the median run of each (the lower middle one for an even N; "
                        "default 1: a busy machine's one run can be far off)")
    gr = g.add_mutually_exclusive_group()
    gr.add_argument("--json-schema", metavar="FILE", help="structured output: JSON valid under this schema (xgrammar)")
    gr.add_argument("--regex", metavar="RE", help="structured output: text matching this regular expression")
    gr.add_argument("--grammar", metavar="FILE", help="structured output: an EBNF grammar (xgrammar's, rule root)")
    g.add_argument("--verbose", action="store_true", help="print every step's drafts and accepted tokens")
    g.add_argument("--json", action="store_true", help="print texts, token ids and stats as JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.generate_parser = g  # its usage line goes with the errors about its arguments
    from .audit.cli import add_audit_parser

    add_audit_parser(sub)
    return parser


# generate()'s argument names as the flags that set them, for the errors it raises
_FLAGS = {"max_new_tokens": "--max-new-tokens", "num_draft_tokens": "-k", "max_draft_tokens": "--max-draft-tokens",
          "draft_confidence": "--draft-confidence", "temperature": "--temperature", "top_k": "--top-k",
          "top_p": "--top-p", "min_p": "--min-p", "seed": "--seed", "stop strings": "--stop", "dtype": "--dtype",
          "device": "--device", "draft_vocab": "--draft-vocab", "tokenizer directory": "--tokenizer directory",
          "target directory": "--target directory", "draft directory": "--draft directory", "tree must": "--tree must",
          "draft_tokenizer directory": "--draft-tokenizer directory"}


def _flag_message(msg: str) -> str:
    """An error of the API, with its argument names written as the CLI's flags."""
    return re.sub(r"^(" + "|".join(re.escape(k) for k in _FLAGS) + r")\b", lambda m: _FLAGS[m.group(1)], msg)


def _check_early(args, parser) -> None:
    """What can be checked before any model loads (a bad --top-p should not wait for them):
    generate()'s scalar arguments, the dtype, the device, and the model paths."""
    from .decoding.arguments import check_generate_args, resolve_dtype, row_seeds
    from .models.embedded import resolve_device

    g = parser.generate_parser
    if (args.draft_tokenizer is not None or args.vocabulary != "auto") and (args.tiny_random or args.target is None):
        g.error("--draft-tokenizer and --vocabulary apply to --target/--draft models; the embedded pair and "
                "--tiny-random share one vocabulary")
    if args.draft_tokenizer is not None and args.draft is None and args.target is not None:
        g.error(f"--draft-tokenizer is the tokenizer of --draft, got no --draft (--drafter {args.drafter})")
    if args.tokenizer is not None and (args.tiny_random or args.target is None):
        g.error("--tokenizer applies to --target/--draft models; the embedded pair and --tiny-random bring "
                "their own")
    if args.target is not None and not args.tiny_random:
        if args.draft is None and args.drafter != "prompt_lookup":
            g.error("--draft is required with --target (or --drafter prompt_lookup to draft without a model)")
        if args.draft is not None and args.drafter == "prompt_lookup":
            g.error("--drafter prompt_lookup takes no --draft")
    drafter = args.drafter or "model"
    if drafter == "prompt_lookup" and args.draft_vocab not in ("auto", "full"):
        g.error(f"--draft-vocab restricts a draft model's proposals; --drafter prompt_lookup has none, got "
                f"--draft-vocab {args.draft_vocab}")
    try:
        check_generate_args(args.max_new_tokens, args.num_draft_tokens, args.temperature, args.top_k, args.top_p,
                            args.stop, args.max_draft_tokens, args.draft_confidence, drafter=drafter,
                            has_draft=drafter != "prompt_lookup", has_tokenizer=True, min_p=args.min_p)
        row_seeds(args.seed, len(args.prompts))
        resolve_dtype(args.dtype)
        resolve_device(args.device)
        if args.tree is not None:
            from .decoding.tree import parse_tree

            parse_tree(args.tree)
            if drafter != "model":
                raise ValueError(f"tree drafting needs a draft model (drafter='model'), got --drafter {drafter}")
    except (ValueError, TypeError) as e:
        g.error(_flag_message(str(e)))
    for flag, value, kind in (("--target", args.target, "model"), ("--draft", args.draft, drafter),
                              ("--tokenizer", args.tokenizer, "tokenizer"),
                              ("--draft-tokenizer", args.draft_tokenizer, "tokenizer")):
        # a local path (absolute, relative or ~), not a hub name: it must exist; a model directory
        # must hold a config.json (else transformers' errors speak of hub ids or tokenizers)
        if value is None or not (os.path.isabs(value) or value.startswith((".", "~")) or os.path.exists(value)):
            continue
        path = os.path.expanduser(value)
        if not os.path.exists(path):
            g.error(f"{flag}: no such file or directory: {value}")
        if kind == "model" and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            g.error(f"{flag}: {value} holds no config.json (not a Hugging Face model directory)")
    if args.draft_vocab not in ("auto", "full"):
        from .decoding.drafters.vocab import load_draft_vocab

        try:  # the file's form now; its ids against the draft's vocabulary once that is loaded
            load_draft_vocab(args.draft_vocab, None)
        except (OSError, ValueError) as e:
            g.error(f"--draft-vocab: {e}")


def chat_ids(tokenizer, text: str) -> list:
    """The token ids of ``text`` sent as one user message through ``tokenizer``'s chat template,
    with the assistant's turn opened (what an instruct model answers)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat needs a tokenizer with a chat template, got "
                         f"{'no tokenizer' if tokenizer is None else type(tokenizer).__name__ + ' without one'}")
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


def _make_decoder(args, parser):
    from .decoding.decoder import SpeculativeDecoder
    from .decoding.pair import embedded_pair

    # how the models run, and what the draft may propose
    if args.no_weight_cache and args.weight_cache is not None:
        parser.error("--weight-cache and --no-weight-cache exclude each other")
    # None: $SPECDEC_WEIGHT_CACHE where set (weight_cache.resolve), else the CLI's default directory
    weight_cache = False if args.no_weight_cache else args.weight_cache or (
        None if os.environ.get("SPECDEC_WEIGHT_CACHE") else True)
    paths = dict(cpu_linear=args.cpu_linear, lean_forward=not args.no_lean_forward, weight_cache=weight_cache,
                 draft_vocab=None if args.draft_vocab == "full" else args.draft_vocab, verification=args.verification,
                 tree=args.tree)
    if args.tiny_random:
        if args.draft or args.target:
            parser.error("--tiny-random builds its own models; do not pass --draft/--target with it")
        if args.drafter == "feature":
            parser.error("--tiny-random has no feature draft; use --drafter model or prompt_lookup with it")
        draft, target, tokenizer = build_tiny_random_pair(seed=0)
        if args.drafter == "prompt_lookup":
            draft = None
        return SpeculativeDecoder(draft=draft, target=target, tokenizer=tokenizer, device=args.device,
                                  dtype=args.dtype, drafter=args.drafter, **paths)
    if args.target is None:
        if args.draft is not None:
            parser.error("--draft needs --target (without both, the embedded default pair is used)")
        if args.drafter == "feature":  # said before any model is loaded
            from .decoding.drafters.feature_model import embedded_feature_draft_dir

            try:
                embedded_feature_draft_dir()
            except FileNotFoundError as e:
                parser.error(f"--drafter feature: {e} (here: pass --draft DIR and --target)")
        try:
            draft, target, tokenizer = embedded_pair(args.drafter, args.device, args.dtype)
        except (FileNotFoundError, ImportError) as e:
            parser.error(f"the embedded default pair is not available: {e}")
        return SpeculativeDecoder(draft=draft, target=target, tokenizer=tokenizer, drafter=args.drafter, **paths)
    draft = args.draft  # (--draft with --target, or prompt lookup without: _check_early)
    return SpeculativeDecoder(draft=draft, target=args.target, tokenizer=args.tokenizer, device=args.device,
                              dtype=args.dtype, drafter=args.drafter, draft_tokenizer=args.draft_tokenizer,
                              vocabulary=args.vocabulary, **paths)


def _user_errors() -> tuple:
    errors = (ValueError, TypeError, OSError)  # OSError: FileNotFoundError, a path that holds no model
    try:
        from safetensors import SafetensorError

        errors += (SafetensorError,)
    except ImportError:  # pragma: no cover - safetensors is a dependency
        pass
    return errors


_USER_ERRORS = _user_errors()


def _decode(dec, inputs, args, common, progress) -> tuple:
    """The speculative run to report, with --baseline the target alone's runs beside it
    (``--repeats`` of each, alternating, which side goes first alternating too, after an untimed
    warm-up of both: a cold first run was up to 1.3x slower, which favoured the side timed
    second): (result, the baseline runs' tokens/s, the speculative runs' tokens/s,
    whether every greedy baseline run gave the reported run's token ids, None when sampling).
    The result is the median speculative run (the lower middle one for an even N), its measured
    speed-up taken against the median baseline run (the same rule), and its trace (--verbose) is
    the one printed (a single run streams it)."""
    import io
    import statistics

    reps = args.repeats if args.baseline else 1
    trace_to = (sys.stderr if args.json else sys.stdout) if args.verbose else None
    buffered = trace_to is not None and reps > 1  # one run streams its trace as it goes
    base_runs, base_ids, results, traces = [], [], [], []
    steps = []
    spec = dict(num_draft_tokens=args.num_draft_tokens, max_draft_tokens=args.max_draft_tokens,
                draft_confidence=args.draft_confidence)

    def baseline():
        # its one-token step goes to the cost model (auto's K = 0, the predicted speed-up);
        # tokens/s None when the target alone emitted nothing (every row stopped at once)
        res = dec.generate_target_only(inputs, progress=progress, **common)
        base_runs.append(res.stats.tokens_per_s)
        base_ids.append(res.token_ids)
        if res.stats.time_per_target_forward_s:
            steps.append(res.stats.time_per_target_forward_s)

    def speculative():
        trace = io.StringIO() if buffered else (trace_to if trace_to is not None else False)
        results.append(dec.generate(inputs, verbose=trace,
                                    target_step_s=statistics.median_low(steps) if steps else None,
                                    progress=progress, **spec, **common))
        traces.append(trace)

    if args.baseline:  # untimed, short: the weights' pages and first-call costs, for both sides
        warm = dict(common, max_new_tokens=min(args.max_new_tokens, 8))
        dec.generate_target_only(inputs, **warm)
        dec.generate(inputs, **spec, **warm)
    for i in range(reps):
        sides = (baseline, speculative) if args.baseline else (speculative,)
        for side in (sides if i % 2 == 0 else sides[::-1]):
            side()
    runs = [r.stats.tokens_per_s or 0.0 for r in results]
    pick = sorted(range(reps), key=lambda i: runs[i])[(reps - 1) // 2]
    res = results[pick]
    if buffered:
        trace_to.write(traces[pick].getvalue())
    good = [b for b in base_runs if b]
    if good and res.stats.tokens_per_s:
        s = res.stats
        s.baseline_tokens_per_s = statistics.median_low(good)  # a run, as the speculative side's
        s.measured_speedup = s.tokens_per_s / s.baseline_tokens_per_s
    same = None
    if args.baseline and args.temperature == 0:  # greedy: the target alone's tokens, or a finding
        same = all(ids == res.token_ids for ids in base_ids)
    return res, base_runs, runs, same


def _grammar(args, parser):
    """--json-schema FILE, --regex RE or --grammar FILE as generate's grammar= (None: none)."""
    from .decoding import grammar

    try:
        if args.regex is not None:
            return grammar.regex(args.regex)
        for flag, path, make in (("--json-schema", args.json_schema, grammar.json_schema),
                                 ("--grammar", args.grammar, grammar.ebnf)):
            if path is not None:
                with open(path) as f:
                    return make(f.read())
    except OSError as e:
        parser.generate_parser.error(f"{flag}: {e}")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "env":
        from .env import main as env_main

        return env_main(as_json=args.json, run_kernels=not args.no_kernel_check)
    if args.command == "audit":
        from .audit.cli import run_audit

        return run_audit(args)
    _check_early(args, parser)
    if args.repeats < 1:
        parser.generate_parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and not args.baseline:
        parser.generate_parser.error(f"--repeats repeats the --baseline comparison; without --baseline, got "
                                     f"--repeats {args.repeats}")
    try:
        dec = _make_decoder(args, parser.generate_parser)
    except _USER_ERRORS as e:  # a path that is no model, a damaged file, an unwritable cache: one line
        parser.generate_parser.error(_flag_message(str(e) or repr(e)))
    prompts = list(args.prompts)
    inputs = prompts
    if args.chat:
        try:
            inputs = [chat_ids(dec.tokenizer, p) for p in prompts]
        except ValueError as e:
            parser.generate_parser.error(str(e))
    progress = not args.no_progress and len(prompts) * args.max_new_tokens >= 256
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop, grammar=_grammar(args, parser))
    try:
        res, base_runs, runs, same = _decode(dec, inputs, args, common, progress)
    except (ValueError, TypeError) as e:
        parser.generate_parser.error(_flag_message(str(e)))
    if args.json:
        out = {"texts": res.texts, "token_ids": res.token_ids, "finish_reasons": res.finish_reasons,
               "draft_vocab_size": None if dec.draft_vocab is None else dec.draft_vocab.numel(),
               "stats": res.stats.to_dict()}
        if same is not None:
            out["baseline_same_token_ids"] = same
        if len(runs) > 1:  # every run's speed, the reported ones being the medians
            out["runs_tokens_per_s"] = runs
            out["baseline_runs_tokens_per_s"] = base_runs
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for prompt, text in zip(prompts, res.texts or [str(t) for t in res.token_ids]):
            print(f"{prompt}\n{text}" if args.chat else f"{prompt}{text}")  # an answer, or a continuation
            print("-" * 40)
        print(res.stats.summary())
        if same is not None:
            print("greedy: the same token ids as the target alone" if same else
                  "greedy: token ids DIFFER from the target alone's (expected only in bf16/fp16, where two "
                  "logits within a rounding step may swap)")
    return 0
