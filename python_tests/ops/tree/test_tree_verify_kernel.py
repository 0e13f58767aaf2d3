"""``fused_verify_tree``'s Triton kernel (``backend="triton"``; interpreted on CPU tensors on a
machine without a GPU) against ``tree_verify_reference``, token for token, path and count.

The grid: both proposal rules, random trees with ragged node counts (0 included), greedy rows
mixed with sampling rows, top-k/top-p/min-p rows, a padded draft vocabulary (Vd < V), V across
tile boundaries (the tile lowered) and not a multiple of it, fp32/bf16/fp16 logits, duplicate
siblings, the uniforms passed in and the kernel's own Philox numbers (``philox_uniforms``), and
every kind of invalid row.  The cases are checked to reach deep accepted paths, rejections, and
acceptances of a sibling after a rejection (where the residual decides).  A chain given as a tree
equals ``fused_verify``'s Triton kernel on the same numbers.
"""

from __future__ import annotations

import pytest
import torch

from helpers import HAS_CUDA
from specdec_kernels import fused_verify
from specdec_kernels.ops.verify import launch as _verify_launch
from specdec_kernels.ops.reference import philox_uniforms
from specdec_kernels.ops.tree.reference import tree_verify_reference
from specdec_kernels.ops.tree.api import _launch_tree, fused_verify_tree
from tree_setup import tree_case

pytestmark = pytest.mark.slow  # the tree kernel, interpreted on a CPU

DEV = "cuda" if HAS_CUDA else "cpu"
D64 = torch.float64


def _dev(t):
    return None if t is None else t.to(DEV)


def _reference(logits, tokens, parents, q, nb, temp, kw, u, D):
    return tree_verify_reference(logits, tokens, parents, q, nb, temp, kw.get("top_k"), kw.get("top_p"), u,
                                 min_p=kw.get("min_p"), max_depth=D)


def _kernel(logits, tokens, parents, q, nb, temp, kw, **extra):
    out = fused_verify_tree(_dev(logits), _dev(tokens), _dev(parents), _dev(q), num_nodes=_dev(nb),
                            temperature=_dev(temp), backend="triton", **{k: _dev(v) for k, v in kw.items()}, **extra)
    return tuple(t.cpu() for t in out)


def _assert_equal(out, ref):
    names = ("tokens", "path", "num_accepted")
    for name, a, r in zip(names, out, ref):
        assert torch.equal(a, r), f"{name}:\nkernel    {a.tolist()}\nreference {r.tolist()}"


def _walk_stats(parents, nb, temp, path, na):
    """(deep, stops_with_children, later_sibling): rows whose accepted path has >= 2 nodes;
    sampling rows that stopped at a node with children (each child examined and not accepted:
    the final draw comes from a residual when one was live); nodes a sampling row accepted after
    an earlier sibling (rejected or passed over: the residual's test)."""
    deep = int((na >= 2).sum())
    stops = later = 0
    for b in range(parents.shape[0]):
        k = int(na[b])
        if k < 0:
            continue
        used = parents[b, :int(nb[b])].tolist()
        pth = path[b, :k].tolist()
        stop = pth[-1] if k else -1
        sampling = float(temp[b]) != 0
        stops += int(sampling and stop in used)
        later += sum(int(sampling and used[:n].count(used[n]) > 0) for n in pth)
    return deep, stops, later


# (name, sampled, warp, V, Vd, logits dtype, q dtype, tile)
CONFIGS = [
    ("sampled", True, False, 37, 37, torch.float32, torch.float32, 16),
    ("sampled-padded-warp", True, True, 45, 38, torch.float32, torch.float32, 64),
    ("sampled-bf16", True, False, 300, 257, torch.bfloat16, torch.bfloat16, 4096),
    ("deterministic", False, False, 37, 37, torch.float32, None, 16),
    ("deterministic-warp-bf16", False, True, 61, 50, torch.bfloat16, None, 32),
    ("sampled-fp16-warp", True, True, 29, 29, torch.float16, torch.float32, 4096),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_kernel_equals_reference(cfg, tree_settings):
    """The same uniforms, and the same seeds/offsets (the kernel's Philox numbers), give the
    reference's tokens, path and count; the cases reach deep paths and residual decisions."""
    name, sampled, warp, V, Vd, dtype, qdtype, tile = cfg
    tree_settings(block_v=tile)
    B, N = 8, 8
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    stats = [0, 0, 0]
    for rep in range(2):
        logits, tokens, parents, q, nb, temp, kw, u = tree_case(B, N, V, Vd, g, sampled, warp=warp)
        nb[0] = 0  # the root alone
        am = logits.argmax(-1)  # [B, N+1]
        nb[1:4] = N
        temp[1:4] = temp[1:4].clamp(min=0.8)  # sampling rows
        if rep == 0:
            parents[1] = torch.arange(N) - 1  # a chain of random children: an early rejection
            # rows 2, 3: four children of the root, two random ones then the root's two likeliest:
            # rejections, then siblings tested against the residual; then three random children of node 2
            parents[2:4] = torch.tensor([-1, -1, -1, -1, 2, 2, 2, 4])
            second = logits[2:4, 0].topk(2, -1).indices[:, 1]
            tokens[2:4, 2], tokens[2:4, 3] = am[2:4, 0].clamp(max=Vd - 1), second.clamp(max=Vd - 1)
        else:
            # rows 1..3: the root's N likeliest tokens as its children (a top-k drafter; sampled
            # rule: q there close to p), one after another against the residual: each rejection
            # takes a sizeable share of p (and of q), so the renormalisations decide the next test
            parents[1:4] = -1
            tokens[1:4] = logits[1:4, 0, :Vd].topk(N, -1).indices
            if q is not None:
                q[1:4, 0] = torch.softmax(logits[1:4, 0, :Vd] * 1.5 + torch.randn(3, Vd, generator=g) * 0.5, -1)
            # duplicate siblings: node 3 repeated as node 4, under the same parent, in every row
            parents[:, 4], tokens[:, 4] = parents[:, 3], tokens[:, 3]
        # rows 4..7: every child the parent's argmax, on sharper logits: long accepted paths
        tokens[4:] = am.gather(1, parents + 1)[4:].clamp(max=Vd - 1)
        logits = logits * 1.5
        logits = logits.to(dtype)
        if q is not None:
            q = q.to(qdtype)
        ref = _reference(logits, tokens, parents, q, nb, temp, kw, u, N)
        assert (ref[2] >= 0).all()
        _assert_equal(_kernel(logits, tokens, parents, q, nb, temp, kw, uniforms=u, max_depth=N), ref)
        seed, offset = torch.arange(B) * 7 + 3 + rep, torch.arange(B) % 3 + 1
        ref_s = _reference(logits, tokens, parents, q, nb, temp, kw, philox_uniforms(seed, offset, N), N)
        _assert_equal(_kernel(logits, tokens, parents, q, nb, temp, kw, seed=seed, offset=offset, max_depth=N),
                      ref_s)
        for r in (ref, ref_s):
            stats = [a + b for a, b in zip(stats, _walk_stats(parents, nb, temp, r[1], r[2]))]
    deep, stops, later = stats
    assert deep >= 2 and stops >= 2 and later >= 1, stats


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_siblings_against_the_residual(sampled, tree_settings):
    """Every row a star: six children of the root, then a child under each of the first three.
    Deterministic rule: the root's six likeliest tokens; sampled rule: q's six likeliest (a
    Gumbel-top-k draw's likeliest outcome), with p loosely related to q.  Each rejection removes
    a sizeable share of p (and of q), so the renormalised residual and q decide the next tests and
    the final draws."""
    tree_settings(block_v=16)
    g = torch.Generator().manual_seed(51 + sampled)
    B, N, V = 8, 9, 24
    q_logits = torch.randn(B, N + 1, V, generator=g) * 2
    logits = q_logits * 0.5 + torch.randn(B, N + 1, V, generator=g) * 1.5
    q = torch.softmax(q_logits, -1) if sampled else None
    parents = torch.tensor([[-1] * 6 + [0, 1, 2]] * B)
    first = (q_logits if sampled else logits)[:, 0].topk(6, -1).indices
    tokens = torch.cat([first, logits[:, 1:4].argmax(-1)], 1)
    nb = torch.full((B,), N)
    temp = torch.ones(B)
    stats = [0, 0, 0]
    for rnd in ({"uniforms": torch.rand(B, N + 1, dtype=D64, generator=g)},
                {"seed": torch.arange(B) + 11, "offset": torch.full((B,), 2)}):
        u = rnd["uniforms"] if "uniforms" in rnd else philox_uniforms(rnd["seed"], rnd["offset"], N)
        ref = _reference(logits, tokens, parents, q, nb, temp, {}, u, 2)
        _assert_equal(_kernel(logits, tokens, parents, q, nb, temp, {}, max_depth=2, **rnd), ref)
        stats = [a + b for a, b in zip(stats, _walk_stats(parents, nb, temp, ref[1], ref[2]))]
    _, stops, later = stats
    assert stops >= 4 and later >= 2, stats


def test_max_depth_none_and_a_single_row():
    """max_depth None: the width is the deepest used node's depth, as the reference's; B = 1; the
    root alone; B = 0."""
    g = torch.Generator().manual_seed(21)
    logits, tokens, parents, q, nb, temp, kw, u = tree_case(4, 6, 19, 19, g, True)
    ref = _reference(logits, tokens, parents, q, nb, temp, kw, u, None)
    out = _kernel(logits, tokens, parents, q, nb, temp, kw, uniforms=u)
    assert out[1].shape == ref[1].shape
    _assert_equal(out, ref)
    one = _kernel(logits[2:3], tokens[2:3], parents[2:3], q[2:3], nb[2:3], temp[2:3], kw, uniforms=u[2:3],
                  max_depth=ref[1].shape[1])
    _assert_equal(one, tuple(t[2:3] for t in ref))
    # the root alone (N = 0: the final token only), and an empty batch
    e = torch.zeros(4, 0, dtype=torch.int64)
    root = _kernel(logits[:, :1], e, e, None, None, temp, {}, uniforms=u[:, -1:])
    _assert_equal(root, _reference(logits[:, :1], e, e, None, torch.zeros(4, dtype=torch.int64), temp, {},
                                   u[:, -1:], None))
    empty = fused_verify_tree(torch.zeros(0, 3, 5, device=DEV), torch.zeros(0, 2, dtype=torch.int64, device=DEV),
                              torch.zeros(0, 2, dtype=torch.int64, device=DEV), None, max_depth=2, backend="triton")
    assert empty.tokens.shape == (0, 3) and empty.path.shape == (0, 2) and empty.num_accepted.shape == (0,)


def _invalid_batch(sampled: bool):
    """Eight rows, each broken in one way (the brief's list) or a control, and the rows expected
    invalid.  The values the public op refuses on CPU go to the launcher directly."""
    B, N, V = 8, 5, 13
    g = torch.Generator().manual_seed(5 + sampled)
    logits = torch.randn(B, N + 1, V, generator=g)
    parents = torch.tensor([[-1, 0, 1, -1, 3]] * B)  # a chain of 3 and a branch of 2
    q = torch.softmax(torch.randn(B, N + 1, V, generator=g), -1) if sampled else None
    tokens = logits.argmax(-1).gather(1, parents + 1).clone()  # the parent's argmax: accepted
    nb = torch.full((B,), N)
    temp = torch.ones(B)
    u = torch.zeros(B, N + 1, dtype=D64)  # every live child accepted
    return B, N, V, logits, parents, q, tokens, nb, temp, u


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_invalid_rows_equal_the_reference(sampled):
    """Each kind of invalid row, through the launcher (no host checks): all -1, as the reference;
    the control rows (a NaN or a bad q where nothing reads it) are valid."""
    B, N, V, logits, parents, q, tokens, nb, temp, u = _invalid_batch(sampled)
    kw = {"top_k": torch.zeros(B, dtype=torch.int64), "top_p": torch.ones(B), "min_p": torch.zeros(B)}
    # batch 1: parameters and the tree
    l1, p1, t1, nb1, temp1, kw1 = logits.clone(), parents.clone(), tokens.clone(), nb.clone(), temp.clone(), \
        {k: v.clone() for k, v in kw.items()}
    temp1[0] = float("nan")
    temp1[1] = 1e-40  # below FLT_MIN
    kw1["top_k"][2] = -1
    kw1["top_p"][3] = 0.0
    kw1["min_p"][4] = 1.5
    nb1[5] = N + 1
    p1[6, 2] = 2  # its own parent
    p1[7, 4] = -2
    bad1 = list(range(8))
    # batch 2: what the walk reaches, and the depth
    l2, p2, t2, q2, temp2 = logits.clone(), parents.clone(), tokens.clone(), None if q is None else q.clone(), \
        temp.clone()
    l2[0, 0, 3] = float("nan")  # the root
    l2[1, 2, 5] = float("inf")  # node 1's position, reached by the chain
    l2[2, 3, :] = float("-inf")  # node 2's position, reached: nothing finite
    t2[3, 1] = V  # a tested child outside [0, V)
    t2[4, 0] = -1
    temp2[4] = 0.0  # (a greedy row: the id is checked all the same)
    l2[5, 5, 0] = float("nan")  # node 4's position, never reached (node 0 is accepted: node 3 is not examined)
    bad2 = [0, 1, 2, 3, 4]
    if sampled:
        q2[6, 0, 2] = float("nan")  # the root's q, where node 0 is tested
        q2[7, 5, 1] = -0.5  # node 4's position: no child of node 4, q never checked
        bad2.append(6)
    for (lg, par, tk, qq, n_, tp, kk, uu), bad in (((l1, p1, t1, q, nb1, temp1, kw1, u), bad1),
                                                   ((l2, p2, t2, q2, nb, temp2, kw, u), bad2)):
        ref = _reference(lg, tk, par, qq, n_, tp, kk, uu, 3)
        assert [b for b in range(B) if int(ref[2][b]) == -1] == bad
        out = _launch_tree(_dev(lg), _dev(tk), _dev(par), _dev(qq), _dev(n_), _dev(tp), _dev(kk["top_k"]),
                           _dev(kk["top_p"]), _dev(kk["min_p"]), torch.zeros(B, dtype=torch.int64, device=DEV),
                           torch.zeros(B, dtype=torch.int64, device=DEV), _dev(uu), 3)
        _assert_equal(tuple(t.cpu() for t in out), ref)
    # a depth beyond max_depth (the chain's depth 3 > 2)
    ref = _reference(logits, tokens, parents, q, nb, temp, {}, u, 2)
    assert (ref[2] == -1).all()
    out = _launch_tree(_dev(logits), _dev(tokens), _dev(parents), _dev(q), _dev(nb), _dev(temp), None, None, None,
                       torch.zeros(B, dtype=torch.int64, device=DEV), torch.zeros(B, dtype=torch.int64, device=DEV),
                       _dev(u), 2)
    _assert_equal(tuple(t.cpu() for t in out), ref)
    # the same batch with max_depth 3: every row valid, the chain accepted to its end
    ref = _reference(logits, tokens, parents, q, nb, temp, {}, u, 3)
    assert ref[2].tolist() == [3] * B


def test_residual_that_sums_to_zero_is_not_taken():
    """q >= p everywhere (a q the public op refuses: it sums to 1.5; the launcher checks nothing):
    the first child's residual sums to 0, so p is kept (row 1's next test and row 2's final draw
    use it) while q loses the child all the same; row 0's second child is rejected with a residual
    taken (p_cur = [1, 0, 0]), its third with p_cur = 0 there, and its fourth, q_cur = 0 by then,
    is passed over."""
    B, V = 3, 3
    logits = torch.zeros(B, 5, V)  # p = 1/3 each
    q = torch.full((B, 5, V), 0.5)
    parents = torch.tensor([[-1, -1, -1, -1]] * B)
    tokens = torch.tensor([[0, 1, 2, 0]] * B)
    u = torch.tensor([[0.9, 0.8, 0.5, 0.0, 0.6], [0.9, 0.1, 0.5, 0.0, 0.3], [0.9, 0.8, 0.5, 0.0, 0.99]], dtype=D64)
    nb = torch.tensor([4, 4, 1])
    temp = torch.ones(B)
    ref = _reference(logits, tokens, parents, q, nb, temp, {}, u, 1)
    assert ref[2].tolist() == [0, 1, 0] and ref[0].tolist() == [[0, -1], [1, 0], [2, -1]]
    zeros = torch.zeros(B, dtype=torch.int64, device=DEV)
    out = _launch_tree(_dev(logits), _dev(tokens), _dev(parents), _dev(q), _dev(nb), _dev(temp), None, None, None,
                       zeros, zeros, _dev(u), 1)
    _assert_equal(tuple(t.cpu() for t in out), ref)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_chain_as_tree_equals_fused_verify_triton(sampled, tree_settings, split_settings):
    """Node n's parent n - 1: the tree kernel gives the chain kernel's tokens and counts on the same
    uniforms and on the same seeds."""
    tree_settings(block_v=16)
    split_settings(chunk=16)
    g = torch.Generator().manual_seed(31 + sampled)
    B, K, V = 6, 4, 29
    Vd = V - 4
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    q = torch.softmax(torch.randn(B, K, Vd, generator=g) * 2, -1)
    x = torch.multinomial(q.reshape(-1, Vd), 1, generator=g).view(B, K)
    am = logits.argmax(-1)[:, :K]
    x = torch.where(torch.rand(B, K, generator=g) < 0.5, am.clamp(max=Vd - 1), x)
    kb = torch.tensor([K, K, 0, 2, K, 3])
    temp = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.3, 1.0])
    u = torch.rand(B, K + 1, dtype=D64, generator=g)
    dp = q if sampled else None
    parents = (torch.arange(K) - 1)[None].expand(B, K)
    dp_tree = torch.cat([q, q[:, -1:]], 1) if sampled else None  # position K's q is never read
    seed, off = torch.arange(B) * 5 + 2, torch.full((B,), 3)
    for rnd in ({"uniforms": u}, {"seed": seed, "offset": off}):
        chain = fused_verify(_dev(logits), _dev(x), _dev(dp), num_draft_tokens=_dev(kb), temperature=_dev(temp),
                             backend="triton", **{k: _dev(v) for k, v in rnd.items()})
        tree = _kernel(logits, x, parents, dp_tree, kb, temp, {}, max_depth=K, **rnd)
        assert torch.equal(tree[2], chain.num_accepted.cpu()) and torch.equal(tree[0], chain.tokens.cpu())
    assert (chain.num_accepted >= 2).any()


def test_backends(monkeypatch):
    """"auto" on CPU tensors is the reference; "triton" on CPU tensors needs the interpreter."""
    g = torch.Generator().manual_seed(41)
    logits, tokens, parents, q, nb, temp, kw, u = tree_case(2, 3, 7, 7, g, True)
    args = (logits, tokens, parents, q)
    kwargs = dict(num_nodes=nb, temperature=temp, uniforms=u, max_depth=3)
    auto = fused_verify_tree(*args, **kwargs)
    torch_out = fused_verify_tree(*args, backend="torch", **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(auto, torch_out))
    monkeypatch.setattr(_verify_launch, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        fused_verify_tree(*args, backend="triton", **kwargs)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\)"):
        fused_verify_tree(*args, backend="cuda", **kwargs)


def test_tree_launch_settings_are_checked_and_restored():
    from specdec_kernels.ops.kernels import tree_launch_settings
    from specdec_kernels.ops.tree import api

    before = api.TREE_BLOCK_V
    with tree_launch_settings(block_v=32):
        assert api.tree_kernel_meta(1000, 4, 2, True, False, False, False, False)["BLOCK_V"] == 32
    assert api.TREE_BLOCK_V == before
    for bad in (0, 8, 48, 2.0, True):
        with pytest.raises(ValueError, match=f"block_v must be an int >= 16, a power of two, got {bad!r}"):
            with tree_launch_settings(block_v=bad):
                pass
    assert api.TREE_BLOCK_V == before
