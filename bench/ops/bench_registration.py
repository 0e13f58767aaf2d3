"""What registering fused_verify as a torch.library custom op costs per call (STYLE item 4).

Decode steps live at microsecond scale, so the eager path of ``fused_verify`` calls the
implementation directly and only ``torch.compile`` goes through ``torch.ops.specdec.fused_verify``.
This measures the difference on a tiny step (B=1, K=1, V=16) where the overhead dominates:
the direct implementation, the registered op, and the public function (validation included).

    python bench/ops/bench_registration.py [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness
from harness import device_name, time_fn, versions  # noqa: E402

from specdec_kernels import fused_verify  # noqa: E402
from specdec_kernels.ops.verify import normalize_arguments, verify_normalized  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    backend = "triton" if dev.type == "cuda" else "torch"
    logits = torch.randn(1, 2, 16, device=dev)
    x = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    q = torch.softmax(torch.randn(1, 1, 16, device=dev), -1)
    a = normalize_arguments(logits, x, q, None, 1.0, None, None, torch.zeros(1, dtype=torch.int64, device=dev), 0, None)
    cases = {
        "direct implementation": lambda: verify_normalized(*a, backend),
        "torch.ops.specdec.fused_verify": lambda: torch.ops.specdec.fused_verify(*a, backend),
        "public fused_verify (validates)": lambda: fused_verify(logits, x, q, seed=0, backend=backend),
    }
    print(f"# registration overhead on {device_name(dev)}, backend={backend}; {versions()}")
    base = None
    for name, fn in cases.items():
        med, q20, q80 = time_fn(fn, dev, min_time_s=1.0, max_reps=5000)
        base = base or med
        print(f"{name:34s} median {med * 1e3:8.1f} us  (q20 {q20 * 1e3:.1f}, q80 {q80 * 1e3:.1f})  "
              f"+{(med - base) * 1e3:.1f} us over direct")


if __name__ == "__main__":
    main()
