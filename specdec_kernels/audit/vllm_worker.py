"""Runs the audit's verification calls through vLLM V1's ``RejectionSampler`` inside vLLM's own
environment (``.venv-vllm``): ``python -m specdec_kernels.audit.vllm_worker IN OUT SEED [fix-expand]``.

IN (``torch.save``): a list of calls, each a dict of target_logits [B, K+1, V], draft_tokens
[B, K], draft_probs [B, K, Vd] or None, and the [B] parameters.  Each is laid out as vLLM's V1
model runner lays out a step (``integrations.vllm.spec_decode_metadata``/``sampling_metadata``:
the rows' K_b draft positions then the bonus position, packed; top_k 0 stored as V; a seeded row
gets its own ``torch.Generator``) and run through vLLM's own, unpatched ``RejectionSampler.forward``
as it is (nothing replaced).  OUT: one dict per call, tokens [B, K+1] and num_accepted [B] (the
number emitted minus one; -1 when a row emits nothing), or error (the exception's type and first
line), plus the versions.
"""

from __future__ import annotations

import sys

import torch


def _one(sampler, call: dict, seed: int) -> dict:
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    from specdec_kernels.integrations import vllm as sv

    logits, drafts, q = call["target_logits"], call["draft_tokens"], call["draft_probs"]
    B, K1, V = logits.shape
    if bool((call["min_p"] > 0).any()):
        raise NotImplementedError("min-p: vLLM applies it as a logits processor (MinPLogitsProcessor) built from "
                                  "the engine's requests, which the audit does not build")
    kb = call["num_draft_tokens"].tolist()
    # SpecDecodeMetadata from the drafts (spec_decode_metadata refuses negative ids; the cases send none)
    md = sv.spec_decode_metadata([[int(t) for t in drafts[b, :k]] for b, k in enumerate(kb)])
    packed = torch.cat([logits[b, :k + 1] for b, k in enumerate(kb)]).clone()  # [sum_b (K_b + 1), V]
    qp = None
    if q is not None:
        qp = torch.zeros(sum(kb), V)
        qp[:, :q.shape[-1]] = torch.cat([q[b, :k] for b, k in enumerate(kb)]).float()
    T = call["temperature"].float()
    gens = None
    if call["seed"] is not None:
        gens = {b: torch.Generator().manual_seed(int(s)) for b, s in enumerate(call["seed"].tolist())}
    top_k = None if bool((call["top_k"] == 0).all()) else call["top_k"]
    top_p = None if bool((call["top_p"] >= 1).all()) else call["top_p"].float()
    sm = sv.sampling_metadata(T, top_k=top_k, top_p=top_p, generators=gens, vocab_size=V)
    torch.manual_seed(seed)
    out = sv.original_forward()(sampler, md, qp, packed, sm).sampled_token_ids.long()  # [B, K+1]
    n = (out != PLACEHOLDER_TOKEN_ID).sum(-1) - 1
    return {"tokens": out, "num_accepted": n}


def _expand_fixed(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` as its docstring defines it, in
    plain torch (x [B] repeated per token, ``replace_from`` replaced by ``replace_to``): on CPU,
    vLLM 0.32.0's C++ override of ``expand_kernel`` does not return float values."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    y = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(y == replace_from, torch.full_like(y, replace_to), y)


def run(calls: list, seed: int = 0, fix_expand: bool = False) -> dict:
    """Every call's result.  ``fix_expand``: replace vLLM's ``expand_batch_to_tokens`` by a correct
    torch version first, to tell what its CPU override causes from the rest."""
    import vllm
    import vllm.v1.sample.rejection_sampler as vrs
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    # the C++ replacements of vLLM's Triton kernels that an engine registers (worker_base.py)
    current_platform.register_triton_kernel_overrides()
    if fix_expand:
        vrs.expand_batch_to_tokens = _expand_fixed
    sampler = RejectionSampler(Sampler())
    results = []
    for i, call in enumerate(calls):
        try:
            with torch.no_grad():
                results.append(_one(sampler, call, seed + i))
        except Exception as e:  # noqa: BLE001 - one call's error, reported by its case
            results.append({"error": type(e).__name__, "message": (str(e).strip().splitlines() or [""])[0][:300]})
    return {"results": results, "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (3, 4):
        print("usage: python -m specdec_kernels.audit.vllm_worker IN OUT SEED [fix-expand]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    calls = torch.load(argv[0], weights_only=False)
    torch.save(run(calls, int(argv[2]), fix_expand=argv[3:] == ["fix-expand"]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
