"""A lean decode-step forward for Hugging Face Llama models on the CPU.

A decode step of the speculative loop feeds 1 (draft) or K+1 (verify) tokens.  At that size a
small model's time goes largely to the Python around the arithmetic: Hugging Face's per-call
and per-layer machinery (keyword plumbing and deprecation wrappers, the output dataclasses, mask
construction).  On the embedded pair this step is 5-22% faster than the model's forward
(bench/cpu/bench_lean_forward.py; the figures in docs/benchmarks.md, "Lean Llama decode step").

``LeanLlamaStep`` runs the same modules in the same order with the same tensor operations as
``LlamaForCausalLM.forward`` with the ``sdpa`` attention (the model's own linear layers,
embedding, rotary module and Hugging Face's ``sdpa_attention_forward``; the RMSNorm and MLP
lines as Hugging Face writes them), so its logits and cache entries are the same bits; the
tests compare them with the model's own forward, bit for bit.  One exception, same bits: over
2 or more new tokens (a verify) it calls torch's sdpa with ``enable_gqa`` instead of letting
``sdpa_attention_forward`` copy K and V to every query head (which it does when given a mask):
the target's verify of K = 2 then costs 1.05x its one-token step instead of 1.07x.  It is used only where that was
checked: the model's exact classes (no subclass that may override a forward), ``sdpa``
attention, inference mode, CPU, no module hooks; anything else keeps the model's forward
(``LeanLlamaStep.unsupported`` says why).  Prefill keeps the model's forward too: its left
padding gives query rows with nothing to attend to, which Hugging Face's masks treat specially.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LeanLlamaStep"]


def _llama_classes():
    from transformers.models.llama import modeling_llama as ml

    return ml


class LeanLlamaStep:
    """The decode-step forward of a ``LlamaForCausalLM`` without Hugging Face's per-call overhead.

    ``LeanLlamaStep.unsupported(model)`` is None when the model qualifies, else the reason.
    ``step(cache, ids, mask, positions, keep, head=None)`` appends ``ids`` [B, q] to ``cache`` (a
    ``DynamicCache``) and returns the logits of the last ``keep`` positions [B, keep, V]; ``mask``
    is [B, T + q] bool (valid cache columns, then the new ones) or None when no column is padding.
    Every query position must see at least one valid column (true of decode steps).  ``head``:
    the output layer to apply instead of ``model.lm_head`` (a draft vocabulary's rows of it,
    ``specdec_kernels.decoding.drafters.vocab``), giving [B, keep, N].  ``embeds`` [B, q, H]: the input
    vectors, given instead of ``ids`` (what ``inputs_embeds`` is to the model's forward);
    ``return_hidden``: return (logits, the final norm's output at those positions [B, keep, H]),
    the hidden states the model's ``lm_head`` reads.
    """

    def __init__(self, model):
        why = self.unsupported(model)
        if why is not None:
            raise ValueError(f"LeanLlamaStep: model not supported: {why}")
        self.model = model
        self.base = model.model
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self._attention = sdpa_attention_forward
        self._rotate_half = _llama_classes().rotate_half

    @staticmethod
    def unsupported(model) -> Optional[str]:
        try:
            ml = _llama_classes()
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
        except ImportError as e:  # pragma: no cover - a transformers without Llama or sdpa
            return f"transformers lacks the Llama modules ({e})"
        if type(model) is not ml.LlamaForCausalLM or type(getattr(model, "model", None)) is not ml.LlamaModel:
            return f"not exactly transformers' LlamaForCausalLM (got {type(model).__name__})"
        cfg = model.config
        if getattr(cfg, "_attn_implementation", None) != "sdpa":
            return f"attention implementation {getattr(cfg, '_attn_implementation', None)!r}, not 'sdpa'"
        if (getattr(cfg, "pretraining_tp", 1) or 1) != 1:
            return f"pretraining_tp = {cfg.pretraining_tp}"
        containers = (torch.nn.ModuleList, torch.nn.ModuleDict)  # no forward: their flag changes nothing
        if any(mod.training for mod in model.modules() if not isinstance(mod, containers)):
            return "model (or one of its modules) in training mode"
        if getattr(model, "_compiled_call_impl", None) is not None:
            return "model compiled (model.compile()): its forward is the compiled one"
        base = model.model
        if len(base.layers) != cfg.num_hidden_layers:
            return f"{len(base.layers)} layers, config.num_hidden_layers = {cfg.num_hidden_layers}"
        # the modules whose forward this class replays (their forward must be the class's own);
        # the linear layers, embedding and rotary module are called as modules
        replayed = [(model, ml.LlamaForCausalLM), (base, ml.LlamaModel), (base.norm, ml.LlamaRMSNorm)]
        for layer in base.layers:
            replayed += [(layer, ml.LlamaDecoderLayer), (layer.self_attn, ml.LlamaAttention),
                         (layer.mlp, ml.LlamaMLP), (layer.input_layernorm, ml.LlamaRMSNorm),
                         (layer.post_attention_layernorm, ml.LlamaRMSNorm)]
        for mod, cls in replayed + [(base.embed_tokens, torch.nn.Embedding),
                                    (base.rotary_emb, ml.LlamaRotaryEmbedding)]:
            if type(mod) is not cls:
                return f"a {cls.__name__} is a {type(mod).__name__}"
        for mod, cls in replayed:
            if "forward" in mod.__dict__:
                return f"the forward of a {cls.__name__} was replaced"
        import inspect

        for cls in {cls for _, cls in replayed}:
            # a forward patched on the class (as kernel libraries do) is not the one replayed here
            fwd = inspect.unwrap(cls.forward)
            if fwd.__module__ != cls.__module__ or fwd.__qualname__ != f"{cls.__name__}.forward":
                return f"{cls.__name__}.forward was replaced (by {fwd.__module__}.{fwd.__qualname__})"
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            registered = ALL_ATTENTION_FUNCTIONS["sdpa"]
        except (ImportError, KeyError):  # pragma: no cover - a transformers without the registry
            registered = sdpa_attention_forward
        if inspect.unwrap(registered) is not inspect.unwrap(sdpa_attention_forward):
            return "the 'sdpa' attention function was re-registered (ALL_ATTENTION_FUNCTIONS)"
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return "global module forward hooks are registered (torch.nn.modules.module.register_module_forward_hook)"
        for mod in model.modules():
            if mod._forward_hooks or mod._forward_pre_hooks or hasattr(mod, "_hf_hook"):
                return f"module {type(mod).__name__} has hooks"
            if getattr(mod, "_compiled_call_impl", None) is not None:
                return f"module {type(mod).__name__} compiled (.compile()): its forward is the compiled one"
        devices = {p.device.type for p in model.parameters()}
        if devices != {"cpu"}:
            return f"parameters on {sorted(devices)}, not the CPU only"
        return None

    @staticmethod
    def _rms_norm(norm, x: Tensor) -> Tensor:
        # LlamaRMSNorm.forward, line for line
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * h.to(input_dtype)

    def step(self, cache, ids: Optional[Tensor], mask: Optional[Tensor], positions: Tensor, keep: int,
             head: Optional[torch.nn.Module] = None, embeds: Optional[Tensor] = None,
             return_hidden: bool = False):
        if embeds is not None:
            if ids is not None or not isinstance(embeds, Tensor) or embeds.dim() != 3 or embeds.shape[1] < 1:
                raise ValueError(f"LeanLlamaStep.step: embeds must be a [B, q >= 1, H] tensor given instead of ids, "
                                 "got embeds "
                                 f"{tuple(embeds.shape) if isinstance(embeds, Tensor) else type(embeds).__name__}"
                                 f" and ids {None if ids is None else tuple(ids.shape)}")
            ids = embeds[..., 0]  # [B, q]: the shape checks below
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
            raise ValueError(f"LeanLlamaStep.step: ids must be a [B, q >= 1] tensor, got "
                             f"{tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}")
        B, q = ids.shape
        if not isinstance(positions, Tensor) or positions.shape != ids.shape:
            raise ValueError(f"LeanLlamaStep.step: positions must have the shape of ids {(B, q)}, got "
                             f"{tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__}")
        T = cache.get_seq_length()
        if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != B
                                 or mask.shape[1] != T + q):
            raise ValueError(f"LeanLlamaStep.step: mask must be None or a bool [B={B}, T + q = {T + q}] tensor "
                             f"(T = {T} cached columns), got {mask.dtype} {tuple(mask.shape)}")
        if mask is not None and q == 1 and bool(mask.all()):
            mask = None  # what Hugging Face does with an all-valid mask (the same attention call, the same bits)
        if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= q:
            raise ValueError(f"LeanLlamaStep.step: keep must be an int in [1, {q}], got {keep!r}")
        base = self.base
        x = base.embed_tokens(ids) if embeds is None else embeds
        cos, sin = base.rotary_emb(x, position_ids=positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rot = self._rotate_half
        if mask is None and q == 1:
            attn_mask = None  # one query, every column valid: what Hugging Face passes too
        else:
            cols = T + q  # the cached columns and the new ones
            causal = torch.ones((q, q), dtype=torch.bool, device=ids.device).tril_()
            if mask is None:
                attn_mask = torch.ones((1, 1, q, cols), dtype=torch.bool, device=ids.device)
            else:
                attn_mask = mask[:, None, None, :].expand(B, 1, q, cols).clone()
            attn_mask[..., T:] &= causal
        for layer in base.layers:
            a = layer.self_attn
            residual = x
            h = self._rms_norm(layer.input_layernorm, x)
            shape = (B, q, -1, a.head_dim)
            qs = a.q_proj(h).view(shape).transpose(1, 2)
            ks = a.k_proj(h).view(shape).transpose(1, 2)
            vs = a.v_proj(h).view(shape).transpose(1, 2)
            qs = (qs * cos) + (rot(qs) * sin)
            ks = (ks * cos) + (rot(ks) * sin)
            ks, vs = cache.update(ks, vs, a.layer_idx)
            if q > 1:
                # Hugging Face's sdpa_attention_forward repeats K and V to every query head here
                # (repeat_kv: a copy of both, per layer) because a mask is given; torch's sdpa
                # reads the grouped heads in place with enable_gqa and gives the same bits (the
                # tests compare with the model's forward), about 15 us a layer faster on the CPU.
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=attn_mask, dropout_p=0.0,
                                                   scale=a.scaling, enable_gqa=ks.shape[1] != qs.shape[1])
                o = o.transpose(1, 2).contiguous()  # [B, q, H, D], as sdpa_attention_forward returns
            else:
                o, _ = self._attention(a, qs, ks, vs, attn_mask, dropout=0.0, scaling=a.scaling)
            x = residual + a.o_proj(o.reshape(B, q, -1).contiguous())
            residual = x
            h = self._rms_norm(layer.post_attention_layernorm, x)
            m = layer.mlp
            x = residual + m.down_proj(m.act_fn(m.gate_proj(h)) * m.up_proj(h))
        x = self._rms_norm(base.norm, x[:, -keep:])
        logits = (self.model.lm_head if head is None else head)(x)
        return (logits, x) if return_hidden else logits
