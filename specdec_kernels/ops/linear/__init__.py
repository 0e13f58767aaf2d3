"""``skinny_linear``, the batch-invariant fp32 CPU linear op (``op``, a C++ kernel in
``csrc/skinny_linear.cpp``), and its pure-PyTorch reference (``reference``).
"""

from .op import auto_isa, skinny_linear, supported_isas
from .reference import skinny_linear_reference

__all__ = ["auto_isa", "skinny_linear", "supported_isas"]
