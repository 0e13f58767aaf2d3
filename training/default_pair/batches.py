"""The corpus as the draft's batches, for its training and its measurement alike.

Length-bucketed, shuffled batches of corpus items (``_batches``); a batch's token ids, attention
mask, label positions, the target's greedy tokens and its top-k (``_collate``); and the draft's
final hidden states and logits at the label positions only (``_label_hidden``,
``_label_logits``).
"""

from __future__ import annotations

import random

import torch


def _batches(corpus, batch_size: int, rng: random.Random):
    """Length-bucketed batches of corpus indices, shuffled."""
    order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]["prompt"]) + len(corpus[i]["gen"]) + rng.random())
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def _collate(corpus, idx, pad: int):
    """-> ids [B, T], attention mask [B, T], positions of labels (b, t) [N] x2, labels [N],
    top-k ids [N, k], top-k logits [N, k].  The label at position t is token t+1; only the
    generated tokens are labels (the first is predicted from the prompt's last token)."""
    seqs = [torch.cat([corpus[i]["prompt"], corpus[i]["gen"]]) for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    bs, ts, labels, tk_ids, tk_logits = [], [], [], [], []
    for b, (i, s) in enumerate(zip(idx, seqs)):
        ids[b, :len(s)] = s
        mask[b, :len(s)] = 1
        tp, tg = len(corpus[i]["prompt"]), len(corpus[i]["gen"])
        pos = torch.arange(tp - 1, tp - 1 + tg)
        bs.append(torch.full((tg,), b))
        ts.append(pos)
        labels.append(corpus[i]["gen"])
        tk_ids.append(corpus[i]["topk_ids"].long())
        tk_logits.append(corpus[i]["topk_logits"].float())
    return ids, mask, torch.cat(bs), torch.cat(ts), torch.cat(labels), torch.cat(tk_ids), torch.cat(tk_logits)


def _label_hidden(draft, ids, mask, bs, ts):
    """The draft's final hidden states at the label positions only: [N, H]."""
    h = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    return h[bs, ts]


def _label_logits(draft, ids, mask, bs, ts):
    """The draft's logits at the label positions over the whole vocabulary: [N, V] fp32."""
    return _label_hidden(draft, ids, mask, bs, ts) @ draft.get_input_embeddings().weight.T
