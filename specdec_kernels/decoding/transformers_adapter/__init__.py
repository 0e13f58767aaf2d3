"""Transformers' generation arguments on the decoding loop, in one place (imports point one way: the
decoder and ``specdec_kernels.hf`` use these modules; these use only the loop's argument helpers).

- ``config.py``: a ``GenerationConfig`` resolved and folded into the call's arguments
  (``fold_arguments``: ``call.GenerateArgs`` -> ``call.CallArgs``), or refused by field;
- ``processors.py``: transformers' sequence-dependent logits processors on every verified position
  (``VerifyProcessors``), and the warpers read back as temperature, top-k, top-p and min-p;
- ``criteria.py``: stopping criteria per row (``RowCriteria``), streamers and chat messages.

The public entry for transformers' own ``generate(custom_generate=...)`` is ``specdec_kernels.hf``;
the table of ``GenerationConfig`` fields is in ``docs/api.md``.
"""
