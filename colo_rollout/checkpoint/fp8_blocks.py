"""Block-scaled FP8 checkpoints, read as the float weights they stand for.

The format (DeepSeek-V3's, and Qwen3-*-FP8 releases; config.json
``quantization_config`` {quant_method: fp8, fmt: e4m3, weight_block_size: [br, bc]}): a
quantised linear stores ``X.weight`` as e4m3 [N, K] beside ``X.weight_scale_inv`` float32
[ceil(N / br), ceil(K / bc)], and the weight is ``q[i, j] * scale_inv[i // br, j // bc]``;
what the release leaves in a float dtype (embeddings, norms, the router, lm_head) is stored as
usual.

Owns ``BlockFp8Store``: a ``CheckpointStore`` view whose names hide each stored weight's
``weight_scale_inv`` and whose ``read`` of such a weight -- whole, or any row / column span,
block-aligned or not -- returns the dequantised values (the span's e4m3 data times the scale
rows and columns covering it, in fp32, then the asked dtype). So the loader and its checks see
the float checkpoint the release was made from, and each rank still reads only its slices (of
the data and of the scales). Checked on opening, from the headers: every e4m3 weight has its
scale with the block grid's shape, and every scale its weight (else a CheckpointError naming the
tensor). With model.fp8 the engine then re-quantises from the dequantised weights.

Also ``quantize_blocks``, the writer's side of the format (how releases make their scales:
each block's amax / 448), for tests and benchmarks that build a release.

Must not go in here: which tensors a model needs (hf_names.py), the on-disk format of files
(store.py).
"""

from __future__ import annotations

import torch

from colo_rollout.checkpoint.store import CheckpointError, CheckpointStore

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPES = (torch.float8_e4m3fn,)
E4M3_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv fp32 [ceil(N / br), ceil(K / bc)]) as block-scaled
    FP8 releases store it: each block's amax / 448 is its scale, w ~ q * scale_inv. On w's
    device."""
    br, bc = block
    n, k = w.shape
    gn, gk = -(-n // br), -(-k // bc)
    padded = torch.zeros(gn * br, gk * bc, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, br, gk, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(gn * br, gk * bc)
    return q[:n, :k].to(torch.float8_e4m3fn), scale


class BlockFp8Store:
    """``store`` as float weights: e4m3 weights with block scales dequantised on read."""

    def __init__(self, store: CheckpointStore, block: tuple[int, int],
                 device: torch.device | str | None = None) -> None:
        # where the dequantisation runs (the parameters' device: a GPU multiplies the spans at
        # memory speed and the host moves one byte a weight); None: where the data is read
        self.store, self.block, self.device = store, block, device
        names = set(store.names())
        br, bc = block
        self._scales: dict[str, str] = {}  # weight name -> its scale's name
        for name in sorted(names):
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in names:
                    raise CheckpointError(f"a block scale without its weight {weight!r}",
                                          path=store.file_of(name), name=name)
                wdtype = store.dtype(weight)
                if wdtype not in FP8_DTYPES and wdtype.itemsize == 1:
                    # another 8-bit weight beside its scales is named as such (found by
                    # probing: an e5m2 weight was reported as its scale being unexpected)
                    raise CheckpointError(f"stored as {str(wdtype).removeprefix('torch.')} "
                                          "beside its block scales: block-scaled weights load "
                                          "from e4m3 (quantization_config.fmt)",
                                          path=store.file_of(weight), name=weight)
                continue
            if store.dtype(name) not in FP8_DTYPES:
                continue
            scale = name + SCALE_SUFFIX
            if scale not in names:
                raise CheckpointError(f"an e4m3 weight without its block scales {scale!r} "
                                      "(quantization_config: weight_block_size "
                                      f"{list(block)})", path=store.file_of(name), name=name)
            shape = store.shape(name)
            if len(shape) != 2:
                raise CheckpointError(f"a block-scaled weight of shape {list(shape)}: 2-D "
                                      "weights only", path=store.file_of(name), name=name)
            sdtype = store.dtype(scale)
            if not sdtype.is_floating_point or sdtype.itemsize < 2:
                # integer or 8-bit scales would multiply the codes by their truncations
                raise CheckpointError(f"stored as {str(sdtype).removeprefix('torch.')}: block "
                                      "scales load from float32, bfloat16 or float16",
                                      path=store.file_of(scale), name=scale)
            grid = (-(-shape[0] // br), -(-shape[1] // bc))
            if tuple(store.shape(scale)) != grid:
                raise CheckpointError(f"shape {list(store.shape(scale))}, expected "
                                      f"{list(grid)}: the [{br}, {bc}] blocks of {name}'s "
                                      f"{list(shape)}", path=store.file_of(scale), name=scale)
            self._scales[name] = scale
        self._hidden = set(self._scales.values())

    # -------------------------------------------------------------- the store's interface
    @property
    def directory(self):
        return self.store.directory

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    def names(self) -> list[str]:
        return [n for n in self.store.names() if n not in self._hidden]

    def __contains__(self, name: object) -> bool:
        return name not in self._hidden and name in self.store

    def file_of(self, name: str):
        return self.store.file_of(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.store.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        """A block-scaled weight reads as fp32 (its dequantised values)."""
        return torch.float32 if name in self._scales else self.store.dtype(name)

    def scaled(self, name: str) -> bool:
        """Whether ``name`` is stored as e4m3 with block scales."""
        return name in self._scales

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
             at: int | None = None) -> torch.Tensor:
        """As ``CheckpointStore.read``; a block-scaled weight's span is dequantised: its e4m3
        data times the scales of the blocks covering it (fp32, on ``device``), then cast to
        ``dtype`` (default fp32). Block-scaled weights are 2-D (no ``at``)."""
        scale_name = self._scales.get(name)
        if scale_name is None:
            return self.store.read(name, rows=rows, cols=cols, dtype=dtype, at=at)
        if at is not None:
            raise CheckpointError("block-scaled FP8 weights of fused experts ([experts, rows, "
                                  "cols]) are not supported; they load per expert",
                                  path=self.store.file_of(name), name=name)
        q = self.store.read(name, rows=rows, cols=cols)  # validates the spans
        if self.device is not None:
            q = q.to(self.device)
        n, k = self.store.shape(name)
        (r0, r1), (c0, c1) = rows or (0, n), cols or (0, k)
        br, bc = self.block
        # the scale blocks covering the span, expanded to elements and cut to it
        s = self.store.read(scale_name, rows=(r0 // br, -(-r1 // br)) if r1 > r0 else (0, 0),
                            cols=(c0 // bc, -(-c1 // bc)) if c1 > c0 else (0, 0),
                            dtype=torch.float32).to(q.device)
        s = s.repeat_interleave(br, 0)[r0 % br: r0 % br + (r1 - r0)]
        s = s.repeat_interleave(bc, 1)[:, c0 % bc: c0 % bc + (c1 - c0)]
        out = q.to(torch.float32) * s
        return out if dtype is None or dtype == torch.float32 else out.to(dtype)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> BlockFp8Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def float_view(store: CheckpointStore | BlockFp8Store, block: tuple[int, int] | None,
               device: torch.device | str | None = None) -> CheckpointStore | BlockFp8Store:
    """``store`` as float weights: a ``BlockFp8Store`` (dequantising on ``device``) where the
    checkpoint is block-scaled FP8 (``block``: ``HFArchitecture.weight_block``), else ``store``
    itself."""
    if block is None:
        return store
    if isinstance(store, BlockFp8Store):
        store = store.store
    return BlockFp8Store(store, block, device)
