#!/usr/bin/env bash
# Stage FlashAttention-4 (flash_attn.cute, engine.prefill_attention: flash) for the GPU host,
# which has no package index: its wheels in .fa4/small, the 92 MB cutlass-dsl cu13 libraries
# in 31 MB parts in .fa4/parts (a device call carries at most 64 MiB), the kernel's source in
# .fa4/src/flash_attn/cute (a namespace package: no flash_attn/__init__.py).
#   bash scripts/fa4_setup.sh /path/to/flash-attention    (a checkout; tested at 0251105a)
# On the host, scripts/install_carried_wheels.sh installs it from /root/fa4 (copy .fa4/small,
# .fa4/src and the parts there, a few per call: docs/gpu.md). Where pip reaches PyPI with
# flash-attn-4 on it, `pip install flash-attn-4[cu13]` is the same thing.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: fa4_setup.sh FLASH_ATTENTION_CHECKOUT}
[ -f "$src/flash_attn/cute/interface.py" ] || { echo "no flash_attn/cute in $src" >&2; exit 1; }
rm -rf .fa4 && mkdir -p .fa4/small .fa4/parts .fa4/src/flash_attn .fa4/dl
dl() { python3 -m pip download -q --no-deps --python-version 3.12 \
         --platform manylinux_2_28_x86_64 --only-binary=:all: -d .fa4/dl "$@"; }
dl nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
   nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
   "apache-tvm-ffi>=0.1.12,<0.2" torch-c-dlpack-ext "quack-kernels>=0.5.3" einops \
   cuda-bindings cuda-pathfinder protobuf
libs=$(ls .fa4/dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
md5sum "$libs" | cut -c1-32 > .fa4/small/cu13.md5
(cd .fa4/parts && split -b 31m "../../$libs" part_)
find .fa4/dl -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .fa4/small/ \;
rm -rf .fa4/dl
cp -r "$src/flash_attn/cute" .fa4/src/flash_attn/
du -sh .fa4/small .fa4/parts/* .fa4/src
