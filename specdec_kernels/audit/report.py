"""The audit's report: a header (what was audited, the versions, the date, the trials) and a table
of the cases (case, statistic, p-value, verdict, the mutant's p-value), then each case's detail;
or the same as JSON."""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import platform

__all__ = ["versions", "header", "format_text", "as_json", "exit_status"]


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(extra: dict | None = None) -> dict:
    """The versions that matter to a verdict: Python, torch, transformers, scipy, this package (and
    ``extra``: vLLM's, read in its own environment)."""
    import torch

    import specdec_kernels

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
           "scipy": _version("scipy"), "specdec_kernels": specdec_kernels.__version__}
    out.update(extra or {})
    return out


def header(target: str, trials: int, mode: str, extra_versions: dict | None = None) -> dict:
    from .checks import ALPHA

    return {"audited": target, "mode": mode, "trials": trials,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": versions(extra_versions), "alpha": ALPHA}


def _num(x, fmt="{:.3g}") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return fmt.format(x)


def format_text(head: dict, rows: list) -> str:
    v = head["versions"]
    lines = [f"specdec audit: {head['audited']} ({head['mode']}, {head['trials']} trials per law call), {head['date']}",
             "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None),
             f"a case fails when its p-value < {head['alpha']:g}; the mutant's p-value (a deliberately wrong sampler "
             f"on the same case) shows the case's power", ""]
    cols = ("case", "statistic", "p-value", "verdict", "mutant p-value")
    table = [cols] + [(r["case"], _num(r.get("statistic"), "{:.4g}"), _num(r.get("pvalue")), r["verdict"],
                       (_num(r.get("mutant_pvalue")) + (f" ({r['mutant_verdict']})" if r.get("mutant_verdict") else ""))
                       if "mutant_pvalue" in r else "-") for r in rows]
    widths = [max(len(str(t[i])) for t in table) for i in range(len(cols))]
    for i, t in enumerate(table):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    failed = [r for r in rows if r["verdict"] in ("FAIL", "error")]
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} cases pass or do not apply; "
              f"{len(failed)} fail{' (' + ', '.join(r['case'] for r in failed) + ')' if failed else ''}", ""]
    for r in rows:
        lines.append(f"{r['case']}: {r['shows']}")
        lines.append(f"  bound: {r['bound']}")
        lines.append(f"  {r['verdict']}: {r.get('detail', '')}")
        if r.get("mutant"):
            lines.append(f"  mutant {r['mutant']} ({r['mutant_says']}): p {_num(r.get('mutant_pvalue'))}, "
                         f"{r.get('mutant_verdict', '-')}")
    return "\n".join(lines) + "\n"


def as_json(head: dict, rows: list) -> dict:
    clean = []
    for r in rows:
        c = dict(r)
        for k in ("statistic", "pvalue", "mutant_pvalue"):
            if isinstance(c.get(k), float) and math.isinf(c[k]):
                c[k] = "inf"
        clean.append(c)
    return {"header": head, "cases": clean}


def exit_status(rows: list) -> int:
    """1 when a case fails (a FAIL, or an error on valid input), else 0."""
    return 1 if any(r["verdict"] in ("FAIL", "error") for r in rows) else 0
