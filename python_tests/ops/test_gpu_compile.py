"""The GPU code compiles for a GPU this machine does not have: sm_90 (H100/H200).

The interpreter (TRITON_INTERPRET=1) runs the verify kernels' Python on numpy: it checks what
the kernels compute, not that Triton's compiler accepts them for a GPU.  Here
``scripts/gpu_compile_check.py`` compiles the verify kernels ahead of time with Triton's own
ptxas, the split kernel (the "triton" backend) and the one-program-per-row kernel (the benchmarks'
baseline, ``bench/ops/rows_kernel.py``), each for every specialisation of ``VARIANTS`` as its launcher makes it,
and the tree kernel (``fused_verify_tree``'s "triton" backend) for every one of
``TREE_VARIANTS``, and compiles ``csrc/*.cu`` with nvcc and torch's extension flags (when nvcc is
on the machine), in a subprocess without the interpreter; each cubin must use no local memory,
its register spills (from ptxas's log) must stay within a bound, and the kernels' PTX must hold
no fused multiply-add (fusion is pinned off).  Nothing is run: correctness on a GPU is the CUDA tests'
(bench/gpu_check.sh).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the ahead-of-time sm_90 compile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


_KERNELS = ("verify_split_kernel", "_verify_rows_kernel", "tree_verify_kernel")
# the meta fields each kernel's result rows show (and the ones they must not)
_FIELDS = {
    "verify_split_kernel": ({"CHUNK", "NCB", "CAP", "BLOCK_K"}, {"BLOCK_V", "BLOCK_N", "BLOCK_D"}),
    "_verify_rows_kernel": ({"BLOCK_V", "BLOCK_K"}, {"CHUNK", "BLOCK_N", "BLOCK_D"}),
    "tree_verify_kernel": ({"BLOCK_V", "BLOCK_N", "BLOCK_D"}, {"CHUNK", "BLOCK_K"}),
}


def _spill_bound(kernel: str, variant: str) -> int:
    """Bytes of spill stores a variant may report (ptxas's log; cuobjdump's LOCAL stays 0 for them).

    Measured under Triton 3.9 for sm_90 at 8 warps:
    - the split kernel: 202-255 registers and no spills in every 49152- or 152064-token variant
      (214-216 on the plain paths, 254-255 with top-k/top-p or given uniforms), 8 bytes at 4
      warps for V = 100 (72 registers).  The draft-logits forms (DRAFT_LOGITS, V = 128,256): 252
      registers and no spills (bf16 plain), 255 and 16 bytes (packed, top-k + top-p, logprobs).
      The min-p forms (HAS_MIN_P, V = 128,256): 255 registers and 8 bytes (bf16 min-p; with top-k +
      top-p), 16 bytes (packed, top-k + top-p, draft logits, logprobs).
      Bounded at 64 bytes: a change that pushes it past 255 registers and spills in earnest fails
      here.  The forms for two programs a multiprocessor: at 4 warps (no cap needed: up to 255
      registers fit two programs of 128 threads) bounded the same; at 8 warps under
      ``maxnreg = 128`` ptxas spills by design (the setting a GPU run weighs against that), so
      those variants may spill up to 1 KB, in local memory.
    - the one-program-per-row kernel: ptxas keeps 128 registers (two blocks a multiprocessor)
      and spills a few bytes in some variants (8 on the plain path, 8-64 with top-k/top-p under
      Triton 3.9; up to 144 under 3.6): 16 bytes on the plain paths, 256 otherwise.
    - the tree kernel: 110-229 registers and no spills in every variant (229 sampled, 172
      deterministic, 205 with top-k + top-p + min-p or at V = 152,064, N = 64, D = 8; 110 at 4 warps
      for V = 100): bounded at 64 bytes, as the split kernel, for the same reason."""
    if kernel == "tree_verify_kernel":
        return 64
    if kernel == "verify_split_kernel":
        return 1024 if "maxnreg 128" in variant else 64
    heavy = "top-k" in variant or "top-p" in variant or "K = 15" in variant or "V = 100" in variant
    return 256 if heavy else 16


def _split_ordering(ticket: int, poll: int) -> dict:
    """The split kernel's memory-ordering instructions in its PTX (Triton 3.9, sm_90), what the
    interleaving tests (``ops.interleave``, sequentially consistent) cannot see: the three
    arrivals (position, row, stage 2) as acq_rel adds; the two ticket claims (the first, and the
    loop's or the prefetch's) acq_rel (TICKET 0) or relaxed; the ready flag's release exchange;
    the poll's acquire, an acquire load (two with POLL 0: the first poll and the loop's; one with
    POLL 1, after the loop's two volatile loads)."""
    want = {"atom.global.gpu.acq_rel.add.u32": 3 + (2 if ticket == 0 else 0),
            "atom.global.gpu.release.exch.b32": 1, "ld.global.gpu.acquire.b32": 2 if poll == 0 else 1}
    if ticket:
        want["atom.global.gpu.relaxed.add.u32"] = 2
    if poll:
        want["ld.volatile.global.b32"] = 2
    return want


def test_verify_kernels_compile_for_sm90(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    # the lists only: the check runs in a subprocess
    from gpu_compile_check import SPLIT_SETTINGS, TREE_VARIANTS, VARIANTS

    proc, results = _check(tmp_path, "--only", "triton", "--arch", "90")
    assert results is not None, proc.stderr[-3000:]
    failed = [(r.get("kernel"), r["variant"], r.get("error")) for r in results if not r["ok"]]
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    expected = {
        "verify_split_kernel": [v[0] for v in VARIANTS] + [v[0] for v in SPLIT_SETTINGS],
        "_verify_rows_kernel": [v[0] for v in VARIANTS],
        "tree_verify_kernel": [v[0] for v in TREE_VARIANTS],
    }
    for kernel in _KERNELS:
        assert [r["variant"] for r in results if r["kernel"] == kernel] == expected[kernel], kernel
        assert f"{kernel} " in proc.stdout, f"the summary does not show {kernel}"
    assert sorted({r["kernel"] for r in results}) == sorted(_KERNELS)
    for r in results:
        what = f"{r['kernel']} {r['variant']}"
        assert r["arch"] == 90
        shown, absent = _FIELDS[r["kernel"]]
        assert shown <= set(r) and not absent & set(r), what
        assert "regs" in r, f"no resource usage read back for {what} (cuobjdump)"
        assert 0 < r["regs"] <= 255
        if "maxnreg 128" not in r["variant"]:  # spills live in local memory under a register cap
            assert r["local"] == 0, f"{what}: {r['local']} bytes of local memory"
        assert "spill_stores" in r, f"no ptxas log read back for {what}"
        bound = _spill_bound(r["kernel"], r["variant"])
        assert r["spill_stores"] <= bound, f"{what}: {r['spill_stores']} bytes of spill stores > {bound}"
        # multiply-adds are not contracted into FMAs (verify.split_kernel_meta, rows_kernel.rows_kernel_meta and
        # tree.api.tree_kernel_meta pin enable_fp_fusion off: the interpreter's and the
        # reference's roundings, whatever Triton's default)
        assert r["enable_fp_fusion"] is False, what
        assert r["fma_f32"] == 0 and r["fma_f64"] == 0, (what, r["fma_f32"], r["fma_f64"])
        if r["kernel"] == "verify_split_kernel":
            order = dict(r["ordering"])
            # a bar.sync before each of the three arrivals and before the flag's release, at least
            assert order.pop("bar.sync") >= 4, (what, r["ordering"])
            assert order == _split_ordering(r["TICKET"], r["POLL"]), (what, r["ordering"])


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
