"""Tree verification keeps the target's distribution: the joint law of the first two and of the
first three emitted tokens, through ``fused_verify_tree``, on trees drawn as a drafter draws them.

A small "world" gives the target's and the draft's distributions at every prefix (tables indexed
by the prefix, so each node's distributions depend on the path to it).  Each trial draws one
tree of a fixed shape from the draft (children sampled without replacement by Gumbel-top-k, or
the draft's top-k for the deterministic rule), runs one verification step, and continues the
emission with the target's own draws until three tokens are known.  The joint laws of the first
two and first three tokens must equal the warped target's: chi-square goodness of fit over
100,000 trials, bins of expected count < 5 merged, each p-value > 1e-4 (a correct rule fails one
test with probability about 2e-4; the seeds are fixed, so each run is deterministic).  Two
mutants must be caught: siblings tested against the unmodified p (the rejected siblings' mass
never removed), and q not renormalised after a sampled sibling is removed.
"""

from __future__ import annotations

import pytest
import torch

from helpers import chi_square_pvalue

from specdec_kernels.ops import reference
from specdec_kernels.ops.tree import reference as tree_reference
from specdec_kernels.ops.verify.reference import warp as warp_reference
from specdec_kernels.ops.tree.api import fused_verify_tree

pytestmark = pytest.mark.slow  # the tree verify law by sampling

N_TRIALS = 100_000
SIGNIFICANCE = 1e-4


class World:
    """Target logits and draft probabilities at every prefix of up to ``depth`` tokens; prefix
    index: root 0, child(i, t) = i * V + t + 1."""

    def __init__(self, case: str, V: int, depth: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.V, self.warp = V, {}
        last = 0
        for _ in range(depth):
            last = last * V + V  # the largest index of a prefix of this length
        M = last + 1
        L = torch.randn(M, V, generator=g) * 1.5
        Vd = V
        if case == "q_equals_p":
            Q = torch.softmax(L, -1)
        elif case == "disjoint":  # p on the first half of the vocabulary, q on the second
            L[:, V // 2:] = float("-inf")
            Q = torch.softmax(torch.randn(M, V, generator=g), -1)
            Q[:, :V // 2] = 0
            Q = Q / Q.sum(-1, keepdim=True)
        elif case == "q_zero_where_p_positive":
            Q = torch.softmax(torch.randn(M, V, generator=g) * 1.5, -1)
            Q[:, -2:] = 0  # never proposed, still likely under p
            L[:, -2:] += 1.0
            Q = Q / Q.sum(-1, keepdim=True)
        elif case == "padded_vocabulary":  # the draft's vocabulary is the first Vd of V
            Vd = V - 2
            Q = torch.softmax(torch.randn(M, Vd, generator=g) * 1.5, -1)
        else:
            Q = torch.softmax(torch.randn(M, V, generator=g) * 1.5, -1)
            if case == "top_k":
                self.warp = {"top_k": 2, "temperature": 0.8}
            elif case == "top_p":
                self.warp = {"top_p": 0.9, "temperature": 1.3}
        self.L, self.Q, self.Vd = L, Q, Vd
        t = self.warp.get("temperature", 1.0)
        kw = {k: torch.full((M,), v) for k, v in self.warp.items() if k in ("top_k", "top_p")}
        s, keep = reference.warp_logits(L, torch.full((M,), 1.0 / t), kw.get("top_k"), kw.get("top_p"))
        self.P = warp_reference._target_probs(s, keep).double()  # [M, V]: the warped target, as the op computes it

    def child(self, i, t):
        return i * self.V + t + 1


def _shape_nodes(branching):
    """BFS nodes of a static tree shape: parents [N] (-1 = root) and each node's level."""
    parents, levels, frontier = [], [], [-1]
    for level, b in enumerate(branching):
        nxt = []
        for par in frontier:
            for _ in range(b):
                parents.append(par)
                levels.append(level)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, levels


def _draw_trees(world: World, branching, rule: str, n: int, g: torch.Generator, duplicates: bool = False):
    """n trees of the given shape: (node_tokens [n, N], parents [n, N], position prefix index [n, N+1])."""
    parents, _ = _shape_nodes(branching)
    N = len(parents)
    tokens = torch.zeros(n, N, dtype=torch.int64)
    pos = torch.zeros(n, N + 1, dtype=torch.int64)  # prefix index of each position (0 = root)
    n_children = {}
    for par in parents:
        n_children[par] = n_children.get(par, 0) + 1
    first_child = {}
    for i, par in enumerate(parents):
        first_child.setdefault(par, i)
    for par, m in n_children.items():
        idx = pos[:, par + 1]
        q = world.Q[idx]  # [n, Vd]
        if rule == "sampled":
            gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=g).clamp(min=1e-30)))
            picks = torch.topk(q.log() + gumbel, m, dim=-1).indices  # without replacement
        else:
            order = torch.sort(q, dim=-1, descending=True, stable=True).indices
            picks = order[:, :m]
            if duplicates and m >= 2:
                picks = torch.cat([picks[:, :1], picks[:, :m - 1]], 1)  # the top child proposed twice
        for j in range(m):
            node = first_child[par] + j
            tokens[:, node] = picks[:, j]
            pos[:, node + 1] = world.child(idx, picks[:, j])
    par_t = torch.tensor(parents, dtype=torch.int64)[None].expand(n, N)
    return tokens, par_t, pos


def _emissions(world: World, branching, rule: str, n: int = N_TRIALS, seed: int = 0, duplicates: bool = False):
    """The first three tokens of n trials [n, 3] (one tree step, then the target's draws)."""
    g = torch.Generator().manual_seed(seed)
    tokens, parents, pos = _draw_trees(world, branching, rule, n, g, duplicates)
    logits = world.L[pos]  # [n, N+1, V]
    q = world.Q[pos] if rule == "sampled" else None
    warp = dict(world.warp)
    out = fused_verify_tree(logits, tokens, parents, q, seed=torch.arange(n) + seed * n, **warp)
    assert (out.num_accepted >= 0).all()
    first3 = torch.full((n, 3), -1, dtype=torch.int64)
    w = min(3, out.tokens.shape[1])
    first3[:, :w] = out.tokens[:, :w]
    idx = torch.zeros(n, dtype=torch.int64)
    for k in range(3):
        missing = first3[:, k] < 0
        draw = torch.multinomial(world.P[idx].float(), 1, generator=g)[:, 0]
        first3[:, k] = torch.where(missing, draw, first3[:, k])
        idx = world.child(idx, first3[:, k])
    return first3


def _law3(world: World):
    V = world.V
    law = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        ia = world.child(0, a)
        for b in range(V):
            ib = world.child(ia, b)
            law[a, b] = world.P[0, a] * world.P[ia, b] * world.P[ib]
    return law


def _pvalues(world: World, first3):
    V = world.V
    law3 = _law3(world)
    law2 = law3.sum(-1)
    two = (first3[:, 0] * V + first3[:, 1]).numpy()
    three = (first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]).numpy()
    return (chi_square_pvalue(two, (law2 / law2.sum()).reshape(-1).numpy()),
            chi_square_pvalue(three, (law3 / law3.sum()).reshape(-1).numpy()))


CASES = ["random", "q_equals_p", "disjoint", "q_zero_where_p_positive", "top_k", "top_p", "padded_vocabulary"]
SHAPES = [(2, 2), (3, 1, 1), (1, 3), (4,)]


@pytest.mark.parametrize("rule", ["sampled", "deterministic"])
@pytest.mark.parametrize("case", CASES)
def test_joint_law_of_two_and_three_tokens(case, rule):
    """Each case over two tree shapes (chosen per case so that every shape is used)."""
    V = 6 if case == "padded_vocabulary" else 4
    world = World(case, V, depth=3, seed=CASES.index(case))
    for s, shape in enumerate([SHAPES[CASES.index(case) % 4], SHAPES[(CASES.index(case) + 1) % 4]]):
        first3 = _emissions(world, shape, rule, seed=s)
        p2, p3 = _pvalues(world, first3)
        assert min(p2, p3) > SIGNIFICANCE, (case, rule, shape, p2, p3)


def test_deterministic_duplicate_siblings_keep_the_law():
    """Duplicate siblings in the deterministic rule are handled (the second copy has probability
    0 under the residual and is passed over), not refused."""
    world = World("random", 4, depth=3, seed=20)
    first3 = _emissions(world, (3, 2), "deterministic", duplicates=True)
    assert min(_pvalues(world, first3)) > SIGNIFICANCE


def test_sampled_children_past_q_support_keep_the_law():
    """Gumbel-top-k asked for more children than q has tokens: the children with q = 0 (no draw
    without replacement gives them) are passed over."""
    world = World("q_zero_where_p_positive", 4, depth=3, seed=21)
    world.Q[:, 1] = 0
    world.Q /= world.Q.sum(-1, keepdim=True)  # support of 1 token: 4 children ask for 3 more
    first3 = _emissions(world, (4,), "sampled")
    assert min(_pvalues(world, first3)) > SIGNIFICANCE


# The mutants: each must be rejected at the same significance.
@pytest.mark.parametrize("rule,case,shape", [("sampled", "random", (3, 1, 1)), ("deterministic", "random", (3, 1, 1)),
                                             ("sampled", "q_zero_where_p_positive", (2, 2))])
def test_rejects_unmodified_p_mutant(rule, case, shape, monkeypatch):
    # siblings tested against the unmodified p: the rejected siblings' mass is never removed
    monkeypatch.setattr(tree_reference, "_tree_residual", lambda p, q: p)
    world = World(case, 4, depth=3, seed=CASES.index(case))
    assert min(_pvalues(world, _emissions(world, shape, rule))) < SIGNIFICANCE


@pytest.mark.parametrize("case,shape", [("random", (3, 1, 1)), ("padded_vocabulary", (4,))])
def test_rejects_unnormalised_q_mutant(case, shape, monkeypatch):
    # q with the sampled sibling removed but not renormalised
    monkeypatch.setattr(tree_reference, "_remove_child", lambda q, c: q.scatter(1, c[:, None], 0.0))
    V = 6 if case == "padded_vocabulary" else 4
    world = World(case, V, depth=3, seed=CASES.index(case))
    assert min(_pvalues(world, _emissions(world, shape, "sampled"))) < SIGNIFICANCE
