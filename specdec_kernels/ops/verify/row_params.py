"""The split kernel's per-row parameters as the launch passes them: each one either a [B] tensor
read in place or a scalar passed by value, and which are tensors is one int of flag bits
(``param_flags``), one bit per parameter.  The bits are written here once, for the launcher
(``launch.py``, which sets them) and the kernel (``triton/draw.py``, which tests them).
"""

from __future__ import annotations

__all__ = ["PARAM_FLAG"]

# parameter -> its bit in param_flags (set: the parameter is a [B] tensor)
PARAM_FLAG = {"num_draft": 1, "temperature": 2, "top_k": 4, "top_p": 8, "seed": 16, "offset": 32, "min_p": 64}
assert len(set(PARAM_FLAG.values())) == len(PARAM_FLAG) and all(b & (b - 1) == 0 for b in PARAM_FLAG.values())
