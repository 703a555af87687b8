//! Isolation between executions and from the host: private /workspace and /tmp, a private pid namespace, root
//! inside mapped to an unprivileged host uid per slot, and no network but loopback.

use std::time::Duration;

use protocol::ExecStatus;
use serde_json::Value;

use super::harness::{
    exec_json, privileged, processes_with_arg, stdout_contains, unique_marker, wait_until, Client,
    Daemon, DaemonOpts,
};

/// Execution A: writes `@SECRET@` files to /workspace and /tmp, then sleeps with `@MARKER@` in its argument.
const WRITE_SECRETS_AND_SLEEP: &str =
    "echo top-secret > /workspace/@SECRET@; echo top-secret > /tmp/@SECRET@; echo written; \
                                       exec sleep 60.@MARKER@";
/// Execution B: its ids and uid map, the files in /workspace and /tmp, the processes it sees, its network
/// interfaces, and a connection out.
const LOOK_AROUND: &str = r#"
import errno, json, os, socket
out = {"uid": os.getuid(), "gid": os.getgid(), "uid_map": open("/proc/self/uid_map").read().split()}
out["workspace"] = os.listdir("/workspace")
out["tmp"] = os.listdir("/tmp")
procs = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            procs.append(open("/proc/" + p + "/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
out["procs"] = procs
try:
    out["net"] = sorted(os.listdir("/sys/class/net"))
except OSError as e:
    out["net"] = None
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(3)
try:
    s.connect(("1.1.1.1", 53))
    out["connect"] = "connected"
except OSError as e:
    out["connect"] = e.errno
print(json.dumps(out))
"#;

#[tokio::test]
async fn concurrent_executions_are_isolated() {
    let Some(_g) = privileged("concurrent_executions_are_isolated").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let marker = unique_marker();
    let secret = format!("secret-{marker}");

    let a_uid = a_writes_its_secrets_and_keeps_running(&d, &mut c, &secret, &marker).await;

    // B looks around.
    let r = c
        .run_completed(exec_json("B", "python", LOOK_AROUND, 30_000, 128))
        .await;
    let out: Value =
        serde_json::from_slice(&r.stdout()).unwrap_or_else(|e| panic!("{e}: {}", r.dump()));
    assert_b_sees_nothing_of_a(&out, &secret, &marker);
    assert_b_is_root_mapped_to_its_own_host_uid(&out, d.uid_range(), a_uid);
    assert_eq!(out["connect"], 101, "no route out (ENETUNREACH): {out}");
    if !out["net"].is_null() {
        assert_eq!(
            out["net"],
            serde_json::json!(["lo"]),
            "only loopback: {out}"
        );
    }

    // A's own files were really there.
    c.cancel("A").await;
    let r = c.collect("A").await;
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Cancelled),
        "{}",
        r.dump()
    );
}

/// A writes its secrets and keeps running, as an unprivileged host uid of the daemon's range. Returns that uid.
async fn a_writes_its_secrets_and_keeps_running(
    d: &Daemon,
    c: &mut Client,
    secret: &str,
    marker: &str,
) -> u32 {
    let a = WRITE_SECRETS_AND_SLEEP
        .replace("@SECRET@", secret)
        .replace("@MARKER@", marker);
    c.send_json(&exec_json("A", "shell", &a, 60_000, 64)).await;
    c.observe("A's write", stdout_contains("A", "written"))
        .await;
    let a_proc = wait_until(
        "A's process on the host",
        Duration::from_secs(10),
        || async {
            processes_with_arg(marker)
                .into_iter()
                .next()
                .ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;
    assert!(
        d.uid_range().contains(&a_proc.uid),
        "A's root runs as an unprivileged host uid in [uid_base, uid_base + max_concurrent): {a_proc:?}, range {:?}",
        d.uid_range()
    );
    a_proc.uid
}

/// The strings of array `k` of `out`.
fn strings(out: &Value, k: &str) -> Vec<String> {
    out[k]
        .as_array()
        .unwrap_or_else(|| panic!("{k}: {out}"))
        .iter()
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// B (`out` of [`LOOK_AROUND`]) sees neither A's files (named `secret`) nor A's processes (`marker`), only its own.
fn assert_b_sees_nothing_of_a(out: &Value, secret: &str, marker: &str) {
    assert!(
        !strings(out, "workspace").iter().any(|n| n == secret),
        "B sees A's /workspace: {out}"
    );
    assert!(
        !strings(out, "tmp").iter().any(|n| n == secret),
        "B sees A's /tmp: {out}"
    );
    let procs = strings(out, "procs");
    assert!(
        procs
            .iter()
            .all(|p| !p.contains(marker) && !p.contains("sleep")),
        "B sees A's processes: {procs:?}"
    );
    assert!(
        procs.len() <= 3,
        "B's pid namespace holds only its own processes: {procs:?}"
    );
}

/// B is root inside, uid 0 alone mapped to a host uid of the daemon's `range`, and not A's (`a_uid`).
fn assert_b_is_root_mapped_to_its_own_host_uid(
    out: &Value,
    range: std::ops::Range<u32>,
    a_uid: u32,
) {
    assert_eq!(out["uid"], 0, "root inside: {out}");
    let map: Vec<u64> = strings(out, "uid_map")
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(map.len(), 3, "one uid_map line: {out}");
    assert_eq!((map[0], map[2]), (0, 1), "uid 0 alone is mapped: {out}");
    let host_uid = map[1] as u32;
    assert!(
        range.contains(&host_uid),
        "B's root maps to a host uid in {range:?}: {out}",
    );
    assert_ne!(
        host_uid, a_uid,
        "concurrent executions never share a host uid"
    );
}

#[tokio::test]
async fn executions_cannot_touch_the_host() {
    let Some(_g) = privileged("executions_cannot_touch_the_host").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let host_file = d.dir().join(format!("host-{}", unique_marker()));
    std::fs::write(&host_file, "host").unwrap();
    let code = format!(
        r#"
import json, os
out = {{}}
for name, path in [("host_file", "{host}"), ("state", "{state}")]:
    out[name] = os.path.exists(path)
try:
    open("/usr/bin/sandboxd-was-here", "w").write("x")
    out["usr_write"] = "written"
except OSError as e:
    out["usr_write"] = e.errno
try:
    open("/etc/passwd", "a").write("x")
    out["etc_write"] = "written"
except OSError as e:
    out["etc_write"] = e.errno
print(json.dumps(out))
"#,
        host = host_file.display(),
        state = d.state_dir.display()
    );
    let r = c
        .run_completed(exec_json("host", "python", &code, 30_000, 128))
        .await;
    let out: Value =
        serde_json::from_slice(&r.stdout()).unwrap_or_else(|e| panic!("{e}: {}", r.dump()));
    assert_eq!(
        out["host_file"], false,
        "the host's files are not visible: {out}"
    );
    assert_eq!(
        out["state"], false,
        "the daemon's state is not visible: {out}"
    );
    assert_ne!(out["usr_write"], "written", "the image is read-only: {out}");
    assert_ne!(out["etc_write"], "written", "the image is read-only: {out}");
    assert!(!std::path::Path::new("/usr/bin/sandboxd-was-here").exists());
}

/// What a program can see of its own container: privileges, ids, limits, cgroups, hostname, `/dev` and the mount
/// table (uid/gid mount options dropped: they name the execution's host uid, which differs per daemon).
#[cfg(feature = "libcontainer")]
const CONTAINER_VIEW: &str = r#"
grep -E '^(Cap|NoNewPrivs|Seccomp|Uid|Gid|Groups|Sig(Blk|Ign))' /proc/self/status
cat /proc/self/uid_map /proc/self/gid_map | awk '{print $1, $3}'
ulimit -a; umask; hostname; cat /proc/self/cgroup
ls -la /dev | awk '{print $1, $NF}'
sed -E 's/,?(uid|gid)=[0-9]+//g' /proc/mounts | sort
for f in /proc/kcore /proc/keys /proc/timer_list /proc/sys/kernel/hostname; do
  echo "$f: $(cat "$f" 2>/dev/null | wc -c) bytes"
done
(echo x > /proc/sys/kernel/hostname) 2>/dev/null && echo "/proc/sys writable" || echo "/proc/sys read-only"
"#;

/// The container's view on a daemon that starts containers with `start`.
#[cfg(feature = "libcontainer")]
async fn container_view(start: &str) -> String {
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(serde_json::json!({"sandbox": {"start": start}})),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let r = c
        .run_completed(exec_json("view", "shell", CONTAINER_VIEW, 20_000, 128))
        .await;
    r.stdout_text()
}

/// Needs the `libcontainer` feature (CI runs it with `--features libcontainer`); without it, the test below checks
/// that the daemon refuses that start.
#[cfg(feature = "libcontainer")]
#[tokio::test]
async fn the_direct_start_gives_the_container_libcontainer_gives() {
    let Some(_g) = privileged("the_direct_start_gives_the_container_libcontainer_gives").await
    else {
        return;
    };
    let direct = container_view("direct").await;
    let libcontainer = container_view("libcontainer").await;
    // One difference, on purpose: the direct start also remounts the root nosuid and nodev.
    let root_line = |view: &str| {
        view.lines()
            .find(|l| l.split(' ').nth(1) == Some("/"))
            .unwrap_or_default()
            .to_owned()
    };
    let direct_root = root_line(&direct);
    assert!(
        direct_root.contains(" ro,nosuid,nodev,"),
        "root mount of the direct start: {direct_root}"
    );
    let without_root = |view: &str| {
        let root = root_line(view);
        view.lines()
            .filter(|l| *l != root)
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        without_root(&direct),
        without_root(&libcontainer),
        "direct:\n{direct}\nlibcontainer:\n{libcontainer}"
    );
    for want in [
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
        "/proc/sys read-only",
        "/proc/keys: 0 bytes",
        "/proc/timer_list: 0 bytes",
    ] {
        assert!(direct.lines().any(|l| l.contains(want)), "{want}: {direct}");
    }
}

/// A build without the `libcontainer` feature refuses `sandbox.start: libcontainer` before it does anything (no
/// state directory, no cgroup, no helper): never a quiet fall back to the direct start. Needs no root: the check
/// comes first.
#[cfg(not(feature = "libcontainer"))]
#[test]
fn a_build_without_libcontainer_refuses_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "state_dir: {}\nsandbox:\n  start: libcontainer\n",
            state.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(super::harness::SANDBOXD)
        .arg("--config")
        .arg(&config)
        .env_remove("SANDBOXD_TOKEN")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Exit::Host: the build cannot provide what the config asks for.
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(
            "sandbox.start: This build has no libcontainer start; rebuild with --features libcontainer"
        ),
        "{stderr}"
    );
    assert!(
        !state.exists(),
        "the refused start created {}",
        state.display()
    );
}
