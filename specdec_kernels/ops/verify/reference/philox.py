"""Counter-based random numbers: the same Philox4x32-10 stream as ``triton.language.rand``.

``philox_uniforms(seed, offset, K)`` gives the [B, K+1] float64 uniforms ``fused_verify`` and
``fused_verify_tree`` draw in-kernel for (seed, offset): 24-bit fp32 values for the acceptance
tests and a 53-bit value for the final draw (``reference``'s docstring says why 53 bits);
``philox_uniforms_host`` computes the same values in Python ints, for small CPU batches.  Every
value is a function of its row's (seed, offset) and its counter only.
"""

from __future__ import annotations

import torch

__all__ = ["philox_uniforms", "uint53_to_uniform"]

_MASK32 = 0xFFFFFFFF


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


def uint53_to_uniform(r0: torch.Tensor, r1: torch.Tensor) -> torch.Tensor:
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


def philox_uniforms_host(seed: list, offset: list, num_draft_slots: int) -> torch.Tensor:
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
    u[:, -1] = uint53_to_uniform(r0[:, -1], r1[:, -1])
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
