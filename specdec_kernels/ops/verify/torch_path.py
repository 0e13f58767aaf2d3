"""The torch path of ``fused_verify`` (the default on CPU tensors): ``verify_reference``'s
computation with fewer passes over the [B, K+1, V] logits and less work per row, bit-identical to
it (tests: test_verify_greedy_fast_path.py, test_verify_sampling_fast_path.py).

Routes: every row greedy (``_verify_greedy``: maxima and first argmaxes only, finished on the
host for small batches), sampled rows without a warp (``_verify_untruncated``) or with top-k,
top-p or min-p (``_verify_warped``); the final draw row by row for few rows or a large vocabulary
(``_final_token_rows``); the Philox numbers in Python ints for small batches (``_uniforms``).  The
other layouts (packed, probabilities in, log-probabilities, ``out=``, draft logits, block
verification) go through ``_run_torch_layout``.  Values are read on the host only where
``host.host_readable`` allows it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from ..host import host_readable, sort_descending_cpu
from .args import _Args, _materialize
from .launch import _Layout
from .reference import block as _block
from .reference import chain as _chain
from .reference.chain import (drafts, final_token, verify_outputs, per_position, row_parameters, stop_position,
                              verify_reference)
from .reference.philox import philox_uniforms, philox_uniforms_host
from .reference.warp import warp_logits


def _all_greedy(a: _Args) -> bool:
    """Whether the CPU torch path may take the greedy route: every row has temperature 0 (the
    reference's definition of a greedy row: ``temperature.float() == 0``, so -0.0 counts).
    CPU only: on CUDA the test would be a host sync."""
    t = a.temperature
    return host_readable(t) and t.numel() > 0 and bool((t == 0).all())


@dataclass(frozen=True)
class Routes:
    """Where the torch path changes method; the outputs are the same bits on either side of each
    threshold (the tests move them with ``routes``).  argmax_chunk: the chunk of
    ``_max_and_first_argmax``, small enough that argmax over one chunk per row is cheap.
    host_greedy_max: up to this many verified positions (B * (K+1)) the greedy route finishes on
    the host, in Python ints, instead of some forty small tensor ops (about half the call at B = 1:
    docs/history/measurements.md).  row_draw_max, row_draw_min_v: the untruncated route's final
    draw goes row by row for up to row_draw_max rows, or any number over a vocabulary of at least
    row_draw_min_v tokens, rather than through the reference's batched passes (faster for a few rows
    or a large vocabulary, slower for many rows of a small one)."""

    argmax_chunk: int = 256
    host_greedy_max: int = 64
    row_draw_max: int = 8
    row_draw_min_v: int = 4096


_ROUTES = [Routes()]  # a module global, not a ContextVar: torch.compile traces the torch path


def current_routes() -> Routes:
    """The ``Routes`` in force (``routes`` changes them within a block)."""
    return _ROUTES[0]


@contextlib.contextmanager
def routes(**changes):
    """Within the block, the torch path's ``Routes`` with ``changes`` (e.g. ``row_draw_max=0``: every
    final draw batched): to exercise each method on the same inputs.  Process-wide."""
    for k, v in changes.items():
        if k not in Routes.__dataclass_fields__:
            raise TypeError(f"routes: unknown setting {k!r}, expected one of {sorted(Routes.__dataclass_fields__)}")
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if k == "argmax_chunk" else 0):
            raise ValueError(f"routes: {k} must be an int >= {1 if k == 'argmax_chunk' else 0}, got {v!r}")
    before, _ROUTES[0] = _ROUTES[0], replace(_ROUTES[0], **changes)
    try:
        yield
    finally:
        _ROUTES[0] = before


def _max_and_first_argmax(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s.amax(-1), s.argmax(-1)) of s [N, V], the argmax exact wherever the maximum is a
    number (rows holding a NaN get some index).  torch's argmax is a scalar loop on CPU, about
    ten times slower than its vectorised amax; so: the maximum of each chunk of Routes.argmax_chunk
    tokens (vectorised), the first chunk whose maximum is the row's, and argmax within that
    chunk only.  The first index of the maximum overall lies in the first chunk holding it, so
    this is the first index of the maximum, as argmax (and -0.0 == +0.0 in both)."""
    N, V = s.shape
    if s.stride(-1) != 1:
        s = s.contiguous()
    C = _ROUTES[0].argmax_chunk
    nc = V // C
    Vm = nc * C
    chunks = s[:, :Vm].view(N, nc, C) if nc else None  # a view: the rows' last dim is dense
    tail = s[:, Vm:] if Vm < V else None
    parts = ([chunks.amax(-1)] if nc else []) + ([tail.amax(-1, keepdim=True)] if tail is not None else [])
    gmax = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # [N, chunks (+ tail)]
    m = gmax.amax(-1)  # [N]
    g = (gmax == m[:, None]).int().argmax(-1)  # the first chunk holding the maximum
    idx = None
    if nc:
        gc = g.clamp(max=nc - 1)
        rows = chunks.gather(1, gc[:, None, None].expand(N, 1, C))[:, 0]  # [N, C]
        idx = gc * C + rows.argmax(-1)
    if tail is not None:
        in_tail = Vm + tail.argmax(-1)
        idx = in_tail if idx is None else torch.where(g == nc, in_tail, idx)
    return m, idx


def _verify_greedy(a: _Args) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` when every row is greedy, without the work greedy rows discard.

    At temperature 0 the reference uses, per position, only s = logits.float() (scaled by
    1 / T = 1, an exact no-op), its argmax (first index of the maximum) and whether the
    position is usable; p, q, top-k/top-p, the uniforms and the final draw only reach rows that
    sample.  top-k/top-p still matter through their range checks (``bad_param``), which are
    repeated here.  Usable positions: no NaN, no +inf, not all -inf, i.e. a finite maximum
    (``amax`` propagates NaN; it is +inf if any +inf, -inf only if all are -inf).  The rest is
    the reference's own code for the stop position j and the outputs, so it is bit-identical
    to it (tests: test_verify_greedy_fast_path.py).
    """
    logits = a.target_logits
    B, K1, V = logits.shape
    K = K1 - 1
    kb = a.num_draft_tokens.to(torch.int64)
    # Maxima and their first indices in the logits' own dtype: a bf16/fp16 -> fp32 conversion
    # is exact and monotone, so both are those of the reference's s = logits.float().
    m, argmax = _max_and_first_argmax(logits.reshape(B * K1, V))
    if B * K1 <= _ROUTES[0].host_greedy_max and host_readable(logits):
        # (CPU only: reading device tensors on the host would be a sync per call)
        return _greedy_host(a, m, argmax, B, K, V)
    _, bad_param, _ = row_parameters(kb, a.temperature, a.top_k, a.top_p, K, a.min_p)
    argmax = argmax.view(B, K1)  # [B, K+1]: first index of the maximum, as the reference
    bad_pos = ~torch.isfinite(m).view(B, K1)  # [B, K+1]

    x = a.draft_tokens.to(torch.int64)  # [B, K]
    bad_x = (x < 0) | (x >= V)  # a greedy row checks only the draft id, never q
    accept = x == argmax[:, :K]
    j, _, bad_row = stop_position(accept, bad_x, bad_pos, bad_param, kb)
    final = argmax.gather(1, j[:, None])[:, 0]
    return verify_outputs(x, j, final, bad_row)


def _greedy_host(a: _Args, m: torch.Tensor, argmax: torch.Tensor, B: int, K: int, V: int):
    """The rest of ``_verify_greedy`` for a small CPU batch, row by row in Python: the same
    decisions as ``row_parameters`` (its checks that can fail here: every temperature is 0 on
    this route, ``_all_greedy``), ``stop_position`` and ``verify_outputs``, so the same outputs (the
    tests compare both with the reference)."""
    K1 = K + 1
    kb = a.num_draft_tokens.tolist()
    x = a.draft_tokens.tolist()
    am = argmax.view(B, K1).tolist()
    fin = torch.isfinite(m).view(B, K1).tolist()  # usable position: a finite maximum
    top_k = a.top_k.tolist() if a.top_k is not None else None
    top_p = a.top_p.tolist() if a.top_p is not None else None
    min_p = a.min_p.tolist() if a.min_p is not None else None
    tokens = [[-1] * K1 for _ in range(B)]
    num = [-1] * B
    for b in range(B):
        k_b = kb[b]
        bad_param = k_b < 0 or k_b > K
        if top_k is not None:
            bad_param |= top_k[b] < 0
        if top_p is not None:
            bad_param |= not (top_p[b] > 0) or top_p[b] > 1
        if min_p is not None:
            bad_param |= not (min_p[b] >= 0) or min_p[b] > 1
        xb, ab, fb = x[b], am[b], fin[b]
        bad_x = [not 0 <= v < V for v in xb]
        j = 0
        while j < K and j < k_b and xb[j] == ab[j] and fb[j] and not bad_x[j]:
            j += 1
        rejected = j < k_b
        bad_row = bad_param or not fb[j] or (rejected and K > 0 and bad_x[min(j, K - 1)])
        if bad_row:
            continue
        tokens[b][:j] = xb[:j]
        tokens[b][j] = ab[j]
        num[b] = j
    dev = a.target_logits.device
    return (torch.tensor(tokens, dtype=torch.int64, device=dev).view(B, K1),
            torch.tensor(num, dtype=torch.int64, device=dev))


def _verify_untruncated(a: _Args, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` when no row has top-k or top-p (``_verify_sampled``)."""
    return _verify_sampled(a, u, warped=False)


def _verify_warped(a: _Args, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` with top-k / top-p / min-p rows (``_verify_sampled``)."""
    return _verify_sampled(a, u, warped=True)


def _verify_sampled(a: _Args, u: torch.Tensor, warped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_reference`` when not every row is greedy, with fewer passes over the [B, K+1, V]
    logits; bit-identical to it (tests: test_verify_sampling_fast_path.py).

    Without a warp the keep mask is all true, so the reference's masked max, masked exp and
    ``where`` are plain ``amax`` and ``exp``; its three scans for unusable positions (a NaN, a +inf,
    all -inf) are one test of the maximum (``amax`` propagates NaN; it is +inf if any +inf, -inf
    only if all are -inf); its argmax comes with the maximum (``_max_and_first_argmax``); and
    p = e / sum(e) is divided out only where it is read: at the drafts (p(x_i)) and at the stop
    position (p_j), which are the same quotients e / sum(e) the reference gathers.  The sums are
    the same reductions over the same [B, K+1, V] tensor.  The rest (stop position, residual,
    final draw, outputs) is the reference's own code.

    With a warp (``warped``), the keep mask is the reference's own ``warp_logits`` (through
    NumPy's sort), and e is zeroed outside it, as the reference's ``where``.  The maximum stays
    the unmasked one: top-k keeps every token >= the k-th largest, top-p at least the most
    likely ones and min-p every token >= fl32(m + ln(min_p)) <= m, so at a usable position (no
    NaN or +inf, not all -inf) the maximum is kept and the masked maximum is the same number; at
    an unusable position the row is invalid as soon as the position is reached, and its values
    are never read.  The reference's scans for unusable positions are over the unmasked s too.
    """
    logits = a.target_logits
    B, K1, V = logits.shape
    K = K1 - 1
    kb = a.num_draft_tokens.to(torch.int64)
    greedy, bad_param, inv_t = row_parameters(kb, a.temperature, a.top_k, a.top_p, K, a.min_p)
    keep = None
    if warped:
        s, keep = warp_logits(logits, inv_t[:, None].expand(B, K1), per_position(a.top_k, K1),
                              per_position(a.top_p, K1), sort_descending_cpu,
                              min_p=per_position(a.min_p, K1))  # s fresh, keep [B, K+1, V] bool
    else:
        s = logits.float() * inv_t[:, None].expand(B, K1)[..., None]  # [B, K+1, V], as warp_logits
    m, argmax = _max_and_first_argmax(s.reshape(B * K1, V))  # a copy only for permuted logits
    m = m.view(B, K1, 1)
    argmax = argmax.view(B, K1)
    bad_pos = ~torch.isfinite(m[..., 0])  # [B, K+1]
    # In place: s is a fresh tensor read no more.  Each [B, K+1, V] temporary not allocated is
    # one fewer fresh block from malloc, whose page faults can cost more than the arithmetic
    # (docs/history/measurements.md).
    e = s.sub_(m).exp_()  # [B, K+1, V]
    if keep is not None:
        e.masked_fill_(~keep, 0.0)  # the reference's where(keep, exp(s - m), 0)
    total = e.sum(-1, keepdim=True)  # [B, K+1, 1]

    x, x_safe, q_x, bad_x = drafts(a.draft_tokens, a.draft_probs, greedy, V)
    p_x = e[:, :K].gather(-1, x_safe[..., None])[..., 0] / total[:, :K, 0]  # [B, K]
    # The acceptance rule through the reference's module, so that a mutant of it (the tests'
    # monkeypatched chain_reference.acceptance_test) reaches this route too.
    accept = torch.where(greedy[:, None], x == argmax[:, :K], _chain.acceptance_test(u[:, :K], p_x, q_x))  # [B, K]
    j, rejected, bad_row = stop_position(accept, bad_x, bad_pos, bad_param, kb)
    p_j = e.gather(1, j[:, None, None].expand(B, 1, V))[:, 0].div_(total.gather(1, j[:, None, None])[:, 0])  # [B, V]
    final, bad_row = _final_token_rows(p_j, x_safe, a.draft_probs, j, rejected, bad_row, greedy, argmax, u[:, K])
    return verify_outputs(x, j, final, bad_row)



def _final_token_rows(p_j, x_safe, draft_probs, j, rejected, bad_row, greedy, argmax, u_final):
    """``verify.reference.chain.final_token`` (same arguments, the same tokens and bad_row) on the CPU, one row
    at a time (few rows, or a large vocabulary), so that a row pays only for what it uses: a greedy row nothing, a
    bonus row one cumulative sum, a rejected row its residual and one cumulative sum, where the
    batched reference makes about fifteen passes over [B, V] for every row.  The inverse CDF is the reference's: the
    first v with cumsum(w)[v] > u * sum(w), found by binary search in the float64 cumsum (a sequential sum of
    non-negative weights, so non-decreasing, and flat exactly where w[v] = 0: the first index past the target
    has w > 0, as the reference requires); the last positive weight if none."""
    B, V = p_j.shape
    r = _ROUTES[0]
    if (B > r.row_draw_max and V < r.row_draw_min_v) or not host_readable(p_j):  # it reads values on the host
        return final_token(p_j, x_safe, draft_probs, j, rejected, bad_row, greedy, argmax, u_final)
    K = x_safe.shape[1]
    j_h, rej, gr, u = j.tolist(), rejected.tolist(), greedy.tolist(), u_final.tolist()
    final = argmax.gather(1, j[:, None])[:, 0].tolist()  # greedy rows keep it
    bad = bad_row.tolist()
    for b in range(B):
        if gr[b]:
            continue
        p = p_j[b]  # [V] fp32
        w = None
        if rej[b]:  # K > 0 here: j < K_b <= K
            jq = min(j_h[b], K - 1)
            if draft_probs is None:  # q one-hot at the rejected draft
                r = p.clamp(min=0.0)  # p - 0 elsewhere, as the reference's p - q_j
                x = int(x_safe[b, jq])
                r[x] = (p[x] - 1.0).clamp(min=0.0)
            else:
                q = draft_probs[b, jq].float()  # [Vd]
                Vd = q.shape[0]
                if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
                    bad[b] = True
                r = p.clamp(min=0.0)
                torch.sub(p[:Vd], q, out=r[:Vd]).clamp_(min=0.0)  # (p - q).clamp(min=0), no temporaries
            w = r.nan_to_num_(nan=0.0)
            cdf = torch.cumsum(w, 0, dtype=torch.float64)  # = cumsum(w.double()), bit for bit
            if not cdf[-1] > 0:  # the residual sums to zero: p itself
                w = None
        if w is None:
            w = torch.nan_to_num(p, nan=0.0)
            cdf = torch.cumsum(w, 0, dtype=torch.float64)
            if not cdf[-1] > 0:  # only invalid rows: a dummy draw, discarded by verify_outputs
                w = torch.ones_like(p)
                cdf = torch.cumsum(w, 0, dtype=torch.float64)
        target = u[b] * float(cdf[-1])
        idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
        if idx >= V:
            pos = (w > 0).nonzero()
            idx = int(pos[-1, 0]) if len(pos) else -1
        final[b] = idx
    dev = p_j.device
    return torch.tensor(final, dtype=torch.int64, device=dev), torch.tensor(bad, dtype=torch.bool, device=dev)


# Up to this many Philox evaluations (B * (K+1)) the CPU path draws them in Python ints
# (``verify.reference.philox.philox_uniforms_host``) rather than with ~360 elementwise tensor ops,
# whose fixed cost is larger for so few (docs/history/measurements.md); the two give the same values.
_HOST_PHILOX_MAX = 128


def _uniforms(a: _Args, K: int) -> torch.Tensor:
    if a.uniforms is not None:
        return a.uniforms
    if (host_readable(a.seed)
            and a.seed.shape[0] * (K + 1) <= _HOST_PHILOX_MAX):
        return philox_uniforms_host(a.seed.tolist(), a.offset.tolist(), K)  # CPU: no device sync
    return philox_uniforms(a.seed, a.offset, K)


def _run_torch(a: _Args) -> tuple[torch.Tensor, torch.Tensor]:
    if _all_greedy(a):
        return _verify_greedy(a)
    K = a.target_logits.shape[1] - 1
    u = _uniforms(a, K)
    if a.target_logits.shape[0] == 0:
        return verify_reference(a.target_logits, a.draft_tokens, a.draft_probs, a.num_draft_tokens,
                                a.temperature, a.top_k, a.top_p, u, min_p=a.min_p)
    if a.top_k is None and a.top_p is None and a.min_p is None:
        return _verify_untruncated(a, u)
    return _verify_warped(a, u)


def _pad_packed(a: _Args, lay: _Layout) -> _Args:
    """Packed arguments in the padded layout, for the torch path (CPU): one gather of the logits
    (positions past a row's K_b repeat its bonus position and its drafts are another row's; no
    padded step reads either)."""
    cu = lay.cu.to(torch.int64)
    B, K = lay.B, lay.K
    dev = a.target_logits.device
    kb = cu[1:] - cu[:-1]  # [B]
    i = torch.arange(K + 1, device=dev)
    rows = (cu[:-1] + torch.arange(B, device=dev))[:, None] + torch.minimum(i[None, :], kb[:, None])  # [B, K+1]
    logits = a.target_logits[rows]  # [B, K+1, V]
    nd = a.draft_tokens.shape[0]
    if nd:
        d = (cu[:-1, None] + i[None, :K]).clamp(max=nd - 1)  # [B, K]
        x = a.draft_tokens[d]
        q = None if a.draft_probs is None else a.draft_probs[d]  # [B, K, Vd]
    else:
        x = a.draft_tokens.new_zeros((B, K))
        q = None if a.draft_probs is None else a.draft_probs.new_zeros((B, K, a.draft_probs.shape[-1]))
    return a._replace(target_logits=logits, draft_tokens=x, draft_probs=q, num_draft_tokens=kb)


def _run_torch_layout(a: _Args, lay: _Layout):
    """The torch path of a call with a layout: (tokens, num_accepted, logprobs or None), written
    into ``lay.out`` when given."""
    if lay.cu is not None:
        a = _pad_packed(a, lay)
    a = _materialize(a)
    with torch.no_grad():
        if lay.draft_logits and a.draft_probs is not None:
            # q = softmax(l / T) with each row's 1 / T (the reference's own function: a mutant of
            # it reaches this path too), then the draft_probs computation
            _, _, inv_t = row_parameters(a.num_draft_tokens, a.temperature, a.top_k, a.top_p, lay.K, a.min_p)
            a = a._replace(draft_probs=_chain.draft_softmax(a.draft_probs, inv_t))
        if lay.block and not _all_greedy(a):  # (greedy rows: block verification is token verification)
            u = _uniforms(a, lay.K)
            tokens, num = _block.block_verify_reference(
                a.target_logits, a.draft_tokens, a.draft_probs, a.num_draft_tokens, a.temperature, a.top_k,
                a.top_p, u, sort_descending=sort_descending_cpu, target_is_probs=lay.probs, min_p=a.min_p)
        elif lay.probs:
            u = _uniforms(a, lay.K)
            tokens, num = verify_reference(a.target_logits, a.draft_tokens, a.draft_probs, a.num_draft_tokens,
                                           a.temperature, None, None, u, target_is_probs=True)
        else:
            tokens, num = _run_torch(a)
        lp = None
        if lay.logprobs:
            lp = _chain.emitted_logprobs(a.target_logits, tokens, num, a.temperature, a.top_k, a.top_p,
                                       target_is_probs=lay.probs, sort_descending=sort_descending_cpu,
                                       min_p=a.min_p)
    if lay.out is None:
        return tokens, num, lp
    outs = (tokens, num, lp)[:len(lay.out)]
    for dst, src in zip(lay.out, outs):
        dst.copy_(src)
    return tuple(lay.out) + ((None,) if len(lay.out) == 2 else ())
