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

Features and weights are cached in ``$SPECDEC_FEATURE_DRAFT_CACHE`` (default
``~/.cache/specdec_kernels/feature_draft_training``).  The figures are in docs/feature_draft.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from feature_draft.data import cmd_extract, cmd_openings  # noqa: E402
from feature_draft.train import cmd_eval, cmd_export, cmd_train  # noqa: E402


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
