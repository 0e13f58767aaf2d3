"""The trainer of the shipped feature draft (``specdec_kernels/assets/feature_draft/``), a draft
that reads the target's hidden state (EAGLE, Li et al. 2024).  It trains, replays and exports a
``specdec_kernels.decoding.drafters.feature_model.FeatureDraft`` for the embedded target (used with
``SpeculativeDecoder(drafter="feature", draft=DIR)``); the shipped one is the sixth run of the
sequence in docs/feature_draft.md, exported there.

The draft: one Llama decoder layer at the target's width (576) over
``fc(concat(embed(x_{t+1}), f_t))``, where ``f_t`` is the target's final hidden state (after
its final norm, what its output layer reads) at position t and ``embed`` the target's own
(frozen) embedding; a final RMSNorm gives ``f^_{t+1}``, and the target's own output layer,
restricted to the shipped draft vocabulary (12,288 tokens), gives the draft's logits.  Trained
on the target's sampled corpus of ``training/make_default_pair.py`` (its cached chunks) to regress
``f_{t+1}`` (smooth L1) and to predict the target's greedy token (cross-entropy), with noise on
the input features (EAGLE-1's recipe: the chain feeds the draft its own predictions).

Measured by simulation on the evaluation corpus (the target's greedy continuations of the 70
evaluation prompts): per start position, the draft runs a chain of K steps (the first from the
true feature, the next ones from its own predicted features) and the run of tokens equal to the
target's greedy ones is counted; greedy speculative decoding is then replayed as in
``default_pair.evaluate.simulate_greedy``.

    python training/train_feature_draft.py extract --chunks 40 --threads 2
    python training/train_feature_draft.py train --files 40 --epochs 4 --weights fd768.pt
    python training/train_feature_draft.py train --files 100 --epochs 1.5 --lr 5e-4 --init fd768.pt --unroll \
        --weights fd768u.pt         # + EAGLE-3's training-time test for the second chain step
    python training/train_feature_draft.py eval --weights fd768u.pt [--shipped]   # replay (--shipped: the draft model)
    python training/train_feature_draft.py export --weights fd768u.pt --out DIR   # for drafter="feature"
    python training/train_feature_draft.py openings --n 1792 --seed 0             # new plain-text data (docs)
    python training/train_feature_draft.py extract --part open --chunks 100       # its features

(The commands that made the shipped one, with their times, are in docs/feature_draft.md.)

Features and weights are cached in ``$SPECDEC_FEATURE_SPIKE_DIR`` (default
``~/.cache/specdec_kernels/feature_spike``).  The figures are in docs/feature_draft.md.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from specdec_kernels.models import embedded as models  # noqa: E402

CACHE = Path(os.environ.get("SPECDEC_FEATURE_SPIKE_DIR", Path.home() / ".cache" / "specdec_kernels" / "feature_spike"))
DISTILL = models.cache_dir() / "distill"


def load_target():
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(models.default_target_path(), local_files_only=True,
                                                  dtype=torch.float32)
    return target.eval()


def sampled_chunks(n: int, part: str = "sampled") -> list:
    """The first n chunks of a part of the distillation corpus ("sampled": the target's sampled
    continuations; "train": its greedy ones), the largest file per chunk."""
    best = {}
    for f in glob.glob(str(DISTILL / f"corpus-{part}*.pt")):
        m = re.match(rf"corpus-{part}-?([a-z]*\d*-)??(\d*)-?[0-9a-f]{{16}}\.pt$", os.path.basename(f))
        if m is None:
            continue
        name = os.path.basename(f)[: -len("-0123456789abcdef.pt")]
        num = re.search(r"(\d+)$", name)
        key = (int(num.group(1)) if num else -1, name)
        if key not in best or os.path.getsize(f) > os.path.getsize(best[key]):
            best[key] = f
    return [best[k] for k in sorted(best)[:n]]


def eval_corpus():
    files = sorted(glob.glob(str(DISTILL / "corpus-eval-*.pt")), key=os.path.getsize)
    return torch.load(files[-1])  # the 70-prompt evaluation corpus


@torch.inference_mode()
def features(target, items, batch_tokens: int = 4096) -> list:
    """Per item: the target's final hidden states [L, 576] (fp16) over prompt + gen."""
    seqs = [torch.cat([c["prompt"], c["gen"]]) for c in items]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [None] * len(seqs)
    s = 0
    while s < len(order):
        e = s + 1
        while e < len(order) and (e - s + 1) * len(seqs[order[e]]) <= batch_tokens:
            e += 1
        idx = order[s:e]
        T = max(len(seqs[i]) for i in idx)
        ids = torch.zeros((len(idx), T), dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, :len(seqs[i])] = seqs[i]
            mask[b, :len(seqs[i])] = 1
        h = target.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for b, i in enumerate(idx):
            out[i] = h[b, :len(seqs[i])].half().clone()
        s = e
    return out


def cmd_extract(args):
    target = load_target()
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokens = 0
    for f in sampled_chunks(args.chunks, args.part) + ["eval"]:
        name = "eval" if f == "eval" else os.path.basename(f).replace("corpus-", "feat-")
        path = CACHE / name
        if path.is_file():
            continue
        items = eval_corpus() if f == "eval" else torch.load(f)
        feats = features(target, items)
        torch.save({"items": items, "feats": feats}, path)
        tokens += sum(len(x) for x in feats)
        print(f"{name}: {len(items)} items, {tokens} tokens so far, {time.time() - t0:.0f} s "
              f"({tokens / (time.time() - t0):.0f} tok/s)", flush=True)


# -- a fifth kind of data: short plain-text openings the target writes itself ------------------
# The training prompts are templates (a few dozen phrasings); the demo's plain-text prompts are
# short generic openings ("Once upon a time") and bare instructions, where the draft is weakest.
# These prompts come from the target itself, sampled (seeded) in answer to the requests below:
# the first 2-7 words of an opening it writes, or a whole question or instruction it writes;
# then its greedy continuations, as for every other greedy part.
OPENING_KINDS = ["a short story", "a fairy tale", "a news article", "an essay", "a letter to a friend",
                 "a recipe", "a product review", "a travel guide", "a biography", "a history lesson",
                 "a science article for children", "a blog post", "a speech", "a poem", "a diary entry",
                 "a textbook chapter", "a report", "a mystery novel", "a fable", "a movie review",
                 "a cover letter", "an advertisement", "a weather forecast", "a sports report",
                 "a how-to guide", "a book summary", "a tutorial about programming", "a legend",
                 "a dialogue", "a description of a place"]
OPENING_REQUESTS = ([("open", f"Write the first sentence of {k}.") for k in OPENING_KINDS]
                    + [("ask", "Write one question that a curious student might ask a teacher."),
                       ("ask", "Write one short instruction that someone might give to an assistant."),
                       ("ask", "Write one question about science or nature."),
                       ("ask", "Write one question about history, geography or people."),
                       ("ask", "Write one request to explain something.")])


def _words(text: str) -> list:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def _eval_texts():
    """(the evaluation prompts (demo and held out) as word strings, their content words that no
    training prompt uses): an opening holding such a word, or holding or starting an evaluation
    prompt, is dropped, so that those prompts and topics stay unseen."""
    from default_pair.prompts import DEMO_PROMPTS, build_prompts

    train_a, train_b, held, train_c = build_prompts(0)
    ev = DEMO_PROMPTS + [t for _, t in held]
    words = lambda texts: {w for t in texts for w in _words(t) if len(w) >= 4}
    banned = words(ev) - words(t for _, t in train_a + train_b + train_c)
    return [" ".join(_words(t)) for t in ev], banned


def _unseen(text: str, eval_texts, banned) -> bool:
    w = _words(text)
    s = " ".join(w)
    return not (set(w) & banned) and not any(e in s or e.startswith(s) for e in eval_texts)


@torch.inference_mode()
def openings(target, tokenizer, n: int, seed: int, batch_size: int = 96) -> list:
    """n distinct plain-text prompts sampled from the target (see OPENING_REQUESTS), seeded."""
    rng = random.Random(seed)
    eval_texts, banned = _eval_texts()
    out, seen, b = [], set(), 0
    eos = tokenizer.eos_token_id
    t0 = time.time()
    while len(out) < n:
        reqs = [OPENING_REQUESTS[rng.randrange(len(OPENING_REQUESTS))] for _ in range(batch_size)]
        rows = [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"] for _, r in reqs]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, T - len(r):] = torch.tensor(r)
            mask[j, T - len(r):] = 1
        torch.manual_seed(seed * 100003 + b)
        b += 1
        gen = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                              top_p=0.95, max_new_tokens=20, pad_token_id=eos, eos_token_id=eos)[:, T:]
        for (kind, _), g in zip(reqs, gen):
            text = tokenizer.decode(g, skip_special_tokens=True).strip().split("\n")[0].strip().strip('"')
            words = text.split()
            if kind == "open":
                if len(words) < 4:
                    continue
                text = " ".join(words[: rng.randint(2, min(7, len(words) - 1))])
            else:
                m = re.match(r"[^?.!]{8,}[?.!]", text)
                if m is None or len(m.group(0).split()) > 20:
                    continue
                text = m.group(0)
            if not text or text.lower() in seen or not _unseen(text, eval_texts, banned):
                continue
            seen.add(text.lower())
            out.append(text)
        print(f"  openings: {len(out)}/{n} ({time.time() - t0:.0f} s)", flush=True)
    return out[:n]


def cmd_openings(args):
    """The prompts (cached as openings-N-SEED.json), then the target's greedy continuations of
    chunks [--start, --stop) of them (default_pair.corpus's format, in its cache, tag
    "openSEED-"); ``extract --part open`` takes their features."""
    import json

    from transformers import AutoTokenizer

    from default_pair.corpus import chunked_corpus

    target = load_target()
    tokenizer = AutoTokenizer.from_pretrained(models.default_target_path(), local_files_only=True)
    path = CACHE / f"openings-{args.n}-{args.seed}.json"
    if path.is_file():
        texts = json.loads(path.read_text())
    else:
        texts = openings(target, tokenizer, args.n, args.seed)
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(texts, indent=0) + "\n")
        print(f"{path}: {len(texts)} prompts, e.g. {texts[:8]}", flush=True)
    if args.stop is not None and args.stop <= args.start:
        return
    prompts = [("plain", t) for t in texts]
    chunked_corpus(target, tokenizer, prompts, args.new_tokens, 32, 8, DISTILL, f"open{args.seed}-", chunk=128,
                   start_chunk=args.start, stop_chunk=args.stop)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("--chunks", type=int, default=40)
    e.add_argument("--part", choices=["sampled", "train", "open"], default="sampled")
    o = sub.add_parser("openings")
    o.add_argument("--n", type=int, default=6144)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--start", type=int, default=0, help="the first chunk (of 128 prompts) to continue")
    o.add_argument("--stop", type=int, default=None, help="the chunk to stop before (0: only the prompts)")
    o.add_argument("--new-tokens", type=int, default=128)
    t = sub.add_parser("train")
    t.add_argument("--files", type=int, default=40)
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--noise", type=float, default=0.1)
    t.add_argument("--reg-weight", type=float, default=1.0)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--init", default=None, help="start from these weights (a file in the cache)")
    t.add_argument("--unroll", action="store_true", help="also train the second chain step on its own predictions")
    v = sub.add_parser("eval")
    v.add_argument("--kmax", type=int, default=4)
    v.add_argument("--shipped", action="store_true", help="replay the shipped standalone draft instead")
    for p in (t, v):
        p.add_argument("--weights", default="feature_draft.pt")
    for p in (e, t, v, o):
        p.add_argument("--threads", type=int, default=2)
    x = sub.add_parser("export")
    x.add_argument("--out", required=True)
    x.add_argument("--weights", default="feature_draft.pt")
    x.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"extract": cmd_extract, "train": cmd_train, "eval": cmd_eval, "export": cmd_export,
     "openings": cmd_openings}[args.cmd](args)


if __name__ == "__main__":
    main()
