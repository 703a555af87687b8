#!/usr/bin/env bash
# Runs a command inside an emulation of systemd/sandboxd.service's sandbox, for hosts (and CI) where systemd is not
# pid 1. .ci/run starts sandboxd this way and runs the conformance suite against it, so a hardening directive that
# breaks containers fails CI. Emulated, as systemd sets them up:
#   ProtectSystem=strict + StateDirectory=   every mount read-only but /proc, /sys, /dev and STATE_DIR
#   ProtectHome=yes                          /root, /home, /run/user empty and inaccessible
#   PrivateTmp=yes                           fresh /tmp and /var/tmp
#   ProtectKernelModules=yes                 /usr/lib/modules inaccessible (the CAP_SYS_MODULE drop is below)
#   NoNewPrivileges=yes, CapabilityBoundingSet=~...   setpriv, with the list read from the unit
# Not emulated: the seccomp filters systemd adds for some of these (the unit sets none that matter to containers).
#
# usage: unshare -m systemd/emulate-unit.sh STATE_DIR -- COMMAND [ARGS...]
# (must run in a fresh mount namespace: it remounts everything read-only.)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
unit="$here/sandboxd.service"
state=${1:?usage: emulate-unit.sh STATE_DIR -- COMMAND...}
shift
[ "${1:-}" = -- ] && shift
[ $# -gt 0 ] || { echo "emulate-unit: no command" >&2; exit 2; }
case "$state" in /tmp/*|/var/tmp/*|/root/*|/home/*) echo "emulate-unit: $state would be hidden (PrivateTmp, ProtectHome)" >&2; exit 2 ;; esac

# The directives emulated here must be the unit's: fail if the unit changed without this script.
for d in ProtectSystem=strict ProtectHome=yes PrivateTmp=yes ProtectKernelModules=yes NoNewPrivileges=yes; do
  grep -qx "$d" "$unit" || { echo "emulate-unit: $unit no longer says $d; update this script" >&2; exit 2; }
done
# CapabilityBoundingSet=~CAP_A CAP_B \ (continued lines) -> -cap_a,-cap_b
caps=$(sed -n '/^CapabilityBoundingSet=~/,/[^\\]$/p' "$unit" | sed 's/^CapabilityBoundingSet=~//; s/\\$//' \
  | tr -s ' \n' '\n' | grep '^CAP_' | tr 'A-Z' 'a-z' | sed 's/^cap_/-/' | paste -sd, -)
[ -n "$caps" ] || { echo "emulate-unit: no CapabilityBoundingSet=~ in $unit" >&2; exit 2; }

if [ "$(readlink /proc/self/ns/mnt)" = "$(readlink /proc/1/ns/mnt)" ]; then
  echo "emulate-unit: run me in a new mount namespace (unshare -m)" >&2
  exit 2
fi
mount --make-rslave /
mkdir -p "$state"
mount --bind "$state" "$state"
awk '{print $5}' /proc/self/mountinfo | sort -u | while read -r mp; do
  case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue ;; esac
  [ "$mp" = "$state" ] && continue
  mount -o remount,bind,ro "$mp" 2>/dev/null || mount -o remount,ro "$mp" 2>/dev/null \
    || { echo "emulate-unit: cannot make $mp read-only" >&2; exit 1; }
done
for d in /root /home /run/user; do
  if [ -d "$d" ]; then mount -t tmpfs -o ro,mode=000 tmpfs "$d"; fi
done
for d in /tmp /var/tmp; do
  mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$d"
done
if [ -d /usr/lib/modules ]; then mount -t tmpfs -o ro,mode=000 tmpfs /usr/lib/modules; fi
if touch /usr/.emulate-unit-check 2>/dev/null; then
  echo "emulate-unit: /usr is still writable" >&2
  exit 1
fi
exec setpriv --no-new-privs --bounding-set "$caps" -- "$@"
