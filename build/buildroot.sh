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
#                                          one, else one made now by mmdebstrap (then cached);
#                                          appends its sha256 to MANIFEST as "tar SHA256"
#
# Debian 12 "bookworm": its python3 is 3.11, the Python the locks are compiled for
# (cp311 wheels), and it gets security fixes (Debian LTS) until mid-2028.
# Inputs, from the environment:
#   DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR   default: the host's apt sources for bookworm and
#                                           bookworm-security, else deb.debian.org
#   DEBIAN_SNAPSHOT=20261130T084402Z        both from snapshot.debian.org as they were then
#                                           (an auditor's rebuild of an older release)
#   BUILDROOT_CACHE                         default /var/cache/tinygw-buildroot
#   BUILDROOT_FRESH=1                       make the root now even when one is cached
#                                           (`make reproduce`); it replaces the cached one
# The cache key is the sha256 of everything that decides the tarball's bytes: the package
# list, the options given to mmdebstrap, its version and this script. mmdebstrap makes
# the same tarball from the same packages (SOURCE_DATE_EPOCH is fixed), so a cached
# root is the root a fresh one would be; its sha256 is checked before each use.
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

sources() {
    if [ -n "${DEBIAN_SNAPSHOT:-}" ]; then
        main=http://snapshot.debian.org/archive/debian/$DEBIAN_SNAPSHOT
        security=http://snapshot.debian.org/archive/debian-security/$DEBIAN_SNAPSHOT
    else
        main=${DEBIAN_MIRROR:-$(host_mirror $RELEASE http://deb.debian.org/debian)}
        security=${DEBIAN_SECURITY_MIRROR:-$(host_mirror $RELEASE-security http://deb.debian.org/debian-security)}
    fi
    for line in "${main%/} $RELEASE" "${main%/} $RELEASE-updates" "${security%/} $RELEASE-security"; do
        echo "deb [arch=$ARCH signed-by=$KEYRING] $line main"
    done
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
        echo "mmdebstrap $(mmdebstrap --version | awk '{ print $2 }')"
        echo "recipe $(sha256sum "$HERE/buildroot.sh" | cut -d' ' -f1)"
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

# The lines of MANIFEST that decide the tarball's bytes (not when or where they were listed).
identity() { grep -E '^(release|include|mmdebstrap|recipe|aptopt|package) ' "$1"; }

make_root() {
    manifest=$1
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
    sources >"$tmp/sources.list"
    say "making a build root with mmdebstrap (about a minute)"
    BUILDROOT_INSTALLED=$tmp/installed SOURCE_DATE_EPOCH=$ROOT_EPOCH mmdebstrap \
        --variant=custom --architectures=$ARCH --include="$pins" --aptopt='Acquire::Languages "none"' "$@" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --customize-hook='chroot "$1" dpkg-query -W -f "\${Package} \${Version} \${Architecture}\n" >"$BUILDROOT_INSTALLED"' \
        $RELEASE "$tmp/root.tar" "$tmp/sources.list" >&2 || die "mmdebstrap failed (a pinned version gone from the mirror since the lists were fetched? run again)"
    # The root holds exactly the pinned packages: a package mmdebstrap added or left out is named.
    awk '$1 == "package" { print $2, $3, $4 }' "$manifest" | sort >"$tmp/pinned"
    sort "$tmp/installed" | diff "$tmp/pinned" - >&2 || die "the root's packages (>) are not the pinned ones (<)"
    (cd "$tmp" && sha256sum root.tar) >"$tmp/root.tar.sha256"
    mv -f "$tmp/root.tar" "$entry/root.tar"
    mv -f "$tmp/root.tar.sha256" "$entry/root.tar.sha256"  # last: its presence marks a complete entry
    identity "$manifest" >"$entry/manifest"
    say "build root cached in $entry"
    # Roots unused for 30 days (older package versions, mostly) are removed.
    find "$CACHE" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -mtime +30 -exec rm -rf {} +
    echo "tar $(cut -d' ' -f1 "$entry/root.tar.sha256")" >>"$manifest"
    echo "$entry/root.tar"
}

case ${1:-}:${2:-} in
    resolve:?*) need_tools; resolve "$2" ;;
    make:?*) need_tools; make_root "$2" ;;
    *) echo "usage: buildroot.sh resolve|make MANIFEST" >&2; exit 2 ;;
esac
