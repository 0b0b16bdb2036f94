#!/bin/sh
# Build the one-file executable and its release.json inside a Debian build root (docs/design.md section 8).
#
#   build/build.sh [--source DIR] [--root-manifest FILE] [OUTDIR]
#       DIR      the tree to build (default: this one); its build/in-root.sh runs in the root
#       FILE     the build root's packages (build/buildroot.sh's manifest, e.g. a release's:
#                `make reproduce REFERENCE=`) instead of those the mirror lists now
#       OUTDIR   default DIR/build/dist
#
# Needs root and apt. Nothing of the host's Python, libraries or pip configuration is used:
#   1. build/buildroot.sh lists the root's Debian packages as the mirror has them now (or
#      takes FILE's) and gives a tarball of a root made of exactly those (cached, keyed by
#      the list);
#   2. the tarball is unpacked into a fresh directory, with the files of this tree that the
#      build reads (tinygw/, build/, requirements/: tracked or not ignored, uncommitted
#      edits included);
#   3. build/in-root.sh runs there under chroot with a clean environment: Debian's python3
#      makes a venv from the locks' hashes and PyInstaller builds;
#   4. the executable and release.json (with `build_root`: every package) are copied out.
# Reproducible: two builds of one tree from roots of the same packages give the same bytes
# from any directory (`make reproduce` checks that).
#   SOURCE_DATE_EPOCH   the source commit's time (honoured if already set, as are
#                       SOURCE_COMMIT and SOURCE_TREE_CLEAN: `make reproduce` builds copies
#                       that have no .git)
#   PIP_INDEX_URL       where the root's pip downloads the locked wheels (default PyPI), with
#                       the host's CA bundle (a TLS proxy's CA too); the hashes decide what
#                       is installed
set -eu

TOOLS=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$TOOLS/.." && pwd)
ROOT_MANIFEST=
while [ $# -gt 0 ]; do
    case $1 in
        --source) ROOT=$(cd "$2" && pwd); shift 2 ;;
        --root-manifest) ROOT_MANIFEST=$2; shift 2 ;;
        -*) echo "usage: build.sh [--source DIR] [--root-manifest FILE] [OUTDIR]" >&2; exit 2 ;;
        *) break ;;
    esac
done
OUTDIR=${1:-$ROOT/build/dist}

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

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tinygw-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM  # through the EXIT trap
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

if [ -n "$ROOT_MANIFEST" ]; then
    cp "$ROOT_MANIFEST" "$WORK/build-root.txt"
else
    sh "$TOOLS/buildroot.sh" resolve "$WORK/build-root.txt"
fi
TARBALL=$(sh "$TOOLS/buildroot.sh" make "$WORK/build-root.txt")

BR=$WORK/root
mkdir "$BR"
tar -x -f "$TARBALL" -C "$BR"
mkdir -p "$BR/build/src" "$BR/build/home"
cp "$WORK/build-root.txt" "$BR/build/build-root.txt"
if [ -e "$ROOT/.git" ]; then
    git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- tinygw build requirements
else
    (cd "$ROOT" && find tinygw build requirements -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
        ! -path 'build/dist/*' ! -path 'build/work/*' -print0)
fi | (cd "$ROOT" && xargs -0 sh -c 'for f; do if [ -f "$f" ]; then printf "%s\0" "$f"; fi; done' sh) |
    (cd "$ROOT" && tar --null --no-recursion -T - -cf -) | tar -x -C "$BR/build/src" -f -
# Network plumbing for pip's downloads only: name resolution and the CAs the host trusts.
cp /etc/resolv.conf "$BR/etc/resolv.conf" 2>/dev/null || true
CA=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
[ -f "$CA" ] && cp "$CA" "$BR/build/download-ca.pem"

# A private mount and pid namespace: /proc for the build, gone with it.
unshare --mount --pid --fork --kill-child --mount-proc="$BR/proc" \
    chroot "$BR" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/build/home LC_ALL=C.UTF-8 TZ=UTC \
    SOURCE_COMMIT="$SOURCE_COMMIT" SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" SOURCE_TREE_CLEAN="$SOURCE_TREE_CLEAN" \
    PIP_INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}" \
    /bin/sh /build/src/build/in-root.sh

cp "$BR/build/dist/tinygw" "$BR/build/dist/release.json" "$OUTDIR/"
echo "build.sh: $OUTDIR/tinygw sha256 $(sha256sum "$OUTDIR/tinygw" | cut -d' ' -f1)"
