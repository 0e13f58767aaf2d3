"""``specdec env``: the bug-report facts on CPU, the CUDA facts with a mocked device (and on a real
one where there is one), the interpreter's verdict, and both entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import transformers

import specdec_kernels
from specdec_kernels import env
from specdec_kernels.cli import main as cli_main
from specdec_kernels.ops import extension

from helpers import HAS_CUDA

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_env_text_on_cpu(on_cpu, capsys):
    assert cli_main(["env"]) == 0
    out = capsys.readouterr().out
    for line in (f"specdec_kernels: {specdec_kernels.__version__}", f"torch: {torch.__version__}",
                 f"triton: {triton.__version__}", f"transformers: {transformers.__version__}",
                 "fused_verify backend (\"auto\") on this device: torch", "device: cpu ("):
        assert line in out, (line, out)
    assert ("C++ extension: loaded from" if extension.HAS_EXT else "C++ extension: NOT loaded") in out
    if extension.HAS_EXT:  # the CPU linear layer's path for each row count, as runs over 1..24
        from specdec_kernels.ops.linear import auto_isa

        line = next(ln for ln in out.splitlines() if ln.startswith("CPU linear layer (skinny_linear) paths: portable"))
        said = {}  # row -> the path the line names for it
        for part in line.split("taken by rows: ", 1)[1].split(", "):
            rows, isa = part.split(": ")
            a, _, b = rows.partition("-")
            for r in range(int(a), int(b or a) + 1):
                said[r] = isa
        assert said == {r: auto_isa(r) for r in range(1, 25)}, line
    assert "Triton interpreter (TRITON_INTERPRET=" in out and "Triton kernels run on this device: " in out


def test_env_json_and_no_device_query_at_import(on_cpu, capsys):
    assert cli_main(["env", "--json", "--no-kernel-check"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["device"]["type"] == "cpu" and info["fused_verify_backend"] == "torch"
    assert info["extension"]["loaded"] == extension.HAS_EXT
    if extension.HAS_EXT and torch.version.cuda is None:
        assert info["extension"]["cuda_kernels"] is False  # a CPU build of torch builds a CppExtension


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_env_interpreter_verdict(on_cpu, monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    problem = "Triton 3.6.0's interpreter (TRITON_INTERPRET=1) cannot run with NumPy 2.4.6: ..."
    monkeypatch.setattr("specdec_kernels.ops.kernels.interpreter_problem", lambda: problem)
    t = env.collect(run_kernels=False)["triton"]
    assert (t["interpreter"] == f"cannot run here: {problem}"
            and t["kernels"].startswith("no: CPU tensors take the torch"))
    monkeypatch.setattr("specdec_kernels.ops.kernels.interpreter_problem", lambda: None)
    t = env.collect(run_kernels=False)["triton"]
    assert t["interpreter"] == "can run here"
    assert t["kernels"] == ("not checked" if interpret == "1" else
                            "not run: on CPU tensors the kernels run only under Triton's interpreter; "
                            "`TRITON_INTERPRET=1 specdec env` runs one launch")


def test_env_on_a_mocked_gpu(monkeypatch):
    """The CUDA facts, as a machine with an H100 reports them (the launch itself replaced)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=132, total_memory=80 * 2**30))
    launched = []
    monkeypatch.setattr(env, "_triton_launch", lambda device: launched.append(device) or "yes: mocked")
    info = env.collect()
    assert launched == ["cuda"] and info["fused_verify_backend"] == "triton"
    assert info["device"]["capability"] == "9.0" and info["triton"] == {"kernels": "yes: mocked"}
    text = env.format_report(info)
    assert "device: cuda:0 NVIDIA H100 80GB HBM3, compute capability 9.0, 132 SMs, 80.0 GiB (1 visible)" in text
    assert "fused_verify backend (\"auto\") on this device: triton" in text
    assert "Triton kernels run on this device: yes: mocked" in text
    monkeypatch.setattr(env, "_triton_launch", lambda device: (_ for _ in ()).throw(RuntimeError("ptxas failed\nmore")))
    assert env.collect()["triton"]["kernels"] == "NO: RuntimeError: ptxas failed"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreted, not compiled" in env.collect()["triton"]["kernels"]


@pytest.mark.skipif(HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the interpreted launch runs on a machine without CUDA, under TRITON_INTERPRET=1")
def test_env_interpreted_launch_on_cpu():
    assert env._triton_launch("cpu").endswith("its tokens equal the torch path's")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (launches the compiled split kernel on it)")
def test_env_on_the_real_gpu():
    info = env.collect()
    assert info["device"]["type"] == "cuda" and info["fused_verify_backend"] == "triton"
    assert info["triton"]["kernels"].startswith("yes:"), info["triton"]
    assert info["triton"]["kernels"].endswith("its tokens equal the torch path's"), info["triton"]


def test_env_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "specdec_kernels", "env", "--no-kernel-check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"specdec_kernels: {specdec_kernels.__version__}") and "fused_verify backend" in r.stdout
