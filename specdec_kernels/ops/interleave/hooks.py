"""The interpreter's hooks: a grid executor that runs a launch's programs as threads of one
``_Run`` (``run.py``), and the builder's memory operations wrapped so that each atomic, volatile
load and (with ``Schedule.every_access``) other access hands the baton on and is bounds-checked."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .run import _ARG, Atomic, Launch, Schedule, _extents, _Run

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
