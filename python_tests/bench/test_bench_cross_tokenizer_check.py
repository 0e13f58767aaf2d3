"""The cross-tokenizer benchmark's check of transformers' intersection method (USD), on the tiny
pair whose tokenizers differ (python_tests/cross_setup.py).

bench/decoding/bench_cross_tokenizer.py reports, beside transformers' USD figures, the probability
its verify divides by at each drafted token (q_verify) and the one the draft drew the token with
(q_drawn), and runs a variant whose pruned draft logits go to their own rows' target ids
(python_tests/audit/test_cross_generators.py tests that reindexing).  Through real sampled
``generate`` calls: the check's sums are the per-token values recomputed here, and the reindexed
variant's q_verify equals its q_drawn token by token, transformers' own does not.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.candidate_generator import AssistantToTargetTranslator  # noqa: E402

import cross_setup  # noqa: E402
from specdec_kernels.audit.hf_usd import usd_misplaced_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "decoding" / "bench_cross_tokenizer.py"


def _bench():
    name = "bench_cross_tokenizer_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def pair():
    draft, target, dt, tt = cross_setup.cross_pair()
    return draft, target, dt, tt


@pytest.mark.parametrize("reindex", [True, False])
def test_q_check_through_a_sampled_generate(pair, reindex):
    b = _bench()
    draft, target, dt, tt = pair
    check = b.QCheck()
    seen = []  # per _speculative_sampling call: (q the verify used, q the draft drew with), recomputed here
    inner = check._gen_utils._speculative_sampling

    def spy(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k):
        tr, pruned = check.translator, check._pruned
        x = candidate_input_ids[0, -candidate_length:]
        overlap = tr.assistant_overlap_token_ids.tolist()  # pruned row -> draft id
        for i, t in enumerate(x.tolist()):
            # the pruned row of the draft token that writes the target token's string, found from the
            # tokenizers alone (not from usd_row_target_ids, which the check itself uses)
            row = overlap.index(dt.convert_tokens_to_ids(tt.convert_ids_to_tokens(t)))
            seen.append((float(candidate_logits[0, i].softmax(-1)[t]), float(pruned[0, i].softmax(-1)[row])))
        return inner(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k)

    check._gen_utils._speculative_sampling = spy
    try:
        check.reindex = reindex
        ids = tt("abc defg", return_tensors="pt").input_ids
        torch.manual_seed(0)
        with torch.inference_mode():
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0, assistant_model=copy.deepcopy(draft),
                            tokenizer=tt, assistant_tokenizer=dt, pad_token_id=0, eos_token_id=None)
        sums = check.take()
    finally:
        check._gen_utils._speculative_sampling = check._orig_sampling
        AssistantToTargetTranslator.get_target_logits = check._orig_logits
        transformers.generation.candidate_generator.AssistantVocabTranslatorCache._cache.clear()
    assert seen and sums[2] == len(seen)
    assert sums[0] == pytest.approx(sum(u for u, _ in seen), rel=1e-5)
    assert sums[1] == pytest.approx(sum(d for _, d in seen), rel=1e-5)
    if reindex:  # the reindexed variant divides by the probability the draft drew each token with
        for used, drawn in seen:
            assert used == pytest.approx(drawn, rel=1e-5, abs=1e-7)
    elif usd_misplaced_rows(check.translator)[0] > 0:  # transformers' scatter: the q used is not the draft's
        assert any(abs(u - d) > 1e-3 for u, d in seen)
