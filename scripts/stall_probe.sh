#!/usr/bin/env bash
# Diagnosis of the Fine stall with P graphs (docs/benchmarks.md, session 7): the 64-conversation
# replay of configs/bench_gpu_large.yaml with P graphs and P's AllReduce unrouted, under several
# settings (the cases below), each bounded by PROBE_TIMEOUT seconds. Logs, bench JSON (every
# rank's GPU timeline) and summary.txt (the table rows and timeline rows) land in $OUT.
#   PROBES="f0 f1" bash scripts/stall_probe.sh     (on the GPU host; 2 GPUs)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-runs/stall_probe}; mkdir -p "$OUT"
site=$(bash scripts/install_carried_wheels.sh) || exit 1
export PYTHONPATH=$site:$PWD
base=(--set "bench.spans=[8]" --set bench.reps=1 --set bench.conversations=${CONV:-64}
      --set "bench.variants=[${VARIANT:-fine-bal}]" --set bench.warmup_replay=false
      --set engine.prefill_graphs=always --set "engine.stream_route='off'" --set engine.stall_dump_s=5)
probe() {  # name, extra env (k=v ...), -- extra --set args
  local name=$1; shift; local envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  local t0=$SECONDS
  env "${envs[@]}" NCCL_DEBUG=WARN timeout "${PROBE_TIMEOUT:-160}" torchrun --standalone --nproc-per-node 2 \
    -m colo_rollout.cli bench configs/bench_gpu_large.yaml "${base[@]}" "$@" \
    --set bench.out_dir=runs/probe_$name > "$OUT/$name.log" 2>&1
  local rc=$?
  cp runs/probe_$name/bench.json "$OUT/$name.json" 2>/dev/null
  printf "%-10s rc=%-4s wall %4d s  %s\n" "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -cE 'stall watch|DeviceStall' "$OUT/$name.log") stall prints" | tee -a "$OUT/summary.txt"
  # the table rows, then the timeline rows (P busy, D busy, overlap, D tail, D median, D max)
  grep -E '^ +0 +(normal|fine)' "$OUT/$name.log" >> "$OUT/summary.txt"
  grep -A4 '^timeline' "$OUT/$name.log" | grep -E '^ +(normal|fine)' >> "$OUT/summary.txt"
}
for p in ${PROBES:-a b c}; do
  case $p in
    a) probe a -- ;;                                               # the repro
    b) probe b CUDA_DEVICE_MAX_CONNECTIONS=32 -- ;;                # hardware-queue aliasing?
    c) probe c -- --set engine.stream_priority=equal ;;            # P-priority starvation?
    d) probe d NCCL_MAX_NCHANNELS=4 -- ;;                          # NCCL's SM share
    e) probe e -- --set engine.stream_route=always ;;              # the fence (control)
    # session 6's conditions: an untimed replay and Normal first, fine-bal as a successor engine
    f) probe f -- --set bench.warmup_replay=true --set "bench.variants=[normal,fine-bal]" ;;
    # D's stream favoured: D's small kernels take freed SMs before P's dense ones
    g) probe g -- --set bench.warmup_replay=true --set "bench.variants=[normal,fine-8,fine-bal]" \
         --set engine.stream_priority=decode ;;
    # session 6's conditions with a short bound (a stall raises DeviceStall after 40 s):
    f0) probe f0 -- --set bench.warmup_replay=true --set "bench.variants=[normal,fine-bal]" \
          --set parallel.timeout_s=40 ;;
    f1) probe f1 CUDA_DEVICE_MAX_CONNECTIONS=32 -- --set bench.warmup_replay=true \
          --set "bench.variants=[normal,fine-bal]" --set parallel.timeout_s=40 ;;
    f2) probe f2 NCCL_RUNTIME_CONNECT=0 -- --set bench.warmup_replay=true \
          --set "bench.variants=[normal,fine-bal]" --set parallel.timeout_s=40 ;;
  esac
done
