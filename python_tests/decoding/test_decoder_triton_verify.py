"""The decoder's loop verifying through the Triton kernel, run on the CPU by Triton's interpreter.

On CUDA, ``SpeculativeDecoder`` verifies every step with the Triton kernel; on the CPU with the
torch path.  No GPU has run the decoder yet, so here the CPU loop is forced through the kernel
(``verify_backend="triton"``; conftest.py sets ``TRITON_INTERPRET=1``) and must give exactly
the tokens of the torch path, which the other decoder tests prove exact: greedy (= the target's
greedy decoding), seeded sampling (the kernel and the torch path draw the same random numbers),
with warps, a ragged batch whose rows finish at different steps, ``K="auto"`` with steps that
verify no draft (K = 0), a draft vocabulary (q zero outside it), prompt lookup (no draft
probabilities) and the feature draft.  The kernel's own exactness against the reference is
test_verify_exact.py's.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels import SpeculativeDecoder
from specdec_kernels.ops.verify import interpreting

from decoder_setup import PROMPTS, _one_thread, _synthetic_times, greedy_refs, pair  # noqa: F401  (fixtures)
from feature_setup import fgreedy_refs, fpair  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.slow,  # the decoder's loop through the interpreted kernel
              pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                 reason="the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 "
                                        "(conftest.py sets it)")]
# Where the models run: the CPU with the interpreted kernel (no GPU: conftest.py sets
# TRITON_INTERPRET=1), else the GPU with the compiled one (the greedy references, made on the
# CPU, are then left to test_decoder_devices.py: the GPU's logits round differently).
DEV = torch.device("cpu" if interpreting() else "cuda")


def _on(*models):
    import copy

    return [m if DEV.type == "cpu" else copy.deepcopy(m).to(DEV) for m in models]


def _refs_hold(refs, token_ids, n=16):
    return DEV.type != "cpu" or [r[:n] for r in refs] == token_ids

CASES = [  # (K, temperature, top_k, top_p)
    (3, 0.0, None, None),
    ("auto", 0.0, None, None),
    (3, 1.0, None, None),
    (2, 0.7, 5, 0.9),
]


def _both(make, **kw):
    """(token_ids, finish reasons, each step's K and accepted counts) of the same call through
    each backend.  With K="auto" the steps depend on measured times (the interpreted kernel is
    slow), so there only the tokens and finish reasons are kept."""
    out = {}
    for backend in ("torch", "triton"):
        res = make(backend).generate(PROMPTS, max_new_tokens=16, seed=11, **kw)
        steps = [(h["k"], h["accepted"]) for h in res.stats.history]
        out[backend] = (res.token_ids, res.finish_reasons, None if kw.get("num_draft_tokens") == "auto" else steps)
    return out


@pytest.mark.parametrize("k,temperature,top_k,top_p", CASES)
def test_model_drafter_through_the_kernel(pair, greedy_refs, k, temperature, top_k, top_p):
    draft, target = _on(*pair)
    got = _both(lambda b: SpeculativeDecoder(draft=draft, target=target, verify_backend=b),
                num_draft_tokens=k, temperature=temperature, top_k=top_k, top_p=top_p)
    assert got["triton"] == got["torch"]
    if temperature == 0:
        assert _refs_hold(greedy_refs, got["triton"][0])


def test_draft_vocabulary_through_the_kernel(pair):
    # the draft proposes 22 of 32 tokens: its q is zero on the others, which the residual covers
    draft, target = _on(*pair)
    got = _both(lambda b: SpeculativeDecoder(draft=draft, target=target,
                                             draft_vocab=list(range(0, 32, 3)) + list(range(1, 32, 3)),
                                             verify_backend=b), num_draft_tokens=3, temperature=1.0)
    assert got["triton"] == got["torch"]


def test_steps_without_drafts_through_the_kernel(pair, greedy_refs, monkeypatch):
    # a verify that costs a step per draft: "auto" takes K = 0 steps, a kernel launch with K = 0
    draft, target = _on(*pair)
    runs = {}
    for backend in ("torch", "triton"):
        seen = []
        with monkeypatch.context() as m:
            _synthetic_times(m, 1.0, seen)  # the same K sequence for both: no measured times
            res = SpeculativeDecoder(draft=draft, target=target, verify_backend=backend).generate(
                PROMPTS, max_new_tokens=16, num_draft_tokens="auto", max_draft_tokens=6)
        runs[backend] = (res.token_ids, [(h["k"], h["accepted"]) for h in res.stats.history])
    assert runs["triton"] == runs["torch"]
    assert _refs_hold(greedy_refs, runs["triton"][0])
    ks = [k for k, _ in runs["triton"][1]]
    assert ks.count(0) >= 4 and max(ks) >= 1, ks  # both kinds of step happened


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompt_lookup_through_the_kernel(pair, temperature):
    (target,) = _on(pair[1])
    got = _both(lambda b: SpeculativeDecoder(target=target, drafter="prompt_lookup", verify_backend=b),
                num_draft_tokens=3, temperature=temperature)
    assert got["triton"] == got["torch"]


@pytest.mark.parametrize("k,temperature,top_k,top_p", CASES)
def test_feature_drafter_through_the_kernel(fpair, fgreedy_refs, k, temperature, top_k, top_p):
    fd, target = _on(*fpair)
    got = _both(lambda b: SpeculativeDecoder(draft=fd, target=target, drafter="feature", verify_backend=b),
                num_draft_tokens=k, temperature=temperature, top_k=top_k, top_p=top_p)
    assert got["triton"] == got["torch"]
    if temperature == 0:
        assert _refs_hold(fgreedy_refs, got["triton"][0])


def test_verify_backend_is_checked(pair, monkeypatch):
    draft, target = pair
    with pytest.raises(ValueError, match=r"^verify_backend must be 'auto', 'triton' or 'torch', got 'cuda'"):
        SpeculativeDecoder(draft=draft, target=target, verify_backend="cuda")
    import specdec_kernels.ops.verify as verify_mod

    monkeypatch.setattr(verify_mod, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"^verify_backend='triton' needs the models on CUDA \(or TRITON_INTERPRET=1 "
                                         r"for the CPU\), got them on cpu"):
        SpeculativeDecoder(draft=draft, target=target, verify_backend="triton")
    monkeypatch.setattr(verify_mod, "interpreting", lambda: True)
    monkeypatch.setattr(verify_mod, "interpreter_problem", lambda: "Triton 3.6.0's interpreter ... NumPy 2.4.6")
    with pytest.raises(RuntimeError, match=r"^verify_backend='triton' on the CPU: Triton 3.6.0's interpreter"):
        SpeculativeDecoder(draft=draft, target=target, verify_backend="triton")
