"""The feature draft's training, replay and export (``train``, ``eval`` and ``export`` of
``training/train_feature_draft.py``).

A fresh or saved ``FeatureDraft`` (``new_draft``, ``load_draft``) over the shipped draft vocabulary
(``draft_vocab``); the cached features as training sequences (``load_feature_files``) and their
batches (``batch``); training (``cmd_train``), the replay of greedy speculative decoding on the
evaluation corpus (``cmd_eval``) and the export to the draft directory format (``cmd_export``).
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec_kernels.models import embedded as models

from .data import CACHE, load_target

HERE = Path(__file__).resolve().parent.parent  # training/, where default_pair/ is


def new_draft(target, intermediate: int = 768):
    """A fresh ``specdec_kernels.decoding.drafters.feature_model.FeatureDraft`` for ``target``: one Llama layer at
    its width (its heads, RoPE and norm epsilon) with an MLP of ``intermediate``."""
    from transformers import LlamaConfig

    from specdec_kernels.decoding.drafters.feature_model import FeatureDraft, target_identity

    tc = target.config
    H = tc.hidden_size
    cfg = LlamaConfig(vocab_size=1, hidden_size=H, intermediate_size=intermediate,
                      num_hidden_layers=1, num_attention_heads=tc.num_attention_heads,
                      num_key_value_heads=tc.num_key_value_heads, head_dim=H // tc.num_attention_heads,
                      max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                      rope_parameters=dict(tc.rope_parameters), pad_token_id=None, bos_token_id=None,
                      eos_token_id=None)
    return FeatureDraft(cfg, target_identity(target))


def load_draft(target, weights: str):
    sd = torch.load(CACHE / weights)
    model = new_draft(target, sd["lm.model.layers.0.mlp.gate_proj.weight"].shape[0])
    model.load_state_dict(sd)
    return model


def draft_vocab():
    from specdec_kernels.decoding.drafters.vocab import load_draft_vocab

    return load_draft_vocab(models.default_draft_path(), 49152)


def load_feature_files(n: int):
    files = sorted((p for p in CACHE.glob("feat-*.pt")), key=lambda p: p.stat().st_mtime)
    data = []
    for p in files[:n]:
        d = torch.load(p)
        for c, f in zip(d["items"], d["feats"]):
            data.append((torch.cat([c["prompt"], c["gen"]]), f, len(c["prompt"]), c["topk_ids"][:, 0].long()))
    return data


def batch(data, idx, emb_w):
    """Column t of a sequence holds the pair (f_{t-1}, x_t) at position t (f_{-1} = 0), as the
    target's column t holds x_t: its output predicts f_t and the token x_{t+1}.
    -> emb [B,T,H], feat [B,T,H], next feature f_t [B,T,H], labels [B,T] (the target's greedy
    token after column t where it is known, else -100), valid [B,T]."""
    L = max(len(data[i][0]) for i in idx)
    B = len(idx)
    H = emb_w.shape[1]
    toks = torch.zeros((B, L), dtype=torch.long)
    feat = torch.zeros((B, L, H))
    nxt = torch.zeros((B, L, H))
    labels = torch.full((B, L), -100, dtype=torch.long)
    valid = torch.zeros((B, L), dtype=torch.bool)
    for b, i in enumerate(idx):
        ids, f, tp, greedy = data[i]
        n = len(ids)
        toks[b, :n] = ids
        feat[b, 1:n] = f[:-1].float()
        nxt[b, :n] = f.float()
        valid[b, :n] = True
        g = torch.arange(n) + 1 - tp  # column t predicts the token at index t + 1 = gen index t + 1 - tp
        ok = (g >= 0) & (g < len(greedy))
        labels[b, :n][ok] = greedy[g[ok]]
    return emb_w[toks], feat, nxt, labels, valid


def cmd_train(args):
    torch.manual_seed(0)
    target = load_target()
    emb_w = target.get_input_embeddings().weight.detach()
    vocab = draft_vocab()
    head = target.lm_head.weight.detach()[vocab]  # [Vd, H]
    remap = torch.full((emb_w.shape[0],), -100, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    data = load_feature_files(args.files)
    ntok = sum(len(d[0]) for d in data)
    print(f"{len(data)} sequences, {ntok} tokens", flush=True)
    model = new_draft(target, args.intermediate)
    with torch.no_grad():
        model.lm.model.norm.weight.copy_(target.model.norm.weight)  # the target's feature scale
    if args.init:
        model.load_state_dict(torch.load(CACHE / args.init))
        print(f"from {CACHE / args.init}", flush=True)
    fscale = float(torch.cat([d[1][:64].float() for d in data[:200]]).std())
    print(f"feature std {fscale:.3f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(0)
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]) + rng.random())
    batches = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
    total = int(len(batches) * args.epochs)
    step = 0
    t0 = time.time()
    model.train()
    while step < total:
        rng.shuffle(batches)
        for idx in batches:
            if step >= total:
                break
            lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / total))
            for g in opt.param_groups:
                g["lr"] = lr
            emb, feat, nxt, labels, valid = batch(data, idx, emb_w)
            feat_in = feat + (torch.rand_like(feat) - 0.5) * (2 * args.noise * fscale)
            pos = torch.arange(emb.shape[1])[None].expand(emb.shape[0], -1)
            lab = remap[labels.clamp(min=0)]
            lab[labels < 0] = -100
            sel = lab >= 0
            if args.unroll:
                # Training-time test: a second pass in which column c takes the first pass's
                # prediction f^_{c-1} as its feature and attends to the true columns < c and to
                # itself: exactly the draft's second chain step at inference.
                L = emb.shape[1]
                with torch.no_grad():
                    out0 = model(emb, feat_in, pos)
                f1 = torch.zeros_like(feat)
                f1[:, 1:] = out0[:, :-1]
                idx = torch.arange(L)
                top = torch.cat([idx[:, None] >= idx[None, :], torch.zeros(L, L, dtype=torch.bool)], 1)
                bot = torch.cat([idx[:, None] > idx[None, :], torch.eye(L, dtype=torch.bool)], 1)
                mask4 = torch.cat([top, bot], 0)[None, None].expand(emb.shape[0], 1, 2 * L, 2 * L)
                h = model.fc(torch.cat([torch.cat([emb, emb], 1), torch.cat([feat_in, f1], 1)], -1))
                both = model.lm.model(inputs_embeds=h, position_ids=torch.cat([pos, pos], 1),
                                  attention_mask=mask4).last_hidden_state
                out, out1 = both[:, :L], both[:, L:]
                v1 = valid.clone()
                v1[:, 0] = False
                sel1 = sel.clone()
                sel1[:, 0] = False
                reg1 = F.smooth_l1_loss(out1[v1] / fscale, nxt[v1] / fscale)
                ce1 = F.cross_entropy(out1[sel1] @ head.T, lab[sel1])
            else:
                out = model(emb, feat_in, pos)
                reg1 = ce1 = torch.zeros(())
            reg = F.smooth_l1_loss(out[valid] / fscale, nxt[valid] / fscale)
            logits = out[sel] @ head.T
            ce = F.cross_entropy(logits, lab[sel])
            loss = args.reg_weight * (reg + reg1) + ce + ce1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % args.log_every == 0 or step == total:
                acc = (logits.argmax(-1) == lab[sel]).float().mean()
                print(f"step {step}/{total} lr {lr:.2e} reg {reg.item():.4f} ce {ce.item():.3f} ce2 {ce1.item():.3f} "
                      f"acc {acc.item():.3f} {time.time() - t0:.0f} s", flush=True)
    torch.save(model.state_dict(), CACHE / args.weights)
    print(f"saved {CACHE / args.weights}")


@torch.inference_mode()
def cmd_eval(args):
    from transformers import DynamicCache

    target = load_target()
    emb_w = target.get_input_embeddings().weight.detach()
    vocab = draft_vocab()
    head = target.lm_head.weight.detach()[vocab]
    model = load_draft(target, args.weights)
    model.eval()
    d = torch.load(CACHE / "eval")
    sys.path.insert(0, str(HERE))
    from default_pair.prompts import DEMO_PROMPTS

    Kmax = args.kmax
    groups = {"all": [], "demo plain": [], "demo chat": [], "held plain": [], "held chat": []}
    if args.shipped:  # the shipped standalone draft, replayed the same way (its chain = teacher forcing)
        from default_pair.evaluate import match_vectors
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(models.default_draft_path(), local_files_only=True,
                                                     dtype=torch.float32).eval()
        pad = target.config.eos_token_id if isinstance(target.config.eos_token_id, int) else 0
        for c, m in zip(d["items"], match_vectors(draft, d["items"], pad, vocab=vocab)):
            runs = []
            for p in range(len(m)):
                r = 0
                while r < Kmax and p + r < len(m) and bool(m[p + r]):
                    r += 1
                runs.append(r)
            demo = c["text"] in DEMO_PROMPTS
            for name in ("all", f"{'demo' if demo else 'held'} {c['kind']}"):
                groups[name].append(runs)
    for c, f in zip(d["items"], d["feats"]) if not args.shipped else []:
        ids = torch.cat([c["prompt"], c["gen"]])
        tp, tg = len(c["prompt"]), len(c["gen"])
        f = f.float()
        # runs[p] = how many of the drafts from start p (target just emitted gen[p - 1] or, at p = 0,
        # the prompt's last token is the newest) match gen[p], gen[p+1], ... (at most Kmax)
        runs = []
        for p in range(tg):
            n = tp - 1 + p  # column of the newest token (the target just emitted it): pair (f_{n-1}, x_n)
            cache = DynamicCache()
            feats = torch.cat([torch.zeros(1, f.shape[1]), f[:n]])  # f_{-1} = 0, f_0 .. f_{n-1}
            out = model(emb_w[ids[:n + 1]][None], feats[None], torch.arange(n + 1)[None], cache)
            fh = out[0, -1]
            run = 0
            for j in range(Kmax):
                if p + j >= tg:
                    break
                guess = vocab[(fh @ head.T).argmax()]
                if int(guess) != int(c["gen"][p + j]):
                    break
                run += 1
                if j + 1 == Kmax or p + j + 1 >= tg:
                    break
                out = model(emb_w[guess][None, None], fh[None, None], torch.tensor([[n + j + 1]]), cache)
                fh = out[0, -1]
            runs.append(run)
        kind = c["kind"]
        demo = c["text"] in DEMO_PROMPTS
        for name in ("all", f"{'demo' if demo else 'held'} {kind}"):
            groups[name].append(runs)
    for name, items in groups.items():
        n = sum(len(r) for r in items)
        first = sum(x > 0 for runs in items for x in runs) / max(1, n)
        line = [f"{name:10s} items {len(items):3d} tokens {n:5d}", f"step-1 match {first:.3f}"]
        for K in range(1, Kmax + 1):
            calls = drafted = acc = 0
            for runs in items:  # replay greedy decoding: from p, min(run, K) accepted + the target's token
                p = 0
                while p < len(runs):
                    k = min(K, len(runs) - p)
                    a = min(runs[p], k)
                    calls, drafted, acc, p = calls + 1, drafted + k, acc + a, p + a + 1
            line.append(f"K={K}: {n / max(1, calls):.2f} tok/call, accepted {acc / max(1, drafted):.3f}")
        print(" | ".join(line), flush=True)


def cmd_export(args):
    """Trained weights -> the directory format of specdec_kernels.decoding.drafters.feature_model (fp16) in --out."""
    from specdec_kernels.decoding.drafters.feature_model import save_feature_draft

    print(save_feature_draft(load_draft(load_target(), args.weights), args.out, vocab=draft_vocab()))
