"""A draft over another tokenizer (drafters/cross.py, drafters/token_strings.py): greedy output
equals the target's, the law of the first two sampled tokens is the target's for both ways of
proposing (chi-square, fails below SIGNIFICANCE with fixed seeds), two mutants are caught, seeded
rows are batch-invariant, the draft's cache holds what it says, and bad input is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cross_setup import ALPHABET, MISSING, cross_pair
from decoder_setup import (SIGNIFICANCE, _assert_row_cache, _chisquare_pvalue, _first_two_joint,  # noqa: F401
                           _one_thread)
from specdec_kernels import SpeculativeDecoder
from specdec_kernels.decoding.drafters import cross
from specdec_kernels.decoding.drafters.base import Drafts
from specdec_kernels.decoding.drafters.token_strings import extendable, intersect, token_keys

PROMPTS = ["abc def", "g", "a. b. c. d. e", "hij klm nop", "ponm"]  # "o", "p": no draft token


@pytest.fixture(scope="module")
def xpair():
    return cross_pair()


def _ids(tt, texts):
    return [tt(t)["input_ids"] for t in texts]


def _decoder(xpair, vocabulary, drafter_class=None):
    draft, target, dt, tt = xpair
    dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=dt, vocabulary=vocabulary)
    if drafter_class is not None:
        drafter = drafter_class(dec.parts.draft_runner, dt, tt, vocabulary, dec.vocab_size)
        dec.parts = dataclasses.replace(dec.parts, drafter=drafter)  # the same parts, another drafter
    return dec


# ----------------------------------------------------------------------------------------------
# What each token writes, and the intersection
# ----------------------------------------------------------------------------------------------
def test_the_pair_tokenizes_differently(xpair):
    _, _, dt, tt = xpair
    assert dt.tokenize("abcd efg") == ["abcd", " ", "e", "fg"]
    assert len(tt("abcd efg")["input_ids"]) == 8
    assert dt.convert_ids_to_tokens(dt("op")["input_ids"]) == ["<unk>", "<unk>"]


def test_intersection_pairs_tokens_that_write_the_same(xpair):
    draft, target, dt, tt = xpair
    inter = intersect(dt, tt, draft.config.vocab_size, target.config.vocab_size)
    pairs = {dt.convert_ids_to_tokens(d): tt.convert_ids_to_tokens(t)
             for d, t in zip(inter.draft_ids.tolist(), inter.target_ids.tolist())}
    assert all(a == b for a, b in pairs.items())
    chars = set(ALPHABET) - set(MISSING)
    assert chars <= set(pairs)  # every character the draft writes; no merge ("abcd") and no "o", "p"
    assert "abcd" not in pairs and "o" not in pairs.values()
    assert inter.target_to_draft.shape == (target.config.vocab_size,)
    assert (inter.target_to_draft[inter.target_ids] == inter.draft_ids).all()
    assert (inter.target_to_draft >= 0).sum() == inter.size


def _byte_level_tokenizer(vocab: dict) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_token_keys_read_byte_level_and_sentencepiece_spellings():
    byte_level = _byte_level_tokenizer({"\u0120the": 0, "\u010a": 1, "a": 2})  # " the", "\n", "a"
    assert token_keys(byte_level) == [("text", b" the"), ("text", b"\n"), ("text", b"a")]
    sp = Tokenizer(models.BPE(vocab={"\u2581the": 0, "<0x0A>": 1, "a": 2}, merges=[]))
    sp = PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>")  # </s> is added: id 3
    assert token_keys(sp) == [("text", b" the"), ("text", b"\n"), ("text", b"a"), ("special", "</s>")]
    assert token_keys(sp, 5)[4] is None  # an output row past the tokenizer
    inter = intersect(byte_level, sp, 3, 4)
    assert inter.draft_ids.tolist() == [0, 1, 2] and inter.target_ids.tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------------------------
# Greedy: the target's own tokens
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocabulary", ["string", "intersection", "auto"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_generate(xpair, vocabulary, k):
    _, target, _, tt = xpair
    dec = _decoder(xpair, vocabulary)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, temperature=0.0)
    for ids, got in zip(_ids(tt, PROMPTS), res.token_ids):
        with torch.inference_mode():
            ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, pad_token_id=0)
        assert got == ref[0, len(ids):].tolist()[:len(got)]
        assert len(got) == 24 or got[-1] == tt.eos_token_id
    assert res.stats.vocabulary in ("string", "intersection")
    assert res.stats.accepted_tokens > 0  # the drafts reach the target and some are kept
    if vocabulary != "auto":
        assert res.stats.vocabulary == vocabulary


# ----------------------------------------------------------------------------------------------
# The law of the first two sampled tokens
# ----------------------------------------------------------------------------------------------
N_DRAWS = 4000


def _joint_counts(dec, prompt_text, tt, V, **kw):
    """The first two tokens of N_DRAWS rows, with 3 new tokens each: the first step verifies K = 2
    drafts (the budget leaves room for 2), so both draft positions' q reach the law."""
    res = dec.generate([prompt_text] * N_DRAWS, max_new_tokens=3, num_draft_tokens=3, seed=11, **kw)
    assert res.stats.drafted_tokens > 0 and res.stats.accepted_tokens > 0
    assert res.stats.history[0]["k"] == 2
    counts = torch.zeros(V * V, dtype=torch.float64)
    for t in res.token_ids:
        if len(t) >= 2:
            counts[t[0] * V + t[1]] += 1
        else:  # an EOS first: the pair (eos, -) gets the first token's cell in the law below
            counts[t[0] * V + t[0]] += 1
    return counts, res


def _law(target, tt, prompt_text, temperature, top_p):
    joint = _first_two_joint(target, tt(prompt_text)["input_ids"], temperature, None, top_p)  # [V, V]
    eos = tt.eos_token_id
    V = joint.shape[0]
    law = joint.clone()
    law[eos] = 0  # a row that emits EOS first stops: all its mass in the (eos, eos) cell
    law[eos, eos] = joint[eos].sum()
    return law.flatten(), V


SETTINGS = [(1.0, None), (0.7, 0.9)]


@pytest.mark.parametrize("vocabulary", ["string", "intersection"])
@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_first_two_tokens_follow_the_target(xpair, vocabulary, temperature, top_p):
    _, target, _, tt = xpair
    prompt = "abc de"
    law, V = _law(target, tt, prompt, temperature, top_p)
    counts, res = _joint_counts(_decoder(xpair, vocabulary), prompt, tt, V, temperature=temperature, top_p=top_p)
    assert res.stats.vocabulary == vocabulary
    assert counts[law == 0].sum() == 0
    assert _chisquare_pvalue(counts, law) > SIGNIFICANCE


class _UnnormalisedQ(cross.CrossVocabDrafter):
    """Mutant: q not renormalised over the intersection (as if its mass were 0.6 of the draft's)."""

    def draft(self, st, K):
        d = super().draft(st, K)
        return d if d.probs is None else d._replace(probs=d.probs * 0.6)


class _DraftQForStrings(cross.CrossVocabDrafter):
    """Mutant: string-level drafts verified with the draft's q at the same characters, as if it
    were theirs (its q over the shared tokens, put on the target's ids)."""

    def _string_drafts(self, st, encs, d_host, num, K, forwards, q=None):
        d = super()._string_drafts(st, encs, d_host, num, K, forwards, q)
        if q is None or d.tokens.shape[1] == 0:
            return d
        inter = intersect(self.draft_tokenizer, self.target_tokenizer, self.runner.vocab_size, self.target_vocab_size)
        t2d = inter.target_to_draft.to(q.device)
        width = d.tokens.shape[1]
        Qd = q[:, :width]  # the draft's positions, taken as the target's
        Qt = torch.where(t2d[None, None, :] >= 0, Qd.gather(2, t2d.clamp(min=0)[None, None, :].expand(
            Qd.shape[0], width, -1)), 0.0)
        return Drafts(d.tokens, Qt, d.num, d.forwards)


@pytest.mark.slow
@pytest.mark.parametrize("vocabulary,mutant", [("intersection", _UnnormalisedQ), ("string", _DraftQForStrings)])
def test_mutants_are_caught(xpair, vocabulary, mutant):
    _, target, _, tt = xpair
    prompt = "abc de"
    law, V = _law(target, tt, prompt, 1.0, None)
    counts, _ = _joint_counts(_decoder(xpair, vocabulary, mutant), prompt, tt, V, temperature=1.0)
    assert _chisquare_pvalue(counts, law) < SIGNIFICANCE


# ----------------------------------------------------------------------------------------------
# Batch invariance, the draft's cache, and its choice
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocabulary", ["string", "intersection", "auto"])
def test_seeded_rows_are_batch_invariant(xpair, vocabulary):
    dec = _decoder(xpair, vocabulary)
    kw = dict(max_new_tokens=12, num_draft_tokens=3, temperature=1.0, top_p=0.9)
    batch = dec.generate(PROMPTS, seed=5, **kw)
    for i, p in enumerate(PROMPTS):
        assert dec.generate([p], seed=5 + i, **kw).token_ids[0] == batch.token_ids[i]


class _Checked(cross.CrossVocabDrafter):
    """After each verify, every row's draft cache holds its held ids (a fresh forward's keys and values)."""

    checked = 0

    def after_verify(self, st, out, feats, n, n_host, K):
        super().after_verify(st, out, feats, n, n_host, K)
        s = st.draft
        for b in range(len(st.rows)):
            if not s.stopped[b]:
                _assert_row_cache(s.cache, b, s.cache_len_host[b], self.runner.model, s.held[b])
                type(self).checked += 1


@pytest.mark.parametrize("vocabulary", ["string", "intersection"])
def test_draft_cache_holds_the_draft_ids_it_says(xpair, vocabulary):
    dec = _decoder(xpair, vocabulary, _Checked)
    _Checked.checked = 0
    dec.generate(PROMPTS, max_new_tokens=10, num_draft_tokens=3, temperature=1.0)
    assert _Checked.checked > len(PROMPTS)


def _string_drafter(draft_tok, target_tok):
    """A CrossVocabDrafter at the string level over these tokenizers, without a model (for
    ``_string_drafts`` alone)."""
    d = object.__new__(cross.CrossVocabDrafter)
    d.draft_tokenizer, d.target_tokenizer, d.target_vocab_size = draft_tok, target_tok, len(target_tok)
    d.extendable = extendable(token_keys(target_tok))
    return d


@pytest.mark.parametrize("drafted,proposed", [
    ("a", ["a"]),  # the only proposal, though text that follows may merge into it: kept
    ("ab", ["ab"]),  # one target token ("ab" begins "abcd"): kept
    ("fa", ["f"]),  # "a" after "f" may merge: dropped, "f" stays
    ("e fg", ["e ", "fg"]),  # neither begins a longer target token
])
def test_string_drafts_propose_a_lone_token_that_text_may_extend(drafted, proposed):
    """Greedy K = 1 at the string level proposes its one target token even where later text
    could merge into it (dropping it left num_draft_tokens="auto", which tries K = 1, a string
    drafter that never proposed anything).  The target here is the BPE with merges, the draft
    the character tokenizer."""
    from types import SimpleNamespace

    from cross_setup import draft_tokenizer, target_tokenizer

    chars, bpe = target_tokenizer(), draft_tokenizer()
    d = _string_drafter(chars, bpe)
    context = "g "
    st = SimpleNamespace(rows=[0], seqs=[bpe(context)["input_ids"]], device=torch.device("cpu"),
                         hooks=SimpleNamespace(grammar=None))
    encs = [chars(context)["input_ids"]]
    ids = chars(drafted)["input_ids"]
    out = d._string_drafts(st, encs, [ids], [len(ids)], 4, len(ids))
    assert bpe.convert_ids_to_tokens(out.tokens[0, :int(out.num[0])].tolist()) == proposed


def test_the_draft_time_after_k0_steps_is_not_a_typical_one(xpair, monkeypatch):
    """The forwards a step reports include the sync's, and the first draft after K = 0 steps
    (whose sync feeds what they emitted) is reported as not typical, so that the recorder's time
    per draft forward, which num_draft_tokens="auto" reads, is the typical step's."""
    from specdec_kernels.decoding import loop
    from specdec_kernels.decoding.stats import StatsRecorder

    dec = _decoder(xpair, "string")
    plan = iter([3, 0, 0, 3, 3, 0, 3] + [3] * 50)
    monkeypatch.setattr(loop, "choose_k", lambda parts, st: next(plan))
    seen = []
    real = StatsRecorder.record_times

    def record(self, t_draft_total, n_draft_forwards, t_target, first_step, k=None, draft_typical=True):
        seen.append((n_draft_forwards, draft_typical))
        return real(self, t_draft_total, n_draft_forwards, t_target, first_step, k=k, draft_typical=draft_typical)

    monkeypatch.setattr(StatsRecorder, "record_times", record)
    dec.generate(PROMPTS[:1], max_new_tokens=12)
    # steps: K = 3, 0, 0, 3 after waiting, 3, 0, 3 after waiting; a drafting step runs the
    # sync's forward (4) unless the draft already holds all of the row's text but its last token (3)
    assert [typical for _, typical in seen[:7]] == [True, True, False, False, True, True, False]
    assert [n for n, _ in seen[:7]] in ([4, 0, 0, 4, 3, 0, 4], [4, 0, 0, 4, 4, 0, 4])


def test_auto_takes_the_intersection_when_it_holds_the_mass(xpair, monkeypatch):
    dec = _decoder(xpair, "auto")
    assert dec.generate(PROMPTS[:2], max_new_tokens=4).stats.vocabulary == "string"  # greedy
    assert dec.generate(PROMPTS[:2], max_new_tokens=4, temperature=1.0).stats.vocabulary == "intersection"
    monkeypatch.setattr(cross, "AUTO_MIN_MASS", 1.01)  # no mass is enough: the string level
    assert dec.generate(PROMPTS[:2], max_new_tokens=4, temperature=1.0).stats.vocabulary == "intersection"
    dec = _decoder(xpair, "auto")  # (decided once per drafter, above)
    res = dec.generate(PROMPTS[:2], max_new_tokens=4, temperature=1.0)
    assert res.stats.vocabulary == "string" and res.stats.intersection_size == dec.parts.drafter.intersection.size
    assert dec.generate_target_only(PROMPTS[:1], max_new_tokens=2).stats.vocabulary is None


def test_a_row_past_the_drafts_context_decodes_alone(xpair):
    draft, target, dt, tt = xpair
    dec = _decoder(xpair, "string")
    dec.parts.drafter.runner.context = 12  # the draft reads 12 tokens at most: the long prompt drafts nothing
    prompts = ["ab", "abc def ghi jklm"]
    res = dec.generate(prompts, max_new_tokens=8, num_draft_tokens=3)
    for ids, got in zip(_ids(tt, prompts), res.token_ids):
        with torch.inference_mode():
            ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=0)
        assert got == ref[0, len(ids):].tolist()[:len(got)]
    # every row past it: the draft retires after one forward-free step, the target decodes alone
    dec.parts.drafter.runner.context = 3  # "ab" is one draft token: 1 + K = 4 > 3
    res = dec.generate(prompts, max_new_tokens=8, num_draft_tokens=3)
    assert res.stats.draft_forwards == 0 and res.stats.drafted_tokens == 0
    assert [k for k in (h["k"] for h in res.stats.history)] == [0] * res.stats.iterations


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------
def test_bad_input_is_refused_in_one_line(xpair):
    draft, target, dt, tt = xpair
    with pytest.raises(TypeError, match="draft_tokenizer must be a tokenizer or its path, got int"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=3)
    with pytest.raises(ValueError, match="vocabulary must be one of .*got 'union'"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=dt, vocabulary="union")
    with pytest.raises(ValueError, match="needs the draft's tokenizer"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, vocabulary="string")
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        SpeculativeDecoder(draft=draft, target=target, draft_tokenizer=dt, vocabulary="intersection")
    with pytest.raises(ValueError, match="same vocabulary with vocabulary='shared'"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=dt, vocabulary="shared")
    with pytest.raises(ValueError, match="draft_vocab applies to a draft over the target's vocabulary"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=dt, draft_vocab=[1, 2])
    with pytest.raises(ValueError, match="tree drafting needs a draft over the target's vocabulary"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=dt, tree=[2, 1])
    specials_only = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={}, merges=[])),
                                            eos_token="</s>")
    with pytest.raises(ValueError, match="draft_tokenizer must write text for the draft's tokens, got a "
                                         ".* none of whose 23 ids is a token with text"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=specials_only)
    disjoint = _byte_level_tokenizer({"\u0120zz": 0, "yy": 1})
    with pytest.raises(ValueError, match="vocabulary='intersection' needs tokens .* got none in common"):
        SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=disjoint,
                           vocabulary="intersection")


# ----------------------------------------------------------------------------------------------
# transformers' generate(custom_generate=...)
# ----------------------------------------------------------------------------------------------
def test_hf_generate_with_a_foreign_assistant(xpair, tmp_path):
    """Models loaded from directories: transformers drops tokenizer= and assistant_tokenizer=
    before calling the callable, so they come from the models' directories; passed directly to
    hf.generate they are used as given.  Greedy: the target's own tokens, for a padded batch."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from specdec_kernels import hf

    draft, target, dt, tt = xpair
    for name, m, tok in (("draft", draft, dt), ("target", target, tt)):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    d2 = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    t2 = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    batch = tt(["abc def", "g"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        ref = [t2.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10, pad_token_id=0)[0, len(ids):]
               for ids in _ids(tt, ["abc def", "g"])]
        out = t2.generate(**batch, custom_generate=hf.generate, assistant_model=d2, tokenizer=tt,
                          assistant_tokenizer=dt, do_sample=False, max_new_tokens=10, pad_token_id=0)
        gc = GenerationConfig(max_new_tokens=10, pad_token_id=0, do_sample=False)
        direct = hf.generate(target, batch["input_ids"], generation_config=gc,
                             attention_mask=batch["attention_mask"], assistant_model=draft, tokenizer=tt,
                             assistant_tokenizer=dt)
    T = batch["input_ids"].shape[1]
    for b in range(2):
        assert out[b, T:].tolist() == ref[b].tolist()[:10]
        assert direct[b, T:].tolist() == ref[b].tolist()[:10]
    with pytest.raises(ValueError, match="needs both tokenizers, got none for tokenizer="):
        hf.generate(target, batch["input_ids"], generation_config=gc, attention_mask=batch["attention_mask"],
                    assistant_model=d2)
    with pytest.raises(ValueError, match="needs both tokenizers, got none for assistant_tokenizer="):
        hf.generate(t2, batch["input_ids"], generation_config=gc, attention_mask=batch["attention_mask"],
                    assistant_model=draft, tokenizer=tt)


def test_cli_drafts_across_tokenizers(xpair, tmp_path):
    """specdec generate --draft DIR --target DIR: each brings its own tokenizer; --vocabulary picks."""
    import subprocess
    import sys

    draft, target, dt, tt = xpair
    for name, m, tok in (("draft", draft, dt), ("target", target, tt)):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    cmd = [sys.executable, "-m", "specdec_kernels", "generate", "abc def", "--draft", str(tmp_path / "draft"),
           "--target", str(tmp_path / "target"), "--max-new-tokens", "8", "--vocabulary", "string"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "draft vocabulary: string" in out.stdout
    bad = subprocess.run(cmd[:-2] + ["--vocabulary", "shared"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "same vocabulary with vocabulary='shared'" in bad.stderr
