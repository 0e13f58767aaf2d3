"""bench/decoding/bench_e2e.py --quick runs end to end on the tiny random pair and writes what it promises.

A subprocess, so the benchmark's own process set-up (threads, sys.path, argument parsing) is
what is tested.  Only structure and the greedy identity check are asserted, never a speed
(STYLE item 18): a ratio measured on a shared CPU says nothing about a pass or a fail.
"""

from __future__ import annotations

import argparse
import importlib.util
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_kernels.ops.extension import HAS_EXT

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "decoding" / "bench_e2e.py"


@pytest.fixture(autouse=True)
def _restore_threads_and_rng():
    """The benchmark mains called in process set torch's thread count (demo_*: 1) and seed the
    global RNG: restored after each test, so that the worker's later tests run as they would
    alone (the tests were flaky before)."""
    import torch

    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_bench_e2e_quick(tmp_path):
    # --ks 1,auto@0.3 and one thread keep the run short on a shared 2-core machine (about 30 s).
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--threads", "1", "--ks", "1,auto@0.3"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "GREEDY CHECK FAILED" not in r.stdout, r.stdout

    for name in ("bench_e2e.csv", "bench_e2e.txt", "bench_e2e.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "bench_e2e.csv", newline="") as f:
        rows = list(csv.DictReader(f))

    got = sorted((r["method"], r["K"], r["batch"], r["temperature"]) for r in rows)
    want = []
    for t in ("0.0", "1.0"):
        want += [("target_hf", "-", "1", t), ("specdec_target_only", "-", "1", t),
                 ("target_hf", "-", "8", t), ("specdec_target_only", "-", "8", t),
                 ("assisted_hf", "-", "8", t)]  # the batch-8 row that says assisted is batch 1 only
        if HAS_EXT:  # fp32 CPU: every method uses skinny_linear, and the target alone also runs stock
            want += [("target_hf_torch_linear", "-", "1", t), ("target_hf_torch_linear", "-", "8", t)]
        for k in ("1", "auto@0.3"):
            want += [("assisted_hf", k, "1", t), ("specdec", k, "1", t), ("specdec", k, "8", t),
                     ("hook_hf", k, "1", t), ("hook_hf", k, "8", t)]
    assert got == sorted(want)

    for r in rows:
        assert r["pair"].startswith("tiny-random")
        assert r["max_new_tokens"] == "8" and r["repeats"] == "1" and r["threads"] == "1"
        for key in ("device", "dtype", "date", "torch", "transformers", "specdec_kernels"):
            assert r[key], key
        if r["method"] == "assisted_hf" and r["batch"] == "8":
            assert r["tokens_per_s"] == "n/a (batch 1 only)"
            continue
        # 8 prompts x 8 tokens (EOS ignored), and a positive speed
        assert int(r["tokens"]) == 64, r
        assert float(r["tokens_per_s"]) > 0
        if r["temperature"] == "0.0" and r["method"] == "target_hf_torch_linear":
            # compared with target_hf; a rounding difference would be noted, never refusing
            assert r["greedy_check"] in ("pass", "differs (rounding, see notes)"), r
        elif r["temperature"] == "0.0":
            assert r["greedy_check"] == "pass", r
            if r["method"] != "target_hf":
                float(r["speedup_vs_target"])  # reported, not REFUSED
        else:
            assert r["greedy_check"] == "n/a (sampling)"
        if r["method"] == "specdec":
            assert 0.0 <= float(r["alpha"]) <= 1.0
            assert float(r["tokens_per_target_call"]) >= 1.0
            hist = [int(x) for x in r["accepted_length_hist"].split()]
            assert sum(hist) > 0
            assert float(r["predicted_speedup"]) > 0
            assert float(r["decode_speedup_vs_target_only"]) > 0
            assert 0 < float(r["prefill_s"]) < float(r["seconds"])
            if r["batch"] == "1":
                float(r["speedup_vs_assisted"])
            else:
                assert r["speedup_vs_assisted"] == "n/a (batch 1 only)"
        if r["method"] == "hook_hf":  # transformers' generate with the hook, at batch 8 too
            if r["batch"] == "1":
                float(r["speedup_vs_assisted"])
            else:
                assert r["speedup_vs_assisted"] == "n/a (batch 1 only)"
        if r["method"] == "assisted_hf":
            assert "assistant_confidence_threshold=" + ("0.3" if r["K"] == "auto@0.3" else "0") in r["hf_config"]

    text = (tmp_path / "bench_e2e.txt").read_text()
    assert "torch threads: 1" in text
    assert ("# linear layers: skinny for every method" if HAS_EXT else "# linear layers: torch") in text
    assert "greedy check (batch 1, temperature 0)" in text and "greedy check (batch 8, temperature 0)" in text


def test_greedy_mismatch_refuses_the_speedup(capsys):
    """A method whose greedy ids differ from the target's gets REFUSED speed-ups at its K (and
    so does every other method at that K), the differing prompt is printed, and the other K
    values keep theirs."""
    sys.path.insert(0, str(ROOT / "bench" / "decoding"))
    try:
        import bench_e2e
    finally:
        sys.path.remove(str(ROOT / "bench" / "decoding"))

    ids = [[1, 2, 3], [4, 5, 6]]

    class FakeBench:
        def hf(self, batch, temperature, assistant_cfg, hook=False):
            return bench_e2e.RunOut([list(x) for x in ids], 1.0)

        def specdec(self, batch, temperature, k, target_only=False):
            out = [list(x) for x in ids]
            if k == 4:
                out[1][2] = 9  # prompt 1 differs at its third token
            return bench_e2e.RunOut(out, 0.5)

    rows, notes = bench_e2e.run_config(FakeBench(), 1, 0.0, [2, 4], repeats=1)
    by = {(r["method"], r["K"]): r for r in rows}
    assert by[("specdec", "4")]["greedy_check"] == "FAIL: prompts 1 differ"
    assert by[("specdec", "4")]["speedup_vs_target"] == "REFUSED"
    assert by[("specdec", "4")]["speedup_vs_assisted"] == "REFUSED"
    assert by[("assisted_hf", "4")]["speedup_vs_target"] == "REFUSED"
    assert by[("specdec", "2")]["greedy_check"] == "pass"
    assert by[("specdec", "2")]["speedup_vs_target"] == 2.0
    assert by[("specdec", "2")]["speedup_vs_assisted"] == 2.0
    out = capsys.readouterr().out
    assert "GREEDY CHECK FAILED (batch 1, temperature 0): specdec K=4 prompt 1 differs" in out
    assert any("specdec K=4 prompt 1" in n for n in notes)


def _load_bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    saved = sys.modules.get(spec.name)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
        if saved is None:
            del sys.modules[spec.name]
        else:
            sys.modules[spec.name] = saved
    return mod


def test_k_entries_with_a_confidence():
    import argparse

    mod = _load_bench_module()
    assert mod._k_list("1,4@0.3,auto,auto@0.25") == [1, "4@0.3", "auto", "auto@0.25"]
    assert [mod.split_k(k) for k in (1, "4@0.3", "auto", "auto@0.25")] == [
        (1, 0.0), (4, 0.3), ("auto", 0.0), ("auto", 0.25)]
    assert mod.assistant_config("4@0.3") == dict(num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
                                                 assistant_confidence_threshold=0.3)
    assert mod.assistant_config("auto@0.3") == dict(assistant_confidence_threshold=0.3)
    assert mod.assistant_config("auto") == {}  # HF's defaults, with the assistant (None ran the target alone)
    for bad, msg in (("4@x", "must be a float, got 'x'"), ("4@1.5", r"must be in \(0, 1\), got 1.5"),
                     ("0@0.3", "must be a positive int or 'auto', got 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            mod._k_list(bad)


@pytest.mark.slow
def test_bench_e2e_quick_feature_draft(tmp_path):
    """--feature-ks times the feature drafter beside the others (here an untrained feature draft
    for the tiny pair's target: rarely accepted, still exact, so the greedy check passes)."""
    import torch

    from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair
    from specdec_kernels.decoding.drafters.feature_model import FeatureDraft, save_feature_draft, target_identity
    from transformers import LlamaConfig

    _, target, _ = build_tiny_random_pair(seed=0)
    tc = target.config
    cfg = LlamaConfig(vocab_size=1, hidden_size=tc.hidden_size, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                      max_position_embeddings=tc.max_position_embeddings)
    torch.manual_seed(0)
    save_feature_draft(FeatureDraft(cfg, target_identity(target)), tmp_path / "fd", dtype=torch.float32)
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--threads", "1", "--ks", "1",
           "--batch", "1", "--temperatures", "0", "--feature-ks", "1,auto", "--feature-draft", str(tmp_path / "fd")]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "bench_e2e.csv", newline="") as f:
        rows = {(row["method"], row["K"]): row for row in csv.DictReader(f)}
    for k in ("1", "auto"):
        row = rows[("specdec_feature", k)]
        assert row["greedy_check"] == "pass" and int(row["tokens"]) == 64, row
        assert float(row["speedup_vs_target"]) > 0 and row["decode_speedup_vs_target_only"], row
    assert "specdec_feature" in (tmp_path / "bench_e2e.txt").read_text()
    bad = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--feature-ks", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "needs --feature-draft DIR" in bad.stderr, bad.stderr[-2000:]


def test_random_pair_writes_a_feature_draft_for_its_target(tmp_path):
    """bench/decoding/random_pair.py's feature draft (what bench/gpu_check.sh times on the GPU): the
    shipped one's layer shape and draft vocabulary, random weights, accepted by the random target
    it was made for and refused by another."""
    import importlib.util
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_kernels.decoding.drafters.vocab import load_draft_vocab
    from specdec_kernels.decoding.drafters.feature_model import default_feature_draft_path, load_feature_draft

    spec = importlib.util.spec_from_file_location("random_pair", ROOT / "bench" / "decoding" / "random_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shape = dict(mod.SMOLLM2_135M, num_hidden_layers=1, intermediate_size=64)  # the target's width and vocabulary
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**shape, initializer_range=0.2)).eval()
    mod.write_feature_draft(str(tmp_path / "fd"), target)
    fd, vocab = load_feature_draft(tmp_path / "fd")
    fd.check_target(target)
    shipped = Path(default_feature_draft_path())
    layers = json.loads((shipped / "feature_draft.json").read_text())["layers"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(fd.config, key) == layers[key], key
    assert torch.equal(vocab, load_draft_vocab(shipped, 49152))
    torch.manual_seed(1)
    other = LlamaForCausalLM(LlamaConfig(**shape, initializer_range=0.2)).eval()
    with pytest.raises(ValueError, match="not the one it was trained for"):
        fd.check_target(other)


def test_demo_alpha_counts_as_generate_does(tmp_path):
    """bench/decoding/demo_alpha.py on the tiny pair: its reached-draft count reproduces stats.alpha
    prompt by prompt, and a set's alpha is its pooled accepted / reached."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("demo_alpha", ROOT / "bench" / "decoding" / "demo_alpha.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--tiny-random", "--drafters", "model", "--kinds", "plain", "--ks", "1,3",
                    "--max-new-tokens", "12", "--json", str(tmp_path / "a.json")])
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(json.dumps(out))
    assert {"device", "date", "torch", "commit"} <= set(out["conditions"])  # (none were recorded before)
    assert [(r["k"], r["kind"], r["drafter"]) for r in out["sets"]] == [(1, "plain", "model"), (3, "plain", "model")]
    for r in out["sets"]:
        assert 0 < r["accepted"] < r["reached"] and r["alpha"] == r["accepted"] / r["reached"], r
    from specdec_kernels import SpeculativeDecoder
    from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair

    draft, target, tok = build_tiny_random_pair(seed=0)
    dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok)
    checked = 0
    for p in ("The capital of France is", "Once upon a time"):
        s = dec.generate([tok(p)["input_ids"]], max_new_tokens=16, num_draft_tokens=3).stats
        if s.alpha:
            assert (mod._reached(s) == round(s.accepted_tokens / s.alpha)
                    and s.accepted_tokens / mod._reached(s) == s.alpha)
            checked += 1
    assert checked
    with pytest.raises(SystemExit):
        mod.main(["--tiny-random", "--drafters", "bogus"])
    assert mod._ks("2,auto,1") == [2, "auto", 1]  # auto: K chosen each step, as the main job
    for bad in ("0", "x", "2,,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="each K must be a positive int or auto"):
            mod._ks(bad)


def test_demo_speed_smoke(tmp_path):
    """bench/decoding/demo_speed.py on the tiny pair: every method's rounds, ratios against the target
    alone (1 for itself), refusals of bad arguments."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("demo_speed", ROOT / "bench" / "decoding" / "demo_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--tiny-random", "--drafter", "model", "--ks", "1,auto", "--max-new-tokens", "6", "--rounds", "2",
                    "--json", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(json.dumps(out))
    assert {"device", "date", "torch", "commit"} <= set(out["conditions"])
    assert list(out["tokens_per_s"]) == ["target", "K=1", "K=auto"] and out["prompts"] == 10
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in out["tokens_per_s"].values())
    assert out["speedup"]["target"] == 1.0 and all(r > 0 for r in out["speedup"].values())
    for bad in (["--rounds", "0"], ["--tiny-random"]):  # the tiny pair has no feature draft
        with pytest.raises(SystemExit):
            mod.main(bad)


@pytest.mark.parametrize("k", ["auto", 2])
def test_assisted_generation_uses_the_draft(k):
    """The assisted_hf rows run the draft as Hugging Face's assistant, at K = auto too (its "auto"
    ran target.generate alone before: every "HF auto" figure until 2026-12-01
    was the target's)."""
    import torch

    from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair

    mod = _load_bench_module()
    draft, target, tok = build_tiny_random_pair(seed=0)
    bench = mod.Bench(draft, target, tok, torch.device("cpu"), [[5, 6, 7], [8, 9]], 12, "ignore", 0)
    calls = []
    handle = draft.register_forward_hook(lambda *a: calls.append(1))
    try:
        out = bench.hf(1, 0.0, mod.assistant_config(k))
    finally:
        handle.remove()
    assert len(calls) > 0 and all(len(t) == 12 for t in out.token_ids)


@pytest.mark.slow
def test_a_run_stopped_at_its_time_limit_writes_the_configurations_done(tmp_path, monkeypatch):
    """bench/gpu_check.sh stops bench_e2e with SIGINT at its limit: the configurations measured
    by then are written (CSV, table, plot), with a note, and the exit status says it was cut."""
    mod = _load_bench_module()
    real, calls = mod.run_config, []

    def run_config(bench, batch, temperature, *args, **kwargs):
        calls.append((batch, temperature))
        if len(calls) == 2:
            raise KeyboardInterrupt  # what SIGINT raises in the main thread
        return real(bench, batch, temperature, *args, **kwargs)

    monkeypatch.setattr(mod, "run_config", run_config)
    rc = mod.main(["--quick", "--out", str(tmp_path), "--ks", "1", "--temperatures", "0"])
    assert rc == 130
    assert calls == [(1, 0.0), (8, 0.0)]
    with open(tmp_path / "bench_e2e.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["batch"] for r in rows} == {"1"}
    assert "interrupted at a time limit" in (tmp_path / "bench_e2e.txt").read_text()
    assert (tmp_path / "bench_e2e.png").stat().st_size > 0


def test_top_p_reaches_every_sampling_method(tmp_path, monkeypatch):
    """--top-p 0.5: Hugging Face's generate (the target alone and assisted) samples with
    top_p=0.5, and so do SpeculativeDecoder's generate and its target-only loop; the CSV says so."""
    import transformers

    from specdec_kernels import SpeculativeDecoder

    mod = _load_bench_module()
    seen = []
    for cls, name in ((SpeculativeDecoder, "generate"), (SpeculativeDecoder, "generate_target_only"),
                      (transformers.GenerationMixin, "generate")):
        real = getattr(cls, name)

        def wrapped(self, *args, _real=real, _who=f"{cls.__name__}.{name}", **kwargs):
            # the bench's own calls (assisted generation calls the assistant's generate inside)
            if _who != "GenerationMixin.generate" or "do_sample" in kwargs:
                seen.append((_who, kwargs.get("top_p"), "assistant_model" in kwargs))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)
    rc = mod.main(["--quick", "--out", str(tmp_path), "--ks", "1", "--temperatures", "1", "--batch", "1",
                   "--top-p", "0.5", "--num-prompts", "2"])
    assert rc == 0
    assert {s[1] for s in seen} == {0.5}, seen
    assert {(s[0], s[2]) for s in seen} == {("SpeculativeDecoder.generate", False),
                                            ("SpeculativeDecoder.generate_target_only", False),
                                            ("GenerationMixin.generate", False), ("GenerationMixin.generate", True)}
    with open(tmp_path / "bench_e2e.csv", newline="") as f:
        assert {r["top_p"] for r in csv.DictReader(f)} == {"0.5"}


@pytest.mark.parametrize("top_p", ["0", "1.5", "nan"])
def test_top_p_out_of_range_is_refused_by_name(top_p):
    mod = _load_bench_module()
    with pytest.raises(SystemExit, match=r"^--top-p must be in \(0, 1\], got "):
        mod.main(["--quick", "--top-p", top_p])


def test_harness_records_the_commit_and_the_cpu_model(monkeypatch):
    """Every result row carries the commit (with -dirty for uncommitted tracked changes; the
    SPECDEC_COMMIT variable first, for a copy of the tree without .git) and the CPU's model name
    (platform.processor() is '' on Linux: two machines' rows read alike)."""
    import shutil
    import subprocess

    import torch

    spec = importlib.util.spec_from_file_location("harness_under_test", ROOT / "bench" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)

    monkeypatch.delenv("SPECDEC_COMMIT", raising=False)
    head = None
    if shutil.which("git"):
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True)
        head = out.stdout.strip() if out.returncode == 0 else None
    if head:  # a git checkout git accepts: its commit
        assert harness.commit() in (head, head + "-dirty")
    monkeypatch.setenv("SPECDEC_COMMIT", "abc123")  # set: it wins
    assert harness.commit() == "abc123" and harness.versions()["commit"] == "abc123"
    monkeypatch.delenv("SPECDEC_COMMIT")
    monkeypatch.setattr(harness.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    assert harness.commit() == "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            assert harness.device_name(torch.device("cpu")).startswith(f"CPU {names[0]}")


def test_time_interleaved_calls_providers_in_rounds():
    """CPU timing: one call of each provider per round (a drift of the machine lands on all of
    them alike); a provider that raises is reported, the others timed."""
    spec = importlib.util.spec_from_file_location("harness_under_test2", ROOT / "bench" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
           "bad": lambda: (_ for _ in ()).throw(RuntimeError("out of memory"))}
    times, failed = harness.time_interleaved(fns, min_time_s=0.0)
    assert set(times) == {"a", "b"} and list(failed) == ["bad"] and "out of memory" in str(failed["bad"])
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then three rounds, the first rotating
    assert all(0 <= t[1] <= t[0] <= t[2] for t in times.values())
    import torch

    with pytest.raises(ZeroDivisionError):  # time_fn raises the function's own error
        harness.time_fn(lambda: 1 / 0, torch.device("cpu"), min_time_s=0.0)


@pytest.mark.slow
def test_bench_e2e_quick_tree_shapes(tmp_path):
    """--tree-shapes times SpeculativeDecoder(tree=...) as method specdec_tree (K = the shape),
    greedy-checked against the target alone like every method."""
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--threads", "1", "--ks", "1",
           "--batch", "1", "--tree-shapes", "2,2;dynamic:4,2,2", "--methods", "specdec,specdec_tree"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "GREEDY CHECK FAILED" not in r.stdout, r.stdout
    with open(tmp_path / "bench_e2e.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["method"] == "specdec_tree"]
    assert sorted((row["K"], row["temperature"]) for row in rows) == sorted(
        [(k, t) for k in ("2,2", "dynamic:4,2,2") for t in ("0.0", "1.0")])
    for row in rows:
        assert float(row["tokens_per_target_call"]) >= 1.0
        if row["temperature"] == "0.0":
            assert row["greedy_check"] == "pass", row
