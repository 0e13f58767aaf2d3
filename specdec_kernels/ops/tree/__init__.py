"""``fused_verify_tree``: exact verification of a tree of drafts in one step.  The public op and
its launcher (``api``), its Triton kernel (``kernel``, imported on the first launch) and its
pure-PyTorch reference with the proof of exactness (``reference``).
"""

from .api import TreeVerifyOutput, fused_verify_tree, tree_kernel_meta
from .reference import tree_depths, tree_verify_reference

__all__ = ["TreeVerifyOutput", "fused_verify_tree", "tree_depths", "tree_kernel_meta", "tree_verify_reference"]
