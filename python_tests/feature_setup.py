"""The feature-draft models and fixtures shared by the tests: a small random Llama target whose
attention is damped (``_damped_llama``), a feature draft for it (``_feature_draft``) fitted in a
few seconds (``_fit``), and the module fixtures ``fpair`` (the pair) and ``fgreedy_refs`` (the
target's greedy continuations of ``PROMPTS``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_kernels.decoding.drafters.feature_model import FeatureDraft, target_identity

from decoder_setup import PROMPTS, _llama


def _feature_draft(target, seed: int = 0, intermediate: int = 64, max_pos: int = None) -> FeatureDraft:
    tc = target.config
    cfg = LlamaConfig(vocab_size=1, hidden_size=tc.hidden_size, intermediate_size=intermediate, num_hidden_layers=1,
                      num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                      max_position_embeddings=max_pos or tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return FeatureDraft(cfg, target_identity(target)).eval()


def _pairs(target, ids: torch.Tensor):
    """(embeddings [B, T, H], features [B, T, H], the target's final hidden states h [B, T, H]):
    column t holds (h[t - 1], x_t), h[-1] = 0."""
    with torch.inference_mode():
        h = target.model(input_ids=ids).last_hidden_state
    feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
    return target.get_input_embeddings()(ids).detach(), feats, h


def _fit(fd: FeatureDraft, target, steps: int = 200, seed: int = 0) -> FeatureDraft:
    """Teach fd to predict the target's next feature and greedy token on the target's greedy
    continuations of 128 random 4-token prompts (a few seconds at these sizes)."""
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    with torch.no_grad():
        ids = torch.randint(0, V, (128, 4), generator=g)
        seqs = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=None)
    emb, feats, h = (t.clone() for t in _pairs(target, seqs))
    with torch.no_grad():
        greedy = target.lm_head(h).argmax(-1)  # the target's greedy token after each column
    head = target.lm_head.weight.detach().clone()
    fd.train()
    opt = torch.optim.Adam(fd.parameters(), lr=1e-2)
    pos = torch.arange(seqs.shape[1])[None].expand(seqs.shape[0], -1)
    for _ in range(steps):
        out = fd(emb, feats, pos)
        loss = torch.nn.functional.smooth_l1_loss(out, h) + torch.nn.functional.cross_entropy(
            (out @ head.T).flatten(0, 1), greedy.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return fd.eval().requires_grad_(False)


def _damped_llama(V: int, hidden: int, init: float, seed: int, max_pos: int = 128) -> LlamaForCausalLM:
    """A random target whose attention outputs are scaled by 0.1: the context still matters, but
    little enough that a feature draft learns to predict it in a hundred steps (alpha ~0.65
    greedy; an undamped random target's features take far longer to learn)."""
    target = _llama(V, hidden, 2, init, seed=seed, max_pos=max_pos)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
    return target


@pytest.fixture(scope="module")
def fpair():
    """A V = 32 target and a feature draft fitted to it."""
    target = _damped_llama(32, 32, 0.2, seed=0)
    return _fit(_feature_draft(target), target, steps=100), target


@pytest.fixture(scope="module")
def fgreedy_refs(fpair):
    _, target = fpair
    with torch.inference_mode():
        return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
