"""transformers' universal speculative decoding (USD), inspected: where each row of the draft's
pruned LM head puts its logit.

USD (``generate(assistant_model=, tokenizer=, assistant_tokenizer=, do_sample=True)``) prunes the
draft's LM head to the tokens the two vocabularies share (``AssistantToTargetTranslator`` with
``assistant_prune_lm_head``), its rows in the order of the draft tokenizer's ``get_vocab()`` (a
hash map's), and ``get_target_logits`` writes the pruned logits to target ids in ascending
draft-id order.  Where the two orders differ, the q its verify divides by is a permutation of the
q the draft sampled from (transformers 5.25).  ``reindexed_target_logits`` is the scatter that
matches the pruned rows: ``specdec audit --generator transformers-usd --transformers-fix-usd``
and the cross-tokenizer benchmark's ``usd_hf_reindexed`` put it in ``get_target_logits``' place.
"""

from __future__ import annotations

import torch

__all__ = ["reindexed_target_logits", "target_id_rows", "usd_misplaced_rows", "usd_row_target_ids"]


def usd_row_target_ids(translator) -> torch.Tensor:
    """[V_pruned]: the target id of each row of the pruned draft head (row j holds draft token
    ``translator.assistant_overlap_token_ids[j]``, whose string is the target's token of that id)."""
    return translator._assistant_to_target_input_ids[translator.assistant_overlap_token_ids]


def target_id_rows(translator) -> torch.Tensor:
    """[V_target] int64: the pruned head's row of each target id, -1 for a target id no draft
    token writes (the inverse of ``usd_row_target_ids``)."""
    own = usd_row_target_ids(translator)
    rows = torch.full((translator.target_vocab_size,), -1, dtype=torch.long)
    rows[own] = torch.arange(own.numel())
    return rows


def usd_misplaced_rows(translator) -> tuple[int, int]:
    """(pruned rows whose logit transformers' get_target_logits writes to another token's target
    id, pruned rows): it writes them in ascending draft-id order, which the pruned rows (in the
    draft tokenizer's get_vocab() order) need not be in."""
    m = translator._assistant_to_target_input_ids
    own = usd_row_target_ids(translator)
    return int((own != m[m != translator.SUPPRESS_TOKEN_ID]).sum()), int(own.numel())


def reindexed_target_logits(translator, assistant_logits: torch.Tensor) -> torch.Tensor:
    """[..., V_target]: the pruned draft head's logits [..., V_pruned] at their own rows' target
    ids (``usd_row_target_ids``), -inf elsewhere: what get_target_logits means to return."""
    rows = translator.assistant_overlap_token_ids.numel()
    if assistant_logits.shape[-1] != rows:
        raise ValueError(f"reindexed_target_logits: assistant_logits must be [..., {rows}] (the pruned head's rows), "
                         f"got shape {list(assistant_logits.shape)}")
    out = torch.full((*assistant_logits.shape[:-1], translator.target_vocab_size), translator.FILTER_VALUE,
                     dtype=assistant_logits.dtype, device=assistant_logits.device)
    out[..., usd_row_target_ids(translator).to(assistant_logits.device)] = assistant_logits
    return out
