"""``SpeculativeDecoder``: exact speculative decoding of any pair of Hugging Face causal LMs.

Each step, a cheap *drafter* (a small model, or prompt lookup) proposes K tokens per row; the
*target* scores all of them in one forward over K + 1 positions; ``fused_verify`` keeps a
prefix of the drafts and adds one token (Leviathan et al. 2023; Chen et al. 2023):

- *accepted*: a draft the verifier keeps (probability min(1, p(x) / q(x)));
- *recovered*: after the first rejection, a token drawn from the residual norm(max(0, p - q));
- *bonus*: when all K_b drafts of a row are accepted, a token drawn from the target itself.

The emitted tokens are distributed exactly as sampling from the target alone (greedily: equal
to the target's greedy decoding), whatever the drafter proposes.

This module is the public class: its arguments, checked and documented.  The parts it runs with
are assembled in ``parts.py`` (one frozen ``DecoderParts``), a call's arguments are one
``call.CallArgs`` (transformers' folded in by ``transformers_adapter/``), its state is made by
``state.start_state``, and the loop (``loop.py``: the cache layout, the step, the randomness) or
the tree path (``tree.py``) runs it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, TextIO, Union

import torch

from .call import CallArgs, GenerateArgs
from .drafters.base import Drafter
from .drafters.sampling import warp_probs  # noqa: F401  (public here: the draft's warp)
from .loop import run
from .parts import DecoderParts, assemble_parts
from .state import DecodeState, GenerationResult, start_state
from .transformers_adapter.config import fold_arguments
from .transformers_adapter.criteria import check_streamer

__all__ = ["SpeculativeDecoder", "GenerationResult", "warp_probs"]


def _part(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.parts, name), doc=doc)


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
        self.parts: DecoderParts = assemble_parts(
            draft, target, tokenizer, device, dtype, drafter=drafter, max_ngram=max_ngram, cpu_linear=cpu_linear,
            lean_forward=lean_forward, draft_vocab=draft_vocab, verify_backend=verify_backend,
            verification=verification, tree=tree, accelerator=accelerator, draft_tokenizer=draft_tokenizer,
            vocabulary=vocabulary, weight_cache=weight_cache)

    target = _part("target", "The target model (eval mode, where the decoder put it).")
    draft = _part("draft", "The draft model, or None (prompt lookup, a feature draft, a drafter instance).")
    feature = _part("feature", "The feature draft (a ``FeatureDraft``), or None.")
    drafter = _part("drafter_name", "The drafter's name: model, prompt_lookup, feature or a registered one.")
    tokenizer = _part("tokenizer", "The target's tokenizer, or None (prompts are then token ids).")
    draft_tokenizer = _part("draft_tokenizer", "The draft's own tokenizer where it has one, else None.")
    vocabulary = _part("vocabulary", "How a draft over another tokenizer is verified: shared, intersection, string.")
    lookup = _part("lookup", "The prompt-lookup drafter (the one drafting when there is no draft).")
    device = _part("device", "Where the models run.")
    accelerator = _part("accelerator", "The CPU accelerators (``cpu.CpuAccelerator`` or one like it).")
    cpu_linear = _part("cpu_linear", "The linear layers' mode during a call: skinny or torch.")
    draft_vocab = _part("draft_vocab", "The tokens the draft may propose (sorted int64 ids), or None: all.")
    verification = _part("verification", "token or block.")
    verify_backend = _part("verify_backend", "fused_verify's backend: auto, triton or torch.")
    tree = _part("tree", "The tree shape (``tree.TreeShape``), or None: chains of K drafts.")
    vocab_size = _part("vocab_size", "The target's vocabulary size: token ids in prompts and outputs are below it.")
    has_draft_network = _part("has_draft_network", "True when a network drafts (a draft model, a feature draft): "
                              "its drafts come with the distributions they were drawn from.")

    @property
    def lean_forward(self) -> bool:
        """Whether the lean Llama decode step is asked for (``lean_status()``: whether each model takes it)."""
        return self.parts.accelerator.lean_forward

    def lean_status(self) -> dict:
        """{"target": reason or None, "draft": ...}: None where the decode steps take the lean path."""
        return self.parts.lean_status()

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
        grammar: Any = None,
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

        Transformers' arguments (``transformers_adapter/``; the field table is in ``docs/api.md``):
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
        before that position), before temperature, top-k and top-p (``transformers_adapter/processors.py``: which
        processors are accepted, ``specdec_stateless = True`` for yours).  A draft model over the
        whole vocabulary applies them to its drafts too (its q is the processed distribution);
        other drafters propose without them (the output's law does not depend on it).

        grammar: structured output (``decoding/grammar.py``, xgrammar): a JSON schema (a dict, or a
        string holding one), ``grammar.regex(...)``, ``grammar.ebnf(...)``, an xgrammar
        ``CompiledGrammar`` for the target's vocabulary, or a list with one per prompt (None: free).
        Each row's tokens follow the target's law masked to what its grammar allows at each prefix
        and renormalised (greedy: the masked argmax); EOS only where the grammar may end.
        """
        given = GenerateArgs(
            prompts=prompts, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, verbose=verbose, min_p=min_p, input_ids=input_ids,
            attention_mask=attention_mask, generation_config=generation_config, do_sample=do_sample,
            streamer=streamer, stopping_criteria=stopping_criteria, logits_processor=logits_processor,
            repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
            bad_words_ids=bad_words_ids, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            max_draft_tokens=max_draft_tokens, draft_confidence=draft_confidence, eos_token_id=eos_token_id,
            baseline_tokens_per_s=baseline_tokens_per_s, target_step_s=target_step_s, progress=progress,
            grammar=grammar)
        call = fold_arguments(self.parts, given).checked(self.parts)
        st = self._started(call)
        if self.parts.tree is not None:
            from .tree import generate_tree

            return generate_tree(self.parts, st)
        if streamer is not None:
            streamer.put(torch.tensor([st.seqs[0]]))  # the prompt, [1, T], as transformers' generate does
        return self.decode(st, call.baseline_tokens_per_s)

    def start(self, prompts, max_new_tokens: int = 64, num_draft_tokens: Union[int, str] = 4,
              temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
              seed: Union[int, Sequence[int], None] = 0, stop: Union[str, Sequence[str], None] = None, *,
              attention_mask: Optional[torch.Tensor] = None, max_draft_tokens: int = 8,
              draft_confidence: float = 0.0, eos_token_id=None, min_p: Optional[float] = None,
              streamer: Any = None, criteria: Any = None, procs: Any = None, verbose: Union[bool, TextIO] = False,
              progress: bool = False, grammar: Any = None) -> DecodeState:
        """The state of a call that a front-end prepares itself (``hf.generate``): ``generate``'s
        arguments of the same names checked, the prompts encoded, the state allocated, no model
        work; ``decode(state)`` then runs it.  streamer: a ``BaseStreamer`` that already has the
        prompt; criteria: ``transformers_adapter.criteria.RowCriteria`` or None; procs:
        ``transformers_adapter.processors.VerifyProcessors`` (over ``self.vocab_size``) or None; grammar:
        ``generate``'s."""
        call = CallArgs(prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, min_p, seed, stop,
                        verbose, attention_mask, max_draft_tokens, draft_confidence, eos_token_id, progress,
                        streamer=streamer, criteria=criteria, procs=procs, grammar=grammar)
        return self._started(call.checked(self.parts))

    def decode(self, st: DecodeState, baseline_tokens_per_s: Optional[float] = None) -> GenerationResult:
        """Run a started state (``start``) to the end with this decoder's forward paths."""
        self.parts.refresh()
        with self.parts.linear_layers():
            return run(self.parts, st, baseline_tokens_per_s)

    @torch.inference_mode()
    def generate_target_only(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                             top_k: Optional[int] = None, top_p: Optional[float] = None,
                             seed: Union[int, Sequence[int], None] = 0, stop=None, *,
                             attention_mask: Optional[torch.Tensor] = None,
                             eos_token_id=None, progress: bool = False,
                             min_p: Optional[float] = None, grammar: Any = None) -> GenerationResult:
        """The baseline: the target alone, one token per forward, through the same cache
        handling and sampler (so greedy output is identical to ``generate``'s).  Its
        ``stats.tokens_per_s`` is what ``generate(baseline_tokens_per_s=...)`` compares to."""
        call = CallArgs(prompts, max_new_tokens, 1, temperature, top_k, top_p, min_p, seed, stop,
                        attention_mask=attention_mask, max_draft_tokens=1, eos_token_id=eos_token_id,
                        progress=progress, target_only=True, grammar=grammar)
        return self.decode(self._started(call.checked(self.parts)))

    def _started(self, call: CallArgs) -> DecodeState:
        """A call's state (``state.start_state``), its streamer checked against its batch."""
        st = start_state(self.parts, call)
        check_streamer(call.streamer, len(st.seqs))
        return st
