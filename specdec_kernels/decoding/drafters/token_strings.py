"""What each token of a tokenizer writes, and the tokens two vocabularies share.

A draft from another model family has another tokenizer.  Where a draft token and a target
token write the same bytes, the draft's choice of that token can be proposed to the target as
that target token (the *intersection* of the vocabularies; Timor et al. 2025, "Accelerating LLM
Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies").

``token_keys`` gives each id a key that two tokenizers can compare:

- a byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: the pre-tokenizer or decoder is ``ByteLevel``)
  writes its tokens in the printable alphabet of ``bytes_to_unicode`` (``Ġ`` is a space, ``Ċ`` a
  newline): the key is the bytes they stand for;
- a SentencePiece vocabulary (``▁`` marks a space; ``<0x0A>`` is a byte token) or a plain one
  (character or word tokens): the token's text with ``▁`` as a space, UTF-8, and a byte token's
  single byte;
- an added or special token (``<|im_end|>``): its content, marked special, so that it matches
  only a special token of the same content on the other side.

Ids of the model's output layer past the tokenizer (padding rows) have no key.  Two ids of one
tokenizer with the same key (a byte token and a one-character token) keep the lower id.  What is
matched only decides which drafts can be proposed as target tokens: the verification is exact
for any set (``CrossVocabDrafter``).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

import torch

__all__ = ["Intersection", "extendable", "intersect", "token_keys"]

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level(tokenizer) -> bool:
    """True when the tokenizer's pre-tokenizer or decoder is byte-level (GPT-2's alphabet)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    parts = (backend.pre_tokenizer, backend.decoder)
    return any(p is not None and b'"ByteLevel"' in p.__getstate__() for p in parts)  # their JSON


def token_keys(tokenizer, size: Optional[int] = None) -> list:
    """One key per id in [0, size) (default: ``len(tokenizer)``): ("special", content) for an added
    or special token, ("text", bytes) for the others, None for an id the tokenizer has no token
    for (see the module docstring)."""
    n = len(tokenizer)
    size = n if size is None else size
    special = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    raw = tokenizer.convert_ids_to_tokens(list(range(min(n, size))))
    byte_level = _byte_level(tokenizer)
    decoder = None
    if byte_level:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        decoder = {c: b for b, c in bytes_to_unicode().items()}
    keys: list = []
    for i in range(size):
        tok = raw[i] if i < len(raw) else None
        if i in special:
            keys.append(("special", special[i]))
        elif tok is None:
            keys.append(None)
        elif byte_level:
            try:
                keys.append(("text", bytes(decoder[c] for c in tok)))
            except KeyError:  # a character outside the byte alphabet: not a byte-level token
                keys.append(("text", tok.encode("utf-8")))
        else:
            m = _BYTE_TOKEN.match(tok)
            keys.append(("text", bytes([int(m.group(1), 16)]) if m else tok.replace("\u2581", " ").encode("utf-8")))
    return keys


class Intersection(NamedTuple):
    """The tokens two vocabularies share: draft_ids [N] and target_ids [N] (int64, the pairs
    ordered by draft id), and target_to_draft [V_target] (int64, -1 where the target token has
    no draft token)."""

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    target_to_draft: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())


def extendable(keys: list) -> set:
    """The ids (of ``token_keys``' list) whose text is a proper prefix of another token's: text
    that follows may merge into such a token."""
    texts = [k[1] for k in keys if k is not None and k[0] == "text"]
    prefixes = {t[:n] for t in texts for n in range(1, len(t))}
    return {i for i, k in enumerate(keys) if k is not None and k[0] == "text" and k[1] in prefixes}


def intersect(draft_tokenizer, target_tokenizer, draft_size: int, target_size: int,
              target_keys: Optional[list] = None, draft_keys: Optional[list] = None) -> Intersection:
    """The pairs (draft id, target id) whose tokens write the same (``token_keys``), over the
    draft's ids [0, draft_size) and the target's [0, target_size) (the models' vocab sizes);
    ``target_keys``, ``draft_keys``: the keys if already computed."""
    first: dict = {}
    keys = token_keys(target_tokenizer, target_size) if target_keys is None else target_keys
    for i, k in enumerate(keys):
        if k is not None and k not in first:
            first[k] = i
    pairs, seen = [], set()
    for i, k in enumerate(token_keys(draft_tokenizer, draft_size) if draft_keys is None else draft_keys):
        j = first.get(k)
        if j is not None and j not in seen:
            seen.add(j)
            pairs.append((i, j))
    d = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    t = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    inv = torch.full((target_size,), -1, dtype=torch.int64)
    inv[t] = d
    return Intersection(d, t, inv)
