#!/bin/bash
# Runs inside the guest (vm-job.service starts it from the host's job directory, /job, and powers off after).
# /job/env says which boot this is (MODE) and where the host's test binary expects sandboxd (SANDBOXD_PATH).
# Each step's output goes to /job/results/STEP.log, its exit code to STEP.rc; tests/vm/run.sh judges them.
set -u
# shellcheck source=/dev/null
. /job/env
out=/job/results
mkdir -p "$out"
exec >>"$out/guest.log" 2>&1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin CI=1
port=7070
token="vm-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export SANDBOXD_URL="ws://127.0.0.1:$port/ws" SANDBOXD_TOKEN="$token"

# step NAME COMMAND...: runs COMMAND with its output in NAME.log and its exit code in NAME.rc.
step() {
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$rc" >"$out/$name.rc"
  echo "$name: exit $rc, $(($(date +%s) - t0)) s"
  return 0
}

# expect_failure NAME COMMAND...: like step, but the command must fail (exit 0 is recorded as 1).
expect_failure() {
  local name=$1
  shift
  if "$@" >"$out/$name.log" 2>&1; then echo 1 >"$out/$name.rc"; else echo 0 >"$out/$name.rc"; fi
  echo "$name (must fail): recorded $(cat "$out/$name.rc")"
}

# The host as the daemon sees it.
{
  uname -r
  cat /proc/cmdline
  findmnt -n -o FSTYPE,OPTIONS /sys/fs/cgroup
  echo "controllers: $(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null)"
  echo "lsm: $(cat /sys/kernel/security/lsm 2>/dev/null)"
  systemctl --version | head -1
} >"$out/host.txt" 2>&1
cat "$out/host.txt"

# sandboxd as a packager installs it: the binary in /usr/local/bin, the project's own unit, a config in /etc.
install -m 755 /job/bin/sandboxd /usr/local/bin/sandboxd
install -m 755 /job/bin/sandboxctl /usr/local/bin/sandboxctl
install -m 644 /job/sandboxd.service /etc/systemd/system/sandboxd.service
mkdir -p /etc/sandboxd
write_config() {
  cat >/etc/sandboxd/config.yaml <<CONF
listen: 127.0.0.1:$port
auth:
  tokens: ["$token"]
capacity:
  max_concurrent: 4
  max_queue: 4
shutdown_grace_ms: 2000
$1
CONF
}
write_config ""
systemctl daemon-reload
# The integration tests run the binary cargo built them against, at the host's path.
mkdir -p "$(dirname "$SANDBOXD_PATH")"
ln -sf /job/bin/sandboxd "$SANDBOXD_PATH"

# unit_checks: the unit-started daemon's cgroup, capabilities, ping and health.
unit_checks() {
  systemctl show -p ControlGroup -p Delegate -p ActiveState sandboxd
  grep -E '^(Cap(Prm|Eff|Bnd)|NoNewPrivs|Seccomp):' "/proc/$(systemctl show -p MainPID --value sandboxd)/status"
  echo "cgroup.procs of the parent: $(cat /sys/fs/cgroup/sandboxd/cgroup.procs 2>&1 | wc -l)"
  echo "subtree_control of the parent: $(cat /sys/fs/cgroup/sandboxd/cgroup.subtree_control 2>&1)"
  sandboxctl ping --json && sandboxctl health
}

# delegated COMMAND...: runs COMMAND as a transient unit with Delegate=yes, as the daemons the tests start would
# run in production (systemd enables the controllers down to it); its exit code is the command's.
delegated() {
  systemd-run --quiet --wait --pipe --collect -p Delegate=yes -E CI=1 -E "PATH=$PATH" "$@"
}

# hardening_diagnosis: when the unit fails, what it fails by. The daemon's credentials under the unit as shipped
# (capability sets, no_new_privs, seccomp), then copies of the unit each without one setting: a copy that starts
# names a setting the failure needs (a failure that needs several together names each of them).
hardening_diagnosis() {
  local key pid=0
  systemctl stop sandboxd
  for key in "" User CapabilityBoundingSet NoNewPrivileges ProtectSystem PrivateTmp ProtectHome ProtectKernelModules \
    Delegate; do
    # Continuation lines joined; not restarted on failure.
    sed -e ':a' -e '/\\$/N; s/\\\n//; ta' /etc/systemd/system/sandboxd.service |
      grep -v -e "^${key:-#}=" -e '^Restart' >/etc/systemd/system/sandboxd-diag.service
    systemctl daemon-reload
    systemctl start --no-block sandboxd-diag
    if [ -z "$key" ]; then
      for _ in $(seq 100); do
        pid=$(systemctl show -p MainPID --value sandboxd-diag)
        [ "${pid:-0}" -gt 0 ] && break
        sleep 0.1
      done
      echo "the daemon under the unit as shipped:"
      grep -E '^(Uid|Cap|NoNewPrivs|Seccomp)' "/proc/$pid/status"
    fi
    while [ "$(systemctl show -p ActiveState --value sandboxd-diag)" = activating ]; do sleep 0.5; done
    echo "without ${key:-nothing}: $(systemctl is-active sandboxd-diag)" "$(journalctl --no-pager -o cat \
      _SYSTEMD_INVOCATION_ID="$(systemctl show -p InvocationID --value sandboxd-diag)" |
      grep -m1 -E 'ERROR|sandboxd:' | cut -c1-240)"
    systemctl stop sandboxd-diag
    systemctl reset-failed sandboxd-diag 2>/dev/null
  done
  rm /etc/systemd/system/sandboxd-diag.service
  systemctl daemon-reload
}

conformance() {
  FSP_TOKEN="$token" /job/bin/fsp-conformance run --endpoint "ws://127.0.0.1:$port/ws" \
    --junit "$out/conformance-$1.junit.xml" --json "$out/conformance-$1"
}

# journal_has NAME WORDS...: the unit's journal names every word.
journal_has() {
  local name=$1 w
  shift
  journalctl -u sandboxd --no-pager -o cat >"$out/$name.journal" 2>&1
  for w in "$@"; do
    grep -qF -- "$w" "$out/$name.journal" || { echo "the journal does not say \"$w\""; cat "$out/$name.journal"; return 1; }
  done
  echo "the journal says: $*"
  grep -F -- "$1" "$out/$name.journal" | head -3
}

case "$MODE" in
  v2)
    step doctor delegated sandboxd --config /etc/sandboxd/config.yaml doctor
    step unit-start systemctl start sandboxd
    step unit-checks unit_checks
    systemctl status sandboxd --no-pager >"$out/unit-status.txt" 2>&1
    systemctl is-active -q sandboxd || hardening_diagnosis >"$out/hardening-diagnosis.txt" 2>&1
    step conformance conformance unit
    step unit-stop systemctl stop sandboxd
    # The daemon removes its parent on a clean stop.
    step unit-parent-removed test ! -e /sys/fs/cgroup/sandboxd
    journalctl -u sandboxd --no-pager >"$out/sandboxd.journal" 2>&1
    # shellcheck disable=SC2086 # the filters are words
    # Under TCG (emulated, several times slower) one test at a time, so each daemon is ready within its deadline.
    threads=2
    [ "$(systemd-detect-virt)" = qemu ] && threads=1
    step integration delegated /job/bin/integration --test-threads=$threads $INTEGRATION_FILTERS
    step runtime-cgroups delegated /job/bin/runtime-lib cgroups::
    ;;
  no-landlock)
    expect_failure doctor sandboxd --config /etc/sandboxd/config.yaml doctor
    expect_failure unit-start systemctl start sandboxd
    step unit-refusal journal_has unit-refusal "landlock ABI 0 found" "sandbox.landlock_min_abi requires" "lsm="
    ;;
  old-kernel)
    expect_failure doctor-default delegated sandboxd --config /etc/sandboxd/config.yaml doctor
    expect_failure unit-start-default systemctl start sandboxd
    step unit-refusal journal_has unit-refusal "landlock ABI 2 found" "sandbox.landlock_min_abi requires 3" \
      "landlock_min_abi: 2"
    systemctl reset-failed sandboxd
    write_config "sandbox:
  landlock_min_abi: 2"
    step doctor delegated sandboxd --config /etc/sandboxd/config.yaml doctor
    step unit-start systemctl start sandboxd
    step unit-checks unit_checks
    systemctl is-active -q sandboxd || hardening_diagnosis >"$out/hardening-diagnosis.txt" 2>&1
    step weaker-layer-reported sh -c 'sandboxctl ping --json | grep -q "\"landlock_abi\": *2" &&
      sandboxctl health | grep -q "\"landlock_abi\": *2"'
    step conformance conformance unit
    step unit-stop systemctl stop sandboxd
    step runtime-cgroups delegated /job/bin/runtime-lib cgroups::
    ;;
  *) echo "unknown MODE $MODE" ;;
esac
journalctl -b --no-pager >"$out/journal.txt" 2>&1
echo done >"$out/done"
sync
# At once: the unit's SuccessAction leaves the guest hanging in its shutdown on some boots.
systemctl poweroff --force --force
