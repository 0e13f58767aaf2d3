"""The audit's own tree speculative decoding of two Markov chains, in float64, written from the
definitions of recursive rejection sampling (Jeon et al. 2024) and never from the package's tree
op, and its mutants: the reference generator of the tree generator audit (``generators``).

One step of a row whose continuation still needs ``room`` tokens, a static tree of branching
factors b_1..b_D: the walk starts at the root (the row's last token), at most D' = min(D,
room - 1) deep.  At a node of depth d < D' holding token t, with p = softmax(target[t] / T) and
q = softmax(draft[t] / T): set p_1 = p, q_1 = q; child c_j (j = 1..b_{d+1}) is drawn from q_j
(without replacement: q_{j+1} = q_j with c_j removed, renormalised) and accepted with probability
min(1, p_j(c_j) / q_j(c_j)); on rejection p_{j+1} = norm(max(0, p_j - q_j)) (p_j if that is 0).
The first child accepted is emitted and the walk goes on from it; when every child is rejected
the token is drawn from p_{b+1} and the step ends; at depth D' the bonus is drawn from p.  The
children are drawn as the walk reaches their parent: the subtrees it never visits do not change
the output, so this has the law of drawing the whole tree first.  Greedy (T = 0): the children
are the draft's top b_{d+1} (the argmax first), the walk follows the child that is the target's
argmax, then emits the argmax.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MUTATIONS", "simulate_tree"]

# name -> what the mutant gets wrong
MUTATIONS = {
    "tree_siblings_unchanged": "tests every sibling against the node's own p and q (min(1, p(c)/q(c))), the rejected "
                               "siblings' mass never removed (p and q not updated), and draws after the last "
                               "rejection from norm(max(0, p - q))",
}


def _draw(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One draw [n] from each row of the weights w [n, V] float64 (not necessarily normalised)."""
    c = w.cumsum(-1)
    u = torch.rand(w.shape[0], 1, dtype=torch.float64, generator=g) * c[:, -1:]
    return torch.searchsorted(c, u, right=True)[:, 0].clamp(max=w.shape[-1] - 1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [n, V], p where that is 0."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=1e-300), p)


def simulate_tree(target: torch.Tensor, draft: torch.Tensor, n: int, L: int, branching: tuple, last: int,
                  temperature: float, mutation: Optional[str] = None, seed: int = 0) -> list:
    """n continuations of length L after token ``last`` by tree speculative decoding of the
    chains (tables [V, V] float64: row i = the logits after token i) with the static tree
    ``branching`` (module docstring), with an optional ``mutation`` (a key of ``MUTATIONS``)."""
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"mutation must be None or one of {sorted(MUTATIONS)}, got {mutation!r}")
    g = torch.Generator().manual_seed(seed)
    greedy = temperature == 0
    pt = torch.softmax(target / (temperature or 1.0), -1)  # [V, V]
    qt = torch.softmax(draft / (temperature or 1.0), -1)
    out = torch.full((n, L), -1, dtype=torch.int64)
    length = torch.zeros(n, dtype=torch.int64)
    prev = torch.full((n,), last, dtype=torch.int64)
    rows = torch.arange(n)

    def emit(sel: torch.Tensor, tok: torch.Tensor) -> None:
        out[rows[sel], length[sel]] = tok
        length[sel] += 1
        prev[sel] = tok

    while bool((length < L).any()):
        walking = length < L
        deep = torch.clamp(L - length - 1, max=len(branching))  # D' per row
        for d, b in enumerate(branching):
            bonus = walking & (deep == d)  # the deepest node: the bonus from p
            if bool(bonus.any()):
                p = pt[prev[bonus]]
                emit(bonus, p.argmax(-1) if greedy else _draw(p, g))
            walking &= ~bonus
            if not bool(walking.any()):
                break
            sel = walking.nonzero()[:, 0]
            p, q = pt[prev[sel]], qt[prev[sel]]
            p0, q0 = p.clone(), q.clone()
            accepted = torch.full((len(sel),), -1, dtype=torch.int64)
            if greedy:
                order = q.argsort(-1, descending=True)[:, :b]  # the draft's top b
                best = p.argmax(-1)
                hit = (order == best[:, None]).any(-1)
                accepted = torch.where(hit, best, -1)
            else:
                left = torch.ones(len(sel), dtype=torch.bool)  # rows still testing children
                for _ in range(b):
                    has = left & (q.sum(-1) > 0)
                    if not bool(has.any()):
                        break
                    c = _draw(torch.where(has[:, None], q, 1.0), g)
                    pc, qc = p.gather(1, c[:, None])[:, 0], q.gather(1, c[:, None])[:, 0]
                    if mutation == "tree_siblings_unchanged":
                        pc, qc = p0.gather(1, c[:, None])[:, 0], q0.gather(1, c[:, None])[:, 0] / q0.sum(-1)
                    u = torch.rand(len(sel), dtype=torch.float64, generator=g)
                    acc = has & (u * qc < pc)
                    accepted = torch.where(acc, c, accepted)
                    rej = has & ~acc
                    if mutation != "tree_siblings_unchanged":
                        p = torch.where(rej[:, None], _residual(p, q), p)
                    q = torch.where(rej[:, None], q.scatter(1, c[:, None], 0.0), q)
                    q = q / q.sum(-1, keepdim=True).clamp(min=1e-300)
                    left &= ~acc
            took = accepted >= 0
            stop = sel[~took]  # every child rejected: the token from what is left of p
            if len(stop):
                last_p = p[~took]
                if greedy:
                    tok = last_p.argmax(-1)
                elif mutation == "tree_siblings_unchanged":
                    tok = _draw(_residual(p0[~took], q0[~took]), g)
                else:
                    tok = _draw(last_p, g)
                mask = torch.zeros(n, dtype=torch.bool)
                mask[stop] = True
                emit(mask, tok)
                walking &= ~mask
            if bool(took.any()):
                mask = torch.zeros(n, dtype=torch.bool)
                mask[sel[took]] = True
                emit(mask, accepted[took])
        if bool(walking.any()):  # accepted at every depth of the tree: the bonus
            p = pt[prev[walking]]
            emit(walking, p.argmax(-1) if greedy else _draw(p, g))
    return out.tolist()
