"""alpha on the demo prompts as ``SpeculativeDecoder.generate`` counts it.

``stats.alpha`` is the drafts accepted over the drafts reached (a draft after a rejection in
its row is not reached): the per-position acceptance rate of E(K) = (1 - alpha^(K+1)) /
(1 - alpha).  This decodes each of the five demo prompts (``DEMO_PROMPTS`` of
``training/default_pair/prompts.py``) alone (batch 1), greedily, as plain text and with the chat
template, with each drafter at each K, and prints alpha pooled over the prompts of a set and per
prompt, with the tokens per target call.
No timings (those are bench_e2e.py's).

    python bench/decoding/demo_alpha.py                                  # the embedded pair + feature draft
    python bench/decoding/demo_alpha.py --drafters model --ks 2 --feature-draft DIR
    python bench/decoding/demo_alpha.py --ks auto --threads 2                 # K chosen each step, as the main job
    python bench/decoding/demo_alpha.py --drafters feature --ks 2,3 --draft-confidence 0.4   # drafts stop when unsure
    python bench/decoding/demo_alpha.py --tiny-random --drafters model --kinds plain   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "training"))
sys.path.insert(0, os.path.dirname(HERE))  # harness, for the conditions


def _ks(text: str) -> list:
    out = []
    for part in text.split(","):
        if part == "auto":
            out.append(part)
            continue
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"--ks: each K must be a positive int or auto, got {part!r}")
        out.append(int(part))
    return out


def _reached(stats) -> int:
    """Drafts reached, from the step history, as ``stats.alpha`` counts them: a row-step that
    accepted n of its K_b drafts reached min(n + 1, K_b) (n < 0: the row was unusable)."""
    return sum(min(n + 1, kb) for h in stats.history for kb, n in zip(h["num_draft"], h["accepted"]) if n >= 0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="model,feature", help="of model, feature (comma-separated)")
    ap.add_argument("--ks", type=_ks, default=[1, 2, 3])
    ap.add_argument("--kinds", default="plain,chat", help="of plain, chat (comma-separated)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--feature-draft", default=None, help="default: the embedded one")
    ap.add_argument("--tiny-random", action="store_true", help="the CLI's tiny random pair (smoke runs)")
    ap.add_argument("--draft-confidence", type=float, default=0.0,
                    help="generate's draft_confidence: a row stops drafting below this estimate (0: off)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    drafters = args.drafters.split(",")
    kinds = args.kinds.split(",")
    if any(d not in ("model", "feature") for d in drafters) or any(k not in ("plain", "chat") for k in kinds):
        raise SystemExit(f"--drafters must be of model, feature and --kinds of plain, chat; got {args.drafters!r}, "
                         f"{args.kinds!r}")

    import torch

    from default_pair.prompts import DEMO_PROMPTS, encode
    from specdec_kernels import SpeculativeDecoder

    torch.set_num_threads(args.threads)
    if args.tiny_random:
        if "feature" in drafters and args.feature_draft is None:
            raise SystemExit("--tiny-random with the feature drafter needs --feature-draft DIR")
        from specdec_kernels.models.tiny import tiny_random_pair as build_tiny_random_pair

        draft, target, tok = build_tiny_random_pair(seed=0)
    else:
        from specdec_kernels.models.embedded import default_pair

        draft, target, tok = default_pair(with_draft="model" in drafters)
    decs = {}
    for name in drafters:
        if name == "model":
            decs[name] = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok)
        else:
            from specdec_kernels.decoding.drafters.feature_model import default_feature_draft_path

            decs[name] = SpeculativeDecoder(draft=args.feature_draft or default_feature_draft_path(), target=target,
                                            tokenizer=tok, drafter="feature")
    out = {"conditions": _conditions(), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
           "draft_confidence": args.draft_confidence, "sets": [], "prompts": []}
    print(f"# alpha = drafts accepted / drafts reached; batch 1, greedy, {args.max_new_tokens} new tokens, "
          f"draft_confidence {args.draft_confidence}")
    for kind in kinds:
        prompts = [(p, encode(tok, kind, p)) for p in DEMO_PROMPTS]
        for name, dec in decs.items():
            for k in args.ks:
                acc = reached = steps = toks = 0
                for text, ids in prompts:
                    s = dec.generate([ids], max_new_tokens=args.max_new_tokens, num_draft_tokens=k,
                                     draft_confidence=args.draft_confidence).stats
                    acc, reached = acc + s.accepted_tokens, reached + _reached(s)
                    steps, toks = steps + s.row_steps, toks + s.generated_tokens
                    out["prompts"].append(dict(kind=kind, drafter=name, k=k, prompt=text, alpha=s.alpha,
                                               tokens_per_call=s.mean_tokens_per_target_call))
                alpha = acc / reached if reached else None
                out["sets"].append(dict(kind=kind, drafter=name, k=k, alpha=alpha, accepted=acc, reached=reached,
                                        tokens_per_call=toks / steps))
                print(f"{kind:5s} {name:7s} K={k}: alpha " + ("-" if alpha is None else f"{alpha:.3f}")
                      + f" ({acc}/{reached}), {toks / steps:.2f} tokens per target call; per prompt: "
                      + ", ".join("-" if r["alpha"] is None else f"{r['alpha']:.2f}"
                                  for r in out["prompts"][-len(prompts):]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _conditions() -> dict:
    import harness
    import torch

    return {"device": harness.device_name(torch.device("cpu")), "date": harness.now(), **harness.versions()}


if __name__ == "__main__":
    main()
