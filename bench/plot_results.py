"""The figures of docs/benchmarks.md and the README, drawn from the committed result files.

One figure per question, each from the result files named in ``FIGURES`` (under bench/results/),
its conditions written under it (machine, threads, dtype, prompts, date: read from the files):

- ``speedup.png``: end to end, the speed-up over the target alone per method and temperature;
- ``tokens_per_call.png``: tokens per target call against the number of drafted tokens verified
  per step, for token, block and tree verification;
- ``verify_op.png``: the verification step's median time per provider against B, for two
  vocabularies.

    python bench/plot_results.py                 # writes docs/img/*.png
    python bench/plot_results.py --out /tmp/img  # elsewhere

Needs matplotlib (``requirements.txt``); draws with the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import matplotlib.ticker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

FIGURES = {
    "speedup.png": ["cpu-zen5/head_20261201_s17/bench_e2e.csv"],
    "tokens_per_call.png": ["cpu-xeon/tree_20261203_t0/bench_e2e.csv", "cpu-xeon/block_20261203_t1/bench_e2e.csv",
                            "cpu-xeon/tree_20261203_t1/bench_e2e.csv", "cpu-xeon/block_20261203_t07_p09/bench_e2e.csv"],
    "verify_op.png": ["cpu-zen5/verify_20261202/bench_verify.csv"],
}


def rows(rel: str) -> list[dict]:
    with open(RESULTS / rel, newline="") as f:
        return list(csv.DictReader(f))


def _caption(fig, text: str) -> None:
    fig.text(0.01, 0.01, text, ha="left", va="bottom", fontsize=7.5, color="#333333", wrap=True)


def plot_speedup(out: Path) -> None:
    rel = FIGURES["speedup.png"][0]
    data = rows(rel)
    methods = [("assisted_hf", "HF assisted generation"), ("specdec", "ours, draft model"),
               ("specdec_feature", "ours, feature draft")]
    temps = sorted({r["temperature"] for r in data}, key=float)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.13
    colours = {"assisted_hf": "#9e9e9e", "specdec": "#1f77b4", "specdec_feature": "#d62728"}
    i = 0
    for method, label in methods:
        for k, hatch in (("2", ""), ("auto", "//")):
            ys = []
            for t in temps:
                (r,) = [r for r in data if r["method"] == method and r["K"] == k and r["temperature"] == t]
                ys.append(float(r["speedup_vs_target"]))
            xs = [j + (i - 2.5) * width for j in range(len(temps))]
            bars = ax.bar(xs, ys, width, label=f"{label}, K = {k}", color=colours[method], hatch=hatch,
                          edgecolor="white" if not hatch else "#ffffff", alpha=0.9 if hatch else 1.0)
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y + 0.02, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
            i += 1
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(temps)))
    ax.set_xticklabels([f"T = {float(t):g}" + (" (greedy)" if float(t) == 0 else "") for t in temps])
    ax.set_ylabel("speed-up over the target alone (tokens/s)")
    ax.set_ylim(0, 2.35)
    ax.set_title("End to end on CPU, batch 1: speed-up over the target alone (HF generate)", fontsize=10)
    ax.legend(fontsize=7.5, ncol=2, loc="upper right", frameon=False)
    r0 = data[0]
    base = {t: float(r["tokens_per_s"]) for r in data for t in temps
            if r["method"] == "target_hf" and r["temperature"] == t}
    _caption(fig, f"{r0['pair']}; {r0['device']}, {r0['dtype']}, torch {r0['torch']}, "
                  f"transformers {r0['transformers']}; batch 1, 5 prompts x {r0['max_new_tokens']} tokens, "
                  f"median of {r0['repeats']}, methods interleaved; "
                  f"target alone {', '.join(f'{v:.1f}' for v in base.values())} tokens/s; {r0['date'][:10]}.\n"
                  f"From bench/results/{rel}")
    fig.subplots_adjust(bottom=0.2, top=0.9, left=0.09, right=0.98)
    fig.savefig(out / "speedup.png", dpi=130)
    plt.close(fig)


def plot_tokens_per_call(out: Path) -> None:
    t0, b1, t1, b07 = (rows(rel) for rel in FIGURES["tokens_per_call.png"])
    nodes = {"2,1,1,1": 8, "4,1,1,1": 16, "8,1,1,1": 32, "dynamic:16,4,4": 16, "dynamic:32,4,4": 32}

    def series(data, method, static=None):
        pts = []
        for r in data:
            if r["method"] != method:
                continue
            if method == "specdec_tree":
                if static is not None and r["K"].startswith("dynamic") == static:
                    continue
                pts.append((nodes[r["K"]], float(r["tokens_per_target_call"])))
            else:
                pts.append((int(r["K"]), float(r["tokens_per_target_call"])))
        return sorted(pts)

    panels = [("T = 0 (greedy)", [("token (chain)", series(t0, "specdec")),
                                  ("tree, static shapes", series(t0, "specdec_tree", static=True)),
                                  ("tree, dynamic", series(t0, "specdec_tree", static=False))]),
              ("T = 1", [("token (chain)", series(b1, "specdec")), ("block", series(b1, "specdec_block")),
                         ("tree, static shapes", series(t1, "specdec_tree", static=True)),
                         ("tree, dynamic", series(t1, "specdec_tree", static=False))]),
              ("T = 0.7, top-p 0.9", [("token (chain)", series(b07, "specdec")),
                                      ("block", series(b07, "specdec_block"))])]
    style = {"token (chain)": ("#1f77b4", "o"), "block": ("#2ca02c", "s"), "tree, static shapes": ("#d62728", "^"),
             "tree, dynamic": ("#ff7f0e", "v")}
    fig, axes = plt.subplots(1, 3, figsize=(10, 4.0), sharey=True)
    for ax, (title, lines) in zip(axes, panels):
        for label, pts in lines:
            c, m = style[label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=m, color=c, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks([2, 4, 8, 16, 32])
        ax.set_xticklabels(["2", "4", "8", "16", "32"])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per target call")
    fig.supxlabel("drafted tokens verified per step (K for a chain; a tree's nodes)", fontsize=9, y=0.17)
    handles = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=4, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.99))
    r0 = t1[0]
    _caption(fig, f"{r0['pair']}; {r0['device']}, {r0['dtype']}; batch 1, {r0['prompts']} prompts x "
                  f"{r0['max_new_tokens']} tokens, one run each ({r0['date'][:10]}); trees on the models' own forward. "
                  "Tokens per target call do not depend on the machine's speed.\nFrom bench/results/cpu-xeon/{"
                  + ", ".join(rel.split("/")[1] for rel in FIGURES["tokens_per_call.png"]) + "}/bench_e2e.csv")
    fig.subplots_adjust(bottom=0.3, top=0.83, left=0.06, right=0.99, wspace=0.08)
    fig.savefig(out / "tokens_per_call.png", dpi=130)
    plt.close(fig)


def plot_verify_op(out: Path) -> None:
    rel = FIGURES["verify_op.png"][0]
    data = [r for r in rows(rel) if r["temperature"] == "1.0" and r["warp"] == "none"]
    providers = [("fused_cpu", "fused_verify (CPU tensors)", "#d62728"), ("torch_batched", "batched torch", "#1f77b4"),
                 ("reference_compiled", "reference, torch.compile", "#2ca02c"),
                 ("hf_style", "row by row, as transformers", "#9e9e9e")]
    vocabs = sorted({int(r["V"]) for r in data})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(9, 4.0))
    for ax, V in zip(axes, vocabs):
        for p, label, c in providers:
            pts = sorted((int(r["B"]), float(r["median_ms"])) for r in data if r["provider"] == p and int(r["V"]) == V)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=c, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.5, 1, 2, 5, 10, 20, 50, 100]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        Bs = sorted({int(r["B"]) for r in data})
        ax.set_xticks(Bs)
        ax.set_xticklabels([str(b) for b in Bs])
        ax.set_xlabel("batch B")
        ax.set_title(f"V = {V:,}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("median ms per verify step")
    axes[0].legend(fontsize=8, frameon=False)
    r0 = data[0]
    fig.suptitle("One verification step on CPU, K = 4, T = 1, no top-k/top-p", fontsize=10)
    _caption(fig, f"{r0['device']}, fp32 logits, torch {r0['torch']}; every draft accepted; providers in rounds, "
                  f"median; {r0['date'][:10]}. `python bench/ops/bench_verify.py --grid cpu --threads 1`.\n"
                  f"From bench/results/{rel}")
    fig.subplots_adjust(bottom=0.24, top=0.86, left=0.08, right=0.99, wspace=0.18)
    fig.savefig(out / "verify_op.png", dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img",
                        help="folder for the PNGs (default docs/img)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_speedup(args.out)
    plot_tokens_per_call(args.out)
    plot_verify_op(args.out)
    for name in FIGURES:
        print(args.out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
