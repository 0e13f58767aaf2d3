"""The decoding loop over a pair of Hugging Face models: draft -> verify -> roll back -> emit.

``decoder`` (``SpeculativeDecoder``, the public class), the parts it is assembled from
(``parts``), a call's arguments (``call``, checked by ``arguments``; transformers' folded in by
``transformers_adapter/``), its state (``state``), the loop (``loop``: the step, the cache layout),
the prefill, what each row emits (``emit``), the statistics and the cost model behind
``num_draft_tokens="auto"`` (``stats``, ``cost_model``), tree drafting (``tree``), the models'
forwards (``runners``), and the drafters (``drafters/``).  It calls
the ops (``specdec_kernels.ops``); the CPU accelerators (``specdec_kernels.cpu``) are handed to it.
"""

from .decoder import GenerationResult, SpeculativeDecoder

__all__ = ["GenerationResult", "SpeculativeDecoder"]
