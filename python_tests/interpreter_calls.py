"""Triton's interpreter, without its repeated language patch at every device-function call.

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` for the interpreter (and
restores it at the end), and every call of a ``@triton.jit`` device function patches it again:
``inspect.getmembers`` over the language's modules, about 0.7 ms a call, which was a fifth of an
interpreted split-kernel launch (its record fields are device functions called per work item).
Inside a launch the second patch sets the attributes the launch has already set, so it changes
nothing; ``install()`` skips it while a launch's patch is in place, and does nothing on a Triton
whose interpreter lacks the names it wraps (the tests then run as before, only slower).
"""

from __future__ import annotations

import inspect
import sys
import threading

_lock = threading.Lock()
_active = False  # a launch's patch is in place (the interleaver's threads share their launch's)
_done: set = set()  # the language modules patched since that launch's patch
_keys: dict = {}  # function -> the language modules its module sees (what the patch patches)


def install() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang``; True when installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    orig = getattr(ti, "_patch_lang", None)
    scope_cls = getattr(ti, "_LangPatchScope", None)
    device_call = getattr(getattr(ti, "InterpretedFunction", None), "__call__", None)
    if orig is None or scope_cls is None or device_call is None or getattr(orig, "_specdec_wrapped", False):
        return False
    device_code = device_call.__code__

    def key(fn):
        k = _keys.get(fn)
        if k is None:
            k = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            _keys[fn] = k
        return k

    def patch_lang(fn):
        global _active
        from_device_call = sys._getframe(1).f_code is device_code
        k = key(fn)
        with _lock:
            if from_device_call:
                if _active and k and k <= _done:
                    return scope_cls()  # this launch has patched these modules already
                scope = orig(fn)  # Triton never restores a device call's own patch either
                if _active:
                    _done.update(k)
                return scope
            if _active:
                return orig(fn)  # a launch inside a launch: as Triton does it
            scope = orig(fn)
            _active = True
            _done.update(k)
        restore = scope.restore

        def restore_and_release():
            global _active
            with _lock:
                try:
                    restore()
                finally:
                    _active = False
                    _done.clear()

        scope.restore = restore_and_release
        return scope

    patch_lang._specdec_wrapped = True
    ti._patch_lang = patch_lang
    return True
