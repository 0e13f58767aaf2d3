"""specdec-kernels: fused kernels for exact speculative decoding of Hugging Face models.

The layers, each a folder, importing one way (``ops`` <- ``decoding`` <- the front-ends):

- ``ops``: ``fused_verify`` verifies K drafted tokens against the target's raw logits in one
  Triton launch (or a vectorised PyTorch path on CPU); ``fused_verify_tree`` a tree of them;
  ``ops.reference`` holds the plain-PyTorch ground truth; ``ops.kv.cache`` the cache roll-back.
- ``decoding``: ``SpeculativeDecoder`` runs batched, KV-cached speculative decoding over
  Hugging Face models, with its drafters in ``decoding.drafters``.
- ``cpu``: optional CPU accelerators the decoder is handed; ``models``: the embedded pair and a
  tiny random one.
- front-ends: ``hf.generate`` (transformers' ``model.generate(custom_generate=...)``), the
  ``specdec`` CLI (``cli``), ``integrations`` (vLLM, FlashInfer's signature), and ``audit``
  (``specdec audit``: the exactness audit of a speculative sampler or generator).
"""

from . import hf  # noqa: F401  (public: specdec_kernels.hf.generate, transformers' custom_generate)
from .decoding import GenerationResult, SpeculativeDecoder
from .ops import (TreeVerifyOutput, VerifyOutput, VerifyOutputWithLogprobs, fused_verify, fused_verify_packed,
                  fused_verify_tree)

__all__ = ["GenerationResult", "SpeculativeDecoder", "TreeVerifyOutput", "VerifyOutput", "VerifyOutputWithLogprobs",
           "fused_verify", "fused_verify_packed", "fused_verify_tree"]
__version__ = "0.1.0"
