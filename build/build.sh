#!/bin/sh
# Build the one-file executable and its release.json (SPEC section 8).
#
#   build/build.sh [OUTDIR]     OUTDIR defaults to build/dist of this source tree
#
# Builds the source tree this script sits in, with $PYTHON (default: its .venv), whose
# packages must be exactly the locks' pins. Reproducible: two builds of one tree with
# one toolchain give the same bytes from any directory (`make reproduce` checks that).
#   PYTHONHASHSEED=0    base_library.zip's member order follows string hashing
#   SOURCE_DATE_EPOCH   the source commit's time (honoured if already set, as is
#                       SOURCE_COMMIT: `make reproduce` builds copies that have no .git)
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${1:-$ROOT/build/dist}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}

if [ -e "$ROOT/.git" ]; then
    : "${SOURCE_COMMIT:=$(git -C "$ROOT" rev-parse HEAD)}"
    : "${SOURCE_DATE_EPOCH:=$(git -C "$ROOT" log -1 --format=%ct)}"
    if [ -n "$(git -C "$ROOT" status --porcelain)" ]; then
        echo "build.sh: warning: uncommitted changes: release.json names commit $SOURCE_COMMIT, the artifact is built from the work tree" >&2
        : "${SOURCE_TREE_CLEAN:=false}"
    fi
    : "${SOURCE_TREE_CLEAN:=true}"
fi
: "${SOURCE_COMMIT:=unknown}" "${SOURCE_DATE_EPOCH:=0}" "${SOURCE_TREE_CLEAN:=unknown}"
PYTHONHASHSEED=0
export PYTHONHASHSEED SOURCE_DATE_EPOCH

"$PYTHON" "$ROOT/build/release.py" check-locks
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT"
"$PYTHON" -m PyInstaller --log-level WARN --clean --noconfirm \
    --distpath "$OUTDIR" --workpath "$ROOT/build/work" "$ROOT/build/tinygw.spec"
"$PYTHON" "$ROOT/build/release.py" write "$OUTDIR/tinygw" "$OUTDIR/release.json" \
    --source-commit "$SOURCE_COMMIT" --source-date-epoch "$SOURCE_DATE_EPOCH" --source-tree-clean "$SOURCE_TREE_CLEAN"
echo "build.sh: $OUTDIR/tinygw sha256 $(sha256sum "$OUTDIR/tinygw" | cut -d' ' -f1)"
