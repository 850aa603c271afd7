#!/usr/bin/env bash
# On the GPU host, at the start of each device call that carries a part of a large wheel:
# copy what this call carried into /root, where it outlives the call on a warm machine
# (docs/gpu.md "How to run it there": FlashAttention-4 in three calls, Transformer Engine in
# five). scripts/install_carried_wheels.sh then joins and installs them once all are there.
#   bash scripts/stage_carried.sh
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p /root/fa4 /root/te /root/whl /root/fa4_pending
for p in .fa4/parts/part_*; do [ -f "$p" ] && cp "$p" /root/fa4/; done
[ -d .fa4/small ] && cp -r .fa4/small /root/fa4/
# the kernel source waits until the libraries' three parts are all there (the installer takes
# a present source as "every part carried")
[ -d .fa4/src/flash_attn ] && cp -r .fa4/src/flash_attn /root/fa4_pending/
if [ "$(ls /root/fa4/part_* 2>/dev/null | wc -l)" = 3 ] && [ -d /root/fa4_pending/flash_attn ]; then
  mkdir -p /root/fa4/src && rm -rf /root/fa4/src/flash_attn
  mv /root/fa4_pending/flash_attn /root/fa4/src/
fi
for p in .te/parts/part_*; do [ -f "$p" ] && cp "$p" /root/te/; done
ls .whl/*.whl >/dev/null 2>&1 && cp .whl/*.whl /root/whl/
# a later call that does not carry .whl gets it back from /root/whl
if ! ls .whl/*.whl >/dev/null 2>&1 && ls /root/whl/*.whl >/dev/null 2>&1; then
  mkdir -p .whl && cp /root/whl/*.whl .whl/
fi
echo "staged: fa4 $(ls /root/fa4/part_* 2>/dev/null | wc -l)/3 parts, te $(ls /root/te/part_* 2>/dev/null | wc -l)/5 parts, $(ls /root/whl 2>/dev/null | wc -l) wheels"
