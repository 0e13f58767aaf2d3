"""The verifier audit's whole-step cases: each trial draws its own drafts, and the law of every
token the step emits (accepted drafts, then the residual's or the bonus token) is tested against
``laws.sequence_law`` (see ``cases`` for the cases' common parts)."""

from __future__ import annotations

import torch

from .cases import (_MIXED_T, K, V, Case, _exact, _finish, _greedy_wrong, _out, _sequence_chi, _sequence_law,
                    _template)
from .laws import warp64
from .protocol import Call, make_params

__all__ = ["STEP_CASES"]

# -- whole steps with drafts drawn per trial: the law of every emitted token ------------------------
#
# Each trial draws its own drafts from q (or, for deterministic proposals, from a law the verifier
# does not see), so the outcomes cover every draft prefix: (accepted drafts, final token), up to
# sum_m V^(m+1) = 11,110 sequences for V = 10, K = 3.  q leans towards p (acceptance ~0.7 a
# position), so that a third or more of the rows accept every draft and emit the bonus token.

_WARPS = {"top_k": dict(temperature=0.8, top_k=4), "top_p": dict(top_p=0.7),
          "top_k_top_p": dict(temperature=0.9, top_k=5, top_p=0.6), "min_p": dict(temperature=2.0, min_p=0.3)}


def _drawn_setup(seed: int, Vd: int = V, lean: float = 0.6, **warp):
    """(logits [K+1, V], law [K, Vd]): logits >= 1e-3 from the warp's boundaries (``_template``) and
    the drafts' law, ``lean`` p_j (restricted to Vd) + (1 - lean) a random law; a greedy setup leans
    towards the argmax instead."""
    logits, _, _ = _template(seed, **warp)
    g = torch.Generator().manual_seed(seed + 7919)
    T = warp.get("temperature", 1.0)
    p = warp64(logits, T if T > 0 else 0.5, warp.get("top_k", 0), warp.get("top_p", 1.0), warp.get("min_p", 0.0))
    if T == 0:
        p = torch.nn.functional.one_hot(logits.argmax(-1), V).double()
    pd = p[:K, :Vd] / p[:K, :Vd].sum(-1, keepdim=True)
    law = lean * pd + (1 - lean) * torch.softmax(torch.randn(K, Vd, generator=g, dtype=torch.float64), -1)
    return logits, (law / law.sum(-1, keepdim=True)).float()


def _drawn_call(seed: int, n: int, with_q: bool = True, Vd: int = V, lean: float = 0.6, **params) -> Call:
    """n rows of one step, each with its own drafts drawn from ``_drawn_setup``'s law."""
    warp = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in params}
    if torch.is_tensor(warp.get("temperature")):
        warp["temperature"] = float(warp["temperature"][warp["temperature"] > 0][0])
    logits, law = _drawn_setup(seed, Vd, lean, **warp)
    g = torch.Generator().manual_seed(seed + 104729)
    drafts = torch.stack([torch.multinomial(law[j].double(), n, replacement=True, generator=g) for j in range(K)], 1)
    return Call(logits.expand(n, -1, -1).contiguous(), drafts,
                law.expand(n, -1, -1).contiguous() if with_q else None, make_params(n, K, **params))


def _drawn_case(name, shows, mutation, seed, groups="one", with_q=True, Vd=V, lean=0.6, calls=None, **params):
    """A case of whole steps with drafts drawn per trial.  ``calls``: several parameter sets (one
    call each); ``groups``: 'one' (every row one law), 'K_b' (rows K_b = 0..K, a law each),
    'temperature' (rows of several temperatures, 0 = greedy checked exactly against the argmax path)."""
    sets = calls or {"": params}

    def build(n):
        out = []
        for i, (label, ps) in enumerate(sets.items()):
            ps = dict(ps)
            if groups == "K_b":
                ps["num_draft_tokens"] = torch.arange(n) % (K + 1)
            if groups == "temperature":
                ps["temperature"] = torch.tensor(_MIXED_T, dtype=torch.float64).repeat(n // len(_MIXED_T) + 1)[:n]
            out.append(_drawn_call(seed + 100 * i, n, with_q, Vd, lean, **ps))
        return out

    def check(calls_, outputs):
        tests, details = [], []
        for i, ((label, ps), call, out) in enumerate(zip(sets.items(), calls_, outputs)):
            if isinstance(out, NotImplementedError):  # (a case of several calls: the others are tested)
                details.append(f"{label}: not supported ({str(out).strip()[:80]})")
                continue
            tokens, num = _out(call, out)
            warp = {k: ps[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in ps}
            law = None if with_q else _drawn_setup(seed + 100 * i, Vd, lean, **warp)[1]
            pre = f"{label}: " if label else ""
            if groups == "one":
                grp = {"": torch.ones(len(num), dtype=torch.bool)}
            elif groups == "K_b":
                grp = {f"K_b={k}": call.params.num_draft_tokens == k for k in range(K + 1)}
            else:
                T = call.params.temperature
                greedy = T == 0
                wrong = _greedy_wrong(call, tokens, num, greedy)
                _exact(wrong, int(greedy.sum()), f"{pre}greedy rows", tests)
                details.append(f"{pre}greedy rows: {wrong} of {int(greedy.sum())} differ from the argmax path "
                               f"({int((num[greedy] == K).sum())} reach the bonus)")
                grp = {f"T={t:g}": T == t for t in sorted(set(T[~greedy].tolist()))}
            for what, rows in grp.items():
                r0 = int(rows.nonzero()[0])
                seq = _sequence_law(call, r0, drawn=True, draft_law=law)
                bonus = int((num[rows] == call.params.num_draft_tokens[rows]).sum())
                _sequence_chi(tokens[rows], num[rows], seq, call.target_logits.shape[-1],
                              f"{pre}sequence{' at ' + what if what else ''} ({bonus} of {int(rows.sum())} rows "
                              f"emit the bonus)", tests, details)
        return _finish(tests, details)

    n_tests = len(sets) * {"one": 1, "K_b": K + 1, "temperature": 3}[groups]
    bound = (f"chi-square of the whole emitted sequence over up to {sum(V ** (m + 1) for m in range(K + 1)):,} "
             f"outcomes, drafts drawn per trial{' (Bonferroni over ' + str(n_tests) + ')' if n_tests > 1 else ''}"
             f"{'; greedy rows exact' if groups == 'temperature' else ''}, fail if p < 1e-4")
    reads = {"one": f"every token, every draft prefix; positions 0..{K}",
             "K_b": f"every token per K_b = 0..{K}; positions 0..K_b",
             "temperature": f"every token (greedy rows exactly); positions 0..{K}"}[groups]
    return Case(name, shows, bound, mutation, build, check, reads=reads, partial=len(sets) > 1)


STEP_CASES = [
    _drawn_case("step_law", "every token a step emits, drafts drawn from q per trial (T=1): the law of the whole "
                "sequence (accepted drafts, then the residual's or the bonus token)", "bonus_from_previous", 51),
    _drawn_case("step_temperature", "the same at temperature 0.5", "bonus_unwarped", 52, temperature=0.5),
    _drawn_case("step_warps", "the same under top-k, top-p, top-k + top-p and min-p (one call each)",
                "bonus_unwarped", 53, calls=_WARPS),
    _drawn_case("step_without_q", "deterministic proposals (draft_probs None) drawn per trial from a law the "
                "verifier does not see", "residual_from_p", 54, with_q=False),
    _drawn_case("step_padded_vocab", "drafts over Vd=6 < V=10 tokens, drawn per trial", "target_truncated", 55,
                Vd=6),
    _drawn_case("step_ragged_k", "rows with K_b = 0..3 in one batch, each its own law of sequences (K_b = 3 reads "
                "the bonus position)", "bonus_from_previous", 56, groups="K_b"),
    _drawn_case("step_greedy_sampled", "greedy rows (exact: the argmax path, bonus included) beside rows at T=0.5 "
                "and 2, drafts drawn per trial", "greedy_bonus_sampled", 57, groups="temperature", lean=0.7),
]
