"""The stages of the default pair's build (``training/make_default_pair.py``): the prompts
(``prompts``), the target's corpus (``corpus``), the draft model and its vocabulary (``draft``,
trained on ``batches`` of the corpus), its measurement (``evaluate``) and the draft directory
(``save``)."""

import warnings

# transformers' notices while the target generates and the draft trains
warnings.filterwarnings("ignore", message=".*past_key_values.*")
warnings.filterwarnings("ignore", category=FutureWarning)
