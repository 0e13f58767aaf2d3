"""The target's corpus (step 2 of the default pair's build).

The target's continuations of the prompts, greedy or sampled, with its top-k logits at every
generated position (``generate_corpus``), cached under a key of what made them, whole
(``cached_corpus``) or in chunks of prompts (``chunked_corpus``: a long generation can be
resumed, extended and filled by a second process).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from specdec_kernels.models import embedded as models

from .prompts import encode


@torch.inference_mode()
def generate_corpus(target, tokenizer, prompts, new_tokens: int, batch_size: int, top_k: int, log_every: int = 1,
                    temperature: float = 0.0, seed: int = 0):
    """The target's continuations: a list of dicts {kind, text, prompt [Tp], gen [Tg],
    topk_ids [Tg, k], topk_logits [Tg, k]}; gen stops after the first EOS.  Greedy with
    ``temperature`` 0, else sampled from the target's full softmax at that temperature (seeded per
    batch); the top-k logits are always the target's raw ones, so topk_ids[:, 0] is the target's
    greedy token at every position, also on a sampled path."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    items = [(kind, text, encode(tokenizer, kind, text)) for kind, text in prompts]
    order = sorted(range(len(items)), key=lambda i: len(items[i][2]))  # similar lengths share a batch
    out = [None] * len(items)
    t0 = time.time()
    done_tokens = 0
    for b, start in enumerate(range(0, len(order), batch_size)):
        idx = order[start:start + batch_size]
        rows = [items[i][2] for i in idx]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), pad, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, T - len(r):] = torch.tensor(r)
            mask[j, T - len(r):] = 1
        sampling = dict(do_sample=False)
        if temperature > 0:
            torch.manual_seed(seed * 100003 + b)
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        res = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, **sampling,
                              eos_token_id=eos, pad_token_id=pad, output_logits=True,
                              return_dict_in_generate=True)
        gen = res.sequences[:, T:]  # [B, Tg]
        logits = torch.stack(res.logits, dim=1).float()  # [B, Tg, V]
        top_vals, top_ids = logits.topk(top_k, dim=-1)  # [B, Tg, k]
        for j, i in enumerate(idx):
            g = gen[j].tolist()
            n = g.index(eos) + 1 if eos in g else len(g)
            out[i] = {"kind": items[i][0], "text": items[i][1], "prompt": torch.tensor(items[i][2]),
                      "gen": torch.tensor(g[:n]), "topk_ids": top_ids[j, :n].to(torch.int32).clone(),
                      "topk_logits": top_vals[j, :n].half().clone()}
            done_tokens += n
        if log_every and (b + 1) % log_every == 0:
            el = time.time() - t0
            print(f"  corpus: {start + len(idx)}/{len(items)} prompts, {done_tokens} tokens, "
                  f"{el:.0f} s ({done_tokens / max(el, 1e-9):.0f} tok/s)", flush=True)
    return out


def cached_corpus(target, tokenizer, prompts, new_tokens, batch_size, top_k, cache: Path, tag: str,
                  temperature: float = 0.0, seed: int = 0):
    what = [prompts, new_tokens, top_k, models.vocab_fingerprint(tokenizer)]
    if temperature > 0:
        what += [temperature, seed]
    key = hashlib.sha256(json.dumps(what).encode())
    path = cache / f"corpus-{tag}-{key.hexdigest()[:16]}.pt"
    if path.is_file():
        print(f"corpus '{tag}': reusing {path}")
        return torch.load(path)
    how = f"sampled (T={temperature})" if temperature > 0 else "greedy"
    print(f"corpus '{tag}': {len(prompts)} prompts x {new_tokens} {how} tokens from the target", flush=True)
    data = generate_corpus(target, tokenizer, prompts, new_tokens, batch_size, top_k,
                           log_every=max(1, len(prompts) // batch_size // 10), temperature=temperature, seed=seed)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(data, tmp)
    os.replace(tmp, path)  # a process stopped mid-save leaves no truncated chunk behind
    return data


def chunked_corpus(target, tokenizer, prompts, new_tokens, batch_size, top_k, cache: Path, tag: str,
                   temperature: float = 0.0, seed: int = 0, chunk: int = 128, start_chunk: int = 0,
                   stop_chunk=None):
    """``cached_corpus`` in chunks of ``chunk`` prompts, each cached on its own (chunk i seeded
    with seed + i), so that a long generation can be resumed and extended (and, from
    ``start_chunk``, filled by a second process)."""
    out = []
    for i, s in enumerate(range(0, len(prompts), chunk)):
        if i < start_chunk or (stop_chunk is not None and i >= stop_chunk):
            continue
        out += cached_corpus(target, tokenizer, prompts[s:s + chunk], new_tokens, batch_size, top_k, cache,
                             f"{tag}{i}", temperature, seed + i)
    return out
