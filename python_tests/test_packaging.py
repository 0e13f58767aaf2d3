"""Packaging as users meet it: an sdist that carries everything the build needs, a wheel built
from that sdist (not from the checkout) that imports with its C++ ops, one version, the licence,
and a build without torch that fails in one line saying what to run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds an sdist and a wheel from it

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd, cwd, timeout=900, env=None):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    return r


def test_wheel_built_from_the_sdist_imports_with_its_ops(tmp_path):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    (sdist,) = dist.glob("specdec_kernels-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    for needed in ("csrc/parallel.h", "csrc/ops.cpp", "LICENSE", "NOTICE", "specdec_kernels/py.typed",
                   "specdec_kernels/assets/draft/model.safetensors", "requirements.txt"):
        assert needed in names, needed
    env = {**os.environ, "USE_CUDA": "0", "MAX_JOBS": "2"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(dist), str(sdist)],
         cwd=tmp_path, env=env)
    (wheel,) = dist.glob("specdec_kernels-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith("METADATA"))
        metadata = z.read(meta).decode()
    version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "specdec_kernels/__init__.py").read_text(), re.M).group(1)
    assert f"\nVersion: {version}\n" in metadata
    assert "License-Expression: Apache-2.0" in metadata or "License: Apache-2.0" in metadata
    assert 'Provides-Extra: hf' in metadata and 'Provides-Extra: bench' in metadata
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)], cwd=tmp_path)
    probe = ("import specdec_kernels, specdec_kernels.ops.extension as e, torch; "
             "assert specdec_kernels.__file__.startswith(%r), specdec_kernels.__file__; "
             "assert e.HAS_EXT and hasattr(torch.ops.specdec, 'compact_kv_'); print(specdec_kernels.__version__)"
             % str(target))
    r = _run([sys.executable, "-W", "error::RuntimeWarning", "-c", probe], cwd=tmp_path,
             env={**os.environ, "PYTHONPATH": str(target)})
    assert r.stdout.strip() == version


def test_a_build_without_torch_says_what_to_run(tmp_path):
    # setup.py run by an interpreter that cannot import torch (an isolated build's situation)
    block = tmp_path / "sitecustomize.py"
    block.write_text("import sys\nclass _B:\n    def find_spec(self, n, p=None, t=None):\n"
                     "        if n == 'torch' or n.startswith('torch.'):\n            raise ImportError('no torch')\n"
                     "sys.meta_path.insert(0, _B())\n")
    r = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "install torch first" in lines[0] and "--no-build-isolation" in lines[0], r.stderr
