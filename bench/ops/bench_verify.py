"""Microbenchmark of the verification step: fused_verify against every PyTorch way of doing it.

Providers, all computing the same step on the same inputs:
  fused_triton        fused_verify, the split-vocabulary Triton kernel (one launch, the vocabulary
                      split into chunks across programs; CUDA only)
  fused_triton_rows   the one-program-per-row kernel it replaced (bench/ops/rows_kernel.py:
                      verify_rows, fused_verify's padded call on that kernel), kept until the two
                      have been measured side by side (CUDA only)
  fused_packed        fused_verify_packed on the same step in the packed layout (the logits as a
                      [B * (K+1), V] view, cu_num_draft_tokens, max_num_draft_tokens and out=
                      given: an engine's call), on CUDA the split kernel, on CPU the torch path
  fused_cpu           fused_verify on CPU tensors: the reference's computation, or its greedy
                      fast route (argmax and compare) when every row has temperature 0 (CPU only)
  fused_block         fused_verify(method="block"): block verification, on CUDA the split kernel
                      (its BLOCK path), on CPU the torch path (block_verify_reference); the same
                      step as fused_triton / fused_cpu, so their ratio is block's cost over token's
  torch_batched       the step as a lean batched PyTorch program (bench/ops/torch_batched.py: every row
                      at once, no host sync, no input checks, fp32); no top-k/top-p (n/a on warped rows)
  reference_eager     specdec_kernels.ops.reference.verify_reference, eager (uniforms from torch.rand):
                      the correctness oracle, which also scans for NaN/inf and works in float64
  reference_compiled  the same under torch.compile
  hf_style            the step as transformers writes it, looped over the rows (bench/ops/hf_style.py);
                      it has no top-k/top-p of its own, so warped rows are marked n/a for it
  vllm_sampler        vLLM V1's own RejectionSampler.forward on the step in its packed layout (its
                      SpecDecodeMetadata and SamplingMetadata, per-request temperature/top-k/top-p);
                      only where vLLM imports (run this script with .venv-vllm/bin/python)
  vllm_plugin         the same call through specdec_kernels.integrations.vllm.fused_forward (what
                      the vLLM plugin runs: the metadata mapped onto one fused_verify_packed call)

Timing on CUDA: every provider under triton.testing.do_bench (launches included, cold L2), the
column median_ms, from which the speed-ups and GB/s come; the two fused kernels at B <= 16 (a
few microseconds, where the launch would dominate) also under CUDA graph replay
(cuda_graph_median_ms, warm L2), compared with the baselines as they are in the
graph_speedup_vs_* columns (the other fused kernel by its graph replay too).  On CPU the
providers are timed in rounds (harness.time_interleaved).

Bandwidth: gbps is the bytes a correct step reads and writes (bytes_moved) over median_ms;
pct_peak is its share of the vendor's figure (harness.PEAK_GBPS), pct_of_copy its share of the
device-to-device copy of a large buffer timed in the same run (copy_gbps: read + write bytes of
--copy-mib MiB over the copy's median time), the bandwidth the device actually reaches.

Drafts (--drafts): "accepted" (the default) makes every draft accepted (the target's argmax,
drawn from a flatter q), so every provider verifies all K + 1 positions; "sampled" draws them
from a q near p: the split kernel still reads every position (in parallel, before it knows
where a row stops), the one-program-per-row kernel reads nothing after a row's first
rejection, so it then does less work than the bytes counted.  The mean accepted count is a
column.

On a machine without a GPU only the torch providers run, on CPU (never the Triton interpreter,
which would measure numpy: bench/ops/bench_verify_interpreter.py does that, as a proxy of the
kernels' passes over the logits). Rows append to a CSV keyed by provider, shape, dtype, device
and versions; a table is printed and a PNG of time against B is drawn per (K, V, dtype, mode).

    python bench/ops/bench_verify.py                     # the grid for this machine (cpu or gpu)
    python bench/ops/bench_verify.py --grid full --out bench/results/gpu
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: hf_style, torch_batched, rows_kernel
from harness import (append_csv, device_name, now, peak_gbps, print_table, time_fn,  # noqa: E402
                     time_interleaved, versions)
from hf_style import hf_style_verify  # noqa: E402
from torch_batched import torch_batched_verify  # noqa: E402

from specdec_kernels import fused_verify, fused_verify_packed  # noqa: E402
from specdec_kernels.ops.reference import verify_reference  # noqa: E402

GRIDS = {
    # B, K, V, dtypes, temperatures, warps
    "full": dict(B=[1, 4, 16, 64, 256], K=[1, 4, 8], V=[32000, 128256, 151936],
                 dtype=["fp32", "bf16"], temperature=[1.0, 0.0], warp=[False, True]),
    # the reduced grid of bench/gpu_check.sh: a few minutes including torch.compile (the
    # targets' batches first, B = 64 for the bandwidth, 16 and 1 for the graph-replayed
    # microseconds: a run stopped at its time limit keeps them)
    "gpu": dict(B=[64, 16, 1, 256, 4], K=[4], V=[128256], dtype=["bf16"], temperature=[1.0, 0.0],
                warp=[False, True]),
    "cpu": dict(B=[1, 4, 16], K=[4], V=[32000, 128256], dtype=["fp32"], temperature=[1.0, 0.0], warp=[False, True]),
    "smoke": dict(B=[1, 4], K=[2], V=[1000], dtype=["fp32"], temperature=[1.0], warp=[False, True]),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROVIDERS = ["fused_triton", "fused_triton_rows", "fused_packed", "fused_block", "fused_cpu", "torch_batched",
             "reference_eager", "reference_compiled", "hf_style", "vllm_sampler", "vllm_plugin"]
# The fused kernels, timed also under CUDA graph replay where a call takes microseconds (B <= 16).
GRAPHED = ("fused_triton", "fused_triton_rows", "fused_packed", "fused_block")
_VLLM: dict = {}  # vLLM's sampler, built once (None: vLLM does not import here)
GRAPH_MAX_B = 16


def make_inputs(B, K, V, dtype, device, drafts="accepted", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * 3).to(dtype)
    lf = logits[:, :K].float()
    if drafts == "accepted":
        # x = the target's argmax, q = the target at twice the temperature (T <= 1 here): the
        # argmax's probability only falls as the temperature rises and only rises under a warp,
        # so q(x) < p(x): every draft is accepted, at T = 0 too
        x = lf.argmax(-1)
        q = torch.softmax(lf / 2, dim=-1)
    else:
        q = torch.softmax(lf + torch.randn(B, K, V, generator=g), dim=-1)
        x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    return logits.to(device), x.to(device), q.to(device)


def bytes_moved(num_accepted, num_draft, V, Vd, elem, full_q=True):
    """The bytes a correct step reads and writes, summed over rows b with K_b = num_draft (an int
    or [B]) drafts that accepted n_b = num_accepted[b]: the logits of positions 0..K_b, V * elem
    each (every decision needs the softmax of its position; the split kernel reads them all, in
    parallel, before it knows where the row stops), the draft row q of the residual, Vd * 4,
    when the row rejected (n_b < K_b) and q is a full distribution (full_q), the outputs
    ((K + 2) * 8, K = the largest K_b).  With every draft accepted (the default drafts) that is
    also what the one-program-per-row kernel reads; with sampled drafts it reads only the
    positions up to n_b."""
    n = num_accepted.double()
    kb = torch.as_tensor(num_draft, dtype=torch.float64).expand_as(n)
    K = int(kb.max()) if kb.numel() else 0
    rejected = (n < kb).double() * (Vd * 4 if full_q else 0)
    return int(((kb + 1) * V * elem + rejected + (K + 2) * 8).sum())


def build_providers(logits, x, q, temperature, warp, device, compiled_cache):
    B, K1, V = logits.shape
    kb = torch.full((B,), K1 - 1, dtype=torch.int64, device=device)
    temp = torch.full((B,), temperature, dtype=torch.float32, device=device)
    top_k = torch.full((B,), 50, dtype=torch.int64, device=device) if warp else None
    top_p = torch.full((B,), 0.9, dtype=torch.float32, device=device) if warp else None
    seed = torch.arange(B, dtype=torch.int64, device=device)

    def reference_step():
        u = torch.rand(B, K1, device=device)
        return verify_reference(logits, x, q, kb, temp, top_k, top_p, u)

    if "fn" not in compiled_cache:
        # dynamic shapes from the start: one graph per code path (with/without warp), not a static
        # first case and a dynamic recompile (4 compiles in the GPU grid's first cases before)
        compiled_cache["fn"] = torch.compile(verify_reference, dynamic=True)
    compiled = compiled_cache["fn"]

    def compiled_step():
        u = torch.rand(B, K1, device=device)
        return compiled(logits, x, q, kb, temp, top_k, top_p, u)

    providers = {
        "reference_eager": reference_step,
        "reference_compiled": compiled_step,
        "hf_style": None if warp else (lambda: hf_style_verify(logits, q, x, temperature)),
        "torch_batched": None if warp else (lambda: torch_batched_verify(logits, q, x, temperature)),
    }

    def fused(backend="auto", method="token"):
        return lambda: fused_verify(logits, x, q, temperature=temp, top_k=top_k, top_p=top_p, seed=seed, offset=0,
                                    backend=backend, method=method)

    cu = torch.arange(B + 1, dtype=torch.int64, device=device) * (K1 - 1)
    packed = (logits.view(B * K1, V), x.reshape(-1), cu, q.reshape(B * (K1 - 1), V))  # views: no copy
    out = (torch.empty((B, K1), dtype=torch.int32, device=device), torch.empty((B,), dtype=torch.int32, device=device))
    providers["fused_packed"] = lambda: fused_verify_packed(
        *packed, max_num_draft_tokens=K1 - 1, temperature=temp, top_k=top_k, top_p=top_p, seed=seed, offset=0, out=out)
    providers["fused_block"] = fused(method="block")
    providers.update(vllm_providers(logits, x, q, temp, top_k, top_p, device))
    if device.type == "cuda":
        providers["fused_triton"] = fused("triton")
        from rows_kernel import verify_rows  # imports Triton: CUDA only

        providers["fused_triton_rows"] = lambda: verify_rows(logits, x, q, temperature=temp, top_k=top_k, top_p=top_p,
                                                             seed=seed, offset=0)
    else:  # fused_verify's CPU path: the reference, or its greedy fast route when every row has T = 0
        providers["fused_cpu"] = fused()
    return providers


def vllm_providers(logits, x, q, temp, top_k, top_p, device) -> dict:
    """vllm_sampler and vllm_plugin on the step (every row with K drafts, as vLLM's runner packs
    them), or {} where vLLM does not import."""
    if "sampler" not in _VLLM:
        try:
            from vllm.platforms import current_platform
            from vllm.v1.sample.rejection_sampler import RejectionSampler
            from vllm.v1.sample.sampler import Sampler
        except ImportError:
            _VLLM["sampler"] = None
        else:
            if device.type == "cpu":  # the C++ stand-ins of vLLM's Triton kernels, as its CPU worker registers them
                current_platform.register_triton_kernel_overrides()
            _VLLM["sampler"] = RejectionSampler(Sampler())
    sampler = _VLLM["sampler"]
    if sampler is None:
        return {}
    from specdec_kernels.integrations import vllm as sv

    B, K1, V = logits.shape
    md = sv.spec_decode_metadata(x.tolist(), device)
    flat_logits = logits.view(B * K1, V)  # vLLM's packed layout: each row's K positions, then its bonus
    flat_q = q.reshape(B * (K1 - 1), V)
    greedy = bool((temp == 0).all())
    sm = sv.sampling_metadata(None if greedy else temp, top_k=top_k, top_p=top_p, vocab_size=V, device=device)
    original = sv.original_forward()
    return {"vllm_sampler": lambda: original(sampler, md, flat_q, flat_logits, sm),
            "vllm_plugin": lambda: sv.fused_forward(sampler, md, flat_q, flat_logits, sm)}


def measure_copy(device, mib):
    """The device-to-device copy bandwidth in GB/s (read + write bytes over the median time) of a
    buffer of ``mib`` MiB, far larger than any cache, or None when mib is 0 or the copy fails: the
    bandwidth this device reaches in this run, the yardstick of pct_of_copy."""
    if not mib:
        return None
    try:
        n = mib << 20
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        med = time_fn(lambda: dst.copy_(src), device)[0]
    except Exception as e:  # noqa: BLE001 - an OOM on a shared device: the column is left empty
        print(f"# device copy of {mib} MiB FAILED: {type(e).__name__}: {e}", flush=True)
        return None
    finally:
        src = dst = None  # noqa: F841 - freed before the cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 2 * n / (med * 1e-3) / 1e9


def measure_case(B, K, V, dt, temperature, warp, device, wanted, compiled_cache, dev_name, peak, ver, stamp,
                 drafts="accepted", copy_gbps=None):
    """Every wanted provider on one (B, K, V, dtype, T, warp) case: its CSV rows, also printed
    as they are measured (a run stopped at a time limit keeps them in its log)."""
    if temperature == 0 and warp:
        return []  # greedy ignores the warp
    logits, x, q = make_inputs(B, K, V, DTYPES[dt], device, drafts)
    providers = build_providers(logits, x, q, temperature, warp, device, compiled_cache)
    times, graph_ms, failed = {}, {}, {}
    try:  # the acceptance behind the bytes; on a GPU this is the kernel, which may fail like a provider
        n_acc = fused_verify(logits, x, q, temperature=temperature, top_k=50 if warp else None,
                             top_p=0.9 if warp else None, seed=torch.arange(B, device=device),
                             offset=0).num_accepted.cpu()
    except Exception as e:  # noqa: BLE001 - reported below; the bytes then assume every draft accepted
        failed["fused_verify (acceptance count)"] = e
        n_acc = torch.full((B,), K)
    chosen = {name: providers[name] for name in PROVIDERS if name in wanted and providers.get(name) is not None}
    if device.type == "cpu":  # the providers in rounds, so that the machine's drift hits them alike
        times, provider_failed = time_interleaved(chosen)
        failed.update(provider_failed)
    else:
        # Every provider is timed the same way (do_bench: launches included, cold L2), so the
        # speedup_vs_* ratios compare like with like; the fused kernels at small B are also timed
        # as a CUDA graph replay (no launch overhead, warm L2), in their own columns. A failed
        # replay (a capture error) is reported and leaves the provider's do_bench time standing.
        for name, fn in chosen.items():
            try:
                times[name] = time_fn(fn, device)
            except Exception as e:  # noqa: BLE001 - a provider's failure (a compile error, OOM) is a finding
                failed[name] = e
                continue
            if name in GRAPHED and B <= GRAPH_MAX_B:
                try:
                    graph_ms[name] = time_fn(fn, device, cuda_graph=True)[0]
                except Exception as e:  # noqa: BLE001
                    failed[f"{name} (CUDA graph)"] = e
    for name, e in failed.items():
        print(f"# B={B} K={K} V={V} {dt} T={temperature} warp={bool(warp)}: {name} FAILED: "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    times = {name: times[name] for name in chosen if name in times}  # the providers' order
    print(f"# B={B} K={K} V={V} {dt} T={temperature} warp={bool(warp)} drafts={drafts} "
          f"(mean accepted {n_acc.double().mean():.2f} of {K}): "
          + ", ".join(f"{n} {t[0]:.4g} ms" for n, t in times.items())
          + "".join(f", {n} graph {t:.4g} ms" for n, t in graph_ms.items()), flush=True)
    nbytes = bytes_moved(n_acc, K, V, q.shape[-1], logits.element_size())  # every row has K_b = K
    rows = []
    for name, (med, q20, q80) in times.items():
        gbps = nbytes / (med * 1e-3) / 1e9
        row = dict(op="verify", provider=name, B=B, K=K, V=V, dtype=dt, temperature=temperature,
                   warp="topk50_topp0.9" if warp else "none", drafts=drafts,
                   mean_accepted=float(n_acc.double().mean()), device=dev_name, threads=torch.get_num_threads(),
                   median_ms=med,
                   q20_ms=q20, q80_ms=q80, cuda_graph_median_ms=graph_ms.get(name), bytes=nbytes, gbps=gbps,
                   pct_peak=(100 * gbps / peak) if peak else None, copy_gbps=copy_gbps,
                   pct_of_copy=(100 * gbps / copy_gbps) if copy_gbps else None, date=stamp, **ver)
        for other, (omed, _, _) in times.items():
            if other != name:
                row[f"speedup_vs_{other}"] = omed / med
                if name in graph_ms:  # the replay against the other as it is (its replay if it has one)
                    row[f"graph_speedup_vs_{other}"] = graph_ms.get(other, omed) / graph_ms[name]
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None, help="default: gpu on CUDA, cpu otherwise")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="bench/results/local")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="MiB of the device-to-device copy behind pct_of_copy (default: 1024 on CUDA, 256 on CPU; "
                         "0: not measured)")
    ap.add_argument("--drafts", choices=["accepted", "sampled"], default="accepted",
                    help="accepted: every draft accepted, all K + 1 positions verified (default); sampled: drawn "
                         "from a q near p (the one-program-per-row kernel stops reading at a row's first "
                         "rejection, the split kernel reads every position)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    grid = GRIDS[args.grid or ("gpu" if device.type == "cuda" else "cpu")]
    wanted = set(args.providers.split(","))
    dev_name, peak, ver, stamp = device_name(device), peak_gbps(device), versions(), now()
    print(f"# bench_verify on {dev_name}; {ver}; {stamp}")
    copy_mib = args.copy_mib if args.copy_mib is not None else (1024 if device.type == "cuda" else 256)
    copy_gbps = measure_copy(device, copy_mib)
    if copy_gbps:
        print(f"# device copy of {copy_mib} MiB: {copy_gbps:.4g} GB/s (read + write)", flush=True)
    rows = []
    compiled_cache: dict = {}
    interrupted = False
    try:
        for case in itertools.product(grid["B"], grid["K"], grid["V"], grid["dtype"], grid["temperature"],
                                      grid["warp"]):
            rows += measure_case(*case, device, wanted, compiled_cache, dev_name, peak, ver, stamp, args.drafts,
                                 copy_gbps)
    except KeyboardInterrupt:  # a time limit (gpu_check.sh's SIGINT): keep the cases measured
        interrupted = True
        print(f"# interrupted: writing the {len(rows)} rows measured so far", flush=True)
    if rows:
        write_results(rows, args.out, dev_name, ver, stamp)
    if interrupted:
        sys.exit(130)


def write_results(rows, out, dev_name, ver, stamp):
    for r in rows:  # one schema for the CSV: every speed-up column, None where not measured
        for p in PROVIDERS:
            r.setdefault(f"speedup_vs_{p}", None)
            r.setdefault(f"graph_speedup_vs_{p}", None)
    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, "bench_verify.csv")
    cols = ["provider", "B", "K", "V", "dtype", "temperature", "warp", "drafts", "mean_accepted", "median_ms", "q20_ms",
            "q80_ms", "cuda_graph_median_ms", "gbps", "pct_peak", "pct_of_copy"]
    cols += [f"speedup_vs_{p}" for p in PROVIDERS]
    if any(r["cuda_graph_median_ms"] is not None for r in rows):
        cols += [f"graph_speedup_vs_{p}" for p in PROVIDERS]
    order = lambda k: (k.startswith("graph_speedup"), k.startswith("speedup"), k)  # noqa: E731
    rows = [{k: r[k] for k in sorted(r, key=order)} for r in rows]
    append_csv(csv_path, rows)
    text = print_table(rows, cols)
    with open(os.path.join(out, "bench_verify.txt"), "w") as f:
        f.write(f"# bench_verify on {dev_name}; {ver}; {stamp}\n{text}\n")
    plot(rows, os.path.join(out, "bench_verify.png"), dev_name)
    print(f"wrote {csv_path} and bench_verify.png in {out}")


def plot(rows, path, dev_name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["K"], r["V"], r["dtype"], r["temperature"], r["warp"]) for r in rows})
    n = len(groups)
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, g in zip(axes.flat, groups):
        for prov in PROVIDERS:
            pts = sorted((r["B"], r["median_ms"]) for r in rows
                         if (r["K"], r["V"], r["dtype"], r["temperature"], r["warp"]) == g and r["provider"] == prov)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B")
        ax.set_ylabel("median ms")
        ax.set_title(f"K={g[0]} V={g[1]} {g[2]} T={g[3]} {g[4]}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"verification step, {dev_name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
