"""``CpuAccelerator``: the CPU accelerators as ``SpeculativeDecoder`` is handed them.

The decoder builds one from its ``cpu_linear`` and ``lean_forward`` arguments (or takes one as
``accelerator=``) and calls nothing else of this folder: the loop asks it for a model's lean
decode step, for the context in which the linear layers run as chosen, and to check the weight
copies a previous decoder left on the models.  Neither accelerator changes which tokens come
out: ``LeanLlamaStep`` gives the model's own bits, ``skinny_linear`` a row's result independent
of the other rows (``docs/numerics.md``).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

__all__ = ["CpuAccelerator", "LINEAR_MODES"]

LINEAR_MODES = ("auto", "skinny", "torch")


class CpuAccelerator:
    """linear: ``"skinny"`` routes the fp32 ``nn.Linear`` inputs of at most
    ``skinny_linear.default_max_rows()`` rows through ``torch.ops.specdec.skinny_linear``;
    ``"torch"`` leaves torch's ``linear``; ``"auto"`` is ``"skinny"`` when the models are fp32 on
    the CPU and the C++ extension is built.  lean_forward: run a qualifying Llama's decode steps
    through ``LeanLlamaStep``.  weight_cache: where ``"skinny"`` keeps its fp16 weight copies
    between processes (``weight_cache.resolve``: a directory, True, False, or None for
    ``$SPECDEC_WEIGHT_CACHE``); ``self.weight_cache`` is the directory chosen, or None."""

    def __init__(self, linear: str = "auto", lean_forward: bool = True, weight_cache=None):
        if linear not in LINEAR_MODES:
            raise ValueError(f"cpu_linear must be 'auto', 'skinny' or 'torch', got {linear!r}")
        if not isinstance(lean_forward, bool):
            raise TypeError(f"lean_forward must be a bool, got {type(lean_forward).__name__}")
        from .weight_cache import resolve

        self.linear = linear
        self.lean_forward = lean_forward
        self.weight_cache = resolve(weight_cache)

    def check_device(self, device: torch.device) -> None:
        """Refuse ``"skinny"`` where it cannot run (before the models are moved)."""
        from ..ops.extension import HAS_EXT

        if self.linear == "skinny" and not (HAS_EXT and device.type == "cpu"):
            raise ValueError("cpu_linear='skinny' needs the models on the CPU and the C++ extension "
                             f"(device {device}, extension built: {HAS_EXT})")

    def linear_mode(self, device: torch.device, models: Sequence[Optional[torch.nn.Module]]) -> str:
        """``"skinny"`` or ``"torch"``: what ``"auto"`` means for these models where they are."""
        from ..ops.extension import HAS_EXT

        if self.linear != "auto":
            return self.linear
        fp32_cpu = device.type == "cpu" and all(p.dtype == torch.float32 for m in models if m is not None
                                                for p in m.parameters())
        return "skinny" if HAS_EXT and fp32_cpu else "torch"

    @staticmethod
    def prepare(model: torch.nn.Module) -> None:
        """Keep the fp16 weight copies a previous decoder left on ``model``'s layers while they
        equal their weights (made once per model; a write through ``.data`` since, which no
        version counter sees, drops them)."""
        from .skinny_linear import revalidate_weight_copies

        revalidate_weight_copies(model)

    def lean_step(self, model: torch.nn.Module, current=None) -> tuple:
        """(a ``LeanLlamaStep`` for ``model``'s decode steps, or None; why not, or None):
        ``current`` is kept when the model still qualifies."""
        if not self.lean_forward:
            return None, "lean_forward=False"
        from .lean_forward import LeanLlamaStep

        why = LeanLlamaStep.unsupported(model)
        if why is not None:
            return None, why
        return (current if current is not None else LeanLlamaStep(model)), None

    def linear_layers(self, mode: str, models: Sequence[Optional[torch.nn.Module]],
                      int8_models: Sequence[Optional[torch.nn.Module]] = ()) -> contextlib.ExitStack:
        """A context in which ``models``' linear layers run as ``mode`` says (``int8_models``:
        streamed as int8 with row scales, for layers that only propose)."""
        stack = contextlib.ExitStack()
        if mode == "skinny":
            from .skinny_linear import use_skinny_linear

            for m in models:
                if m is not None:
                    stack.enter_context(use_skinny_linear(m, weight_cache=getattr(self, "weight_cache", None)))
            for m in int8_models:
                if m is not None:
                    stack.enter_context(use_skinny_linear(m, int8_weights=True))
        return stack
