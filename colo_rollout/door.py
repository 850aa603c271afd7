"""Errors at the door: what every command checks before it spawns or initialises a rank.

Owns the checks of each command's inputs -- the config (``load_config``: file, encoding, YAML,
duplicate keys, schema), a named checkpoint's files, and what the command will ask of the
engine: the demo's synthetic requests, the trainer's prompts, the bench's trace
(``bench_trace``, which the bench's ranks use too), bench-decode-overhead's requests,
bench-speed's shapes against the engine's limits, and the
arguments of stress-turnstile and bench-rendezvous -- and the one form a user mistake takes
there: an exception (``is_user_error``) whose message is one line, ``FILE[:LINE]: KEY:
problem``, which ``cli.main`` prints as ``error: ...`` and exits with 2 (no traceback).

A request the command would build is checked by the engine's own rule, ``Scheduler.validate``
(pure Python), so the door and the ranks cannot disagree. Nothing here imports torch or
megatron: the door costs milliseconds.
"""

from __future__ import annotations

import math
import os
import pathlib
import tempfile
from collections.abc import Mapping
from typing import Any

from colo_rollout.config.checkpoint_errors import CheckpointError
from colo_rollout.config import ENGINE_MODES, Config, ConfigError, load_config
from colo_rollout.config.files import OutputError
from colo_rollout.config.loader import located
from colo_rollout.sched.request import Request, RequestError, SamplingParams
from colo_rollout.workloads.trace import Conversation, Trace, TraceError, generate_trace, load_trace


class DoorError(ValueError):
    """A command-line argument the command cannot run with; the message is one line."""


# a mistake in the command's inputs, reported as one ``error:`` line with exit code 2
USER_ERRORS = (ConfigError, CheckpointError, TraceError, DoorError, OutputError)


def is_user_error(err: BaseException) -> bool:
    return isinstance(err, USER_ERRORS)

# stress-turnstile: a rank's injected skew (up to ~1.6 x max_skew per round, with P's host
# delays) must stay well inside the 30 s rendezvous timeout of stress.stress_turnstile
MAX_SKEW_MS = 10_000.0


# --------------------------------------------------------------------------- config commands
def load(command: str, config_path: str | os.PathLike, overrides: Mapping[str, Any],
         **args: Any) -> Config:
    """The validated config of ``command`` (demo, train, bench, bench-decode-overhead), with a
    named checkpoint's files checked (headers only) and everything the command will ask of the
    engine checked against it. Raises a user error (is_user_error)."""
    source = os.fspath(config_path)
    lines: dict[str, int] = {}  # each key's line in the file: the checks' errors name it too
    cfg = load_config(source, overrides, lines)
    if cfg.model.checkpoint is not None:
        from colo_rollout.checkpoint.loader import check_checkpoint

        check_checkpoint(cfg.model)
    check = {"demo": check_demo, "train": check_train, "bench": check_bench,
             "bench-decode-overhead": check_decode_overhead,
             "bench-speed": check_bench_speed, "bench-mtp": check_bench_mtp}.get(command)
    try:
        check_engine(cfg, source)
        check_outputs(cfg, source, command)
        if check is not None:
            check(cfg, source, **args)
    except ConfigError as err:
        raise located(err, source, lines, overrides) from err
    return cfg


def check_engine(cfg: Config, source: str) -> None:
    """What the engine will ask of this host and of itself: its kernels, dispatch backend,
    layer spec, FP8, the process-group backend and the memory (every command that builds an
    engine; generate runs it with its own source)."""
    from colo_rollout.config.schema import normalization_problem

    why = normalization_problem(cfg.model)
    if why is not None:
        raise ConfigError(f"{source}: model.normalization: {why}", key="model.normalization",
                          source=source)
    check_kernels(cfg, source)
    check_dispatch(cfg, source)
    check_use_te(cfg, source)
    check_fp8(cfg, source)
    check_backend(cfg, source)  # after the settings' own checks: those name the key to change
    check_memory(cfg, source)


def unwritable(path: str | os.PathLike, file: bool = False) -> str | None:
    """Why this process could not write the directory ``path`` (made if missing) -- or with
    ``file`` the file ``path`` in its directory --, or None: checked before a run, so a bad
    output path is not found after minutes of work. The nearest existing ancestor must be a
    writable directory; an existing ``path`` must be a directory (a file with ``file``)."""
    p = pathlib.Path(path)
    # a link to nowhere (the path or a folder on the way): exists() follows it and says no,
    # but neither a file nor a folder can be made there (found by probing: a traceback after
    # the whole run, or rank 0's FileExistsError and the others' timeout)
    for q in (p, *p.parents):
        if q.is_symlink() and not q.exists():
            return f"{q} is a link to {os.readlink(q)}, which does not exist"
    if p.exists():
        if file and p.is_dir():
            return f"{p} is a directory"
        if file and not p.is_file():  # a FIFO would block the write, /dev/full refuse it
            return f"{p} is not a regular file"
        if not file and not p.is_dir():
            return f"{p} exists and is not a directory"
    probe = p.parent if file or p.exists() and not p.is_dir() else p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:  # a file made and removed: permissions alone pass root where no file can be made
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"no file can be made in {probe}: {e.strerror or e}"
    return None


# the files each output folder receives (a directory or a device of one of these names
# there was found only by the final write, after the whole run); a name ending in / is a
# folder (tensorboard's: a file of its name failed the train run after ~2 minutes, found by
# probing)
OUTPUT_FILES = {"bench.out_dir": ("bench.json", "runs_partial.jsonl", "ccdf_request.png",
                                  "timeline.png"),
                "bench_speed.out_dir": ("bench_speed.json", "bench_speed_breakdown.png"),
                "rl.out_dir": ("metrics.jsonl", "reward.png", "tb/"),
                "bench-sync --out": ("bench_sync.json",), "bench-mtp --out": ("bench_mtp.json",)}


def check_output(key: str, path: str | os.PathLike | None, source: str | None = None,
                 file: bool = False, files: tuple[str, ...] = (), inputs=()) -> None:
    """One output path (a config key, or a command's flag when ``source`` is None) that the
    run will write: refused now, naming the key, if it cannot be written. ``files``: the
    names the run writes in the folder ``path`` -- any that exists must be a regular file
    (a folder, for a name ending in /). ``inputs``: what the run reads (``run_inputs``),
    which the output must not overwrite (``_check_not_inputs``)."""
    why = None if path is None else (
        "an empty path" if not os.fspath(path).strip() else unwritable(path, file))
    if why is None and path is not None:
        why = next(filter(None, (_not_writable_as(os.path.join(path, n.rstrip("/")), n)
                                 for n in files)), None)
    if why:
        at = f"{source}: " if source else ""
        raise ConfigError(f"{at}{key}: {path}: cannot write here ({why})", key=key,
                          source=source)
    _check_not_inputs(key, path, inputs, source, file, files)


def _not_writable_as(target: str, name: str) -> str | None:
    """Why ``target`` cannot receive the run's ``name`` (a file, or a folder where ``name``
    ends in /), or None (absent, or already of its kind)."""
    if not os.path.lexists(target):
        return None
    if name.endswith("/"):
        return None if os.path.isdir(target) else (
            f"{target} exists and is not a folder (the run writes its {name} there)")
    return None if os.path.isfile(target) else (
        f"{target} exists and is not a regular file (the run writes its {name} there)")


def run_inputs(cfg: Config, source: str, command: str) -> list[tuple[str, str, bool]]:
    """What a run of ``command`` reads that an output could overwrite: (what, real path,
    whether a folder) -- the config file, model.checkpoint, bench's trace file."""
    out = [(f"the config file {source}", os.path.realpath(source), False)]
    if cfg.model.checkpoint is not None:
        out.append((f"model.checkpoint {cfg.model.checkpoint}",
                    os.path.realpath(cfg.model.checkpoint), True))
    trace = cfg.bench.trace
    if command == "bench" and trace not in ("synthetic", "mooncake"):
        trace = trace.removeprefix("mooncake:")
        out.append((f"bench.trace {trace}", os.path.realpath(trace), False))
    return out


def _check_not_inputs(key: str, path: str | os.PathLike | None, inputs,
                      source: str | None = None, file: bool = False,
                      files: tuple[str, ...] = ()) -> None:
    """An output (a config key, or a flag where ``source`` is None: the file ``path``, or the
    folder ``path`` receiving ``files``) that would overwrite what the run reads (``inputs``,
    ``run_inputs``) is refused, naming it (found by probing: a report written over the
    config, into the checkpoint -- over its config.json too -- and a bench's partial runs over
    its own trace, each silently)."""
    if path is None or not os.fspath(path).strip():
        return
    real = os.path.realpath(path)
    targets = [real] if file else [os.path.join(real, n.rstrip("/")) for n in files]
    why = None
    for what, at, folder in inputs:
        if folder and (real == at or real.startswith(at + os.sep)):
            why = f"{'is' if real == at else 'is inside'} {what}, which the run reads"
        elif not folder and at in targets:
            why = (f"the run would overwrite {what} (its {os.path.basename(at)} there)"
                   if not file else f"is {what}, which the run reads")
        if why:
            at_ = f"{source}: " if source else ""
            raise ConfigError(f"{at_}{key}: {path}: {why}; write elsewhere", key=key,
                              source=source)


def check_outputs(cfg: Config, source: str, command: str) -> None:
    """The output folders ``command`` writes, from its config (the flags' paths are checked by
    the CLI through ``check_output``)."""
    keys = {"train": ("rl.out_dir", "rl.export_dir"), "bench": ("bench.out_dir",),
            "bench-speed": ("bench_speed.out_dir",)}.get(command, ())
    inputs = run_inputs(cfg, source, command)
    for key in keys:
        section, name = key.split(".")
        check_output(key, getattr(getattr(cfg, section), name), source,
                     files=OUTPUT_FILES.get(key, ()),
                     # (rl.export_dir: its own check below says more)
                     inputs=inputs if key != "rl.export_dir" else ())
    if command == "train" and cfg.rl.export_dir is not None:
        _check_export_dir(cfg, source)


def _check_export_dir(cfg: Config, source: str) -> None:
    """rl.export_dir writes a checkpoint (config.json, safetensors): never into the checkpoint
    the run reads (it would overwrite it, silently, while its weights are in use), nor onto a
    file the run writes itself."""
    export = os.path.realpath(cfg.rl.export_dir)
    ckpt = cfg.model.checkpoint
    if ckpt is not None:
        ckpt = os.path.realpath(ckpt)
        if export == ckpt or export.startswith(ckpt + os.sep):
            raise ConfigError(f"{source}: rl.export_dir: {cfg.rl.export_dir}: is "
                              f"{'' if export == ckpt else 'inside '}model.checkpoint {ckpt}, "
                              "which the run reads: export elsewhere", key="rl.export_dir",
                              source=source)
    from colo_rollout.checkpoint.export import export_problem

    why = export_problem(cfg.model)
    if why is not None:
        raise ConfigError(f"{source}: rl.export_dir: {why}", key="rl.export_dir", source=source)
    # the files the export writes there: none may be a folder (found by probing: a folder
    # named config.json failed the export after the whole run, its weights left beside no
    # config) -- config.json, the weights and the source's other files it copies
    if os.path.isdir(export):
        writes = {"config.json", "model.safetensors", "model.safetensors.index.json"}
        if ckpt is not None and os.path.isdir(ckpt):
            writes |= {e.name for e in os.scandir(ckpt) if e.is_file()}
        for entry in sorted(os.scandir(export), key=lambda e: e.name):
            name = entry.name
            shard = name.startswith("model-") and name.endswith(".safetensors")
            if (name in writes or shard) and entry.is_dir():
                raise ConfigError(f"{source}: rl.export_dir: {cfg.rl.export_dir}: {name} there "
                                  "is a folder; the export writes a file of that name",
                                  key="rl.export_dir", source=source)
    out = os.path.realpath(cfg.rl.out_dir)
    own = {os.path.join(out, name) for name in ("metrics.jsonl", "reward.png", "tb")}
    if export in own:
        raise ConfigError(f"{source}: rl.export_dir: {cfg.rl.export_dir}: the run writes its "
                          f"own {os.path.basename(export)} there (rl.out_dir {cfg.rl.out_dir})",
                          key="rl.export_dir", source=source)


def check_backend(cfg: Config, source: str) -> None:
    """parallel.backend nccl puts each rank on a GPU: the host has CUDA and, where this
    process launches the ranks (no torchrun), a GPU per rank."""
    if cfg.parallel.backend != "nccl":
        return
    import torch

    why = None
    if not torch.cuda.is_available():
        why = "this host has no CUDA device"
    elif "WORLD_SIZE" not in os.environ and torch.cuda.device_count() < cfg.parallel.world_size:
        why = (f"parallel.world_size {cfg.parallel.world_size} ranks need as many GPUs, this "
               f"host has {torch.cuda.device_count()}")
    if why:
        raise ConfigError(f"{source}: parallel.backend: 'nccl' runs a rank per GPU, and {why}; "
                          "use 'gloo' for CPU ranks", key="parallel.backend", source=source)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# a trajectory's token as the RL step holds it, at the least: its id and logprob (8 + 8)
_TOKEN_BYTES = 16
# a request the demo makes up front: its objects, and each token of it as a Python int in a
# tuple (the least they take: 8 bytes of pointer + a 28-byte int)
_PY_REQUEST_BYTES = 400
_PY_TOKEN_BYTES = 36


def memory_need(cfg: Config, drawn_whole: bool = False) -> dict[str, int]:
    """Bytes one rank holds at the least, by the config key that sizes them: its shares of
    the embedding and output layer (``model.vocab_size``; vocab-parallel over attention TP),
    of the routed experts (``model.num_experts``; over every rank), of the rest
    (``model.num_layers``: attention, norms, routers, dense and shared MLPs; over attention
    TP), its KV cache (``engine.num_kv_blocks``) and, with engine.record_routing, the routing
    record (``engine.max_prefill_tokens``, ``engine.decode_buckets``); ``drawn_whole``: each
    rank also holds the whole model once (random weights drawn before its slices are taken).
    A lower bound: activations, graphs, FP8 copies and the trainer are not counted."""
    from colo_rollout.config.tensor_shapes import parameter_counts

    m, e, lay = cfg.model, cfg.engine, cfg.parallel
    b = _DTYPE_BYTES[m.params_dtype]
    n = parameter_counts(m)
    layers = m.num_layers + m.mtp_num_layers
    kv = (e.num_kv_blocks + 1) * e.kv_block_size * layers * m.kv_cache_elems(lay.atp) * b

    def held(values: int, over: int) -> int:
        return values * b // over + (values * b if drawn_whole else 0)

    need = {"model.vocab_size": held(n.vocab, lay.atp),
            "model.num_experts": held(n.experts, lay.world_size),
            "model.num_layers": held(n.rest, lay.atp), "engine.num_kv_blocks": kv}
    if e.record_routing:
        # routing replay's record (worker.py: RoutingRecord, made whole at the engine's build):
        # int16 expert ids of every MoE layer for every replica's P token budget and D rows --
        # the largest decode bucket padded to attention TP, two rows a sequence with MTP
        # (found by probing: a decode bucket of 10^12, past any batch the engine builds, was
        # accepted and failed in each rank's allocator)
        moe = sum(1 for i in range(m.num_layers) if m.is_moe_layer(i))
        per_row = 2 * moe * m.moe_router_topk * lay.adp
        d_rows = -(-e.decode_buckets[-1] // lay.atp) * lay.atp * (2 if e.mtp else 1)
        need["engine.max_prefill_tokens"] = per_row * e.max_prefill_tokens
        need["engine.decode_buckets"] = per_row * d_rows
    return need


def _memory_budget(cfg: Config) -> tuple[int, str, int] | None:
    """(bytes, where, ranks sharing them): one GPU's memory for GPU ranks, else this host's
    memory shared by the host's ranks; None where it cannot be read."""
    if cfg.parallel.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            return None  # check_backend names it
        props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        return props.total_memory, f"a GPU's {props.total_memory / 2**30:.0f} GiB", 1
    return _host_budget(cfg)


def _host_budget(cfg: Config) -> tuple[int, str, int] | None:
    """(bytes, where, ranks sharing them) of this host's memory; None where unreadable."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world_size))
    return total, f"this host's {total / 2**30:.0f} GiB", ranks


def check_memory(cfg: Config, source: str) -> None:
    """A run whose weights and KV cache cannot fit at all is refused before any rank
    allocates (found by probing: a vocabulary of 10^13 or 10^8 layers ended in an allocator
    traceback or a hang). Only the impossible is refused: the need counted is a lower bound
    (``memory_need``; CPU ranks without a checkpoint also draw the whole model each) against
    the whole memory, not what is free."""
    budget = _memory_budget(cfg)
    if budget is None:
        return
    total, where, ranks = budget
    # CPU ranks without a checkpoint each draw the full random state dict (worker.py)
    need = memory_need(cfg, cfg.model.checkpoint is None and cfg.parallel.backend != "nccl")
    if ranks * sum(need.values()) <= total:
        return
    key = max(need, key=need.get)
    parts = ", ".join(f"{k.split('.')[1]} {v / 2**30:.3g} GiB" for k, v in need.items() if v)
    raise ConfigError(f"{source}: {key}: the run needs at least "
                      f"{ranks * sum(need.values()) / 2**30:.3g} GiB ({ranks} rank"
                      f"{'s' if ranks > 1 else ''} x {parts}), more than {where}",
                      key=key, source=source)


# engine keys that pick a kernel backend (auto | torch | triton; prefill_attention: | cudnn |
# flash)
KERNEL_KEYS = ("decode_attention", "prefill_attention", "moe_kernel")
# the backends that run on GPU ranks only, and what they are called in an error
_GPU_KERNELS = {"triton": "the Triton kernels",
                "cudnn": "cuDNN's attention and the Triton kernels",
                "flash": "FlashAttention-4 and the Triton kernels"}


def check_kernels(cfg: Config, source: str) -> None:
    """A kernel backend asked for by name can run: "triton" needs GPU ranks (parallel.backend
    nccl) and triton installed; "cudnn" and "flash" their library and a 16-bit model whose
    head dim the library takes. (The model build refuses them too; here it is one line before
    any rank starts.)"""
    import importlib.util

    for key in KERNEL_KEYS:
        asked = getattr(cfg.engine, key, "auto")
        if asked not in _GPU_KERNELS:
            continue
        if cfg.parallel.backend != "nccl":
            why = (f"{_GPU_KERNELS[asked]} run on GPU ranks, and parallel.backend is "
                   f"{cfg.parallel.backend!r}")
        elif importlib.util.find_spec("triton") is None:
            why = "triton is not installed"
        elif asked in ("cudnn", "flash"):
            why = _dense_kernel_problem(asked, cfg.model)
            if why is None:
                continue
        else:
            continue
        raise ConfigError(f"{source}: engine.{key}: {asked!r} cannot run here: {why}; use "
                          "'auto' (triton where it can run, else torch) or 'torch'",
                          key=f"engine.{key}", source=source)


def _dense_kernel_problem(asked: str, m) -> str | None:
    """Why P's dense attention kernel ``asked`` ("cudnn" or "flash") cannot run for model
    section ``m`` on this host's GPU, or None (config/attention_support.py: the rule the
    model's backend choice applies on each rank)."""
    import torch

    from colo_rollout.config.attention_support import dense_kernel_problem

    return dense_kernel_problem(asked, "cuda", getattr(torch, m.params_dtype), m.head_dim,
                                m.v_head_dim if m.is_mla else None)


def check_use_te(cfg: Config, source: str) -> None:
    """``model.use_te: on`` (TE's layers in the engine; FP8 and engine.batch_invariant refuse
    it themselves) needs Transformer Engine importable on a CUDA host."""
    if cfg.model.use_te != "on" or cfg.model.fp8 is not None:
        return
    import torch

    from colo_rollout.config.te_support import te_available

    if not torch.cuda.is_available() or not te_available():
        what = "CUDA device" if not torch.cuda.is_available() else "Transformer Engine"
        raise ConfigError(f"{source}: model.use_te: 'on' builds Transformer Engine's layers, and "
                          f"this host has no {what}; set model.use_te: auto or off",
                          key="model.use_te", source=source)


def check_fp8(cfg: Config, source: str) -> None:
    """``model.fp8`` before any rank starts: this host's GPU has FP8 tensor cores (sm89+; a
    host without CUDA has none), Transformer Engine runs the recipe here where
    ``model.fp8_backend`` is te (model/fp8_te.py), and every FP8 GEMM's shard has both dims in
    multiples of 16 (model/fp8.py; the model build checks the same on each rank)."""
    m = cfg.model
    if m.fp8 is None:
        return
    import torch

    from colo_rollout.config.schema import FP8_MIN_CAPABILITY as MIN_CAPABILITY
    from colo_rollout.config.schema import FP8_ROW_MULTIPLE as ROW_MULTIPLE
    from colo_rollout.config.schema import FP8_BLOCK

    def refuse(problem: str, key: str = "model.fp8") -> None:
        raise ConfigError(f"{source}: {key}: {problem}", key=key, source=source)

    if not torch.cuda.is_available():
        refuse(f"{m.fp8!r} needs a CUDA GPU with FP8 tensor cores (sm89 or later), and this "
               "host has no CUDA device; set model.fp8: null")
    cap = torch.cuda.get_device_capability(0)
    if cap < MIN_CAPABILITY:
        refuse(f"{m.fp8!r} needs FP8 tensor cores (sm89 or later); "
               f"{torch.cuda.get_device_name(0)} is sm{cap[0]}{cap[1]}; set model.fp8: null")
    if m.fp8_backend == "te":  # TE importable, and its FP8 recipe supported on this GPU
        from colo_rollout.config.te_support import te_fp8_problem

        problem = te_fp8_problem(m.fp8_recipe)
        if problem:
            refuse(f"'te': {problem}", key="model.fp8_backend")
    if m.params_dtype != "bfloat16":
        refuse(f"{m.fp8!r} needs params_dtype 'bfloat16' (the FP8 GEMMs' inputs and outputs), "
               f"got {m.params_dtype!r}; set model.params_dtype: bfloat16 or model.fp8: null")
    if m.use_te == "on":
        refuse(f"{m.fp8!r} runs colo_rollout's FP8 GEMMs on the local layer spec, but use_te "
               "is 'on' (Transformer Engine's modules would not run); set model.use_te: auto, "
               "or model.fp8: null", key="model.use_te")
    if cfg.engine.moe_kernel == "torch":
        refuse("'torch' is the FP8 experts' CPU reference (dequantised fp32 grouped GEMMs, "
               "whose CUDA fallback reads the group sizes on the host: no D graphs); FP8 on "
               "the GPU runs the Triton kernel: set engine.moe_kernel: auto",
               key="engine.moe_kernel")
    atp = cfg.parallel.atp
    if m.is_mla:  # its FP8 GEMMs: the query, key/value-down and output projections
        widths = {"model.hidden_size": m.hidden_size,
                  "model.kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim,
                  # the heads split over attention TP, the down projections whole
                  "model.num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim) / "
                  "parallel.atp": m.num_attention_heads * m.head_dim // atp,
                  "model.num_attention_heads x v_head_dim / parallel.atp":
                      m.num_attention_heads * m.v_head_dim // atp}
        if m.q_lora_rank is not None:
            widths["model.q_lora_rank"] = m.q_lora_rank
    else:
        widths = {"model.hidden_size": m.hidden_size,
                  "model.num_attention_heads x head_dim / parallel.atp":
                      m.num_attention_heads * m.head_dim // atp,
                  "model.num_query_groups x head_dim / parallel.atp":
                      m.num_query_groups * m.head_dim // atp}
    if m.has_dense_layers:
        widths["model.ffn_hidden_size / parallel.atp"] = m.dense_ffn_hidden_size // atp
    if m.shared_expert_ffn_hidden_size is not None:
        widths["model.shared_expert_ffn_hidden_size / parallel.atp"] = (
            m.shared_expert_ffn_hidden_size // atp)
    multiple = ROW_MULTIPLE
    if m.fp8_recipe == "blockwise":  # 1 x 128 / 128 x 128 scale blocks: the experts' too
        multiple = FP8_BLOCK
        widths["model.moe_ffn_hidden_size"] = m.moe_ffn_hidden_size
        # MLA's key/value down projection stays in params_dtype where its rows are no whole
        # number of blocks (DeepSeek-V3's 576; model/mla_attention.py fp8_weights)
        widths.pop("model.kv_lora_rank + qk_rope_head_dim", None)
    for what, v in widths.items():
        if v % multiple:
            key = "model.fp8_recipe" if multiple != ROW_MULTIPLE else "model.fp8"
            refuse(f"FP8 GEMMs{' (blockwise)' if multiple != ROW_MULTIPLE else ''} need every "
                   f"dimension in multiples of {multiple}; {what} is {v}", key=key)


def check_dispatch(cfg: Config, source: str) -> None:
    """``model.moe_dispatch: deepep`` needs the deep_ep package importable here (the ranks
    import it at model build; whether it carries colo_rollout's patch is checked there)."""
    import importlib.util

    if cfg.model.moe_dispatch == "deepep" and importlib.util.find_spec("deep_ep") is None:
        raise ConfigError(f"{source}: model.moe_dispatch: 'deepep' needs the deep_ep package, "
                          "which is not importable here (build it on the GPU host: "
                          "scripts/deepep_setup.sh); use 'alltoall' or 'gather'",
                          key="model.moe_dispatch", source=source)


def _refusal(cfg: Config, prompt: tuple[int, ...], params: SamplingParams) -> str | None:
    """Why every rank would refuse a request of ``prompt`` and ``params`` (None: it would be
    served): the engine's own rule, on a fresh scheduler of this config."""
    from colo_rollout.sched.scheduler import Scheduler

    sched = Scheduler(cfg.engine, cfg.parallel.adp, cfg.parallel.atp, cfg.model.vocab_size)
    try:
        sched.validate(Request("door", prompt, params))
    except RequestError as e:
        return str(e).removeprefix("request 'door': ")
    return None


def _refusal_of_length(cfg: Config, n: int, params: SamplingParams,
                       token: int = 0) -> str | None:
    """``_refusal`` of a prompt of ``n`` copies of ``token``, the engine's sequence cap
    checked first, as the engine checks it, before the prompt is made (found by probing: a
    length of 10^11 was a MemoryError at the door, 10^20 an OverflowError)."""
    total = n + params.max_tokens
    if total > cfg.engine.max_seq_len:
        return (f"prompt ({n}) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"engine.max_seq_len {cfg.engine.max_seq_len}")
    return _refusal(cfg, (token,) * n, params)


def check_demo(cfg: Config, source: str) -> None:
    """The demo's synthetic requests (workload section) are all served: its longest request
    and its sampling parameters pass the engine's request rule, and every rank can hold them
    (they are made up front)."""
    w = cfg.workload
    # each request's prompt and output are tuples of Python ints on every rank (~36 bytes a
    # token) besides its request objects (found by probing: 10^20 requests grew the ranks
    # silently until they were killed); counted at the shortest lengths: a lower bound of
    # need, refused only past the whole memory
    budget = _host_budget(cfg)
    held = w.num_requests * (_PY_REQUEST_BYTES + (w.prompt_len_min + w.output_len_min)
                             * _PY_TOKEN_BYTES)
    if budget is not None and held * budget[2] > budget[0]:
        raise ConfigError(f"{source}: workload.num_requests: {w.num_requests} requests hold at "
                          f"least {held / 2**30:.3g} GiB on each of {budget[2]} rank(s), more "
                          f"than {budget[1]}", key="workload.num_requests", source=source)
    params = SamplingParams(temperature=w.temperature, top_k=w.top_k, top_p=w.top_p,
                            max_tokens=1, ignore_eos=True)
    why = _refusal(cfg, (0,), params)
    if why is not None:  # the sampling parameters alone: the key the refusal names first
        said = why.split("': ", 1)[-1] if why.startswith("request '") else why
        named = [k for k in ("temperature", "top_k", "top_p") if k in said]
        key = "workload." + (min(named, key=said.find) if named else "top_k")
        raise ConfigError(f"{source}: {key}: every request of the workload would be "
                          f"refused: {why}", key=key, source=source)
    # the longest request, refused naming the longer of its two lengths (found by probing:
    # an output_len_max of 10^11 was blamed on prompt_len_max)
    key = ("workload.output_len_max" if w.output_len_max > w.prompt_len_max
           else "workload.prompt_len_max")
    what = (f"the workload's longest request (prompt {w.prompt_len_max} + output_len_max "
            f"{w.output_len_max} tokens)")
    params = SamplingParams(temperature=w.temperature, top_k=w.top_k, top_p=w.top_p,
                            max_tokens=w.output_len_max, ignore_eos=True)
    why = _refusal_of_length(cfg, w.prompt_len_max, params)
    if why is not None:
        raise ConfigError(f"{source}: {key}: {what} would be refused: {why}", key=key,
                          source=source)


def check_train(cfg: Config, source: str) -> None:
    """The trainer's prompts (rl section) are served and its reward can be earned; the engine
    runs the layer spec the trainer syncs into."""
    rl, vocab = cfg.rl, cfg.model.vocab_size
    if cfg.model.use_te == "on":
        raise ConfigError(f"{source}: model.use_te: 'on' builds Transformer Engine's layers in "
                          "the engine, but the trainer builds megatron's local spec and its "
                          "weight sync cannot map the other parameter names (the fused "
                          "norm + QKV); set model.use_te: auto or off", key="model.use_te",
                          source=source)
    if vocab < 2:
        raise ConfigError(f"{source}: model.vocab_size: {vocab} leaves no token for the "
                          "trainer's prompts (drawn from ids [1, vocab_size))",
                          key="model.vocab_size", source=source)
    if rl.target_token >= vocab:
        raise ConfigError(f"{source}: rl.target_token: {rl.target_token} is outside the model's "
                          f"vocabulary [0, {vocab}): the reward could never be earned",
                          key="rl.target_token", source=source)
    # the task's longest prompt (rl.prompt_len_max, or the reverse task's reverse_len + 1)
    longest, key = rl.longest_prompt
    what = f"{key} {getattr(rl, key.split('.')[1])}: prompts of {longest} tokens"
    room = cfg.engine.max_seq_len - longest  # rollout() caps max_tokens by it
    if room < 1:
        raise ConfigError(f"{source}: {key}: {what} leave no room for a generated token in "
                          f"engine.max_seq_len {cfg.engine.max_seq_len}", key=key,
                          source=source)
    if rl.max_new_tokens > room:  # the longest prompts' completions would be cut short
        raise ConfigError(f"{source}: rl.max_new_tokens: {rl.max_new_tokens} tokens after "
                          f"{what} exceed engine.max_seq_len {cfg.engine.max_seq_len}",
                          key="rl.max_new_tokens", source=source)
    # every trajectory of a step is held at once (rollout, rewards, the trainer's batch): at
    # the least its tokens and their logprobs (found by probing: 10^10 trajectories a step
    # grew the ranks until they were killed)
    budget = _memory_budget(cfg)
    trajectories = rl.prompts_per_step * rl.samples_per_prompt
    held = trajectories * (longest + rl.max_new_tokens) * _TOKEN_BYTES
    if budget is not None and held > budget[0]:
        raise ConfigError(f"{source}: rl.prompts_per_step: {rl.prompts_per_step} prompts x "
                          f"rl.samples_per_prompt {rl.samples_per_prompt} = {trajectories} "
                          f"trajectories a step hold at least {held / 2**30:.3g} GiB, more "
                          f"than {budget[1]}", key="rl.prompts_per_step", source=source)
    params = SamplingParams(temperature=rl.temperature, max_tokens=min(rl.max_new_tokens, room),
                            ignore_eos=True)
    why = _refusal_of_length(cfg, longest, params, token=1)
    if why is not None:
        raise ConfigError(f"{source}: {key}: the trainer's longest prompt ({longest} tokens, "
                          f"max_new_tokens {rl.max_new_tokens}) would be refused: {why}",
                          key=key, source=source)


def check_bench_mtp(cfg: Config, source: str, *, batches: tuple[int, ...], prompt_len: int,
                    new_tokens: int) -> None:
    """bench-mtp's requests (``batches`` sequences of ``prompt_len`` prompt and
    ``new_tokens`` output tokens at once) are served by the engine, and its oracle can be
    built: the engine's own rule on the longest request and the largest batch's KV blocks
    (a refused request used to leave the table all NaN with exit 0)."""
    m = cfg.model
    if m.is_moe_layer(0) != m.is_moe_layer(m.num_layers - 1):
        key = "model.first_k_dense" if m.first_k_dense else "model.dense_layers"
        raise ConfigError(f"{source}: {key}: {getattr(m, key[6:])}: "
                          "bench-mtp's oracle copies layer 0 into the MTP layer, which is of "
                          "the last layer's kind: layer 0 must be of that kind too",
                          key=key, source=source)
    e = cfg.engine
    why = _refusal_of_length(cfg, prompt_len, SamplingParams(max_tokens=new_tokens,
                                                             ignore_eos=True), token=1)
    if why is None and max(batches) > e.max_batch_size:
        why = f"--batches {max(batches)} exceeds engine.max_batch_size {e.max_batch_size}"
    if why is None:
        per = -(-(prompt_len + new_tokens + 1) // e.kv_block_size)  # +1: the draft's slot
        rows = -(-max(batches) // cfg.parallel.adp)
        if per * rows > e.num_kv_blocks:
            why = (f"{max(batches)} sequences of {prompt_len + new_tokens} tokens need "
                   f"{per * rows} KV blocks per replica, engine.num_kv_blocks is "
                   f"{e.num_kv_blocks}")
    if why is not None:
        raise ConfigError(f"{source}: engine: bench-mtp's requests ({max(batches)} at once, "
                          f"--prompt-len {prompt_len} + --new-tokens {new_tokens}) would not "
                          f"all be served: {why}", key="engine", source=source)


def check_decode_overhead(cfg: Config, source: str, *, reps: int, mode: str) -> None:
    """bench-decode-overhead's arguments, and its requests (8-token prompts, up to 128 output
    tokens: bench_decode.decode_overhead) are served."""
    from colo_rollout.config.schema import MAX_BENCH_REPEATS

    _require_arg(1 <= reps <= MAX_BENCH_REPEATS, "--reps",
                 f"must be in [1, {MAX_BENCH_REPEATS}], got {reps}")
    _require_arg(mode in ENGINE_MODES and mode != "normal", "--mode",
                 f"expected a PD mode ({', '.join(m for m in ENGINE_MODES if m != 'normal')}) "
                 f"to time against Normal; got {mode!r}")
    out_len = min(128, cfg.engine.max_seq_len - 8)
    # two generated tokens at least: P gives the first, D steps (what is timed) the rest
    # (found by probing: with one there was no D step, and the ratio divided by zero)
    why = ("engine.max_seq_len must be >= 10 (8 prompt tokens + at least 2 generated: D "
           "steps are what is timed)" if out_len < 2 else
           _refusal(cfg, tuple(range(1, 9)), SamplingParams(max_tokens=out_len, ignore_eos=True)))
    if why is not None:
        raise ConfigError(f"{source}: engine: the decode-heavy requests (8 prompt tokens, "
                          f"{max(out_len, 0)} output tokens) would be refused: {why}",
                          key="engine", source=source)


def check_bench_speed(cfg: Config, source: str) -> None:
    """bench-speed (tools/bench_speed.py) runs on one rank, and every shape of its bench_speed
    section fits the engine section: batch sizes within engine.max_batch_size, every sequence
    within engine.max_seq_len, each step's KV blocks within engine.num_kv_blocks (the bench
    lays every step's sequences out side by side from block 0), the peer's prefill within
    model.max_position_embeddings."""
    if cfg.engine.mtp:
        raise ConfigError(f"{source}: engine.mtp: bench-speed times the plain D step (one row "
                          "per sequence) against its roofline; MTP drafting's decode speed is "
                          "`colo-rollout bench-mtp`", key="engine.mtp", source=source)
    b, e = cfg.bench_speed, cfg.engine

    def refuse(key: str, problem: str) -> None:
        raise ConfigError(f"{source}: {key}: {problem}", key=key, source=source)

    if cfg.parallel.world_size != 1:
        refuse("parallel.world_size", f"bench-speed runs on one rank; got "
               f"{cfg.parallel.world_size}")

    def fits(key: str, seqs: list[tuple[int, int]], what: str, prefill: bool = True) -> None:
        """seqs: (cached, new) tokens of one step's sequences (``prefill``: a P step, whose
        new tokens the engine holds to engine.max_prefill_tokens -- found by probing: the
        bench timed P steps the engine would never schedule)."""
        longest = max(c + n for c, n in seqs)
        if longest > e.max_seq_len:
            refuse(key, f"{what}: a sequence of {longest} tokens exceeds engine.max_seq_len "
                   f"{e.max_seq_len}")
        need = sum(-(-(c + n) // e.kv_block_size) for c, n in seqs)
        if need > e.num_kv_blocks:
            refuse(key, f"{what} needs {need} KV blocks of {e.kv_block_size} tokens; "
                   f"engine.num_kv_blocks is {e.num_kv_blocks}")
        new = sum(n for _, n in seqs)
        if prefill and new > e.max_prefill_tokens:
            refuse(key, f"{what}: {new} new tokens in one P step exceed "
                   f"engine.max_prefill_tokens {e.max_prefill_tokens}")

    for key, batches, contexts in (("bench_speed.decode_batches", b.decode_batches,
                                    [b.short_context]),
                                   ("bench_speed.long_batches", b.long_batches,
                                    b.long_contexts),
                                   ("bench_speed.sampled_batches", b.sampled_batches,
                                    [b.short_context])):
        for B in batches:
            if B > e.max_batch_size:
                refuse(key, f"{B} rows exceed engine.max_batch_size {e.max_batch_size}")
            for ctx in contexts:
                fits(key, [(ctx - 1, 1)] * B, f"decode of {B} rows at {ctx} tokens of context",
                     prefill=False)
    for n in b.prefill_lengths:
        fits("bench_speed.prefill_lengths", [(0, n)], f"a prefill of {n} tokens")
    if b.prefill_batch_seqs:
        fits("bench_speed.prefill_batch_seqs", [(0, b.prefill_batch_len)] * b.prefill_batch_seqs,
             f"{b.prefill_batch_seqs} prefills of {b.prefill_batch_len} tokens")
    if b.prefill_mixed:
        fits("bench_speed.prefill_mixed", [(0, n) for n in b.prefill_mixed],
             f"the mixed prefill of {len(b.prefill_mixed)} sequences")
    if b.continuation_seqs:
        fits("bench_speed.continuation_context", b.continuation_shape(),
             f"the continuation prefill ({b.continuation_seqs} sequences)")
    if b.profile:
        k = b.profile_prefill_seqs
        fits("bench_speed.profile_prefill", [(0, b.breakdown_prefill)] * k,
             f"the profiled prefill of {k} x {b.breakdown_prefill} tokens" if k > 1
             else f"the profiled prefill of {b.breakdown_prefill} tokens")
    if b.hf_peer:
        over = [n for n in b.hf_prefill_lengths if n > cfg.model.max_position_embeddings]
        if over:
            refuse("bench_speed.hf_prefill_lengths", f"{over[0]} tokens exceed "
                   f"model.max_position_embeddings {cfg.model.max_position_embeddings}")


# --------------------------------------------------------------------------- the bench's trace
def check_bench(cfg: Config, source: str) -> None:
    """The bench's trace (bench_trace) can be replayed; a trace file's error also names the
    config key that chose the file."""
    try:
        bench_trace(cfg, source)
    except TraceError as e:
        if source in e.detail:
            raise
        raise TraceError(e.path, e.line, e.field, f"{e.detail} (bench.trace of {source})") \
            from None


def turn_cap(e) -> int:
    """The most tokens (context + prompt + output) one replayed turn may hold on an engine of
    settings ``e``: max_seq_len, a re-prefill of the whole context within max_prefill_tokens,
    one replica's KV blocks."""
    return min(e.max_seq_len, e.max_prefill_tokens, e.num_kv_blocks * e.kv_block_size)


def bench_trace(cfg: Config, source: str = "<config>") -> Trace:
    """The trace the bench replays (``bench_trace_offered``'s second part)."""
    return bench_trace_offered(cfg, source)[1]


def bench_trace_offered(cfg: Config, source: str = "<config>") -> tuple[Trace, Trace]:
    """(the trace offered -- selected and scaled, before the turns that do not fit are
    dropped --, the trace the bench replays): ``bench.trace``'s first ``bench.conversations``
    conversations, ``bench.max_turns`` turns each, lengths scaled by ``bench.length_scale``,
    and each turn that does not fit the engine dropped with the rest of its conversation
    (context + prompt + output within engine.max_seq_len and one replica's KV blocks, a
    re-prefill of the whole context within engine.max_prefill_tokens).

    Raises TraceError (the trace file's problem: file, line, field) or ConfigError
    (``source``: key) for a trace the bench can never run: an unreadable or invalid file,
    explicit prompt ids that cannot be rescaled, lie outside the model's vocabulary or exceed
    what one turn may hold, or no turn left to replay."""
    b, e = cfg.bench, cfg.engine
    if b.trace == "synthetic":
        trace = generate_trace(b.seed)
    elif b.trace == "mooncake":
        from colo_rollout.workloads.trace import load_mooncake

        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.normpath(os.path.join(here, "..", "..", "shared", "traces",
                                             "mooncake_conversation_trace.jsonl"))
        if not os.path.isfile(path):
            raise TraceError(path, None, "file", "cannot read trace file: no such file "
                             f"(bench.trace 'mooncake' of {source} reads ../shared/traces)")
        trace = load_mooncake(path)
    elif b.trace.startswith("mooncake:"):  # a Mooncake-format file of the user's
        from colo_rollout.workloads.trace import load_mooncake

        trace = load_mooncake(b.trace[len("mooncake:"):])
    else:
        trace = load_trace(b.trace)
    convs = tuple(Conversation(c.conv, c.arrival_s, c.turns[: b.max_turns])
                  for c in trace.conversations[: b.conversations])
    trace = Trace(convs, source=trace.source)
    cap = turn_cap(e)
    vocab = cfg.model.vocab_size
    for t in trace.iter_turns():  # explicit ids: their content and length are fixed
        if t.prompt is None:
            continue
        if b.length_scale != 1.0:
            where = f"{trace.source}:{t.line}" if t.line is not None else trace.source
            raise ConfigError(f"{source}: bench.length_scale: {b.length_scale:g} cannot rescale "
                              f"the explicit prompt ids of {where} (conversation {t.conv!r}, "
                              f"turn {t.turn}); set bench.length_scale: 1.0 for this trace",
                              key="bench.length_scale", source=source)
        bad = [i for i in t.prompt if i >= vocab]
        if bad:
            raise TraceError(trace.source, t.line, "prompt",
                             f"token id {bad[0]} is outside the model's vocabulary [0, {vocab}) "
                             f"(model.vocab_size of {source})")
        if t.prompt_tokens + t.output_tokens > cap:
            raise TraceError(trace.source, t.line, "prompt",
                             f"{t.prompt_tokens} prompt ids + {t.output_tokens} output tokens "
                             f"exceed the {cap} tokens one turn may hold here ({_cap_text(e)} "
                             f"of {source}): the bench could never run this turn")
    name = trace.source  # the file (the transforms below append to it)
    if b.length_scale != 1.0:
        trace = trace.scaled_lengths(b.length_scale)
    kept = trace.truncated(cap)
    _check_schedule(kept, b, name, source)
    if not kept.conversations:
        first = min((c.turns[0] for c in trace.conversations),
                    key=lambda t: t.prompt_tokens + t.output_tokens)
        raise ConfigError(f"{source}: bench.trace: no turn of {name} fits the engine: "
                          f"the smallest first turn ({first.prompt_tokens} prompt + "
                          f"{first.output_tokens} output tokens, after bench.length_scale "
                          f"{b.length_scale:g}) exceeds {cap} tokens ({_cap_text(e)})",
                          key="bench.trace", source=source)
    return trace, kept


# the longest a run of spawned ranks may take (launch.py's limit), and so the longest a
# replay's schedule may take
SPAWNED_RUN_S = 3600.0
MAX_REPLAY_S = SPAWNED_RUN_S


def _check_schedule(trace: Trace, b, name: str, source: str) -> None:
    """Refuse a bench whose schedule alone outlasts what a run may take:

      * one replay: a conversation's arrival plus its client waits (x the largest of
        bench.wait_scales) past MAX_REPLAY_S -- it would sit at 0% for hours (a trace in ms
        read as seconds) until the run's limit tore it down;
      * a run of spawned ranks (SPAWNED_RUN_S): the warm-up and every cell's
        replay together (found by probing: such runs sat for an hour, then ended in a
        traceback).

    ``b``: the bench section; ``name``: the trace's file."""
    convs = trace.conversations
    if not convs:
        return

    def span(scale: float):
        """(the least length of a replay at this wait scale, its longest conversation)"""
        def end(c):
            return c.arrival_s + scale * sum(t.wait_s for t in c.turns)
        c = max(convs, key=end)
        return end(c), c

    late = max(convs, key=lambda c: c.arrival_s)
    if late.arrival_s > MAX_REPLAY_S:  # the trace's own time, whatever the waits' scale (found
        # by probing: it was blamed on bench.wait_scales, which cannot move it)
        raise TraceError(name, None, "arrival_s",
                         f"conversation {late.conv!r} arrives at {late.arrival_s:g} s, past the "
                         f"{MAX_REPLAY_S:g} s a replay may take (a trace in milliseconds read "
                         "as seconds?)")
    scale = max(b.wait_scales)
    longest, conv = span(scale)
    if longest > MAX_REPLAY_S:
        raise ConfigError(
            f"{source}: bench.wait_scales: conversation {conv.conv!r} of {name} is "
            f"scheduled over {longest:.6g} s (arrival {conv.arrival_s:g} s + its waits x "
            f"{scale:g}), past the {MAX_REPLAY_S:g} s a replay may take; scale the waits "
            "down or use a trace in seconds", key="bench.wait_scales", source=source)
    if "WORLD_SIZE" in os.environ:  # torchrun's ranks: no limit on the run as a whole
        return
    variants = len(b.ladder())
    total = ((span(b.wait_scales[0])[0] if b.warmup_replay else 0.0)
             + sum(span(w)[0] for w in b.wait_scales) * variants * b.reps)
    if total > SPAWNED_RUN_S:
        raise ConfigError(
            f"{source}: bench.reps: the replays are scheduled over {total:.6g} s at least (the "
            f"warm-up and {len(b.wait_scales)} wait scale(s) x {variants} variant(s) x "
            f"{b.reps} rep(s), each as long as its trace's arrivals and waits), past the "
            f"{SPAWNED_RUN_S:g} s a run of spawned ranks may take; fewer reps, variants or "
            "wait scales, or shorter waits", key="bench.reps", source=source)


def _cap_text(e) -> str:
    return (f"the least of engine.max_seq_len {e.max_seq_len}, engine.max_prefill_tokens "
            f"{e.max_prefill_tokens} and engine.num_kv_blocks x kv_block_size "
            f"{e.num_kv_blocks * e.kv_block_size}")


# --------------------------------------------------------------------------- argument commands
def _require_arg(cond: bool, flag: str, detail: str) -> None:
    if not cond:
        raise DoorError(f"{flag}: {detail}")


# the local tools' process and repeat counts at most these (found by probing: --ranks 100000
# passed the door and would have started that many processes)
MAX_LOCAL_RANKS = 64
MAX_COUNT = 1_000_000


def check_stress_args(ranks: int, seeds: int, cycles: int, max_skew_ms: float, span: int,
                      control_cycles: int) -> None:
    """stress-turnstile's arguments (tools/stress.py's bounds)."""
    _require_arg(ranks >= 1, "--ranks", f"must be >= 1, got {ranks}")
    _require_arg(seeds >= 1, "--seeds", f"must be >= 1, got {seeds}")
    _require_arg(cycles >= 1, "--cycles", f"must be >= 1, got {cycles}")
    _require_arg(ranks <= MAX_LOCAL_RANKS, "--ranks", f"must be at most {MAX_LOCAL_RANKS} (one "
                 f"process each on this host), got {ranks}")
    _require_arg(seeds <= MAX_COUNT, "--seeds", f"must be at most {MAX_COUNT}, got {seeds}")
    _require_arg(cycles <= MAX_COUNT, "--cycles", f"must be at most {MAX_COUNT}, got {cycles}")
    _require_arg(span >= 1, "--span", f"must be >= 1 (boundaries per turnstile round), got "
                 f"{span}")
    _require_arg(control_cycles >= 0, "--control-cycles", f"must be >= 0, got {control_cycles}")
    _require_arg(control_cycles <= MAX_COUNT, "--control-cycles",
                 f"must be at most {MAX_COUNT}, got {control_cycles}")
    _require_arg(math.isfinite(max_skew_ms) and 0 <= max_skew_ms <= MAX_SKEW_MS,
                 "--max-skew-ms", f"must be in [0, {MAX_SKEW_MS:g}] (a skewed rank must meet its "
                 f"peers within the 30 s rendezvous timeout), got {max_skew_ms:g}")


def check_rendezvous_args(ranks: list[int], rounds: int) -> None:
    """bench-rendezvous's arguments."""
    bad = [n for n in ranks if n < 1]
    _require_arg(not bad, "--ranks", f"every rank count must be >= 1, got {bad[0] if bad else 0}")
    _require_arg(rounds >= 1, "--rounds", f"must be >= 1, got {rounds}")
    big = [n for n in ranks if n > MAX_LOCAL_RANKS]
    _require_arg(not big, "--ranks", f"every rank count must be at most {MAX_LOCAL_RANKS} (one "
                 f"process each on this host), got {big[0] if big else 0}")
    _require_arg(rounds <= MAX_COUNT, "--rounds", f"must be at most {MAX_COUNT}, got {rounds}")
