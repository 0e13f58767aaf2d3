"""Pure-PyTorch references of the verification op, one module per piece: ``chain``
(``verify_reference``, token-by-token verification, and the pieces the others share), ``block``
(``block_verify_reference``), ``philox`` (the kernel's random numbers) and ``warp`` (temperature,
top-k, top-p, min-p).  ``specdec_kernels.ops.reference`` re-exports them with the other families'.
"""

from .block import block_verify_reference
from .chain import FLT_MIN, draft_softmax, emitted_logprobs, inverse_cdf, verify_reference
from .philox import philox_uniforms, uint53_to_uniform
from .warp import LN2, LOG_SERIES, SQRT2, min_p_log, min_p_threshold, order_key, warp_logits

__all__ = ["FLT_MIN", "LN2", "LOG_SERIES", "SQRT2", "block_verify_reference", "draft_softmax", "emitted_logprobs",
           "inverse_cdf", "min_p_log", "min_p_threshold", "order_key", "philox_uniforms", "uint53_to_uniform",
           "verify_reference", "warp_logits"]
