"""The CLI (``specdec generate``, ``python -m specdec_kernels``): the tiny random pair end to end
with --json, user errors as one line (no traceback) with exit status 2, --baseline when the
target emits nothing, --chat, and the module entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec_kernels.cli import build_tiny_random_pair, main as cli_main, tiny_char_tokenizer

from decoder_setup import _one_thread  # noqa: F401  (autouse fixture)


def test_cli_tiny_random_json(capsys):
    assert cli_main(["generate", "hello world", "the cat", "--tiny-random", "--json", "-k", "auto",
                     "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "10", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["texts"]) == 2 and all(len(t) <= 12 for t in out["token_ids"])
    assert out["stats"]["iterations"] > 0 and "alpha" in out["stats"]


def test_cli_requires_models(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--draft", "some/path"])
    assert e.value.code == 2
    assert "--draft needs --target (without both, the embedded default pair is used)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["generate", "hello", "--tiny-random", "-k", "0"])
    assert "must be a positive int or 'auto', got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    # (before: tracebacks with exit status 1, or an option silently ignored)
    (["--target", "/nonexistent/model", "--draft", "/nonexistent/draft"], "/nonexistent"),
    (["--tiny-random", "--tokenizer", "/nonexistent"],
     "--tokenizer applies to --target/--draft models; the embedded pair and --tiny-random bring their own"),
    (["--tiny-random", "--dtype", "complex64"], "dtype must be float32, float16 or bfloat16 "
                                               "(a torch.dtype or its name), got 'complex64'"),
    (["--tiny-random", "--device", "meta"], "device 'meta' holds no data: models cannot run there"),
    (["--tiny-random", "--draft-vocab", "BAD"], "header"),  # a file that is not safetensors
    # (before: hub-id and tokenizer messages for paths, API names for flags, and
    # these checks only after the models had loaded)
    (["--target", "/nonexistent/model", "--draft", "/nonexistent/d"],
     "specdec generate: error: --target: no such file or directory: /nonexistent/model"),
    (["--target", "EMPTY", "--draft", "EMPTY"], "holds no config.json (not a Hugging Face model directory)"),
    (["--tiny-random", "--draft-vocab", "BAD"], "specdec generate: error: --draft-vocab: "),
    (["--tiny-random", "--max-draft-tokens", "0"], "specdec generate: error: --max-draft-tokens must be > 0, got 0"),
    (["--tiny-random", "--top-p", "2"], "specdec generate: error: --top-p must be in (0, 1] (1 = off), got 2.0"),
    (["--tiny-random", "--draft-confidence", "1.5"], "error: --draft-confidence must be in [0, 1)"),
    (["--tiny-random", "--seed", str(2**70)], "error: --seed must fit in int64 [-2**63, 2**63), got"),
    (["--tiny-random", "--stop", ""], "error: --stop must not be empty"),
    (["--tiny-random", "--weight-cache", "d", "--no-weight-cache"],
     "error: --weight-cache and --no-weight-cache exclude each other"),
    (["--target", "some/model", "--draft-confidence", "0.5"],
     "error: --draft is required with --target (or --drafter prompt_lookup to draft without a model)"),
    (["--tiny-random", "--drafter", "prompt_lookup", "--draft-vocab", "BAD"],
     "error: --draft-vocab restricts a draft model's proposals; --drafter prompt_lookup has none"),
])
def test_cli_user_errors_are_one_line(argv, says, capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    (tmp_path / "empty").mkdir()
    import specdec_kernels.cli as cli

    def no_models(*a, **k):  # every case above is refused before any model is built
        raise AssertionError("a model was built")

    monkeypatch.setattr(cli, "build_tiny_random_pair", no_models)
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", *[str(bad) if a == "BAD" else str(tmp_path / "empty") if a == "EMPTY" else a
                                         for a in argv]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2  # usage, then the one error line


def test_cli_baseline_when_the_target_emits_nothing(capsys, tmp_path):
    """--baseline where the target alone emits no token (a NaN in its output layer: every row ends
    "nonfinite"): the measured speed-up is n/a (the run stopped with an error about
    baseline_tokens_per_s before)."""
    draft, target, tok = build_tiny_random_pair(seed=0)
    with torch.no_grad():
        target.lm_head.weight[5] = float("nan")
    target.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    tok.save_pretrained(tmp_path / "d")
    assert cli_main(["generate", "hi", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"),
                     "--max-new-tokens", "4", "--baseline", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reasons"] == ["nonfinite"] and out["stats"]["measured_speedup"] is None


def test_cli_baseline_repeats(capsys):
    # --repeats N: N runs of each side, alternating; the reported run is the median speculative
    # one, its speed-up against the median baseline run; its trace printed once.
    import statistics

    assert cli_main(["generate", "hello world", "--tiny-random", "--json", "--baseline", "--repeats", "3",
                     "--max-new-tokens", "8", "--verbose", "-k", "2"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    runs, base = out["runs_tokens_per_s"], out["baseline_runs_tokens_per_s"]
    assert len(runs) == 3 and len(base) == 3
    s = out["stats"]
    assert s["tokens_per_s"] == statistics.median_low(runs)
    assert s["baseline_tokens_per_s"] == statistics.median_low(base)
    assert s["measured_speedup"] == s["tokens_per_s"] / s["baseline_tokens_per_s"]
    assert cap.err.count("[step 1 | row 0] Drafted:") == 1
    # an even N: the lower middle run on both sides (before: a mean of two beside one run)
    assert cli_main(["generate", "hello world", "--tiny-random", "--json", "--baseline", "--repeats", "4",
                     "--max-new-tokens", "8", "-k", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["stats"]
    assert s["tokens_per_s"] == statistics.median_low(out["runs_tokens_per_s"])
    assert s["baseline_tokens_per_s"] == statistics.median_low(out["baseline_runs_tokens_per_s"])
    for argv, says in ((["--repeats", "2"], "--repeats repeats the --baseline comparison; without --baseline, got "
                                           "--repeats 2"),
                       (["--baseline", "--repeats", "0"], "--repeats must be >= 1, got 0")):
        with pytest.raises(SystemExit) as e:
            cli_main(["generate", "hi", "--tiny-random", *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_cli_baseline_warms_up_and_alternates_sides(capsys, monkeypatch):
    # (before: the target alone always ran first, cold, up to 1.3x slower: the speed-up read high)
    from specdec_kernels import SpeculativeDecoder

    calls = []
    for name in ("generate", "generate_target_only"):
        real = getattr(SpeculativeDecoder, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            calls.append(("spec" if _name == "generate" else "base", kw["max_new_tokens"]))
            return _real(self, *a, **kw)
        monkeypatch.setattr(SpeculativeDecoder, name, spy)
    assert cli_main(["generate", "hello world", "--tiny-random", "--json", "--baseline", "--repeats", "3",
                     "--max-new-tokens", "12", "-k", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert calls == [("base", 8), ("spec", 8), ("base", 12), ("spec", 12), ("spec", 12), ("base", 12),
                     ("base", 12), ("spec", 12)]
    assert out["baseline_same_token_ids"] is True  # greedy, fp32: the target alone's ids
    assert cli_main(["generate", "hello world", "--tiny-random", "--json", "--baseline", "--max-new-tokens", "6",
                     "--temperature", "1"]) == 0
    assert "baseline_same_token_ids" not in json.loads(capsys.readouterr().out)  # sampled: not comparable
    assert cli_main(["generate", "hello world", "--tiny-random", "--baseline", "--max-new-tokens", "6"]) == 0
    assert "greedy: the same token ids as the target alone" in capsys.readouterr().out


def test_cli_chat(capsys):
    from specdec_kernels.cli import chat_ids

    tok = tiny_char_tokenizer()
    with pytest.raises(ValueError, match=r"^--chat needs a tokenizer with a chat template, got \w+ without one$"):
        chat_ids(tok, "hi")
    with pytest.raises(ValueError, match="--chat needs a tokenizer with a chat template, got no tokenizer"):
        chat_ids(None, "hi")
    tok.chat_template = ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    assert chat_ids(tok, "ab") == tok("[ab]>", add_special_tokens=False)["input_ids"]
    with pytest.raises(SystemExit) as e:  # the tiny random pair's tokenizer has no template
        cli_main(["generate", "hello", "--tiny-random", "--chat"])
    assert e.value.code == 2 and "--chat needs a tokenizer with a chat template" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "specdec_kernels", "generate", "abc", "--tiny-random", "--json",
                        "--max-new-tokens", "5", "--verbose"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["generated_tokens"] <= 5
    assert "Drafted:" in r.stderr  # --verbose goes to stderr when --json owns stdout
