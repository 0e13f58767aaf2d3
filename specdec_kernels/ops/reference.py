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

The references live in one module per op family, all re-exported here: ``verify.reference.philox``
(the random numbers), ``verify.reference.warp`` (temperature, top-k, top-p, min-p), ``verify.reference.chain``
(``verify_reference``, ``emitted_logprobs`` and the pieces the others share), ``verify.reference.block``
(``block_verify_reference``), ``kv.reference`` (``compact_kv_reference``, ``gather_kv_reference``)
and ``linear.reference`` (``skinny_linear_reference``); the tree's is ``tree.reference``.
"""

from __future__ import annotations

# Every public name of the sub-modules is importable from here; ``__all__`` lists the ones a star
# import takes.
from .kv.reference import compact_kv_reference, gather_kv_reference
from .linear.reference import skinny_linear_reference
from .verify.reference.block import block_verify_reference
from .verify.reference.chain import FLT_MIN, draft_softmax, emitted_logprobs, inverse_cdf, verify_reference  # noqa: F401
from .verify.reference.philox import philox_uniforms, uint53_to_uniform  # noqa: F401
from .verify.reference.warp import LN2, LOG_SERIES, SQRT2, min_p_log, min_p_threshold, order_key, warp_logits  # noqa: F401

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
