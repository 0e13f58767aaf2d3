"""End-to-end speed on the ten demo prompts decoded one at a time (batch 1), against the target alone.

The five demo prompts (``DEMO_PROMPTS`` of ``training/default_pair/prompts.py``) as plain text
and with the chat template, each decoded alone, greedily, ``--max-new-tokens`` each (EOS ends a
row, as in ``generate``), by the target alone (``generate_target_only``: the same loop, cache and
lean step without a draft) and by ``SpeculativeDecoder`` at each ``--ks`` (K or auto), the methods
interleaved round by round in one process after a warm-up round; every method must emit the same
token ids.  Prints tokens/s per round and the median ratio to the target alone; ``--json`` keeps
the figures.  Speed is a ratio measured side by side: the target alone's own speed moves by a
few percent from one process to the next on a VM, so run it several times.

    python bench/decoding/demo_speed.py                                    # feature draft, K = 2 and auto, 1 thread
    python bench/decoding/demo_speed.py --drafter model --ks 2 --rounds 3
    python bench/decoding/demo_speed.py --tiny-random --drafter model --max-new-tokens 8 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "training"))
sys.path.insert(0, HERE)  # demo_alpha

from demo_alpha import _conditions, _ks  # noqa: E402  (the conditions; the same --ks parser)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["feature", "model"], default="feature")
    ap.add_argument("--ks", type=_ks, default=[2, "auto"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny-random", action="store_true", help="the CLI's tiny random pair (smoke runs)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_new_tokens < 1 or args.threads < 1:
        raise SystemExit(f"--rounds, --max-new-tokens and --threads must be >= 1, got {args.rounds}, "
                         f"{args.max_new_tokens}, {args.threads}")
    if args.tiny_random and args.drafter == "feature":
        raise SystemExit("--tiny-random has no feature draft: use --drafter model with it")

    import torch

    from default_pair.prompts import DEMO_PROMPTS, encode
    from specdec_kernels import SpeculativeDecoder

    torch.set_num_threads(args.threads)
    if args.tiny_random:
        from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair

        draft, target, tok = build_tiny_random_pair(seed=0)
        prompts = [tok(p)["input_ids"] for p in DEMO_PROMPTS] * 2
    else:
        from specdec_kernels.models.embedded import default_pair

        draft, target, tok = default_pair(with_draft=args.drafter == "model")
        prompts = [encode(tok, kind, p) for kind in ("plain", "chat") for p in DEMO_PROMPTS]
    if args.drafter == "feature":
        from specdec_kernels.decoding.drafters.feature_model import default_feature_draft_path

        dec = SpeculativeDecoder(draft=default_feature_draft_path(), target=target, tokenizer=tok, drafter="feature")
    else:
        dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok)

    methods = ["target"] + [f"K={k}" for k in args.ks]

    def run(method: str) -> tuple:
        seconds, tokens, ids = 0.0, 0, []
        for p in prompts:
            t0 = time.perf_counter()
            if method == "target":
                r = dec.generate_target_only([p], max_new_tokens=args.max_new_tokens)
            else:
                k = method[2:]
                r = dec.generate([p], max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=k if k == "auto" else int(k))
            seconds += time.perf_counter() - t0
            tokens += len(r.token_ids[0])
            ids.append(r.token_ids[0])
        return tokens / seconds, ids

    for m in methods:  # warm-up round (allocations, the draft's output-layer copy)
        run(m)
    speeds = {m: [] for m in methods}
    ref = None
    for r in range(args.rounds):
        for m in methods:
            tps, ids = run(m)
            if ref is None:
                ref = ids
            if ids != ref:
                raise SystemExit(f"{m} emitted other token ids than the target alone: not greedy-exact")
            speeds[m].append(tps)
        print(f"round {r + 1}: " + ", ".join(f"{m} {v[-1]:.1f}" for m, v in speeds.items()) + " tokens/s", flush=True)
    base = statistics.median(speeds["target"])
    out = {"conditions": _conditions(), "drafter": args.drafter, "threads": args.threads,
           "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "prompts": len(prompts),
           "tokens_per_s": speeds,
           "speedup": {m: statistics.median(v) / base for m, v in speeds.items()}}
    print(f"# ten demo prompts one at a time, batch 1, greedy, {args.max_new_tokens} new tokens, {args.threads} "
          f"thread(s), {args.drafter} drafter; median of {args.rounds} interleaved rounds; same token ids")
    for m, v in speeds.items():
        print(f"{m:8s} {statistics.median(v):7.1f} tokens/s  {out['speedup'][m]:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
