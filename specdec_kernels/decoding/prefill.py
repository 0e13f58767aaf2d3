"""The prefill: every prompt token but the last goes into both caches before the first step.

Prompts of very different lengths are not all padded to the longest: ``_prefill_groups``
splits the rows into groups of similar lengths, one forward each, when that costs less (a
forward's fixed cost against the padded tokens it saves), and the groups' caches are stacked
into the batch's.  The rows' caches are left-aligned (see ``decoder.py``).

Internal to ``SpeculativeDecoder`` (whose ``_prefill`` calls ``prefill_``), like the drafters'
steps: the decoder's ``DecodeState`` has been checked by ``generate``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from ..ops.kv.cache import new_cache, stack_caches_

if TYPE_CHECKING:  # pragma: no cover
    from .state import DecodeState

# The prefill's fixed cost of one more forward, in padded prompt tokens: what a forward over a
# [rows, P] block costs is about this + rows * P tokens.  On the CPU a forward's fixed part (the
# Python of the layers, one pass over the weights) weighs about as much as 12 tokens of
# arithmetic (SmolLM2-135M, fp32, 1 thread: docs/history/measurements.md); on a GPU the arithmetic
# of a few thousand tokens hides behind the launch overhead, so rows are split only when the lengths
# differ by thousands.
_PREFILL_GROUP_COST = {"cpu": 12, "other": 4096}


def _prefill_groups(lens: Sequence[int], fixed_cost: float) -> list:
    """Rows with ``lens[i] > 0`` tokens to prefill, partitioned into groups of similar lengths
    that minimise the sum over groups of ``fixed_cost + len(group) * max length in the group``.
    Each group is a list of row indices; rows with nothing to prefill are in none.

    The optimum groups consecutive lengths and never splits rows of one length (moving them to
    the group of their longest does not raise its maximum and may save a forward), so this is a
    dynamic programme over the D distinct lengths in increasing order, L_1 < ... < L_D with N_j
    rows of length <= L_j: best_j = fixed_cost + N_j * L_j + min_{i<j} (best_i - N_i * L_j), a
    minimum over lines of slope -N_i queried at increasing L_j, kept as a lower envelope (the
    convex hull trick): O(B log B) for B rows rather than the O(B^2) of trying every cut."""
    order = sorted((i for i in range(len(lens)) if lens[i] > 0), key=lambda i: (lens[i], i))
    if not order:
        return []
    L, N, ends = [], [0], []  # distinct lengths; N[j]: rows in the first j of them; ends: their run ends
    for pos, i in enumerate(order):
        if L and lens[i] == L[-1]:
            N[-1] += 1
            ends[-1] = pos + 1
        else:
            L.append(lens[i])
            N.append(N[-1] + 1)
            ends.append(pos + 1)
    D = len(L)
    best = [0.0] * (D + 1)  # best[j]: the cost of the rows of the first j lengths
    cut = [0] * (D + 1)
    hull: list = []  # line indices i (slope -N[i], intercept best[i]), slopes decreasing
    head = 0

    def value(i: int, x: float) -> float:
        return best[i] - N[i] * x

    for j in range(1, D + 1):
        i3 = j - 1  # the line of a group starting after length j - 1
        while len(hull) - head >= 2:
            i1, i2 = hull[-2], hull[-1]
            # i2 is never below both neighbours once i3 meets i1 at or before i2 does
            if (best[i3] - best[i1]) * (N[i2] - N[i1]) <= (best[i2] - best[i1]) * (N[i3] - N[i1]):
                hull.pop()
            else:
                break
        hull.append(i3)
        head = min(head, len(hull) - 1)
        x = L[j - 1]
        while len(hull) - head >= 2 and value(hull[head + 1], x) <= value(hull[head], x):
            head += 1
        i = hull[head]
        best[j] = fixed_cost + N[j] * x + value(i, x)
        cut[j] = i
    groups, j = [], D
    while j > 0:
        i = cut[j]
        groups.append(sorted(order[(ends[i - 1] if i > 0 else 0):ends[j - 1]]))
        j = i
    return groups[::-1]


def prefill_(st: "DecodeState", t, d, feature) -> None:
    """Cache every prompt token but the last, which becomes the first step's ``last``: the
    target (runner ``t``) and the draft (runner ``d``, None for prompt lookup; ``feature``: the
    FeatureDraft when ``d`` runs one) into ``st.target_cache`` / ``st.draft.cache``; sets the rows' lengths and
    ``last``."""
    t0 = time.perf_counter()
    dev = st.device
    lens = [st.settings.prompt_lens[p] for p in st.rows]
    B, P = len(lens), max(lens) - 1
    st.last = torch.tensor([st.seqs[p][-1] for p in st.rows], dtype=torch.int64, device=dev)
    st.target_len_host = [n - 1 for n in lens]
    st.target_len = torch.tensor(st.target_len_host, dtype=torch.int64, device=dev)
    st.draft.begin(st, P)  # the drafter's own per-row state (its cache's lengths, a feature draft's first pair)
    groups = _prefill_groups(st.target_len_host, _PREFILL_GROUP_COST.get(dev.type, _PREFILL_GROUP_COST["other"]))
    if P > 0 and len(groups) == 1:
        # One forward over all rows (right-padded to P).  A row whose prompt is one token has
        # no valid column here; column 0 stands in as a valid key for this forward only, so
        # no query row is fully masked (sdpa would write NaN into the cache).  Later masks
        # drop it and compaction overwrites it.
        _prefill_rows(st, t, d, feature, list(range(B)), P, st.target_cache, st.draft.cache)
    elif P > 0:
        # Prompts of very different lengths: one forward per group of similar lengths (no
        # row is padded to the longest prompt), then the groups' caches stacked, right-padded
        # to P columns, into the batch's caches.  Rows with nothing to cache are in no group.
        parts = []
        for g in groups:
            Pg = max(st.target_len_host[i] for i in g)
            target_cache = new_cache(t.model)
            draft_cache = new_cache(d.model) if st.draft.cache is not None else None
            _prefill_rows(st, t, d, feature, g, Pg, target_cache, draft_cache)
            parts.append((torch.tensor(g, dtype=torch.int64, device=dev), target_cache, draft_cache))
        stack_caches_(st.target_cache, [(g, c) for g, c, _ in parts], B, P)
        if st.draft.cache is not None:
            stack_caches_(st.draft.cache, [(g, c) for g, _, c in parts], B, P)
    st.target_columns = P
    if st.hooks.clock.cuda:
        torch.cuda.synchronize(dev)
    st.prefill_time = time.perf_counter() - t0

def _prefill_rows(st: "DecodeState", t, d, feature, rows: list, P: int, target_cache, draft_cache) -> None:
    """Cache the prompts (all tokens but the last) of batch rows ``rows`` into ``target_cache``/``draft_cache``
    in one forward each, right-padded to ``P`` columns."""
    dev = st.device
    n = len(rows)
    ids = torch.zeros((n, P), dtype=torch.int64)  # right-padded; the pad id is irrelevant
    for j, i in enumerate(rows):
        L = st.target_len_host[i]
        ids[j, :L] = torch.tensor(st.seqs[st.rows[i]][:L])
    ids = ids.to(dev)
    lens = torch.tensor([max(st.target_len_host[i], 1) for i in rows], dtype=torch.int64, device=dev)
    mask = torch.arange(P, device=dev)[None, :] < lens[:, None]  # [n, P]
    pos = torch.arange(P, device=dev)[None, :].expand(n, P)
    # the draft's positions stop at its context where it is shorter than the target's: a prompt
    # past it leaves the draft nothing to draft from (drafters.base.draft_cap), but a valid cache
    dpos = pos if st.settings.draft_context is None else pos.clamp(max=st.settings.draft_context - 1)
    if feature is not None and draft_cache is not None:
        # the target's features h; the draft's column t takes (h[t - 1], x_t), h[-1] = 0
        h = t.forward_hidden(target_cache, ids, mask, pos, 0)  # [n, P, H]
        feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1).to(st.draft.pending_features.dtype)
        d.step(draft_cache, ids, feats, mask, dpos, 1, model_path=True)
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        last_col = (lens - 1)[:, None, None].expand(n, 1, h.shape[-1])
        has = torch.tensor([st.target_len_host[i] > 0 for i in rows], device=dev)[:, None]  # else f = 0
        st.draft.pending_features[idx, 0] = torch.where(
            has, h.gather(1, last_col)[:, 0], 0).to(st.draft.pending_features.dtype)
        return
    t.forward(target_cache, ids, mask, pos, 0, 1)
    if draft_cache is not None:
        d.forward(draft_cache, ids.clamp(max=d.vocab_size - 1), mask, dpos, 0, 1)
