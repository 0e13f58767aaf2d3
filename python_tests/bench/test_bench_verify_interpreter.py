"""bench/ops/bench_verify_interpreter.py --smoke: every case of both kernels timed under Triton's
interpreter, with its ratio to the plain case, and the files it promises.  A subprocess: the
script sets TRITON_INTERPRET before triton is imported, which a worker that has already
imported the kernels (or one on a GPU machine, where conftest leaves it unset) could not redo.
No speed is asserted: a ratio measured on a shared CPU says nothing about a pass or a fail."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every case of both kernels under the interpreter

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "ops" / "bench_verify_interpreter.py"


def test_smoke_run_times_every_case_and_writes_its_files(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--out", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FAILED" not in r.stdout
    with open(tmp_path / "bench_verify_interpreter.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    warps = ["none", "topk50", "topp0.9", "topk50_topp0.9"]
    masked = ["mask", "mask_topk50_topp0.9"]  # the split kernel under a grammar's mask
    assert [(row["kernel"], row["warp"]) for row in rows] == (
        [("split", w) for w in warps + masked] + [("rows", w) for w in warps])
    for row in rows:
        assert float(row["median_s"]) > 0 and float(row["ratio_to_plain"]) > 0, row
        assert row["interpreter"] == "True" and row["commit"] and row["rounds"] == "1"
        assert float(row["mean_accepted"]) == 2  # make_inputs' accepted drafts, K = 2 (allowed by the mask)
        assert (row["fallback_positions"] != "") == (row["kernel"] == "split")
    assert all(float(row["ratio_to_plain"]) == 1 for row in rows if row["warp"] == "none")
    cond = json.loads((tmp_path / "conditions.json").read_text())
    assert cond["shape"] == dict(B=1, K=2, V=600, dtype="fp32", temperature=1.0, drafts="accepted")
    assert cond["triton_interpret"] == "1" and cond["cpu"] and cond["versions"]["commit"] and cond["threads"] == 1
    assert cond["claim"]["ratio"] == float(rows[3]["ratio_to_plain"])
    assert cond["mask_claim"]["ratio"] == float(rows[4]["ratio_to_plain"])
    assert "ratio_to_plain" in (tmp_path / "bench_verify_interpreter.txt").read_text()


def test_knobs_smoke_runs_every_setting_and_checks_the_tokens(tmp_path):
    """bench_verify_knobs --smoke (the interpreter, tiny shapes): a row per batch, warp and
    setting, every setting giving the first one's tokens, and its CSV/table written. No timing is
    asserted."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "ops", "bench_verify_knobs.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "bench_verify_knobs.txt").read_text()
    rows = [line for line in text.splitlines()[3:] if line.strip()]
    assert len(rows) == 10, text  # 2 batches x (default and combined with and without a warp, prefetch plain)
    assert all(" True " in r for r in rows), text
    assert (tmp_path / "bench_verify_knobs.csv").exists()
