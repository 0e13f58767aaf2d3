"""The first ``generate`` of a decoder against the warm ones: what preparing the CPU linear
path's weights costs (checking which weights fp16 holds exactly, making those copies), against
what loading the models cost.

Per pair, side by side in one run: the models' load (or random init), then a new
``SpeculativeDecoder``: its construction, its first ``generate`` and two more; then a second
decoder over the same models: its construction and first ``generate`` (the weights' copies are
kept per model, so it should cost what a warm call costs).

    python bench/decoding/bench_first_call.py --threads 1                     # the embedded pair
    python bench/decoding/bench_first_call.py --threads 1 --pair qwen-shapes  # random weights in the shapes of
                                                                    # Qwen2.5-0.5B drafting for 1.5B
    python bench/decoding/bench_first_call.py --threads 1 --pair qwen-shapes --fp16-exact  # weights rounded
                                                                    # through fp16 (every copy made)

Writes bench_first_call.{csv,txt} under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
import harness  # noqa: E402

# (hidden, layers, heads, kv heads, mlp, vocab) of the Qwen2.5 models the first-call figure came from
QWEN = {"draft": (896, 24, 14, 2, 4864, 151936), "target": (1536, 28, 12, 2, 8960, 151936)}


def _qwen(shape, seed: int, fp16_exact: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, mlp, vocab = shape
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg).eval()
    if fp16_exact:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    return model


def load(args):
    t0 = time.perf_counter()
    if args.pair == "embedded":
        from specdec_kernels.models.embedded import default_pair

        draft, target, _ = default_pair()
        name = "embedded (SmolLM2-135M-Instruct + shipped draft)"
    else:
        target = _qwen(QWEN["target"], 0, args.fp16_exact)
        draft = _qwen(QWEN["draft"], 1, args.fp16_exact)
        name = "random weights, Qwen2.5-1.5B target / 0.5B draft shapes" + (", fp16-exact" if args.fp16_exact else "")
    return draft, target, name, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["embedded", "qwen-shapes"], default="embedded")
    ap.add_argument("--fp16-exact", action="store_true", help="qwen-shapes: round every weight through fp16")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results/local")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec_kernels import SpeculativeDecoder

    draft, target, name, t_load = load(args)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    rows = [dict(step="load", seconds=t_load)]

    def timed(label, fn):
        t0 = time.perf_counter()
        out = fn()
        rows.append(dict(step=label, seconds=time.perf_counter() - t0))
        return out

    dec = timed("decoder 1: construction", lambda: SpeculativeDecoder(draft=draft, target=target))
    for i in range(3):
        timed(f"decoder 1: generate {i + 1}", lambda: dec.generate(prompt, max_new_tokens=args.tokens))
    dec2 = timed("decoder 2: construction", lambda: SpeculativeDecoder(draft=draft, target=target))
    timed("decoder 2: generate 1", lambda: dec2.generate(prompt, max_new_tokens=args.tokens))
    header = [f"# bench_first_call {harness.now()}: python bench/decoding/bench_first_call.py {' '.join(argv or sys.argv[1:])}",
              f"# device: CPU {harness.cpu_model()} x{torch.get_num_threads()} threads",
              f"# pair: {name}; fp32; cpu_linear {dec.cpu_linear}; greedy, batch 1, {args.tokens} new tokens, "
              f"prompt of 8 tokens; K = 4",
              f"# versions: {harness.versions()}"]
    print("\n".join(header))
    text = harness.print_table(rows, ["step", "seconds"])
    os.makedirs(args.out, exist_ok=True)
    for r in rows:
        r.update(pair=name, threads=torch.get_num_threads(), date=harness.now(), commit=harness.commit())
    harness.append_csv(os.path.join(args.out, "bench_first_call.csv"), rows)
    with open(os.path.join(args.out, "bench_first_call.txt"), "a") as f:
        f.write("\n".join(header) + "\n" + text + "\n\n")
    return rows


if __name__ == "__main__":
    main()
