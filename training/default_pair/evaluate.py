"""The default pair's measurement (step 5 of its build).

Match vectors: where the draft's argmax equals the target's greedy token, teacher-forced on the
target's continuations (``match_vectors``), from which greedy speculative decoding is simulated
(``simulate_greedy``) and summed up per group of prompts (``summarize``); single-token and verify
forward times of both models as ``SpeculativeDecoder`` runs them (``forward_times``); and an
end-to-end run of ``SpeculativeDecoder`` against its target-only loop (``end_to_end``).
"""

from __future__ import annotations

import statistics
import time

import torch

from .batches import _collate, _label_logits
from .prompts import encode


@torch.inference_mode()
def match_vectors(draft, corpus, pad: int, batch_size: int = 16, vocab=None):
    """Per item: a bool tensor [Tg], True where the draft's argmax (over the token ids ``vocab``
    only, when given: what the decoder's draft proposes) equals the target's greedy token."""
    out = [None] * len(corpus)
    order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]["prompt"]) + len(corpus[i]["gen"]))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        ids, mask, bs, ts, labels, _, _ = _collate(corpus, idx, pad)
        logits = _label_logits(draft, ids, mask, bs, ts)  # [N, V]
        guess = logits.argmax(-1) if vocab is None else vocab[logits[:, vocab].argmax(-1)]
        hit = guess == labels  # [N]
        for b, i in enumerate(idx):
            out[i] = hit[bs == b]
    return out


def simulate_greedy(match, K: int):
    """Greedy speculative decoding is determined by the match vector: from position p, the
    target accepts the run of consecutive matches (at most K) and adds one token of its own.
    -> (tokens, target calls, drafted, accepted)."""
    p, calls, drafted, accepted, n = 0, 0, 0, 0, len(match)
    while p < n:
        k = min(K, n - p)
        a = 0
        while a < k and bool(match[p + a]):
            a += 1
        calls += 1
        drafted += k
        accepted += a
        p += a + 1
    return n, calls, drafted, accepted


def summarize(corpus, matches, groups):
    rows = {}
    for name, sel in groups.items():
        ids = [i for i in range(len(corpus)) if sel(corpus[i])]
        if not ids:
            continue
        hits = torch.cat([matches[i] for i in ids])
        row = {"prompts": len(ids), "tokens": int(hits.numel()), "alpha": float(hits.float().mean())}
        for K in (2, 3, 4, 5, 6, 8):
            tok = calls = dr = ac = 0
            for i in ids:
                a, b, c, d = simulate_greedy(matches[i], K)
                tok, calls, dr, ac = tok + a, calls + b, dr + c, ac + d
            row[f"K{K}"] = {"tokens_per_call": tok / calls, "accept_rate": ac / max(dr, 1)}
        rows[name] = row
    return rows


@torch.inference_mode()
def forward_times(dec, ctx: int, reps: int, ks=(1, 2, 3, 4, 5, 6, 8, 9)):
    """Median seconds of one KV-cached decode-step forward at batch 1 with ``ctx`` tokens
    already cached, run by the ``SpeculativeDecoder`` ``dec`` (its linear layers and decode-step
    path: the lean Llama step where the model qualifies): the draft for 1 token, the target for 1
    and for K+1 tokens (a verify call).  The two models are measured interleaved so that load from
    other processes hits both alike.  Also returns "path": how they ran."""
    from specdec_kernels.ops.kv.cache import crop_cache_, new_cache

    runners = {"target": dec._t, "draft": dec._d}
    g = torch.Generator().manual_seed(0)
    hi = min(r.vocab_size for r in runners.values())
    prefix = torch.randint(0, hi, (1, ctx), generator=g)
    caches = {}
    for name, r in runners.items():
        caches[name] = new_cache(r.model)
        r.forward(caches[name], prefix, None, torch.arange(ctx)[None], 0, 1)
    times = {"draft_1": [], **{f"target_{k}": [] for k in ks}}
    with dec._linear_layers():
        for r in range(reps):
            for name, n in [("draft", 1)] + [("target", k) for k in ks]:
                x = torch.randint(0, hi, (1, n), generator=g)
                pos = torch.arange(ctx, ctx + n)[None]
                t0 = time.perf_counter()
                runners[name].step(caches[name], x, None, pos, ctx, 1)
                times[f"{name}_{n}"].append(time.perf_counter() - t0)
                crop_cache_(caches[name], ctx)
    out = {k: statistics.median(v) for k, v in times.items()}
    steps = {name: "lean step" if why is None else "model forward" for name, why in dec.lean_status().items()}
    linear = "skinny_linear" if dec.cpu_linear == "skinny" else "torch linear"
    vocab = "" if dec.draft_vocab is None else f", {dec.draft_vocab.numel()}-token draft vocabulary"
    out["path"] = f"{linear}; target: {steps['target']}, draft: {steps['draft']}{vocab}"
    return out


def end_to_end(dec, tokenizer, prompts, max_new: int, K: int, rounds: int):
    """Wall time of the target alone (``dec.generate_target_only``) and of speculative decoding
    (``dec.generate``, greedy, K drafts a step) on the same prompts, batch 1, alternating so that
    background load hits both alike; the token ids compared."""
    t_base, t_spec, tokens, calls, same = 0.0, 0.0, 0, 0, True
    per_prompt = []
    for r in range(rounds):
        for kind, text in prompts:
            ids = [encode(tokenizer, kind, text)]
            runs = ["base", "spec"] if r % 2 == 0 else ["spec", "base"]
            res = {}
            for name in runs:
                t0 = time.perf_counter()
                if name == "base":
                    res[name] = dec.generate_target_only(ids, max_new_tokens=max_new)
                else:
                    res[name] = dec.generate(ids, max_new_tokens=max_new, num_draft_tokens=K)
                res[name + "_t"] = time.perf_counter() - t0
            t_base += res["base_t"]
            t_spec += res["spec_t"]
            ok = res["base"].token_ids == res["spec"].token_ids
            same &= ok
            n_tok = len(res["spec"].token_ids[0])
            tokens += n_tok
            calls += res["spec"].stats.iterations
            if r == 0:
                per_prompt.append({"kind": kind, "prompt": text, "tokens": n_tok,
                                   "target_calls": res["spec"].stats.iterations, "same_output": ok,
                                   "speedup": res["base_t"] / res["spec_t"]})
    return {"K": K, "max_new_tokens": max_new, "rounds": rounds, "target_alone_s": t_base,
            "speculative_s": t_spec, "speedup": t_base / t_spec, "tokens": tokens,
            "tokens_per_target_call": tokens / calls, "same_output": same, "per_prompt": per_prompt,
            "method": "SpeculativeDecoder.generate vs generate_target_only, batch 1, greedy",
            "lean": dec.lean_status()}
