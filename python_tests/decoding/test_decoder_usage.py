"""SpeculativeDecoder as it is used: prompt lookup, stopping (EOS, stop strings,
max_new_tokens), bad input (each error with ``match=``, before any model work), the pieces
(the draft's warp and random numbers, the cost model, stats); the CLI's own tests are in
test_cli.py (its device refusal is checked beside the constructor's, here).
"""

from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch
from scipy import stats as sps

from specdec_kernels.ops import reference
from specdec_kernels.cli import build_tiny_random_pair, main as cli_main, tiny_char_tokenizer
from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.drafters.sampling import draft_key, _draft_uniforms, _sample_inverse_cdf, warp_probs
from specdec_kernels.decoding.drafters.prompt_lookup import PromptLookupDrafter, prompt_lookup
from specdec_kernels.decoding.stats import choose_num_draft_tokens, expected_tokens_per_step, predicted_speedup

from decoder_setup import PROMPTS, SIGNIFICANCE, _CountingForward, _chisquare_pvalue, _llama, _naive_warp
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)


# ----------------------------------------------------------------------------------------------
# Prompt lookup
# ----------------------------------------------------------------------------------------------
def test_prompt_lookup_function():
    assert prompt_lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # 3-gram match
    assert prompt_lookup([1, 2, 3, 4, 9, 9, 3], 2) == [4, 9]  # falls back to a 1-gram
    assert prompt_lookup([7, 1, 2, 8, 1, 2], 4) == [8, 1, 2]  # most recent match; stops at the end
    assert prompt_lookup([5, 5, 5], 4) == [5]  # a repeat proposes its own continuation
    assert prompt_lookup([1, 2, 3], 4) == []
    assert prompt_lookup([1], 4) == []
    assert PromptLookupDrafter().propose([[1, 2, 1], [3]], [2, 2]) == [[2, 1], []]
    assert prompt_lookup([1, 2, 7, 1, 2, 8, 1, 2], 1) == [8]  # the most recent of two matches
    assert prompt_lookup([1, 2, 3, 9, 5, 3, 6, 1, 2, 3], 1) == [9]  # the longest n-gram first
    assert prompt_lookup([1, 2, 3, 9, 5, 3, 6, 1, 2, 3], 1, max_ngram=1) == [6]
    with pytest.raises(ValueError, match=r"need 1 <= min_ngram <= max_ngram, got min_ngram=0, max_ngram=3"):
        PromptLookupDrafter(min_ngram=0)
    with pytest.raises(ValueError, match=r"need 1 <= min_ngram <= max_ngram, got min_ngram=1, max_ngram=0"):
        PromptLookupDrafter(max_ngram=0)
    # u = 0 never draws a leading zero-probability token; u * sum at the end draws the last nonzero one
    edge = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    assert _sample_inverse_cdf(edge, torch.tensor([0.0], dtype=torch.float64)).tolist() == [1]
    assert _sample_inverse_cdf(edge, torch.tensor([1.0], dtype=torch.float64)).tolist() == [2]
    with pytest.raises(ValueError, match=r"need 1 <= min_ngram <= max_ngram, got min_ngram=3, max_ngram=2"):
        prompt_lookup([1, 2], 1, max_ngram=2, min_ngram=3)
    # the decoder refuses a bad max_ngram before it loads anything (here: a target path that does not exist)
    with pytest.raises(ValueError, match=r"need 1 <= min_ngram <= max_ngram, got min_ngram=1, max_ngram=0"):
        SpeculativeDecoder(target="/nonexistent/target", max_ngram=0)


@pytest.mark.parametrize("k", [4, "auto"])
def test_prompt_lookup_greedy_matches_generate(pair, k):
    _, target = pair
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9], [5, 6, 5, 6, 5]]
    with torch.inference_mode():
        refs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=30,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    dec = SpeculativeDecoder(target=target)  # draft=None: prompt lookup
    assert dec.drafter == "prompt_lookup"
    res = dec.generate(prompts, max_new_tokens=30, num_draft_tokens=k)
    assert res.token_ids == refs
    assert res.stats.accepted_tokens > 0  # greedy random models repeat themselves: lookup pays off
    assert res.stats.mean_tokens_per_target_call > 1.0


# ----------------------------------------------------------------------------------------------
# Stopping: EOS, stop strings, max_new_tokens
# ----------------------------------------------------------------------------------------------
def test_eos_stops_only_its_row(pair, greedy_refs):
    draft, target = pair
    eos = greedy_refs[2][5]
    first = [r.index(eos) if eos in r else None for r in greedy_refs]
    res = SpeculativeDecoder(draft=draft, target=target).generate(PROMPTS, max_new_tokens=24, eos_token_id=eos)
    for i, r in enumerate(greedy_refs):
        if first[i] is None:
            assert res.token_ids[i] == r and res.finish_reasons[i] == "length"
        else:
            assert res.token_ids[i] == r[: first[i] + 1] and res.finish_reasons[i] == "eos"
    assert res.finish_reasons[2] == "eos"
    dec = SpeculativeDecoder(draft=draft, target=target)
    for form in ([eos], (eos, 31), torch.tensor(eos), torch.tensor([eos])):  # other forms, the same ids
        other = dec.generate(PROMPTS, max_new_tokens=24, eos_token_id=form)
        assert other.token_ids[2] == res.token_ids[2] and other.finish_reasons[2] == "eos", form


@pytest.mark.parametrize("k", [1, 8])
def test_max_new_tokens_is_never_exceeded(pair, greedy_refs, k):
    draft, target = pair
    for m in (1, 2, 5):
        res = SpeculativeDecoder(draft=draft, target=target).generate(PROMPTS, max_new_tokens=m, num_draft_tokens=k)
        assert res.token_ids == [r[:m] for r in greedy_refs]
        assert res.stats.generated_tokens == m * len(PROMPTS)


@pytest.fixture(scope="module")
def tiny():
    draft, target, tok = build_tiny_random_pair(seed=0, noise=0.005)
    return SpeculativeDecoder(draft=draft, target=target, tokenizer=tok), tok


def test_stop_strings(tiny):
    dec, tok = tiny
    prompts = ["hello world", "the cat"]
    free = dec.generate(prompts, max_new_tokens=30, eos_token_id=[])
    text = free.texts[0]
    stop = text[6:9]
    ids = free.token_ids[0]
    end = next(j for j in range(len(ids) + 1) if stop in tok.decode(ids[:j], skip_special_tokens=True))
    res = dec.generate(prompts, max_new_tokens=30, stop=[stop, "will never appear ~"], eos_token_id=[])
    assert res.token_ids[0] == ids[:end]
    assert res.texts[0].endswith(stop) and stop not in res.texts[0][:-1]
    assert res.finish_reasons[0] == "stop"
    if stop not in free.texts[1]:
        assert res.token_ids[1] == free.token_ids[1]


def _byte_level_chain_model(chain_text: list):
    """A byte-level BPE tokenizer (GPT-2 style: a character outside its merges is several byte
    tokens) and a 1-layer Llama whose greedy next token depends only on the current one
    (attention and MLP outputs zeroed, output rows on the normalised embeddings), rigged to emit
    the tokens of ``chain_text`` in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello world a x y z w"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    chain = [i for part in chain_text for i in tok(part)["input_ids"]]
    assert len(set(chain)) == len(chain)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for a, b in zip(chain, chain[1:]):
            head[b] = 50 * emb[a] / emb[a].norm()
    return model, tok, chain


def test_stop_strings_split_inside_a_character():
    """A stop string whose characters are several byte tokens is found wherever the steps split
    them (seen missed before: a character completed in a later step than its first bytes, or a
    search window starting inside one)."""
    emoji = "\U0001F600"
    model, tok, chain = _byte_level_chain_model(["a", "x", emoji, "y", "z", "w"])
    assert [tok.decode([i]) for i in chain[2:6]] == ["\ufffd"] * 4  # the emoji is four byte tokens
    dec = SpeculativeDecoder(draft=copy.deepcopy(model), target=model, tokenizer=tok)
    for prompt, stop, want in [("a", emoji, "x" + emoji), ("x", emoji, emoji), ("a", emoji + "y", "x" + emoji + "y"),
                               ("a", "x" + emoji, "x" + emoji)]:
        for k in (1, 2, 3, 5):
            res = dec.generate([prompt], max_new_tokens=8, num_draft_tokens=k, stop=stop, eos_token_id=[])
            assert (res.texts[0], res.finish_reasons[0]) == (want, "stop"), (prompt, stop, k, res.texts[0])
        res = dec.generate_target_only([prompt], max_new_tokens=8, stop=stop, eos_token_id=[])
        assert (res.texts[0], res.finish_reasons[0]) == (want, "stop"), (prompt, stop, "target only")
    free = dec.generate(["a"], max_new_tokens=8, num_draft_tokens=2, eos_token_id=[])
    assert free.texts[0] == "x" + emoji + "yzw" and free.finish_reasons[0] == "length"  # the chain, unstopped


def test_text_prompts_and_verbose(tiny):
    dec, tok = tiny
    buf = io.StringIO()
    res = dec.generate("The Capital of France is", max_new_tokens=12, num_draft_tokens=4, verbose=buf)
    ids = tok("The Capital of France is")["input_ids"]
    assert res.token_ids == dec.generate([ids], max_new_tokens=12, num_draft_tokens=4).token_ids
    out = buf.getvalue()
    assert "Drafted:  '" in out and "Accepted: '" in out
    assert " tokens)" in out and ("+ bonus: " in out or "+ recovered: " in out)


def test_verbose_tells_a_step_without_drafts(tiny, monkeypatch):
    """A K = 0 step ("auto") prints the target's own token as such, with no Drafted line."""
    from specdec_kernels.decoding.stats import StatsRecorder

    dec, _ = tiny
    ks = iter([0, 3, 0, 3, 3, 3, 3, 3])
    monkeypatch.setattr(StatsRecorder, "choose_k", lambda self, k_max, allow_zero=False: next(ks))
    buf = io.StringIO()
    res = dec.generate("The Capital of France is", max_new_tokens=8, num_draft_tokens="auto", verbose=buf)
    lines = buf.getvalue().splitlines()
    assert [h["k"] for h in res.stats.history][:3] == [0, 3, 0]
    step1 = [ln for ln in lines if ln.startswith("[step 1 |")]
    assert len(step1) == 1 and "+ target, no drafts: '" in step1[0]
    assert any(ln.startswith("[step 2 |") and "Drafted:  '" in ln for ln in lines)


# ----------------------------------------------------------------------------------------------
# Bad input: ValueError/TypeError naming the argument, before any model work
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(prompts=""), ValueError, r"prompts\[0\] must not be empty, got ''"),
    (dict(prompts=[]), ValueError, "prompts must hold at least one prompt"),
    (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\] must not be empty, got 0 tokens"),
    (dict(prompts=[[1, 99]]), ValueError, r"prompts\[0\] token ids must be in \[0, 32\), got 99"),
    (dict(prompts=["text"]), TypeError, "prompts given as text need a tokenizer"),
    (dict(prompts=[[1], [2, "x"]]), TypeError,
     r"prompts\[1\] must be a str or a list of int token ids, got a list holding a str \('x'\)"),
    (dict(prompts=[[1], 2.5]), TypeError, r"prompts\[1\] must be a str or a list of int token ids, got float"),
    (dict(prompts=[[1]] , max_new_tokens=0), ValueError, "max_new_tokens must be > 0, got 0"),
    (dict(prompts=[[1]], max_new_tokens=2.0), TypeError, "max_new_tokens must be an int, got float"),
    (dict(prompts=[[1]], num_draft_tokens=0), ValueError, "num_draft_tokens must be a positive int or 'auto', got 0"),
    (dict(prompts=[[1]], num_draft_tokens="fast"), ValueError,
     "num_draft_tokens must be a positive int or 'auto', got 'fast'"),
    (dict(prompts=[[1]], temperature=-0.5), ValueError,
     r"temperature must be finite and >= 0 \(0 = greedy\), got -0.5"),
    (dict(prompts=[[1]], temperature=1e-39), ValueError,
     r"temperature must be 0 \(greedy\) or >= 1.1754944e-38 \(the smallest normal fp32\), got 1e-39"),
    (dict(prompts=[[1]], top_k=-1), ValueError, r"top_k must be >= 0 \(0 = off\), got -1"),
    (dict(prompts=[[1]], top_p=0.0), ValueError, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    (dict(prompts=[[1]], stop="x"), ValueError, "stop strings need a tokenizer"),
    (dict(prompts=[[1], [2]], seed=[1]), ValueError, r"seed as a list must have one entry per prompt \(2\), got 1"),
    (dict(prompts=[list(range(30)) * 5]), ValueError,
     r"prompts\[0\] must fit the target's context \(max_position_embeddings = 128\), got 150 tokens"),
    # (seen accepted before: a float tensor truncated to ids, a 2-D one
    # flattened, eos "19" read as {1, 9}, verbose=1 failing after the first step)
    (dict(prompts=[torch.tensor([1.7, 2.2])]), TypeError,
     r"prompts\[0\] as a tensor must be 1-D integer token ids, got dtype float32 shape \[2\]"),
    (dict(prompts=[torch.tensor([True, False])]), TypeError, r"got dtype bool shape \[2\]"),
    (dict(prompts=[[3], torch.tensor([[1, 2], [3, 4]])]), TypeError,
     r"prompts\[1\] as a tensor must be 1-D integer token ids, got dtype int64 shape \[2, 2\]"),
    (dict(prompts=[[1]], eos_token_id="19"), TypeError,
     r"eos_token_id must be an int, a list of ints or None, got str"),
    (dict(prompts=[[1]], eos_token_id=True), TypeError, r"eos_token_id must be .*, got bool"),
    (dict(prompts=[[1]], eos_token_id=[5, 2.0]), TypeError, r"eos_token_id must be .*, got list"),
    (dict(prompts=[[1]], verbose=1), TypeError, r"verbose must be a bool or a text stream \(with .write\), got int"),
    # (accepted before: EOS ids that can never match, a mask that is not 0/1
    # or has a gap; a seed overflow that did not say which)
    (dict(prompts=[[1]], eos_token_id=1000), ValueError,
     r"eos_token_id must be in \[0, 32\) \(the target's vocabulary\), got 1000"),
    (dict(prompts=[[1]], eos_token_id=[3, -1]), ValueError, r"eos_token_id must be in \[0, 32\) .*, got -1"),
    (dict(prompts=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 7]])), ValueError,
     "attention_mask must hold only 0 and 1, got 7"),
    (dict(prompts=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1]])), ValueError,
     r"attention_mask\[0\] must mark one contiguous run of tokens \(left or right padding\), "
     r"got a gap between columns 0 and 2"),
    (dict(prompts=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1.0, 0.5]])), ValueError,
     "attention_mask must hold only 0 and 1, got 0.5"),
    (dict(prompts=[[1], [2]], seed=2**63 - 1), ValueError,
     r"seed \+ 1 \(row 1's seed\) must fit in int64 \[-2\*\*63, 2\*\*63\), got 9223372036854775808"),
    (dict(prompts=[[1], [2]], seed=[0, -2**63 - 1]), ValueError,
     r"seed\[1\] must fit in int64 .*, got -9223372036854775809"),
    (dict(prompts=[[1]], seed=True), TypeError, r"seed must be an int, a list of ints or None, got a bool \(True\)"),
    (dict(prompts=[[1], [2]], seed=[1, False]), TypeError, r"seed must be .*, got a bool \(\[1, False\]\)"),
    (dict(prompts=[[1]], baseline_tokens_per_s="fast"), TypeError,
     "baseline_tokens_per_s must be None or a number, got str"),
    (dict(prompts=[[1]], baseline_tokens_per_s=-5.0), ValueError,
     r"baseline_tokens_per_s must be finite and > 0, got -5.0"),
    (dict(prompts=[[1]], target_step_s="1 ms"), TypeError, "target_step_s must be None or a number, got str"),
    (dict(prompts=[[1]], target_step_s=float("nan")), ValueError, r"target_step_s must be finite and > 0, got nan"),
])
def test_bad_generate_arguments(pair, kwargs, exc, match):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    tc, dc = _CountingForward(dec, "target"), _CountingForward(dec, "draft")
    try:
        with pytest.raises(exc, match=match):
            dec.generate(**kwargs)
    finally:
        tc.restore()
        dc.restore()
    assert tc.calls == [] and dc.calls == []  # refused before any generation work


def test_numpy_scalars_and_a_huge_k(pair, greedy_refs):
    # NumPy integers and floats are taken as Python ones (refused before: "got int64"); a K far
    # beyond max_new_tokens costs nothing (the recorder was sized by K: 10**7 took 0.9 s and
    # 230 MB).
    import numpy as np

    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    res = dec.generate([PROMPTS[0]], max_new_tokens=np.int64(12), num_draft_tokens=np.int32(3),
                       temperature=np.float32(0.0), seed=np.int64(0))
    assert res.token_ids[0] == greedy_refs[0][:12]
    st = dec.start([PROMPTS[0]], 12, 10**9, 0.0, None, None, 0, max_draft_tokens=8)
    assert st.settings.k_max == 11 and len(st.hooks.recorder._reached) == 11
    assert dec.generate([PROMPTS[0]], max_new_tokens=12, num_draft_tokens=10**9).token_ids[0] == greedy_refs[0][:12]
    # seed=None: the drawn seeds come back, and repeat the run
    torch.manual_seed(5)
    drawn = dec.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=6, temperature=1.0, seed=None, num_draft_tokens=2)
    again = dec.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=6, temperature=1.0, seed=drawn.seeds,
                         num_draft_tokens=2)
    assert len(drawn.seeds) == 2 and drawn.seeds[1] == drawn.seeds[0] + 1 and again.token_ids == drawn.token_ids
    # NumPy scalars elsewhere too; a float 0/1 attention mask as a bool one
    dec.generate([PROMPTS[0]], max_new_tokens=4, eos_token_id=[np.int64(3)], baseline_tokens_per_s=np.float32(10),
                 target_step_s=np.float64(0.01))
    ids = torch.tensor([[0, 0] + PROMPTS[0], [9, 8, 7, 6, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = dec.generate(ids, attention_mask=mask.bool(), max_new_tokens=6).token_ids
    assert dec.generate(ids, attention_mask=mask.float(), max_new_tokens=6).token_ids == want
    assert want[0] == greedy_refs[0][:6]


def test_bad_constructor_arguments(pair, tmp_path):
    draft, target = pair
    with pytest.raises(TypeError, match=r"^max_ngram must be an int, got float \(2.5\)"):
        SpeculativeDecoder(target=target, drafter="prompt_lookup", max_ngram=2.5)
    with pytest.raises(TypeError, match=r"target must be a model name/path or a PreTrainedModel, "
                                        r"got None \(pass neither"):
        SpeculativeDecoder(draft=draft)
    with pytest.raises(ValueError, match="drafter must be one of"):
        SpeculativeDecoder(draft=draft, target=target, drafter="medusa")
    with pytest.raises(ValueError, match="draft and target must be on the same device, got draft on meta"):
        SpeculativeDecoder(draft=copy.deepcopy(draft).to("meta"), target=target)
    with pytest.raises(ValueError, match="the draft vocabulary must not exceed the target's: draft vocab_size = 40"):
        SpeculativeDecoder(draft=_llama(40, 32, 1, 0.2, seed=0), target=target)
    # (accepted before: max_ngram ignored beside a draft model; models on meta
    # failing inside transformers at the first generate)
    with pytest.raises(ValueError, match=r"^max_ngram applies to drafter='prompt_lookup', got max_ngram=2 with "
                                         r"drafter='model'$"):
        SpeculativeDecoder(draft=draft, target=target, max_ngram=2)
    meta_draft, meta_target = copy.deepcopy(draft).to("meta"), copy.deepcopy(target).to("meta")
    for device in (None, "cpu"):  # (with a device: "Cannot copy out of meta tensor" from torch before)
        with pytest.raises(ValueError, match="the models must hold their weights, got the target and draft on the "
                                             "meta device"):
            SpeculativeDecoder(draft=meta_draft, target=meta_target, device=device, dtype=torch.float16)
        assert next(meta_target.parameters()).dtype == torch.float32
    # Tokenizers from paths: with vocabulary="shared", a different vocabulary is refused before any
    # weights load (the default, "auto", drafts across them: test_cross_vocab.py).
    tok = tiny_char_tokenizer()
    tok.save_pretrained(tmp_path / "target")
    other = tiny_char_tokenizer()
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="draft and target tokenizers must have the same vocabulary with "
                                         "vocabulary='shared', got 52 vs 51"):
        SpeculativeDecoder(draft=str(tmp_path / "draft"), target=str(tmp_path / "target"), vocabulary="shared")


def test_a_refused_pair_leaves_the_models_as_they_were(pair):
    # (before: the models were converted to the requested dtype before the checks)
    draft, target = pair
    big_draft = _llama(40, 32, 1, 0.2, seed=0)
    with pytest.raises(ValueError, match="the draft vocabulary must not exceed the target's"):
        SpeculativeDecoder(draft=big_draft, target=target, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="draft_vocab"):
        SpeculativeDecoder(draft=draft, target=target, dtype=torch.float16, draft_vocab=[99])
    for m in (target, draft, big_draft):
        assert next(m.parameters()).dtype == torch.float32


def _gpt2(n_positions: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=n_positions,
                                      bos_token_id=None, eos_token_id=None)).eval()


@pytest.mark.parametrize("draft_kind", ["llama", "gpt2"])
def test_a_draft_with_a_shorter_context_stops_drafting_at_it(pair, draft_kind):
    # The target's context (128) bounds the sequences, not the draft's (16): a row drafts while
    # its draft inputs lie below 16, then the target goes on alone; a prompt past 16 is taken.
    # (Before: the smaller context cut generate and even generate_target_only short.)
    # GPT-2 has absolute position embeddings: a position past 15 would not even index them.
    _, target = pair
    if draft_kind == "llama":
        draft = _llama(32, 32, 1, 0.2, seed=1, max_pos=16)
    else:
        draft = _gpt2(16, seed=1)
    dec = SpeculativeDecoder(draft=draft, target=target)
    prompts = [[1, 2, 3], list(range(1, 21)), [5] * 14, [7] * 15, [9] * 16]
    dc = _CountingForward(dec, "draft")
    try:
        res = dec.generate(prompts, max_new_tokens=24, num_draft_tokens=3)
    finally:
        dc.restore()
    assert dc.calls and all(int(pos.max()) <= 15 for _, _, pos in dc.calls)
    for p, got in zip(prompts, res.token_ids):
        ref = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=24, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref
    assert res.finish_reasons == ["length"] * 5 and res.stats.drafted_tokens > 0
    only = dec.generate_target_only([[1, 2, 3]], max_new_tokens=40)
    assert len(only.token_ids[0]) == 40 and only.finish_reasons == ["length"]
    # A prompt past the draft's context: no draft forward at all, the target's tokens.
    dc = _CountingForward(dec, "draft")
    try:
        long = dec.generate([list(range(1, 21))], max_new_tokens=6, num_draft_tokens=3)
    finally:
        dc.restore()
    assert dc.calls == [] and long.stats.drafted_tokens == 0
    assert long.token_ids[0] == res.token_ids[1][:6]
    # A step drafts only if some row may verify a draft: here the short row's budget and the long
    # row's position leave none in the second step (before: K = 3 with every K_b = 0 there).
    two = dec.generate([[1, 2, 3], list(range(1, 21))], max_new_tokens=5, num_draft_tokens=3)
    assert all(h["k"] == 0 or max(h["num_draft"]) > 0 for h in two.stats.history), two.stats.history
    # Sampling: each row decoded alone gives its tokens in the batch.
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=1.0, seed=7)
    batch = dec.generate(prompts, **kw)
    for i, p in enumerate(prompts):
        assert dec.generate([p], **dict(kw, seed=7 + i)).token_ids[0] == batch.token_ids[i]


def test_unusable_devices_are_refused_by_name(pair, capsys, monkeypatch):
    # a CUDA device on a machine (or a torch) without one: a ValueError naming it, not the
    # AssertionError from deep inside Module.to; a misspelt device: the same kind of error
    draft, target = pair
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device 'cuda' is not available: torch .* finds no CUDA GPU$"):
        SpeculativeDecoder(draft=draft, target=target, device="cuda")
    with pytest.raises(ValueError, match=r"^device must be a torch.device or a device name such as 'cpu' or "
                                         r"'cuda:0', got 'gpu0'$"):
        SpeculativeDecoder(draft=draft, target=target, device="gpu0")
    assert next(target.parameters()).device.type == "cpu"  # nothing moved
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--tiny-random", "--device", "cuda:1"])
    assert e.value.code == 2
    assert "device 'cuda:1' is not available" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^device 'cuda:1' is not available: torch finds 1 CUDA GPU\(s\)$"):
        SpeculativeDecoder(draft=draft, target=target, device="cuda:1")
    # other device types: only CUDA was checked before
    with pytest.raises(ValueError, match=r"^device 'meta' holds no data: models cannot run there$"):
        SpeculativeDecoder(draft=draft, target=target, device="meta")
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        with pytest.raises(ValueError, match=r"^device 'xpu' is not available: "):
            SpeculativeDecoder(draft=draft, target=target, device="xpu")
    assert next(target.parameters()).device.type == "cpu"


def test_load_pair_from_paths(tiny, tmp_path):
    dec, tok = tiny
    for name, model in (("draft", dec.draft), ("target", dec.target)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    loaded = SpeculativeDecoder(draft=str(tmp_path / "draft"), target=str(tmp_path / "target"), dtype="float32")
    a = loaded.generate(["hello"], max_new_tokens=10)
    b = dec.generate(["hello"], max_new_tokens=10)
    assert a.texts == b.texts and a.token_ids == b.token_ids


# ----------------------------------------------------------------------------------------------
# Pieces: warp, draft random numbers, stats
# ----------------------------------------------------------------------------------------------
def test_warp_probs_matches_the_verifier_semantics():
    g = torch.Generator().manual_seed(0)
    B, V = 64, 17
    logits = (torch.randn(B, V, generator=g) * 2).round(decimals=0)  # many ties
    temp = torch.rand(B, generator=g) + 0.3
    top_k = torch.randint(0, V + 3, (B,), generator=g)
    top_p = torch.rand(B, generator=g).clamp(min=0.05)
    top_p[::4] = 1.0
    ours = warp_probs(logits, temp, top_k, top_p)
    s, keep = reference.warp_logits(logits, 1.0 / temp, top_k, top_p)
    m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    e = torch.where(keep, torch.exp(s - m), 0.0)
    torch.testing.assert_close(ours, e / e.sum(-1, keepdim=True))
    for b in range(8):  # and the hand-written float64 warp
        want = _naive_warp((logits[b] / 1.0).tolist(), float(temp[b]), int(top_k[b]) if 0 < top_k[b] <= V else None,
                           float(top_p[b]))
        torch.testing.assert_close(ours[b].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5)
    # top-p's mass is renormalised over the top-k set: over {0, 1}, token 0 holds 0.73 >= 0.7, so
    # top-p keeps it alone; over the whole vocabulary (e^3 of 44.2) it would keep both.
    two = torch.tensor([[3.0, 2.0, 1.0] + [0.0] * 14])
    assert warp_probs(two, 1.0, 2, 0.7).tolist() == [[1.0] + [0.0] * 16]
    assert reference.warp_logits(two, torch.ones(1), torch.tensor([2]), torch.tensor([0.7]))[1].tolist() == \
        [[True] + [False] * 16]
    # Rows with both warps active, each cutting something, against the reference.
    k2 = torch.randint(1, V, (B,), generator=g)
    p2 = torch.rand(B, generator=g) * 0.6 + 0.3
    s2, keep2 = reference.warp_logits(logits, 1.0 / temp, k2, p2)
    e2 = torch.where(keep2, torch.exp(s2 - s2.masked_fill(~keep2, float("-inf")).amax(-1, keepdim=True)), 0.0)
    torch.testing.assert_close(warp_probs(logits, temp, k2, p2), e2 / e2.sum(-1, keepdim=True))
    # Temperature 0: one-hot at the first maximum.
    tied = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert warp_probs(tied, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_nan_draft_logits_leave_the_target_to_decode(pair):
    """A draft that emits NaN logits (top-p on, so the warp's sort/cumsum sees NaN) must not crash
    the warp (it gathered index -1 before) nor stop the row: a position without a distribution is
    not verified (K_b cut before it), so the target samples it itself.  With a draft broken at
    every position each step verifies nothing and the output is the target alone's, token for
    token (the same seeds).  (Before, such rows ended "nonfinite" with no token, the target fine.)"""
    nan_logits = torch.tensor([[float("nan"), 1.0, 2.0], [0.5, 1.0, 2.0]])
    probs = warp_probs(nan_logits, 1.0, None, 0.9)  # no IndexError
    assert bool(probs[0].isnan().all()) and torch.allclose(probs[1].sum(), torch.tensor(1.0))
    draft, target = pair
    bad = copy.deepcopy(draft)
    with torch.no_grad():
        bad.lm_head.weight[3, 0] = float("nan")  # token 3's logit is NaN at every position
    dec = SpeculativeDecoder(bad, target)
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=[5, 6])
    res = dec.generate(PROMPTS[:2], num_draft_tokens=3, **kw)
    alone = dec.generate_target_only(PROMPTS[:2], **kw)
    assert res.finish_reasons == ["length", "length"]
    assert res.token_ids == alone.token_ids and all(len(t) == 8 for t in res.token_ids)
    assert res.stats.drafted_tokens == 0 and res.stats.accepted_tokens == 0  # nothing verified
    assert all(h["num_draft"] == [0, 0] for h in res.stats.history)
    # Each step stops drafting after the first position (every row's K_b is 0): one draft forward
    # (none in the last step, where no row has room for a draft)
    assert [h["k"] for h in res.stats.history] == [1] * 7 + [0]
    assert res.stats.draft_forwards == 7


def test_draft_sampler_is_uniform_and_exact():
    B = 20000
    keys = [draft_key(s) for s in range(B)]
    lo = torch.tensor([k[0] for k in keys])
    hi = torch.tensor([k[1] for k in keys])
    u = _draft_uniforms(lo, hi, torch.full((B,), 3), 2)
    assert ((u >= 0) & (u < 1)).all()
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert sps.chisquare(counts.numpy()).pvalue > SIGNIFICANCE
    # Different draft positions and steps give unrelated numbers.
    u2 = _draft_uniforms(lo, hi, torch.full((B,), 3), 3)
    assert abs(float(torch.corrcoef(torch.stack([u, u2]))[0, 1])) < 0.05
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2]).expand(B, 4)
    x = _sample_inverse_cdf(probs, u)
    observed = torch.bincount(x, minlength=4)
    assert observed[1] == 0
    assert _chisquare_pvalue(observed, probs[0].double()) > SIGNIFICANCE


def test_draft_hash_on_the_host_equals_the_tensor_ops(monkeypatch):
    """The draft's uniforms of small CPU batches come from Python ints (_draft_hash_int), of
    large ones (and on a GPU) from tensor ops (_draft_hash), a step's positions at once: the
    same values, for random and extreme keys, steps and positions."""
    import random

    from specdec_kernels.decoding.drafters import sampling as ds

    rng = random.Random(3)
    B = 200
    keys = [draft_key(rng.choice([rng.randint(-(2**63), 2**63 - 1), 0, -1, 2**63 - 1])) for _ in range(B)]
    lo = torch.tensor([k[0] for k in keys])
    hi = torch.tensor([k[1] for k in keys])
    step = torch.tensor([rng.choice([0, 1, rng.randint(0, 2**40), 2**32 - 1, 2**32]) for _ in range(B)])
    for j in (0, 1, 7):
        tensor_ops = ds._draft_uniforms(lo, hi, step, j)  # 200 rows > _HOST_HASH_MAX
        host = torch.cat([ds._draft_uniforms(lo[i:i + 50], hi[i:i + 50], step[i:i + 50], j) for i in range(0, B, 50)])
        assert B > ds._HOST_HASH_MAX >= 50
        assert tensor_ops.dtype == host.dtype == torch.float64 and torch.equal(tensor_ops, host), j
    # A step's K positions at once (what DraftPicker draws): the same numbers, column by column, on
    # either path.
    all_k = ds._draft_uniforms_k(lo, hi, step, 8)  # [200, 8], tensor ops
    assert all_k.shape == (B, 8)
    assert torch.equal(all_k, torch.cat([ds._draft_uniforms_k(lo[i:i + 50], hi[i:i + 50], step[i:i + 50], 8)
                                         for i in range(0, B, 50)]))
    assert torch.equal(all_k[:, 7], ds._draft_uniforms(lo, hi, step, 7))
    small = ds._draft_uniforms(lo[:3], hi[:3], step[:3], 2)  # the host path
    monkeypatch.setattr(ds, "_HOST_HASH_MAX", 0)  # the same small batch through the tensor ops
    assert torch.equal(ds._draft_uniforms(lo[:3], hi[:3], step[:3], 2), small)


def test_draft_sampler_resolves_the_tail_of_a_large_vocabulary():
    """The draft must be drawn from the q the verifier is told.  With fp32 uniforms (24 bits) and
    an fp32 CDF, a token of probability below ~2^-24 was drawn with probability 0 or 2^-24, not q
    (over a 49,152-token softmax, a total variation of ~4.5e-4 between the two).  The uniforms
    now carry 53 bits and the CDF is summed in float64: a uniform inside a tiny token's interval
    draws that token, and the uniforms are not on fp32's 2^-24 grid."""
    g = torch.Generator().manual_seed(0)
    V = 49152
    q = torch.softmax(torch.randn(V, generator=g) * 3.0, -1)  # fp32, a long tail
    tiny = ((q > 0) & (q < 2.0 ** -26)).nonzero()[:, 0]
    assert len(tiny) > 100  # the tail this is about
    cdf = torch.cumsum(q.double(), 0)
    picked = tiny[torch.randperm(len(tiny), generator=g)[:64]]
    for v in picked.tolist():
        lo = float(cdf[v - 1]) if v > 0 else 0.0
        u = (lo + float(q[v]) / 2) / float(cdf[-1])  # the middle of token v's interval
        u = math.floor(u * 2.0 ** 53) / 2.0 ** 53  # on the sampler's grid
        got = _sample_inverse_cdf(q[None], torch.tensor([u], dtype=torch.float64))
        assert got.item() == v, (v, float(q[v]), got.item())
    B = 4096
    keys = [draft_key(s) for s in range(B)]
    u = _draft_uniforms(torch.tensor([k[0] for k in keys]), torch.tensor([k[1] for k in keys]), torch.full((B,), 7), 1)
    assert u.dtype == torch.float64
    scaled = u * 2.0 ** 53
    assert torch.equal(scaled, scaled.floor())  # multiples of 2^-53
    assert float((u * 2.0 ** 24 != (u * 2.0 ** 24).floor()).double().mean()) > 0.99  # below fp32's grid
    # A zero-probability token is never drawn, even where its CDF value would pass the threshold.
    z = torch.tensor([[0.25, 0.0, 0.75]])
    assert _sample_inverse_cdf(z, torch.tensor([0.25], dtype=torch.float64)).item() == 2


def test_speedup_model():
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert predicted_speedup(0.8, 4, 0.0, 1.0) == pytest.approx(expected_tokens_per_step(0.8, 4))
    assert choose_num_draft_tokens(0.9, 0.01, 1.0, 8) == 8
    assert choose_num_draft_tokens(0.1, 0.5, 1.0, 8) == 1
    k = choose_num_draft_tokens(0.7, 0.1, 1.0, 16)
    rate = lambda k: expected_tokens_per_step(0.7, k) / (k * 0.1 + 1.0)  # noqa: E731
    assert all(rate(k) >= rate(j) for j in range(1, 17))


def test_stats_are_consistent(pair):
    draft, target = pair
    res = SpeculativeDecoder(draft=draft, target=target).generate(PROMPTS, max_new_tokens=20, num_draft_tokens=4)
    s = res.stats
    assert s.iterations == len(s.history)
    assert s.row_steps == sum(len(h["rows"]) for h in s.history)
    assert s.generated_tokens == sum(len(t) for t in res.token_ids)
    assert s.accepted_tokens == sum(n * c for n, c in enumerate(s.accepted_length_histogram))
    assert s.drafted_tokens == sum(sum(h["num_draft"]) for h in s.history)
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)
    assert 0 < s.acceptance_per_position[0] <= 1
    # Per draft position, from the step history: draft i of a row-step that accepted n of its K_b
    # drafts was reached when i < min(n + 1, K_b) and accepted when i < n.
    reached, accepted = [0] * 4, [0] * 4
    for h in s.history:
        for kb, n in zip(h["num_draft"], h["accepted"]):
            for i in range(min(n + 1, kb)):
                reached[i] += 1
                accepted[i] += i < n
    last = max(i for i in range(4) if reached[i])
    assert s.acceptance_per_position == [accepted[i] / reached[i] if reached[i] else None for i in range(last + 1)]
    assert s.alpha == pytest.approx(sum(accepted) / sum(reached))
    assert s.mean_tokens_per_target_call == pytest.approx(s.generated_tokens / s.row_steps)
    assert s.draft_time_s > 0 and s.target_time_s > 0 and s.tokens_per_s > 0
    assert s.measured_speedup is None  # no baseline given
    d = s.to_dict()
    assert "history" not in d and json.dumps(d)
