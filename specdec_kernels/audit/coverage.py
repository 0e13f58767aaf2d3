"""The audit's coverage: what each case reads, which of the built-in mutants it catches, and the
smallest departure from the exact law that it is sure to see.

``coverage(trials)`` runs the audit's own exact sampler (``sampler.reference_verify``) and every
built-in mutant (``sampler.MUTATIONS`` and the cases' own) through every case at ``trials`` rows
per law call.  A case's detection threshold is computed from its tests' sizes (``laws.detectable_tv``:
the total variation from a tested law beyond which any departure, whatever its direction, is
detected with probability >= 1/2 at the case's Bonferroni level), for its finest test and for its
test of the whole emitted sequence.  An exact test detects any forbidden outcome of probability
>= ln 2 / n per row with probability >= 1/2.

    python -m specdec_kernels.audit.coverage --trials 5000 30000 --save bench/results/audit/coverage
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from .adapters import run_calls
from .block import block_verifier
from .checks import ALPHA
from .laws import detectable_tv
from .run import ALL_CASES, _seeded, evaluate
from .sampler import MUTATIONS, mutant, reference_verify

__all__ = ["coverage", "format_markdown"]


def _exact_reference(target_logits, draft_tokens, draft_probs, params):
    return reference_verify(target_logits, draft_tokens, draft_probs, params)


_exact_reference.supports_seed = True
_exact_reference.supports_block = False


def _thresholds(tests: list) -> dict:
    """The case's finest and whole-sequence detection thresholds (total variation) from its tests."""
    m = len(tests)
    tv = []
    for t in tests:
        if t.get("exact"):
            tv.append((t["what"], math.log(2) / max(t["n"], 1)))
        else:
            tv.append((t["what"], detectable_tv(t["dof"], t["n"], m, ALPHA)))
    seq = [v for w, v in tv if "sequence" in w]
    return {"finest": min((v for _, v in tv), default=math.inf), "sequence": max(seq) if seq else None,
            "per_test": {w: v for w, v in tv}}


def coverage(trials: int, log=None) -> dict:
    """{case: {reads, mutant (its own), caught: [mutants that fail it], finest, sequence, per_test}}."""
    mutants = {name: mutant(name) for name in MUTATIONS}
    for c in ALL_CASES:
        if c.mutant_verifier is not None:
            mutants[c.mutation] = c.mutant_verifier
    out = {}
    for i, case in enumerate(ALL_CASES):
        t0 = time.perf_counter()
        calls = _seeded(i, case.build(trials))
        exact = block_verifier() if "block" in case.needs else _exact_reference
        ref = evaluate(case, calls, run_calls(exact, calls, seed=11))
        caught = []
        for name, fn in mutants.items():
            if not all(getattr(fn, f"supports_{n}", False) for n in case.needs):
                continue
            mcalls = calls if "seed" in case.needs else [c.with_seeds(None) for c in calls]
            r = evaluate(case, mcalls, run_calls(fn, mcalls, seed=7))
            if r["verdict"] == "FAIL":
                caught.append(name)
        row = {"reads": case.reads, "mutant": case.mutation, "exact_verdict": ref["verdict"],
               "exact_pvalue": ref["pvalue"], "caught": caught}
        row.update(_thresholds(ref.get("tests", [])))
        out[case.name] = row
        if log is not None:
            log(f"{case.name}: {len(caught)} mutants caught, finest TV {row['finest']:.3g} "
                f"({time.perf_counter() - t0:.1f} s)")
    return out


def _tv(x) -> str:
    if x is None or math.isinf(x):
        return "-"
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e} (exact)"


def format_markdown(results: dict) -> str:
    """A table: case, what it reads, the mutants it catches (its own in bold), and its thresholds at
    each size (``results``: trials -> ``coverage(trials)``)."""
    sizes = sorted(results)
    first = results[sizes[0]]
    head = ["case", "reads", "mutants caught"]
    for n in sizes:
        head += [f"TV, finest test (n={n:,})", f"TV, whole sequence (n={n:,})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in first.items():
        caught = set.intersection(*(set(results[n][name]["caught"]) for n in sizes))
        only = set.union(*(set(results[n][name]["caught"]) for n in sizes)) - caught
        names = [f"**{m}**" if m == row["mutant"] else m for m in sorted(caught)]
        names += [f"{m} (at n={max(sizes):,} only)" for m in sorted(only)]
        cells = [f"`{name}`", row["reads"], ", ".join(names) or "-"]
        for n in sizes:
            cells += [_tv(results[n][name]["finest"]), _tv(results[n][name]["sequence"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, nargs="+", default=[5_000, 30_000])
    ap.add_argument("--save", default=None, help="write PREFIX.md and PREFIX.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = {n: coverage(n, log=print) for n in args.trials}
    text = format_markdown(results)
    print(text)
    if args.save:
        with open(args.save + ".md", "w") as f:
            f.write(f"Coverage of `specdec audit --verifier` (`python -m specdec_kernels.audit.coverage --trials "
                    f"{' '.join(map(str, args.trials))}`); bold: the case's own mutant.\n\n" + text)
        with open(args.save + ".json", "w") as f:
            json.dump({str(n): r for n, r in results.items()}, f, indent=1, default=str)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
