"""The split verify kernel's launch settings, side by side on one GPU: which one to make the default.

Settings (``ops.kernels.launch_settings``; the fields of ``SplitSettings``), in the order they are
measured (a run stopped at its time limit keeps the rows it wrote):

  default         today's defaults: acq_rel ticket after each item, every stage-1 item first,
                  an acquire atomic per poll, 1 chunk an item, 1 program an SM, 8 warps
  combined        ticket="prefetch", stage2_lag=2, poll="relaxed", poll_sleep_ns=200
  prefetch        ticket="prefetch" alone (one dependent atomic less per item)
  lag2, lag8      stage2_lag alone: a row's stage 2 numbered after row b + L's stage 1 (L2 reads)
  tiles4          tiles_per_item=4 (four chunks an item, software-pipelined)
  2sm_4warps      programs_per_sm=2, num_warps=4 (two programs an SM without a register cap)
  combined_tiles4 combined + tiles_per_item=4
  combined_2sm    combined + programs_per_sm=2, num_warps=4
  2sm_maxnreg128  programs_per_sm=2, maxnreg=128 at 8 warps (spills: see gpu_compile_check)

Cases: V = 128,256, bf16, K = 4, T = 1, every draft accepted (bench_verify's inputs), at
B = 64, 16, 256 and 1; plain, and top-k 50 + top-p 0.9 for default and combined.  B <= 16 is
also timed replayed in a CUDA graph; every row has GB/s of the bytes a correct step reads and its
share of a device copy measured in the same run (the figure that matters at B >= 64).  Every
setting must give the tokens of the default (``same_tokens``).  CSV and a table in --out.

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

_COMBINED = dict(ticket="prefetch", stage2_lag=2, poll="relaxed", poll_sleep_ns=200)
SETTINGS = [
    ("default", {}),
    ("combined", _COMBINED),
    ("prefetch", dict(ticket="prefetch")),
    ("lag2", dict(stage2_lag=2)),
    ("lag8", dict(stage2_lag=8)),
    ("tiles4", dict(tiles_per_item=4)),
    ("2sm_4warps", dict(programs_per_sm=2, num_warps=4)),
    ("combined_tiles4", dict(_COMBINED, tiles_per_item=4)),
    ("combined_2sm", dict(_COMBINED, programs_per_sm=2, num_warps=4)),
    ("2sm_maxnreg128", dict(programs_per_sm=2, maxnreg=128)),
]
# the settings also measured with top-k 50 + top-p 0.9
WARPED = ("default", "combined")
BATCHES = (64, 16, 256, 1)


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
    batches = (2, 1) if smoke else BATCHES
    settings = SETTINGS[:3] if smoke else SETTINGS
    copy_gbps = None if smoke else measure_copy(device, 256)
    ver, stamp, dev_name = versions(), now(), device_name(device)
    csv_path = os.path.join(args.out, "bench_verify_knobs.csv") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    inputs = {B: make_inputs(B, K, V, dt, device) for B in batches}
    want = {}  # (B, warp) -> the default's tokens, which every other setting must give
    rows = []
    try:
        for name, changes in settings:
            for B in batches:
                logits, x, q = inputs[B]
                for warp in (False, True) if name in WARPED else (False,):
                    row = measure(logits, x, q, warp, B <= 16 and not smoke, smoke, device, changes)
                    if row["tokens"] is not None:
                        ref = want.setdefault((B, warp), row["tokens"])
                        row["same_tokens"] = bool(torch.equal(row["tokens"], ref))
                    row.pop("tokens")
                    nbytes = bytes_moved(row.pop("num_accepted"), K, V, V, logits.element_size())
                    med = row["median_ms"]
                    row.update(gbps=nbytes / (med * 1e-3) / 1e9 if med else None, copy_gbps=copy_gbps)
                    row["pct_of_copy"] = 100 * row["gbps"] / copy_gbps if row["gbps"] and copy_gbps else None
                    row.update(op="verify_knobs", setting=name, B=B, K=K, V=V, dtype=str(dt).replace("torch.", ""),
                               warp="top-k 50 + top-p 0.9" if warp else "none", device=dev_name, date=stamp, **ver)
                    rows.append(row)
                    if csv_path:  # row by row: a run stopped at its time limit keeps what it measured
                        append_csv(csv_path, [row])
                    print(f"# {name} B={B} warp={warp}: {med} ms, graph {row['cuda_graph_median_ms']} ms, "
                          f"{row['gbps']} GB/s, same tokens {row['same_tokens']} {row['error']}", flush=True)
    except KeyboardInterrupt:  # gpu_check.sh's time limit (SIGINT): keep the table of what ran
        print("# stopped (SIGINT): the settings measured so far follow", flush=True)
    cols = ["setting", "B", "warp", "median_ms", "cuda_graph_median_ms", "gbps", "pct_of_copy", "same_tokens",
            "error"]
    head = (f"# bench_verify_knobs on {dev_name}; {ver}; {stamp}; V={V} K={K} {dt} T=1, drafts accepted; "
            f"copy {copy_gbps} GB/s; settings: " + "; ".join(f"{n}={c or 'defaults'}" for n, c in settings))
    table = print_table(rows, cols) if rows else ""
    print(head)
    if args.out:
        with open(os.path.join(args.out, "bench_verify_knobs.txt"), "w") as f:
            f.write(head + "\n" + table + "\n")
    return rows


def measure(logits, x, q, warp, graphed, smoke, device, changes):
    """One setting on one case: its row (times, tokens and num_accepted for the caller, error).
    A failing graph replay keeps the eager time; a failing setting (a compile error) is a row."""
    B = logits.shape[0]
    kw = dict(temperature=1.0, seed=torch.arange(B, device=device), offset=0)
    if warp:
        kw.update(top_k=50, top_p=0.9)
    row = dict(median_ms=None, q20_ms=None, q80_ms=None, cuda_graph_median_ms=None, same_tokens=None, error="",
               tokens=None, num_accepted=torch.full((B,), x.shape[1]))
    try:
        with launch_settings(**changes):
            def step():
                return fused_verify(logits, x, q, backend="triton", **kw)
            out = step()
            row.update(tokens=out.tokens.cpu(), num_accepted=out.num_accepted.cpu())
            row["median_ms"], row["q20_ms"], row["q80_ms"] = time_fn(
                step, device, min_time_s=0.05 if smoke else 0.2, max_reps=3 if smoke else 200)
            if graphed:
                try:
                    row["cuda_graph_median_ms"] = time_fn(step, device, cuda_graph=True)[0]
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"CUDA graph: {type(e).__name__}: {e}"[:200]
    except Exception as e:  # noqa: BLE001 - a setting that fails is a finding
        row["error"] = f"{type(e).__name__}: {e}"[:200]
    return row


if __name__ == "__main__":
    main()
