"""vLLM's engine with and without the specdec_kernels plugin: generated tokens per second.

Runs in vLLM's environment (``.venv-vllm/bin/python bench/integrations/bench_vllm_engine.py``, built by
scripts/bootstrap_vllm.sh).  One ``vllm.LLM`` per drafting method (the embedded target; the embedded
draft model as ``draft_model``, or ``ngram`` prompt lookup), its engine core in this process, and
for each batch size (default 1 and 8) the same greedy requests generated with vLLM's own
rejection sampler and with the plugin's (``specdec_kernels.integrations.vllm.patch()`` /
``unpatch()`` between calls), in alternating order over ``--rounds`` rounds after one warm-up of
each, so that the machine's drift hits both alike.  Greedy requests: both samplers must emit the
same tokens (checked: a difference is printed and the row is marked), so the two rows time the
same work.  Each request generates ``--max-tokens`` tokens (``ignore_eos``).

Columns: tokens_per_s (all requests' generated tokens over the call's wall time, median over the
rounds; rounds_s: every round's seconds), speedup_plugin (the plugin's tokens/s over vLLM's own in
the same rounds), and the share of steps that went through the fused op (``fused_steps``; the rest
fell back to vLLM's sampler, see ``fallback_reason``).  The verification step is a small part of an
engine step on a CPU (the target's forward dominates): the ratio says what the plugin costs or
saves end to end there, not what the kernel does on a GPU.

    .venv-vllm/bin/python bench/integrations/bench_vllm_engine.py                 # draft_model and ngram, B = 1 and 8
    .venv-vllm/bin/python bench/integrations/bench_vllm_engine.py --methods ngram --batches 1 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: patch() reaches it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the embedded pair is small

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
from harness import append_csv, cpu_model, now, print_table, versions  # noqa: E402

from specdec_kernels.models import embedded as models  # noqa: E402
from specdec_kernels.integrations import vllm as sv  # noqa: E402

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
    """The embedded target's converted directory: ``$SPECDEC_VLLM_TARGET``, else the cache's path
    (converted from the GGUF wheel by ``models.default_target_path()`` where gguf is installed:
    the main environment)."""
    path = os.environ.get("SPECDEC_VLLM_TARGET") or models.default_target_path(convert=False)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"the embedded target must be converted first (SPECDEC_VLLM_TARGET or {path}): "
                                f"run specdec_kernels.models.embedded.default_target_path() in the main environment")
    return path


def speculative_config(method: str, k: int) -> dict:
    """vLLM's speculative_config for the embedded draft model or n-gram prompt lookup."""
    if method == "draft_model":
        return {"method": "draft_model", "model": models.default_draft_path(), "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    raise ValueError(f"method must be 'draft_model' or 'ngram', got {method!r}")


def make_llm(method: str, k: int, max_num_seqs: int, max_model_len: int = 512):
    """``vllm.LLM`` on the embedded target, fp32, eager, its engine core in this process."""
    from vllm import LLM

    return LLM(model=target_path(), speculative_config=speculative_config(method, k), enforce_eager=True,
               max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype="float32", seed=0,
               gpu_memory_utilization=0.25)


def timed_generate(llm, prompts, params, plugin: bool, counter: list):
    """(token ids per request, seconds, fused steps) of one generate call with the chosen sampler."""
    (sv.patch if plugin else sv.unpatch)()
    counter.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], dt, len(counter)


def bench_method(method: str, batches: list, rounds: int, max_tokens: int, k: int, stamp: str, ver: dict) -> list:
    from vllm import SamplingParams

    counter: list = []
    real = sv.fused_rejection_sample

    def counting(*args, **kwargs):
        counter.append(1)
        return real(*args, **kwargs)

    sv.fused_rejection_sample = counting
    llm = make_llm(method, k, max(batches))
    rows = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for B in batches:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(B)]
            for plugin in (False, True):  # warm-up of each
                timed_generate(llm, prompts, params, plugin, counter)
            secs = {False: [], True: []}
            outs, fused = {}, 0
            for r in range(rounds):
                for plugin in ((False, True) if r % 2 == 0 else (True, False)):
                    ids, dt, n = timed_generate(llm, prompts, params, plugin, counter)
                    secs[plugin].append(dt)
                    outs[plugin] = ids
                    if plugin:
                        fused = n
            same = outs[False] == outs[True]
            n_tok = sum(len(t) for t in outs[True])
            tps = {p: n_tok / statistics.median(s) for p, s in secs.items()}
            print(f"# {method} B={B}: vLLM's sampler {tps[False]:.1f} tok/s, plugin {tps[True]:.1f} tok/s "
                  f"({tps[True] / tps[False]:.3f}x){'' if same else ' OUTPUTS DIFFER'}", flush=True)
            for plugin in (False, True):
                rows.append(dict(method=method, sampler="specdec plugin" if plugin else "vLLM", B=B, K=k,
                                 max_tokens=max_tokens, rounds=rounds, tokens=n_tok,
                                 tokens_per_s=tps[plugin], median_s=statistics.median(secs[plugin]),
                                 rounds_s=" ".join(f"{x:.3g}" for x in secs[plugin]),
                                 speedup_plugin=tps[True] / tps[False], same_tokens=same,
                                 fused_steps=fused if plugin else 0, device=f"CPU {cpu_model()}",
                                 threads=torch.get_num_threads(), date=stamp, **ver))
    finally:
        sv.unpatch()
        sv.fused_rejection_sample = real
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - an engine already down
            pass
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="draft_model,ngram")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--out", default="bench/results/local")
    args = ap.parse_args(argv)
    try:
        import vllm
    except ImportError:
        sys.exit("bench_vllm_engine needs vLLM: run it with .venv-vllm/bin/python "
                 "(scripts/bootstrap_vllm.sh builds it)")
    ver = dict(versions(), vllm=vllm.__version__)
    stamp = now()
    print(f"# bench_vllm_engine on CPU {cpu_model()}; {ver}; {stamp}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for method in args.methods.split(","):
        if method not in ("draft_model", "ngram"):
            sys.exit(f"--methods must list draft_model and/or ngram, got {method!r}")
        rows += bench_method(method, batches, args.rounds, args.max_tokens, args.k, stamp, ver)
    os.makedirs(args.out, exist_ok=True)
    append_csv(os.path.join(args.out, "bench_vllm_engine.csv"), rows)
    cols = ["method", "sampler", "B", "K", "tokens", "tokens_per_s", "median_s", "rounds_s", "speedup_plugin",
            "same_tokens", "fused_steps"]
    text = print_table(rows, cols)
    with open(os.path.join(args.out, "bench_vllm_engine.txt"), "w") as f:
        f.write(f"# bench_vllm_engine on CPU {cpu_model()}; {ver}; {stamp}\n{text}\n")
    print(f"wrote {args.out}/bench_vllm_engine.csv")


if __name__ == "__main__":
    main()
