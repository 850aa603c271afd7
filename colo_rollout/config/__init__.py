"""Run configuration for colo_rollout: schema, validation, YAML loading and dumping.

The typed description of one rollout job -- parallel layout, model shape, engine limits, the
synthetic workload, the benchmark and RL -- as frozen dataclasses (``schema``), the checks they
share (``checks``), and the single place where YAML files (and dotted-key overrides) become a
validated :class:`Config` (``loader``). Every problem is reported as a :class:`ConfigError`
whose message names the source file (when there is one) and the dotted key, e.g.
``configs/x.yaml: model.hidden_size: expected int, got str 'abc'``.

Only the standard library and PyYAML are used; YAML is always parsed with ``yaml.safe_load``.
"""

from colo_rollout.config.checks import ConfigError
from colo_rollout.config.loader import (
    Config,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)
from colo_rollout.config.schema import (
    BACKENDS,
    ENGINE_MODES,
    FP8_FORMATS,
    MOE_COMPUTE,
    MOE_DISPATCH,
    NORMALIZATIONS,
    PARAMS_DTYPES,
    SEGMENT_POLICIES,
    STREAM_PRIORITIES,
    STREAM_ROUTES,
    USE_TE_MODES,
    BenchConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RLConfig,
    WorkloadConfig,
)

__all__ = [
    "BACKENDS",
    "ENGINE_MODES",
    "FP8_FORMATS",
    "MOE_COMPUTE",
    "MOE_DISPATCH",
    "NORMALIZATIONS",
    "PARAMS_DTYPES",
    "SEGMENT_POLICIES",
    "STREAM_PRIORITIES",
    "STREAM_ROUTES",
    "USE_TE_MODES",
    "BenchConfig",
    "Config",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RLConfig",
    "WorkloadConfig",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
]
