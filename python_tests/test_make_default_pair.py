"""The draft build's second stage (scripts/make_default_pair.py: grow_draft) on a tiny random Llama.

Growing a trained draft must not change what it computes: the new layers start as the identity
(zeroed output projections), sit between the old ones, and keep the cache's layer numbering; the
KV-cached decode of the grown model must agree with its full forward.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("make_default_pair", ROOT / "scripts" / "make_default_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
def test_grow_draft_keeps_the_function(build, old, new, grown_at):
    draft = _tiny(old)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = draft(ids).logits
        grown = build.grow_draft(draft, new, seed=3)
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


def test_grow_draft_refuses_fewer_layers(build):
    with pytest.raises(ValueError, match="layers must be >= the draft's 4, got 3"):
        build.grow_draft(_tiny(4), 3, seed=0)
