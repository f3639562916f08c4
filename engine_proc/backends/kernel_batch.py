"""The checked boundary between the paged backend and its kernels.

The C kernels read and write where their arguments point: a block id past the pool, a
length past a row's block table, a slot in the null block or a position past the RoPE
table is an out-of-bounds read or write that nothing notices. So every pass's arguments
are checked here, once, before any kernel runs -- always (not under a debug flag), in
O(rows) Python plus four vector reductions (a minimum and maximum each of the block
tables, slots and positions, and a count of each row's null entries); the rows
at fault are looked for only once a check fails::

    block_tables [B, W] int32, contiguous     used entries (the first ceil(len / bs)) in [0, num_blocks);
                                              padding may be the null block (num_blocks)
    seq_lens / kernel_lens [B] (int32)        1 <= len <= W · block_size
    slots [T] int64, contiguous               in [0, num_blocks · block_size): never the null block
    positions [T] int64, contiguous           in [0, rope_positions)
    every tensor on the cache's device

A violation raises :class:`BatchRejected` naming the rows at fault; the pass has not run
and no row state has changed, so the scheduler fails those rows (logged) and carries on.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class BatchRejected(ValueError):
    """A pass's kernel arguments failed :func:`check_batch`; the pass did not run.
    ``rows``: the ids of the rows at fault (all of the pass's when the fault is not one
    row's, such as a tensor of the wrong dtype)."""

    def __init__(self, rows: Sequence[str], problem: str):
        super().__init__(f"{problem} (rows {', '.join(rows[:8])}{' …' if len(rows) > 8 else ''})")
        self.rows, self.problem = list(rows), problem


@dataclass(frozen=True)
class KernelLimits:
    """What the kernels may address: the pool's blocks and the RoPE table's rows."""

    num_blocks: int  # block ids 0 .. num_blocks-1; num_blocks is the null block
    block_size: int  # tokens per block
    rope_positions: int  # rows of the RoPE table (the context window)
    device: torch.device


def check_batch(limits: KernelLimits, row_ids: Sequence[str], block_tables: torch.Tensor,
                seq_lens: Sequence[int], slots: torch.Tensor, positions: torch.Tensor,
                token_offsets: Sequence[int] | None = None, kernel_lens: torch.Tensor | None = None) -> None:
    """Check one pass's kernel arguments (module docstring); raises :class:`BatchRejected`.

    ``row_ids`` ``[B]`` name the rows of ``block_tables`` ``[B, W]`` and ``seq_lens``
    ``[B]`` (tokens of KV after the pass); ``slots`` and ``positions`` ``[T]`` hold the
    pass's new tokens, row ``i``'s from ``token_offsets[i]`` (decode: one each, ``None``).
    """
    rows = list(row_ids)
    _check_tensor(rows, "block_tables", block_tables, torch.int32, 2, limits.device)
    _check_tensor(rows, "slots", slots, torch.int64, 1, limits.device)
    _check_tensor(rows, "positions", positions, torch.int64, 1, limits.device)
    b, width = block_tables.shape
    if b != len(rows) or len(seq_lens) != b:
        raise BatchRejected(rows, f"{b} block-table rows, {len(seq_lens)} lengths for {len(rows)} rows")
    if slots.numel() != positions.numel():
        raise BatchRejected(rows, f"{slots.numel()} slots for {positions.numel()} positions")
    if kernel_lens is not None:
        _check_tensor(rows, "kernel_lens", kernel_lens, torch.int32, 1, limits.device)
        if kernel_lens.numel() != b:
            raise BatchRejected(rows, f"{kernel_lens.numel()} kernel lengths for {b} rows")
    bs, capacity = limits.block_size, width * limits.block_size
    if not 1 <= min(seq_lens) <= max(seq_lens) <= capacity:
        raise BatchRejected([r for r, n in zip(rows, seq_lens) if not 1 <= n <= capacity],
                            f"a length outside [1, {capacity}] (the block table's {width} blocks)")
    if kernel_lens is not None and kernel_lens.tolist() != list(seq_lens):
        raise BatchRejected(rows, "kernel lengths differ from the rows' lengths")
    low, high = torch.aminmax(block_tables)
    if low.item() < 0 or high.item() > limits.num_blocks or _null_inside(block_tables, seq_lens, limits):
        _block_fault(limits, rows, block_tables, seq_lens)
    _check_range(rows, token_offsets, "slot", slots, limits.num_blocks * bs, "outside the pool's slots")
    _check_range(rows, token_offsets, "position", positions, limits.rope_positions,
                 f"past the RoPE table's {limits.rope_positions} rows")


def _null_inside(block_tables: torch.Tensor, seq_lens: Sequence[int], limits: KernelLimits) -> bool:
    """Whether a row holds the null block where its KV should be: more null entries than
    its padding (the entries past its ``ceil(len / block_size)`` blocks)."""
    width, bs = block_tables.shape[1], limits.block_size
    nulls = block_tables.eq(limits.num_blocks).sum(dim=1).tolist()
    return any(k > width + (-n // bs) for k, n in zip(nulls, seq_lens))  # width - ceil(n / bs)


def _block_fault(limits: KernelLimits, rows: list[str], block_tables: torch.Tensor, seq_lens: Sequence[int]):
    """The slow path, on a violation only: which rows hold a block id outside the pool."""
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < torch.tensor(
        [-(-n // limits.block_size) for n in seq_lens], device=block_tables.device)[:, None]
    bad = (block_tables < 0) | (block_tables > limits.num_blocks) | (used & (block_tables == limits.num_blocks))
    at = bad.any(dim=1).nonzero().flatten().tolist()
    raise BatchRejected([rows[i] for i in at] or rows, f"a block id outside the pool [0, {limits.num_blocks})")


def _check_tensor(rows: list[str], name: str, t: torch.Tensor, dtype: torch.dtype, dim: int,
                  device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise BatchRejected(rows, f"{name} is a {type(t).__name__}, not a tensor")
    if t.dtype != dtype:
        raise BatchRejected(rows, f"{name} is {t.dtype}, the kernels take {dtype}")
    if t.dim() != dim:
        raise BatchRejected(rows, f"{name} has {t.dim()} dimensions, the kernels take {dim}")
    if not t.is_contiguous():
        raise BatchRejected(rows, f"{name} is not contiguous")
    if t.device.type != device.type:
        raise BatchRejected(rows, f"{name} is on {t.device}, the KV cache on {device}")


def _check_range(rows: list[str], offsets: Sequence[int] | None, what: str, t: torch.Tensor, limit: int,
                 says: str) -> None:
    if t.numel() == 0:
        return
    low, high = torch.aminmax(t)
    if low.item() >= 0 and high.item() < limit:
        return
    bad = (t < 0) | (t >= limit)
    tokens = bad.nonzero().flatten().tolist()
    at = sorted({i if offsets is None else bisect_right(offsets, i) - 1 for i in tokens})
    raise BatchRejected([rows[i] for i in at if 0 <= i < len(rows)] or rows,
                        f"a {what} {says} ({t[tokens[0]].item()} of {limit})")
