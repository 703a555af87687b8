#!/usr/bin/env bash
# Build the sandboxd language images: minimal Debian bookworm root
# filesystems as reproducible tarballs, then OCI layouts.
#
# Usage (as root, from anywhere):
#   images/build.sh [--tar-only] [--check] NAME...
#   NAME: shell | python | javascript | elixir | python-data | code-interpreter | all
#
#   --tar-only  stop after images/out/NAME/rootfs.tar (skip the OCI packing)
#   --check     run the image's programs in a chroot (inside a user namespace
#               where every file is owned by nobody, as in the sandbox)
#               before packing
#
# For each NAME this writes
#   images/out/NAME/rootfs.tar     uncompressed tar, ./-relative, numeric owners
#   images/out/NAME/packages.txt   installed packages and versions
#   images/out/NAME/oci/           OCI layout, via `sandboxd images pack`
#
# Environment:
#   SOURCE_DATE_EPOCH  timestamp for the build (default below); same value +
#                      same mirror state => byte-identical rootfs.tar
#   SANDBOXD           sandboxd binary (default: target/release/sandboxd)
#   DEBIAN_MIRROR      default http://deb.debian.org/debian
#   DEBIAN_SECURITY    default http://deb.debian.org/debian-security
#                      (set to "none" to build from the main archive only)
#   TMPDIR             where the chroot is built (needs ~1 GB for elixir)
#
# Packages per image: images/packages/NAME. How they are slimmed:
# images/hooks/ (dpkg-excludes, trim.sh, closure.awk). See images/README.md.
set -euo pipefail

SUITE=bookworm
: "${SOURCE_DATE_EPOCH:=1735689600}" # 2025-01-01T00:00:00Z
export SOURCE_DATE_EPOCH
: "${DEBIAN_MIRROR:=http://deb.debian.org/debian}"
: "${DEBIAN_SECURITY:=http://deb.debian.org/debian-security}"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
out_base=$here/out
sandboxd=${SANDBOXD:-$repo/target/release/sandboxd}
ALL=(shell python javascript elixir)

# Packages that only serve to install packages. trim.sh removes them even
# when a kept package depends on them (dash -> dpkg, debianutils;
# base-files -> awk; erlang-base -> adduser -> passwd), unless
# packages/NAME lists them.
DROP="dpkg tar debianutils debconf libdebconfclient0 perl-base mawk
      init-system-helpers usrmerge sensible-utils adduser passwd"

usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }
log() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] error: %s\n' "$*" >&2; exit 1; }

tar_only=0 check=0 names=()
for arg in "$@"; do
    case $arg in
    --tar-only) tar_only=1 ;;
    --check) check=1 ;;
    -h | --help) usage; exit 0 ;;
    all) names+=("${ALL[@]}") ;;
    shell | python | javascript | elixir | python-data | code-interpreter) names+=("$arg") ;;
    *) usage >&2; die "unknown argument: $arg" ;;
    esac
done
[ ${#names[@]} -gt 0 ] || { usage >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap --mode=root; try sudo)"

ensure_tools() {
    local missing=()
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    [ -e /usr/share/keyrings/debian-archive-keyring.gpg ] || missing+=(debian-archive-keyring)
    [ ${#missing[@]} -eq 0 ] && return
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Programs run by --check, as: env -i PATH=... HOME=/tmp LANG=C.UTF-8 chroot ROOT /bin/sh -c "$test"
# shellcheck disable=SC2016 # expanded inside the image, not here
check_script() {
    case $1 in
    shell) echo 'echo hi && busybox true && ls / >/dev/null && test "$(echo x | busybox sed s/x/y/)" = y && [ "$(id -u)" = 0 ]' ;;
    python) echo '/usr/bin/python3 -c "import locale; locale.setlocale(locale.LC_ALL, \"\"); import json, sqlite3, ssl, zlib, lzma, bz2, ctypes, decimal, hashlib, zoneinfo, subprocess; assert subprocess.run([\"/bin/sh\", \"-c\", \"exit 3\"]).returncode == 3; print(json.dumps({\"ok\": 1}))"' ;;
    python-data) echo '/usr/bin/python3 -c "import numpy, pandas; print(pandas.DataFrame({\"a\": numpy.arange(4)}).describe().loc[\"mean\", \"a\"])"' ;;
    code-interpreter) echo 'MPLBACKEND=Agg /usr/bin/python3 -c "import numpy, pandas, matplotlib.pyplot as plt; plt.plot([1, 2]); plt.savefig(\"/tmp/p.png\"); print(pandas.DataFrame({\"a\": [1]}).to_html()[:6])" && /usr/bin/node -e "console.log(1)" && /bin/bash -c "echo ok"' ;;
    javascript) echo '/usr/bin/node -e "const c = require(\"crypto\"); console.log(c.createHash(\"sha256\").update(\"x\").digest(\"hex\").length, new Intl.NumberFormat(\"de-DE\").format(1234.5), require(\"child_process\").execSync(\"echo ok\").toString().trim())"' ;;
    elixir) echo '/usr/bin/elixir -e "IO.puts(Enum.sum(1..10)); IO.puts(:crypto.hash(:sha256, \"x\") |> Base.encode16() |> String.length())"' ;;
    esac
}

cmd_for() {
    case $1 in
    shell) echo /bin/sh ;;
    python | python-data | code-interpreter) echo /usr/bin/python3 ;;
    javascript) echo /usr/bin/node ;;
    elixir) echo /usr/bin/elixir ;;
    esac
}

# Run the check inside a user namespace whose root is host uid 100000, so
# every file of the image appears owned by nobody (as under sandboxd), with
# /dev bound, /proc and a tmpfs /tmp mounted, and no network.
run_check() {
    local name=$1 root=$2
    log "$name: checking"
    # shellcheck disable=SC2016 # expanded by the inner sh
    setpriv --reuid=100000 --regid=100000 --clear-groups -- \
        unshare --map-root-user --mount --pid --net --ipc --uts --fork -- /bin/sh -euc '
        root=$1; shift
        mount --rbind /dev "$root/dev"
        mount -t proc proc "$root/proc"
        mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
        exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            HOME=/tmp LANG=C.UTF-8 /usr/sbin/chroot "$root" /bin/sh -c "$1"
    ' sh "$root" "$(check_script "$name")"
}

build_one() {
    local name=$1 list=$here/packages/$1 out=$out_base/$1 work root
    local -a include
    mapfile -t include < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$list" | tr -d ' \t')
    work=$(mktemp -d "${TMPDIR:-/tmp}/sandboxd-image-$name.XXXXXX")
    chmod 0755 "$work" # --check enters it as an unprivileged uid
    # shellcheck disable=SC2064
    trap "rm -rf --one-file-system '$work'" EXIT
    root=$work/root

    local -a mirrors=("deb $DEBIAN_MIRROR $SUITE main" "deb $DEBIAN_MIRROR $SUITE-updates main")
    [ "$DEBIAN_SECURITY" = none ] || mirrors+=("deb $DEBIAN_SECURITY $SUITE-security main")

    log "$name: mmdebstrap $SUITE (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH): ${include[*]}"
    local start=$SECONDS
    IMAGE_KEEP="${include[*]}" IMAGE_DROP="$DROP" \
        mmdebstrap --mode=root --format=directory --variant=essential \
        --include="$(IFS=,; echo "${include[*]}")" \
        --dpkgopt="$here/hooks/dpkg-excludes" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --customize-hook="$here/hooks/trim.sh" \
        "$SUITE" "$root" "${mirrors[@]}"

    # mmdebstrap has unmounted everything: now /dev can be emptied (the
    # importer refuses device nodes; the runtime mounts its own /dev), and
    # apt's directories go (the images have no apt; mmdebstrap needed them
    # until its cleanup step).
    find "$root/dev" -mindepth 1 -delete
    dpkg-query --admindir="$root/var/lib/dpkg" -W apt >/dev/null 2>&1 ||
        rm -rf "$root/etc/apt" "$root/var/lib/apt" "$root/var/cache/apt" "$root/var/log/apt"
    local special
    special=$(find "$root" \( -type b -o -type c -o -type p -o -type s \) -printf '/%P\n')
    [ -z "$special" ] || die "$name: special files left: $special"

    grep -q '^root:[^:]*:0:0:' "$root/etc/passwd" ||
        die "$name: no root in /etc/passwd"
    [ -x "$root$(cmd_for "$name")" ] || die "$name: $(cmd_for "$name") missing"
    [ $check = 0 ] || run_check "$name" "$root"

    mkdir -p "$out"
    dpkg-query --admindir="$root/var/lib/dpkg" -W -f '${Package} ${Version}\n' > "$out/packages.txt"
    # The same tar options mmdebstrap uses for its own tarballs (without
    # xattrs): sorted, mtimes clamped to SOURCE_DATE_EPOCH, numeric owners.
    tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime --numeric-owner \
        --one-file-system --format=pax \
        --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
        -C "$root" -cf "$out/rootfs.tar.tmp" .
    mv "$out/rootfs.tar.tmp" "$out/rootfs.tar"
    rm -rf --one-file-system "$work"
    trap - EXIT
    log "$name: $out/rootfs.tar: $(du -m "$out/rootfs.tar" | cut -f1) MB," \
        "$(wc -l < "$out/packages.txt") packages, $((SECONDS - start)) s," \
        "sha256 $(sha256sum "$out/rootfs.tar" | cut -c1-16)"
}

pack_one() {
    local name=$1 out=$out_base/$1
    rm -rf "$out/oci"
    log "$name: packing $out/oci"
    "$sandboxd" images pack --rootfs "$out/rootfs.tar" --out "$out/oci" \
        --compression zstd --cmd "$(cmd_for "$name")"
}

ensure_tools
for name in "${names[@]}"; do
    build_one "$name"
done
[ $tar_only = 0 ] || exit 0

# Packing is the last step, so the tarballs exist even without sandboxd.
if [ ! -x "$sandboxd" ] || ! "$sandboxd" images pack --help >/dev/null 2>&1; then
    die "build sandboxd first: cargo build --release -p sandboxd (no usable $sandboxd; set SANDBOXD to override). The rootfs tarballs are in $out_base/"
fi
for name in "${names[@]}"; do
    pack_one "$name"
done
