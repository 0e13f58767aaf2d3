"""How ``SpeculativeDecoder`` runs each of its networks, resolved once per model.

``ModelRunner``: a Hugging Face causal LM (the target, or a draft model) with its forward's calling
convention (the cache keyword, ``cache_position``, ``logits_to_keep``), its lean decode step
(``LeanLlamaStep``) where the model qualifies, and its draft vocabulary (the output layer's
rows for those tokens).  ``FeatureRunner``: a feature draft (``specdec_kernels.decoding.drafters.feature_model``)
with the target's embedding and the draft vocabulary's rows of the target's output layer.
Both return the same bits on the lean path as through the model's own forward (tested in
test_lean_forward.py and test_feature_draft.py).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..ops.host import tensor_version


def cache_keyword(module) -> str:
    """The cache keyword of a module's forward: transformers 5 renamed past_key_values to cache
    (the old name is deprecated)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def output_rows(out: torch.nn.Module, rows: Optional[torch.Tensor], fp16_values: bool = False) -> torch.nn.Linear:
    """A copy of the output layer ``out`` restricted to the token ids ``rows`` (all of them when
    None), as ordinary tensors (``use_skinny_linear`` versions them), without grad.
    ``fp16_values``: fp32 weights rounded to fp16 values (``skinny_linear`` then streams half the
    bytes on the CPU)."""
    n = out.weight.shape[0] if rows is None else rows.numel()
    with torch.inference_mode(False), torch.no_grad():
        head = torch.nn.Linear(out.in_features, n, bias=out.bias is not None,
                               device=out.weight.device, dtype=out.weight.dtype)
        head.weight.copy_(out.weight if rows is None else out.weight.index_select(0, rows))
        if fp16_values and head.weight.dtype == torch.float32:
            head.weight.copy_(head.weight.half().float())
        if out.bias is not None:
            head.bias.copy_(out.bias if rows is None else out.bias.index_select(0, rows))
    return head.requires_grad_(False)


# model types known to lack a KV cache argument or position_ids (for wrappers, whose forward's
# signature says nothing; transformers' own classes are judged by their signature)
_NO_CACHE_TYPES = frozenset({"rwkv", "xlnet"})
_NO_POSITION_TYPES = frozenset({"mpt", "rwkv", "xlnet"})


def check_supported(model, name: str) -> None:
    """Refuse, by name, a model whose forward the decoder cannot drive exactly: an encoder-decoder,
    a forward without a KV cache argument (RWKV, XLNet), one without ``position_ids`` (MPT: its
    ALiBi counts cache columns, which a ragged batch leaves gaps in; BLOOM's counts the attention
    mask's valid columns, which is exact), GPT-Neo's local attention (a window over cache columns)."""
    from transformers import PreTrainedModel

    cfg = model.config
    kind = type(model).__name__
    model_type = getattr(cfg, "model_type", None)
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"the {name} must be a decoder-only causal LM, got an encoder-decoder {kind}")
    # A transformers model says what it takes in its forward's signature; a wrapper around one
    # (PEFT's, a module forwarding **kwargs) is judged by its config's model type.
    if isinstance(model, PreTrainedModel):
        params = inspect.signature(model.forward).parameters
        no_cache = "past_key_values" not in params and "cache" not in params
        no_positions = "position_ids" not in params and model_type != "bloom"
    else:
        no_cache = model_type in _NO_CACHE_TYPES
        no_positions = model_type in _NO_POSITION_TYPES
    if no_cache:
        raise ValueError(f"the {name} must take a KV cache (past_key_values) that the decoder can roll back, "
                         f"got {kind}, whose forward takes none")
    if no_positions:
        raise ValueError(f"the {name} must take position_ids (a ragged batch leaves gaps in its cache that "
                         f"positions derived from cache columns would count), got {kind}, whose forward takes none")
    layers = getattr(cfg, "attention_layers", None)
    if isinstance(layers, (list, tuple)) and "local" in layers:
        raise ValueError(f"the {name} must use full attention only, got {kind} with local attention layers (a "
                         f"window of {getattr(cfg, 'window_size', '?')} cache columns)")


def model_context(cfg) -> tuple:
    """(the longest sequence a model may decode exactly, or None; what sets it).  A longrope
    model (Phi-3-128k, Phi-3.5) switches its rotary factors once a call's largest position
    passes original_max_position_embeddings, for the whole call: in a batch a short row would
    take a long row's factors, so it is capped there."""
    ctx = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(ctx, int) or ctx <= 0:  # XLNet-style -1: no limit said
        ctx = None
    source = "max_position_embeddings"
    for rope in _rope_dicts(cfg):
        if rope.get("rope_type", rope.get("type")) == "longrope":
            orig = (rope.get("original_max_position_embeddings")
                    or getattr(cfg, "original_max_position_embeddings", None))
            if isinstance(orig, int) and orig > 0 and (ctx is None or orig < ctx):
                ctx, source = orig, "original_max_position_embeddings of its longrope scaling"
    return ctx, source


def _rope_dicts(cfg) -> list:
    out = []
    for name in ("rope_parameters", "rope_scaling"):
        r = getattr(cfg, name, None)
        if isinstance(r, dict):
            out += [r] + [v for v in r.values() if isinstance(v, dict)]  # per layer type (Gemma 3)
    return out


class ModelRunner:
    """One model with its forward's calling convention, resolved once."""

    def __init__(self, model, name: str):
        check_supported(model, name)
        self.model = model
        self.name = name
        params = inspect.signature(model.forward).parameters
        self.cache_kw = cache_keyword(model)
        self.has_cache_position = "cache_position" in params
        self.has_logits_to_keep = "logits_to_keep" in params
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context, self.context_source = model_context(cfg)
        self.lean = None  # a LeanLlamaStep for the decode steps, set by use_lean()
        self.lean_unsupported: Optional[str] = "not requested"
        self.vocab_rows: Optional[torch.Tensor] = None  # a draft vocabulary [N] on the device, or None
        self.head: Optional[torch.nn.Linear] = None  # the output layer's vocab_rows rows (lean path)

    def use_lean(self, accelerator) -> None:
        """Run decode steps through the lean step ``accelerator`` gives where the model
        qualifies (else keep its reason: ``SpeculativeDecoder.lean_status``)."""
        self.lean, self.lean_unsupported = accelerator.lean_step(self.model, self.lean)

    def set_vocab(self, rows: Optional[torch.Tensor]) -> None:
        """Make ``step`` return logits over the token ids ``rows`` [N] only (sorted, on the
        model's device), or over the whole vocabulary (None).  On the lean path the output layer
        is applied to those rows only (a copy of them, taken now: call again after the weights
        change); otherwise the model's logits are gathered."""
        self.vocab_rows, self.head = rows, None
        if rows is None or self.lean is None:
            return
        self.head = output_rows(self.model.lm_head, rows)

    def step(self, cache, ids: torch.Tensor, mask: Optional[torch.Tensor], positions: torch.Tensor,
             start: int, keep: int) -> torch.Tensor:
        """``forward`` for a decode step (every new position sees a valid cache column): the lean
        path when it is on, the same bits (see lean_forward).  With a vocabulary (``set_vocab``)
        the logits are those of its tokens only: [B, keep, N]."""
        if self.lean is not None:
            return self.lean.step(cache, ids, mask, positions, keep, head=self.head)
        logits = self.forward(cache, ids, mask, positions, start, keep)
        return logits if self.vocab_rows is None else logits.index_select(-1, self.vocab_rows)

    def step_hidden(self, cache, ids: torch.Tensor, mask: Optional[torch.Tensor], positions: torch.Tensor,
                    start: int, keep: int) -> tuple:
        """``step`` that also returns the final norm's output at those positions [B, keep, H]
        (what a feature draft reads); the logits are the same bits as ``step``'s.  Off the lean
        path the logits come from the model's own forward (a model may scale or cap what its
        output layer gives: Granite, Cohere, Gemma 2) and the features from a hook on its final
        norm for that one call."""
        if self.lean is not None:
            return self.lean.step(cache, ids, mask, positions, keep, head=self.head, return_hidden=True)
        seen = []
        handle = self.model.get_decoder().norm.register_forward_hook(lambda mod, args, out: seen.append(out))
        try:
            logits = self.forward(cache, ids, mask, positions, start, keep)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise RuntimeError(f"the target's final norm ran {len(seen)} times in one forward; a feature draft "
                               f"needs its output once (model.model.norm)")
        h = seen[0][:, -keep:]
        return (logits if self.vocab_rows is None else logits.index_select(-1, self.vocab_rows)), h

    def forward_hidden(self, cache, ids: torch.Tensor, mask: Optional[torch.Tensor], positions: torch.Tensor,
                       start: int) -> torch.Tensor:
        """``forward`` through the model's decoder only: its last hidden states [B, q, H] (the
        final norm's output; ``LlamaForCausalLM`` applies ``lm_head`` to exactly these)."""
        q = ids.shape[1]
        kwargs = {self.cache_kw: cache, "use_cache": True, "position_ids": positions}
        if mask is not None:
            kwargs["attention_mask"] = mask.to(torch.long)
        if self.has_cache_position:
            kwargs["cache_position"] = torch.arange(start, start + q, device=ids.device)
        decoder = self.model.get_decoder()
        kwargs[cache_keyword(decoder)] = kwargs.pop(self.cache_kw)
        return decoder(input_ids=ids, **kwargs).last_hidden_state

    def forward(self, cache, ids: torch.Tensor, mask: Optional[torch.Tensor], positions: torch.Tensor,
                start: int, keep: int) -> torch.Tensor:
        """Append ids [B, q] at cache column ``start``; mask [B, start + q] bool (valid columns),
        or None when every column is valid (the model then builds only its causal mask: the same
        logits, bit for bit, without the padding-mask work, 0.5-0.7 ms of a 25 ms step of the
        embedded target on CPU); positions [B, q].  Returns the logits of the last ``keep``
        columns [B, keep, V]."""
        q = ids.shape[1]
        kwargs = {self.cache_kw: cache, "use_cache": True, "position_ids": positions}
        if mask is not None:
            kwargs["attention_mask"] = mask.to(torch.long)
        if self.has_cache_position:  # models that index the cache by it (column, not position)
            kwargs["cache_position"] = torch.arange(start, start + q, device=ids.device)
        if self.has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(input_ids=ids, **kwargs)
        return out.logits[:, -keep:]


class FeatureRunner:
    """A feature draft (``specdec_kernels.decoding.drafters.feature_model``) with the target's embedding and the
    draft vocabulary's rows of the target's output layer."""

    def __init__(self, fd, target):
        self.fd = fd
        self.model = fd.lm  # what LeanLlamaStep and the cache run
        self.name = "draft"
        self.target = target
        self.embed = target.get_input_embeddings()
        self.out = target.get_output_embeddings()
        self.vocab_size = int(self.embed.num_embeddings)
        self.context, self.context_source = model_context(fd.config)
        self.lean = None
        self.lean_unsupported: Optional[str] = "not requested"
        self.vocab_rows: Optional[torch.Tensor] = None
        self.head: Optional[torch.nn.Linear] = None

    use_lean = ModelRunner.use_lean  # its layers are a LlamaForCausalLM's (fd.lm)

    def set_vocab(self, rows: Optional[torch.Tensor]) -> None:
        """The draft's output layer: the target's, restricted to ``rows`` (a copy taken now),
        fp32 weights rounded to fp16 values (a draft may compute anything, the verifier uses the
        target's own logits; ``skinny_linear`` then streams half the bytes on the CPU)."""
        self.vocab_rows = rows
        # The target's layers as they are now (a module replaced since is taken).
        self.embed = self.target.get_input_embeddings()
        out = self.out = self.target.get_output_embeddings()
        # The copy (40-50 ms for 12,288 x 576 on the CPU) is kept on the output layer while the
        # rows and its weights are unchanged (the same tensors, storage and version counter: an
        # in-place update bumps it; weights made under inference mode have no counter, so their
        # copy is taken every call; cpu.skinny_linear.forget_weight_copies drops it).
        params = [out.weight] + ([] if out.bias is None else [out.bias])
        versions = [tensor_version(t) for t in params]
        key = None
        if None not in versions:
            key = (None if rows is None else rows.tolist(), [id(t) for t in params], [t.data_ptr() for t in params],
                   versions)
        cached = out.__dict__.get("_specdec_head")
        if key is not None and cached is not None and cached[0] == key:
            self.head = cached[1]
            return
        self.head = output_rows(out, rows, fp16_values=True)
        if key is not None:
            out.__dict__["_specdec_head"] = (key, self.head)

    def step(self, cache, tokens: torch.Tensor, feats: torch.Tensor, mask: Optional[torch.Tensor],
             positions: torch.Tensor, keep: int, model_path: bool = False) -> torch.Tensor:
        """Append the pairs (tokens [B, q], feats [B, q, H]) to ``cache``; the predicted
        features f^ of the last ``keep`` positions [B, keep, H].  ``model_path``: through the
        model's forward even where the lean step would do (the prefill)."""
        if self.lean is not None and not model_path:
            x = self.fd.inputs(self.embed(tokens), feats)
            return self.lean.step(cache, None, mask, positions, keep, embeds=x, return_hidden=True)[1]
        return self.fd(self.embed(tokens), feats, positions, cache,
                       None if mask is None else mask.to(torch.long))[:, -keep:]
