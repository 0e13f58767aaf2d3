"""``fused_verify_tree`` and ``tree_verify_reference``: exact results, invariants, determinism,
invalid rows and argument errors.  (The distribution tests are in test_tree_verify_law.py.)

Exact: the vectorised reference equals a plain per-row walk written here from the rules (children
lists, recursion), on the same uniforms, over random trees of random shapes, both rules, ragged
node counts, greedy rows, top-k/top-p/min-p and padded draft vocabularies; and a chain given as a
tree equals ``fused_verify`` for the same uniforms and for the same seeds.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import fused_verify
from specdec_kernels.ops import reference
from specdec_kernels.ops.verify.reference import warp as warp_reference
from specdec_kernels.ops.tree.reference import tree_verify_reference
from specdec_kernels.ops.tree.api import fused_verify_tree
from tree_setup import tree_case

D64 = torch.float64


def _walk_row(p, argmax, tokens, parents, q, nb, greedy, u):
    """One row by the rules, as a walk over children lists.  p [N+1, V] fp32 (warped), argmax
    [N+1], q [N+1, V] fp32 or None.  Returns (path, final token)."""
    N1, V = p.shape
    N = N1 - 1
    children = {j: [n for n in range(nb) if parents[n] == j - 1] for j in range(N1)}
    pos, path = 0, []
    p_cur, p_w = p[0].clone(), p[0].clone()
    q_cur = None if q is None else q[0].clone()
    while True:
        moved = False
        for n in children[pos]:
            c = int(tokens[n])
            if greedy:
                moved = c == int(argmax[pos])
                if moved:
                    break
                continue
            if q is not None:
                if float(q_cur[c]) == 0:
                    continue
                acc = float(u[n]) * float(q_cur[c]) < float(p_cur[c])
            else:
                if float(p_cur[c]) == 0:
                    continue
                acc = float(u[n]) < float(p_cur[c])
            if acc:
                moved = True
                break
            qj = q_cur if q is not None else torch.nn.functional.one_hot(torch.tensor(c), V).float()
            r = (p_cur - qj).clamp(min=0.0)
            if float(r.sum()) > 0:
                p_cur, p_w = r / r.sum(), r
            if q is not None:
                q_cur = q_cur.clone()
                q_cur[c] = 0
                q_cur = q_cur / q_cur.sum() if float(q_cur.sum()) > 0 else torch.zeros_like(q_cur)
        if not moved:
            break
        path.append(n)
        pos = n + 1
        p_cur, p_w = p[pos].clone(), p[pos].clone()
        q_cur = None if q is None else q[pos].clone()
    final = int(argmax[pos]) if greedy else int(reference.inverse_cdf(p_w[None].double(), u[N:N1])[0])
    return path, final


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("warp", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_the_walk(sampled, warp, seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 48, 7, 9
    Vd = V - 2 if seed == 1 else V
    logits, tokens, parents, q, nb, temp, kw, u = tree_case(B, N, V, Vd, g, sampled, warp=warp)
    out_tokens, path, na = tree_verify_reference(logits, tokens, parents, q, nb, temp, kw.get("top_k"),
                                                 kw.get("top_p"), u, min_p=kw.get("min_p"), max_depth=N)
    assert (na >= 2).any() and (na == 0).any()  # deep walks and early stops both occur
    qf = None
    if sampled:
        qf = torch.zeros(B, N + 1, V)
        qf[..., :Vd] = q
    for b in range(B):
        t = float(temp[b])
        one = {k: v[b:b + 1].expand(N + 1) for k, v in kw.items()}
        s, keep = reference.warp_logits(logits[b], torch.full((N + 1,), 1.0 / t if t else 1.0), one.get("top_k"),
                                        one.get("top_p"), min_p=one.get("min_p"))
        p = warp_reference._target_probs(s, keep)
        pth, final = _walk_row(p, s.argmax(-1), tokens[b], parents[b].tolist(), None if qf is None else qf[b],
                               int(nb[b]), t == 0, u[b])
        assert int(na[b]) == len(pth), b
        assert path[b, :len(pth)].tolist() == pth and (path[b, len(pth):] == -1).all(), b
        assert out_tokens[b, :len(pth)].tolist() == tokens[b, pth].tolist(), b
        assert int(out_tokens[b, len(pth)]) == final, b
        assert (out_tokens[b, len(pth) + 1:] == -1).all(), b


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("warp", [False, True])
def test_chain_as_tree_equals_fused_verify(sampled, warp):
    g = torch.Generator().manual_seed(7)
    B, K, V = 96, 5, 11
    Vd = V - 3
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    q = torch.softmax(torch.randn(B, K, Vd, generator=g) * 2, -1)
    x = torch.multinomial(q.reshape(-1, Vd), 1, generator=g).view(B, K)  # q(x) > 0: a draw from q
    am = logits.argmax(-1)[:, :K]
    x = torch.where(torch.rand(B, K, generator=g) < 0.3, am.clamp(max=Vd - 1), x)  # long acceptances too
    kb = torch.randint(0, K + 1, (B,), generator=g)
    temp = torch.rand(B, generator=g) + 0.5
    temp[:10] = 0.0
    kw = {"top_k": torch.randint(0, V, (B,), generator=g), "top_p": torch.full((B,), 0.85)} if warp else {}
    u = torch.rand(B, K + 1, dtype=D64, generator=g)
    dp = q if sampled else None
    chain = fused_verify(logits, x, dp, num_draft_tokens=kb, temperature=temp, uniforms=u, backend="torch", **kw)
    parents = (torch.arange(K) - 1)[None].expand(B, K)
    dp_tree = torch.cat([q, q[:, -1:]], 1) if sampled else None  # position K's q is never read
    tree = fused_verify_tree(logits, x, parents, dp_tree, num_nodes=kb, temperature=temp, uniforms=u, max_depth=K,
                             **kw)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.tokens, chain.tokens)
    assert (chain.num_accepted >= 2).any() and (chain.num_accepted < kb).any()
    # and for the same seeds: the same Philox stream
    seed, off = torch.arange(B) * 3 + 1, torch.full((B,), 5)
    chain = fused_verify(logits, x, dp, num_draft_tokens=kb, temperature=temp, seed=seed, offset=off, backend="torch",
                         **kw)
    tree = fused_verify_tree(logits, x, parents, dp_tree, num_nodes=kb, temperature=temp, seed=seed, offset=off,
                             max_depth=K, **kw)
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.num_accepted, chain.num_accepted)


def test_invariants_determinism_and_row_independence():
    g = torch.Generator().manual_seed(11)
    B, N, V = 64, 9, 7
    logits, tokens, parents, q, nb, temp, kw, _ = tree_case(B, N, V, V, g, True)
    seed = torch.arange(B) + 100
    out = fused_verify_tree(logits, tokens, parents, q, num_nodes=nb, temperature=temp, seed=seed, offset=3)
    D = out.path.shape[1]
    assert out.tokens.shape == (B, D + 1)
    for b in range(B):
        k = int(out.num_accepted[b])
        assert 0 <= k <= D
        pth = out.path[b, :k].tolist()
        assert all(0 <= n < int(nb[b]) for n in pth)
        assert all(int(parents[b, n]) == (pth[i - 1] if i else -1) for i, n in enumerate(pth))  # a root path
        assert out.tokens[b, :k].tolist() == tokens[b, pth].tolist()
        assert 0 <= int(out.tokens[b, k]) < V and (out.tokens[b, k + 1:] == -1).all() and (out.path[b, k:] == -1).all()
    again = fused_verify_tree(logits, tokens, parents, q, num_nodes=nb, temperature=temp, seed=seed, offset=3)
    assert all(torch.equal(a, c) for a, c in zip(out, again))
    other = fused_verify_tree(logits, tokens, parents, q, num_nodes=nb, temperature=temp, seed=seed, offset=4)
    assert not torch.equal(other.tokens, out.tokens)
    for b in (0, 17, 63):
        alone = fused_verify_tree(logits[b:b + 1], tokens[b:b + 1], parents[b:b + 1], q[b:b + 1],
                                  num_nodes=nb[b:b + 1], temperature=temp[b:b + 1], seed=seed[b:b + 1], offset=3,
                                  max_depth=D)
        assert torch.equal(alone.tokens[0], out.tokens[b]) and torch.equal(alone.path[0], out.path[b])


def test_greedy_follows_the_argmax_child():
    g = torch.Generator().manual_seed(12)
    B, V = 32, 6
    logits = torch.randn(B, 5, V, generator=g)
    am = logits.argmax(-1)
    parents = torch.tensor([[-1, -1, 1, 1]] * B)
    tokens = torch.stack([(am[:, 0] + 1) % V, am[:, 0], (am[:, 2] + 2) % V, am[:, 2]], 1)  # node 1 then node 3
    out = fused_verify_tree(logits, tokens, parents, None, temperature=0.0)
    assert out.path.tolist() == [[1, 3]] * B
    assert out.tokens.tolist() == torch.stack([am[:, 0], am[:, 2], am[:, 4]], 1).tolist()


def test_invalid_rows_are_all_minus_one():
    g = torch.Generator().manual_seed(13)
    B, N, V = 8, 4, 5
    logits = torch.randn(B, N + 1, V, generator=g)
    parents = torch.tensor([[-1, 0, 1, 2]] * B)  # a chain
    q = torch.softmax(torch.randn(B, N + 1, V, generator=g), -1)
    tokens = logits.argmax(-1)[:, :N].clone()  # likely accepted
    u = torch.zeros(B, N + 1, dtype=D64)  # u = 0: every child with p > 0 is accepted
    logits[0, 0, 2] = float("nan")  # the root: invalid
    logits[1, N, 1] = float("inf")  # the last position, reached: invalid
    logits[2, :, :] = float("-inf")  # nothing finite
    tokens[3, 1] = V  # an id outside [0, V), tested
    q[4, 1, 0] = float("nan")  # q at a position whose child is tested
    bad_parents = parents.clone()
    bad_parents[5, 2] = 2  # a node its own parent
    out = tree_verify_reference(logits, tokens, bad_parents, q, torch.full((B,), N), torch.ones(B), None, None, u,
                                max_depth=N)
    assert out[2][:6].tolist() == [-1] * 6
    assert (out[0][:6] == -1).all() and (out[1][:6] == -1).all()
    assert (out[2][6:] == N).all()
    # a NaN at a position never reached does not matter
    logits2 = logits[6:7].clone()
    logits2[0, N, :] = float("nan")
    one = tree_verify_reference(logits2, tokens[6:7], parents[6:7], q[6:7], torch.tensor([N - 1]), torch.ones(1),
                                None, None, u[6:7], max_depth=N)
    assert int(one[2][0]) == N - 1


def _args(B=2, N=3, V=5):
    return (torch.zeros(B, N + 1, V), torch.zeros(B, N, dtype=torch.int64), torch.tensor([[-1, 0, 0]] * B))


@pytest.mark.parametrize("change,kind,message", [
    (lambda a, k: (a[0][0], a[1], a[2]), ValueError, "target_logits must have 3 dims"),
    (lambda a, k: (a[0].long(), a[1], a[2]), TypeError, "target_logits must have dtype"),
    (lambda a, k: (a[0], a[1][:, :2], a[2]), ValueError, "node_tokens must have shape [2, 3]"),
    (lambda a, k: (a[0], a[1].float(), a[2]), TypeError, "node_tokens must have dtype int32 or int64"),
    (lambda a, k: (a[0], a[1], torch.tensor([[-1, 0, 2]] * 2)), ValueError, "parents[0, 2] must be -1 (the root)"),
    (lambda a, k: (a[0], a[1], torch.tensor([[-1, -2, 0]] * 2)), ValueError, "parents[0, 1] must be -1"),
    (lambda a, k: k.update(num_nodes=4) or a, ValueError, "num_nodes must be in [0, N] = [0, 3], got 4"),
    (lambda a, k: k.update(max_depth=1) or (a[0], a[1], torch.tensor([[-1, 0, 1]] * 2)), ValueError,
     "max_depth = 1 is smaller than the depth 2 of node 1 of row 0"),
    (lambda a, k: k.update(max_depth=4) or a, ValueError, "max_depth must be in [0, N] = [0, 3], got 4"),
    (lambda a, k: k.update(uniforms=torch.zeros(2, 3, dtype=D64)) or a, ValueError, "uniforms must have shape [2, 4]"),
    (lambda a, k: k.update(temperature=-1.0) or a, ValueError, "temperature must be finite and >= 0"),
    (lambda a, k: k.update(top_p=0.0) or a, ValueError, "top_p must be in (0, 1]"),
    (lambda a, k: k.update(backend="cuda") or a, ValueError, "backend must be one of ('auto', 'triton', 'torch')"),
    (lambda a, k: k.update(draft_probs=torch.ones(2, 4, 5)) or a, ValueError, "draft_probs[0, 0] must sum to 1"),
    (lambda a, k: k.update(draft_probs=torch.ones(2, 3, 5) / 5) or a, ValueError,
     "draft_probs must have shape [2, 4, 5]"),
])
def test_argument_errors_name_the_argument(change, kind, message):
    kw = {}
    args = change(_args(), kw)
    with pytest.raises(kind) as e:
        fused_verify_tree(*args, **kw)
    assert message in str(e.value), str(e.value)


def test_root_only_and_empty_batch():
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(3, 1, 5, generator=g)
    u = torch.rand(3, 1, dtype=D64, generator=g)
    e = torch.zeros(3, 0, dtype=torch.int64)
    out = fused_verify_tree(logits, e, e, None, uniforms=u)
    assert out.path.shape == (3, 0) and out.num_accepted.tolist() == [0, 0, 0]
    chain = fused_verify(logits, e, None, uniforms=u, backend="torch")  # the bonus token alone
    assert torch.equal(out.tokens, chain.tokens)
    empty = fused_verify_tree(torch.zeros(0, 3, 5), torch.zeros(0, 2, dtype=torch.int64),
                              torch.zeros(0, 2, dtype=torch.int64), None, max_depth=2)
    assert empty.tokens.shape == (0, 3) and empty.path.shape == (0, 2)
