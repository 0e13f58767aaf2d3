"""Statistics of a speculative-decoding run (``DecodingStats``) and the recorder that keeps them
step by step and picks K for ``num_draft_tokens="auto"`` (``StatsRecorder``), through the
speed-up model of ``cost_model.py`` (where the terms, alpha, E(K) and T_target(K) are defined).
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field
from typing import Optional

from .cost_model import (ALPHA_PRIOR, ALPHA_PRIOR_TRIALS, TARGET_SLOPE_PRIOR, TIME_EMA,  # noqa: F401  (public here too)
                         ZERO_REFRESH, choose_num_draft_tokens, cpu_slope_prior, expected_tokens_per_step,
                         fit_step_cost, predicted_speedup)

__all__ = [
    "DecodingStats",
    "StatsRecorder",
    "expected_tokens_per_step",
    "predicted_speedup",
    "choose_num_draft_tokens",
    "cpu_slope_prior",
]

@dataclass
class DecodingStats:
    """What one ``SpeculativeDecoder.generate`` call did.  Times are wall-clock seconds."""

    iterations: int = 0  # target verify forwards (steps), the prefill not counted
    row_steps: int = 0  # sum over steps of the rows active in it
    generated_tokens: int = 0  # tokens emitted, after truncation at EOS/stop/max_new_tokens
    drafted_tokens: int = 0  # sum of K_b over row-steps (a row's unusable step, n = -1, not counted)
    accepted_tokens: int = 0  # sum of n_b over row-steps
    acceptance_rate: Optional[float] = None  # accepted / drafted
    alpha: Optional[float] = None  # accepted / reached: the per-position acceptance (see module doc)
    acceptance_per_position: list = field(default_factory=list)  # [i]: P(draft i+1 accepted | reached)
    accepted_length_histogram: list = field(default_factory=list)  # [n]: row-steps that accepted n
    mean_tokens_per_target_call: Optional[float] = None  # emitted tokens per row-step (a row of a target call)
    mean_num_draft_tokens: Optional[float] = None  # mean K over steps
    draft_forwards: int = 0
    draft_time_s: float = 0.0  # draft forwards and draft sampling (or prompt lookup)
    target_time_s: float = 0.0  # target verify forwards and verification
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0
    tokens_per_s: Optional[float] = None  # generated_tokens / total_time_s
    time_per_draft_forward_s: Optional[float] = None
    time_per_target_forward_s: Optional[float] = None
    predicted_speedup: Optional[float] = None  # from alpha, the rows' K_b, mean K and the step times above
    baseline_tokens_per_s: Optional[float] = None  # the target alone, when measured
    measured_speedup: Optional[float] = None  # tokens_per_s / baseline_tokens_per_s
    finish_reasons: list = field(default_factory=list)  # per prompt: eos|stop|length|context|nonfinite
    # a draft model's vocabulary: "shared" (the target's), or, over another tokenizer, the way its
    # drafts were proposed ("intersection" | "string"); None without a draft model
    vocabulary: Optional[str] = None
    intersection_size: Optional[int] = None  # the tokens both vocabularies share (where computed)
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
            f"({f(self.mean_tokens_per_target_call, '{:.2f}')} per row per target call), "
            f"{f(self.tokens_per_s, '{:.1f}')} tokens/s",
            f"drafted {self.drafted_tokens}, accepted {self.accepted_tokens} "
            f"(rate {f(self.acceptance_rate)}, alpha {f(self.alpha)}); per position [{per_pos}]",
            f"accepted-length histogram {{{hist}}}",
            f"time: draft {self.draft_time_s:.3f}s, target {self.target_time_s:.3f}s, "
            f"prefill {self.prefill_time_s:.3f}s, total {self.total_time_s:.3f}s",
            f"speed-up: predicted {f(self.predicted_speedup, '{:.2f}x')}, "
            f"measured {f(self.measured_speedup, '{:.2f}x')}",
        ] + ([] if self.vocabulary in (None, "shared") else [
            f"draft vocabulary: {self.vocabulary} (the tokenizers share "
            f"{'n/a' if self.intersection_size is None else self.intersection_size} tokens)"]))


class StatsRecorder:
    """Accumulates per-step counts and times; ``alpha()``, ``times()`` and ``target_time()`` feed
    K selection (``choose_k``).

    Times: T_draft is one number (per draft forward); the target's verify step is kept per
    verified length n = K + 1 (an exponential moving average per n, with its count), since its
    cost grows with K.  ``target_time(n)`` models it as a + b * n (see there); ``choose_k``
    maximises E(K) / (K * T_draft + T_target(K)) over K in 1..k_max with it.
    """

    def __init__(self, k_max: int, t_draft_prior: float, t_target_prior: float = 1.0,
                 keep_history: bool = True, target_slope_prior: float = TARGET_SLOPE_PRIOR,
                 zero_step_draft_forwards: int = 1):
        if not (isinstance(target_slope_prior, (int, float)) and math.isfinite(target_slope_prior)
                and target_slope_prior >= 0):
            raise ValueError(f"StatsRecorder: target_slope_prior must be a finite number >= 0, got "
                             f"{target_slope_prior!r}")
        if isinstance(zero_step_draft_forwards, bool) or not isinstance(zero_step_draft_forwards, int) \
                or zero_step_draft_forwards < 0:
            raise ValueError(f"StatsRecorder: zero_step_draft_forwards must be an int >= 0, got "
                             f"{zero_step_draft_forwards!r}")
        self.k_max = k_max
        self.target_slope_prior = target_slope_prior  # r of the prior shape (see TARGET_SLOPE_PRIOR)
        # draft forwards a K = 0 step runs (1: a drafter that keeps its cache in step each step;
        # SpeculativeDecoder passes 0: its drafts' tokens wait for their next forward)
        self.zero_step_draft_forwards = zero_step_draft_forwards
        self.stats = DecodingStats(acceptance_per_position=[], accepted_length_histogram=[0] * (k_max + 1))
        self._reached = [0] * k_max  # [i]: row-steps that reached draft position i
        self._accepted_at = [0] * k_max  # [i]: row-steps that accepted draft position i
        self._kb_count: dict = {}  # K_b -> usable row-steps that verified K_b drafts
        self._k_sum = 0
        self._keep_history = keep_history
        # Per-forward times: priors until measured; after that an exponential moving average
        # (the target's per verified length n = K + 1: {n: [time, count]}).
        self._t_draft = t_draft_prior
        self._t_target_prior = t_target_prior  # the prior one-token step
        self._t_one_given: Optional[float] = None  # a one-token step measured elsewhere (set_target_step)
        self._target_by_len: dict = {}
        self._last_k: Optional[int] = None
        self._measured_draft = 0
        self._measured_target = 0
        self._zero_run = 0  # K = 0 choices in a row

    # -- recording -------------------------------------------------------------------------
    def record_step(self, k: int, rows: list, num_draft: list, accepted: list, emitted: list) -> None:
        """One verify step: K, the prompt indices of its rows, each row's K_b, n_b (-1: the row
        was unusable) and the number of tokens it finally emitted."""
        s = self.stats
        s.iterations += 1
        self._k_sum += k
        self._last_k = k
        for kb, n, e in zip(num_draft, accepted, emitted):
            s.row_steps += 1
            s.generated_tokens += e
            if n < 0:
                continue
            s.drafted_tokens += kb
            s.accepted_tokens += n
            self._kb_count[kb] = self._kb_count.get(kb, 0) + 1
            s.accepted_length_histogram[n] += 1
            for i in range(min(n + 1, kb)):
                self._reached[i] += 1
                if i < n:
                    self._accepted_at[i] += 1
        if self._keep_history:
            s.history.append(dict(k=k, rows=list(rows), num_draft=list(num_draft), accepted=list(accepted)))

    def record_times(self, t_draft_total: float, n_draft_forwards: int, t_target: float,
                     first_step: bool, k: Optional[int] = None, draft_typical: bool = True) -> None:
        """One step's times: its draft work, and its target verify step, which verified k drafts
        (k + 1 tokens; None: the K of the last ``record_step``).  ``draft_typical=False``: the
        draft work included more than a step's share (a draft taking the tokens or pairs that
        waited through K = 0 steps), so it does not update the per-forward draft time."""
        s = self.stats
        s.draft_time_s += t_draft_total
        s.target_time_s += t_target
        s.draft_forwards += n_draft_forwards
        if first_step:  # warm-up (allocations, kernel selection): not representative
            return
        ema = TIME_EMA
        if n_draft_forwards > 0 and draft_typical:
            t = t_draft_total / n_draft_forwards
            self._t_draft = t if self._measured_draft == 0 else (1 - ema) * self._t_draft + ema * t
            self._measured_draft += 1
        if k is None:
            k = self._last_k if self._last_k is not None else 0
        n = int(k) + 1
        entry = self._target_by_len.get(n)
        if entry is None:
            self._target_by_len[n] = [t_target, 1]
        else:
            entry[0] = (1 - ema) * entry[0] + ema * t_target
            entry[1] += 1
        self._measured_target += 1

    def set_target_step(self, t_one: float) -> None:
        """The target's one-token step as measured elsewhere (a run of the target alone over the
        same prompts): ``target_time`` takes it for n = 1 until a K = 0 step measures it here,
        instead of extrapolating the verify steps' line below their shortest length."""
        if not (isinstance(t_one, (int, float)) and not isinstance(t_one, bool) and math.isfinite(t_one)
                and t_one > 0):
            raise ValueError(f"StatsRecorder: the one-token step must be a finite number > 0, got {t_one!r}")
        self._t_one_given = float(t_one)

    # -- estimates -------------------------------------------------------------------------
    def alpha(self, with_prior: bool = True) -> Optional[float]:
        reached = sum(self._reached)
        accepted = sum(self._accepted_at)
        if with_prior:
            return (accepted + ALPHA_PRIOR * ALPHA_PRIOR_TRIALS) / (reached + ALPHA_PRIOR_TRIALS)
        return accepted / reached if reached else None

    def times(self) -> tuple[float, float]:
        """(T_draft per draft forward, T_target of a one-token target step), priors until
        measured; the target's cost at other lengths is ``target_time``."""
        return self._t_draft, self.target_time(1)

    def target_time_samples(self) -> dict:
        """{verified length n = K + 1: (moving-average step time, number of measurements)}."""
        return {n: (t, c) for n, (t, c) in sorted(self._target_by_len.items())}

    def target_time(self, n: float) -> float:
        """The modelled target verify step over n = K + 1 tokens (n may be fractional).

        - Measured at two or more lengths: the line a + b * n fitted by least squares to the
          per-length moving averages, each weighted by its number of measurements, with
          a, b >= 0 (``fit_step_cost``); it interpolates, and extrapolates to longer n.  Below
          the shortest measured length n_lo the prior shape is anchored at the line's value
          there: a step's cost is flat while it is memory-bound and grows once it is
          compute-bound, so a line through two longer lengths extrapolates to a far too cheap
          short step (at batch 2 on a CPU: 16-20 ms for the 27 ms one-token step).
        - Measured at one length n1 only (time t1): the prior shape scaled through it,
          t1 * (1 + r * (n - 1)) / (1 + r * (n1 - 1)) with r = ``target_slope_prior``.
        - Nothing measured: t_target_prior * (1 + r * (n - 1)).
        With a one-token step given (``set_target_step``) and n = 1 not measured here, it stands
        for n = 1: below the shortest measured length the step interpolates linearly between it
        and the value there (nothing measured: the prior shape through it).
        The result is kept above 1e-12 so that a rate is always finite.
        """
        r = self.target_slope_prior
        pts = self._target_by_len
        given = self._t_one_given if 1 not in pts else None
        if len(pts) >= 2:
            a, b = fit_step_cost([(m, t, c) for m, (t, c) in pts.items()])
            n_lo = min(pts)
            if n < n_lo:
                t = self._below(n, n_lo, a + b * n_lo, given)
            else:
                t = a + b * n
        elif len(pts) == 1:
            (n1, (t1, _)), = pts.items()
            t = self._below(n, n1, t1, given) if n < n1 else t1 * (1 + r * (n - 1)) / (1 + r * (n1 - 1))
        else:
            t = (self._t_target_prior if given is None else given) * (1 + r * (n - 1))
        return max(t, 1e-12)

    def _below(self, n: float, n_lo: int, t_lo: float, given: Optional[float]) -> float:
        """The step over n < n_lo tokens from its value t_lo at n_lo: the prior shape anchored
        there, or (a one-token step given) the line between (1, given) and (n_lo, t_lo)."""
        if given is None or n_lo <= 1:
            r = self.target_slope_prior
            return t_lo * (1 + r * (n - 1)) / (1 + r * (n_lo - 1))
        return given + (t_lo - given) * (n - 1) / (n_lo - 1)

    def choose_k(self, k_max: int, allow_zero: bool = False) -> int:
        """The K in 1..k_max maximising E(K) / (K * T_draft + T_target(K)).

        Exploration: while the target has been measured at one verified length only, the line
        cannot be fitted, so the chooser takes one step at another length, far from the measured
        one for a good slope (K = 1 if it measured K >= 2, else min(k_max, 4)), or, with
        allow_zero, K = 0 where the prior shape through the measured length rates that higher
        (a CPU at batch 8 explores a one-token step, not one over 5 tokens a row); the prior
        shape decides until then.

        allow_zero: K = 0 may win too, a step that verifies no draft (rate 1 / (z * T_draft +
        T_target(0)), z = ``zero_step_draft_forwards``, the draft forwards such a step runs: 1 by
        default, 0 in ``SpeculativeDecoder``, whose K = 0 steps leave the draft's tokens waiting).
        Where verifying costs more than it returns (a CPU at batch 8) that is the target alone.
        Before the one-token step is measured, K = 0 is tried once only if it would win with the
        line through the measured lengths extrapolated down to one token (cheaper than the
        real step where that is memory-bound, so a K = 0 that would lose even then is never
        tried: it costs a step's worth of drafts at batch 1).  K = 0 is chosen only while it beats
        the best K >= 1, and after ``ZERO_REFRESH`` in a row one step takes that K, so that alpha
        is measured again.
        """
        if len(self._target_by_len) == 1 and (k_max >= 2 or allow_zero):
            (n1,) = self._target_by_len
            return self._explore(n1 - 1, k_max, allow_zero)
        k = choose_num_draft_tokens(self.alpha(), self._t_draft, lambda k: self.target_time(k + 1), k_max)
        if not allow_zero or len(self._target_by_len) < 2:
            return k
        rate_k = expected_tokens_per_step(self.alpha(), k) / (k * self._t_draft + self.target_time(k + 1))
        if 1 not in self._target_by_len:  # not measured: try it once if even the optimistic line says so
            a, b = fit_step_cost([(m, t, c) for m, (t, c) in self._target_by_len.items()])
            t_zero = self.zero_step_draft_forwards * self._t_draft
            return 0 if 1.0 / (t_zero + max(a + b, 1e-12)) > rate_k else k
        rate_0 = 1.0 / (self.zero_step_draft_forwards * self._t_draft + self.target_time(1))
        if rate_0 > rate_k and self._zero_run < ZERO_REFRESH:
            self._zero_run += 1
            return 0
        self._zero_run = 0
        return k

    def _explore(self, k_measured: int, k_max: int, allow_zero: bool) -> int:
        """The exploring step's K (see ``choose_k``): a length far from ``k_measured``, or K = 0
        where the prior shape through the measured length rates it higher."""
        far = 1 if k_measured >= 2 else min(k_max, 4)
        if allow_zero and k_measured > 0:
            rate_zero = 1.0 / (self.zero_step_draft_forwards * self._t_draft + self.target_time(1))
            rate_far = (-1.0 if far == k_measured else  # k_max = 1: no other length but K = 0
                        expected_tokens_per_step(self.alpha(), far) / (far * self._t_draft + self.target_time(far + 1)))
            if rate_zero > rate_far:
                return 0
        return far

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
            if self._target_by_len:
                # The same per-K cost as choose_k: the target alone pays T_target(0) per token,
                # a step of mean K pays T_target(mean K) (the model is linear in K).
                t_one = self.target_time(1)
                t_verify = self.target_time(s.mean_num_draft_tokens + 1)
            else:  # no step after the warm-up one: the mean step time for both
                t_one = t_verify = s.time_per_target_forward_s
            # Tokens a row-step is expected to emit: E(alpha, K_b) over the rows' own K_b (a row
            # may verify fewer than the step's K: prompt lookup's misses, draft_confidence, the
            # budget), while a step costs what its K costs.
            rows = sum(self._kb_count.values())
            e_rows = sum(c * expected_tokens_per_step(s.alpha, kb) for kb, c in self._kb_count.items()) / rows
            s.predicted_speedup = predicted_speedup(s.alpha, s.mean_num_draft_tokens, t_d, t_one, t_verify,
                                                    expected_tokens=e_rows)
        s.baseline_tokens_per_s = baseline_tokens_per_s
        if baseline_tokens_per_s and s.tokens_per_s:
            s.measured_speedup = s.tokens_per_s / baseline_tokens_per_s
        return s
