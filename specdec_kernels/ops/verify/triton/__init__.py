"""``fused_verify``'s Triton kernel: the split kernel (``split_kernel``) with its stages (``stage1``,
``stage2``), the warp's candidate keys and top-k/top-p/min-p from them (``candidates``) and its
final draw (``draw``), and the device functions it shares with ``fused_verify_tree``'s kernel
(``common``).  Importing a module here imports Triton; the launcher imports the kernel on its
first launch, so the torch path runs without Triton.
"""
