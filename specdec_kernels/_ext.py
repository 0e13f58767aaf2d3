"""Loads the compiled extension ``specdec_kernels._C`` once, if it was built.

Importing ``_C`` registers the ``torch.ops.specdec.*`` ops (schemas, CPU kernels and, in a
CUDA build, CUDA kernels).  When it is missing (a source checkout that was never built, or a
build that no longer matches the installed torch) the package still works: every op falls
back to its pure-PyTorch reference, and one warning says so.

Nothing here queries a GPU: importing the package must work on a machine without one.
"""

from __future__ import annotations

import warnings

__all__ = ["HAS_EXT", "EXT_IMPORT_ERROR"]

EXT_IMPORT_ERROR: ImportError | None = None

try:
    from specdec_kernels import _C  # noqa: F401  (the import itself registers the ops)
except ImportError as exc:  # not built, or built against another torch (undefined symbols)
    EXT_IMPORT_ERROR = exc
    HAS_EXT = False
    warnings.warn(
        "specdec_kernels: the C++ extension specdec_kernels._C is missing "
        f"({type(exc).__name__}: {exc}); the pure-PyTorch fallbacks are used instead. "
        "Build it from the repository root with `pip install --no-build-isolation -e .`",
        RuntimeWarning,
        stacklevel=2,
    )
else:
    HAS_EXT = True
