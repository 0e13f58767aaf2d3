"""The ``vllm.general_plugins`` entry point: installed, harmless unless ``SPECDEC_VLLM=1``, loud on
a bad value, and active in the engine process of a multiprocess ``vllm.LLM`` (no code change)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from engine_setup import MAX_TOKENS

HERE = Path(__file__).resolve().parent


def run(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "SPECDEC_VLLM"}
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), e.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                          timeout=420)


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("specdec_kernels") == "specdec_kernels.integrations.vllm:register", eps


LOAD = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from specdec_kernels.integrations import vllm as sv
print("patched", sv.is_patched())
"""


@pytest.mark.parametrize("value,patched", [(None, False), ("0", False), ("1", True)])
def test_vllm_loads_the_plugin(value, patched):
    r = run(LOAD, **({} if value is None else {"SPECDEC_VLLM": value}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"patched {patched}" in r.stdout


def test_bad_value_is_named():
    r = run(LOAD, SPECDEC_VLLM="2")
    assert r.returncode != 0
    assert "SPECDEC_VLLM must be 0 or 1 (unset: off), got '2'" in r.stderr


def test_register_without_vllm_is_harmless():
    """``register`` when vLLM cannot be imported (its modules blocked): no error, nothing patched."""
    r = run("""
        import sys
        sys.modules["vllm"] = None  # import vllm now raises ImportError
        from specdec_kernels.integrations import vllm as sv
        sv.register()
        print("ok", sv.is_patched())
    """, SPECDEC_VLLM="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok False" in r.stdout


def test_multiprocess_engine_uses_the_plugin():
    """``vllm.LLM`` with its engine core in its own process and SPECDEC_VLLM=1: the plugin patches
    the sampler there (vLLM's log says so) and the engine generates (the outputs' equality with
    vLLM's own sampler is test_engine.py's, in one process)."""
    code = """
        import json, os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        from engine_setup import PROMPTS, make_llm, token_ids, MAX_TOKENS
        from vllm import SamplingParams
        llm = make_llm("ngram")
        out = token_ids(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        print("RESULT " + json.dumps(out), flush=True)
    """
    r = run(code, SPECDEC_VLLM="1")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "RejectionSampler.forward now runs fused_verify_packed" in r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert [len(t) for t in out] == [MAX_TOKENS] * 2


def test_bench_vllm_engine_runs(tmp_path):
    """bench/integrations/bench_vllm_engine.py on a small case, in a process of its own: both samplers' rows,
    the same greedy tokens, steps through the fused op."""
    import csv

    bench = HERE.parents[2] / "bench" / "integrations" / "bench_vllm_engine.py"
    r = subprocess.run([sys.executable, str(bench), "--methods", "ngram", "--batches", "2", "--rounds", "1",
                        "--max-tokens", "8", "--out", str(tmp_path)],
                       env={k: v for k, v in os.environ.items() if k != "SPECDEC_VLLM"}, capture_output=True,
                       text=True, timeout=420)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = list(csv.DictReader(open(tmp_path / "bench_vllm_engine.csv")))
    assert [(row["sampler"], row["B"]) for row in rows] == [("vLLM", "2"), ("specdec plugin", "2")]
    assert all(row["same_tokens"] == "True" for row in rows)
    assert rows[0]["fused_steps"] == "0" and int(rows[1]["fused_steps"]) > 0
