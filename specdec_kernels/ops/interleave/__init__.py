"""Run a Triton kernel's launches under Triton's interpreter with the programs of a grid interleaved.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the programs of a grid one after another, each
to its end, so a protocol between programs (work tickets, arrival counters, flags that other
programs poll) only ever runs in one order there.  Within ``interleaved(schedule)`` every launch of
an interpreted kernel runs its G programs as G threads that hold one baton between them: only the
holder runs, and it hands the baton on

- before every atomic (``tl.atomic_*``) and every volatile load (``tl.load(..., volatile=True)``,
  the interpreter's ``tl.atomic_poll`` and ``tl.atomic_load``),
- and, with ``Schedule.every_access``, before every other global load and store,

to a program drawn by ``random.Random(schedule.seed)``: a seed is a reproducible schedule.  The
draw is weighted by speeds that the scheduler redraws every few switches (``Schedule.phase``), so
programs run at varied relative speeds and now and then one nearly stops for a while: the orders
in which one program overtakes another by many steps (a later item finishing first) come up, not
only the near-lockstep of a uniform draw.  The interpreter's per-program state, the program id of
``tl.program_id``, is restored at each switch.  ``Schedule.resident`` = R < G starts programs
R + 1.. only when an earlier one exits (a grid larger than the machine); ``Schedule.starve`` keeps
one program off the baton for every other stretch of ``Schedule.starve_stretch`` switches (a slow
multiprocessor, stopped at whatever point of its work the stretch begins).

A run fails, naming each program, the tickets it claimed (``ticket=``: the counter the kernel
claims work from) and what it was doing:

- ``Deadlock``: no program stored anything for ``deadlock_switches`` switches while every live
  program kept polling (its last ``deadlock_polls`` operations or more were polls: volatile
  loads, or atomics that changed nothing); the message names what each one polls and reads;
- ``SwitchLimit``: the launch took more than ``max_switches`` switches;
- ``OutOfBounds``: a load, store or atomic touched (with an unmasked lane) memory outside the
  tensor argument its pointer was derived from (checked here on each access: the interpreter
  itself dereferences any address it is given);
- ``ProgramError``: any other exception raised in a program (a failed ``tl.static_assert``, an
  error of the interpreter's, ...).

What it sees and what it cannot see.  The interleaving is sequentially consistent: every load
sees the latest store in one global order, and a program's accesses happen in program order.  So
it checks the protocol's logic (who combines, who waits for whom, which records exist by the time
they are read, whether any order of claims and arrivals deadlocks) over the orders a scheduler can
produce, and it never shows the weak ordering of a GPU: a missing release or acquire, a relaxed
atomic that should not be, a ``bar.sync`` that should separate a program's stores from its
arrival, or a stale cached line, all behave here as if ordered.  Those are the compiled code's, and
for the split kernel ``python_tests/ops/test_gpu_compile.py`` checks them in the PTX that
``scripts/gpu_compile_check.py`` compiles for sm_90 (``split_kernel_atomics``, counted per
variant): the three arrivals (position, row, stage 2) are ``atom.global.gpu.acq_rel.add``; the
ticket's two claims ``acq_rel`` or ``relaxed`` adds as the ticket form says; the ready flag's
release an ``atom.global.gpu.release.exch``; the polls' acquire an ``ld.global.gpu.acquire`` (every
poll, or once after the ``ld.volatile.global`` loop of the relaxed form); and ``bar.sync``s before
them.  It counts instructions, not which address each one orders.  Nor does the interleaving see
what happens inside one program between two of its switch points: with ``every_access`` off, all
of a program's plain loads and stores between two atomics happen at once.  Each launch's tensors
are the ones the interpreter hands the kernel (CPU tensors; a CUDA tensor's copy).  An access is
checked against the argument its pointer was derived from (through pointer arithmetic, splats and
broadcasts); a pointer made otherwise (``tl.where`` between two, an integer cast) is checked
against all of them.

Use it for tests only: it replaces the interpreter's grid executor and wraps its builder's memory
operations for the duration of the block (both restored on exit).  A launch costs a little more
than under the plain interpreter (the split kernel's: 5-50% more, the most with ``every_access``).

The package: ``run.py`` holds one launch's state (``_Run``: the baton, the scheduler, the checks)
and the errors; ``hooks.py`` the interpreter's hooks (the grid executor and the builder's memory
operations) that hand each access to it; this module the context manager.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

from .hooks import _executor_class, _State, _wrap_builder
from .run import Atomic, Deadlock, InterleaveError, Launch, OutOfBounds, ProgramError, Schedule, SwitchLimit

__all__ = ["Atomic", "Deadlock", "InterleaveError", "Launch", "OutOfBounds", "ProgramError", "Schedule",
           "SwitchLimit", "interleaved"]

_ACTIVE: list = []


@contextlib.contextmanager
def interleaved(schedule: Schedule, *, ticket: Optional[tuple] = None,
                describe: Optional[Callable[[str, int], str]] = None):
    """Within the block, every launch of an interpreted Triton kernel runs its programs interleaved
    under ``schedule`` (module docstring); yields the block's record, whose ``launches`` holds a
    ``Launch`` per launch.  ``ticket``: (argument name, element index) of the counter the kernel
    claims work tickets from (each program's claims are recorded and named in failures).
    ``describe(arg, index)``: a name for an element of an argument, shown in failures (or "").
    Needs ``TRITON_INTERPRET=1`` when the kernels were defined; blocks do not nest."""
    from triton.runtime import interpreter as ti

    if _ACTIVE:
        raise RuntimeError("interleaved: blocks do not nest")
    state = _State(schedule, ticket, describe)
    base = ti.GridExecutor
    ti.GridExecutor = _executor_class(base, state)
    saved = _wrap_builder(ti.interpreter_builder, state)
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()
        ti.GridExecutor = base
        for name, old in saved.items():
            if old is None:
                delattr(ti.interpreter_builder, name)
            else:
                setattr(ti.interpreter_builder, name, old)
