"""A small vLLM engine on the embedded target, run in this process (so that
``specdec_kernels.integrations.vllm.patch()`` / ``unpatch()`` switch the sampler between calls).

The target is the converted directory of ``specdec_kernels.models`` (``$SPECDEC_VLLM_TARGET``,
else the cache's path, which the main environment's wrapper test converts first); the draft is
the shipped ``specdec_kernels/assets/draft``, loaded by vLLM as it is.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the engine's memory is small

from specdec_kernels import models  # noqa: E402

NUM_SPEC = 3
MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a small robot",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The number 12 is 12, the number 13 is",
    "Water boils at",
    "Translate to French: good morning ->",
]


def target_path() -> str:
    path = os.environ.get("SPECDEC_VLLM_TARGET") or models.default_target_path(convert=False)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"the embedded target must be converted first (SPECDEC_VLLM_TARGET or {path}): "
                                f"run specdec_kernels.models.default_target_path() in the main environment")
    return path


def speculative_config(method: str) -> dict:
    if method == "draft_model":
        return {"method": "draft_model", "model": models.default_draft_path(), "num_speculative_tokens": NUM_SPEC}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": NUM_SPEC, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    raise ValueError(f"method must be 'draft_model' or 'ngram', got {method!r}")


def make_llm(method: str):
    from vllm import LLM

    return LLM(model=target_path(), speculative_config=speculative_config(method), enforce_eager=True,
               max_model_len=256, max_num_seqs=8, dtype="float32", seed=0, gpu_memory_utilization=0.25)


def close_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an engine that is already down
        pass
    del llm
    gc.collect()


def token_ids(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
