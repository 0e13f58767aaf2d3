"""Where a cross-tokenizer step's time goes on the real pair (bench/decoding/real_pair.py), at batch 1.

For each setting, SpeculativeDecoder(draft=, target=, tokenizer=, draft_tokenizer=, cpu_linear=)
decodes the chosen prompts one at a time (seed = prompt index) and the totals of its
DecodingStats are printed: wall time, tokens, verify steps, draft / target-verify / prefill
seconds, accepted and drafted tokens, tokens/s; the target alone (``target.generate``, the same
sampling) is timed first on the same prompts.  The settings cross K (4, 1), draft_confidence
and the CPU linear layer (``cpu_linear="auto"``: the batch-invariant skinny layer; ``"torch"``:
transformers' ``nn.Linear``), at T = 1.  One process, one run: read ratios within it.

    python bench/decoding/cross_step_costs.py [--prompts 0,6] [--max-new-tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import harness  # noqa: E402
import real_pair  # noqa: E402

SETTINGS = [  # (name, cpu_linear, generate's keywords)
    ("K=4", "auto", dict(num_draft_tokens=4)),
    ("K=1", "auto", dict(num_draft_tokens=1)),
    ("K=6, draft_confidence 0.4", "auto", dict(num_draft_tokens=6, draft_confidence=0.4)),
    ("K=4, cpu_linear torch", "torch", dict(num_draft_tokens=4)),
    ("K=1, cpu_linear torch", "torch", dict(num_draft_tokens=1)),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=str(real_pair.DEFAULT_CACHE))
    ap.add_argument("--prompts", default="0,6", help="indices into real_pair.PROMPTS")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results", "cpu-xeon", "cross_tokenizer",
                                                  "step_costs.txt"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdec_kernels import SpeculativeDecoder

    draft, dtok, target, ttok = real_pair.load_real_pair(args.cache_dir)
    sel = [int(p) for p in args.prompts.split(",")]
    prompts = {p: real_pair.chat_prompt_ids(ttok, real_pair.PROMPTS[p][1])[0].tolist() for p in sel}
    n = args.max_new_tokens
    lines = [f"# cross_step_costs {harness.now()}: python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
             f"# device: {harness.device_name(torch.device('cpu'))}; versions: {harness.versions()}",
             f"# prompts {sel}, batch 1, T = 1 (top_k 0, top_p 1), {n} new tokens, stop at EOS; "
             "seconds summed over the prompts"]
    t0 = time.perf_counter()
    tokens = 0
    for p in sel:
        torch.manual_seed(p)
        out = target.generate(torch.tensor([prompts[p]]), max_new_tokens=n, do_sample=True, top_k=0, top_p=1.0)
        tokens += out.shape[1] - len(prompts[p])
    t = time.perf_counter() - t0
    lines.append(f"target alone: {tokens} tokens {t:.2f} s, {tokens / t:.3f} tokens/s")
    print(lines[-1], flush=True)
    decoders = {}
    for name, cpu_linear, kw in SETTINGS:
        dec = decoders.get(cpu_linear)
        if dec is None:
            dec = decoders[cpu_linear] = SpeculativeDecoder(draft=draft, target=target, tokenizer=ttok,
                                                            draft_tokenizer=dtok, cpu_linear=cpu_linear)
            dec.generate([prompts[sel[0]]], max_new_tokens=4, num_draft_tokens=2, temperature=1.0, seed=0)  # warm-up
        tot = dict(seconds=0.0, tokens=0, steps=0, draft_s=0.0, verify_s=0.0, prefill_s=0.0, accepted=0, drafted=0)
        for p in sel:
            s = dec.generate([prompts[p]], max_new_tokens=n, temperature=1.0, seed=p, **kw).stats
            for k, v in (("seconds", s.total_time_s), ("tokens", s.generated_tokens), ("steps", s.iterations),
                         ("draft_s", s.draft_time_s), ("verify_s", s.target_time_s), ("prefill_s", s.prefill_time_s),
                         ("accepted", s.accepted_tokens), ("drafted", s.drafted_tokens)):
                tot[k] += v
        per_step = tot["verify_s"] / max(tot["steps"], 1)
        lines.append(f"{name} ({s.vocabulary}): " + ", ".join(f"{k} {round(v, 2)}" for k, v in tot.items())
                     + f"; {tot['tokens'] / tot['seconds']:.3f} tokens/s; verify {per_step:.3f} s a step; "
                       f"mean K {s.mean_num_draft_tokens:.2f} (last prompt)")
        print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
