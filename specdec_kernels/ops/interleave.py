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

This module is long for one reason: the baton, the scheduler, the checks and the interpreter's
hooks all act on one launch's state (``_Run``), and apart they would share it across modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
from typing import Callable, Optional

import numpy as np


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


_ARG = "interleave.arg"  # a pointer handle's attribute: the kernel argument it was derived from


def _masked(ptrs, mask) -> np.ndarray:
    data = ptrs.data
    if mask is None:
        return data.reshape(-1)
    m = np.broadcast_to(mask.data, data.shape)
    return data[m]


def _element_size(ptr) -> int:
    return max(1, ptr.get_element_ty().primitive_bitwidth // 8)


def _values(ptrs, mask, np_dtype):
    """The values at the unmasked lanes (for atomics: before and after), as raw bytes for comparing."""
    from triton._C.libtriton import interpreter as _interp

    m = np.ones(ptrs.data.shape, dtype=bool) if mask is None else np.broadcast_to(mask.data, ptrs.data.shape).copy()
    other = np.zeros(ptrs.data.shape, dtype=np_dtype)
    return _interp.load(ptrs.data, m, other, np_dtype)[m]


def _shown(v: np.ndarray):
    return v.item() if v.size == 1 else tuple(v.tolist())


class _State:
    """The active ``interleaved`` block: its schedule, how it names things, and its launches."""

    def __init__(self, schedule: Schedule, ticket, describe):
        self.schedule = schedule
        self.ticket = ticket
        self.describe = describe
        self.launches: list = []
        self.run: Optional[_Run] = None


# The builder's operations whose result points into the same argument as their pointer operand.
_DERIVING = ("create_addptr", "create_splat", "create_broadcast", "create_expand_dims", "create_unsplat",
             "create_trans")


def _wrap_builder(builder, state: _State) -> dict:
    """The builder's memory operations, each a switch point (atomics and volatile loads always,
    plain loads and stores with ``every_access``) with the bounds check; returns the originals."""
    from triton.runtime.interpreter import _get_np_dtype

    cls = type(builder)

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        run = state.run
        if run is None:
            return cls.create_masked_load(builder, ptrs, mask, other, cache_policy, is_volatile)
        el = _element_size(ptrs)
        addrs = _masked(ptrs, mask)
        if is_volatile or state.schedule.every_access:
            run.switch("volatile load of" if is_volatile else "load of", int(ptrs.data.reshape(-1)[0]), el)
        run.check("load", ptrs, addrs, el)
        ret = cls.create_masked_load(builder, ptrs, mask, other, cache_policy, is_volatile)
        if is_volatile and addrs.size:
            run.after(False, poll=f"volatile load of {run.name(int(addrs[0]), el)} reads "
                                  f"{_shown(ret.data[np.broadcast_to(mask.data, ptrs.data.shape)])}")
        else:
            run.after(False)
        return ret

    def masked_store(ptrs, value, mask, cache_policy):
        run = state.run
        if run is None:
            return cls.create_masked_store(builder, ptrs, value, mask, cache_policy)
        el = _element_size(ptrs)
        addrs = _masked(ptrs, mask)
        if state.schedule.every_access:
            run.switch("store to", int(ptrs.data.reshape(-1)[0]), el)
        run.check("store", ptrs, addrs, el)
        ret = cls.create_masked_store(builder, ptrs, value, mask, cache_policy)
        run.after(addrs.size > 0)
        return ret

    def atomic(kind, ptr, mask, do):
        run = state.run
        if run is None:
            return do()
        el = _element_size(ptr)
        addrs = _masked(ptr, mask)
        first = int(ptr.data.reshape(-1)[0])
        run.switch(f"atomic {kind} on", first, el)
        run.check(f"atomic {kind}", ptr, addrs, el)
        np_dtype = _get_np_dtype(ptr.get_element_ty())
        before = _values(ptr, mask, np_dtype)
        ret = do()
        after = _values(ptr, mask, np_dtype)
        changed = before.tobytes() != after.tobytes()
        arg, index = run.where(first, el) if addrs.size else (None, first)
        prog = run.current()
        if addrs.size:
            idx = index if addrs.size == 1 else tuple(run.where(int(a), el)[1] for a in addrs)
            run.launch.atomics.append(Atomic(prog.pid, arg, idx, _shown(before), _shown(after)))
            if run.ticket_addr is not None and addrs.size == 1 and first == run.ticket_addr:
                prog.tickets.append(before.item())
        run.after(changed, poll=None if changed or not addrs.size else
                  f"atomic {kind} on {run.name(first, el)} reads {_shown(before)}")
        return ret

    def atomic_rmw(rmwOp, ptr, val, mask, sem, scope):
        return atomic(str(rmwOp).rsplit(".", 1)[-1].lower(), ptr, mask,
                      lambda: cls.create_atomic_rmw(builder, rmwOp, ptr, val, mask, sem, scope))

    def atomic_cas(ptr, cmp, val, sem, scope):
        return atomic("cas", ptr, None, lambda: cls.create_atomic_cas(builder, ptr, cmp, val, sem, scope))

    def derived(name):
        """The builder's ``name`` with the result's pointer provenance taken from its first operand."""
        op = getattr(cls, name)

        def derive(*args):
            out = op(builder, *args)
            src = next((a for a in args if hasattr(a, "attr")), None)
            if state.run is not None and src is not None and _ARG in src.attr:
                out.attr[_ARG] = src.attr[_ARG]
            return out

        return derive

    wrappers = dict(create_masked_load=masked_load, create_masked_store=masked_store,
                    create_atomic_rmw=atomic_rmw, create_atomic_cas=atomic_cas,
                    **{name: derived(name) for name in _DERIVING})
    saved = {name: builder.__dict__.get(name) for name in wrappers}
    for name, w in wrappers.items():
        setattr(builder, name, w)
    return saved


def _executor_class(base, state: _State):
    """A ``GridExecutor`` whose launches run under ``state``'s schedule (Triton 3.x's executor, with
    the loop over the grid replaced by ``_Run``)."""
    import inspect

    from triton.runtime import interpreter as ti

    class InterleavedExecutor(base):
        def __call__(self, *args_dev, **kwargs):
            argspec = inspect.getfullargspec(self.fn)
            kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
            args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
            for hook in self.pre_run_hooks:
                hook(*args_hst, **kwargs_hst)
            patch_scope = ti._patch_lang(self.fn)
            try:
                named = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
                args = {name: arg if name in self.constexprs else ti._implicit_cvt(arg) for name, arg in named.items()}
                for name, arg in args.items():
                    if hasattr(named[name], "data_ptr") and hasattr(arg, "handle"):
                        arg.handle.attr[_ARG] = name  # where its pointers may go
                grid = self.grid(args) if callable(self.grid) else self.grid
                grid = tuple(grid) + (1,) * (3 - len(grid))
                if grid[1] != 1 or grid[2] != 1:
                    raise ValueError(f"interleaved: a one-dimensional grid only, got {grid}")
                ti.interpreter_builder.set_grid_dim(*grid)
                ticket_addr = None
                if state.ticket is not None:
                    t = named[state.ticket[0]]
                    ticket_addr = t.data_ptr() + state.ticket[1] * t.element_size()
                launch = Launch(grid=grid[0])
                state.launches.append(launch)
                run = _Run(state.schedule, grid[0], _extents(named), ticket_addr, state.describe, launch,
                           ti.interpreter_builder)
                state.run = run
                try:
                    run.run(self.fn, args)
                finally:
                    state.run = None
            finally:
                patch_scope.restore()
            self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    return InterleavedExecutor


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
