"""Sampling and length arguments at their types' limits: one clear error naming the argument,
from ``generate``, the CLI (exit 2, one line) and ``fused_verify`` alike (one checker serves the
three: ``verify.check_sampling_scalars``), before any model work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec_kernels import fused_verify
from specdec_kernels.decoding.arguments import check_generate_args, load_tokenizer

EDGES = [  # (keyword, value, the message's start)
    ("temperature", 1e39, "temperature must fit in float32"),
    ("temperature", 1e-50, "temperature must be 0 (greedy) or >= 1.1754944e-38"),
    ("top_p", 1e-50, "top_p must be representable in float32"),
    ("min_p", 1e-50, "min_p must be representable in float32"),
    ("top_k", 10**19, "top_k must fit in int64"),
    ("top_k", -1, "top_k must be >= 0"),
]


def _generate_args(**kw):
    base = dict(max_new_tokens=4, num_draft_tokens=2, temperature=1.0, top_k=None, top_p=None, stop=None,
                max_draft_tokens=8, draft_confidence=0.0, drafter="model", has_draft=True, has_tokenizer=True)
    base.update(kw)
    return check_generate_args(base.pop("max_new_tokens"), base.pop("num_draft_tokens"), base.pop("temperature"),
                               base.pop("top_k"), base.pop("top_p"), base.pop("stop"), base.pop("max_draft_tokens"),
                               base.pop("draft_confidence"), **base)


@pytest.mark.parametrize("name,value,message", EDGES)
def test_generate_and_fused_verify_refuse_the_same_values_alike(name, value, message):
    with pytest.raises(ValueError) as gen:
        _generate_args(**{name: value})
    assert str(gen.value).startswith(message), str(gen.value)
    logits = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError) as op:
        fused_verify(logits, torch.zeros(1, 1, dtype=torch.int64), backend="torch", **{name: value})
    assert str(op.value) == str(gen.value)


@pytest.mark.parametrize("kw,message", [
    (dict(max_new_tokens=2**63), "max_new_tokens must fit in int64"),
])
def test_integer_options_at_their_limits(kw, message):
    with pytest.raises(ValueError, match="^" + message):
        _generate_args(**kw)


def test_decoder_generate_refuses_before_any_work():
    from decoder_setup import _llama, _perturbed  # the suite's tiny random pair

    from specdec_kernels import SpeculativeDecoder

    target = _llama(32, 32, 2, 0.2, seed=0)
    dec = SpeculativeDecoder(draft=_perturbed(target, 0.01, seed=1), target=target)
    for name, value, message in EDGES:
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            dec.generate([[1, 2, 3]], max_new_tokens=4, **{name: value})


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "1e39"], "--temperature must fit in float32"),
    (["--top-k", "10000000000000000000"], "--top-k must fit in int64"),
    (["--top-p", "1e-50"], "--top-p must be representable in float32"),
    (["--max-new-tokens", str(2**63)], "--max-new-tokens must fit in int64"),
])
def test_cli_exits_2_with_one_line(flags, message):
    r = subprocess.run([sys.executable, "-m", "specdec_kernels", "generate", "hi", "--tiny-random", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_model_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"^target directory '.*' holds no tokenizer files .*--tokenizer DIR"):
        load_tokenizer(str(tmp_path), "target")
    r = subprocess.run([sys.executable, "-m", "specdec_kernels", "generate", "hi", "--target", str(tmp_path),
                        "--drafter", "prompt_lookup"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "--target directory" in last and str(tmp_path) in last and "--tokenizer" in last, r.stderr[-2000:]
