"""A tiny pair whose tokenizers differ, for the cross-vocabulary drafter's tests.

The target reads characters: one token per character of ``ALPHABET`` (ids in alphabet order
after its specials).  The draft's tokenizer is a BPE over a permuted *part* of that alphabet (it
cannot write ``MISSING``: those characters become its unknown token) with merges, so a prompt
tokenizes differently on the two sides and some target tokens have no draft token.  Both models
are random Llamas; the draft is the target's copy where their tokens write the same character
(its embedding and output rows are the target's rows of that character), plus noise, so that
its drafts are often accepted.
"""

from __future__ import annotations

import copy
import random

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from specdec_kernels.models.tiny import tiny_llama

ALPHABET = "abcdefghijklmnop ."
MISSING = "op"  # characters the draft's tokenizer has no token for
MERGES = [("a", "b"), ("c", "d"), ("ab", "cd"), ("e", " "), ("f", "g")]
TARGET_SPECIALS = ["<unk>", "</s>"]
DRAFT_SPECIALS = ["</s>", "<unk>"]  # the same contents, other ids


def _fast(vocab: dict, merges: list, unk: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, eos_token="</s>", pad_token=unk,
                                   padding_side="left")


def target_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character: ``<unk>`` 0, ``</s>`` 1, then ``ALPHABET``'s characters."""
    vocab = {s: i for i, s in enumerate(TARGET_SPECIALS)}
    for c in ALPHABET:
        vocab[c] = len(vocab)
    return _fast(vocab, [], "<unk>")


def draft_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """A BPE over ``ALPHABET`` less ``MISSING``, its characters in a permuted order, with ``MERGES``."""
    chars = [c for c in ALPHABET if c not in MISSING]
    random.Random(seed).shuffle(chars)
    vocab = {s: i for i, s in enumerate(DRAFT_SPECIALS)}
    for c in chars:
        vocab[c] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    return _fast(vocab, MERGES, "<unk>")


def cross_pair(noise: float = 0.05, seed: int = 0):
    """(draft, target, draft_tokenizer, target_tokenizer): random Llamas over the two tokenizers
    (module docstring).  The target's vocab_size is padded by 2 rows past its tokenizer."""
    tt, dt = target_tokenizer(), draft_tokenizer(seed)
    target = tiny_llama(len(tt) + 2, 32, 2, 0.2, seed=seed, eos_token_id=tt.eos_token_id, pad_token_id=0)
    cfg = copy.deepcopy(target.config)
    cfg.vocab_size = len(dt)
    cfg.eos_token_id = dt.eos_token_id
    draft = type(target)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for (name, p), q in zip(draft.named_parameters(), target.parameters()):
            if p.shape == q.shape:
                p.copy_(q + noise * torch.randn(p.shape, generator=g))
            else:  # the embedding and output layers: the target's row of the same string, else random
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
                tv = tt.get_vocab()
                for s, i in dt.get_vocab().items():
                    if s in tv:
                        p[i] = q[tv[s]] + noise * torch.randn(p.shape[1:], generator=g)
    return draft, target, dt, tt
