"""The tiny random pair: small random Llama models over a character-level tokenizer, made in
a second, for the CLI's ``--tiny-random``, the tests and the benchmarks' quick runs.

``tiny_llama`` builds a random ``LlamaForCausalLM`` from a seed (the same weights for the same
arguments on every machine), ``perturbed`` a draft from it (the target with Gaussian noise on
every weight, so that drafts are often, not always, accepted), ``tiny_random_pair`` the pair the
CLI uses, over ``tiny_char_tokenizer``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

__all__ = ["perturbed", "tiny_char_tokenizer", "tiny_llama", "tiny_random_pair"]

_TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?'\"-()\n"


def tiny_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: <unk> = 0, <eos> = 1, then one id per
    character of a small alphabet (lower-case letters, digits, space, punctuation, newline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in _TINY_CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<unk>")


def tiny_llama(vocab_size: int, hidden: int, layers: int, init: float, seed: int, max_pos: int = 128,
               eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None):
    """A random ``LlamaForCausalLM`` (eval mode, fp32): MLP 2 * hidden, 4 heads, 2 KV heads,
    untied embeddings, weights drawn with std ``init`` from ``seed`` (the global RNG is left as
    it was).  A larger ``init`` makes the logits peaked: greedy argmaxes are then not near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, initializer_range=init, bos_token_id=None,
                      eos_token_id=eos_token_id, pad_token_id=pad_token_id, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


def perturbed(model, noise: float, seed: int):
    """A draft: a copy of ``model`` with Gaussian noise (std ``noise``, drawn from ``seed``) added
    to every weight."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return d


def tiny_random_pair(seed: int = 0, noise: float = 0.02):
    """(draft, target, tokenizer): a 2-layer random Llama target (hidden 64, context 1,024) over
    ``tiny_char_tokenizer`` and its ``perturbed`` draft."""
    tokenizer = tiny_char_tokenizer()
    target = tiny_llama(len(tokenizer), 64, 2, 0.1, seed, max_pos=1024, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return perturbed(target, noise, seed), target, tokenizer
