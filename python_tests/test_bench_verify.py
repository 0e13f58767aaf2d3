"""bench/bench_verify.py on its smoke grid: the rows it promises, and a run stopped at a time
limit (bench/gpu_check.sh sends SIGINT) keeps the cases measured.  No speed is asserted.  In
process, without --threads (which would change torch's thread count for the worker's later tests)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_verify.py"


@pytest.fixture
def bench_verify():
    spec = importlib.util.spec_from_file_location("bench_verify_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mod


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_grid_writes_every_case_and_provider(bench_verify, tmp_path, capsys):
    bench_verify.main(["--grid", "smoke", "--providers", "fused_cpu,reference_eager", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "bench_verify.csv")
    got = sorted((r["provider"], r["B"], r["warp"]) for r in rows)
    want = sorted((p, b, w) for p in ("fused_cpu", "reference_eager") for b in ("1", "4")
                  for w in ("none", "topk50_topp0.9"))
    assert got == want
    for r in rows:
        assert float(r["median_ms"]) > 0 and r["date"] and r["torch"]
        other = "reference_eager" if r["provider"] == "fused_cpu" else "fused_cpu"
        assert float(r[f"speedup_vs_{other}"]) > 0
    out = capsys.readouterr().out
    assert out.count("# B=") == 4  # one progress line per case, printed as it is measured
    assert (tmp_path / "bench_verify.png").stat().st_size > 0


def test_a_run_stopped_at_its_time_limit_keeps_the_cases_measured(bench_verify, tmp_path, monkeypatch):
    real, calls = bench_verify.measure_case, []

    def measure_case(*args, **kwargs):
        calls.append(args[:6])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what SIGINT raises in the main thread
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_verify, "measure_case", measure_case)
    with pytest.raises(SystemExit) as e:
        bench_verify.main(["--grid", "smoke", "--providers", "fused_cpu", "--out", str(tmp_path)])
    assert e.value.code == 130
    assert len(calls) == 2
    rows = _rows(tmp_path / "bench_verify.csv")
    assert [(r["provider"], r["B"], r["warp"]) for r in rows] == [("fused_cpu", "1", "none")]
