"""The scheduling mode as a typed strategy, built once from config (``strategy_for``).

Owns what differs between the modes of the ordering ladder (DESIGN.md item 9), so that no other
module tests the mode's name:
  * ``Normal``: strict P priority, no multiplexing -- P and D run on the default stream one
    step each, with no turnstile and no rendezvous; P's MoE graphs are on by default.
  * ``Global(fence)``: PD mode with the whole P epoch as one segment (its span is every
    boundary). ``fence=True`` is Global-Complete (the host waits for P's GPU work before D may
    be enqueued); ``fence=False`` is Global-Enqueue (D goes once every rank host-enqueued P).
  * ``Fine(policy)``: the segment turnstile -- ready D goes first, and P advances by the
    policy's span of boundaries per round.
PD strategies keep P's MoE graphs off by default (docs/benchmarks.md, sessions 6-7: Fine with
them stalled on 2 GPUs while P's AllReduce was unrouted).

Must not go in here: the round itself (engine.py drives it from these properties), span
policies (segment_policy.py), streams (stream_route.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from colo_rollout.config import EngineConfig
from colo_rollout.multiplex.segment_policy import BalancedSpan, policy_for


@dataclass(frozen=True)
class Normal:
    """Strict P priority: one phase per step, no P/D machinery."""

    pd = False  # P/D multiplexing: P on its own stream, turnstile, rendezvous
    d_first = False  # ready D is enqueued before the P epoch's first segment
    fence = False  # whole-P GPU fence before D (Global-Complete)
    whole_epoch = True  # P's span is the whole epoch
    p_graphs_by_default = True  # engine.prefill_graphs "auto"
    policy = None  # the span policy (Fine only)
    balanced = False  # the span policy re-sizes K every round from rank-agreed hints


@dataclass(frozen=True)
class Global:
    """The whole P epoch as one segment; ``fence``: wait for its GPU work before D."""

    fence: bool
    pd = True
    d_first = False
    whole_epoch = True
    p_graphs_by_default = False
    policy = None
    balanced = False


@dataclass(frozen=True)
class Fine:
    """The segment turnstile with a span ``policy`` (fixed, load-selected or balanced)."""

    policy: object
    pd = True
    d_first = True
    fence = False
    whole_epoch = False
    p_graphs_by_default = False

    @property
    def balanced(self) -> bool:
        return isinstance(self.policy, BalancedSpan)


Strategy = Normal | Global | Fine


def strategy_for(engine: EngineConfig, boundaries: int) -> Strategy:
    """The strategy of ``engine.mode`` (validated by the config); ``boundaries``: one P epoch's
    boundary count (the balanced span's ceiling)."""
    if engine.mode == "normal":
        return Normal()
    if engine.mode in ("global_complete", "global_enqueue"):
        return Global(fence=engine.mode == "global_complete")
    return Fine(policy_for(engine, boundaries))
