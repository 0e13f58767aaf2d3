"""SpeculativeDecoder's caches: after each step both caches equal a fresh forward over each row's
prefix (also through steps without drafts and the grouped prefill), and nothing is recomputed:
every forward is wrapped and its fed tokens counted.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.prefill import _PREFILL_GROUP_COST, _prefill_groups
from specdec_kernels.decoding import loop

from decoder_setup import PROMPTS, SKEWED, _CountingForward, _CountingModelForward, _assert_row_cache
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)


# ----------------------------------------------------------------------------------------------
# 4. Cache rollback
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_equal_fresh_forward_after_each_step(pair, temperature):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    st = dec.start(PROMPTS, 30, 4, temperature, None, None, 0, max_draft_tokens=4)
    caught_up = 0
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        for _ in range(5):
            loop.step(dec.parts, st)
            assert st.target_cache.get_seq_length() == max(st.target_len_host)
            assert st.draft.cache.get_seq_length() == max(st.draft.cache_len_host)
            for b, p in enumerate(st.rows):
                seq = st.seqs[p]
                # The target caches everything but the last emitted token; the draft also lacks
                # x_K when the row accepted all K drafts (it catches up next step).
                assert st.target_len_host[b] == len(seq) - 1
                assert st.draft.cache_len_host[b] == len(seq) - 1 - int(st.draft.catch_up_host[b])
                caught_up += int(st.draft.catch_up_host[b])
                _assert_row_cache(st.target_cache, b, st.target_len_host[b], target, seq[: st.target_len_host[b]])
                _assert_row_cache(st.draft.cache, b, st.draft.cache_len_host[b], draft,
                                  seq[: st.draft.cache_len_host[b]])
    assert caught_up > 0  # the catch-up path was exercised


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_steps_without_drafts(pair, temperature):
    """K = 0 steps chosen by "auto" run no draft forward: the tokens the draft has not taken
    (catch-up included) wait, right-aligned, and its next step with drafts feeds them in one
    block before its drafts.  After each step both caches equal a fresh forward over the prefix,
    and what waits, the catch-up token and ``last`` are exactly the rest of the row."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    st = dec.start(PROMPTS, 30, "auto", temperature, None, None, 0, max_draft_tokens=4)
    pattern = [4, 0, 0, 3, 0, 4, 0, 2, 0, 0, 0, 1]
    ks = iter(pattern)
    st.hooks.recorder.choose_k = lambda k_max, allow_zero=False: next(ks)
    fed = []
    orig = dec.parts.draft_runner.step
    dec.parts.draft_runner.step = lambda *a, **kw: fed.append(1) or orig(*a, **kw)
    zero_after_catch = waited_most = 0
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        for k in pattern:
            catch_before = any(st.draft.catch_up_host)
            fed.clear()
            loop.step(dec.parts, st)
            assert st.hooks.recorder.stats.history[-1]["k"] == k
            if k == 0:
                assert not fed  # no draft forward at all
                zero_after_catch += int(catch_before)
                assert not any(st.draft.catch_up_host)  # the catch-up token waits with the rest
            else:
                assert len(fed) == k and st.draft.waiting is None  # one block, then a forward per draft
            for b, p in enumerate(st.rows):
                seq = st.seqs[p]
                assert st.target_len_host[b] == len(seq) - 1
                ld = st.draft.cache_len_host[b]
                w = 0 if st.draft.waiting is None else st.draft.waiting_count_host[b]
                waiting = [] if w == 0 else st.draft.waiting[b, -w:].tolist()
                catch = [int(st.draft.catch_up[b])] if st.draft.catch_up_host[b] else []
                assert waiting + catch + [int(st.last[b])] == seq[ld:]
                waited_most = max(waited_most, w)
                _assert_row_cache(st.target_cache, b, st.target_len_host[b], target, seq[: st.target_len_host[b]])
                _assert_row_cache(st.draft.cache, b, ld, draft, seq[:ld])
    assert zero_after_catch > 0  # a K = 0 step came after a row's catch-up token
    assert waited_most >= 3  # tokens waited through several K = 0 steps




def test_prefill_groups_are_optimal_partitions():
    """_prefill_groups against brute force over every partition of the rows (not only runs of
    consecutive lengths): same cost; each row with tokens in exactly one group, the others in none."""
    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for i in range(len(part)):
                yield part[:i] + [[first] + part[i]] + part[i + 1:]
            yield [[first]] + part

    def cost(groups, lens, fixed):
        return sum(fixed + len(g) * max(lens[i] for i in g) for g in groups)

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 7, (), generator=g))
        lens = torch.randint(0, 40, (n,), generator=g).tolist()
        fixed = [0, 1, 8, 30, 4096][trial % 5]
        groups = _prefill_groups(lens, fixed)
        rows = sorted(i for grp in groups for i in grp)
        assert rows == [i for i in range(n) if lens[i] > 0], (lens, groups)
        nonzero = [i for i in range(n) if lens[i] > 0]
        best = min(cost(p, lens, fixed) for p in partitions(nonzero)) if nonzero else 0
        assert cost(groups, lens, fixed) == best, (lens, fixed, groups)
    assert _prefill_groups([1, 29, 0, 12, 11], 8) == [[0], [3, 4], [1]]
    assert _prefill_groups([1, 29, 0, 12, 11], 4096) == [[0, 1, 3, 4]]


def test_prefill_groups_match_the_quadratic_programme_on_large_batches():
    """The envelope (convex hull) form against the plain dynamic programme over every cut of the
    sorted rows, on batches of up to 300 rows with repeated lengths and fractional costs: the same
    optimal cost, and every row with tokens in exactly one group."""
    def quadratic(lens, fixed):
        ls = sorted(x for x in lens if x > 0)
        best = [0.0] + [math.inf] * len(ls)
        for j in range(1, len(ls) + 1):
            best[j] = min(best[i] + fixed + (j - i) * ls[j - 1] for i in range(j))
        return best[-1]

    g = torch.Generator().manual_seed(1)
    for trial in range(80):
        n = int(torch.randint(1, 301, (), generator=g))
        top = [3, 40, 2000][trial % 3]
        lens = torch.randint(0, top, (n,), generator=g).tolist()
        fixed = [0, 0.5, 12, 37.25, 4096][trial % 5]
        groups = _prefill_groups(lens, fixed)
        assert sorted(i for grp in groups for i in grp) == [i for i in range(n) if lens[i] > 0]
        got = sum(fixed + len(grp) * max(lens[i] for i in grp) for grp in groups)
        assert got == pytest.approx(quadratic(lens, fixed), rel=1e-12, abs=1e-9), (trial, n, fixed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grouped_prefill_caches_and_outputs(pair, temperature):
    """Skewed prompt lengths: the prefill runs one forward per group, the stacked caches equal a
    fresh forward over each row's prefix (after the prefill and after every step), and every
    row's output equals the prompt decoded alone (greedy: equals target.generate)."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    st = dec.start(SKEWED, 12, 3, temperature, None, None, 7, max_draft_tokens=3)
    tc = _CountingForward(dec, "target")
    try:
        with torch.inference_mode():
            loop.prefill(dec.parts, st)
    finally:
        tc.restore()
    groups = _prefill_groups([len(p) - 1 for p in SKEWED], _PREFILL_GROUP_COST["cpu"])
    assert len(groups) > 1
    assert [tuple(c[0].shape) for c in tc.calls] == [(len(g), max(len(SKEWED[i]) - 1 for i in g)) for g in groups]
    with torch.inference_mode():
        for b, p in enumerate(st.rows):
            if st.target_len_host[b]:
                _assert_row_cache(st.target_cache, b, st.target_len_host[b], target,
                                  st.seqs[p][: st.target_len_host[b]])
                _assert_row_cache(st.draft.cache, b, st.draft.cache_len_host[b], draft,
                                  st.seqs[p][: st.draft.cache_len_host[b]])
        for _ in range(4):
            loop.step(dec.parts, st)
            for b, p in enumerate(st.rows):
                _assert_row_cache(st.target_cache, b, st.target_len_host[b], target,
                                  st.seqs[p][: st.target_len_host[b]])
                _assert_row_cache(st.draft.cache, b, st.draft.cache_len_host[b], draft,
                                  st.seqs[p][: st.draft.cache_len_host[b]])
    kw = dict(max_new_tokens=12, num_draft_tokens=3, temperature=temperature)
    batch = dec.generate(SKEWED, seed=7, **kw)
    for i, p in enumerate(SKEWED):
        alone = dec.generate([p], seed=7 + i, **kw)
        assert alone.token_ids[0] == batch.token_ids[i], i
        if temperature == 0:
            with torch.inference_mode():
                ref = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=0)
            assert batch.token_ids[i] == ref[0, len(p):].tolist(), i


# ----------------------------------------------------------------------------------------------
# 5. Nothing is recomputed: count what each model is fed
# ----------------------------------------------------------------------------------------------

def test_a_batch_without_padding_runs_without_a_mask(pair, greedy_refs):
    """One prompt: no cache column is ever padding, so after the prefill the decoder calls both
    models without an attention mask (their causal mask alone, the same logits), and the output
    still equals target.generate."""
    draft, target = pair
    i = max(range(len(PROMPTS)), key=lambda j: len(PROMPTS[j]))  # a prompt with a prefill
    dec = SpeculativeDecoder(draft=draft, target=target)
    tc, dc = _CountingForward(dec, "target"), _CountingForward(dec, "draft")
    try:
        res = dec.generate([PROMPTS[i]], max_new_tokens=24, num_draft_tokens=3)
    finally:
        tc.restore()
        dc.restore()
    assert res.token_ids == [greedy_refs[i]]
    assert len(tc.calls) > 2 and tc.unmasked == len(tc.calls) - 1  # all but the prefill
    assert len(dc.calls) > 2 and dc.unmasked == len(dc.calls) - 1
    assert tc.lean == len(tc.calls) - 1 and dc.lean == len(dc.calls) - 1  # the steps took the lean path


@pytest.mark.parametrize("path", ["lean", "model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_token_is_fed_once(pair, temperature, path):
    """Counted where the decoder hands tokens to each model (path "lean": the default, decode
    steps through LeanLlamaStep) and at the models' own forward (path "model": lean_forward=False)."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target, lean_forward=path == "lean")
    if path == "lean":
        tc, dc = _CountingForward(dec, "target"), _CountingForward(dec, "draft")
    else:
        tc, dc = _CountingModelForward(target), _CountingModelForward(draft)
    try:
        res = dec.generate(PROMPTS, max_new_tokens=20, num_draft_tokens=4, temperature=temperature, seed=3)
    finally:
        tc.restore()
        dc.restore()
    if path == "lean":
        assert tc.lean == len(tc.calls) - 1 and dc.lean == len(dc.calls) - 1  # all but the prefill
    hist = res.stats.history
    lens = {p: len(x) for p, x in enumerate(PROMPTS)}
    P = max(lens.values()) - 1
    # Prefill: every prompt token but the last, once, in both models.
    for calls in (tc.calls, dc.calls):
        ids, mask, pos = calls[0]
        assert ids.shape == (len(PROMPTS), P)
        assert mask.sum(1).tolist() == [max(lens[p] - 1, 1) for p in range(len(PROMPTS))]  # col 0 stands in
    assert len(tc.calls) == 1 + len(hist)
    assert len(dc.calls) == 1 + sum(h["k"] for h in hist)

    cached = {p: lens[p] - 1 for p in lens}  # tokens in the target cache
    d_cached = dict(cached)  # tokens in the draft cache
    prev_all = {p: False for p in lens}  # row accepted all K last step (draft must catch up)
    di = 1
    fed_t = fed_d = catch_ups = 0
    for s, h in enumerate(hist):
        K, rows = h["k"], h["rows"]
        # Draft: K forwards; the first feeds [x_K, last] for rows catching up, else [last].
        for j in range(K):
            ids, mask, pos = dc.calls[di + j]
            T = mask.shape[1] - ids.shape[1]
            if j == 0:
                assert ids.shape[1] == (2 if any(prev_all[p] for p in rows) else 1)
                catch_ups += sum(prev_all[p] for p in rows)
            else:
                assert ids.shape[1] == 1
            for b, p in enumerate(rows):
                new = mask[b, T:].bool()
                if j == 0:
                    assert mask[b, :T].sum().item() == d_cached[p]  # the cache holds each token once
                    assert new.sum().item() == 1 + prev_all[p]
                    assert pos[b, new][0].item() == d_cached[p]  # the first new token is the next position
                fed_d += new.sum().item()
        di += K
        # Target: exactly [last, x_1 .. x_K] at the positions after the cached tokens.
        ids, mask, pos = tc.calls[1 + s]
        T = mask.shape[1] - ids.shape[1]
        assert ids.shape == (len(rows), K + 1)
        for b, p in enumerate(rows):
            assert mask[b, :T].sum().item() == cached[p]
            assert mask[b, T:].all()
            assert pos[b].tolist() == list(range(cached[p], cached[p] + K + 1))
            n = h["accepted"][b]
            cached[p] += n + 1
            d_cached[p] += int(prev_all[p]) + min(n + 1, K)
            prev_all[p] = n == K
            fed_t += K + 1
    # Totals: the target saw each kept token once plus each rejected draft once.
    rejected = res.stats.drafted_tokens - res.stats.accepted_tokens
    steps_rows = res.stats.row_steps
    assert fed_t == sum(h["k"] * len(h["rows"]) for h in hist) + steps_rows
    assert fed_t == res.stats.accepted_tokens + steps_rows + rejected + sum(
        (h["k"] - kb) for h in hist for kb in h["num_draft"])
    assert fed_d > 0 and catch_ups > 0  # the two-column catch-up forward happened


def test_a_ragged_catch_up_block_over_a_dense_draft_cache(pair):
    """K = 1 over prompts of one length: after a step every row's draft cache can have the same
    length while only the rows that accepted their draft catch up, so the next draft block is
    ragged (filler columns) over a dense cache and needs its mask.  The draft cache must equal a
    fresh forward after each step, and seeded sampling stays batch invariant (a mutant that
    dropped the mask there survived the suite before, in a mutation run)."""
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    st = dec.start(prompts, 12, 1, 0.0, None, None, 0, max_draft_tokens=4)
    hit = 0
    with torch.inference_mode():
        loop.prefill(dec.parts, st)
        for _ in range(8):
            hit += min(st.draft.cache_len_host) == st.draft.columns and len(set(st.draft.catch_up_host)) > 1
            loop.step(dec.parts, st)
            for b, p in enumerate(st.rows):
                _assert_row_cache(st.draft.cache, b, st.draft.cache_len_host[b], draft,
                                  st.seqs[p][: st.draft.cache_len_host[b]])
    assert hit > 0  # the case this is about was reached
    kw = dict(max_new_tokens=16, num_draft_tokens=1, temperature=1.0)
    prompts = prompts + [[10, 11, 12]]
    batch = dec.generate(prompts, seed=50, **kw)
    for i, p in enumerate(prompts):
        assert dec.generate([p], seed=50 + i, **kw).token_ids[0] == batch.token_ids[i], i
