"""The generator audit across tokenizers (``ours-cross``, ``transformers-usd``) and its helpers
for transformers' universal speculative decoding (USD): where each row of the draft's pruned LM
head puts its logit.

The helpers are held to the tokenizers' own strings on the tiny pair whose tokenizers differ
(python_tests/cross_setup.py): ``reindexed_target_logits`` puts every pruned row's logit at the
target token of the same string, ``usd_misplaced_rows`` counts the rows whose logit transformers'
get_target_logits puts at a token of another string.  The audit runs are small (their p-values
are tested only where the law is exact by construction or the fault is large: a wrong scatter
moves the law's chi-square p-value below 1e-4 at a few hundred continuations).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers.generation.candidate_generator import AssistantToTargetTranslator  # noqa: E402

import cross_setup  # noqa: E402
from specdec_kernels.audit.chains import (  # noqa: E402
    CHARS, DRAFT_EXTRA, DRAFT_IDS, chain_tokenizers, draft_chain_in_draft_ids)
from specdec_kernels.audit.generators import run_generator_audit  # noqa: E402
from specdec_kernels.audit.hf_usd import (  # noqa: E402
    reindexed_target_logits, target_id_rows, usd_misplaced_rows, usd_row_target_ids)


@pytest.fixture(scope="module")
def translator():
    draft, target, dt, tt = cross_setup.cross_pair()
    tr = AssistantToTargetTranslator(tt, dt, target.config.vocab_size, assistant_model=copy.deepcopy(draft),
                                     assistant_prune_lm_head=True)
    return tr, dt, tt, target.config.vocab_size


def test_reindexed_logits_land_on_the_target_token_of_the_same_string(translator):
    tr, dt, tt, V = translator
    rows = tr.assistant_overlap_token_ids.numel()
    assert rows > 0
    out = reindexed_target_logits(tr, torch.arange(rows, dtype=torch.float32)[None, None])[0, 0]  # row j's logit: j
    assert out.shape == (V,)
    for j, d in enumerate(tr.assistant_overlap_token_ids.tolist()):
        t = int((out == j).nonzero()[0])
        assert tt.convert_ids_to_tokens(t) == dt.convert_ids_to_tokens(d), (j, d, t)
        assert t == int(usd_row_target_ids(tr)[j])
    assert int(torch.isinf(out).sum()) == V - rows
    inv = target_id_rows(tr)  # the inverse: the row of each target id, -1 where no draft token writes it
    assert inv.shape == (V,) and int((inv >= 0).sum()) == rows
    assert torch.equal(inv[usd_row_target_ids(tr)], torch.arange(rows))
    with pytest.raises(ValueError, match=rf"assistant_logits must be \[\.\.\., {rows}\].*got shape \[1, {rows + 1}\]"):
        reindexed_target_logits(tr, torch.zeros(1, rows + 1))


def test_misplaced_rows_count_the_rows_transformers_puts_at_another_string(translator):
    tr, dt, tt, _ = translator
    rows = tr.assistant_overlap_token_ids.numel()
    theirs = tr.get_target_logits(torch.arange(rows, dtype=torch.float32)[None, None])[0, 0]
    other = sum(tt.convert_ids_to_tokens(int((theirs == j).nonzero()[0])) != dt.convert_ids_to_tokens(d)
                for j, d in enumerate(tr.assistant_overlap_token_ids.tolist()))
    assert usd_misplaced_rows(tr) == (other, rows)


def test_the_chain_tokenizers_write_the_same_characters_under_other_ids():
    tt, dt = chain_tokenizers()
    assert len(tt) == len(CHARS) and len(dt) == len(CHARS) + 1  # transformers: other vocabulary sizes
    for i, c in enumerate(CHARS):
        assert tt.convert_ids_to_tokens(i) == c and dt.convert_ids_to_tokens(DRAFT_IDS[i]) == c
    assert dt.convert_ids_to_tokens(len(CHARS)) == DRAFT_EXTRA and tt(DRAFT_EXTRA).input_ids == []
    table = torch.randn(len(CHARS), len(CHARS), dtype=torch.float64)
    d = draft_chain_in_draft_ids(table)
    for a in range(len(CHARS)):
        for b in range(len(CHARS)):
            assert d[DRAFT_IDS[a], DRAFT_IDS[b]] == table[a, b]
    assert (d[:, len(CHARS)] < -30).all()  # the extra token is never drawn


def test_generator_audit_refuses_an_unknown_vocabulary():
    with pytest.raises(ValueError, match="vocabulary must be 'intersection' or 'string', got 'shared'"):
        run_generator_audit("ours-cross", 100, vocabulary="shared")


@pytest.mark.parametrize("vocabulary", ["intersection", "string"])
def test_generator_audit_of_ours_across_tokenizers(vocabulary):
    (r,) = run_generator_audit("ours-cross", 1_500, vocabulary=vocabulary)
    assert r["verdict"] == "pass", r
    assert r["mutant_verdict"] == "FAIL", r
    assert r["case"].endswith(vocabulary) and "tokens drafted" in r["detail"], r


@pytest.fixture
def vocab_order(monkeypatch):
    """Sets the order of ``get_vocab()``'s items (a Rust hash map's, so it changes from one tokenizer
    object to the next): "ascending" or "descending" ids."""
    from transformers import PreTrainedTokenizerFast

    real = PreTrainedTokenizerFast.get_vocab

    def set_order(order: str):
        def get_vocab(self):
            return dict(sorted(real(self).items(), key=lambda kv: kv[1], reverse=order == "descending"))

        monkeypatch.setattr(PreTrainedTokenizerFast, "get_vocab", get_vocab)

    return set_order


def test_generator_audit_of_transformers_usd_fails_unless_its_scatter_is_reindexed(vocab_order):
    vocab_order("descending")  # the pruned rows in descending draft ids: all 6 misplaced
    (bad,) = run_generator_audit("transformers-usd", 400, mutants=False)
    (fixed,) = run_generator_audit("transformers-usd", 400, mutants=False, fix_usd=True)
    assert "writes 6 of the draft's 6 pruned LM-head rows to another token's id" in bad["detail"], bad
    assert bad["verdict"] == "FAIL", bad
    assert fixed["verdict"] == "pass" and "(reindexed here)" in fixed["detail"], fixed
    vocab_order("ascending")  # the order transformers' scatter assumes: nothing misplaced
    (lucky,) = run_generator_audit("transformers-usd", 400, mutants=False)
    assert "writes 0 of the draft's 6" in lucky["detail"] and lucky["verdict"] == "pass", lucky
