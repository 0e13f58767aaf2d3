"""bench/ops/bench_verify.py on its smoke grid: the rows it promises, and a run stopped at a time
limit (bench/gpu_check.sh sends SIGINT) keeps the cases measured.  No speed is asserted.  In
process, without --threads (which would change torch's thread count for the worker's later tests)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from helpers import needs_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "ops" / "bench_verify.py"


@pytest.fixture
def bench_verify():
    spec = importlib.util.spec_from_file_location("bench_verify_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mod


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_grid_writes_every_case_and_provider(bench_verify, tmp_path, capsys):
    # --device cpu: on a machine with CUDA the default device would run fused_triton instead
    bench_verify.main(["--grid", "smoke", "--device", "cpu", "--providers", "fused_cpu,reference_eager,torch_batched",
                       "--out", str(tmp_path)])
    rows = _rows(tmp_path / "bench_verify.csv")
    got = sorted((r["provider"], r["B"], r["warp"]) for r in rows)
    want = sorted((p, b, w) for p in ("fused_cpu", "reference_eager") for b in ("1", "4")
                  for w in ("none", "topk50_topp0.9"))
    want = sorted(want + [("torch_batched", b, "none") for b in ("1", "4")])  # no top-k/top-p of its own
    assert got == want
    assert all(r["drafts"] == "accepted" and float(r["mean_accepted"]) == 2 and r["commit"] for r in rows)
    for r in rows:
        assert float(r["median_ms"]) > 0 and r["date"] and r["torch"]
        other = "reference_eager" if r["provider"] == "fused_cpu" else "fused_cpu"
        assert float(r[f"speedup_vs_{other}"]) > 0
    out = capsys.readouterr().out
    assert out.count("# B=") == 4  # one progress line per case, printed as it is measured
    assert (tmp_path / "bench_verify.png").stat().st_size > 0
    # the copy timed in the same run: every row's share of it
    assert "# device copy of 256 MiB:" in out
    assert all(float(r["copy_gbps"]) > 0 and float(r["pct_of_copy"]) > 0 for r in rows)
    assert all(r["cuda_graph_median_ms"] == "" and r["graph_speedup_vs_fused_triton"] == "" for r in rows)


def test_the_fused_kernels_are_providers_on_cuda_only(bench_verify):
    assert bench_verify.PROVIDERS[:2] == ["fused_triton", "fused_triton_rows"]
    assert set(bench_verify.GRAPHED) == {"fused_triton", "fused_triton_rows", "fused_packed", "fused_block"}
    import torch

    logits, x, q = bench_verify.make_inputs(2, 2, 100, torch.float32, torch.device("cpu"))
    # {"fn": None}: no torch.compile wrapper made, none of the providers is called
    prov = bench_verify.build_providers(logits, x, q, 1.0, False, torch.device("cpu"), {"fn": None})
    assert "fused_cpu" in prov and "fused_triton" not in prov and "fused_triton_rows" not in prov
    # the packed provider runs on either device, on the same step: the same tokens
    tokens = prov["fused_packed"]().tokens
    assert torch.equal(tokens.long(), prov["fused_cpu"]().tokens)


def test_the_gpu_branch_times_the_fused_kernels_under_graph_replay_too(bench_verify, monkeypatch, capsys):
    """The timing logic of the CUDA branch, run on the meta device with stand-in timings: do_bench
    for every provider, a graph replay for the fused kernels at B <= 16 only, graph_speedup_vs_*
    against the others as they are (the other fused kernel by its replay), and a failed replay
    reported without losing the provider's do_bench time."""
    import torch

    calls = []

    def time_fn(fn, device, cuda_graph=False):
        name = fn()
        calls.append((name, cuda_graph))
        if cuda_graph and name == "fused_triton_rows" and broken_rows_graph:
            raise RuntimeError("capture failed (simulated)")
        return {"fused_triton": (4.0, 3.0, 5.0), "fused_triton_rows": (8.0, 7.0, 9.0),
                "reference_eager": (40.0, 30.0, 50.0)}[name] if not cuda_graph else \
            ({"fused_triton": 1.0, "fused_triton_rows": 2.0}[name], 0, 0)

    monkeypatch.setattr(bench_verify, "time_fn", time_fn)
    monkeypatch.setattr(bench_verify, "build_providers", lambda *a: {n: (lambda n=n: n) for n in (
        "fused_triton", "fused_triton_rows", "reference_eager")})
    wanted = {"fused_triton", "fused_triton_rows", "reference_eager"}
    meta = torch.device("meta")
    broken_rows_graph = False
    rows = bench_verify.measure_case(16, 2, 100, "fp32", 1.0, False, meta, wanted, {}, "dev", 1000.0, {}, "now",
                                     copy_gbps=500.0)
    by = {r["provider"]: r for r in rows}
    assert sorted(calls) == sorted([(n, False) for n in wanted] + [("fused_triton", True), ("fused_triton_rows", True)])
    assert by["fused_triton"]["cuda_graph_median_ms"] == 1.0 and by["reference_eager"]["cuda_graph_median_ms"] is None
    assert by["fused_triton"]["speedup_vs_reference_eager"] == 10.0  # do_bench against do_bench
    assert by["fused_triton"]["graph_speedup_vs_reference_eager"] == 40.0  # the replay against do_bench
    assert by["fused_triton"]["graph_speedup_vs_fused_triton_rows"] == 2.0  # replay against replay
    assert "graph_speedup_vs_fused_triton" not in by["reference_eager"]
    # bytes: the acceptance count failed on meta, so every draft counts as accepted: 3 positions
    nbytes = 16 * (3 * 100 * 4 + 4 * 8)
    assert by["fused_triton"]["bytes"] == nbytes
    gbps = nbytes / 4e-3 / 1e9
    assert abs(by["fused_triton"]["pct_of_copy"] - 100 * gbps / 500.0) < 1e-9
    assert abs(by["fused_triton"]["pct_peak"] - 100 * gbps / 1000.0) < 1e-9
    calls.clear()
    broken_rows_graph = True
    rows = bench_verify.measure_case(16, 2, 100, "fp32", 1.0, False, meta, wanted, {}, "dev", None, {}, "now")
    by = {r["provider"]: r for r in rows}
    assert by["fused_triton_rows"]["median_ms"] == 8.0 and by["fused_triton_rows"]["cuda_graph_median_ms"] is None
    assert by["fused_triton_rows"]["pct_of_copy"] is None
    assert by["fused_triton"]["graph_speedup_vs_fused_triton_rows"] == 8.0  # the other as it is: no replay
    assert "fused_triton_rows (CUDA graph) FAILED: RuntimeError: capture failed" in capsys.readouterr().out
    calls.clear()
    bench_verify.measure_case(64, 2, 100, "fp32", 1.0, False, meta, wanted, {}, "dev", None, {}, "now")
    assert not any(graph for _, graph in calls)  # B > 16: no replay


@needs_cuda
def test_both_fused_kernels_are_timed_eagerly_and_under_cuda_graph_replay(bench_verify, capsys):
    """On a GPU: the split kernel (whose workspace must exist on the capture stream before the
    capture) and the one-program-per-row kernel each get a do_bench time and a graph replay
    time, and the replay's ratios to the other providers."""
    import torch

    dev = torch.device("cuda")
    rows = bench_verify.measure_case(4, 2, 1000, "fp32", 1.0, True, dev, {"fused_triton", "fused_triton_rows",
                                     "reference_eager"}, {}, "gpu", None, {}, "now", copy_gbps=1000.0)
    assert "FAILED" not in capsys.readouterr().out
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"fused_triton", "fused_triton_rows", "reference_eager"}
    for name in ("fused_triton", "fused_triton_rows"):
        r = by[name]
        assert r["cuda_graph_median_ms"] > 0 and r["pct_of_copy"] > 0 and r["mean_accepted"] == 2
        other = "fused_triton_rows" if name == "fused_triton" else "fused_triton"
        assert r[f"graph_speedup_vs_{other}"] > 0 and r["graph_speedup_vs_reference_eager"] > 0
    assert by["reference_eager"]["cuda_graph_median_ms"] is None


@pytest.mark.slow
def test_a_run_stopped_at_its_time_limit_keeps_the_cases_measured(bench_verify, tmp_path, monkeypatch):
    real, calls = bench_verify.measure_case, []

    def measure_case(*args, **kwargs):
        calls.append(args[:6])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what SIGINT raises in the main thread
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_verify, "measure_case", measure_case)
    with pytest.raises(SystemExit) as e:
        bench_verify.main(["--grid", "smoke", "--device", "cpu", "--providers", "fused_cpu", "--out", str(tmp_path)])
    assert e.value.code == 130
    assert len(calls) == 2
    rows = _rows(tmp_path / "bench_verify.csv")
    assert [(r["provider"], r["B"], r["warp"]) for r in rows] == [("fused_cpu", "1", "none")]


def test_accepted_drafts_are_all_accepted_and_bytes_count_every_position(bench_verify):
    """--drafts accepted (the default): every provider verifies all K + 1 positions (with sampled
    drafts the one-program-per-row kernel, which stops reading at a row's first rejection, does
    less work than the baselines); GB/s counts the logits of all K_b + 1 positions a correct step
    reads (the split kernel reads them in parallel), and q's row after a rejection."""
    import torch

    from specdec_kernels import fused_verify

    for T in (1.0, 0.0):
        for warp in (False, True):
            logits, x, q = bench_verify.make_inputs(8, 3, 500, torch.float32, torch.device("cpu"), "accepted")
            n = fused_verify(logits, x, q, temperature=T, top_k=50 if warp else None, top_p=0.9 if warp else None,
                             seed=0).num_accepted
            assert n.tolist() == [3] * 8, (T, warp)
    logits, x, q = bench_verify.make_inputs(64, 3, 500, torch.float32, torch.device("cpu"), "sampled")
    n = fused_verify(logits, x, q, temperature=0.0, seed=0).num_accepted
    assert n.double().mean() < 3
    # rows stopping at 0 and at K = 3: (4 + 4) logit rows of V * E, one residual row of Vd * 4, outputs
    assert bench_verify.bytes_moved(torch.tensor([0, 3]), 3, 100, 90, 2) == (4 + 4) * 100 * 2 + 90 * 4 + 2 * 5 * 8
    # per-row K_b = [1, 3], the first row rejecting at 0; no q row without a full q (one-hot drafts)
    assert bench_verify.bytes_moved(torch.tensor([0, 3]), torch.tensor([1, 3]), 100, 90, 2) == \
        (2 + 4) * 100 * 2 + 90 * 4 + 2 * 5 * 8
    assert bench_verify.bytes_moved(torch.tensor([0, 3]), 3, 100, 90, 2, full_q=False) == (4 + 4) * 100 * 2 + 2 * 5 * 8


def test_torch_batched_baseline_computes_the_step(bench_verify):
    """The lean batched PyTorch baseline verifies as the package does: greedy tokens equal, the
    same acceptances from the same uniforms, and its final token follows p (chi-square, 1e-4)."""
    import numpy as np
    import torch
    from scipy import stats

    from specdec_kernels import fused_verify
    from torch_batched import torch_batched_verify

    logits, x, q = bench_verify.make_inputs(64, 3, 50, torch.float32, torch.device("cpu"), "sampled")
    tok, n = torch_batched_verify(logits, q, x, 0.0)
    ref = fused_verify(logits, x, q, temperature=0.0, seed=0)
    assert torch.equal(tok, ref.tokens) and torch.equal(n, ref.num_accepted)
    u = torch.rand(64, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, n = torch_batched_verify(logits, q, x, 1.0, uniforms=u[:, :3])
    assert torch.equal(n, fused_verify(logits, x, q, temperature=1.0, uniforms=u).num_accepted)
    assert 0 < n.double().mean() < 3  # both outcomes
    # the distribution of the first token, N rows of one case (V = 6, a q unlike p)
    N, V = 40_000, 6
    g = torch.Generator().manual_seed(2)
    lg = torch.randn(1, 3, V, generator=g, dtype=torch.float64)
    qq = torch.softmax(torch.randn(1, 2, V, generator=g, dtype=torch.float64), -1)
    xs = torch.multinomial(qq[0, 0], N, replacement=True, generator=g)
    xx = torch.stack([xs, torch.multinomial(qq[0, 1], N, replacement=True, generator=g)], 1)
    with torch.random.fork_rng():  # its draws come from the global RNG: seeded here, restored after
        torch.manual_seed(3)
        tok, _ = torch_batched_verify(lg.float().expand(N, -1, -1), qq.float().expand(N, -1, -1), xx, 1.0)
    p1 = torch.softmax(lg[0, 0], -1).numpy()
    counts = np.bincount(tok[:, 0].numpy(), minlength=V)
    assert stats.chisquare(counts, p1 * N).pvalue > 1e-4
    assert stats.chisquare(counts, qq[0, 0].numpy() * N).pvalue < 1e-4  # the draft's q would be rejected
    for B, K in ((2, 0), (0, 0), (0, 2)):  # edges: no drafts (the bonus alone), no rows
        lg, q0, x0 = torch.randn(B, K + 1, 7), torch.softmax(torch.randn(B, K, 7), -1), torch.randint(0, 7, (B, K))
        for T in (0.0, 1.0):
            tok, n = torch_batched_verify(lg, q0, x0, T)
            assert tok.shape == (B, K + 1) and n.shape == (B,) and bool((tok[:, 0] >= 0).all())


def test_a_failing_provider_is_reported_and_the_others_kept(bench_verify, tmp_path, capsys, monkeypatch):
    real = bench_verify.build_providers

    def build(*a, **k):
        prov = real(*a, **k)
        prov["reference_eager"] = lambda: (_ for _ in ()).throw(RuntimeError("out of memory"))
        return prov

    monkeypatch.setattr(bench_verify, "build_providers", build)
    bench_verify.main(["--grid", "smoke", "--device", "cpu", "--providers", "fused_cpu,reference_eager",
                       "--out", str(tmp_path)])
    assert {r["provider"] for r in _rows(tmp_path / "bench_verify.csv")} == {"fused_cpu"}
    assert capsys.readouterr().out.count("reference_eager FAILED: RuntimeError: out of memory") == 4


def test_a_failing_acceptance_count_does_not_stop_the_run(bench_verify, tmp_path, capsys, monkeypatch):
    # (before: the count behind the bytes ran the op outside the per-provider handling)
    def broken(*a, **k):
        raise RuntimeError("triton compile error (simulated)")

    monkeypatch.setattr(bench_verify, "fused_verify", broken)
    bench_verify.main(["--grid", "smoke", "--device", "cpu", "--providers", "reference_eager", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "bench_verify.csv")
    assert {r["provider"] for r in rows} == {"reference_eager"} and all(r["mean_accepted"] == "2.0" for r in rows)
    assert "fused_verify (acceptance count) FAILED: RuntimeError: triton compile error" in capsys.readouterr().out
