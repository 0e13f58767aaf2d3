"""``specdec audit``: an exactness audit of a speculative sampler (a verifier) or of a whole
speculative generator, by statistical tests against laws computed from the definitions.

- ``protocol``: the verifier's call (``SamplingParams``, ``Call``); ``adapters``: ours, vLLM,
  FlashInfer, transformers and ``module:function``; ``vllm_bridge``/``vllm_worker``: vLLM run in
  its own environment.
- ``laws``: the exact laws in float64 and the chi-square; ``sampler``: the audit's own sampler
  and its mutants; ``cases``/``checks``/``run``: the verifier cases and how they are run.
- ``generators``: Markov-chain models whose law of whole continuations is known, and the
  generator audit; ``report``: the table and JSON.  docs/audit.md describes every case.
"""

from .protocol import Call, SamplingParams, make_params
from .run import run_verifier_audit

__all__ = ["Call", "SamplingParams", "make_params", "run_verifier_audit"]
