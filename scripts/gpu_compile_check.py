"""Compile the package's GPU code for a GPU this machine does not have (ahead of time).

Two parts, each compiled for the given compute capabilities (default 9.0: H100/H200) and each
cubin's resource usage read back with ``cuobjdump --dump-resource-usage``:

- ``triton``: the three verify kernels through ``triton.compile`` with a ``GPUTarget`` (no driver
  or GPU needed: Triton's own ptxas makes the cubin).  The two chain kernels once per
  specialisation listed in ``VARIANTS`` each: the split kernel
  (``specdec_kernels/ops/verify/triton/split_kernel.py``, the ``"triton"`` backend; constexprs and
  num_warps from ``verify.split_kernel_meta``) and the one-program-per-row kernel
  (``bench/ops/rows_kernel.py``, the benchmarks' baseline; from ``rows_kernel.rows_kernel_meta``),
  as for a launch.  The argument types are the ones the launchers pass:
  an absent optional pointer is the int64 placeholder they pass instead; the split kernel's
  per-row parameters are typed as [B] tensors of the op's dtypes (whether a row reads the tensor
  or the scalar argument is decided at run time, so both paths are compiled), its scalar
  temperature/top_p fp32, its scalar seed/offset i64 (they may not fit in 32 bits), its workspace
  as the launcher allocates it (int32 counters, fp32/int32 partial records, int32 candidates,
  float64 chunk masses) and its work-item order pointer as the placeholder (HAS_ORDER is a tests'
  specialisation).  Other integer arguments are typed i32 (the JIT's type for values that fit)
  without the JIT's divisibility hints, which change scheduling, not validity.  The tree kernel
  (``specdec_kernels/ops/tree/kernel.py``, ``fused_verify_tree``'s ``"triton"`` backend;
  constexprs and num_warps from ``tree.api.tree_kernel_meta``) once per specialisation listed
  in ``TREE_VARIANTS``, typed as ``tree.api._launch_tree`` passes its arguments.
- ``cuda``: the CUDA source of the C++ ops (``csrc/*.cu``) through ``nvcc -c`` with the flags
  torch's ``BuildExtension`` gives a ``CUDAExtension`` (torch's include paths, its common nvcc
  flags, the ``-std`` torch's CUDAExtension uses, the extension's defines), when nvcc is found.  A CPU build of torch
  ships the CUDA headers but not ``c10/cuda/impl/cuda_cmake_macros.h``, which a CUDA build
  generates: the check then supplies that one-line header (``#define
  C10_CUDA_BUILD_SHARED_LIBS``, what a CUDA build of torch writes there).

Nothing runs: a compile check says that the code is valid for that architecture and what it
uses (registers, stack, local memory; spills from ptxas's own log, since a spill can sit in the
stack frame with no local memory), not that it is correct; the CUDA
tests (``bench/gpu_check.sh``) do that on a GPU.  Exit status 1 when anything failed to compile.

    python scripts/gpu_compile_check.py                      # both parts, sm_90
    python scripts/gpu_compile_check.py --arch 80,90 --json out.json
    python scripts/gpu_compile_check.py --only triton
"""

from __future__ import annotations

import argparse
import contextlib
import io
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (name, logits dtype, draft token dtype, V, K, draft_probs, top_k, top_p, uniforms)
VARIANTS = [
    ("fp32 plain", "fp32", "i64", 49152, 4, True, False, False, False),
    ("fp32 top-k + top-p", "fp32", "i64", 49152, 4, True, True, True, False),
    ("fp32 top-k", "fp32", "i64", 49152, 4, True, True, False, False),
    ("fp32 top-p", "fp32", "i64", 49152, 4, True, False, True, False),
    ("fp32 one-hot drafts", "fp32", "i64", 49152, 4, False, False, False, False),
    ("fp32 one-hot drafts + top-k + top-p", "fp32", "i64", 49152, 4, False, True, True, False),
    ("fp32 given uniforms", "fp32", "i64", 49152, 4, True, True, True, True),
    ("bf16 plain", "bf16", "i64", 49152, 4, True, False, False, False),
    ("bf16 top-k + top-p", "bf16", "i64", 49152, 4, True, True, True, False),
    ("fp16 plain", "fp16", "i32", 49152, 4, True, False, False, False),
    ("fp32 K = 0", "fp32", "i64", 49152, 0, True, False, False, False),
    ("fp32 K = 15", "fp32", "i64", 152064, 15, True, True, True, False),
    ("fp32 V = 100", "fp32", "i64", 100, 3, True, True, True, False),
]

# The split kernel's memory-ordering instructions as Triton lowers them for sm_90: the ticket's
# and the arrivals' atomic adds (acq_rel or relaxed), the ready flag's release exchange, the
# polls' acquire (an atomic add of 0 with acquire order becomes an acquire load) and the relaxed
# poll's volatile loads.
_ORDERING = re.compile(r"\b(?:atom\.global\.gpu\.\w+\.\w+\.\w+|ld\.global\.gpu\.acquire\.\w+"
                       r"|ld\.volatile\.global\.\w+)")


def split_kernel_atomics(ptx: str) -> dict:
    """{instruction: count} of the memory-ordering instructions in a kernel's PTX (``_ORDERING``),
    with ``bar.sync``'s count (the barrier before each arrival and before the flag's release)."""
    out: dict = {}
    for m in _ORDERING.findall(ptx):
        out[m] = out.get(m, 0) + 1
    out["bar.sync"] = ptx.count("bar.sync")
    return out


_USAGE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _arch_list(text: str) -> list:
    out = []
    for part in text.split(","):
        part = part.strip().replace(".", "")
        if not part.isdigit() or len(part) < 2:
            raise argparse.ArgumentTypeError(f"--arch: compute capabilities like 90 or 9.0, got {part!r}")
        out.append(int(part))
    return out


def cuobjdump() -> str | None:
    """Triton's bundled cuobjdump, else the CUDA toolkit's, else None."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if bundled.is_file():
        return str(bundled)
    return shutil.which("cuobjdump")


def resource_usage(path: str) -> dict:
    """{kernel name: {regs, stack, shared, local}} of a cubin or object file (empty without cuobjdump)."""
    tool = cuobjdump()
    if tool is None:
        return {}
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    return {m[1]: dict(regs=int(m[2]), stack=int(m[3]), shared=int(m[4]), local=int(m[5]))
            for m in _USAGE.finditer(out)}


def _kernel(name: str):
    """One of the package's Triton kernels (imported here, after the environment is set up)."""
    from specdec_kernels.ops.kernels import triton_kernels

    return triton_kernels()[name]


def _rows_kernel():
    """bench/ops/rows_kernel.py, the one-program-per-row kernel (the benchmarks' baseline, not the package's)."""
    sys.path.insert(0, str(ROOT / "bench" / "ops"))
    import rows_kernel

    return rows_kernel


def verify_signature(logits: str, tokens: str, meta: dict) -> dict:
    """The one-program-per-row verify kernel's argument types for a launch with these dtypes and flags."""
    _verify_kernel = _rows_kernel()._verify_rows_kernel

    placeholder = "*i64"  # the launcher passes num_accepted for an absent optional pointer
    sig = dict(
        logits_ptr=f"*{logits}", stride_lb="i32", stride_lk="i32",
        draft_tokens_ptr=f"*{tokens}", stride_tb="i32",
        draft_probs_ptr="*fp32" if meta["HAS_DRAFT_PROBS"] else placeholder, stride_qb="i32", stride_qk="i32",
        num_draft_ptr="*i64", temperature_ptr="*fp32",
        top_k_ptr="*i64", top_p_ptr="*fp32" if meta["HAS_TOP_P"] else placeholder,
        seed_ptr="*i64", offset_ptr="*i64",
        uniforms_ptr="*fp64" if meta["HAS_UNIFORMS"] else placeholder,
        tokens_ptr="*i64", num_accepted_ptr="*i64",
        K="i32", V="i32", Vd="i32",
    )
    params = list(inspect.signature(_verify_kernel.fn).parameters)
    for name in params:
        if name not in sig:
            sig[name] = "constexpr"
    if list(sig) != params:
        raise RuntimeError(f"the verify kernel's parameters changed: {params}; update verify_signature")
    return sig


def tree_signature(logits: str, tokens: str, parents: str, meta: dict) -> dict:
    """The tree verify kernel's argument types for a launch with these dtypes and flags (as
    ``tree.api._launch_tree`` passes them: fp32 draft probabilities, [B] tensors of every
    per-row parameter, fp32 workspaces, int64 outputs)."""
    _tree_verify_kernel = _kernel("tree_verify")

    placeholder = "*i64"  # the launcher passes num_accepted for an absent optional pointer
    sig = dict(
        logits_ptr=f"*{logits}", stride_lb="i32", stride_ln="i32",
        node_tokens_ptr=f"*{tokens}", stride_xb="i32",
        parents_ptr=f"*{parents}", stride_pb="i32",
        draft_probs_ptr="*fp32" if meta["HAS_DRAFT_PROBS"] else placeholder, stride_qb="i32", stride_qn="i32",
        num_nodes_ptr="*i64", temperature_ptr="*fp32",
        top_k_ptr="*i64" if meta["HAS_TOP_K"] else placeholder,
        top_p_ptr="*fp32" if meta["HAS_TOP_P"] else placeholder,
        min_p_ptr="*fp32" if meta["HAS_MIN_P"] else placeholder,
        seed_ptr="*i64", offset_ptr="*i64",
        uniforms_ptr="*fp64" if meta["HAS_UNIFORMS"] else placeholder,
        p_ws_ptr="*fp32",
        q_ws_ptr="*fp32" if meta["HAS_DRAFT_PROBS"] else placeholder,
        tokens_ptr="*i64", path_ptr="*i64", num_accepted_ptr="*i64",
        N="i32", V="i32", Vd="i32", D="i32",
    )
    params = list(inspect.signature(_tree_verify_kernel.fn).parameters)
    for name in params:
        if name not in sig:
            sig[name] = "constexpr"
    if list(sig) != params:
        raise RuntimeError(f"the tree verify kernel's parameters changed: {params}; update tree_signature")
    return sig


def verify_split_signature(logits: str, tokens: str, meta: dict) -> dict:
    """The split verify kernel's argument types for a launch with these dtypes and flags (as
    ``_verify_launch._launch_triton`` passes them)."""
    _verify_split_kernel = _kernel("verify_split")

    placeholder = "*i64"  # the launcher passes num_accepted for an absent tensor
    sig = dict(
        logits_ptr=f"*{logits}", stride_lb="i32", stride_lk="i32",
        draft_tokens_ptr=f"*{tokens}", stride_tb="i32", stride_tk="i32",
        draft_probs_ptr=f"*{meta.get('_q_dtype', 'fp32')}" if meta["HAS_DRAFT_PROBS"] else placeholder,
        stride_qb="i32", stride_qk="i32",
        cu_ptr="*i32" if meta["PACKED"] else placeholder, cu_stride="i32",
        mask_ptr="*i32" if meta.get("MASKED") else placeholder, stride_mb="i32", stride_mk="i32",
        uniforms_ptr="*fp64" if meta["HAS_UNIFORMS"] else placeholder, stride_ub="i32", stride_uk="i32",
        param_flags="i32",
        nd_ptr="*i64", nd_stride="i32", nd_scalar="i32",
        t_ptr="*fp32", t_stride="i32", t_scalar="fp32",
        k_ptr="*i64", k_stride="i32", k_scalar="i32",
        p_ptr="*fp32" if meta["HAS_TOP_P"] else placeholder, p_stride="i32", p_scalar="fp32",
        mp_ptr="*fp32" if meta.get("HAS_MIN_P") else placeholder, mp_stride="i32", mp_scalar="fp32",
        seed_ptr="*i64", seed_stride="i32", seed_scalar="i64",
        off_ptr="*i64", off_stride="i32", off_scalar="i64",
        seed_row_step="i32",
        tokens_ptr="*i64", stride_ob="i32", stride_oc="i32", num_accepted_ptr="*i64", stride_on="i32",
        logprobs_ptr="*fp32" if meta["LOGPROBS"] else placeholder, stride_pb="i32", stride_pc="i32",
        counters_ptr="*i32", part_f_ptr="*fp32", part_i_ptr="*i32", cand_ptr="*i32", mass_ptr="*fp64",
        order_ptr="*i32" if meta["HAS_ORDER"] else placeholder,
        B="i32", K="i32", V="i32", Vd="i32", NC="i32", LAG="i32",
    )
    params = list(inspect.signature(_verify_split_kernel.fn).parameters)
    for name in params:
        if name not in sig:
            sig[name] = "constexpr"
    if list(sig) != params:
        raise RuntimeError(f"the split verify kernel's parameters changed: {params}; update verify_split_signature")
    return sig


@contextlib.contextmanager
def _ptxas_log_printed():
    """Triton's own ptxas run (its flags, -v included) prints its log, and compiles afresh (a
    cached kernel runs no ptxas): spills are in that log only, not in cuobjdump's resource usage
    (a spill can sit in a STACK frame with LOCAL 0)."""
    from triton import knobs

    old, old_dump = os.environ.get("TRITON_CACHE_DIR"), knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-aot-cache-")
    try:
        yield
    finally:
        knobs.nvidia.dump_ptxas_log = old_dump
        shutil.rmtree(os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR")
        else:
            os.environ["TRITON_CACHE_DIR"] = old


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _spills(ptxas_log: str) -> dict:
    """{spill_stores, spill_loads} in bytes from a ptxas -v log ({} when it printed none)."""
    found = _SPILLS.findall(ptxas_log)
    if not found:
        return {}
    return dict(spill_stores=sum(int(a) for a, _ in found), spill_loads=sum(int(b) for _, b in found))


def _kernels() -> list:
    """(kernel, meta function, signature function, the meta fields a result row shows) of each
    Triton kernel checked: the split kernel (the "triton" backend) first, then the
    one-program-per-row kernel (bench/ops/rows_kernel.py), then the tree kernel
    (``fused_verify_tree``'s "triton" backend; its cases come from ``TREE_VARIANTS``)."""
    _tree_verify_kernel = _kernel("tree_verify")
    rows = _rows_kernel()
    _verify_kernel = rows._verify_rows_kernel
    _verify_split_kernel = _kernel("verify_split")
    from specdec_kernels.ops.tree.api import tree_kernel_meta
    from specdec_kernels.ops.verify import split_kernel_meta

    return [
        (_verify_split_kernel, split_kernel_meta, verify_split_signature, ("CHUNK", "NCB", "CAP", "BLOCK_K")),
        (_verify_kernel, rows.rows_kernel_meta, verify_signature, ("BLOCK_V", "BLOCK_K")),
        (_tree_verify_kernel, tree_kernel_meta, tree_signature, ("BLOCK_V", "BLOCK_N", "BLOCK_D")),
    ]


# The tree kernel's specialisations: (variant, logits dtype, node token dtype, parent dtype, V,
# N (nodes), D (the outputs' width, the deepest node), draft_probs, top_k, top_p, min_p,
# uniforms).  draft_probs False is the deterministic rule (children a function of the prefix).
TREE_VARIANTS = [
    ("fp32 plain sampled", "fp32", "i64", "i64", 49152, 16, 4, True, False, False, False, False),
    ("bf16 deterministic", "bf16", "i64", "i64", 49152, 16, 4, False, False, False, False, False),
    ("fp32 top-k + top-p + min-p", "fp32", "i64", "i64", 49152, 16, 4, True, True, True, True, False),
    ("fp32 given uniforms", "fp32", "i64", "i64", 49152, 16, 4, True, False, False, False, True),
    ("fp16 int32 node tokens and parents", "fp16", "i32", "i32", 49152, 16, 4, True, False, False, False, False),
    ("bf16 V = 152064, N = 64, D = 8", "bf16", "i64", "i64", 152064, 64, 8, True, True, True, False, False),
    ("fp32 V = 100, N = 5, D = 2", "fp32", "i64", "i64", 100, 5, 2, True, True, True, False, False),
]


# The split kernel's launch settings beside its defaults (bench_verify_knobs.py times them on a
# GPU) and its engine-facing forms: (variant, logits dtype, draft token dtype, V, K, draft_probs,
# top_k, top_p, uniforms, constexprs set). At 4 chunks its loads are software-pipelined (cp.async
# on a GPU, where the JIT's alignment hints apply; this check compiles without them, so it checks
# validity only). "_q_dtype" is the draft probabilities' (or, DRAFT_LOGITS, the draft logits')
# pointer type, not a constexpr. HAS_MIN_P: a min_p argument, its pointer typed as a [B] fp32
# tensor (the kernel reads it or the scalar at run time, so both paths compile).
SPLIT_SETTINGS = [
    ("bf16 plain, 4 chunks an item", "bf16", "i64", 128256, 4, True, False, False, False, {"TILES": 4}),
    ("bf16 plain, prefetched relaxed ticket, relaxed poll, 200 ns sleep", "bf16", "i64", 128256, 4, True, False, False,
     False, {"TICKET": 2, "POLL": 1, "SLEEP_NS": 200}),
    ("bf16 top-k + top-p, prefetched ticket, relaxed poll", "bf16", "i64", 128256, 4, True, True, True, False,
     {"TICKET": 2, "POLL": 1, "SLEEP_NS": 200}),
    ("bf16 plain, 4 warps (two programs an SM)", "bf16", "i64", 128256, 4, True, False, False, False,
     {"num_warps": 4}),
    ("bf16 top-k + top-p, 4 warps (two programs an SM)", "bf16", "i64", 128256, 4, True, True, True, False,
     {"num_warps": 4}),
    ("bf16 plain, 8 warps, maxnreg 128", "bf16", "i64", 128256, 4, True, False, False, False, {"maxnreg": 128}),
    ("bf16 top-k + top-p, 8 warps, maxnreg 128", "bf16", "i64", 128256, 4, True, True, True, False,
     {"maxnreg": 128}),
    ("bf16 top-k + top-p, 4 chunks an item", "bf16", "i64", 128256, 4, True, True, True, False, {"TILES": 4}),
    ("bf16 packed, bf16 q, logprobs", "bf16", "i32", 128256, 4, True, False, False, False,
     {"PACKED": True, "LOGPROBS": True, "_q_dtype": "bf16"}),
    ("bf16 packed top-k + top-p, logprobs", "bf16", "i32", 128256, 4, True, True, True, False,
     {"PACKED": True, "LOGPROBS": True}),
    ("fp32 probabilities in, packed", "fp32", "i32", 128256, 4, True, False, False, False,
     {"PACKED": True, "PROBS": True}),
    ("bf16 draft logits (bf16)", "bf16", "i64", 128256, 4, True, False, False, False,
     {"DRAFT_LOGITS": True, "_q_dtype": "bf16"}),
    ("bf16 packed top-k + top-p, fp32 draft logits, logprobs", "bf16", "i32", 128256, 4, True, True, True, False,
     {"PACKED": True, "LOGPROBS": True, "DRAFT_LOGITS": True}),
    ("bf16 min-p", "bf16", "i64", 128256, 4, True, False, False, False, {"HAS_MIN_P": True}),
    ("bf16 top-k + top-p + min-p", "bf16", "i64", 128256, 4, True, True, True, False, {"HAS_MIN_P": True}),
    ("bf16 packed top-k + top-p + min-p, fp32 draft logits, logprobs", "bf16", "i32", 128256, 4, True, True, True,
     False, {"PACKED": True, "LOGPROBS": True, "DRAFT_LOGITS": True, "HAS_MIN_P": True}),
    ("bf16 block verification", "bf16", "i64", 128256, 4, True, False, False, False, {"BLOCK": True}),
    ("bf16 block, one-hot drafts, top-k + top-p", "bf16", "i64", 128256, 4, False, True, True, False, {"BLOCK": True}),
    ("bf16 packed block, fp32 draft logits, min-p, logprobs", "bf16", "i32", 128256, 4, True, False, False, False,
     {"PACKED": True, "LOGPROBS": True, "DRAFT_LOGITS": True, "HAS_MIN_P": True, "BLOCK": True}),
    ("bf16 grammar mask", "bf16", "i64", 128256, 4, True, False, False, False, {"MASKED": True}),
    ("bf16 grammar mask, top-k + top-p + min-p", "bf16", "i64", 128256, 4, True, True, True, False,
     {"MASKED": True, "HAS_MIN_P": True}),
    ("bf16 packed grammar mask, fp32 draft logits, logprobs", "bf16", "i32", 128256, 4, True, False, False, False,
     {"PACKED": True, "LOGPROBS": True, "DRAFT_LOGITS": True, "MASKED": True}),
    ("fp32 block, grammar mask, probabilities in", "fp32", "i64", 128256, 4, True, False, False, False,
     {"BLOCK": True, "MASKED": True, "PROBS": True}),
]


def compile_triton(archs: list) -> list:
    import triton

    results = []
    tmp = tempfile.mkdtemp(prefix="specdec-aot-")
    for arch in archs:
        for kernel, meta_of, signature_of, shown in _kernels():
            if kernel.fn.__name__ == "tree_verify_kernel":
                for name, logits, tokens, parents, V, N, D, has_q, has_k, has_p, has_mp, has_u in TREE_VARIANTS:
                    meta = meta_of(V, N, D, has_q, has_k, has_p, has_mp, has_u)
                    signature = signature_of(logits, tokens, parents, meta)
                    results.append(_compile_one(kernel, meta, signature, name, arch, shown, tmp, len(results),
                                                triton.__version__))
                continue
            cases = [(v, None) for v in VARIANTS]
            if kernel.fn.__name__ == "verify_split_kernel":
                cases += [(v[:-1], v[-1]) for v in SPLIT_SETTINGS]
            for (name, logits, tokens, V, K, has_q, has_k, has_p, has_u), extra in cases:
                meta = meta_of(V, K + 1, has_q, has_k, has_p, has_u)
                meta.update(extra or {})
                signature = signature_of(logits, tokens, meta)
                meta.pop("_q_dtype", None)
                results.append(_compile_one(kernel, meta, signature, name, arch, shown, tmp, len(results),
                                            triton.__version__))
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def _compile_one(kernel, meta: dict, signature: dict, name: str, arch: int, shown, tmp: str, n: int,
                 triton_version: str) -> dict:
    """One specialisation compiled for sm_<arch>: its result row (resources, spills, FMAs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kname = kernel.fn.__name__
    meta = dict(meta)
    options = dict(num_warps=meta.pop("num_warps"), enable_fp_fusion=meta.pop("enable_fp_fusion"))
    if "maxnreg" in meta:
        options["maxnreg"] = meta.pop("maxnreg")
    row = dict(part="triton", kernel=kname, variant=name, arch=arch, num_warps=options["num_warps"],
               **{f: meta[f] for f in shown}, triton=triton_version)
    for f in ("TILES", "TICKET", "POLL", "SLEEP_NS"):
        if f in meta:
            row[f] = meta[f]
    if "maxnreg" in options:
        row["maxnreg"] = options["maxnreg"]
    t0 = time.time()
    try:
        src = ASTSource(fn=kernel, signature=signature, constexprs=meta)
        log = io.StringIO()
        with _ptxas_log_printed(), contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        path = os.path.join(tmp, f"{kname}-{arch}-{n}.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        # fused multiply-adds in the PTX: none while enable_fp_fusion is off (the kernels write
        # no tl.fma), hundreds with it on
        ptx = k.asm["ptx"]
        row.update(ok=True, enable_fp_fusion=options["enable_fp_fusion"],
                   fma_f32=ptx.count("fma.rn.f32"), fma_f64=ptx.count("fma.rn.f64"),
                   **resource_usage(path).get(kname, {}), **_spills(log.getvalue()))
        if kname == "verify_split_kernel":
            row["ordering"] = split_kernel_atomics(ptx)
    except Exception as e:  # noqa: BLE001  (reported, and the exit status says it)
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
    row["seconds"] = round(time.time() - t0, 2)
    return row


def _torch_cxx_std() -> str:
    """The C++ standard torch's CUDAExtension passes nvcc (c++17 in torch 2.11, the GPU image's;
    c++20 in 2.13): the check compiles as the real build would."""
    from torch.utils import cpp_extension as ce

    m = re.search(r"cuda_cflags = \['-std=(c\+\+\d+)'\]", inspect.getsource(ce))
    return m[1] if m else "c++17"


def _nvcc() -> str | None:
    """torch's CUDA_HOME/bin/nvcc where torch found a toolkit, else nvcc on PATH, else None."""
    from torch.utils import cpp_extension as ce

    if ce.CUDA_HOME and os.path.exists(os.path.join(ce.CUDA_HOME, "bin", "nvcc")):
        return os.path.join(ce.CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


def nvcc_command(source: str, output: str, arch: int, shim_dir: str | None) -> list:
    """nvcc -c for one csrc/*.cu file, with the flags BuildExtension gives a CUDAExtension."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension as ce

    nvcc = _nvcc()
    # nvcc adds its own toolkit's include directory (cuda_runtime.h) itself
    includes = [str(ROOT / "csrc")] + ([shim_dir] if shim_dir else []) + ce.include_paths("cpu") + [
        sysconfig.get_paths()["include"]]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return ([nvcc, "-c", source, "-o", output] + [f"-I{p}" for p in includes] + ce.COMMON_NVCC_FLAGS
            + ["--compiler-options", "-fPIC", "-O3", f"-std={_torch_cxx_std()}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               "-DTORCH_EXTENSION_NAME=_C", "-DPy_LIMITED_API=0x030a0000", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-gencode=arch=compute_{arch},code=sm_{arch}"])


def compile_cuda(archs: list, sources: list | None = None) -> list:
    from torch.utils import cpp_extension as ce

    nvcc = _nvcc()
    if nvcc is None:
        return [dict(part="cuda", ok=None, error="nvcc not found (set CUDA_HOME or put nvcc on PATH)")]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    tmp = tempfile.mkdtemp(prefix="specdec-nvcc-")
    shim = None
    torch_include = ce.include_paths("cpu")[0]
    if not os.path.exists(os.path.join(torch_include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        shim = os.path.join(tmp, "shim")
        os.makedirs(os.path.join(shim, "c10", "cuda", "impl"))
        with open(os.path.join(shim, "c10", "cuda", "impl", "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    results = []
    for arch in archs:
        for source in sources or sorted(str(p) for p in (ROOT / "csrc").glob("*.cu")):
            out = os.path.join(tmp, f"{Path(source).stem}-{arch}.o")
            row = dict(part="cuda", source=os.path.relpath(source, ROOT) if source.startswith(str(ROOT)) else source,
                       arch=arch, nvcc=version, shim_header=shim is not None)
            t0 = time.time()
            proc = subprocess.run(nvcc_command(source, out, arch, shim), capture_output=True, text=True)
            row["seconds"] = round(time.time() - t0, 2)
            if proc.returncode != 0:
                errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
                row.update(ok=False, error="\n".join(errors[:20]) or proc.stderr[-2000:])
            else:
                row.update(ok=True, kernels=resource_usage(out))
            results.append(row)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=_arch_list, default=[90], help="compute capabilities, e.g. 80,90 (default 90)")
    ap.add_argument("--only", choices=["triton", "cuda"], default=None)
    ap.add_argument("--cu", action="append", default=None, help="a .cu file instead of csrc/*.cu (repeatable)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    # The interpreter replaces @triton.jit functions with interpreted ones, which cannot be
    # compiled: the kernel module must be imported without it (in a fresh process).
    if os.environ.pop("TRITON_INTERPRET", None) and any(
            m in sys.modules for m in ("rows_kernel", "specdec_kernels.ops.verify.triton.common",
                                       "specdec_kernels.ops.verify.triton.split_kernel",
                                       "specdec_kernels.ops.verify.triton.candidates",
                                       "specdec_kernels.ops.verify.triton.draw",
                                       "specdec_kernels.ops.tree.kernel")):
        raise SystemExit("run this in a process that has not imported the kernels under TRITON_INTERPRET")
    results = []
    if args.only in (None, "triton"):
        results += compile_triton(args.arch)
    if args.only in (None, "cuda"):
        results += compile_cuda(args.arch, args.cu)
    for r in results:
        what = r.get("variant") or r.get("source") or ""
        status = {True: "ok", False: "FAILED", None: "skipped"}[r["ok"]]
        kernel = f" {r['kernel']:20s}" if r["part"] == "triton" else ""
        line = f"{r['part']:6s} sm_{r.get('arch', '?')}{kernel} {what:38s} {status}"
        if r["part"] == "triton" and r["ok"]:
            if "BLOCK_N" in r:
                blocks = f"BLOCK_V {r['BLOCK_V']}, BLOCK_N {r['BLOCK_N']}, BLOCK_D {r['BLOCK_D']}"
            elif "BLOCK_V" in r:
                blocks = f"BLOCK_V {r['BLOCK_V']}, BLOCK_K {r['BLOCK_K']}"
            else:
                blocks = f"CHUNK {r['CHUNK']}, NCB {r['NCB']}, CAP {r['CAP']}, BLOCK_K {r['BLOCK_K']}"
            line += (f"  {r.get('regs', '?')} regs, stack {r.get('stack', '?')}, local {r.get('local', '?')}, "
                     f"spills {r.get('spill_stores', '?')}/{r.get('spill_loads', '?')} B, "
                     f"shared {r.get('shared', '?')} B, {r['num_warps']} warps, {blocks}, "
                     f"{r['fma_f32']} FMA")
        elif r["part"] == "cuda" and r["ok"] and r["kernels"]:
            use = r["kernels"].values()
            line += (f"  {len(use)} kernels: {min(u['regs'] for u in use)}-{max(u['regs'] for u in use)} regs, "
                     f"local {max(u['local'] for u in use)}, stack {max(u['stack'] for u in use)}")
        print(line)
        if r["ok"] is False or r["ok"] is None:
            print("    " + r["error"].replace("\n", "\n    "))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any(r["ok"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
