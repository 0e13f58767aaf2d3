"""The decoder's bookkeeping that its output tokens do not show: the verbose trace (labels,
accepted prefixes, drafts shown), the default EOS (generation config, config, tokenizer), the
CLI's --json texts, auto's draft-time flag after K = 0 steps, prompt lookup's verify width,
a feature draft's chain positions, the draft's warp (a draft equal to the target accepts
everything), and the retirement of a draft past its shorter context.  Mutation testing
(2026-12-02): 14 of 71 mutants of the decoder-side modules survived the suite; each
test here fails on one or more of the 10 that mattered."""

from __future__ import annotations

import ast
import copy
import io
import json
import re

import torch

from specdec_kernels.cli import build_tiny_random_pair, main as cli_main
from specdec_kernels.decoding import loop
from specdec_kernels.decoding.decoder import SpeculativeDecoder

from decoder_setup import PROMPTS, _llama, _one_thread, pair  # noqa: F401  (fixtures)
from feature_setup import fpair  # noqa: F401  (fixture)


# --- verbose trace: labels (bonus / recovered), accepted prefix, drafts shown ------------------
_LINE = re.compile(r"^\[step (\d+) \| row (\d+)\] (Drafted:  |Accepted: |\+ )(.*)$")


def _check_trace(res, trace: str) -> set:
    """Every row-step of ``res.stats.history`` has its lines in ``trace``, consistent with the
    tokens; returns the labels of the '+' lines seen."""
    by = {}
    for ln in trace.splitlines():
        m = _LINE.match(ln)
        assert m, ln
        by.setdefault((int(m[1]), int(m[2])), []).append((m[3], m[4]))
    pos = [0] * len(res.token_ids)
    kinds = set()
    for s, h in enumerate(res.stats.history, 1):
        for p, kb, n in zip(h["rows"], h["num_draft"], h["accepted"]):
            lines = dict(by.pop((s, p)))
            emitted = min(n + 1, len(res.token_ids[p]) - pos[p])  # cut by EOS at the row's last step
            if kb > 0:
                drafted = ast.literal_eval(lines["Drafted:  "])
                acc_txt, counts = lines["Accepted: "].rsplit(" (", 1)
                assert len(drafted) == kb and counts == f"{n}/{kb} tokens)"
                assert ast.literal_eval(acc_txt) == drafted[:n]
                m = min(n, emitted)
                assert drafted[:m] == res.token_ids[p][pos[p]:pos[p] + m]
            if emitted == n + 1:
                kind, tok = lines["+ "].split(": ", 1)
                want = "target, no drafts" if kb == 0 else "bonus" if n == kb else "recovered"
                assert kind == want, (s, p, n, kb, kind)
                assert ast.literal_eval(tok) == res.token_ids[p][pos[p] + n:pos[p] + n + 1]
                kinds.add(kind)
            else:
                assert "+ " not in lines, (s, p, lines)  # the token after the EOS was not emitted
            pos[p] += emitted
    assert not by
    assert pos == [len(t) for t in res.token_ids]
    return kinds


def test_verbose_trace_matches_history_and_tokens(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    buf = io.StringIO()
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=4, temperature=1.0, seed=3, verbose=buf,
                       eos_token_id=[])
    assert _check_trace(res, buf.getvalue()) == {"bonus", "recovered"}
    # greedy, with an EOS that is an accepted draft (not the step's last token)
    free = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=4, eos_token_id=[])
    pos, eos = [0] * len(PROMPTS), None
    for h in free.stats.history:
        for p, n in zip(h["rows"], h["accepted"]):
            ids = free.token_ids[p]
            if eos is None and n >= 2 and ids[pos[p]] not in ids[:pos[p]]:
                eos = ids[pos[p]]
            pos[p] += n + 1
    assert eos is not None
    buf = io.StringIO()
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=4, eos_token_id=eos, verbose=buf)
    assert "eos" in res.finish_reasons
    _check_trace(res, buf.getvalue())


# --- EOS taken from the model / the tokenizer when eos_token_id is not given -----------------
def test_default_eos_from_generation_config_config_and_tokenizer(pair):
    draft, target = pair
    target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    free = SpeculativeDecoder(draft=draft, target=target).generate([PROMPTS[2]], max_new_tokens=24)
    ids = free.token_ids[0]
    assert free.finish_reasons == ["length"]
    e1, e2 = ids[3], ids[9]
    assert e1 not in ids[:3] and e2 not in ids[:3]
    cut1 = ids[: ids.index(e1) + 1]

    target.config.eos_token_id = e1  # the config only
    target.generation_config.eos_token_id = None
    res = SpeculativeDecoder(draft=draft, target=target).generate([PROMPTS[2]], max_new_tokens=24)
    assert (res.token_ids[0], res.finish_reasons[0]) == (cut1, "eos")

    target.generation_config.eos_token_id = [e2, e1]  # the generation config wins over the config
    target.config.eos_token_id = e2
    res = SpeculativeDecoder(draft=draft, target=target).generate([PROMPTS[2]], max_new_tokens=24)
    assert (res.token_ids[0], res.finish_reasons[0]) == (cut1, "eos")

    class Tok:  # only what the decoder reads of a tokenizer here
        eos_token_id = e1

        def get_vocab(self):
            return {str(i): i for i in range(32)}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    target.generation_config.eos_token_id = None
    target.config.eos_token_id = None
    res = SpeculativeDecoder(draft=draft, target=target, tokenizer=Tok()).generate([PROMPTS[2]], max_new_tokens=24)
    assert (res.token_ids[0], res.finish_reasons[0]) == (cut1, "eos")


# --- CLI --json: the texts are the decoded token ids ------------------------------------------
def test_cli_json_texts_are_the_decoded_ids(capsys):
    assert cli_main(["generate", "hello world", "the cat", "--tiny-random", "--json", "-k", "3",
                     "--max-new-tokens", "12", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    _, _, tok = build_tiny_random_pair()
    assert out["texts"] == [tok.decode(t, skip_special_tokens=True) for t in out["token_ids"]]
    assert any(out["texts"])


# --- the draft time of a step that took tokens waiting through K = 0 steps is not typical ----
def test_the_step_after_k_zero_steps_reports_an_untypical_draft_time(pair, monkeypatch):
    from specdec_kernels.decoding.stats import StatsRecorder

    draft, target = pair
    ks = iter([3, 0, 0, 3, 3, 0] + [3] * 40)
    monkeypatch.setattr(StatsRecorder, "choose_k", lambda self, k_max, allow_zero=False: next(ks))
    seen = []
    orig = StatsRecorder.record_times

    def rec(self, *a, **kw):
        seen.append((kw["k"], kw["draft_typical"]))
        return orig(self, *a, **kw)

    monkeypatch.setattr(StatsRecorder, "record_times", rec)
    SpeculativeDecoder(draft=draft, target=target).generate([PROMPTS[0]], max_new_tokens=24,
                                                             num_draft_tokens="auto", eos_token_id=[])
    assert seen[:7] == [(3, True), (0, True), (0, False), (3, False), (3, True), (0, True), (3, False)]


# --- prompt lookup verifies no wider block than its longest proposal --------------------------
def test_prompt_lookup_step_width_is_the_longest_proposal(pair):
    _, target = pair
    res = SpeculativeDecoder(target=target, drafter="prompt_lookup").generate(
        [[1, 2, 3, 4, 5], [6, 7, 6, 7, 6]], max_new_tokens=10, num_draft_tokens=4, eos_token_id=[])
    assert res.stats.history[0]["num_draft"][0] == 0
    for h in res.stats.history:
        assert h["k"] == max(h["num_draft"]), h


# --- a feature draft's own chain pairs continue the positions of its block --------------------
def test_feature_chain_positions_are_consecutive(fpair):
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    calls = []
    orig_step, orig_draft = dec.parts.draft_runner.step, dec.parts.drafter.draft

    def step(cache, tokens, feats, mask, positions, keep, model_path=False):
        if calls:  # not the prefill
            calls[-1].append(positions[0].tolist())
        return orig_step(cache, tokens, feats, mask, positions, keep, model_path)

    def drafting(st, K):
        calls.append([])
        return orig_draft(st, K)

    dec.parts.draft_runner.step = step
    dec.parts.drafter.draft = drafting
    dec.generate([[5, 6, 7, 8, 9, 10, 11]], max_new_tokens=20, num_draft_tokens=4)
    chained = 0
    for fwd in calls:
        nxt = fwd[0][-1] + 1
        for p in fwd[1:]:
            assert p == [nxt], fwd
            nxt += 1
            chained += 1
    assert chained > 5


# --- the draft warps like the target: a draft equal to the target accepts every draft ---------
def test_a_draft_equal_to_the_target_accepts_everything_when_sampling(pair):
    _, target = pair
    dec = SpeculativeDecoder(draft=copy.deepcopy(target), target=target)
    for kw in (dict(top_k=3), dict(top_p=0.6), dict(temperature=0.7, top_k=5, top_p=0.9)):
        kw = {"temperature": 1.0, **kw}
        res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=4, seed=1, eos_token_id=[], **kw)
        assert res.stats.drafted_tokens > 0 and res.stats.acceptance_rate == 1.0, (kw, res.stats.acceptance_rate)


# --- past a shorter draft context the draft is retired (no state kept, nothing waits) ---------
def test_a_draft_past_its_context_is_retired(pair):
    _, target = pair
    dec = SpeculativeDecoder(draft=_llama(32, 32, 1, 0.2, seed=1, max_pos=16), target=target)
    seen = []
    st = dec.start([[1, 2, 3], [4, 5]], max_new_tokens=30, num_draft_tokens=3, eos_token_id=[])
    with torch.inference_mode(), dec.parts.linear_layers():
        loop.prefill(dec.parts, st)
        while st.rows:
            before = min(st.target_len_host)
            loop.step(dec.parts, st)
            seen.append((before, st.target_only, st.draft.cache is None, st.draft.waiting is None))
    drafted = st.hooks.recorder.finalize(1.0, 0.0, st.finish, None, draft_is_free=False).drafted_tokens
    assert drafted > 0
    past = [s for s in seen if s[0] >= 16]
    assert past and all(s[1:] == (True, True, True) for s in past), seen
