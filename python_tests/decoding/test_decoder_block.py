"""``SpeculativeDecoder(verification="block")`` and ``specdec generate --verification block``:
greedy output equals ``target.generate`` token for token; sampling keeps the target's joint law of
the first two tokens (chi-square, significance 1e-3, 4,000 rows of a random-weight pair); the
drafts accepted per step under block verification are at least token verification's on average
over the same seeds."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding.decoder import SpeculativeDecoder

from decoder_setup import PROMPTS, SIGNIFICANCE, _chisquare_pvalue, _first_two_joint, _llama, _perturbed
from decoder_setup import _one_thread, greedy_refs, pair  # noqa: F401  (fixtures; _one_thread: autouse)


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_block_greedy_matches_generate(pair, greedy_refs, k):
    draft, target = pair
    dec = SpeculativeDecoder(draft=draft, target=target, verification="block")
    res = dec.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, max_draft_tokens=6)
    assert res.token_ids == greedy_refs


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p", [(1.0, None), (0.7, 0.9)])
def test_block_sampling_matches_target_distribution(temperature, top_p):
    V, N = 8, 4000
    target = _llama(V, 16, 2, 0.3, seed=0, max_pos=64)
    draft = _perturbed(target, 0.05, seed=1)
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(draft=draft, target=target, verification="block")
    res = dec.generate([prompt] * N, max_new_tokens=2, temperature=temperature, top_p=top_p, seed=1000,
                       num_draft_tokens=2)
    toks = torch.tensor([t[:2] for t in res.token_ids])  # [N, 2]
    observed = torch.zeros((V, V), dtype=torch.int64)
    observed.index_put_((toks[:, 0], toks[:, 1]), torch.ones(N, dtype=torch.int64), accumulate=True)
    joint = _first_two_joint(target, prompt, temperature, None, top_p)
    assert observed[joint == 0].sum() == 0
    assert _chisquare_pvalue(observed, joint) > SIGNIFICANCE
    q_joint = _first_two_joint(draft, prompt, temperature, None, top_p)  # power: the draft's law fails
    pseudo = (q_joint * N).round().to(torch.int64)
    pseudo[joint == 0] = 0
    assert _chisquare_pvalue(pseudo, joint) < SIGNIFICANCE


def test_block_accepts_at_least_as_many():
    """Same pair, prompts and seeds, K = 4 at T = 1: mean accepted drafts per row-step under
    block verification >= token verification's minus 3 standard errors (the exact inequality is
    tested on the laws in test_block_verify.py; here the loop passes it on)."""
    V, N = 16, 600
    target = _llama(V, 16, 2, 0.3, seed=2, max_pos=64)
    draft = _perturbed(target, 0.3, seed=3)
    means, ses = {}, {}
    for method in ("token", "block"):
        dec = SpeculativeDecoder(draft=draft, target=target, verification=method)
        res = dec.generate([[1, 2, 3]] * N, max_new_tokens=5, temperature=1.0, seed=7, num_draft_tokens=4)
        h = res.stats.accepted_length_histogram
        n = torch.tensor([i for i, c in enumerate(h) for _ in range(c)], dtype=torch.float64)
        means[method], ses[method] = float(n.mean()), float(n.std()) / len(n) ** 0.5
    assert means["block"] >= means["token"] - 3 * (ses["block"] ** 2 + ses["token"] ** 2) ** 0.5, means


def test_verification_argument_errors(pair):
    draft, target = pair
    with pytest.raises(ValueError, match="verification must be 'token' or 'block', got 'tree'"):
        SpeculativeDecoder(draft=draft, target=target, verification="tree")


def test_cli_verification_flag(capsys):
    from specdec_kernels.cli import main

    rc = main(["generate", "hello", "--tiny-random", "--max-new-tokens", "4", "--verification", "block",
               "--temperature", "1.0"])
    assert rc in (0, None)
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--tiny-random", "--verification", "blocks"])
    assert e.value.code == 2
