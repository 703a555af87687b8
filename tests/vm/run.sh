#!/usr/bin/env bash
# Boots a Debian guest with only cgroup v2 and runs sandboxd's cgroup-touching suites inside it, sandboxd started
# by systemd with the project's own unit (systemd/sandboxd.service, Delegate=yes). Run as root from the checkout:
#
#   tests/vm/run.sh v2            trixie (6.12): doctor, the unit-started daemon (conformance suite, its cgroup),
#                                 the integration tests that touch cgroups, the runtime's cgroup tests
#   tests/vm/run.sh no-landlock   trixie booted without Landlock in lsm=: the daemon must refuse to start
#   tests/vm/run.sh old-kernel    bookworm (6.1, Landlock ABI 2): refusal with the defaults, then with
#                                 sandbox.landlock_min_abi: 2 the conformance suite passes and ping/healthz say ABI 2
#   tests/vm/run.sh all           the three, one after the other
#
# Needs qemu-system-x86 and mmdebstrap (apt). Uses KVM when /dev/kvm opens, TCG otherwise. The guest images are
# cached (tests/vm/image.sh); the binaries are built here (cargo) and shared into the guest with the job over 9p.
# Prints each step's exit code and the suites' count lines; exits non-zero on any failure or a timeout.
# SANDBOXD_VM_TIMEOUT (seconds, default 1500) bounds each boot.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"
mode=${1:?usage: run.sh v2|no-landlock|old-kernel|all}
if [ "$mode" = all ]; then
  for m in v2 no-landlock old-kernel; do "$0" "$m"; done
  exit 0
fi
# The integration tests that create, limit, freeze or remove cgroups (libtest filters: a test runs when its name
# contains one of them).
integration_filters="suite::limits:: suite::pool:: suite::cleanup:: suite::lifecycle:: suite::capacity:: \
suite::attacks_resources::fork_and_thread_bombs suite::attacks_resources::memory_bombs_end_in_oom \
suite::attacks_resources::a_cpu_burner suite::neighbours::"

case "$mode" in
  v2) suite=trixie lsm="" ;;
  # Debian's default lsm= list without landlock.
  no-landlock) suite=trixie lsm="lsm=lockdown,capability,yama,apparmor,bpf" ;;
  old-kernel) suite=bookworm lsm="" ;;
  *) echo "run.sh: unknown mode $mode" >&2; exit 2 ;;
esac

command -v qemu-system-x86_64 >/dev/null || { echo "run.sh: qemu-system-x86_64 is missing (apt-get install qemu-system-x86)" >&2; exit 1; }
t0=$(date +%s)
image=$("$here/image.sh" "$suite")
t_image=$(date +%s)

# test_binary CARGO-ARGS...: the test executable cargo builds for those arguments.
test_binary() {
  cargo test "$@" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
found = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]]
print(found[-1])'
}
cargo build -q -p sandboxd -p sandboxctl -p fsp-conformance
job=$(mktemp -d /var/tmp/sandboxd-vm.XXXXXX)
trap 'rm -rf "$job"' EXIT
mkdir -p "$job/bin" "$job/results"
install -m 755 target/debug/sandboxd target/debug/sandboxctl target/debug/fsp-conformance "$job/bin/"
install -m 755 "$(test_binary -p sandboxd --test all)" "$job/bin/integration"
install -m 755 "$(test_binary -p sandboxd-runtime --lib)" "$job/bin/runtime-lib"
install -m 755 "$here/guest.sh" "$job/guest.sh"
install -m 644 systemd/sandboxd.service "$job/sandboxd.service"
cat >"$job/env" <<ENV
MODE=$mode
SANDBOXD_PATH=$repo/target/debug/sandboxd
INTEGRATION_FILTERS="$integration_filters"
ENV

# KVM when /dev/kvm opens; TCG otherwise, and when KVM cannot run this kernel (nested KVM without EPT, as on
# CI's machine, fails to emulate the VEX instructions of the kernel's decompressor: "KVM internal error"). Under
# TCG the guest is several times slower: the integration tests are cut to the named subset below.
tcg_filters="suite::limits::memory_limit_ends_in_oom suite::limits::pids_and_disk_limits_are_enforced \
suite::lifecycle::restart_after_a_crash_removes_the_leftover_container \
suite::pool::a_pooled_container_gets_the_requests_memory_and_pids_limits"
deadline=$(( $(date +%s) + ${SANDBOXD_VM_TIMEOUT:-1500} ))
stall_s=${SANDBOXD_VM_STALL:-180}
# boot ACCEL-ARGS...: runs the guest to its power-off; 0 when it finished, 2 when KVM failed, 1 on a timeout, 3 when
# the guest stalled before its init started (its console silent for $stall_s s with no `systemd[1]` line yet).
boot() {
  # Fresh logs: the loop below must not read the last attempt's.
  rm -rf "$job/results" "$job/qemu.log" "$job/console.log" && mkdir -p "$job/results"
  done_at=""
  qemu-system-x86_64 "$@" -machine q35 -smp 2 -m 4096 \
    -kernel "$image/vmlinuz" -initrd "$image/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all $lsm" \
    -drive "file=$image/disk.raw,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$job,mount_tag=job,security_model=none,multidevs=remap" \
    -nic none -display none -serial "file:$job/console.log" -monitor none -no-reboot >"$job/qemu.log" 2>&1 &
  local qpid=$! started size=0 grown
  started=$(date +%s)
  grown=$started
  while kill -0 "$qpid" 2>/dev/null; do
    # A kernel that stops printing before userspace (seen once under TCG: silent after 1.8 s of boot for 20 min)
    # never finishes: stopped here, so the caller can boot once more instead of waiting for the deadline. Once
    # systemd runs, the console may be quiet for minutes while a test runs; that is not a stall.
    if [ "$(stat -c %s "$job/console.log" 2>/dev/null || echo 0)" != "$size" ]; then
      size=$(stat -c %s "$job/console.log" 2>/dev/null || echo 0); grown=$(date +%s)
    elif [ "$(date +%s)" -gt $((grown + stall_s)) ] && ! grep -q "systemd\[1\]" "$job/console.log" 2>/dev/null; then
      kill "$qpid"; wait "$qpid" 2>/dev/null; echo "vm $mode: the guest stalled before its init started"; return 3
    fi
    # KVM failing: an internal error, or a guest that has not printed a line within a minute (under KVM the
    # kernel prints at once; nested KVM may instead hang silently before the first line).
    if grep -q "KVM internal error" "$job/qemu.log" ||
      { [ "$1" = -enable-kvm ] && [ ! -s "$job/console.log" ] && [ "$(date +%s)" -gt $((started + 60)) ]; }; then
      kill "$qpid"; wait "$qpid" 2>/dev/null; return 2
    fi
    # The guest powers itself off after writing `done`; one that lingers is stopped here.
    if [ -f "$job/results/done" ] && [ -z "${done_at:-}" ]; then done_at=$(date +%s); fi
    if [ -n "${done_at:-}" ] && [ "$(date +%s)" -gt $((done_at + 30)) ]; then
      kill "$qpid"; wait "$qpid" 2>/dev/null; return 0
    fi
    if [ "$(date +%s)" -gt "$deadline" ]; then
      kill "$qpid"; wait "$qpid" 2>/dev/null; echo "vm $mode: timed out"; return 1
    fi
    sleep 1
  done
  wait "$qpid"
  local rc=$?
  # KVM refusing this guest before it ran: qemu itself aborts (seen on a host whose KVM cannot set an MSR of
  # `-cpu host`: "failed to set MSR 0x10a", an assertion in qemu's kvm code).
  if [ "$rc" -ne 0 ] && [ "$1" = -enable-kvm ] && [ ! -f "$job/results/done" ] &&
    grep -qiE "kvm|failed to set MSR" "$job/qemu.log"; then
    return 2
  fi
  return "$rc"
}
set +e
qemu_rc=2
# SANDBOXD_VM_ACCEL=tcg skips the KVM attempt (a caller that saw KVM fail on this host saves the minute it takes).
if [ "${SANDBOXD_VM_ACCEL:-auto}" != tcg ] && [ -r /dev/kvm ] && [ -w /dev/kvm ]; then
  echo "== vm $mode: $(cat "$image/kernel") ($suite), KVM"
  boot -enable-kvm -cpu host
  qemu_rc=$?
  # A guest that stalled under KVM gets its one emulated boot, as one KVM refused.
  [ "$qemu_rc" = 3 ] && qemu_rc=2
  [ "$qemu_rc" = 2 ] && echo "vm $mode: KVM cannot run this guest here ($(grep -m1 "error" "$job/qemu.log" ||
    echo "no console output within a minute")); TCG instead"
fi
if [ "$qemu_rc" = 2 ]; then
  echo "== vm $mode: $(cat "$image/kernel") ($suite), TCG: integration tests cut to $tcg_filters"
  sed -i "s|^INTEGRATION_FILTERS=.*|INTEGRATION_FILTERS=\"$tcg_filters\"|" "$job/env"
  boot -accel tcg,thread=multi -cpu max
  qemu_rc=$?
  # An emulated guest's kernel has been seen to oops, and once to stall in early boot, under TCG on a busy host (not
  # reproducible): one more boot. A guest whose kernel panicked does not finish (no `done`), but qemu exits 0 then
  # (panic=-1 reboots, and -no-reboot turns the reboot into qemu's exit).
  if [ "$qemu_rc" = 3 ] ||
    { [ ! -f "$job/results/done" ] && grep -qE "Kernel panic|Oops" "$job/console.log" 2>/dev/null; }; then
    echo "vm $mode: the guest kernel failed under TCG ($(grep -m1 -E "Kernel panic|Oops" "$job/console.log" ||
      echo "stalled before its init")); booting once more"
    boot -accel tcg,thread=multi -cpu max
    qemu_rc=$?
  fi
fi
set -e
t_end=$(date +%s)
results=$job/results
# The log of everything the guest ran stays next to the conformance reports.
mkdir -p "target/vm/$mode"
cp -r "$results/." "target/vm/$mode/" 2>/dev/null || true
cp "$job/console.log" "target/vm/$mode/" 2>/dev/null || true
cat "$results/guest.log" 2>/dev/null || true
if [ "$qemu_rc" -ne 0 ] || [ ! -f "$results/done" ]; then
  echo "vm $mode: the guest did not finish (qemu exit $qemu_rc; 124 is the timeout); console tail:"
  tail -n 60 "$job/console.log" || true
  exit 1
fi
failed=0
for rc in "$results"/*.rc; do
  name=$(basename "$rc" .rc)
  # The count lines of libtest and of the conformance suite.
  grep -hE "^test result:|^[0-9]+ cases in " "$results/$name.log" | sed "s/^/  $name: /" || true
  if [ "$(cat "$rc")" != 0 ]; then
    failed=1
    echo "vm $mode: step $name failed (exit $(cat "$rc")); its log:"
    tail -n 80 "$results/$name.log"
  fi
done
echo "vm $mode: $((t_image - t0)) s for the image, $((t_end - t_image)) s to build, boot and run (logs in target/vm/$mode)"
exit "$failed"
