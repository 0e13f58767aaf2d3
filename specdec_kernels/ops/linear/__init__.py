"""``skinny_linear``, the batch-invariant fp32 CPU linear op (``op``, a C++ kernel in
``csrc/skinny_linear.cpp``), and its pure-PyTorch reference (``reference``).
"""

from .op import skinny_linear, supported_isas
from .reference import skinny_linear_reference

__all__ = ["skinny_linear", "supported_isas"]
