"""``bench/gpu_check.sh`` prepared: with ``GPU_CHECK_DRY_RUN=1`` it checks that every file it names
exists and that its CUDA test files collect, then prints each stage's command instead of running
it, and exits 0; a missing file fails it (a test moved or renamed without the script)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dry_run(root, out):
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    env.pop("OUT", None)
    return subprocess.run(["bash", os.path.join(root, "bench", "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_gpu_check_dry_run_prints_every_stage(tmp_path):
    r = _dry_run(ROOT, tmp_path / "out")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "tests collected" in log and "[dry-run]" in log
    for stage in ("tests on CUDA", "specdec audit --verifier ours --backend triton", "bench_verify_knobs",
                  "bench_verify (gpu grid)", "bench_e2e trees", "done: build=0 tests=0 audit=0"):
        assert stage in log, stage


def test_gpu_check_dry_run_fails_on_a_missing_file(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv*", "*.so", "__pycache__", "build",
                                                               "results", "assets", "docs"))
    os.remove(copy / "bench" / "ops" / "bench_verify_knobs.py")
    r = _dry_run(copy, tmp_path / "out")
    assert r.returncode != 0 and "gpu_check: missing bench/ops/bench_verify_knobs.py" in r.stdout + r.stderr
