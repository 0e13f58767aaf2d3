"""The split kernel's workspace layout table (``ops/verify/records.py``): its fields never overlap
and fit the sizes the launcher allocates, in every form; the counters start on lines of their
own; the kernel's field constexprs cover every field and counter of the table (the layout is
written once, there)."""

from __future__ import annotations

import itertools

import pytest

from specdec_kernels.ops.verify import records
from specdec_kernels.ops.verify.workspace import SplitWorkspace

SHAPES = list(itertools.product([1, 3, 7], [1, 2, 6], [1, 4, 9]))  # (B, K1, NC)
FORMS = list(itertools.product([False, True], [False, True]))  # (draft_logits, block)


def _present(form: str, draft_logits: bool, block: bool) -> bool:
    return form in ("", "block" if block else "token") or (form == "draft_logits" and draft_logits)


@pytest.mark.parametrize("draft_logits,block", FORMS)
def test_fields_are_disjoint_and_inside_the_allocation(draft_logits, block):
    for B, K1, NC in SHAPES:
        sizes = SplitWorkspace.sizes(B, K1, NC, 0, draft_logits, block)
        for tensor, fields in records.RECORDS.items():
            spans = sorted((records.elements(records.field_offset(tensor, name), B, K1, NC),
                            records.elements(length, B, K1, NC), name)
                           for name, length, form, _ in fields if _present(form, draft_logits, block))
            end = 0
            for start, n, name in spans:
                assert start >= end, (tensor, name, B, K1, NC)
                end = start + n
            assert end == sizes[tensor], (tensor, B, K1, NC, end, sizes[tensor])


def test_sizes_as_the_docs_state_them():
    """docs/verify_kernel.md: draft logits add 12 bytes per chunk and position and 12 per position."""
    B, K1, NC = 3, 5, 7
    plain = SplitWorkspace.sizes(B, K1, NC, 64)
    draft = SplitWorkspace.sizes(B, K1, NC, 64, draft_logits=True)
    extra = 4 * (draft["part_f"] - plain["part_f"]) + 4 * (draft["part_i"] - plain["part_i"])
    assert extra == 12 * B * K1 * NC + 12 * B * K1
    assert plain["mass"] == B * NC
    assert SplitWorkspace.sizes(B, K1, NC, 64, block=True)["mass"] == 2 * B * K1 * NC + B * K1
    assert plain["cand"] == B * K1 * NC * 64


def test_counters_start_on_lines_of_their_own():
    for B, K1 in itertools.product([1, 2, 31, 33], [1, 5, 32]):
        lay = records.counter_layout(B, K1)
        starts = [lay[name] for name, _, _ in records.COUNTERS]
        assert starts[0] == 0 and all(s % records.LINE == 0 for s in starts) and lay["total"] % records.LINE == 0
        for (name, length, _), start, nxt in zip(records.COUNTERS, starts, starts[1:] + [lay["total"]]):
            assert start + records.elements(length, B, K1, 1) <= nxt, (name, B, K1)


def test_the_kernel_names_every_field_and_counter_of_the_table():
    from specdec_kernels.ops.verify.triton import split_kernel, stage1

    def value(c):
        return getattr(c, "value", c)

    prefix = {"part_f": "_F_", "part_i": "_I_", "mass": "_M_"}
    for tensor, fields in records.RECORDS.items():
        for name, _, _, _ in fields:
            const = prefix[tensor] + name.upper()
            assert value(getattr(stage1, const)) == records.field_offset(tensor, name), const
    for i, (name, _, _) in enumerate(records.COUNTERS):
        assert value(getattr(split_kernel, "_C_" + name.upper())) == i, name
    assert tuple(value(split_kernel._COUNTER_LENGTHS)) == records.counter_lengths()


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="no field"):
        records.field_offset("part_f", "nope")
    with pytest.raises(KeyError, match="no counter"):
        records.counter_index("nope")
