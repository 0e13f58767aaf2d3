"""SpeculativeDecoder is exact (small random-weight Llama models from decoder_setup.py, CPU, fp32).

- greedy output equals ``target.generate(do_sample=False)`` token for token (batch 1 and a
  ragged batch, K in {1, 3, 8} and "auto", tensor prompts with a padding mask, a target
  vocabulary padded beyond the draft's);
- sampling is exact: the joint distribution of the first two generated tokens over many seeds
  matches the target's closed-form distribution (chi-square, significance level 1e-3), and the
  same test rejects the draft's own distribution (so it has the power to see a mistake);
- batch invariance (greedy and seeded sampling): a row of a batch equals its prompt alone.
The caches, what each model is fed, and the rest: test_decoder_caches.py, test_decoder_usage.py,
test_decoder_draft_vocab.py.
"""

from __future__ import annotations


import pytest
import torch

from specdec_kernels.decoding.decoder import SpeculativeDecoder

from decoder_setup import (PROMPTS, SIGNIFICANCE, _chisquare_pvalue, _first_two_joint, _llama, _perturbed,
                           _synthetic_times)
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)


# ----------------------------------------------------------------------------------------------
# 1. Greedy equals target.generate
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_greedy_matches_generate_ragged_batch(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, max_draft_tokens=6)
    assert res.token_ids == greedy_refs
    assert res.finish_reasons == ["length"] * len(PROMPTS)
    s = res.stats
    assert 0.2 < s.alpha < 0.95, s.alpha  # the draft is neither useless nor perfect
    # Ragged acceptance really happened: some step's rows accepted different numbers.
    assert any(len(set(h["accepted"])) > 1 for h in s.history)
    assert sum(s.accepted_length_histogram) == s.row_steps
    assert s.generated_tokens == 24 * len(PROMPTS)
    if k == "auto":
        # K in 1..6, less only where every row's budget is nearly spent (K_b <= budget - 1).
        assert all(1 <= h["k"] <= 6 or h["num_draft"] == [0] * len(h["rows"]) for h in s.history)



def test_greedy_auto_k_follows_the_verify_cost(pair, greedy_refs, monkeypatch):
    """K="auto" with a flat verify cost drafts more than with a steep one; where verifying one
    draft costs as much as two plain steps it mostly takes K = 0 (the target alone; the draft's
    tokens wait), with a step at K >= 1 at least every ZERO_REFRESH + 1; all reproduce
    target.generate exactly; the recorder receives each step's K."""
    from specdec_kernels.decoding.stats import ZERO_REFRESH

    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    mean_k = {}
    for slope in (0.0, 0.3, 1.0):
        seen = []
        with monkeypatch.context() as m:
            _synthetic_times(m, slope, seen)
            res = dec.generate(PROMPTS, max_new_tokens=40, num_draft_tokens="auto", max_draft_tokens=6)
        assert res.token_ids == [dec.generate_target_only([p], max_new_tokens=40).token_ids[0] for p in PROMPTS]
        assert [r[:24] for r in res.token_ids] == greedy_refs, slope
        ks = [h["k"] for h in res.stats.history]
        assert [k for k, _ in seen] == ks  # record_times gets the step's own K
        mean_k[slope] = res.stats.mean_num_draft_tokens
        if slope == 0.0:
            assert max(ks) == 6, ks
        elif slope == 0.3:  # T(K) = 1 + 0.3 K: drafts pay, so K = 0 is never even tried
            assert ks[:-2] and all(k >= 1 for k in ks[:-2]), ks
        else:  # T(K) = 1 + K: one draft costs a step and returns 0.6-0.7 of a token: K = 0
            zeros = ks[4:-2]
            assert zeros.count(0) >= 0.8 * len(zeros) and len(zeros) > ZERO_REFRESH, ks
            runs = "".join("0" if k == 0 else "x" for k in ks[4:]).split("x")
            assert max(len(r) for r in runs) <= ZERO_REFRESH and "x" in "".join(
                "0" if k == 0 else "x" for k in ks[4:]), ks  # refreshed
    assert mean_k[0.0] > mean_k[0.3] + 2 > mean_k[1.0] + 2, mean_k


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_matches_generate_batch1(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    for i in (0, 2):
        res = dec.generate([PROMPTS[i]], max_new_tokens=24, num_draft_tokens=k)
        assert res.token_ids == [greedy_refs[i]]


def test_greedy_tensor_prompts_with_left_padding_mask(pair, greedy_refs):
    """[B, T] ids with an attention mask (HF's left padding) are taken row by row."""
    draft, target = pair
    T = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(PROMPTS), T), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    res = SpeculativeDecoder(draft=draft, target=target).generate(ids, attention_mask=mask, max_new_tokens=24)
    assert res.token_ids == greedy_refs


def test_target_only_baseline_matches_generate(pair, greedy_refs):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    base = dec.generate_target_only(PROMPTS, max_new_tokens=24)
    assert base.token_ids == greedy_refs
    assert base.stats.iterations == 24 and base.stats.drafted_tokens == 0
    res = dec.generate(PROMPTS, max_new_tokens=24, baseline_tokens_per_s=base.stats.tokens_per_s)
    assert res.stats.measured_speedup == pytest.approx(res.stats.tokens_per_s / base.stats.tokens_per_s)
    assert res.stats.predicted_speedup is not None and res.stats.predicted_speedup > 0


def test_padded_target_vocabulary(pair):
    """A target whose vocabulary is padded beyond the draft's (Vd < V): drafts pass [B, K, Vd]."""
    _, target = pair
    big = _llama(40, 32, 2, 0.2, seed=0)
    with torch.no_grad():  # the target's weights; padded ids 32..39 embed to 0 and get logit 0
        big_params = dict(big.named_parameters())
        for name, p in target.named_parameters():
            q = big_params[name]
            q.zero_()
            q[: p.shape[0]].copy_(p)
    draft = _perturbed(target, 0.01, seed=1)
    with torch.inference_mode():
        refs = [big.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                             pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    dec = SpeculativeDecoder(draft=draft, target=big)
    assert dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=3).token_ids == refs
    res = dec.generate(PROMPTS, max_new_tokens=16, num_draft_tokens=3, temperature=1.0, seed=3)
    assert all(len(t) == 16 for t in res.token_ids)
    # Padded ids were sampled, and fed back to a draft that cannot embed them (it sees id 31).
    assert any(t >= 32 for row in res.token_ids for t in row)


# ----------------------------------------------------------------------------------------------
# 2. Sampling is exact: chi-square against the target's closed-form distribution
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p,k,vocab", [
    (1.0, None, None, 2, None),
    (0.7, 4, None, 1, None),
    (1.0, 6, 0.9, 3, None),
    # a draft vocabulary: the draft never proposes 1, 4 or 7; the residual must supply them
    (1.0, None, None, 2, [0, 2, 3, 5, 6]),
    (0.7, 4, None, 3, [0, 2, 3, 5, 6]),
    # rows stop drafting on the draft's confidence (different K_b per row)
    (1.0, None, None, "conf", None),
    # "auto" choosing K = 0 (no draft forward: its tokens wait), then K = 1, which feeds them
    (1.0, None, None, "zero", None),
    # the draft's logits are NaN at about half its positions (a function of its own logits):
    # a row verifies only the drafts before its first such position, the target samples that one
    (1.0, None, 0.9, "nan", None),
    # the CPU verify's final draw row by row for every row (it takes batches of up to 8 rows;
    # 4,000 here), so that its residual and bonus draws meet the chi-square themselves
    (1.0, None, None, "rows", None),
    (0.7, None, None, "rows", [0, 2, 3, 5, 6]),
])
def test_sampling_matches_target_distribution(temperature, top_k, top_p, k, vocab, monkeypatch, torch_routes):
    V, N = 8, 4000
    target = _llama(V, 16, 2, 0.3, seed=0, max_pos=64)
    draft = _perturbed(target, 0.05, seed=1)  # alpha ~ 0.5: rejections, recoveries and bonuses
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(draft=draft, target=target, draft_vocab=vocab)
    # "conf": K = 3 with the confidence rule, 4 new tokens (so K is not cut by the budget) of which
    # the first two are tested
    conf = dict(num_draft_tokens=3, draft_confidence=0.1) if k == "conf" else dict(num_draft_tokens=k)
    if k == "rows":
        from specdec_kernels.ops.verify import torch_path as verify_mod

        torch_routes(row_draw_max=10**6)
        row_draws = []
        orig_rows = verify_mod._final_token_rows
        monkeypatch.setattr(verify_mod, "_final_token_rows",
                            lambda *a: row_draws.append(a[0].shape[0]) or orig_rows(*a))
        conf = dict(num_draft_tokens=2)
    if k == "nan":
        conf = dict(num_draft_tokens=3)
        draft_step = dec.parts.draft_runner.step

        def nan_step(*args, **kwargs):
            logits = draft_step(*args, **kwargs)  # [B, C, V]
            return logits.masked_fill((logits[..., 0] > logits[..., 1])[..., None], float("nan"))

        dec.parts.draft_runner.step = nan_step
    if k == "zero":
        from specdec_kernels.decoding.stats import StatsRecorder

        conf = dict(num_draft_tokens="auto")
        chosen = iter([0, 1, 1])
        orig_choose = StatsRecorder.choose_k
        StatsRecorder.choose_k = lambda self, k_max, allow_zero=False: next(chosen)
    # One batch of N copies of the prompt: row p samples with seed 1000 + p.
    try:
        res = dec.generate([prompt] * N, max_new_tokens={"conf": 4, "zero": 3, "nan": 4}.get(k, 2),
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=1000, **conf)
    finally:
        if k == "zero":
            StatsRecorder.choose_k = orig_choose
    if k == "rows":  # every step's final draw went row by row, over all 4,000 rows at first
        assert row_draws and row_draws[0] == N
    if k == "conf":  # in the first step, rows verified 1, 2 and 3 drafts
        assert set(res.stats.history[0]["num_draft"]) == {1, 2, 3}
    if k == "nan":  # rows cut at 1 and 2 drafts in the first step (its first draft is the same for
        # all: one prompt), at 0 later; none ended "nonfinite"
        assert set(res.stats.history[0]["num_draft"]) == {1, 2, 3}
        assert any(0 in h["num_draft"] for h in res.stats.history[1:])
        assert set(res.finish_reasons) == {"length"}
    if k == "zero":  # a K = 0 step (no draft forward), then steps that verified a draft
        ks = [h["k"] for h in res.stats.history]
        assert ks[:2] == [0, 1] and res.stats.draft_forwards == sum(ks) >= 1
    toks = torch.tensor([t[:2] for t in res.token_ids])  # [N, 2]
    assert toks.shape == (N, 2)
    assert 0.1 < res.stats.alpha < 0.95
    observed = torch.zeros((V, V), dtype=torch.int64)
    observed.index_put_((toks[:, 0], toks[:, 1]), torch.ones(N, dtype=torch.int64), accumulate=True)

    joint = _first_two_joint(target, prompt, temperature, top_k, top_p)  # [V, V]
    assert observed[joint == 0].sum() == 0  # tokens removed by top-k/top-p never appear
    if vocab is not None:  # the tokens the draft cannot propose are emitted (from the residual)
        outside = torch.ones(V, dtype=torch.bool)
        outside[vocab] = False
        assert joint.sum(1)[outside].sum() > 0.05
        assert observed.sum(1)[outside].sum() > 0
    p_first = _chisquare_pvalue(observed.sum(1), joint.sum(1))
    p_joint = _chisquare_pvalue(observed, joint)
    assert p_first > SIGNIFICANCE, p_first
    assert p_joint > SIGNIFICANCE, p_joint

    # Power: had the decoder emitted the draft's samples, the same test would reject them.
    q_joint = _first_two_joint(draft, prompt, temperature, top_k, top_p)
    pseudo = (q_joint * N).round().to(torch.int64)
    pseudo[joint == 0] = 0
    assert _chisquare_pvalue(pseudo, joint) < SIGNIFICANCE


@pytest.mark.slow
def test_prompt_lookup_sampling_first_token_distribution():
    """Deterministic drafts (draft_probs=None) with sampling: the first token is still p.
    (max_new_tokens=2, so K=2 is capped to 1 and a draft is verified: with max_new_tokens=1 the
    budget left K=0 and only the bonus was sampled, so a wrong residual passed.)"""
    V, N = 8, 3000
    target = _llama(V, 16, 2, 0.3, seed=0, max_pos=64)
    prompt = [3, 3, 3, 3]  # lookup proposes 3, 3, ...: a frequent token here, so some are accepted
    res = SpeculativeDecoder(target=target).generate([prompt] * N, max_new_tokens=2, num_draft_tokens=2,
                                                     temperature=1.0, seed=7)
    assert res.stats.drafted_tokens >= N  # every row verified a draft for its first token
    assert 0 < res.stats.accepted_tokens < res.stats.drafted_tokens  # both outcomes reached
    first = torch.tensor([t[0] for t in res.token_ids])
    observed = torch.bincount(first, minlength=V)
    p1 = torch.tensor(_first_two_joint(target, prompt, 1.0, None, None).sum(1).tolist())
    assert _chisquare_pvalue(observed, p1) > SIGNIFICANCE


# ----------------------------------------------------------------------------------------------
# 3. Batch invariance
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_equals_prompt_decoded_alone(pair, temperature):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    kw = dict(max_new_tokens=16, num_draft_tokens=3, temperature=temperature, top_k=20 if temperature else None)
    batch = dec.generate(PROMPTS, seed=50, **kw)
    for i, p in enumerate(PROMPTS):
        alone = dec.generate([p], seed=50 + i, **kw)  # row i of a call uses seed + i
        assert alone.token_ids[0] == batch.token_ids[i], i
    if temperature:  # the seed matters
        assert dec.generate(PROMPTS, seed=51, **kw).token_ids != batch.token_ids
