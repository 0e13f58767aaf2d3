"""The warp of the target's logits: temperature, then top-k, top-p and min-p (``warp_logits``).

min-p's threshold is computed by fixed float64 steps (``min_p_log``, ``min_p_threshold``) that the
Triton kernels repeat one for one, so every backend keeps the same tokens; ``order_key`` is the
float-to-int32 map the kernels compare scaled logits with; ``_target_probs`` turns a warp's scaled
logits and mask into the target distribution p.
"""

from __future__ import annotations

import torch

__all__ = ["LN2", "LOG_SERIES", "SQRT2", "min_p_log", "min_p_threshold", "order_key", "warp_logits"]


def order_key(x: torch.Tensor) -> torch.Tensor:
    """Map fp32 to int32 so that integer order equals float order (-0.0 taken as +0.0)."""
    bits = (x + 0.0).contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def torch_sort_descending(s: torch.Tensor) -> torch.Tensor:
    return torch.sort(s, dim=-1, descending=True).values


# ln(f) = 2 atanh(z), z = (f - 1) / (f + 1): the series' coefficients 2 / (2k + 1), k = 0..11, for
# |z| <= (sqrt(2) - 1) / (sqrt(2) + 1) (f in [sqrt(2) / 2, sqrt(2)]), where the first omitted term
# is below 2^-60 of the sum.  The Triton kernel holds the same constants (``verify.triton.candidates``).
LOG_SERIES = tuple(2.0 / (2 * k + 1) for k in range(12))
LN2 = 0.6931471805599453  # ln 2 rounded to float64
SQRT2 = 1.4142135623730951  # sqrt(2) rounded to float64


def min_p_log(min_p: torch.Tensor) -> torch.Tensor:
    """L = fl32(ln(min_p)) [...] fp32 of min_p [...] in (0, 1] (fp32 values), by a fixed sequence
    of float64 IEEE operations that the Triton kernel repeats step for step (its fused multiply-
    adds are off), so that every backend gets the same bits: min_p = f * 2^e (f in [1, 2), halved
    above sqrt(2)), ln(min_p) = e * ln 2 + 2 atanh((f - 1) / (f + 1)), the series summed by
    Horner's rule, then rounded once to fp32.  Within a few float64 ulps of ln(min_p), so L is
    fl32(ln(min_p)) but for values within ~2^-50 of a rounding boundary of fp32.  min_p = 1 gives
    exactly 0; min_p = 2^-j gives fl32(-j * LN2), the product rounded in float64 first."""
    x = min_p.double()
    bits = x.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023  # the exponent (an fp32 value is normal in float64)
    f = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # the significand, in [1, 2)
    big = f > SQRT2
    f = torch.where(big, f * 0.5, f)  # exact
    e = torch.where(big, e + 1, e).double()
    z = (f - 1.0) / (f + 1.0)
    w = z * z
    acc = torch.full_like(w, LOG_SERIES[-1])
    for c in LOG_SERIES[-2::-1]:
        acc = acc * w + c  # two roundings (no fused multiply-add), as in the kernel
    return (e * LN2 + z * acc).float()


def min_p_threshold(m: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The smallest scaled logit min-p keeps: T = fl32(m + L), L = ``min_p_log(min_p)`` = fl32(ln
    min_p), [...] fp32.  m [...] fp32: the position's largest scaled logit; min_p [...] fp32 in (0,
    1].  One fp32 addition (one IEEE rounding), as in the kernel.  min-p keeps token v iff s_v >= T."""
    return m.float() + min_p_log(min_p)


def warp_logits(
    logits: torch.Tensor,  # [..., V] any float dtype
    inv_temperature: torch.Tensor,  # [...] fp32: 1 / temperature
    top_k: torch.Tensor | None,  # [...] int, 0 = off
    top_p: torch.Tensor | None,  # [...] fp32, >= 1 = off
    sort_descending=torch_sort_descending,
    *,
    min_p: torch.Tensor | None = None,  # [...] fp32 in [0, 1], 0 = off
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits s = logits * (1 / T) and the mask of the tokens the warp keeps.

    top-k keeps every token whose s is >= the k-th largest s (ties at the boundary are all
    kept; k >= V keeps all).  top-p then keeps token v iff the probability mass, renormalised
    over the top-k set, of the tokens with s strictly greater than s_v is < top_p: the smallest
    set of most likely tokens whose mass reaches top_p, with ties kept together.
    min-p (after temperature, top-k and top-p: transformers' order, ``GenerationMixin.
    _get_logits_processor`` appends ``MinPLogitsWarper`` after ``TopKLogitsWarper`` and
    ``TopPLogitsWarper``) keeps token v iff p(v) >= min_p * max_w p(w), i.e. exp(s_v - m) >=
    min_p with m = max_w s_w (the ratio does not depend on the renormalisation by top-k/top-p,
    whose kept sets hold the maximum), evaluated exactly as

        s_v >= T,   T = fl32(m + L),   L = fl32(ln(min_p))   (``min_p_threshold``, ``min_p_log``:
                                                        ln in float64 by fixed IEEE steps)

    so a set of tied values is kept or dropped whole, min_p = 1 keeps the maximum and its ties
    only (T = m), and min_p = 0 is off (nothing is applied, bit for bit the call without it).  The
    kept set is an upper set of s holding the maximum, so it intersects the top-k/top-p set (a
    higher threshold); top-p's mass is over the top-k set, not over the min-p set.  A position
    whose maximum is not finite (NaN, +inf, all -inf: unusable anyway) is not min-p filtered.
    ``sort_descending`` sorts s's last dimension (torch's sort; the CPU path passes
    ``host.sort_descending_cpu``, the same values faster); min-p alone needs no sort.
    Returns (s [..., V] fp32, keep [..., V] bool).
    """
    s = logits.float() * inv_temperature[..., None]
    keep = torch.ones_like(s, dtype=torch.bool)
    if top_k is not None or top_p is not None:
        keep = _warp_top_k_top_p(s, top_k, top_p, sort_descending)
    if min_p is not None:
        m = s.amax(-1)  # [...]
        active = (min_p > 0) & (min_p <= 1) & torch.isfinite(m)  # out of range: an invalid row
        T = min_p_threshold(m, min_p.float().masked_fill(~active, 1.0))
        keep = keep & (~active[..., None] | (s >= T[..., None]))
    return s, keep


def _warp_top_k_top_p(s: torch.Tensor, top_k, top_p, sort_descending) -> torch.Tensor:
    """``warp_logits``'s top-k then top-p mask of the scaled logits s [..., V]."""
    V = s.shape[-1]
    keep = torch.ones_like(s, dtype=torch.bool)
    s_sorted = sort_descending(s)  # [..., V]
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > V), V, k)
        kth = s_sorted.gather(-1, (k - 1)[..., None])  # [..., 1]
        keep = s >= kth
    if top_p is not None:
        kept_lo = (s if top_k is None else s.masked_fill(~keep, float("inf"))).amin(-1, keepdim=True)
        kept_sorted = s_sorted >= kept_lo
        m = s_sorted[..., :1]
        # In place on one fresh buffer: exp(s_sorted - m) where kept, else 0, then the mass
        # before each token (on the CPU each fresh [..., V] temporary costs malloc's page faults).
        e = torch.sub(s_sorted, m).exp_().masked_fill_(~kept_sorted, 0.0)  # [..., V]
        csum = torch.cumsum(e, dim=-1)
        mass_before = torch.sub(csum, e, out=e)  # mass of the tokens sorted ahead of this one
        p_lim = top_p.float()[..., None] * csum[..., -1:]
        n_keep = (mass_before < p_lim).sum(-1, keepdim=True)  # >= 1: mass_before[0] = 0
        # ... except where the mass is NaN (a NaN, +inf or all--inf position: its row is marked
        # invalid anyway); the clamp keeps the gather in range there.
        cut = s_sorted.gather(-1, (n_keep - 1).clamp(min=0))  # the smallest kept value
        active = (top_p < 1.0)[..., None]
        keep = keep & (~active | (s >= cut))
    return keep


def _target_probs(s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """p = exp(s - max) / sum over the kept tokens; 0 elsewhere.  [..., V] fp32."""
    m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    e = torch.where(keep, torch.exp(s - m), 0.0)
    return e / e.sum(-1, keepdim=True)


def mask_target(target_logits: torch.Tensor, token_bitmask: torch.Tensor | None,
                target_is_probs: bool = False) -> torch.Tensor:
    """A grammar's mask, the first warp (``ops/verify/bitmask.py``): token_bitmask [..., W] int32,
    bit v % 32 of word v // 32 set when token v is allowed; a forbidden token's logit becomes -inf
    (a probability 0).  None: the logits as they are."""
    if token_bitmask is None:
        return target_logits
    V = target_logits.shape[-1]
    bits = (token_bitmask.to(torch.int64)[..., None] >> torch.arange(32, device=token_bitmask.device)) & 1
    allowed = bits.flatten(-2)[..., :V].bool()  # [..., 32 W] -> [..., V]
    return torch.where(allowed, target_logits, torch.zeros((), dtype=target_logits.dtype) if target_is_probs
                       else torch.full((), float("-inf"), dtype=target_logits.dtype))

