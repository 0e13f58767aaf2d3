"""What transformers users pass per row, as ``SpeculativeDecoder`` takes it: stopping criteria
(``split_criteria`` maps the length and EOS criteria onto the decoder's budget and EOS set;
``RowCriteria`` evaluates the others after each accepted token, on that row alone), a streamer
(``check_streamer``: batch 1, as transformers' own), and chat messages (``chat_prompts``:
through the tokenizer's chat template).  Transformers is imported inside the functions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["RowCriteria", "chat_prompts", "check_streamer", "split_criteria"]


def split_criteria(criteria) -> tuple:
    """(max_length or None, EOS ids or None, the other criteria): ``MaxLengthCriteria`` and
    ``EosTokenCriteria`` become the decoder's budget and EOS set; the rest are evaluated per
    token by ``RowCriteria``."""
    from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    max_length, eos, rest = None, None, StoppingCriteriaList()
    for c in criteria or ():
        if type(c) is MaxLengthCriteria:
            max_length = c.max_length if max_length is None else min(max_length, c.max_length)
        elif type(c) is EosTokenCriteria:
            ids = torch.as_tensor(c.eos_token_id).reshape(-1).tolist()
            eos = sorted(set(ids) | set(eos or ()))
        else:
            if not callable(c):
                raise TypeError(f"stopping_criteria must hold StoppingCriteria (callables), got "
                                f"{type(c).__name__}")
            rest.append(c)
    return max_length, eos, rest


class RowCriteria:
    """Stopping criteria evaluated the way ``generate`` would see each row: after each accepted
    token, on that row alone as a [1, T] batch (``prefixes[p]``, the ids before the generated
    ones as the criteria see them, then the generated ids), ``scores=None``.  Called by the
    decoder once per row and step with the step's new tokens; returns how many of them to keep
    (up to and including the first where a criterion fires), or None."""

    def __init__(self, criteria, prefixes: Sequence[Sequence[int]], device: torch.device):
        from transformers import StoppingCriteriaList

        self.criteria = StoppingCriteriaList(criteria)
        self.prefixes = [list(p) for p in prefixes]
        self.device = device

    def __call__(self, p: int, generated: list, new: list) -> Optional[int]:
        base = self.prefixes[p] + generated
        for j in range(1, len(new) + 1):
            ids = torch.tensor([base + new[:j]], dtype=torch.int64, device=self.device)  # [1, T]
            if bool(torch.as_tensor(self.criteria(ids, None)).any()):
                return j
        return None


def check_streamer(streamer, batch: int) -> None:
    """A streamer has ``put`` and ``end`` (transformers' ``BaseStreamer``) and takes batch 1, as
    transformers' own streamers do (the rows of a batch advance by different counts each step)."""
    if streamer is None:
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer must have put() and end() (transformers' BaseStreamer), got "
                        f"{type(streamer).__name__}")
    if batch != 1:
        raise ValueError(f"streamer takes one prompt (batch size 1, as transformers' streamers), got {batch} prompts")


def _is_conversation(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def chat_prompts(prompts, tokenizer) -> Optional[list]:
    """Chat messages as token-id lists through the tokenizer's chat template (with the generation
    prompt); None when ``prompts`` is not chat: a list of {"role", "content"} dicts (one
    conversation) or a list of such lists."""
    if _is_conversation(prompts):
        convs = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(_is_conversation(c) for c in prompts):
        convs = list(prompts)
    else:
        return None
    if tokenizer is None:
        raise TypeError("prompts given as chat messages need a tokenizer with a chat template: pass tokenizer=... "
                        "to SpeculativeDecoder")
    for i, conv in enumerate(convs):
        for j, m in enumerate(conv):
            if "role" not in m or "content" not in m:
                where = f"prompts[{j}]" if len(convs) == 1 and _is_conversation(prompts) else f"prompts[{i}][{j}]"
                raise ValueError(f"{where} must be a message with 'role' and 'content', got keys {sorted(m)}")
    rows = []
    for conv in convs:
        ids = tokenizer.apply_chat_template(list(conv), add_generation_prompt=True, tokenize=True, return_dict=False)
        rows.append([int(t) for t in ids])
    return rows
