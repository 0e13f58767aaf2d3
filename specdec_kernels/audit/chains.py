"""The generator audit's models: Markov chains in Hugging Face format, whose law of continuations
is known exactly, and their tokenizers (each token a character).

``markov_llama(table)``: a one-layer ``LlamaForCausalLM`` whose attention and MLP write nothing
(``o_proj`` and ``down_proj`` are zero), whose embedding of token i is c e_i, so that the final
RMSNorm gives f e_i and the LM head's column i, set to table[i] / f, makes the logits at every
position table[previous token].  ``continuation_law``: the law of x_1..x_L after a prompt ending
in x_0, prod_i softmax(table[x_{i-1}] / T)[x_i]; ``greedy_path``: its argmax path.
``chain_tokenizers``: the target's tokenizer writes ``CHARS`` as ids 0..5, the draft's numbers
them ``DRAFT_IDS`` and has one token more (``DRAFT_EXTRA``).
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["VG", "HIDDEN", "LENGTH", "PROMPT", "CHARS", "DRAFT_IDS", "DRAFT_EXTRA", "EXTRA_LOGIT", "chain_tokenizers",
           "draft_chain_in_draft_ids", "chain_tables", "markov_llama", "continuation_law", "continuation_counts",
           "greedy_path"]

# vocabulary, hidden size (one head of 64: a size vLLM's CPU attention takes), continuation length, prompt
VG, HIDDEN, LENGTH, PROMPT = 6, 64, 3, [2]


# the chains' tokens as text (target id i writes CHARS[i]) and the draft tokenizer's id of each:
# DRAFT_IDS[i] is the draft's id of CHARS[i].  The draft's vocabulary has one token more,
# DRAFT_EXTRA (id VG), which the target cannot write and the draft chain never draws (logit
# EXTRA_LOGIT): transformers takes two models with vocabularies of one size for one tokenizer.
CHARS = "abcdef"
DRAFT_IDS = (3, 5, 0, 4, 1, 2)
DRAFT_EXTRA, EXTRA_LOGIT = "g", -40.0


def chain_tokenizers():
    """(target tokenizer, draft tokenizer): one token per character, no special tokens; the
    target's are ``CHARS`` in order, the draft's ``CHARS`` numbered as ``DRAFT_IDS`` says and
    ``DRAFT_EXTRA`` last."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    def fast(vocab: dict):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    target = fast({c: i for i, c in enumerate(CHARS)})
    draft = fast({**{c: DRAFT_IDS[i] for i, c in enumerate(CHARS)}, DRAFT_EXTRA: len(CHARS)})
    return target, draft


def draft_chain_in_draft_ids(table: torch.Tensor) -> torch.Tensor:
    """[V + 1, V + 1]: the draft chain [V, V] (rows and columns in target ids) over the draft
    tokenizer's ids, plus ``DRAFT_EXTRA``'s row (the first token's) and column (EXTRA_LOGIT)."""
    V = len(DRAFT_IDS)
    inv = torch.tensor(DRAFT_IDS).argsort()  # draft id -> target id
    out = torch.full((V + 1, V + 1), EXTRA_LOGIT, dtype=table.dtype)
    out[:V, :V] = table[inv][:, inv]
    out[V, :V] = table[inv[0], inv]
    return out


def chain_tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target table [V, V], draft table [V, V]) float64 logits: row i = the logits after token i."""
    g = torch.Generator().manual_seed(seed)
    target = 1.2 * torch.randn(VG, VG, generator=g, dtype=torch.float64)
    draft = target + 0.9 * torch.randn(VG, VG, generator=g, dtype=torch.float64)
    return target, draft


def markov_llama(table: torch.Tensor):
    """A ``LlamaForCausalLM`` (fp32, eval) whose logits after token i are ``table[i]`` [V, V]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    V = table.shape[0]
    cfg = LlamaConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    c = 10.0
    f = c / math.sqrt(c * c / HIDDEN + cfg.rms_norm_eps)  # the final norm's output scale
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.model.embed_tokens.weight[:, :V].copy_(c * torch.eye(V))
        m.model.norm.weight.fill_(1.0)
        for layer in m.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        m.lm_head.weight[:, :V].copy_((table.T / f).float())
    m.generation_config.pad_token_id = None
    m.generation_config.eos_token_id = None
    return m


def continuation_law(table: torch.Tensor, last: int, L: int, temperature: float) -> torch.Tensor:
    """[V ** L] float64: the law of x_1..x_L (index sum_i x_i V^(L-i)) after token ``last``."""
    step = torch.softmax(table / temperature, -1)
    V = table.shape[0]
    law = torch.zeros(V ** L, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=L):
        pr, prev = 1.0, last
        for x in seq:
            pr *= float(step[prev, x])
            prev = x
        law[sum(x * V ** (L - 1 - i) for i, x in enumerate(seq))] = pr
    return law


def greedy_path(table: torch.Tensor, last: int, L: int) -> list:
    """The L tokens of the chain's greedy path after token ``last`` (each the argmax of its row)."""
    out = []
    for _ in range(L):
        last = int(table[last].argmax())
        out.append(last)
    return out


def continuation_counts(seqs: list, V: int, L: int) -> torch.Tensor:
    """[V ** L] int64: how many of ``seqs`` (continuations of L ids in [0, V)) are each sequence, at
    ``continuation_law``'s index sum_i x_i V^(L-i); a continuation of another length or with an id
    outside [0, V) raises ValueError naming it."""
    bad = [s for s in seqs if len(s) != L or any(not 0 <= t < V for t in s)]
    if bad:
        raise ValueError(f"a continuation must be {L} ids in [0, {V}), got {bad[0]!r} ({len(bad)} of {len(seqs)})")
    idx = torch.tensor([sum(t * V ** (L - 1 - i) for i, t in enumerate(s)) for s in seqs], dtype=torch.int64)
    return torch.bincount(idx, minlength=V ** L)
