"""Many same-dtype tensor copies in one kernel launch: the weight sync's replay of whole
parameters (rl/weight_sync.py, ``LocalReplay``).

Why: a Qwen3-30B-A3B-shaped sync moves ~6,300 parameter pairs; ``torch._foreach_copy_`` pays
~2.6 us of host time per pair (its per-tensor checks and metadata), 17 ms over the 15 ms
the bytes take at copy speed. Here the pairs become a table of (source address, destination
address, length) chunks on the device, made once; a sync is one launch over the table and no
Python per tensor.

Owns ``MultiCopy``: the table (rebuilt by ``refresh`` when the tensors moved), ``run``, and
the rule that decides which pairs it takes (``eligible``): CUDA, triton importable, both
sides contiguous, the same dtype and size. The copy unit is the widest integer (8, 4, 2 or 1
bytes) dividing every address and length. Each program copies one chunk of at most CHUNK
units in BLOCK-unit steps.
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import tl, triton

CHUNK = 1 << 16  # units per program (512 KiB at 8-byte units)
BLOCK = 2048  # units per load/store step
_UNITS = (8, 4, 2, 1)


def eligible(dst: torch.Tensor, src: torch.Tensor, devices: tuple[str, ...] = ("cuda",)) -> bool:
    """Whether a (dst, src) pair can be a byte copy of this kernel (``devices``: the device
    types it may run on -- "cpu" only under Triton's interpreter, the tests)."""
    return (triton is not None and dst.device.type in devices and src.device == dst.device
            and dst.dtype == src.dtype and dst.numel() == src.numel()
            and dst.is_contiguous() and src.is_contiguous())


class MultiCopy:
    """``dst[i].copy_(src[i])`` for every i in one launch (``eligible`` pairs only). The tensors
    are read for their addresses at ``refresh`` (at construction too): call it again when any
    of them moved (weight_sync.LocalReplay does when a data pointer changed)."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor],
                 devices: tuple[str, ...] = ("cuda",)) -> None:
        if len(dst) != len(src) or not dst:
            raise ValueError("MultiCopy needs matching, non-empty lists")
        for d, s in zip(dst, src):
            if not eligible(d, s, devices):
                raise ValueError(f"MultiCopy cannot copy {tuple(s.shape)} {s.dtype} "
                                 f"{s.device} into {tuple(d.shape)} {d.dtype} {d.device}")
        self.dst, self.src = dst, src
        self.device = dst[0].device
        self.nbytes = sum(d.numel() * d.element_size() for d in dst)
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the chunk table from the tensors' current addresses."""
        da = [d.data_ptr() for d in self.dst]
        sa = [s.data_ptr() for s in self.src]
        lens = [d.numel() * d.element_size() for d in self.dst]
        unit = next(u for u in _UNITS
                    if all(x % u == 0 for xs in (da, sa, lens) for x in xs))
        n = torch.tensor(lens, dtype=torch.int64) // unit  # units per pair
        per = (n + CHUNK - 1) // CHUNK  # chunks per pair
        pair = torch.repeat_interleave(torch.arange(len(n)), per)
        first = torch.cumsum(per, 0) - per  # each pair's first chunk
        k = torch.arange(int(per.sum())) - first[pair]  # chunk index within its pair
        off = k * CHUNK * unit
        count = torch.minimum(n[pair] - k * CHUNK, torch.tensor(CHUNK))
        table = torch.stack([torch.tensor(sa, dtype=torch.int64)[pair] + off,
                             torch.tensor(da, dtype=torch.int64)[pair] + off, count])
        self.table = table.to(self.device)
        self.chunks = table.shape[1]
        self.unit = unit

    def run(self) -> int:
        """Enqueue the copies on the current stream; returns the bytes."""
        if self.chunks:
            dt = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[self.unit]
            t = self.table
            _copy_chunks[(self.chunks,)](t[0], t[1], t[2], DT=dt, CHUNK=CHUNK, BLOCK=BLOCK,
                                         num_warps=8)
        return self.nbytes


if triton is not None:

    @triton.jit
    def _copy_chunks(SrcAddr, DstAddr, Count, DT: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
        c = tl.program_id(0)
        src = tl.load(SrcAddr + c).to(tl.pointer_type(DT))
        dst = tl.load(DstAddr + c).to(tl.pointer_type(DT))
        n = tl.load(Count + c)
        for i in range(0, CHUNK, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
