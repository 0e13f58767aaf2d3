"""The split verify kernel's launch settings, side by side on one GPU: which one to make the default.

Settings (``verify.py`` module values, set around each call):
  tiles             _TILES_PER_ITEM: chunks of 4096 tokens per work item, streamed with software
                    pipelining (_STAGES deep): more bytes in flight per program at large B
  programs_per_sm   _PROGRAMS_PER_SM: the persistent grid, programs per multiprocessor
  maxnreg           _MAXNREG: a register cap (128 lets two programs share a multiprocessor)

Cases: V = 128,256, bf16, K = 4, T = 1, every draft accepted (bench_verify's inputs), plain and
top-k 50 + top-p 0.9, at B = 64 (bandwidth: GB/s of the bytes a correct step reads, and its share
of a device copy measured in the same run) and B = 16 (time, eager and replayed in a CUDA graph).
Every setting gives the same tokens (checked here against the first). CSV and a table in --out.

    python bench/ops/bench_verify_knobs.py --out bench/results/gpu-<date>
    python bench/ops/bench_verify_knobs.py --smoke          # CPU, under TRITON_INTERPRET=1: the mechanics
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: bench_verify
from bench_verify import bytes_moved, make_inputs, measure_copy  # noqa: E402
from harness import append_csv, device_name, now, print_table, time_fn, versions  # noqa: E402

from specdec_kernels import fused_verify  # noqa: E402
from specdec_kernels.ops.kernels import launch_settings  # noqa: E402

# (tiles, programs_per_sm, maxnreg)
SETTINGS = [(1, 1, None), (4, 1, None), (1, 2, 128), (4, 2, 128)]


def setting(tiles, programs, maxnreg):
    return launch_settings(tiles, programs, maxnreg)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for bench_verify_knobs.csv/.txt")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes (a test of the script)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_verify_knobs: needs a CUDA GPU (or --smoke for the interpreter)")
    V, K, dt = (300, 2, torch.float32) if smoke else (128256, 4, torch.bfloat16)
    batches = [(2, False), (1, True)] if smoke else [(64, False), (16, True)]  # (B, graph replay)
    settings = SETTINGS[:2] if smoke else SETTINGS
    copy_gbps = None if smoke else measure_copy(device, 256)
    ver, stamp, dev_name = versions(), now(), device_name(device)
    csv_path = os.path.join(args.out, "bench_verify_knobs.csv") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    rows = []
    try:
        for B, graphed in batches:
            logits, x, q = make_inputs(B, K, V, dt, device)
            for warp in (False, True):
                want = None  # the first setting that ran: the tokens every other one must give
                for tiles, programs, maxnreg in settings:
                    row = measure(logits, x, q, warp, graphed and not smoke, smoke, device, (tiles, programs, maxnreg))
                    if row["tokens"] is not None:
                        if want is None:
                            want = row["tokens"]
                        row["same_tokens"] = bool(torch.equal(row["tokens"], want))
                    row.pop("tokens")
                    nbytes = bytes_moved(row.pop("num_accepted"), K, V, V, logits.element_size())
                    med = row["median_ms"]
                    row.update(gbps=nbytes / (med * 1e-3) / 1e9 if med else None, copy_gbps=copy_gbps)
                    row["pct_of_copy"] = 100 * row["gbps"] / copy_gbps if row["gbps"] and copy_gbps else None
                    row.update(op="verify_knobs", B=B, K=K, V=V, dtype=str(dt).replace("torch.", ""),
                               warp="top-k 50 + top-p 0.9" if warp else "none", device=dev_name, date=stamp, **ver)
                    rows.append(row)
                    if csv_path:  # row by row: a run stopped at its time limit keeps what it measured
                        append_csv(csv_path, [row])
                    print(f"# B={B} warp={warp} tiles={tiles} programs/SM={programs} maxnreg={maxnreg}: "
                          f"{med} ms, graph {row['cuda_graph_median_ms']} ms, {row['gbps']} GB/s, "
                          f"same tokens {row['same_tokens']} {row['error']}", flush=True)
    except KeyboardInterrupt:  # gpu_check.sh's time limit (SIGINT): keep the table of what ran
        print("# stopped (SIGINT): the settings measured so far follow", flush=True)
    cols = ["B", "warp", "tiles", "programs_per_sm", "maxnreg", "median_ms", "cuda_graph_median_ms", "gbps",
            "pct_of_copy", "same_tokens", "error"]
    head = f"# bench_verify_knobs on {dev_name}; {ver}; {stamp}; V={V} K={K} {dt} T=1, drafts accepted; copy {copy_gbps} GB/s"
    table = print_table(rows, cols) if rows else ""
    print(head)
    if args.out:
        with open(os.path.join(args.out, "bench_verify_knobs.txt"), "w") as f:
            f.write(head + "\n" + table + "\n")
    return rows


def measure(logits, x, q, warp, graphed, smoke, device, knobs):
    """One setting on one case: its row (times, tokens and num_accepted for the caller, error).
    A failing graph replay keeps the eager time; a failing setting (a compile error) is a row."""
    tiles, programs, maxnreg = knobs
    B = logits.shape[0]
    kw = dict(temperature=1.0, seed=torch.arange(B, device=device), offset=0)
    if warp:
        kw.update(top_k=50, top_p=0.9)
    row = dict(tiles=tiles, programs_per_sm=programs, maxnreg=maxnreg or "", median_ms=None, q20_ms=None,
               q80_ms=None, cuda_graph_median_ms=None, same_tokens=None, error="", tokens=None,
               num_accepted=torch.full((B,), x.shape[1]))
    with setting(tiles, programs, maxnreg):
        def step():
            return fused_verify(logits, x, q, backend="triton", **kw)
        try:
            out = step()
            row.update(tokens=out.tokens, num_accepted=out.num_accepted.cpu())
            row["median_ms"], row["q20_ms"], row["q80_ms"] = time_fn(
                step, device, min_time_s=0.05 if smoke else 0.2, max_reps=3 if smoke else 200)
        except Exception as e:  # noqa: BLE001 - a setting that fails is a finding
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            return row
        if graphed:
            try:
                row["cuda_graph_median_ms"] = time_fn(step, device, cuda_graph=True)[0]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"CUDA graph: {type(e).__name__}: {e}"[:200]
    return row


if __name__ == "__main__":
    main()
