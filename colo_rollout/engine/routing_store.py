"""Recorded routing on the host: the experts each token of a trajectory was routed to.

Owns ``RoutingStore``: per trajectory key (the request's session, else its id) an array
[positions, MoE layers, k] of expert ids, written at the absolute positions P and D computed
(a continuation turn's positions follow its context's; a re-prefill after eviction writes the
same positions again). Each position keeps the stamp of the run that wrote it last (the
plan's step + 1, the same on every rank; 0 = never written). ``take`` hands a trajectory's ids
over (and forgets them): its positions from 0 up to the first never written. Ids are uint8
where the model has <= 256 experts, else int16. Every rank keeps its own store: identical
ones with the gather backend (every replica's tokens routed on every rank); with a dispatch
backend only its replica's keys -- under attention TP only the positions of its ATP chunk of
the replica's rows -- which ``take_partial`` hands over with their stamps for
``Engine.take_routings`` to merge over the ranks (per position the latest stamp wins).

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
        self._stamps: dict[str, np.ndarray] = {}  # per position: the last writer's stamp

    def add(self, key: str, first: int, ids: torch.Tensor, stamp: int = 1) -> None:
        """ids [n, MoE layers, k] of positions first .. first + n - 1 of ``key``, written by
        the run stamped ``stamp`` (>= 1)."""
        n = ids.shape[0]
        if n == 0:
            return
        if stamp < 1:
            raise ValueError(f"routing stamp must be >= 1, got {stamp}")
        arr, st = self._ids.get(key), self._stamps.get(key)
        need = first + n
        if arr is None or arr.shape[0] < need:
            size = max(need, 2 * (arr.shape[0] if arr is not None else 0))
            grown = np.zeros((size, *self.shape), dtype=self.dtype)
            stamps = np.zeros(size, dtype=np.int64)
            if arr is not None:
                grown[: arr.shape[0]] = arr
                stamps[: st.shape[0]] = st
            arr, st = self._ids[key], self._stamps[key] = grown, stamps
        arr[first:need] = ids.numpy().astype(self.dtype, copy=False)
        st[first:need] = stamp

    def take(self, key: str, inputs: int | None = None) -> np.ndarray | None:
        """The ids of ``key``'s positions 0 .. n-1 (every position written so far, in order;
        a trajectory's last token was never an input, so n = its length - 1), forgotten
        here; None if nothing was recorded. ``inputs``: at most that many positions -- with
        MTP drafting a D iteration also routes the draft's position, which is past the last
        input when the draft was rejected and the sequence ended there."""
        arr, st = self._ids.pop(key, None), self._stamps.pop(key, None)
        if arr is None:
            return None
        unwritten = np.flatnonzero(st == 0)
        known = int(unwritten[0]) if unwritten.size else st.shape[0]
        if inputs is not None:
            known = min(known, inputs)
        return arr[:known].copy()

    def take_partial(self, key: str, inputs: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """``key``'s ids and stamps up to its last written position (at most ``inputs``),
        holes included (stamp 0), forgotten here; None if nothing was recorded."""
        arr, st = self._ids.pop(key, None), self._stamps.pop(key, None)
        if arr is None:
            return None
        written = np.flatnonzero(st)
        n = int(written[-1]) + 1 if written.size else 0
        if inputs is not None:
            n = min(n, inputs)
        return arr[:n].copy(), st[:n].copy()

    def trim(self, key: str, inputs: int) -> None:
        """Positions of ``key`` from ``inputs`` on no longer hold anything: a trajectory that
        ended with ``inputs`` input tokens (with MTP drafting, a rejected draft's position past
        them was routed: found by probing, a session's routing one row too long)."""
        st = self._stamps.get(key)
        if st is not None:
            st[max(inputs, 0):] = 0

    def drop(self, key: str) -> None:
        """Forget ``key``'s ids (a new conversation under a used key; a closed one nobody
        took)."""
        self._ids.pop(key, None)
        self._stamps.pop(key, None)

    def __len__(self) -> int:
        return len(self._ids)
