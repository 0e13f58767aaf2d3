"""The host side of a step: what each row emits, why it stops, and the trace.

After the step's one host sync the loop hands over each row's verified tokens; here they are
cut at the row's budget, an EOS (kept), a stop string (the tokens up to the one that completed
it), or the first token where a stopping criterion fires, then streamed, traced (``verbose``)
and appended to the row.  Pure host work on Python lists: no tensor is read here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .state import DecodeState

__all__ = ["append_row", "cut_row", "emit_rows", "log_row", "stop_cut"]


def emit_rows(st: "DecodeState", tokenizer, n_host: list, kb_host: list, tok_host: list, x_host: list) -> list:
    """Append each active row's new tokens (``tok_host[i][: n + 1]``, cut as the module
    docstring says), set its finish reason, and return how many each row emitted."""
    emitted_counts = []
    for i, p in enumerate(st.rows):
        m = n_host[i]
        if m < 0:
            st.finish[p] = "nonfinite"
            emitted_counts.append(0)
            continue
        new, reason = cut_row(st, tokenizer, p, tok_host[i][: m + 1])
        if st.hooks.streamer is not None and new:
            st.hooks.streamer.put(torch.tensor(new))
        if st.hooks.verbose is not None:
            log_row(st, tokenizer, p, x_host[i][: kb_host[i]], m, kb_host[i], new)
        append_row(st, p, new, reason)
        emitted_counts.append(len(new))
    return emitted_counts


def cut_row(st: "DecodeState", tokenizer, p: int, new: list) -> tuple:
    """(the tokens of ``new`` that row p keeps, the reason it stops there or None): cut at the row's
    budget, at an EOS (kept), after the token that completes a stop string, or at the first token
    where a stopping criterion fires (EOS wins a tie)."""
    room = st.budget_host[p] - len(st.generated[p])
    new = new[:room]
    reason = None
    for j, t in enumerate(new):
        if t in st.settings.eos:
            new, reason = new[: j + 1], "eos"
            break
    if st.settings.stop:
        cut = stop_cut(tokenizer, st.generated[p], new, st.settings.stop)
        if cut is not None:
            new, reason = new[:cut], "stop"
    if st.hooks.criteria is not None and new:
        cut = st.hooks.criteria(p, st.generated[p], new)
        if cut is not None and (reason is None or cut < len(new)):
            new, reason = new[:cut], "stop"
    return new, reason


def append_row(st: "DecodeState", p: int, new: list, reason: Optional[str]) -> None:
    """Row p takes its kept tokens and its finish reason (``"length"`` or ``"context"`` once its
    budget is spent)."""
    st.generated[p].extend(new)
    st.seqs[p].extend(new)
    if reason is None and len(st.generated[p]) >= st.budget_host[p]:
        reason = "length" if st.budget_host[p] == st.settings.max_new else "context"
    st.finish[p] = reason


def stop_cut(tokenizer, generated: list, new: list, stop: list) -> Optional[int]:
    """The number of ``new`` tokens up to the one that completes a stop string, or None.
    Only matches that end in the new tokens count; they may start in earlier ones."""
    longest = max(len(s) for s in stop)
    # Grow the window of earlier tokens until it holds a stop string's length in whole
    # characters: with byte-level tokens a window may start inside a character, whose first
    # bytes then decode as U+FFFD.
    w = longest
    while True:
        window = generated[-w:] if w else []
        old = tokenizer.decode(window, skip_special_tokens=True)
        if len(old.lstrip("\ufffd")) >= longest or w >= len(generated):
            break
        w *= 2
    for j in range(1, len(new) + 1):
        text = tokenizer.decode(window + new[:j], skip_special_tokens=True)
        # The characters that were already there: a character whose last bytes were still to
        # come decoded as U+FFFD in ``old`` and differs now, so the search starts before it.
        base = len(os.path.commonprefix([old, text]))
        for s in stop:
            if text.find(s, max(0, base - len(s) + 1)) != -1:
                return j
    return None


def log_row(st: "DecodeState", tokenizer, p: int, drafts: list, n: int, kb: int, emitted: list) -> None:
    """One row's step: its drafts, the accepted prefix, then the recovered or bonus token
    (shown only if it was emitted, i.e. not cut by EOS, a stop string or the budget); a row
    that drafted nothing (K = 0, or no room) shows the target's own token."""
    def show(ids):
        return repr(ids) if tokenizer is None else repr(tokenizer.decode(ids))

    out = st.hooks.verbose
    head = f"[step {st.steps_done} | row {p}]"
    if kb > 0:
        print(f"{head} Drafted:  {show(drafts)}", file=out)
        print(f"{head} Accepted: {show(drafts[:n])} ({n}/{kb} tokens)", file=out)
    if len(emitted) == n + 1:
        kind = "target, no drafts" if kb == 0 else "bonus" if n == kb else "recovered"
        print(f"{head} + {kind}: {show(emitted[n:])}", file=out)
