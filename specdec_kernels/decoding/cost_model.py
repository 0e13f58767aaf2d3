"""The speed-up model behind ``num_draft_tokens="auto"``: what a step of K drafts is expected
to emit and cost, and the K that maximises tokens per second.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
section 3; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"):

- a *step* (iteration) is one target forward that verifies K drafted tokens of every active
  row; a *row-step* is one row's share of it.
- a draft token is *accepted* when the verifier keeps it; a row-step that accepts n of its
  K_b drafts emits n + 1 tokens (the n drafts, then a *recovered* token drawn from the
  residual after a rejection, or a *bonus* token drawn from the target when all K_b were
  accepted).
- alpha, the acceptance rate, is modelled as the probability that a draft is accepted given
  that all drafts before it were: each draft position a row-step *reaches* (the first n + 1
  when it rejects, all K_b when it does not) is one Bernoulli(alpha) trial, and alpha is
  estimated as accepted / reached.  Under that model a step with K drafts emits

      E(K) = (1 - alpha^(K+1)) / (1 - alpha)          tokens (K + 1 when alpha = 1),

  and costs K * T_draft + T_target(K), against T_target(0) per token for the target alone:

      speed-up(K) = E(K) * T_target(0) / (K * T_draft + T_target(K)).

  T_target(K) is the target's verify step over K + 1 tokens (forward and verification).  It
  grows with K where the forward is compute-bound (on a CPU, 5 tokens cost about twice one),
  so one measured T_target for every K over-drafts.  ``StatsRecorder`` keeps the measured step
  time per verified length n = K + 1 and models T_target(K) = a + b * (K + 1): see
  ``StatsRecorder.target_time``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

__all__ = ["ALPHA_PRIOR", "ALPHA_PRIOR_TRIALS", "TARGET_SLOPE_PRIOR", "TIME_EMA", "ZERO_REFRESH",
           "choose_num_draft_tokens", "cpu_slope_prior", "expected_tokens_per_step", "fit_step_cost",
           "predicted_speedup"]

# Priors used before anything is measured: acceptance rate, and its weight in pseudo-trials.
ALPHA_PRIOR = 0.6
ALPHA_PRIOR_TRIALS = 4.0
# Prior shape of the target's step cost over the verified length n = K + 1, used until two
# lengths are measured: T_target(n) proportional to 1 + r * (n - 1), i.e. each extra verified
# token costs the fraction r of a one-token step.  r = TARGET_SLOPE_PRIOR on a GPU (memory-bound
# at these sizes); on a CPU, where a step turns compute-bound as the rows grow, ``cpu_slope_prior``
# (``SpeculativeDecoder`` passes it to ``StatsRecorder``).
TARGET_SLOPE_PRIOR = 0.1
# Exponential moving average weight of a new time measurement.
TIME_EMA = 0.3
# choose_k(allow_zero=True): after this many K = 0 steps in a row, one step at the best K >= 1,
# so that alpha (which K = 0 steps do not measure) stays current.
ZERO_REFRESH = 16


def cpu_slope_prior(batch: int) -> float:
    """The prior r for a CPU step over ``batch`` rows: 0.03 * batch^1.5, at least
    TARGET_SLOPE_PRIOR.  Through the slopes measured for the embedded target on a CPU (1 thread,
    skinny_linear; docs/history/measurements.md): 0.03 at batch 1, 0.65 at batch 8 (so 0.1 up to
    batch 2, 0.24 at 4, 0.68 at 8)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"cpu_slope_prior: batch must be an int >= 1, got {batch!r}")
    return max(TARGET_SLOPE_PRIOR, 0.03 * batch ** 1.5)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E(K) = (1 - alpha^(K+1)) / (1 - alpha): tokens emitted per step with K drafts when each
    draft is accepted with probability alpha given that the ones before it were."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha}")
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: float, t_draft: float, t_target: float,
                      t_verify: Optional[float] = None, expected_tokens: Optional[float] = None) -> float:
    """E(K) * T_target / (K * T_draft + T_verify): T_target is the target's one-token step (what
    the target alone pays per token), T_verify its step verifying K drafts (K + 1 tokens); None
    takes T_verify = T_target (a cost independent of K).  A fractional K (the mean of a run that
    varied K) interpolates E linearly between its neighbours.  ``expected_tokens``: the tokens a
    step is expected to emit, in place of E(K) (``finalize`` passes the mean of E(alpha, K_b)
    over the rows' own K_b)."""
    if not (math.isfinite(t_target) and t_target > 0):
        raise ValueError(f"t_target must be finite and > 0, got {t_target}")
    if t_verify is None:
        t_verify = t_target
    if not (math.isfinite(t_verify) and t_verify > 0):
        raise ValueError(f"t_verify must be finite and > 0, got {t_verify}")
    if not (math.isfinite(k) and k >= 0):
        raise ValueError(f"k must be finite and >= 0, got {k}")
    if not math.isfinite(t_draft):
        raise ValueError(f"t_draft must be finite, got {t_draft}")
    if expected_tokens is not None:
        if isinstance(expected_tokens, bool) or not isinstance(expected_tokens, (int, float)) or not (
                math.isfinite(expected_tokens) and expected_tokens >= 1):
            raise ValueError(f"expected_tokens must be finite and >= 1, got {expected_tokens}")
        e = expected_tokens
    else:
        lo = int(k)
        frac = k - lo
        e = expected_tokens_per_step(alpha, lo)
        if frac > 0:
            e = (1 - frac) * e + frac * expected_tokens_per_step(alpha, lo + 1)
    return e * t_target / (k * max(t_draft, 0.0) + t_verify)


def choose_num_draft_tokens(alpha: float, t_draft: float, t_target: Union[float, Callable[[int], float]],
                            k_max: int) -> int:
    """The K in 1..k_max that maximises E(K) / (K * T_draft + T_target(K)) (ties: the smaller K).

    ``t_target``: the target's verify step, either one number for every K or a function of K
    (the step that verifies K drafts, i.e. a forward over K + 1 tokens)."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    if not math.isfinite(t_draft):
        raise ValueError(f"t_draft must be finite, got {t_draft}")
    cost = t_target if callable(t_target) else (lambda k: t_target)
    best_k, best = 1, -1.0
    for k in range(1, k_max + 1):
        c = cost(k)
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"t_target must be finite and > 0, got {c} for K = {k}")
        rate = expected_tokens_per_step(alpha, k) / (k * max(t_draft, 0.0) + c)
        if rate > best * (1 + 1e-9):
            best_k, best = k, rate
    return best_k


def fit_step_cost(points: list) -> tuple[float, float]:
    """(a, b) of the line t = a + b * n that fits ``points`` [(n, t, weight)] by weighted least
    squares with a >= 0 and b >= 0 (a step never gets cheaper with more tokens, and costs no
    less per token for fewer).  Needs two distinct n."""
    W = sum(w for _, _, w in points)
    n_bar = sum(w * n for n, _, w in points) / W
    t_bar = sum(w * t for _, t, w in points) / W
    s_nn = sum(w * (n - n_bar) ** 2 for n, _, w in points)
    if s_nn <= 0:
        raise ValueError("fit_step_cost needs points at two distinct lengths")
    b = sum(w * (n - n_bar) * (t - t_bar) for n, t, w in points) / s_nn
    a = t_bar - b * n_bar
    if a >= 0 and b >= 0:
        return a, b
    # The constrained optimum lies on a boundary: a flat line, or a line through the origin.
    sse = lambda a, b: sum(w * (t - a - b * n) ** 2 for n, t, w in points)  # noqa: E731
    flat = (t_bar, 0.0)
    origin = (0.0, sum(w * n * t for n, t, w in points) / sum(w * n * n for n, _, w in points))
    feasible = [c for c in (flat, origin) if c[0] >= 0 and c[1] >= 0] or [(max(t_bar, 0.0), 0.0)]
    return min(feasible, key=lambda c: sse(*c))
