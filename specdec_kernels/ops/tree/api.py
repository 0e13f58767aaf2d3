"""``fused_verify_tree``: exact verification of a tree of drafted tokens in one step.

The rules, the layout of every input and output, and the proof that each rule keeps the target's
distribution are in ``tree.reference``'s docstring.  This module checks the arguments (each error
names the argument, the expected and the actual value), draws the random numbers (the chain's
Philox stream: ``reference.philox_uniforms(seed, offset, N)``) and runs the step.  Backends:
``"triton"``, the kernel of ``tree/kernel.py`` (one launch, one program per row, its Philox
numbers drawn in-kernel, no host read but the output width D when ``max_depth`` is None), the
default on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors when asked for;
``"torch"``, the reference itself, vectorised over the batch (one pass over the N nodes of [B, V]
operations), the default on CPU.  Both compute the same tokens on the same uniforms.

Dtypes: logits fp32/bf16/fp16 (read as fp32), draft probabilities fp32/bf16/fp16 (read as fp32),
node tokens and parents int32/int64, per-row parameters as ``fused_verify`` takes them, uniforms
float64 (fp32 widened); outputs int64.  The kernel reads fp32 draft probabilities (others are
converted first) and keeps its residual state in float32 workspaces [B, 2, V] and [B, Vd] that the
launcher allocates.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from ..host import host_readable
from ..verify.args import (FloatArg, IntArg, INDEX_DTYPES, LOGIT_DTYPES, as_tensor, check_draft_probs,
                           check_draft_sums, check_tensor, listed, normalize_rows, per_row_spec, range_fails,
                           shape_of)
from ..verify.launch import resolve_backend
from ..verify.reference.philox import philox_uniforms
from .reference import tree_depths, tree_verify_reference

__all__ = ["TreeVerifyOutput", "fused_verify_tree"]

_TREE_BACKENDS = ("auto", "triton", "torch")
# The kernel's vocabulary tile; the tests lower it to cross tile boundaries on small vocabularies.
# The kernel's vocabulary tile, a power of two >= 16 (``ops.kernels.tree_launch_settings``
# changes it: the tests lower it to cross tile boundaries on small vocabularies).
TREE_BLOCK_V = 4096


class TreeVerifyOutput(NamedTuple):
    tokens: torch.Tensor  # [B, D+1] int64: the accepted path's tokens, the final token, then -1
    path: torch.Tensor  # [B, D] int64: the accepted node indices, then -1
    num_accepted: torch.Tensor  # [B] int64: the path's length; -1 = invalid row (tokens and path all -1)


def fused_verify_tree(
    target_logits: torch.Tensor,  # [B, N+1, V] fp32/bf16/fp16: position 0 = the root, n + 1 = node n
    node_tokens: torch.Tensor,  # [B, N] int32/int64
    parents: torch.Tensor,  # [B, N] int32/int64: -1 = the root, else an earlier node
    draft_probs: Optional[torch.Tensor] = None,  # [B, N+1, Vd]: q at each position (children sampled w/o replacement)
    *,
    num_nodes: Optional[IntArg] = None,  # None (all N), int or [B] int: row b uses its first num_nodes[b] nodes
    temperature: FloatArg = 1.0,  # float or [B]: 0 = greedy (follow the argmax child, then emit the argmax)
    top_k: Optional[IntArg] = None,  # None, int or [B] int (0 = off)
    top_p: Optional[FloatArg] = None,  # None, float or [B] (1.0 = off)
    min_p: Optional[FloatArg] = None,  # None, float or [B] in [0, 1] (0 = off)
    seed: Optional[IntArg] = None,  # None (torch's default generator), int, or [B] int64
    offset: IntArg = 0,  # int or [B] int64: a step counter
    uniforms: Optional[torch.Tensor] = None,  # [B, N+1] float64 (or fp32) in [0, 1)
    max_depth: Optional[int] = None,  # D: the outputs' width (None: the deepest used node, a host read)
    backend: str = "auto",  # "auto" | "triton" | "torch"
) -> TreeVerifyOutput:
    """Verify a tree of drafted tokens against the target (``tree.reference`` gives the rules).

    ``draft_probs`` given: the children of each position were sampled without replacement from
    ``draft_probs[b, j]`` (Gumbel-top-k, or one draw after another with the drawn tokens removed),
    and are verified by recursive rejection sampling (Jeon et al. 2024).  ``draft_probs=None``: the
    children are a deterministic function of the prefix (the draft's top-k), verified against the
    target's residual with each rejected child removed.  Both are exact: the emitted tokens are
    distributed as sampling from the target alone.  The target's warp (temperature, then top-k,
    top-p, min-p) is ``fused_verify``'s; it applies to p only.  A chain (node n's parent n - 1)
    gives ``fused_verify``'s result for the same uniforms, except for a draft x with q(x) = 0 and
    p(x) > 0 (which no draw from q gives): ``fused_verify`` accepts it, the tree op passes it over.
    On CPU a node deeper than ``max_depth`` or a q row that does not sum to 1 raises; on CUDA the
    first makes its row invalid and the second is not checked (no host read).

    Randomness: row b's numbers depend on (seed[b], offset[b]) only (the chain's Philox stream
    with N draft slots); ``uniforms[b, n]`` tests node n and ``uniforms[b, N]`` drives the final
    draw.  Shapes, dtypes, devices and scalars are checked here; on CPU the values of num_nodes,
    parents and the per-row parameters are checked too (on CUDA a bad value marks its row
    invalid).  A row that reaches a NaN or +inf logit, a position with no finite logit, a child id
    outside [0, V), a malformed parent or (sampling) a NaN/inf/negative q gets num_accepted = -1
    and tokens = path = -1.

    ``backend``: ``"auto"`` runs the Triton kernel on CUDA tensors and the reference on CPU ones;
    ``"triton"`` the kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
    ``"torch"`` the reference, on the tensors' device.
    """
    if backend not in _TREE_BACKENDS:
        raise ValueError(f"backend must be one of {_TREE_BACKENDS}, got {backend!r}")
    if not isinstance(target_logits, torch.Tensor):
        raise TypeError(f"target_logits must be a torch.Tensor, got {type(target_logits).__name__}")
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must have 3 dims [B, N+1, V], got {target_logits.dim()}: "
                         f"{shape_of(target_logits)}")
    if target_logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"target_logits must have dtype float32, bfloat16 or float16, got "
                        f"{str(target_logits.dtype).replace('torch.', '')}")
    B, N1, V = target_logits.shape
    N = N1 - 1
    if N1 < 1:
        raise ValueError(f"target_logits must have N+1 >= 1 positions (dim 1: the root and the N nodes), got "
                         f"shape {shape_of(target_logits)}")
    if V < 1:
        raise ValueError(f"target_logits must have a vocabulary V >= 1, got shape {shape_of(target_logits)}")
    dev = target_logits.device
    resolved = resolve_backend(backend, dev)  # "triton" on CPU tensors needs TRITON_INTERPRET=1
    for name, t in (("node_tokens", node_tokens), ("parents", parents)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have 2 dims [B, N], got {t.dim()}: {shape_of(t)}")
        check_tensor(name, t, INDEX_DTYPES, [B, N], dev)
    check_draft_probs(draft_probs, [B, N1], "[B, N+1, Vd]", V, dev)
    if num_nodes is None:
        nb = N
    else:
        nb = per_row_spec("num_nodes", num_nodes, B, torch.int64, dev, int)
        if B > 0 and range_fails(nb, lambda v: (v < 0) | (v > N)):
            raise ValueError(f"num_nodes must be in [0, N] = [0, {N}], got {listed(nb)}")
    if max_depth is not None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int):
            raise TypeError(f"max_depth must be an int or None, got {type(max_depth).__name__}")
        if not 0 <= max_depth <= N:
            raise ValueError(f"max_depth must be in [0, N] = [0, {N}], got {max_depth}")
    temp, top_k, top_p, seed, offset, min_p = normalize_rows(B, N, dev, temperature, top_k, top_p, seed, offset,
                                                              uniforms, False, min_p)
    nb = as_tensor(nb, B, torch.int64, dev)
    if host_readable(parents) and host_readable(nb) and B > 0 and N > 0:
        depth, bad_tree = tree_depths(parents, nb)
        if bool(bad_tree.any()):
            b = int(bad_tree.nonzero()[0, 0])
            n = next(i for i in range(int(nb[b])) if not -1 <= int(parents[b, i]) < i)
            raise ValueError(f"parents[{b}, {n}] must be -1 (the root) or an earlier node in [0, {n}), "
                             f"got {int(parents[b, n])}")
        if max_depth is not None and bool((depth > max_depth).any()):
            b, n = (int(i) for i in (depth > max_depth).nonzero()[0])
            raise ValueError(f"max_depth = {max_depth} is smaller than the depth {int(depth[b, n])} of node {n} "
                             f"of row {b}")
    temp_t = as_tensor(temp, B, torch.float32, dev)
    if draft_probs is not None and B > 0 and N1 > 0 and host_readable(draft_probs) and bool((temp_t != 0).any()):
        # A position's q is read when a sampling row tests a child there: check every used parent's.
        par = parents.to(torch.int64)
        live = (torch.arange(N, device=dev)[None, :] < nb[:, None]) & (temp_t != 0)[:, None]  # [B, N]
        hits = torch.zeros(B, N1, dtype=torch.int64, device=dev)
        hits.scatter_add_(1, par.clamp(-1, N - 1) + 1, live.long())
        used = hits > 0  # [B, N+1]: the positions whose q a sampling row reads
        check_draft_sums(draft_probs.reshape(B * N1, -1), used.reshape(-1), lambda i: f"[{i // N1}, {i % N1}]",
                          lambda i: f"the children of position {i % N1}")
    opt = lambda v, dtype: None if v is None else as_tensor(v, B, dtype, dev)  # noqa: E731
    if resolved == "triton":
        # seed None: row b's seed is base + b, base drawn from torch's default generator
        tokens, path, na = _launch_tree(
            target_logits, node_tokens, parents, draft_probs, nb, temp_t, opt(top_k, torch.int64),
            opt(top_p, torch.float32), opt(min_p, torch.float32), as_tensor(seed, B, torch.int64, dev),
            as_tensor(offset, B, torch.int64, dev), None if uniforms is None else uniforms.to(torch.float64),
            max_depth)
        return TreeVerifyOutput(tokens, path, na)
    if uniforms is None:
        # seed None: row b's seed is base + b, base drawn from torch's default generator
        u = philox_uniforms(as_tensor(seed, B, torch.int64, dev), as_tensor(offset, B, torch.int64, dev), N)
    else:
        u = uniforms.to(torch.float64)
    tokens, path, na = tree_verify_reference(
        target_logits, node_tokens, parents, draft_probs, nb, temp_t, opt(top_k, torch.int64),
        opt(top_p, torch.float32), u, min_p=opt(min_p, torch.float32), max_depth=max_depth)
    return TreeVerifyOutput(tokens, path, na)


def tree_kernel_meta(V: int, N: int, D: int, has_draft_probs: bool, has_top_k: bool, has_top_p: bool,
                      has_min_p: bool, has_uniforms: bool) -> dict:
    """The tree kernel's compile-time parameters: its code-path constexprs, the block sizes (the
    vocabulary tile, N and D + 1 rounded up to powers of two), num_warps and enable_fp_fusion
    (pinned off: a multiply and an add stay two roundings, as in the interpreter and the reference, and
    the bits do not change with Triton's default)."""
    import triton  # imported lazily: the torch path needs no Triton

    block_v = max(16, min(triton.next_power_of_2(V), TREE_BLOCK_V))
    return dict(HAS_DRAFT_PROBS=has_draft_probs, HAS_TOP_K=has_top_k, HAS_TOP_P=has_top_p, HAS_MIN_P=has_min_p,
                HAS_UNIFORMS=has_uniforms, BLOCK_V=block_v, BLOCK_N=triton.next_power_of_2(max(N, 1)),
                BLOCK_D=triton.next_power_of_2(D + 1), num_warps=8 if block_v >= 2048 else 4,
                enable_fp_fusion=False)


def _launch_tree(
    target_logits: torch.Tensor,  # [B, N+1, V] fp32/bf16/fp16
    node_tokens: torch.Tensor,  # [B, N] int32/int64
    parents: torch.Tensor,  # [B, N] int32/int64
    draft_probs: Optional[torch.Tensor],  # [B, N+1, Vd] or None
    num_nodes: torch.Tensor,  # [B] int64
    temperature: torch.Tensor,  # [B] fp32
    top_k: Optional[torch.Tensor],  # [B] int64
    top_p: Optional[torch.Tensor],  # [B] fp32
    min_p: Optional[torch.Tensor],  # [B] fp32
    seed: torch.Tensor,  # [B] int64
    offset: torch.Tensor,  # [B] int64
    uniforms: Optional[torch.Tensor],  # [B, N+1] float64, or None: Philox in-kernel
    max_depth: Optional[int],  # D; None: the deepest used node (a host read)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree kernel (``tree/kernel.py``) on checked arguments: allocates the outputs and
    the workspaces, picks the grid (one program per row) and launches.  A value out of range marks
    its row invalid in the kernel, as in the reference.  Returns (tokens [B, D+1], path [B, D],
    num_accepted [B]), int64."""
    from .kernel import tree_verify_kernel  # imported lazily: the torch path needs no Triton

    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    if max_depth is None:
        depth, _ = tree_depths(parents, num_nodes.to(torch.int64).clamp(0, N))
        D = int(depth.max()) if depth.numel() else 0  # the reference's width
    else:
        D = int(max_depth)
    tokens = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    path = torch.empty((B, D), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, path, num_accepted
    contig = lambda t: t if t.stride(-1) == 1 else t.contiguous()  # noqa: E731  (rows read at ptr + v)
    logits = contig(target_logits)
    x, par = contig(node_tokens), contig(parents)
    q = None if draft_probs is None else contig(draft_probs.float())  # the kernel reads fp32 q
    Vd = q.shape[-1] if q is not None else V
    # The residual's two slots and q_w: written by a row before it reads them, so not initialised.
    p_ws = torch.empty((B, 2, V), dtype=torch.float32, device=dev)
    q_ws = torch.empty((B, Vd), dtype=torch.float32, device=dev) if q is not None else num_accepted
    u = None if uniforms is None else uniforms.to(torch.float64).contiguous()
    dummy = num_accepted  # stands in for absent optional pointers; never dereferenced
    row = lambda t, dtype: t.to(dtype).contiguous()  # noqa: E731  (row b read at ptr + b)
    meta = tree_kernel_meta(V, N, D, q is not None, top_k is not None, top_p is not None, min_p is not None,
                             u is not None)
    # Triton launches on the current device's current stream: make it the tensors'.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        tree_verify_kernel[(B,)](
            logits, logits.stride(0), logits.stride(1),
            x, x.stride(0),
            par, par.stride(0),
            q if q is not None else dummy, q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            row(num_nodes, torch.int64), row(temperature, torch.float32),
            row(top_k, torch.int64) if top_k is not None else dummy,
            row(top_p, torch.float32) if top_p is not None else dummy,
            row(min_p, torch.float32) if min_p is not None else dummy,
            row(seed, torch.int64), row(offset, torch.int64),
            u if u is not None else dummy,
            p_ws, q_ws,
            tokens, path, num_accepted,
            N, V, Vd, D,
            **meta,
        )
    return tokens, path, num_accepted
