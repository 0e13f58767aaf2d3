"""Statistics of a speculative-decoding run, and the speed-up model that picks K.

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

  and costs K * T_draft + T_target, against T_target per token for the target alone:

      speed-up(K) = E(K) * T_target / (K * T_draft + T_target).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

__all__ = [
    "DecodingStats",
    "StatsRecorder",
    "expected_tokens_per_step",
    "predicted_speedup",
    "choose_num_draft_tokens",
]

# Priors used before anything is measured: acceptance rate, and its weight in pseudo-trials.
ALPHA_PRIOR = 0.6
ALPHA_PRIOR_TRIALS = 4.0


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E(K) = (1 - alpha^(K+1)) / (1 - alpha): tokens emitted per step with K drafts when each
    draft is accepted with probability alpha given that the ones before it were."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: float, t_draft: float, t_target: float) -> float:
    """E(K) * T_target / (K * T_draft + T_target); a fractional K (the mean of a run that varied
    K) interpolates E linearly between its neighbours."""
    if t_target <= 0:
        raise ValueError(f"t_target must be > 0, got {t_target}")
    lo = int(k)
    frac = k - lo
    e = expected_tokens_per_step(alpha, lo)
    if frac > 0:
        e = (1 - frac) * e + frac * expected_tokens_per_step(alpha, lo + 1)
    return e * t_target / (k * max(t_draft, 0.0) + t_target)


def choose_num_draft_tokens(alpha: float, t_draft: float, t_target: float, k_max: int) -> int:
    """The K in 1..k_max that maximises E(K) / (K * T_draft + T_target) (ties: the smaller K)."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    best_k, best = 1, -1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens_per_step(alpha, k) / (k * max(t_draft, 0.0) + t_target)
        if rate > best * (1 + 1e-9):
            best_k, best = k, rate
    return best_k


@dataclass
class DecodingStats:
    """What one ``SpeculativeDecoder.generate`` call did.  Times are wall-clock seconds."""

    iterations: int = 0  # target verify forwards (steps), the prefill not counted
    row_steps: int = 0  # sum over steps of the rows active in it
    generated_tokens: int = 0  # tokens emitted, after truncation at EOS/stop/max_new_tokens
    drafted_tokens: int = 0  # sum of K_b over row-steps
    accepted_tokens: int = 0  # sum of n_b over row-steps
    acceptance_rate: Optional[float] = None  # accepted / drafted
    alpha: Optional[float] = None  # accepted / reached: the per-position acceptance (see module doc)
    acceptance_per_position: list = field(default_factory=list)  # [i]: P(draft i+1 accepted | reached)
    accepted_length_histogram: list = field(default_factory=list)  # [n]: row-steps that accepted n
    mean_tokens_per_target_call: Optional[float] = None  # emitted tokens per row-step
    mean_num_draft_tokens: Optional[float] = None  # mean K over steps
    draft_forwards: int = 0
    draft_time_s: float = 0.0  # draft forwards and draft sampling (or prompt lookup)
    target_time_s: float = 0.0  # target verify forwards and verification
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0
    tokens_per_s: Optional[float] = None  # generated_tokens / total_time_s
    time_per_draft_forward_s: Optional[float] = None
    time_per_target_forward_s: Optional[float] = None
    predicted_speedup: Optional[float] = None  # from alpha, mean K and the step times above
    baseline_tokens_per_s: Optional[float] = None  # the target alone, when measured
    measured_speedup: Optional[float] = None  # tokens_per_s / baseline_tokens_per_s
    finish_reasons: list = field(default_factory=list)  # per prompt: eos|stop|length|context|nonfinite
    history: list = field(default_factory=list, repr=False)  # per step: dict(k, rows, num_draft, accepted)

    def to_dict(self, with_history: bool = False) -> dict:
        d = asdict(self)
        if not with_history:
            d.pop("history")
        return d

    def summary(self) -> str:
        """A few human-readable lines."""
        def f(x, fmt="{:.3f}"):
            return "n/a" if x is None else fmt.format(x)

        hist = ", ".join(f"{n}:{c}" for n, c in enumerate(self.accepted_length_histogram))
        per_pos = ", ".join(f(a, "{:.2f}") for a in self.acceptance_per_position)
        return "\n".join([
            f"tokens: {self.generated_tokens} in {self.iterations} steps "
            f"({f(self.mean_tokens_per_target_call, '{:.2f}')} per target call), "
            f"{f(self.tokens_per_s, '{:.1f}')} tokens/s",
            f"drafted {self.drafted_tokens}, accepted {self.accepted_tokens} "
            f"(rate {f(self.acceptance_rate)}, alpha {f(self.alpha)}); per position [{per_pos}]",
            f"accepted-length histogram {{{hist}}}",
            f"time: draft {self.draft_time_s:.3f}s, target {self.target_time_s:.3f}s, "
            f"prefill {self.prefill_time_s:.3f}s, total {self.total_time_s:.3f}s",
            f"speed-up: predicted {f(self.predicted_speedup, '{:.2f}x')}, "
            f"measured {f(self.measured_speedup, '{:.2f}x')}",
        ])


class StatsRecorder:
    """Accumulates per-step counts and times; ``alpha()`` and ``times()`` feed K selection."""

    def __init__(self, k_max: int, t_draft_prior: float, t_target_prior: float = 1.0,
                 keep_history: bool = True):
        self.k_max = k_max
        self.stats = DecodingStats(acceptance_per_position=[], accepted_length_histogram=[0] * (k_max + 1))
        self._reached = [0] * k_max  # [i]: row-steps that reached draft position i
        self._accepted_at = [0] * k_max  # [i]: row-steps that accepted draft position i
        self._k_sum = 0
        self._keep_history = keep_history
        # Per-forward times: priors until measured; after that an exponential moving average.
        self._t_draft = t_draft_prior
        self._t_target = t_target_prior
        self._measured_draft = 0
        self._measured_target = 0

    # -- recording -------------------------------------------------------------------------
    def record_step(self, k: int, rows: list, num_draft: list, accepted: list, emitted: list) -> None:
        """One verify step: K, the prompt indices of its rows, each row's K_b, n_b (-1: the row
        was unusable) and the number of tokens it finally emitted."""
        s = self.stats
        s.iterations += 1
        self._k_sum += k
        for kb, n, e in zip(num_draft, accepted, emitted):
            s.row_steps += 1
            s.generated_tokens += e
            if n < 0:
                continue
            s.drafted_tokens += kb
            s.accepted_tokens += n
            s.accepted_length_histogram[n] += 1
            for i in range(min(n + 1, kb)):
                self._reached[i] += 1
                if i < n:
                    self._accepted_at[i] += 1
        if self._keep_history:
            s.history.append(dict(k=k, rows=list(rows), num_draft=list(num_draft), accepted=list(accepted)))

    def record_times(self, t_draft_total: float, n_draft_forwards: int, t_target: float,
                     first_step: bool) -> None:
        s = self.stats
        s.draft_time_s += t_draft_total
        s.target_time_s += t_target
        s.draft_forwards += n_draft_forwards
        if first_step:  # warm-up (allocations, kernel selection): not representative
            return
        ema = 0.3
        if n_draft_forwards > 0:
            t = t_draft_total / n_draft_forwards
            self._t_draft = t if self._measured_draft == 0 else (1 - ema) * self._t_draft + ema * t
            self._measured_draft += 1
        self._t_target = t_target if self._measured_target == 0 else (1 - ema) * self._t_target + ema * t_target
        self._measured_target += 1

    # -- estimates -------------------------------------------------------------------------
    def alpha(self, with_prior: bool = True) -> Optional[float]:
        reached = sum(self._reached)
        accepted = sum(self._accepted_at)
        if with_prior:
            return (accepted + ALPHA_PRIOR * ALPHA_PRIOR_TRIALS) / (reached + ALPHA_PRIOR_TRIALS)
        return accepted / reached if reached else None

    def times(self) -> tuple[float, float]:
        """(T_draft per draft forward, T_target per target forward), priors until measured."""
        return self._t_draft, self._t_target

    def choose_k(self, k_max: int) -> int:
        t_d, t_t = self.times()
        return choose_num_draft_tokens(self.alpha(), t_d, t_t, k_max)

    # -- final -----------------------------------------------------------------------------
    def finalize(self, total_time_s: float, prefill_time_s: float, finish_reasons: list,
                 baseline_tokens_per_s: Optional[float], draft_is_free: bool = False) -> DecodingStats:
        s = self.stats
        s.total_time_s = total_time_s
        s.prefill_time_s = prefill_time_s
        s.finish_reasons = list(finish_reasons)
        s.acceptance_rate = s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else None
        s.alpha = self.alpha(with_prior=False)
        last = max((i for i in range(self.k_max) if self._reached[i]), default=-1)
        s.acceptance_per_position = [
            self._accepted_at[i] / self._reached[i] if self._reached[i] else None for i in range(last + 1)]
        top = max((n for n, c in enumerate(s.accepted_length_histogram) if c), default=0)
        s.accepted_length_histogram = s.accepted_length_histogram[: top + 1]
        s.mean_tokens_per_target_call = s.generated_tokens / s.row_steps if s.row_steps else None
        s.mean_num_draft_tokens = self._k_sum / s.iterations if s.iterations else None
        s.tokens_per_s = s.generated_tokens / total_time_s if total_time_s > 0 else None
        s.time_per_draft_forward_s = s.draft_time_s / s.draft_forwards if s.draft_forwards else None
        s.time_per_target_forward_s = s.target_time_s / s.iterations if s.iterations else None
        if s.alpha is not None and s.time_per_target_forward_s and s.mean_num_draft_tokens:
            # With a model drafter the cost is per draft forward; prompt lookup costs per step.
            if draft_is_free:
                t_d = (s.draft_time_s / s.iterations) / s.mean_num_draft_tokens
            else:
                t_d = s.time_per_draft_forward_s or 0.0
            s.predicted_speedup = predicted_speedup(s.alpha, s.mean_num_draft_tokens, t_d,
                                                    s.time_per_target_forward_s)
        s.baseline_tokens_per_s = baseline_tokens_per_s
        if baseline_tokens_per_s and s.tokens_per_s:
            s.measured_speedup = s.tokens_per_s / baseline_tokens_per_s
        return s
