"""Recorded routing on the host: the experts each token of a trajectory was routed to.

Owns ``RoutingStore``: per trajectory key (the request's session, else its id) an array
[positions, MoE layers, k] of expert ids, written at the absolute positions P and D computed
(a continuation turn's positions follow its context's; a re-prefill after eviction writes the
same positions again). ``take`` hands a trajectory's ids over (and forgets them). Ids are
uint8 where the model has <= 256 experts, else int16. Every rank keeps its own store:
identical ones with the gather backend (every replica's tokens routed on every rank); with a
dispatch backend only its replica's keys (``Engine.take_routings`` merges them over the ranks).

Host only (numpy); the device side is model/routing_record.py.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingStore:
    def __init__(self, moe_layers: int, topk: int, num_experts: int) -> None:
        self.shape = (moe_layers, topk)
        self.dtype = np.uint8 if num_experts <= 256 else np.int16
        self._ids: dict[str, np.ndarray] = {}
        self._known: dict[str, int] = {}  # positions [0, known) written, in order

    def add(self, key: str, first: int, ids: torch.Tensor) -> None:
        """ids [n, MoE layers, k] of positions first .. first + n - 1 of ``key``."""
        n = ids.shape[0]
        if n == 0:
            return
        arr = self._ids.get(key)
        need = first + n
        if arr is None or arr.shape[0] < need:
            grown = np.zeros((max(need, 2 * (arr.shape[0] if arr is not None else 0)),
                              *self.shape), dtype=self.dtype)
            if arr is not None:
                grown[: arr.shape[0]] = arr
            arr = self._ids[key] = grown
        arr[first:need] = ids.numpy().astype(self.dtype, copy=False)
        known = self._known.get(key, 0)
        if first <= known:  # contiguous from 0 (later positions of a re-prefill extend it)
            self._known[key] = max(known, need)

    def take(self, key: str, inputs: int | None = None) -> np.ndarray | None:
        """The ids of ``key``'s positions 0 .. n-1 (every position written so far, in order;
        a trajectory's last token was never an input, so n = its length - 1), forgotten
        here; None if nothing was recorded. ``inputs``: at most that many positions -- with
        MTP drafting a D iteration also routes the draft's position, which is past the last
        input when the draft was rejected and the sequence ended there."""
        arr = self._ids.pop(key, None)
        known = self._known.pop(key, 0)
        if inputs is not None:
            known = min(known, inputs)
        return None if arr is None else arr[:known].copy()

    def __len__(self) -> int:
        return len(self._ids)
