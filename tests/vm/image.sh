#!/usr/bin/env bash
# Builds (or finds in the cache) a Debian guest for tests/vm/run.sh and prints its directory, which holds
# `disk.raw` (ext4 root, booted read-only-by-snapshot), `vmlinuz` and `initrd.img`.
#
#   tests/vm/image.sh SUITE        SUITE: trixie (6.12, the main guest) or bookworm (6.1, the older kernel)
#
# The root is made by mmdebstrap from Debian's archive; the cache (SANDBOXD_VM_CACHE, default
# /var/cache/sandboxd-vm) is keyed by a hash of this file, so a change to the package list or the guest's units
# builds a new image. The guest runs one unit of its own, `vm-job.service`: it mounts the host's job directory
# (9p tag `job`) at /job, runs /job/guest.sh and powers off; everything else comes from the job directory.
set -euo pipefail
suite=${1:?usage: image.sh trixie|bookworm}
cache=${SANDBOXD_VM_CACHE:-/var/cache/sandboxd-vm}
packages=linux-image-amd64,initramfs-tools,systemd,systemd-sysv,udev,dbus,kmod,procps,iproute2,e2fsprogs,python3,nodejs,busybox-static
here=$(cd "$(dirname "$0")" && pwd)
key=$( (cat "$here/image.sh" "$here/vm-job.service"; echo "$suite") | sha256sum | cut -c1-16)
out="$cache/$suite-$key"
if [ -f "$out/done" ]; then
  echo "$out"
  exit 0
fi
for tool in mmdebstrap mkfs.ext4; do
  command -v "$tool" >/dev/null || { echo "image.sh: $tool is missing (apt-get install mmdebstrap e2fsprogs)" >&2; exit 1; }
done
mkdir -p "$cache"
rm -rf "$out"
tmp=$(mktemp -d "$cache/.build-$suite.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"
case "$suite" in
  trixie) mirrors=("deb http://deb.debian.org/debian trixie main" "deb http://deb.debian.org/debian-security trixie-security main") ;;
  bookworm) mirrors=("deb http://deb.debian.org/debian bookworm main" "deb http://deb.debian.org/debian-security bookworm-security main") ;;
  *) echo "image.sh: unknown suite $suite" >&2; exit 1 ;;
esac
# The initramfs needs virtio and ext4 (MODULES=most has them); the hooks write the guest's few files.
mmdebstrap --mode=root --variant=apt --include="$packages" \
  --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d"; echo MODULES=most > "$1/etc/initramfs-tools/conf.d/modules"' \
  --customize-hook='echo sandboxd-vm > "$1/etc/hostname"' \
  --customize-hook='echo "/dev/vda / ext4 rw,errors=remount-ro 0 1" > "$1/etc/fstab"' \
  --customize-hook="copy-in $here/vm-job.service /etc/systemd/system" \
  --customize-hook='chroot "$1" systemctl enable vm-job.service' \
  --customize-hook='chroot "$1" systemctl mask getty@tty1.service serial-getty@ttyS0.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer' \
  "$suite" "$root" "${mirrors[@]}" >"$tmp/mmdebstrap.log" 2>&1 || { tail -n 40 "$tmp/mmdebstrap.log" >&2; exit 1; }
mkdir -p "$tmp/out"
cp "$root"/boot/vmlinuz-* "$tmp/out/vmlinuz"
cp "$root"/boot/initrd.img-* "$tmp/out/initrd.img"
ls "$root/lib/modules" >"$tmp/out/kernel"
truncate -s 8G "$tmp/out/disk.raw"
mkfs.ext4 -q -F -L root -d "$root" "$tmp/out/disk.raw"
touch "$tmp/out/done"
mv "$tmp/out" "$out"
echo "$out"
