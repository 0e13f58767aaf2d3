"""SpeculativeDecoder over architectures other than Llama (the stated scope: "any pair of
AutoModelForCausalLM that share a vocabulary").

The decoder's own tests use Llama models (whose decode steps it may run through its lean path);
other architectures run through their own forward with the decoder's explicit 2-D attention
mask and position ids over left-aligned caches with gaps.  For each architecture, tiny random
weights (V = 64, 2 layers; the draft = the target with noise on every weight): a ragged batch of
five prompts decoded greedily equals ``target.generate(do_sample=False)`` of each prompt alone,
token for token, at K = 1, 3 and "auto"; seeded sampling gives each row the tokens it gets when
decoded alone (batch invariance, which a wrong mask or position in a ragged batch breaks); and
a pair of two different architectures (a Llama draft for a Qwen2 target) is exact too.  An
architecture whose cache is not a plain full-attention DynamicCache (a sliding window) is
refused by name.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from specdec_kernels import SpeculativeDecoder

from decoder_setup import PROMPTS, _one_thread, _perturbed  # noqa: F401  (_one_thread: autouse fixture)

V = 64
COMMON = dict(vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, initializer_range=0.2)
# name -> (model class, config) with peaked logits (init std 0.2: no near-ties for greedy)
ARCHS = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                     initializer_range=0.2, **COMMON)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **SMALL, **COMMON)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=8, **SMALL, **COMMON)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **SMALL,
                                                              **COMMON)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SMALL, **COMMON)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=128,
                                                  init_std=0.2, word_embed_proj_dim=32, **COMMON)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=2, head_dim=8, **SMALL, **COMMON)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=2, **SMALL, **COMMON)),
    "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, initializer_range=0.2,
                                                        **COMMON)),
    "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4,
                                                     initializer_range=0.2, **COMMON)),
}


def _make(name: str, seed: int = 0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ARCHS[name]().eval()


def _greedy_refs(target, n: int = 16) -> list:
    with torch.inference_mode():
        return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_greedy_and_batch_invariance(name):
    target = _make(name)
    dec = SpeculativeDecoder(draft=_perturbed(target, 0.01, seed=1), target=target)
    refs = _greedy_refs(target)
    for k in (1, 3, "auto"):
        res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=k)
        assert res.token_ids == refs, (name, k)
    lean = dec.lean_status()  # after a generate: why neither model takes the Llama-only lean step
    assert lean["target"] is not None and lean["draft"] is not None, lean
    assert res.stats.accepted_tokens > 0  # the drafts were really verified, not all rejected
    batch = dec.generate(PROMPTS, max_new_tokens=12, num_draft_tokens=3, temperature=1.0, seed=7)
    for p, prompt in enumerate(PROMPTS):
        alone = dec.generate([prompt], max_new_tokens=12, num_draft_tokens=3, temperature=1.0, seed=7 + p)
        assert alone.token_ids[0] == batch.token_ids[p], (name, p)


def test_a_pair_of_two_architectures():
    # a Llama draft for a Qwen2 target over the same 64 ids: nothing shared but the vocabulary
    target = _make("qwen2")
    draft = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **SMALL, **COMMON)).eval()
    dec = SpeculativeDecoder(draft=draft, target=target)
    assert dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=3).token_ids == _greedy_refs(target)


def test_a_sliding_window_cache_is_refused():
    target = tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=8, **SMALL, **COMMON)).eval()
    dec = SpeculativeDecoder(draft=_perturbed(target, 0.01, seed=1), target=target)
    with pytest.raises(ValueError, match=r"model Gemma2ForCausalLM uses a DynamicSlidingWindowLayer cache layer; "
                                         r"the speculative decoder needs plain full-attention DynamicCache layers"):
        dec.generate(PROMPTS, max_new_tokens=4)
