"""Pure-PyTorch references for every op of the package, with their random numbers passed in.

These are the ground truth of the tests, the baseline of the benchmarks, and the CPU path of
``fused_verify``.  They are written plainly: vectorised over the batch and the draft positions,
but with no tricks beyond what the maths says.

Terms, used the same way everywhere (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"):

- *target distribution* p_i: softmax of the target's logits at verify position i, after
  temperature, top-k, top-p and min-p (the "warp"). Tokens removed by the warp have p = 0.
- *draft distribution* q_i: the distribution the drafter sampled x_i from (one-hot for a
  deterministic drafter; zero beyond the draft vocabulary).
- *accepted*: draft x_i is accepted when ``u_i * q_i(x_i) < p_i(x_i)``, i.e. with probability
  min(1, p_i(x_i) / q_i(x_i)), written without a division.
- *recovered* token: at the first rejection i, a token drawn from the *residual*
  norm(max(0, p_i - q_i)); from p_i itself if the residual sums to zero in floating point.
- *bonus* token: drawn from p_{K_b} when row b accepted all K_b of its drafts.
- *invalid* row: a value the row needs is not usable (a NaN or +inf logit, a position whose
  logits are all -inf, a NaN/inf/negative draft probability, a draft token outside [0, V), a
  bad per-row parameter). It emits nothing: ``num_accepted = -1`` and ``tokens`` all -1.

Random numbers: ``uniforms`` is [B, K+1] float64 (or fp32) in [0, 1); ``uniforms[b, i]``
(i < K) is the acceptance test of draft i and ``uniforms[b, K]`` drives the final inverse-CDF
draw (recovered or bonus).  ``philox_uniforms`` produces exactly the numbers the Triton kernel
draws itself: 24-bit fp32 values for the acceptance tests (``tl.rand``) and a 53-bit value for
the final draw.  The acceptance test and the final draw compute in float64: u * q(x) of an fp32
q is exact there, and the inverse CDF sums fp32 weights with a rounding of ~2^-53 of the running
sum per addition, so that a token of probability below fp32's resolution (~2^-24) is drawn with
its own probability to within ~2^-53 of the total, not with 0 or 2^-24 (a 53-bit uniform over an
fp32 cumulative sum would not be enough: the sum itself swallows such tokens).  In all, the
draw's total variation from the weights it is given is at most ~V * 2^-54 (3e-12 at V = 49,152).
"""

from __future__ import annotations

import torch

__all__ = [
    "compact_kv_reference",
    "gather_kv_reference",
    "draft_softmax",
    "order_key",
    "min_p_log",
    "min_p_threshold",
    "warp_logits",
    "verify_reference",
    "block_verify_reference",
    "philox_uniforms",
    "skinny_linear_reference",
]

_MASK32 = 0xFFFFFFFF
# The smallest positive temperature accepted: the smallest normal fp32 (2^-126).
FLT_MIN = 2.0 ** -126


# ----------------------------------------------------------------------------------------------
# Counter-based random numbers: the same Philox4x32-10 stream as triton.language.rand
# ----------------------------------------------------------------------------------------------
def _mulhilo32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for uint32 values held in int64 (no int64 overflow)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    mid = (a_hi * b_lo + a_lo * b_hi) * 65536 + a_lo * b_lo  # < 2**50
    hi = a_hi * b_hi + (mid >> 32)
    return hi & _MASK32, mid & _MASK32


def _philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox4x32 (Salmon et al. 2011) as triton.language.random.philox_impl computes it."""
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo32(c2, 0xCD9E8D57)
        hi_a, lo_a = _mulhilo32(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def _uint32_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """triton.language.random.uint_to_uniform_float for uint32: a float32 in [0, 1)."""
    x = torch.where(x >= 2**31, x - 2**32, x)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)  # ~x for negatives
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def _uint53_to_uniform(r0: torch.Tensor, r1: torch.Tensor) -> torch.Tensor:
    """Two uint32 words r0, r1 [...] (in int64) -> float64 uniforms [...] in [0, 1) on the 2^-53
    grid: 27 bits of r0 and 26 of r1, every value equally likely (the final draw's uniform, and
    the draft's, from its hashes)."""
    return ((r0 >> 5) * 67108864 + (r1 >> 6)).to(torch.float64) * (1.0 / 9007199254740992.0)


def _philox_r01_host(seed: int, offset: int, counter: int) -> tuple[int, int]:
    """The first two output words of ``_philox4x32`` for one (seed, offset, counter), in Python
    ints: the same uint32 arithmetic without a tensor op per step (for small batches on the host)."""
    c0, c1, c2, c3 = counter, offset & _MASK32, 0, 0
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        pb = c2 * 0xCD9E8D57
        pa = c0 * 0xD2511F53
        c0, c1, c2, c3 = ((pb >> 32) & _MASK32) ^ c1 ^ k0, pb & _MASK32, ((pa >> 32) & _MASK32) ^ c3 ^ k1, pa & _MASK32
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    return c0, c1


def _philox_uniforms_host(seed: list, offset: list, num_draft_slots: int) -> torch.Tensor:
    """``philox_uniforms`` computed in Python ints (seed, offset: lists of B ints in int64 range):
    the same [B, K+1] float64 values, for CPU batches small enough that ~360 tensor ops per call
    cost more than B * (K+1) Philox evaluations on the host."""
    K1 = num_draft_slots + 1
    counters = [i + 1 if i < num_draft_slots else 0 for i in range(K1)]
    words = torch.tensor([[_philox_r01_host(s, o, c) for c in counters] for s, o in zip(seed, offset)],
                         dtype=torch.int64).reshape(len(seed), K1, 2)  # [B, K+1, (r0, r1)]
    return _uniforms_from_words(words[..., 0], words[..., 1])


def _uniforms_from_words(r0: torch.Tensor, r1: torch.Tensor) -> torch.Tensor:
    """[B, K+1] Philox words (counters 1..K, then 0) -> the uniforms [B, K+1] float64: the
    acceptance tests' fp32 ``tl.rand`` values (of r0), the final draw's 53 bits (of r0 and r1)."""
    u = _uint32_to_uniform(r0).to(torch.float64)
    u[:, -1] = _uint53_to_uniform(r0[:, -1], r1[:, -1])
    return u


def philox_uniforms(seed: torch.Tensor, offset: torch.Tensor, num_draft_slots: int) -> torch.Tensor:
    """The uniforms fused_verify draws for (seed, offset): [B, K+1] float64 in [0, 1).

    Number i comes from Philox4x32-10 with counter (c, offset_b, 0, 0) and key seed_b (what
    ``tl.randint4x(seed_b, (offset_b << 32) | c)`` computes): counter c = i + 1 for the
    acceptance test of draft i, which is ``tl.rand``'s fp32 value of the first word, and c = 0
    for the final draw, whose 53 bits are 27 of the first word and 26 of the second.  So a row's
    numbers depend on its own seed and offset only, never on B, K or the other rows.
    """
    seed = seed.to(torch.int64)  # [B]
    offset = offset.to(torch.int64)  # [B]
    B = seed.shape[0]
    counter = torch.arange(num_draft_slots + 1, dtype=torch.int64, device=seed.device)
    counter = torch.where(counter == num_draft_slots, 0, counter + 1)  # final draw uses c = 0
    c0 = counter.expand(B, -1)
    c1 = (offset & _MASK32)[:, None].expand_as(c0)
    zero = torch.zeros_like(c0)
    k0 = (seed & _MASK32)[:, None].expand_as(c0)
    k1 = ((seed >> 32) & _MASK32)[:, None].expand_as(c0)
    r0, r1, _, _ = _philox4x32(c0, c1, zero, zero, k0, k1)
    return _uniforms_from_words(r0, r1)


# ----------------------------------------------------------------------------------------------
# The warp: temperature, top-k, top-p, min-p
# ----------------------------------------------------------------------------------------------
def order_key(x: torch.Tensor) -> torch.Tensor:
    """Map fp32 to int32 so that integer order equals float order (-0.0 taken as +0.0)."""
    bits = (x + 0.0).contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _torch_sort_descending(s: torch.Tensor) -> torch.Tensor:
    return torch.sort(s, dim=-1, descending=True).values


# ln(f) = 2 atanh(z), z = (f - 1) / (f + 1): the series' coefficients 2 / (2k + 1), k = 0..11, for
# |z| <= (sqrt(2) - 1) / (sqrt(2) + 1) (f in [sqrt(2) / 2, sqrt(2)]), where the first omitted term
# is below 2^-60 of the sum.  The Triton kernel holds the same constants (``_verify_split_kernel``).
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
    sort_descending=_torch_sort_descending,
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
    ``_host.sort_descending_cpu``, the same values faster); min-p alone needs no sort.
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


def draft_softmax(draft_logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """The draft distributions of ``draft_logits=``: q = softmax(draft_logits / T) per row, fp32.

    draft_logits [B, K, Vd] (any float dtype, read as fp32); inv_temperature [B] fp32, each row's
    1 / T (``_row_parameters``: the target's own, 1 for greedy and invalid rows).  Computed as
    the target's p: s = logits.float() * (1 / T), m = max s, e = exp(s - m), q = e / sum(e); no
    top-k/top-p (q is the law the draft sampled from).  A row holding a NaN or +inf scaled logit,
    or no finite one, gets q all NaN (an unusable draft distribution, as such a softmax gives):
    a sampling row that reads it is invalid.  -inf logits have q = 0."""
    s = draft_logits.float() * inv_temperature.float()[:, None, None]  # [B, K, Vd]
    bad = torch.isnan(s).any(-1, keepdim=True) | torch.isposinf(s).any(-1, keepdim=True) | torch.isneginf(s).all(
        -1, keepdim=True)
    m = s.amax(-1, keepdim=True).masked_fill(bad, 0.0)
    e = torch.exp(s - m)
    q = e / e.sum(-1, keepdim=True)
    return q.masked_fill(bad, float("nan"))


def _accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p(x) / q(x)): u * q(x) < p(x), with no division, in
    float64 (u float64; p(x), q(x) fp32, so the product of a 24-bit u and q is exact)."""
    return u.double() * q_x.double() < p_x.double()


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The unnormalised residual max(0, p - q) of the whole distributions [N, V]."""
    return (p - q).clamp(min=0.0)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first v with w[v] > 0 and cumsum(w)[v] > u * sum(w), summed in float64 (each
    addition rounds by at most ~2^-53 of the running sum: a weight below ~2^-54 of it still
    vanishes, a total variation of at most ~V * 2^-54 in all, against ~2^-24-sized errors of an
    fp32 sum); the last v with w > 0 if rounding leaves none (-1 if there is none).  A weight
    of 0 is never the pick, however the sum is ordered (the kernel tests w > 0 the same way).
    weights [N, V] >= 0 with a positive sum, u [N] float64 in [0, 1).  Returns [N] int64."""
    w = weights.double()
    cdf = torch.cumsum(w, dim=-1)  # [N, V]
    target = u.double() * cdf[:, -1]  # [N]
    V = weights.shape[-1]
    ar = torch.arange(V, device=weights.device)
    idx = torch.where((cdf > target[:, None]) & (w > 0), ar, V).amin(-1)
    last_nonzero = torch.where(w > 0, ar, -1).amax(-1)
    return torch.where(idx >= V, last_nonzero, idx)


def _draft_distributions(draft_probs, draft_logits, kb, temperature, top_k, top_p, K: int, min_p):
    """q [B, K, Vd]: draft_probs, or with ``draft_logits`` its softmax at each row's temperature
    (``draft_softmax``); None stays None (one-hot q)."""
    if draft_logits is None:
        return draft_probs
    if draft_probs is not None:
        raise ValueError("draft_probs and draft_logits are exclusive: pass one of them, got both")
    _, _, inv_t_d = _row_parameters(kb, temperature, top_k, top_p, K, min_p)
    return draft_softmax(draft_logits, inv_t_d)


def _target_distributions(target_logits, kb, temperature, top_k, top_p, min_p, target_is_probs: bool,
                          sort_descending):
    """(greedy [B], bad_param [B], p [B, K+1, V] fp32, bad_pos [B, K+1], argmax [B, K+1]): the
    warped target distributions of every verify position (``verify_reference``'s definitions),
    whether a position is unusable, and the first index of the maximum of each scaled row."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    if target_is_probs:
        if top_k is not None or top_p is not None or min_p is not None:
            raise ValueError("top_k, top_p and min_p must be None with target_is_probs=True")
        greedy, bad_param, _ = _row_parameters(kb, temperature, None, None, K)
        bad_param = bad_param | (~greedy & (temperature.float() != 1))
        s = target_logits.float()  # [B, K+1, V]
        bad_pos = torch.isnan(s).any(-1) | torch.isinf(s).any(-1) | (s < 0).any(-1) | ~(s > 0).any(-1)
        p = s / s.sum(-1, keepdim=True)
    else:
        greedy, bad_param, inv_t = _row_parameters(kb, temperature, top_k, top_p, K, min_p)
        s, keep = warp_logits(target_logits, inv_t[:, None].expand(B, K1), _per_position(top_k, K1),
                              _per_position(top_p, K1), sort_descending, min_p=_per_position(min_p, K1))
        # A position is unusable if any logit is NaN or +inf, or if nothing has a finite logit.
        bad_pos = torch.isnan(s).any(-1) | torch.isposinf(s).any(-1) | torch.isneginf(s).all(-1)  # [B, K+1]
        p = _target_probs(s, keep)  # [B, K+1, V]
    return greedy, bad_param, p, bad_pos, s.argmax(-1)


# ----------------------------------------------------------------------------------------------
# The verification step
# ----------------------------------------------------------------------------------------------
def verify_reference(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16
    draft_tokens: torch.Tensor,  # [B, K] int
    draft_probs: torch.Tensor | None,  # [B, K, Vd] fp32, Vd <= V; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64 in [0, K]
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] fp32, 1 = off
    uniforms: torch.Tensor,  # [B, K+1] float64 (or fp32) in [0, 1)
    *,
    sort_descending=_torch_sort_descending,  # the warp's sort (see warp_logits)
    target_is_probs: bool = False,  # target_logits holds the target's probabilities, used as given
    draft_logits: torch.Tensor | None = None,  # [B, K, Vd], Vd <= V: the draft's logits instead of draft_probs
    min_p: torch.Tensor | None = None,  # [B] fp32 in [0, 1], 0 = off
) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative-decoding verification step. Returns (tokens [B, K+1] int64,
    num_accepted [B] int64); row b emits tokens[b, :num_accepted[b] + 1].

    The target's warp is temperature, top-k, top-p, then min-p (``warp_logits``, which defines
    each; min-p keeps v iff s_v >= fl32(max s + fl32(ln min_p))).  Greedy rows use none of them
    (the argmax of the logits), but a parameter out of range (top_k < 0, top_p outside (0, 1],
    min_p outside [0, 1] or NaN) makes any row invalid.  The warp applies to p only, never to q.

    ``draft_logits`` (draft_probs None): q = ``draft_softmax(draft_logits, 1 / T)``, the row's own
    temperature, no top-k/top-p; then exactly the draft_probs computation with that q.

    ``target_is_probs``: p_i = target_logits[b, i] / its sum (fp32), no temperature or warp
    (top_k, top_p and min_p must be None); temperature 0 is a greedy row (the argmax of p), 1 samples,
    any other value makes the row invalid.  A position is unusable if an entry is NaN, inf or
    negative, or if none is positive."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    kb = num_draft_tokens.to(torch.int64)  # [B]
    draft_probs = _draft_distributions(draft_probs, draft_logits, kb, temperature, top_k, top_p, K, min_p)
    greedy, bad_param, p, bad_pos, argmax = _target_distributions(
        target_logits, kb, temperature, top_k, top_p, min_p, target_is_probs, sort_descending)

    x, x_safe, q_x, bad_x = _drafts(draft_tokens, draft_probs, greedy, V)
    p_x = p[:, :K].gather(-1, x_safe[..., None])[..., 0]  # [B, K]
    u = uniforms.double()
    accept = torch.where(greedy[:, None], x == argmax[:, :K], _accept(u[:, :K], p_x, q_x))  # [B, K]

    j, rejected, bad_row = _stop_position(accept, bad_x, bad_pos, bad_param, kb)

    # The final draw at position j: the residual after a rejection, p itself for the bonus.
    p_j = p.gather(1, j[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    final, bad_row = _final_token(p_j, x_safe, draft_probs, j, rejected, bad_row, greedy, argmax, u[:, K])
    return _outputs(x, j, final, bad_row)


def _block_stop_weights(pp: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """h_i = r_i / (r_i + 1 - p_i) [B, K] float64 for i = 0..K-1 (Sun et al., Algorithm 2): the
    weight of stopping after i accepted drafts, given the stop comes at i or earlier; 0 where
    r_i + 1 - p_i is 0 (p_i = 1 and an empty residual: the row never stops there)."""
    den = r + (1.0 - pp)
    return torch.where(den > 0, r / den.masked_fill(den <= 0, 1.0), 0.0)


def _block_residual(p_tau: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """The unnormalised residual max(0, p_tau * P - Q) [B, V] float64 of the extra token after a
    stop before K_b (p_tau [B], P and Q [B, V])."""
    return (p_tau[:, None] * P - Q).clamp(min=0.0)


def block_verify_reference(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16
    draft_tokens: torch.Tensor,  # [B, K] int
    draft_probs: torch.Tensor | None,  # [B, K, Vd] fp32, Vd <= V; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64 in [0, K]
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] fp32, 1 = off
    uniforms: torch.Tensor,  # [B, K+1] float64 (or fp32) in [0, 1)
    *,
    sort_descending=_torch_sort_descending,  # the warp's sort (see warp_logits)
    target_is_probs: bool = False,  # target_logits holds the target's probabilities, used as given
    draft_logits: torch.Tensor | None = None,  # [B, K, Vd], Vd <= V: the draft's logits instead of draft_probs
    min_p: torch.Tensor | None = None,  # [B] fp32 in [0, 1], 0 = off
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding",
    ICLR 2025, arXiv 2403.10444, Algorithm 2): the drafts are accepted or rejected jointly, with
    the target's law kept and at least as many drafts accepted on average as ``verify_reference``.
    Same inputs, warps (temperature, top-k, top-p, min-p), ``target_is_probs`` and
    ``draft_logits`` as ``verify_reference``, and the same outputs: tokens [B, K+1] int64 (the
    accepted drafts, the extra token, then -1), num_accepted [B] int64.

    Indices (1-based as in the paper; position i of the tensors is the paper's i + 1): x_i =
    draft_tokens[b, i-1], P_i = the warped target distribution at position i-1, Q_i =
    draft_probs[b, i-1] (one-hot at x_i when None), K = K_b.  With p_0 = 1,

        p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i))                       i = 1..K
        r_i = sum_v max(0, p_i P_{i+1}(v) - Q_{i+1}(v))                  i = 0..K-1
        h_i = r_i / (r_i + 1 - p_i)   (0 if the denominator is 0),  h_K = p_K

    (p_i is computed as 1 if p_{i-1} P_i(x_i) >= Q_i(x_i) > 0 or >= Q_i(x_i) = 0 with P_i(x_i) > 0,
    with no division there; a draft the target gives probability 0 has p_i = 0 even where
    Q_i(x_i) = 0.)  The number of
    accepted drafts tau is the largest i in 1..K with ``uniforms[b, i-1] < h_i``, 0 if none (the
    paper's test eta <= h_i, taken strictly so that h_i = 0 never stops on a uniform of exactly 0:
    on the uniforms' grid in [0, 1), u < h has probability h up to the grid's resolution).  The
    extra token is drawn with ``uniforms[b, K]`` (as in ``verify_reference``, whatever K_b) by the
    inverse CDF: from P_{K+1} when tau = K, else from norm(max(0, p_tau P_{tau+1} - Q_{tau+1}))
    (from P_{tau+1} if that residual sums to zero in floating point).  uniforms[b, i] for i >= K_b
    and i < K are not read.  All of it is computed in float64 from the fp32 p and q.

    Greedy rows (temperature 0) are token verification, invalid-row rules included: their
    outputs are ``verify_reference``'s.

    Invalid sampling rows (num_accepted -1, tokens all -1): as ``verify_reference``'s parameters,
    plus any unusable value the rule reads, which is every position 0..K_b of the logits, every
    draft id, every q_i(x_i) and draft distribution of positions below K_b (block verification
    reads all of them, not only those up to the first rejection).
    """
    B, K1, V = target_logits.shape
    K = K1 - 1
    kb = num_draft_tokens.to(torch.int64)  # [B]
    draft_probs = _draft_distributions(draft_probs, draft_logits, kb, temperature, top_k, top_p, K, min_p)
    greedy, bad_param, p, bad_pos, _ = _target_distributions(
        target_logits, kb, temperature, top_k, top_p, min_p, target_is_probs, sort_descending)
    x, x_safe, q_x, bad_x = _drafts(draft_tokens, draft_probs, greedy, V)
    cols = torch.arange(K1, device=target_logits.device)
    used_pos = cols[None, :] <= kb[:, None]  # [B, K+1]: positions 0..K_b
    used_x = cols[None, :K] < kb[:, None]  # [B, K]: drafts 0..K_b-1
    bad_row = bad_param | (bad_pos & used_pos).any(-1) | (bad_x & used_x).any(-1)

    P = torch.nan_to_num(p.double(), nan=0.0)  # [B, K+1, V]
    Q = torch.zeros(B, K, V, dtype=torch.float64, device=p.device)
    if draft_probs is None:
        Q.scatter_(-1, x_safe[..., None], 1.0)
    else:
        Q[..., :draft_probs.shape[-1]] = draft_probs.double()
        bad_q = ~torch.isfinite(Q).all(-1) | (Q < 0).any(-1)  # [B, K]
        bad_row |= (bad_q & used_x).any(-1)
        Q = torch.nan_to_num(Q, nan=0.0, posinf=0.0).clamp(min=0.0)
    Q_x = torch.nan_to_num(q_x.double(), nan=0.0, posinf=0.0).clamp(min=0.0)  # [B, K]
    P_x = P[:, :K].gather(-1, x_safe[..., None])[..., 0]  # [B, K]

    # p_0..p_K [B, K+1]; row b's values past K_b are not read.
    pp = [torch.ones(B, dtype=torch.float64, device=p.device)]
    for i in range(K):
        num = pp[-1] * P_x[:, i]
        one = (num >= Q_x[:, i]) & (num > 0)  # else Q_x > 0 or num = 0 (then p_i = 0)
        pp.append(torch.where(one, 1.0, num / Q_x[:, i].masked_fill(Q_x[:, i] <= 0, 1.0)))
    pp = torch.stack(pp, dim=1)  # [B, K+1]
    r = (pp[:, :K, None] * P[:, :K] - Q).clamp(min=0.0).sum(-1)  # [B, K]: r_0..r_{K-1}
    h = _block_stop_weights(pp[:, :K], r)  # [B, K]: h_0..h_{K-1}
    h = torch.cat([h, torch.zeros(B, 1, dtype=torch.float64, device=p.device)], dim=1)  # [B, K+1]
    h = torch.where(cols[None, :] == kb[:, None], pp, h)  # h_{K_b} = p_{K_b}
    u = uniforms.double()
    i1 = cols[1:]  # [K]: i = 1..K, its uniform uniforms[:, i-1]
    stop = (u[:, :K] < h[:, 1:]) & (i1[None, :] <= kb[:, None])  # [B, K]
    tau = torch.where(stop, i1[None, :], 0).amax(-1) if K > 0 else torch.zeros(B, dtype=torch.int64)
    tau = tau.clamp(0, K)

    P_t = P.gather(1, tau[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]: P_{tau+1}
    Q_t = Q.gather(1, tau.clamp(max=K - 1)[:, None, None].expand(B, 1, V))[:, 0] if K > 0 else torch.zeros_like(P_t)
    p_t = pp.gather(1, tau[:, None])[:, 0]  # [B]
    residual = torch.where((tau < kb)[:, None], _block_residual(p_t, P_t, Q_t), P_t)
    weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, P_t)
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, 1.0)  # invalid rows only
    tokens, num = _outputs(x, tau, _inverse_cdf(weights, u[:, K]), bad_row)

    # Greedy rows: token verification against the argmax, as verify_reference has it.
    t_tok, n_tok = verify_reference(target_logits, draft_tokens, draft_probs, num_draft_tokens, temperature, top_k,
                                    top_p, uniforms, sort_descending=sort_descending,
                                    target_is_probs=target_is_probs, min_p=min_p)
    return torch.where(greedy[:, None], t_tok, tokens), torch.where(greedy, n_tok, num)


def emitted_logprobs(
    target_logits: torch.Tensor,  # [B, K+1, V]: what verify_reference was given
    tokens: torch.Tensor,  # [B, K+1] int: its output
    num_accepted: torch.Tensor,  # [B] int: its output
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] fp32, 1 = off
    *,
    target_is_probs: bool = False,
    sort_descending=_torch_sort_descending,
    min_p: torch.Tensor | None = None,  # [B] fp32, 0 = off
) -> torch.Tensor:
    """[B, K+1] fp32: the target log-probability of each emitted token, log p_i(tokens[b, i]) for
    i <= num_accepted[b], under the row's warped distribution ((s - m) - log sum exp(s - m) over the
    kept tokens; with target_is_probs, log p - log sum p); a greedy row's under softmax(logits)
    (T = 1, no warp); -inf where nothing is emitted (and on invalid rows)."""
    B, K1, V = target_logits.shape
    temp = temperature.float()
    greedy = temp == 0
    if target_is_probs:
        s = target_logits.float()
        lp_all = torch.log(s) - torch.log(s.sum(-1, keepdim=True))
    else:
        inv_t = torch.where(greedy | ~(temp > 0), 1.0, 1.0 / temp.masked_fill(~(temp > 0), 1.0))
        k = None if top_k is None else torch.where(greedy, 0, top_k.to(torch.int64))
        p_ = None if top_p is None else torch.where(greedy, 1.0, top_p.float())
        mp = None if min_p is None else torch.where(greedy, 0.0, min_p.float())
        s, keep = warp_logits(target_logits, inv_t[:, None].expand(B, K1), _per_position(k, K1),
                              _per_position(p_, K1), sort_descending, min_p=_per_position(mp, K1))
        m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        lse = torch.log(torch.where(keep, torch.exp(s - m), 0.0).sum(-1, keepdim=True))
        lp_all = torch.where(keep, (s - m) - lse, float("-inf"))
    lp = lp_all.gather(-1, tokens.to(torch.int64).clamp(min=0)[..., None])[..., 0]  # [B, K+1]
    cols = torch.arange(K1, device=tokens.device)[None, :]
    emitted = (cols <= num_accepted.to(torch.int64)[:, None]) & (tokens >= 0)
    return torch.where(emitted, lp, float("-inf"))


def _per_position(t: torch.Tensor | None, K1: int) -> torch.Tensor | None:
    """A per-row parameter [B] as one per verify position [B, K+1] (a view); None stays None."""
    return None if t is None else t[:, None].expand(t.shape[0], K1)


def _row_parameters(
    kb: torch.Tensor,  # [B] int64: K_b
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor | None,  # [B] int
    top_p: torch.Tensor | None,  # [B] fp32
    K: int,
    min_p: torch.Tensor | None = None,  # [B] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(greedy, bad_param, inv_t), each [B]: temperature 0 (-0.0 too); a parameter out of range
    (temperature NaN, inf, negative or in (0, FLT_MIN); top_k < 0; top_p outside (0, 1]; min_p
    outside [0, 1]; NaN); 1 / T (1 for greedy and bad rows)."""
    temp = temperature.float()
    greedy = temp == 0
    # A positive temperature below the smallest normal fp32 (2^-126) is refused: its reciprocal
    # overflows (or, subnormal, may be flushed to 0 on a GPU) and no logit survives the scaling.
    bad_param = ~torch.isfinite(temp) | (temp < 0) | ((temp > 0) & (temp < FLT_MIN)) | (kb < 0) | (kb > K)
    if top_k is not None:
        bad_param |= top_k < 0
    if top_p is not None:
        bad_param |= ~(top_p > 0) | (top_p > 1)  # NaN fails the first test
    if min_p is not None:
        bad_param |= ~(min_p >= 0) | (min_p > 1)
    inv_t = torch.where(greedy | bad_param, 1.0, 1.0 / temp.masked_fill(temp == 0, 1.0))
    return greedy, bad_param, inv_t


def _drafts(
    draft_tokens: torch.Tensor,  # [B, K] int
    draft_probs: torch.Tensor | None,  # [B, K, Vd] or None
    greedy: torch.Tensor,  # [B] bool
    V: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, x_safe, q_x, bad_x), each [B, K]: the drafts as int64; with ids outside [0, V) replaced
    by 0; q_i(x_i) (1 for a deterministic drafter, 0 for an id past the draft vocabulary Vd); and
    whether draft i is unusable (its id out of range, or, for a sampling row, its q not a
    finite non-negative number)."""
    x = draft_tokens.to(torch.int64)
    x_ok = (x >= 0) & (x < V)
    x_safe = torch.where(x_ok, x, 0)
    if draft_probs is None:
        q_x = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    else:
        Vd = draft_probs.shape[-1]
        q_x = draft_probs.float().gather(-1, x_safe.clamp(max=Vd - 1)[..., None])[..., 0]
        q_x = torch.where(x_safe < Vd, q_x, 0.0)
    bad_x = ~x_ok | (~greedy[:, None] & (~torch.isfinite(q_x) | (q_x < 0)))
    return x, x_safe, q_x, bad_x


def _final_token(
    p_j: torch.Tensor,  # [B, V] fp32: the target distribution at the stop position j
    x_safe: torch.Tensor,  # [B, K] int64 drafts, out-of-range ids replaced by 0
    draft_probs: torch.Tensor | None,  # [B, K, Vd] or None (one-hot q)
    j: torch.Tensor,  # [B] int64 stop position
    rejected: torch.Tensor,  # [B] bool: j < K_b
    bad_row: torch.Tensor,  # [B] bool
    greedy: torch.Tensor,  # [B] bool
    argmax: torch.Tensor,  # [B, K+1] int64: first index of the maximum of s
    u_final: torch.Tensor,  # [B] float64: the final draw's uniform
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recovered (after a rejection: residual norm(max(0, p_j - q_j))) or bonus (p_j) token
    of each row, its argmax for greedy rows; and bad_row, extended by an unusable q_j."""
    B, V = p_j.shape
    K = x_safe.shape[1]
    if draft_probs is None:
        q_j = torch.zeros_like(p_j)
        if K > 0:
            x_j = x_safe.gather(1, j.clamp(max=K - 1)[:, None])  # [B, 1]
            q_j.scatter_(1, x_j, 1.0)
    else:
        q_j = torch.zeros_like(p_j)
        if K > 0:
            Vd = draft_probs.shape[-1]
            q_rows = draft_probs.float().gather(1, j.clamp(max=K - 1)[:, None, None].expand(B, 1, Vd))[:, 0]
            q_j[:, :Vd] = q_rows
            bad_q = ~torch.isfinite(q_rows).all(-1) | (q_rows < 0).any(-1)
            bad_row |= rejected & ~greedy & bad_q
    residual = torch.where(rejected[:, None], _residual(p_j, q_j), p_j)
    residual = torch.nan_to_num(residual, nan=0.0)  # only on rows already marked invalid
    empty = residual.sum(-1) <= 0
    weights = torch.where(empty[:, None], torch.nan_to_num(p_j, nan=0.0), residual)
    # Only invalid rows can still sum to zero here; they get a dummy draw that is discarded below.
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, 1.0)
    sampled = _inverse_cdf(weights, u_final)
    final = torch.where(greedy, argmax.gather(1, j[:, None])[:, 0], sampled)
    return final, bad_row


def _stop_position(
    accept: torch.Tensor,  # [B, K] bool: draft i passes its test
    bad_x: torch.Tensor,  # [B, K] bool: draft i (its id, or for sampling rows its q) is unusable
    bad_pos: torch.Tensor,  # [B, K+1] bool: position i's logits are unusable
    bad_param: torch.Tensor,  # [B] bool: the row's parameters are out of range
    kb: torch.Tensor,  # [B] int64: the row's number of drafts K_b
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(j, rejected, bad_row): j [B] = the position where the row stops (its first rejection,
    its first unusable position, or K_b when it accepts everything: then position K_b gives the
    bonus token); rejected = j < K_b; bad_row = the row read something unusable."""
    K = accept.shape[1]
    i = torch.arange(K, device=accept.device)
    stops = (~accept | bad_pos[:, :K] | bad_x) & (i[None, :] < kb[:, None])  # [B, K]
    j = torch.minimum((~stops).int().cumprod(-1).sum(-1), kb).clamp(0, K)  # [B]: leading non-stops
    rejected = j < kb
    bad_row = bad_param | bad_pos.gather(1, j[:, None])[:, 0]
    bad_row |= torch.where(rejected, bad_x.gather(1, j.clamp(max=K - 1)[:, None])[:, 0] if K > 0 else False, False)
    return j, rejected, bad_row


def _outputs(
    x: torch.Tensor,  # [B, K] int64 drafts
    j: torch.Tensor,  # [B] int64 stop position
    final: torch.Tensor,  # [B] int64 the recovered or bonus token
    bad_row: torch.Tensor,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, K+1] (accepted drafts, the final token at j, then -1; all -1 for a bad row)
    and num_accepted [B] (j, or -1 for a bad row)."""
    B, K = x.shape
    cols = torch.arange(K + 1, device=x.device)[None, :]
    x_pad = torch.cat([x, x.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    tokens = torch.where(cols < j[:, None], x_pad, -1)
    tokens = torch.where(cols == j[:, None], final[:, None], tokens)
    tokens = torch.where(bad_row[:, None], -1, tokens)
    num_accepted = torch.where(bad_row, -1, j)
    return tokens, num_accepted


# ----------------------------------------------------------------------------------------------
# KV-cache compaction (the ground truth of specdec::compact_kv_, see kv_cache.py)
# ----------------------------------------------------------------------------------------------
def compact_kv_reference(
    caches: list[torch.Tensor],  # L x [B, H, T, D], any dtype; modified in place
    src_start: int,  # first position written by this step, in [0, T]
    dst_start: torch.Tensor,  # [B] int64, in [0, src_start]
    count: torch.Tensor,  # [B] int64, in [0, T - src_start]
) -> None:
    """KV-cache compaction, in place: for every cache c, row b and j in [0, count[b]),
    ``c[b, :, dst_start[b] + j, :] = c[b, :, src_start + j, :]``.

    Rows are copied one position at a time in increasing j, which is memmove semantics
    because ``dst_start[b] <= src_start``: a source position is always read before a
    destination write reaches it.  Raises ValueError for index values out of range, with the
    same text as the CPU kernel.  Reads the indices on the host (plain loops, no tricks).
    """
    dst = dst_start.tolist()  # [B]
    cnt = count.tolist()  # [B]
    shortest = min(range(len(caches)), key=lambda i: caches[i].shape[2])
    T = caches[shortest].shape[2]
    for b, (d, n) in enumerate(zip(dst, cnt)):
        if d < 0:
            raise ValueError(f"compact_kv_: dst_start[{b}] must be >= 0, got {d}")
        if d > src_start:
            raise ValueError(
                f"compact_kv_: dst_start[{b}] must be <= src_start = {src_start}, got {d}"
            )
        if n < 0:
            raise ValueError(f"compact_kv_: count[{b}] must be >= 0, got {n}")
        if n > T - src_start:
            raise ValueError(
                f"compact_kv_: src_start + count[{b}] must be <= T = {T} "
                f"(T = caches[{shortest}].size(2)), got {src_start} + {n}"
            )
    for c in caches:
        for b, (d, n) in enumerate(zip(dst, cnt)):
            for j in range(n):
                c[b, :, d + j, :] = c[b, :, src_start + j, :]  # [H, D]


# ----------------------------------------------------------------------------------------------
# KV-cache gathering (the ground truth of specdec::gather_kv_, see kv_cache.py)
# ----------------------------------------------------------------------------------------------
def gather_kv_reference(
    caches: list[torch.Tensor],  # L x [B, H, T, D], any dtype, one T; modified in place
    src_index: torch.Tensor,  # [B, M] int64: row b's kept columns, strictly increasing, >= dst_start[b]
    count: torch.Tensor,  # [B] int64, in [0, M]: how many of src_index[b] are used
    dst_start: torch.Tensor,  # [B] int64, >= 0, dst_start[b] + count[b] <= T
) -> None:
    """KV-cache gathering, in place: for every cache c, row b and j in [0, count[b]),
    ``c[b, :, dst_start[b] + j, :] = old c[b, :, src_index[b, j], :]``.

    Every source column of a row is read (into a new tensor) before any of the row's columns is
    written, which is the op's "read before write" meaning whatever the index order.  The op
    requires the used indices to be strictly increasing with ``src_index[b, 0] >= dst_start[b]``
    (so that its kernels can copy in increasing j with no temporary); this function checks
    the same rules and raises ValueError for any value out of range, with the same text as the
    CPU kernel.  Entries ``src_index[b, j]`` for ``j >= count[b]`` are not read.  Reads the
    indices on the host (plain loops, no tricks).
    """
    src = src_index.tolist()  # [B][M]
    cnt = count.tolist()  # [B]
    dst = dst_start.tolist()  # [B]
    M = src_index.shape[1]
    T = caches[0].shape[2]
    for b, (d, n) in enumerate(zip(dst, cnt)):
        if d < 0:
            raise ValueError(f"gather_kv_: dst_start[{b}] must be >= 0, got {d}")
        if not 0 <= n <= M:
            raise ValueError(
                f"gather_kv_: count[{b}] must be in [0, M] = [0, {M}] (M = src_index.size(1)), got {n}"
            )
        if n > T - d:
            raise ValueError(
                f"gather_kv_: dst_start[{b}] + count[{b}] must be <= T = {T} "
                f"(T = caches[0].size(2)), got {d} + {n}"
            )
        for j in range(n):
            s = src[b][j]
            if not 0 <= s < T:
                raise ValueError(
                    f"gather_kv_: src_index[{b}, {j}] must be in [0, T) = [0, {T}) "
                    f"(T = caches[0].size(2)), got {s}"
                )
            if j == 0 and s < d:
                raise ValueError(
                    f"gather_kv_: src_index[{b}, 0] must be >= dst_start[{b}] = {d} "
                    f"(columns move towards the prefix only), got {s}"
                )
            if j > 0 and s <= src[b][j - 1]:
                raise ValueError(
                    f"gather_kv_: src_index[{b}, {j}] must be > src_index[{b}, {j - 1}] = "
                    f"{src[b][j - 1]} (the used indices must be strictly increasing), got {s}"
                )
    for c in caches:
        for b, (d, n) in enumerate(zip(dst, cnt)):
            if n == 0:
                continue
            idx = torch.tensor(src[b][:n], dtype=torch.int64, device=c.device)  # [n]
            old = c[b].index_select(1, idx)  # [H, n, D]: a copy, read before any write
            c[b, :, d : d + n, :] = old


def skinny_linear_reference(
    x: torch.Tensor,  # [..., K] fp32
    weight: torch.Tensor,  # [N, K] fp32
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in float64, rounded once to fp32: the ground truth
    ``skinny_linear`` is compared with.  (The kernel sums in fp32 in a fixed order, so the two
    differ by fp32 rounding error; the tests bound it.)"""
    y = x.double() @ weight.double().T  # [..., N] fp64
    if bias is not None:
        y = y + bias.double()
    return y.float()
