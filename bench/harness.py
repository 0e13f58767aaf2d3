"""Shared benchmark harness: timing, environment facts, CSV rows, tables and plots.

Speed is always a ratio of providers measured side by side in one run (STYLE item 18).
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch

# Peak memory bandwidth by device name, GB/s (vendor figures), for the % of peak column.
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100": 3350.0, "A100": 2039.0}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_model()} x{torch.get_num_threads()} threads"


def cpu_model() -> str:
    """The CPU's model name (platform.processor() is '' on Linux: every CPU row read "x86_64",
    so two machines' rows could not be told apart)."""
    name, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name is None:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    name = name or platform.processor() or platform.machine()
    return f"{name} ({isa})" if isa else name  # a VM may name only the vendor: the ISA tells them apart


def commit() -> str:
    """The SPECDEC_COMMIT environment variable where set (a copy of the tree without .git, as on
    the GPU machine); else the repository's commit, with "-dirty" when tracked files differ from
    it; else "unknown"."""
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        git = ["git", "-C", root]
        head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode == 0:
            dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=30).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_GBPS.items():
        if key in name:
            return value
    return None


def versions() -> dict[str, str]:
    import transformers

    import specdec_kernels

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "specdec_kernels": specdec_kernels.__version__, "commit": commit()}


def time_fn(fn: Callable[[], object], device: torch.device, min_time_s: float = 0.2, max_reps: int = 200,
            cuda_graph: bool = False) -> tuple[float, float, float]:
    """(median, q20, q80) wall time of fn in milliseconds.

    CUDA: triton.testing.do_bench (cold L2 between reps), or do_bench_cudagraph for
    microsecond-scale cases where launch overhead would dominate. CPU: perf_counter over
    repetitions after one warm-up call, at least min_time_s in total.

    do_bench_cudagraph warms fn up on a stream of its own but captures on torch.cuda.graph's
    default capture stream, so fn first runs once eagerly there: an op that keeps scratch per
    stream (fused_verify's split kernel: its workspace) makes it outside the capture, and the
    graph replays the call as a decode loop would, not with a temporary workspace of its own.
    """
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            warm_up_on_capture_stream(fn, device)
            q = triton.testing.do_bench_cudagraph(fn, quantiles=[0.5, 0.2, 0.8])
        else:
            q = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        return float(q[0]), float(q[1]), float(q[2])
    times, failed = time_interleaved({"fn": fn}, min_time_s, max_reps)
    if failed:
        raise failed["fn"]
    return times["fn"]


def warm_up_on_capture_stream(fn: Callable[[], object], device: torch.device) -> None:
    """One eager call of fn on the stream that ``torch.cuda.graph`` captures on by default (made
    here as torch.cuda.graph would make it, when no graph has been captured yet)."""
    stream = getattr(torch.cuda.graph, "default_capture_stream", None)
    if stream is None:
        stream = torch.cuda.graph.default_capture_stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


def time_interleaved(fns: dict, min_time_s: float = 0.2, max_reps: int = 200,
                     min_rounds: int = 3) -> tuple[dict, dict]:
    """CPU: ({name: (median, q20, q80) ms}, {name: the exception it raised}) of the no-argument
    functions in ``fns``, called in rounds (one call of each per round, after one warm-up call
    each, the round's first function rotating) until each has ``min_rounds`` calls and
    ``min_time_s`` per function has passed (or ``max_reps`` rounds): a drift of the machine
    lands on every provider alike, not on the one timed during it (one provider after another,
    single cells moved up to 2.7x between runs on the VM), and no provider always follows the
    same neighbour."""
    failed, times = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            times[name] = []
        except Exception as e:  # noqa: BLE001 - reported by the caller
            failed[name] = e
    start = time.perf_counter()
    rounds = 0
    while times and (rounds < min_rounds
                     or (time.perf_counter() - start < min_time_s * len(times) and rounds < max_reps)):
        names = list(times)
        for name in names[rounds % len(names):] + names[: rounds % len(names)]:
            if name not in times:
                continue
            t0 = time.perf_counter()
            try:
                fns[name]()
            except Exception as e:  # noqa: BLE001
                failed[name] = e
                del times[name]
                continue
            times[name].append((time.perf_counter() - t0) * 1e3)
        rounds += 1
    out = {}
    for name, ts in times.items():
        ts.sort()
        qs = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) >= 2 else [ts[0]] * 9  # within the data
        out[name] = (statistics.median(ts), qs[1], qs[7])
    return out, failed


def append_csv(path: str, rows: list[dict]) -> None:
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = list(rows[0].keys())
    if os.path.exists(path):
        with open(path, newline="") as f:
            old_fields = next(csv.reader(f), [])
        if old_fields == fields:
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=fields).writerows(rows)
            return
        # the columns changed (a newer script): rewrite the file under the union of the columns,
        # old rows with empty cells for the new ones
        with open(path, newline="") as f:
            old_rows = list(csv.DictReader(f))
        fields = old_fields + [c for c in fields if c not in old_fields]
        rows = old_rows + rows
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)


def print_table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    lines = [" | ".join(c.ljust(widths[c]) for c in columns), "-+-".join("-" * widths[c] for c in columns)]
    lines += [" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    text = "\n".join(lines)
    print(text)
    return text


def _fmt(v) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
