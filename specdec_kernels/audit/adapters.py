"""Verifier adapters: each wraps a speculative sampler in the protocol of ``protocol`` (one call:
target logits [B, K+1, V], drafts [B, K], draft probabilities or None, per-row parameters ->
tokens [B, K+1] padded with -1, num_accepted [B]).

- ``ours``: ``specdec_kernels.fused_verify`` (padded layout); ``ours-packed``: ``fused_verify_packed``.
- ``transformers``: the verification of transformers' assisted generation with ``do_sample=True``
  (``transformers.generation.utils._speculative_sampling``, batch 1: one row at a time), after the
  warpers ``generate`` builds (temperature, top-k, top-p, min-p, in that order); a greedy row goes
  the way ``do_sample=False`` does (accept while the draft is the argmax).  No per-row seeds.
- ``flashinfer``: ``flashinfer.sampling.chain_speculative_sampling`` (probabilities in: the warp is
  applied here by ``laws.warp64``, so its cases test the verification only).
- ``vllm``: vLLM V1's ``RejectionSampler.forward``, run in vLLM's environment by ``vllm_worker``.
- ``module:function``: any callable of the protocol.

``load_verifier(name)`` returns one; a package that is not installed raises ``AdapterUnavailable``
with one line saying so.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

import torch

from .protocol import AdapterUnavailable, SamplingParams

__all__ = ["AdapterUnavailable", "VERIFIERS", "load_verifier", "run_calls"]

VERIFIERS = ("ours", "ours-packed", "vllm", "flashinfer", "transformers")


def _opt(t: torch.Tensor, off) -> Optional[torch.Tensor]:
    return None if bool((t == off).all()) else t


def ours(backend: str = "auto", packed: bool = False):
    """``fused_verify`` (or ``fused_verify_packed``) as a protocol verifier, with ``method=params.method``
    (token or block verification)."""
    from ..ops.verify import fused_verify, fused_verify_packed

    def verify(target_logits, draft_tokens, draft_probs, params: SamplingParams):
        kw = dict(temperature=params.temperature.float(), top_k=_opt(params.top_k, 0),
                  top_p=_opt(params.top_p.float(), 1.0), min_p=_opt(params.min_p.float(), 0.0), seed=params.seed,
                  backend=backend, method=params.method)
        if not packed:
            out = fused_verify(target_logits, draft_tokens, draft_probs, num_draft_tokens=params.num_draft_tokens, **kw)
            return out.tokens, out.num_accepted
        kb = params.num_draft_tokens.tolist()
        B, K1, _ = target_logits.shape
        logits = torch.cat([target_logits[b, :k + 1] for b, k in enumerate(kb)])  # [sum_b (K_b + 1), V]
        drafts = torch.cat([draft_tokens[b, :k] for b, k in enumerate(kb)])  # [sum_b K_b]
        q = None if draft_probs is None else torch.cat([draft_probs[b, :k] for b, k in enumerate(kb)])
        cu = torch.tensor([0] + kb).cumsum(0)
        out = fused_verify_packed(logits, drafts, cu, q, max_num_draft_tokens=K1 - 1, **kw)
        return out.tokens, out.num_accepted

    verify.supports_seed = True
    verify.supports_block = True  # params.method "block": fused_verify(..., method="block")
    verify.__name__ = "fused_verify_packed" if packed else "fused_verify"
    return verify


def transformers_verifier():
    """transformers' ``_speculative_sampling`` (assisted generation, ``do_sample=True``), row by row."""
    try:
        import transformers
        from transformers.generation import logits_process as lp
        from transformers.generation.utils import _speculative_sampling
    except ImportError as e:
        raise AdapterUnavailable(f"transformers' speculative sampling is not importable here: {e}") from None

    def warpers(T, top_k, top_p, min_p):
        procs = lp.LogitsProcessorList()
        if T != 1.0:
            procs.append(lp.TemperatureLogitsWarper(T))
        if top_k:
            procs.append(lp.TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            procs.append(lp.TopPLogitsWarper(top_p=top_p))
        if min_p:
            procs.append(lp.MinPLogitsWarper(min_p=min_p))
        return procs

    def verify(target_logits, draft_tokens, draft_probs, params: SamplingParams):
        B, K1, V = target_logits.shape
        tokens = torch.full((B, K1), -1, dtype=torch.int64)
        num = torch.zeros(B, dtype=torch.int64)
        combos = torch.stack([params.temperature, params.top_k.double(), params.top_p, params.min_p,
                              params.num_draft_tokens.double()], -1)
        for combo in torch.unique(combos, dim=0):
            rows = (combos == combo).all(-1).nonzero()[:, 0]
            T, top_k, top_p, min_p, kb = combo.tolist()
            kb = int(kb)
            if T == 0:  # do_sample=False: the argmax path
                sel = target_logits[rows, :kb + 1].float().argmax(-1)  # [n, kb + 1]
                match = (draft_tokens[rows, :kb] == sel[:, :kb]).long()
                n = match.cumprod(-1).sum(-1) if kb else torch.zeros(len(rows), dtype=torch.int64)
                for i, b in enumerate(rows.tolist()):
                    tokens[b, :int(n[i]) + 1] = sel[i, :int(n[i]) + 1]
                num[rows] = n
                continue
            procs = warpers(T, int(top_k), top_p, min_p)
            flat = target_logits[rows, :kb + 1].float().reshape(-1, V)
            warped = procs(None, flat).reshape(len(rows), kb + 1, V)  # the warpers do not read input_ids
            for i, b in enumerate(rows.tolist()):
                if kb == 0:  # no candidates: generate samples the next token from the target
                    t = torch.multinomial(torch.softmax(warped[i, 0], -1), 1)
                    tokens[b, 0] = t
                    continue
                if draft_probs is None:  # (an id outside [0, V) is left for transformers' own indexing)
                    q = torch.nn.functional.one_hot(draft_tokens[b, :kb].clamp(0, V - 1), V).float()
                else:
                    q = torch.zeros(kb, V)
                    q[:, :draft_probs.shape[-1]] = draft_probs[b, :kb].float()
                cand_logits = q.log()[None]  # softmax(log q) = q
                valid, n = _speculative_sampling(draft_tokens[b, :kb][None], cand_logits, kb, warped[i][None])
                n = int(n)
                tokens[b, :n + 1] = valid[0, :n + 1]
                num[b] = n
        return tokens, num

    verify.supports_seed = False
    verify.__name__ = f"transformers {transformers.__version__} _speculative_sampling"
    return verify


def flashinfer_verifier():
    """FlashInfer's ``chain_speculative_sampling`` on probabilities warped by ``laws.warp64``."""
    try:
        import flashinfer
        from flashinfer.sampling import chain_speculative_sampling
    except ImportError:
        raise AdapterUnavailable("flashinfer is not installed (pip install flashinfer-python; it needs CUDA)") from None
    if not torch.cuda.is_available():
        raise AdapterUnavailable(f"flashinfer {flashinfer.__version__} is installed but needs a CUDA device")
    from .laws import warp64

    def verify(target_logits, draft_tokens, draft_probs, params: SamplingParams):
        B, K1, V = target_logits.shape
        if bool((params.num_draft_tokens != K1 - 1).any()):
            raise NotImplementedError("chain_speculative_sampling takes one K for the whole batch")
        if bool((params.temperature == 0).any()):
            raise NotImplementedError("chain_speculative_sampling samples; greedy rows are not its interface")
        p = torch.stack([warp64(target_logits[b], float(params.temperature[b]), int(params.top_k[b]),
                                float(params.top_p[b]), float(params.min_p[b])) for b in range(B)])
        if draft_probs is None:
            q = torch.nn.functional.one_hot(draft_tokens.clamp(0, V - 1), V).float()
        else:
            q = torch.zeros(B, K1 - 1, V)
            q[..., :draft_probs.shape[-1]] = draft_probs.float()
        out = chain_speculative_sampling(q.cuda(), draft_tokens.int().cuda(), p.float().cuda())
        tokens, emitted = out[0].long().cpu(), out[2].long().cpu()
        return tokens, emitted

    verify.supports_seed = False
    verify.__name__ = f"flashinfer {flashinfer.__version__} chain_speculative_sampling"
    return verify


def user_verifier(spec: str):
    """``module:function`` (or ``path/to/file.py:function``): a callable of the protocol."""
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"--verifier must be one of {VERIFIERS} or module:function, got {spec!r}")
    try:
        if mod_name.endswith(".py"):
            s = importlib.util.spec_from_file_location("specdec_audit_user_verifier", mod_name)
            if s is None:
                raise ImportError(f"no such file: {mod_name}")
            mod = importlib.util.module_from_spec(s)
            s.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
    except (ImportError, FileNotFoundError) as e:
        raise AdapterUnavailable(f"cannot import {mod_name!r} for --verifier {spec}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--verifier {spec}: {mod_name} has no callable {fn_name!r}")
    return fn


def load_verifier(name: str, vllm_python: Optional[str] = None, backend: str = "auto"):
    """The verifier for a CLI name (``VERIFIERS`` or ``module:function``)."""
    if name == "ours":
        return ours(backend)
    if name == "ours-packed":
        return ours(backend, packed=True)
    if name == "transformers":
        return transformers_verifier()
    if name == "flashinfer":
        return flashinfer_verifier()
    if name == "vllm":
        from .vllm_bridge import vllm_verifier

        return vllm_verifier(vllm_python)
    return user_verifier(name)


def run_calls(verifier, calls: list, seed: int = 0) -> list:
    """Each call's output, or the exception it raised.  A verifier with ``run_many`` (one that runs
    elsewhere, such as vLLM's in its own environment) takes them all at once; others are called one
    by one, torch's generator seeded with ``seed + i`` before call i (reproducible without seeds)."""
    if hasattr(verifier, "run_many"):
        return verifier.run_many(calls, seed)
    outs = []
    for i, c in enumerate(calls):
        torch.manual_seed(seed + i)
        try:
            with torch.no_grad():
                outs.append(verifier(c.target_logits, c.draft_tokens, c.draft_probs, c.params))
        except Exception as e:  # noqa: BLE001 - reported as the case's error, not the tool's
            outs.append(e)
    return outs

