"""The draft model of the default pair (steps 3 and 4 of its build) and its draft vocabulary.

``make_draft``: a Llama over the target's vocabulary whose tied embedding starts as the target's
projected onto its top principal directions; ``grow_draft``: the same function with more layers
(new ones start as the identity); ``train_draft``: distillation from the target's corpus (its
greedy token and its top-k distribution, sampled softmax); ``corpus_draft_vocab``: the tokens
the target emits most often in the corpus, the ones the decoder's draft proposes.
"""

from __future__ import annotations

import copy
import math
import random
import time

import torch

from specdec_kernels.decoding.drafters.vocab import frequent_tokens

from .batches import _batches, _collate, _label_hidden
from .evaluate import match_vectors

# The draft vocabulary's size (specdec_kernels.decoding.drafters.vocab): on the shipped draft, restricting its
# argmax to the 12,288 tokens the target emits most often in the training corpus leaves alpha at
# temperature 0 unchanged on every evaluation set (8,192 loses 2 of the 4,049 tokens), and its
# output layer takes 0.2 ms instead of 0.81 ms of a 1.6 ms draft token (1 thread, Zen 5).
DRAFT_VOCAB = 12288


def make_draft(target, hidden: int, layers: int, intermediate: int, seed: int):
    """A Llama over the target's vocabulary.  Its tied embedding = the target's projected on its
    top ``hidden`` principal directions (SVD of the [V, 576] matrix: about 76% of the energy at
    192), rescaled to the usual 0.02 init scale: the draft starts with the target's token
    geometry.  (Keeping the target's scale, with the final norm set to give target-scale logits,
    starts from confidently wrong softmaxes and trained worse in our runs.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    head_dim = 64
    cfg = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                      num_key_value_heads=hidden // head_dim, head_dim=head_dim,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, rope_parameters=dict(tc.rope_parameters),
                      tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
                      pad_token_id=tc.pad_token_id, initializer_range=0.02)
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(cfg)
    with torch.no_grad():
        E = target.get_input_embeddings().weight.detach().float()  # [V, 576]
        _, _, Vh = torch.linalg.svd(E, full_matrices=False)  # Vh: [576, 576], rows = directions
        proj = E @ Vh[:hidden].T  # [V, hidden]
        proj *= 0.02 / proj.std()
        draft.get_input_embeddings().weight.copy_(proj)
    draft.tie_weights()
    return draft


def grow_draft(draft, layers: int, seed: int):
    """The same draft with ``layers`` decoder layers (>= its own), computing the same function:
    the new layers are spread between the old ones (evenly, each after an old layer) with their
    output projections (attention ``o_proj``, MLP ``down_proj``) zeroed, so each starts as the
    identity on the residual stream; their other weights get the usual random init.  Training
    then continues from the old draft's function instead of from scratch."""
    from transformers import LlamaForCausalLM

    old = draft.config.num_hidden_layers
    if layers < old:
        raise ValueError(f"grow_draft: layers must be >= the draft's {old}, got {layers}")
    extra = layers - old
    # after[i] new layers follow old layer i, spread evenly (4 -> 6: after old 1 and 3)
    after = [(i + 1) * extra // old - i * extra // old for i in range(old)]
    cfg = copy.deepcopy(draft.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[0]] * layers
    torch.manual_seed(seed)
    grown = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name in ("embed_tokens", "norm"):
            getattr(grown.model, name).load_state_dict(getattr(draft.model, name).state_dict())
        grown.lm_head.load_state_dict(draft.lm_head.state_dict())  # the embedding again when tied
        slots = iter(grown.model.layers)  # built with their own layer_idx, so the cache numbering holds
        for layer, n_new in zip(draft.model.layers, after):
            next(slots).load_state_dict(layer.state_dict())
            for _ in range(n_new):
                new = next(slots)
                new.self_attn.o_proj.weight.zero_()
                new.mlp.down_proj.weight.zero_()
    grown.tie_weights()
    return grown.eval()


def active_vocab(corpus, vocab_size: int) -> torch.Tensor:
    """Every token id that occurs in the corpus (prompts, greedy tokens, the target's top-k): [A]."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for c in corpus:
        seen[c["prompt"]] = True
        seen[c["gen"]] = True
        seen[c["topk_ids"].long().reshape(-1)] = True
    return seen.nonzero().squeeze(1)


def train_draft(draft, corpus, pad: int, epochs: float, batch_size: int, lr: float, seed: int,
                soft_weight: float, negatives: int, emb_lr_scale: float = 1.0, log_every: int = 50,
                eval_corpus=None):
    """Distil: cross-entropy on the target's greedy token + ``soft_weight`` x cross-entropy to
    the target's renormalised top-k distribution.  The softmax runs over a sampled candidate set
    (sampled softmax): the A tokens that occur in the corpus, plus ``negatives`` other ids drawn
    afresh each step so that the rest of the vocabulary is pushed down too.  The output layer is
    ~98% of the draft's arithmetic; this cuts training time several-fold."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    V = draft.config.vocab_size
    active = active_vocab(corpus, V)  # [A]
    inactive = torch.ones(V, dtype=torch.bool)
    inactive[active] = False
    inactive = inactive.nonzero().squeeze(1)  # [V - A]
    slot = torch.full((V,), -1, dtype=torch.long)  # token id -> candidate index
    print(f"  sampled softmax: {len(active)} corpus tokens + {negatives} sampled negatives of {len(inactive)}")
    emb = draft.get_input_embeddings().weight  # [V, H], tied with the output layer
    emb.requires_grad_(emb_lr_scale > 0)  # 0: keep the target's projected geometry frozen
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and p is not emb]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if emb_lr_scale > 0:
        groups.append({"params": [emb], "weight_decay": 0.0, "lr": lr * emb_lr_scale})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)
    steps_per_epoch = math.ceil(len(corpus) / batch_size)
    total = max(1, int(round(epochs * steps_per_epoch)))
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    draft.train()
    step, t0, seen, run_loss, run_acc = 0, time.time(), 0, 0.0, 0.0
    batches = []
    while step < total:
        if not batches:
            batches = _batches(corpus, batch_size, rng)
        ids, mask, bs, ts, labels, tk_ids, tk_logits = _collate(corpus, batches.pop(), pad)
        neg = inactive[torch.randperm(len(inactive), generator=g)[:negatives]] if negatives else inactive[:0]
        cand = torch.cat([active, neg])  # [C]
        slot[cand] = torch.arange(len(cand))
        labels = tk_ids[:, 0]  # the target's greedy token (== the corpus token on a greedy path)
        h = _label_hidden(draft, ids, mask, bs, ts)  # [N, H]
        logits = h @ emb[cand].T  # [N, C]
        logp = torch.log_softmax(logits, dim=-1)
        hard = -logp.gather(1, slot[labels][:, None]).mean()
        soft_p = torch.softmax(tk_logits, dim=-1)  # [N, k] the target's top-k, renormalised
        soft = -(soft_p * logp.gather(1, slot[tk_ids])).sum(-1).mean()
        slot[cand] = -1
        loss = hard + soft_weight * soft
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        seen += len(labels)
        run_loss += hard.item()
        run_acc += (cand[logits.argmax(-1)] == labels).float().mean().item()
        if step % log_every == 0 or step == total:
            n = log_every if step % log_every == 0 else step % log_every
            el = time.time() - t0
            print(f"  train step {step}/{total}: hard CE {run_loss / n:.3f}, train match {run_acc / n:.3f}, "
                  f"lr {sched.get_last_lr()[0]:.2e}, {seen / el:.0f} tok/s, {el:.0f} s", flush=True)
            run_loss, run_acc = 0.0, 0.0
        if eval_corpus is not None and (step % steps_per_epoch == 0 or step == total):
            draft.eval()
            hits = torch.cat(match_vectors(draft, eval_corpus, pad))
            print(f"  after {step / steps_per_epoch:.1f} epochs: eval alpha (demo + held-out) "
                  f"{hits.float().mean():.3f}", flush=True)
            draft.train()
    draft.eval()
    return draft


def corpus_draft_vocab(corpus, vocab_size: int, n: int) -> torch.Tensor:
    """The draft vocabulary: the ``n`` tokens the target emits most often in ``corpus`` (its
    continuations, greedy and sampled; ties to the lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for c in corpus:
        counts += torch.bincount(c["gen"].long(), minlength=vocab_size)
    return frequent_tokens(counts, n)
