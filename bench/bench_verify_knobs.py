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

    python bench/bench_verify_knobs.py --out bench/results/gpu-<date>
    python bench/bench_verify_knobs.py --smoke          # CPU, under TRITON_INTERPRET=1: the mechanics
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_verify import bytes_moved, make_inputs, measure_copy  # noqa: E402
from harness import append_csv, device_name, now, print_table, time_fn, versions  # noqa: E402

from specdec_kernels import fused_verify  # noqa: E402
from specdec_kernels import verify as verify_mod  # noqa: E402

# (tiles, programs_per_sm, maxnreg)
SETTINGS = [(1, 1, None), (4, 1, None), (1, 2, 128), (4, 2, 128), (2, 1, None)]


@contextlib.contextmanager
def setting(tiles, programs, maxnreg):
    old = verify_mod._TILES_PER_ITEM, verify_mod._PROGRAMS_PER_SM, verify_mod._MAXNREG
    verify_mod._TILES_PER_ITEM, verify_mod._PROGRAMS_PER_SM, verify_mod._MAXNREG = tiles, programs, maxnreg
    try:
        yield
    finally:
        verify_mod._TILES_PER_ITEM, verify_mod._PROGRAMS_PER_SM, verify_mod._MAXNREG = old


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
    copy_gbps = None if smoke else measure_copy(device, 1024)
    ver, stamp, dev_name = versions(), now(), device_name(device)
    rows = []
    for B, graphed in batches:
        logits, x, q = make_inputs(B, K, V, dt, device)
        for warp in (False, True):
            kw = dict(temperature=1.0, seed=torch.arange(B, device=device), offset=0)
            if warp:
                kw.update(top_k=50, top_p=0.9)
            want = None
            for tiles, programs, maxnreg in settings:
                with setting(tiles, programs, maxnreg):
                    def step():
                        return fused_verify(logits, x, q, backend="triton", **kw)
                    try:
                        out = step()
                        if want is None:
                            want = out
                        same = bool(torch.equal(out.tokens, want.tokens))
                        med, q20, q80 = time_fn(step, device, min_time_s=0.05 if smoke else 0.2, max_reps=3 if smoke else 200)
                        g_med = time_fn(step, device, cuda_graph=True)[0] if graphed and not smoke else None
                        err = ""
                    except Exception as e:  # noqa: BLE001 - a setting that fails (a compile error) is a finding
                        med = q20 = q80 = g_med = None
                        same, err = False, f"{type(e).__name__}: {e}"[:200]
                        out = None
                n = out.num_accepted if out is not None else torch.full((B,), K)
                nbytes = bytes_moved(n.cpu(), K, V, V, logits.element_size())
                gbps = nbytes / (med * 1e-3) / 1e9 if med else None
                row = dict(op="verify_knobs", B=B, K=K, V=V, dtype=str(dt).replace("torch.", ""),
                           warp="top-k 50 + top-p 0.9" if warp else "none", tiles=tiles,
                           programs_per_sm=programs, maxnreg=maxnreg or "", median_ms=med, q20_ms=q20, q80_ms=q80,
                           cuda_graph_median_ms=g_med, gbps=gbps, copy_gbps=copy_gbps,
                           pct_of_copy=100 * gbps / copy_gbps if gbps and copy_gbps else None,
                           same_tokens=same, error=err, device=dev_name, date=stamp, **ver)
                rows.append(row)
                print(f"# B={B} warp={warp} tiles={tiles} programs/SM={programs} maxnreg={maxnreg}: "
                      f"{med} ms, graph {g_med} ms, {gbps} GB/s, same tokens {same} {err}", flush=True)
    cols = ["B", "warp", "tiles", "programs_per_sm", "maxnreg", "median_ms", "cuda_graph_median_ms", "gbps",
            "pct_of_copy", "same_tokens", "error"]
    table = print_table(rows, cols)
    head = f"# bench_verify_knobs on {dev_name}; {ver}; {stamp}; V={V} K={K} {dt} T=1, drafts accepted; copy {copy_gbps} GB/s"
    print(head)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        append_csv(os.path.join(args.out, "bench_verify_knobs.csv"), rows)
        with open(os.path.join(args.out, "bench_verify_knobs.txt"), "w") as f:
            f.write(head + "\n" + table + "\n")
    return rows


if __name__ == "__main__":
    main()
