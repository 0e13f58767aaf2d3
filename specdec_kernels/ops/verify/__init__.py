"""The verification op, ``fused_verify`` and ``fused_verify_packed``, in four layers: the public
ops (``api``), the argument checks (``args``), the launcher and the choice of backend
(``launch``, with the split kernel's scratch in ``workspace``), and on the CPU the vectorised
torch path (``torch_path``).  The Triton kernel is in ``triton/`` (the split kernel and its
stages, and the device functions it shares with the tree kernel); the pure-PyTorch references,
the ground truth of all of them, in ``reference/``.

Everything the old single module exported is importable from here: ``specdec_kernels.ops.verify.X``.
"""

from .api import (METHODS, VerifyOutput, VerifyOutputWithLogprobs, check_sampling_scalars, check_temperature,
                  fused_verify, fused_verify_packed, verify_normalized, verify_prechecked)
from .args import DRAFT_PROBS_SUM_TOL, FloatArg, IntArg, host_value_checks, normalize_arguments
from .launch import interpreter_problem, interpreting, split_kernel_meta

__all__ = ["VerifyOutput", "VerifyOutputWithLogprobs", "check_sampling_scalars", "fused_verify", "fused_verify_packed",
           "host_value_checks"]
