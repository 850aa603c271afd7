"""A whole run configuration: cross-section rules, YAML loading (safe_load), overrides, dumping.

The single place where YAML files and dotted-key overrides (``--set KEY=VALUE``) become a
validated ``Config``. YAML is read with safe_load's semantics, except that a key repeated in one
mapping is an error naming both lines (PyYAML would keep the last silently).
"""

import bisect
import copy
import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from colo_rollout.config.files import FileProblem, read_regular_file
from colo_rollout.config.checks import (
    ConfigError,
    _check_field_types,
    _describe,
    _error,
    _key_text,
    _require,
    _short,
    _with_source,
)
from colo_rollout.config.schema import (
    BenchConfig,
    BenchSpeedConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RLConfig,
    WorkloadConfig,
    batch_invariance_problem,
    deepep_layout_problem,
    trainer_tp_widths,
)

@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole rollout job; checks the constraints that span sections.

    (decode_buckets[-1] >= max_batch_size lives in EngineConfig, which owns both keys.)
    """

    SECTION: ClassVar[str] = ""

    # Process layout.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Model shape and numerics.
    model: ModelConfig = field(default_factory=ModelConfig)
    # Engine limits.
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Synthetic workload.
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    # Trace-replay benchmark.
    bench: BenchConfig = field(default_factory=BenchConfig)
    # Decode/prefill speed against the roofline (colo-rollout bench-speed).
    bench_speed: BenchSpeedConfig = field(default_factory=BenchSpeedConfig)
    # Colocated RL training.
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self) -> None:
        _check_field_types(self)
        par, model, engine = self.parallel, self.model, self.engine
        atp_desc = f"parallel.atp {par.atp} (world_size {par.world_size} / adp {par.adp})"
        _require(
            model.num_attention_heads % par.atp == 0,
            "model.num_attention_heads",
            f"{model.num_attention_heads} is not divisible by {atp_desc}; ATP shards attention heads",
        )
        _require(
            model.is_mla or model.num_query_groups % par.atp == 0,  # MLA: no KV groups
            "model.num_query_groups",
            f"{model.num_query_groups} is not divisible by {atp_desc}; ATP shards KV groups",
        )
        _require(
            model.vocab_size % par.atp == 0,
            "model.vocab_size",
            f"{model.vocab_size} is not divisible by {atp_desc}; the embedding is vocab-parallel",
        )
        for key, width in (("ffn_hidden_size", model.dense_ffn_hidden_size if
                            model.has_dense_layers else None),
                           ("shared_expert_ffn_hidden_size", model.shared_expert_ffn_hidden_size)):
            _require(width is None or width % par.atp == 0, f"model.{key}",
                     f"{width} is not divisible by {atp_desc}; ATP shards dense and shared-expert "
                     "FFNs")
        _require(
            model.moe_ffn_hidden_size % par.etp == 0,
            "model.moe_ffn_hidden_size",
            f"{model.moe_ffn_hidden_size} is not divisible by the expert TP width {par.etp} "
            f"(world_size {par.world_size} / ep {par.ep})",
        )
        _require(
            model.moe_dispatch != "alltoall" or par.ep == par.world_size,
            "model.moe_dispatch",
            f"'alltoall' needs every expert whole on one rank: parallel.ep {par.ep} must equal "
            f"world_size {par.world_size} (expert TP {par.etp} is not supported by it)",
        )
        _require(
            model.moe_dispatch != "deepep" or par.ep == par.world_size,
            "model.moe_dispatch",
            f"'deepep' needs every expert whole on one rank: parallel.ep {par.ep} must equal "
            f"world_size {par.world_size}",
        )
        why = (deepep_layout_problem(par.ep, model.hidden_size, model.moe_router_topk)
               if model.moe_dispatch == "deepep" else None)
        _require(why is None, "model.moe_dispatch", f"'deepep': {why}")
        _require(
            model.moe_dispatch != "deepep" or par.backend == "nccl",
            "model.moe_dispatch",
            f"'deepep' runs on GPU ranks (NVLink/NVSHMEM), and parallel.backend is "
            f"{par.backend!r}; use 'alltoall' (every backend) or 'gather'",
        )
        _require(
            self.rl.task != "reverse" or self.rl.reverse_alphabet + 1 < model.vocab_size,
            "rl.reverse_alphabet",
            f"{self.rl.reverse_alphabet} symbols and a separator do not fit model.vocab_size "
            f"{model.vocab_size}",
        )
        _require(
            not engine.mtp or model.mtp_num_layers >= 1,
            "engine.mtp",
            "drafts with the model's MTP layer, and model.mtp_num_layers is 0 (a checkpoint "
            "ships one as num_nextn_predict_layers with the layer's tensors; transformers' "
            "save_pretrained writes none)",
        )
        if model.is_mla:
            _require(engine.prefill_attention != "triton", "engine.prefill_attention",
                     "'triton' with model.attention 'mla': MLA's P has no Triton kernel "
                     "('auto', 'torch', 'cudnn' or 'flash')")
        why = batch_invariance_problem(model) if engine.batch_invariant else None
        _require(why is None, "engine.batch_invariant", str(why))
        tp = self.rl.trainer_tp
        # megatron's MTP layer on the local spec cannot run sequence parallelism (its torch
        # norms assert; found by probing: the trainer crashed building it)
        _require(tp == 1 or model.mtp_num_layers == 0, "rl.trainer_tp",
                 f"{tp} with model.mtp_num_layers {model.mtp_num_layers}: megatron's MTP layer "
                 "on the local spec cannot take the sequence parallelism a TP trainer runs; "
                 "train an MTP model at rl.trainer_tp 1 (rl.trainer_ep for expert parallelism)")
        tp_widths = {"parallel.world_size": par.world_size,
                     **trainer_tp_widths(model, self.rl.trainer_ep)}
        bad = [f"{k} {v}" for k, v in tp_widths.items() if v % tp]
        _require(
            not bad, "rl.trainer_tp",
            f"{tp} does not divide {', '.join(bad)} (the trainer's TP splits the ranks, heads, "
            "KV groups, the vocabulary and the FFN widths)",
        )
        _require(
            par.world_size % self.rl.trainer_ep == 0
            and model.num_experts % self.rl.trainer_ep == 0,
            "rl.trainer_ep",
            f"{self.rl.trainer_ep} must divide parallel.world_size {par.world_size} and "
            f"model.num_experts {model.num_experts}",
        )
        _require(
            self.rl.recompute == "none" or par.backend == "nccl",
            "rl.recompute",
            "'full' needs GPUs (parallel.backend nccl): megatron's recompute saves and restores "
            "CUDA RNG states",
        )
        _require(
            not self.rl.routing_replay or engine.record_routing,
            "rl.routing_replay",
            "needs engine.record_routing: true (the rollout must record what the trainer "
            "replays)",
        )
        _require(
            model.num_experts % par.ep == 0,
            "model.num_experts",
            f"{model.num_experts} is not divisible by parallel.ep {par.ep}",
        )
        _require(
            engine.max_seq_len <= model.max_position_embeddings,
            "engine.max_seq_len",
            f"{engine.max_seq_len} exceeds model.max_position_embeddings "
            f"{model.max_position_embeddings}",
        )
        if engine.eos_token_id is not None:
            _require(
                engine.eos_token_id < model.vocab_size,
                "engine.eos_token_id",
                f"{engine.eos_token_id} is out of range for model.vocab_size {model.vocab_size}",
            )
        bad = [i for i in engine.stop_token_ids if i >= model.vocab_size]
        _require(not bad, "engine.stop_token_ids",
                 f"{bad[:1]} is out of range for model.vocab_size {model.vocab_size}")
        # (the workload section is the demo's alone: the door's check_demo holds its requests
        # to the engine's limits, so a bench or train config need not size it)


# --------------------------------------------------------------------------- #
# dict <-> Config, YAML
# --------------------------------------------------------------------------- #


def _did_you_mean(key: Any, allowed: list[str]) -> str:
    """A hint naming the allowed keys closest to a misspelt ``key`` (difflib's ratio >= 0.6,
    or, for keys of 4+ characters, one that starts with it or it with one: ``max_batch`` for
    ``max_batch_size``), else ""."""
    if not isinstance(key, str) or not key:
        return ""
    near = ([a for a in allowed if a.startswith(key) or key.startswith(a)] if len(key) >= 4
            else [])
    near += [a for a in difflib.get_close_matches(key, allowed, n=3) if a not in near]
    return f" (did you mean {' or '.join(near[:3])}?)" if near else ""


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from mapping ``data``, recursing into dataclass-typed fields.

    Unknown keys are rejected here; scalar type checks and validation run in
    each class's ``__post_init__``.  ``prefix`` is the dotted key of ``data``.
    """
    where = prefix or "top level"
    if data is None and prefix:  # a section's header alone (``bench:``): its defaults
        data = {}
    if not isinstance(data, Mapping):
        at = "" if prefix else " at the top level"
        raise _error(prefix, f"expected a mapping{at}, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{_key_text(key)}" if prefix else _key_text(key)
        if key not in allowed:
            # (found by probing: `on:` and `null:` were named engine.True and engine.None)
            read = (" (YAML reads an unquoted yes/no/on/off/true/false key as a boolean, null "
                    "or ~ as null: quote a key meant as text)"
                    if key is None or isinstance(key, bool) else "")
            raise _error(dotted, f"unknown key{read}{_did_you_mean(key, allowed)}; allowed "
                                 f"keys at {where}: {', '.join(allowed)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            value = _build(tp, value, dotted)
        kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a :class:`Config` from plain nested data (as parsed from YAML).

    Missing keys take their defaults.  Any problem is a :class:`ConfigError`
    whose message starts with ``source``.
    """
    data, arch = _with_checkpoint_fields(data, source)
    try:
        return _build(Config, data, "")
    except ConfigError as err:
        field_name = (err.key or "").removeprefix("model.")
        if arch is not None and field_name in arch.sources:  # a value config.json gave
            src = arch.sources[field_name]
            origin = "architectures" if src == "architectures" else src
            err = ConfigError(f"{err} (model.{field_name} comes from {arch.path}: {origin})",
                              key=err.key)
        raise _with_source(err, source) from err


def _with_checkpoint_fields(data: Mapping[str, Any], source: str):
    """(``data`` with the model section's architecture fields read from ``model.checkpoint``'s
    config.json (config/hf_config.py) when it names one, that HFArchitecture or None)."""
    model = data.get("model") if isinstance(data, Mapping) else None
    if isinstance(model, Mapping) and isinstance(model.get("checkpoint"), os.PathLike):
        # (a pathlib.Path from Python callers: the path it names)
        model = {**model, "checkpoint": os.fspath(model["checkpoint"])}
        data = {**data, "model": model}
    if not (isinstance(model, Mapping) and isinstance(model.get("checkpoint"), str)):
        return data, None  # no checkpoint (a wrong type is reported by the schema)
    from colo_rollout.config.hf_config import ContradictionError, merge_checkpoint_fields
    from colo_rollout.config.checkpoint_errors import CheckpointError

    try:
        merged, arch = merge_checkpoint_fields(dict(model), source)
    except CheckpointError as err:  # names config.json (or the directory) and its key
        raise ConfigError(f"{source}: model.checkpoint: {err}", key="model.checkpoint",
                          source=source) from None
    except ContradictionError as err:
        raise _with_source(ConfigError(str(err), key=err.key), source) from None
    return {**data, "model": merged, **_checkpoint_engine(data, merged, source)}, arch


def _checkpoint_engine(data: Mapping[str, Any], model: Mapping[str, Any], source: str) -> dict:
    """``{"engine": ...}`` with what the checkpoint decides where the YAML leaves it unset
    (found by probing: an engine built from a checkpoint ran past its eos to max_tokens, and
    one of a model with fewer than 1024 positions was refused naming engine.max_seq_len, a key
    the user never wrote):

      * engine.eos_token_id (and engine.stop_token_ids: the other ids) from the checkpoint's
        generation_config.json / config.json, as transformers' generate stops;
        ``engine.eos_token_id: null`` keeps it off. Ids past the vocabulary (never
        generated) are left out;
      * engine.max_seq_len at most the model's max_position_embeddings.

    ``{}`` when nothing is filled."""
    engine = data.get("engine")
    if engine is None:
        engine = {}
    if not isinstance(engine, Mapping):
        return {}  # (the schema names the wrong type)
    out = dict(engine)
    positions = model.get("max_position_embeddings")
    default_len = EngineConfig.max_seq_len
    if "max_seq_len" not in engine and isinstance(positions, int) \
            and not isinstance(positions, bool) and 0 < positions < default_len:
        out["max_seq_len"] = positions
    if "eos_token_id" not in engine:
        out.update(_checkpoint_eos(engine, model, source))
    return {"engine": out} if out != engine else {}


def _checkpoint_eos(engine: Mapping[str, Any], model: Mapping[str, Any], source: str) -> dict:
    """engine.eos_token_id / stop_token_ids from the checkpoint (``_checkpoint_engine``)."""
    from colo_rollout.config.checkpoint_errors import CheckpointError
    from colo_rollout.config.hf_config import checkpoint_eos_ids

    try:
        ids = checkpoint_eos_ids(model["checkpoint"])
    except CheckpointError as err:
        raise ConfigError(f"{source}: model.checkpoint: {err}", key="model.checkpoint",
                          source=source) from None
    vocab = model.get("vocab_size")
    ids = [i for i in ids if not isinstance(vocab, int) or i < vocab]
    if not ids:
        return {}
    out = {"eos_token_id": ids[0]}
    if "stop_token_ids" not in engine and len(ids) > 1:
        out["stop_token_ids"] = ids[1:]
    return out


class _DuplicateKey(Exception):
    """A key repeated in one YAML mapping: (dotted key, 1-based line, line of the first)."""


class _BadScalar(ValueError):
    """A scalar YAML reads but Python cannot hold: (dotted key, 1-based line, problem)."""


# the largest config file read (real ones are a few kB; /dev/zero would never end). PyYAML's
# pure-Python reader takes ~8 s a MB of dense YAML (found by probing: a 20 MB list, well
# under the 64 MB this was, ran past two minutes at the door); a MB of comments takes 0.3 s
MAX_CONFIG_BYTES = 2**20
# the most YAML nodes (scalars, lists, mappings, aliases) and the deepest nesting one config
# document (or --set value) may hold: real configs hold a few hundred nodes three levels
# deep. The node bound keeps a dense file's parse under ~0.2 s; the depth bound keeps the
# composer's recursion (one Python frame per level) far from Python's limit (found by
# probing: 1000 nested brackets were a RecursionError traceback at the door)
MAX_YAML_NODES = 10_000
MAX_YAML_DEPTH = 32

# Python converts integers of at most this many digits (sys.get_int_max_str_digits' default)
_MAX_INT_CHARS = 4300


# a line break as editors, `wc -l` and diff count them: LF, CRLF, or a lone CR (PyYAML also
# breaks lines at U+0085, U+2028 and U+2029, so its own line numbers drift past one of those)
_BREAK = re.compile(r"\r\n|\n|\r")
_BREAK_BYTES = re.compile(rb"\r\n|\n|\r")


class LineIndex:
    """1-based (line, column) of a character (or byte) offset in a text (bytes), lines
    counted as editors count them (``_BREAK``): PyYAML's marks carry an offset, and their
    own line numbers would name an editor's line 3 as line 4 past a U+2028 inside a quoted
    value (found by probing)."""

    def __init__(self, text: str | bytes) -> None:
        pattern = _BREAK_BYTES if isinstance(text, bytes) else _BREAK
        self._ends = [m.end() for m in pattern.finditer(text)]  # each line's first offset

    def line(self, index: int) -> int:
        return bisect.bisect_right(self._ends, index) + 1

    def column(self, index: int) -> int:
        n = bisect.bisect_right(self._ends, index)
        return index - (self._ends[n - 1] if n else 0) + 1


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (``_DuplicateKey``).

    Everything else is safe_load's: the same tags and resolution; merge keys (``<<``) may still
    be overridden by the mapping's own keys, as YAML specifies. A document past MAX_YAML_NODES
    nodes or MAX_YAML_DEPTH levels is a ComposerError at the node that crossed the bound
    (a YAMLError with its line and column, as a syntax error)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.lines = LineIndex(stream)
        self._nodes = 0  # nodes composed so far (this loader reads one document)
        self._alias_paths = 0  # paths walked under aliases for their lines (bounded)
        self._depth = 0  # nesting of the node being composed
        # dotted key (as messages name it: ``_key_text``; list items ``key[i]``) -> the
        # 1-based line it is written on, for the schema's errors (``load_config``)
        self.key_lines: dict[str, int] = {}

    def compose_node(self, parent: Any, index: Any) -> yaml.Node:
        self._nodes += 1
        self._depth += 1
        try:
            if self._nodes > MAX_YAML_NODES or self._depth > MAX_YAML_DEPTH:
                what = (f"more than {MAX_YAML_NODES} values (a config holds a few hundred)"
                        if self._nodes > MAX_YAML_NODES else
                        f"nested more than {MAX_YAML_DEPTH} levels deep (a config nests three)")
                raise yaml.composer.ComposerError(None, None, what,
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self._check_unique(node, "", set())
        return self.construct_document(node)

    def _check_unique(self, node: yaml.Node, path: str, seen: set[int]) -> None:
        if id(node) in seen:  # an alias: its node was checked where it was anchored; its
            self._alias_lines(node, path)  # keys under this path take the anchor's lines
            return
        seen.add(id(node))
        if (isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int"
                and len(node.value) > _MAX_INT_CHARS):
            raise _BadScalar(path, self._line(node),
                             f"an integer of {len(node.value)} characters (Python converts at "
                             f"most {_MAX_INT_CHARS} digits)")
        if (isinstance(node, yaml.ScalarNode) and ":" in node.value and node.tag in
                ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")):
            # YAML 1.1's base 60: an unquoted 1:30 is the number 90 (a time, a ratio or a
            # step count written so would be read silently as another number)
            raise _BadScalar(path, self._line(node),
                             f"{node.value} is a base-60 number in YAML 1.1 "
                             f"({self.construct_object(node)!r}); write the number, or quote "
                             "the text")
        if (isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int"
                and re.fullmatch(r"[-+]?0[0-7_]+", node.value)):
            # YAML 1.1's octal: an unquoted 010 is the number 8 (a seed, a count or an id
            # padded with a zero would be read silently as another number; found by probing)
            raise _BadScalar(path, self._line(node),
                             f"{node.value} is an octal number in YAML 1.1 "
                             f"({self.construct_object(node)!r}); write the number without its "
                             "leading zero, or quote the text")
        if isinstance(node, yaml.ScalarNode):
            self._construct_scalar(node, path)
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            merges = []
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    merges.append(value_node)  # after the mapping's own keys: they win
                    continue
                # (a key that cannot be read is named by its text: at the top level the
                # path alone would be empty)
                text = _key_text(key_node.value) if isinstance(key_node, yaml.ScalarNode) \
                    else "?"
                key = (self._construct_scalar(key_node, f"{path}.{text}" if path else text)
                       if isinstance(key_node, yaml.ScalarNode) else None)
                dotted = f"{path}.{_key_text(key)}" if path else _key_text(key)
                line = self._line(key_node)
                self.key_lines.setdefault(dotted, line)
                try:
                    if key in first:
                        raise _DuplicateKey(dotted, line, first[key])
                    if key is not None:
                        first[key] = line
                except TypeError:  # an unhashable key: the constructor reports it
                    pass
                self._check_unique(value_node, dotted, seen)
            for value_node in merges:  # a merged key takes the line of the mapping merged
                self._check_unique(value_node, path, seen)  # (where the mapping lacks it)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.key_lines.setdefault(f"{path}[{i}]", self._line(item))
                self._check_unique(item, f"{path}[{i}]", seen)

    def _line(self, node: yaml.Node) -> int:
        return self.lines.line(node.start_mark.index)

    def _alias_lines(self, node: yaml.Node, path: str) -> None:
        """The lines of the keys under ``path`` that an alias gives (where the anchored node
        writes them; found by probing: an error inside `spans: *w` named no line), at most
        MAX_YAML_NODES of them over the document: nested aliases multiply the paths (an
        alias bomb), and a line is a courtesy, not worth that walk."""
        stack = [(node, path)]
        while stack and self._alias_paths < MAX_YAML_NODES:
            n, p = stack.pop()
            self._alias_paths += 1
            if isinstance(n, yaml.MappingNode):
                for key_node, value_node in n.value:
                    if isinstance(key_node, yaml.ScalarNode) and \
                            key_node.tag != "tag:yaml.org,2002:merge":
                        dotted = f"{p}.{_key_text(key_node.value)}" if p else \
                            _key_text(key_node.value)
                        self.key_lines.setdefault(dotted, self._line(key_node))
                        stack.append((value_node, dotted))
            elif isinstance(n, yaml.SequenceNode):
                for i, item in enumerate(n.value):
                    self.key_lines.setdefault(f"{p}[{i}]", self._line(item))
                    stack.append((item, f"{p}[{i}]"))

    def _construct_scalar(self, node: yaml.ScalarNode, path: str) -> Any:
        """The Python value of scalar ``node`` (at dotted key ``path``), or _BadScalar naming
        its line: PyYAML's constructors fail on text an explicit tag cannot read with plain
        Python errors, not YAMLErrors (found by probing: ``!!bool abc`` a KeyError,
        ``!!int ''`` an IndexError, ``!!timestamp abc`` an AttributeError -- tracebacks at
        the door -- and ``!!int abc`` a ValueError that named neither line nor key)."""
        try:
            return self.construct_object(node)
        except (ValueError, LookupError, AttributeError, TypeError) as err:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            why = f" ({err})" if isinstance(err, ValueError) else ""
            raise _BadScalar(path, self._line(node),
                             f"{_short(node.value)} cannot be read as {tag}{why}") from None


def _yaml_load(text: str, lines: dict[str, int] | None = None) -> Any:
    """``yaml.safe_load(text)``, refusing duplicate keys (UniqueKeyLoader); ``lines``: filled
    with each dotted key's line (``UniqueKeyLoader.key_lines``). A ReaderError (a character
    YAML does not allow) is raised before the loader exists."""
    loader = UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        if lines is not None:
            lines.update(loader.key_lines)
        loader.dispose()


def parse_override(pair: str, flag: str = "--set") -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--set`` (or ``flag``) as (dotted key, value parsed as YAML); a
    ConfigError whose message starts ``--set KEY:`` for a pair without ``=`` or a value that
    is not valid YAML."""
    # (the messages quote a key or value cut short: an argument may be 128 kB long)
    if "=" not in pair:
        raise ConfigError(f"{flag} {_key_text(pair)}: expected KEY=VALUE, e.g. {flag} "
                          "engine.mode=fine", key=pair, source=flag)
    key, text = pair.split("=", 1)
    if not key:
        raise ConfigError(f"{flag} {_key_text(pair)}: the key before '=' is empty",
                          source=flag)
    name, shown = _key_text(key), _short(text)
    try:
        return key, _yaml_load(text)
    except _DuplicateKey as dup:
        raise ConfigError(f"{flag} {name}: duplicate key {dup.args[0]!r} in the value {shown}",
                          key=key, source=flag) from None
    except _BadScalar as bad:
        raise ConfigError(f"{flag} {name}: invalid value: {bad.args[2]}", key=key,
                          source=flag) from None
    except ValueError as err:  # a scalar YAML resolves but Python refuses
        raise ConfigError(f"{flag} {name}: invalid value: {err}", key=key, source=flag) \
            from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or getattr(err, "context", None) or str(err)
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        at = f" at column {mark.column + 1}" if mark is not None and mark.line == 0 else ""
        raise ConfigError(f"{flag} {name}: the value {shown} is not valid YAML{at}: {problem} "
                          "(quote a string that YAML cannot read, inside the shell's quotes: "
                          f"{flag} '{name}=\"...\"')", key=key, source=flag) from None


def _merged(base: dict, update: Mapping) -> dict:
    """``base`` with ``update``'s keys set, mappings merged key by key (copies)."""
    out = copy.deepcopy(base)
    for k, v in update.items():
        out[k] = (_merged(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict)
                  else copy.deepcopy(v))
    return out


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Set each dotted key of ``overrides`` in nested ``data`` (in place), checking it exists."""
    for dotted, value in overrides.items():
        if not isinstance(dotted, str) or not dotted:
            raise _error(_key_text(repr(dotted)), "override keys must be non-empty dotted "
                         "strings")
        parts = dotted.split(".")
        dotted = _key_text(dotted)  # (as the messages name it)
        cls: Any = Config
        node = data
        for depth, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(cls) if f.init]
            if part not in names:
                where = ".".join(parts[:depth]) or "top level"
                raise _error(dotted, f"unknown override key{_did_you_mean(part, names)}; "
                                     f"allowed keys at {where}: {', '.join(names)}")
            if depth == len(parts) - 1:
                sub_cls = typing.get_type_hints(cls)[part]
                if dataclasses.is_dataclass(sub_cls) and value is None:
                    # (found by probing: `--set workload=~` dropped the file's whole section
                    # to its defaults, where a mapping is merged key by key)
                    raise _error(dotted, f"a section is set key by key (--set {dotted}.KEY="
                                         f"VALUE) or as a mapping (--set '{dotted}={{KEY: "
                                         "VALUE}'), not null")
                if (dataclasses.is_dataclass(sub_cls) and isinstance(value, Mapping)
                        and isinstance(node.get(part), dict)):
                    # a section given whole (--set 'rl={steps: 1}') sets those keys: the
                    # file's other keys stay (replacing the section dropped them to defaults)
                    node[part] = _merged(node[part], value)
                else:
                    node[part] = copy.deepcopy(value)
                break
            sub_cls = typing.get_type_hints(cls)[part]
            if not dataclasses.is_dataclass(sub_cls):
                raise _error(dotted, f"{'.'.join(parts[: depth + 1])} is not a section")
            if node.get(part) is None:  # absent, or a section's header alone (its defaults)
                node[part] = {}
            child = node[part]
            if not isinstance(child, dict):
                # Leave it for _build to report as "expected a mapping".
                break
            cls, node = sub_cls, child


def load_config(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None,
                lines: dict[str, int] | None = None) -> Config:
    """Load a YAML config file, apply dotted-key ``overrides``, and validate it.

    ``overrides`` maps dotted keys to values, e.g. ``{"parallel.world_size": 4}``.
    Raises :class:`ConfigError` (message prefixed with the file path) for
    unreadable files, YAML syntax errors, unknown keys, wrong types and
    failed validation.
    """
    source = os.fspath(path)
    lines = {} if lines is None else lines  # the caller's: its own checks' errors (located)
    data = read_config_file(source, lines)
    if overrides:
        try:
            _apply_overrides(data, overrides)
        except ConfigError as err:
            raise _with_source(err, source) from err
    try:
        return config_from_dict(data, source=source)
    except ConfigError as err:
        raise located(err, source, lines, overrides or {}) from err


def located(err: ConfigError, source: str, lines: Mapping[str, int],
             overrides: Mapping[str, Any]) -> ConfigError:
    """``err`` (a message ``source: KEY: problem``: the schema's, or a later check's of the
    same file -- the door's) with the file's line of its key
    (``source:LINE: KEY: problem``) where the file writes the key and no override touched it
    (a key an override set, one under a section an override gave, or a section holding a key
    an override set, stays as it is -- the file's line would point at a value that is not
    the one refused; so does a key the file leaves to its default or to config.json)."""
    key, text = err.key, str(err)
    if not key or not text.startswith(f"{source}: "):
        return err
    if any(key == o or key.startswith((f"{o}.", f"{o}[")) or o.startswith(f"{key}.")
           for o in _set_keys(overrides)):  # (a section whose key an override set: as well)
        return err
    line = lines.get(key)
    if line is None:
        return err
    return ConfigError(f"{source}:{line}: {text[len(source) + 2:]}", key=key, source=source)


def _set_keys(overrides: Mapping[str, Any]) -> list[str]:
    """The dotted keys ``overrides`` set: a section given as a mapping (``--set
    'workload={seed: 1}'``) sets the keys it holds -- the file's others stay the file's
    (``_apply_overrides`` merges it; found by probing: their errors had lost their lines) --
    any other value the key itself."""
    out: list[str] = []
    for o, v in overrides.items():
        if isinstance(v, Mapping) and v:
            out += _set_keys({f"{o}.{k}": sub for k, sub in v.items()})
        else:
            out.append(str(o))
    return out


def read_config_file(path: str | os.PathLike,
                     lines: dict[str, int] | None = None) -> dict[str, Any]:
    """The top-level mapping of the YAML config file ``path``, as the door reads it (a
    bounded regular file, UTF-8, safe_load with duplicate keys, tags, size and depth
    refused), not yet validated against the schema -- for a caller that reads the file's own
    sections before ``load_config`` (it must not open the file any other way: a FIFO would
    block, an alias bomb grow). Raises ConfigError as ``load_config`` does. ``lines``: filled
    with the line each dotted key is written on."""
    source = os.fspath(path)
    try:
        raw = read_regular_file(source, MAX_CONFIG_BYTES, "config file",
                                "a config is a YAML file")
    except FileProblem as err:  # (an empty path is named as the argument it is: found by
        # probing, the line began "error: : ")
        raise ConfigError(f"{source or 'CONFIG'}: {err}", source=source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        at = LineIndex(raw)
        line, column = at.line(err.start), at.column(err.start)
        raise ConfigError(
            f"{source}:{line}: not valid UTF-8: byte 0x{raw[err.start]:02x} at column {column} "
            f"({err.reason}); config files are read as UTF-8", source=source) from None
    try:
        data = _yaml_load(text, lines)
    except _DuplicateKey as dup:
        dotted, line, first = dup.args
        raise ConfigError(
            f"{source}:{line}: {dotted}: duplicate key (first at line {first}); YAML would "
            "silently keep only this last one", key=dotted, source=source) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}{_yaml_error_text(err, LineIndex(text))}",
                          source=source) from None
    except _BadScalar as bad:
        dotted, line, problem = bad.args
        raise ConfigError(f"{source}:{line}: {dotted}: {problem}", key=dotted or None,
                          source=source) from None
    except ValueError as err:  # a scalar YAML resolves but Python refuses (a 5000-digit int)
        raise ConfigError(f"{source}: invalid YAML value: {err}", source=source) from None
    if not isinstance(data, dict):
        got = "an empty document" if data is None else _describe(data)
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {got}", source=source
        )
    return data


def _yaml_error_text(err: yaml.YAMLError, at: LineIndex) -> str:
    """``:L: invalid YAML at column C: <problem>`` (1-based, lines as editors count
    them: ``at``, the document's LineIndex) for a PyYAML error, to follow the file's name;
    ``: invalid YAML: <problem>`` where it has no place."""
    index = None
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "syntax error"
        index = None if mark is None else mark.index
    elif isinstance(err, yaml.reader.ReaderError):
        # (a character YAML refuses: its own text names a stream "<unicode string>" and a
        # character offset, found by probing)
        problem = (f"unacceptable character #x{err.character:04x}: {err.reason}"
                   if isinstance(err.character, int) else str(err.reason))
        index = err.position
    else:
        problem = " ".join(str(err).split())
    if index is None:
        return f": invalid YAML: {problem}"
    line = at.line(index)
    return f":{line}: invalid YAML at column {at.column(index)}: {problem}"


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of ``cfg`` (like dataclasses.asdict); config_from_dict inverts it."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write ``cfg`` as YAML to ``path``; ``load_config(path) == cfg`` afterwards."""
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        yaml.safe_dump(config_to_dict(cfg), fh, sort_keys=False, default_flow_style=False)
