"""Tree verification: the pure-PyTorch reference of ``fused_verify_tree``, and why it is exact.

A *tree* of drafted tokens replaces the chain: each node holds a token and a parent (the root,
or an earlier node), and the target scores every node in one forward, so that the logits at a
node give the target's distribution of that node's children.  One verification step walks the
tree from the root: at the current node it tests that node's children one after the other, in
the order they were proposed; the first child accepted becomes the current node and the walk goes
on from it; when every child of the current node is rejected (or it has none), one more token is
drawn from what is left of the target's distribution there, and the step ends.

Conventions (one for every function of the tree ops)
----------------------------------------------------
- ``target_logits [B, N+1, V]``: position 0 is the root (the last token of the prefix), position
  n + 1 is node n; position j's logits score the children of that position.
- ``node_tokens [B, N]`` and ``parents [B, N]``: node n's token, and its parent (-1 = the root,
  else a node m < n: nodes in topological order), siblings in the order they were proposed.
  Row b uses its first ``num_nodes[b]`` nodes; the others are ignored.
- ``draft_probs [B, N+1, Vd]`` (Vd <= V, zero beyond Vd) is the draft's distribution q at each
  position, from which that position's children were **sampled without replacement** (e.g.
  Gumbel-top-k); ``None`` means the children are **deterministic** (e.g. the draft's top-k).
- ``uniforms [B, N+1]`` in [0, 1): ``uniforms[b, n]`` is node n's acceptance test,
  ``uniforms[b, N]`` the final draw (``reference.philox_uniforms(seed, offset, N)``: the chain's
  numbers, so a chain given as a tree uses the very numbers ``fused_verify`` uses).
- Outputs: ``tokens [B, D+1]`` (the accepted path's tokens, then the final token, then -1),
  ``path [B, D]`` (the accepted node indices, then -1) and ``num_accepted [B]`` (the path's
  length; -1 for an invalid row, whose tokens and path are all -1), D = the deepest node's depth.

The two rules, and why each is exact
------------------------------------
Write p for the target's (warped) distribution at the current node, and let the current node's
children be c_1, ..., c_m.  It is enough to show that the token this node emits (a child that is
accepted, or the final draw) is distributed as p: when child c is accepted, the walk restarts at c
with the target's distribution given the prefix and c, and by induction over the depth every
further token has the target's conditional law; so the emitted sequence, continued by the
target, has the target's joint law.

*Sampled without replacement* (recursive rejection sampling; Jeon et al. 2024, "Recursive
Speculative Decoding"): c_1 ~ q_1 = q, and c_{j+1} ~ q_{j+1} = q_j with c_j removed,
renormalised (the law of the next draw without replacement).  Set p_1 = p.  Child c_j is accepted
with probability min(1, p_j(c_j) / q_j(c_j)); on rejection p_{j+1} = norm(max(0, p_j - q_j));
after the last rejection the token is drawn from p_{m+1}.  Claim: from stage j on, the emitted
token has law p_j, whatever c_1..c_{j-1} were.  For j = m + 1 it is the final draw.  At stage j,
    P(emit c_j = v) = q_j(v) min(1, p_j(v)/q_j(v)) = min(p_j(v), q_j(v)),
    P(reject)       = 1 - sum_v min(p_j(v), q_j(v)) = sum_v max(0, p_j(v) - q_j(v)),
and on rejection the token has law p_{j+1} by induction; p_{j+1} does not depend on which c_j was
drawn (it is built from the whole of q_j, not from c_j), so conditioning on the rejection does not
change it.  In all: min(p_j, q_j) + max(0, p_j - q_j) = p_j.  (A chain is the case m = 1: the
token rule of Leviathan et al.)  What makes it exact is both updates: siblings tested against
the unmodified p accept too often (p_j(v) > p(v) is what must be used once the earlier tests
have taken their share), and a q_j left unnormalised misstates the law the sibling was drawn from.

*Deterministic children* (c_1..c_m a function of the prefix, e.g. the draft's top-m): set p_1 = p;
accept c_j with probability p_j(c_j); on rejection p_{j+1} = p_j with c_j removed, renormalised;
draw the final token from p_{m+1}.  Stage j emits c_j with probability p_j(c_j) and otherwise a
token of law p_{j+1} = p_j(. | not c_j), so its law is p_j; by induction the node emits p.  This
is the sampled rule with q_j the point mass at c_j (max(0, p_j - 1{c_j}) is p_j with c_j
removed), and it is how the reference computes it.

Edge cases, each exact
----------------------
- A child whose current probability under the proposal rule is 0 is passed over (it changes
  nothing and uses no random number): for the sampled rule q_j(c) = 0 (a duplicate of an earlier
  sibling, a token past the draft vocabulary, or a child proposed after q's support ran out: none
  can be a draw without replacement from q_j); for the deterministic rule p_j(c) = 0 (duplicate
  siblings are therefore handled, not refused: the second copy has p_j = 0).  Passing over a child
  is the same as the proposal not having made it, so the rule stays exact.  (The chain op differs
  on one input the sampled rule cannot produce: a draft x with q(x) = 0 and p(x) > 0, which
  ``fused_verify`` accepts.)
- A residual that sums to 0 in floating point (p_j <= q_j everywhere, rejected only by
  rounding) is not taken: the walk keeps p_j, as the chain op keeps p.
- Greedy rows (temperature 0) follow the child equal to the argmax of the current logits (the
  first such child), then emit the argmax.
- A row is invalid (all -1) if its parameters are out of range, its tree is malformed (a parent
  outside [-1, n) for a node it uses, or a node deeper than ``max_depth``), it reaches a position
  whose logits are unusable (NaN, +inf, none finite), it tests a child whose id is outside
  [0, V), or (sampled rule, non-greedy) it tests a child at a position whose q holds a NaN, an
  inf or a negative entry.

Numerics follow the chain reference: p and q in fp32, the acceptance test u * q(c) < p(c) in
float64 with no division (u < p(c) for the deterministic rule), the residuals and their
renormalisation in fp32, and the final inverse-CDF draw summed in float64 over the unnormalised
weights (``reference.inverse_cdf``).
"""

from __future__ import annotations

import torch

from ..verify.reference.chain import acceptance_test, inverse_cdf, target_distributions
from ..verify.reference.warp import torch_sort_descending

__all__ = ["tree_depths", "tree_verify_reference"]


def tree_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [B, N] int64, bad_tree [B] bool): each used node's depth (the root's children have
    depth 1; 0 for unused nodes) and whether a used node's parent is outside [-1, n)."""
    B, N = parents.shape
    par = parents.to(torch.int64)
    nb = num_nodes.to(torch.int64)
    depth = torch.zeros(B, N, dtype=torch.int64, device=parents.device)
    bad = torch.zeros(B, dtype=torch.bool, device=parents.device)
    for n in range(N):
        used = n < nb
        pn = par[:, n]
        ok = (pn >= -1) & (pn < n)
        bad |= used & ~ok
        parent_depth = depth.gather(1, pn.clamp(0, max(n - 1, 0))[:, None])[:, 0] if n > 0 else torch.zeros_like(pn)
        d = torch.where(pn >= 0, parent_depth + 1, 1)
        depth[:, n] = torch.where(used & ok, d, 0)
    return depth, bad


def _tree_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The unnormalised residual max(0, p - q) after a rejection, fp32 [B, V]."""
    return (p - q).clamp(min=0.0)


def _remove_child(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """q with token c removed and renormalised (the law of the next draw without replacement);
    all zeros once nothing is left.  q [B, V] fp32, c [B] int64."""
    q = q.scatter(1, c[:, None], 0.0)
    s = q.sum(-1, keepdim=True)
    return torch.where(s > 0, q / s.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def tree_verify_reference(
    target_logits: torch.Tensor,  # [B, N+1, V] fp32/bf16/fp16: position 0 = root, n+1 = node n
    node_tokens: torch.Tensor,  # [B, N] int
    parents: torch.Tensor,  # [B, N] int: -1 = the root, else an earlier node
    # draft_probs [B, N+1, Vd] fp32, Vd <= V: children sampled w/o replacement; None = deterministic
    draft_probs: torch.Tensor | None,
    num_nodes: torch.Tensor,  # [B] int64 in [0, N]
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] fp32, 1 = off
    uniforms: torch.Tensor,  # [B, N+1] float64 (or fp32) in [0, 1)
    *,
    min_p: torch.Tensor | None = None,  # [B] fp32 in [0, 1], 0 = off
    max_depth: int | None = None,  # D, the width of path; None = the deepest used node
    sort_descending=torch_sort_descending,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tree-verification step (the module docstring gives the rules and their proof).
    Returns (tokens [B, D+1] int64, path [B, D] int64, num_accepted [B] int64)."""
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    nb = num_nodes.to(torch.int64)
    par = parents.to(torch.int64)
    x = node_tokens.to(torch.int64)
    depth, bad_tree = tree_depths(par, nb.clamp(0, N))
    D = (int(depth.max()) if depth.numel() else 0) if max_depth is None else int(max_depth)
    bad_tree |= (depth > D).any(-1)

    greedy, bad_param, p, bad_pos, argmax = target_distributions(
        target_logits, nb, temperature, top_k, top_p, min_p, False, sort_descending)  # p [B, N+1, V] fp32
    sampled = draft_probs is not None
    if sampled:
        Vd = draft_probs.shape[-1]
        q = torch.zeros(B, N1, V, dtype=torch.float32, device=dev)
        q[..., :Vd] = draft_probs.float()
        bad_q = ~torch.isfinite(q).all(-1) | (q < 0).any(-1)  # [B, N+1]
        q = torch.nan_to_num(q, nan=0.0, posinf=0.0).clamp(min=0.0)

    rows = torch.arange(B, device=dev)
    bad = bad_param | bad_tree | bad_pos[:, 0]
    cur = torch.full((B,), -1, dtype=torch.int64, device=dev)  # the current node (-1 = the root)
    n_acc = torch.zeros(B, dtype=torch.int64, device=dev)
    path = torch.full((B, max(D, 0)), -1, dtype=torch.int64, device=dev)
    p_cur = p[:, 0].clone()  # [B, V] the current node's (residual) distribution, normalised
    p_w = p_cur.clone()  # [B, V] its unnormalised weights: what the final draw samples
    q_cur = q[:, 0].clone() if sampled else None  # [B, V] the law the next sibling was drawn from
    u = uniforms.double()

    for n in range(N):
        c = x[:, n]
        examine = ~bad & (n < nb) & (par[:, n] == cur)
        bad |= examine & ((c < 0) | (c >= V))
        examine &= ~bad
        c_safe = c.clamp(0, V - 1)
        p_c = p_cur.gather(1, c_safe[:, None])[:, 0]
        if sampled:
            sampling = examine & ~greedy
            bad |= sampling & bad_q[rows, cur + 1]
            examine &= ~bad
            q_c = q_cur.gather(1, c_safe[:, None])[:, 0]
            live = examine & (greedy | (q_c > 0))
            passes = acceptance_test(u[:, n], p_c, q_c)
        else:
            live = examine & (greedy | (p_c > 0))
            passes = u[:, n] < p_c.double()
        accept = live & torch.where(greedy, c == argmax[rows, cur + 1], passes)
        reject = live & ~accept & ~greedy

        q_j = q_cur if sampled else torch.nn.functional.one_hot(c_safe, V).float()
        r = _tree_residual(p_cur, q_j)
        s = r.sum(-1, keepdim=True)
        take = reject[:, None] & (s > 0)
        p_cur = torch.where(take, r / s.clamp(min=torch.finfo(torch.float32).tiny), p_cur)
        p_w = torch.where(take, r, p_w)
        if sampled:
            q_cur = torch.where(reject[:, None], _remove_child(q_cur, c_safe), q_cur)

        a = accept[:, None]
        path = torch.where(a & (torch.arange(path.shape[1], device=dev) == n_acc[:, None]), n, path)
        n_acc = n_acc + accept.long()
        cur = torch.where(accept, n, cur)
        p_cur = torch.where(a, p[:, n + 1], p_cur)
        p_w = torch.where(a, p[:, n + 1], p_w)
        if sampled:
            q_cur = torch.where(a, q[:, n + 1], q_cur)
        bad |= accept & bad_pos[:, n + 1]

    weights = torch.nan_to_num(p_w.double(), nan=0.0, posinf=0.0)  # only invalid rows hold NaN
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, 1.0)  # a dummy draw, discarded
    final = torch.where(greedy, argmax[rows, cur + 1], inverse_cdf(weights, u[:, N]))

    cols = torch.arange(D + 1, device=dev)[None, :]
    path_tokens = x.gather(1, path.clamp(min=0)) if D > 0 else x.new_zeros(B, 0)
    tokens = torch.where(cols[:, :D] < n_acc[:, None], path_tokens, -1)
    tokens = torch.cat([tokens, torch.full((B, 1), -1, dtype=torch.int64, device=dev)], 1)
    tokens = torch.where(cols == n_acc[:, None], final[:, None], tokens)
    tokens = torch.where(bad[:, None], -1, tokens)
    path = torch.where(bad[:, None], -1, path)
    return tokens, path, torch.where(bad, -1, n_acc)
