#!/usr/bin/env bash
# On the GPU host (no package index there): install the wheels this repo carries into
# /tmp/site, and print the PYTHONPATH to use. See docs/gpu.md for how they get there.
#   .whl/*.whl                      megatron-core, msgspec (cp312)
#   .te/small/*.whl + /root/te/part_*   Transformer Engine (core wheel sent in 58 MB parts)
set -euo pipefail
site=/tmp/site
mkdir -p "$site"
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$@" >&2; }
python3 -c "import megatron.core, msgspec" 2>/dev/null || pip_install .whl/*.whl
if ls /root/te/part_* >/dev/null 2>&1 && [ -d .te/small ] && [ ! -e "$site/transformer_engine" ]; then
  core=/root/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
  cat /root/te/part_* > "$core"
  want=$(cat .te/small/te_core.md5); got=$(md5sum "$core" | cut -c1-32)
  [ "$want" = "$got" ] || { echo "TE core wheel checksum mismatch ($got != $want)" >&2; exit 1; }
  pip_install "$core" .te/small/*.whl
fi
echo "$site"
