"""``python -m specdec_kernels generate ...``: see ``specdec_kernels.cli``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
