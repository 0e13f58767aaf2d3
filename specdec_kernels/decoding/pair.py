"""Loading and checking a (draft, target) pair, before anything is converted or moved.

``load_pair`` resolves what ``SpeculativeDecoder`` (and the CLI, through it) is given: model
names or paths are loaded, the embedded default pair stands in for neither, a feature draft's
directory is read, the tokenizers are loaded and compared (a vocabulary mismatch is refused
before any weights are loaded), and every check that can refuse the pair runs while a caller's
modules are still as they were (a dtype round trip is lossy, so nothing is converted here).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch

from .arguments import load_tokenizer, resolve_dtype, vocab_mismatch
from .drafters.base import Drafter
from .drafters.registry import drafter_kind, drafter_names

__all__ = ["DRAFTERS", "Pair", "device_of", "embedded_pair", "load_model", "load_pair"]

DRAFTERS = ("model", "prompt_lookup", "feature")  # the built-in ones; drafters.registry.drafter_names(): all


class Pair(NamedTuple):
    """What ``load_pair`` resolved: the models (not yet converted or moved), the drafter's name,
    the tokenizer (or None), the device the models will run on, the dtype asked for (or None),
    and for a feature draft its saved draft vocabulary whether the caller passed the module, and the
    prompt-lookup drafter."""

    target: torch.nn.Module
    draft: Optional[torch.nn.Module]
    feature: Optional[torch.nn.Module]
    drafter: str
    tokenizer: Any
    device: torch.device
    dtype: Optional[torch.dtype]
    feature_vocab: Optional[torch.Tensor]
    feature_given: bool
    lookup: Any  # the drafter without a network (drafter="prompt_lookup": a PromptLookupDrafter), else None
    instance: Any = None  # the Drafter passed as drafter=<instance>, else None
    draft_tokenizer: Any = None  # the draft's tokenizer, where known
    vocabulary: str = "shared"  # "shared", or for a draft over another tokenizer "auto" | "intersection" | "string"


def device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def load_model(model, dtype):
    """A model name/path loaded with ``AutoModelForCausalLM`` (in ``dtype``), or the module as given."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": dtype} if dtype is not None else {}
        return AutoModelForCausalLM.from_pretrained(model, **kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"models must be a name/path or a torch.nn.Module, got {type(model).__name__}")
    return model  # converted by the decoder once every check has passed


def embedded_pair(drafter: Optional[str], device, dtype) -> tuple:
    """(draft, target, tokenizer) of the embedded default pair, offline, for ``drafter``: None or
    "model" its draft model, "feature" the directory of the embedded target's feature draft
    (checked first: a missing one is said before any model is loaded), "prompt_lookup" None."""
    feature_dir = None
    if drafter == "feature":
        from .drafters.feature_model import embedded_feature_draft_dir

        feature_dir = embedded_feature_draft_dir()
    from ..models.embedded import default_pair

    draft, target, tokenizer = default_pair(device=device, dtype=resolve_dtype(dtype),
                                            with_draft=drafter in (None, "model"))
    draft = feature_dir if drafter == "feature" else None if drafter == "prompt_lookup" else draft
    return draft, target, tokenizer


def load_pair(draft, target, tokenizer, device: Optional[torch.device], dtype, drafter: Optional[str],
              max_ngram: Optional[int] = None, tree: bool = False, draft_tokenizer=None,
              vocabulary: str = "auto") -> Pair:
    """Resolve and check a pair as ``SpeculativeDecoder`` takes it (its docstring says what each
    argument may be); ``device``: as ``models.resolve_device`` resolved it (None: where they are)."""
    from .drafters.cross import VOCABULARIES

    if not isinstance(vocabulary, str) or vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {VOCABULARIES}, got {vocabulary!r}")
    instance = None
    if isinstance(drafter, Drafter):  # it drafts for the target alone, with what it brings
        instance, drafter = drafter, None
        if draft is not None:
            raise ValueError(f"drafter=<a Drafter instance> brings what it drafts with and takes no draft, got "
                             f"draft={type(draft).__name__} with drafter={type(instance).__name__}")
        if max_ngram is not None:
            raise ValueError(f"max_ngram applies to drafter='prompt_lookup', got max_ngram={max_ngram!r} with "
                             f"drafter={type(instance).__name__}")
        if tree:
            raise ValueError(f"tree drafting needs a draft model (drafter='model'), got drafter="
                             f"{type(instance).__name__}")
    elif drafter is not None and not isinstance(drafter, str):
        raise TypeError(f"drafter must be one of {drafter_names()}, a Drafter instance or None, got "
                        f"{type(drafter).__name__}")
    if instance is not None:
        if target is None:  # the embedded target, without its draft
            _, target, default_tokenizer = embedded_pair("prompt_lookup", device, dtype)
            tokenizer = default_tokenizer if tokenizer is None else tokenizer
        tokenizer = load_tokenizer(tokenizer, "tokenizer") if isinstance(tokenizer, str) else tokenizer
        if tokenizer is None and isinstance(target, str):
            tokenizer = load_tokenizer(target, "target")
        target = load_model(target, resolve_dtype(dtype))
        return _checked(Pair(target, None, None, instance.name, tokenizer, None, resolve_dtype(dtype), None, False,
                             None, instance), device)
    feature_given = False
    if target is None and draft is None and drafter in (None, "feature"):
        draft, target, default_tokenizer = embedded_pair(drafter, device, dtype)
        tokenizer = default_tokenizer if tokenizer is None else tokenizer
    if target is None:
        raise TypeError("target must be a model name/path or a PreTrainedModel, got None "
                        "(pass neither draft nor target for the embedded default pair)")
    if drafter is None:
        drafter = "model" if draft is not None else "prompt_lookup"
    kind = drafter_kind(drafter)  # the registry's entry (a ValueError naming the registered ones)
    if kind.draft == "model" and draft is None:
        raise ValueError(f"drafter={drafter!r} needs a draft model, got draft=None")
    if tree and drafter != "model":
        raise ValueError(f"tree drafting needs a draft model (drafter='model'), got drafter={drafter!r}")
    if kind.draft is None and draft is not None:
        raise ValueError(f"drafter={drafter!r} takes no draft model, got draft={type(draft).__name__}")
    dtype = resolve_dtype(dtype)
    feature = None  # a FeatureDraft (drafter="feature")
    feature_vocab = None
    if kind.draft == "feature":
        from .drafters.feature_model import FeatureDraft, load_feature_draft

        feature_given = not isinstance(draft, (str, os.PathLike))
        if not feature_given:
            draft, feature_vocab = load_feature_draft(draft, dtype=dtype or torch.float32)
        elif not isinstance(draft, FeatureDraft):
            raise TypeError(f"drafter='feature' needs a FeatureDraft or the directory of one "
                            f"(specdec_kernels.decoding.drafters.feature_model), got draft={type(draft).__name__}")
        feature, draft = draft.eval(), None
    if max_ngram is not None and "max_ngram" not in kind.options:
        raise ValueError(f"max_ngram applies to drafter='prompt_lookup', got max_ngram={max_ngram!r} with "
                         f"drafter={drafter!r}")
    options = {} if max_ngram is None else {"max_ngram": max_ngram}
    lookup = kind.make(None, **options) if kind.draft is None else None  # checked before any loading

    # Tokenizers first: a mismatch is refused before loading any weights.
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer, "tokenizer")
    if tokenizer is None and isinstance(target, str):
        tokenizer = load_tokenizer(target, "target")
    if isinstance(draft_tokenizer, (str, os.PathLike)):
        draft_tokenizer = load_tokenizer(str(draft_tokenizer), "draft_tokenizer")
    elif draft_tokenizer is not None and not hasattr(draft_tokenizer, "get_vocab"):
        raise TypeError(f"draft_tokenizer must be a tokenizer or its path, got {type(draft_tokenizer).__name__}")
    if draft_tokenizer is None and isinstance(draft, str):
        draft_tokenizer = load_tokenizer(draft, "draft")
    mode = _vocabulary(vocabulary, draft_tokenizer, tokenizer, kind.draft, drafter, tree)

    target = load_model(target, dtype)  # a path is loaded in dtype; a module is converted below
    draft = load_model(draft, dtype) if draft is not None else None
    return _checked(Pair(target, draft, feature, drafter, tokenizer, None, dtype, feature_vocab, feature_given,
                         lookup, None, draft_tokenizer, mode), device)


def _vocabulary(vocabulary: str, draft_tokenizer, tokenizer, draft_kind, drafter: str, tree: bool) -> str:
    """How the draft's tokens reach the target: "shared" (one vocabulary: the draft proposes the
    target's ids), else the ``vocabulary`` asked for a draft model over another tokenizer
    (``drafters.cross``).  "auto" is "shared" when the tokenizers' vocabularies are equal (or the
    draft's is not known), else a cross-vocabulary draft."""
    if vocabulary == "shared" or (vocabulary == "auto" and (draft_tokenizer is None or tokenizer is None)):
        if draft_tokenizer is not None and tokenizer is not None:
            why = vocab_mismatch(draft_tokenizer.get_vocab(), tokenizer.get_vocab())
            if why is not None:
                raise ValueError(f"draft and target tokenizers must have the same vocabulary with "
                                 f"vocabulary='shared', got {why} (vocabulary='auto' drafts across them)")
        return "shared"
    if vocabulary == "auto" and vocab_mismatch(draft_tokenizer.get_vocab(), tokenizer.get_vocab()) is None:
        return "shared"
    if draft_kind != "model":
        raise ValueError(f"vocabulary={vocabulary!r} needs a draft model (drafter='model'), got drafter={drafter!r}")
    if draft_tokenizer is None:
        raise ValueError(f"vocabulary={vocabulary!r} needs the draft's tokenizer: pass draft_tokenizer= (or the "
                         f"draft by name or directory, which brings its own)")
    if tokenizer is None:
        raise ValueError(f"vocabulary={vocabulary!r} needs the target's tokenizer: pass tokenizer=")
    if tree:
        raise ValueError("tree drafting needs a draft over the target's vocabulary, got a draft with another "
                         "tokenizer")
    return vocabulary


def _checked(pair: Pair, device: Optional[torch.device]) -> Pair:
    """``pair`` with the device its models will run on, once every check that can refuse it has
    passed, before a caller's module is converted or moved: a refused pair leaves the models as
    they were (a dtype round trip is lossy)."""
    target, draft, feature = pair.target, pair.draft, pair.feature
    final_device = torch.device(device) if device is not None else device_of(target)
    if device is None and draft is not None and device_of(draft) != device_of(target):
        raise ValueError(f"draft and target must be on the same device, got draft on {device_of(draft)} "
                         f"and target on {device_of(target)} (pass device=...)")
    on_meta = [name for name, m in (("target", target), ("draft", draft), ("feature draft", feature))
               if m is not None and any(p.is_meta for p in m.parameters())]
    if on_meta:
        raise ValueError(f"the models must hold their weights, got the {' and '.join(on_meta)} on the meta "
                         f"device (no data): load them with their weights")
    return pair._replace(device=final_device)
