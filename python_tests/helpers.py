"""Shared helpers of the tests: the tolerance policy and the input generators."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (this case times or graphs the real kernel)")

# Tolerance policy (STYLE item 15): per-dtype (atol, rtol) for comparing floating-point values
# computed by two implementations. Token ids and counts are always compared exactly.
TOLERANCES = {
    torch.float32: (1e-5, 1.3e-6),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_step(B: int, K: int, V: int, dtype=torch.float32, device="cpu", seed: int = 0,
              Vd: int | None = None, scale: float = 3.0, draft_noise: float = 0.5):
    """Target logits [B, K+1, V], draft probabilities [B, K, Vd] close to the target (so that
    drafts are often but not always accepted) and drafts sampled from them [B, K]."""
    g = torch.Generator().manual_seed(seed)
    Vd = V if Vd is None else Vd
    logits = torch.randn(B, K + 1, V, generator=g) * scale
    draft_logits = logits[:, :K, :Vd] + torch.randn(B, K, Vd, generator=g) * draft_noise * scale
    q = torch.softmax(draft_logits, dim=-1)
    if B * K:
        x = torch.multinomial(q.reshape(-1, Vd), 1, generator=g).view(B, K)
    else:
        x = torch.zeros(B, K, dtype=torch.int64)
    return (logits.to(dtype).to(device), x.to(device), q.to(device))


def inject_unusable_positions(logits: torch.Tensor, rng) -> None:
    """In place, on fp32 logits [B, K+1, V]: 0-2 unusable positions (a NaN, a +inf, or all -inf),
    chosen by ``rng`` (a random.Random)."""
    B, K1, V = logits.shape
    for _ in range(rng.choice([0, 0, 1, 2])):
        b, i = rng.randrange(B), rng.randrange(K1)
        kind = rng.choice(["nan", "posinf", "allneginf"])
        if kind == "nan":
            logits[b, i, rng.randrange(V)] = float("nan")
        elif kind == "posinf":
            logits[b, i, rng.randrange(V)] = float("inf")
        else:
            logits[b, i] = float("-inf")


def random_randomness(rng, g: torch.Generator, B: int, K: int) -> dict:
    """fused_verify's random-number arguments, chosen at random: explicit uniforms [B, K+1], or a
    seed (an int or per-row [B]) with an offset."""
    if rng.random() < 0.5:
        return {"uniforms": torch.rand(B, K + 1, generator=g)}
    return {"seed": rng.choice([7, torch.randint(0, 2**40, (B,), generator=g)]), "offset": rng.randint(0, 5)}


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """The warped target distribution from its definition, in float64."""
    s = logits.double().numpy() / temperature
    keep = np.isfinite(s)
    if top_k:
        kth = np.sort(s)[::-1][min(top_k, len(s)) - 1]
        keep &= s >= kth
    e = np.where(keep, np.exp(np.where(keep, s, 0) - s[keep].max()), 0.0)
    p = e / e.sum()
    if top_p is not None and top_p < 1:
        # keep v iff the mass of tokens strictly more likely than v is < top_p
        greater = np.array([p[p > p[v]].sum() for v in range(len(p))])
        keep &= greater < top_p
        p = np.where(keep, p, 0.0)
        p = p / p.sum()
    return p


def chi_square_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(p)).astype(np.float64)
    if counts[p == 0].sum() > 0 or (tokens < 0).any():
        return 0.0  # a token the target forbids was emitted
    n = counts.sum()
    exp = p * n
    order = np.argsort(exp)
    obs_bins, exp_bins, acc_o, acc_e = [], [], 0.0, 0.0
    for v in order:
        if p[v] == 0:
            continue
        acc_o += counts[v]
        acc_e += exp[v]
        if acc_e >= 5:
            obs_bins.append(acc_o)
            exp_bins.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        if exp_bins:
            obs_bins[-1] += acc_o
            exp_bins[-1] += acc_e
        else:
            obs_bins.append(acc_o)
            exp_bins.append(acc_e)
    if len(exp_bins) < 2:
        return 1.0 if obs_bins[0] == n else 0.0  # a single allowed token: all draws must be it
    return float(stats.chisquare(obs_bins, exp_bins).pvalue)


def random_bitmask(g: torch.Generator, lead: tuple, V: int, density: float = 0.5) -> torch.Tensor:
    """A grammar's token mask in xgrammar's layout for ``token_bitmask=``: [*lead, ceil(V/32)] int32
    with each token allowed with probability ``density`` (at least one per position), its padding
    bits set at random (they must not be read)."""
    W = (V + 31) // 32
    bits = torch.rand(*lead, W * 32, generator=g) < density
    bits[..., torch.randint(0, V, (1,), generator=g)] = True
    bits[..., V:] = torch.rand(*lead, W * 32 - V, generator=g) < 0.5
    words = (bits.view(*lead, W, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)
