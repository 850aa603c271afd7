#!/usr/bin/env bash
# On the GPU host (no package index there): install the wheels this repo carries into
# /tmp/site, and print the PYTHONPATH to use. See docs/gpu.md for how they get there.
#   .whl/*.whl                      megatron-core, msgspec (cp312); nvidia-ml-py where carried
#                                   (bench-speed's SM clock and power readings)
#   .te/small/*.whl + /root/te/part_*   Transformer Engine (core wheel sent in 58 MB parts)
#   /root/fa4/{small,src,part_*}       FlashAttention-4 (flash_attn.cute source, its wheels, the
#                                      cutlass-dsl cu13 libraries sent in 31 MB parts)
set -euo pipefail
site=/tmp/site
mkdir -p "$site"
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$@" >&2; }
python3 -c "import megatron.core, msgspec" 2>/dev/null || pip_install .whl/*.whl
if ls .whl/nvidia_ml_py-*.whl >/dev/null 2>&1 && ! python3 -c "import pynvml" 2>/dev/null; then
  pip_install .whl/nvidia_ml_py-*.whl
fi
if ls /root/te/part_* >/dev/null 2>&1 && [ -d .te/small ] && [ ! -e "$site/transformer_engine" ]; then
  core=/root/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
  cat /root/te/part_* > "$core"
  want=$(cat .te/small/te_core.md5); got=$(md5sum "$core" | cut -c1-32)
  [ "$want" = "$got" ] || { echo "TE core wheel checksum mismatch ($got != $want)" >&2; exit 1; }
  pip_install "$core" .te/small/*.whl
fi
if ls /root/fa4/part_* >/dev/null 2>&1 && [ -d /root/fa4/src/flash_attn ] \
    && [ ! -e "$site/flash_attn" ]; then
  libs=/root/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  cat /root/fa4/part_* > "$libs"
  want=$(cat /root/fa4/small/cu13.md5); got=$(md5sum "$libs" | cut -c1-32)
  [ "$want" = "$got" ] || { echo "cutlass-dsl libs checksum mismatch ($got != $want)" >&2; exit 1; }
  pip_install "$libs" /root/fa4/small/*.whl
  # the wheel's .pth (not read from a PYTHONPATH folder) puts these packages on sys.path
  for p in "$site"/nvidia_cutlass_dsl/dsl_packages/*; do ln -sfn "$p" "$site/$(basename "$p")"; done
  cp -r /root/fa4/src/flash_attn "$site/"  # a namespace package: flash_attn.cute only
fi
echo "$site"
