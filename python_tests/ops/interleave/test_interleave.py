"""``ops.interleave`` on small kernels of its own: programs interleaved at atomics (and, asked,
at every access), each with its own program id; a seed a reproducible schedule; the resident
limit and the starved program; a deadlock, a runaway launch, an access out of bounds (also into
another argument) and an exception each failing the launch with the programs named."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import HAS_CUDA
from specdec_kernels.ops.interleave import (Deadlock, OutOfBounds, ProgramError, Schedule, SwitchLimit, interleaved)

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interleaving runs Triton's interpreter (CPU tensors)")


@triton.jit
def _count(cnt_ptr, out_ptr, N: tl.constexpr):
    """Each program: N rounds of an atomic add, then a store of its program id at its own slot."""
    pid = tl.program_id(0)
    for r in range(N):
        tl.atomic_add(cnt_ptr, 1)
        tl.store(out_ptr + pid * N + r, tl.program_id(0))


@triton.jit
def _wait_for_other(flags_ptr, VOLATILE: tl.constexpr):
    """Program p waits for program 1 - p's flag, then sets its own: a deadlock for two programs."""
    pid = tl.program_id(0)
    if VOLATILE:
        v = tl.load(flags_ptr + 1 - pid, volatile=True)
        while v == 0:
            v = tl.load(flags_ptr + 1 - pid, volatile=True)
    else:
        v = tl.atomic_add(flags_ptr + 1 - pid, 0)
        while v == 0:
            v = tl.atomic_add(flags_ptr + 1 - pid, 0)
    tl.atomic_xchg(flags_ptr + pid, 1)


@triton.jit
def _wait_for_last(flags_ptr, LAST: tl.constexpr):
    """Programs 0..LAST-1 wait for program LAST's flag, which sets it."""
    pid = tl.program_id(0)
    if pid < LAST:
        v = tl.atomic_add(flags_ptr + LAST, 0)
        while v == 0:
            v = tl.atomic_add(flags_ptr + LAST, 0)
    else:
        tl.atomic_xchg(flags_ptr + pid, 1)


@triton.jit
def _store_at(out_ptr, other_ptr, off):
    """Program 1 stores at out_ptr + off; program 0 at out_ptr (other_ptr: another argument, unused)."""
    pid = tl.program_id(0)
    tl.atomic_add(out_ptr, 0)
    tl.store(out_ptr + pid * off, 1.0)


@triton.jit
def _spin(cnt_ptr):
    """Adds for ever (well, 10^6 times)."""
    for r in range(1000000):
        tl.atomic_add(cnt_ptr, 1)


@triton.jit
def _fails(x_ptr, FAIL: tl.constexpr):
    tl.atomic_add(x_ptr, 1)
    tl.static_assert(not FAIL, "this program fails")


def _count_run(schedule: Schedule, G: int = 3, N: int = 6):
    cnt = torch.zeros(1, dtype=torch.int32)
    out = torch.full((G * N,), -1, dtype=torch.int32)
    with interleaved(schedule, ticket=("cnt_ptr", 0)) as rec:
        _count[(G,)](cnt, out, N)
    (launch,) = rec.launches
    return cnt, out, launch


def test_programs_interleave_each_with_its_own_program_id():
    """Three programs of six rounds: every round's store carries its own program id (restored at
    each switch), the 18 atomics interleave the programs, and ``tickets`` lists each program's
    reads of the counter, all 18 values once."""
    cnt, out, launch = _count_run(Schedule(seed=1))
    assert int(cnt) == 18
    assert out.tolist() == [p for p in range(3) for _ in range(6)]
    order = [a.program for a in launch.atomics]
    assert sorted(order) == [0] * 6 + [1] * 6 + [2] * 6
    assert sum(a != b for a, b in zip(order, order[1:])) >= 4, order  # not one program after another
    assert sorted(t for ts in launch.tickets.values() for t in ts) == list(range(18))
    assert all(a.arg == "cnt_ptr" and a.index == 0 and a.new == a.old + 1 for a in launch.atomics)


def test_a_seed_is_a_reproducible_schedule():
    orders = {s: [a.program for a in _count_run(Schedule(seed=s))[2].atomics] for s in (3, 3, 4, 5)}
    again = [a.program for a in _count_run(Schedule(seed=3))[2].atomics]
    assert orders[3] == again
    assert len({tuple(o) for o in orders.values()}) == 3


def test_every_access_switches_at_plain_stores_too():
    """With ``every_access`` the stores are switch points as well: more switches than atomics alone."""
    plain = _count_run(Schedule(seed=2))[2].switches
    every = _count_run(Schedule(seed=2, every_access=True))[2].switches
    assert every >= plain + 18 - 3


def test_resident_limit_starts_a_program_when_one_exits():
    """R = 1 of G = 3: the programs run one after another; R = 2: program 2 starts after one of
    the first two has exited."""
    order = [a.program for a in _count_run(Schedule(seed=7, resident=1))[2].atomics]
    assert order == [0] * 6 + [1] * 6 + [2] * 6
    for seed in range(4):
        order = [a.program for a in _count_run(Schedule(seed=seed, resident=2))[2].atomics]
        first2 = order.index(2)
        assert order[:first2].count(0) == 6 or order[:first2].count(1) == 6, order


def test_a_starved_program_is_kept_off_for_stretches():
    """The starved program goes without the baton for a stretch of ``starve_stretch`` switches at
    a time: its longest absence from the atomics is far longer than under the plain schedule."""
    def longest_absence(schedule):
        order = [a.program for a in _count_run(schedule, G=2, N=40)[2].atomics]
        at = [-1] + [k for k, p in enumerate(order) if p == 0]  # program 0's atomics
        return max(b - a - 1 for a, b in zip(at, at[1:]))

    starved = [longest_absence(Schedule(seed=s, starve=0, starve_stretch=16, phase=0)) for s in range(3)]
    plain = [longest_absence(Schedule(seed=s, phase=0)) for s in range(3)]
    assert min(starved) >= 12 and max(plain) < 12, (starved, plain)


@pytest.mark.parametrize("volatile", [False, True], ids=["atomic_poll", "volatile_poll"])
def test_a_deadlock_fails_naming_each_program_and_what_it_polls(volatile):
    flags = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(Deadlock) as e, interleaved(Schedule(seed=0, deadlock_switches=50),
                                                   describe=lambda arg, i: f"flag of program {i}"):
        _wait_for_other[(2,)](flags, volatile)
    msg = str(e.value)
    assert "every live program polls" in msg
    for p in (0, 1):
        assert f"program {p} (tickets claimed: none)" in msg
        assert f"flags_ptr[{1 - p}] (flag of program {1 - p}) reads 0" in msg
    assert ("volatile load of" in msg) == volatile


def test_programs_that_wait_for_one_not_yet_started_deadlock_only_below_its_residency():
    """Programs 0 and 1 wait for program 2: fine with all three resident, a deadlock when only two
    are (program 2 starts only when one of them exits, and neither does)."""
    for resident, fails in ((3, False), (2, True)):
        flags = torch.zeros(3, dtype=torch.int32)
        if fails:
            with pytest.raises(Deadlock, match=r"(?s)not started \(resident limit 2\): program 2"):
                with interleaved(Schedule(seed=1, resident=resident, deadlock_switches=30)):
                    _wait_for_last[(3,)](flags, 2)
        else:
            with interleaved(Schedule(seed=1, resident=resident, deadlock_switches=30)):
                _wait_for_last[(3,)](flags, 2)
            assert flags.tolist() == [0, 0, 1]


def test_an_access_out_of_bounds_fails_with_the_program():
    out = torch.zeros(4)
    with pytest.raises(OutOfBounds, match=r"program 1 \(tickets claimed: none\): store out of bounds .* "
                                          r"out_ptr holds 4 elements, this is element 4"):
        with interleaved(Schedule(seed=0)):
            _store_at[(2,)](out, out, 4)


def test_an_access_into_another_argument_is_out_of_bounds():
    """An offset from one tensor that lands in another (both arguments of the launch) is caught:
    a pointer keeps the argument it was derived from."""
    both = torch.zeros(8)
    a, b = both[:4], both[4:]
    with interleaved(Schedule(seed=0)):
        _store_at[(2,)](a, b, 2)  # element 2 of a: in bounds
    with pytest.raises(OutOfBounds, match=r"out_ptr holds 4 elements, this is element 5"):
        with interleaved(Schedule(seed=0)):
            _store_at[(2,)](a, b, 5)  # element 1 of b, the other argument


def test_a_runaway_launch_ends_at_the_switch_bound():
    with pytest.raises(SwitchLimit, match=r"passed 200 switches; program \d \(tickets claimed: \.\.\., \d+"):
        with interleaved(Schedule(seed=0, max_switches=200), ticket=("cnt_ptr", 0)):
            _spin[(2,)](torch.zeros(1, dtype=torch.int32))


def test_an_exception_in_a_program_fails_the_launch_naming_it():
    with pytest.raises(ProgramError, match=r"program \d \(tickets claimed: none\) raised AssertionError"):
        with interleaved(Schedule(seed=0)):
            _fails[(2,)](torch.zeros(1, dtype=torch.int32), True)


def test_the_interpreter_is_restored_after_the_block():
    from triton.runtime import interpreter as ti

    before = ti.GridExecutor
    with pytest.raises(RuntimeError, match="do not nest"):
        with interleaved(Schedule()), interleaved(Schedule()):
            pass
    assert ti.GridExecutor is before and "create_masked_load" not in vars(ti.interpreter_builder)
    cnt, out = torch.zeros(1, dtype=torch.int32), torch.full((6,), -1, dtype=torch.int32)
    _count[(2,)](cnt, out, 3)  # the plain interpreter again
    assert int(cnt) == 6 and out.tolist() == [0, 0, 0, 1, 1, 1]


def test_schedule_settings_are_checked():
    for bad in (dict(resident=0), dict(phase=-1), dict(starve=-1), dict(max_switches=0), dict(deadlock_polls=0)):
        with pytest.raises(ValueError, match=f"Schedule.{next(iter(bad))} must be an int"):
            Schedule(**bad)
