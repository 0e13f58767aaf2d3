"""The KV-cache roll-back ops: ``compact_kv_`` and ``gather_kv_`` (``torch.ops.specdec.*``, C++/CUDA
kernels in ``csrc/``) with their DynamicCache forms and cache helpers (``cache``), and their
pure-PyTorch references (``reference``).
"""

from .cache import (compact_dynamic_cache_, compact_kv_, crop_cache_, gather_dynamic_cache_, gather_kv_, new_cache,
                    stack_caches_)
from .reference import compact_kv_reference, gather_kv_reference

__all__ = ["compact_dynamic_cache_", "compact_kv_", "gather_dynamic_cache_", "gather_kv_"]
