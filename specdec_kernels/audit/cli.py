"""``specdec audit``: the exactness audit from the command line.

    specdec audit --verifier ours --quick        # about a minute on 2 CPU cores
    specdec audit --verifier vllm --json
    specdec audit --verifier mypkg.sampler:verify
    specdec audit --generator transformers

Prints the table (case, statistic, p-value, verdict, mutant's p-value) and each case's detail, or
JSON; ``--save PREFIX`` also writes PREFIX.txt and PREFIX.json.  Exit status 0 when every case
passes (or does not apply), 1 when one fails or errs, 2 when the adapter cannot run here (its
package is not installed: one line says so) or the arguments are wrong.
"""

from __future__ import annotations

import json
import sys

__all__ = ["add_audit_parser", "run_audit"]

# ours-block's sizes are larger: its mutant (block verification's extra token from the token method's residual)
# moves the continuations' law less than the others' (p ~ 1e-5 at 30,000), and the batch runs 100,000 rows in ~5 s;
# ours-tree runs its rows one after the other (~6 ms a row on 2 CPU cores)
QUICK = {"verifier": 5_000, "ours": 3_000, "transformers": 1_500, "vllm": 3_000, "ours-cross": 3_000,
         "transformers-usd": 1_500, "ours-block": 100_000, "ours-tree": 2_000}
FULL = {"verifier": 30_000, "ours": 30_000, "transformers": 12_000, "vllm": 10_000, "ours-cross": 12_000,
        "transformers-usd": 6_000, "ours-block": 200_000, "ours-tree": 10_000}
GENERATOR_TEMPERATURES = {"quick": (1.0,), "full": (1.0, 0.6)}


def add_audit_parser(sub) -> None:
    from .adapters import VERIFIERS
    from .generators import GENERATORS

    a = sub.add_parser("audit", help="test a speculative sampler's (or generator's) output law against the exact "
                                     "one, with a deliberately wrong sampler beside each case")
    what = a.add_mutually_exclusive_group(required=True)
    what.add_argument("--verifier", metavar="|".join(VERIFIERS) + "|module:function",
                      help="the verification step to audit (module:function or path/file.py:function: a callable "
                           "of the protocol in docs/audit.md)")
    what.add_argument("--generator", choices=GENERATORS, help="a whole speculative generator, on Markov-chain models")
    a.add_argument("--quick", action="store_true", help="fewer trials: about a minute on 2 CPU cores")
    a.add_argument("--trials", type=int, default=None, help="rows per law call (overrides --quick's and the default)")
    a.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.add_argument("--save", metavar="PREFIX", default=None, help="also write PREFIX.txt and PREFIX.json")
    a.add_argument("--no-mutants", action="store_true", help="do not run the mutants")
    a.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                   help="fused_verify's backend for --verifier ours/ours-packed (default auto)")
    a.add_argument("--vllm-python", default=None, help="the interpreter that has vLLM (default: this one, "
                                                       "$SPECDEC_VLLM_PYTHON, or .venv-vllm beside the source)")
    a.add_argument("--vllm-fix-expand", action="store_true",
                   help="replace vLLM's CPU expand_batch_to_tokens (which loses float values) by a correct one first")
    a.add_argument("--transformers-fix-usd", action="store_true",
                   help="--generator transformers-usd with its pruned draft logits scattered to their own rows' "
                        "target ids (transformers 5.25 misplaces them)")


def _print_row(row) -> None:
    p = "-" if row.get("pvalue") is None else f"{row['pvalue']:.3g}"
    print(f"  {row['case']}: {row['verdict']} (p {p})", file=sys.stderr, flush=True)


def run_audit(args, parser=None) -> int:
    import torch

    from .adapters import AdapterUnavailable, load_verifier
    from .run import case_names
    from .report import as_json, exit_status, format_text, header

    def usage(msg: str) -> int:
        if parser is not None:
            parser.error(msg)
        print(f"specdec audit: error: {msg}", file=sys.stderr)
        return 2

    if args.trials is not None and args.trials < 100:
        return usage(f"--trials must be >= 100, got {args.trials}")
    mode = "quick" if args.quick else "full"
    sizes = QUICK if args.quick else FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one thread is the fastest, and the machine may be shared
    try:
        if args.verifier is not None:
            cases = None
            if args.cases:
                cases = [c.strip() for c in args.cases.split(",") if c.strip()]
                unknown = [c for c in cases if c not in case_names()]
                if unknown:
                    return usage(f"--cases: unknown {unknown}; the cases are {case_names()}")
            verifier = load_verifier(args.verifier, args.vllm_python, args.backend) if args.verifier != "vllm" else None
            if args.verifier == "vllm":
                from .vllm_bridge import vllm_verifier

                verifier = vllm_verifier(args.vllm_python, args.vllm_fix_expand)
            from .run import run_verifier_audit

            trials = args.trials or sizes["verifier"]
            rows = run_verifier_audit(verifier, trials, cases, mutants=not args.no_mutants,
                                      log=None if args.json else _print_row)
            name = f"--verifier {args.verifier}" + (" (expand_batch_to_tokens fixed)" if args.vllm_fix_expand else "")
            extra = getattr(verifier, "versions", None)
            head = header(f"{name}: {getattr(verifier, '__name__', type(verifier).__name__)}", trials, mode, extra)
        else:
            from .generators import run_generator_audit

            trials = args.trials or sizes.get(args.generator, sizes["ours"])
            rows = []
            runs = [dict(temperature=T) for T in GENERATOR_TEMPERATURES[mode]]
            if args.generator == "vllm":  # controls: the engine without speculation, and with every request in
                runs += [dict(temperature=1.0, K=0), dict(temperature=1.0, one_batch=True)]  # one batch
            if args.generator == "ours-cross":  # both ways of using the foreign draft
                runs += [dict(temperature=T, vocabulary="string") for T in GENERATOR_TEMPERATURES[mode]]
            if args.generator in ("ours-block", "ours-tree"):  # greedy, checked exactly
                runs.append(dict(temperature=0.0))
            for run in runs:
                rows += run_generator_audit(args.generator, trials, mutants=not args.no_mutants,
                                            vllm_python=args.vllm_python, fix_expand=args.vllm_fix_expand,
                                            fix_usd=args.transformers_fix_usd, **run)
                if not args.json:
                    _print_row(rows[-1])
            from .generators import _vllm

            extra = getattr(_vllm, "versions", None) if args.generator == "vllm" else None
            fixed = " (expand_batch_to_tokens fixed)" if args.vllm_fix_expand and args.generator == "vllm" else ""
            if args.transformers_fix_usd and args.generator == "transformers-usd":
                fixed = " (get_target_logits reindexed)"
            head = header(f"--generator {args.generator}{fixed}", trials, mode, extra)
    except AdapterUnavailable as e:
        print(f"specdec audit: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        return usage(str(e))
    finally:
        torch.set_num_threads(threads)
    text = format_text(head, rows)
    doc = as_json(head, rows)
    if args.save:
        with open(args.save + ".txt", "w") as f:
            f.write(text)
        with open(args.save + ".json", "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text)
    return exit_status(rows)
