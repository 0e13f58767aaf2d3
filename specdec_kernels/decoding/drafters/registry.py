"""The drafters by name: the one registry that ``SpeculativeDecoder(drafter=<name>)`` (through
``pair.load_pair``) and the CLI's ``--drafter`` read.  A new drafter registers here once
(``register_drafter``): its name, what ``draft=`` holds for it, and how to build it from the
decoder's draft runner.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

__all__ = ["DrafterKind", "drafter_kind", "drafter_names", "register_drafter", "unregister_drafter"]


class DrafterKind(NamedTuple):
    """A registered drafter.  draft: what ``draft=`` holds for it: "model" (a causal LM over the
    target's vocabulary, run by a ``runners.ModelRunner``), "feature" (a ``FeatureDraft`` or its
    directory, run by a ``runners.FeatureRunner``), or None (nothing: it drafts without a
    network).  make(runner, **options) -> Drafter: the runner of its draft (None when ``draft`` is
    None); options: the keyword arguments it takes (``max_ngram`` for prompt lookup)."""

    name: str
    draft: Optional[str]
    make: Callable
    options: tuple = ()


_KINDS: dict = {}


def register_drafter(name: str, draft: Optional[str], make: Callable, options: tuple = ()) -> DrafterKind:
    """Register a drafter under ``name`` (refused if the name is taken); returns its entry."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a drafter's name must be a non-empty str, got {name!r}")
    if draft not in ("model", "feature", None):
        raise ValueError(f"draft must be 'model', 'feature' or None, got {draft!r}")
    if name in _KINDS:
        raise ValueError(f"a drafter named {name!r} is already registered")
    _KINDS[name] = kind = DrafterKind(name, draft, make, tuple(options))
    return kind


def unregister_drafter(name: str) -> None:
    """Remove a registered drafter (tests register and remove their own)."""
    _KINDS.pop(name, None)


def drafter_names() -> tuple:
    """The registered drafters' names, in registration order."""
    return tuple(_KINDS)


def drafter_kind(name: str) -> DrafterKind:
    """The entry of ``name``; a ValueError naming the registered ones if there is none."""
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"drafter must be one of {drafter_names()}, got {name!r}")
    return kind


def _model(runner):
    from .model import ModelDrafter

    return ModelDrafter(runner)


def _lookup(runner, max_ngram: Optional[int] = None):
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(max_ngram=3 if max_ngram is None else max_ngram)


def _feature(runner):
    from .feature import FeatureDrafter

    return FeatureDrafter(runner)


register_drafter("model", "model", _model)
register_drafter("prompt_lookup", None, _lookup, options=("max_ngram",))
register_drafter("feature", "feature", _feature)
