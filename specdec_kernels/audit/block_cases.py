"""The verifier audit's cases of block verification (Sun et al. 2025): run for verifiers that set
``supports_block`` (they take ``params.method``).

The one-step law of block verification is written from the definitions (``block.block_step_law``):
with the case's target distributions P_1..P_{K+1} fixed per position (prefix-independent, as in
the token cases) and the drafts drawn per trial from Q_1..Q_K, every one of the V^K = 1000 draft
sequences is enumerated with its p_i, r_i, h_i, the law of the number accepted tau and the law of
the extra token: the exact law of the emitted sequence (accepted drafts, then the extra token)
over its sum_{m=0..K} V^(m+1) = 11,110 outcomes.  A verifier's n outputs are tested against it
by chi-square (bins of expected count < 5 pooled; a count in a bin of probability 0 fails).

- ``block_sequences``: drafts drawn per trial from q (T = 1);
- ``block_fixed_drafts``: one draft sequence for every trial (T = 0.8), with its q and without
  (one-hot q); the two tests combined by Bonferroni.

Their mutant (``block.mutant('block_residual_token')``, the audit's own block sampler) takes the
extra token after a stop from the token method's residual norm(max(0, P - Q)).  The case's logits
and q are drawn from a fixed seed and kept only where that mutant's law is far from the correct
one (total variation >= 0.02, >= 1% of its mass on sequences the correct law forbids); with a
one-hot q the two residuals are the same law, so the mutant's power is the q call's.
"""

from __future__ import annotations

import torch

from . import block
from .cases import K, V, Case, _chi, _finish, _out
from .checks import counts
from .laws import sequence_index, sequence_space, warp64
from .protocol import Call, make_params

__all__ = ["BLOCK_CASES"]

MUTATION = "block_residual_token"
_APART_TV, _APART_FORBIDDEN = 0.02, 0.01  # how far the mutant's law must be from the case's


def _apart(law: torch.Tensor, wrong: torch.Tensor) -> bool:
    tv = float((law - wrong).abs().sum()) / 2
    return tv >= _APART_TV and float(wrong[law <= 1e-12].sum()) >= _APART_FORBIDDEN


def _block_template(seed: int, temperature: float, fixed: bool):
    """(logits [K+1, V] fp32, q [K, V] fp32, drafts [K] or None): the first draw from ``seed``
    whose block law (drafts drawn from q, or the fixed ``drafts``, a draw from q) is apart from the
    mutant's (``_apart``).  q = softmax(logits / 2 + noise): a draft near the target, not on it."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):
        logits = 1.5 * torch.randn(K + 1, V, generator=g)
        q = torch.softmax(0.5 * logits[:K] + torch.randn(K, V, generator=g), -1).float()
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(K)]) if fixed else None
        P = warp64(logits, temperature)
        if _apart(block.block_step_law(P, q, drafts), block.block_step_law(P, q, drafts, mutation=MUTATION)):
            return logits, q, drafts
    raise RuntimeError(f"no block case apart from its mutant from seed {seed}")


def _call(logits, drafts, q, n, temperature) -> Call:
    """n rows of one step: logits [K+1, V], drafts [n, K] or [K], q [K, V] or None; method 'block'."""
    return Call(logits.expand(n, -1, -1).contiguous(), drafts.expand(n, -1).contiguous(),
                None if q is None else q.expand(n, -1, -1).contiguous(),
                make_params(n, K, temperature=temperature, method="block"))


_SEQ_T, _FIXED_T = 1.0, 0.8


def _sequences_build(n):
    logits, q, _ = _block_template(101, _SEQ_T, fixed=False)
    g = torch.Generator().manual_seed(102)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(K)], 1)  # [n, K]
    return [_call(logits, drafts, q, n, _SEQ_T)]


def _fixed_build(n):
    logits, q, drafts = _block_template(111, _FIXED_T, fixed=True)
    return [_call(logits, drafts, q, n, _FIXED_T), _call(logits, drafts, None, n, _FIXED_T)]


def _test(call: Call, out, law: torch.Tensor, what: str, tests: list, details: list) -> None:
    """The chi-square of the emitted sequences of ``call``'s rows against ``law``, and the mean
    number accepted beside the law's."""
    tokens, num = _out(call, out)
    offsets = sequence_space(V, K)
    _chi(counts(sequence_index(tokens, num, V), offsets[-1]), law, what, tests, details)
    mean = sum(m * float(law[offsets[m]:offsets[m + 1]].sum()) for m in range(K + 1))
    details[-1] += f" (mean accepted {float(num.double().mean()):.3f}, law {mean:.3f})"


def _P(call: Call) -> torch.Tensor:
    return warp64(call.target_logits[0], float(call.params.temperature[0]))


def _sequences_check(calls, outputs):
    call = calls[0]
    tests, details = [], []
    law = block.block_step_law(_P(call), call.draft_probs[0])  # the drafts are drawn from q (the build's)
    _test(call, outputs[0], law, "emitted sequences, drafts drawn from q", tests, details)
    return _finish(tests, details)


def _fixed_check(calls, outputs):
    tests, details = [], []
    for call, out, what in zip(calls, outputs, ("emitted sequences, fixed drafts with q",
                                                  "emitted sequences, fixed drafts, one-hot q (draft_probs None)")):
        drafts = call.draft_tokens[0]
        q = call.draft_probs[0] if call.draft_probs is not None else torch.nn.functional.one_hot(drafts, V)
        _test(call, out, block.block_step_law(_P(call), q, drafts), what, tests, details)
    return _finish(tests, details)


_BOUND = "chi-square over the 11,110 emitted sequences (pooled to expected >= 5){}, fail if p < 1e-4"

BLOCK_CASES: list = [
    Case("block_sequences", "block verification's emitted sequence (accepted drafts, then the extra token) has its "
         "exact law, drafts drawn per trial from q (T=1, K=3): P(tau = i) = h_i prod_{j>i} (1 - h_j), the extra "
         "token from norm(max(0, p_tau P - Q)) or the bonus", _BOUND.format(""), MUTATION, _sequences_build,
         _sequences_check, needs={"block"}, mutant_verifier=block.mutant(MUTATION),
         mutant_says=block.MUTATIONS[MUTATION], reads=f"every token, every draft prefix; positions 0..{K}"),
    Case("block_fixed_drafts", "block verification's emitted sequence for one fixed draft sequence (T=0.8), with its "
         "q and with deterministic drafts (one-hot q)", _BOUND.format(" per call (Bonferroni over 2)"), MUTATION,
         _fixed_build, _fixed_check, needs={"block"}, mutant_verifier=block.mutant(MUTATION),
         mutant_says=block.MUTATIONS[MUTATION] + " (the one-hot call cannot tell: its two residuals are one law)",
         reads=f"every token (fixed drafts, with q and one-hot); positions 0..{K}"),
]
