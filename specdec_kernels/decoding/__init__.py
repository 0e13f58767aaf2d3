"""The decoding loop over a pair of Hugging Face models: draft -> verify -> roll back -> emit.

``decoder`` (``SpeculativeDecoder``), its per-call state (``state``), the prefill, the
statistics and the cost model behind ``num_draft_tokens="auto"`` (``stats``), tree drafting
(``tree``), the models' forwards (``runners``), the arguments (``arguments``, and transformers'
in ``transformers_args`` and ``logits_processors``), and the drafters (``drafters/``).  It calls
the ops (``specdec_kernels.ops``); the CPU accelerators (``specdec_kernels.cpu``) are handed to it.
"""

from .decoder import GenerationResult, SpeculativeDecoder

__all__ = ["GenerationResult", "SpeculativeDecoder"]
