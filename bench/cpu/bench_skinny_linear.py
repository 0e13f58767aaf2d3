"""Benchmark of specdec::skinny_linear against torch's linear on the CPU.

Two measurements, each provider side by side in one run (speed is the ratio):

1. ``sweep``: all the fp32 linear layers of one forward of the embedded target
   (SmolLM2-135M: 30 x [q 576x576, k 192x576, v 192x576, o 576x576, gate 1536x576,
   up 1536x576, down 576x1536] + the 49,152 x 576 output layer; 538 MB of weights, so
   they stream from memory as in the model) over M = 1..32 rows;
2. ``--model``: the embedded target's forward over M new tokens (KV cache of 64), with and
   without ``use_skinny_linear``: what one verify of K = M - 1 drafts costs.

    python bench/cpu/bench_skinny_linear.py --threads 1            # sweep only
    python bench/cpu/bench_skinny_linear.py --threads 1 --model    # + the target forward
    python bench/cpu/bench_skinny_linear.py --threads 1 --isa      # + each SIMD path forced
    python bench/cpu/bench_skinny_linear.py --threads 1 --rows 1,2,3,4 --draft-fp16   # the draft's fp16 tiles
    python bench/cpu/bench_skinny_linear.py --threads 1 --rows 1,2 --draft-int8      # the feature draft's int8 head

Rows append to bench/results/cpu/bench_skinny_linear.csv (or --csv).
"""

from __future__ import annotations

import argparse
import time
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
sys.path.insert(0, BENCH)  # harness
import harness  # noqa: E402


def target_shapes(layers: int = 30, hidden: int = 576, kv: int = 192, mlp: int = 1536,
                  vocab: int = 49152) -> list[tuple[int, int]]:
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                 (mlp, hidden), (mlp, hidden), (hidden, mlp)]
    return per_layer * layers + [(vocab, hidden)]


def run_sweep(rows: list[int], min_time_s: float, isas: list[str] = ()) -> list[dict]:
    from specdec_kernels.cpu.skinny_linear import skinny_linear

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.02 for n, k in target_shapes()]  # [N, K] fp32
    nbytes = sum(w.numel() * 4 for w in weights)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in weights}}  # [M, K]
        provs = {
            "torch F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
            # the same product as w @ x^T ([N, M], transposed): another BLAS call, much faster
            # than F.linear's at 2-5 rows on the Zen 5 VM
            "torch w @ x.T": lambda: [torch.matmul(w, xs[w.shape[1]].T) for w in weights],
            "skinny_linear": lambda: [skinny_linear(xs[w.shape[1]], w) for w in weights],
        }
        for isa in isas:  # one code path forced, to see where each wins
            provs[f"skinny {isa}"] = (lambda isa=isa: [torch.ops.specdec.skinny_linear_isa(
                xs[w.shape[1]], w, None, isa) for w in weights])
        times, failed = harness.time_interleaved(provs, min_time_s)  # in rounds: drift hits all alike
        if failed:
            raise RuntimeError(f"rows={m}: " + "; ".join(f"{n}: {e!r}" for n, e in failed.items()))
        for name, (med, q20, q80) in times.items():
            out.append({
                "bench": "sweep", "provider": name, "rows": m, "ms": med, "q20_ms": q20, "q80_ms": q80,
                "GB/s": nbytes / med / 1e6,
                "speedup_vs_linear": times["torch F.linear"][0] / med,
                "speedup_vs_best_torch": min(times["torch F.linear"][0], times["torch w @ x.T"][0]) / med,
                "vs_own_1_row": None,
            })
    for name in ("torch F.linear", "torch w @ x.T", "skinny_linear", *(f"skinny {isa}" for isa in isas)):
        one = next(r["ms"] for r in out if r["provider"] == name and r["rows"] == rows[0])
        for r in out:
            if r["provider"] == name:
                r["vs_own_1_row"] = r["ms"] / one
    return out


def _alternating_medians_us(calls: dict, reps: int, flush=None) -> dict:
    """Median microseconds of each call in ``calls`` (name -> no-argument function) over ``reps``
    rounds, the calls alternating; ``flush``: a tensor updated in place before each call (a 64 MB
    stream, as a target step leaves the caches)."""
    ts = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            if flush is not None:
                flush.add_(1.0)
            t0 = time.perf_counter()
            f()
            ts[name].append((time.perf_counter() - t0) * 1e6)
    return {name: sorted(v)[len(v) // 2] for name, v in ts.items()}


def draft_fp16_shapes() -> list[tuple[int, int]]:
    """The embedded draft's layer shapes (hidden 192, MLP 768) and its 12,288-row output layer."""
    return [(192, 192), (768, 192), (192, 768), (12288, 192)]


def run_draft_fp16(rows: list[int], reps: int) -> list[dict]:
    """fp16 weights (the embedded draft's, streamed as fp16): the default tiles (4 weight rows for
    M = 1, 2 for M = 2-6) against tiles of one weight row (``avx2_1row``, the same bits), per layer
    shape, hot in cache and after a 64 MB stream (as after a target step); medians of ``reps``
    calls, the two alternating."""
    g = torch.Generator().manual_seed(0)
    flush = torch.empty(64 * 1024 * 1024 // 4)
    op = torch.ops.specdec.skinny_linear_isa
    out = []
    for n, k in draft_fp16_shapes():
        w = (torch.randn(n, k, generator=g) * 0.02).half()
        for m in rows:
            x = torch.randn(m, k, generator=g)
            assert torch.equal(op(x, w, None, "auto"), op(x, w, None, "avx2_1row"))
            for cold in (False, True):
                med = _alternating_medians_us({isa: (lambda isa=isa: op(x, w, None, isa))
                                               for isa in ("auto", "avx2_1row")}, reps, flush if cold else None)
                for isa in med:
                    out.append({"bench": f"draft fp16 {n}x{k} {'after 64 MB' if cold else 'hot'}",
                                "provider": "skinny " + isa, "rows": m, "ms": med[isa] / 1e3,
                                "speedup_vs_one_row": med["avx2_1row"] / med[isa]})
    return out


def run_draft_int8(rows: list[int], reps: int) -> list[dict]:
    """The feature draft's output layer (12,288 x 576, the target's rows): its fp16 copy against
    the per-row int8 copy it streams on the CPU (``use_skinny_linear(int8_weights=True)``: the
    kernel over the int8 values, then the row scales), hot in cache and after a 64 MB stream (as
    after a target step); medians of ``reps`` calls, the two alternating."""
    from specdec_kernels.cpu.skinny_linear import int8_copy

    g = torch.Generator().manual_seed(0)
    flush = torch.empty(64 * 1024 * 1024 // 4)
    op = torch.ops.specdec.skinny_linear
    lin = torch.nn.Linear(576, 12288, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(12288, 576, generator=g) * 0.02)
    w16 = lin.weight.detach().half()
    w8, scale = int8_copy(lin)
    calls = {"fp16": lambda x: op(x, w16, None), "int8": lambda x: op(x, w8, None).mul_(scale)}
    out = []
    for m in rows:
        x = torch.randn(m, 576, generator=g)
        for cold in (False, True):
            med = _alternating_medians_us({name: (lambda f=f: f(x)) for name, f in calls.items()}, reps,
                                          flush if cold else None)
            for name in med:
                out.append({"bench": f"feature head 12288x576 {'after 64 MB' if cold else 'hot'}",
                            "provider": "skinny " + name, "rows": m, "ms": med[name] / 1e3,
                            "speedup_vs_fp16": med["fp16"] / med[name]})
    return out


def run_model(rows: list[int], reps: int) -> list[dict]:
    from specdec_kernels.cpu.skinny_linear import use_skinny_linear
    from specdec_kernels.models.embedded import default_pair

    _, target, tok = default_pair()
    ids = tok("The capital of France is a city that", return_tensors="pt").input_ids
    ids = ids.repeat(1, 64)[:, :64]  # [1, 64]
    g = torch.Generator().manual_seed(0)

    def forward_ms(m: int) -> list[float]:
        with torch.no_grad():
            cache = target(ids, use_cache=True).past_key_values
            times = []
            for _ in range(reps):
                x = torch.randint(0, 1000, (1, m), generator=g)  # [1, M]
                t0 = time.perf_counter()
                target(x, past_key_values=cache, use_cache=True)
                times.append((time.perf_counter() - t0) * 1e3)
                cache.crop(-m)
        return times

    out = []
    for m in rows:
        # interleave the two providers so that load changes hit both alike
        stock, fast = [], []
        for _ in range(2):
            stock += forward_ms(m)
            with use_skinny_linear(target):
                fast += forward_ms(m)
        for name, ts in (("torch F.linear", stock), ("skinny_linear", fast)):
            ts.sort()
            out.append({"bench": "target forward", "provider": name, "rows": m,
                        "ms": ts[len(ts) // 2], "q20_ms": ts[len(ts) // 5], "q80_ms": ts[(4 * len(ts)) // 5]})
    for name in ("torch F.linear", "skinny_linear"):
        one = next(r["ms"] for r in out if r["provider"] == name and r["rows"] == rows[0])
        for r in out:
            if r["provider"] == name:
                r["vs_own_1_row"] = r["ms"] / one
    for r in out:
        r["speedup_vs_linear"] = next(
            s["ms"] for s in out if s["provider"] == "torch F.linear" and s["rows"] == r["rows"]) / r["ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,5,6,9,16,32", help="comma-separated M values")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", action="store_true", help="also time the embedded target's forward")
    ap.add_argument("--reps", type=int, default=5, help="target forwards per provider per round (2 rounds)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per sweep measurement")
    ap.add_argument("--isa", action="store_true",
                    help="also time each SIMD path of skinny_linear forced (avx2, avx512 where the CPU has it)")
    ap.add_argument("--draft-fp16", action="store_true",
                    help="only the embedded draft's fp16 layer shapes: the default tiles against one-row tiles")
    ap.add_argument("--draft-int8", action="store_true",
                    help="only the feature draft's output layer: its fp16 copy against its int8 copy")
    ap.add_argument("--csv", default=os.path.join(BENCH, "results", "cpu", "bench_skinny_linear.csv"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(" ".join(["python"] + sys.argv))
    cond = {"device": harness.device_name(torch.device("cpu")), "date": harness.now(), **harness.versions()}
    print(cond)
    from specdec_kernels.cpu.skinny_linear import supported_isas

    for on, run, ratio, suffix in ((args.draft_int8, run_draft_int8, "speedup_vs_fp16", "_draft_int8"),
                                   (args.draft_fp16, run_draft_fp16, "speedup_vs_one_row", "_draft_fp16")):
        if on:  # a draft-layer mode alone, in its own CSV
            results = run(rows, max(args.reps, 200))
            cols = ["bench", "provider", "rows", "ms", ratio]
            harness.print_table(results, cols)
            harness.append_csv(args.csv.replace(".csv", suffix + ".csv"),
                               [{**cond, **{c: r.get(c) for c in cols}} for r in results])
            return 0
    results = run_sweep(rows, args.min_time, list(supported_isas()) if args.isa else [])
    if args.model:
        results += run_model(rows, args.reps)
    cols = ["bench", "provider", "rows", "ms", "q20_ms", "q80_ms", "GB/s", "vs_own_1_row", "speedup_vs_linear",
            "speedup_vs_best_torch"]
    harness.print_table(results, cols)
    harness.append_csv(args.csv, [{**cond, **{c: r.get(c) for c in cols}} for r in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
