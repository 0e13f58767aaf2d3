"""A grammar's token mask on the verification: ``fused_verify(..., token_bitmask=)``.

The layout is xgrammar's (``xgrammar.allocate_token_bitmask`` / ``fill_next_token_bitmask`` write it
directly): int32 words, bit ``v % 32`` of word ``v // 32`` set when token v is allowed, W =
ceil(V / 32) words per position.  ``fused_verify`` takes [B, K+1, W] (one mask per verify position,
each for its own prefix: the row's tokens, then the drafts before it); ``fused_verify_packed``
[sum_b (K_b + 1), W].  Words past V's last bit are not read.

The masked law of a position is the target's restricted to the allowed tokens and renormalised,
what plain decoding with the same mask gives: the mask is applied first, a forbidden token's logit
becomes -inf (a probability, with ``target_is_probs``, 0), then temperature, top-k, top-p and min-p
as without a mask (vLLM's and transformers' order).  A NaN or inf at a forbidden token is masked
away; at an allowed one it makes the row invalid as without a mask.  A position that allows
nothing, or only tokens whose logits are -inf, has no finite logit: its row is invalid
(``num_accepted = -1``, tokens -1), never a forbidden token.

Memory traffic: the Triton kernel applies the mask inside its one launch (MASKED): every read of a
position's logits also reads the mask's words that cover them, W * 4 = V / 8 bytes a position
(1/32 of fp32 logits, 1/16 of bf16), and nothing is written.  The torch path (CPU) masks a copy
first: one extra pass (read [B, K+1, V] and W words per position, write [B, K+1, V]).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["allowed_tokens", "apply_token_bitmask", "bitmask_width", "check_token_bitmask"]


def bitmask_width(vocab_size: int) -> int:
    """W, the int32 words of one position's mask: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def check_token_bitmask(mask, lead_shape: tuple, vocab_size: int, device: torch.device,
                        name: str = "token_bitmask") -> torch.Tensor:
    """``mask`` checked against the logits' leading shape and vocabulary (one line naming the
    argument, the expected and the actual value); returned as it is."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(mask).__name__}")
    if mask.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (xgrammar's bitmask), got {mask.dtype}")
    want = (*lead_shape, bitmask_width(vocab_size))
    if tuple(mask.shape) != want:
        raise ValueError(f"{name} must have shape {list(want)} (ceil(V / 32) = {want[-1]} words for V = "
                         f"{vocab_size}), got {list(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} must be on the logits' device {device}, got {mask.device}")
    return mask


def allowed_tokens(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 -> [..., V] bool: token v allowed where bit v % 32 of word v // 32 is set.
    The words' bytes, least significant first (little-endian int32, as xgrammar writes them), each
    tested against its 8 bit values."""
    by = mask.contiguous().view(torch.uint8)  # [..., 4 W]: byte v // 8 holds bit v % 8 of token v
    if sys.byteorder == "big":  # the words' bytes in memory, most significant first
        by = by.unflatten(-1, (-1, 4)).flip(-1).flatten(-2)
    bit = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (by.unsqueeze(-1) & bit).ne(0).flatten(-2)[..., :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, target_is_probs: bool = False) -> torch.Tensor:
    """A copy of ``logits`` [..., V] with the forbidden tokens at -inf (probabilities: at 0)."""
    keep = allowed_tokens(mask, logits.shape[-1])
    return logits.masked_fill(~keep, 0.0 if target_is_probs else float("-inf"))
