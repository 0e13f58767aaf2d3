"""LeanLlamaStep (specdec_kernels/cpu/lean_forward.py): the decode-step forward without Hugging Face's
per-call overhead must give the model's own logits and cache entries, bit for bit.

Each case prefills a ragged, left-padded batch through the model's forward, copies the cache,
then appends the same q new tokens through the model's forward (``ModelRunner.forward``) and through
the lean step, and compares the logits and every layer's keys and values with ``torch.equal``:
q = 1 (a draft token) and q = 4 (a verify step), without a mask (no padding) and with one
(left padding, and the draft's catch-up "gap" column), grouped-query and plain attention,
fp32 and bf16, with torch's linear and with ``skinny_linear``.  Then the decoder: the same token
ids with the lean path on and off, and the models it must refuse.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_kernels.ops.extension import HAS_EXT
from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.runners import ModelRunner
from specdec_kernels.cpu.lean_forward import LeanLlamaStep

V = 61


def _llama(heads: int, kv_heads: int, seed: int = 0, dtype=torch.float32, **extra) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    return model.to(dtype)


def _prefill(model, lens, P):
    """A [B, P] left-padded prefill through the model's forward; returns (cache, valid [B, P])."""
    from specdec_kernels.ops.kv.cache import new_cache

    g = torch.Generator().manual_seed(3)
    B = len(lens)
    ids = torch.randint(0, V, (B, P), generator=g)
    valid = torch.arange(P)[None, :] >= torch.tensor([P - n for n in lens])[:, None]
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    cache = new_cache(model)
    with torch.no_grad():
        ModelRunner(model, "m").forward(cache, ids, None if valid.all() else valid, pos, 0, 1)
    return cache, valid


def _compare(model, lens, P, q, gap=False):
    runner = ModelRunner(model, "m")
    lean = LeanLlamaStep(model)
    cache, valid = _prefill(model, lens, P)
    B = len(lens)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (B, q), generator=g)
    start = torch.tensor(lens)
    pos = start[:, None] + torch.arange(q)[None, :]
    new_valid = torch.ones((B, q), dtype=torch.bool)
    if gap:  # the draft's catch-up: row 0 feeds a gap column first (masked, its position unused)
        new_valid[0, 0] = False
    mask = torch.cat([valid, new_valid], 1)
    if bool(mask.all()):
        mask = None
    c_ref, c_lean = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.no_grad():
        ref = runner.forward(c_ref, ids, mask, pos, P, q)
        out = lean.step(c_lean, ids, mask, pos, q)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (B, q, V)
    assert torch.equal(out, ref), f"logits differ by up to {(out.float() - ref.float()).abs().max().item():.3g}"
    for li, (a, b) in enumerate(zip(c_ref.layers, c_lean.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"layer {li} cache differs"
    assert c_lean.get_seq_length() == P + q


CASES = [  # (lens, P, q, gap)
    ([5], 5, 1, False),        # batch 1, no padding, one token: no mask at all
    ([5], 5, 4, False),        # a verify step, no padding
    ([5, 2, 4], 5, 1, False),  # ragged: a padding mask
    ([5, 2, 4], 5, 4, False),
    ([5, 3], 5, 2, True),      # the draft's catch-up feed with a gap column
]


@pytest.mark.parametrize("lens,P,q,gap", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_step_equals_the_models_forward(lens, P, q, gap, heads, kv_heads, dtype):
    _compare(_llama(heads, kv_heads, dtype=dtype), lens, P, q, gap)


@pytest.mark.parametrize("lens,P,q,gap", CASES)
def test_lean_step_embeds_and_hidden_states(lens, P, q, gap):
    """``embeds`` (the model's inputs_embeds) and ``return_hidden`` (the final norm's output, what
    lm_head reads): the bits of the model's decoder forward, the cache too."""
    model = _llama(4, 2)
    cache, valid = _prefill(model, lens, P)
    B = len(lens)
    g = torch.Generator().manual_seed(6)
    embeds = torch.randn(B, q, 32, generator=g)
    pos = torch.tensor(lens)[:, None] + torch.arange(q)[None, :]
    new_valid = torch.ones((B, q), dtype=torch.bool)
    if gap:
        new_valid[0, 0] = False
    mask = torch.cat([valid, new_valid], 1)
    mask = None if bool(mask.all()) else mask
    c_ref, c_lean = copy.deepcopy(cache), copy.deepcopy(cache)
    kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    with torch.no_grad():
        h_ref = model.model(inputs_embeds=embeds, position_ids=pos, use_cache=True,
                            attention_mask=None if mask is None else mask.long(), **{kw: c_ref}).last_hidden_state
        logits, h = LeanLlamaStep(model).step(c_lean, None, mask, pos, q, embeds=embeds, return_hidden=True)
        assert torch.equal(logits, model.lm_head(h_ref))
    assert torch.equal(h, h_ref)
    for a, b in zip(c_ref.layers, c_lean.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with pytest.raises(ValueError, match=r"embeds must be a \[B, q >= 1, H\] tensor given instead of ids"):
        LeanLlamaStep(model).step(c_lean, torch.zeros(B, q, dtype=torch.long), mask, pos, q, embeds=embeds)


@pytest.mark.skipif(not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e .")
@pytest.mark.parametrize("lens,P,q,gap", CASES)
def test_lean_step_equals_the_models_forward_with_skinny_linear(lens, P, q, gap):
    from specdec_kernels.cpu.skinny_linear import use_skinny_linear

    model = _llama(4, 2)
    with use_skinny_linear(model):
        _compare(model, lens, P, q, gap)


def test_lean_step_with_rope_scaling():
    # llama3-style rope scaling: the rotary module is the model's own, so its scaling comes along
    model = _llama(4, 2, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 32})
    _compare(model, [5, 2, 4], 5, 4)


def test_unsupported_models_are_named():
    assert LeanLlamaStep.unsupported(_llama(4, 2)) is None
    eager = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="eager")).eval()
    assert "'eager'" in LeanLlamaStep.unsupported(eager)

    class MyLlama(LlamaForCausalLM):
        pass

    sub = MyLlama(_llama(4, 2).config).eval()
    assert "MyLlama" in LeanLlamaStep.unsupported(sub)
    training = _llama(4, 2).train()
    assert "training" in LeanLlamaStep.unsupported(training)
    hooked = _llama(4, 2)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "LlamaMLP has hooks" in LeanLlamaStep.unsupported(hooked)
    replaced = _llama(4, 2)
    replaced.forward = lambda *a, **k: None  # someone wraps the model's forward: respected
    assert LeanLlamaStep.unsupported(replaced) == "the forward of a LlamaForCausalLM was replaced"
    replaced = _llama(4, 2)
    replaced.model.layers[2].self_attn.forward = lambda *a, **k: None
    assert LeanLlamaStep.unsupported(replaced) == "the forward of a LlamaAttention was replaced"
    fewer = _llama(4, 2)
    fewer.model.layers = fewer.model.layers[:2]
    assert LeanLlamaStep.unsupported(fewer) == "2 layers, config.num_hidden_layers = 3"
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2)).eval()
    assert "GPT2LMHeadModel" in LeanLlamaStep.unsupported(gpt2)
    with pytest.raises(ValueError, match="LeanLlamaStep: model not supported: .*GPT2LMHeadModel"):
        LeanLlamaStep(gpt2)
    # whose own forward differs from the replay (taken before): one module in
    # training mode (dropout), a compiled model, global forward hooks
    one_training = _llama(4, 2)
    one_training.model.layers[0].self_attn.train()
    assert "training" in LeanLlamaStep.unsupported(one_training)
    compiled = _llama(4, 2)
    compiled.compile()
    assert "compiled" in LeanLlamaStep.unsupported(compiled)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert "global module forward hooks" in LeanLlamaStep.unsupported(_llama(4, 2))
    finally:
        handle.remove()
    assert LeanLlamaStep.unsupported(_llama(4, 2)) is None


def test_lean_step_with_an_all_valid_mask_over_one_token():
    """One new token with an all-valid mask gives the model's bits (Hugging Face drops such a mask
    and calls sdpa as without one; the lean step built a 4-D mask and differed in the last bits
    before)."""
    from specdec_kernels.ops.kv.cache import new_cache
    from specdec_kernels.decoding.runners import cache_keyword

    model = _llama(4, 2)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        c1, c2 = new_cache(model), new_cache(model)
        for c in (c1, c2):
            model(input_ids=ids[:, :5], use_cache=True, **{cache_keyword(model): c})
        want = model(input_ids=ids[:, 5:], attention_mask=torch.ones(1, 6, dtype=torch.long), use_cache=True,
                     position_ids=torch.tensor([[5]]), **{cache_keyword(model): c1}).logits
        got = LeanLlamaStep(model).step(c2, ids[:, 5:], torch.ones(1, 6, dtype=torch.bool), torch.tensor([[5]]), 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs,match", [
    (dict(ids=torch.zeros(3, dtype=torch.long)), r"ids must be a \[B, q >= 1\] tensor, got \(3,\)"),
    (dict(positions=torch.zeros(2, 2, dtype=torch.long)), r"positions must have the shape of ids \(1, 2\), "
                                                          r"got \(2, 2\)"),
    (dict(mask=torch.ones(1, 2)), r"mask must be None or a bool \[B=1, T \+ q = 2\] tensor \(T = 0 cached columns\), "
                                  r"got torch.float32 \(1, 2\)"),
    (dict(mask=torch.ones(2, 2, dtype=torch.bool)), r"mask must be None or a bool \[B=1, T \+ q = 2\] tensor"),
    # a width other than the cache's + q (accepted before: raised inside layer 0, after it had
    # cached), a bool keep
    (dict(mask=torch.ones(1, 7, dtype=torch.bool)), r"mask must be None or a bool \[B=1, T \+ q = 2\] tensor "
                                                    r"\(T = 0 cached columns\), got torch.bool \(1, 7\)"),
    (dict(keep=3), r"keep must be an int in \[1, 2\], got 3"),
    (dict(keep=0), r"keep must be an int in \[1, 2\], got 0"),
    (dict(keep=True), r"keep must be an int in \[1, 2\], got True"),
])
def test_lean_step_names_a_bad_argument(kwargs, match):
    model = _llama(4, 2)
    from specdec_kernels.ops.kv.cache import new_cache

    args = dict(cache=new_cache(model), ids=torch.zeros(1, 2, dtype=torch.long), mask=None,
                positions=torch.arange(2)[None], keep=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match), torch.no_grad():
        LeanLlamaStep(model).step(**args)
    assert args["cache"].get_seq_length() == 0  # refused before anything was cached


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoder_same_tokens_with_and_without_the_lean_path(temperature):
    target = _llama(4, 2, seed=0)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    on = SpeculativeDecoder(draft, target)
    off = SpeculativeDecoder(draft, target, lean_forward=False)
    assert on.lean_status() == {"target": None, "draft": None}
    assert off.lean_status() == {"target": "lean_forward=False", "draft": "lean_forward=False"}
    calls = []
    orig = LeanLlamaStep.step

    def counting(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    LeanLlamaStep.step = counting
    try:
        a = on.generate(PROMPTS, max_new_tokens=12, num_draft_tokens=3, temperature=temperature, seed=7)
    finally:
        LeanLlamaStep.step = orig
    assert calls, "the lean path never ran"
    b = off.generate(PROMPTS, max_new_tokens=12, num_draft_tokens=3, temperature=temperature, seed=7)
    assert a.token_ids == b.token_ids
    ta = on.generate_target_only(PROMPTS, max_new_tokens=12, temperature=temperature, seed=7)
    tb = off.generate_target_only(PROMPTS, max_new_tokens=12, temperature=temperature, seed=7)
    assert ta.token_ids == tb.token_ids
    if temperature == 0.0:
        assert a.token_ids == ta.token_ids


def test_decoder_falls_back_when_a_model_changes():
    target = _llama(4, 2, seed=0)
    dec = SpeculativeDecoder(copy.deepcopy(target), target)
    assert dec.lean_status()["target"] is None
    handle = target.model.layers[0].register_forward_pre_hook(lambda *a: None)
    try:
        dec.generate([[1, 2, 3]], max_new_tokens=2, num_draft_tokens=2)
        assert "has hooks" in dec.lean_status()["target"] and dec.lean_status()["draft"] is None
    finally:
        handle.remove()
    with pytest.raises(TypeError, match="lean_forward must be a bool, got str"):
        SpeculativeDecoder(copy.deepcopy(target), target, lean_forward="yes")


@pytest.mark.parametrize("flag,expected", [([], None), (["--no-lean-forward"], "lean_forward=False")])
def test_cli_passes_lean_forward(flag, expected):
    from specdec_kernels.cli import _make_decoder, build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "Hi", "--tiny-random"] + flag)
    # the tiny random pair is two plain Llamas on the CPU: the lean step unless turned off
    assert _make_decoder(args, parser).lean_status() == {"target": expected, "draft": expected}


def test_bench_lean_forward_rows():
    # bench/cpu/bench_lean_forward.py's measurement on a tiny model: both providers, every row, the
    # logits compared (the timing itself is not tested)
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_lean_forward", Path(__file__).resolve().parents[2] / "bench" / "cpu" / "bench_lean_forward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.run(_llama(4, 2), "tiny", [1, 3], reps=3, ctx=8)
    assert [(r["provider"], r["new_tokens"]) for r in rows] == [
        ("model forward", 1), ("lean step", 1), ("model forward", 3), ("lean step", 3)]
    assert all(r["same_logits"] is True and r["ms"] > 0 and r["q20_ms"] <= r["ms"] <= r["q80_ms"] for r in rows)
    assert rows[0]["speedup_vs_model_forward"] == 1.0
    from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair

    draft, target, tok = build_tiny_random_pair(seed=0)
    rows = mod.run_decoder(draft, target, tok, ["hello there", "abc"], [2], max_new=5, rounds=1)
    assert [(r["provider"], r["k"]) for r in rows] == [
        ("model forward", "target alone"), ("lean step", "target alone"), ("model forward", 2), ("lean step", 2)]
    assert all(r["same_ids"] is True and r["tokens"] == 10 and r["tokens_per_s"] > 0 for r in rows)
