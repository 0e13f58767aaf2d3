"""A drafter of the user's own, passed as ``SpeculativeDecoder(drafter=<a Drafter instance>)``:
it drafts in the loop through the one interface (``drafters/base.py``), makes its own state at
each call, and the output stays the target's: greedy equals ``target.generate``, seeded rows do
not depend on the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from specdec_kernels.decoding import SpeculativeDecoder
from specdec_kernels.decoding.drafters.base import Drafter, Drafts, DraftState

from decoder_setup import PROMPTS
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)


@dataclass
class StepsState(DraftState):
    """Per active row, how many steps it drafted in (the drafter's own state)."""

    drafted: list = field(default_factory=list)

    def begin(self, st, columns: int) -> None:
        self.drafted = [0] * len(st.rows)

    def select_rows(self, idx, keep, prefilled) -> None:
        self.drafted = [self.drafted[i] for i in keep]


class RepeatLast(Drafter):
    """Proposes the row's last token K times (no network, no distribution: one-hot q)."""

    name = "repeat_last"

    def __init__(self):
        self.states = []  # every state it made, one per generate call

    def new_state(self, st, target_only):
        self.states.append(StepsState())
        return self.states[-1]

    def draft(self, st, K: int) -> Drafts:
        st.draft.drafted = [n + 1 for n in st.draft.drafted]
        return Drafts(st.last[:, None].expand(len(st.rows), K).clone(), None, None, 0)  # [B, K] int64


class GreedyModelDrafter(Drafter):
    """A draft model run without a cache: each step, K greedy tokens from full forwards over each
    row's sequence (slow, simple: what a user's drafter might do)."""

    name = "greedy_model"

    def __init__(self, model):
        self.model = model.eval()

    def draft(self, st, K: int) -> Drafts:
        rows = []
        for p in st.rows:
            seq = list(st.seqs[p])
            for _ in range(K):
                logits = self.model(torch.tensor([seq])).logits[0, -1]  # [V]
                seq.append(int(logits.argmax()))
            rows.append(seq[-K:])
        return Drafts(torch.tensor(rows, dtype=torch.int64, device=st.device), None, None, K)  # [B, K]


@pytest.mark.parametrize("k", [1, 3])
def test_a_custom_drafter_decodes_the_targets_greedy_tokens(pair, greedy_refs, k):
    _, target = pair
    drafter = RepeatLast()
    dec = SpeculativeDecoder(target=target, drafter=drafter)
    assert dec.drafter == "repeat_last"
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k)
    assert res.token_ids == greedy_refs
    assert len(drafter.states) == 1 and isinstance(drafter.states[0], StepsState)
    assert res.stats.drafted_tokens > 0  # it drafted through the loop
    dec.generate(PROMPTS[:2], max_new_tokens=4, num_draft_tokens=k)
    assert len(drafter.states) == 2 and drafter.states[0] is not drafter.states[1]  # a state per call


def test_a_custom_network_drafter_matches_generate_and_gets_drafts_accepted(pair, greedy_refs):
    draft, target = pair
    dec = SpeculativeDecoder(target=target, drafter=GreedyModelDrafter(draft))
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=3)
    assert res.token_ids == greedy_refs
    assert res.stats.acceptance_rate > 0.3  # the perturbed draft agrees with the target often


def test_a_custom_drafter_with_auto_k_and_sampling_keeps_rows_batch_invariant(pair):
    _, target = pair
    dec = SpeculativeDecoder(target=target, drafter=RepeatLast())
    batch = dec.generate(PROMPTS, max_new_tokens=12, num_draft_tokens=3, temperature=1.0, seed=5)
    for p, prompt in enumerate(PROMPTS):
        alone = dec.generate([prompt], max_new_tokens=12, num_draft_tokens=3, temperature=1.0, seed=5 + p)
        assert alone.token_ids[0] == batch.token_ids[p]
    auto = dec.generate(PROMPTS, max_new_tokens=12, num_draft_tokens="auto", temperature=0.0)
    assert all(len(t) == 12 for t in auto.token_ids)


def test_a_drafter_instance_takes_no_draft(pair):
    draft, target = pair
    with pytest.raises(ValueError, match="takes no draft"):
        SpeculativeDecoder(draft=draft, target=target, drafter=RepeatLast())
    with pytest.raises(TypeError, match="a Drafter instance"):
        SpeculativeDecoder(target=target, drafter=3)


def test_a_registered_drafter_is_a_choice_of_the_cli_and_a_name_of_the_decoder(pair, greedy_refs):
    from specdec_kernels.cli import build_parser
    from specdec_kernels.decoding.drafters.registry import drafter_names, register_drafter, unregister_drafter

    _, target = pair
    register_drafter("repeat_last", None, lambda runner: RepeatLast())
    try:
        assert "repeat_last" in drafter_names()
        assert build_parser().parse_args(["generate", "hi", "--drafter", "repeat_last"]).drafter == "repeat_last"
        dec = SpeculativeDecoder(target=target, drafter="repeat_last")
        assert isinstance(dec.parts.drafter, RepeatLast) and dec.drafter == "repeat_last"
        assert dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=2).token_ids == greedy_refs
        with pytest.raises(ValueError, match="already registered"):
            register_drafter("repeat_last", None, lambda runner: RepeatLast())
    finally:
        unregister_drafter("repeat_last")
    assert "repeat_last" not in drafter_names()
    with pytest.raises(SystemExit):  # no longer a choice
        build_parser().parse_args(["generate", "hi", "--drafter", "repeat_last"])
    with pytest.raises(ValueError, match="drafter must be one of"):
        SpeculativeDecoder(target=target, drafter="repeat_last")
