"""The first ``generate`` of a decoder against the warm ones: what preparing the CPU linear
path's weights costs (checking which weights fp16 holds exactly, making those copies), against
what loading the models cost.

Per pair, side by side in one run: the models' load (or random init); the preparation's
throughput: ``ops.linear.fp16_exact_copy`` over every fp32 linear weight of both models (what a
first ``generate`` does; the copies are dropped), against a plain copy of the same bytes to fp16
(``torch.empty_like(w, dtype=fp16).copy_(w)``) and ``w.clone()``, interleaved, --prep-repeats
rounds, the median; then a new ``SpeculativeDecoder``: its construction, its first ``generate``
and two more; then a second decoder over the same models: its construction and first
``generate`` (the weights' copies are kept per model, so it should cost what a warm call costs).
The summary: (construction + first generate) / the median warm generate, whether every call gave
the same tokens, and the preparation's GB/s (bytes read + written) against the plain copy's.

    python bench/decoding/bench_first_call.py --threads 2 --pair readme       # the README's main job: the
                                        # embedded pair's feature draft, its two prompts, K = auto, 64 tokens
    python bench/decoding/bench_first_call.py --threads 1                     # the embedded pair
    python bench/decoding/bench_first_call.py --threads 1 --pair qwen-shapes  # random weights in the shapes of
                                                                    # Qwen2.5-0.5B drafting for 1.5B
    python bench/decoding/bench_first_call.py --threads 2 --pair qwen-shapes --fp16-exact  # weights rounded
                                                                    # through fp16 (every copy made)

--weight-cache DIR keeps the fp16 copies in DIR (``cpu.weight_cache``): run it twice to see the
first run write them (the cache cold) and a later process map them (warm); the header says how
many copies DIR held before the run.

    python bench/decoding/bench_first_call.py --threads 2 --pair qwen-shapes --fp16-exact --weight-cache /tmp/wc

--profile also writes the first call's cProfile (construction + first generate, the 40 costliest
functions by cumulative time) to bench_first_call_profile.txt.  Writes bench_first_call.{csv,txt}
under --out.
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
    """A Qwen2 model of ``shape`` with transformers' initialisation's laws (N(0, 0.02) matrices, zero
    biases, unit norms), drawn in place from ``seed`` (built on the meta device: transformers' own
    initialisation of 2B parameters took 1.5 minutes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    hidden, layers, heads, kv, mlp, vocab = shape
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model = model.to_empty(device="cpu").eval()
    model.tie_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
            if fp16_exact:
                p.copy_(p.half().float())
    model.model.rotary_emb = Qwen2RotaryEmbedding(config=cfg)  # its inverse frequencies, left empty by to_empty
    return model


def load(args):
    t0 = time.perf_counter()
    if args.pair == "readme":
        from specdec_kernels.decoding.pair import embedded_pair

        draft, target, args.tokenizer = embedded_pair("feature", None, None)  # the feature draft's directory
        name = "embedded (SmolLM2-135M-Instruct + its feature draft), the README's main job"
    elif args.pair == "embedded":
        from specdec_kernels.models.embedded import default_pair

        draft, target, _ = default_pair()
        name = "embedded (SmolLM2-135M-Instruct + shipped draft)"
    else:
        target = _qwen(QWEN["target"], 0, args.fp16_exact)
        draft = _qwen(QWEN["draft"], 1, args.fp16_exact)
        name = "random weights, Qwen2.5-1.5B target / 0.5B draft shapes" + (", fp16-exact" if args.fp16_exact else "")
    return draft, target, name, time.perf_counter() - t0


def _linear_weights(models):
    """The weights use_skinny_linear prepares: every fp32 CPU nn.Linear's (a tied one once)."""
    seen, out = set(), []
    for m in models:
        for mod in m.modules() if isinstance(m, torch.nn.Module) else ():
            if type(mod) is torch.nn.Linear and mod.weight.dtype == torch.float32 and id(mod.weight) not in seen:
                seen.add(id(mod.weight))
                out.append(mod.weight.detach())
    return out


def preparation_throughput(weights, repeats: int) -> dict:
    """Seconds (the median of ``repeats`` interleaved rounds) of: the preparation
    (``fp16_exact_copy`` on every weight), a plain copy of the same weights to fp16, and a clone; the
    bytes each moves; how many weights fp16 holds exactly."""
    import statistics

    from specdec_kernels.ops.linear import fp16_exact_copy

    def prepare():
        return sum(fp16_exact_copy(w) is not None for w in weights)

    def copy_fp16():
        for w in weights:
            torch.empty_like(w, dtype=torch.float16).copy_(w)

    def clone():
        for w in weights:
            w.clone()

    times = {"prepare": [], "copy_fp16": [], "clone": []}
    exact = 0
    for _ in range(repeats):
        for name, fn in (("prepare", prepare), ("copy_fp16", copy_fp16), ("clone", clone)):
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            if name == "prepare":
                exact = out
    n = sum(w.numel() for w in weights)
    moved = {"prepare": None, "copy_fp16": 6 * n, "clone": 8 * n}  # bytes read + written
    res = {k: statistics.median(v) for k, v in times.items()}
    # the preparation reads every weight until its first inexact block and writes the exact ones' copies
    n_exact = sum(w.numel() for w in weights if fp16_exact_copy(w) is not None)
    moved["prepare"] = 6 * n_exact + 4 * (n - n_exact)  # an upper bound for the inexact ones (early exit)
    return dict(seconds=res, bytes=moved, elements=n, exact_weights=exact, weights=len(weights),
                exact_elements=n_exact)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["readme", "embedded", "qwen-shapes"], default="embedded")
    ap.add_argument("--fp16-exact", action="store_true", help="qwen-shapes: round every weight through fp16")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens (default: 64 for readme, else 40)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prep-repeats", type=int, default=3, help="rounds of the preparation's throughput (0: skip)")
    ap.add_argument("--profile", action="store_true", help="cProfile the first call (construction + first generate)")
    ap.add_argument("--weight-cache", default=None, metavar="DIR",
                    help="keep the fp16 weight copies in DIR between runs (default: memory only)")
    ap.add_argument("--out", default="bench/results/local")
    args = ap.parse_args(argv)
    cached_before = (sum(f.endswith(".f16") for f in os.listdir(args.weight_cache))
                     if args.weight_cache and os.path.isdir(args.weight_cache) else 0)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_import = time.perf_counter()
    from specdec_kernels import SpeculativeDecoder

    t_import = time.perf_counter() - t_import
    draft, target, name, t_load = load(args)
    if args.pair == "readme":
        tokens = args.tokens or 64
        prompt = ["The capital of France is", "def fibonacci(n):"]
        make = dict(draft=draft, target=target, tokenizer=args.tokenizer, drafter="feature",
                    weight_cache=args.weight_cache or False)
        gen = dict(max_new_tokens=tokens, num_draft_tokens="auto")
        job = f"the prompts {prompt}, drafter feature, K = auto, greedy, {tokens} new tokens"
    else:
        tokens = args.tokens or 40
        prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
        make = dict(draft=draft, target=target, weight_cache=args.weight_cache or False)
        gen = dict(max_new_tokens=tokens)
        job = f"greedy, batch 1, {tokens} new tokens, prompt of 8 tokens; K = 4"
    rows = [dict(step="import specdec_kernels", seconds=t_import), dict(step="load", seconds=t_load)]
    prep = None
    if args.prep_repeats > 0:
        weights = _linear_weights([target] + ([draft] if isinstance(draft, torch.nn.Module) else []))
        prep = preparation_throughput(weights, args.prep_repeats)
        for k, sec in prep["seconds"].items():
            rows.append(dict(step=f"weights: {k}", seconds=sec, gb_per_s=prep["bytes"][k] / sec / 1e9))
        del weights

    def timed(label, fn):
        t0 = time.perf_counter()
        out = fn()
        rows.append(dict(step=label, seconds=time.perf_counter() - t0))
        return out

    profile_text = None
    if args.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    dec = timed("decoder 1: construction", lambda: SpeculativeDecoder(**make))
    outs = [timed("decoder 1: generate 1", lambda: dec.generate(prompt, **gen))]
    if args.profile:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        profile_text = buf.getvalue()
    for i in range(1, 3):
        outs.append(timed(f"decoder 1: generate {i + 1}", lambda: dec.generate(prompt, **gen)))
    dec2 = timed("decoder 2: construction", lambda: SpeculativeDecoder(**make))
    outs.append(timed("decoder 2: generate 1", lambda: dec2.generate(prompt, **gen)))
    secs = {r["step"]: r["seconds"] for r in rows}
    warm = sorted([secs["decoder 1: generate 2"], secs["decoder 1: generate 3"]])[0]
    first = secs["decoder 1: construction"] + secs["decoder 1: generate 1"]
    same = all(o.token_ids == outs[0].token_ids for o in outs)
    summary = [f"# first call (construction + first generate) / warm generate (the faster of two): "
               f"{first:.2f} / {warm:.2f} s = {first / warm:.2f}x; every call the same tokens: {same}"]
    if prep is not None:
        s_, b_ = prep["seconds"], prep["bytes"]
        summary.append(f"# preparation: {prep['weights']} weights, {prep['elements'] / 1e6:.0f}M elements, "
                       f"{prep['exact_weights']} fp16-exact; {b_['prepare'] / s_['prepare'] / 1e9:.1f} GB/s "
                       f"against a plain "
                       f"fp16 copy's {b_['copy_fp16'] / s_['copy_fp16'] / 1e9:.1f} GB/s "
                       f"({b_['prepare'] / s_['prepare'] / (b_['copy_fp16'] / s_['copy_fp16']):.0%}) and a clone's "
                       f"{b_['clone'] / s_['clone'] / 1e9:.1f} GB/s; seconds {s_['prepare']:.3f} / "
                       f"{s_['copy_fp16']:.3f} / {s_['clone']:.3f}")
    load_avg = os.getloadavg()
    header = [f"# bench_first_call {harness.now()}: python bench/decoding/bench_first_call.py "
              f"{' '.join(argv or sys.argv[1:])}",
              f"# device: CPU {harness.cpu_model()} x{torch.get_num_threads()} threads; load average at the end "
              f"{load_avg[0]:.2f} / {load_avg[1]:.2f} / {load_avg[2]:.2f} on {os.cpu_count()} cores",
              f"# pair: {name}; fp32; cpu_linear {dec.cpu_linear}; {job}",
              "# weight cache: " + (f"{args.weight_cache}, {cached_before} copies in it before the run "
                                    f"({'warm' if cached_before else 'cold'})"
                                    if args.weight_cache else "none (memory only)"),
              f"# versions: {harness.versions()}; commit {harness.commit()}"]
    print("\n".join(header))
    text = harness.print_table(rows, ["step", "seconds", "gb_per_s"])
    print("\n".join(summary))
    os.makedirs(args.out, exist_ok=True)
    for r in rows:
        r.setdefault("gb_per_s", None)
        r.update(pair=name, threads=torch.get_num_threads(), date=harness.now(), commit=harness.commit())
    harness.append_csv(os.path.join(args.out, "bench_first_call.csv"), rows)
    with open(os.path.join(args.out, "bench_first_call.txt"), "a") as f:
        f.write("\n".join(header) + "\n" + text + "\n" + "\n".join(summary) + "\n\n")
    if profile_text is not None:
        with open(os.path.join(args.out, "bench_first_call_profile.txt"), "a") as f:
            f.write("\n".join(header) + "\n" + profile_text + "\n")
    return rows


if __name__ == "__main__":
    main()
