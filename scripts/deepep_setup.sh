#!/usr/bin/env bash
# Stage DeepEP for the GPU host in the ignored folder .deepep/ (carry it: carry [".deepep"]):
# ../shared/deepep's source, build script and smoke test, with colo_rollout's split-phase
# dispatch patch (scripts/deepep/colo_patches.py) appended to its apply_patches.py -- so the
# build stamp covers our patch, and a package built from other inputs is never unpacked.
#
#   bash scripts/deepep_setup.sh [BUILT_TGZ]
#
# BUILT_TGZ: a deep_ep_built_full.tgz that an earlier GPU run of this patch left in $OUT
# (default: .deepep-built/deep_ep_built_full.tgz when present); staged next to build.sh, where
# build.sh unpacks it instead of compiling (~10 s instead of ~90 s) when its stamp matches.
# On the GPU host: `bash .deepep/build.sh build` then PYTHONPATH=/tmp/deepep/site has deep_ep.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${DEEPEP_SHARED:-$ROOT/../shared/deepep}
DEST=$ROOT/.deepep
BUILT=${1:-$ROOT/.deepep-built/deep_ep_built_full.tgz}
[ -f "$SHARED/build.sh" ] || { echo "error: $SHARED/build.sh: no DeepEP build folder there" >&2; exit 2; }
rm -rf "$DEST"
mkdir -p "$DEST"
for f in README.md build.sh preflight.py smoke_test.py src.tar.gz hdr.tgz nvshmem-3.4.5-dev.tgz; do
    cp "$SHARED/$f" "$DEST/"
done
# the upstream patches, then ours (each idempotent, each failing loudly on a mismatch)
cat "$SHARED/apply_patches.py" "$ROOT/scripts/deepep/colo_patches.py" > "$DEST/apply_patches.py"
if [ -f "$BUILT" ]; then
    cp "$BUILT" "$DEST/deep_ep_built_full.tgz"
    echo "staged $DEST with the prebuilt package $BUILT"
else
    echo "staged $DEST (no prebuilt package: the GPU host compiles, ~90 s)"
fi
