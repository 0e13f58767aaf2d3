"""The feature draft's data (``extract`` and ``openings`` of ``training/train_feature_draft.py``).

The target (``load_target``); the chunks of the distillation corpus that
``training/make_default_pair.py`` caches (``sampled_chunks``, ``eval_corpus``); the target's final
hidden states over them (``features``, cached by ``cmd_extract``); and the short plain-text openings
the target writes itself (``openings``, continued by ``cmd_openings``).  Features, openings and
weights are cached in ``CACHE`` (``$SPECDEC_FEATURE_DRAFT_CACHE``, default
``~/.cache/specdec_kernels/feature_draft_training``).
"""

from __future__ import annotations

import glob
import os
import random
import re
import time
from pathlib import Path

import torch

from specdec_kernels.models import embedded as models

CACHE = Path(os.environ.get("SPECDEC_FEATURE_DRAFT_CACHE",
                            Path.home() / ".cache" / "specdec_kernels" / "feature_draft_training"))
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

    def words(texts):
        return {w for t in texts for w in _words(t) if len(w) >= 4}

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

