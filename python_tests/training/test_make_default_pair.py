"""The draft build (training/make_default_pair.py, its stages in training/default_pair/) on a tiny
random Llama: its second stage's grow_draft, its record of stages, the draft vocabulary, saving,
and the entry point's argument checks.

Growing a trained draft must not change what it computes: the new layers start as the identity
(zeroed output projections), sit between the old ones, and keep the cache's layer numbering; the
KV-cached decode of the grown model must agree with its full forward.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build():
    """The entry point; loading it puts training/ on sys.path, where its stages are (default_pair)."""
    spec = importlib.util.spec_from_file_location("make_default_pair", ROOT / "training" / "make_default_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def stages(build):
    from default_pair import draft, evaluate, save

    return SimpleNamespace(draft=draft, evaluate=evaluate, save=save)


def _tiny(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a trained draft's projections are not zero: make every weight matter
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("old,new,grown_at", [(4, 4, []), (4, 6, [2, 5]), (4, 8, [1, 3, 5, 7]), (3, 4, [3]),
                                              (2, 7, [1, 2, 4, 5, 6])])
def test_grow_draft_keeps_the_function(stages, old, new, grown_at):
    draft = _tiny(old)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = draft(ids).logits
        grown = stages.draft.grow_draft(draft, new, seed=3)
        got = grown(ids).logits
    assert grown.config.num_hidden_layers == new and len(grown.model.layers) == new
    assert [m.self_attn.layer_idx for m in grown.model.layers] == list(range(new))
    zero = [i for i, m in enumerate(grown.model.layers)
            if not m.self_attn.o_proj.weight.any() and not m.mlp.down_proj.weight.any()]
    assert zero == grown_at
    # the old layers, in order, at the other positions, bit for bit
    kept = [i for i in range(new) if i not in grown_at]
    for i, j in enumerate(kept):
        for a, b in zip(draft.model.layers[i].parameters(), grown.model.layers[j].parameters()):
            assert torch.equal(a, b)
    # new layers are random apart from the zeroed projections (they can learn)
    for j in grown_at:
        assert grown.model.layers[j].self_attn.q_proj.weight.std() > 0
    assert grown.lm_head.weight.data_ptr() == grown.model.embed_tokens.weight.data_ptr()  # still tied
    assert torch.equal(got, want)  # identity layers add exact zeros to the residual stream

    with torch.no_grad():  # the KV cache of the grown model: prefill 8, then one token at a time
        out = grown(ids[:, :8], use_cache=True)
        cache = out.past_key_values
        for t in range(8, 12):
            step = grown(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            torch.testing.assert_close(step.logits[:, -1], want[:, t], rtol=1e-4, atol=1e-4)


def test_grow_draft_refuses_fewer_layers(stages):
    with pytest.raises(ValueError, match="layers must be >= the draft's 4, got 3"):
        stages.draft.grow_draft(_tiny(4), 3, seed=0)


def test_stage_history_chains_stages(stages):
    # a draft written before `stages` existed: its second stage as flat more_* keys
    legacy = dict(seed=0, layers=4, epochs=2.0, lr=3e-3, word_prompts=6144, sampled_prompts=2315, sampled_passes=6,
                  train_prompts=8459, train_tokens=1335527, wall_s=2370, more_epochs=2.0, more_lr=1e-3,
                  more_threads=2, grow_layers=4, more_wall_s=2304, resumed_wall_s=2322)
    hist = stages.save.stage_history(legacy)
    assert {k: hist[k] for k in ("seed", "epochs", "lr", "word_prompts", "train_tokens", "wall_s")} == dict(
        seed=0, epochs=2.0, lr=3e-3, word_prompts=6144, train_tokens=1335527, wall_s=2370)
    assert not any(k.startswith(("more_", "grow_")) or k == "resumed_wall_s" for k in hist)
    assert hist["stages"] == [dict(epochs=2.0, lr=1e-3, threads=2, layers=4, seed=1, word_prompts=6144,
                                   sampled_prompts=2315, sampled_passes=6, train_prompts=8459,
                                   train_tokens=1335527, wall_s=2304)]
    # a newer record: stages are kept as they are (and copied, not shared)
    third = dict(epochs=1.5, lr=1e-3, threads=2, layers=4, seed=2, word_prompts=19267, sampled_prompts=2315,
                 sampled_passes=6, train_prompts=21582, train_tokens=2146640, wall_s=2800)
    newer = {**hist, "stages": hist["stages"] + [third]}
    again = stages.save.stage_history(newer)
    assert again == newer and again["stages"][1] is not third
    # a first stage alone has no later stages
    assert stages.save.stage_history(dict(seed=0, epochs=2.0))["stages"] == []


def test_update_info_needs_eval_only(build, capsys):
    with pytest.raises(SystemExit):
        build.main(["--update-info"])
    assert "--update-info writes --eval-only's measurements: it needs --eval-only" in capsys.readouterr().err


def test_corpus_draft_vocab_and_the_restricted_match(stages, tmp_path):
    """The draft vocabulary is the tokens the target emits most often in the corpus; the alpha the
    build reports with it is that of the restricted argmax (what the decoder's draft proposes)."""
    from specdec_kernels.decoding.drafters import vocab as dv

    g = torch.Generator().manual_seed(2)
    corpus = []
    for i in range(6):
        gen = torch.tensor([5, 5, 7, 11, 5, 7, 3 + i])  # 5 most often, then 7, then 11, then 3..8 once
        corpus.append({"prompt": torch.randint(0, 97, (4 + i,), generator=g), "gen": gen,
                       "topk_ids": gen[:, None].to(torch.int32), "topk_logits": torch.zeros(len(gen), 1).half()})
    assert stages.draft.corpus_draft_vocab(corpus, 97, 3).tolist() == [5, 7, 11]
    # 3..8 tie at 1 (and 5, 7 more): id 3
    assert stages.draft.corpus_draft_vocab(corpus, 97, 4).tolist() == [3, 5, 7, 11]
    draft = _tiny(2)
    vocab = torch.tensor([5, 7, 11])
    full = stages.evaluate.match_vectors(draft, corpus, pad=0)
    sub = stages.evaluate.match_vectors(draft, corpus, pad=0, vocab=vocab)
    with torch.no_grad():
        for c, f, s in zip(corpus, full, sub):
            ids = torch.cat([c["prompt"], c["gen"]])[None]
            logits = draft(ids).logits[0, len(c["prompt"]) - 1:-1]  # the predictions of the gen tokens
            assert torch.equal(f, logits.argmax(-1) == c["gen"])
            assert torch.equal(s, vocab[logits[:, vocab].argmax(-1)] == c["gen"])
    # the draft directory gets the file, with the choice recorded
    info = {"draft_vocab": {"size": 3, "source": "a test"}}
    out = tmp_path / "draft"
    stages.save.save_draft(draft, str(tmp_path / "no-tokenizer"), out, info, vocab)
    assert dv.load_draft_vocab(out, 97).tolist() == [5, 7, 11]
    stages.save.save_draft(draft, str(tmp_path / "no-tokenizer"), out, {})  # without one: no file
    assert not (out / dv.FILE_NAME).exists()
