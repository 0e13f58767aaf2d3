"""The verifier audit's cases of block verification (Sun et al. 2025): run for verifiers that set
``supports_block`` (they take ``params.method``)."""

from __future__ import annotations

__all__ = ["BLOCK_CASES"]

BLOCK_CASES: list = []
