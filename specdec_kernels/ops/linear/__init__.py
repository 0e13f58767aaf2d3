"""``skinny_linear``, the batch-invariant fp32 CPU linear op (``op``, a C++ kernel in
``csrc/skinny_linear.cpp``), and its pure-PyTorch reference (``reference``); the one-pass
preparation of its fp16 weights (``fp16_exact_copy``, ``fp16_copy_matches``: csrc/fp16_copy.cpp).
"""

from .op import auto_isa, fp16_copy_matches, fp16_exact_copy, fp16_exact_copy_into, skinny_linear, supported_isas
from .reference import skinny_linear_reference

__all__ = ["auto_isa", "fp16_copy_matches", "fp16_exact_copy", "fp16_exact_copy_into", "skinny_linear",
           "supported_isas"]
