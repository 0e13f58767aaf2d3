"""The decoding loop: ``run`` a started call (``state.start_state``) with a decoder's parts
(``parts.DecoderParts``) to its ``GenerationResult``, one ``step`` at a time.

Cache layout (ragged batches without moving old data).  Both models keep a ``DynamicCache``
whose rows are *left-aligned*: row b's tokens occupy columns [0, len_b); columns [len_b, T)
are a masked gap.  Every forward appends its new columns at T (the same for every row) with an
explicit 2D ``attention_mask`` and ``position_ids`` (row b's new tokens get positions len_b,
len_b + 1, ...).  After verifying [last, x_1 .. x_K] at columns T .. T+K, row b keeps n_b + 1 of
them: they are compacted down to len_b (``compact_dynamic_cache_``), len_b grows by n_b + 1 and
the cache is cropped to max_b len_b.  The emitted recovered/bonus token is not cached: it is
the next step's ``last``.  The draft model does the same with its own cache: it ran K one-token
forwards on [last, x_1 .. x_{K-1}] and keeps min(n_b + 1, K) of them; a row that accepted all K
lacks x_K, so its next step *catches up* by feeding [x_K, last] (rows that need no catch-up
feed a masked gap column and ``last``).  A K = 0 step (``"auto"``) runs no draft forward: what the
draft has not taken waits, and its next step feeds it all in one right-aligned block before its
drafts.  Nothing already cached is ever fed again.
Finished rows are sliced out of both caches.  This module holds the loop and the target's side
(``step``: draft -> verify -> roll back -> emit); each drafter (``drafters/``: one interface in
``base.py``) owns its forwards and cache bookkeeping, the draft's warp and random numbers are in
``drafters/sampling.py``, the call's state in ``state.py``, the prefill in ``prefill.py``, what
each row emits in ``emit.py``, the checks of the arguments in ``call.py`` and ``arguments.py``,
transformers' arguments (``GenerationConfig``, streamers, stopping criteria, chat messages) in
``integrations/transformers/``, the DynamicCache helpers in ``ops/kv/cache.py``.

Host synchronisation: one device-to-host copy per step (the accepted counts and tokens, needed
to detokenise, check stop strings and EOS, and crop the caches); everything else stays on the
device.

Randomness: row p of a call uses seed ``seed + p`` (or ``seed[p]``).  The verifier draws from
Philox at (seed_p, step); the draft samples by inverse CDF from counter-based hashes of
(a key derived from seed_p, step, draft position).  So a row's output depends only on its
prompt, its seed and K (with ``"auto"``, K comes from measured times: a seeded sampling run is then
reproducible in distribution, not token for token), never on the other rows: decoding prompt p
alone with seed ``seed + p`` gives the same tokens as in the batch (at a fixed K), provided the
models give that row the same logits, bit for bit, in the batch and alone.  The tests check it
on their models.  A model's forward need not be batch-invariant: in the prefill, torch's matmul
over more rows than ``skinny_linear`` takes, and attention over a left-padded or gapped cache,
may round a row's logits differently in the last bit, and a token then differs where a uniform
falls within that rounding of a decision boundary (rare: about 1e-6 of the draws at one step of
a tiny random model, docs/history/measurements.md).  The randomness and the verification never
depend on the other rows.

Tests drive the loop step by step through ``prefill`` and ``step`` (inside
``parts.linear_layers()``, as ``run``'s caller holds it).
"""

from __future__ import annotations

import time

import torch

from ..ops.host import to_device
from ..ops.kv.cache import compact_dynamic_cache_, crop_cache_
from .emit import emit_rows
from .parts import DecoderParts
from .prefill import prefill_
from .state import DecodeState, GenerationResult

__all__ = ["choose_k", "drop_finished", "prefill", "run", "step"]


def run(parts: DecoderParts, st: DecodeState, baseline_tokens_per_s=None) -> GenerationResult:
    """Decode every row of ``st`` to its end: the prefill, then steps until no row is left."""
    t0 = time.perf_counter()
    drop_finished(parts, st)
    if st.rows:
        prefill(parts, st)
    while st.rows:
        step(parts, st)
    total = time.perf_counter() - t0
    if st.hooks.pbar is not None:
        st.hooks.pbar.close()
    if st.hooks.streamer is not None:
        st.hooks.streamer.end()
    stats = st.hooks.recorder.finalize(total, st.prefill_time, st.finish, baseline_tokens_per_s,
                                       draft_is_free=parts.draft_runner is None)
    for name, value in parts.drafter.describe(st).items():  # e.g. the vocabulary a draft model used
        setattr(stats, name, value)
    return GenerationResult.of(st, parts.tokenizer, stats)


def prefill(parts: DecoderParts, st: DecodeState) -> None:
    """``prefill.prefill_`` with these parts' models."""
    prefill_(st, parts.target_runner, parts.draft_runner, parts.feature)

def choose_k(parts: DecoderParts, st: DecodeState) -> int:
    """K, the drafts of this step.  ``"auto"`` may choose K = 0 with a draft model or a
    feature draft: such a step runs no draft forward at all (the tokens, or pairs, the draft
    has not taken wait, and its next forward takes them together), so it costs what a step
    of the target alone costs."""
    if st.target_only:
        return 0
    s = st.settings
    auto_zero = s.k == "auto" and parts.drafter.network
    k = st.hooks.recorder.choose_k(s.k_max, allow_zero=auto_zero) if s.k == "auto" else s.k
    # Row b drafts K_b = min(K, budget_b - 1, its room below a shorter draft context:
    # drafters.base.draft_cap), so K is at most the largest K_b any row may verify.
    dctx = st.settings.draft_context
    room = max(st.budget_host[p] - len(st.generated[p]) - 1 if dctx is None else
               min(st.budget_host[p] - len(st.generated[p]) - 1, dctx - n)
               for p, n in zip(st.rows, st.target_len_host))
    return max(min(k, room), 0)


def _row_params(st: DecodeState, B: int) -> tuple:
    """(temperature [B] fp32, top_k [B] int64 or None, top_p [B] fp32 or None, min_p [B] fp32 or
    None) for ``fused_verify``, made once per batch size (rows drop out as they finish)."""
    got = st.row_params.get(B)
    if got is None:
        def full(v, dt):
            return None if v is None else torch.full((B,), v, dtype=dt, device=st.device)
        s = st.settings
        got = st.row_params[B] = (full(s.temperature, torch.float32), full(s.top_k, torch.int64),
                                  full(s.top_p, torch.float32), full(s.min_p, torch.float32))
    return got


def step(parts: DecoderParts, st: DecodeState) -> None:
    """One step: draft -> verify -> roll back -> emit, with one host sync (after the verify)."""
    dctx = st.settings.draft_context
    if dctx is not None and not st.target_only and min(st.target_len_host) >= dctx:
        st.retire_draft()
    drafter = None if st.target_only else parts.drafter
    K = choose_k(parts, st)
    # this step's draft takes what waited through K = 0 steps (not a typical draft time)
    waited = st.draft.holds_waiting()
    clock = st.hooks.clock
    t_a = clock.mark()
    d = drafter.draft(st, K) if drafter is not None and K > 0 else None
    X, Q, kb = _verify_inputs(st, drafter, d)  # [B, K], [B, K, Vd] or None, [B] K_b
    K = X.shape[1]
    t_b = clock.mark()
    out, feats = _verify(parts, st, drafter, X, Q, kb)
    n = out.num_accepted  # [B] int64 in [-1, K_b]
    t_c = clock.mark()  # on CUDA before the sync, which then guarantees the event has completed

    # The step's one host sync: counts, K_b, tokens, drafts.
    packed = torch.cat([n[:, None], kb[:, None], out.tokens[:, : K + 1], X], 1).cpu()
    n_host, kb_host = packed[:, 0].tolist(), packed[:, 1].tolist()
    tok_host, x_host = packed[:, 2:3 + K].tolist(), packed[:, 3 + K:].tolist()

    # Roll back (device work, no sync): the target keeps last + the accepted drafts, the
    # drafter what it accepted (or, without drafts, what waits for its next forward).
    keep_t = (n + 1).clamp(min=0)  # [B]
    compact_dynamic_cache_(st.target_cache, st.target_columns, st.target_len, keep_t)
    st.target_len, st.target_columns = st.target_len + keep_t, st.target_columns + K + 1
    st.target_len_host = [a + max(m + 1, 0) for a, m in zip(st.target_len_host, n_host)]
    if drafter is not None and d is not None:
        drafter.after_verify(st, out, feats, n, n_host, K)
    elif drafter is not None:  # a K = 0 step
        drafter.wait(st, out, feats)
    st.last = out.tokens.gather(1, n.clamp(min=0)[:, None])[:, 0]
    st.gen, st.step, st.steps_done = st.gen + keep_t, st.step + 1, st.steps_done + 1

    # Emit (host): EOS, stop strings, stopping criteria, the streamer, the trace.
    emitted = emit_rows(st, parts.tokenizer, n_host, kb_host, tok_host, x_host)
    st.hooks.recorder.record_step(K, st.rows, kb_host, n_host, emitted)
    st.hooks.recorder.record_times(clock.seconds(t_a, t_b), 0 if d is None else d.forwards, clock.seconds(t_b, t_c),
                             first_step=st.steps_done == 1, k=K, draft_typical=not waited)
    if st.hooks.pbar is not None:
        st.hooks.pbar.update(sum(emitted))
    drop_finished(parts, st)
    if st.rows:  # drop the columns past the longest row (rejected drafts, finished rows)
        st.target_columns = max(st.target_len_host)
        crop_cache_(st.target_cache, st.target_columns)
        st.draft.crop()


def _verify_inputs(st: DecodeState, drafter, d) -> tuple:
    """(X [B, K] int64, Q [B, K, Vd] fp32 or None, K_b [B] int64) for the verify: a network's
    K_b is its K (fewer where it cut a row) within the row's budget; no drafts: K = 0."""
    B, dev = len(st.rows), st.device
    if d is None:
        return (torch.zeros((B, 0), dtype=torch.int64, device=dev), None,
                torch.zeros(B, dtype=torch.int64, device=dev))
    if not drafter.network:  # it proposed within each row's budget
        return d.tokens, d.probs, d.num
    kb = torch.clamp(st.budget - st.gen - 1, max=d.tokens.shape[1])  # [B]
    return d.tokens, d.probs, kb if d.num is None else torch.minimum(kb, d.num)


def _verify(parts: DecoderParts, st: DecodeState, drafter, X: torch.Tensor, Q, kb: torch.Tensor) -> tuple:
    """The target scores [last, x_1 .. x_K] at cache columns target_columns .. target_columns + K and
    ``fused_verify`` keeps a prefix of the drafts and adds one token.  Returns (VerifyOutput, the target's
    features at those columns [B, K + 1, H] for a drafter that reads them, else None)."""
    from ..ops.verify import fused_verify, verify_prechecked

    B, K, dev = X.shape[0], X.shape[1], st.device
    ids = torch.cat([st.last[:, None], X], 1)  # [B, K+1]
    pos = st.target_len[:, None] + torch.arange(K + 1, device=dev)[None, :]  # [B, K+1]
    if st.settings.context is not None:
        pos = pos.clamp(max=st.settings.context - 1)
    mask = None  # every row's cache is full: no padding, no mask
    if min(st.target_len_host) < st.target_columns:
        mask = torch.cat([torch.arange(st.target_columns, device=dev)[None, :] < st.target_len[:, None],
                          torch.ones((B, K + 1), dtype=torch.bool, device=dev)], 1)  # [B, target_columns + K + 1]
    feats = None
    if drafter is not None and drafter.reads_features:
        # logits [B, K+1, V] and feats [B, K+1, H]
        logits, feats = parts.target_runner.step_hidden(st.target_cache, ids, mask, pos, st.target_columns, K + 1)
    else:
        logits = parts.target_runner.step(st.target_cache, ids, mask, pos, st.target_columns, K + 1)  # [B, K+1, V]
    if st.hooks.procs is not None:  # sequence processors: position i sees the row's ids, then x_1 .. x_i
        logits = st.hooks.procs(logits, X, kb.tolist(), st.rows, st.generated)
    bitmask = None
    if st.hooks.grammar is not None:  # each position's grammar mask, from the row's tokens and x_1 .. x_i
        bitmask = st.hooks.grammar.verify_bitmask(X.tolist(), kb.tolist(), st.rows, st.generated, K)
    temp, top_k, top_p, min_p = _row_params(st, B)
    if parts.verification == "block" or bitmask is not None:
        # the op's checks included (block verification and a grammar's mask, applied in the launch, are eager)
        out = fused_verify(logits, X, Q, num_draft_tokens=kb, temperature=temp, top_k=top_k, top_p=top_p,
                           min_p=min_p, seed=st.seed, offset=st.step, backend=parts.verify_backend,
                           method=parts.verification, token_bitmask=bitmask)
    else:  # fused_verify without its per-call checks: generate checked the parameters, the tensors are built here
        out = verify_prechecked(logits, X, Q, kb, temp, top_k, top_p, st.seed, st.step, min_p=min_p,
                                backend=parts.verify_backend)
    return out, feats


def drop_finished(parts: DecoderParts, st: DecodeState) -> None:
    keep = [i for i, p in enumerate(st.rows) if st.finish[p] is None]
    if len(keep) == len(st.rows):
        return
    st.rows = [st.rows[i] for i in keep]
    if not keep:
        return
    idx = to_device(keep, torch.int64, st.device)
    for name in ("last", "target_len", "gen", "budget", "seed", "key_lo", "key_hi", "step"):
        t = getattr(st, name)
        if t is not None:
            setattr(st, name, t.index_select(0, idx))
    st.target_len_host = [st.target_len_host[i] for i in keep] if st.target_len_host else st.target_len_host
    parts.drafter.select_rows(st, idx, keep)  # what the drafter keeps per row, its cache included
    if st.target_len_host:  # after the prefill: slice the cache (the caller crops it)
        st.target_cache.batch_select_indices(idx)


