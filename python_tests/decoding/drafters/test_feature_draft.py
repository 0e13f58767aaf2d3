"""Tests of the feature draft (``specdec_kernels.decoding.drafters.feature_model``, ``drafter="feature"``): a draft
that reads the target's hidden states, on a small random-weight Llama target (CPU, fp32) with a
feature draft fitted to it here in a few seconds (so that drafts are accepted often enough to
exercise ragged acceptance).

What is checked: greedy output equals ``target.generate`` (batch 1, a ragged batch with a
one-token prompt, K in {1, 3, 8, "auto"}; lean and model paths); sampling is exact (chi-square on
the joint distribution of the first two tokens, with and without a draft vocabulary); batch
invariance; after every step the draft's cache equals a fresh forward of the draft over the true
(feature, token) pairs of each row and the target's cache a fresh forward over the row; the
target's logits with features are the bits of those without; save/load; every refusal.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from specdec_kernels.decoding import loop
from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.drafters.feature_model import (
    FeatureDraft,
    load_feature_draft,
    save_feature_draft,
    target_identity,
)

from feature_setup import _damped_llama, _feature_draft, _fit, _pairs, fgreedy_refs, fpair  # noqa: F401  (fixtures)
from decoder_setup import (  # noqa: F401  (fixtures and helpers shared with the decoder's tests)
    CACHE_ATOL,
    CACHE_RTOL,
    PROMPTS,
    SIGNIFICANCE,
    SKEWED,
    _assert_row_cache,
    _assert_row_equals,
    _chisquare_pvalue,
    _first_two_joint,
    _llama,
    _one_thread,
    _synthetic_times,
)


# ----------------------------------------------------------------------------------------------
# Greedy equals target.generate
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
@pytest.mark.parametrize("lean", [True, False])
def test_feature_greedy_matches_generate_ragged_batch(fpair, fgreedy_refs, k, lean):
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature", lean_forward=lean)
    assert dec.lean_status() == ({"target": None, "draft": None} if lean else
                                 {"target": "lean_forward=False", "draft": "lean_forward=False"})
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, max_draft_tokens=6)
    assert res.token_ids == fgreedy_refs
    s = res.stats
    assert s.generated_tokens == 24 * len(PROMPTS)
    if k == "auto":
        # with models this small a draft forward costs about what a target step does, so "auto"
        # drafts in a few steps and takes K = 0 (no draft forward) in the rest: too few drafts
        # for the checks below, which the fixed K check
        assert s.drafted_tokens > 0 and any(h["k"] == 0 for h in s.history), [h["k"] for h in s.history]
        return
    assert 0.4 < s.alpha < 0.95, s.alpha  # the fitted draft is useful, not perfect
    assert any(len(set(h["accepted"])) > 1 for h in s.history)  # ragged acceptance happened


def test_feature_greedy_matches_generate_batch1(fpair, fgreedy_refs):
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    for p, ref in zip(PROMPTS, fgreedy_refs):
        assert dec.generate([p], max_new_tokens=24, num_draft_tokens=3).token_ids[0] == ref


def test_an_untrained_feature_draft_is_still_exact(fpair, fgreedy_refs):
    _, target = fpair
    dec = SpeculativeDecoder(draft=_feature_draft(target, seed=5), target=target, drafter="feature")
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=2)
    assert res.token_ids == fgreedy_refs
    assert res.stats.alpha < 0.3


# ----------------------------------------------------------------------------------------------
# Sampling is exact
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,k,vocab", [
    (1.0, None, 2, None),
    (0.7, 4, 3, None),
    (1.0, None, 2, [0, 2, 3, 5, 6]),  # the draft never proposes 1, 4 or 7
])
def test_feature_sampling_matches_target_distribution(temperature, top_k, k, vocab):
    V, N = 8, 4000
    target = _damped_llama(V, 16, 0.3, seed=0, max_pos=64)
    fd = _fit(_feature_draft(target, intermediate=32), target, steps=100)
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature", draft_vocab=vocab)
    res = dec.generate([prompt] * N, max_new_tokens=2, num_draft_tokens=k, temperature=temperature,
                       top_k=top_k, seed=1000)
    assert 0.1 < res.stats.alpha < 0.95, res.stats.alpha
    toks = torch.tensor([t[:2] for t in res.token_ids])
    observed = torch.zeros((V, V), dtype=torch.int64)
    observed.index_put_((toks[:, 0], toks[:, 1]), torch.ones(N, dtype=torch.int64), accumulate=True)
    joint = _first_two_joint(target, prompt, temperature, top_k, None)
    assert observed[joint == 0].sum() == 0
    if vocab is not None:  # tokens the draft cannot propose are emitted (from the residual)
        outside = torch.ones(V, dtype=torch.bool)
        outside[vocab] = False
        assert observed.sum(1)[outside].sum() > 0
    assert _chisquare_pvalue(observed.sum(1), joint.sum(1)) > SIGNIFICANCE
    assert _chisquare_pvalue(observed, joint) > SIGNIFICANCE


def test_a_nan_feature_draft_leaves_the_target_to_decode(fpair):
    """A feature draft whose every output is NaN proposes nothing it can be verified on (each
    step's K_b is 0), so the target decodes alone: the tokens of the target-only loop with the
    same seeds, every row to its length (before, the rows ended "nonfinite" with no token)."""
    fd, target = fpair
    bad = copy.deepcopy(fd)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    dec = SpeculativeDecoder(draft=bad, target=target, drafter="feature")
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=20, seed=[3, 4, 5])
    res = dec.generate(PROMPTS[:3], num_draft_tokens=2, **kw)
    assert res.finish_reasons == ["length"] * 3 and res.stats.drafted_tokens == 0
    assert res.token_ids == dec.generate_target_only(PROMPTS[:3], **kw).token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_row_equals_prompt_decoded_alone(fpair, temperature):
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, top_k=20 if temperature else None)
    batch = dec.generate(PROMPTS, seed=50, **kw)
    for i, p in enumerate(PROMPTS):
        assert dec.generate([p], seed=50 + i, **kw).token_ids[0] == batch.token_ids[i], i
    if temperature:
        assert dec.generate(PROMPTS, seed=51, **kw).token_ids != batch.token_ids


def test_feature_lean_and_model_paths_sample_alike(fpair):
    fd, target = fpair
    kw = dict(max_new_tokens=12, num_draft_tokens=3, temperature=1.0, seed=9)
    a = SpeculativeDecoder(draft=fd, target=target, drafter="feature").generate(PROMPTS, **kw)
    b = SpeculativeDecoder(draft=fd, target=target, drafter="feature", lean_forward=False).generate(PROMPTS, **kw)
    assert a.token_ids == b.token_ids


# ----------------------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------------------
def _assert_draft_row_cache(dc, b: int, length: int, fd, target, ids: list):
    """Row b's first ``length`` draft-cache columns = a fresh draft forward over the true pairs."""
    assert len(ids) == length
    emb, feats, _ = _pairs(target, torch.tensor([ids]))
    ref = DynamicCache(config=fd.lm.config)
    with torch.inference_mode():
        fd(emb, feats, torch.arange(length)[None], ref)
    _assert_row_equals(dc, b, length, ref)


def _assert_feature_state(st, fd, target):
    """Every row: the target's cache holds every token but the newest, the draft's the same columns
    less the pending pairs, which are the row's newest tokens with the target's features (a
    one-token prompt caches nothing at first, and its first feature is 0)."""
    for b, p in enumerate(st.rows):
        seq = st.seqs[p]
        ld, c = st.draft.cache_len_host[b], st.draft.pending_count_host[b]
        assert ld + c == len(seq)
        assert st.draft.pending_tokens[b, :c].tolist() == seq[ld:]
        if ld == 0:
            continue
        _assert_row_cache(st.target_cache, b, st.target_len_host[b], target, seq[: st.target_len_host[b]])
        assert st.target_len_host[b] == len(seq) - 1
        _assert_draft_row_cache(st.draft.cache, b, ld, fd, target, seq[:ld])
        _, feats, _ = _pairs(target, torch.tensor([seq]))
        torch.testing.assert_close(st.draft.pending_features[b, :c], feats[0, ld:], atol=CACHE_ATOL, rtol=CACHE_RTOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_caches_equal_fresh_forward_after_each_step(fpair, temperature):
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    st = dec.start(PROMPTS, 30, 4, temperature, None, None, 0, max_draft_tokens=4)
    counts = set()
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        for _ in range(6):
            loop.step(dec.parts, st)
            counts.update(st.draft.pending_count_host)
            _assert_feature_state(st, fd, target)
    assert len(counts) > 1  # rows had different numbers of pending pairs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_grouped_prefill(fpair, temperature):
    """Prompts of very different lengths, so that the prefill runs one forward per group and
    stacks the groups' caches (it crashed with the feature draft: the groups' draft caches were
    made for a draft model that is None here): both caches equal fresh forwards after the prefill
    and after each step, each row's pending pairs hold its last token with the target's feature,
    every row equals its prompt decoded alone, and greedy equals target.generate."""
    from specdec_kernels.decoding.prefill import _PREFILL_GROUP_COST, _prefill_groups

    fd, target = fpair
    assert len(_prefill_groups([len(p) - 1 for p in SKEWED], _PREFILL_GROUP_COST["cpu"])) > 1
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    st = dec.start(SKEWED, 12, 3, temperature, None, None, 7, max_draft_tokens=3)
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        for step in range(5):
            _assert_feature_state(st, fd, target)
            if step < 4:
                loop.step(dec.parts, st)
    kw = dict(max_new_tokens=12, num_draft_tokens=3, temperature=temperature)
    batch = dec.generate(SKEWED, seed=7, **kw)
    for i, p in enumerate(SKEWED):
        assert dec.generate([p], seed=7 + i, **kw).token_ids[0] == batch.token_ids[i], i
        if temperature == 0:
            with torch.inference_mode():
                ref = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=0)
            assert batch.token_ids[i] == ref[0, len(p):].tolist(), i


def test_feature_auto_takes_steps_without_drafts(fpair, fgreedy_refs, monkeypatch):
    """Where verifying a draft costs more than it returns (a synthetic target step of 1 + K),
    "auto" takes K = 0 steps with a feature draft too (the target alone, no draft forward: the
    pending pairs wait), mostly, with a K >= 1 step at least every ZERO_REFRESH + 1; where drafts
    pay (1 + 0.3 K) it does only to explore (the third step: the prior at five rows on a CPU
    rates a one-token step the cheap second length); greedy equals target.generate either way."""
    from specdec_kernels.decoding.stats import ZERO_REFRESH

    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    for slope in (0.3, 1.0):
        with monkeypatch.context() as m:
            _synthetic_times(m, slope, [])
            res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens="auto", max_draft_tokens=6)
        assert res.token_ids == fgreedy_refs, slope
        ks = [h["k"] for h in res.stats.history]
        if slope == 0.3:
            assert ks[2] == 0 and ks[3:-2] and all(k >= 1 for k in ks[:2] + ks[3:-2]), ks
        else:
            zeros = ks[4:-2]
            assert zeros.count(0) >= 0.8 * len(zeros) and len(zeros) > ZERO_REFRESH, ks
            assert max(len(r) for r in "".join("0" if k == 0 else "x" for k in ks[4:]).split("x")) <= ZERO_REFRESH


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_caches_after_steps_without_drafts(fpair, temperature):
    """K = 0 steps chosen by "auto" between steps with drafts: after each, both caches equal fresh
    forwards and the pending pairs are the row's newest tokens with the target's features."""
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    st = dec.start(PROMPTS, 30, "auto", temperature, None, None, 0, max_draft_tokens=4)
    pattern = iter([4, 0, 0, 3, 0, 4, 0, 2, 0])
    st.hooks.recorder.choose_k = lambda k_max, allow_zero=False: next(pattern)
    ks = []
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        for _ in range(9):
            loop.step(dec.parts, st)
            ks.append(st.hooks.recorder.stats.history[-1]["k"])
            _assert_feature_state(st, fd, target)
    assert ks == [4, 0, 0, 3, 0, 4, 0, 2, 0], ks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_zero_steps_run_no_draft_forward(fpair, fgreedy_refs, temperature):
    """A K = 0 step runs no draft forward: its new pair waits with the row's other pending
    pairs, and the next step with drafts feeds them all in its one block (several per row,
    ragged).  Every true pair is fed exactly once (the draft's cache columns), the state is that
    of fresh forwards after every step, and greedy equals target.generate."""
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    pattern = [3, 0, 0, 0, 2, 0, 4, 0, 0, 1, 3, 0]
    # 60: no row finishes within the pattern
    st = dec.start(PROMPTS, 60, "auto", temperature, None, None, 0, max_draft_tokens=4)
    ks = iter(pattern)
    st.hooks.recorder.choose_k = lambda k_max, allow_zero=False: next(ks)
    blocks = []  # per step: the valid pairs of its pending block, or None without a draft forward
    orig_step, orig_draft = dec.parts.draft_runner.step, dec.parts.drafter.draft
    calls = []

    def counting(cache, tokens, feats, mask, positions, keep, model_path=False):
        calls.append(tokens.numel() if mask is None else int(mask[:, -tokens.shape[1]:].sum()))
        return orig_step(cache, tokens, feats, mask, positions, keep, model_path)

    def drafting(st_, K):
        calls.clear()
        out = orig_draft(st_, K)
        blocks[-1] = calls[0]  # the first forward of a step is its pending block
        return out

    dec.parts.draft_runner.step = counting
    dec.parts.drafter.draft = drafting
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        prefilled = sum(st.draft.cache_len_host)
        most = 0
        for k in pattern:
            before = list(st.draft.pending_count_host)
            most = max(most, *before)
            blocks.append(None)
            loop.step(dec.parts, st)
            if k == 0:
                assert blocks[-1] is None  # no draft forward at all
                assert st.draft.pending_count_host == [c + 1 for c in before]
            else:
                assert blocks[-1] == sum(before)  # every waiting pair, once
            _assert_feature_state(st, fd, target)
    assert len(st.rows) == len(PROMPTS)
    assert most >= 4  # pairs did wait over several K = 0 steps
    assert prefilled + sum(b for b in blocks if b) == sum(st.draft.cache_len_host)  # each true pair fed once
    if temperature == 0:
        assert [st.generated[p] for p in range(len(PROMPTS))] == [r[: len(st.generated[p])]
                                                                 for p, r in enumerate(fgreedy_refs)]


def test_feature_draft_is_fed_each_true_pair_once(fpair):
    """The draft's forwards take every (feature, token) pair once, plus K - 1 pairs of its own per
    step; nothing is fed twice."""
    fd, target = fpair
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    fed = []
    orig = dec.parts.draft_runner.step

    def counting(cache, tokens, feats, mask, positions, keep, model_path=False):
        valid = tokens.numel() if mask is None else int(mask[:, -tokens.shape[1]:].sum())
        fed.append((tokens.shape[1], valid))
        return orig(cache, tokens, feats, mask, positions, keep, model_path)

    dec.parts.draft_runner.step = counting
    prompt = [5, 6, 7, 8, 9, 10, 11]
    res = dec.generate([prompt], max_new_tokens=20, num_draft_tokens=3)
    s = res.stats
    total = sum(v for _, v in fed)
    # prefill: 6 pairs; each step: its pending pairs (emitted by the previous step, or the prompt's
    # last token) + K - 1 chain pairs; the last step's emitted tokens are never fed
    last_emitted = s.history[-1]["accepted"][0] + 1
    chain = sum(max(h["k"] - 1, 0) for h in s.history)  # K - 1 per step (K shrinks near the budget)
    assert chain >= 2 * (s.iterations - 3)
    assert total == 6 + (len(prompt) - 6) + (s.generated_tokens - last_emitted) + chain
    assert len(fed) == 1 + s.iterations + chain  # the prefill, one block per step, the chain's


# ----------------------------------------------------------------------------------------------
# The target's features, save/load, refusals
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lean", [True, False])
def test_step_hidden_logits_are_the_step_bits(fpair, lean):
    from specdec_kernels.ops.kv.cache import new_cache
    from specdec_kernels.cpu import CpuAccelerator
    from specdec_kernels.decoding.runners import ModelRunner

    _, target = fpair
    r = ModelRunner(target, "target")
    if lean:
        r.use_lean(CpuAccelerator())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        c1, c2 = new_cache(target), new_cache(target)
        r.forward(c1, ids[:, :3], None, pos[:, :3], 0, 1)
        r.forward(c2, ids[:, :3], None, pos[:, :3], 0, 1)
        a = r.step(c1, ids[:, 3:], None, pos[:, 3:], 3, 2)
        b, h = r.step_hidden(c2, ids[:, 3:], None, pos[:, 3:], 3, 2)
        full = target.model(input_ids=ids).last_hidden_state[:, 3:]
        assert torch.equal(target.lm_head(h), b)
    assert torch.equal(a, b)
    torch.testing.assert_close(h, full, atol=1e-5, rtol=1e-4)


def test_save_and_load_roundtrip(fpair, tmp_path):
    fd, target = fpair
    save_feature_draft(fd, tmp_path / "fd", vocab=torch.tensor([0, 3, 5]), dtype=torch.float32)
    fd2, vocab = load_feature_draft(tmp_path / "fd")
    assert vocab.tolist() == [0, 3, 5]
    saved = [k for k in fd.state_dict() if not k.startswith(("lm.lm_head.", "lm.model.embed_tokens."))]
    assert len(saved) == 11  # fc, 9 in the layer, the norm
    for k in saved:
        assert torch.equal(fd.state_dict()[k], fd2.state_dict()[k]), k
    dec = SpeculativeDecoder(draft=str(tmp_path / "fd"), target=target, drafter="feature")
    assert dec.draft_vocab.tolist() == [0, 3, 5]
    assert SpeculativeDecoder(draft=str(tmp_path / "fd"), target=target, drafter="feature",
                              draft_vocab=None).draft_vocab is None


def test_models_loaded_under_inference_mode(fpair, fgreedy_refs, tmp_path):
    """A target and a feature draft made under ``torch.inference_mode`` (inference tensors, no
    version counter) decode as the others do: the draft's output-layer copy is re-taken each call,
    and it follows an in-place change of the target's output layer made there."""
    fd, target = fpair
    save_feature_draft(fd, tmp_path / "fd", dtype=torch.float32)
    with torch.inference_mode():
        target_i = copy.deepcopy(target)
        for p in target_i.parameters():
            p.data = p.data.clone()  # inference tensors
        assert target_i.lm_head.weight.is_inference()
        dec = SpeculativeDecoder(draft=str(tmp_path / "fd"), target=target_i, drafter="feature")
        for _ in range(2):
            res = dec.generate([PROMPTS[0]], max_new_tokens=24, num_draft_tokens=3)
            assert res.token_ids[0] == fgreedy_refs[0]
        target_i.lm_head.weight.mul_(2.0)
        dec.generate([PROMPTS[0]], max_new_tokens=2, num_draft_tokens=1)
        assert torch.equal(dec.parts.draft_runner.head.weight, target_i.lm_head.weight.half().float())


def test_feature_draft_refusals(fpair, tmp_path):
    fd, target = fpair
    with pytest.raises(TypeError, match="drafter='feature' needs a FeatureDraft or the directory of one"):
        SpeculativeDecoder(draft=copy.deepcopy(target), target=target, drafter="feature")
    other = _damped_llama(32, 32, 0.2, seed=7)
    with pytest.raises(ValueError, match="the target is not the one it was trained for"):
        SpeculativeDecoder(draft=fd, target=other, drafter="feature")
    wide = _damped_llama(32, 48, 0.2, seed=0)
    with pytest.raises(ValueError, match="the target's hidden_size must be 32"):
        SpeculativeDecoder(draft=fd, target=wide, drafter="feature")
    with pytest.raises(FileNotFoundError, match="must hold feature_draft.json and model.safetensors"):
        load_feature_draft(tmp_path / "missing")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype, got 'float16'"):
        load_feature_draft(tmp_path / "missing", dtype="float16")
    with pytest.raises(ValueError, match="config.hidden_size must be the target's 48"):
        FeatureDraft(fd.config, target_identity(wide))
    with pytest.raises(ValueError, match="target must be target_identity"):
        FeatureDraft(fd.config, {"hidden_size": 32})
    with pytest.raises(TypeError, match="config must be a LlamaConfig, got dict"):
        FeatureDraft({}, target_identity(target))
    with pytest.raises(ValueError, match=r"embeds and feats must both be \[B, q, H=32\], "
                                         r"got \(1, 2, 32\) and \(1, 3, 32\)"):
        fd.inputs(torch.zeros(1, 2, 32), torch.zeros(1, 3, 32))
    with pytest.raises(TypeError, match="save_feature_draft: draft must be a FeatureDraft, got LlamaForCausalLM"):
        save_feature_draft(target, tmp_path / "x")
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    with pytest.raises(ValueError, match="draft_confidence must be in"):
        dec.generate([[1, 2]], max_new_tokens=2, draft_confidence=1.5)


def test_cli_feature_drafter(capsys, tmp_path):
    """``specdec generate --drafter feature --draft DIR --target DIR``: the same text as the target
    alone (greedy); --tiny-random has no feature draft and says so."""
    import json

    from specdec_kernels.cli import build_tiny_random_pair, main as cli_main

    _, target, tok = build_tiny_random_pair(seed=0)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    fd = _fit(_feature_draft(target, intermediate=32), target, steps=30)
    save_feature_draft(fd, tmp_path / "fd", dtype=torch.float32)
    args = ["generate", "hello", "--target", str(tmp_path / "target"), "--json", "--max-new-tokens", "8"]
    assert cli_main(args + ["--drafter", "feature", "--draft", str(tmp_path / "fd"), "-k", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stats"]["drafted_tokens"] > 0
    with torch.inference_mode():
        ids = tok(["hello"], return_tensors="pt").input_ids
        ref = target.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert got["token_ids"][0] == ref
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--tiny-random", "--drafter", "feature"])
    assert e.value.code == 2 and "--tiny-random has no feature draft" in capsys.readouterr().err


def test_missing_embedded_feature_draft_is_said(capsys, monkeypatch, tmp_path):
    """An install without the embedded feature draft's files: asking for it names the missing
    directory and what to pass instead, before loading any model."""
    from specdec_kernels.decoding.drafters import feature_model as feature_draft
    from specdec_kernels.models import embedded as models
    from specdec_kernels.cli import main as cli_main

    missing = str(tmp_path / "no_feature_draft")
    monkeypatch.setattr(feature_draft, "default_feature_draft_path", lambda: missing)

    def no_pair(*a, **k):
        raise AssertionError("the default pair was loaded before the feature draft's directory was checked")

    monkeypatch.setattr(models, "default_pair", no_pair)
    with pytest.raises(FileNotFoundError, match=f"the embedded feature draft is missing \\({missing}\\).*draft=DIR"):
        SpeculativeDecoder(drafter="feature")
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hello", "--drafter", "feature"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and missing in err and "pass --draft DIR" in err


def test_feature_head_is_kept_until_the_target_changes(fpair):
    """The draft's output layer (the target's rows, fp16-rounded) is copied once and reused by
    later calls, and copied again when the target's output layer is changed in place."""
    fd, target = fpair
    target = copy.deepcopy(target)
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature", draft_vocab=[1, 5, 9])
    head = dec.parts.draft_runner.head
    dec.generate([[1, 2, 3]], max_new_tokens=3)
    assert dec.parts.draft_runner.head is head
    assert torch.equal(head.weight, target.lm_head.weight[[1, 5, 9]].half().float())
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    dec.generate([[1, 2, 3]], max_new_tokens=3)
    assert dec.parts.draft_runner.head is not head
    assert torch.equal(dec.parts.draft_runner.head.weight, target.lm_head.weight[[1, 5, 9]].half().float())
    # a replaced output layer is taken (the runner kept the old module before);
    # a write through .data (no version bump) after forget_weight_copies, or by a new decoder
    want = lambda: target.lm_head.weight[[1, 5, 9]].half().float()  # noqa: E731
    target.lm_head = torch.nn.Linear(target.lm_head.in_features, target.lm_head.out_features, bias=False)
    dec.generate([[1, 2, 3]], max_new_tokens=3)
    assert torch.equal(dec.parts.draft_runner.head.weight, want())
    target.lm_head.weight.data.mul_(3.0)
    dec2 = SpeculativeDecoder(draft=fd, target=target, drafter="feature", draft_vocab=[1, 5, 9])
    dec2.generate([[1, 2, 3]], max_new_tokens=3)
    assert torch.equal(dec2.parts.draft_runner.head.weight, want())
    target.lm_head.weight.data.mul_(0.5)
    from specdec_kernels.cpu.skinny_linear import forget_weight_copies

    assert forget_weight_copies(target) >= 1
    dec2.generate([[1, 2, 3]], max_new_tokens=3)
    assert torch.equal(dec2.parts.draft_runner.head.weight, want())


def test_feature_head_streams_int8_on_the_cpu(fpair, fgreedy_refs):
    """With cpu_linear "skinny" (the CPU default) the draft's output layer runs over its per-row
    int8 copy (cpu_linear.use_skinny_linear(int8_weights=True)) inside generate's layer context,
    and the output is still the target's greedy one; with cpu_linear="torch" it is the fp32
    layer.  The target's layers are never int8."""
    from specdec_kernels.cpu.skinny_linear import int8_copy

    fd, target = fpair
    fh = torch.randn(3, target.config.hidden_size)
    for mode in ("skinny", "torch"):
        dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature", cpu_linear=mode)
        res = dec.generate(PROMPTS[:2], max_new_tokens=12, num_draft_tokens=2)
        assert res.token_ids == [r[:12] for r in fgreedy_refs[:2]]
        head = dec.parts.draft_runner.head
        with dec.parts.linear_layers(), torch.no_grad():
            got = head(fh)
            assert all("_specdec_int8" not in m.__dict__ for m in target.modules())
        if mode == "skinny":
            w8, scale = int8_copy(head)
            assert torch.equal(got, torch.ops.specdec.skinny_linear(fh, w8, None) * scale)
        else:
            assert torch.equal(got, torch.nn.functional.linear(fh, head.weight))


def test_targets_that_scale_their_logits():
    """A target whose forward rescales its output layer's result (Granite: / logits_scaling) is
    verified on its own logits: off the lean path step_hidden takes them from the model's forward
    (it applied the output layer itself before: logits 4x too large, the samples far from the
    target's distribution), and sampling matches the target (chi-square on the
    first two tokens)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from specdec_kernels.ops.kv.cache import new_cache
    from specdec_kernels.decoding.runners import ModelRunner

    V, N = 8, 4000
    cfg = GraniteConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        logits_scaling=4.0, initializer_range=0.5, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        target = GraniteForCausalLM(cfg).eval()
    r = ModelRunner(target, "target")
    ids, pos = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    with torch.inference_mode():
        a = r.step(new_cache(target), ids, None, pos, 0, 2)
        b, h = r.step_hidden(new_cache(target), ids, None, pos, 0, 2)
        assert torch.equal(a, b)
        torch.testing.assert_close(b, target.lm_head(h) / 4.0)
        torch.testing.assert_close(h, target.model(input_ids=ids).last_hidden_state[:, 2:])
    fd = _feature_draft(target, intermediate=32)
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(draft=fd, target=target, drafter="feature")
    res = dec.generate([prompt] * N, max_new_tokens=2, num_draft_tokens=2, temperature=1.0, seed=7)
    toks = torch.tensor([t[:2] for t in res.token_ids])
    observed = torch.zeros((V, V), dtype=torch.int64)
    observed.index_put_((toks[:, 0], toks[:, 1]), torch.ones(N, dtype=torch.int64), accumulate=True)
    joint = _first_two_joint(target, prompt, 1.0, None, None)
    assert _chisquare_pvalue(observed.sum(1), joint.sum(1)) > SIGNIFICANCE
    assert _chisquare_pvalue(observed, joint) > SIGNIFICANCE


def test_feature_draft_takes_the_targets_dtype(fpair):
    """A feature draft in another dtype than its target runs in the target's (a bf16 target beside
    a draft in fp32 failed in the first draft step: "expected m1 and m2 to have the same dtype")."""
    fd, target = fpair
    t16 = copy.deepcopy(target).to(torch.bfloat16)
    dec = SpeculativeDecoder(draft=copy.deepcopy(fd).float(), target=t16, drafter="feature")
    assert {p.dtype for p in dec.feature.parameters()} == {torch.bfloat16}
    res = dec.generate([[1, 2, 3], [4]], max_new_tokens=6, num_draft_tokens=2)
    assert all(len(t) == 6 and all(0 <= i < target.config.vocab_size for i in t) for t in res.token_ids)


def test_a_feature_draft_passed_as_an_object_is_converted_as_a_copy(fpair):
    """(before: the caller's draft was converted in place: its weights rounded for good, and a
    second decoder over an fp32 target converted the first one's bf16 draft under it)"""
    fd, target = fpair
    mine = copy.deepcopy(fd).float()
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    t16 = copy.deepcopy(target).to(torch.bfloat16)
    dec16 = SpeculativeDecoder(draft=mine, target=t16, drafter="feature")
    dec32 = SpeculativeDecoder(draft=mine, target=target, drafter="feature")
    assert all(torch.equal(v, mine.state_dict()[k]) for k, v in before.items())  # untouched
    assert {p.dtype for p in dec16.feature.parameters()} == {torch.bfloat16} and dec32.feature is mine
    dec16.generate([[1, 2, 3]], max_new_tokens=4, num_draft_tokens=2)
    meta = copy.deepcopy(fd).to("meta")
    with pytest.raises(ValueError, match="got the feature draft on the meta device"):
        SpeculativeDecoder(draft=meta, target=target, drafter="feature")


def test_a_refused_vocabulary_writes_nothing(fpair, tmp_path):
    """(before: the weights and config were written before the vocabulary was refused, beside
    the old draft's vocabulary file)"""
    fd, _ = fpair
    save_feature_draft(fd, tmp_path / "a", vocab=[0, 3, 5])
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    other = copy.deepcopy(fd)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="ids must be unique, got 3 more than once"):
        save_feature_draft(other, tmp_path / "a", vocab=[3, 3])
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == weights


def test_save_feature_draft_checks_its_dtype(fpair, tmp_path):
    """dtype must be a floating torch.dtype (int8 saved all-zero weights before; a string gave
    "Invalid device string")."""
    fd, _ = fpair
    for bad in (torch.int8, "float16"):
        with pytest.raises(TypeError, match=r"save_feature_draft: dtype must be a floating torch.dtype, got"):
            save_feature_draft(fd, tmp_path / "x", dtype=bad)
        assert not (tmp_path / "x").exists()


def test_output_rows_restricts_weight_and_bias():
    """A draft vocabulary's output layer keeps the chosen rows of the weight and of the bias."""
    from specdec_kernels.decoding.runners import output_rows

    out = torch.nn.Linear(4, 6, bias=True)
    rows = torch.tensor([1, 4])
    head = output_rows(out, rows)
    assert torch.equal(head.bias, out.bias[rows]) and torch.equal(head.weight, out.weight[rows])
    half = output_rows(out, None, fp16_values=True)
    assert torch.equal(half.weight, out.weight.half().float()) and torch.equal(half.bias, out.bias)
