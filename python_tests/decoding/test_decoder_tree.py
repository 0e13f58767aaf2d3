"""``SpeculativeDecoder(tree=...)`` and ``specdec generate --tree``: greedy output equals
``target.generate`` token for token over static and dynamic tree shapes; sampling keeps the
target's joint law of the first two tokens (chi-square, significance 1e-3, 4,000 rows of a
random-weight pair, and the draft's own law is rejected by the same test); both KV caches after
every step equal a fresh forward over the row's ids; the arguments it refuses are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import tree as tree_decoding
from specdec_kernels.decoding.decoder import SpeculativeDecoder
from specdec_kernels.decoding.tree import TreeShape, parse_tree

from decoder_setup import PROMPTS, SIGNIFICANCE, _assert_row_cache, _chisquare_pvalue, _first_two_joint, _llama
from decoder_setup import _perturbed
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)

SHAPES = [(2, 2), (3, 1, 1), (1, 1, 1, 1), "dynamic:6,3,3"]


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_greedy_matches_generate(pair, greedy_refs, shape):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target, tree=shape)
    res = dec.generate(PROMPTS, max_new_tokens=24)
    assert res.token_ids == greedy_refs
    assert res.stats.mean_tokens_per_target_call > 1.5  # the tree's drafts are accepted


def _tree_law(shape, temperature, top_p, N=6000, noise=0.3):
    """(observed [V, V], joint [V, V], the draft's joint) of the first two tokens of N rows, each a
    3-token budget (so trees reach depth 2 in the first step)."""
    V = 8
    target = _llama(V, 16, 2, 0.3, seed=0, max_pos=64)
    draft = _perturbed(target, noise, seed=1)
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(draft=draft, target=target, tree=shape)
    res = dec.generate([prompt] * N, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=1000)
    assert max(h["num_draft"][0] for h in res.stats.history) >= 2  # depth-2 trees were verified
    toks = torch.tensor([t[:2] for t in res.token_ids])  # [N, 2]
    observed = torch.zeros((V, V), dtype=torch.int64)
    observed.index_put_((toks[:, 0], toks[:, 1]), torch.ones(N, dtype=torch.int64), accumulate=True)
    return observed, _first_two_joint(target, prompt, temperature, None, top_p), \
        _first_two_joint(draft, prompt, temperature, None, top_p)


@pytest.mark.slow
@pytest.mark.parametrize("shape,temperature,top_p", [((2, 2), 1.0, None), ((3, 2), 1.3, 0.9),
                                                     ("dynamic:4,2,3", 1.0, None)])
def test_tree_sampling_matches_target_distribution(shape, temperature, top_p):
    observed, joint, q_joint = _tree_law(shape, temperature, top_p)
    N = int(observed.sum())
    assert observed[joint == 0].sum() == 0
    assert _chisquare_pvalue(observed, joint) > SIGNIFICANCE
    pseudo = (q_joint * N).round().to(torch.int64)  # power: the draft's law fails
    pseudo[joint == 0] = 0
    assert _chisquare_pvalue(pseudo, joint) < SIGNIFICANCE


@pytest.mark.slow
def test_pruning_drawn_children_is_caught(monkeypatch):
    """The mutant the tree loop must not be: draw one child more than the shape asks for and keep
    the most probable ones (pruning by the children's own probability). The law test rejects it."""
    real = tree_decoding._children

    def pruned(logq, m, sample, g):
        drawn = real(logq, m + 1, sample, g)
        return sorted(drawn, key=lambda c: -float(logq[c]))[:m]

    monkeypatch.setattr(tree_decoding, "_children", pruned)
    observed, joint, _ = _tree_law((2, 2), 1.0, None)
    assert _chisquare_pvalue(observed, joint) < SIGNIFICANCE


def test_padded_target_vocabulary_and_a_short_draft_context():
    """A target vocabulary beyond the draft's (its ids fed to the draft clamped, as the chain loop
    does) and a draft whose context ends inside the generation (the rows go on with the target
    alone): greedy output is still target.generate's."""
    target = _llama(40, 32, 2, 0.2, seed=0, max_pos=64)
    draft = _perturbed(_llama(32, 32, 2, 0.2, seed=0, max_pos=12), 0.01, seed=1)
    with torch.no_grad():  # the draft's rows are the target's first 32
        for name, p in draft.named_parameters():
            t = dict(target.named_parameters())[name]
            p.copy_(t[:p.shape[0]] if p.shape != t.shape else t)
    prompts = [[1, 2, 3], [35, 36, 37, 38, 39, 5]]  # ids past the draft's vocabulary
    with torch.inference_mode():
        refs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    dec = SpeculativeDecoder(draft=draft, target=target, tree=(2, 2))
    res = dec.generate(prompts, max_new_tokens=12)
    assert res.token_ids == refs
    assert res.stats.draft_forwards < 2 * res.stats.iterations  # the draft stopped at its context


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_every_step_equal_a_fresh_forward(pair, temperature):
    draft, target = pair
    seen = []

    def check(tc, dc, seq, ld):
        _assert_row_cache(tc, 0, len(seq) - 1, target, seq[:-1])  # all but the last emitted token
        _assert_row_cache(dc, 0, ld, draft, seq[:ld])
        seen.append(len(seq))

    dec = SpeculativeDecoder(draft=draft, target=target, tree=(2, 2, 1))
    st = dec.start(PROMPTS[:3], max_new_tokens=12, temperature=temperature, seed=4)
    tree_decoding.generate_tree(dec.parts, st, after_step=check)
    assert len(seen) >= 6


@pytest.mark.slow
def test_a_wider_tree_accepts_more_per_call():
    """Same pair and seeds at T = 1: a tree of 3 children per depth gives more tokens per target
    call than the chain of the same depth (by more than 3 standard errors of the difference)."""
    V, N = 16, 300
    target = _llama(V, 16, 2, 0.3, seed=2, max_pos=64)
    draft = _perturbed(target, 0.3, seed=3)
    per_call = {}
    for shape in ((1, 1), (3, 3)):
        dec = SpeculativeDecoder(draft=draft, target=target, tree=shape)
        res = dec.generate([[1, 2, 3]] * N, max_new_tokens=3, temperature=1.0, seed=7)
        h = res.stats.accepted_length_histogram
        n = torch.tensor([i for i, c in enumerate(h) for _ in range(c)], dtype=torch.float64)
        per_call[shape] = (float(n.mean()), float(n.std()) / len(n) ** 0.5)
    (m1, s1), (m3, s3) = per_call[(1, 1)], per_call[(3, 3)]
    assert m3 - m1 > 3 * (s1 ** 2 + s3 ** 2) ** 0.5, per_call


@pytest.mark.parametrize("spec,message", [
    ("4,x", "tree must be branching factors per depth such as '4,2,2,1', got '4,x'"),
    ((2, 0), "tree must be a non-empty sequence of branching factors >= 1"),
    ((), "tree must be a non-empty sequence of branching factors >= 1"),
    ("dynamic:4,2", "tree must be 'dynamic:NODES,DEPTH,BRANCH'"),
    ("dynamic:1,2,2", "a dynamic tree's nodes must be >= its depth (2), got 1"),
    ((16, 16, 2), "tree must have at most 256 nodes, got 784"),
])
def test_tree_spec_errors(spec, message):
    with pytest.raises(ValueError) as e:
        parse_tree(spec)
    assert message in str(e.value)


def test_tree_shape_objects_are_checked():
    with pytest.raises(ValueError, match="a dynamic tree's depth must be an int >= 1, got 0"):
        TreeShape(nodes=4, depth=0, branch=2)
    with pytest.raises(ValueError, match="a static tree's branching factors must be ints >= 1"):
        TreeShape(branching=(2, 0))


def test_architectures_without_rotary_4d_masks_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=32))
    with pytest.raises(ValueError, match=r"tree drafting takes the target of model type llama / mistral / qwen2 / "
                                         r"qwen3 .*GPT2LMHeadModel is 'gpt2'"):
        SpeculativeDecoder(draft=gpt2, target=gpt2, tree=(2, 2))


def test_tree_shapes():
    assert parse_tree("4,2,2,1") == TreeShape(branching=(4, 2, 2, 1))
    assert parse_tree((4, 2)).max_nodes == 12 and parse_tree((4, 2)).max_depth == 2
    assert parse_tree("dynamic:8,4,3").max_nodes == 8


def test_tree_argument_errors(pair):
    draft, target = pair
    with pytest.raises(ValueError, match="tree drafting needs a draft model"):
        SpeculativeDecoder(target=target, drafter="prompt_lookup", tree=(2, 2))
    dec = SpeculativeDecoder(draft=draft, target=target, tree=(2, 2))
    with pytest.raises(ValueError, match="tree drafting does not take draft_confidence"):
        dec.generate([PROMPTS[0]], max_new_tokens=4, draft_confidence=0.5)


def test_cli_tree_flag(capsys):
    from specdec_kernels.cli import main

    rc = main(["generate", "hello", "--tiny-random", "--max-new-tokens", "4", "--tree", "2,2", "--temperature", "1.0"])
    assert rc in (0, None)
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--tiny-random", "--tree", "2,x"])
    assert e.value.code == 2
