"""Sequence-dependent logits processors in the speculative loop
(``specdec_kernels/decoding/transformers_adapter/processors.py``): repetition_penalty,
no_repeat_ngram_size, bad_words_ids, a ``prefix_allowed_tokens_fn`` grammar mask and processors
marked ``specdec_stateless = True``, through transformers'
``generate(custom_generate=specdec_kernels.hf.generate)`` and ``SpeculativeDecoder.generate``:
greedy token for token equal to ``target.generate`` with the same processors (batch 1 and a ragged
left-padded batch of 5); the law of the first two sampled tokens against the target's with the
processors applied to the right prefixes (chi-square on 20,000 draws, with a mutant that processes
the verify positions with the accepted prefix only and must be rejected); the ids and scores each
processor call sees (a recording processor); refusals by name.
"""

from __future__ import annotations


import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, MinLengthLogitsProcessor,
                          NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                          PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper)

from specdec_kernels import hf
from specdec_kernels.decoding.transformers_adapter import processors as logits_procs
from specdec_kernels.decoding.decoder import SpeculativeDecoder

from decoder_setup import CACHE_ATOL, CACHE_RTOL, PROMPTS, SIGNIFICANCE, _chisquare_pvalue
from decoder_setup import _one_thread, pair  # noqa: F401  (fixtures; _one_thread: autouse)
from hf_setup import _quiet  # noqa: F401  (autouse fixture)
from hf_setup import PAD, _hook, _left_padded

NEW = 20
V = 32





def _grammar(batch_id, sent):
    """A grammar mask over the last token and the row's index: a third of the vocabulary is out."""
    return [t for t in range(V) if (t - int(sent[-1]) + batch_id) % 3 != 0]


class _Shift(LogitsProcessor):
    """A user processor marked stateless: adds 2.0 to the token after each row's last one."""

    specdec_stateless = True

    def __call__(self, input_ids, scores):
        nxt = (input_ids[:, -1] + 1) % scores.shape[-1]
        return scores.scatter_add(1, nxt[:, None], torch.full_like(scores[:, :1], 2.0))


@pytest.fixture(scope="module")
def bad_words(pair):
    """Words the unconstrained greedy output of the ragged batch holds (one, two and three tokens)."""
    _, target = pair
    ids, mask = _left_padded(PROMPTS)
    T = ids.shape[1]
    with torch.inference_mode():
        free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD)
    return [[free[0, T + 1].item()], free[2, T + 3:T + 5].tolist(), free[4, T + 2:T + 5].tolist()]


def _processor_kwargs(kind: str, bad_words) -> dict:
    return {"repetition_penalty": dict(repetition_penalty=1.5),
            "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
            "bad_words_ids": dict(bad_words_ids=bad_words),
            "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=_grammar),
            "all": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=bad_words,
                        prefix_allowed_tokens_fn=_grammar, logits_processor=LogitsProcessorList([_Shift()]))}[kind]


_KINDS = ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "prefix_allowed_tokens_fn", "all"]


# ----------------------------------------------------------------------------------------------
# Greedy: token for token target.generate's output with the same processors
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", _KINDS)
def test_greedy_equals_generate_with_processors(pair, bad_words, kind):
    draft, target = pair
    kw = _processor_kwargs(kind, bad_words)
    ids, mask = _left_padded(PROMPTS)
    T = ids.shape[1]
    one = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, **kw)
        ref1 = target.generate(one, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, **kw)
        free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD)
    assert ref.tolist() != free.tolist()  # the processors change the output
    for draft_kw in (dict(assistant_model=draft, num_assistant_tokens=3), dict(prompt_lookup_num_tokens=3)):
        out = _hook(target, ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                    **draft_kw, **kw)
        assert out.tolist() == ref.tolist()
        out1 = _hook(target, one, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, **draft_kw, **kw)
        assert out1.tolist() == ref1.tolist()
    # SpeculativeDecoder.generate: the same arguments, a left-padded [B, T] batch and a list of one prompt
    dec = SpeculativeDecoder(draft=draft, target=target)
    res = dec.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_draft_tokens=4, **kw)
    assert res.token_ids == [r[T:].tolist() for r in ref]
    res1 = dec.generate([PROMPTS[2]], max_new_tokens=NEW, num_draft_tokens=2, **kw)
    assert res1.token_ids == [ref1[0, len(PROMPTS[2]):].tolist()]


def test_greedy_generation_config_fields_map_to_processors(pair, bad_words):
    draft, target = pair
    ids, mask = _left_padded(PROMPTS)
    T = ids.shape[1]
    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, repetition_penalty=1.4,
                          no_repeat_ngram_size=2, bad_words_ids=bad_words)
    with torch.inference_mode():
        ref = target.generate(ids, attention_mask=mask, generation_config=gc)
    res = SpeculativeDecoder(draft=draft, target=target).generate(ids, attention_mask=mask, generation_config=gc)
    assert res.token_ids == [r[T:].tolist() for r in ref]
    # hf.generate called as a function (no processors built by transformers): the config's fields
    out = hf.generate(target, ids, generation_config=gc, attention_mask=mask, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    with pytest.raises(ValueError, match=r"repetition_penalty=1.2 and generation_config .*in one place"):
        SpeculativeDecoder(draft=draft, target=target).generate(ids, attention_mask=mask, generation_config=gc,
                                                                repetition_penalty=1.2)


# ----------------------------------------------------------------------------------------------
# Sampling: the law of the first two tokens
# ----------------------------------------------------------------------------------------------
def _free_grammar(batch_id, sent):  # the same mask for every row (the law below has V rows of its own)
    return _grammar(0, sent)


def _processed_joint(model, prompt, temperature, top_k, penalty, grammar=True) -> torch.Tensor:
    """P(t1, t2) [V, V] float64 under transformers' own processors, in generate's order (repetition
    penalty, the grammar mask, then temperature and top-k), each applied to the prefix the token is
    sampled after: the prompt for t1, the prompt and t1 for t2."""
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)]
                                + ([PrefixConstrainedLogitsProcessor(_free_grammar, 1)] if grammar else [])
                                + [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(procs(ids, model(ids).logits[:, -1].float()), -1).double()[0]  # [V]
        ext = torch.tensor([prompt + [t] for t in range(V)])  # [V, T+1]
        p2 = torch.softmax(procs(ext, model(ext).logits[:, -1].float()), -1).double()  # [V, V]
    return p1[:, None] * p2


def _sample_counts(target, draft, prompt, n, t, k, penalty, grammar=True) -> torch.Tensor:
    torch.manual_seed(1234)
    extra = dict(prefix_allowed_tokens_fn=_free_grammar) if grammar else {}
    out = _hook(target, torch.tensor([prompt] * n), do_sample=True, temperature=t, top_k=k, max_new_tokens=2,
                pad_token_id=PAD, assistant_model=draft, num_assistant_tokens=3, repetition_penalty=penalty, **extra)
    T = len(prompt)
    return torch.bincount(out[:, T] * V + out[:, T + 1], minlength=V * V).reshape(V, V)


@pytest.mark.slow
def test_sampling_law_of_the_first_two_tokens_with_processors(pair, monkeypatch):
    """20,000 rows of one prompt: the counts of (t1, t2) against the target's law with the
    processors (chi-square, p > SIGNIFICANCE = 1e-3, fixed seed; nothing outside the support).  The
    draft (the target with noise) has its second draft accepted often, so t2 is often the bonus or
    recovered token of position 1.  Mutant: the verify positions processed with the accepted prefix
    only (not the drafts before them): rejected (tokens outside the law's support, or p < 1e-3).
    The law without the processors is rejected too."""
    draft, target = pair
    prompt, n, (t, k, penalty) = [3, 1, 4], 20_000, (0.8, 20, 1.5)
    law = _processed_joint(target, prompt, t, k, penalty)
    counts = _sample_counts(target, draft, prompt, n, t, k, penalty)
    assert counts.sum() == n and counts[law == 0].sum() == 0
    assert _chisquare_pvalue(counts, law) > SIGNIFICANCE
    plain = _processed_joint(target, prompt, t, k, 1.0)
    assert counts[plain == 0].sum() > 0 or _chisquare_pvalue(counts, plain) < SIGNIFICANCE

    monkeypatch.setattr(logits_procs, "_position_ids", lambda base, drafts, i: base)
    bad = _sample_counts(target, draft, prompt, n, t, k, penalty)
    outside = bad[law == 0].sum().item()
    assert outside > 0 or _chisquare_pvalue(bad, law) < SIGNIFICANCE


@pytest.mark.slow
def test_sampling_law_with_a_repetition_penalty_alone(pair, monkeypatch):
    """As above with repetition_penalty=3.0 only (no token is masked): the chi-square accepts the
    counts (p > 1e-3) and rejects those of the accepted-prefix-only mutant (p < 1e-3)."""
    draft, target = pair
    prompt, n, (t, k, penalty) = [3, 1, 4], 20_000, (0.8, 20, 3.0)
    law = _processed_joint(target, prompt, t, k, penalty, grammar=False)
    counts = _sample_counts(target, draft, prompt, n, t, k, penalty, grammar=False)
    assert counts[law == 0].sum() == 0 and _chisquare_pvalue(counts, law) > SIGNIFICANCE
    monkeypatch.setattr(logits_procs, "_position_ids", lambda base, drafts, i: base)
    bad = _sample_counts(target, draft, prompt, n, t, k, penalty, grammar=False)
    assert _chisquare_pvalue(bad, law) < SIGNIFICANCE


_MASKS = {  # generate's keyword -> the processor transformers builds for it
    "no_repeat_ngram_size": (2, lambda v: NoRepeatNGramLogitsProcessor(v)),
    "bad_words_ids": ([[5], [1, 2], [4, 1, 7]], lambda v: NoBadWordsLogitsProcessor(v)),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_MASKS))
def test_sampling_law_with_a_sequence_mask(pair, monkeypatch, kind):
    """n-gram blocking and bad words, each alone: 20,000 rows of a prompt ending in tokens they
    act on (the bigram (1, 4) and the words [1, 2], [4, 1, 7] are live at t1 and t2); the counts
    of (t1, t2) against the target's law under transformers' own processor (chi-square, p >
    SIGNIFICANCE = 1e-3, nothing outside the support); the accepted-prefix-only mutant is
    rejected (tokens outside the support, or p < 1e-3)."""
    draft, target = pair
    value, make = _MASKS[kind]
    prompt, n, (t, k) = [3, 1, 4, 1], 20_000, (0.8, 20)
    procs = LogitsProcessorList([make(value), TemperatureLogitsWarper(t), TopKLogitsWarper(k)])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p1 = torch.softmax(procs(ids, target(ids).logits[:, -1].float()), -1).double()[0]  # [V]
        ext = torch.tensor([prompt + [x] for x in range(V)])  # [V, T+1]
        p2 = torch.softmax(procs(ext, target(ext).logits[:, -1].float()), -1).double()  # [V, V]
    law = p1[:, None] * p2
    plain = LogitsProcessorList([TemperatureLogitsWarper(t), TopKLogitsWarper(k)])
    with torch.inference_mode():
        q1 = torch.softmax(plain(ids, target(ids).logits[:, -1].float()), -1).double()[0]
    assert float(q1[law.sum(1) == 0].sum()) > 0.01  # the mask removes real mass at t1

    def counts():
        torch.manual_seed(1234)
        out = _hook(target, torch.tensor([prompt] * n), do_sample=True, temperature=t, top_k=k, max_new_tokens=2,
                    pad_token_id=PAD, assistant_model=draft, num_assistant_tokens=3, **{kind: value})
        T = len(prompt)
        return torch.bincount(out[:, T] * V + out[:, T + 1], minlength=V * V).reshape(V, V)

    c = counts()
    assert c.sum() == n and c[law == 0].sum() == 0
    assert _chisquare_pvalue(c, law) > SIGNIFICANCE
    monkeypatch.setattr(logits_procs, "_position_ids", lambda base, drafts, i: base)
    bad = counts()
    assert bad[law == 0].sum() > 0 or _chisquare_pvalue(bad, law) < SIGNIFICANCE


# ----------------------------------------------------------------------------------------------
# What each call sees
# ----------------------------------------------------------------------------------------------
class _Recording(LogitsProcessor):
    specdec_stateless = True

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        return scores


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_positions_see_their_prefixes(pair, temperature):
    """Each call's rows: the scores are the target's logits after exactly those ids (a fresh
    forward of the row alone), or, for the draft model's calls, the draft's; so every verify
    position is processed with its own prefix (the row's tokens, then the drafts before it);
    every emitted token came from a target position whose ids were the prompt and the tokens
    emitted before it; and some target positions held drafts that were not all emitted."""
    draft, target = pair
    rec = _Recording()
    dec = SpeculativeDecoder(draft=draft, target=target)
    res = dec.generate([list(p) for p in PROMPTS], max_new_tokens=10, num_draft_tokens=3, temperature=temperature,
                       seed=3, logits_processor=LogitsProcessorList([rec]))
    seen, drafted = set(), 0
    with torch.inference_mode():
        for ids, scores in rec.calls:
            assert ids.dim() == 2 and scores.shape == (ids.shape[0], V)
            t, d = target(ids).logits[:, -1].float(), draft(ids).logits[:, -1].float()
            for r in range(ids.shape[0]):
                if torch.allclose(scores[r], t[r], atol=CACHE_ATOL, rtol=CACHE_RTOL):
                    seen.add(tuple(ids[r].tolist()))
                else:
                    torch.testing.assert_close(scores[r], d[r], atol=CACHE_ATOL, rtol=CACHE_RTOL)
                    drafted += 1
    emitted = {tuple(p + g[:j]) for p, g in zip(PROMPTS, res.token_ids) for j in range(len(g))}
    assert emitted <= seen
    assert seen - emitted  # positions after drafts that were not all emitted (rejections, cut rows)
    assert drafted > 0  # the draft model applies the processors too


def test_the_draft_applies_the_processors(pair, monkeypatch):
    """With the grammar mask on the draft its drafts are accepted more often than without (the
    draft model proposing unconstrained); the tokens are the same (greedy) either way."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    kw = dict(max_new_tokens=16, num_draft_tokens=4, prefix_allowed_tokens_fn=_grammar, repetition_penalty=1.5)
    on = dec.generate([list(p) for p in PROMPTS], **kw)
    monkeypatch.setattr(logits_procs.VerifyProcessors, "draft_scores", lambda self, logits, *a: logits)
    off = dec.generate([list(p) for p in PROMPTS], **kw)
    assert on.token_ids == off.token_ids
    assert on.stats.acceptance_rate > off.stats.acceptance_rate + 0.2
    # a draft vocabulary (the draft scores some tokens only): the draft proposes without them
    monkeypatch.undo()
    sub = SpeculativeDecoder(draft=draft, target=target, draft_vocab=list(range(0, V, 2)))
    assert sub.generate([list(p) for p in PROMPTS], **kw).token_ids == on.token_ids


def test_prefix_constraint_gets_the_row_index(pair):
    """``batch_id`` is the row's index in the batch, as in generate, even in a call of some rows."""
    draft, target = pair
    got = []

    def fn(batch_id, sent):
        got.append((batch_id, tuple(sent.tolist())))
        return list(range(V))

    dec = SpeculativeDecoder(draft=draft, target=target)
    dec.generate([list(p) for p in PROMPTS], max_new_tokens=6, num_draft_tokens=2, prefix_allowed_tokens_fn=fn)
    assert {b for b, _ in got} == set(range(len(PROMPTS)))
    assert all(s[:len(PROMPTS[b])] == tuple(PROMPTS[b]) for b, s in got)


# ----------------------------------------------------------------------------------------------
# Refusals: each names the processor
# ----------------------------------------------------------------------------------------------
class _Unmarked(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


def test_refused_processors_are_named(pair):
    draft, target = pair
    ids = torch.tensor([[1, 2, 3]])
    kw = dict(max_new_tokens=4, pad_token_id=PAD, assistant_model=draft)
    dec = SpeculativeDecoder(draft=draft, target=target)
    for proc in (_Unmarked(), MinLengthLogitsProcessor(10, 5)):  # a minimum still ahead of the 3-token input
        name = type(proc).__name__
        with pytest.raises(ValueError, match=rf"logits_processor {name} is not supported .*specdec_stateless"):
            _hook(target, ids, logits_processor=LogitsProcessorList([proc]), **kw)
        with pytest.raises(ValueError, match=rf"logits_processor {name} is not supported"):
            dec.generate([[1, 2, 3]], max_new_tokens=4, logits_processor=LogitsProcessorList([proc]))
    marked = _Unmarked()
    marked.specdec_stateless = True  # an instance may opt in too
    assert dec.generate([[1, 2, 3]], max_new_tokens=4, logits_processor=[marked]).token_ids
    with pytest.raises(ValueError, match="logits_processor TemperatureLogitsWarper: pass temperature="):
        dec.generate([[1, 2, 3]], max_new_tokens=4, logits_processor=[TemperatureLogitsWarper(0.5)])
    with pytest.raises(ValueError, match="logits_processor _Shift comes after a warper"):
        hf.generate(target, ids, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5), _Shift()]),
                    generation_config=GenerationConfig(do_sample=True, max_new_tokens=4), assistant_model=draft)
    with pytest.raises(ValueError, match="PrefixConstrainedLogitsProcessor must have num_beams=1"):
        dec.generate([[1, 2, 3]], max_new_tokens=4,
                     logits_processor=[PrefixConstrainedLogitsProcessor(_grammar, 2)])
    for field, value in (("sequence_bias", {(3,): 1.0}), ("encoder_repetition_penalty", 1.1),
                         ("suppress_tokens", [4])):
        with pytest.raises(ValueError, match=rf"generation_config\.{field} asks for "):
            _hook(target, ids, **{field: value}, **kw)
