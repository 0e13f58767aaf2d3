"""The drafters: what proposes the K tokens of a step.

``model`` (a draft model with its own KV cache), ``feature`` (a draft that reads the target's
hidden states; its network in ``feature_model``), ``prompt_lookup`` (n-gram matches in the row's
own tokens, no network), and what they share: ``sampling`` (the draft's warp and its
counter-based random numbers) and ``vocab`` (restricting a draft's proposals to a token subset).
"""
