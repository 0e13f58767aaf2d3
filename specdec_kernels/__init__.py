"""specdec-kernels: fused kernels for exact speculative decoding of Hugging Face models.

``fused_verify`` verifies K drafted tokens against the target's raw logits in one Triton launch
(or a vectorised PyTorch path on CPU); ``reference`` holds the plain-PyTorch ground truth;
``fused_verify_tree`` verifies a tree of drafted tokens exactly (both proposal rules);
``SpeculativeDecoder`` runs batched, KV-cached speculative decoding over Hugging Face models;
``hf.generate`` runs it from transformers' ``model.generate(custom_generate=...)``.
"""

from . import cpu_linear as _cpu_linear  # noqa: F401  (registers the skinny_linear ops' fakes)
from . import hf  # noqa: F401  (specdec_kernels.hf.generate: transformers' custom_generate)
from .decoder import GenerationResult, SpeculativeDecoder
from .tree_verify import TreeVerifyOutput, fused_verify_tree
from .verify import VerifyOutput, VerifyOutputWithLogprobs, fused_verify, fused_verify_packed

__all__ = ["GenerationResult", "SpeculativeDecoder", "TreeVerifyOutput", "VerifyOutput", "VerifyOutputWithLogprobs",
           "fused_verify", "fused_verify_packed", "fused_verify_tree"]
__version__ = "0.1.0"
