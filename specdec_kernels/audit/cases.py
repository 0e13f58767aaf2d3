"""The verifier audit's cases: each builds verification calls, states its bound, and reads the
verifier's outputs into (statistic, p-value).  Each names a mutant (``sampler.MUTATIONS``) that
must fail it: its p-value beside the case's is the case's power.

A law case repeats one row n times (n trials of the same step) and tests a histogram of the
outputs by chi-square against the exact law (``laws.row_laws``, float64 from the logits); an exact
case counts forbidden outcomes (p-value 0 when there is one, else 1).  The logits of each case are
drawn from a fixed seed and kept only when they sit at least 1e-3 from every warp boundary (an
fp32 verifier may otherwise keep another set legitimately).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .checks import FormatError, combine, counts, emitted
from .laws import (boundary_margin, chi2_pvalue, pooled_bins, row_laws, sequence_index, sequence_law, step_weights,
                   warp64)
from .protocol import Call, make_params
from .sampler import _warp

__all__ = ["Case", "Outcome", "CASES"]

V, K = 10, 3  # the law cases' vocabulary and draft length


@dataclass
class Outcome:
    statistic: Optional[float]  # chi-square statistic, or the number of forbidden outcomes
    pvalue: float
    detail: str = ""
    tests: list = field(default_factory=list)  # per test: {what, n, dof} (chi-square) or {what, n, exact}


@dataclass
class Case:
    name: str
    shows: str  # what a pass shows
    bound: str  # the statistic and its threshold
    mutation: str  # the mutant that must fail it
    build: Callable[[int], list]  # n -> [Call]
    check: Callable[[list, list], Outcome]  # (calls, outputs) -> Outcome
    needs: set = field(default_factory=set)  # adapter features: {"seed", "block"}: verifier.supports_<name>
    bad_input: bool = False  # its inputs are unusable: a raised error is a pass, not the verifier's error
    mutant_verifier: Optional[Callable] = None  # its mutant, when not ``sampler.mutant(mutation)``
    mutant_says: Optional[str] = None  # what that mutant gets wrong (default: ``sampler.MUTATIONS[mutation]``)
    reads: str = ""  # the emitted tokens and positions its tests read
    partial: bool = False  # its calls test separate features: a call the verifier does not support is skipped


def _template(seed: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, with_q=True, Vt=V, Vd=None,
              accept=None, apart_from=None):
    """(logits [K+1, Vt], drafts [K], q [K, Vd] or None): the first draw from ``seed`` that sits
    >= 1e-3 from the warp's boundaries (with ``accept``, whose a_0 is in that range; with
    ``apart_from``, a mutation of the warp, whose p_0 under it is >= 0.1 away in total variation)."""
    Vd = Vt if Vd is None else Vd
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):
        logits = 1.5 * torch.randn(K + 1, Vt, generator=g)
        p = warp64(logits, temperature, top_k, top_p, min_p)
        drafts = torch.tensor([int(torch.multinomial(p[j, :Vd] + 1e-3, 1, generator=g)) for j in range(K)])
        q = None
        if with_q:
            q = torch.softmax(torch.randn(K, Vd, generator=g), -1)
            q[torch.arange(K), drafts] += 0.3
            q = (q / q.sum(-1, keepdim=True)).float()
        if temperature > 0 and boundary_margin(logits, temperature, top_k, top_p, min_p) < 1e-3:
            continue
        if apart_from is not None:
            wrong = _warp(logits[:1], temperature, top_k, top_p, min_p, apart_from)
            if float((wrong - p[:1]).abs().sum()) / 2 < 0.1:
                continue
        a0 = row_laws(logits, drafts, q, K, temperature, top_k, top_p, min_p)["accept"][0]
        if accept is not None and not accept[0] <= a0 <= accept[1]:
            continue
        return logits.float(), drafts, q
    raise RuntimeError(f"no logits away from the warp's boundaries from seed {seed}")


def _repeat(logits, drafts, q, n, **params) -> Call:
    return Call(logits.expand(n, -1, -1).contiguous(), drafts.expand(n, -1).contiguous(),
                None if q is None else q.expand(n, -1, -1).contiguous(), make_params(n, K, **params))


def _scalar(call: Call, name: str, row: int = 0):
    v = getattr(call.params, name)[row]
    return float(v) if v.dtype.is_floating_point else int(v)


def _laws_of(call: Call, row: int = 0) -> dict:
    q = None if call.draft_probs is None else call.draft_probs[row]
    return row_laws(call.target_logits[row], call.draft_tokens[row], q, _scalar(call, "num_draft_tokens", row),
                    _scalar(call, "temperature", row), _scalar(call, "top_k", row), _scalar(call, "top_p", row),
                    _scalar(call, "min_p", row))


def _sequence_law(call: Call, row: int = 0, drawn: bool = False, draft_law=None) -> torch.Tensor:
    """The law of row ``row``'s whole emitted sequence (``laws.sequence_law``): with its drafts fixed,
    or (``drawn``) with drafts drawn per trial from its q (or from ``draft_law`` [K, Vd] when the call
    has no q)."""
    q = None if call.draft_probs is None else call.draft_probs[row]
    A, S = step_weights(call.target_logits[row], q, _scalar(call, "num_draft_tokens", row),
                        _scalar(call, "temperature", row), _scalar(call, "top_k", row), _scalar(call, "top_p", row),
                        _scalar(call, "min_p", row), drafts=None if drawn else call.draft_tokens[row],
                        draft_law=draft_law)
    return sequence_law(A, S, call.draft_tokens.shape[1])


def _sequence_chi(tokens, num, law, V_: int, what: str, tests: list, details: list):
    """Chi-square of the rows' emitted sequences (tokens [n, K+1], num [n]) against ``law``."""
    _chi(counts(sequence_index(tokens, num, V_), law.shape[0]), law, what, tests, details)


def _out(call: Call, out, allow_invalid=False):
    if isinstance(out, BaseException):
        raise out
    return emitted(out, call.params.num_draft_tokens, call.target_logits.shape[-1], allow_invalid)


def _chi(observed, law, what: str, tests: list, details: list):
    stat, p, dof = chi2_pvalue(observed, law)
    n = int(observed.sum())
    bins = pooled_bins(law, n)
    tests.append((stat, p, dict(what=what, n=n, dof=int(bins.max()) if n else 0)))
    details.append(f"{what}: chi2 {stat:.4g} (dof {dof}), p {p:.3g}")


def _exact(wrong: int, n: int, what: str, tests: list):
    tests.append((wrong, 0.0 if wrong else 1.0, dict(what=what, n=n, exact=True)))


def _finish(tests, details) -> Outcome:
    p = combine([t[1] for t in tests])
    worst = min(tests, key=lambda t: t[1])
    return Outcome(worst[0], p, "; ".join(details), [t[2] for t in tests if len(t) > 2])


# -- law cases: one row repeated, statistics of the emitted tokens --------------------------------

def _law_case(name, shows, mutation, stats=("first",), seed=0, **params):
    """A case of one row repeated n times: ``stats`` among 'first' (the first emitted token),
    'second' (the second given the first: the law of the pairs (first, second or none), whose
    conditional given draft 0 accepted is the second position's), 'num_accepted', 'sequence' (the
    whole emitted sequence: the number accepted and the final token, the drafts being fixed)."""
    warp = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in params}
    with_q = params.pop("with_q", True)
    Vd = params.pop("Vd", None)
    Vt = params.pop("Vt", V)

    def build(n):
        logits, drafts, q = _template(seed, **warp, with_q=with_q, Vt=Vt, Vd=Vd, accept=(0.2, 0.8),
                                      apart_from=mutation if warp else None)
        return [_repeat(logits, drafts, q, n, **params)]

    def check(calls, outputs):
        call = calls[0]
        tokens, num = _out(call, outputs[0])
        laws, Vc = _laws_of(call), call.target_logits.shape[-1]
        tests, details = [], []
        if "first" in stats:
            _chi(counts(tokens[:, 0], Vc), laws["first"], "first token", tests, details)
        if "second" in stats:  # the pairs (first, second or none): P(d_0, y) = a_0 law2(y), P(x, none) = rest
            d0, a0 = int(call.draft_tokens[0, 0]), laws["accept"][0]
            joint = torch.zeros(Vc, Vc + 1, dtype=torch.float64)
            joint[:, Vc] = laws["first"]
            joint[d0, Vc] -= a0
            joint[d0, :Vc] += a0 * laws["second_given_accept"]
            joint = joint.clamp(min=0)
            second = torch.where(num >= 1, tokens[:, 1], Vc)
            sel = (num >= 1) & (tokens[:, 0] == d0)
            _chi(counts(tokens[:, 0] * (Vc + 1) + second, Vc * (Vc + 1)), joint.flatten(),
                 f"(first, second) pairs ({int(sel.sum())} rows accept draft 0, {a0 * len(num):.0f} expected)",
                 tests, details)
        if "num_accepted" in stats:
            _chi(counts(num, K + 1), laws["num_accepted"], "number accepted", tests, details)
        if "sequence" in stats:
            _sequence_chi(tokens, num, _sequence_law(call), Vc, "the whole emitted sequence", tests, details)
        return _finish(tests, details)

    names = {"first": "the first token", "second": "the pairs (first token, second token or none)",
             "num_accepted": "the number accepted", "sequence": "the whole emitted sequence"}
    bound = (f"chi-square of {' and of '.join(names[s] for s in stats)}"
             f"{' (Bonferroni over ' + str(len(stats)) + ')' if len(stats) > 1 else ''}, fail if p < 1e-4")
    reads = {"first": "token 0", "second": "tokens 0-1 (pairs)", "num_accepted": "the number accepted",
             "sequence": "every token (fixed drafts)"}
    kb = params.get("num_draft_tokens", K)
    return Case(name, shows, bound, mutation, build, check,
                reads="; ".join(reads[s] for s in stats) + f"; K_b = {kb}, positions 0..{kb}")


# -- mixed greedy and sampled rows ---------------------------------------------------------------

_MIXED_T = (0.0, 0.5, 0.0, 2.0)


def _mixed_build(n):
    logits, drafts, q = _template(11, temperature=0.5, accept=(0.2, 0.8))
    T = torch.tensor(_MIXED_T, dtype=torch.float64).repeat(n // len(_MIXED_T) + 1)[:n]
    return [_repeat(logits, drafts, q, n, temperature=T)]


def _greedy_path(call: Call, rows: torch.Tensor) -> torch.Tensor:
    """tokens [n, K+1] int64 of greedy rows ``rows`` [n]: the drafts kept while each is its
    position's argmax, then the argmax at the first other position (at most K_b), then -1."""
    g = call.target_logits[rows].double().argmax(-1)  # [n, K+1]
    d = call.draft_tokens[rows]
    kb = call.params.num_draft_tokens[rows]
    cols = torch.arange(d.shape[1])
    match = ((d == g[:, :-1]) & (cols[None, :] < kb[:, None])).long().cumprod(-1)  # [n, K]
    m = match.sum(-1)
    out = torch.full_like(g, -1)
    out[:, :-1] = torch.where(match.bool(), d, -1)
    out[torch.arange(len(m)), m] = g[torch.arange(len(m)), m]
    return out


def _greedy_wrong(call: Call, tokens: torch.Tensor, num: torch.Tensor, greedy: torch.Tensor) -> int:
    """How many greedy rows (mask ``greedy``) emit anything but their argmax path."""
    rows = greedy.nonzero()[:, 0]
    want = _greedy_path(call, rows)
    return int(((tokens[rows] != want).any(-1) | (num[rows] != (want >= 0).sum(-1) - 1)).sum())


def _mixed_check(calls, outputs):
    call = calls[0]
    tokens, num = _out(call, outputs[0])
    T = call.params.temperature
    tests, details = [], []
    greedy = T == 0
    wrong = _greedy_wrong(call, tokens, num, greedy)
    _exact(wrong, int(greedy.sum()), "greedy rows", tests)
    details.append(f"greedy rows: {wrong} of {int(greedy.sum())} differ from the argmax path (every emitted token)")
    for t in sorted(set(T[~greedy].tolist())):
        rows = T == t
        law = _laws_of(call, int(rows.nonzero()[0]))["first"]
        _chi(counts(tokens[rows, 0], V), law, f"first token at T={t:g}", tests, details)
    return _finish(tests, details)


# -- ragged K ------------------------------------------------------------------------------------

def _ragged_build(n):
    logits, drafts, q = _template(21, accept=(0.3, 0.9))
    kb = torch.arange(n) % (K + 1)
    return [_repeat(logits, drafts, q, n, num_draft_tokens=kb)]


def _ragged_check(calls, outputs):
    call = calls[0]
    tokens, num = _out(call, outputs[0])
    tests, details = [], []
    for kb in range(K + 1):
        rows = call.params.num_draft_tokens == kb
        laws = _laws_of(call, int(rows.nonzero()[0]))
        _chi(counts(num[rows], kb + 1), laws["num_accepted"], f"number accepted at K_b={kb}", tests, details)
        _chi(counts(tokens[rows, 0], V), laws["first"], f"first at K_b={kb}", tests, details)
        _sequence_chi(tokens[rows], num[rows], _sequence_law(call, int(rows.nonzero()[0])), V,
                      f"sequence at K_b={kb}", tests, details)
    return _finish(tests, details)


# -- bad input: NaN/inf logits, draft ids out of range -------------------------------------------

NAN_AT = 3


def _bad_calls(n, kind):
    logits, drafts, q = _template(31, accept=(0.2, 0.8))
    greedy_drafts = logits[:K].argmax(-1)  # accepted by a greedy row: the bonus position is read
    calls = []
    if kind == "nan":
        for pos, T, d in ((0, 1.0, drafts), (0, 0.0, drafts), (K, 0.0, greedy_drafts), (K, 1.0, greedy_drafts)):
            lg = logits.clone()
            lg[pos, NAN_AT] = math.nan
            calls.append(_repeat(lg, d, q if T else None, n, temperature=T))
        lg = logits.clone()
        lg[0, NAN_AT] = math.inf
        calls.append(_repeat(lg, drafts, q, n, temperature=1.0))
    else:
        for T, with_q, bad in ((1.0, False, V), (1.0, False, V + 7), (0.0, False, V), (1.0, True, V)):
            d = drafts.clone()
            d[0] = bad
            calls.append(_repeat(logits, d, q if with_q else None, n, temperature=T))
    return calls


_BAD_LABELS = {
    "nan": ("NaN at draft 0, sampled", "NaN at draft 0, greedy", "NaN at the bonus, greedy",
            "NaN at the bonus, sampled", "+inf at draft 0, sampled"),
    "ids": ("id V, no q, sampled", "id V+7, no q, sampled", "id V, greedy", "id V, with q, sampled"),
}


def _bad_check(kind):
    def check(calls, outputs):
        bad, refused, raised, rows = 0, 0, 0, 0
        notes, per_call = [], []
        for label, call, out in zip(_BAD_LABELS[kind], calls, outputs):
            B = call.target_logits.shape[0]
            rows += B
            if isinstance(out, BaseException):
                if isinstance(out, FormatError):
                    raise out
                raised += B
                notes.append(f"{type(out).__name__}: {str(out).splitlines()[0][:80] if str(out) else ''}")
                per_call.append(f"{label}: raised")
                continue
            tokens, num = torch.as_tensor(out[0]).long(), torch.as_tensor(out[1]).long()
            Vc = call.target_logits.shape[-1]
            n_emit = torch.where(num < 0, 0, num + 1)
            inside = torch.arange(tokens.shape[1])[None, :] < n_emit[:, None]
            forbidden = (tokens < 0) | (tokens >= Vc)
            if kind == "nan":  # the token emitted at position j is the index of a NaN of logits[b, j]
                nan = torch.isnan(call.target_logits)  # [B, K+1, V]
                forbidden |= nan.gather(-1, tokens.clamp(0, Vc - 1)[..., None])[..., 0]
            row_bad = (inside & forbidden).any(-1)
            bad += int(row_bad.sum())
            refused += int((num < 0).sum())
            per_call.append(f"{label}: {int(row_bad.sum())} bad, {int((num < 0).sum())} refused")
        what = "the NaN logit's index" if kind == "nan" else "an id outside [0, V)"
        detail = (f"{bad} of {rows} rows emit a forbidden token ({what}); {refused} refused (num_accepted -1), "
                  f"{raised} in calls that raised ({'; '.join(per_call)})")
        if notes:
            detail += " [" + "; ".join(sorted(set(notes))) + "]"
        return Outcome(bad, 0.0 if bad else 1.0, detail)
    return check


# -- seeded determinism and batch invariance ------------------------------------------------------

def _seed_build(n):
    logits, drafts, q = _template(41, accept=(0.2, 0.8))
    other, odrafts, oq = _template(42)
    m = n // 2
    base = _repeat(logits, drafts, q, m, seed=torch.arange(m) + 1000)
    alt = _repeat(other, odrafts, oq, m, seed=torch.arange(m) + 5000)
    mixed = Call(torch.cat([alt.target_logits, base.target_logits]), torch.cat([alt.draft_tokens, base.draft_tokens]),
                 torch.cat([alt.draft_probs, base.draft_probs]),
                 make_params(2 * m, K, seed=torch.cat([alt.params.seed, base.params.seed])))
    return [base, base, mixed]


def _seed_check(calls, outputs):
    a, a2, mixed = (_out(c, o) for c, o in zip(calls, outputs))
    m = a[0].shape[0]
    rerun = int((a[0] != a2[0]).any(-1).sum())
    moved = int((a[0] != mixed[0][m:]).any(-1).sum())
    differ = int((a[0][1:] != a[0][:-1]).any(-1).sum())
    detail = (f"{rerun} of {m} rows differ on a rerun with the same seeds; {moved} differ when other rows are put "
              f"before them; ({differ} of {m - 1} neighbouring rows differ: the seeds vary the draws)")
    bad = rerun + moved + (differ == 0)
    return Outcome(bad, 0.0 if bad else 1.0, detail)


CASES = [
    _law_case("first_token", "the first emitted token has the target's law (T=1, drafts sampled from q)",
              "accept_p", ("first", "sequence"), seed=1),
    _law_case("second_given_first", "the second token given the first (draft 0 accepted) has its exact law, "
              "tested with the first as the law of the pairs",
              "residual_from_p_after_first", ("second", "sequence"), seed=2),
    _law_case("num_accepted", "the number of accepted drafts has law a_0 ... a_{m-1} (1 - a_m)",
              "accept_inverted", ("num_accepted", "sequence"), seed=3),
    _law_case("temperature", "temperature 0.5 is applied to p", "temperature_ignored",
              ("first", "num_accepted", "sequence"), seed=4, temperature=0.5),
    _law_case("top_k", "top-k 4 (at T=0.8) removes the other tokens from p", "top_k_ignored",
              ("first", "num_accepted", "sequence"), seed=5, temperature=0.8, top_k=4),
    _law_case("top_p", "top-p 0.7 keeps the smallest set reaching 0.7", "top_p_exclusive",
              ("first", "num_accepted", "sequence"), seed=6, top_p=0.7),
    _law_case("top_k_top_p", "top-k 5 then top-p 0.6 (top-p's mass renormalised over the top-k set)",
              "topk_after_topp", ("first", "num_accepted", "sequence"), seed=7, temperature=0.9, top_k=5, top_p=0.6),
    _law_case("min_p", "min-p 0.3 after temperature 2 (transformers' order)", "min_p_before_temperature",
              ("first", "num_accepted", "sequence"), seed=8, temperature=2.0, min_p=0.3),
    _law_case("bonus_token", "with K_b = 1, the bonus token after an accepted draft has p_1's law (the pairs "
              "(number accepted, final token))", "bonus_reuses_uniform", ("sequence",), seed=12, num_draft_tokens=1),
    Case("mixed_greedy_sampled", "in one batch, greedy rows take the argmax path and sampled rows their own T "
         "(0.5 and 2.0)", "greedy rows exact; chi-square of the first token per temperature (Bonferroni), "
         "fail if p < 1e-4", "one_temperature", _mixed_build, _mixed_check,
         reads=f"greedy rows: every token exactly; sampled rows: token 0; positions 0..{K}"),
    Case("ragged_k", "rows with K_b = 0..3 in one batch each verify only their own K_b drafts",
         "chi-square of number accepted and first token per K_b (Bonferroni over 8), fail if p < 1e-4",
         "ignore_num_draft_tokens", _ragged_build, _ragged_check,
         reads="per K_b = 0..3: the number accepted, token 0, every token (fixed drafts); positions 0..K_b"),
    _law_case("drafts_without_q", "deterministic proposals (draft_probs None): one-hot q, residual excludes the "
              "rejected draft", "residual_from_p", ("first", "num_accepted", "sequence"), seed=9, with_q=False),
    _law_case("padded_vocab", "a draft over Vd=6 < V=10 tokens: the tokens >= Vd keep their target mass",
              "target_truncated", ("first", "num_accepted", "sequence"), seed=10, Vd=6),
    Case("nan_inf_logits", "a NaN logit's index is never emitted (sampled and greedy rows, at a draft and the "
         "bonus position); +inf leaves tokens in [0, V)", "exact: 0 forbidden tokens (an error raised passes)",
         "no_input_check", lambda n: _bad_calls(n, "nan"), _bad_check("nan"), bad_input=True,
         reads="every emitted token against the NaN's index and [0, V); positions 0..3"),
    Case("draft_ids_out_of_range", "a draft id >= V is never emitted (with and without q, greedy and sampled)",
         "exact: 0 forbidden tokens (an error raised passes)", "no_input_check",
         lambda n: _bad_calls(n, "ids"), _bad_check("ids"), bad_input=True,
         reads="every emitted token against [0, V); positions 0..3"),
    Case("seeded_determinism", "the same seed gives the same tokens on a rerun and when other rows change",
         "exact: 0 rows differ", "shared_stream", _seed_build, _seed_check, needs={"seed"},
         reads="every emitted token of every row, rerun and moved"),
]
