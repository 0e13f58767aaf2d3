"""Optional CPU accelerators for the decoding loop: ``skinny_linear`` (fp32 linear layers for
the few-row inputs of decode steps, ``torch.ops.specdec.skinny_linear``) and ``lean_forward``
(a Llama decode step without Hugging Face's per-call overhead).  Both give the same tokens as
the plain forwards (``skinny_linear``: a row's result independent of the other rows); the
decoder is handed them as a ``CpuAccelerator`` (``SpeculativeDecoder(accelerator=...)``, or built
from its ``cpu_linear`` and ``lean_forward`` arguments).
"""

from .accelerator import CpuAccelerator

__all__ = ["CpuAccelerator"]
