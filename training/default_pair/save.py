"""The draft directory the default pair's build writes (``save_draft``): fp16 weights with an
fp32 config, the target's tokenizer files, the draft vocabulary and ``distill_info.json``, the
build's record of its stages (``stage_history`` readies a saved one for one more stage)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specdec_kernels.decoding.drafters.vocab import save_draft_vocab


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def stage_history(prev: dict) -> dict:
    """The ``training`` record of a draft to resume from, made ready for one more stage.

    The first stage's settings stay flat (as a full build writes them); every later stage is an
    entry of ``stages`` with its own data (word prompts, tokens) and schedule.  Drafts written
    before ``stages`` existed record their second stage as ``more_*`` keys: converted here.
    """
    first = {k: v for k, v in prev.items()
             if not k.startswith(("more_", "grow_")) and k not in ("stages", "resumed_wall_s")}
    stages = [dict(s) for s in prev.get("stages", [])]
    if "more_epochs" in prev and not stages:
        stages.append(dict(epochs=prev["more_epochs"], lr=prev["more_lr"], threads=prev["more_threads"],
                           layers=prev.get("grow_layers", prev.get("layers")), seed=prev.get("seed", 0) + 1,
                           word_prompts=prev.get("word_prompts"), sampled_prompts=prev.get("sampled_prompts"),
                           sampled_passes=prev.get("sampled_passes"), train_prompts=prev.get("train_prompts"),
                           train_tokens=prev.get("train_tokens"), wall_s=prev.get("more_wall_s")))
    return {**first, "stages": stages}


def save_draft(draft, target_dir: str, out: Path, info: dict, vocab=None):
    """fp16 weights (half the bytes), config dtype float32 so that ``from_pretrained`` without a
    dtype gives the fast CPU dtype; the target's tokenizer files, copied byte for byte; the draft
    vocabulary ``vocab`` (token ids, or None for none) as draft_vocab.json."""
    tmp = Path(tempfile.mkdtemp(prefix="draft-", dir=str(out.parent)))
    try:
        if vocab is not None:
            save_draft_vocab(tmp, vocab, draft.config.vocab_size, source=info["draft_vocab"]["source"])
        draft.to(torch.float16).save_pretrained(tmp)
        draft.to(torch.float32)
        cfg_path = tmp / "config.json"  # save_pretrained writes the weights' dtype; declare fp32
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = "float32"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(target_dir) / name).is_file():
                shutil.copyfile(Path(target_dir) / name, tmp / name)
        (tmp / "distill_info.json").write_text(json.dumps(info, indent=1, default=float) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
