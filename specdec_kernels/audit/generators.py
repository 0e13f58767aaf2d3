"""The generator audit: whole speculative generators run end to end on models whose law of
continuations is known exactly.

The models (``chains``) are Markov chains in Hugging Face format: a one-layer ``LlamaForCausalLM`` whose
attention and MLP write nothing (``o_proj`` and ``down_proj`` are zero), whose embedding of token
i is c e_i, so that the final RMSNorm gives f e_i and the LM head's column i, set to table[i] / f,
makes the logits at every position table[previous token].  The target's continuation x_1..x_L of
a prompt ending in x_0 then has law prod_i softmax(table_t[x_{i-1}] / T)[x_i]; the draft is
another chain (table_d), so drafts are often rejected.  A generator passes when the histogram
of its N continuations fits that law (chi-square, bins pooled to expected counts >= 5, fail if
p < 1e-4); at temperature 0 every continuation must be the target chain's greedy path (an exact
case: one differing row fails).  The mutant (``MUTANTS``, one per generator): speculative
decoding of the same chains by the audit's own code with one wrong rule: a wrong acceptance rule
(``sampler.MUTATIONS['accept_p']``), block verification's extra token from the token method's
residual (``block.MUTATIONS``), a tree whose siblings are tested without removing the rejected
ones' mass (``tree.MUTATIONS``); at temperature 0, greedy decoding that accepts every draft.

Generators: ``ours`` (``SpeculativeDecoder``, the N prompts as one batch), ``ours-block`` (the
same with ``verification="block"``), ``ours-tree`` (``SpeculativeDecoder(tree=TREE)``, rows one
after the other as its tree loop runs them), ``transformers``
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

import sys
from typing import Optional

import torch

from . import block, tree
from .adapters import AdapterUnavailable
from .chains import (LENGTH, PROMPT, VG, chain_tables, chain_tokenizers, continuation_counts, continuation_law,
                     draft_chain_in_draft_ids, greedy_path, markov_llama)
from .checks import ALPHA
from .laws import chi2_pvalue
from .protocol import make_params
from .hf_usd import reindexed_target_logits, usd_misplaced_rows
from .sampler import MUTATIONS, reference_verify

__all__ = ["GENERATORS", "GREEDY_GENERATORS", "MUTANTS", "TREE", "simulate", "greedy_outcome", "run_generator_audit"]

GENERATORS = ("ours", "transformers", "vllm", "ours-cross", "transformers-usd", "ours-block", "ours-tree")
GREEDY_GENERATORS = ("ours", "ours-block", "ours-tree")  # those run at temperature 0 (checked exactly)
TREE = (2, 2)  # ours-tree's static tree: 2 children of the root, 2 of each (6 nodes a step, depth 2)
# each generator's mutant (a key of sampler.MUTATIONS, block.MUTATIONS or tree.MUTATIONS); at temperature 0
# every generator's is GREEDY_MUTANT
MUTANTS = {"ours": "accept_p", "transformers": "accept_p", "vllm": "accept_p", "ours-cross": "accept_p",
           "transformers-usd": "accept_p", "ours-block": "block_residual_token", "ours-tree": "tree_siblings_unchanged"}
GREEDY_MUTANT = "greedy_accept_all"
MUTANT_SAYS = {
    "accept_p": "speculative decoding of the same chains, accepting a draft with probability p(x)",
    "block_residual_token": "block verification of the same chains (the audit's block sampler), "
                            + block.MUTATIONS["block_residual_token"],
    "tree_siblings_unchanged": f"tree speculative decoding of the same chains (tree {TREE}, the audit's own walk) that "
                               + tree.MUTATIONS["tree_siblings_unchanged"],
    GREEDY_MUTANT: "greedy speculative decoding of the same chains that accepts every draft (the draft chain's greedy "
                   "tokens, then the target's argmax)",
}


def simulate(target: torch.Tensor, draft: torch.Tensor, n: int, L: int, K: int, temperature: float,
             mutation: Optional[str] = None, seed: int = 0, method: str = "token") -> list:
    """n continuations by speculative decoding of the chains (tables [V, V]) with the audit's own
    sampler (``mutation``: one of its mutants), K drafts a step: the reference generator.
    ``method`` "block": block verification by the audit's block sampler (``block.block_verify``,
    ``mutation`` one of ``block.MUTATIONS``)."""
    verify = block.block_verify if method == "block" else reference_verify
    g = torch.Generator().manual_seed(seed)
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
        params = make_params(n, K, temperature=temperature, method=method)
        torch.manual_seed(int(torch.randint(0, 2 ** 31, (), generator=g)))
        tokens, num = verify(logits, x, torch.stack(probs, 1).float(), params, mutation=mutation)
        for b in range(n):
            out[b].extend(tokens[b, :int(num[b]) + 1].tolist())
        last = torch.tensor([o[-1] for o in out])
    return [o[:L] for o in out]


def _greedy_accept_all(target: torch.Tensor, draft: torch.Tensor, n: int, L: int, K: int) -> list:
    """n continuations (all one) by greedy speculative decoding that accepts every draft: the
    draft chain's K greedy tokens, then the target's argmax after the last, a step at a time."""
    out, last = [], PROMPT[-1]
    while len(out) < L:
        for _ in range(K):
            last = int(draft[last].argmax())
            out.append(last)
        last = int(target[last].argmax())
        out.append(last)
    return [out[:L]] * n


def _ours(target_m, draft_m, n, L, K, temperature, seed, verification="token", tree_shape=None):
    """``SpeculativeDecoder`` on the n prompts as one batch (``verification``: "token" or "block";
    ``tree_shape``: tree drafting, whose loop runs the rows one after the other), row p seeded
    seed + p.  Returns (continuations, what the report adds to its detail); a run that drafted
    nothing, or accepted nothing, tested nothing and raises."""
    from ..decoding.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(draft=draft_m, target=target_m, tokenizer=None, device="cpu", dtype="float32",
                             verification=verification, tree=tree_shape)
    res = dec.generate([list(PROMPT)] * n, max_new_tokens=L, num_draft_tokens=K, temperature=temperature,
                       seed=seed)
    drafted, accepted = res.stats.drafted_tokens, res.stats.accepted_tokens
    what = f"tree {tree_shape}" if tree_shape is not None else f"{verification} verification"
    if not drafted or not accepted:
        raise RuntimeError(f"SpeculativeDecoder ({what}) drafted {drafted} tokens and accepted {accepted}: "
                           f"nothing was verified")
    return res.token_ids, f", {drafted} tokens drafted, {accepted} accepted"


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
            lambda tr, logits: reindexed_target_logits(tr, logits) if tr.assistant_prune_lm_head
            else theirs(tr, logits))
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
    its draft logits scattered by ``reindexed_target_logits``.  ``temperature`` 0 (the generators
    of ``GREEDY_GENERATORS``): an exact case, every continuation the target chain's greedy path.
    The mutant is the generator's (``MUTANTS``; ``GREEDY_MUTANT`` at temperature 0), simulated by
    the audit's own code on the same chains with ``trials`` continuations."""
    if name not in GENERATORS:
        raise ValueError(f"--generator must be one of {GENERATORS}, got {name!r}")
    if temperature < 0 or (temperature == 0 and name not in GREEDY_GENERATORS):
        raise ValueError(f"temperature must be > 0 (or 0, greedy, for {GREEDY_GENERATORS}), got {temperature} "
                         f"for generator {name!r}")
    if vocabulary not in ("intersection", "string"):
        raise ValueError(f"vocabulary must be 'intersection' or 'string', got {vocabulary!r}")
    if K == 0 and name != "vllm":
        raise ValueError(f"K = 0 (the target alone) is the vLLM engine's control only, got generator {name!r}")
    python = None
    if name == "vllm":
        from .vllm_bridge import find_vllm_python

        python = find_vllm_python(vllm_python)
    target_t, draft_t = chain_tables()
    greedy = temperature == 0
    law = None if greedy else continuation_law(target_t, PROMPT[-1], LENGTH, temperature)
    path = greedy_path(target_t, PROMPT[-1], LENGTH)
    what = f"K={K}" if K else "the target alone, no speculation: a control of the engine's own sampling"
    if name == "ours-block":
        what += ", block verification"
    if name == "ours-tree":
        what = f"tree {TREE} ({tree_nodes(TREE)} nodes a step, depth {len(TREE)})"
    if one_batch:
        what += ", all requests in one batch"
    cross = name in ("ours-cross", "transformers-usd")
    if cross:
        what += (", the draft over another tokenizer" +
                 (f", vocabulary={vocabulary!r}" if name == "ours-cross" else ", transformers' intersection"
                  + (" with its scatter reindexed" if fix_usd else "")))
    mutation = GREEDY_MUTANT if greedy else MUTANTS[name]
    row = dict(case=f"continuations_L{LENGTH}_" + ("greedy" if greedy else f"T{temperature:g}")
               + ("" if K else "_target_alone") + ("_one_batch" if one_batch else "")
               + (f"_{vocabulary}" if name == "ours-cross" else ""),
               shows=(f"every continuation of length {LENGTH} (V={VG}, {what}, greedy) is the target chain's greedy "
                      f"path {path}" if greedy else
                      f"the law of whole continuations of length {LENGTH} (V={VG}, {what}, T={temperature:g}) equals "
                      f"the target chain's"),
               bound="exact: 0 continuations differ" if greedy else
               "chi-square over the V^L continuations (pooled to expected >= 5), fail if p < 1e-4",
               mutant=mutation, mutant_says=MUTANT_SAYS[mutation])
    try:
        draft_m = markov_llama(draft_chain_in_draft_ids(draft_t) if cross else draft_t)
        models = (markov_llama(target_t), draft_m, trials, LENGTH, K, temperature, 1234)
        steps = ""  # what the generator adds to the detail
        if name == "vllm":
            seqs = _vllm(*models, python=python, fix_expand=fix_expand,
                         max_num_seqs=max(trials, 256) if one_batch else 256)
        elif name in ("ours", "ours-block", "ours-tree"):
            seqs, steps = _ours(*models, verification="block" if name == "ours-block" else "token",
                                tree_shape=TREE if name == "ours-tree" else None)
        elif name == "ours-cross":
            seqs, steps = _ours_cross(*models, vocabulary=vocabulary)
        else:
            seqs, steps = _transformers(*models, tokenizers=chain_tokenizers() if cross else None, fix_scatter=fix_usd)
        if greedy:
            row.update(greedy_outcome(seqs, path, steps))
        else:
            stat, p, dof = chi2_pvalue(continuation_counts(seqs, VG, LENGTH), law)
            row.update(verdict="pass" if p >= ALPHA else "FAIL", statistic=stat, pvalue=p,
                       detail=f"{trials} continuations{steps}: chi2 {stat:.4g} (dof {dof}), p {p:.3g}")
    except AdapterUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - the generator's error, reported as the case's
        row.update(verdict="error", statistic=None, pvalue=None,
                   detail=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
    if mutants and K:  # (the control has no verification to get wrong)
        seqs = _mutant_continuations(mutation, target_t, draft_t, trials, K, temperature)
        if greedy:
            mp = greedy_outcome(seqs, path)["pvalue"]
        else:
            _, mp, _ = chi2_pvalue(continuation_counts(seqs, VG, LENGTH), law)
        row.update(mutant_verdict="pass" if mp >= ALPHA else "FAIL", mutant_pvalue=mp)
    return [row]


def greedy_outcome(seqs: list, path: list, note: str = "") -> dict:
    """The exact greedy case's verdict, statistic (rows that differ), p-value (0 or 1) and detail
    for continuations ``seqs`` against the target chain's greedy ``path`` (ids checked as
    ``continuation_counts`` checks them)."""
    continuation_counts(seqs, VG, len(path))
    wrong = sum(list(s) != path for s in seqs)
    first = next((list(s) for s in seqs if list(s) != path), None)
    return dict(verdict="FAIL" if wrong else "pass", statistic=wrong, pvalue=0.0 if wrong else 1.0,
                detail=f"{len(seqs)} continuations{note}: {wrong} differ from the greedy path {path}"
                       + (f" (first: {first})" if wrong else ""))


def tree_nodes(branching: tuple) -> int:
    """The number of nodes of a static tree (the root not counted)."""
    total, width = 0, 1
    for b in branching:
        width *= b
        total += width
    return total


def _mutant_continuations(mutation: str, target_t, draft_t, n: int, K: int, temperature: float) -> list:
    """n continuations of length LENGTH by the audit's own simulation with ``mutation``."""
    if mutation == GREEDY_MUTANT:
        return _greedy_accept_all(target_t, draft_t, n, LENGTH, K)
    if mutation in tree.MUTATIONS:
        return tree.simulate_tree(target_t, draft_t, n, LENGTH, TREE, PROMPT[-1], temperature, mutation=mutation,
                                  seed=5)
    if mutation in block.MUTATIONS:
        return simulate(target_t, draft_t, n, LENGTH, K, temperature, mutation=mutation, seed=5, method="block")
    if mutation in MUTATIONS:
        return simulate(target_t, draft_t, n, LENGTH, K, temperature, mutation=mutation, seed=5)
    raise ValueError(f"unknown mutant {mutation!r}")
