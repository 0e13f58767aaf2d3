"""SpeculativeDecoder with a draft vocabulary (the draft proposes only some tokens; the output
is still the target's) and with drafts stopped on the draft's confidence.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec_kernels.cli import main as cli_main
from specdec_kernels.decoding.decoder import SpeculativeDecoder

from decoder_setup import PROMPTS, _synthetic_times
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)


# ----------------------------------------------------------------------------------------------
# 7. Draft vocabulary: the draft proposes only some tokens; the output is still the target's
# ----------------------------------------------------------------------------------------------
VOCAB = [0, 1, 2, 3, 5, 8, 13, 21, 30]  # 9 of the pair's 32 tokens


class _DraftRecorder:
    """Records (X, Q) of every draft call (``ModelDrafter.draft``) of a decoder, and in ``calls`` its K
    and the K_b it returned."""

    def __init__(self, dec):
        self.dec, self.out, self.calls = dec, [], []
        orig = dec.parts.drafter.draft

        def wrapped(st, K):
            d = orig(st, K)
            self.out.append((d.tokens.clone(), None if d.probs is None else d.probs.clone()))
            self.calls.append((K, None if d.num is None else d.num.clone()))
            return d

        dec.parts.drafter.draft = wrapped


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_draft_vocab_greedy_matches_generate(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k)
    assert res.token_ids == greedy_refs
    assert res.stats.accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_vocab_restricts_drafts_and_q(pair, temperature):
    draft, target = pair
    inside = torch.zeros(32, dtype=torch.bool)
    inside[VOCAB] = True
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, seed=5)
    full = _DraftRecorder(SpeculativeDecoder(draft=draft, target=target))
    full.dec.generate(PROMPTS, **kw)
    assert not all(inside[X].all() for X, _ in full.out)  # unrestricted, the draft proposes other tokens
    rec = _DraftRecorder(SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB))
    rec.dec.generate(PROMPTS, **kw)
    for X, Q in rec.out:
        assert inside[X].all()
        if temperature == 0:
            assert Q is None
            continue
        assert Q.shape == X.shape + (32,)
        assert (Q[..., ~inside] == 0).all()  # exactly zero where the draft cannot propose
        torch.testing.assert_close(Q.sum(-1), torch.ones(X.shape), atol=1e-5, rtol=0)
        assert (Q.gather(-1, X[..., None]) > 0).all()  # a sampled token had probability


def test_draft_vocab_greedy_drafts_are_the_restricted_argmax(pair):
    """At temperature 0 the draft proposes the argmax of its logits over the vocabulary: the
    first draft of a step (fed the prompt, nothing else) checked against the draft's own forward."""
    draft, target = pair
    rec = _DraftRecorder(SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB))
    rec.dec.generate(PROMPTS, max_new_tokens=2, num_draft_tokens=1)
    X = rec.out[0][0]  # the first step's drafts
    with torch.inference_mode():
        for b, p in enumerate(PROMPTS):
            logits = draft(torch.tensor([p])).logits[0, -1]
            assert X[b, 0].item() == VOCAB[int(logits[VOCAB].argmax())]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_vocab_paths_and_batch_invariance(pair, temperature):
    draft, target = pair
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, top_k=20 if temperature else None)
    lean = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB)
    model = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB, lean_forward=False)
    batch = lean.generate(PROMPTS, seed=50, **kw)
    # the subset output layer ran
    assert lean.lean_status()["draft"] is None and lean.parts.draft_runner.head is not None
    assert model.parts.draft_runner.head is None
    assert model.generate(PROMPTS, seed=50, **kw).token_ids == batch.token_ids
    for i, p in enumerate(PROMPTS):
        assert lean.generate([p], seed=50 + i, **kw).token_ids[0] == batch.token_ids[i], i


@pytest.mark.parametrize("cpu_linear", ["skinny", "torch"])
def test_draft_vocab_logits_are_the_output_layer_rows(pair, cpu_linear):
    """The lean step with the vocabulary's rows of the output layer gives the full logits'
    columns, bit for bit (skinny_linear sums each output in a fixed order; torch's linear
    within a tolerance)."""
    from specdec_kernels.ops.extension import HAS_EXT
    from specdec_kernels.ops.kv.cache import new_cache

    if cpu_linear == "skinny" and not HAS_EXT:
        pytest.skip("cpu_linear='skinny' needs the C++ extension (not built)")
    draft, target = pair
    sub = SpeculativeDecoder(draft=draft, target=target, draft_vocab=VOCAB, cpu_linear=cpu_linear)
    full = SpeculativeDecoder(draft=draft, target=target, cpu_linear=cpu_linear)
    ids = torch.tensor([[4, 9, 17, 2, 6]])
    outs = []
    with torch.inference_mode():
        for dec in (sub, full):
            cache = new_cache(draft)
            dec.parts.draft_runner.forward(cache, ids[:, :4], None, torch.arange(4)[None], 0, 1)
            with dec.parts.linear_layers():
                outs.append(dec.parts.draft_runner.step(cache, ids[:, 4:], None, torch.tensor([[4]]), 4, 1))
    assert outs[0].shape == (1, 1, len(VOCAB))
    if cpu_linear == "skinny":
        assert torch.equal(outs[0], outs[1][..., VOCAB])
    else:
        torch.testing.assert_close(outs[0], outs[1][..., VOCAB], atol=1e-6, rtol=1e-6)


def test_draft_vocab_follows_the_weights(pair):
    """The output layer's rows are taken again at each generate: a change to the draft's weights
    between calls is used."""
    draft, target = pair
    d = copy.deepcopy(draft)
    dec = SpeculativeDecoder(draft=d, target=target, draft_vocab=VOCAB)
    dec.generate([[1, 2]], max_new_tokens=2)
    with torch.no_grad():
        d.lm_head.weight.mul_(2.0)
    dec.generate([[1, 2]], max_new_tokens=2)
    assert torch.equal(dec.parts.draft_runner.head.weight, d.lm_head.weight[VOCAB])


def test_draft_vocab_choices_and_errors(pair, tmp_path):
    from specdec_kernels.decoding.drafters import vocab as dv

    draft, target = pair
    mk = functools.partial(SpeculativeDecoder, draft=draft, target=target)
    assert mk(draft_vocab=None).draft_vocab is None
    assert mk(draft_vocab=list(range(32))).draft_vocab is None  # the whole vocabulary: nothing to restrict
    assert mk(draft_vocab=[30, 2, 5]).draft_vocab.tolist() == [2, 5, 30]  # sorted
    assert mk(draft_vocab=torch.tensor([7, 1], dtype=torch.int32)).draft_vocab.tolist() == [1, 7]
    # (before: NumPy ids and ranges were refused as "got list"; a file saved for another
    # vocabulary was taken whenever its ids fitted; a meta tensor gave torch's error)
    import numpy as np

    assert mk(draft_vocab=[np.int64(3), np.int32(1)]).draft_vocab.tolist() == [1, 3]
    assert mk(draft_vocab=range(2, 5)).draft_vocab.tolist() == [2, 3, 4]
    with pytest.raises(TypeError, match=r"draft_vocab must be a 1-D integer tensor or a list of ints, got a list "
                                        r"holding a float \(2.0\)"):
        mk(draft_vocab=[1, 2.0])
    with pytest.raises(ValueError, match="draft_vocab must hold token ids, got a tensor on the meta device"):
        mk(draft_vocab=torch.tensor([1, 2], device="meta"))
    (tmp_path / "other").mkdir()
    dv.save_draft_vocab(tmp_path / "other", [1, 2, 3], 50000)
    with pytest.raises(ValueError, match=r"must be a draft vocabulary for vocab_size 32 \(the draft's\), got one "
                                         r"saved for vocab_size 50000"):
        mk(draft_vocab=str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"counts must be a 1-D integer tensor \[V\], "
                                         r"got shape \(2,\), dtype torch.bool"):
        dv.frequent_tokens(torch.tensor([True, False]), 1)
    # "auto": the file in the directory the draft was loaded from, if any
    d = copy.deepcopy(draft)
    d.save_pretrained(tmp_path / "draft")
    assert mk(draft=LlamaForCausalLM.from_pretrained(tmp_path / "draft")).draft_vocab is None
    dv.save_draft_vocab(tmp_path / "draft", torch.tensor(VOCAB), 32, source="a test")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "draft")
    assert mk(draft=loaded).draft_vocab.tolist() == VOCAB
    assert mk(draft=loaded, draft_vocab=None).draft_vocab is None
    assert mk(draft_vocab=str(tmp_path / "draft")).draft_vocab.tolist() == VOCAB  # a directory
    assert mk(draft_vocab=tmp_path / "draft" / dv.FILE_NAME).draft_vocab.tolist() == VOCAB  # the file
    assert SpeculativeDecoder(target=target).draft_vocab is None  # prompt lookup: "auto" is nothing
    with pytest.raises(ValueError, match="draft_vocab restricts a draft model's proposals; "
                                         "drafter='prompt_lookup' has no draft model, got draft_vocab=\\[1, 2\\]"):
        SpeculativeDecoder(target=target, draft_vocab=[1, 2])
    with pytest.raises(ValueError, match=r"draft_vocab ids must be in \[0, 32\) \(the draft's vocab_size\), "
                                         r"got min 0, max 32"):
        mk(draft_vocab=[0, 32])
    with pytest.raises(ValueError, match=r"draft_vocab ids must be in \[0, 32\) \(the draft's vocab_size\), "
                                         r"got min -1, max 5"):
        mk(draft_vocab=[-1, 5])
    with pytest.raises(ValueError, match="draft_vocab ids must be unique, got 3 more than once"):
        mk(draft_vocab=[3, 1, 3])
    with pytest.raises(ValueError, match=r"draft_vocab must be a non-empty 1-D tensor of token ids, got shape \(0,\)"):
        mk(draft_vocab=[])
    with pytest.raises(ValueError, match=r"got shape \(2, 1\)"):
        mk(draft_vocab=torch.tensor([[1], [2]]))
    with pytest.raises(TypeError, match="draft_vocab must hold integer token ids, got dtype torch.float32"):
        mk(draft_vocab=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="draft_vocab must be a 1-D integer tensor or a list of ints, got dict"):
        mk(draft_vocab={1: 2})
    with pytest.raises(FileNotFoundError, match="no draft vocabulary at"):
        mk(draft_vocab=str(tmp_path / "nowhere"))
    from safetensors.torch import save_file

    save_file({"ids": torch.tensor([1])}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match=r"must hold a tensor 'token_ids', got \['ids'\]"):
        mk(draft_vocab=str(tmp_path / "wrong.safetensors"))


def test_frequent_tokens_and_the_file():
    from specdec_kernels.decoding.drafters import vocab as dv

    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert dv.frequent_tokens(counts, 1).tolist() == [2]  # 9 at ids 2 and 5: the lower id first
    assert dv.frequent_tokens(counts, 3).tolist() == [0, 2, 5]  # then 5 at ids 0 and 3: id 0
    assert dv.frequent_tokens(counts, 6).tolist() == list(range(6))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"vocab_size must be an int >= 1, got {bad!r}"):
            dv.check_draft_vocab([1], bad)
        with pytest.raises(ValueError, match=f"vocab_size must be an int >= 1, got {bad!r}"):
            dv.save_draft_vocab(".", [1], bad)
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 6\], got 7"):
        dv.frequent_tokens(counts, 7)
    with pytest.raises(ValueError, match="counts must be a 1-D integer tensor"):
        dv.frequent_tokens(counts.float(), 2)


def test_draft_vocab_file_forms(tmp_path):
    """The file is JSON (``draft_vocab.json``), so a model directory holding one loads in engines
    that read every ``*.safetensors`` there as weights; the earlier ``draft_vocab.safetensors``
    is still read (file or directory), and saving over it replaces it."""
    from safetensors.torch import save_file

    from specdec_kernels.decoding.drafters import vocab as dv

    assert dv.FILE_NAME == "draft_vocab.json" and dv.LEGACY_FILE_NAME == "draft_vocab.safetensors"
    path = dv.save_draft_vocab(tmp_path, [7, 3, 5], 11, source="a test")
    assert path == tmp_path / "draft_vocab.json" and not list(tmp_path.glob("*.safetensors"))
    doc = json.loads(path.read_text())
    assert doc["token_ids"] == [3, 5, 7] and doc["vocab_size"] == 11 and doc["metadata"] == {"source": "a test"}
    assert dv.load_draft_vocab(tmp_path, 11).tolist() == [3, 5, 7]
    assert dv.load_draft_vocab(path, None).tolist() == [3, 5, 7]
    with pytest.raises(ValueError, match=r"must be a draft vocabulary for vocab_size 12 \(the draft's\), got one "
                                         r"saved for vocab_size 11"):
        dv.load_draft_vocab(tmp_path, 12)
    # the earlier form, as directories written before hold it
    old = tmp_path / "old"
    old.mkdir()
    save_file({"token_ids": torch.tensor([4, 1])}, str(old / dv.LEGACY_FILE_NAME), metadata={"vocab_size": "9"})
    assert dv.directory_vocab_file(old) == old / dv.LEGACY_FILE_NAME
    assert dv.load_draft_vocab(old, 9).tolist() == [1, 4]
    assert dv.load_draft_vocab(old / dv.LEGACY_FILE_NAME, 9).tolist() == [1, 4]
    with pytest.raises(ValueError, match="saved for vocab_size 9"):
        dv.load_draft_vocab(old, 10)
    dv.save_draft_vocab(old, [2], 9)
    assert sorted(p.name for p in old.iterdir()) == ["draft_vocab.json"]
    assert dv.load_draft_vocab(old, 9).tolist() == [2]
    # bad JSON files are named
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json must be a JSON draft vocabulary \(an object with 'token_ids'\), "
                                         r"got a file it cannot read \(JSONDecodeError"):
        dv.load_draft_vocab(bad, None)
    bad.write_text(json.dumps({"ids": [1]}))
    with pytest.raises(ValueError, match=r"bad.json must hold an object with 'token_ids', got \['ids'\]"):
        dv.load_draft_vocab(bad, None)
    bad.write_text(json.dumps({"token_ids": [1, "2"]}))
    with pytest.raises(TypeError, match=r"token_ids of .*bad.json must be a 1-D integer tensor or a list of ints, "
                                        r"got a list holding a str"):
        dv.load_draft_vocab(bad, None)
    assert dv.directory_vocab_file(tmp_path / "nowhere") is None


def test_cli_draft_vocab(capsys, tmp_path):
    from specdec_kernels.decoding.drafters import vocab as dv

    base = ["generate", "hello", "--tiny-random", "--json", "--max-new-tokens", "6", "-k", "2"]
    assert cli_main(base) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] is None  # no file beside a built model
    dv.save_draft_vocab(tmp_path, torch.arange(0, 40, 2), 51)
    assert cli_main(base + ["--draft-vocab", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] == 20
    assert cli_main(base + ["--draft-vocab", "full"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] is None
    with pytest.raises(SystemExit) as e:
        cli_main(base + ["--draft-vocab", str(tmp_path / "missing")])
    assert e.value.code == 2 and "no draft vocabulary at" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 8. Stopping drafts on the draft's confidence
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("conf,k", [(0.5, 4), (0.9, 8), (0.3, "auto")])
def test_draft_confidence_greedy_matches_generate(pair, greedy_refs, conf, k, monkeypatch):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    if k == "auto":  # times for which drafting pays (these tiny models' own favour K = 0)
        _synthetic_times(monkeypatch, 0.05, [])
    rec = _DraftRecorder(dec)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, draft_confidence=conf)
    assert res.token_ids == greedy_refs
    # the rule acted: some row stopped before K, and some step drafted fewer than K for every row
    assert any((kb < K).any() for K, kb in rec.calls)
    assert any(X.shape[1] < K for (X, _), (K, _) in zip(rec.out, rec.calls))


def test_draft_confidence_rule(pair):
    """K_b is the first draft at which the product of the drafts' probabilities (under the
    distribution each was sampled from) falls below the threshold, else K; the drafting stops
    once every row has stopped."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    rec = _DraftRecorder(dec)
    res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=5, temperature=1.0, seed=3, draft_confidence=0.2)
    assert rec.calls and any((kb < K).any() for K, kb in rec.calls)
    for h, (K, kb) in zip(res.stats.history, rec.calls):  # the verifier saw each row's K_b (or less: budget)
        assert all(n <= kb[i].item() for i, n in enumerate(h["num_draft"]))
    for (X, Q), (K, kb) in zip(rec.out, rec.calls):
        cum = Q.gather(-1, X[..., None])[..., 0].cumprod(-1)  # [B, K']
        below = cum < 0.2
        want = torch.where(below.any(-1), below.int().argmax(-1) + 1, torch.full_like(kb, K)).clamp(max=X.shape[1])
        assert torch.equal(kb, want)
        if X.shape[1] < K:
            assert (kb <= X.shape[1]).all() and below[:, -1].any()
        assert X.shape[1] == int(kb.max())  # no draft forward after the last row stopped


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_confidence_batch_invariance(pair, temperature):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    kw = dict(max_new_tokens=16, num_draft_tokens=4, temperature=temperature, draft_confidence=0.4)
    batch = dec.generate(PROMPTS, seed=70, **kw)
    for i, p in enumerate(PROMPTS):
        assert dec.generate([p], seed=70 + i, **kw).token_ids[0] == batch.token_ids[i], i


def test_draft_confidence_errors(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    with pytest.raises(ValueError, match=r"draft_confidence must be in \[0, 1\) \(0 = off\), got 1.0"):
        dec.generate([[1]], draft_confidence=1.0)
    with pytest.raises(ValueError, match=r"draft_confidence must be in \[0, 1\) \(0 = off\), got -0.1"):
        dec.generate([[1]], draft_confidence=-0.1)
    with pytest.raises(TypeError, match="draft_confidence must be a float, got str"):
        dec.generate([[1]], draft_confidence="0.5")
    with pytest.raises(ValueError, match="draft_confidence needs a draft model's probabilities; "
                                         "drafter='prompt_lookup' has none, got draft_confidence=0.5"):
        SpeculativeDecoder(target=target).generate([[1]], draft_confidence=0.5)


def test_greedy_draft_confidence_is_the_running_product(pair, monkeypatch):
    """Greedy: K_b is the first draft j (1-based) at which the product of the draft's softmax
    probabilities of its argmaxes falls below the threshold, else K; the draft stops as soon as
    every row has stopped (a mutant using the current probability alone survived before)."""
    from specdec_kernels.decoding.drafters import base as draft_base

    seen = []
    orig_add = draft_base.DraftPicker.add

    def add(self, logits, j):
        if j == 0:
            seen.append([])
        seen[-1].append(torch.softmax(logits.float(), -1).amax(-1))
        return orig_add(self, logits, j)

    monkeypatch.setattr(draft_base.DraftPicker, "add", add)
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    rec = _DraftRecorder(dec)
    # this model's argmax probabilities are 0.14-0.42: a threshold of 0.15 stops rows at 1-2 drafts
    dec.generate([[1, 2, 3], [5, 6, 7, 8, 9]], max_new_tokens=12, num_draft_tokens=6, temperature=0.0,
                 draft_confidence=0.15)
    assert rec.calls and any(X.shape[1] < K for (X, _), (K, _) in zip(rec.out, rec.calls))
    for (X, _), (K, kb), probs in zip(rec.out, rec.calls, seen):
        cum = torch.stack(probs, 1).cumprod(1)  # [B, K']
        below = cum < 0.15
        want = torch.where(below.any(1), below.int().argmax(1) + 1, torch.full_like(kb, K))
        assert torch.equal(kb, want.clamp(max=X.shape[1]))
        assert X.shape[1] == int(kb.max())
