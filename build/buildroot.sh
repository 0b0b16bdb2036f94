#!/bin/sh
# The Debian build root that build/build.sh builds in (docs/design.md section 8: the build does not
# depend on the builder's machine). Needs root and apt; installs mmdebstrap when missing.
#
#   build/buildroot.sh resolve MANIFEST   fetch Debian's package lists now and write MANIFEST:
#                                          the exact packages of the root (name, version,
#                                          architecture, sha256 of the .deb), where and when
#                                          they were listed
#   build/buildroot.sh make MANIFEST      print the path of a tarball of the root made of
#                                          exactly those packages: the cached one when there is
#                                          one, else one made now (then cached); adds to
#                                          MANIFEST the mmdebstrap and recipe that make it and
#                                          "tar SHA256"
#   build/buildroot.sh check RELEASE_JSON  resolve now (the host's mirror, never a snapshot)
#                                          and name each package of the release's root that
#                                          has a newer version (`make release-check`); exit 1
#                                          when there is one: the release is stale
#
# A root is made from the .debs themselves, never from today's package lists: build/debs.py
# fetches each by its exact version and checks its sha256 (from the host's mirror, else the
# snapshot archive when DEBIAN_SNAPSHOT is set, else DEBS_DIR), and mmdebstrap installs
# them from a local repository of exactly those files. So any manifest makes its root for as
# long as its .debs exist somewhere, a release's manifest (`make reproduce REFERENCE=`) too.
# Debian 12 "bookworm": its python3 is 3.11, the Python the locks are compiled for
# (cp311 wheels), and it gets security fixes (Debian LTS) until mid-2028.
# Inputs, from the environment:
#   DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR   default: the host's apt sources for bookworm and
#                                           bookworm-security, else deb.debian.org
#   DEBIAN_SNAPSHOT=20261130T084402Z        resolve: both from snapshot.debian.org as they
#                                           were then; make: the second place for a .deb
#   DEBS_DIR                                make: the third place, a folder of .debs (any
#                                           names, any depth: matched by sha256)
#   BUILDROOT_CACHE                         default /var/cache/tinygw-buildroot
#   BUILDROOT_FRESH=1                       make the root now even when one is cached
#                                           (`make reproduce`); it replaces the cached one
# The cache key is the sha256 of everything that decides the tarball's bytes: the package
# list, the suites its sources.list names, the options given to mmdebstrap, its version and
# this script. mmdebstrap makes the same tarball from the same packages (SOURCE_DATE_EPOCH
# is fixed), so a cached root is the root a fresh one would be; its sha256 is checked before
# each use. The fetched .debs are kept in $BUILDROOT_CACHE/debs as SHA256.deb.
# shellcheck disable=SC2016  # $(FIELD) in apt formats and $1 in hooks are not for this shell
set -eu

RELEASE=bookworm
ARCH=amd64
# What the build needs besides Debian's Essential:yes set. libpython3.11: PyInstaller
# bundles the shared libpython. binutils: it strips with strip and appends its archive
# with objcopy.
# usr-is-merged: satisfies init-system-helpers without usrmerge, which would pull in perl
# (mmdebstrap's merged-usr hook merges /usr, as usrmerge would).
INCLUDE="python3 python3-venv libpython3.11 binutils usr-is-merged"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
ROOT_EPOCH=1686355200  # 2023-06-10, Debian 12's release: the time of files mmdebstrap writes itself
CACHE=${BUILDROOT_CACHE:-/var/cache/tinygw-buildroot}
HERE=$(cd "$(dirname "$0")" && pwd)

say() { echo "buildroot.sh: $*" >&2; }
die() { say "$*"; exit 1; }

need_tools() {
    [ "$(id -u)" = 0 ] || die "needs root (mmdebstrap's root mode, chroot)"
    [ "$(dpkg --print-architecture 2>/dev/null)" = "$ARCH" ] || die "builds on $ARCH hosts only"
    if ! command -v mmdebstrap >/dev/null || [ ! -e "$KEYRING" ]; then
        say "mmdebstrap or Debian's keyring is missing; installing them with apt-get"
        apt-get update -qq && apt-get install -y -qq mmdebstrap debian-archive-keyring >/dev/null
    fi
}

# The mirror the host's apt uses for SUITE, else DEFAULT.
host_mirror() {
    apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null |
        awk -v suite="$1" '$1 == suite { print $2; exit }' | grep . || echo "$2"
}

# apt options for fetching that the host uses and the root must too: a mirror whose
# Release files have expired (snapshots, frozen mirrors) is refused otherwise.
apt_options() {
    if [ -n "${DEBIAN_SNAPSHOT:-}" ]; then
        echo 'Acquire::Check-Valid-Until "false";'
        return
    fi
    eval "$(apt-config shell VALID_UNTIL Acquire::Check-Valid-Until CHECK_DATE Acquire::Check-Date)"
    [ "${VALID_UNTIL:-}" = false ] && echo 'Acquire::Check-Valid-Until "false";'
    [ "${CHECK_DATE:-}" = false ] && echo 'Acquire::Check-Date "false";'
    true
}

# The host's mirror for bookworm(-updates) and for bookworm-security, unless DEBIAN_MIRROR or
# DEBIAN_SECURITY_MIRROR name others.
main_mirror() { echo "${DEBIAN_MIRROR:-$(host_mirror $RELEASE http://deb.debian.org/debian)}"; }
security_mirror() { echo "${DEBIAN_SECURITY_MIRROR:-$(host_mirror $RELEASE-security http://deb.debian.org/debian-security)}"; }

# The three suites' sources.list lines, from "MAIN SECURITY" on stdin.
source_lines() {
    read -r main security
    for line in "${main%/} $RELEASE" "${main%/} $RELEASE-updates" "${security%/} $RELEASE-security"; do
        echo "deb [arch=$ARCH signed-by=$KEYRING] $line main"
    done
}

# Where resolve lists the packages: the host's mirror, or the snapshot archive at DEBIAN_SNAPSHOT.
sources() {
    if [ -n "${DEBIAN_SNAPSHOT:-}" ]; then
        echo "http://snapshot.debian.org/archive/debian/$DEBIAN_SNAPSHOT http://snapshot.debian.org/archive/debian-security/$DEBIAN_SNAPSHOT"
    else
        echo "$(main_mirror) $(security_mirror)"
    fi | source_lines
}

# The sources.list a root of MANIFEST holds: the suites its packages were listed from.
root_sources() {
    awk -v r=$RELEASE '$1 == "source" && $3 == r { m = $2 } $1 == "source" && $3 == r "-security" { s = $2 }
                       END { print m, s }' "$1" | source_lines
}

resolve() {
    manifest=$1
    apt=$(mktemp -d "${TMPDIR:-/tmp}/tinygw-apt.XXXXXX")
    trap 'rm -rf "$apt"' EXIT
    chmod 755 "$apt"  # apt downloads as its user _apt
    mkdir -p "$apt/etc/apt.conf.d" "$apt/etc/preferences.d" "$apt/etc/sources.list.d" \
        "$apt/state/lists/partial" "$apt/cache/archives/partial" "$apt/log"
    : >"$apt/state/status"  # nothing installed: apt lists every package the root needs
    sources >"$apt/etc/sources.list"
    # Only these settings: none of the host's apt.conf.d, preferences or pins.
    {
        echo "Dir \"$apt/\"; Dir::State \"$apt/state/\"; Dir::State::status \"$apt/state/status\"; Dir::Etc \"$apt/etc/\";"
        echo "Dir::Cache \"$apt/cache/\"; Dir::Log \"$apt/log/\"; Debug::NoLocking \"true\";"
        echo "APT::Architecture \"$ARCH\"; APT::Architectures { \"$ARCH\"; };"
        echo 'APT::Install-Recommends "false"; Acquire::Languages "none";'
        apt_options
    } >"$apt/apt.conf"
    export APT_CONFIG="$apt/apt.conf"

    fetched=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    apt-get -qq update || die "apt-get update failed for these sources: $(cat "$apt/etc/sources.list")"
    lists=$(apt-get indextargets --format '$(FILENAME)' 'Identifier: Packages')
    # shellcheck disable=SC2086  # word splitting: the list files, then package names
    essential=$(awk 'BEGIN { RS = ""; FS = "\n" } /\nEssential: yes/ { print substr($1, 10) }' $lists | sort -u)
    # shellcheck disable=SC2086
    apt-get -s -q install $essential $INCLUDE >"$apt/plan" ||
        die "apt cannot install $INCLUDE from these sources: $(cat "$apt/plan")"
    sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*\[\([^]]*\)\]).*/\1 \2 \3/p' "$apt/plan" | sort >"$apt/packages"
    # The sha256 of each .deb, as the signed package lists give it (apt checks downloads against it).
    # shellcheck disable=SC2046
    apt-cache show $(awk '{ print $1 "=" $2 }' "$apt/packages") |
        awk 'BEGIN { RS = ""; FS = "\n" }
             { split("", field); for (i = 1; i <= NF; i++) { split($i, kv, ": "); field[kv[1]] = kv[2] }
               print "package", field["Package"], field["Version"], field["Architecture"], field["SHA256"] }' |
        sort -u >"$apt/debs"
    [ "$(wc -l <"$apt/debs")" = "$(wc -l <"$apt/packages")" ] || die "one .deb has two sha256 sums in the lists"

    {
        echo "release $RELEASE"
        echo "include $INCLUDE"
        apt_options | sed 's/^/aptopt /'
        echo "fetched $fetched"
        for packages in $lists; do  # "source URI SUITE DATE", the date from the suite's Release file
            release_file=$(echo "$packages" | sed 's/_main_binary-[a-z0-9]*_Packages$/_InRelease/')
            uri=$(apt-get indextargets --format '$(FILENAME) $(REPO_URI) $(RELEASE)' 'Identifier: Packages' |
                awk -v f="$packages" '$1 == f { print $2, $3 }')
            echo "source $uri $(sed -n 's/^Date: //p' "$release_file")"
        done
        cat "$apt/debs"
    } >"$manifest"
    say "$(wc -l <"$apt/debs") packages of $RELEASE, lists fetched $fetched from $(sources | awk '{ print $4 }' | sort -u | tr '\n' ' ')"
}

# The lines of MANIFEST that decide the tarball's bytes (not when the lists were fetched).
identity() {
    awk '$1 ~ /^(release|include|mmdebstrap|recipe|aptopt|package)$/ { print; next }
         $1 == "source" { print $1, $2, $3 }' "$1"
}

make_root() {
    manifest=$1
    # The tools that make the root now, whoever wrote MANIFEST (a release made by older ones).
    grep -v -E '^(mmdebstrap|recipe|tar) ' "$manifest" >"$manifest.new" || true
    echo "mmdebstrap $(mmdebstrap --version | awk '{ print $2 }')" >>"$manifest.new"
    echo "recipe $(sha256sum "$HERE/buildroot.sh" | cut -d' ' -f1)" >>"$manifest.new"
    mv -f "$manifest.new" "$manifest"
    grep -q '^source .* '$RELEASE'-security ' "$manifest" || die "$manifest names no $RELEASE-security source"
    key=$(identity "$manifest" | sha256sum | cut -d' ' -f1)
    entry=$CACHE/$key
    if [ -z "${BUILDROOT_FRESH:-}" ] && [ -f "$entry/root.tar.sha256" ]; then
        if (cd "$entry" && sha256sum --quiet -c root.tar.sha256); then
            say "cached build root $entry"
            touch "$entry"  # in use: kept by the pruning below
            echo "tar $(cut -d' ' -f1 "$entry/root.tar.sha256")" >>"$manifest"
            echo "$entry/root.tar"
            return
        fi
        say "the cached root in $entry does not match its sha256; making it again"
    fi

    mkdir -p "$entry"
    tmp=$(mktemp -d "$entry/new.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    pins=$(awk '$1 == "package" { printf "%s%s=%s", sep, $2, $3; sep = "," }' "$manifest")
    set --
    while read -r option; do [ -z "$option" ] || set -- "$@" --aptopt="$option"; done <<EOF
$(sed -n 's/^aptopt //p' "$manifest")
EOF
    # Each .deb by its version and sha256, then a repository of exactly those for mmdebstrap.
    python3 "$HERE/debs.py" fetch "$manifest" "$CACHE/debs" --mirror "$(main_mirror)" \
        --security-mirror "$(security_mirror)" ${DEBIAN_SNAPSHOT:+--snapshot "$DEBIAN_SNAPSHOT"} \
        ${DEBS_DIR:+--debs-dir "$DEBS_DIR"} || die "a .deb of the manifest is missing (above)"
    python3 "$HERE/debs.py" repo "$manifest" "$CACHE/debs" "$tmp/repo"
    echo "deb [trusted=yes] copy:$tmp/repo ./" >"$tmp/sources.list"
    # The root names the suites its packages were listed from, not the local repository, in
    # the file mmdebstrap writes for a sources file named sources.list.
    root_sources "$manifest" >"$tmp/root-sources.list"
    say "making a build root with mmdebstrap (about a minute)"
    BUILDROOT_INSTALLED=$tmp/installed BUILDROOT_SOURCES=$tmp/root-sources.list SOURCE_DATE_EPOCH=$ROOT_EPOCH mmdebstrap \
        --variant=custom --architectures=$ARCH --include="$pins" --aptopt='Acquire::Languages "none"' "$@" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --customize-hook='chroot "$1" dpkg-query -W -f "\${Package} \${Version} \${Architecture}\n" >"$BUILDROOT_INSTALLED"' \
        --customize-hook='cat "$BUILDROOT_SOURCES" >"$1/etc/apt/sources.list.d/0000sources.list"' \
        $RELEASE "$tmp/root.tar" "$tmp/sources.list" >&2 || die "mmdebstrap failed"
    # The root holds exactly the pinned packages: a package mmdebstrap added or left out is named.
    awk '$1 == "package" { print $2, $3, $4 }' "$manifest" | sort >"$tmp/pinned"
    sort "$tmp/installed" | diff "$tmp/pinned" - >&2 || die "the root's packages (>) are not the pinned ones (<)"
    (cd "$tmp" && sha256sum root.tar) >"$tmp/root.tar.sha256"
    mv -f "$tmp/root.tar" "$entry/root.tar"
    mv -f "$tmp/root.tar.sha256" "$entry/root.tar.sha256"  # last: its presence marks a complete entry
    identity "$manifest" >"$entry/manifest"
    say "build root cached in $entry"
    # Roots unused for 30 days (older package versions, mostly) are removed.
    find "$CACHE" -mindepth 1 -maxdepth 1 -type d ! -name "$key" ! -name debs -mtime +30 -exec rm -rf {} +
    find "$CACHE/debs" -name '*.deb' -mtime +30 -delete
    echo "tar $(cut -d' ' -f1 "$entry/root.tar.sha256")" >>"$manifest"
    echo "$entry/root.tar"
}

check_release() {
    now=$(mktemp "${TMPDIR:-/tmp}/tinygw-now.XXXXXX")
    (DEBIAN_SNAPSHOT='' resolve "$now") || { rm -f "$now"; exit 1; }
    status=0
    python3 "$HERE/debs.py" stale "$1" "$now" || status=$?
    rm -f "$now"
    return $status
}

case ${1:-}:${2:-} in
    resolve:?*) need_tools; resolve "$2" ;;
    make:?*) need_tools; make_root "$2" ;;
    check:?*) need_tools; check_release "$2" ;;
    *) echo "usage: buildroot.sh resolve|make MANIFEST, buildroot.sh check RELEASE_JSON" >&2; exit 2 ;;
esac
