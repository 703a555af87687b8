#!/usr/bin/env bash
# Whether CRIU can capture an agent sandbox's process memory while keeping it confined, as a script that
# can be run again on another kernel or CRIU: not part of CI (it downloads a Debian root, about 30 s).
#
# 1. `criu check` with the host's Debian package (bookworm's CRIU 3.17.1, if installed).
# 2. In a Debian trixie root (CRIU 4.x; mmdebstrap, in a mount namespace of its own with pivot_root), a process
#    confined by Landlock (landlock.c) is dumped and restored: once with a domain that does not allow reading /proc
#    (the dump fails: CRIU's parasite runs inside the target, under its domain), once with /proc allowed (the dump
#    and restore succeed, and the restored process reads a file its domain forbade: the Landlock domain is lost).
#
# Prints the verdict of each; exits 0 when the run itself worked (whatever the verdicts). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${CRIU_EVAL_DIR:-/var/tmp/sandboxd-criu-eval}
mkdir -p "$work"

echo "== host: $(uname -r)"
if command -v criu >/dev/null 2>&1; then
  echo "== host criu: $(criu --version | head -1)"
  criu check 2>&1 | tail -2 || true
else
  echo "== host criu: not installed (apt-get install criu)"
fi

if [ ! -x "$work/root/usr/sbin/criu" ]; then
  rm -rf "$work/root"
  mmdebstrap --variant=minbase --include=criu,gcc,libc6-dev,linux-libc-dev trixie "$work/root" \
    "deb http://deb.debian.org/debian trixie main" >"$work/mmdebstrap.log" 2>&1
fi
cp "$here/landlock.c" "$work/root/tmp/landlock.c"
chroot "$work/root" gcc -O2 -o /tmp/landlock /tmp/landlock.c
echo "== trixie criu: $(chroot "$work/root" criu --version | head -1)"

# One experiment in a mount namespace whose root is the trixie root: the confined process started, dumped,
# restored, its lines before and after printed, then ended by its pid (the restored process keeps it).
experiment() { # LL_PROC value ("" or 1)
  unshare -m --propagation private sh -c '
    mount --rbind "$1/root" "$1/root"
    mount -t proc proc "$1/root/proc"
    mount -t tmpfs tmpfs "$1/root/dev"
    mknod -m 666 "$1/root/dev/null" c 1 3
    mknod -m 666 "$1/root/dev/urandom" c 1 9
    mount -t tmpfs tmpfs "$1/root/run"
    cd "$1/root"; mkdir -p .old; pivot_root . .old; umount -l /.old
    cd /tmp; rm -rf img out.log; mkdir img; : >empty
    LL_PROC=$2 setsid /tmp/landlock >out.log 2>&1 <empty &
    pid=$!
    sleep 2.5
    if criu dump -t "$pid" -D img -o dump.log; then
      echo "dump: ok"
      criu restore -D img -d -o restore.log && echo "restore: ok" || grep Error img/restore.log
      sleep 2.5
    else
      echo "dump: failed"; grep Error img/dump.log | sed "s/^/  /"
    fi
    echo "lines:"; sed "s/^/  /" out.log
    kill "$pid" 2>/dev/null || true
    if grep -q read-allowed out.log; then
      echo "verdict: the Landlock domain was lost (a forbidden read succeeded)"
    else
      echo "verdict: every read stayed forbidden"
    fi' sh "$work" "$1"
}
echo "== a domain without /proc"
experiment ""
echo "== a domain with /proc readable"
experiment 1
