"""The generator audit: whole speculative generators run end to end on models whose law of
continuations is known exactly.

The models are Markov chains in Hugging Face format: a one-layer ``LlamaForCausalLM`` whose
attention and MLP write nothing (``o_proj`` and ``down_proj`` are zero), whose embedding of token
i is c e_i, so that the final RMSNorm gives f e_i and the LM head's column i, set to table[i] / f,
makes the logits at every position table[previous token].  The target's continuation x_1..x_L of
a prompt ending in x_0 then has law prod_i softmax(table_t[x_{i-1}] / T)[x_i]; the draft is
another chain (table_d), so drafts are often rejected.  A generator passes when the histogram
of its N continuations fits that law (chi-square, bins pooled to expected counts >= 5, fail if
p < 1e-4).  The mutant: speculative decoding of the same chains by the audit's own sampler with
a wrong acceptance rule (``sampler.MUTATIONS['accept_p']``).

Generators: ``ours`` (``SpeculativeDecoder``, the N prompts as one batch), ``transformers``
(``generate(assistant_model=..., do_sample=True)``, batch 1, N times) and ``vllm`` (``vllm.LLM``
with ``speculative_config={"method": "draft_model", ...}``, run by ``vllm_generate_worker`` in
vLLM's environment; K = 0 runs the target alone, a control of the engine's own sampling).

Across tokenizers: the same chains, each token a character of ``CHARS`` (``chain_tokenizers``),
the draft's tokenizer numbering the characters in another order (``DRAFT_IDS``) and its model the
draft chain over its own ids.  ``ours-cross`` (``SpeculativeDecoder(..., tokenizer=,
draft_tokenizer=, vocabulary=)``, the intersection and the string level, N prompts as one batch)
and ``transformers-usd`` (``generate(assistant_model=, tokenizer=, assistant_tokenizer=,
do_sample=True)``: transformers' UniversalSpeculativeDecodingGenerator, batch 1, N times).
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import Optional

import torch

from .adapters import AdapterUnavailable
from .checks import ALPHA
from .laws import chi2_pvalue
from .protocol import make_params
from .hf_usd import reindexed_target_logits, usd_misplaced_rows
from .sampler import reference_verify

__all__ = ["GENERATORS", "markov_llama", "chain_tables", "chain_tokenizers", "continuation_law", "run_generator_audit"]

GENERATORS = ("ours", "transformers", "vllm", "ours-cross", "transformers-usd")
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


def _index(seqs: list, V: int, L: int) -> torch.Tensor:
    bad = [s for s in seqs if len(s) != L or any(not 0 <= t < V for t in s)]
    if bad:
        raise ValueError(f"a continuation must be {L} ids in [0, {V}), got {bad[0]!r} ({len(bad)} of {len(seqs)})")
    return torch.tensor([sum(t * V ** (L - 1 - i) for i, t in enumerate(s)) for s in seqs], dtype=torch.int64)


def simulate(target: torch.Tensor, draft: torch.Tensor, n: int, L: int, K: int, temperature: float,
             mutation: Optional[str] = None, seed: int = 0) -> list:
    """n continuations by speculative decoding of the chains (tables [V, V]) with the audit's own
    sampler (``mutation``: one of its mutants), K drafts a step: the reference generator."""
    g = torch.Generator().manual_seed(seed)
    V = target.shape[0]
    out = [[] for _ in range(n)]
    last = torch.full((n,), PROMPT[-1], dtype=torch.int64)
    qt = torch.softmax(draft / temperature, -1)
    while min(len(o) for o in out) < L:
        drafts, probs, prev = [], [], last
        for _ in range(K):
            d = torch.multinomial(qt[prev], 1, generator=g)[:, 0]
            drafts.append(d)
            probs.append(qt[prev])
            prev = d
        x = torch.stack(drafts, 1)  # [n, K]
        ctx = torch.cat([last[:, None], x], 1)  # [n, K+1]: the tokens whose successors are verified
        logits = target[ctx].float()  # [n, K+1, V]
        params = make_params(n, K, temperature=temperature)
        torch.manual_seed(int(torch.randint(0, 2 ** 31, (), generator=g)))
        tokens, num = reference_verify(logits, x, torch.stack(probs, 1).float(), params, mutation=mutation)
        for b in range(n):
            out[b].extend(tokens[b, :int(num[b]) + 1].tolist())
        last = torch.tensor([o[-1] for o in out])
    return [o[:L] for o in out]


def _ours(target_m, draft_m, n, L, K, temperature, seed):
    from ..decoding.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(draft=draft_m, target=target_m, tokenizer=None, device="cpu", dtype="float32")
    res = dec.generate([list(PROMPT)] * n, max_new_tokens=L, num_draft_tokens=K, temperature=temperature,
                       seed=seed)
    return res.token_ids


def _transformers(target_m, draft_m, n, L, K, temperature, seed, tokenizers=None, fix_scatter=False):
    """``target.generate(assistant_model=draft, do_sample=True)`` n times (batch 1), counting the
    calls of its speculative sampling (``transformers.generation.utils._speculative_sampling``):
    a run that never verifies a draft would test nothing.  ``tokenizers`` (target's, draft's):
    passed as ``tokenizer=`` and ``assistant_tokenizer=``, which makes it transformers' universal
    speculative decoding (USD); ``fix_scatter``: USD with ``hf_usd.reindexed_target_logits`` in
    ``get_target_logits``' place.  Returns (continuations, what the report adds to its detail)."""
    import transformers.generation.utils as tgu
    from transformers.generation.candidate_generator import AssistantToTargetTranslator, AssistantVocabTranslatorCache
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
    real, steps = tgu._speculative_sampling, []

    def counting(*a, **k):
        steps.append(1)
        return real(*a, **k)

    theirs = AssistantToTargetTranslator.get_target_logits
    tgu._speculative_sampling = counting
    if fix_scatter:
        AssistantToTargetTranslator.get_target_logits = (
            lambda tr, logits: reindexed_target_logits(tr, logits) if tr.assistant_prune_lm_head else theirs(tr, logits))
    torch.manual_seed(seed)
    draft_m.generation_config.num_assistant_tokens = K
    draft_m.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.tensor([PROMPT])
    extra = {} if tokenizers is None else dict(tokenizer=tokenizers[0], assistant_tokenizer=tokenizers[1])
    out = []
    try:
        with torch.no_grad():
            for _ in range(n):
                g = target_m.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft_m,
                                      do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=L,
                                      min_new_tokens=L, **extra)
                out.append(g[0, len(PROMPT):].tolist())
    finally:
        tgu._speculative_sampling = real
        AssistantToTargetTranslator.get_target_logits = theirs
    if not steps:
        raise RuntimeError("transformers' assisted generation never called _speculative_sampling")
    note = f", {len(steps)} calls of _speculative_sampling"
    tr = None if tokenizers is None else AssistantVocabTranslatorCache._cache.get(tokenizers[0], {}).get(tokenizers[1])
    if tr is not None and getattr(tr, "assistant_prune_lm_head", False):
        wrong, rows = usd_misplaced_rows(tr)
        note += (f"; its get_target_logits {'would write' if fix_scatter else 'writes'} {wrong} of the draft's {rows} "
                 f"pruned LM-head rows to another token's id" + (" (reindexed here)" if fix_scatter else ""))
    return out, note


def _ours_cross(target_m, draft_m, n, L, K, temperature, seed, vocabulary="intersection"):
    """``SpeculativeDecoder`` over the chain tokenizers, the n prompts as one batch.  Returns
    (continuations, what the report adds to its detail)."""
    from ..decoding.decoder import SpeculativeDecoder

    tt, dt = chain_tokenizers()
    dec = SpeculativeDecoder(draft=draft_m, target=target_m, tokenizer=tt, draft_tokenizer=dt, vocabulary=vocabulary,
                             device="cpu", dtype="float32")
    res = dec.generate([list(PROMPT)] * n, max_new_tokens=L, num_draft_tokens=K, temperature=temperature,
                       seed=seed)
    used = res.stats.vocabulary
    if used != vocabulary:
        raise RuntimeError(f"SpeculativeDecoder used vocabulary {used!r}, not {vocabulary!r}")
    if not res.stats.drafted_tokens:
        raise RuntimeError("SpeculativeDecoder drafted no token across the tokenizers")
    return res.token_ids, f", {res.stats.drafted_tokens} tokens drafted, {res.stats.accepted_tokens} accepted"


def _vllm(target_m, draft_m, n, L, K, temperature, seed, python=None, fix_expand=False, max_num_seqs=256):
    """vLLM's engine (``vllm_generate_worker``) on the models saved to a temporary directory, run
    by the interpreter that has vLLM (``vllm_bridge.find_vllm_python``)."""
    import os
    import subprocess
    import tempfile

    from .vllm_bridge import ROOT

    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, "target"), os.path.join(d, "draft"), os.path.join(d, "out.pt")]
        target_m.save_pretrained(paths[0])
        draft_m.save_pretrained(paths[1])
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [python or sys.executable, "-m", "specdec_kernels.audit.vllm_generate_worker", paths[0], paths[1],
               str(n), str(L), str(K), str(temperature), str(max_num_seqs), paths[2]]
        cmd += ["fix-expand"] if fix_expand else []
        proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True)
        if not os.path.exists(paths[2]):
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"the vLLM engine worker exited with status {proc.returncode}: {tail}")
        res = torch.load(paths[2], weights_only=False)
    if "error" in res:
        raise RuntimeError(res["error"])
    _vllm.versions = res["versions"]
    return res["continuations"]


def run_generator_audit(name: str, trials: int, temperature: float = 1.0, K: int = 2, mutants: bool = True,
                        vllm_python: Optional[str] = None, fix_expand: bool = False, one_batch: bool = False,
                        vocabulary: str = "intersection", fix_usd: bool = False) -> list:
    """The generator audit's row (a list of one dict, as the verifier audit's rows) for generator
    ``name`` (``GENERATORS``): ``trials`` continuations of length ``LENGTH`` after ``PROMPT``.
    ``vllm_python``, ``fix_expand``: as for the vLLM verifier (``vllm_bridge``).  ``one_batch``
    (vLLM): every request in one step (``max_num_seqs`` >= trials; by default 256, so that new
    requests' prefills share steps with other requests' speculative steps, as in serving).
    ``vocabulary`` (``ours-cross``): "intersection" or "string"; ``fix_usd`` (``transformers-usd``):
    its draft logits scattered by ``reindexed_target_logits``."""
    if name not in GENERATORS:
        raise ValueError(f"--generator must be one of {GENERATORS}, got {name!r}")
    if vocabulary not in ("intersection", "string"):
        raise ValueError(f"vocabulary must be 'intersection' or 'string', got {vocabulary!r}")
    if K == 0 and name != "vllm":
        raise ValueError(f"K = 0 (the target alone) is the vLLM engine's control only, got generator {name!r}")
    python = None
    if name == "vllm":
        from .vllm_bridge import find_vllm_python

        python = find_vllm_python(vllm_python)
    target_t, draft_t = chain_tables()
    law = continuation_law(target_t, PROMPT[-1], LENGTH, temperature)
    what = f"K={K}" if K else "the target alone, no speculation: a control of the engine's own sampling"
    if one_batch:
        what += ", all requests in one batch"
    cross = name in ("ours-cross", "transformers-usd")
    if cross:
        what += (", the draft over another tokenizer" +
                 (f", vocabulary={vocabulary!r}" if name == "ours-cross" else ", transformers' intersection"
                  + (" with its scatter reindexed" if fix_usd else "")))
    row = dict(case=f"continuations_L{LENGTH}_T{temperature:g}" + ("" if K else "_target_alone")
               + ("_one_batch" if one_batch else "") + (f"_{vocabulary}" if name == "ours-cross" else ""),
               shows=f"the law of whole continuations of length {LENGTH} (V={VG}, {what}, T={temperature:g}) equals "
                     f"the target chain's", bound="chi-square over the V^L continuations "
               "(pooled to expected >= 5), fail if p < 1e-4", mutant="accept_p",
               mutant_says="speculative decoding of the same chains, accepting a draft with probability p(x)")
    try:
        draft_m = markov_llama(draft_chain_in_draft_ids(draft_t) if cross else draft_t)
        models = (markov_llama(target_t), draft_m, trials, LENGTH, K, temperature, 1234)
        steps = ""  # what the generator adds to the detail
        if name == "vllm":
            seqs = _vllm(*models, python=python, fix_expand=fix_expand,
                         max_num_seqs=max(trials, 256) if one_batch else 256)
        elif name == "ours":
            seqs = _ours(*models)
        elif name == "ours-cross":
            seqs, steps = _ours_cross(*models, vocabulary=vocabulary)
        else:
            seqs, steps = _transformers(*models, tokenizers=chain_tokenizers() if cross else None, fix_scatter=fix_usd)
        stat, p, dof = chi2_pvalue(torch.bincount(_index(seqs, VG, LENGTH), minlength=VG ** LENGTH), law)
        row.update(verdict="pass" if p >= ALPHA else "FAIL", statistic=stat, pvalue=p,
                   detail=f"{trials} continuations{steps}: chi2 {stat:.4g} (dof {dof}), p {p:.3g}")
    except AdapterUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - the generator's error, reported as the case's
        row.update(verdict="error", statistic=None, pvalue=None,
                   detail=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
    if mutants and K:  # (the control has no verification to get wrong)
        seqs = simulate(target_t, draft_t, trials, LENGTH, K, temperature, mutation="accept_p", seed=5)
        _, mp, _ = chi2_pvalue(torch.bincount(_index(seqs, VG, LENGTH), minlength=VG ** LENGTH), law)
        row.update(mutant_verdict="pass" if mp >= ALPHA else "FAIL", mutant_pvalue=mp)
    return [row]
