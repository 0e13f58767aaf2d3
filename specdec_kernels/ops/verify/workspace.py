"""The split kernel's scratch (``SplitWorkspace``): arrival counters and ready flags, per-chunk and
per-position partial records, candidate keys and float64 masses.  One per device and stream
(``workspace``), one per captured CUDA graph (``captured_workspace``), grown as needed and never
freed.  The sizes (``SplitWorkspace.sizes``), the counters' layout (``counter_layout``) and the
offsets ``records`` reads follow the field layout of ``triton/stage1.py`` (``_f_fields``, ``_i_fields``).

Nothing a launch leaves here can reach a later call: the launcher zeroes the counters a launch
uses before it (one memset), and every record a launch reads was written earlier in the same
launch (the arrival counters order them).  Two launches that share a workspace never overlap:
calls on one stream are ordered, streams have their own, and a graph replays into its own.
"""

from __future__ import annotations

from typing import Optional

import torch

# int32 counters per 128-byte line: the ticket, the position and row counters, the ready flags
# and the stage-2 counters each start on a line of their own (no false sharing between the
# ticket every program claims from and the flags stage 2 polls).
LINE = 32


def _line_up(n: int) -> int:
    return -(-n // LINE) * LINE


def counter_layout(B: int, K1: int) -> dict:
    """Where each counter field starts in ``counters`` (int32 elements), and the total used:
    ticket [1], pos [B * K1] (position arrivals), row [B] (row arrivals), ready [B] (the row's
    acceptance chain is done), s2 [B] (stage-2 arrivals).  The kernel computes the same offsets."""
    pos = LINE
    row = _line_up(pos + B * K1)
    ready = _line_up(row + B)
    s2 = _line_up(ready + B)
    return dict(ticket=0, pos=pos, row=row, ready=ready, s2=s2, total=_line_up(s2 + B))


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
        """Elements of each tensor a launch uses; ``draft_logits``: the draft's per-chunk max, sum
        and NaN/+inf count and its per-position (m_d, S_d, bad_d), after the other fields;
        ``block``: the float64 chunk masses and q counts of every position, and the rule's p_i."""
        N1 = B * K1 * NC
        d = 1 if draft_logits else 0
        return dict(counters=counter_layout(B, K1)["total"], part_f=(2 * N1 + 2 * B * K1) * (1 + d),
                    part_i=4 * N1 + 4 * B * K1 + 4 * B + B * NC + d * (N1 + B * K1), cand=max(1, N1 * cap),
                    mass=2 * N1 + B * K1 if block else B * NC)

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
        N1, P = B * K1 * NC, B * K1
        f, i = self.part_f, self.part_i
        c = 4 * N1  # the position records follow the four per-chunk arrays
        rows = c + 3 * P + 4 * B + B * NC  # where `scanned` starts
        out = dict(m=f[2 * N1:2 * N1 + P].view(B, K1), S=f[2 * N1 + P:2 * N1 + 2 * P].view(B, K1),
                   argmax=i[c:c + P].view(B, K1), bad=i[c + P:c + 2 * P].view(B, K1),
                   thr=i[c + 2 * P:c + 3 * P].view(B, K1), scanned=i[rows:rows + P].view(B, K1))
        if draft_logits:
            fd = 2 * N1 + 2 * P + 2 * N1  # after the target's fields and the draft's two per-chunk arrays
            idd = rows + P + N1  # after `scanned` and the draft's per-chunk counts
            out.update(m_d=f[fd:fd + P].view(B, K1), S_d=f[fd + P:fd + 2 * P].view(B, K1),
                       bad_d=i[idd:idd + P].view(B, K1))
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
