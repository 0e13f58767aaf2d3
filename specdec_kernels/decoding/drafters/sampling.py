"""How a draft samples: the warp (temperature, top-k, top-p) and counter-based random numbers.

``warp_probs`` is the distribution a draft samples from, with the verifier's semantics (the
verifier applies the same warp to the target inside ``fused_verify``).  The draft's random
numbers are hashes of (a key derived from the row's seed, the row's step, the draft position):
no generator state, so a row's drafts never depend on the other rows of a batch, and they are
independent of the verifier's Philox stream.  ``_sample_inverse_cdf`` turns one uniform (53
bits) into a token by inverse CDF in float64 (no ``torch.multinomial``), so that the token is
drawn from the q the verifier is told, not from its fp32 rounding.
"""

from __future__ import annotations

from typing import Union

import torch

from ...ops.host import host_readable, sort_descending_cpu
from ...ops.reference import inverse_cdf, uint53_to_uniform

__all__ = ["warp_probs"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


# ----------------------------------------------------------------------------------------------
# The warp, for the draft's sampling (the verifier applies the same warp to the target)
# ----------------------------------------------------------------------------------------------
def _per_row_param(value, batch_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(batch_shape)
    return torch.full(batch_shape, value, dtype=dtype, device=device)


def warp_probs(
    logits: torch.Tensor,  # [..., V] any float dtype
    temperature: Union[float, torch.Tensor],  # float or [...]: 0 = greedy
    top_k: Union[int, torch.Tensor, None] = None,  # int or [...]: 0 or >= V = off
    top_p: Union[float, torch.Tensor, None] = None,  # float or [...]: 1.0 = off
    *,
    min_p: Union[float, torch.Tensor, None] = None,  # float or [...] in [0, 1]: 0 = off
) -> torch.Tensor:
    """The distribution a row samples from: [..., V] fp32, rows sum to 1.

    s = logits.float() * (1 / temperature).  top-k keeps every token with s >= the k-th
    largest s (ties at the boundary all kept).  top-p then keeps token v iff the probability
    mass, renormalised over the top-k set, of the tokens with s strictly greater than s_v is
    < top_p (the smallest set of most likely tokens reaching top_p, ties kept together).
    min-p then keeps token v iff s_v >= fl32(m + fl32(ln min_p)), m the largest s
    (``reference.min_p_threshold``, the verifier's rule).
    p = exp(s - max) over the kept tokens, normalised.  Temperature 0 is greedy: one-hot at
    the argmax of the logits (the lowest index on ties).  These are the verifier's semantics.
    """
    s0 = logits.float()  # [..., V]
    V = s0.shape[-1]
    bshape = s0.shape[:-1]
    temp = _per_row_param(temperature, bshape, torch.float32, s0.device)  # [...]
    greedy = temp == 0
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(temp), temp)  # fp32 division, as the verifier
    s = s0 * inv_t[..., None]  # [..., V]
    keep = torch.ones_like(s, dtype=torch.bool)
    if top_k is not None or top_p is not None:
        s_sorted = sort_descending_cpu(s)  # [..., V] (torch's sort off the CPU)
        if top_k is not None:
            k = _per_row_param(top_k, bshape, torch.int64, s0.device)
            k = torch.where((k <= 0) | (k > V), V, k)
            kth = s_sorted.gather(-1, (k - 1)[..., None])  # [..., 1]: the k-th largest
            keep = s >= kth
        if top_p is not None:
            p_lim = _per_row_param(top_p, bshape, torch.float32, s0.device)  # [...]
            in_k = s_sorted >= s.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)
            e = torch.where(in_k, torch.exp(s_sorted - s_sorted[..., :1]), 0.0)  # [..., V]
            csum = torch.cumsum(e, dim=-1)
            # Mass ahead of each sorted token; at the first token of a tie group that is the
            # mass of the strictly greater tokens, and it only grows along the sorted order.
            before = csum - e
            n_keep = (before < p_lim[..., None] * csum[..., -1:]).sum(-1, keepdim=True)  # >= 1
            cut = s_sorted.gather(-1, (n_keep - 1).clamp(min=0))  # smallest kept value; ties kept
            keep = keep & ((p_lim >= 1.0)[..., None] | (s >= cut))
    if min_p is not None:
        from ...ops.reference import min_p_threshold

        mp = _per_row_param(min_p, bshape, torch.float32, s0.device)  # [...]
        m = s.amax(-1)  # [...]: the maximum is in every kept set
        active = (mp > 0) & (mp <= 1) & torch.isfinite(m)
        T = min_p_threshold(m, mp.masked_fill(~active, 1.0))
        keep = keep & (~active[..., None] | (s >= T[..., None]))
    m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    e = torch.where(keep, torch.exp(s - m), 0.0)
    probs = e / e.sum(-1, keepdim=True)
    if not isinstance(temperature, torch.Tensor) and temperature != 0:
        return probs  # no greedy row: the one-hot below would not be taken
    one_hot = torch.zeros_like(probs).scatter_(-1, s0.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[..., None], one_hot, probs)


# ----------------------------------------------------------------------------------------------
# Counter-based random numbers for the draft (no generator state; batch-invariant)
# ----------------------------------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without int64 overflow."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draft_key(seed: int) -> tuple[int, int]:
    """The draft's (lo, hi) 32-bit key for a row seed: a different stream from the verifier's
    Philox key (seed itself), so the draft's and the verifier's numbers are independent."""
    k = _splitmix64(seed & _MASK64)
    return k & _MASK32, k >> 32


def _draft_hash(key_lo: torch.Tensor, key_hi: torch.Tensor, step: torch.Tensor, c) -> torch.Tensor:
    """32-bit hashes (in int64) of (the row's key, its step, a counter c): key_lo, key_hi, step
    [B] (or [B, 1]) and c an int (or [1, C] int64) broadcast together."""
    h = _fmix32(key_lo ^ (step & _MASK32))
    h = _fmix32(h ^ key_hi)
    h = _fmix32(h ^ ((c * 0x9E3779B9 + 0x7F4A7C15) & _MASK32))
    return _fmix32(h ^ key_lo)


# Up to this many rows the CPU computes the draft's hashes in Python ints (a few microseconds a
# row) rather than with ~120 elementwise tensor ops (~0.15 ms whatever the batch); the two give
# the same values (tested).
_HOST_HASH_MAX = 64


def _fmix32_int(h: int) -> int:
    """``_fmix32`` in Python ints."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _draft_hash_int(key_lo: int, key_hi: int, step: int, c: int) -> int:
    """``_draft_hash`` for one row in Python ints."""
    h = _fmix32_int(key_lo ^ (step & _MASK32))
    h = _fmix32_int(h ^ key_hi)
    h = _fmix32_int(h ^ ((c * 0x9E3779B9 + 0x7F4A7C15) & _MASK32))
    return _fmix32_int(h ^ key_lo)


def _draft_uniforms(key_lo: torch.Tensor, key_hi: torch.Tensor, step: torch.Tensor, j: int) -> torch.Tensor:
    """[B] float64 uniforms in [0, 1) for draft position j of each row's step: 53 random bits
    (27 from one hash, 26 from another), multiples of 2^-53 (``_draft_uniforms_k``'s column j).

    53 bits rather than fp32's 24: with a 24-bit uniform and an fp32 CDF, a token whose
    probability is below ~2^-24 is drawn with probability 0 or 2^-24 instead of q (the whole
    tail of a 49,152-token softmax: a total variation of ~4.5e-4 between what was drawn and the
    q the verifier is told), and speculative sampling is exact only if the draft was drawn from
    the q it reports."""
    return _draft_uniforms_k(key_lo, key_hi, step, 1, start=j)[:, 0]


def _draft_uniforms_k(key_lo: torch.Tensor, key_hi: torch.Tensor, step: torch.Tensor, P: int,
                      start: int = 0) -> torch.Tensor:
    """[B, P] float64 uniforms of draft positions start .. start + P - 1 of each row's step, all
    at once: one set of elementwise ops for the step instead of one per position (on a GPU each
    op is a kernel launch; the counters come from ``arange`` on the device, not a host-to-device
    copy, which would wait for the stream), or Python ints on the CPU for small batches."""
    js = range(start, start + P)
    if host_readable(key_lo) and key_lo.numel() <= _HOST_HASH_MAX:
        lo, hi, st = key_lo.tolist(), key_hi.tolist(), step.tolist()  # CPU tensors: no device sync
        a = [[_draft_hash_int(x, y, s, 2 * j) for j in js] for x, y, s in zip(lo, hi, st)]
        b = [[_draft_hash_int(x, y, s, 2 * j + 1) for j in js] for x, y, s in zip(lo, hi, st)]
        shape = (len(lo), len(js))
        return uint53_to_uniform(torch.tensor(a, dtype=torch.int64).reshape(shape),
                                  torch.tensor(b, dtype=torch.int64).reshape(shape))
    even = 2 * (start + torch.arange(P, dtype=torch.int64, device=key_lo.device))  # [P]: counters 2j
    c = torch.cat([even, even + 1])[None, :]  # [1, 2P]: 2j, then 2j + 1
    h = _draft_hash(key_lo[:, None], key_hi[:, None], step[:, None], c)  # [B, 2P]
    return uint53_to_uniform(h[:, :P], h[:, P:])


def _sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first v with p[v] > 0 and cumsum(p)[v] > u * sum(p), the sums in float64 (never a
    zero-probability token; the last token with p > 0 if rounding leaves none; 0 for a row
    without a distribution): the verifier's own inverse CDF, ``reference.inverse_cdf``.
    probs [B, V] fp32 (or float64), u [B] float64 -> [B] int64.

    In float64 each addition rounds by ~2^-53 of the running sum, so token v is drawn with
    probability q_v / sum(q) to within ~2^-53 of the total (with ``_draft_uniforms``' 53-bit
    grid)."""
    return inverse_cdf(probs, u).clamp(min=0)  # the verifier's own sampler (0 for a NaN row)
