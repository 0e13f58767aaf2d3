"""Benchmark of the lean Llama decode step (specdec_kernels.cpu.lean_forward) against the model's own
forward, on the embedded pair, side by side in one run (speed is the ratio).

The decode-step forwards of ``SpeculativeDecoder``: the draft's one-token step and the target's
step over M = 1 (the target alone) and M = K + 1 = 2..5 (a verify) new tokens, after a 64-token
prompt in the KV cache, batch 1, with the decoder's linear layers (``skinny_linear`` on fp32
CPU; ``--linear torch`` for torch's).  The two providers alternate call by call, each appending
to its own copy of the cache, which is cropped back after every call; the logits of the two are
compared bit for bit before timing.

With ``--decoder``, also ``SpeculativeDecoder`` itself with ``lean_forward`` on and off (two
decoders over the same models), run after run in alternation: greedy, batch 1, the first
``--prompts`` prompts of bench_e2e.py one after the other, ``--max-new-tokens`` each, at each K
of ``--ks`` and with the target alone (``generate_target_only``); median tokens/s of
``--rounds`` runs, the token ids of the two compared.

    python bench/cpu/bench_lean_forward.py --threads 1
    python bench/cpu/bench_lean_forward.py --threads 1 --decoder

Rows append to bench/results/cpu/bench_lean_forward.csv (or --csv).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
sys.path.insert(0, BENCH)  # harness
sys.path.insert(0, os.path.join(BENCH, "decoding"))  # bench_e2e, for --decoder's prompts
import harness  # noqa: E402


def run(model, name: str, rows: list[int], reps: int, ctx: int = 64) -> list[dict]:
    from specdec_kernels.ops.kv.cache import crop_cache_, new_cache
    from specdec_kernels.decoding.runners import ModelRunner
    from specdec_kernels.cpu.lean_forward import LeanLlamaStep

    runner = ModelRunner(model, name)
    lean = LeanLlamaStep(model)
    g = torch.Generator().manual_seed(0)
    V = runner.vocab_size
    prompt = torch.randint(0, V, (1, ctx), generator=g)
    out = []
    with torch.inference_mode():
        base = new_cache(model)
        runner.forward(base, prompt, None, torch.arange(ctx)[None], 0, 1)
        caches = {"model forward": base, "lean step": copy.deepcopy(base)}
        calls = {
            "model forward": lambda c, x, p, m: runner.forward(c, x, None, p, ctx, m),
            "lean step": lambda c, x, p, m: lean.step(c, x, None, p, m),
        }
        for m in rows:
            x = torch.randint(0, V, (1, m), generator=g)
            pos = torch.arange(ctx, ctx + m)[None]
            res = {}
            for prov, fn in calls.items():
                res[prov] = fn(caches[prov], x, pos, m)
                crop_cache_(caches[prov], ctx)
            same = torch.equal(res["model forward"], res["lean step"])
            times = {prov: [] for prov in calls}
            for _ in range(reps):
                for prov, fn in calls.items():
                    t0 = time.perf_counter()
                    fn(caches[prov], x, pos, m)
                    times[prov].append((time.perf_counter() - t0) * 1e3)
                    crop_cache_(caches[prov], ctx)
            med = {}
            for prov, ts in times.items():
                ts.sort()
                med[prov] = ts[len(ts) // 2]
                out.append({"model": name, "provider": prov, "new_tokens": m, "ms": med[prov],
                            "q20_ms": ts[len(ts) // 5], "q80_ms": ts[(4 * len(ts)) // 5], "same_logits": same})
            for r in out[-2:]:
                r["speedup_vs_model_forward"] = med["model forward"] / r["ms"]
    return out


def run_decoder(draft, target, tok, prompts: list, ks: list, max_new: int, rounds: int) -> list[dict]:
    from specdec_kernels import SpeculativeDecoder

    decs = {"model forward": SpeculativeDecoder(draft, target, tokenizer=tok, lean_forward=False),
            "lean step": SpeculativeDecoder(draft, target, tokenizer=tok)}
    ids = [tok(p)["input_ids"] for p in prompts]
    out = []
    for k in ["target alone"] + ks:
        times = {prov: [] for prov in decs}
        tokens = {}
        for _ in range(rounds):
            for prov, dec in decs.items():
                t0 = time.perf_counter()
                res = []
                for row in ids:  # batch 1, one prompt after the other
                    if k == "target alone":
                        r = dec.generate_target_only([row], max_new_tokens=max_new, eos_token_id=[])
                    else:
                        r = dec.generate([row], max_new_tokens=max_new, num_draft_tokens=k, eos_token_id=[])
                    res += r.token_ids
                times[prov].append(time.perf_counter() - t0)
                tokens[prov] = res
        same = tokens["model forward"] == tokens["lean step"]
        n = sum(len(t) for t in tokens["lean step"])
        med = {prov: sorted(ts)[len(ts) // 2] for prov, ts in times.items()}
        for prov in decs:
            out.append({"model": "decoder", "provider": prov, "k": k, "tokens": n, "tokens_per_s": n / med[prov],
                        "speedup_vs_model_forward": med["model forward"] / med[prov], "same_ids": same})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=60, help="calls per provider per measurement (alternating)")
    ap.add_argument("--target-rows", default="1,2,3,4,5", help="new tokens per target step (comma-separated)")
    ap.add_argument("--linear", choices=["skinny", "torch"], default="skinny",
                    help="the models' linear layers: skinny_linear (the decoder's default on fp32 CPU) or torch's")
    ap.add_argument("--decoder", action="store_true", help="also SpeculativeDecoder with lean_forward on and off")
    ap.add_argument("--ks", default="1,2,auto", help="with --decoder: K values")
    ap.add_argument("--prompts", type=int, default=5, help="with --decoder: the first N prompts of bench_e2e.py")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="with --decoder: tokens per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="with --decoder: runs per provider (median)")
    ap.add_argument("--csv", default=os.path.join(BENCH, "results", "cpu", "bench_lean_forward.csv"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(" ".join(["python"] + sys.argv))
    cond = {"device": harness.device_name(torch.device("cpu")), "date": harness.now(),
            "threads": torch.get_num_threads(), "linear": args.linear, **harness.versions()}
    print(cond)
    from specdec_kernels.cpu.skinny_linear import use_skinny_linear
    from specdec_kernels.models.embedded import default_pair

    draft, target, tok = default_pair()
    import contextlib

    results = []
    for name, model, rows in (("draft", draft, [1]),
                              ("target", target, [int(r) for r in args.target_rows.split(",")])):
        with use_skinny_linear(model) if args.linear == "skinny" else contextlib.nullcontext():
            results += run(model, name, rows, args.reps)
    cols = ["model", "provider", "new_tokens", "ms", "q20_ms", "q80_ms", "speedup_vs_model_forward", "same_logits"]
    harness.print_table(results, cols)
    ok = all(r["same_logits"] for r in results)
    if args.decoder:
        from bench_e2e import PROMPTS

        ks = [k if k == "auto" else int(k) for k in args.ks.split(",")]
        dec_rows = run_decoder(draft, target, tok, PROMPTS[: args.prompts], ks, args.max_new_tokens, args.rounds)
        dcols = ["model", "provider", "k", "tokens", "tokens_per_s", "speedup_vs_model_forward", "same_ids"]
        harness.print_table(dec_rows, dcols)
        ok = ok and all(r["same_ids"] for r in dec_rows)
        cols += ["k", "tokens", "tokens_per_s", "same_ids"]
        results += dec_rows
    harness.append_csv(args.csv, [{**cond, **{c: r.get(c) for c in cols}} for r in results])
    if not ok:
        print("the lean step's logits or token ids differ from the model's forward", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
