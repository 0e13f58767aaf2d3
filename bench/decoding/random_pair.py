"""Random-weight models of the default pair's shapes, for timing the decoding loop on a machine
that the 98 MB target GGUF cannot travel to (the GPU check). Timings are honest (same shapes,
same kernels); acceptance is not (random weights): acceptance figures come from CPU runs of the
real pair.

    python bench/decoding/random_pair.py OUT_DIR     # writes OUT_DIR/target, OUT_DIR/draft, OUT_DIR/feature_draft

The target has SmolLM2-135M-Instruct's architecture (30 layers, hidden 576, 9 heads, 3 KV
heads, MLP 1536, V = 49,152); the draft takes the shipped draft's config.json; the feature draft
(for ``--feature-ks``) takes the shipped feature draft's layer configuration and draft
vocabulary, with random weights, made for the random target (its identity). A larger
initializer range makes the random logits peaked, so greedy argmaxes are not near-ties and the
greedy identity check of bench_e2e stays meaningful.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
DRAFT_ASSETS = os.path.join(HERE, "..", "..", "specdec_kernels", "assets", "draft")
FEATURE_ASSETS = os.path.join(HERE, "..", "..", "specdec_kernels", "assets", "feature_draft")

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    target_cfg = LlamaConfig(**SMOLLM2_135M, initializer_range=0.2)
    with open(os.path.join(DRAFT_ASSETS, "config.json")) as f:
        draft_cfg = LlamaConfig(**{k: v for k, v in json.load(f).items()
                                   if k not in ("architectures", "transformers_version", "model_type")})
    draft_cfg.initializer_range = 0.2
    for name, cfg in (("target", target_cfg), ("draft", draft_cfg)):
        path = os.path.join(out_dir, name)
        LlamaForCausalLM(cfg).save_pretrained(path)
        for fname in os.listdir(DRAFT_ASSETS):  # the shared tokenizer files
            if fname.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(DRAFT_ASSETS, fname), path)
        print(f"wrote {path}: {sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) / 1e6:.1f}M parameters")
    write_feature_draft(os.path.join(out_dir, "feature_draft"), LlamaForCausalLM.from_pretrained(
        os.path.join(out_dir, "target")))


def write_feature_draft(path: str, target) -> None:
    """A random-weight feature draft of the shipped one's shape and draft vocabulary, for ``target``."""
    from specdec_kernels.decoding.drafters.vocab import load_draft_vocab
    from specdec_kernels.decoding.drafters.feature_model import FeatureDraft, save_feature_draft, target_identity

    with open(os.path.join(FEATURE_ASSETS, "feature_draft.json")) as f:
        layers = json.load(f)["layers"]
    cfg = LlamaConfig(**{k: v for k, v in layers.items() if k not in ("architectures", "transformers_version",
                                                                      "model_type")})
    fd = FeatureDraft(cfg, target_identity(target))
    vocab = load_draft_vocab(FEATURE_ASSETS, target.config.vocab_size)
    save_feature_draft(fd, path, vocab)
    n = sum(p.numel() for name, p in fd.named_parameters() if not name.startswith(("lm.lm_head", "lm.model.embed")))
    print(f"wrote {path}: {n / 1e6:.1f}M parameters, {len(vocab)} draft tokens")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/decoding/random_pair.py OUT_DIR")
    main(sys.argv[1])
