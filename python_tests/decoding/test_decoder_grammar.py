"""``generate(..., grammar=...)``: structured output, exact (``decoding/grammar.py``, xgrammar).

1. Greedy: the same ids as ``target.generate`` with xgrammar's own transformers logits processor on
   the same JSON schema, on the embedded pair and its feature draft, batch 1 and a ragged batch.
2. Law: a tiny character-level pair and a regex whose masks differ along the prefix; the joint law
   of the first three tokens against the masked target's, computed exactly (chi-square,
   significance 1e-4, 6,000 rows), with three mutants the statistic must reject: position 0's mask
   applied at every position, the bonus position left unmasked, and the draft drawing without the
   grammar while reporting the masked q.
3. Every output of 200 sampled generations (T = 1) of a nested JSON schema parses and validates.
4. Arguments: what is refused, by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cross_setup import target_tokenizer
from helpers import chi_square_pvalue
from specdec_kernels import SpeculativeDecoder, models
from specdec_kernels.decoding import grammar as G
from specdec_kernels.models.tiny import perturbed, tiny_llama

xgr = pytest.importorskip("xgrammar")

SIGNIFICANCE = 1e-4
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "population": {"type": "integer"}}, "required": ["city", "population"]}


@pytest.fixture(scope="module")
def embedded():
    return models.default_pair()


def _hf_reference(target, tok, prompts, schema, max_new):
    from xgrammar.contrib.hf import LogitsProcessor

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=target.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        out = target.generate(**enc, do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                              logits_processor=[LogitsProcessor([compiled] * len(prompts))])
    return [row[enc["input_ids"].shape[1]:].tolist() for row in out]


def _assert_same(res, refs, eos: int, max_new: int):
    for b, (mine, ref) in enumerate(zip(res.token_ids, refs)):
        assert mine == ref[:len(mine)], b
        assert (res.finish_reasons[b] == "eos" and mine[-1] == eos) or len(mine) == max_new, (b, res.finish_reasons)


@pytest.mark.slow
@pytest.mark.parametrize("feature", [False, True])
def test_greedy_equals_target_generate_with_xgrammars_processor(embedded, feature):
    draft, target, tok = embedded
    dec = (SpeculativeDecoder(drafter="feature") if feature else SpeculativeDecoder(draft, target, tok))
    prompts = ["The largest city in France, as JSON:", "Data:", "A city record in JSON format follows."]
    for batch in (prompts[:1], prompts):
        refs = _hf_reference(dec.target, dec.tokenizer, batch, CITY, 20)
        res = dec.generate(batch, max_new_tokens=20, grammar=CITY)
        _assert_same(res, refs, dec.tokenizer.eos_token_id, 20)
        for text, reason in zip(res.texts, res.finish_reasons):
            if reason == "eos":
                json.loads(text)


@pytest.fixture
def draft_verdicts(monkeypatch):
    """[bool]: for every draft the verify reads under a grammar, whether the grammar allows it where
    it stands (from the masks ``RowGrammars.verify_bitmask`` fills for the verify)."""
    from specdec_kernels.ops.verify.bitmask import allowed_tokens

    verdicts = []
    fill = G.RowGrammars.verify_bitmask

    def checked(self, drafts, kb_host, rows, generated, K):
        mask = fill(self, drafts, kb_host, rows, generated, K)
        keep = allowed_tokens(mask.cpu(), self.vocab_size)
        verdicts.extend(bool(keep[b, i, drafts[b][i]]) for b in range(len(rows)) for i in range(kb_host[b]))
        return mask

    monkeypatch.setattr(G.RowGrammars, "verify_bitmask", checked)
    return verdicts


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "feature", "prompt_lookup"])
def test_every_draft_is_one_the_grammar_allows(embedded, drafter, draft_verdicts):
    """The drafters draft under the grammar: every draft the verify reads is allowed where it
    stands (a draft model and a feature draft mask their logits, prompt lookup cuts its proposals
    at the first forbidden token), and the ids are still the target's."""
    draft, target, tok = embedded
    verdicts = draft_verdicts
    dec = {"model": lambda: SpeculativeDecoder(draft, target, tok),
           "feature": lambda: SpeculativeDecoder(drafter="feature"),
           "prompt_lookup": lambda: SpeculativeDecoder(target=target, tokenizer=tok,
                                                       drafter="prompt_lookup")}[drafter]()
    prompts = ['Cities: {"city": "Lyon", "population": 513275} {"city": "Nice", "population": 342669}. Next:',
               'A city record in JSON format follows: {"city": "Rome", "population": 2761632}']
    refs = _hf_reference(dec.target, dec.tokenizer, prompts, CITY, 24)
    res = dec.generate(prompts, max_new_tokens=24, grammar=CITY, num_draft_tokens=4)
    _assert_same(res, refs, dec.tokenizer.eos_token_id, 24)
    assert len(verdicts) >= 10 and all(verdicts), (len(verdicts), verdicts.count(False))


@pytest.mark.parametrize("vocabulary", ["intersection", "string"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_over_another_tokenizer_drafts_under_the_grammar(vocabulary, temperature, draft_verdicts):
    """Across tokenizers: the intersection drafts the shared tokens the grammar allows (its logits
    masked), the string level cuts its proposals at the first forbidden token; every draft the
    verify reads is allowed, greedy ids are the target's alone under the same grammar, and every
    output matches the regex."""
    import re

    from cross_setup import cross_pair

    draft, target, dt, tt = cross_pair(noise=0.02)
    dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tt, draft_tokenizer=dt, vocabulary=vocabulary)
    pattern = "[a-h ]+[.]"
    prompts = ["abcd efgh abcd ef", "hgfe dcba", "a b c d e"]
    res = dec.generate(prompts, max_new_tokens=16, num_draft_tokens=4, temperature=temperature, seed=3,
                       grammar=G.regex(pattern))
    if temperature == 0.0:
        alone = dec.generate_target_only(prompts, max_new_tokens=16, temperature=0.0, grammar=G.regex(pattern))
        assert res.token_ids == alone.token_ids
    for text, reason in zip(res.texts, res.finish_reasons):
        assert re.fullmatch("[a-h ]*[.]?", text) and (reason != "eos" or re.fullmatch(pattern, text)), (text, reason)
    assert len(draft_verdicts) >= 10 and all(draft_verdicts), (len(draft_verdicts), draft_verdicts.count(False))


# --- the law ---------------------------------------------------------------------------------------
REGEX = "[a-d][a-d]?[e-h]+"  # position 0: a-d; 1: a-h; 2: e-h, or EOS after one of e-h
N_ROWS = 6_000


@pytest.fixture(scope="module")
def chars():
    tok = target_tokenizer()
    target = tiny_llama(len(tok), 32, 2, 0.3, seed=11, eos_token_id=tok.eos_token_id)
    draft = perturbed(target, 0.1, seed=12)
    return SpeculativeDecoder(draft=draft, target=target, tokenizer=tok), tok


def _masked_joint(dec, tok, prompt: list) -> dict:
    """{(t1, t2, t3): probability} of the first three tokens under the target masked by REGEX (T = 1)."""
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=dec.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    eos = tok.eos_token_id
    law = {}

    def allowed(prefix):
        m = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
        for t in prefix:
            assert m.accept_token(t)
        mask = xgr.allocate_token_bitmask(1, dec.vocab_size)
        m.fill_next_token_bitmask(mask)
        return [v for v in range(dec.vocab_size) if (int(mask[0, v // 32]) >> (v % 32)) & 1]

    def probs(prefix):
        with torch.inference_mode():
            logits = dec.target(torch.tensor([prompt + prefix])).logits[0, -1].double()
        keep = allowed(prefix)
        p = torch.zeros_like(logits)
        p[keep] = torch.softmax(logits[keep], -1)
        return p

    p1 = probs([])
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs([t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            if t2 == eos:
                law[(t1, t2, -1)] = float(p1[t1] * p2[t2])
                continue
            p3 = probs([t1, t2])
            for t3 in torch.nonzero(p3).flatten().tolist():
                law[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return law


def _first_three(dec, tok, prompt):
    res = dec.generate([prompt] * N_ROWS, max_new_tokens=3, num_draft_tokens=2, temperature=1.0, seed=1000,
                       grammar=G.regex(REGEX))
    return [tuple((g + [-1, -1, -1])[:3]) for g in res.token_ids]


def _pvalue(law: dict, seen: list) -> float:
    keys = sorted(law)
    index = {k: i for i, k in enumerate(keys)}
    p = np.array([law[k] for k in keys])
    if any(s not in index for s in seen):
        return 0.0  # a sequence the masked target cannot produce
    return chi_square_pvalue(np.array([index[s] for s in seen]), p / p.sum())


@pytest.mark.slow
def test_the_first_three_tokens_follow_the_masked_target(chars):
    dec, tok = chars
    prompt = tok("abc")["input_ids"]
    assert _pvalue(_masked_joint(dec, tok, prompt), _first_three(dec, tok, prompt)) > SIGNIFICANCE


@pytest.mark.slow
@pytest.mark.parametrize("mutant", ["position_zero_everywhere", "bonus_unmasked", "draft_unmasked_q_masked"])
def test_a_wrong_mask_is_caught(chars, monkeypatch, mutant):
    """Three wrong rules the law test must reject: position 0's mask at every position; the last
    position a row reads (its bonus or recovered token) unmasked; the draft sampling without the
    grammar while reporting the masked q as the law it drew from."""
    dec, tok = chars
    real, real_allowed = G.RowGrammars.verify_bitmask, G.RowGrammars.draft_allowed

    def wrong(self, drafts, kb_host, rows, generated, K):
        mask = real(self, drafts, kb_host, rows, generated, K)
        if mutant == "position_zero_everywhere":
            return mask[:, :1].expand_as(mask).contiguous()
        for b, k in enumerate(kb_host):
            mask[b, k] = -1  # the last position a row reads: its bonus (or its recovered token)
        return mask

    if mutant == "draft_unmasked_q_masked":
        from specdec_kernels.decoding.drafters.base import DraftPicker

        real_add = DraftPicker.add

        def add_reporting_masked(self, logits, j):  # logits unmasked (below): x drawn without the grammar
            out = real_add(self, logits, j)
            allowed = real_allowed(self.st.hooks.grammar, self.xs[:-1], self.st.rows, self.st.generated, self.Vd)
            self.Q[:, j] = torch.softmax(logits.float().masked_fill(~allowed, float("-inf")), -1)  # T = 1: no warp
            return out

        monkeypatch.setattr(G.RowGrammars, "draft_allowed", lambda self, *a: None)
        monkeypatch.setattr(DraftPicker, "add", add_reporting_masked)
    else:
        monkeypatch.setattr(G.RowGrammars, "verify_bitmask", wrong)
    prompt = tok("abc")["input_ids"]
    assert _pvalue(_masked_joint(dec, tok, prompt), _first_three(dec, tok, prompt)) < SIGNIFICANCE


# --- JSON that always parses ---------------------------------------------------------------------
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["city", "town", "village"]},
        "location": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                      "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                     "required": ["lat", "lon"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["port", "capital", "old"]}, "maxItems": 3},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "kind", "location", "tags", "population"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_sampled_json_parses_and_validates(embedded):
    """200 rows at T = 1 of a nested schema, on random models over the embedded pair's tokenizer (their
    text is anything the grammar allows: strings of any characters, the control characters that
    xgrammar 0.2.9 lets into a length-bounded string among them), JSON on one line with bounded
    lengths, so that every row ends at EOS within its budget: every text parses and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    tok = embedded[2]
    target = tiny_llama(len(tok), 32, 2, 0.05, seed=3, eos_token_id=tok.eos_token_id)
    dec = SpeculativeDecoder(perturbed(target, 0.01, seed=4), target, tok)
    res = dec.generate(["A place, as JSON:"] * 200, max_new_tokens=160, num_draft_tokens=2, temperature=1.0, seed=0,
                       grammar=G.json_schema(NESTED, any_whitespace=False))
    assert res.finish_reasons == ["eos"] * 200, res.finish_reasons
    for text in res.texts:
        jsonschema.validate(json.loads(text), NESTED)


def test_a_bounded_json_string_refuses_control_characters(chars):
    """xgrammar 0.2.9's class for a length-bounded string's characters lets U+0000-U+001F in; the
    compiled schema refuses them, as JSON does."""
    dec, tok = chars
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=dec.vocab_size)
    compiled = G._compiler(tok, dec.vocab_size).compile(G.json_schema({"type": "string", "maxLength": 4}))
    assert info.vocab_size == dec.vocab_size
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('"ab') and not m.accept_string("\x08") and m.accept_string('c"')


# --- arguments -----------------------------------------------------------------------------------
def test_arguments_are_refused_by_name(chars):
    dec, tok = chars
    with pytest.raises(ValueError, match="grammar as a string must be a JSON schema"):
        dec.generate(["ab"], max_new_tokens=2, grammar="[a-d]+")
    with pytest.raises(TypeError, match=r"regex\(pattern\): pattern must be a non-empty str, got 3"):
        G.regex(3)
    with pytest.raises(TypeError, match=r"ebnf\(grammar\): grammar must be a non-empty str, got ''"):
        G.ebnf("")
    with pytest.raises(TypeError, match=r"json_schema\(schema\): schema must be a dict or its JSON text, got list"):
        G.json_schema([])
    with pytest.raises(TypeError, match="grammar must be a JSON schema .* got int"):
        dec.generate(["ab"], max_new_tokens=2, grammar=3)
    with pytest.raises(ValueError, match=r"one grammar per prompt \(2\), got 1"):
        dec.generate(["ab", "cd"], max_new_tokens=2, grammar=[G.regex("a+")])
    with pytest.raises(ValueError, match="grammar= needs an EOS id"):
        dec.generate(["ab"], max_new_tokens=2, grammar=G.regex("a+"), eos_token_id=[])
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=dec.vocab_size + 3)
    other = xgr.GrammarCompiler(info).compile_regex("a+")
    with pytest.raises(ValueError, match=rf"compiled for the target's vocabulary \({dec.vocab_size} tokens\)"):
        dec.generate(["ab"], max_new_tokens=2, grammar=other)
    tree = SpeculativeDecoder(draft=dec.draft, target=dec.target, tokenizer=tok, tree=(2, 1))
    with pytest.raises(ValueError, match="tree drafting does not take grammar"):
        tree.generate(["ab"], max_new_tokens=2, grammar=G.regex("a+"))


def test_rows_follow_their_own_grammars(chars):
    """One grammar per row, a free row among them; greedy rows equal their solo runs."""
    dec, tok = chars
    grammars = [G.regex("[a-d]+"), None, G.regex("(ef)+")]
    res = dec.generate(["ab", "cd", "ef"], max_new_tokens=6, grammar=grammars)
    assert set(res.texts[0]) <= set("abcd") and set(res.texts[2]) <= set("ef")
    for i, g in enumerate(grammars):
        assert dec.generate([["ab", "cd", "ef"][i]], max_new_tokens=6, grammar=g).token_ids[0] == res.token_ids[i]


# --- the CLI and the transformers hook -----------------------------------------------------------
@pytest.mark.slow
def test_cli_and_hook_take_a_grammar(embedded, tmp_path, capsys):
    import re

    from specdec_kernels import hf
    from specdec_kernels.cli import main

    draft, target, tok = embedded
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    assert main(["generate", "Call us at", "--regex", pattern, "--max-new-tokens", "20", "--json",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert re.fullmatch(pattern, out["texts"][0]) and out["finish_reasons"] == ["eos"]
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    assert main(["generate", "A city as JSON:", "--json-schema", str(schema), "--max-new-tokens", "40", "--json",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reasons"] != ["eos"] or set(json.loads(out["texts"][0])) >= {"city", "population"}
    enc = tok(["The largest city in France, as JSON:"], return_tensors="pt")
    ids = target.generate(**enc, custom_generate=hf.generate, assistant_model=draft, do_sample=False,
                          max_new_tokens=30, grammar=CITY)[0, enc["input_ids"].shape[1]:].tolist()
    want = SpeculativeDecoder(draft, target, tok).generate(["The largest city in France, as JSON:"], max_new_tokens=30,
                                                           grammar=CITY).token_ids[0]
    assert ids[:len(want)] == want
