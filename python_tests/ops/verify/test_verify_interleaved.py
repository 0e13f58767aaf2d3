"""The split kernel (``verify/triton/split_kernel.py``) with its programs interleaved
(``ops.interleave``): G = 2, 3 and 8 programs, R resident at once (R < G and R = G), a starved
program, switches at every access or at atomics only, under every launch-settings form.  Each
launch gives the torch backend's tokens and counts (log-probabilities within the fp32 tolerance),
the plain interpreter's outputs bit for bit, no deadlock, no access out of bounds, and the items
``_ticket_item`` numbers, ticket by ticket.  A quick set (48 schedules), a slow set (816), the
protocol's mutants (each caught within the quick set's schedules), and the tree kernel."""

from __future__ import annotations

import random

import pytest

from helpers import HAS_CUDA
from interleave_cases import (CASES, MACHINES, MUTANTS, SLOW_CASES, assert_same, assert_torch_backend, check_claims,
                              full_form, mutant_kernel, outputs, plain, quick_schedules, run_interleaved)
from specdec_kernels.ops.interleave import InterleaveError
from specdec_kernels.ops.verify.triton import split_kernel
from specdec_kernels.ops.verify import workspace as workspace_mod

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interleaving runs Triton's interpreter (CPU tensors)")


@pytest.fixture(autouse=True)
def _own_workspaces(monkeypatch):
    """The test's CPU workspaces are its own (each case sizes a fresh one)."""
    monkeypatch.setattr(workspace_mod, "_WORKSPACES", {})


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interleaved_schedules_give_the_torch_backends_outputs(case):
    """Three schedules a case (the forms and machines rotate across cases, a handful of schedules
    each): outputs equal to the torch backend's and to the plain interpreter's, claims in order."""
    k = CASES.index(case)
    want = outputs(case.call("torch", seed=k))
    base = plain(case, k, {})
    assert_torch_backend(base, want)
    for form, machine, seed in quick_schedules(k):
        got, launch = run_interleaved(case, k, form, machine, seed)
        assert_same(got, base, (case.name, form, machine, seed))
        check_claims(launch, case, form)


SLOW_SCHEDULES = 816  # every combination of the settings 17 times: each value of each setting in >= 204
SLOW_PARTS = 8


@pytest.mark.slow
@pytest.mark.parametrize("part", range(SLOW_PARTS))
def test_many_interleaved_schedules_give_the_plain_interpreters_outputs(part):
    """The slow set, part ``part`` of ``SLOW_PARTS``: schedule i runs settings ``full_form(i)`` on
    a case of ``SLOW_CASES`` and a machine drawn from i, with the checks of the quick set."""
    plain_out = {}
    for i in range(part, SLOW_SCHEDULES, SLOW_PARTS):
        rng = random.Random(i)
        k = rng.randrange(len(SLOW_CASES))
        case, form, machine = SLOW_CASES[k], full_form(i), rng.choice(MACHINES)
        if k not in plain_out:
            plain_out[k] = plain(case, k, {})
            assert_torch_backend(plain_out[k], outputs(case.call("torch", seed=k)))
        got, launch = run_interleaved(case, k, form, machine, schedule_seed=i)
        assert_same(got, plain_out[k], (case.name, form, machine, i))
        check_claims(launch, case, form)


def _first_failure(limit: int):
    """The quick set's schedules in order (case by case) until one fails: (count, what failed), or
    (count, None) when none of the first ``limit`` does."""
    n = 0
    for k, case in enumerate(CASES):
        base = plain(case, k, {})
        for form, machine, seed in quick_schedules(k):
            n += 1
            try:
                got, launch = run_interleaved(case, k, form, machine, seed)
                assert_same(got, base, (case.name, form, machine, seed))
                check_claims(launch, case, form)
            except (AssertionError, InterleaveError) as e:
                return n, f"{case.name}, {form}, {machine}, seed {seed}: {type(e).__name__}"
            if n == limit:
                return n, None
    return n, None


# Schedules of the quick set each mutant took to fail, at the time of writing (docs/verify_kernel.md).
MUTANT_SCHEDULES = {"combine_by_last_chunk_item": 3, "draw_by_last_numbered_item": 4, "stage2_without_ready_flag": 1,
                    "flag_before_chain_records": 1, "arrival_before_records": 35}


@pytest.mark.slow
@pytest.mark.parametrize("name", MUTANTS)
def test_protocol_mutant_passes_the_plain_interpreter_and_fails_interleaved(name, monkeypatch, tmp_path):
    """Each mutant assumes that items finish in ticket order: the plain interpreter (one program,
    items in ticket order) gives the torch backend's outputs on every case, and the quick set's
    schedules make it fail (wrong outputs, a deadlock, an access out of bounds or claims out of
    order) within the number of schedules docs/verify_kernel.md gives."""
    monkeypatch.setattr(split_kernel, "verify_split_kernel", mutant_kernel(name, tmp_path))
    for k, case in enumerate(CASES):
        assert_torch_backend(plain(case, k, {}), outputs(case.call("torch", seed=k)))
    n, failure = _first_failure(MUTANT_SCHEDULES[name])
    assert failure is not None, f"{name} passed the first {n} schedules of the quick set"


def test_tree_kernel_programs_touch_only_their_rows_under_interleaving(tree_settings):
    """``fused_verify_tree``'s kernel (one program a row) communicates through nothing: under
    schedules that switch at every load and store, with all rows resident or fewer, it runs no
    atomic and gives the plain interpreter's tokens, paths and counts."""
    import torch

    from specdec_kernels import fused_verify_tree
    from specdec_kernels.ops.interleave import Schedule, interleaved
    from tree_setup import tree_case

    tree_settings(block_v=16)
    logits, tokens, parents, q, nb, temp, kw, u = tree_case(4, 4, 40, 40, torch.Generator().manual_seed(3), warp=True)
    call = lambda: fused_verify_tree(logits, tokens, parents, q, num_nodes=nb, temperature=temp, seed=7,  # noqa: E731
                                     backend="triton", **kw)
    want = call()
    for seed, resident in ((0, None), (1, 2), (2, 3)):
        with interleaved(Schedule(seed=seed, resident=resident, every_access=True)) as rec:
            got = call()
        (launch,) = rec.launches
        assert launch.grid == 4 and launch.atomics == [] and launch.switches > 100
        for a, b in zip(got, want):
            assert torch.equal(a, b)
