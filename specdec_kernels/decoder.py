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
Finished rows are sliced out of both caches.  This module holds the loop and the target's side;
each drafter's forwards and cache bookkeeping are in ``draft_steps.py``, the draft's warp and
random numbers in ``draft_sampling.py``, the prefill in ``prefill.py``, the checks of the
arguments in ``arguments.py``, transformers' arguments (``GenerationConfig``, streamers, stopping
criteria, chat messages) in ``hf_args.py``, the DynamicCache helpers in ``kv_cache.py``.

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
falls within that rounding of a decision boundary (about 1e-6 of the draws, measured on
2026-12-01, at one step of a tiny random model).  The randomness and the verification never
depend on the other rows.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, TextIO, Union

import torch

from ._host import to_device
from .draft_sampling import _draft_key, warp_probs
from .draft_steps import (draft_with_features, draft_with_model, feature_after_verify_, feature_wait_,
                          model_after_verify_, model_wait_)
from .arguments import (as_float, as_int, check_context, check_generate_args, encode_prompts, eos_ids, load_tokenizer, resolve_dtype, row_seeds,
                        verbose_stream, vocab_mismatch)
from .drafters import PromptLookupDrafter
from .hf_args import check_streamer, decoder_arguments
from .kv_cache import _crop_, _new_cache, compact_dynamic_cache_
from .prefill import prefill_
from .runners import _FeatureRunner, _Runner
from .stats import TARGET_SLOPE_PRIOR, DecodingStats, StatsRecorder, cpu_slope_prior

__all__ = ["SpeculativeDecoder", "GenerationResult", "warp_probs"]

_DRAFTERS = ("model", "prompt_lookup", "feature")


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


class _Clock:
    """Wall-clock marks; on CUDA, events recorded before the step's single host sync and
    resolved after it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))  # the models' device, not the current one
            return ev
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a


# ----------------------------------------------------------------------------------------------
# Results and state
# ----------------------------------------------------------------------------------------------
@dataclass
class GenerationResult:
    """texts[p]: the generated text of prompt p (None without a tokenizer); token_ids[p]: its
    generated ids (ending with the EOS or the token that completed a stop string, if any);
    finish_reasons[p]: eos | stop (a stop string or a stopping criterion) | length | context |
    nonfinite (the target's logits, or logit / T, were NaN/inf where the row needed them, which
    includes a verify block whose drafts make the target's forward NaN; a draft's own NaN/inf
    only costs its drafts: the target decodes that position itself); stats: see DecodingStats;
    seeds[p]: row p's seed (the one drawn when ``seed=None``: passing these as ``seed`` repeats
    the run, at a fixed K)."""

    texts: Optional[list]
    token_ids: list
    stats: DecodingStats
    finish_reasons: list
    seeds: list = field(default_factory=list)


@dataclass
class _State:
    rows: list  # prompt index of each active row, in batch order
    seqs: list  # per prompt: prompt + generated token ids (host)
    prompt_lens: list
    generated: list  # per prompt: generated ids
    finish: list  # per prompt: None while active
    k: Any  # int or "auto"
    k_max: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    eos: set
    stop: list
    max_new: int
    context: Optional[int]  # the longest sequence (prompt + generated) allowed: the target's context
    target_only: bool  # no draft (the baseline, or a draft retired past its context)
    recorder: StatsRecorder
    clock: _Clock
    verbose: Optional[TextIO]
    pbar: Any
    device: torch.device
    # device tensors, one entry per active row
    last: torch.Tensor = None  # [B] int64: the next token to feed (emitted, not yet cached)
    lt: torch.Tensor = None  # [B] int64: valid target-cache columns
    ld: torch.Tensor = None  # [B] int64: valid draft-cache columns
    catch: torch.Tensor = None  # [B] int64: the token the draft must catch up on, or -1
    # a draft model's tokens waiting through K = 0 steps (right-aligned: row b's wait_host[b]
    # tokens end at the last column), fed before its next step's [catch-up, last]; None: none
    wait: torch.Tensor = None  # [B, W] int64
    wait_cnt: torch.Tensor = None  # [B] int64
    wait_host: list = None
    gen: torch.Tensor = None  # [B] int64: tokens generated so far
    budget: torch.Tensor = None  # [B] int64: tokens the row may generate in total
    seed: torch.Tensor = None  # [B] int64: the verifier's Philox seed
    key_lo: torch.Tensor = None  # [B] int64: the draft's counter-hash key
    key_hi: torch.Tensor = None
    step: torch.Tensor = None  # [B] int64: the row's own step counter
    # host mirrors
    lt_host: list = field(default_factory=list)
    ld_host: list = field(default_factory=list)
    catch_host: list = field(default_factory=list)
    budget_host: list = field(default_factory=list)
    tc: Any = None  # target cache
    dc: Any = None  # draft cache
    Tt: int = 0  # target cache columns
    Td: int = 0  # draft cache columns
    steps_done: int = 0
    prefill_time: float = 0.0
    draft_confidence: float = 0.0  # a row stops drafting below this estimate of acceptance (0: off)
    # the draft's context where it is shorter than the target's (None: not binding): a row drafts
    # only from inputs at positions < draft_context (draft_steps.draft_cap), then the target alone
    draft_context: Optional[int] = None
    seeds: list = field(default_factory=list)  # per prompt: its seed (host)
    row_params: dict = field(default_factory=dict)  # B -> fused_verify's per-row parameter tensors
    # a feature draft's pending pairs: (the target's feature at column c - 1, the token at column c)
    # for the columns c the target has made true and the draft has not taken yet
    pend_tok: torch.Tensor = None  # [B, C] int64
    pend_feat: torch.Tensor = None  # [B, C, H]
    pend_cnt: torch.Tensor = None  # [B] int64 in [1, C]
    pend_cnt_host: list = field(default_factory=list)
    block_start: int = 0  # the draft cache column where this step's pending pairs went
    waited: bool = False  # the pending pairs include some that waited through K = 0 steps
    streamer: Any = None  # transformers' BaseStreamer (batch 1): each step's emitted tokens
    criteria: Any = None  # hf_args.RowCriteria: (prompt, generated, new) -> new tokens kept, or None
    procs: Any = None  # logits_procs.VerifyProcessors: the verify logits' sequence processors, or None
    min_p: Optional[float] = None  # min-p after top-k/top-p (None: off, or a greedy run)


# ----------------------------------------------------------------------------------------------
# The decoder
# ----------------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """Exact speculative decoding with a draft model (or prompt lookup) and a target model.

    draft, target: a model name/path (loaded with ``AutoModelForCausalLM``) or a model; with
    neither (and no drafter), the embedded default pair of ``specdec_kernels.models``.
    ``draft=None`` drafts by prompt lookup (``drafter="prompt_lookup"``); ``drafter="feature"``
    takes a ``specdec_kernels.feature_draft.FeatureDraft`` (or its directory) as ``draft``: a draft
    that reads the target's hidden states, trained for that target (with neither draft nor
    target: the embedded target with its embedded feature draft).  The two must share
    a vocabulary (the target's may be padded beyond the draft's); when both tokenizers are
    known their vocabularies must be equal.  tokenizer: a tokenizer or path (default: the
    target's, when the target is given by path); without one, prompts must be token ids.
    device, dtype: where and in which dtype to put the models (default: where they are; both
    must be on the same device).
    cpu_linear: how the models' fp32 ``nn.Linear`` layers run on the CPU during ``generate``:
    ``"skinny"`` routes inputs of at most ``cpu_linear.default_max_rows()`` rows (16; 24 with
    AVX-512) through ``torch.ops.specdec.skinny_linear``
    (``specdec_kernels.cpu_linear``), which streams the weights once for all K+1 verified
    positions (torch's SGEMM takes 2-3x a decode step there; bench/bench_skinny_linear.py) and
    whose result for a row does not depend on the other rows; ``"torch"`` leaves torch's
    ``linear``; ``"auto"`` (default) is ``"skinny"`` when the
    models are fp32 on the CPU and the C++ extension is built, else ``"torch"``.  The layers are
    patched only for the duration of each ``generate``/``generate_target_only`` call.

    lean_forward: run the decode steps (the draft's tokens, the target's verify) of a plain
    ``LlamaForCausalLM`` with ``sdpa`` attention on the CPU through
    ``specdec_kernels.lean_forward.LeanLlamaStep``: the model's own modules in the same order,
    the same bits, without Hugging Face's per-call overhead (about 0.3 ms of a 2.1 ms draft token
    and 1.4 ms of a 26 ms target step with the embedded pair).  Checked at each ``generate``;
    other models, devices or attention implementations keep their forward
    (``lean_status()`` says which path each model takes and why).

    draft_vocab: the tokens the draft may propose (``specdec_kernels.draft_vocab``): its logits
    are computed for those rows of its output layer only and its distribution is zero elsewhere
    (exactness does not depend on the set; the residual covers the rest).  ``"auto"`` (default):
    the ``draft_vocab.json`` (or an older directory's ``draft_vocab.safetensors``) of the local
    directory the draft was loaded from, if it has one (the embedded draft ships 12,288 tokens), else the whole vocabulary; None: the whole
    vocabulary; a path (a directory or the file); or the token ids (a 1-D tensor or a list).
    ``self.draft_vocab`` is what was chosen (sorted int64 ids, or None).

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
                 drafter: Optional[str] = None, max_ngram: Optional[int] = None, cpu_linear: str = "auto",
                 lean_forward: bool = True, draft_vocab: Any = "auto", verify_backend: str = "auto",
                 verification: str = "token", tree: Any = None):
        if cpu_linear not in ("auto", "skinny", "torch"):
            raise ValueError(f"cpu_linear must be 'auto', 'skinny' or 'torch', got {cpu_linear!r}")
        if verify_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"verify_backend must be 'auto', 'triton' or 'torch', got {verify_backend!r}")
        if verification not in ("token", "block"):
            raise ValueError(f"verification must be 'token' or 'block', got {verification!r}")
        self.verification = verification
        from .tree_decoding import parse_tree

        self.tree = parse_tree(tree)  # None: chains of K drafts
        from .models import resolve_device

        device = resolve_device(device)
        self.verify_backend = verify_backend
        if target is None and draft is None and drafter in (None, "feature"):
            from .models import default_pair  # the embedded default pair, offline

            if drafter == "feature":  # the embedded target's feature draft instead of its draft model
                from .feature_draft import embedded_feature_draft_dir

                feature_dir = embedded_feature_draft_dir()
            draft, target, default_tokenizer = default_pair(device=device, dtype=resolve_dtype(dtype),
                                                            with_draft=drafter != "feature")
            tokenizer = default_tokenizer if tokenizer is None else tokenizer
            if drafter == "feature":
                draft = feature_dir
        if target is None:
            raise TypeError("target must be a model name/path or a PreTrainedModel, got None "
                            "(pass neither draft nor target for the embedded default pair)")
        if drafter is None:
            drafter = "model" if draft is not None else "prompt_lookup"
        if drafter not in _DRAFTERS:
            raise ValueError(f"drafter must be one of {_DRAFTERS}, got {drafter!r}")
        if drafter == "model" and draft is None:
            raise ValueError("drafter='model' needs a draft model, got draft=None")
        if self.tree is not None and drafter != "model":
            raise ValueError(f"tree drafting needs a draft model (drafter='model'), got drafter={drafter!r}")
        if drafter == "prompt_lookup" and draft is not None:
            raise ValueError(f"drafter='prompt_lookup' takes no draft model, got draft={type(draft).__name__}")
        dtype = resolve_dtype(dtype)
        self.feature = None  # a FeatureDraft (drafter="feature")
        feature_vocab = None
        if drafter == "feature":
            from .feature_draft import FeatureDraft, load_feature_draft

            feature_given = not isinstance(draft, (str, os.PathLike))
            if not feature_given:
                draft, feature_vocab = load_feature_draft(draft, dtype=dtype or torch.float32)
            elif not isinstance(draft, FeatureDraft):
                raise TypeError(f"drafter='feature' needs a FeatureDraft or the directory of one "
                                f"(specdec_kernels.feature_draft), got draft={type(draft).__name__}")
            self.feature, draft = draft.eval(), None
        self.drafter = drafter
        if max_ngram is not None and drafter != "prompt_lookup":
            raise ValueError(f"max_ngram applies to drafter='prompt_lookup', got max_ngram={max_ngram!r} with "
                             f"drafter={drafter!r}")
        self.lookup = (PromptLookupDrafter(max_ngram=3 if max_ngram is None else max_ngram)
                       if drafter == "prompt_lookup" else None)

        # Tokenizers first: a mismatch is refused before loading any weights.
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer, "tokenizer")
        if tokenizer is None and isinstance(target, str):
            tokenizer = load_tokenizer(target, "target")
        draft_tokenizer = load_tokenizer(draft, "draft") if isinstance(draft, str) else None
        if draft_tokenizer is not None and tokenizer is not None:
            why = vocab_mismatch(draft_tokenizer.get_vocab(), tokenizer.get_vocab())
            if why is not None:
                raise ValueError(f"draft and target tokenizers must have the same vocabulary, got {why}")
        self.tokenizer = tokenizer

        target = self._load(target, dtype)  # a path is loaded in dtype; a module is converted below
        draft = self._load(draft, dtype) if draft is not None else None
        # Everything that can refuse the pair is checked before a caller's module is converted or
        # moved: a refused pair leaves the models as they were (a dtype round trip is lossy).
        final_device = torch.device(device) if device is not None else _device_of(target)
        if device is None and draft is not None and _device_of(draft) != _device_of(target):
            raise ValueError(f"draft and target must be on the same device, got draft on {_device_of(draft)} "
                             f"and target on {_device_of(target)} (pass device=...)")
        on_meta = [name for name, m in (("target", target), ("draft", draft), ("feature draft", self.feature))
                   if m is not None and any(p.is_meta for p in m.parameters())]
        if on_meta:
            raise ValueError(f"the models must hold their weights, got the {' and '.join(on_meta)} on the meta "
                             f"device (no data): load them with their weights")
        if verify_backend == "triton" and final_device.type != "cuda":
            from .verify import _interpreter_problem, _interpreting

            if not _interpreting():
                raise ValueError(f"verify_backend='triton' needs the models on CUDA (or TRITON_INTERPRET=1 for the "
                                 f"CPU), got them on {final_device}")
            problem = _interpreter_problem()
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
        self._t = _Runner(target, "target")
        self._d = _Runner(draft, "draft") if draft is not None else None
        if self.feature is not None:
            self._d = _FeatureRunner(self.feature, target)
        self._feature_vocab = feature_vocab
        if self._d is not None and self._d.vocab_size > self._t.vocab_size:
            raise ValueError(f"the draft vocabulary must not exceed the target's: draft vocab_size = "
                             f"{self._d.vocab_size}, target vocab_size = {self._t.vocab_size}")
        if not isinstance(lean_forward, bool):
            raise TypeError(f"lean_forward must be a bool, got {type(lean_forward).__name__}")
        self.draft = draft
        self.draft_vocab = self._resolve_draft_vocab(draft_vocab)
        if cpu_linear == "skinny":
            from ._ext import HAS_EXT

            if not (HAS_EXT and final_device.type == "cpu"):
                raise ValueError("cpu_linear='skinny' needs the models on the CPU and the C++ extension "
                                 f"(device {final_device}, extension built: {HAS_EXT})")

        # Accepted: convert and move.
        for model in (target, draft):
            if model is not None and dtype is not None:
                model.to(dtype)
            if model is not None and device is not None:
                model.to(final_device)
        if self.feature is not None:
            self.feature.to(device=feature_at[0], dtype=feature_at[1])
        self.device = _device_of(target)
        self.target = target.eval()
        self.draft = draft.eval() if draft is not None else None
        if self.tree is not None:
            from .tree_decoding import check_tree_model

            check_tree_model(self.target, "the target")
            check_tree_model(self.draft, "the draft")
        self.cpu_linear = self._resolve_cpu_linear(cpu_linear)
        # The fp16 weight copies a previous decoder left on these models' layers are kept while
        # they equal their weights (made once per model; a write through .data since, which no
        # version counter sees, drops them); int8 and output-layer copies are made again.
        from .cpu_linear import revalidate_weight_copies

        for model in (target, draft):
            if model is not None:
                revalidate_weight_copies(model)
        self.lean_forward = lean_forward
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
                if self.lean_forward:
                    r.use_lean()
                else:
                    r.lean, r.lean_unsupported = None, "lean_forward=False"
        if self._d is not None:
            self._d.set_vocab(None if self.draft_vocab is None else self.draft_vocab.to(self.device))

    def _resolve_draft_vocab(self, spec) -> Optional[torch.Tensor]:
        from . import draft_vocab as dv

        if spec is None or (isinstance(spec, str) and spec == "auto" and self._d is None):
            return None
        if self._d is None:
            raise ValueError(f"draft_vocab restricts a draft model's proposals; drafter={self.drafter!r} has "
                             f"no draft model, got draft_vocab={spec!r}")
        V = self._d.vocab_size
        if isinstance(spec, str) and spec == "auto" and self.feature is not None:
            ids = self._feature_vocab  # the one saved with the feature draft, if any
        elif isinstance(spec, str) and spec == "auto":
            path = dv.model_directory_vocab(self.draft)
            ids = None if path is None else dv.load_draft_vocab(path, V)
        elif isinstance(spec, (str, os.PathLike)):
            ids = dv.load_draft_vocab(spec, V)
        else:
            ids = dv.check_draft_vocab(spec, V)
        return None if ids is None or ids.numel() == V else ids

    def lean_status(self) -> dict:
        """{"target": reason or None, "draft": ...}: None where the decode steps take the lean path."""
        return {r.name: r.lean_unsupported for r in (self._t, self._d) if r is not None}

    def _resolve_cpu_linear(self, mode: str) -> str:
        from ._ext import HAS_EXT

        fp32_cpu = self.device.type == "cpu" and all(
            p.dtype == torch.float32 for m in (self.target, self.draft, self.feature) if m is not None
            for p in m.parameters())
        if mode == "auto":  # ("skinny" was checked against the device before the models moved)
            return "skinny" if HAS_EXT and fp32_cpu else "torch"
        return mode

    def _linear_layers(self):
        """A context in which the models' linear layers run as ``self.cpu_linear`` says."""
        import contextlib

        stack = contextlib.ExitStack()
        if self.cpu_linear == "skinny":
            from .cpu_linear import use_skinny_linear

            head = self._d.head if self._d is not None else None  # the draft vocabulary's rows
            for m in (self.target, self.draft, self.feature, head if self.feature is None else None):
                if m is not None:
                    stack.enter_context(use_skinny_linear(m))
            if self.feature is not None and head is not None:
                # the feature draft's output layer (a copy of the target's rows) streams as int8
                # with row scales: a quarter of the fp32 bytes; it only proposes, the verify
                # reads the target's own logits
                stack.enter_context(use_skinny_linear(head, int8_weights=True))
        return stack

    @staticmethod
    def _load(model, dtype):
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            kwargs = {"dtype": dtype} if dtype is not None else {}
            return AutoModelForCausalLM.from_pretrained(model, **kwargs)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"models must be a name/path or a torch.nn.Module, got {type(model).__name__}")
        return model  # converted by the constructor once every check has passed

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

        Transformers' arguments (``hf_args.py``; the field table is in ``hf.py``):
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
        before that position), before temperature, top-k and top-p (``logits_procs.py``: which
        processors are accepted, ``specdec_stateless = True`` for yours).  A draft model over the
        whole vocabulary applies them to its drafts too (its q is the processed distribution);
        other drafters propose without them (the output's law does not depend on it).
        """
        args, streamer, criteria, procs = decoder_arguments(self, locals(), _GENERATE_DEFAULTS)
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
        return self._decode(st, baseline_tokens_per_s)

    def _generate_tree(self, st: _State, streamer, criteria, procs, draft_confidence, verbose) -> GenerationResult:
        """``generate`` with tree steps (``tree_decoding.run_tree``); what it does not take is
        refused by name."""
        from .tree_decoding import run_tree

        for name, value in (("streamer", streamer), ("stopping_criteria", criteria), ("logits processors", procs)):
            if value is not None:
                raise ValueError(f"tree drafting does not take {name} yet; got one (use tree=None)")
        if draft_confidence:
            raise ValueError(f"tree drafting does not take draft_confidence, got {draft_confidence}")
        if verbose:
            raise ValueError("tree drafting does not print a trace yet: got verbose=True")
        self._refresh_lean()
        with self._linear_layers(), torch.inference_mode():
            stats = run_tree(self, st, self.tree, self._stop_cut)
        if st.pbar is not None:
            st.pbar.close()
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(g, skip_special_tokens=True) for g in st.generated]
        return GenerationResult(texts=texts, token_ids=st.generated, stats=stats, finish_reasons=list(st.finish),
                                seeds=list(st.seeds))

    def _decode(self, st: _State, baseline_tokens_per_s=None) -> GenerationResult:
        """Run a started state (``_start``) to the end with this decoder's forward paths."""
        self._refresh_lean()
        with self._linear_layers():
            return self._run(st, baseline_tokens_per_s)

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
        return self._decode(st)

    # -- the loop -----------------------------------------------------------------------------
    def _start(self, prompts, max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed, stop,
               verbose, attention_mask, max_draft_tokens, eos_token_id, progress, target_only,
               draft_confidence: float = 0.0, min_p: Optional[float] = None) -> _State:
        """Validate everything, encode, allocate the state (no model work yet)."""
        # NumPy (or other Integral / Real) scalars as Python ones; anything else is refused below
        max_new_tokens, num_draft_tokens, top_k, max_draft_tokens = (
            as_int(v) for v in (max_new_tokens, num_draft_tokens, top_k, max_draft_tokens))
        temperature, top_p, draft_confidence, min_p = (as_float(v) for v in (temperature, top_p, draft_confidence,
                                                                             min_p))
        k_max, stop = check_generate_args(max_new_tokens, num_draft_tokens, temperature, top_k, top_p, stop,
                                          max_draft_tokens, draft_confidence, drafter=self.drafter,
                                          has_draft=self._d is not None, has_tokenizer=self.tokenizer is not None,
                                          min_p=min_p)
        rows = encode_prompts(prompts, attention_mask, self.tokenizer, self._t.vocab_size)
        context = check_context(rows, (self._t,))  # the target's: a draft's shorter one only stops drafting
        draft_context = None if (target_only or self._d is None) else self._d.context
        if draft_context is not None and context is not None and draft_context >= context:
            draft_context = None
        B = len(rows)
        seeds = row_seeds(seed, B)
        verbose = verbose_stream(verbose)
        eos = eos_ids(eos_token_id, self.target, self.tokenizer, self._t.vocab_size)

        # Budgets: max_new_tokens, and the context (positions < context; the last emitted
        # token is never fed, so a sequence may reach context + 1 tokens).
        budgets = []
        for r in rows:
            b = max_new_tokens
            if context is not None:
                b = min(b, context + 1 - len(r))
            budgets.append(b)
        # no step verifies more drafts than the longest budget leaves room for (the recorder's
        # per-position lists and "auto"'s search are sized by k_max)
        k_max = max(1, min(k_max, max(budgets) - 1))
        pbar = None
        if progress:
            from tqdm.auto import tqdm

            pbar = tqdm(total=sum(budgets), unit="tok", desc="specdec", leave=False)
        dev = self.device
        keys = [_draft_key(s) for s in seeds]
        st = _State(
            rows=list(range(B)), seqs=[list(r) for r in rows], prompt_lens=[len(r) for r in rows],
            generated=[[] for _ in rows], finish=[None] * B,
            k=num_draft_tokens, k_max=k_max, temperature=float(temperature), top_k=top_k,
            top_p=None if top_p is None else float(top_p), eos=eos,
            # min_p: None when off (0) or greedy (the verify call then skips it)
            min_p=None if not min_p or temperature == 0 else float(min_p),
            stop=stop,
            max_new=max_new_tokens, context=context, target_only=target_only,
            # K = 0 steps run no draft forward (see _step)
            recorder=StatsRecorder(k_max, self._t_draft_prior if self._d is not None else 0.0,
                                   target_slope_prior=cpu_slope_prior(B) if dev.type == "cpu" else TARGET_SLOPE_PRIOR,
                                   zero_step_draft_forwards=0),
            clock=_Clock(dev), verbose=verbose, pbar=pbar, device=dev, draft_confidence=float(draft_confidence),
            draft_context=draft_context, seeds=seeds,
        )
        st.seed = torch.tensor(seeds, dtype=torch.int64, device=dev)
        st.key_lo = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=dev)
        st.key_hi = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=dev)
        st.step = torch.zeros(B, dtype=torch.int64, device=dev)
        st.gen = torch.zeros(B, dtype=torch.int64, device=dev)
        st.budget = torch.tensor(budgets, dtype=torch.int64, device=dev)
        st.budget_host = budgets
        st.tc = _new_cache(self.target)
        st.dc = _new_cache(self._d.model) if (self._d is not None and not target_only) else None
        # Rows with no budget (prompt already fills the context) finish before any work.
        for i, b in enumerate(budgets):
            if b <= 0:
                st.finish[i] = "context"
        if draft_context is not None and all(len(r) - 1 >= draft_context for r in rows):
            self._retire_draft(st)  # no prompt leaves the draft a position to draft from
        return st

    @staticmethod
    def _retire_draft(st: _State) -> None:
        """Every active row is past the draft's context (it never drafts again): the rest is the
        target alone, with no draft state kept (nothing waits for a draft forward)."""
        st.target_only = True
        st.dc = None
        st.wait = st.wait_cnt = st.wait_host = None
        st.pend_tok = st.pend_feat = st.pend_cnt = None
        st.pend_cnt_host = []

    def _run(self, st: _State, baseline_tokens_per_s) -> GenerationResult:
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
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(g, skip_special_tokens=True) for g in st.generated]
        return GenerationResult(texts=texts, token_ids=st.generated, stats=stats, finish_reasons=list(st.finish),
                                seeds=list(st.seeds))

    def _prefill(self, st: _State) -> None:
        """``prefill.prefill_`` with this decoder's models (a method: tests call it)."""
        prefill_(st, self._t, self._d, self.feature)

    def _choose_k(self, st: _State) -> int:
        """K, the drafts of this step.  ``"auto"`` may choose K = 0 with a draft model or a
        feature draft: such a step runs no draft forward at all (the tokens, or pairs, the draft
        has not taken wait, and its next forward takes them together), so it costs what a step
        of the target alone costs."""
        if st.target_only:
            return 0
        auto_zero = st.k == "auto" and (self.draft is not None or self.feature is not None)
        k = st.recorder.choose_k(st.k_max, allow_zero=auto_zero) if st.k == "auto" else st.k
        # Row b drafts K_b = min(K, budget_b - 1, its room below a shorter draft context:
        # draft_steps.draft_cap), so K is at most the largest K_b any row may verify.
        dctx = st.draft_context
        room = max(st.budget_host[p] - len(st.generated[p]) - 1 if dctx is None else
                   min(st.budget_host[p] - len(st.generated[p]) - 1, dctx - lt)
                   for p, lt in zip(st.rows, st.lt_host))
        return max(min(k, room), 0)

    def _draft_with_model(self, st: _State, K: int):
        """``draft_steps.draft_with_model`` with this decoder's draft model (a method: tests wrap it)."""
        return draft_with_model(self._d, st, K)

    def _draft_with_features(self, st: _State, K: int):
        """``draft_steps.draft_with_features`` with this decoder's feature draft (tests wrap it)."""
        return draft_with_features(self._d, st, K)

    @staticmethod
    def _row_params(st: _State, B: int) -> tuple:
        """(temperature [B] fp32, top_k [B] int64 or None, top_p [B] fp32 or None, min_p [B] fp32 or
        None) for ``fused_verify``, made once per batch size (rows drop out as they finish)."""
        got = st.row_params.get(B)
        if got is None:
            full = lambda v, dt: None if v is None else torch.full((B,), v, dtype=dt, device=st.device)
            got = st.row_params[B] = (full(st.temperature, torch.float32), full(st.top_k, torch.int64),
                                      full(st.top_p, torch.float32), full(st.min_p, torch.float32))
        return got

    def _step(self, st: _State) -> None:
        from .verify import _verify_checked, fused_verify

        dev = st.device
        B = len(st.rows)
        if st.draft_context is not None and not st.target_only and min(st.lt_host) >= st.draft_context:
            self._retire_draft(st)
        K = self._choose_k(st)
        remaining = st.budget - st.gen  # [B] >= 1 for active rows
        clock = st.clock
        t_a = clock.mark()
        X, Q, block, n_draft_fwd = None, None, None, 0
        Xd = None  # the draft tokens whose forwards this step fed the draft's cache ([B, Kd])
        drafted = False  # X came from a draft network (the draft model or the feature draft)
        skipped = False  # a feature draft's K = 0 step: no draft forward, its pending pairs wait
        # this step's draft takes what waited through K = 0 steps (not a typical draft time)
        waited = st.waited if st.pend_tok is not None else st.wait is not None
        if self.draft is not None and K == 0 and not st.target_only:
            # K = 0 (``"auto"``: verifying drafts does not pay, or no row has room for a draft)
            model_wait_(st)
        elif st.pend_tok is not None and K == 0:
            skipped = True
        elif st.pend_tok is not None:  # a feature draft (not the target-only baseline)
            X, Q, kb_draft = self._draft_with_features(st, K)
            drafted = X is not None
            n_draft_fwd = X.shape[1]
        elif K > 0 and self.draft is not None:
            X, Q, block, kb_draft = self._draft_with_model(st, K)
            drafted, n_draft_fwd, Xd = True, X.shape[1], X
        elif K > 0:
            want = [min(K, st.budget_host[p] - len(st.generated[p]) - 1) for p in st.rows]
            props = self.lookup.propose([st.seqs[p] for p in st.rows], want)
            K = max(len(x) for x in props)
            kb_host = [len(x) for x in props]
            X = to_device([x + [0] * (K - len(x)) for x in props], torch.int64, dev).reshape(B, K)
            kb = to_device(kb_host, torch.int64, dev)
        if drafted:
            K = X.shape[1]  # fewer when the draft cut every row short (confidence, no distribution)
            kb = torch.clamp(remaining - 1, max=K)  # [B]
            if kb_draft is not None:
                kb = torch.minimum(kb, kb_draft)
        if X is None:
            K = 0
            X = torch.zeros((B, 0), dtype=torch.int64, device=dev)
            kb = torch.zeros(B, dtype=torch.int64, device=dev)
        t_b = clock.mark()

        # Verify: the target scores [last, x_1 .. x_K] at columns Tt .. Tt + K.
        ids = torch.cat([st.last[:, None], X], 1)  # [B, K+1]
        pos = st.lt[:, None] + torch.arange(K + 1, device=dev)[None, :]  # [B, K+1]
        if st.context is not None:
            pos = pos.clamp(max=st.context - 1)
        mask = None  # every row's cache is full: no padding, no mask
        if min(st.lt_host) < st.Tt:
            mask = torch.cat([torch.arange(st.Tt, device=dev)[None, :] < st.lt[:, None],
                              torch.ones((B, K + 1), dtype=torch.bool, device=dev)], 1)  # [B, Tt+K+1]
        if st.pend_tok is not None:
            logits, feats = self._t.step_hidden(st.tc, ids, mask, pos, st.Tt, K + 1)  # + [B, K+1, H]
        else:
            logits = self._t.step(st.tc, ids, mask, pos, st.Tt, K + 1)  # [B, K+1, V]
        if st.procs is not None:  # sequence processors: position i sees the row's ids, then x_1 .. x_i
            logits = st.procs(logits, X, kb.tolist(), st.rows, st.generated)
        # fused_verify's computation without its per-call argument checks (generate checked
        # the parameters; the tensors below are built here in its dtypes and shapes)
        temp, top_k, top_p, min_p = self._row_params(st, B)
        if self.verification == "block":  # the op's checks included (block verification is eager)
            out = fused_verify(logits, X, Q, num_draft_tokens=kb, temperature=temp, top_k=top_k, top_p=top_p,
                               min_p=min_p, seed=st.seed, offset=st.step, backend=self.verify_backend, method="block")
        else:
            out = _verify_checked(logits, X, Q, kb, temp, top_k, top_p, st.seed, st.step, min_p=min_p,
                                  backend=self.verify_backend)
        n = out.num_accepted  # [B] int64 in [-1, K_b]
        # On CUDA the mark goes before the sync, which then guarantees that the event has
        # completed (elapsed_time raises on one that has not).
        t_c = clock.mark()
        # The step's one host sync: counts, tokens, drafts, K_b.
        packed = torch.cat([n[:, None], kb[:, None], out.tokens[:, : K + 1], X], 1).cpu()
        n_host = packed[:, 0].tolist()
        kb_host = packed[:, 1].tolist()
        tok_host = packed[:, 2:3 + K].tolist()
        x_host = packed[:, 3 + K:].tolist()

        # Roll both caches back to what each row accepted (device work, no sync).
        keep_t = (n + 1).clamp(min=0)  # [B]: last + the accepted drafts
        compact_dynamic_cache_(st.tc, st.Tt, st.lt, keep_t)
        st.lt = st.lt + keep_t
        st.Tt += K + 1
        st.lt_host = [a + max(m + 1, 0) for a, m in zip(st.lt_host, n_host)]
        if Xd is not None:
            model_after_verify_(st, block, Xd, n, n_host)
        if skipped:
            feature_wait_(st, out, feats)
        elif st.pend_tok is not None:
            feature_after_verify_(st, out, feats, n, n_host, K)
        st.last = out.tokens.gather(1, n.clamp(min=0)[:, None])[:, 0]
        st.gen = st.gen + keep_t
        st.step = st.step + 1
        st.steps_done += 1

        # Host bookkeeping: emit, stop, log.
        emitted_counts = []
        for i, p in enumerate(st.rows):
            m = n_host[i]
            if m < 0:
                st.finish[p] = "nonfinite"
                emitted_counts.append(0)
                continue
            new = tok_host[i][: m + 1]
            room = st.budget_host[p] - len(st.generated[p])
            new = new[:room]
            reason = None
            for j, t in enumerate(new):
                if t in st.eos:
                    new, reason = new[: j + 1], "eos"
                    break
            if st.stop:
                cut = self._stop_cut(st.generated[p], new, st.stop)
                if cut is not None:
                    new, reason = new[:cut], "stop"
            if st.criteria is not None and new:
                cut = st.criteria(p, st.generated[p], new)  # the first token where one fires (EOS wins a tie)
                if cut is not None and (reason is None or cut < len(new)):
                    new, reason = new[:cut], "stop"
            if st.streamer is not None and new:
                st.streamer.put(torch.tensor(new))
            if st.verbose is not None:
                self._log(st, p, x_host[i][: kb_host[i]], m, kb_host[i], new)
            st.generated[p].extend(new)
            st.seqs[p].extend(new)
            emitted_counts.append(len(new))
            if reason is None and len(st.generated[p]) >= st.budget_host[p]:
                reason = "length" if st.budget_host[p] == st.max_new else "context"
            st.finish[p] = reason
        st.recorder.record_step(K, st.rows, kb_host, n_host, emitted_counts)
        st.recorder.record_times(clock.seconds(t_a, t_b), n_draft_fwd, clock.seconds(t_b, t_c),
                                 first_step=st.steps_done == 1, k=K, draft_typical=not waited)  # the target's time per K + 1 verified
        if st.pbar is not None:
            st.pbar.update(sum(emitted_counts))
        self._drop_finished(st)
        if st.rows:  # drop the columns past the longest row (rejected drafts, finished rows)
            st.Tt = max(st.lt_host)
            _crop_(st.tc, st.Tt)
            if st.dc is not None:
                st.Td = max(st.ld_host)
                _crop_(st.dc, st.Td)

    def _stop_cut(self, generated: list, new: list, stop: list) -> Optional[int]:
        """The number of ``new`` tokens up to the one that completes a stop string, or None.
        Only matches that end in the new tokens count; they may start in earlier ones."""
        tok = self.tokenizer
        longest = max(len(s) for s in stop)
        # Grow the window of earlier tokens until it holds a stop string's length in whole
        # characters: with byte-level tokens a window may start inside a character, whose first
        # bytes then decode as U+FFFD.
        w = longest
        while True:
            window = generated[-w:] if w else []
            old = tok.decode(window, skip_special_tokens=True)
            if len(old.lstrip("\ufffd")) >= longest or w >= len(generated):
                break
            w *= 2
        for j in range(1, len(new) + 1):
            text = tok.decode(window + new[:j], skip_special_tokens=True)
            # The characters that were already there: a character whose last bytes were still to
            # come decoded as U+FFFD in ``old`` and differs now, so the search starts before it.
            base = len(os.path.commonprefix([old, text]))
            for s in stop:
                if text.find(s, max(0, base - len(s) + 1)) != -1:
                    return j
        return None

    def _drop_finished(self, st: _State) -> None:
        keep = [i for i, p in enumerate(st.rows) if st.finish[p] is None]
        if len(keep) == len(st.rows):
            return
        st.rows = [st.rows[i] for i in keep]
        if not keep:
            return
        idx = to_device(keep, torch.int64, st.device)
        for name in ("last", "lt", "ld", "catch", "gen", "budget", "seed", "key_lo", "key_hi", "step"):
            t = getattr(st, name)
            if t is not None:
                setattr(st, name, t.index_select(0, idx))
        st.lt_host = [st.lt_host[i] for i in keep] if st.lt_host else st.lt_host
        st.ld_host = [st.ld_host[i] for i in keep] if st.ld_host else st.ld_host
        st.catch_host = [st.catch_host[i] for i in keep] if st.catch_host else st.catch_host
        if st.wait is not None:
            st.wait, st.wait_cnt = st.wait.index_select(0, idx), st.wait_cnt.index_select(0, idx)
            st.wait_host = [st.wait_host[i] for i in keep]
        if st.pend_tok is not None:
            st.pend_tok, st.pend_feat, st.pend_cnt = (t.index_select(0, idx) for t in (st.pend_tok, st.pend_feat,
                                                                                     st.pend_cnt))
            st.pend_cnt_host = [st.pend_cnt_host[i] for i in keep]
        if st.lt_host:  # after the prefill: slice the caches (the caller crops them)
            st.tc.batch_select_indices(idx)
            if st.dc is not None:
                st.dc.batch_select_indices(idx)

    def _log(self, st: _State, p: int, drafts: list, n: int, kb: int, emitted: list) -> None:
        """One row's step: its drafts, the accepted prefix, then the recovered or bonus token
        (shown only if it was emitted, i.e. not cut by EOS, a stop string or the budget); a row
        that drafted nothing (K = 0, or no room) shows the target's own token."""
        def show(ids):
            return repr(ids) if self.tokenizer is None else repr(self.tokenizer.decode(ids))

        out = st.verbose
        head = f"[step {st.steps_done} | row {p}]"
        if kb > 0:
            print(f"{head} Drafted:  {show(drafts)}", file=out)
            print(f"{head} Accepted: {show(drafts[:n])} ({n}/{kb} tokens)", file=out)
        if len(emitted) == n + 1:
            kind = "target, no drafts" if kb == 0 else "bonus" if n == kb else "recovered"
            print(f"{head} + {kind}: {show(emitted[n:])}", file=out)


# generate's arguments and their defaults, taken once (hf_args tells a passed argument from a default)
_GENERATE_DEFAULTS = {n: p.default for n, p in inspect.signature(SpeculativeDecoder.generate).parameters.items()
                      if n != "self"}
