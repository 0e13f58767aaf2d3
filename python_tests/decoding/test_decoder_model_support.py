"""Models the decoder cannot drive exactly are refused by name; one it can drive only up to a
length is capped there (found on 2026-12-01 with tiny random models of each family):

- MPT's forward takes no position_ids: its ALiBi counts cache columns, which a ragged batch
  leaves gaps in (wrong tokens on ragged batches); BLOOM's counts the attention mask (exact);
- GPT-Neo's local attention layers: a window over cache columns (wrong tokens);
- encoder-decoders and models without a KV cache argument (T5, RWKV, XLNet): unclear errors
  from deep inside before;
- a longrope model (Phi-3-128k, Phi-3.5) switches its rotary factors for a whole call once the
  call's largest position passes original_max_position_embeddings: capped there; a dynamic-NTK
  model rescales only past max_position_embeddings, which the decoder never passes (tested);
- the lean Llama step replays transformers' forwards: a forward patched on the class, or a
  re-registered "sdpa" attention, sends the model back to its own forward.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from specdec_kernels import SpeculativeDecoder

from decoder_setup import _one_thread  # noqa: F401  (autouse fixture)

V = 64
COMMON = dict(vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build().eval()


def _greedy(target, prompt, n):
    return target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           do_sample=False, max_new_tokens=n, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("build,match", [
    (lambda: tf.MptForCausalLM(tf.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=128, **COMMON)),
     "the target must take position_ids .* got MptForCausalLM, whose forward takes none"),
    (lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                                  attention_types=[[["global", "local"], 1]], **COMMON)),
     r"the target must use full attention only, got GPTNeoForCausalLM with local attention layers \(a window of 4"),
    (lambda: tf.T5ForConditionalGeneration(tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                                        decoder_start_token_id=0, **COMMON)),
     "the target must be a decoder-only causal LM, got an encoder-decoder T5ForConditionalGeneration"),
    (lambda: tf.RwkvForCausalLM(tf.RwkvConfig(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                              intermediate_size=64, context_length=128, **COMMON)),
     r"the target must take a KV cache \(past_key_values\) that the decoder can roll back, got RwkvForCausalLM"),
])
def test_models_it_cannot_drive_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target=_seeded(build), drafter="prompt_lookup")


def test_a_wrapper_forwarding_kwargs_is_judged_by_its_config():
    # (before: a module whose forward takes **kwargs, as PEFT's, was refused once the signature
    # checks came in; MPT behind such a wrapper is still refused, by its model type)
    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kw):
            return self.inner(**kw)

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    llama = _seeded(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.2, **COMMON)))
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    got = SpeculativeDecoder(target=Wrap(llama), drafter="prompt_lookup").generate(prompts, max_new_tokens=6).token_ids
    assert got == [_greedy(llama, p, 6) for p in prompts]
    mpt = _seeded(lambda: tf.MptForCausalLM(tf.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=128, **COMMON)))
    with pytest.raises(ValueError, match="the target must take position_ids .* got Wrap"):
        SpeculativeDecoder(target=Wrap(mpt), drafter="prompt_lookup")


def test_gpt_neo_with_global_attention_only_and_bloom_are_exact():
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    for build in (lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4,
                                                               attention_types=[[["global"], 2]], **COMMON)),
                  lambda: tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **COMMON))):
        target = _seeded(build)
        got = SpeculativeDecoder(target=target, drafter="prompt_lookup").generate(prompts, max_new_tokens=8,
                                                                                  num_draft_tokens=3).token_ids
        assert got == [_greedy(target, p, 8) for p in prompts]


def test_longrope_is_capped_at_its_original_context():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 16}
    target = _seeded(lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, original_max_position_embeddings=16, rope_parameters=rope,
        initializer_range=0.2, **COMMON)))
    dec = SpeculativeDecoder(target=target, drafter="prompt_lookup")
    assert dec.parts.target_runner.context == 16
    with pytest.raises(ValueError, match=r"prompts\[1\] must fit the target's context "
                                         r"\(original_max_position_embeddings of its longrope scaling = 16\), "
                                         r"got 20 tokens"):
        dec.generate([[1, 2, 3], list(range(14, 34))], max_new_tokens=4)
    prompts = [[1, 2, 3], list(range(14, 26)), [5]]
    res = dec.generate(prompts, max_new_tokens=20, num_draft_tokens=3)
    for p, got, why in zip(prompts, res.token_ids, res.finish_reasons):
        n = 16 + 1 - len(p)  # positions < 16; the last token is never fed
        assert why == "context" and got == _greedy(target, p, n)


def test_lean_step_steps_aside_for_patched_classes(monkeypatch):
    from transformers.models.llama import modeling_llama as ml

    target = _seeded(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.2, **COMMON)))
    assert SpeculativeDecoder(target=target, drafter="prompt_lookup").lean_status() == {"target": None}
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    orig = ml.LlamaMLP.forward
    with monkeypatch.context() as m:
        m.setattr(ml.LlamaMLP, "forward", lambda self, x: 2 * orig(self, x))  # as kernel libraries patch
        dec = SpeculativeDecoder(target=target, drafter="prompt_lookup")
        assert dec.lean_status()["target"].startswith("LlamaMLP.forward was replaced")
        assert dec.generate(prompts, max_new_tokens=8).token_ids == [_greedy(target, p, 8) for p in prompts]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *a, **k: sdpa(*a, **k)
        dec = SpeculativeDecoder(target=target, drafter="prompt_lookup")
        assert dec.lean_status()["target"] == ("the 'sdpa' attention function was re-registered "
                                               "(ALL_ATTENTION_FUNCTIONS)")
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    assert SpeculativeDecoder(target=target, drafter="prompt_lookup").lean_status() == {"target": None}


def test_dynamic_ntk_rope_never_rescales_inside_the_context():
    # transformers grows a dynamic rope's frequencies once a call's largest position passes
    # max_position_embeddings (for the whole call, as longrope); the decoder stops before it.
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    target = _seeded(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=16, rope_parameters=rope, initializer_range=0.2, **COMMON)))
    inv_freq = target.model.rotary_emb.inv_freq.clone()
    dec = SpeculativeDecoder(target=target, drafter="prompt_lookup")
    assert dec.parts.target_runner.context == 16
    prompts = [[1, 2, 3], list(range(14, 26)), [5], [7, 8, 7, 8, 7]]
    res = dec.generate(prompts, max_new_tokens=20, num_draft_tokens=3)
    assert torch.equal(target.model.rotary_emb.inv_freq, inv_freq)  # never rescaled
    for p, got, why in zip(prompts, res.token_ids, res.finish_reasons):
        assert why == "context" and got == _greedy(target, p, 16 + 1 - len(p))
