"""The ground truth of the KV-cache ops ``specdec::compact_kv_`` and ``specdec::gather_kv_``
(``kv/cache.py``): plain loops over the indices, read on the host, with the CPU kernels' error
messages.
"""

from __future__ import annotations

import torch

__all__ = ["compact_kv_reference", "gather_kv_reference"]


def compact_kv_reference(
    caches: list[torch.Tensor],  # L x [B, H, T, D], any dtype; modified in place
    src_start: int,  # first position written by this step, in [0, T]
    dst_start: torch.Tensor,  # [B] int64, in [0, src_start]
    count: torch.Tensor,  # [B] int64, in [0, T - src_start]
) -> None:
    """KV-cache compaction, in place: for every cache c, row b and j in [0, count[b]),
    ``c[b, :, dst_start[b] + j, :] = c[b, :, src_start + j, :]``.

    Rows are copied one position at a time in increasing j, which is memmove semantics
    because ``dst_start[b] <= src_start``: a source position is always read before a
    destination write reaches it.  Raises ValueError for index values out of range, with the
    same text as the CPU kernel.  Reads the indices on the host (plain loops, no tricks).
    """
    dst = dst_start.tolist()  # [B]
    cnt = count.tolist()  # [B]
    shortest = min(range(len(caches)), key=lambda i: caches[i].shape[2])
    T = caches[shortest].shape[2]
    for b, (d, n) in enumerate(zip(dst, cnt)):
        if d < 0:
            raise ValueError(f"compact_kv_: dst_start[{b}] must be >= 0, got {d}")
        if d > src_start:
            raise ValueError(
                f"compact_kv_: dst_start[{b}] must be <= src_start = {src_start}, got {d}"
            )
        if n < 0:
            raise ValueError(f"compact_kv_: count[{b}] must be >= 0, got {n}")
        if n > T - src_start:
            raise ValueError(
                f"compact_kv_: src_start + count[{b}] must be <= T = {T} "
                f"(T = caches[{shortest}].size(2)), got {src_start} + {n}"
            )
    for c in caches:
        for b, (d, n) in enumerate(zip(dst, cnt)):
            for j in range(n):
                c[b, :, d + j, :] = c[b, :, src_start + j, :]  # [H, D]


def gather_kv_reference(
    caches: list[torch.Tensor],  # L x [B, H, T, D], any dtype, one T; modified in place
    src_index: torch.Tensor,  # [B, M] int64: row b's kept columns, strictly increasing, >= dst_start[b]
    count: torch.Tensor,  # [B] int64, in [0, M]: how many of src_index[b] are used
    dst_start: torch.Tensor,  # [B] int64, >= 0, dst_start[b] + count[b] <= T
) -> None:
    """KV-cache gathering, in place: for every cache c, row b and j in [0, count[b]),
    ``c[b, :, dst_start[b] + j, :] = old c[b, :, src_index[b, j], :]``.

    Every source column of a row is read (into a new tensor) before any of the row's columns is
    written, which is the op's "read before write" meaning whatever the index order.  The op
    requires the used indices to be strictly increasing with ``src_index[b, 0] >= dst_start[b]``
    (so that its kernels can copy in increasing j with no temporary); this function checks
    the same rules and raises ValueError for any value out of range, with the same text as the
    CPU kernel.  Entries ``src_index[b, j]`` for ``j >= count[b]`` are not read.  Reads the
    indices on the host (plain loops, no tricks).
    """
    src = src_index.tolist()  # [B][M]
    cnt = count.tolist()  # [B]
    dst = dst_start.tolist()  # [B]
    M = src_index.shape[1]
    T = caches[0].shape[2]
    for b, (d, n) in enumerate(zip(dst, cnt)):
        if d < 0:
            raise ValueError(f"gather_kv_: dst_start[{b}] must be >= 0, got {d}")
        if not 0 <= n <= M:
            raise ValueError(
                f"gather_kv_: count[{b}] must be in [0, M] = [0, {M}] (M = src_index.size(1)), got {n}"
            )
        if n > T - d:
            raise ValueError(
                f"gather_kv_: dst_start[{b}] + count[{b}] must be <= T = {T} "
                f"(T = caches[0].size(2)), got {d} + {n}"
            )
        for j in range(n):
            s = src[b][j]
            if not 0 <= s < T:
                raise ValueError(
                    f"gather_kv_: src_index[{b}, {j}] must be in [0, T) = [0, {T}) "
                    f"(T = caches[0].size(2)), got {s}"
                )
            if j == 0 and s < d:
                raise ValueError(
                    f"gather_kv_: src_index[{b}, 0] must be >= dst_start[{b}] = {d} "
                    f"(columns move towards the prefix only), got {s}"
                )
            if j > 0 and s <= src[b][j - 1]:
                raise ValueError(
                    f"gather_kv_: src_index[{b}, {j}] must be > src_index[{b}, {j - 1}] = "
                    f"{src[b][j - 1]} (the used indices must be strictly increasing), got {s}"
                )
    for c in caches:
        for b, (d, n) in enumerate(zip(dst, cnt)):
            if n == 0:
                continue
            idx = torch.tensor(src[b][:n], dtype=torch.int64, device=c.device)  # [n]
            old = c[b].index_select(1, idx)  # [H, n, D]: a copy, read before any write
            c[b, :, d : d + n, :] = old
