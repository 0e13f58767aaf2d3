"""The ``vllm`` verifier adapter: the audit's calls run by ``vllm_worker`` in an interpreter that
has vLLM (this one if ``import vllm`` works; else ``--vllm-python``, ``$SPECDEC_VLLM_PYTHON``, or
``.venv-vllm/bin/python`` beside the package's source tree or beside the running virtual environment,
as scripts/bootstrap_vllm.sh makes it).
All the calls of an audit go in one subprocess (vLLM's import takes seconds)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import tempfile
from pathlib import Path
from typing import Optional

import torch

from .protocol import AdapterUnavailable

__all__ = ["vllm_verifier", "find_vllm_python"]

ROOT = Path(__file__).resolve().parents[2]  # the directory holding specdec_kernels/


def find_vllm_python(given: Optional[str] = None) -> Optional[str]:
    """The interpreter to run vLLM in: None when it is this one."""
    for cand in (given, os.environ.get("SPECDEC_VLLM_PYTHON")):
        if cand:
            if not os.access(cand, os.X_OK):
                raise AdapterUnavailable(f"vllm: the interpreter {cand} does not exist or is not executable")
            return cand
    if importlib.util.find_spec("vllm") is not None:
        return None
    # .venv-vllm beside the source tree, or beside the virtual environment running this
    for local in (ROOT / ".venv-vllm" / "bin" / "python", Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"):
        if local.exists():
            return str(local)
    raise AdapterUnavailable("vllm is not installed (no `import vllm` here, no .venv-vllm: run "
                             "scripts/bootstrap_vllm.sh, or pass --vllm-python / set SPECDEC_VLLM_PYTHON)")


def _as_dict(c) -> dict:
    p = c.params
    return dict(target_logits=c.target_logits, draft_tokens=c.draft_tokens, draft_probs=c.draft_probs,
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                num_draft_tokens=p.num_draft_tokens, seed=p.seed)


class VllmVerifier:
    """vLLM's ``RejectionSampler.forward`` as a protocol verifier (``run_many``: every call in one
    worker).  ``versions`` holds vLLM's and its torch's after a run."""

    supports_seed = True
    __name__ = "vllm RejectionSampler"

    def __init__(self, python: Optional[str], fix_expand: bool = False):
        self.python = python
        self.fix_expand = fix_expand
        self.versions = {}

    def run_many(self, calls: list, seed: int = 0) -> list:
        payload = [_as_dict(c) for c in calls]
        if self.python is None:
            from .vllm_worker import run

            res = run(payload, seed, fix_expand=self.fix_expand)
        else:
            with tempfile.TemporaryDirectory() as d:
                src, dst = os.path.join(d, "in.pt"), os.path.join(d, "out.pt")
                torch.save(payload, src)
                env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                proc = subprocess.run([self.python, "-m", "specdec_kernels.audit.vllm_worker", src, dst, str(seed)]
                                      + (["fix-expand"] if self.fix_expand else []),
                                      cwd=str(ROOT), env=env, capture_output=True, text=True)
                if proc.returncode != 0 or not os.path.exists(dst):
                    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                    if "No module named 'vllm'" in proc.stderr:
                        raise AdapterUnavailable(f"vllm is not installed in {self.python}")
                    return [RuntimeError(f"the vLLM worker exited with status {proc.returncode}: {tail}")] * len(calls)
                res = torch.load(dst, weights_only=False)
        self.versions = {"vllm": res["versions"]["vllm"], "torch in vLLM's environment": res["versions"]["torch"]}
        out = []
        for r in res["results"]:
            if "error" in r:
                kind = NotImplementedError if r["error"] == "NotImplementedError" else RuntimeError
                out.append(kind(f"{r['error']}: {r['message']}" if kind is RuntimeError else r["message"]))
            else:
                out.append((r["tokens"], r["num_accepted"]))
        return out

    def __call__(self, target_logits, draft_tokens, draft_probs, params):
        from .protocol import Call

        out = self.run_many([Call(target_logits, draft_tokens, draft_probs, params)])[0]
        if isinstance(out, BaseException):
            raise out
        return out


def vllm_verifier(python: Optional[str] = None, fix_expand: bool = False) -> VllmVerifier:
    """``fix_expand``: vLLM with its CPU ``expand_batch_to_tokens`` replaced by a correct one
    (``vllm_worker._expand_fixed``), to see what else the audit finds."""
    return VllmVerifier(find_vllm_python(python), fix_expand)


