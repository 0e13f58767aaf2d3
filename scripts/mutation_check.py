"""The quick test set's power: each mutant below is a deliberately wrong one-line change to the
op's reference, its torch path, the Triton kernel or the decoding loop; the quick set
(``pytest python_tests -m "not slow"``) must fail on every one of them.

For each mutant: the line is changed in place (the file must be as committed), the quick set runs
with ``-x`` (it stops at the first failing test), the file is restored, and the result is one row:
caught (the first failing test) or missed.  A missed mutant is a hole in the quick set: a test that
should exist.  Exit status 1 if any mutant is missed.

    python scripts/mutation_check.py                     # all, results as markdown on stdout
    python scripts/mutation_check.py --only kernel_accept_flipped --out results.md
    python scripts/mutation_check.py --list
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "specdec_kernels/"

# (name, layer, file, the line as committed, the mutant, what is wrong)
MUTANTS = [
    ("reference_accept_flipped", "reference", PKG + "ops/verify/reference/chain.py",
     "return u.double() * q_x.double() < p_x.double()", "return u.double() * q_x.double() > p_x.double()",
     "the acceptance test's comparison flipped (accept when u q(x) > p(x))"),
    ("reference_residual_unclamped", "reference", PKG + "ops/verify/reference/chain.py",
     "return (p - q).clamp(min=0.0)", "return (p - q)",
     "the residual's clamp at 0 dropped (max(0, p - q) -> p - q)"),
    ("reference_top_k_drops_ties", "reference", PKG + "ops/verify/reference/warp.py",
     "keep = s >= kth", "keep = s > kth",
     "top-k keeps only values above the k-th, dropping it and its ties"),
    ("reference_philox_offset", "reference", PKG + "ops/verify/reference/philox.py",
     "c1 = (offset & _MASK32)[:, None].expand_as(c0)", "c1 = ((offset + 1) & _MASK32)[:, None].expand_as(c0)",
     "the uniforms drawn at offset + 1 (a wrong seed offset)"),
    ("torch_greedy_accept_flipped", "torch path", PKG + "ops/verify/torch_path.py",
     "accept = x == argmax[:, :K]", "accept = x != argmax[:, :K]",
     "greedy rows accept a draft that is not the argmax"),
    ("torch_residual_keeps_the_draft", "torch path", PKG + "ops/verify/torch_path.py",
     "r[x] = (p[x] - 1.0).clamp(min=0.0)", "r[x] = p[x]",
     "without draft probabilities the rejected draft keeps its mass in the residual"),
    ("torch_greedy_host_one_more", "torch path", PKG + "ops/verify/torch_path.py",
     "while j < K and j < k_b and xb[j] == ab[j]", "while j < K and j <= k_b and xb[j] == ab[j]",
     "the host greedy route accepts one draft past the row's K_b (off by one)"),
    ("kernel_accept_flipped", "kernel", PKG + "ops/verify/triton/stage1.py",
     "u * q_x.to(tl.float64) < p_x.to(tl.float64))", "u * q_x.to(tl.float64) > p_x.to(tl.float64))",
     "the kernel's acceptance comparison flipped"),
    ("kernel_philox_offset", "kernel", PKG + "ops/verify/triton/draw.py",
     "counter_base = _param(flags, _P_OFFSET, off_ptr, off_stride, off_scalar, b, tl.int64) << 32",
     "counter_base = (_param(flags, _P_OFFSET, off_ptr, off_stride, off_scalar, b, tl.int64) + 1) << 32",
     "the kernel draws at offset + 1 (a wrong seed offset)"),
    ("kv_compact_one_short", "KV op", PKG + "ops/kv/reference.py",
     "            for j in range(n):\n                c[b, :, d + j, :] = c[b, :, src_start + j, :]",
     "            for j in range(n - 1):\n                c[b, :, d + j, :] = c[b, :, src_start + j, :]",
     "compact_kv_'s reference moves one column too few (off by one)"),
    ("loop_target_keeps_one_short", "loop", PKG + "decoding/loop.py",
     "keep_t = (n + 1).clamp(min=0)", "keep_t = n.clamp(min=0)",
     "the target's cache keeps one position too few after a step (off by one)"),
    ("loop_next_token_one_early", "loop", PKG + "decoding/loop.py",
     "st.last = out.tokens.gather(1, n.clamp(min=0)[:, None])[:, 0]",
     "st.last = out.tokens.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]",
     "the next step starts from the token before the emitted one"),
    ("loop_budget_one_more", "loop", PKG + "decoding/loop.py",
     "kb = torch.clamp(st.budget - st.gen - 1, max=d.tokens.shape[1])",
     "kb = torch.clamp(st.budget - st.gen, max=d.tokens.shape[1])",
     "a row may draft one token past its max_new_tokens budget"),
]


def run_one(name, file, old, new, timeout):
    path = ROOT / file
    text = path.read_text()
    if text.count(old) != 1:
        return "stale", f"the line is not in {file} exactly once (found {text.count(old)}): update the mutant"
    committed = subprocess.run(["git", "diff", "--quiet", "--", file], cwd=ROOT).returncode == 0
    if not committed:
        return "stale", f"{file} has uncommitted changes: commit or stash them first"
    path.write_text(text.replace(old, new))
    try:
        cmd = [sys.executable, "-m", "pytest", "python_tests", "-m", "not slow", "-x", "-q", "-n", "2",
               "-p", "no:cacheprovider", "--no-header", "-rf"]
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", f"the quick set ran past {timeout} s"
        failed = re.findall(r"^FAILED (\S+)", r.stdout, re.M) or re.findall(r"^ERROR (\S+)", r.stdout, re.M)
        if r.returncode == 0:
            return "missed", "the quick set passed"
        return "caught", failed[0] if failed else f"pytest exit status {r.returncode}"
    finally:
        path.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=None, help="run this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per quick-set run (default 900)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only is None or m[0] in args.only]
    if args.list:
        for name, layer, file, _, _, what in MUTANTS:
            print(f"{name:32s} {layer:10s} {file}: {what}")
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# Mutants against the quick set, commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", f"`python scripts/mutation_check.py` on {os.cpu_count()} cores: the quick set "
             "(`pytest python_tests -m \"not slow\" -x -n 2`) run once per mutant.", "",
             "| mutant | layer | what is wrong | result | first failing test | seconds |", "|---|---|---|---|---|---|"]
    missed = 0
    for name, layer, file, old, new, what in chosen:
        t0 = time.perf_counter()
        result, detail = run_one(name, file, old, new, args.timeout)
        secs = time.perf_counter() - t0
        missed += result != "caught"
        row = f"| `{name}` | {layer} | {what} | **{result}** | {detail} | {secs:.0f} |"
        lines.append(row)
        print(row, flush=True)
    lines += ["", f"{len(chosen) - missed} of {len(chosen)} caught."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
