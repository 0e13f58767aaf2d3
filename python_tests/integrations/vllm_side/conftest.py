"""Tests that run inside vLLM's own environment (``.venv-vllm``, built by scripts/bootstrap_vllm.sh).

``python_tests/integrations/test_integration_vllm.py`` runs them there in a subprocess; in an environment
without vLLM they are not collected (the main suite's pytest sees nothing here).
"""

import importlib.util
import os
import sys

HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]

if HAS_VLLM:
    sys.path.insert(0, os.path.dirname(__file__))
