"""``specdec env`` (``python -m specdec_kernels env``): the facts a bug report needs, like torch's
``collect_env``: the versions of Python, torch, Triton, transformers and NumPy, the C++
extension's state (loaded or not and why, CUDA kernels or not), the device and its compute
capability, the backend ``fused_verify`` takes there (``backend="auto"``: ``"triton"`` on CUDA
tensors, ``"torch"`` on CPU tensors) and whether the Triton kernels run on it: on a GPU, one
``fused_verify`` launch of the split kernel (which compiles it for the device) checked against
the torch path; on a CPU, whether Triton's interpreter (``TRITON_INTERPRET=1``, the only way the
kernels run on CPU tensors) can run them here, and with it set, one interpreted launch.

Everything is queried when ``collect`` is called, never at import (the package imports on a
machine without a GPU).
"""

from __future__ import annotations

import glob
import importlib
import os
import platform
import sys
import time

__all__ = ["collect", "format_report", "main"]


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed, version unknown")
    except Exception as e:  # not installed, or broken: the report says which
        return f"not importable ({type(e).__name__}: {e})"


def _extension_facts() -> dict:
    import torch

    from .ops import extension

    if not extension.HAS_EXT:
        return {"loaded": False, "why": f"{type(extension.EXT_IMPORT_ERROR).__name__}: {extension.EXT_IMPORT_ERROR}",
                "cuda_kernels": False}
    built = sorted(glob.glob(os.path.join(os.path.dirname(extension.__file__), "_C*")))
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    from .ops.linear import auto_isa, supported_isas

    runs = []  # the CPU linear op's SIMD path by row count: [first, last, path] over rows 1..24
    for rows in range(1, 25):
        try:
            isa = auto_isa(rows)
        except RuntimeError:  # an extension built before the op
            isa = "unknown (an older build of the extension: rebuild it)"
        if runs and runs[-1][2] == isa:
            runs[-1][1] = rows
        else:
            runs.append([rows, rows, isa])
    paths = {(f"{a}" if a == b else f"{a}-{b}"): isa for a, b, isa in runs}
    return {"loaded": True, "path": built[0] if built else "?", "torch": torch.__version__,
            "cuda_kernels": bool(has("specdec::compact_kv_", "CUDA")),
            "cpu_linear": {"paths": ["portable", *supported_isas()], "auto_by_rows": paths}}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:  # not Linux
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _device_facts() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"type": "cpu", "name": _cpu_name(), "threads": torch.get_num_threads()}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return {"type": "cuda", "index": index, "name": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
            "multiprocessors": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count()}


def _triton_launch(device: str) -> str:
    """One ``fused_verify`` launch of the split kernel on ``device`` (B = 2, K = 3, V = 1000, T = 1,
    top-p 0.9; the first launch compiles it), its tokens compared with the torch path's on the
    same random numbers."""
    import torch

    from . import fused_verify

    gen = torch.Generator().manual_seed(0)
    B, K, V = 2, 3, 1000
    logits = torch.randn(B, K + 1, V, generator=gen)
    q = torch.softmax(torch.randn(B, K, V, generator=gen), -1)
    x = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, K)
    u = torch.rand(B, K + 1, generator=gen, dtype=torch.float64)
    kw = dict(temperature=1.0, top_p=0.9, uniforms=u)
    start = time.perf_counter()
    out = fused_verify(logits.to(device), x.to(device), q.to(device), backend="triton",
                       **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    ref = fused_verify(logits, x, q, backend="torch", **kw)
    same = torch.equal(out.tokens.cpu(), ref.tokens) and torch.equal(out.num_accepted.cpu(), ref.num_accepted)
    return (f"yes: the split kernel compiled and ran in {seconds:.1f} s (first launch), "
            + ("its tokens equal the torch path's" if same else
               "its tokens DIFFER from the torch path's on the same random numbers (a bug, unless a uniform "
               "fell within the last bit of a decision boundary: docs/numerics.md)"))


def _triton_facts(device: dict, run_kernels: bool) -> dict:
    from .ops.kernels import interpreter_problem

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device["type"] == "cuda":
        if interpreting:
            return {"kernels": "TRITON_INTERPRET=1 is set: the kernels are interpreted, not compiled (unset it)"}
        if not run_kernels:
            return {"kernels": "not checked"}
        try:
            return {"kernels": _triton_launch("cuda")}
        except Exception as e:  # the report's point: say what failed, in one line
            return {"kernels": f"NO: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    try:
        problem = interpreter_problem()
    except Exception as e:  # Triton missing or broken
        problem = f"{type(e).__name__}: {e}"
    facts = {"interpreter": ("can run here" if problem is None else f"cannot run here: {problem}"),
             "TRITON_INTERPRET": "1" if interpreting else "unset"}
    if problem is not None:
        facts["kernels"] = "no: CPU tensors take the torch path; the interpreter cannot run the kernels here"
    elif not interpreting:
        facts["kernels"] = ("not run: on CPU tensors the kernels run only under Triton's interpreter; "
                            "`TRITON_INTERPRET=1 specdec env` runs one launch")
    elif run_kernels:
        try:
            facts["kernels"] = _triton_launch("cpu").replace("compiled and ran", "ran under the interpreter")
        except Exception as e:
            facts["kernels"] = f"NO: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    else:
        facts["kernels"] = "not checked"
    return facts


def collect(run_kernels: bool = True) -> dict:
    """The report as a dict of sections.  ``run_kernels``: launch the split kernel once on the
    device (on CPU only with ``TRITON_INTERPRET=1`` set)."""
    import torch

    from . import __file__ as package_file, __version__

    device = _device_facts()
    return {
        "specdec_kernels": {"version": __version__, "path": os.path.dirname(package_file)},
        "versions": {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
                     "torch_cuda": torch.version.cuda, "triton": _version("triton"),
                     "transformers": _version("transformers"), "numpy": _version("numpy")},
        "extension": _extension_facts(),
        "device": device,
        "fused_verify_backend": "triton" if device["type"] == "cuda" else "torch",
        "triton": _triton_facts(device, run_kernels),
    }


def format_report(info: dict) -> str:
    """The report as text: one ``name: value`` line per fact, a blank line between sections."""
    ext = info["extension"]
    if ext["loaded"]:
        ext_line = (f"loaded from {ext['path']}, works with torch {ext['torch']}; CUDA kernels: "
                    + ("yes" if ext["cuda_kernels"] else "no (a CPU build: the KV ops run on CPU tensors only)"))
    else:
        ext_line = f"NOT loaded (the pure-PyTorch fallbacks run): {ext['why']}"
    dev = info["device"]
    if dev["type"] == "cuda":
        dev_line = (f"cuda:{dev['index']} {dev['name']}, compute capability {dev['capability']}, "
                    f"{dev['multiprocessors']} SMs, {dev['memory_gib']} GiB ({dev['count']} visible)")
    else:
        dev_line = f"cpu ({dev['name']}, {dev['threads']} torch threads); no CUDA device visible"
    v = info["versions"]
    lines = [f"specdec_kernels: {info['specdec_kernels']['version']} ({info['specdec_kernels']['path']})",
             "",
             f"python: {v['python']} ({v['platform']})",
             f"torch: {v['torch']} ({'CUDA ' + v['torch_cuda'] if v['torch_cuda'] else 'a build without CUDA'})",
             f"triton: {v['triton']}",
             f"transformers: {v['transformers']}",
             f"numpy: {v['numpy']}",
             "",
             f"C++ extension: {ext_line}",
             f"device: {dev_line}",
             *([f"CPU linear layer (skinny_linear) paths: {', '.join(ext['cpu_linear']['paths'])}; taken by rows: "
                + ", ".join(f"{r}: {isa}" for r, isa in ext["cpu_linear"]["auto_by_rows"].items())]
               if ext["loaded"] else []),
             f"fused_verify backend (\"auto\") on this device: {info['fused_verify_backend']}"]
    t = info["triton"]
    if "interpreter" in t:
        lines.append(f"Triton interpreter (TRITON_INTERPRET={t['TRITON_INTERPRET']}): {t['interpreter']}")
    lines.append(f"Triton kernels run on this device: {t['kernels']}")
    return "\n".join(lines)


def main(as_json: bool = False, run_kernels: bool = True, out=None) -> int:
    """Print the report (``as_json``: as JSON) to ``out`` (default stdout)."""
    import json

    out = out or sys.stdout
    info = collect(run_kernels=run_kernels)
    if as_json:
        json.dump(info, out, indent=2)
        out.write("\n")
    else:
        out.write(format_report(info) + "\n")
    return 0

