"""The split kernel under ``ops.interleave``: the cases, settings forms and machines that
``test_verify_interleaved.py`` runs, one interleaved launch checked against the torch backend and
against the plain interpreter, and the check of the items claimed ticket by ticket."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from helpers import assert_close, make_step, random_bitmask
from specdec_kernels import fused_verify, fused_verify_packed
from specdec_kernels.ops.interleave import Schedule, interleaved
from specdec_kernels.ops.kernels import launch_settings, split_workspace
from specdec_kernels.ops.verify.launch import interpreter_grid
from specdec_kernels.ops.verify import workspace as workspace_mod
from specdec_kernels.ops.verify.workspace import counter_layout

CHUNK = 16  # tokens a chunk: V = 40 gives 3 chunks a position, V = 80 gives 5


@dataclasses.dataclass(frozen=True)
class Case:
    """One verification step: B rows of K_b = kb[b] drafts over V tokens (Vd draft tokens),
    temperatures (0: greedy), a warp, and the form of the call."""

    name: str
    kb: tuple
    temps: tuple
    V: int = 40
    Vd: Optional[int] = None
    method: str = "token"
    packed: bool = False
    probs: bool = False  # target_is_probs
    draft: str = "probs"  # "probs" | "logits" (draft_logits=) | "none" (one-hot q)
    logprobs: bool = False
    top_k: Optional[tuple] = None
    top_p: Optional[tuple] = None
    min_p: Optional[float] = None
    grammar: bool = False  # token_bitmask=: a random mask per verify position
    data_seed: int = 0

    @property
    def B(self) -> int:
        return len(self.kb)

    @property
    def K(self) -> int:
        return max(self.kb)

    def call(self, backend: str, seed: int):
        """fused_verify (fused_verify_packed) on this step with row seeds seed + b."""
        B, K, V = self.B, self.K, self.V
        logits, x, q = make_step(B, K, V, seed=self.data_seed, Vd=self.Vd)
        kb = torch.tensor(self.kb)
        target = torch.softmax(logits, -1) if self.probs else logits
        kw = dict(temperature=torch.tensor(self.temps), seed=torch.arange(B) + seed, offset=torch.arange(B) * 3,
                  backend=backend, target_is_probs=self.probs, return_logprobs=self.logprobs, method=self.method)
        if self.top_k is not None:
            kw["top_k"] = torch.tensor(self.top_k)
        if self.top_p is not None:
            kw["top_p"] = torch.tensor(self.top_p)
        if self.min_p is not None:
            kw["min_p"] = self.min_p
        dq = None if self.draft == "none" else (torch.log(q) if self.draft == "logits" else q)
        mask = None
        if self.grammar:
            mask = random_bitmask(torch.Generator().manual_seed(self.data_seed), (B, K + 1), V, density=0.6)
        if self.packed:
            K1 = K + 1
            rows = torch.cat([torch.arange(k + 1) + b * K1 for b, k in enumerate(self.kb)])
            drafts = torch.cat([torch.arange(k) + b * K for b, k in enumerate(self.kb)]).long()
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), kb.cumsum(0)])
            pdq = None if dq is None else dq.reshape(B * K, -1)[drafts]
            if mask is not None:
                kw["token_bitmask"] = mask.reshape(B * K1, -1)[rows]
            if self.draft == "logits":
                kw["draft_logits"] = pdq
                pdq = None
            return fused_verify_packed(target.reshape(B * K1, V)[rows], x.reshape(-1)[drafts], cu, pdq,
                                       max_num_draft_tokens=K, **kw)
        if self.draft == "logits":
            kw["draft_logits"] = dq
            dq = None
        return fused_verify(target, x, dq, num_draft_tokens=kb, token_bitmask=mask, **kw)


def _greedy_mix(B: int) -> tuple:
    return tuple(0.0 if b % 3 == 1 else (1.0, 0.7, 1.3)[b % 3] for b in range(B))


# Every form the issue names: token and block verification, padded and packed, probabilities and
# draft logits in, log-probabilities, each warp, a grammar's mask, ragged K_b with 0, greedy and
# sampled rows, B 1-8.
CASES = [
    Case("token_padded_plain_B1", (2,), (1.0,)),
    Case("token_padded_ragged_B3", (2, 0, 1), (1.0, 0.0, 0.7), data_seed=1),
    Case("token_packed_logprobs_B4", (3, 1, 0, 2), _greedy_mix(4), logprobs=True, data_seed=2),
    Case("token_topk_B2", (2, 1), (1.0, 0.8), top_k=(3, 5), data_seed=3),
    Case("token_topp_packed_B3", (1, 2, 2), (1.0, 0.0, 0.9), top_p=(0.8, 1.0, 0.6), packed=True, data_seed=4),
    Case("token_minp_B2", (2, 2), (1.0, 1.2), min_p=0.05, data_seed=5),
    Case("token_combined_warp_logprobs_B3", (2, 1, 2), (1.0, 0.0, 0.8), top_k=(6, 0, 4), top_p=(0.9, 1.0, 0.7),
         min_p=0.02, logprobs=True, data_seed=6),
    Case("token_probs_in_packed_B3", (2, 0, 1), (1.0, 0.0, 1.0), probs=True, packed=True, data_seed=7),
    Case("token_draft_logits_B2", (2, 1), (1.0, 0.9), draft="logits", data_seed=8),
    Case("token_onehot_drafts_B8", (1, 0, 2, 1, 0, 1, 2, 1), _greedy_mix(8), draft="none", data_seed=9),
    Case("block_padded_B3", (2, 1, 0), (1.0, 0.0, 0.8), method="block", data_seed=10),
    Case("block_packed_draft_logits_logprobs_B2", (2, 1), (1.0, 1.1), method="block", packed=True, draft="logits",
         logprobs=True, data_seed=11),
    Case("block_topk_topp_B2", (1, 2), (0.9, 1.0), method="block", top_k=(4, 0), top_p=(1.0, 0.8), data_seed=12),
    Case("token_five_chunks_B2", (2, 1), (1.0, 0.0), V=80, data_seed=13),
    Case("token_grammar_packed_warp_logprobs_B3", (2, 0, 1), (1.0, 0.0, 0.9), packed=True, top_k=(5, 0, 0),
         top_p=(1.0, 1.0, 0.8), min_p=0.02, logprobs=True, grammar=True, data_seed=14),
    Case("block_grammar_B2", (2, 1), (1.0, 0.8), method="block", grammar=True, data_seed=15),
]

# The slow set's cases: the same forms on 2 chunks a position (3 for the five-chunk case), so
# that its many schedules stay within minutes.
SLOW_CASES = [dataclasses.replace(c, V=32 if c.V == 40 else 48) for c in CASES]

# The launch settings' forms: every ticket, stage-2 lag (None is B: the plain order), chunks per
# item and poll form, each in several combinations.
FORMS = [
    dict(ticket="acq_rel"),
    dict(ticket="relaxed", stage2_lag=0),
    dict(ticket="prefetch", stage2_lag=1, poll="relaxed"),
    dict(ticket="prefetch", stage2_lag=2, tiles_per_item=4),
    dict(ticket="relaxed", tiles_per_item=4, poll="relaxed"),
    dict(ticket="acq_rel", stage2_lag=0, poll="relaxed", tiles_per_item=4),
]


def full_form(i: int) -> dict:
    """Schedule i's settings in the slow set: every 48 consecutive schedules take each combination
    of ticket (3), stage-2 lag (0, 1, 2, None), chunks per item (1, 4) and poll form (2) once."""
    return dict(ticket=("acq_rel", "relaxed", "prefetch")[i % 3], stage2_lag=(0, 1, 2, None)[i // 3 % 4],
                tiles_per_item=(1, 4)[i // 12 % 2], poll=("acquire", "relaxed")[i // 24 % 2])


@dataclasses.dataclass(frozen=True)
class Machine:
    """G programs, R resident at once, a starved program, and whether every load and store is a
    switch point."""

    programs: int
    resident: int
    every_access: bool = False
    starve: Optional[int] = None

    def schedule(self, seed: int) -> Schedule:
        return Schedule(seed=seed, resident=self.resident, every_access=self.every_access, starve=self.starve)


MACHINES = [
    Machine(2, 2, every_access=True),
    Machine(3, 2),
    Machine(8, 3, every_access=True, starve=1),
    Machine(3, 3, every_access=True, starve=0),
    Machine(8, 8),
    Machine(2, 2, starve=1),
    Machine(3, 3, every_access=True),
    Machine(8, 5, every_access=True),
]


QUICK_SCHEDULES = 3  # a case's schedules in the quick set


def quick_schedules(k: int) -> list:
    """The quick set's schedules of case k: [(form, machine, schedule seed)], the forms and machines
    rotating across cases."""
    return [(FORMS[(k + j) % len(FORMS)], MACHINES[(k * QUICK_SCHEDULES + j) % len(MACHINES)], 1000 * k + j)
            for j in range(QUICK_SCHEDULES)]


# Mutants of the protocol, each assuming that items finish in ticket order: (old, new) source
# replacements in ``split_kernel.py``, applied to a copy of the module (``mutant_kernel``).
_ARRIVE = "arrived = tl.atomic_add(pos_cnt_ptr + pid_bi, 1, sem=\"acq_rel\")"
_RELEASE = "tl.atomic_xchg(ready_ptr + b, 1, sem=\"release\")"
MUTANTS = {
    # the combine done by the item of a position's last chunk, not by the position's last arrival
    "combine_by_last_chunk_item": [("if arrived == NI - 1:", "if g == NI - 1:")],
    # the final draw done by a row's last-numbered stage-2 item, not by its last arrival
    "draw_by_last_numbered_item": [("if arrived == NI * (K1 if BLOCK else 1) - 1:",
                                    "if pos * NI + g == NI * (K1 if BLOCK else 1) - 1:")],
    # stage 2 reads the row's records without waiting for its ready flag
    "stage2_without_ready_flag": [("_wait_ready(ready_ptr + b, POLL, SLEEP_NS)", "pass")],
    # the ready flag released before the acceptance chain stores the row's records
    "flag_before_chain_records": [
        ("if rows_done == K1 - 1:\n", f"if rows_done == K1 - 1:\n                    {_RELEASE}\n"),
        (f"tl.debug_barrier()\n                    {_RELEASE}\n", "tl.debug_barrier()\n")],
    # a stage-1 item counted at its position before it stores its chunk records
    "arrival_before_records": [
        (f"tl.debug_barrier()\n            {_ARRIVE}\n", "tl.debug_barrier()\n"),
        ("stage1_item(logits_ptr + l_off,", f"{_ARRIVE}\n            stage1_item(logits_ptr + l_off,")],
}


def mutant_kernel(name: str, folder) -> object:
    """The split kernel with mutant ``name``'s replacements (each must match once): a copy of
    ``split_kernel.py`` written to ``folder`` and imported beside it (its relative imports resolve
    to the real stage functions)."""
    import importlib.util
    import pathlib

    from specdec_kernels.ops.verify.triton import split_kernel

    src = pathlib.Path(split_kernel.__file__).read_text()
    for old, new in MUTANTS[name]:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = pathlib.Path(folder) / f"split_kernel_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"specdec_kernels.ops.verify.triton._{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.verify_split_kernel


def counter_names(B: int, K1: int):
    """``describe`` for ``interleaved``: what an element of the split kernel's counters is."""
    lay = counter_layout(B, K1)

    def describe(arg: str, index: int) -> str:
        if arg != "counters_ptr":
            return ""
        if index == 0:
            return "the ticket"
        for field, what, n in (("pos", "arrivals at position", B * K1), ("row", "arrivals at row", B),
                               ("ready", "ready flag of row", B), ("s2", "stage-2 arrivals of row", B)):
            k = index - lay[field]
            if 0 <= k < n:
                return f"{what} {divmod(k, K1) if field == 'pos' else k}"
        return ""

    return describe


def ticket_item(t: int, B: int, A: int, C: int, T1: int, lag: int) -> int:
    """The kernel's ``_ticket_item`` in Python: the work item of ticket t."""
    head, mid = lag * A, (B - lag) * (A + C)
    if head <= t < head + mid:
        s, r = lag + (t - head) // (A + C), (t - head) % (A + C)
        return s * A + r if r < A else T1 + (s - lag) * C + (r - A)
    if t >= head + mid:
        return T1 + (B - lag) * C + (t - head - mid)
    return t


def check_claims(launch, case: Case, settings: dict) -> None:
    """Every ticket below the item count claimed once, each program's claims rising and ending with
    one past the items (tickets >= the count: it found none left); and the item each ticket ran,
    read from its arrival (the position counter of stage 1, the row's stage-2 counter), is the
    one ``_ticket_item`` numbers for it."""
    B, K1, V = case.B, case.K + 1, case.V
    NC = -(-V // CHUNK)
    NI = -(-NC // settings.get("tiles_per_item", 1))
    block = case.method == "block"
    A, C = K1 * NI, NI * (K1 if block else 1)
    T1, n = B * A, B * (A + C)
    lag = settings.get("stage2_lag")
    lag = B if lag is None else min(lag, B)
    claimed = sorted(t for ts in launch.tickets.values() for t in ts)
    assert claimed[:n] == list(range(n)), claimed
    for p, ts in launch.tickets.items():
        assert ts == sorted(ts) and ts and ts[-1] >= n, (p, ts)
    lay = counter_layout(B, K1)
    queue = {p: [] for p in launch.tickets}
    seen = {}
    for a in launch.atomics:
        if a.arg != "counters_ptr":
            continue
        if a.index == 0:
            queue[a.program].append(a.old)
        elif lay["pos"] <= a.index < lay["pos"] + B * K1 and a.new != a.old:
            seen[queue[a.program].pop(0)] = ("stage 1", a.index - lay["pos"])
        elif lay["s2"] <= a.index < lay["s2"] + B:
            seen[queue[a.program].pop(0)] = ("stage 2", a.index - lay["s2"])
    want = {}
    for t in range(n):
        item = ticket_item(t, B, A, C, T1, lag)
        want[t] = ("stage 1", item // NI) if item < T1 else ("stage 2", (item - T1) // C)
    assert seen == want
    for p, rest in queue.items():
        assert rest and all(t >= n for t in rest), (p, rest)


def fresh_workspace() -> None:
    """A new CPU workspace, sized by the next launch exactly (its tensors bound the bounds check)."""
    workspace_mod._WORKSPACES[("cpu", None, 0)] = workspace_mod.SplitWorkspace()


def poison_workspace() -> None:
    """Junk in every record of the CPU workspace (NaN floats, -7 ints): a record read before it
    is written shows in the tokens.  The launcher zeroes the counters itself."""
    for name, t in split_workspace("cpu").tensors().items():
        t.fill_(-7 if not t.is_floating_point() else float("nan"))


def outputs(out) -> tuple:
    return (out.tokens, out.num_accepted, getattr(out, "logprobs", None))


def assert_same(got: tuple, want: tuple, what: str) -> None:
    """Tokens and counts equal; log-probabilities bit for bit."""
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (what, got[:2], want[:2])
    if want[2] is not None:
        assert torch.equal(got[2].view(torch.int32), want[2].view(torch.int32)), (what, got[2], want[2])


def assert_torch_backend(got: tuple, torch_out: tuple) -> None:
    """Tokens and counts equal to the torch backend's; log-probabilities the same -inf slots and
    within the fp32 tolerance."""
    assert torch.equal(got[0], torch_out[0]) and torch.equal(got[1], torch_out[1]), (got[:2], torch_out[:2])
    if torch_out[2] is not None:
        assert torch.equal(torch.isinf(got[2]), torch.isinf(torch_out[2]))
        fin = torch.isfinite(torch_out[2])
        assert_close(got[2][fin], torch_out[2][fin])


def plain(case: Case, seed: int, settings: dict) -> tuple:
    """The kernel under the plain interpreter (one program, every item in ticket order), in a
    fresh workspace."""
    fresh_workspace()
    with launch_settings(chunk=CHUNK, **settings):
        return outputs(case.call("triton", seed))


def run_interleaved(case: Case, seed: int, settings: dict, machine: Machine, schedule_seed: int):
    """One interleaved launch of ``case``: (outputs, the launch's record)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(launch_settings(chunk=CHUNK, **settings))
        stack.enter_context(interpreter_grid(machine.programs))
        poison_workspace()
        rec = stack.enter_context(interleaved(machine.schedule(schedule_seed), ticket=("counters_ptr", 0),
                                              describe=counter_names(case.B, case.K + 1)))
        out = outputs(case.call("triton", seed))
    (launch,) = rec.launches
    return out, launch
