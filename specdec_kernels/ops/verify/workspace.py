"""The split kernel's scratch (``SplitWorkspace``): arrival counters and ready flags, per-chunk and
per-position partial records, candidate keys and float64 masses.  One per device and stream
(``workspace``), one per captured CUDA graph (``captured_workspace``), grown as needed and never
freed.  The sizes (``SplitWorkspace.sizes``), the counters' layout (``counter_layout``) and the
offsets ``records`` reads come from the layout table the kernel's field pointers come from
(``records.py``).

Nothing a launch leaves here can reach a later call: the launcher zeroes the counters a launch
uses before it (one memset), and every record a launch reads was written earlier in the same
launch (the arrival counters order them).  Two launches that share a workspace never overlap:
calls on one stream are ordered, streams have their own, and a graph replays into its own.
"""

from __future__ import annotations

from typing import Optional

import torch

from .records import counter_layout, elements, field_offset, position_fields, tensor_size

class SplitWorkspace:
    """The split kernel's scratch on one device and stream (or of one captured graph): counters
    (zeroed by the launcher before each launch) and partial records, grown as needed, never
    shrunk or freed.  ``tensors()`` names them; ``reset()`` zeroes them all."""

    NAMES = ("counters", "part_f", "part_i", "cand", "mass")

    def __init__(self):
        self.counters = self.part_f = self.part_i = self.cand = self.mass = None
        self.retired: list = []

    @staticmethod
    def _fits(t: Optional[torch.Tensor], n: int) -> bool:
        return t is not None and t.numel() >= n

    @staticmethod
    def sizes(B: int, K1: int, NC: int, cap: int, draft_logits: bool = False, block: bool = False) -> dict:
        """Elements of each tensor a launch uses (``records.tensor_size``); ``draft_logits``: the
        draft's per-chunk max, sum and NaN/+inf count and its per-position (m_d, S_d, bad_d), after
        the other fields; ``block``: the float64 chunk masses and q counts of every position, and
        the rule's p_i; ``cap``: candidate keys per chunk (0: no warp)."""
        rec = {t: tensor_size(t, B, K1, NC, draft_logits, block) for t in ("part_f", "part_i", "mass")}
        return dict(counters=counter_layout(B, K1)["total"], part_f=rec["part_f"], part_i=rec["part_i"],
                    cand=max(1, B * K1 * NC * cap), mass=rec["mass"])

    def fits(self, sizes: dict) -> bool:
        return all(self._fits(getattr(self, k), n) for k, n in sizes.items())

    def ensure(self, dev: torch.device, sizes: dict) -> None:
        """Grow what is too small.  A replaced tensor is kept alive (``retired``): a CUDA graph
        captured with it replays into it (doubling keeps all of them under twice the largest).
        The tensors are made as normal tensors even inside ``torch.inference_mode()`` (a decoding
        loop's first call): an inference tensor could not be zeroed by a later call outside it."""
        for k, n in sizes.items():
            old = getattr(self, k)
            if self._fits(old, n):
                continue
            if old is not None:
                self.retired.append(old)
            n = max(n, 2 * old.numel() if old is not None else 0)
            dtype = {"part_f": torch.float32, "mass": torch.float64}.get(k, torch.int32)
            with torch.inference_mode(False):
                setattr(self, k, torch.zeros(n, dtype=dtype, device=dev) if k == "counters"
                        else torch.empty(n, dtype=dtype, device=dev))

    def tensors(self) -> dict:
        """{name: tensor} of the current tensors (none before the first launch): ``counters``
        (int32: ticket, arrivals, ready flags; ``counter_layout``), ``part_f`` (fp32 records),
        ``part_i`` (int32 records), ``cand`` (int32 candidate keys), ``mass`` (float64 masses)."""
        return {k: getattr(self, k) for k in self.NAMES if getattr(self, k) is not None}

    def reset(self) -> None:
        """Zero every tensor (a device op on the current stream).  Never needed for correctness:
        each launch zeroes the counters it uses; for tools that inspect the workspace."""
        for t in self.tensors().values():
            t.zero_()

    def records(self, B: int, K1: int, NC: int, draft_logits: bool = False) -> dict:
        """The last launch's per-position records as [B, K+1] views (tests and diagnostics):
        m (max), S (kept mass), argmax, bad, thr (the smallest kept order key), scanned (1 where
        top-k/top-p fell back to bisecting the whole position), in the kernel's layout; with
        ``draft_logits`` (a launch with draft logits) also m_d, S_d, bad_d (the draft's max, sum
        and unusable flag, written at the positions i < K_b of sampled rows)."""
        out = {}
        for tensor, field in position_fields(("part_f", "part_i"), draft_logits):
            at = elements(field_offset(tensor, field), B, K1, NC)
            out[field] = getattr(self, tensor)[at:at + B * K1].view(B, K1)
        return out


_WORKSPACES: dict = {}
# One workspace per captured call, alive as long as the process (a graph replays into it).
_CAPTURED: list = []


def workspace(dev: torch.device, stream: Optional[int] = None) -> SplitWorkspace:
    """The workspace of ``dev`` and a stream (its ``stream_id``; None: the current stream)."""
    if stream is None:
        stream = torch.cuda.current_stream(dev).stream_id if dev.type == "cuda" else 0
    key = (dev.type, dev.index, stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = SplitWorkspace()
    return ws


def captured_workspace() -> SplitWorkspace:
    """A new workspace for a call under CUDA-graph capture, kept alive with the process: its
    tensors come from the graph's pool, and no other graph or eager call ever uses it."""
    ws = SplitWorkspace()
    _CAPTURED.append(ws)
    return ws
