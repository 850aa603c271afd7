"""Multi-turn rollout traces: data model, JSONL replay format, paper-statistics generator and
the Mooncake importer. A trace is data; replay timing lives in colo_rollout.workloads.replay.

  model.py      Turn, Conversation, Trace, TraceStats, TraceError, PAPER_TARGETS
  jsonl.py      load_trace / dump_trace (validating; errors name file, line, field)
  generator.py  generate_trace, lognormal_from_quantiles, write_stats_table
  mooncake.py   load_mooncake
"""

from colo_rollout.workloads.trace.generator import (
    GeneratorParams,
    generate_trace,
    lognormal_from_quantiles,
    write_stats_table,
)
from colo_rollout.workloads.trace.jsonl import dump_trace, load_trace
from colo_rollout.workloads.trace.model import PAPER_TARGETS, Conversation, Trace, TraceError, TraceStats, Turn
from colo_rollout.workloads.trace.mooncake import load_mooncake

__all__ = [
    "PAPER_TARGETS",
    "Conversation",
    "GeneratorParams",
    "Trace",
    "TraceError",
    "TraceStats",
    "Turn",
    "dump_trace",
    "generate_trace",
    "load_mooncake",
    "load_trace",
    "lognormal_from_quantiles",
    "write_stats_table",
]
