"""The parts a decoder runs with, assembled once: ``assemble_parts`` -> ``DecoderParts``.

``SpeculativeDecoder.__init__`` hands its arguments here.  ``load_pair`` (``pair.py``) resolves and
checks the models and tokenizers while the caller's modules are untouched; then the feature draft
is checked against the target, the runners are made (``runners.py``: the target's, the draft's or
the feature draft's forward paths), the drafter chosen (the registry's, a cross-vocabulary one, or
the caller's instance), the CPU accelerator built, the draft vocabulary resolved, and only then are
the models converted and moved.  What comes out is one frozen object: the loop (``loop.py``), the
tree path (``tree.py``), the state's start (``state.py``) and the transformers adapter
(``integrations/transformers/``) take it instead of reaching into the decoder.  The runners it holds
keep their own per-call state (the lean path, the draft vocabulary's rows), refreshed by
``DecoderParts.refresh`` at each call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .drafters.registry import drafter_kind
from .drafters.vocab import resolve_draft_vocab
from .pair import device_of, load_pair
from .runners import FeatureRunner, ModelRunner

__all__ = ["DecoderParts", "assemble_parts"]


@dataclass(frozen=True)
class DecoderParts:
    """What a decoder runs with.  target / draft / feature: the models (eval mode, converted and
    moved; draft None for prompt lookup or a feature draft; feature: a ``FeatureDraft`` or None);
    target_runner / draft_runner: their forward paths (draft_runner None without a draft network);
    drafter: the ``Drafter`` the loop drafts through, drafter_name its name; tokenizer (or None),
    draft_tokenizer, vocabulary (``"shared"``, ``"intersection"`` or ``"string"``), lookup (the
    prompt-lookup drafter); device; accelerator and cpu_linear (the CPU layer and the linear mode it
    chose); draft_vocab (sorted int64 ids or None); draft_prior (the draft/target cost ratio before
    anything is measured: their parameter counts); verification (``"token"`` / ``"block"``),
    verify_backend, tree (a ``TreeShape`` or None)."""

    target: torch.nn.Module
    draft: Optional[torch.nn.Module]
    feature: Any
    target_runner: ModelRunner
    draft_runner: Any
    drafter: Any
    drafter_name: str
    tokenizer: Any
    draft_tokenizer: Any
    vocabulary: str
    lookup: Any
    device: torch.device
    accelerator: Any
    cpu_linear: str
    draft_vocab: Optional[torch.Tensor]
    draft_prior: float
    verification: str
    verify_backend: str
    tree: Any

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size."""
        return self.target_runner.vocab_size

    @property
    def has_draft_network(self) -> bool:
        """True when a network drafts (its drafts come with the distributions they were drawn from)."""
        return self.draft_runner is not None

    def refresh(self) -> None:
        """Decide the decode-step path of each model again (it may have moved or changed mode), and
        take the draft vocabulary's rows of the draft's output layer again (its weights may have
        changed): at the start of every call."""
        for r in (self.target_runner, self.draft_runner):
            if r is not None:
                r.use_lean(self.accelerator)
        if self.draft_runner is not None:
            self.draft_runner.set_vocab(None if self.draft_vocab is None else self.draft_vocab.to(self.device))

    def lean_status(self) -> dict:
        """{"target": reason or None, "draft": ...}: None where the decode steps take the lean path."""
        return {r.name: r.lean_unsupported for r in (self.target_runner, self.draft_runner) if r is not None}

    def linear_layers(self):
        """A context in which the models' linear layers run as ``cpu_linear`` says; a feature
        draft's output layer (a copy of the target's rows) streams as int8 with row scales: a quarter
        of the fp32 bytes (it only proposes; the verify reads the target's own logits)."""
        head = self.draft_runner.head if self.draft_runner is not None else None  # the draft vocabulary's rows
        feature = self.feature is not None
        return self.accelerator.linear_layers(self.cpu_linear, (self.target, self.draft, self.feature,
                                                                None if feature else head),
                                              (head if feature else None,))


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_options(cpu_linear, lean_forward, weight_cache, accelerator, verify_backend, verification) -> None:
    if cpu_linear not in ("auto", "skinny", "torch"):
        raise ValueError(f"cpu_linear must be 'auto', 'skinny' or 'torch', got {cpu_linear!r}")
    if accelerator is not None and (cpu_linear != "auto" or lean_forward is not True or weight_cache is not None):
        raise ValueError(f"pass either accelerator= or cpu_linear/lean_forward/weight_cache, got accelerator="
                         f"{type(accelerator).__name__} with cpu_linear={cpu_linear!r}, "
                         f"lean_forward={lean_forward!r}, weight_cache={weight_cache!r}")
    if verify_backend not in ("auto", "triton", "torch"):
        raise ValueError(f"verify_backend must be 'auto', 'triton' or 'torch', got {verify_backend!r}")
    if verification not in ("token", "block"):
        raise ValueError(f"verification must be 'token' or 'block', got {verification!r}")


def _check_triton_backend(verify_backend: str, device: torch.device) -> None:
    if verify_backend != "triton" or device.type == "cuda":
        return
    from ..ops.verify import interpreter_problem, interpreting

    if not interpreting():
        raise ValueError(f"verify_backend='triton' needs the models on CUDA (or TRITON_INTERPRET=1 for the "
                         f"CPU), got them on {device}")
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(f"verify_backend='triton' on the CPU: {problem}")


def assemble_parts(draft=None, target=None, tokenizer=None, device=None, dtype=None, *, drafter=None,
                   max_ngram=None, cpu_linear: str = "auto", lean_forward: bool = True, draft_vocab: Any = "auto",
                   verify_backend: str = "auto", verification: str = "token", tree: Any = None,
                   accelerator: Any = None, draft_tokenizer: Any = None, vocabulary: str = "auto",
                   weight_cache: Any = None) -> DecoderParts:
    """``SpeculativeDecoder``'s arguments (its docstring says what each means) checked, loaded and
    put together; every check that can refuse them runs before a caller's model is converted or
    moved."""
    _check_options(cpu_linear, lean_forward, weight_cache, accelerator, verify_backend, verification)
    from ..models.embedded import resolve_device
    from .tree import check_tree_model, parse_tree

    shape = parse_tree(tree)  # None: chains of K drafts
    device = resolve_device(device)
    pair = load_pair(draft, target, tokenizer, device, dtype, drafter, max_ngram, tree=shape is not None,
                     draft_tokenizer=draft_tokenizer, vocabulary=vocabulary)
    cross = pair.vocabulary != "shared"
    if cross and not (draft_vocab is None or (isinstance(draft_vocab, str) and draft_vocab == "auto")):
        raise ValueError(f"draft_vocab applies to a draft over the target's vocabulary, got draft_vocab="
                         f"{type(draft_vocab).__name__} with a draft over another tokenizer (vocabulary="
                         f"{pair.vocabulary!r})")
    target, draft, feature, final_device, dtype = pair.target, pair.draft, pair.feature, pair.device, pair.dtype
    _check_triton_backend(verify_backend, final_device)
    feature_at = None
    if feature is not None:
        feature.check_target(target)  # with a tolerance that any dtype passes
        # It runs on the target's features, where they will be and in their dtype (a bf16 target
        # beside a draft loaded in fp32 failed in the first draft step).  A draft the caller passed
        # is converted as a copy: in place, its weights were rounded for good, and a second decoder
        # over another target converted the first one's under it.
        feature_at = (final_device, dtype or next(target.parameters()).dtype)
        have = next(feature.parameters())
        if pair.feature_given and (have.device, have.dtype) != feature_at:
            feature = copy.deepcopy(feature)
    t_runner = ModelRunner(target, "target")
    d_runner = FeatureRunner(feature, target) if feature is not None else (
        ModelRunner(draft, "draft") if draft is not None else None)
    if cross:  # a draft model over another tokenizer (drafters/cross.py)
        from .drafters.cross import CrossVocabDrafter

        the_drafter = CrossVocabDrafter(d_runner, pair.draft_tokenizer, pair.tokenizer, pair.vocabulary,
                                        t_runner.vocab_size)
    elif pair.instance is not None:
        the_drafter = pair.instance
    else:  # the registry's (drafters/registry.py), or prompt lookup
        the_drafter = pair.lookup if d_runner is None else drafter_kind(pair.drafter).make(d_runner)
    if d_runner is not None and not cross and d_runner.vocab_size > t_runner.vocab_size:
        raise ValueError(f"the draft vocabulary must not exceed the target's: draft vocab_size = "
                         f"{d_runner.vocab_size}, target vocab_size = {t_runner.vocab_size}")
    if accelerator is None:  # the one place decoding names the CPU layer: its default accelerator
        from ..cpu.accelerator import CpuAccelerator

        accelerator = CpuAccelerator(cpu_linear, lean_forward, weight_cache)
    vocab_rows = None if cross else resolve_draft_vocab(draft_vocab, d_runner, pair.drafter, draft, feature,
                                                        pair.feature_vocab)
    accelerator.check_device(final_device)

    # Accepted: convert and move.
    for model in (target, draft):
        if model is not None and dtype is not None:
            model.to(dtype)
        if model is not None and device is not None:
            model.to(final_device)
    if feature is not None:
        feature.to(device=feature_at[0], dtype=feature_at[1])
    target = target.eval()
    draft = draft.eval() if draft is not None else None
    if shape is not None:
        check_tree_model(target, "the target")
        check_tree_model(draft, "the draft")
    on = device_of(target)
    linear = accelerator.linear_mode(on, (target, draft, feature))
    for model in (target, draft):  # the weight copies a previous decoder left, kept while current
        if model is not None:
            accelerator.prepare(model)
    drafting = draft if draft is not None else feature
    prior = max(_num_params(drafting) / max(_num_params(target), 1), 0.02) if drafting is not None else 0.0
    parts = DecoderParts(target=target, draft=draft, feature=feature, target_runner=t_runner, draft_runner=d_runner,
                         drafter=the_drafter, drafter_name=pair.drafter, tokenizer=pair.tokenizer,
                         draft_tokenizer=pair.draft_tokenizer, vocabulary=pair.vocabulary, lookup=pair.lookup,
                         device=on, accelerator=accelerator, cpu_linear=linear, draft_vocab=vocab_rows,
                         draft_prior=prior, verification=verification, verify_backend=verify_backend, tree=shape)
    parts.refresh()
    return parts
