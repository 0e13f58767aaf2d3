"""The auto-K cost model of ``stats``: T_target depends on the number of verified tokens.

No timings are measured here: times are injected into ``StatsRecorder`` (or passed to the
chooser), and the expected K and costs are computed by hand from
E(K) = (1 - alpha^(K+1)) / (1 - alpha) over K * T_draft + T_target(K).
"""

from __future__ import annotations

import pytest

from specdec_kernels.decoding.stats import (
    TARGET_SLOPE_PRIOR,
    TIME_EMA,
    ZERO_REFRESH,
    StatsRecorder,
    choose_num_draft_tokens,
    expected_tokens_per_step,
    fit_step_cost,
    predicted_speedup,
)


def _recorder(alpha_steps: int = 0, k_max: int = 8, t_draft_prior: float = 0.05) -> StatsRecorder:
    rec = StatsRecorder(k_max, t_draft_prior)
    for _ in range(alpha_steps):  # one row accepting 4 of 5 drafts: alpha moves towards 0.8
        rec.record_step(5, [0], [5], [4], [5])
    return rec


def _inject(rec: StatsRecorder, k: int, t_target: float, t_draft: float = 0.05, times: int = 1) -> None:
    for _ in range(times):
        rec.record_times(t_draft * k, k, t_target, first_step=False, k=k)


# ----------------------------------------------------------------------------------------------
# The chooser with a per-K cost
# ----------------------------------------------------------------------------------------------
def test_chooser_matches_hand_computed_rates():
    # alpha 0.8, T_draft 0.1.  E(1..7) = 1.8, 2.44, 2.952, 3.3616, 3.68928, 3.951424, 4.1611392.
    # Flat T_target = 1: rates E / (1 + 0.1 K) = 1.636, 2.033, 2.271, 2.401, 2.4595, 2.4696, 2.4477
    # -> K = 6.  T_target(K) = 1 + 0.5 K: rates E / (1 + 0.6 K) = 1.125, 1.109, ... -> K = 1.
    # T_target(K) = 1 + 0.1 K: rates E / (1 + 0.2 K) = 1.5, 1.743, 1.845, 1.868, 1.845 -> K = 4.
    assert [round(expected_tokens_per_step(0.8, k), 7) for k in (1, 2, 3)] == [1.8, 2.44, 2.952]
    assert choose_num_draft_tokens(0.8, 0.1, 1.0, 8) == 6
    assert choose_num_draft_tokens(0.8, 0.1, lambda k: 1.0, 8) == 6
    assert choose_num_draft_tokens(0.8, 0.1, lambda k: 1.0 + 0.5 * k, 8) == 1
    assert choose_num_draft_tokens(0.8, 0.1, lambda k: 1.0 + 0.1 * k, 8) == 4
    # The chooser maximises exactly the formula with T_target(K).
    for alpha, td, slope in [(0.6, 0.02, 0.3), (0.9, 0.05, 0.05), (0.75, 0.0, 0.2)]:
        cost = lambda k: 0.7 + slope * (k + 1)  # noqa: E731
        rate = lambda k: expected_tokens_per_step(alpha, k) / (k * td + cost(k))  # noqa: E731
        k = choose_num_draft_tokens(alpha, td, cost, 12)
        assert all(rate(k) >= rate(j) for j in range(1, 13)), (alpha, td, slope, k)


def test_chooser_picks_smaller_k_when_verify_cost_grows_steeply():
    ks = [choose_num_draft_tokens(0.85, 0.03, lambda k, s=s: 1.0 + s * k, 10) for s in (0.0, 0.05, 0.2, 0.5, 2.0)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1], ks
    assert ks[0] >= 8 and ks[-1] == 1, ks


def test_recorder_chooses_by_measured_cost_per_length():
    """Injected step times at two lengths: flat -> large K, steep -> small K."""
    flat, steep = _recorder(20), _recorder(20)
    for rec, t2, t5 in ((flat, 1.0, 1.0), (steep, 1.0, 2.5)):
        _inject(rec, 1, t2, times=3)
        _inject(rec, 4, t5, times=3)
    assert flat.choose_k(8) >= 6
    assert steep.choose_k(8) <= 2
    # steep: T_target(n) = 0.5 n exactly (two points), so the chooser sees T(K) = 0.5 (K + 1).
    alpha = steep.alpha()
    assert steep.target_time(3) == pytest.approx(1.5)
    assert steep.choose_k(8) == choose_num_draft_tokens(alpha, 0.05, lambda k: 0.5 * (k + 1), 8)


# ----------------------------------------------------------------------------------------------
# The cost model of the recorder
# ----------------------------------------------------------------------------------------------
def test_target_time_prior_then_one_length_then_line():
    rec = StatsRecorder(8, 0.1, t_target_prior=2.0)
    r = TARGET_SLOPE_PRIOR
    assert rec.target_time(1) == pytest.approx(2.0)
    assert rec.target_time(5) == pytest.approx(2.0 * (1 + 4 * r))
    assert rec.times() == (0.1, pytest.approx(2.0))
    _inject(rec, 3, 0.4)  # n = 4
    assert rec.target_time(4) == pytest.approx(0.4)
    assert rec.target_time(1) == pytest.approx(0.4 / (1 + 3 * r))
    assert rec.target_time(7) == pytest.approx(0.4 * (1 + 6 * r) / (1 + 3 * r))
    _inject(rec, 1, 0.25)  # n = 2: the line through (2, 0.25) and (4, 0.4): 0.1 + 0.075 n
    assert rec.target_time(3) == pytest.approx(0.325)
    assert rec.target_time(9) == pytest.approx(0.775)
    # below the shortest measured length (n = 2): the prior shape anchored at the line's 0.25,
    # not the line's 0.175
    assert rec.target_time(1) == pytest.approx(0.25 / (1 + r))
    assert rec.target_time(1.5) == pytest.approx(0.25 * (1 + 0.5 * r) / (1 + r))
    assert rec.target_time_samples() == {2: (0.25, 1), 4: (0.4, 1)}


def test_target_time_moving_average_and_warm_up():
    rec = StatsRecorder(4, 0.1)
    rec.record_times(0.5, 2, 9.0, first_step=True, k=2)  # warm-up: totals only
    assert rec.target_time_samples() == {} and rec.stats.target_time_s == 9.0
    _inject(rec, 2, 1.0)
    _inject(rec, 2, 2.0)
    assert rec.target_time_samples() == {3: (pytest.approx((1 - TIME_EMA) * 1.0 + TIME_EMA * 2.0), 2)}
    rec.record_step(1, [0], [1], [1], [2])
    rec.record_times(0.1, 1, 0.5, first_step=False)  # k=None: the K of the last record_step
    assert set(rec.target_time_samples()) == {2, 3}


def test_fit_step_cost_least_squares_and_constraints():
    # Three points, weights 1, 2, 1: weighted least squares by hand.
    pts = [(1, 1.0, 1), (3, 2.0, 2), (5, 4.0, 1)]
    # n_bar = 3, t_bar = 2.25, S_nn = 8, S_nt = 1*(-2)(-1.25) + 0 + 1*2*1.75 = 6 -> b = 0.75, a = 0.
    a, b = fit_step_cost(pts)
    assert (a, b) == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.75))
    # Times falling with n (noise): the flat line at the weighted mean.
    assert fit_step_cost([(2, 2.0, 1), (5, 1.0, 3)]) == (pytest.approx(1.25), 0.0)
    # A negative intercept: the line through the origin, b = sum(w n t) / sum(w n^2).
    a, b = fit_step_cost([(2, 0.1, 1), (4, 1.0, 1)])
    assert a == 0.0 and b == pytest.approx((0.2 + 4.0) / (4 + 16))
    with pytest.raises(ValueError, match="two distinct lengths"):
        fit_step_cost([(3, 1.0, 2)])


def test_line_fit_used_by_the_recorder_with_counts_as_weights():
    rec = StatsRecorder(8, 0.05)
    _inject(rec, 0, 1.0)  # n = 1
    _inject(rec, 2, 2.0, times=2)  # n = 3, moving average stays 2.0, weight 2
    _inject(rec, 4, 4.0)  # n = 5
    assert rec.target_time(4) == pytest.approx(0.75 * 4)  # a = 0, b = 0.75 (see above)


def test_exploration_measures_a_second_length():
    """Measured at one length only: one step far from it (K = 1, or min(k_max, 4)), or K = 0
    (allow_zero) where the prior shape through the measured length rates that higher."""
    rec = _recorder(10)
    _inject(rec, 4, 1.0)
    assert rec.choose_k(8) == 1  # measured K = 4 only: explore K = 1
    rec2 = _recorder(10)
    _inject(rec2, 1, 1.0)
    assert rec2.choose_k(8) == 4 and rec2.choose_k(3) == 3
    assert rec2.choose_k(1) == 1  # no other length without K = 0
    # measured K = 1, alpha prior 0.6, T_draft 0.05: at batch 1 on a CPU (r = 0.1) K = 4 even
    # with K = 0 allowed (rates 2.306 / (0.2 + 1.4 / 1.1) = 1.57 against 1.1: a K = 0 step gives
    # up a step's drafts); at batch 8 (r = 0.8) K = 0, the cheap step (1.8 against 2.306 /
    # (0.2 + 4.2 / 1.8) = 0.91)
    for r, allow_zero, want in ((0.1, False, 4), (0.1, True, 4), (0.8, False, 4), (0.8, True, 0)):
        rec3 = StatsRecorder(8, 0.05, target_slope_prior=r)
        _inject(rec3, 1, 1.0)
        assert rec3.choose_k(8, allow_zero=allow_zero) == want, (r, allow_zero)
    rec4 = StatsRecorder(1, 0.05)  # k_max = 1: the only other length is K = 0
    _inject(rec4, 1, 1.0)
    assert rec4.choose_k(1, allow_zero=True) == 0 and rec4.choose_k(1) == 1
    _inject(rec, 1, 0.5)  # two lengths: the model decides
    assert rec.choose_k(8) == choose_num_draft_tokens(rec.alpha(), 0.05, lambda k: rec.target_time(k + 1), 8)


def test_k_zero_when_verifying_does_not_pay():
    """allow_zero: K = 0 (rate 1 / (T_draft + T_target(0))) against the best K >= 1, by hand."""
    def k0_recorder(t1, t2, t3):
        rec = StatsRecorder(8, 0.05)
        for _ in range(20):  # one row accepting 1 of 2 drafts: alpha towards 0.5
            rec.record_step(2, [0], [2], [1], [2])
        _inject(rec, 1, t2)
        _inject(rec, 2, t3)
        return rec, t1

    # a CPU at batch 8: T(0) = 35, T(1) = 58.5, T(2) = 84 (ms), T_draft = 0.05
    rec, t1 = k0_recorder(35.0, 58.5, 84.0)
    assert rec.choose_k(8) >= 1  # without allow_zero, never 0
    assert rec.choose_k(8, allow_zero=True) == 0  # the one-token step is not measured: measure it
    _inject(rec, 0, t1)
    a = rec.alpha()
    best = choose_num_draft_tokens(a, 0.05, lambda k: rec.target_time(k + 1), 8)
    rate_best = expected_tokens_per_step(a, best) / (best * 0.05 + rec.target_time(best + 1))
    assert 1 / (0.05 + rec.target_time(1)) > rate_best  # so K = 0 wins ...
    ks = [rec.choose_k(8, allow_zero=True) for _ in range(2 * ZERO_REFRESH + 2)]
    # ... ZERO_REFRESH times in a row, then one step at the best K >= 1 (alpha measured again)
    assert ks == ([0] * ZERO_REFRESH + [best]) * 2
    # a memory-bound step (batch 1): T(1) = 22, T(2) = 23.1: even the line's T(0) = 20.9 loses
    # to the best K >= 1, so K = 0 is not even tried
    rec, _ = k0_recorder(20.6, 22.0, 23.1)
    want = choose_num_draft_tokens(rec.alpha(), 0.05, lambda k: rec.target_time(k + 1), 8)
    assert want >= 1 and [rec.choose_k(8, allow_zero=True) for _ in range(3)] == [want] * 3


# ----------------------------------------------------------------------------------------------
# predicted_speedup with the per-K cost
# ----------------------------------------------------------------------------------------------
def test_predicted_speedup_with_verify_cost():
    e4 = expected_tokens_per_step(0.8, 4)
    assert predicted_speedup(0.8, 4, 0.1, 1.0) == pytest.approx(e4 / 1.4)
    assert predicted_speedup(0.8, 4, 0.1, 1.0, 2.0) == pytest.approx(e4 / 2.4)
    with pytest.raises(ValueError, match="t_verify must be finite and > 0, got 0.0"):
        predicted_speedup(0.8, 4, 0.1, 1.0, 0.0)


def test_finalize_reports_with_the_per_k_cost():
    rec = StatsRecorder(4, 0.05)
    # Steps: K = 3, 3, 1 (one row; accepted 2, 3, 1 drafts), the first one the warm-up.
    for i, (k, n, tt) in enumerate([(3, 2, 9.0), (3, 3, 2.0), (1, 1, 1.0)]):
        rec.record_step(k, [0], [k], [n], [n + 1])
        rec.record_times(0.05 * k, k, tt, first_step=i == 0, k=k)
    s = rec.finalize(10.0, 0.1, ["length"], None)
    # Line through (4, 2.0) and (2, 1.0): T(n) = 0.5 n; the one-token step below the shortest
    # measured length n = 2: 1.0 / (1 + r).  Mean K = 7/3, alpha = 6 / 7.
    assert s.alpha == pytest.approx(6 / 7)
    mean_k = 7 / 3
    t_one = 1.0 / (1 + TARGET_SLOPE_PRIOR)
    # Tokens per row-step: the mean of E(alpha, K_b) over the rows' K_b (3, 3, 1), not E(mean K).
    e_rows = (2 * expected_tokens_per_step(6 / 7, 3) + expected_tokens_per_step(6 / 7, 1)) / 3
    expected = predicted_speedup(6 / 7, mean_k, 0.05, t_one, 0.5 * (mean_k + 1), expected_tokens=e_rows)
    assert s.predicted_speedup == pytest.approx(expected)


def test_finalize_predicts_from_each_rows_own_number_of_drafts():
    # Two rows per step, K = 3: one row verifies 3 drafts, the other none (prompt lookup found
    # no match; or draft_confidence, or its budget).  The rows' tokens are E(alpha, 3) and
    # E(alpha, 0) = 1, not E(alpha, 3) for both (before: with prompt lookup the
    # prediction was above the tokens per row-step measured, 1.56 against 1.28).
    rec = StatsRecorder(3, 0.0)
    for i, n in enumerate([2, 1, 3, 0]):
        rec.record_step(3, [0, 1], [3, 0], [n, 0], [n + 1, 1])
        rec.record_times(0.0, 0, 1.0, first_step=i == 0, k=3)
    s = rec.finalize(10.0, 0.1, ["length"] * 2, None, draft_is_free=True)
    alpha = s.alpha
    assert alpha == pytest.approx(6 / 9)  # accepted 2 + 1 + 3 + 0 of the 3 + 2 + 3 + 1 drafts reached
    e_rows = (expected_tokens_per_step(alpha, 3) + 1.0) / 2
    t1, tv = rec.target_time(1), rec.target_time(4)
    assert s.predicted_speedup == pytest.approx(e_rows * t1 / tv)
    assert s.predicted_speedup < expected_tokens_per_step(alpha, 3) * t1 / tv  # what it was
    with pytest.raises(ValueError, match="expected_tokens must be finite and >= 1, got 0.5"):
        predicted_speedup(0.5, 2, 0.0, 1.0, expected_tokens=0.5)
    with pytest.raises(ValueError, match="expected_tokens must be finite and >= 1, got 2"):
        predicted_speedup(0.5, 2, 0.0, 1.0, expected_tokens="2")


def test_a_one_token_step_measured_elsewhere():
    # The verify steps measured at n = 3 and 5 (the line 20 + 2 n); the target alone measured
    # 30 at n = 1 (the CLI's --baseline run).  Below n = 3 the step is the line between (1, 30)
    # and (3, 26), not the prior shape anchored at 26 (which put the one-token step at
    # 26 / 1.2 = 21.7: the main job's predicted speed-up was 1.4-1.6x beside a measured 1.8-2.1x).
    rec = StatsRecorder(4, 0.05)
    _inject(rec, 2, 26.0)
    _inject(rec, 4, 30.0)
    assert rec.target_time(1) == pytest.approx(26.0 / (1 + 2 * TARGET_SLOPE_PRIOR))
    rec.set_target_step(30.0)
    assert rec.target_time(1) == pytest.approx(30.0) and rec.target_time(2) == pytest.approx(28.0)
    assert rec.target_time(4) == pytest.approx(28.0) and rec.target_time(5) == pytest.approx(30.0)  # the line
    _inject(rec, 0, 29.0)  # a K = 0 step measured here takes over
    assert rec.target_time(1) != pytest.approx(30.0)
    one = StatsRecorder(4, 0.05)
    one.set_target_step(10.0)  # nothing measured here: the prior shape through it
    assert one.target_time(3) == pytest.approx(10.0 * (1 + 2 * TARGET_SLOPE_PRIOR))
    with pytest.raises(ValueError, match=r"the one-token step must be a finite number > 0, got -1.0"):
        one.set_target_step(-1.0)


def test_cpu_slope_prior_through_the_measured_slopes():
    """0.03 * B^1.5 (the embedded target's measured slopes: 0.03 at batch 1, 0.65 at batch 8),
    at least TARGET_SLOPE_PRIOR; the decoder gives it to its recorder on the CPU."""
    from specdec_kernels.decoding.stats import cpu_slope_prior

    assert cpu_slope_prior(1) == cpu_slope_prior(2) == TARGET_SLOPE_PRIOR
    assert cpu_slope_prior(4) == pytest.approx(0.24) and cpu_slope_prior(8) == pytest.approx(0.03 * 8 ** 1.5)
    assert all(cpu_slope_prior(b) <= cpu_slope_prior(b + 1) for b in range(1, 64))


def test_decoder_recorder_gets_the_cpu_prior():
    from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair
    from specdec_kernels.decoding.decoder import SpeculativeDecoder
    from specdec_kernels.decoding.stats import cpu_slope_prior

    draft, target, tok = build_tiny_random_pair(seed=0)
    dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok)
    for B in (1, 3, 8):
        st = dec.start(["ab"] * B, 4, "auto", 0.0, None, None, 0, max_draft_tokens=4)
        rec = st.hooks.recorder
        assert rec.target_slope_prior == cpu_slope_prior(B) and rec.zero_step_draft_forwards == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_slope_prior=-0.1), "target_slope_prior must be a finite number >= 0, got -0.1"),
    (dict(target_slope_prior=float("nan")), "target_slope_prior must be a finite number >= 0, got nan"),
    (dict(zero_step_draft_forwards=-1), "zero_step_draft_forwards must be an int >= 0, got -1"),
    (dict(zero_step_draft_forwards=True), "zero_step_draft_forwards must be an int >= 0, got True"),
])
def test_recorder_refuses_bad_priors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StatsRecorder(8, 0.05, **kwargs)


@pytest.mark.parametrize("batch", [0, -2, 1.5, True])
def test_cpu_slope_prior_refuses_a_bad_batch(batch):
    from specdec_kernels.decoding.stats import cpu_slope_prior

    with pytest.raises(ValueError, match=f"batch must be an int >= 1, got {batch!r}"):
        cpu_slope_prior(batch)


@pytest.mark.parametrize("call,match", [
    # (before: a ZeroDivisionError, or NaN/K = 1 returned silently)
    (lambda: choose_num_draft_tokens(0.5, 0.0, 0.0, 8), r"t_target must be finite and > 0, got 0.0 for K = 1"),
    (lambda: choose_num_draft_tokens(0.5, 0.1, float("nan"), 8), r"t_target must be finite and > 0, got nan"),
    (lambda: choose_num_draft_tokens(0.5, 0.1, lambda k: 1.0 if k < 3 else float("inf"), 8),
     r"t_target must be finite and > 0, got inf for K = 3"),
    (lambda: choose_num_draft_tokens(float("nan"), 0.1, 1.0, 8), r"alpha must be a number in \[0, 1\], got nan"),
    (lambda: choose_num_draft_tokens(0.9, float("nan"), 1.0, 8), r"t_draft must be finite, got nan"),
    (lambda: predicted_speedup(0.5, 4, 0.1, float("inf")), r"t_target must be finite and > 0, got inf"),
    (lambda: predicted_speedup(0.5, -0.5, 0.1, 1.0), r"k must be finite and >= 0, got -0.5"),
    (lambda: predicted_speedup(0.5, 2, 0.1, 1.0, t_verify=float("nan")), r"t_verify must be finite and > 0, got nan"),
    (lambda: expected_tokens_per_step(float("nan"), 3), r"alpha must be a number in \[0, 1\], got nan"),
])
def test_cost_model_refuses_unusable_numbers(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_stats_by_hand():
    """finalize's figures on a hand-made history (a mutation run found these unchecked before):
    K_b / accepted per step (3, 2), (3, 3), (1, 1), (3, 0) and an unusable step (3, -1)."""
    rec = StatsRecorder(4, 0.05)
    for k, n in [(3, 2), (3, 3), (1, 1), (3, 0)]:
        rec.record_step(k, [0], [k], [n], [n + 1])
    rec.record_step(3, [0], [3], [-1], [0])  # an unusable row: neither drafted nor reached
    s = rec.finalize(1.0, 0.0, ["length"], None)
    assert s.drafted_tokens == 10 and s.accepted_tokens == 6
    assert s.alpha == pytest.approx(6 / 8)  # reached 3 + 3 + 1 + 1: drafts after a rejection are not
    assert s.acceptance_per_position == [pytest.approx(3 / 4), 1.0, pytest.approx(1 / 2)]
    assert choose_num_draft_tokens(0.0, 0.0, 1.0, 8) == 1  # a tie goes to the smaller K
    a, b = fit_step_cost([(2, 0.1, 3), (4, 1.0, 1)])  # a line through the origin, weighted
    assert a == 0.0 and b == pytest.approx((3 * 0.2 + 4.0) / (3 * 4 + 16))


def test_prompt_lookup_predicted_speedup_counts_its_cost_per_draft():
    rec = StatsRecorder(4, 0.0)
    for i in range(3):
        rec.record_step(2, [0], [2], [1], [2])
        rec.record_times(0.02, 0, 1.0, first_step=i == 0, k=2)
    s = rec.finalize(1.0, 0.0, ["length"], None, draft_is_free=True)
    # the lookup's 0.02 s a step is 0.01 s a draft at K = 2
    assert s.predicted_speedup == pytest.approx(predicted_speedup(0.5, 2, 0.01, rec.target_time(1), rec.target_time(3)))


def test_an_untypical_draft_time_is_not_averaged_in():
    rec = StatsRecorder(4, 0.05)
    rec.record_times(5.0, 1, 1.0, first_step=False, k=1, draft_typical=False)
    assert rec.times()[0] == 0.05
