"""One interleaved launch: its schedule, its record and the state its programs share (``_Run``:
the baton, the scheduler and the checks), and the errors a run raises.  ``hooks.py`` hands every
atomic, volatile load and (with ``Schedule.every_access``) other access of a program to it."""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Optional

import numpy as np

__all__ = ["Atomic", "Deadlock", "InterleaveError", "Launch", "OutOfBounds", "ProgramError", "Schedule", "SwitchLimit"]

_ARG = "interleave.arg"  # a pointer handle's attribute: the kernel argument it was derived from


class InterleaveError(AssertionError):
    """A launch under ``interleaved`` failed: the message names the programs and their tickets."""


class Deadlock(InterleaveError):
    """Every live program polled with no store by anyone for ``Schedule.deadlock_switches`` switches."""


class SwitchLimit(InterleaveError):
    """A launch took more than ``Schedule.max_switches`` switches."""


class OutOfBounds(InterleaveError):
    """A load, store or atomic touched memory outside the tensor argument its pointer comes from."""


class ProgramError(InterleaveError):
    """A program raised (the exception is chained)."""


class _Abort(BaseException):
    """Unwinds a program's thread once the run has failed (not an Exception: the interpreter wraps those)."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One reproducible interleaving of every launch in an ``interleaved`` block.

    seed: the scheduler's ``random.Random`` seed.  resident: R, the programs that run at once
    (None: all of the grid); program R + k starts when the k-th one exits.  every_access: also
    switch before every global load and store (not only before atomics and volatile loads).
    phase: the mean number of switches between redraws of the programs' speeds (each program's
    weight in the draw is 2^-e, e uniform in 0..6; 0: a uniform draw throughout).  starve: a
    program id kept off the baton for every other stretch of ``starve_stretch`` switches, the
    first from a random point (it still runs when no other program can).  deadlock_switches,
    deadlock_polls: a launch fails as a deadlock after that many switches without a store, once
    every live program's last ``deadlock_polls`` operations or more were polls.  max_switches: a
    launch that takes more fails."""

    seed: int = 0
    resident: Optional[int] = None
    every_access: bool = False
    phase: int = 24
    starve: Optional[int] = None
    starve_stretch: int = 64
    deadlock_switches: int = 400
    deadlock_polls: int = 4
    max_switches: int = 1_000_000

    def __post_init__(self):
        for name, lo in (("resident", 1), ("phase", 0), ("starve", 0), ("starve_stretch", 1), ("deadlock_switches", 1),
                         ("deadlock_polls", 1), ("max_switches", 1)):
            v = getattr(self, name)
            if (v is not None or name not in ("resident", "starve")) and not (isinstance(v, int) and v >= lo):
                raise ValueError(f"Schedule.{name} must be an int >= {lo}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Atomic:
    """One atomic of a launch, in the order they ran: the program, the argument the address lies
    in and the element index there, and the values before and after (scalars for a one-element
    atomic, else tuples)."""

    program: int
    arg: str
    index: object
    old: object
    new: object


@dataclasses.dataclass
class Launch:
    """What one launch under ``interleaved`` did: its grid, the switches it took, the tickets each
    program claimed in claim order (``ticket=``), and every atomic (``atomics``)."""

    grid: int
    switches: int = 0
    tickets: dict = dataclasses.field(default_factory=dict)
    atomics: list = dataclasses.field(default_factory=list)


class _Program:
    def __init__(self, pid: int):
        self.pid = pid
        self.tickets: list = []
        self.polls = 0  # consecutive polls since the last store by anyone
        self.polling = False  # its last operation was a poll
        self.last_poll = ""  # what it polled last, and what it read
        self.doing: tuple = ("not started",)  # (what, address, element size) of its next operation
        self.thread: Optional[threading.Thread] = None


def _extents(named: dict) -> tuple:
    """([(lo, hi, name)] byte ranges of the tensor arguments, sorted, aliases under the first name;
    {name: (lo, hi)} of every tensor argument, aliases included)."""
    import torch

    out, by_name, seen = [], {}, set()
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            continue
        el = t.element_size()
        if t.numel() == 0:
            by_name[name] = (t.data_ptr(), t.data_ptr())
            continue
        lo = t.data_ptr() + el * sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
        hi = t.data_ptr() + el * (sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride())) + 1)
        by_name[name] = (lo, hi)
        if (lo, hi) not in seen:
            seen.add((lo, hi))
            out.append((lo, hi, name))
    return sorted(out), by_name


class _Run:
    """The baton, the scheduler and the checks of one launch."""

    def __init__(self, schedule: Schedule, grid: int, extents: tuple, ticket_addr: Optional[int], describe,
                 launch: Launch, builder):
        self.s = schedule
        self.grid = grid
        self.extents, self.by_name = extents
        self.los = np.array([e[0] for e in self.extents], dtype=np.uint64)
        self.his = np.array([e[1] for e in self.extents], dtype=np.uint64)
        self.ticket_addr = ticket_addr
        self.describe = describe
        self.launch = launch
        self.builder = builder
        self.rng = random.Random(schedule.seed)
        self.weights = [1.0] * grid
        self.next_phase = 0
        self.starve_offset = self.rng.randrange(schedule.starve_stretch)
        self.cond = threading.Condition()
        self.programs = [_Program(p) for p in range(grid)]
        self.pending = list(range(grid))
        self.live: list = []
        self.holder: Optional[int] = None
        self.switches = 0
        self.quiet = 0  # switches since the last store
        self.failure: Optional[BaseException] = None
        self.finished = 0
        self.local = threading.local()

    # -- naming ---------------------------------------------------------------------------------
    def where(self, addr: int, el: int) -> tuple:
        """(argument name, element index) of a byte address (None, addr) outside every argument."""
        k = int(np.searchsorted(self.los, np.uint64(addr), side="right")) - 1
        if k >= 0 and addr < int(self.his[k]):
            lo, _, name = self.extents[k]
            return name, (addr - lo) // el
        return None, addr

    def name(self, addr: int, el: int) -> str:
        arg, index = self.where(addr, el)
        if arg is None:
            return f"address {addr:#x}"
        text = f"{arg}[{index}]"
        if self.describe is not None:
            extra = self.describe(arg, index)
            if extra:
                text += f" ({extra})"
        return text

    def doing(self, prog: _Program) -> str:
        what = prog.doing
        return what[0] if len(what) == 1 else f"{what[0]} {self.name(what[1], what[2])}"

    def who(self, prog: _Program) -> str:
        t = ", ".join(str(x) for x in prog.tickets[-3:]) or "none"
        more = "..., " if len(prog.tickets) > 3 else ""
        return f"program {prog.pid} (tickets claimed: {more}{t})"

    # -- failures -------------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Record the run's first failure and wake every program (call with the lock held)."""
        if self.failure is None:
            self.failure = error
        self.cond.notify_all()

    def current(self) -> _Program:
        return self.local.prog

    # -- the baton ------------------------------------------------------------------------------
    def _choose(self) -> Optional[int]:
        live = self.live
        if not live:
            return None
        s = self.s
        if s.starve is not None and len(live) > 1 and (self.switches + self.starve_offset) // s.starve_stretch % 2:
            live = [p for p in live if p.pid != s.starve] or live
        if s.phase and self.switches >= self.next_phase:
            self.weights = [2.0 ** -self.rng.randint(0, 6) for _ in range(self.grid)]
            self.next_phase = self.switches + self.rng.randint(1, 2 * s.phase)
        if len(live) == 1:
            return live[0].pid
        return self.rng.choices(live, weights=[self.weights[p.pid] for p in live])[0].pid

    def _stuck(self) -> bool:
        s = self.s
        return (self.quiet >= s.deadlock_switches and bool(self.live)
                and all(p.polling and p.polls >= s.deadlock_polls for p in self.live))

    def _deadlock_message(self) -> str:
        lines = [f"deadlock: no store for {self.quiet} switches (switch {self.switches}); every live program polls:"]
        for p in self.live:
            lines.append(f"  {self.who(p)}: {p.last_poll}, {p.polls} polls in a row")
        waiting = [self.who(self.programs[q]) for q in self.pending]
        if waiting:
            lines.append(f"  not started (resident limit {self.s.resident}): " + "; ".join(waiting))
        return "\n".join(lines)

    def _hand_on(self, prog: _Program) -> None:
        """Give the baton to the scheduler's choice and wait to get it back (lock held)."""
        self.switches += 1
        self.quiet += 1
        if self.switches > self.s.max_switches:
            self.fail(SwitchLimit(f"the launch passed {self.s.max_switches} switches; "
                                  + "; ".join(f"{self.who(p)}: {self.doing(p)}" for p in self.live)))
        elif self._stuck():
            self.fail(Deadlock(self._deadlock_message()))
        if self.failure is not None:
            raise _Abort()
        nxt = self._choose()
        if nxt != prog.pid:
            self.holder = nxt
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.holder == prog.pid or self.failure is not None)
            if self.failure is not None:
                raise _Abort()
        self.builder.set_grid_idx(prog.pid, 0, 0)

    def switch(self, what: str, addr: int, el: int) -> None:
        """Called by the running program before a switch point: ``what`` it is about to do at the
        byte address ``addr`` (elements of ``el`` bytes)."""
        prog = self.current()
        prog.doing = (what, addr, el)
        with self.cond:
            self._hand_on(prog)

    def after(self, stored: bool, poll: Optional[str] = None) -> None:
        """Called by the running program after a memory operation: a store (anything that changed
        memory), a poll (``poll``: what it read), or neither."""
        prog = self.current()
        if stored:
            self.quiet = 0
            for p in self.programs:
                p.polls = 0
            prog.polling = False
        elif poll is not None:
            prog.polling = True
            prog.polls += 1
            prog.last_poll = poll
        else:
            prog.polling = False
            prog.polls = 0

    # -- programs -------------------------------------------------------------------------------
    def _spawn(self, fn, args) -> None:
        prog = self.programs[self.pending.pop(0)]
        self.live.append(prog)
        prog.thread = threading.Thread(target=self._body, args=(prog, fn, args), daemon=True,
                                       name=f"interleaved-program-{prog.pid}")
        prog.thread.start()

    def _body(self, prog: _Program, fn, args) -> None:
        self.local.prog = prog
        try:
            with self.cond:
                self.cond.wait_for(lambda: self.holder == prog.pid or self.failure is not None)
                if self.failure is not None:
                    raise _Abort()
            prog.doing = ("running",)
            self.builder.set_grid_idx(prog.pid, 0, 0)
            fn(**args)
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - any failure of a program fails the run
            with self.cond:
                if self.failure is None:
                    err = e
                    while err.__cause__ is not None and type(err).__name__ == "InterpreterError":
                        err = err.__cause__  # the interpreter wraps each device function's exception
                    if isinstance(err, InterleaveError):
                        self.fail(err)
                    else:
                        pe = ProgramError(f"{self.who(prog)} raised {type(err).__name__}: {err}")
                        pe.__cause__ = err
                        self.fail(pe)
        finally:
            with self.cond:
                if prog in self.live:
                    self.live.remove(prog)
                prog.doing = ("exited",)
                self.finished += 1
                if self.failure is None:
                    if self.pending:
                        self._spawn(fn, args)
                    self.holder = self._choose()
                    self.switches += 1
                self.cond.notify_all()

    def run(self, fn, args) -> None:
        with self.cond:
            for _ in range(min(self.s.resident or self.grid, self.grid)):
                self._spawn(fn, args)
            self.holder = self._choose()
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.finished == self.grid - len(self.pending) and (
                self.failure is not None or not self.pending))
        for p in self.programs:
            if p.thread is not None:
                p.thread.join()
        self.launch.switches = self.switches
        self.launch.tickets = {p.pid: list(p.tickets) for p in self.programs}
        if self.failure is not None:
            raise self.failure

    def check(self, what: str, ptrs, addrs: np.ndarray, el: int) -> None:
        """Fail the run if an address of ``addrs`` (the unmasked lanes of ``ptrs``) lies outside the
        argument the pointer was derived from (outside every argument, where that is not known)."""
        if addrs.size == 0:
            return
        base = ptrs.attr.get(_ARG)
        if base is not None:
            lo, hi = self.by_name[base]
            ok = (addrs >= np.uint64(lo)) & (addrs + np.uint64(el) <= np.uint64(hi))
        elif self.his.size:
            k = np.searchsorted(self.los, addrs, side="right").astype(np.int64) - 1
            ok = (k >= 0) & (addrs + np.uint64(el) <= self.his[np.maximum(k, 0)])
        else:
            ok = np.zeros(addrs.shape, dtype=bool)
        if not np.all(ok):
            bad = int(addrs[~ok][0])
            if base is not None:
                lo, hi = self.by_name[base]
                near = f"; {base} holds {(hi - lo) // el} elements, this is element {(bad - lo) // el}"
            else:
                near = f"; no argument holds it ({self.name(bad, el)})"
            prog = self.current()
            with self.cond:
                self.fail(OutOfBounds(f"{self.who(prog)}: {what} out of bounds at {bad:#x} "
                                      f"({int((~ok).sum())} of {addrs.size} lanes){near}"))
            raise _Abort()
