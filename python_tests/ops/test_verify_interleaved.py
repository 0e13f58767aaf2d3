"""The split kernel (``verify/triton/split_kernel.py``) with its programs interleaved
(``ops.interleave``): G = 2, 3 and 8 programs, R resident at once (R < G and R = G), a starved
program, switches at every access or at atomics only, under every launch-settings form.  Each
launch gives the torch backend's tokens and counts (log-probabilities within the fp32 tolerance),
the plain interpreter's outputs bit for bit, no deadlock, no access out of bounds, and the items
``_ticket_item`` numbers, ticket by ticket."""

from __future__ import annotations

import pytest

from interleave_cases import (CASES, assert_same, assert_torch_backend, check_claims, outputs, plain, quick_schedules,
                              run_interleaved)
from specdec_kernels.ops.verify import workspace as workspace_mod


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
