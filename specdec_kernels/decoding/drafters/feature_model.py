"""A draft that reads the target's hidden states (the idea of EAGLE, Li et al. 2024).

A standalone draft model sees only tokens.  This one also sees, at every position, the target's
final hidden state ``f`` (the output of its final norm: what its output layer reads), so it
extrapolates the target's own features instead of re-deriving them from text:

    f^_{t+1} = norm(layer(fc(concat(embed(x_{t+1}), f_t))))    logits_{t+1} = lm_head(f^_{t+1})

``embed`` and ``lm_head`` are the target's own (not stored here; the output layer restricted to a
draft vocabulary, ``specdec_kernels.decoding.drafters.vocab``); ``layer`` is a Llama decoder layer with its
own KV cache; ``fc`` mixes the token with the feature.  Pair t (the token x_{t+1} with the
target's feature at position t) sits at position t + 1.  In a decoding step the draft first
takes the pairs the last verify made true (the accepted drafts and the target's own token, with
the target's features from that verify), then runs its chain on its own predicted features.
Its proposals are verified like any draft's, so the output is the target's distribution
whatever the draft predicts; the draft only changes how many tokens each target call gives.

A feature draft belongs to the target it was trained on: it stores that target's final-norm
weight and refuses another target (``check_target``).  The embedded one
(``specdec_kernels/assets/feature_draft``) was trained by ``training/train_feature_draft.py`` for
SmolLM2-135M-Instruct.

Files: ``feature_draft.json`` (the layer's Llama configuration, the target's identity),
``model.safetensors`` (fc, the layer, the norm) and ``draft_vocab.json`` (its tokens; the embedded
one has it in the earlier form, ``draft_vocab.safetensors``, which is read the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["FeatureDraft", "load_feature_draft", "save_feature_draft", "default_feature_draft_path",
           "embedded_feature_draft_dir"]

_CONFIG = "feature_draft.json"
_WEIGHTS = "model.safetensors"
_VOCAB = "draft_vocab.json"
_LEGACY_VOCAB = "draft_vocab.safetensors"  # read where an earlier save wrote it


def default_feature_draft_path() -> str:
    return str(Path(__file__).resolve().parents[2] / "assets" / "feature_draft")  # specdec_kernels/assets


def embedded_feature_draft_dir() -> str:
    """The embedded feature draft's directory; ``FileNotFoundError`` naming it when an install
    lacks the package's assets (checked before any model is loaded)."""
    d = default_feature_draft_path()
    if not Path(d).is_dir():
        raise FileNotFoundError(f"the embedded feature draft is missing ({d}); reinstall specdec-kernels or "
                                "pass draft=DIR, one trained by training/train_feature_draft.py")
    return d


def _target_parts(target):
    """(decoder, final norm weight, hidden size, vocab size) of a Hugging Face causal LM."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    norm = getattr(decoder, "norm", None)
    if decoder is None or norm is None or getattr(norm, "weight", None) is None:
        raise ValueError(f"a feature draft needs a target with a decoder and a final norm (model.model.norm), "
                         f"got {type(target).__name__}")
    cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return decoder, norm.weight, int(cfg.hidden_size), int(cfg.vocab_size)


class FeatureDraft(nn.Module):
    """fc + Llama decoder layer(s) + final norm over (token embedding, target feature) pairs.

    ``config``: the ``LlamaConfig`` of the layers (``hidden_size`` = the target's); ``target``:
    ``target_identity(the target it was trained for)``.
    ``forward(embeds, feats, positions, cache=None, attention_mask=None)`` -> f^ [B, q, H]: the
    model path; ``SpeculativeDecoder`` runs the same through ``LeanLlamaStep`` on the CPU.
    """

    def __init__(self, config, target: dict):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        if not isinstance(config, LlamaConfig):
            raise TypeError(f"FeatureDraft: config must be a LlamaConfig, got {type(config).__name__}")
        keys = ("hidden_size", "vocab_size", "norm_weight", "embedding_sample")
        if not isinstance(target, dict) or any(k not in target for k in keys):
            raise ValueError(f"FeatureDraft: target must be target_identity(the target), a dict with {keys}, got "
                             f"{sorted(target) if isinstance(target, dict) else type(target).__name__}")
        if int(config.hidden_size) != int(target["hidden_size"]):
            raise ValueError(f"FeatureDraft: config.hidden_size must be the target's {target['hidden_size']}, "
                             f"got {config.hidden_size}")
        if getattr(config, "_attn_implementation", None) is None:
            config._attn_implementation = "sdpa"
        self.config = config
        self.target = dict(target)
        H = int(config.hidden_size)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.lm = LlamaForCausalLM(config)  # its own embedding and output layer are unused (vocab_size 1)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def inputs(self, embeds: Tensor, feats: Tensor) -> Tensor:
        """fc(concat(embeds, feats)): both [B, q, H]."""
        H = self.hidden_size
        if embeds.shape != feats.shape or embeds.shape[-1] != H:
            raise ValueError(f"FeatureDraft: embeds and feats must both be [B, q, H={H}], got "
                             f"{tuple(embeds.shape)} and {tuple(feats.shape)}")
        return self.fc(torch.cat([embeds, feats.to(embeds.dtype)], dim=-1))

    def forward(self, embeds: Tensor, feats: Tensor, positions: Tensor, cache=None,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        from ..runners import cache_keyword

        kw = {cache_keyword(self.lm.model): cache}
        out = self.lm.model(inputs_embeds=self.inputs(embeds, feats), position_ids=positions,
                            attention_mask=attention_mask, use_cache=cache is not None, **kw)
        return out.last_hidden_state

    def check_target(self, target) -> None:
        """Refuse a target other than the one this draft was trained for (its hidden size, its
        vocabulary size, its final-norm weight and a sample of its embedding, compared with a
        tolerance that any dtype passes)."""
        _, norm_w, H, V = _target_parts(target)
        want = self.target
        if H != want["hidden_size"] or H != self.hidden_size:
            raise ValueError(f"feature draft: the target's hidden_size must be {want['hidden_size']} (the draft "
                             f"was trained on such a target), got {H}")
        if V != want["vocab_size"]:
            raise ValueError(f"feature draft: the target's vocab_size must be {want['vocab_size']}, got {V}")
        for what, ref, got in (("final-norm weight", want["norm_weight"], norm_w.detach().float().cpu()),
                               ("embedding", want["embedding_sample"], _embedding_sample(target))):
            ref = torch.tensor(ref, dtype=torch.float32)
            if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-2, atol=1e-3):
                err = float((got - ref).abs().max()) if got.shape == ref.shape else float("nan")
                raise ValueError(f"feature draft: the target is not the one it was trained for (its {what} "
                                 f"differs by up to {err:.3g})")


def _embedding_sample(target) -> Tensor:
    """16 values of 4 rows of the target's input embedding (float32, CPU)."""
    w = target.get_input_embeddings().weight.detach()
    V = w.shape[0]
    rows = sorted({0, V // 3, (2 * V) // 3, V - 1})
    return w[rows, :16].float().cpu()


def target_identity(target) -> dict:
    """What identifies the target a feature draft is trained for: its sizes, its final-norm
    weight and a sample of its embedding."""
    _, norm_w, H, V = _target_parts(target)
    return {"hidden_size": H, "vocab_size": V, "norm_weight": [float(v) for v in norm_w.detach().float().cpu()],
            "embedding_sample": _embedding_sample(target).tolist()}


def save_feature_draft(draft: FeatureDraft, directory, vocab: Optional[Tensor] = None,
                       dtype: torch.dtype = torch.float16) -> Path:
    """Write ``draft`` (weights in ``dtype``) and its draft vocabulary (or None) to ``directory``."""
    from safetensors.torch import save_file

    from .vocab import save_draft_vocab

    if not isinstance(draft, FeatureDraft):
        raise TypeError(f"save_feature_draft: draft must be a FeatureDraft, got {type(draft).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"save_feature_draft: dtype must be a floating torch.dtype, got {dtype!r}")
    if vocab is not None:  # refused before anything is written
        from .vocab import check_draft_vocab

        vocab = check_draft_vocab(vocab, draft.target["vocab_size"])
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"layers": draft.config.to_dict(), "target": draft.target, "format": 1}
    sd = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items()
          if not k.startswith(("lm.lm_head.", "lm.model.embed_tokens."))}
    save_file(sd, str(out / _WEIGHTS))
    (out / _CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    if vocab is not None:
        save_draft_vocab(out, vocab, draft.target["vocab_size"])
    else:
        for name in (_VOCAB, _LEGACY_VOCAB):
            if (out / name).exists():
                (out / name).unlink()
    return out


def load_feature_draft(directory, dtype: torch.dtype = torch.float32, device=None):
    """(FeatureDraft in eval mode, draft vocabulary [N] int64 or None) from ``directory``."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from .vocab import directory_vocab_file, load_draft_vocab

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"load_feature_draft: dtype must be a floating torch.dtype, got {dtype!r}")
    d = Path(directory)
    if not (d / _CONFIG).is_file() or not (d / _WEIGHTS).is_file():
        raise FileNotFoundError(f"feature draft: {d} must hold {_CONFIG} and {_WEIGHTS}")
    cfg = json.loads((d / _CONFIG).read_text())
    if cfg.get("format") != 1:
        raise ValueError(f"feature draft: {d / _CONFIG} has format {cfg.get('format')!r}, expected 1")
    config = LlamaConfig(**cfg["layers"])
    config._attn_implementation = "sdpa"
    draft = FeatureDraft(config, cfg["target"])
    sd = load_file(str(d / _WEIGHTS))
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith(("lm.lm_head.", "lm.model.embed_tokens."))]
    if missing or unexpected:
        raise ValueError(f"feature draft: {d / _WEIGHTS} does not match its configuration "
                         f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    draft = draft.to(dtype=dtype, device=device).eval().requires_grad_(False)
    vocab = None
    vocab_file = directory_vocab_file(d)
    if vocab_file is not None:
        vocab = load_draft_vocab(vocab_file, cfg["target"]["vocab_size"])
    return draft, vocab
