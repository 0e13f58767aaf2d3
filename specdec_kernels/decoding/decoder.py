"""``SpeculativeDecoder``: exact speculative decoding of any pair of Hugging Face causal LMs.

Each step, a cheap *drafter* (a small model, or prompt lookup) proposes K tokens per row; the
*target* scores all of them in one forward over K + 1 positions; ``fused_verify`` keeps a
prefix of the drafts and adds one token (Leviathan et al. 2023; Chen et al. 2023):

- *accepted*: a draft the verifier keeps (probability min(1, p(x) / q(x)));
- *recovered*: after the first rejection, a token drawn from the residual norm(max(0, p - q));
- *bonus*: when all K_b drafts of a row are accepted, a token drawn from the target itself.

The emitted tokens are distributed exactly as sampling from the target alone (greedily: equal
to the target's greedy decoding), whatever the drafter proposes.

Cache layout (ragged batches without moving old data).  Both models keep a ``DynamicCache``
whose rows are *left-aligned*: row b's tokens occupy columns [0, len_b); columns [len_b, T)
are a masked gap.  Every forward appends its new columns at T (the same for every row) with an
explicit 2D ``attention_mask`` and ``position_ids`` (row b's new tokens get positions len_b,
len_b + 1, ...).  After verifying [last, x_1 .. x_K] at columns T .. T+K, row b keeps n_b + 1 of
them: they are compacted down to len_b (``compact_dynamic_cache_``), len_b grows by n_b + 1 and
the cache is cropped to max_b len_b.  The emitted recovered/bonus token is not cached: it is
the next step's ``last``.  The draft model does the same with its own cache: it ran K one-token
forwards on [last, x_1 .. x_{K-1}] and keeps min(n_b + 1, K) of them; a row that accepted all K
lacks x_K, so its next step *catches up* by feeding [x_K, last] (rows that need no catch-up
feed a masked gap column and ``last``).  A K = 0 step (``"auto"``) runs no draft forward: what the
draft has not taken waits, and its next step feeds it all in one right-aligned block before its
drafts.  Nothing already cached is ever fed again.
Finished rows are sliced out of both caches.  This module holds the loop and the target's side
(``_step``: draft -> verify -> roll back -> emit); each drafter (``drafters/``: one interface in
``base.py``) owns its forwards and cache bookkeeping, the draft's warp and random numbers are in
``drafters/sampling.py``, the call's state in ``state.py``, the prefill in ``prefill.py``, what
each row emits in ``emit.py``, the checks of the arguments in ``arguments.py``, transformers'
arguments (``GenerationConfig``, streamers, stopping criteria, chat messages) in
``transformers_args.py``, the DynamicCache helpers in ``ops/kv/cache.py``.

Host synchronisation: one device-to-host copy per step (the accepted counts and tokens, needed
to detokenise, check stop strings and EOS, and crop the caches); everything else stays on the
device.

Randomness: row p of a call uses seed ``seed + p`` (or ``seed[p]``).  The verifier draws from
Philox at (seed_p, step); the draft samples by inverse CDF from counter-based hashes of
(a key derived from seed_p, step, draft position).  So a row's output depends only on its
prompt, its seed and K (with ``"auto"``, K comes from measured times: a seeded sampling run is then
reproducible in distribution, not token for token), never on the other rows: decoding prompt p
alone with seed ``seed + p`` gives the same tokens as in the batch (at a fixed K), provided the
models give that row the same logits, bit for bit, in the batch and alone.  The tests check it
on their models.  A model's forward need not be batch-invariant: in the prefill, torch's matmul
over more rows than ``skinny_linear`` takes, and attention over a left-padded or gapped cache,
may round a row's logits differently in the last bit, and a token then differs where a uniform
falls within that rounding of a decision boundary (rare: about 1e-6 of the draws at one step of
a tiny random model, docs/history/measurements.md).  The randomness and the verification never
depend on the other rows.

This module is long for one reason: it is the public class, and about 200 of its ~650 lines
document its ~30 arguments (``SpeculativeDecoder``'s and ``generate``'s docstrings, where users
read them).  The loop itself is short: ``_step`` reads top to bottom in one screen (draft,
verify, the one host sync, roll back, emit), and everything it delegates lives in a module of
its own.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from typing import Any, Optional, Sequence, TextIO, Union

import torch

from ..ops.host import to_device
from ..ops.kv.cache import compact_dynamic_cache_, crop_cache_
from .arguments import as_float
from .drafters.base import Drafter
from .drafters.registry import drafter_kind
from .drafters.vocab import resolve_draft_vocab
from .drafters.sampling import warp_probs  # noqa: F401  (public here: the draft's warp)
from .emit import emit_rows, stop_cut
from .pair import device_of, load_pair
from .prefill import prefill_
from .runners import FeatureRunner, ModelRunner
from .state import DecodeState, GenerationResult, start_state
from .transformers_args import decoder_arguments
from .transformers_rows import check_streamer

__all__ = ["SpeculativeDecoder", "GenerationResult", "warp_probs"]


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# The decoder
# ----------------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """Exact speculative decoding with a draft model (or prompt lookup) and a target model.

    draft, target: a model name/path (loaded with ``AutoModelForCausalLM``) or a model; with
    neither (and no drafter), the embedded default pair of ``specdec_kernels.models``.
    ``draft=None`` drafts by prompt lookup (``drafter="prompt_lookup"``); ``drafter="feature"``
    takes a ``specdec_kernels.decoding.drafters.feature_model.FeatureDraft`` (or its directory) as ``draft``: a draft
    that reads the target's hidden states, trained for that target (with neither draft nor
    target: the embedded target with its embedded feature draft).  ``drafter=<a Drafter instance>``
    (``specdec_kernels.decoding.drafters.base.Drafter``) drafts through that object, which brings
    what it drafts with (no ``draft``); ``self.drafter`` is the drafter's name.  tokenizer: a
    tokenizer or path (default: the target's, when the target is given by path); without one,
    prompts must be token ids.

    draft_tokenizer, vocabulary: a draft model may have a tokenizer of its own
    (``drafters/cross.py``).  draft_tokenizer: a tokenizer or path (default: the draft's, when the
    draft is given by path).  vocabulary: ``"auto"`` (default): ``"shared"`` when the two
    tokenizers' vocabularies are equal or the draft's is not known, else a draft over another
    tokenizer: greedy, its text re-encoded by the target's tokenizer; sampling, through the tokens
    both write the same way when they hold at least half the draft's probability at the start of
    a text (``"intersection"``: its
    distribution restricted there and renormalised is the verify's q), else its text re-encoded by
    the target's tokenizer (``"string"``: deterministic proposals).  ``"shared"``: one vocabulary
    (the target's may be padded beyond the draft's; tokenizers that differ are refused).  Every
    way is exact; ``stats.vocabulary`` says which was used, ``self.vocabulary`` what was asked.
    device, dtype: where and in which dtype to put the models (default: where they are; both
    must be on the same device).
    cpu_linear: how the models' fp32 ``nn.Linear`` layers run on the CPU during ``generate``:
    ``"skinny"`` routes inputs of at most ``cpu.skinny_linear.default_max_rows()`` rows (16; 24 with
    AVX-512) through ``torch.ops.specdec.skinny_linear``
    (``specdec_kernels.cpu.skinny_linear``), which streams the weights once for all K+1 verified
    positions (torch's SGEMM takes 2-3x a decode step there; bench/cpu/bench_skinny_linear.py) and
    whose result for a row does not depend on the other rows; ``"torch"`` leaves torch's
    ``linear``; ``"auto"`` (default) is ``"skinny"`` when the
    models are fp32 on the CPU and the C++ extension is built, else ``"torch"``.  The layers are
    patched only for the duration of each ``generate``/``generate_target_only`` call.

    lean_forward: run the decode steps (the draft's tokens, the target's verify) of a plain
    ``LlamaForCausalLM`` with ``sdpa`` attention on the CPU through
    ``specdec_kernels.cpu.lean_forward.LeanLlamaStep``: the model's own modules in the same order,
    the same bits, without Hugging Face's per-call overhead (a few percent of a small model's decode
    step on the CPU: docs/benchmarks.md, "Lean Llama decode step").  Checked at each ``generate``;
    other models, devices or attention implementations keep their forward
    (``lean_status()`` says which path each model takes and why).

    weight_cache: where ``"skinny"`` keeps its fp16 weight copies for the next process over the
    same weights (``specdec_kernels.cpu.weight_cache``: each copy checked in full before use): a
    directory, ``True`` (``~/.cache/specdec-kernels/fp16-weights``), ``False`` (memory only) or
    None (default: ``$SPECDEC_WEIGHT_CACHE``, unset meaning memory only).

    accelerator: the CPU accelerators as one object (``specdec_kernels.cpu.CpuAccelerator``, or
    one with its methods and ``lean_forward`` attribute) instead of ``cpu_linear``,
    ``lean_forward`` and ``weight_cache`` (None, default: built from those; passing both is refused).

    draft_vocab: the tokens the draft may propose (``specdec_kernels.decoding.drafters.vocab``): its logits
    are computed for those rows of its output layer only and its distribution is zero elsewhere
    (exactness does not depend on the set; the residual covers the rest).  ``"auto"`` (default):
    the ``draft_vocab.json`` (or an older directory's ``draft_vocab.safetensors``) of the local
    directory the draft was loaded from, if it has one (the embedded draft ships 12,288 tokens), else the whole
    vocabulary; None: the whole vocabulary; a path (a directory or the file); or the token ids (a 1-D tensor or a
    list).  ``self.draft_vocab`` is what was chosen (sorted int64 ids, or None).

    verify_backend: ``fused_verify``'s backend for every step: ``"auto"`` (default: the Triton
    kernel on CUDA, the torch path on the CPU), ``"triton"`` (the kernel; on CPU tensors only
    under ``TRITON_INTERPRET=1``, as the tests run the decoder's loop through it) or ``"torch"``.
    The two give the same tokens from the same random numbers.

    verification: how each step's drafts are verified: ``"token"`` (default: token by token,
    Leviathan et al. 2023) or ``"block"`` (block verification, Sun et al. 2025: the drafts are
    judged jointly; the same target distribution, at least as many drafts accepted on average;
    ``fused_verify(method="block")``).  Greedy rows give the same tokens either way.
    """

    def __init__(self, draft=None, target=None, tokenizer=None, device=None, dtype=None, *,
                 drafter: Union[str, Drafter, None] = None, max_ngram: Optional[int] = None, cpu_linear: str = "auto",
                 lean_forward: bool = True, draft_vocab: Any = "auto", verify_backend: str = "auto",
                 verification: str = "token", tree: Any = None, accelerator: Any = None,
                 draft_tokenizer: Any = None, vocabulary: str = "auto", weight_cache: Any = None):
        if cpu_linear not in ("auto", "skinny", "torch"):
            raise ValueError(f"cpu_linear must be 'auto', 'skinny' or 'torch', got {cpu_linear!r}")
        if accelerator is not None and (cpu_linear != "auto" or lean_forward is not True or weight_cache is not None):
            raise ValueError(f"pass either accelerator= or cpu_linear/lean_forward/weight_cache, got accelerator="
                             f"{type(accelerator).__name__} with cpu_linear={cpu_linear!r}, "
                             f"lean_forward={lean_forward!r}, weight_cache={weight_cache!r}")
        if verify_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"verify_backend must be 'auto', 'triton' or 'torch', got {verify_backend!r}")
        if verification not in ("token", "block"):
            raise ValueError(f"verification must be 'token' or 'block', got {verification!r}")
        self.verification = verification
        from .tree import parse_tree

        self.tree = parse_tree(tree)  # None: chains of K drafts
        from ..models.embedded import resolve_device

        device = resolve_device(device)
        self.verify_backend = verify_backend
        pair = load_pair(draft, target, tokenizer, device, dtype, drafter, max_ngram, tree=self.tree is not None,
                         draft_tokenizer=draft_tokenizer, vocabulary=vocabulary)
        self.vocabulary, self.draft_tokenizer = pair.vocabulary, pair.draft_tokenizer
        cross = pair.vocabulary != "shared"
        if cross and not (draft_vocab is None or (isinstance(draft_vocab, str) and draft_vocab == "auto")):
            raise ValueError(f"draft_vocab applies to a draft over the target's vocabulary, got draft_vocab="
                             f"{type(draft_vocab).__name__} with a draft over another tokenizer (vocabulary="
                             f"{pair.vocabulary!r})")
        target, draft, self.feature, drafter = pair.target, pair.draft, pair.feature, pair.drafter
        self.drafter, self.tokenizer, final_device, dtype = drafter, pair.tokenizer, pair.device, pair.dtype
        feature_vocab, feature_given = pair.feature_vocab, pair.feature_given
        self.lookup = pair.lookup
        if verify_backend == "triton" and final_device.type != "cuda":
            from ..ops.verify import interpreter_problem, interpreting

            if not interpreting():
                raise ValueError(f"verify_backend='triton' needs the models on CUDA (or TRITON_INTERPRET=1 for the "
                                 f"CPU), got them on {final_device}")
            problem = interpreter_problem()
            if problem is not None:
                raise RuntimeError(f"verify_backend='triton' on the CPU: {problem}")
        if self.feature is not None:
            self.feature.check_target(target)  # with a tolerance that any dtype passes
            # It runs on the target's features, where they will be and in their dtype (a bf16
            # target beside a draft loaded in fp32 failed in the first draft step).  A draft the
            # caller passed is converted as a copy (below): in place, its weights were rounded for
            # good, and a second decoder over another target converted the first one's under it.
            feature_at = (final_device, dtype or next(target.parameters()).dtype)
            have = next(self.feature.parameters())
            if feature_given and (have.device, have.dtype) != feature_at:
                self.feature = copy.deepcopy(self.feature)
        self._t = ModelRunner(target, "target")
        self._d = ModelRunner(draft, "draft") if draft is not None else None
        if self.feature is not None:
            self._d = FeatureRunner(self.feature, target)
        # the drafter the loop drafts through (drafters/base.py: draft, after_verify, wait, select_rows)
        self._drafter = (pair.instance if pair.instance is not None else self.lookup if self._d is None
                         else drafter_kind(self.drafter).make(self._d))  # the registry's (drafters/registry.py)
        if cross:  # a draft model over another tokenizer (drafters/cross.py)
            from .drafters.cross import CrossVocabDrafter

            self._drafter = CrossVocabDrafter(self._d, pair.draft_tokenizer, pair.tokenizer, pair.vocabulary,
                                              self._t.vocab_size)
        self._feature_vocab = feature_vocab
        if self._d is not None and not cross and self._d.vocab_size > self._t.vocab_size:
            raise ValueError(f"the draft vocabulary must not exceed the target's: draft vocab_size = "
                             f"{self._d.vocab_size}, target vocab_size = {self._t.vocab_size}")
        if accelerator is None:  # the one place the decoder names the CPU layer: its default accelerator
            from ..cpu.accelerator import CpuAccelerator

            accelerator = CpuAccelerator(cpu_linear, lean_forward, weight_cache)
        self.accelerator = accelerator
        self.draft = draft
        self.draft_vocab = None if cross else resolve_draft_vocab(draft_vocab, self._d, self.drafter, self.draft,
                                                                  self.feature, self._feature_vocab)
        self.accelerator.check_device(final_device)

        # Accepted: convert and move.
        for model in (target, draft):
            if model is not None and dtype is not None:
                model.to(dtype)
            if model is not None and device is not None:
                model.to(final_device)
        if self.feature is not None:
            self.feature.to(device=feature_at[0], dtype=feature_at[1])
        self.device = device_of(target)
        self.target = target.eval()
        self.draft = draft.eval() if draft is not None else None
        if self.tree is not None:
            from .tree import check_tree_model

            check_tree_model(self.target, "the target")
            check_tree_model(self.draft, "the draft")
        self.cpu_linear = self.accelerator.linear_mode(self.device, (self.target, self.draft, self.feature))
        for model in (target, draft):  # the weight copies a previous decoder left, kept while current
            if model is not None:
                self.accelerator.prepare(model)
        self.lean_forward = self.accelerator.lean_forward
        self._refresh_lean()
        # The draft/target cost ratio before anything is measured: their parameter counts.
        drafting = self.draft if self.draft is not None else self.feature
        self._t_draft_prior = (max(_num_params(drafting) / max(_num_params(self.target), 1), 0.02)
                               if drafting is not None else 0.0)

    def _refresh_lean(self) -> None:
        """Decide the decode-step path of each model again (it may have moved or changed mode),
        and take the draft vocabulary's rows of the draft's output layer again (its weights may
        have changed)."""
        for r in (self._t, self._d):
            if r is not None:
                r.use_lean(self.accelerator)
        if self._d is not None:
            self._d.set_vocab(None if self.draft_vocab is None else self.draft_vocab.to(self.device))

    def lean_status(self) -> dict:
        """{"target": reason or None, "draft": ...}: None where the decode steps take the lean path."""
        return {r.name: r.lean_unsupported for r in (self._t, self._d) if r is not None}

    def _linear_layers(self):
        """A context in which the models' linear layers run as ``self.cpu_linear`` says; a
        feature draft's output layer (a copy of the target's rows) streams as int8 with row
        scales: a quarter of the fp32 bytes (it only proposes; the verify reads the target's own
        logits)."""
        head = self._d.head if self._d is not None else None  # the draft vocabulary's rows
        feature = self.feature is not None
        return self.accelerator.linear_layers(self.cpu_linear, (self.target, self.draft, self.feature,
                                                                None if feature else head),
                                              (head if feature else None,))

    # -- public -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompts=None,
        max_new_tokens: int = 64,
        num_draft_tokens: Union[int, str] = 4,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: Union[int, Sequence[int], None] = 0,
        stop: Union[str, Sequence[str], None] = None,
        verbose: Union[bool, TextIO] = False,
        *,
        min_p: Optional[float] = None,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        generation_config: Any = None,
        do_sample: Optional[bool] = None,
        streamer: Any = None,
        stopping_criteria: Any = None,
        logits_processor: Any = None,
        repetition_penalty: Optional[float] = None,
        no_repeat_ngram_size: Optional[int] = None,
        bad_words_ids: Optional[Sequence[Sequence[int]]] = None,
        prefix_allowed_tokens_fn: Any = None,
        max_draft_tokens: int = 8,
        draft_confidence: float = 0.0,
        eos_token_id: Union[int, Sequence[int], None] = None,
        baseline_tokens_per_s: Optional[float] = None,
        target_step_s: Optional[float] = None,
        progress: bool = False,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens for each prompt.

        prompts: a str, a list of str, a list of token-id lists, or [B, T] ids (with an
        optional ``attention_mask`` marking the valid tokens of padded rows); or chat messages
        (a list of {"role", "content"} dicts, or a list of such lists), which go through the
        tokenizer's chat template with the generation prompt.  input_ids: the [B, T] ids under
        transformers' name (``**tokenizer(texts, return_tensors="pt", padding=True)``), instead
        of prompts.
        num_draft_tokens: K, or "auto" to pick K in 1..max_draft_tokens every step from the
        running acceptance rate, the measured draft forward time and the target's step time
        per verified length K + 1 (see ``stats.StatsRecorder``); with a draft model or a feature
        draft it may also pick K = 0 (a step of the target alone, no draft forward).
        temperature 0 is greedy; top_k/top_p warp the target (and the draft) before sampling.
        min_p (a float in [0, 1], None or 0 = off): after top_k/top_p, keep the tokens whose
        probability is >= min_p times the largest one (transformers' ``MinPLogitsWarper``); no
        effect when greedy.
        seed: row p uses ``seed + p`` (or ``seed[p]``); None draws one.
        stop: strings that end a row once its generated text contains one (the tokens up to
        the one that completed it are kept).  Rows also stop at EOS (kept), after
        ``max_new_tokens``, or when the sequence fills the model's context.
        verbose: print each step's drafts and accepted tokens (True: to stdout, or a stream).
        draft_confidence: a row stops drafting (before K) once the draft's own estimate that all
        its drafts so far are accepted falls below this: the product of the drafts'
        probabilities under the draft (at temperature 0, of its unwarped softmax; else of the
        distribution it sampled from).  The step then verifies fewer drafts for that row, and on
        the CPU the draft stops as soon as every row has stopped.  0 (default): always K.  The
        output distribution does not depend on it (the draft side alone decides).
        baseline_tokens_per_s: the target alone's speed, for ``stats.measured_speedup``.
        target_step_s: the target's one-token step over these prompts, measured elsewhere (a
        ``generate_target_only`` run's ``stats.time_per_target_forward_s``): the cost model's
        T_target(0), for ``"auto"``'s K = 0 and for ``stats.predicted_speedup`` (else extrapolated
        from the verify steps, a few to 20% low on the CPU).

        Transformers' arguments (``transformers_args.py``; the field table is in ``hf.py``):
        generation_config: a ``GenerationConfig``, resolved as ``target.generate`` resolves it
        (unset fields from the target's ``generation_config``, then transformers' defaults); it
        then sets the sampling, length, EOS and draft arguments (passing one of those too, at a
        value other than its default, is refused), its ``stop_strings`` stop rows as
        transformers' ``StopStringCriteria`` does, and a field the loop cannot honour is refused
        by name.  do_sample: False is greedy whatever the temperature; True samples at
        ``temperature`` (1.0 when it is left at 0).  streamer: transformers' ``BaseStreamer``
        (``TextStreamer``, ``TextIteratorStreamer``): ``put`` gets the prompt ([1, T]), then each
        step's emitted tokens (1-D), then ``end()``; one prompt only.  stopping_criteria: a
        ``StoppingCriteriaList``, evaluated after each emitted token on that row alone ([1, T]:
        the row as given, then its generated ids; ``scores=None``); the row ends at the first
        token where one fires (finish reason ``"stop"``).
        repetition_penalty, no_repeat_ngram_size, bad_words_ids, prefix_allowed_tokens_fn,
        logits_processor: transformers' sequence-dependent logits processors (or the config's
        fields of the same names), built and ordered as ``generate`` builds them, then the
        ``LogitsProcessorList``'s; each verify position's target scores are processed with the ids
        the target alone would have seen there (the row as given, its generated ids, the drafts
        before that position), before temperature, top-k and top-p (``logits_processors.py``: which
        processors are accepted, ``specdec_stateless = True`` for yours).  A draft model over the
        whole vocabulary applies them to its drafts too (its q is the processed distribution);
        other drafters propose without them (the output's law does not depend on it).
        """
        args, streamer, criteria, procs = decoder_arguments(self, locals(), GENERATE_DEFAULTS)
        prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, stop, eos_token_id, \
            max_draft_tokens, draft_confidence, min_p = (args[k] for k in (
                "prompts", "max_new_tokens", "num_draft_tokens", "temperature", "top_k", "top_p", "stop",
                "eos_token_id", "max_draft_tokens", "draft_confidence", "min_p"))
        baseline_tokens_per_s, target_step_s = as_float(baseline_tokens_per_s), as_float(target_step_s)
        for name, v in (("baseline_tokens_per_s", baseline_tokens_per_s), ("target_step_s", target_step_s)):
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"{name} must be None or a number, got {type(v).__name__}")
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"{name} must be finite and > 0, got {v}")
        st = self._start(prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed, stop,
                         verbose, attention_mask, max_draft_tokens, eos_token_id, progress, target_only=False,
                         draft_confidence=draft_confidence, min_p=min_p)
        check_streamer(streamer, len(st.seqs))
        if self.tree is not None:
            return self._generate_tree(st, streamer, criteria, procs, draft_confidence, verbose)
        st.streamer, st.criteria, st.procs = streamer, criteria, procs
        if streamer is not None:
            streamer.put(torch.tensor([st.seqs[0]]))  # the prompt, [1, T], as transformers' generate does
        if target_step_s is not None:
            st.recorder.set_target_step(target_step_s)
        return self.decode(st, baseline_tokens_per_s)

    def _generate_tree(self, st: DecodeState, streamer, criteria, procs, draft_confidence, verbose) -> GenerationResult:
        """``generate`` with tree steps (``tree.run_tree``); what it does not take is
        refused by name."""
        from .tree import check_tree_arguments, run_tree

        check_tree_arguments(streamer, criteria, procs, draft_confidence, verbose)
        self._refresh_lean()
        with self._linear_layers(), torch.inference_mode():
            stats = run_tree(self, st, self.tree, lambda g, new, stop: stop_cut(self.tokenizer, g, new, stop))
        if st.pbar is not None:
            st.pbar.close()
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(g, skip_special_tokens=True) for g in st.generated]
        return GenerationResult(texts=texts, token_ids=st.generated, stats=stats, finish_reasons=list(st.finish),
                                seeds=list(st.seeds))

    def start(self, prompts, max_new_tokens: int = 64, num_draft_tokens: Union[int, str] = 4,
              temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
              seed: Union[int, Sequence[int], None] = 0, stop: Union[str, Sequence[str], None] = None, *,
              attention_mask: Optional[torch.Tensor] = None, max_draft_tokens: int = 8,
              draft_confidence: float = 0.0, eos_token_id=None, min_p: Optional[float] = None,
              streamer: Any = None, criteria: Any = None, procs: Any = None, verbose: Union[bool, TextIO] = False,
              progress: bool = False) -> DecodeState:
        """The state of a call that a front-end prepares itself (``hf.generate``): ``generate``'s
        arguments of the same names checked, the prompts encoded, the state allocated, no model
        work; ``decode(state)`` then runs it.  streamer: a ``BaseStreamer`` that already has the
        prompt; criteria: ``transformers_rows.RowCriteria`` or None; procs:
        ``logits_processors.VerifyProcessors`` (over ``self.vocab_size``) or None."""
        st = self._start(prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed, stop, verbose,
                         attention_mask, max_draft_tokens, eos_token_id, progress, target_only=False,
                         draft_confidence=draft_confidence, min_p=min_p)
        check_streamer(streamer, len(st.seqs))
        st.streamer, st.criteria, st.procs = streamer, criteria, procs
        return st

    def decode(self, st: DecodeState, baseline_tokens_per_s: Optional[float] = None) -> GenerationResult:
        """Run a started state (``start``) to the end with this decoder's forward paths."""
        self._refresh_lean()
        with self._linear_layers():
            return self._run(st, baseline_tokens_per_s)

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size: token ids in prompts and outputs are below it."""
        return self._t.vocab_size

    @property
    def has_draft_network(self) -> bool:
        """True when a network drafts (a draft model, a feature draft): its drafts come with the
        distributions they were drawn from; False for a drafter without one (prompt lookup)."""
        return self._d is not None

    @torch.inference_mode()
    def generate_target_only(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                             top_k: Optional[int] = None, top_p: Optional[float] = None,
                             seed: Union[int, Sequence[int], None] = 0, stop=None, *,
                             attention_mask: Optional[torch.Tensor] = None,
                             eos_token_id=None, progress: bool = False,
                             min_p: Optional[float] = None) -> GenerationResult:
        """The baseline: the target alone, one token per forward, through the same cache
        handling and sampler (so greedy output is identical to ``generate``'s).  Its
        ``stats.tokens_per_s`` is what ``generate(baseline_tokens_per_s=...)`` compares to."""
        st = self._start(prompts, max_new_tokens, 1, temperature, top_k, top_p, seed, stop, False,
                         attention_mask, 1, eos_token_id, progress, target_only=True, min_p=min_p)
        return self.decode(st)

    # -- the loop -----------------------------------------------------------------------------
    def _start(self, prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed, stop,
               verbose, attention_mask, max_draft_tokens, eos_token_id, progress, target_only,
               draft_confidence: float = 0.0, min_p: Optional[float] = None) -> DecodeState:
        """Validate everything, encode, allocate the state (no model work yet): ``state.start_state``."""
        st = start_state(self, prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed, stop,
                         verbose, attention_mask, max_draft_tokens, eos_token_id, progress, target_only,
                         draft_confidence, min_p)
        if st.draft_context is not None and all(len(st.seqs[p]) - 1 >= st.draft_context for p in st.rows):
            self._retire_draft(st)  # no prompt leaves the draft a position to draft from
        return st

    @staticmethod
    def _retire_draft(st: DecodeState) -> None:
        """Every active row is past the draft's context (it never drafts again): the rest is the
        target alone, with no draft state kept (nothing waits for a draft forward)."""
        st.target_only = True
        st.draft.retire()

    def _run(self, st: DecodeState, baseline_tokens_per_s) -> GenerationResult:
        t0 = time.perf_counter()
        self._drop_finished(st)
        if st.rows:
            self._prefill(st)
        while st.rows:
            self._step(st)
        total = time.perf_counter() - t0
        if st.pbar is not None:
            st.pbar.close()
        if st.streamer is not None:
            st.streamer.end()
        stats = st.recorder.finalize(total, st.prefill_time, st.finish, baseline_tokens_per_s,
                                     draft_is_free=self._d is None)
        for name, value in self._drafter.describe(st).items():  # e.g. the vocabulary a draft model used
            setattr(stats, name, value)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(g, skip_special_tokens=True) for g in st.generated]
        return GenerationResult(texts=texts, token_ids=st.generated, stats=stats, finish_reasons=list(st.finish),
                                seeds=list(st.seeds))

    def _prefill(self, st: DecodeState) -> None:
        """``prefill.prefill_`` with this decoder's models (a method: tests call it)."""
        prefill_(st, self._t, self._d, self.feature)

    def _choose_k(self, st: DecodeState) -> int:
        """K, the drafts of this step.  ``"auto"`` may choose K = 0 with a draft model or a
        feature draft: such a step runs no draft forward at all (the tokens, or pairs, the draft
        has not taken wait, and its next forward takes them together), so it costs what a step
        of the target alone costs."""
        if st.target_only:
            return 0
        auto_zero = st.k == "auto" and self._drafter.network
        k = st.recorder.choose_k(st.k_max, allow_zero=auto_zero) if st.k == "auto" else st.k
        # Row b drafts K_b = min(K, budget_b - 1, its room below a shorter draft context:
        # drafters.base.draft_cap), so K is at most the largest K_b any row may verify.
        dctx = st.draft_context
        room = max(st.budget_host[p] - len(st.generated[p]) - 1 if dctx is None else
                   min(st.budget_host[p] - len(st.generated[p]) - 1, dctx - n)
                   for p, n in zip(st.rows, st.target_len_host))
        return max(min(k, room), 0)

    @staticmethod
    def _row_params(st: DecodeState, B: int) -> tuple:
        """(temperature [B] fp32, top_k [B] int64 or None, top_p [B] fp32 or None, min_p [B] fp32 or
        None) for ``fused_verify``, made once per batch size (rows drop out as they finish)."""
        got = st.row_params.get(B)
        if got is None:
            def full(v, dt):
                return None if v is None else torch.full((B,), v, dtype=dt, device=st.device)
            got = st.row_params[B] = (full(st.temperature, torch.float32), full(st.top_k, torch.int64),
                                      full(st.top_p, torch.float32), full(st.min_p, torch.float32))
        return got

    def _step(self, st: DecodeState) -> None:
        """One step: draft -> verify -> roll back -> emit, with one host sync (after the verify)."""
        if st.draft_context is not None and not st.target_only and min(st.target_len_host) >= st.draft_context:
            self._retire_draft(st)
        drafter = None if st.target_only else self._drafter
        K = self._choose_k(st)
        # this step's draft takes what waited through K = 0 steps (not a typical draft time)
        waited = st.draft.holds_waiting()
        clock = st.clock
        t_a = clock.mark()
        d = drafter.draft(st, K) if drafter is not None and K > 0 else None
        X, Q, kb = self._verify_inputs(st, drafter, d)  # [B, K], [B, K, Vd] or None, [B] K_b
        K = X.shape[1]
        t_b = clock.mark()
        out, feats = self._verify(st, drafter, X, Q, kb)
        n = out.num_accepted  # [B] int64 in [-1, K_b]
        t_c = clock.mark()  # on CUDA before the sync, which then guarantees the event has completed

        # The step's one host sync: counts, K_b, tokens, drafts.
        packed = torch.cat([n[:, None], kb[:, None], out.tokens[:, : K + 1], X], 1).cpu()
        n_host, kb_host = packed[:, 0].tolist(), packed[:, 1].tolist()
        tok_host, x_host = packed[:, 2:3 + K].tolist(), packed[:, 3 + K:].tolist()

        # Roll back (device work, no sync): the target keeps last + the accepted drafts, the
        # drafter what it accepted (or, without drafts, what waits for its next forward).
        keep_t = (n + 1).clamp(min=0)  # [B]
        compact_dynamic_cache_(st.target_cache, st.target_columns, st.target_len, keep_t)
        st.target_len, st.target_columns = st.target_len + keep_t, st.target_columns + K + 1
        st.target_len_host = [a + max(m + 1, 0) for a, m in zip(st.target_len_host, n_host)]
        if drafter is not None and d is not None:
            drafter.after_verify(st, out, feats, n, n_host, K)
        elif drafter is not None:  # a K = 0 step
            drafter.wait(st, out, feats)
        st.last = out.tokens.gather(1, n.clamp(min=0)[:, None])[:, 0]
        st.gen, st.step, st.steps_done = st.gen + keep_t, st.step + 1, st.steps_done + 1

        # Emit (host): EOS, stop strings, stopping criteria, the streamer, the trace.
        emitted = emit_rows(st, self.tokenizer, n_host, kb_host, tok_host, x_host)
        st.recorder.record_step(K, st.rows, kb_host, n_host, emitted)
        st.recorder.record_times(clock.seconds(t_a, t_b), 0 if d is None else d.forwards, clock.seconds(t_b, t_c),
                                 first_step=st.steps_done == 1, k=K, draft_typical=not waited)
        if st.pbar is not None:
            st.pbar.update(sum(emitted))
        self._drop_finished(st)
        if st.rows:  # drop the columns past the longest row (rejected drafts, finished rows)
            st.target_columns = max(st.target_len_host)
            crop_cache_(st.target_cache, st.target_columns)
            st.draft.crop()

    @staticmethod
    def _verify_inputs(st: DecodeState, drafter, d) -> tuple:
        """(X [B, K] int64, Q [B, K, Vd] fp32 or None, K_b [B] int64) for the verify: a network's
        K_b is its K (fewer where it cut a row) within the row's budget; no drafts: K = 0."""
        B, dev = len(st.rows), st.device
        if d is None:
            return (torch.zeros((B, 0), dtype=torch.int64, device=dev), None,
                    torch.zeros(B, dtype=torch.int64, device=dev))
        if not drafter.network:  # it proposed within each row's budget
            return d.tokens, d.probs, d.num
        kb = torch.clamp(st.budget - st.gen - 1, max=d.tokens.shape[1])  # [B]
        return d.tokens, d.probs, kb if d.num is None else torch.minimum(kb, d.num)

    def _verify(self, st: DecodeState, drafter, X: torch.Tensor, Q, kb: torch.Tensor) -> tuple:
        """The target scores [last, x_1 .. x_K] at cache columns target_columns .. target_columns + K and
        ``fused_verify`` keeps a prefix of the drafts and adds one token.  Returns (VerifyOutput, the target's
        features at those columns [B, K + 1, H] for a drafter that reads them, else None)."""
        from ..ops.verify import fused_verify, verify_prechecked

        B, K, dev = X.shape[0], X.shape[1], st.device
        ids = torch.cat([st.last[:, None], X], 1)  # [B, K+1]
        pos = st.target_len[:, None] + torch.arange(K + 1, device=dev)[None, :]  # [B, K+1]
        if st.context is not None:
            pos = pos.clamp(max=st.context - 1)
        mask = None  # every row's cache is full: no padding, no mask
        if min(st.target_len_host) < st.target_columns:
            mask = torch.cat([torch.arange(st.target_columns, device=dev)[None, :] < st.target_len[:, None],
                              torch.ones((B, K + 1), dtype=torch.bool, device=dev)], 1)  # [B, target_columns + K + 1]
        feats = None
        if drafter is not None and drafter.reads_features:
            # logits [B, K+1, V] and feats [B, K+1, H]
            logits, feats = self._t.step_hidden(st.target_cache, ids, mask, pos, st.target_columns, K + 1)
        else:
            logits = self._t.step(st.target_cache, ids, mask, pos, st.target_columns, K + 1)  # [B, K+1, V]
        if st.procs is not None:  # sequence processors: position i sees the row's ids, then x_1 .. x_i
            logits = st.procs(logits, X, kb.tolist(), st.rows, st.generated)
        temp, top_k, top_p, min_p = self._row_params(st, B)
        if self.verification == "block":  # the op's checks included (block verification is eager)
            out = fused_verify(logits, X, Q, num_draft_tokens=kb, temperature=temp, top_k=top_k, top_p=top_p,
                               min_p=min_p, seed=st.seed, offset=st.step, backend=self.verify_backend, method="block")
        else:  # fused_verify without its per-call checks: generate checked the parameters, the tensors are built here
            out = verify_prechecked(logits, X, Q, kb, temp, top_k, top_p, st.seed, st.step, min_p=min_p,
                                    backend=self.verify_backend)
        return out, feats

    def _drop_finished(self, st: DecodeState) -> None:
        keep = [i for i, p in enumerate(st.rows) if st.finish[p] is None]
        if len(keep) == len(st.rows):
            return
        st.rows = [st.rows[i] for i in keep]
        if not keep:
            return
        idx = to_device(keep, torch.int64, st.device)
        for name in ("last", "target_len", "gen", "budget", "seed", "key_lo", "key_hi", "step"):
            t = getattr(st, name)
            if t is not None:
                setattr(st, name, t.index_select(0, idx))
        st.target_len_host = [st.target_len_host[i] for i in keep] if st.target_len_host else st.target_len_host
        self._drafter.select_rows(st, idx, keep)  # what the drafter keeps per row, its cache included
        if st.target_len_host:  # after the prefill: slice the cache (the caller crops it)
            st.target_cache.batch_select_indices(idx)


# generate's arguments and their defaults, taken once (transformers_args tells a passed argument from a default)
GENERATE_DEFAULTS = {n: p.default for n, p in inspect.signature(SpeculativeDecoder.generate).parameters.items()
                      if n != "self"}
