"""The experts each token was routed to, recorded on the device per phase (routing replay).

Owns ``RoutingRecord``: two buffers [MoE layers, rows, k] of expert ids, P's and D's own (the
phases interleave, so nothing here is shared between them), that every MoE layer's router
writes its top-k ids into (``GatherMoE.forward``'s ``record``): rows are the layer's input rows
-- all replicas' tokens, as the gather backend routes them on every rank; a dispatch backend
writes only the rows its rank routes (model.py: ``records_own_rows``). Captured graphs (D's,
P's MoE blocks) write through the same addresses, so the buffers are made once, at their
largest: P's for ``p_rows`` tokens of a step, D's for ``d_rows`` rows of an iteration.

``read(phase, rows)`` copies the first ``rows`` rows to the host after the phase's work
enqueued so far on the current stream (runtime/device.py: ``Pending``); the next step of the
phase writes after it on the same stream.

Ids are int16 (experts < 32768); the host side keeps them as uint8 where E <= 256.
"""

from __future__ import annotations

import torch

from colo_rollout.runtime.device import Pending

PHASES = ("P", "D")


class RoutingRecord:
    def __init__(self, moe_layers: list[int], p_rows: int, d_rows: int, topk: int,
                 device: torch.device) -> None:
        self.index = {layer: j for j, layer in enumerate(moe_layers)}  # layer -> buffer slot
        self.topk = topk
        self._buf = {ph: torch.zeros((len(moe_layers), rows, topk), dtype=torch.int16,
                                     device=device)
                     for ph, rows in (("P", p_rows), ("D", d_rows))}

    def rows(self, phase: str) -> int:
        return self._buf[phase].shape[1]

    def view(self, phase: str, layer: int, rows: int) -> torch.Tensor:
        """Layer ``layer``'s [rows, k] slot of ``phase``'s buffer (what its router writes)."""
        buf = self._buf[phase]
        if rows > buf.shape[1]:
            raise ValueError(f"routing record: {rows} {phase} rows, the buffer holds "
                             f"{buf.shape[1]} (engine.max_prefill_tokens / decode_buckets)")
        return buf[self.index[layer], :rows]

    def read(self, phase: str, rows: int) -> Pending:
        """[MoE layers, rows, k] on the host, copied after the phase's work so far."""
        part = self._buf[phase][:, :rows]
        # on a CPU the buffer is the host copy: the next step would overwrite it
        return Pending(part if part.is_cuda else part.clone())
