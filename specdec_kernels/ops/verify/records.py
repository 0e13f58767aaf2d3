"""The split kernel's workspace layout, written once: the fields of its record tensors (``part_f``,
``part_i``, ``mass``) and of its counters, in order, each with its length.  The launcher's sizes
and the offsets ``workspace.SplitWorkspace.records`` reads (``workspace.py``) and the kernel's
field pointers (``triton/stage1.py``'s ``_F_*``, ``_I_*``, ``_M_*`` and ``triton/split_kernel.py``'s
``_C_*`` constexprs) are all taken from it.

A length (and an offset) is written as its counts of the launch's units, for B rows, K1 = K + 1
positions and NC vocabulary chunks: (chunks [B, K+1, NC], positions [B, K+1], rows [B], row
chunks [B, NC], single elements); ``elements`` turns it into a number of elements.
"""

from __future__ import annotations

__all__ = ["CHUNKS", "POSITIONS", "ROWS", "ROW_CHUNKS", "ONE", "RECORDS", "COUNTERS", "LINE", "elements",
           "field_offset", "tensor_size", "position_fields", "counter_index", "counter_lengths", "counter_layout"]

CHUNKS = (1, 0, 0, 0, 0)  # [B, K+1, NC]
POSITIONS = (0, 1, 0, 0, 0)  # [B, K+1]
ROWS = (0, 0, 1, 0, 0)  # [B]
ROW_CHUNKS = (0, 0, 0, 1, 0)  # [B, NC]
ONE = (0, 0, 0, 0, 1)  # a single element

# tensor -> its fields in order: (field, length, form, what it holds).  form "": in every launch;
# "draft_logits": with draft logits (DRAFT_LOGITS); "block" / "token": block / token-by-token
# verification (BLOCK or not).  A field starts where the fields before it of its own form and of
# every launch end; a form's fields come after every launch's, which keep their offsets in all forms.
RECORDS = {
    "part_f": (  # fp32
        ("chunk_max", CHUNKS, "", "the chunk's max score"),
        ("chunk_sum", CHUNKS, "", "the chunk's sum of exp(s - chunk max)"),
        ("m", POSITIONS, "", "the position's max (0 if unusable)"),
        ("S", POSITIONS, "", "the position's kept mass"),
        ("draft_chunk_max", CHUNKS, "draft_logits", "the chunk's max of the draft's scaled logits"),
        ("draft_chunk_sum", CHUNKS, "draft_logits", "the chunk's sum of exp(l / T - chunk max)"),
        ("m_d", POSITIONS, "draft_logits", "the position's draft max (0 if unusable)"),
        ("S_d", POSITIONS, "draft_logits", "the position's draft sum"),
    ),
    "part_i": (  # int32
        ("chunk_argmax", CHUNKS, "", "the chunk's first argmax"),
        ("chunk_bad", CHUNKS, "", "the chunk's count of non-finite scores"),
        ("chunk_thr", CHUNKS, "", "the chunk's t_c: every key above it is in the chunk's candidate list"),
        ("chunk_count", CHUNKS, "", "the chunk's candidate count"),
        ("argmax", POSITIONS, "", "the position's argmax"),
        ("bad", POSITIONS, "", "1 where the position is unusable"),
        ("thr", POSITIONS, "", "the position's threshold: the smallest kept order key"),
        ("j", ROWS, "", "the row's stop position"),
        ("rejected", ROWS, "", "1 where the row's draft at j was rejected"),
        ("row_bad", ROWS, "", "1 where the row is invalid"),
        ("x_j", ROWS, "", "the rejected draft x_j (-1 if none)"),
        ("q_bad", ROW_CHUNKS, "", "the chunk's count of non-finite or negative q_j entries"),
        ("scanned", POSITIONS, "", "1 where the warp fell back to scanning the whole position"),
        ("draft_chunk_bad", CHUNKS, "draft_logits", "the chunk's count of NaN/+inf draft logits"),
        ("bad_d", POSITIONS, "draft_logits", "1 where q_i is not a distribution"),
    ),
    "mass": (  # float64
        ("masses", ROW_CHUNKS, "token", "the chunk masses of the final draw's weights at the stop position"),
        ("chunk_mass", CHUNKS, "block", "the chunk mass of max(0, p_i P_i - Q_i) below K_b, of P at K_b"),
        ("chunk_q_bad", CHUNKS, "block", "the chunk's count of non-finite or negative q_i entries"),
        ("p", POSITIONS, "block", "p_0..p_K of the block rule"),
    ),
}

# int32 counters per 128-byte line: every counter field starts on a line of its own (no false
# sharing between the ticket every program claims from and the flags stage 2 polls).
LINE = 32
# The counters (int32, zeroed by the launcher before each launch), in order: (field, length, what it holds)
COUNTERS = (
    ("ticket", ONE, "the next work item's ticket"),
    ("pos", POSITIONS, "position arrivals"),
    ("row", ROWS, "row arrivals"),
    ("ready", ROWS, "1 once the row's acceptance chain is done"),
    ("s2", ROWS, "stage-2 arrivals"),
)


def _check_table() -> None:
    for tensor, fields in RECORDS.items():
        names = [f[0] for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"records: {tensor} names a field twice: {names}")
        forms = [f[2] for f in fields]
        if "" in forms and any(f for f in forms[:max(i for i, f in enumerate(forms) if f == "") + 1]):
            raise ValueError(f"records: {tensor}'s fields of every launch must come first: {forms}")
    if len({c[0] for c in COUNTERS}) != len(COUNTERS):
        raise ValueError("records: a counter is named twice")


_check_table()


def elements(length: tuple, B: int, K1: int, NC: int) -> int:
    """A length (or offset) in elements, for B rows, K1 positions and NC chunks."""
    n_chunks, n_pos, n_rows, n_row_chunks, n_one = length
    return n_chunks * B * K1 * NC + n_pos * B * K1 + n_rows * B + n_row_chunks * B * NC + n_one


def field_offset(tensor: str, field: str) -> tuple:
    """Where ``field`` of ``tensor`` starts, in counts of the units (``elements`` gives the number)."""
    fields = RECORDS[tensor]
    form = next((f[2] for f in fields if f[0] == field), None)
    if form is None:
        raise KeyError(f"records: {tensor} has no field {field!r}")
    off = [0] * 5
    for name, length, f_form, _ in fields:
        if name == field:
            return tuple(off)
        if f_form in ("", form):
            off = [a + b for a, b in zip(off, length)]
    raise AssertionError("unreachable")


def _forms(draft_logits: bool, block: bool) -> tuple:
    return ("", "block" if block else "token") + (("draft_logits",) if draft_logits else ())


def tensor_size(tensor: str, B: int, K1: int, NC: int, draft_logits: bool = False, block: bool = False) -> int:
    """Elements of ``tensor`` a launch uses: its fields of every launch and of the launch's forms."""
    forms = _forms(draft_logits, block)
    return sum(elements(length, B, K1, NC) for _, length, form, _ in RECORDS[tensor] if form in forms)


def position_fields(tensors=("part_f", "part_i"), draft_logits: bool = False) -> list:
    """(tensor, field) of every per-position field of ``tensors`` a launch writes, those of every
    launch first (then the draft's, with ``draft_logits``)."""
    out = [(t, f[0]) for t in tensors for f in RECORDS[t] if f[1] == POSITIONS and f[2] == ""]
    if draft_logits:
        out += [(t, f[0]) for t in tensors for f in RECORDS[t] if f[1] == POSITIONS and f[2] == "draft_logits"]
    return out


def counter_index(field: str) -> int:
    """The place of counter ``field`` in ``COUNTERS``."""
    for i, c in enumerate(COUNTERS):
        if c[0] == field:
            return i
    raise KeyError(f"records: no counter {field!r}")


def counter_lengths() -> tuple:
    """The counters' lengths, in order (the kernel's ``_COUNTER_LENGTHS``)."""
    return tuple(c[1] for c in COUNTERS)


def _line_up(n: int) -> int:
    return -(-n // LINE) * LINE


def counter_layout(B: int, K1: int) -> dict:
    """Where each counter field starts in ``counters`` (int32 elements), and the total used: each
    field on a line of its own after the ones before it.  The kernel computes the same offsets
    (``triton/split_kernel.py``'s ``_counter``)."""
    out, off = {}, 0
    for name, length, _ in COUNTERS:
        out[name] = off
        off = _line_up(off + elements(length, B, K1, 1))
    out["total"] = off
    return out
