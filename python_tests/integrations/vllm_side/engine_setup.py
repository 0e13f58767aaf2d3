"""A small vLLM engine on the embedded target, run in this process (so that
``specdec_kernels.integrations.vllm.patch()`` / ``unpatch()`` switch the sampler between calls).

The target is the converted directory of ``specdec_kernels.models.embedded`` (``$SPECDEC_VLLM_TARGET``,
else the cache's path, which the main environment's wrapper test converts first); the draft is
the shipped ``specdec_kernels/assets/draft``, loaded by vLLM as it is.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

# The engine's set-up is the benchmark's (bench/integrations/bench_vllm_engine.py): the same prompts, target
# directory and speculative configurations.
_spec = importlib.util.spec_from_file_location(
    "bench_vllm_engine", Path(__file__).resolve().parents[3] / "bench" / "integrations" / "bench_vllm_engine.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

NUM_SPEC = 3
MAX_TOKENS = 32
PROMPTS = bench.PROMPTS
target_path = bench.target_path


def make_llm(method: str):
    return bench.make_llm(method, NUM_SPEC, max_num_seqs=8, max_model_len=256)


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
