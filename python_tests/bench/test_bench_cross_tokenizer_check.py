"""The cross-tokenizer benchmark's check of transformers' intersection method (USD), on the tiny
pair whose tokenizers differ (python_tests/cross_setup.py).

bench/decoding/bench_cross_tokenizer.py reports, beside transformers' USD figures, whether the
probability its verify divides by (q_verify) is the one the draft drew each token with (q_drawn),
and runs a reindexed variant whose pruned draft logits go to their own rows' target ids.  These
tests hold the check to the tokenizers' own strings: the reindexing puts every pruned row's logit
at the target token of the same string, the misplaced-row count is the count of rows whose
logit transformers' scatter puts at a token of another string, and through a real sampled
``generate`` call the reindexed variant's q_verify equals its q_drawn token by token.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cross_setup  # noqa: E402

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


def _translator(draft, target, dt, tt):
    return AssistantToTargetTranslator(tt, dt, target.config.vocab_size, assistant_model=copy.deepcopy(draft),
                                       assistant_prune_lm_head=True)


def test_reindexed_logits_land_on_the_target_token_of_the_same_string(pair):
    b = _bench()
    draft, target, dt, tt = pair
    tr = _translator(draft, target, dt, tt)
    rows = tr.assistant_overlap_token_ids.numel()
    assert rows > 0
    logits = torch.arange(rows, dtype=torch.float32)[None, None]  # row j's logit is j
    out = b.reindexed_target_logits(tr, logits)[0, 0]  # [V_target]
    assert out.shape == (target.config.vocab_size,)
    placed = 0
    for j, d in enumerate(tr.assistant_overlap_token_ids.tolist()):
        t = int((out == j).nonzero()[0])
        assert tt.convert_ids_to_tokens(t) == dt.convert_ids_to_tokens(d), (j, d, t)
        placed += 1
    assert placed == rows
    assert int(torch.isinf(out).sum()) == target.config.vocab_size - rows


def test_misplaced_rows_count_the_rows_transformers_puts_at_another_string(pair):
    b = _bench()
    draft, target, dt, tt = pair
    tr = _translator(draft, target, dt, tt)
    rows = tr.assistant_overlap_token_ids.numel()
    logits = torch.arange(rows, dtype=torch.float32)[None, None]
    theirs = tr.get_target_logits(logits)[0, 0]
    other = sum(tt.convert_ids_to_tokens(int((theirs == j).nonzero()[0])) != dt.convert_ids_to_tokens(d)
                for j, d in enumerate(tr.assistant_overlap_token_ids.tolist()))
    assert b.misplaced_rows(tr) == (other, rows)


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
        for i, t in enumerate(x.tolist()):
            row = int((b.pruned_row_target_ids(tr) == t).nonzero()[0])
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
    elif b.misplaced_rows(check.translator)[0] > 0:  # transformers' scatter: the q used is not the draft's
        assert any(abs(u - d) > 1e-3 for u, d in seen)
