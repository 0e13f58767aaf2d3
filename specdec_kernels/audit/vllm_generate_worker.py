"""Runs the generator audit's continuations through vLLM's engine (``vllm.LLM`` with a draft model,
V1 engine, its core in this process) inside vLLM's environment:

    python -m specdec_kernels.audit.vllm_generate_worker TARGET_DIR DRAFT_DIR N L K T SEQS OUT [fix-expand]

TARGET_DIR and DRAFT_DIR hold the Markov-chain models (``chains.markov_llama``, saved with
``save_pretrained``); N requests of the one-token prompt ``chains.PROMPT`` each generate L
tokens at temperature T (``ignore_eos``, no tokenizer), K speculative tokens a step (K = 0: the
target alone, no speculative decoding: a control of the engine's own sampling), at most SEQS requests
in a step (``max_num_seqs``: below N, new requests' prefills share steps with others' speculative
steps; at N or more, all are prefilled in one step and decode together).  OUT
(``torch.save``): {"continuations": [[ids]], "versions": {...}} or {"error": ...}.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here: a patch reaches it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the models are tiny

import torch  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    target, draft, n, L, K, T, seqs, out = argv[:8]
    n, L, K, T, seqs = int(n), int(L), int(K), float(T), int(seqs)
    try:
        import vllm
        from vllm import LLM, SamplingParams

        from .chains import PROMPT

        if argv[8:] == ["fix-expand"]:
            import vllm.v1.sample.rejection_sampler as vrs

            from .vllm_worker import _expand_fixed

            vrs.expand_batch_to_tokens = _expand_fixed
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K} if K else None
        llm = LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
                  max_model_len=32, max_num_seqs=seqs, max_num_batched_tokens=max(4096, 4 * seqs),
                  gpu_memory_utilization=0.25, speculative_config=spec)
        params = SamplingParams(temperature=T, max_tokens=L, min_tokens=L, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": list(PROMPT)} for _ in range(n)], params, use_tqdm=False)
        res = {"continuations": [list(o.outputs[0].token_ids) for o in outs],
               "versions": {"vllm": vllm.__version__, "torch in vLLM's environment": torch.__version__}}
    except Exception as e:  # noqa: BLE001 - reported as the case's error
        res = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}
    torch.save(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
