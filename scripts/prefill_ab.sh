#!/usr/bin/env bash
# Same-run A/B of bench-speed's prefill rows (and the B = 1 decode row) on one GPU: each config
# under each variant, alternating, so the ratios come from one machine.
#   bash scripts/prefill_ab.sh                       (both bench shapes; default vs cudnn)
#   CONFIGS="configs/bench_speed_gpu.yaml" VARIANTS="- engine.prefill_attention=cudnn" \
#     REPS=2 bash scripts/prefill_ab.sh
# A variant is "-" (the config as it is) or KEY=VALUE[,KEY=VALUE...] passed as --set. Results:
# $OUT/ab_<config>_<variant>_<rep>/bench_speed.json and the table rows on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/prefill_ab}
mkdir -p "$OUT"
site=$(bash scripts/install_carried_wheels.sh 2>/dev/null | tail -1) || exit 1
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
CONFIGS=${CONFIGS:-configs/bench_speed_gpu.yaml configs/bench_speed_qwen3.yaml}
VARIANTS=${VARIANTS:-- engine.prefill_attention=cudnn}
ROWS="--set bench_speed.hf_peer=false --set bench_speed.profile=false --set bench_speed.decode_batches=[1] --set bench_speed.long_batches=[] --set bench_speed.long_contexts=[] --set bench_speed.sampled_batches=[]"
for rep in $(seq 1 "${REPS:-1}"); do
  for c in $CONFIGS; do
    for v in $VARIANTS; do
      sets=""
      if [ "$v" != "-" ]; then
        for kv in ${v//,/ }; do sets="$sets --set $kv"; done
      fi
      name="$(basename "$c" .yaml)_${v//[^A-Za-z0-9]/_}_$rep"
      echo "=== $c  variant: $v  rep $rep"
      timeout "${RUN_TIMEOUT:-240}" torchrun --standalone --nproc-per-node 1 -m colo_rollout.cli \
        bench-speed "$c" $ROWS $sets --set bench_speed.out_dir="$OUT/ab_$name" > "$OUT/ab_$name.log" 2>&1 \
        || echo "  failed: $OUT/ab_$name.log"
      grep -E "^ +1 +[0-9]+ |^1 x|^8 x|^16 x" "$OUT/ab_$name.log" | cut -c1-110
    done
  done
done
