"""fused_verify's Triton kernels under Triton's interpreter: a proxy of their passes over the logits.

Without a GPU the kernels run on CPU tensors under TRITON_INTERPRET=1, where every block
operation is a numpy call: a call's time grows with the number of block operations the kernel
runs over its tiles, not with memory bandwidth, so the ratio of two calls of one kernel says how
many more passes over the logits one makes than the other.  A pass over a tile held in
registers (a bisection step over a chunk's keys) costs here what a pass that loads it costs, so
the ratio overstates what the extra passes cost a GPU in memory traffic.  The figure checked
here: the split kernel's top-k 50 + top-p 0.9 call costs at most 3x its plain call (its
top-k/top-p are decided from per-chunk candidate keys, with no re-read of the logits, unless
those cannot decide and the position is bisected whole), and its call under a grammar's token
mask (``token_bitmask=``, applied inside the launch) at most 1.3x.  The absolute times are
numpy's, not a GPU's.

Kernels, each with four warps of the same inputs:
  split   fused_verify(backend="triton"): the split-vocabulary kernel (one launch, chunks of 4096 tokens)
  rows    rows_kernel.verify_rows (bench/ops/rows_kernel.py): the one-program-per-row kernel it replaced
  warps   plain (none), top_k=50, top_p=0.9, top_k=50 + top_p=0.9; the split kernel also under a
          grammar's mask (mask, mask_topk50_topp0.9): each position allows a random half of the
          tokens and its draft, so that every draft is still accepted

The inputs are bench_verify.make_inputs' (every draft accepted by default: all K + 1 positions
verified), fp32 logits, T = 1, one seed.  The ten calls are timed in rounds
(harness.time_interleaved: one call of each per round after a warm-up call each, the first
rotating), so a drift of the machine lands on every case alike; each reports its median over
--repeats rounds and its ratio to the plain case of the same kernel.  For the split kernel,
fallback_positions counts the positions whose top-k/top-p fell back to bisecting the whole
position (from its workspace records; empty where those are not available).  About 23 s a
round at the default shape on a 2-core Zen 5 VM: the default 3 rounds and the warm-up take
about 1.5 minutes (--repeats 5: 2.5).

    python bench/ops/bench_verify_interpreter.py                      # B = 1, K = 4, V = 32,000
    python bench/ops/bench_verify_interpreter.py --repeats 5 --out bench/results/cpu-zen5/interpreter_x
    python bench/ops/bench_verify_interpreter.py --smoke --out /tmp/x  # tiny shape, one round (tests)

Writes to --out: bench_verify_interpreter.csv (appended), .txt (the table) and conditions.json
(commit, versions, CPU model, threads, load averages, the arguments).
"""

from __future__ import annotations

import os

# Before triton or the package is imported: @triton.jit reads it when a kernel is defined.
os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: bench_verify, rows_kernel
from bench_verify import make_inputs  # noqa: E402
from harness import append_csv, cpu_model, device_name, now, print_table, time_interleaved, versions  # noqa: E402
from rows_kernel import verify_rows  # noqa: E402

from specdec_kernels import fused_verify  # noqa: E402

# kernel -> (what the CSV's backend column says, the call)
KERNELS = {"split": ("triton", lambda *a, **kw: fused_verify(*a, backend="triton", **kw)),
           "rows": ("rows_kernel", verify_rows)}
# (name, top_k, top_p); "none" first: the others' ratio is to it
WARPS = [("none", None, None), ("topk50", 50, None), ("topp0.9", None, 0.9), ("topk50_topp0.9", 50, 0.9)]
# (name, top_k, top_p) under a grammar's mask: the split kernel only (the rows kernel takes none)
MASKED_WARPS = [("mask", None, None), ("mask_topk50_topp0.9", 50, 0.9)]
SMOKE = dict(B=1, K=2, V=600, repeats=1)


def default_out() -> str:
    """bench/results/cpu-<the CPU model, as a slug>/interpreter_<UTC date>."""
    slug = "".join(c if c.isalnum() else "-" for c in cpu_model().lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d")
    return os.path.join("bench", "results", f"cpu-{slug}", f"interpreter_{day}")


def fallback_positions(B: int, K1: int, V: int):
    """How many of the last split launch's B * K1 positions bisected the whole position for
    top-k/top-p (its workspace's `scanned` records), or None where the records are not there."""
    try:
        from specdec_kernels.ops.kernels import split_workspace_records
        from specdec_kernels.ops.verify import split_kernel_meta

        nc = -(-V // split_kernel_meta(V, K1, True, True, True, False)["CHUNK"])
        rec = split_workspace_records(torch.device("cpu"), B, K1, nc)
        return int(rec["scanned"].sum())
    except Exception:  # noqa: BLE001 - a diagnostic only: the records of the last launch
        return None


def allowed_to_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[..., V] bool -> xgrammar's layout, [..., ceil(V / 32)] int32 (bit v % 32 of word v // 32)."""
    V = allowed.shape[-1]
    W = (V + 31) // 32
    bits = torch.zeros(*allowed.shape[:-1], W * 32, dtype=torch.int64)
    bits[..., :V] = allowed.long()
    words = (bits.view(*allowed.shape[:-1], W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def build_cases(B, K, V, seed=0):
    """{(kernel, warp): a no-argument call}, and {(kernel, warp): what its last call gave}
    (num_accepted; for the split kernel also its fallback count), filled as they are called."""
    logits, x, q = make_inputs(B, K, V, torch.float32, torch.device("cpu"))
    allowed = torch.rand(B, K + 1, V, generator=torch.Generator().manual_seed(seed)) < 0.5
    allowed[:, :K].scatter_(2, x[:, :, None].long(), True)  # every draft allowed where it stands
    mask = allowed_to_bitmask(allowed)
    last: dict = {}
    cases = {}
    for kernel, (_, verify) in KERNELS.items():
        warps = [(w, k, p, None) for w, k, p in WARPS]
        if kernel == "split":
            warps += [(w, k, p, mask) for w, k, p in MASKED_WARPS]
        for warp, top_k, top_p, bitmask in warps:
            def call(key=(kernel, warp), verify=verify, top_k=top_k, top_p=top_p, bitmask=bitmask):
                kw = {} if bitmask is None else dict(token_bitmask=bitmask)
                out = verify(logits, x, q, temperature=1.0, top_k=top_k, top_p=top_p, seed=seed, **kw)
                last[key] = dict(num_accepted=out.num_accepted,
                                 fallback_positions=fallback_positions(B, K + 1, V) if key[0] == "split" else None)
                return out

            cases[(kernel, warp)] = call
    return cases, last


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up call of each case")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a tiny run for the tests: {SMOKE} (overrides --B --K --V --repeats)")
    ap.add_argument("--out", default=None, help="default: bench/results/cpu-<CPU model>/interpreter_<date>")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or default_out()
    B, K, V = args.B, args.K, args.V
    dev_name, ver, stamp = device_name(torch.device("cpu")), versions(), now()
    load_before = os.getloadavg()
    print(f"# bench_verify_interpreter on {dev_name}; {ver}; {stamp}; B={B} K={K} V={V} fp32 T=1, "
          f"{args.repeats} rounds; load average {load_before[0]:.2f}", flush=True)

    cases, last = build_cases(B, K, V)
    times, failed = time_interleaved({f"{k}:{w}": fn for (k, w), fn in cases.items()}, min_time_s=0.0,
                                     max_reps=args.repeats, min_rounds=args.repeats)
    for name, e in failed.items():
        print(f"# {name} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    load_after = os.getloadavg()

    rows = []
    for kernel, warp in cases:
        t = times.get(f"{kernel}:{warp}")
        if t is None:
            continue
        plain = times.get(f"{kernel}:none")
        n_acc = last[(kernel, warp)]["num_accepted"]
        rows.append(dict(
            kernel=kernel, backend=KERNELS[kernel][0], warp=warp, B=B, K=K, V=V, dtype="fp32", temperature=1.0,
            drafts="accepted", mean_accepted=float(n_acc.double().mean()),
            median_s=t[0] / 1e3, q20_s=t[1] / 1e3, q80_s=t[2] / 1e3,
            ratio_to_plain=(t[0] / plain[0]) if plain else None,
            fallback_positions=last[(kernel, warp)]["fallback_positions"],
            rounds=args.repeats, device=dev_name, threads=torch.get_num_threads(), interpreter=True,
            date=stamp, **ver))
    if not rows:
        sys.exit("no case ran")

    os.makedirs(out, exist_ok=True)
    append_csv(os.path.join(out, "bench_verify_interpreter.csv"), rows)
    cols = ["kernel", "warp", "B", "K", "V", "mean_accepted", "median_s", "q20_s", "q80_s", "ratio_to_plain",
            "fallback_positions"]
    text = print_table(rows, cols)
    split = {r["warp"]: r for r in rows if r["kernel"] == "split"}

    def ratio_claim(warp: str, bound: float, statement: str, line: str):
        """The claim on split's ``warp`` over its plain call (None where it did not run), its line printed."""
        if warp not in split or split[warp]["ratio_to_plain"] is None:
            return None, ""
        ratio = split[warp]["ratio_to_plain"]
        line = f"{line} = {ratio:.3g}x ({'<=' if ratio <= bound else '>'} {bound:g}x)"
        return dict(statement=statement, ratio=ratio, holds=bool(ratio <= bound)), line

    claim, line = ratio_claim("topk50_topp0.9", 3.0,
                              "split kernel: top-k 50 + top-p 0.9 costs at most 3x its plain call",
                              "split top-k 50 + top-p 0.9 / plain")
    mask_claim, mask_line = ratio_claim("mask", 1.3,
                                        "split kernel: a call under a grammar's mask costs at most 1.3x its plain call",
                                        "split under a grammar's mask / plain")
    if mask_claim and split.get("mask_topk50_topp0.9", {}).get("ratio_to_plain") and claim:
        both = split["mask_topk50_topp0.9"]["ratio_to_plain"] / claim["ratio"]
        mask_line += f"; with top-k 50 + top-p 0.9, masked / unmasked = {both:.3g}x"
    for text_line in (line, mask_line):
        if text_line:
            print(text_line)
            text += "\n" + text_line
    with open(os.path.join(out, "bench_verify_interpreter.txt"), "w") as f:
        f.write(f"# bench_verify_interpreter on {dev_name}; {ver}; {stamp}; B={B} K={K} V={V} fp32 T=1, "
                f"{args.repeats} rounds; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
                f"{text}\n")
    conditions = dict(
        date=stamp, argv=list(sys.argv[1:] if argv is None else argv),
        shape=dict(B=B, K=K, V=V, dtype="fp32", temperature=1.0, drafts="accepted"),
        rounds=args.repeats, warm_up_calls=1, cpu=cpu_model(), device=dev_name, threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(), load_average_before=load_before, load_average_after=load_after,
        python=platform.python_version(), numpy=np.__version__, triton_interpret=os.environ["TRITON_INTERPRET"],
        versions=ver, claim=claim, mask_claim=mask_claim,
        failed={k: f"{type(e).__name__}: {e}" for k, e in failed.items()})
    with open(os.path.join(out, "conditions.json"), "w") as f:
        json.dump(conditions, f, indent=2)
    print(f"wrote bench_verify_interpreter.csv, .txt and conditions.json in {out}")


if __name__ == "__main__":
    main()
