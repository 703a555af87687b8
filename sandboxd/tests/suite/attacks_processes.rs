//! Adversarial suite, processes: `kill(-1)` and signals to pid 1 reach only the sandbox, the init's
//! descriptors cannot be stolen, double-forked processes are gone at the end, orphans are reaped, uid 0 inside is an
//! unprivileged uid outside with no capabilities, and concurrent executions cannot see each other's files,
//! processes, environment, IPC or sockets.

use std::process::{Command, Stdio};
use std::time::Duration;

use protocol::ExecStatus;
use serde_json::{json, Value};

use super::attack::{json_of, x86_64_only, Arena, PY_SYSCALL};
use super::harness::{
    exec_json, privileged, proc_info, processes_with_arg, stdout_contains, unique_marker,
    wait_until, with, Client, Daemon, DaemonOpts,
};

/// A host process that must survive the attacks (killed when dropped).
struct HostSleeper(std::process::Child);

impl HostSleeper {
    fn start(uid: u32) -> HostSleeper {
        use std::os::unix::process::CommandExt;
        let child = Command::new("sleep")
            .arg(format!("600.{}", unique_marker()))
            .uid(uid)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn a host sleeper");
        HostSleeper(child)
    }

    fn alive(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for HostSleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A neighbour execution that runs for 3 s.
const NEIGHBOUR: &str =
    "import time\nprint('neighbour up', flush=True)\ntime.sleep(3)\nprint('neighbour done')";
/// `kill(-1, SIGKILL)` with children of its own, `kill` of the daemon's and the host sleepers' pids (`@DAEMON@`,
/// `@SLEEPER_0@`, `@SLEEPER_1@`), and the pids it can see (after [`PY_SYSCALL`]).
const KILL_MINUS_ONE_PROBE: &str = r#"
import signal, time
kids = []
for i in range(5):
    p = os.fork()
    if p == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(p)
out = {}
out["kill(-1)"] = errname(sc(62, -1, 9)[1])
out["killed kids"] = sorted(os.waitid(os.P_ALL, 0, os.WEXITED).si_status for _ in kids)
out["kill(daemon pid)"] = errname(sc(62, @DAEMON@, 9)[1])
out["kill(host sleepers)"] = [errname(sc(62, p, 9)[1]) for p in (@SLEEPER_0@, @SLEEPER_1@)]
out["visible pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps(out))
"#;
/// SIGTERM, SIGKILL, SIGSTOP, SIGINT and SIGHUP to pid 1, then whether the init is still the parent (after
/// [`PY_SYSCALL`]).
const SIGNALS_TO_PID_1: &str = "\nout = {}\nfor s in (15, 9, 19, 2, 1):\n    out[str(s)] = errname(sc(62, 1, s)[1])\n\
                                import time\ntime.sleep(0.3)\nout['ppid'] = os.getppid()\nprint(json.dumps(out))\n";
/// `pidfd_getfd` of the init's descriptors (its status pipe: a forged exit record), tracing it, reading its
/// memory, opening its fd 3 (after [`PY_SYSCALL`]).
const STEAL_INIT_FDS_PROBE: &str = r#"
out = {}
pidfd, err = sc(434, 1, 0)
out["pidfd_open(1)"] = errname(err)
got = {}
if pidfd >= 0:
    for fd in range(0, 64):
        r, e = sc(438, pidfd, fd, 0)
        got[errname(e)] = got.get(errname(e), 0) + 1
out["pidfd_getfd"] = got
out["ptrace(PTRACE_SEIZE, 1)"] = errname(sc(101, 0x4206, 1, 0, 0)[1])
out["process_vm_readv(1)"] = errname(sc(310, 1, 0, 0, 0, 0, 0)[1])
try:
    os.open("/proc/1/fd/3", os.O_WRONLY)
    out["open /proc/1/fd/3"] = "OK"
except OSError as e:
    out["open /proc/1/fd/3"] = errname(e.errno)
print(json.dumps(out))
"#;

#[tokio::test]
async fn kill_minus_one_and_signals_to_pid_1_reach_only_the_sandbox() {
    let Some(_g) = privileged("kill_minus_one_and_signals_to_pid_1_reach_only_the_sandbox").await
    else {
        return;
    };
    if !x86_64_only("kill_minus_one_and_signals_to_pid_1_reach_only_the_sandbox") {
        return;
    }
    let mut a = Arena::start("processes", DaemonOpts::default()).await;
    let mut sleepers = [HostSleeper::start(0), HostSleeper::start(65534)];

    kill_minus_one_hits_only_the_sandbox(&mut a, &mut sleepers).await;
    signals_to_pid_1_are_ignored(&mut a).await;
    the_inits_descriptors_cannot_be_stolen(&mut a).await;
    assert!(sleepers.iter_mut().all(|s| s.alive()));
    a.finish();
}

/// kill(-1, SIGKILL) and kill(<host pid of the daemon>, SIGKILL) while a neighbour runs: only the program's own
/// children die.
async fn kill_minus_one_hits_only_the_sandbox(a: &mut Arena, sleepers: &mut [HostSleeper; 2]) {
    let case = "kill(-1, SIGKILL)";
    let n_id = a.id("neighbour");
    let watch = a.watch().await;
    a.c.send_json(&exec_json(&n_id, "python", NEIGHBOUR, 30_000, 128))
        .await;
    a.c.observe(
        "the neighbour to run",
        stdout_contains(&n_id, "neighbour up"),
    )
    .await;
    let code = format!("{PY_SYSCALL}{KILL_MINUS_ONE_PROBE}")
        .replace("@DAEMON@", &a.d.pid().to_string())
        .replace("@SLEEPER_0@", &sleepers[0].0.id().to_string())
        .replace("@SLEEPER_1@", &sleepers[1].0.id().to_string());
    let id = a.id(case);
    let r = a.c.run(exec_json(&id, "python", &code, 30_000, 128)).await;
    let n = a.c.collect(&n_id).await;
    a.watched(watch, case);
    a.after(case).await;
    let out = json_of(case, &r);
    assert_eq!(out["kill(-1)"], "OK", "{case}: {out}");
    assert_eq!(
        out["killed kids"],
        json!([9, 9, 9, 9, 9]),
        "{case}: its own children were killed: {out}"
    );
    // The host pids do not exist in the sandbox's pid namespace (or name one of its own processes).
    assert!(
        out["visible pids"].as_array().unwrap().len() <= 3,
        "{case}: only the init, the program and listdir's process are visible: {out}"
    );
    assert_eq!(
        (n.terminal_status(), n.stdout_text().as_str()),
        (
            Some(ExecStatus::Completed),
            "neighbour up\nneighbour done\n"
        ),
        "{case}: the neighbour execution was hit: {}",
        n.dump()
    );
    assert!(
        sleepers.iter_mut().all(|s| s.alive()),
        "{case}: a host process was killed"
    );
    a.contained(case);
}

/// Signals to the container's init: ignored (no handlers), so the execution still ends normally.
async fn signals_to_pid_1_are_ignored(a: &mut Arena) {
    let case = "signals to pid 1";
    let out = a
        .attack_py(case, &format!("{PY_SYSCALL}{SIGNALS_TO_PID_1}"), json!({}))
        .await;
    assert_eq!(out["ppid"], 1, "{case}: the init is still there: {out}");
    a.contained(case);
}

/// Stealing the init's descriptors (its status pipe: a forged exit record) or tracing it fails.
async fn the_inits_descriptors_cannot_be_stolen(a: &mut Arena) {
    let case = "steal the init's descriptors";
    let out = a
        .attack_py(
            case,
            &format!("{PY_SYSCALL}{STEAL_INIT_FDS_PROBE}"),
            json!({}),
        )
        .await;
    assert_eq!(out["pidfd_open(1)"], "OK", "{case}: {out}");
    let got = out["pidfd_getfd"].as_object().unwrap();
    assert!(
        got.keys().all(|k| k == "EPERM"),
        "{case}: pidfd_getfd on the non-dumpable init must fail: {out}"
    );
    for k in ["ptrace(PTRACE_SEIZE, 1)", "process_vm_readv(1)"] {
        assert_eq!(out[k], "EPERM", "{case}: {k}: {out}");
    }
    assert!(
        out["open /proc/1/fd/3"] == "EACCES" || out["open /proc/1/fd/3"] == "ENOENT",
        "{case}: {out}"
    );
    a.contained(case);
}

#[tokio::test]
async fn double_forked_processes_are_gone_and_orphans_are_reaped() {
    let Some(_g) = privileged("double_forked_processes_are_gone_and_orphans_are_reaped").await
    else {
        return;
    };
    let mut a = Arena::start("processes", DaemonOpts::default()).await;

    // Daemons that detach (setsid, double fork, ignore SIGHUP/SIGTERM) and outlive the program's exit.
    let case = "double-forked daemons";
    let tag = format!("3600.{}", unique_marker());
    let code = format!(
        r#"
import os, signal, sys, time
TAG = "{tag}"
for i in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.execvp("sleep", ["sleep", TAG])
        os._exit(0)
deadline = time.time() + 5
while time.time() < deadline:
    n = 0
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and TAG.encode() in open("/proc/" + p + "/cmdline", "rb").read():
                n += 1
        except OSError:
            pass
    if n == 3:
        break
    time.sleep(0.01)
print("daemons %d" % n, flush=True)
"#
    );
    let id = a.id(case);
    let watch = a.watch().await;
    a.c.send_json(&exec_json(&id, "python", &code, 30_000, 128))
        .await;
    a.c.observe("the daemons to run", stdout_contains(&id, "daemons 3"))
        .await;
    let seen = processes_with_arg(&tag);
    let r = a.c.collect(&id).await;
    a.watched(watch, case);
    assert_eq!(
        (r.terminal_status(), r.result().exit_code),
        (Some(ExecStatus::Completed), Some(0)),
        "{case}: {}",
        r.dump()
    );
    wait_until(
        "the double-forked daemons to be gone",
        Duration::from_secs(10),
        || async {
            let left = processes_with_arg(&tag);
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        },
    )
    .await;
    a.after(case).await;
    assert!(
        !seen.is_empty() || r.result().duration_ms < 50,
        "{case}: precondition: the daemons were visible on the host while the program ran"
    );
    a.contained(case);

    // Many orphans exit: the init reaps them all while the program still runs.
    let case = "zombies reaped";
    let code = r#"
import json, os, time
r, w = os.pipe()
for i in range(50):
    if os.fork() == 0:
        g = os.fork()
        if g == 0:
            os.close(r); os.close(w)
            time.sleep(1)
            os._exit(0)
        os.write(w, ("%d\n" % g).encode())
        os._exit(0)
os.close(w)
orphans = [int(x) for x in os.fdopen(r).read().split()]
for _ in range(50):
    os.wait()
def states():
    s = {}
    for p in orphans:
        try:
            st = open("/proc/%d/stat" % p).read().rsplit(")", 1)[1].split()
            s[p] = (st[0], int(st[1]))
        except OSError:
            pass
    return s
early = states()
deadline = time.time() + 10
while time.time() < deadline and states():
    time.sleep(0.05)
left = states()
zombies = [p for p in os.listdir("/proc") if p.isdigit() and open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()[0] == "Z"]
print(json.dumps({"orphans": len(orphans), "alive at first": len(early),
                  "parents": sorted(set(pp for _, pp in early.values())), "left": len(left), "zombies": zombies}))
"#;
    let out = a.attack_py(case, code, json!({"pids_max": 128})).await;
    assert_eq!(out["orphans"], 50, "{case}: {out}");
    assert_eq!(out["left"], 0, "{case}: every orphan was reaped: {out}");
    assert_eq!(out["zombies"], json!([]), "{case}: {out}");
    assert!(
        out["alive at first"].as_u64().unwrap() > 0 && out["parents"] == json!([1]),
        "{case}: precondition: the orphans were seen alive, adopted by the init: {out}"
    );
    a.contained(case);
    a.finish();
}

/// The program's ids, capabilities, no_new_privs, seccomp mode and pid namespaces from /proc/self/status, its uid
/// map, and attempts to change ids or raise capabilities; then it execs a sleep tagged `@TAG@` for the host to find
/// (after [`PY_SYSCALL`]).
const UID_PROBE: &str = r#"
import sys, time
TAG = "@TAG@"
st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
out = {k: st[k].split() for k in ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
                                   "Seccomp", "Seccomp_filters", "NSpid")}
out["uid_map"] = open("/proc/self/uid_map").read().split()
out["setgroups"] = open("/proc/self/setgroups").read().strip()
def err(f):
    try:
        f()
        return "OK"
    except OSError as e:
        return errname(e.errno)
out["setuid(1000)"] = err(lambda: os.setuid(1000))
out["setgroups([0])"] = err(lambda: os.setgroups([0]))
out["setgid(1000)"] = err(lambda: os.setgid(1000))
# capset: try to raise CAP_SYS_ADMIN (21) in every set.
hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)(1 << 21, 1 << 21, 1 << 21, 0, 0, 0)
out["capset(CAP_SYS_ADMIN)"] = errname(sc(126, hdr, data)[1])
out["prctl(PR_SET_NO_NEW_PRIVS, 0)"] = errname(sc(157, 38, 0, 0, 0, 0)[1])
out["prctl(PR_CAP_AMBIENT_RAISE)"] = errname(sc(157, 47, 2, 21, 0, 0)[1])
print(json.dumps(out), flush=True)
print("ready", flush=True)
os.execv("/bin/sleep", ["sleep", "30." + TAG])
"#;
/// A copy of python with the setuid bit and a file capability (CAP_SYS_ADMIN), run to report its ids and
/// capabilities.
const SETUID_COPY_PROBE: &str = r#"
import errno, json, os, shutil, struct, subprocess
out = {}
shutil.copy("/usr/bin/python3", "/workspace/py")
os.chmod("/workspace/py", 0o6755)
cap = struct.pack("<IIIII", 0x02000001, 1 << 21, 0, 1 << 21, 0)
try:
    os.setxattr("/workspace/py", "security.capability", cap)
    out["setxattr security.capability"] = "OK"
except OSError as e:
    out["setxattr security.capability"] = errno.errorcode[e.errno]
p = subprocess.run(["/workspace/py", "-c", "print(open('/proc/self/status').read())"], capture_output=True, text=True)
st = dict(l.split(":", 1) for l in p.stdout.splitlines() if ":" in l)
for k in ("Uid", "CapPrm", "CapEff", "CapAmb"):
    out[k] = st.get(k, "").split()
out["rc"] = p.returncode
print(json.dumps(out))
"#;

#[tokio::test]
async fn root_inside_is_an_unprivileged_uid_outside() {
    let Some(_g) = privileged("root_inside_is_an_unprivileged_uid_outside").await else {
        return;
    };
    if !x86_64_only("root_inside_is_an_unprivileged_uid_outside") {
        return;
    }
    let mut a = Arena::start("processes", DaemonOpts::default()).await;
    uid_0_inside_is_unprivileged_outside(&mut a).await;
    setuid_bits_and_file_capabilities_grant_nothing(&mut a).await;
    a.finish();
}

/// The fields `k` of a /proc/<pid>/status, split on whitespace.
fn status_field(status: &str, k: &str) -> Vec<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{k}:")))
        .unwrap_or("")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// [`UID_PROBE`], seen from the host while it sleeps and from inside.
async fn uid_0_inside_is_unprivileged_outside(a: &mut Arena) {
    let case = "uid 0 inside is unprivileged outside";
    let tag = unique_marker();
    let code = format!("{PY_SYSCALL}{UID_PROBE}").replace("@TAG@", &tag);
    let id = a.id(case);
    let watch = a.watch().await;
    a.c.send_json(&exec_json(&id, "python", &code, 30_000, 128))
        .await;
    a.c.observe("the probe", stdout_contains(&id, "ready"))
        .await;
    let host = wait_until(
        "the program on the host",
        Duration::from_secs(10),
        || async {
            processes_with_arg(&tag)
                .into_iter()
                .next()
                .ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", host.pid)).unwrap();
    a.c.cancel(&id).await;
    let r = a.c.collect(&id).await;
    a.watched(watch, case);
    a.after(case).await;
    let out = r
        .stdout_text()
        .lines()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .unwrap_or_else(|| panic!("{case}: {}", r.dump()));

    let host_uid = assert_unprivileged_on_the_host(case, &status, a.d.uid_range());
    assert_root_without_privileges_inside(case, &out, host_uid);
    assert!(proc_info(host.pid).is_none_or(|p| !p.cmdline.contains(&tag)));
    a.contained(case);
}

/// From the host (`status` of the program): every uid is in the daemon's unprivileged `range`, no capabilities,
/// in a child pid namespace. Returns the host uid.
fn assert_unprivileged_on_the_host(case: &str, status: &str, range: std::ops::Range<u32>) -> u32 {
    let uids: Vec<u32> = status_field(status, "Uid")
        .iter()
        .map(|u| u.parse().unwrap())
        .collect();
    assert!(
        uids.len() == 4 && uids.iter().all(|u| range.contains(u)),
        "{case}: every host uid of the program is in the daemon's unprivileged range {range:?}: {uids:?}",
    );
    assert!(uids[0] >= 100_000, "{case}: not a system uid: {uids:?}");
    for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(
            status_field(status, k),
            ["0000000000000000"],
            "{case}: host view of {k}"
        );
    }
    assert_eq!(
        status_field(status, "NSpid").len(),
        2,
        "{case}: in a child pid namespace"
    );
    uids[0]
}

/// From inside (`out` of [`UID_PROBE`]): uid 0 mapped to `host_uid` alone, no capabilities, no_new_privs, the
/// seccomp profile, and no way to change ids or raise capabilities.
fn assert_root_without_privileges_inside(case: &str, out: &Value, host_uid: u32) {
    assert_eq!(out["Uid"], json!(["0", "0", "0", "0"]), "{case}: {out}");
    for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(out[k], json!(["0000000000000000"]), "{case}: {k}: {out}");
    }
    assert_eq!(out["NoNewPrivs"], json!(["1"]), "{case}: {out}");
    assert_eq!(out["Seccomp"], json!(["2"]), "{case}: {out}");
    assert_eq!(
        out["Seccomp_filters"],
        json!(["1"]),
        "{case}: the profile's one program (the denylist and the allowlist chained): {out}"
    );
    assert_eq!(
        out["uid_map"],
        json!(["0", host_uid.to_string(), "1"]),
        "{case}: {out}"
    );
    assert_eq!(out["setuid(1000)"], "EINVAL", "{case}: unmapped: {out}");
    assert_eq!(out["setgid(1000)"], "EINVAL", "{case}: unmapped: {out}");
    assert_eq!(out["setgroups([0])"], "EPERM", "{case}: {out}");
    assert_eq!(out["capset(CAP_SYS_ADMIN)"], "EPERM", "{case}: {out}");
    assert_eq!(
        out["prctl(PR_SET_NO_NEW_PRIVS, 0)"], "EINVAL",
        "{case}: {out}"
    );
    assert_eq!(out["prctl(PR_CAP_AMBIENT_RAISE)"], "EPERM", "{case}: {out}");
}

/// A copy of python with the setuid bit and a file capability (CAP_SYS_ADMIN): exec grants nothing.
async fn setuid_bits_and_file_capabilities_grant_nothing(a: &mut Arena) {
    let case = "setuid bit and file capabilities grant nothing";
    let out = a
        .attack_py(
            case,
            SETUID_COPY_PROBE,
            json!({"disk_mb": 64, "memory_mb": 256}),
        )
        .await;
    assert_eq!(out["rc"], 0, "{case}: {out}");
    assert_eq!(out["Uid"], json!(["0", "0", "0", "0"]), "{case}: {out}");
    for k in ["CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(out[k], json!(["0000000000000000"]), "{case}: {k}: {out}");
    }
    a.contained(case);
}

/// Execution A: leaves traces of `@SECRET@` everywhere (files, an abstract and a loopback socket, System V shared
/// memory, the host name), waits 4 s, then checks its files are intact.
const TRACES_A: &str = r#"
import os, socket, sys, time, mmap
SECRET = "@SECRET@"
for d in ("/workspace", "/tmp", "/dev/shm"):
    open(d + "/" + SECRET, "w").write(SECRET)
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
u.bind("\0" + SECRET); u.listen(1)
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("127.0.0.1", 47000)); t.listen(1)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0x5eed, 4096, 0o1666)
try:
    socket.sethostname("a-" + SECRET[-8:])
except OSError:
    pass
print("A ready %d" % shmid, flush=True)
time.sleep(4)
intact = all(open(d + "/" + SECRET).read() == SECRET for d in ("/workspace", "/tmp", "/dev/shm"))
print("A intact" if intact else "A tampered")
"#;
/// Execution B: looks for A's traces of `@SECRET@`, and for processes it can see or signal.
const LOOK_FOR_A: &str = r#"
import errno, json, os, socket
SECRET = "@SECRET@"
out = {}
out["files"] = [d for d in ("/workspace", "/tmp", "/dev/shm") if any(SECRET in n for n in os.listdir(d))]
hits = []
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    for f in ("cmdline", "environ"):
        try:
            if SECRET.encode() in open("/proc/%s/%s" % (p, f), "rb").read():
                hits.append(p + "/" + f)
        except OSError:
            pass
out["proc"] = hits
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["env"] = [k for k, v in os.environ.items() if SECRET in v]
out["sysvipc shm"] = open("/proc/sysvipc/shm").read().splitlines()[1:]
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    u.connect("\0" + SECRET); out["abstract"] = "connected"
except OSError as e:
    out["abstract"] = errno.errorcode[e.errno]
t = socket.socket(); t.settimeout(2)
try:
    t.connect(("127.0.0.1", 47000)); out["tcp"] = "connected"
except OSError as e:
    out["tcp"] = errno.errorcode[e.errno]
out["hostname"] = socket.gethostname()
alive = []
for p in range(1, 4097):
    try:
        os.kill(p, 0)
        alive.append(p)
    except OSError:
        pass
out["signalable"] = alive
print(json.dumps(out))
"#;

#[tokio::test]
async fn concurrent_executions_cannot_see_each_other() {
    let Some(_g) = privileged("concurrent_executions_cannot_see_each_other").await else {
        return;
    };
    let mut a = Arena::start("processes", DaemonOpts::default()).await;
    let case = "another execution's files, processes, env, IPC, sockets";
    let marker = unique_marker();
    let secret = format!("secret-{marker}");

    // A: leaves traces everywhere, then checks they are intact.
    let a_id = a.id("A");
    let watch = a.watch().await;
    a.c.send_json(&with(
        exec_json(
            &a_id,
            "python",
            &TRACES_A.replace("@SECRET@", &secret),
            30_000,
            128,
        ),
        json!({"env": {"A_SECRET": secret}}),
    ))
    .await;
    a.c.observe("A's traces", stdout_contains(&a_id, "A ready"))
        .await;

    // B: looks for them.
    let b_id = a.id("B");
    let b =
        a.c.run(with(
            exec_json(
                &b_id,
                "python",
                &LOOK_FOR_A.replace("@SECRET@", &secret),
                30_000,
                128,
            ),
            json!({"env": {"B_ONLY": "b"}}),
        ))
        .await;
    let ar = a.c.collect(&a_id).await;
    a.watched(watch, case);
    a.after(case).await;
    assert_b_found_nothing_of_a(case, &json_of(case, &b));
    assert_eq!(
        (ar.terminal_status(), ar.stdout_text().lines().last()),
        (Some(ExecStatus::Completed), Some("A intact")),
        "{case}: A was disturbed: {}",
        ar.dump()
    );
    a.contained(case);
    a.finish();
}

/// B's report (`out` of [`LOOK_FOR_A`]): none of A's files, processes, environment, shared memory, sockets or host
/// name, and only its own processes.
fn assert_b_found_nothing_of_a(case: &str, out: &Value) {
    assert_eq!(out["files"], json!([]), "{case}: A's files: {out}");
    assert_eq!(out["proc"], json!([]), "{case}: A's processes: {out}");
    assert_eq!(out["env"], json!([]), "{case}: A's environment: {out}");
    assert_eq!(
        out["sysvipc shm"],
        json!([]),
        "{case}: A's System V shared memory: {out}"
    );
    assert_eq!(
        out["abstract"], "ECONNREFUSED",
        "{case}: A's abstract socket: {out}"
    );
    assert_eq!(
        out["tcp"], "ECONNREFUSED",
        "{case}: A's loopback port: {out}"
    );
    assert_eq!(
        out["hostname"], "sandbox",
        "{case}: A's hostname change: {out}"
    );
    assert!(
        out["pids"].as_array().unwrap().len() <= 3
            && out["signalable"].as_array().unwrap().len() <= 3,
        "{case}: B sees and can signal only its own processes: {out}"
    );
}

/// The program starts with an empty signal mask and every signal at its default disposition, whatever the daemon,
/// the helper and the container's init had (the Rust runtime ignores SIGPIPE; the init catches SIGTERM, SIGINT and
/// SIGHUP to forward them; glibc's two internal real-time signals, 32 and 33, used to arrive ignored): a program
/// that relies on SIGPIPE ending it, or on a default SIGINT, behaves as on a host.
#[tokio::test]
async fn the_program_starts_with_default_signal_dispositions_and_mask() {
    let Some(_g) = privileged("the_program_starts_with_default_signal_dispositions_and_mask").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    // The program's own status (SigCgt is whatever the program installed itself, so it is not checked).
    let r = c
        .run(exec_json(
            "sig",
            "shell",
            "exec cat /proc/self/status",
            10_000,
            64,
        ))
        .await;
    assert_eq!(r.terminal_status(), Some(ExecStatus::Completed), "{r:?}");
    let status = r.stdout_text();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {name} in {status}"))
            .to_owned()
    };
    assert_eq!(field("SigBlk:"), "0000000000000000", "blocked signals");
    assert_eq!(field("SigIgn:"), "0000000000000000", "ignored signals");
}
