#!/bin/sh
# mmdebstrap --customize-hook for images/build.sh: shrink an "essential"
# chroot down to what the image needs, and remove host-specific state.
#
#   IMAGE_KEEP="python3 dash" IMAGE_DROP="dpkg tar ..." trim.sh ROOT
#
# IMAGE_KEEP names the packages the image is for. Those, their Depends and
# Pre-Depends (transitively; see closure.awk), base-files, base-passwd,
# usr-is-merged and libc-bin (ldconfig, and the C.UTF-8 locale in
# /usr/lib/locale/C.utf8, which glibc does not build in) stay installed.
# Every other package is purged with the host's dpkg (--root), without
# running its prerm/postrm scripts: they would need tools that are being
# removed in the same run. Their few side effects are
# undone by hand below (dangling alternatives/rc.d links, /etc/shells, the
# debconf cache). IMAGE_DROP lists packages that are only needed to install
# packages (dpkg, debconf, ...); they are removed even if something depends on
# them, unless IMAGE_KEEP names them.
#
# It runs while mmdebstrap still has /proc, /sys and /dev/pts mounted in ROOT,
# so it never touches those; build.sh empties /dev afterwards.
set -eu

root=$1
here=$(cd "$(dirname "$0")" && pwd)
admin=$root/var/lib/dpkg

installed() { dpkg-query --admindir="$admin" -W -f '${db:Status-Abbrev} ${Package}\n' | awk '$1 == "ii" { print $2 }' | sort -u; }

keep=$(awk -v KEEP="${IMAGE_KEEP:?} base-files base-passwd usr-is-merged libc-bin" \
    -v DROP="${IMAGE_DROP:-}" -f "$here/closure.awk" "$admin/status" | sort -u)
remove=$(installed | grep -vxF "$keep" || true)

echo "trim: keeping: $(echo "$keep" | tr '\n' ' ')" >&2
echo "trim: purging: $(echo "$remove" | tr '\n' ' ')" >&2

purge() {
    [ $# -gt 0 ] || return 0
    for p in "$@"; do
        rm -f "$admin/info/$p.prerm" "$admin/info/$p.postrm" \
              "$admin/info/$p:"*.prerm "$admin/info/$p:"*.postrm
    done
    dpkg --root="$root" --log=/dev/null --purge --force-depends \
        --force-remove-essential --force-remove-protected "$@" \
        2>&1 | grep -vE '^(Removing|Purging configuration files for) |^\(Reading database|overriding problem because --force|essential package; it should not|protected package; it should not|not empty so not removed|dependency problems, but removing anyway|^ .* depends on |^  (Package )?.* is (to be removed|not installed)|^$' >&2 || true
}

# shellcheck disable=SC2086
purge $remove
# ld.so.cache without the purged libraries, from the image's own ldconfig.
chroot "$root" /sbin/ldconfig
if installed | grep -qvxF "$keep"; then echo "trim: purge left packages behind" >&2; exit 1; fi

# Does absolute path $1 exist inside $root, following symlinks inside $root?
exists_in_root() {
    p=$1 n=0
    while [ $n -lt 40 ]; do
        n=$((n + 1))
        if [ -L "$root$p" ]; then
            t=$(readlink "$root$p")
            case $t in /*) p=$t ;; *) p=${p%/*}/$t ;; esac
            continue
        fi
        [ -e "$root$p" ]
        return
    done
    return 1
}

# /etc/shells: only shells that still exist. root's shell: /bin/sh if bash left.
if [ -f "$root/etc/shells" ]; then
    while read -r line; do
        case $line in /*) exists_in_root "$line" || continue ;; esac
        printf '%s\n' "$line"
    done < "$root/etc/shells" > "$root/etc/shells.new"
    cat "$root/etc/shells.new" > "$root/etc/shells" && rm -f "$root/etc/shells.new"
fi
exists_in_root /bin/bash || sed -i 's#^\(root:[^:]*:0:0:[^:]*:[^:]*:\)/bin/bash$#\1/bin/sh#' "$root/etc/passwd"

# Leftovers of purged tools (their directories held non-package files).
is_installed() { installed | grep -qx "$1"; }
is_installed debconf || rm -rf "$root/var/cache/debconf"
# (/etc/alternatives stays: e.g. /usr/bin/js -> /etc/alternatives/js -> nodejs)
is_installed dpkg || rm -rf "$root/etc/dpkg" "$root/var/lib/dpkg/lock" \
    "$root/var/lib/dpkg/lock-frontend" "$root/var/lib/dpkg/triggers/Lock"
is_installed libpam-runtime || rm -rf "$root/etc/pam.d" "$root/etc/security"
is_installed init-system-helpers ||
    rm -rf "$root/etc/systemd" "$root/var/lib/systemd" "$root/usr/lib/systemd" \
        "$root"/etc/rc?.d "$root/etc/init.d"
# Build-time metadata of the dpkg database (shlibs/symbols are for
# dpkg-shlibdeps); status, *.list and *.md5sums stay for inventory tools.
rm -f "$root"/var/lib/dpkg/info/*.symbols "$root"/var/lib/dpkg/info/*.shlibs \
    "$root"/var/lib/dpkg/info/*.triggers

# Host-specific and non-reproducible state. (mmdebstrap's own cleanup also
# empties /tmp and /run, removes dpkg/apt logs and ldconfig's aux-cache and
# truncates /etc/machine-id, after this hook.)
rm -f "$root/etc/resolv.conf" "$root/etc/hostname" "$root/etc/machine-id" \
    "$root/var/lib/dbus/machine-id" "$root"/var/lib/dpkg/*-old \
    "$root"/var/cache/debconf/*-old
rm -rf "$root/var/cache/ldconfig"
find "$root/var/log" -type f -delete
# Backups and lock of the user database (adduser/useradd in postinsts).
rm -f "$root/etc/passwd-" "$root/etc/group-" "$root/etc/shadow-" \
    "$root/etc/gshadow-" "$root/etc/subuid-" "$root/etc/subgid-" "$root/etc/.pwd.lock"

# Dangling symlinks left by skipped prerm/postrm scripts (update-alternatives,
# update-rc.d): /usr/bin/awk -> /etc/alternatives/awk -> /usr/bin/mawk, ...
find "$root" -xdev \( -path "$root/proc" -o -path "$root/sys" -o -path "$root/dev" \) -prune \
    -o -type l -print | while read -r link; do
    exists_in_root "${link#"$root"}" || { echo "trim: removing dangling ${link#"$root"}" >&2; rm -f "$link"; }
done
if [ -d "$admin/alternatives" ]; then
    for a in "$admin/alternatives"/*; do
        [ -e "$a" ] || continue
        [ -L "$root/etc/alternatives/${a##*/}" ] || rm -f "$a"
    done
fi

# Mount points the sandbox runtime uses, and a world-writable /tmp.
mkdir -p "$root/workspace" "$root/sandbox" "$root/tmp" "$root/proc" "$root/dev"
chmod 0755 "$root/workspace" "$root/sandbox"
chmod 1777 "$root/tmp"
# The sandbox sees every file as owned by nobody, so a 0700 /root would be
# unusable even for the container's root.
chmod 0755 "$root/root"
# busybox (the shell image) brings grep, sed, awk, find and the other POSIX tools coreutils lacks; Debian installs
# none of its applet links. Link the applets that nothing else provides.
if [ -x "$root/usr/bin/busybox" ]; then
    for a in $(chroot "$root" /usr/bin/busybox --list); do
        case $a in */* | "" | .*) continue ;; esac
        [ -e "$root/usr/bin/$a" ] || [ -e "$root/usr/sbin/$a" ] || [ -L "$root/usr/bin/$a" ] ||
            ln -s busybox "$root/usr/bin/$a"
    done
fi

# The runtime drops setuid/setgid bits anyway; drop them here so the tarball
# says what the container gets.
find "$root" -xdev \( -path "$root/proc" -o -path "$root/sys" -o -path "$root/dev" \) -prune \
    -o -perm /6000 \( -type f -o -type d \) -exec chmod ug-s {} +
