"""The split kernel's scratch (``_Workspace``): arrival counters, per-chunk and per-position
partial records, candidate keys and float64 masses, one set per device and stream
(``device_workspace``), grown as needed and never freed.  The sizes (``_Workspace.sizes``) and the
offsets ``records`` reads follow the field layout at the top of ``_verify_split_kernel``'s body.
"""

from __future__ import annotations

from typing import Optional

import torch


class _Workspace:
    """The split kernel's scratch on one device and stream: arrival counters (zero between
    launches: every launch resets what it used) and partial records, grown as needed, never
    shrunk or freed.  Under CUDA-graph capture the capture stream's workspace is used when it
    exists and fits (warm up on the capture stream to get it: the graph then has no memset, and
    its replays must not overlap other calls that use that stream's workspace); otherwise the
    captured call makes a temporary one, zeroed inside the graph (one memset node per replay)."""

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
        return dict(counters=2 + B * K1 + 3 * B, part_f=(2 * N1 + 2 * B * K1) * (1 + d),
                    part_i=4 * N1 + 4 * B * K1 + 4 * B + B * NC + d * (N1 + B * K1), cand=max(1, N1 * cap),
                    mass=2 * N1 + B * K1 if block else B * NC)

    def fits(self, sizes: dict) -> bool:
        return all(self._fits(getattr(self, k), n) for k, n in sizes.items())

    def ensure(self, dev: torch.device, sizes: dict) -> None:
        """Grow what is too small (counters zeroed: a device op, once per growth, not per call).
        A replaced tensor is kept alive (``retired``): a CUDA graph captured with it replays into
        it (doubling keeps all of them under twice the largest)."""
        for k, n in sizes.items():
            old = getattr(self, k)
            if self._fits(old, n):
                continue
            if old is not None:
                self.retired.append(old)
            n = max(n, 2 * old.numel() if old is not None else 0)
            if k == "counters":
                t = torch.zeros(n, dtype=torch.int32, device=dev)
            else:
                t = torch.empty(n, dtype={"part_f": torch.float32, "mass": torch.float64}.get(k, torch.int32),
                                device=dev)
            setattr(self, k, t)

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


def device_workspace(dev: torch.device) -> _Workspace:
    stream = torch.cuda.current_stream(dev).stream_id if dev.type == "cuda" else 0
    key = (dev.type, dev.index, stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _Workspace()
    return ws
