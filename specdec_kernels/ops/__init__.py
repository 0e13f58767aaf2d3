"""The ops: exact verification kernels, their launchers, their pure-PyTorch references, and the
KV-cache roll-back ops (``torch.ops.specdec.*``).

This layer imports nothing from the rest of the package; ``decoding/`` and the integrations sit
on top of it.  ``verify`` (``fused_verify``, ``fused_verify_packed``), ``tree.api``
(``fused_verify_tree``), ``kv.cache`` (``compact_kv_``, ``gather_kv_`` and their DynamicCache
forms), ``linear`` (``skinny_linear``, the batch-invariant CPU linear op), ``reference`` and
``tree.reference`` (the ground truth the tests compare to).
"""

from .kv import compact_dynamic_cache_, compact_kv_, gather_dynamic_cache_, gather_kv_
from .linear import skinny_linear
from .tree import TreeVerifyOutput, fused_verify_tree
from .verify import VerifyOutput, VerifyOutputWithLogprobs, fused_verify, fused_verify_packed

__all__ = ["TreeVerifyOutput", "VerifyOutput", "VerifyOutputWithLogprobs", "compact_dynamic_cache_", "compact_kv_",
           "fused_verify", "fused_verify_packed", "fused_verify_tree", "gather_dynamic_cache_", "gather_kv_",
           "skinny_linear"]
