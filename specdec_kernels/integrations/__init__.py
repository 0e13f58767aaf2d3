"""Integrations of the verify ops (``fused_verify``, ``fused_verify_packed``) into engines and libraries.

- ``specdec_kernels.integrations.vllm``: a drop-in for vLLM V1's rejection sampler, registered as
  a vLLM general plugin (entry point ``vllm.general_plugins``) that is active when
  ``SPECDEC_VLLM=1``.
- ``specdec_kernels.integrations.flashinfer``: ``chain_speculative_sampling``, FlashInfer's
  ``flashinfer.sampling.chain_speculative_sampling`` (its arguments, outputs and counters) on
  ``fused_verify(..., target_is_probs=True)``; imports no FlashInfer.

Nothing here imports an engine until its module is imported.
"""
