"""Loads the compiled extension ``specdec_kernels.ops._C`` once, if it was built.

Importing ``_C`` registers the ``torch.ops.specdec.*`` ops (schemas, CPU kernels and, in a
CUDA build, CUDA kernels).  When it is missing (a source checkout that was never built, or a
build that no longer matches the installed torch) the package still works: every op falls
back to its pure-PyTorch reference, and one warning says so.

Nothing here queries a GPU: importing the package must work on a machine without one.
"""

from __future__ import annotations

import glob
import os
import warnings

__all__ = ["HAS_EXT", "EXT_IMPORT_ERROR"]

EXT_IMPORT_ERROR: ImportError | None = None

try:
    from . import _C  # noqa: F401  (the import itself registers the ops)
except ImportError as exc:  # not built, or built against another torch (undefined symbols)
    EXT_IMPORT_ERROR = exc
    HAS_EXT = False
    _here = os.path.dirname(os.path.abspath(__file__))
    if not glob.glob(os.path.join(_here, "_C*")):
        # Python's own words here ("partially initialized module ... circular import") mislead: the
        # package imported is a source tree (the current directory, most often) with no build in it.
        _why = (f"the package was imported from {_here}, which holds no built extension; if specdec-kernels is "
                "installed, this source tree shadows it (run Python from another directory), else build it here "
                "with `pip install --no-build-isolation -e .`")
    else:  # built, but not loadable: another torch, most often
        _why = (f"{type(exc).__name__}: {exc}; rebuild it against the installed torch with "
                "`pip install --no-build-isolation -e .` from the repository root")
    warnings.warn(
        f"specdec_kernels: the C++ extension specdec_kernels.ops._C is not loaded ({_why}); the pure-PyTorch "
        "fallbacks are used instead.",
        RuntimeWarning,
        stacklevel=2,
    )
else:
    HAS_EXT = True
