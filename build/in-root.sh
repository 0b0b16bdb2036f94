#!/bin/sh
# The build itself, inside the build root: build/build.sh runs it under chroot with only
# PATH, HOME, LC_ALL, TZ, SOURCE_COMMIT, SOURCE_DATE_EPOCH, SOURCE_TREE_CLEAN and
# PIP_INDEX_URL set. Every path is the same in every build:
#   /build/src               the source tree's tinygw/, build/, requirements/
#   /build/build-root.txt    the root's packages (build/buildroot.sh), for release.json
#   /build/venv              made by Debian's python3 from the locks' hashes alone
#   /build/dist              the executable and release.json
#   PYTHONHASHSEED=0         base_library.zip's member order follows string hashing
set -eu

VENV_PYTHON=/build/venv/bin/python
PYTHONHASHSEED=0
export PYTHONHASHSEED
cd /build/src

/usr/bin/python3 build/release.py requirements >/build/requirements.txt
/usr/bin/python3 -m venv /build/venv
# Wheels only (nothing compiled here), each checked against the locks' hashes; no pip
# configuration or cache is read.
CERT=/build/download-ca.pem
[ -f "$CERT" ] || CERT=/etc/ssl/certs/ca-certificates.crt
"$VENV_PYTHON" -m pip install --isolated --no-cache-dir --disable-pip-version-check --quiet \
    --index-url "$PIP_INDEX_URL" --cert "$CERT" --only-binary :all: --require-hashes --no-deps \
    -r /build/requirements.txt
broken=$("$VENV_PYTHON" -m pip check --isolated --disable-pip-version-check) || { echo "$broken" >&2; exit 1; }
"$VENV_PYTHON" build/release.py check-locks

"$VENV_PYTHON" -m PyInstaller --log-level WARN --clean --noconfirm \
    --distpath /build/dist --workpath /build/work build/tinygw.spec
"$VENV_PYTHON" build/release.py write /build/dist/tinygw /build/dist/release.json \
    --source-commit "$SOURCE_COMMIT" --source-date-epoch "$SOURCE_DATE_EPOCH" \
    --source-tree-clean "$SOURCE_TREE_CLEAN" --build-root /build/build-root.txt
