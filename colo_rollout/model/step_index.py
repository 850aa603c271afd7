"""A P step's per-token index arrays made on the device: each new token's position and KV slot
from its sequence's start, length and block table.

The host would otherwise build them with numpy -- a range, a shift and a mask, a gather through
the block table, a multiply-add per token -- and copy three token-long arrays instead of one,
all on the step's head, while the GPU waits for its first kernel (issue 16: at Qwen3 8 x 1k the
host spent 0.45 ms in the index arrays and 0.48 ms in their copy before layer 0, of a ~2 ms
head). Here the host sends one row per sequence (``META``: its first row in the step, its new
tokens, its start position) and the block tables, and one kernel writes positions and slots.

  * ``positions_and_slots(meta, tables, rows, block_size)``: meta [S, 3] int64 on the device,
    tables [S, W] int64 (padded with any block: entries past a sequence's last position are
    never read) -> (positions [rows], slots [rows]) int64, with slot = table[s, p // bs] * bs +
    p % bs. Rows not covered by a sequence are left unwritten. One launch; host values read:
    none (the grid from the caller's ``longest`` sequence).
  * ``positions_and_slots_torch``: the reference (any device), the same arrays by torch ops.

Invariant the caller keeps (worker/runner.py checks it on the host, per sequence): every
position p of sequence s has p // block_size < its table's length.

Imports torch and triton (where present), and model/bound_kernel.py.
"""

from __future__ import annotations

import torch

from colo_rollout.model.bound_kernel import BoundKernel, all_aligned
from colo_rollout.model.kernel_backend import tl, triton

META_COLUMNS = 3  # per sequence: first row, new tokens, start position
BLOCK = 1024  # tokens per program


def positions_and_slots_torch(meta: torch.Tensor, tables: torch.Tensor, rows: int,
                              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the same positions and slots by torch ops (rows not covered: zero)."""
    pos = torch.zeros(rows, dtype=torch.int64, device=meta.device)
    slots = torch.zeros(rows, dtype=torch.int64, device=meta.device)
    for s in range(meta.shape[0]):
        row0, n, start = (int(v) for v in meta[s])
        p = torch.arange(start, start + n, dtype=torch.int64, device=meta.device)
        pos[row0 : row0 + n] = p
        slots[row0 : row0 + n] = tables[s, p // block_size] * block_size + p % block_size
    return pos, slots


def positions_and_slots(meta: torch.Tensor, tables: torch.Tensor, rows: int, block_size: int,
                        longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and KV slots [rows] (int64) of a P step's new tokens, by one kernel (CUDA, or
    CPU tensors under the interpreter); ``longest``: the most new tokens of one sequence (the
    grid's second dimension). See the module docstring."""
    if triton is None:
        raise RuntimeError("triton is not importable: build the step's index arrays on the host")
    if meta.dtype != torch.int64 or tables.dtype != torch.int64 or meta.shape[-1] != 3:
        raise ValueError(f"meta {tuple(meta.shape)} {meta.dtype} / tables {tables.dtype}: "
                         "int64 [S, 3] and [S, W] expected")
    pos = torch.empty(rows, dtype=torch.int64, device=meta.device)
    slots = torch.empty(rows, dtype=torch.int64, device=meta.device)
    S = meta.shape[0]
    if S == 0 or rows == 0 or longest == 0:
        return pos, slots
    # meta and tables are views into the step's packed copy (any 8-byte offset): they and the
    # strides are do_not_specialize; the outputs are fresh (aligned) and the block size a
    # constexpr (one per engine): the key is the block size
    key = (block_size,) if all_aligned(pos, slots) else None
    _POS_SLOTS(key, (S, triton.cdiv(longest, BLOCK)),
               (meta, tables, pos, slots, meta.stride(0), tables.stride(0), block_size, BLOCK),
               4)
    return pos, slots


if triton is not None:

    @triton.jit(do_not_specialize=["META", "TABLES", "stride_m", "stride_t"])
    def _pos_slots_kernel(META, TABLES, POS, SLOTS, stride_m, stride_t,
                          BS: tl.constexpr, BLOCK_T: tl.constexpr):
        """Program (s, c): tokens c * BLOCK_T .. of sequence s -- positions start + i, slots
        through row s of the block tables."""
        s = tl.program_id(0)
        c = tl.program_id(1)
        row0 = tl.load(META + s * stride_m)
        n = tl.load(META + s * stride_m + 1)
        start = tl.load(META + s * stride_m + 2)
        i = c * BLOCK_T + tl.arange(0, BLOCK_T)
        m = i < n
        p = start + i
        blk = tl.load(TABLES + s.to(tl.int64) * stride_t + p // BS, mask=m, other=0)
        tl.store(POS + row0 + i, p, mask=m)
        tl.store(SLOTS + row0 + i, blk * BS + p % BS, mask=m)


_POS_SLOTS = BoundKernel(_pos_slots_kernel) if triton is not None else None

