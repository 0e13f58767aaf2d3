"""Running the verifier audit: every case's calls through the verifier and through the case's
mutant, each read into an outcome, as rows of the report (``report``).

A row: the case, the verdict ('pass', 'FAIL', 'error': the verifier raised or broke the protocol
on valid input, 'n/a': it does not support what the case needs), the statistic, the p-value, the
mutant's p-value and verdict (a case whose mutant passes has no power: it says so).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from .adapters import run_calls
from .block_cases import BLOCK_CASES
from .cases import CASES, Case
from .step_cases import STEP_CASES
from .checks import ALPHA, FormatError
from .sampler import MUTATIONS, mutant

__all__ = ["QUICK_TRIALS", "FULL_TRIALS", "ALL_CASES", "case_names", "run_verifier_audit", "evaluate"]

ALL_CASES = CASES + STEP_CASES + BLOCK_CASES  # token verification's cases (marginal, whole-step), then block's


def case_names() -> list:
    return [c.name for c in ALL_CASES]


def _supports(verifier, case: Case) -> bool:
    return all(getattr(verifier, f"supports_{need}", False) for need in case.needs)


def _mutant_of(case: Case):
    return case.mutant_verifier if case.mutant_verifier is not None else mutant(case.mutation)

QUICK_TRIALS = 3_000  # rows per call of a law case with --quick
FULL_TRIALS = 30_000


def _seeded(case_index: int, calls: list) -> list:
    """Calls whose rows have no seed get row seeds (reproducible, distinct across cases and calls)."""
    out = []
    for i, c in enumerate(calls):
        if c.params.seed is None:
            B = c.target_logits.shape[0]
            c = c.with_seeds(torch.arange(B, dtype=torch.int64) + (case_index * 100 + i) * 1_000_003)
        out.append(c)
    return out


def evaluate(case: Case, calls: list, outputs: list) -> dict:
    """A case's outcome: verdict, statistic, p-value and detail."""
    errors = [o for o in outputs if isinstance(o, BaseException)]
    law_case = not case.bad_input
    unsupported = [e for e in errors if isinstance(e, NotImplementedError)]
    if law_case and unsupported and len(unsupported) == len(errors) and (len(errors) == len(outputs)
                                                                        or not case.partial):
        return dict(verdict="n/a", statistic=None, pvalue=None, detail=f"not supported: {errors[0]}")
    if law_case and len(errors) > len(unsupported):
        e = errors[0]
        return dict(verdict="error", statistic=None, pvalue=None,
                    detail=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")
    try:
        o = case.check(calls, outputs)
    except FormatError as e:
        return dict(verdict="FAIL", statistic=None, pvalue=0.0, detail=f"protocol: {e}")
    return dict(verdict="pass" if o.pvalue >= ALPHA else "FAIL", statistic=o.statistic, pvalue=o.pvalue,
                detail=o.detail, tests=o.tests)


def run_verifier_audit(verifier, trials: int = FULL_TRIALS, cases: Optional[list] = None, mutants: bool = True,
                       log=None) -> list:
    """Run ``cases`` (default: all) against ``verifier`` with ``trials`` rows per law call; returns
    the report's rows (dicts).  ``log``: a callable given one line per case as it finishes."""
    cases = ALL_CASES if cases is None else [c for c in ALL_CASES if c.name in cases]
    seeds = getattr(verifier, "supports_seed", False)
    built = []
    for i, case in enumerate(cases):
        calls = case.build(trials)
        if seeds:
            calls = _seeded(i, calls)
        built.append(calls)
    runnable = [(case, calls) for case, calls in zip(cases, built) if _supports(verifier, case)]
    t0 = time.perf_counter()
    if hasattr(verifier, "run_many"):  # one batch of every case's calls (a worker in another environment)
        flat = [c for _, calls in runnable for c in calls]
        outs = run_calls(verifier, flat)
        split, i = [], 0
        for _, calls in runnable:
            split.append(outs[i:i + len(calls)])
            i += len(calls)
    else:
        split = [run_calls(verifier, calls, seed=1000 * k) for k, (_, calls) in enumerate(runnable)]
    results = dict(zip([c.name for c, _ in runnable], split))
    rows = []
    for case, calls in zip(cases, built):
        row = dict(case=case.name, shows=case.shows, bound=case.bound, mutant=case.mutation,
                   mutant_says=case.mutant_says or MUTATIONS[case.mutation])
        if case.name not in results:
            missing = sorted(n for n in case.needs if not getattr(verifier, f"supports_{n}", False))
            what = {"seed": "takes no per-row seeds", "block": "has no block verification"}
            row.update(verdict="n/a", statistic=None, pvalue=None,
                       detail=f"the verifier {' and '.join(what.get(n, 'lacks ' + n) for n in missing)} "
                              f"({', '.join('supports_' + n for n in missing)} not set)")
        else:
            row.update(evaluate(case, calls, results[case.name]))
        if mutants:
            mcalls = calls if (case.needs & {"seed"}) else [c.with_seeds(None) for c in calls]
            m = evaluate(case, mcalls, run_calls(_mutant_of(case), mcalls, seed=7))
            row.update(mutant_verdict=m["verdict"], mutant_pvalue=m["pvalue"])
        rows.append(row)
        if log is not None:
            log(row)
    rows_time = time.perf_counter() - t0
    for r in rows:
        r.setdefault("seconds_all_cases", round(rows_time, 2))
    return rows
