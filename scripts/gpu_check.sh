#!/usr/bin/env bash
# GPU host check: runs every GPU test and benchmark in one go and prints a short table last.
#   bash scripts/gpu_check.sh            (on a CUDA host; megatron-core installed, or carried as
#                                         a cp312 wheel in .whl/ -- see docs/gpu.md)
# Results land in $OUT (default runs/gpu_check): pytest log, JSON lines per test, demo reports.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
site=$(bash scripts/install_carried_wheels.sh) || exit 1
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $NGPU  ($(python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'))"
python3 -c "import transformer_engine as te; print('Transformer Engine', te.__version__)" 2>/dev/null \
  || echo "Transformer Engine: not installed (TE-spec tests skip)"
# DeepEP (the deepep rows): staged here by `bash scripts/deepep_setup.sh` and carried as .deepep;
# unpacked (or compiled, ~90 s) on this host; without it those rows skip
if [ -f .deepep/build.sh ]; then
  if bash .deepep/build.sh build > "$OUT/deepep_build.log" 2>&1; then
    export PYTHONPATH=/tmp/deepep/site:$PYTHONPATH
    echo "DeepEP: $(grep -m1 '^PASS build' "$OUT/deepep_build.log" | cut -c1-100)"
  else
    echo "DeepEP: build failed ($OUT/deepep_build.log); the deepep rows skip"
  fi
fi
export COLO_GPU_REPORT=$OUT/gpu_tests.jsonl
rm -f "$COLO_GPU_REPORT"

# PYTEST_ARGS picks a subset (default: every GPU test); RUN_DEMO=0 / RUN_BENCH=0 skip those parts
python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests/test_gpu.py} 2>&1 | tee "$OUT/pytest.log"
# and the kernel files' own GPU tests (marked gpu: the bound launches, the greedy pick, the
# fused norms, the pinned stage, batch invariance's bits)
[ -n "${PYTEST_ARGS:-}" ] || python3 -m pytest -q -p no:cacheprovider -m gpu tests \
  --ignore=tests/test_gpu.py 2>&1 | tee -a "$OUT/pytest.log"

for n in 1 2; do
  [ "${RUN_DEMO:-1}" = 1 ] || break
  [ "$NGPU" -ge "$n" ] || continue
  if [ "$n" = 1 ]; then set_layout="--set parallel.world_size=1 --set parallel.adp=1 --set parallel.ep=1"; else set_layout=""; fi
  timeout "${DEMO_TIMEOUT:-240}" torchrun --standalone --nproc-per-node "$n" -m colo_rollout.cli demo configs/demo_gpu.yaml \
    $set_layout --report "$OUT/demo_gpu$n.json" 2>&1 | tail -n 12 \
    || echo "demo on $n GPU(s) failed"
done

# decode-only overhead of the PD machinery (no P pending) vs Normal, 2 GPUs
if [ "$NGPU" -ge 2 ] && [ "${RUN_DEMO:-1}" = 1 ]; then
  timeout 180 torchrun --standalone --nproc-per-node 2 -m colo_rollout.cli bench-decode-overhead \
    configs/demo_gpu.yaml --reps 5 2>&1 | grep -A4 "median ms" || echo "decode overhead run failed"
fi

# the ordering ladder on a trace, 2 GPUs (EP2/ADP2) then 1 (BENCH_GPUS picks; BENCH_CONFIG picks
# the config, e.g. configs/bench_gpu_large.yaml; BENCH_ARGS adds e.g.
# --set engine.stream_priority=decode); RUN_BENCH=0 skips it. Every run is
# bounded (BENCH_TIMEOUT s) and appends each finished replay to runs_partial.jsonl, so a run cut
# short still leaves its numbers.
if [ "${RUN_BENCH:-1}" = 1 ]; then
  for n in ${BENCH_GPUS:-2 1}; do
    [ "$NGPU" -ge "$n" ] || continue
    if [ "$n" = 1 ]; then set_layout="--set parallel.world_size=1 --set parallel.adp=1 --set parallel.ep=1"; else set_layout=""; fi
    timeout "${BENCH_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "$n" -m colo_rollout.cli \
      bench "${BENCH_CONFIG:-configs/bench_gpu.yaml}" $set_layout --set bench.out_dir="$OUT/bench$n" ${BENCH_ARGS:-} 2>&1 \
      | tr '\r' '\n' | grep -v 'run/s\|Warning\|warnings.warn' | tail -n 26 || echo "bench on $n GPU(s) failed"
  done
fi

# the weight sync against the copy bandwidth (issue 18 item 2): the bench-speed shape on one
# GPU (trainer TP1 beside the engine); RUN_SYNC=0 skips it
if [ "${RUN_SYNC:-1}" = 1 ]; then
  timeout 300 torchrun --standalone --nproc-per-node 1 -m colo_rollout.cli bench-sync \
    configs/bench_speed_gpu.yaml --out "$OUT/sync" 2>&1 | tail -n 4 || echo "bench-sync failed"
fi

# a random Qwen3-30B-A3B-shaped checkpoint (CKPT_LAYERS layers, ~1.35 GB each in bf16) written to
# CKPT_DIR, served through model.checkpoint, against transformers in bf16 and fp32;
# RUN_CHECKPOINT=0 skips it
if [ "${RUN_CHECKPOINT:-1}" = 1 ]; then
  timeout 300 python3 scripts/gpu_checkpoint.py --dir "${CKPT_DIR:-/root/qwen3_ckpt}" \
    --layers "${CKPT_LAYERS:-12}" --json "$OUT/checkpoint.json" 2>&1 \
    | grep -v -i 'warn\|Loading weights' | tail -n 8 || echo "checkpoint run failed"
  # the same shape as a block-scaled FP8 release (dequantised at load; transformers scores its
  # bf16 twin); RUN_FP8_RELEASE=0 skips it
  if [ "${RUN_FP8_RELEASE:-1}" = 1 ]; then
    timeout 400 python3 scripts/gpu_checkpoint.py --fp8-release \
      --dir "${CKPT_DIR:-/root/qwen3_ckpt}_fp8" --layers "${CKPT_LAYERS:-12}" \
      --json "$OUT/checkpoint_fp8_release.json" 2>&1 \
      | grep -v -i 'warn\|Loading weights' | tail -n 8 || echo "FP8 release run failed"
  fi
fi

# decode and prefill against the roofline, one GPU, with the transformers peer (bench-speed);
# SPEED_CONFIGS picks the shapes, RUN_SPEED=0 skips it
if [ "${RUN_SPEED:-1}" = 1 ] && [ "$NGPU" -ge 1 ]; then
  # SPEED_FP8: the GEMM precisions to run each shape in ("off": bf16; "e4m3": model.fp8);
  # SPEED_ARGS adds overrides (e.g. fewer shapes)
  for c in ${SPEED_CONFIGS:-configs/bench_speed_gpu.yaml configs/bench_speed_qwen3.yaml}; do
    for fp8 in ${SPEED_FP8:-off e4m3}; do
      name=$(basename "$c" .yaml); fp8_set=""
      if [ "$fp8" != off ]; then name=${name}_fp8; fp8_set="--set model.fp8=$fp8"; fi
      timeout "${SPEED_TIMEOUT:-400}" torchrun --standalone --nproc-per-node 1 -m colo_rollout.cli \
        bench-speed "$c" $fp8_set --set bench_speed.out_dir="$OUT/$name" ${SPEED_ARGS:-} 2>&1 \
        | grep -v -i 'warn' | tail -n 60 || echo "bench-speed $c ($fp8) failed"
    done
  done
fi

python3 scripts/gpu_table.py "$OUT"
