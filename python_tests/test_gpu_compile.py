"""The GPU code compiles for a GPU this machine does not have: sm_90 (H100/H200).

The interpreter (TRITON_INTERPRET=1) runs the verify kernel's Python on numpy: it checks what
the kernel computes, not that Triton's compiler accepts it for a GPU.  Here
``scripts/gpu_compile_check.py`` compiles it ahead of time with Triton's own ptxas for each
specialisation the launcher makes, and compiles ``csrc/*.cu`` with nvcc and torch's extension
flags (when nvcc is on the machine), in a subprocess without the interpreter; each cubin must
use no local memory (a register spill shows there), and the kernel's PTX must hold no fused
multiply-add (fusion is pinned off).  Nothing is run: correctness on a GPU is
the CUDA tests' (bench/gpu_check.sh).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_compile_check.py")


def _nvcc_available() -> bool:
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from gpu_compile_check import _nvcc  # the check's own lookup (the check runs in a subprocess)

    return _nvcc() is not None


def _check(tmp_path, *args):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--json", str(out), *args], capture_output=True, text=True,
                          timeout=900)
    results = json.loads(out.read_text()) if out.exists() else None
    return proc, results


def test_verify_kernel_compiles_for_sm90(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from gpu_compile_check import VARIANTS  # the list only: the check itself runs in a subprocess

    proc, results = _check(tmp_path, "--only", "triton", "--arch", "90")
    assert results is not None, proc.stderr[-3000:]
    failed = [(r["variant"], r.get("error")) for r in results if not r["ok"]]
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [r["variant"] for r in results] == [v[0] for v in VARIANTS]
    for r in results:
        assert r["arch"] == 90
        assert "regs" in r, f"no resource usage read back for {r['variant']} (cuobjdump)"
        assert 0 < r["regs"] <= 255
        assert r["local"] == 0, f"{r['variant']}: {r['local']} bytes of local memory"
        # spills, from ptxas's own log (cuobjdump's LOCAL stays 0 for them; a review): ptxas keeps
        # 128 registers at 8 warps (two blocks a multiprocessor) and spills a few bytes in some
        # variants (8 on the plain path, 8-64 with top-k/top-p under Triton 3.9; up to 144 under
        # 3.6): bounded, so that a kernel change that spills in earnest fails here
        assert "spill_stores" in r, f"no ptxas log read back for {r['variant']}"
        bound = 256 if ("top-k" in r["variant"] or "top-p" in r["variant"] or "K = 15" in r["variant"]
                        or "V = 100" in r["variant"]) else 16
        assert r["spill_stores"] <= bound, f"{r['variant']}: {r['spill_stores']} bytes of spill stores > {bound}"
        # multiply-adds are not contracted into FMAs (verify._kernel_meta pins enable_fp_fusion
        # off: the interpreter's and the reference's roundings, whatever Triton's default)
        assert r["enable_fp_fusion"] is False and r["fma_f32"] == 0, (r["variant"], r["fma_f32"])


@pytest.mark.skipif(not _nvcc_available(), reason="nvcc not found: the CUDA source compile check needs a CUDA "
                                                  "toolkit (CUDA_HOME or nvcc on PATH)")
def test_cuda_sources_compile_for_sm90(tmp_path):
    proc, results = _check(tmp_path, "--only", "cuda", "--arch", "90")
    assert results is not None, proc.stderr[-3000:]
    sources = sorted(f"csrc/{f}" for f in os.listdir(os.path.join(ROOT, "csrc")) if f.endswith(".cu"))
    assert sorted(r["source"] for r in results) == sources
    failed = [(r["source"], r.get("error")) for r in results if not r["ok"]]
    assert not failed, failed
    assert proc.returncode == 0
    for r in results:
        assert r["kernels"], f"no kernels found in the object of {r['source']}"
        for name, use in r["kernels"].items():
            assert use["local"] == 0, f"{name}: {use['local']} bytes of local memory (register spills)"


@pytest.mark.skipif(not _nvcc_available(), reason="nvcc not found: the CUDA source compile check needs a CUDA "
                                                  "toolkit (CUDA_HOME or nvcc on PATH)")
def test_cuda_check_reports_a_source_that_does_not_compile(tmp_path):
    """The check can fail: csrc/compact_kv_cuda.cu with one call misspelt is reported, with
    nvcc's error, and the exit status says so."""
    src = open(os.path.join(ROOT, "csrc", "compact_kv_cuda.cu")).read()
    assert "C10_CUDA_KERNEL_LAUNCH_CHECK();" in src
    bad = tmp_path / "compact_kv_broken.cu"
    bad.write_text(src.replace("C10_CUDA_KERNEL_LAUNCH_CHECK();", "C10_CUDA_KERNEL_LAUNCH_CHEK();", 1))
    proc, results = _check(tmp_path, "--only", "cuda", "--arch", "90", "--cu", str(bad))
    assert proc.returncode == 1
    (r,) = results
    assert r["ok"] is False and "C10_CUDA_KERNEL_LAUNCH_CHEK" in r["error"]
