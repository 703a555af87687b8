//! Neighbour suite: kernel resources the kernel counts per user (inotify instances and watches, POSIX message
//! queue bytes, queued signals) or host-wide (ptys, pids, tmpfs inodes, the state disk). While one execution (A)
//! holds all it can of one of them, a second execution (B) on the same daemon and host root (this test process)
//! must still get one.
//!
//! Why it can go wrong: the kernel charges what a process in a user namespace holds to every owner up the chain,
//! up to the namespace's creator in the initial namespace. When the daemon (root) creates every container's user
//! namespace, one execution's inotify instances are root's, and `inotify_init1` fails for root and for every other
//! container until it ends.
//!
//! Each case runs A until it prints `{"held": n, "errno": e}` and sleeps; then host root and B each take one of
//! the resource and release it; then A is cancelled and host root tries once more (the resource came back). A is
//! also killed by pid when the case ends early ([`KillOnDrop`]), and its timeout (30 s) bounds it if even that
//! fails. Host-root probes release what they take (descriptors closed, queues unlinked, files removed).
//!
//! What bounds each one:
//! - inotify instances and watches, POSIX message queue bytes, queued signals: the per-user counters, charged to
//!   the container's host uid because that uid owns its user namespace;
//! - ptys: the container's devpts instance (`max=64`); all instances but the host's share
//!   `kernel.pty.max - kernel.pty.reserve`, and the host's keeps the reserve;
//! - pids: the pids cgroup (`pids_max`);
//! - /dev/shm: a tmpfs per container (`disk_mb` of pages); its inodes are charged to the memory cgroup;
//! - keyrings: seccomp refuses `add_key` and `keyctl` (EPERM);
//! - the state disk: `artifacts.max_files` and `artifacts.max_total_bytes` per execution (`max_store_bytes` for
//!   the store).

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use protocol::{ExecStatus, ServerMessage};
use serde_json::{json, Value};

use super::attack::x86_64_only;
use super::harness::{
    exec_json, is, privileged_alone, stdout_contains, wait_until, with, Client, Collected, Daemon,
    DaemonOpts,
};
use super::images::agent_http;

/// How long A may run at most (also the bound when the test process dies before cancelling it).
const HOLD_TIMEOUT_MS: u64 = 30_000;
/// How long a resource may take to come back to host root after A ended.
const RELEASE_DEADLINE: Duration = Duration::from_secs(15);

/// Shared by every program: `MARK` names the process (`/proc/self/comm`, inherited by children, so
/// [`KillOnDrop`] finds them), `hold` reports what was taken and keeps it, `ok_or` prints `ok` or what failed,
/// `mq` opens a POSIX message queue of 10 messages of 8 KiB and `mq_create` creates one: 0, or the errno. Landlock
/// refuses the open that follows the creation (EACCES: the queue's file is under no allowed path) but the queue,
/// and its charge against `RLIMIT_MSGQUEUE`, stay; a second exclusive create answering EEXIST proves it.
const PRELUDE: &str = r#"
import ctypes, json, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
try:
    with open("/proc/self/comm", "w") as f:
        f.write(MARK)
except OSError:
    pass
def hold(count, err):
    print(json.dumps({"held": count, "errno": err}), flush=True)
    time.sleep(60)
def ok_or(r, what):
    print("ok" if r >= 0 else "%s: %s" % (what, os.strerror(ctypes.get_errno())), flush=True)
class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
MQ_ATTR = MqAttr(0, 10, 8192, 0)
def mq(name, flags=0):
    return libc.mq_open(name, os.O_CREAT | os.O_RDWR | flags, 0o600, ctypes.byref(MQ_ATTR))
def mq_create(name):
    if mq(name) >= 0:
        return 0
    e = ctypes.get_errno()
    if e == 13 and mq(name, os.O_EXCL) < 0 and ctypes.get_errno() == 17:
        return 0
    return e
"#;

/// A: inotify instances until refused.
const HOLD_INOTIFY_INSTANCES: &str = r#"
fds, err = [], 0
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        err = ctypes.get_errno()
        break
    fds.append(fd)
hold(len(fds), err)
"#;
/// B: one inotify instance.
const ONE_INOTIFY_INSTANCE: &str = "ok_or(libc.inotify_init1(0), 'inotify_init1')\n";

/// A: watches on 4000 files from one instance after another until refused (about 48 instances for the default
/// 192536 watches, so instances are left for everyone).
const HOLD_INOTIFY_WATCHES: &str = r#"
os.makedirs("/tmp/w")
names = [b"/tmp/w/%d" % i for i in range(4000)]
for p in names:
    open(p, "w").close()
n, err, fds = 0, 0, []
while not err and len(fds) < 120:
    fd = libc.inotify_init1(0)
    if fd < 0:
        err = ctypes.get_errno()
        break
    fds.append(fd)
    for p in names:
        if libc.inotify_add_watch(fd, p, 2) < 0:
            err = ctypes.get_errno()
            break
        n += 1
hold(n, err)
"#;
/// B: one watch.
const ONE_INOTIFY_WATCH: &str = r#"
fd = libc.inotify_init1(0)
ok_or(libc.inotify_add_watch(fd, b"/tmp", 2) if fd >= 0 else fd, "inotify")
"#;

/// A: message queues of 80 KiB until refused (`RLIMIT_MSGQUEUE`, 800 KiB by default). They live as long as the
/// container's ipc namespace.
const HOLD_MQUEUES: &str = r#"
n, err = 0, 0
while n < 1000:
    err = mq_create(b"/nb%d" % n)
    if err:
        break
    n += 1
hold(n, err)
"#;
/// B: one message queue.
const ONE_MQUEUE: &str = r#"
e = mq_create(b"/neighbour")
print("ok" if e == 0 else "mq_open: %s" % os.strerror(e))
"#;

/// A: a real-time signal queued to itself (blocked) until refused (`RLIMIT_SIGPENDING`).
const HOLD_SIGNALS: &str = r#"
sig = signal.SIGRTMIN
signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
n, err = 0, 0
while n < 1000000:
    if libc.sigqueue(os.getpid(), sig, ctypes.c_void_p(0)) != 0:
        err = ctypes.get_errno()
        break
    n += 1
hold(n, err)
"#;
/// B: one queued signal, received.
const ONE_SIGNAL: &str = r#"
sig = signal.SIGRTMIN
signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
r = libc.sigqueue(os.getpid(), sig, ctypes.c_void_p(0))
if r == 0:
    signal.sigtimedwait([sig], 0)
ok_or(r, "sigqueue")
"#;

/// A: ptys from six processes (1000 each at most: `RLIMIT_NOFILE`) until refused.
const HOLD_PTYS: &str = r#"
def grab():
    fds, err = [], 0
    while len(fds) < 1000:
        try:
            fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
        except OSError as e:
            err = e.errno
            break
    return fds, err
r, w = os.pipe()
for i in range(5):
    if os.fork() == 0:
        fds, err = grab()
        os.write(w, b"%d %d\n" % (len(fds), err))
        time.sleep(60)
        os._exit(0)
got = b""
while got.count(b"\n") < 5:
    got += os.read(r, 4096)
counts = [tuple(map(int, l.split())) for l in got.split(b"\n") if l]
fds, err = grab()
errs = [e for _, e in counts if e] + ([err] if err else [])
hold(len(fds) + sum(n for n, _ in counts), errs[0] if errs else 0)
"#;
/// B: one pty.
const ONE_PTY: &str = r#"
try:
    m, s = os.openpty()
    print("ok")
except OSError as e:
    print("openpty: %s" % e)
"#;

/// A: a fork bomb (its pids cgroup refuses the 65th process).
const HOLD_PIDS: &str = r#"
kids, err = 0, 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        kids += 1
    except OSError as e:
        err = e.errno
        break
hold(kids, err)
"#;
/// B: eight children.
const EIGHT_CHILDREN: &str = r#"
kids = []
for i in range(8):
    p = os.fork()
    if p == 0:
        os._exit(0)
    kids.append(p)
print("ok" if all(os.waitpid(p, 0)[1] == 0 for p in kids) else "a child failed")
"#;

/// A: 100000 empty files in /dev/shm (inodes, no pages). Nothing refuses them before the memory cgroup does (the
/// inodes are charged to it: 300000 end in `oom` at 256 MiB), and the /dev/shm of each container is a tmpfs of its
/// own (one-byte files get ENOSPC at `disk_mb` of pages).
const HOLD_SHM_INODES: &str = r#"
n, err = 0, 0
try:
    while n < 100000:
        os.close(os.open("/dev/shm/f%d" % n, os.O_CREAT | os.O_WRONLY, 0o600))
        n += 1
except OSError as e:
    err = e.errno
hold(n, err)
"#;
/// B: 100 files in /dev/shm and /tmp.
const HUNDRED_TMPFS_FILES: &str = r#"
try:
    for d in ("/dev/shm", "/tmp"):
        for i in range(100):
            with open("%s/g%d" % (d, i), "wb") as f:
                f.write(b"y")
    print("ok")
except OSError as e:
    print("tmpfs: %s" % e)
"#;

/// One shared resource: what A takes, what B and host root take while A holds it.
struct Case {
    /// Names the case in failures.
    name: &'static str,
    /// A's program after [`PRELUDE`]: takes the resource, then calls `hold(count, errno)`.
    hold: &'static str,
    /// A's `limits`.
    limits: Value,
    /// Whether A must have been refused (a nonzero errno); else it stops at a count of its own.
    until_refused: bool,
    /// B's program after [`PRELUDE`]: takes one and prints `ok` or what failed.
    neighbour: &'static str,
    /// Host root takes one (and releases it).
    host: fn() -> Result<(), String>,
}

/// What happened while A held the resource.
struct Outcome {
    /// A's `{"held", "errno"}` line (null when A ended before holding).
    held: Value,
    /// A to its end (after the cancel).
    a: Collected,
    /// B to its end.
    b: Collected,
    /// Host root's probe while A held.
    host: Result<(), String>,
}

/// Kills, when dropped, every process named `comm` inside the cgroup parent of the daemon this test started (A's
/// processes, by pid), so a failing case releases host root's resources at once.
struct KillOnDrop {
    comm: String,
    cgroup_parent: String,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in pids_named(&self.comm, &self.cgroup_parent) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// Processes whose `/proc/<pid>/comm` is `comm` and whose cgroup is under `cgroup_parent`.
fn pids_named(comm: &str, cgroup_parent: &str) -> Vec<i32> {
    let inside = format!("/{cgroup_parent}/");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm)
                && std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                    .is_ok_and(|c| c.contains(&inside))
        })
        .collect()
}

/// A fresh process name of at most 15 bytes.
fn fresh_comm() -> String {
    format!("nbhold{:08x}", rand::random::<u32>())
}

/// A python program: `MARK`, [`PRELUDE`], `body`.
fn program(comm: &str, body: &str) -> String {
    format!("MARK = {comm:?}\n{PRELUDE}{body}")
}

/// Starts A and waits until it holds (or ended); returns its `held` line, or null.
async fn start_holder(c: &mut Client, id: &str, code: &str, limits: &Value) -> Value {
    let exec = with(
        exec_json(id, "python", code, HOLD_TIMEOUT_MS, 256),
        json!({ "limits": limits }),
    );
    c.send_json(&exec).await;
    let holding = stdout_contains(id, "\"held\"");
    let (ended, failed) = (is(id, "result"), is(id, "error"));
    let m = c
        .observe("A to hold the resource", |m| {
            holding(m) || ended(m) || failed(m)
        })
        .await;
    match m {
        ServerMessage::Stdout(ch) => {
            held_line(&String::from_utf8_lossy(&ch.decode().unwrap_or_default()))
        }
        _ => Value::Null,
    }
}

/// The `{"held": ..}` line of A's output, or null.
fn held_line(text: &str) -> Value {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v.get("held").is_some())
        .unwrap_or(Value::Null)
}

/// Runs `case` on `d`: A holds, host root and B take one each, A is cancelled.
async fn while_held(d: &Daemon, case: &Case) -> Outcome {
    let mut c = Client::connect(d).await;
    let comm = fresh_comm();
    let _kill = KillOnDrop {
        comm: comm.clone(),
        cgroup_parent: d.cgroup_parent.clone(),
    };
    let held = start_holder(&mut c, "a", &program(&comm, case.hold), &case.limits).await;
    let host = (case.host)();
    let b = c
        .run(exec_json(
            "b",
            "python",
            &program("neighbour", case.neighbour),
            30_000,
            128,
        ))
        .await;
    c.cancel("a").await;
    let a = c.collect("a").await;
    Outcome { held, a, b, host }
}

/// Runs `case` and asserts: A took the resource; B and host root each got one while A held it; host root gets one
/// after A ended.
async fn check(d: &Daemon, case: &Case) {
    let o = while_held(d, case).await;
    let name = case.name;
    eprintln!("{name}: A held {}; host root: {:?}", o.held, o.host);
    assert!(
        !o.held.is_null(),
        "{name}: precondition: A takes the resource and holds it: {}",
        o.a.dump()
    );
    if case.until_refused {
        assert_ne!(
            o.held["errno"], 0,
            "{name}: precondition: A took all it could: {}",
            o.held
        );
    }
    let mut wrong = Vec::new();
    if let Err(e) = &o.host {
        wrong.push(format!("host root was refused: {e}"));
    }
    if (o.b.terminal_status(), o.b.stdout_text().as_str()) != (Some(ExecStatus::Completed), "ok\n")
    {
        wrong.push(format!("execution B was refused: {}", o.b.dump()));
    }
    assert!(
        wrong.is_empty(),
        "{name}: while A held {}: {}",
        o.held,
        wrong.join("; ")
    );
    wait_until(
        "host root to get the resource after A ended",
        RELEASE_DEADLINE,
        || async { (case.host)() },
    )
    .await;
}

/// The standard daemon of the suite, started after the privilege check.
async fn daemon() -> Daemon {
    Daemon::start(DaemonOpts::default()).await
}

// ---------------------------------------------------------------------------------------------------------------
// Host-root probes
// ---------------------------------------------------------------------------------------------------------------

/// `what: <errno text>` of the last failed call.
fn last_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// Owns a descriptor a libc call returned (closed on drop), or the call's error.
fn owned(fd: libc::c_int, what: &str) -> Result<OwnedFd, String> {
    if fd < 0 {
        return Err(last_error(what));
    }
    // SAFETY: `fd` was just returned by the kernel to this thread and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One inotify instance.
fn host_inotify_instance() -> Result<(), String> {
    // SAFETY: no pointers; the descriptor is owned (and closed) at once.
    owned(
        unsafe { libc::inotify_init1(libc::IN_CLOEXEC) },
        "inotify_init1",
    )
    .map(drop)
}

/// One inotify watch (on `/`).
fn host_inotify_watch() -> Result<(), String> {
    // SAFETY: no pointers; the descriptor is owned (and closed) at once.
    let fd = owned(
        unsafe { libc::inotify_init1(libc::IN_CLOEXEC) },
        "inotify_init1",
    )?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: a valid inotify descriptor and a NUL-terminated path; the watch goes with the descriptor.
    let wd = unsafe { libc::inotify_add_watch(fd, c"/".as_ptr(), libc::IN_MODIFY) };
    if wd < 0 {
        return Err(last_error("inotify_add_watch"));
    }
    Ok(())
}

/// One POSIX message queue of 10 messages of 8 KiB, closed and unlinked.
fn host_mqueue() -> Result<(), String> {
    let name = CString::new(format!("/sandboxd-neighbours-{}", std::process::id()))
        .map_err(|e| e.to_string())?;
    // SAFETY: mq_attr is plain integers; zero is valid for every field, the sizes are set below.
    let mut attr: libc::mq_attr = unsafe { std::mem::zeroed() };
    attr.mq_maxmsg = 10;
    attr.mq_msgsize = 8192;
    // SAFETY: a NUL-terminated name and a valid attribute struct; the queue is closed and unlinked below.
    let q = unsafe {
        libc::mq_open(
            name.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
            0o600 as libc::mode_t,
            &attr as *const libc::mq_attr,
        )
    };
    if q < 0 {
        return Err(last_error("mq_open"));
    }
    // SAFETY: `q` is the queue descriptor opened above; the name is the one created.
    unsafe {
        libc::mq_close(q);
        libc::mq_unlink(name.as_ptr());
    }
    Ok(())
}

/// One real-time signal queued to a thread of this process (blocked there) and received back, on a thread of its
/// own so no other thread's mask changes.
fn host_sigqueue() -> Result<(), String> {
    let probe = || -> Result<(), String> {
        let sig = libc::SIGRTMAX() - 1;
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t; the mask changes on this short-lived thread only.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        // SAFETY: siginfo_t is plain data; zero is valid for every field.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        info.si_signo = sig;
        info.si_code = -1; // SI_QUEUE: counted against RLIMIT_SIGPENDING, as sigqueue(3) is.
                           // SAFETY: targets this very thread, where `sig` is blocked; `info` is valid for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                libc::gettid(),
                sig,
                &info as *const libc::siginfo_t,
            )
        };
        if r != 0 {
            return Err(last_error("rt_tgsigqueueinfo"));
        }
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid set, info and timeout; takes back the signal queued above.
        let got = unsafe { libc::sigtimedwait(&set, &mut info, &zero) };
        if got != sig {
            return Err(last_error("sigtimedwait"));
        }
        Ok(())
    };
    std::thread::spawn(probe)
        .join()
        .map_err(|_| "the signal probe thread panicked".to_owned())?
}

/// One pty of the host's devpts.
fn host_pty() -> Result<(), String> {
    // SAFETY: no pointers; the descriptor is owned (and closed) at once.
    owned(
        unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) },
        "posix_openpt",
    )
    .map(drop)
}

/// A child process.
fn host_fork() -> Result<(), String> {
    match std::process::Command::new("/bin/true").status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("/bin/true: {s}")),
        Err(e) => Err(format!("spawn /bin/true: {e}")),
    }
}

/// A one-byte file in the host's /dev/shm, removed again.
fn host_shm_file() -> Result<(), String> {
    let p = format!("/dev/shm/sandboxd-neighbours-{}", std::process::id());
    let r = std::fs::write(&p, b"z").map_err(|e| format!("write {p}: {e}"));
    let _ = std::fs::remove_file(&p);
    r
}

/// `keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)`: reads, creates nothing.
fn host_keyctl() -> Result<(), String> {
    // SAFETY: integer arguments only.
    let r = unsafe { libc::syscall(libc::SYS_keyctl, 0, -3, 0) };
    if r < 0 {
        return Err(last_error("keyctl(KEYCTL_GET_KEYRING_ID)"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn neighbours_get_inotify_instances_while_one_execution_holds_all_it_can() {
    let test = "neighbours_get_inotify_instances_while_one_execution_holds_all_it_can";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "inotify instances (fs.inotify.max_user_instances)",
        hold: HOLD_INOTIFY_INSTANCES,
        limits: json!({}),
        until_refused: true,
        neighbour: ONE_INOTIFY_INSTANCE,
        host: host_inotify_instance,
    };
    check(&d, &case).await;
}

#[tokio::test]
async fn neighbours_get_inotify_watches_while_one_execution_holds_all_it_can() {
    let test = "neighbours_get_inotify_watches_while_one_execution_holds_all_it_can";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "inotify watches (fs.inotify.max_user_watches)",
        hold: HOLD_INOTIFY_WATCHES,
        limits: json!({"memory_mb": 512, "disk_mb": 64}),
        until_refused: true,
        neighbour: ONE_INOTIFY_WATCH,
        host: host_inotify_watch,
    };
    check(&d, &case).await;
}

#[tokio::test]
async fn neighbours_get_message_queues_while_one_execution_holds_all_it_can() {
    let test = "neighbours_get_message_queues_while_one_execution_holds_all_it_can";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "POSIX message queue bytes (RLIMIT_MSGQUEUE)",
        hold: HOLD_MQUEUES,
        limits: json!({}),
        until_refused: true,
        neighbour: ONE_MQUEUE,
        host: host_mqueue,
    };
    check(&d, &case).await;
}

#[tokio::test]
async fn neighbours_queue_signals_while_one_execution_holds_all_it_can() {
    let test = "neighbours_queue_signals_while_one_execution_holds_all_it_can";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "queued signals (RLIMIT_SIGPENDING)",
        hold: HOLD_SIGNALS,
        limits: json!({}),
        until_refused: true,
        neighbour: ONE_SIGNAL,
        host: host_sigqueue,
    };
    check(&d, &case).await;
}

#[tokio::test]
async fn neighbours_get_ptys_while_one_execution_holds_all_it_can() {
    let test = "neighbours_get_ptys_while_one_execution_holds_all_it_can";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "ptys (kernel.pty.max)",
        hold: HOLD_PTYS,
        limits: json!({"memory_mb": 512, "pids_max": 32}),
        until_refused: true,
        neighbour: ONE_PTY,
        host: host_pty,
    };
    check(&d, &case).await;
}

#[tokio::test]
async fn neighbours_fork_while_one_execution_is_at_its_pids_max() {
    let test = "neighbours_fork_while_one_execution_is_at_its_pids_max";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "pids (the pids cgroup)",
        hold: HOLD_PIDS,
        limits: json!({"pids_max": 64}),
        until_refused: true,
        neighbour: EIGHT_CHILDREN,
        host: host_fork,
    };
    check(&d, &case).await;
}

#[tokio::test]
async fn neighbours_create_tmpfs_files_while_one_execution_fills_dev_shm_with_inodes() {
    let test = "neighbours_create_tmpfs_files_while_one_execution_fills_dev_shm_with_inodes";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let case = Case {
        name: "/dev/shm inodes",
        hold: HOLD_SHM_INODES,
        limits: json!({"memory_mb": 512, "disk_mb": 64}),
        until_refused: false,
        neighbour: HUNDRED_TMPFS_FILES,
        host: host_shm_file,
    };
    check(&d, &case).await;
}

/// `add_key(2)` and `keyctl(2)` (x86_64 numbers 248 and 250) from inside: errno names.
const TRY_KEYRINGS: &str = r#"
libc.syscall.restype = ctypes.c_long
def sc(*args):
    ctypes.set_errno(0)
    r = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return "OK" if r >= 0 else os.strerror(ctypes.get_errno())
print(json.dumps({"add_key": sc(248, b"user", b"neighbour", b"v", 1, -2), "keyctl": sc(250, 0, -3, 0)}))
"#;

#[tokio::test]
async fn keyrings_are_refused_inside_and_host_root_keeps_its_own() {
    let test = "keyrings_are_refused_inside_and_host_root_keeps_its_own";
    if !x86_64_only(test) {
        return;
    }
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = daemon().await;
    let mut c = Client::connect(&d).await;
    let r = c
        .run_completed(exec_json(
            "keys",
            "python",
            &program("keys", TRY_KEYRINGS),
            30_000,
            128,
        ))
        .await;
    let out = held_or_json(&r);
    eprintln!("keyrings: inside {out}; host root: {:?}", host_keyctl());
    for call in ["add_key", "keyctl"] {
        assert_ne!(out[call], "OK", "keyrings: seccomp refuses {call}: {out}");
    }
    host_keyctl().unwrap_or_else(|e| panic!("keyrings: host root's keyctl: {e}"));
}

/// The first JSON line of an execution's stdout.
fn held_or_json(r: &Collected) -> Value {
    r.stdout_text()
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line: {}", r.dump()))
}

/// Bytes of the files under `dir` (0 when it is missing).
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

/// The artifact limits of [`artifacts_fill_the_state_disk_only_up_to_max_total_bytes`].
const ARTIFACT_FILES: u64 = 16;
const ARTIFACT_TOTAL_BYTES: u64 = 8 << 20;
/// Writes 100 random files of 1 MiB under out/.
const HUNDRED_ARTIFACTS_OF_1_MIB: &str =
    "import os\nos.makedirs('out')\nfor i in range(100):\n    open('out/f%03d' % i, 'wb').write(os.urandom(1 << 20))\n";

#[tokio::test]
async fn artifacts_fill_the_state_disk_only_up_to_max_total_bytes() {
    let test = "artifacts_fill_the_state_disk_only_up_to_max_total_bytes";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"artifacts": {
            "max_files": ARTIFACT_FILES, "max_file_bytes": 1 << 20, "max_total_bytes": ARTIFACT_TOTAL_BYTES,
        }})),
        ..DaemonOpts::default()
    })
    .await;
    let before = bytes_under(&d.state_dir);
    let mut c = Client::connect(&d).await;
    let exec = with(
        exec_json("a", "python", HUNDRED_ARTIFACTS_OF_1_MIB, 60_000, 256),
        json!({"artifacts": {"paths": ["out/*"]}, "limits": {"disk_mb": 128}}),
    );
    let r = c.run_completed(exec).await;
    let stored = bytes_under(&d.state_dir).saturating_sub(before);
    let manifest = r.result_raw()["artifacts"].clone();
    let listed = manifest["artifacts"].as_array().map_or(0, Vec::len) as u64;
    eprintln!(
        "artifacts: 100 MiB offered, {listed} listed, state dir grew by {stored} bytes (max_files {ARTIFACT_FILES}, \
         max_total_bytes {ARTIFACT_TOTAL_BYTES})"
    );
    assert!(
        listed <= ARTIFACT_FILES,
        "artifacts: at most max_files: {manifest}"
    );
    // The manifest and the store's index are small: 1 MiB of slack.
    assert!(
        stored <= ARTIFACT_TOTAL_BYTES + (1 << 20),
        "artifacts: the state dir grew by {stored} bytes, above max_total_bytes {ARTIFACT_TOTAL_BYTES}: {manifest}"
    );
    let b = c
        .run_completed(exec_json("b", "shell", "echo ok", 30_000, 64))
        .await;
    assert_eq!(b.stdout_text(), "ok\n", "artifacts: B: {}", b.dump());
}

/// The first file named `name` under `dir`, at most `depth` levels down.
fn find_file(dir: &Path, name: &str, depth: usize) -> Option<std::path::PathBuf> {
    let entries: Vec<_> = std::fs::read_dir(dir).ok()?.flatten().collect();
    if let Some(e) = entries.iter().find(|e| e.file_name() == name) {
        return Some(e.path());
    }
    let mut dirs = entries
        .iter()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()));
    dirs.find_map(|e| find_file(&e.path(), name, depth.checked_sub(1)?))
}

/// An agent sandbox's `POST /sandboxes` body: host image, no backend (nothing is uploaded).
fn agent_sandbox() -> Value {
    json!({
        "workspaceRequirements": {"resourceLimits": {"memoryMb": 256, "diskMb": 16}},
        "bootstrap": {"backendUrl": "http://127.0.0.1:9", "backendToken": "t", "agentId": "a",
                      "tokenExpiresAt": "2099-01-01T00:00:00Z",
                      "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"},
    })
}

/// Removes the agent sandbox when dropped (after [`KillOnDrop`] of its agent, declared later).
struct SandboxGuard<'a> {
    d: &'a Daemon,
    id: String,
}

impl Drop for SandboxGuard<'_> {
    fn drop(&mut self) {
        let (d, path) = (self.d, format!("/sandboxes/{}", self.id));
        let _ = std::thread::scope(|s| {
            s.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                Some(rt.block_on(agent_http(d, "DELETE", &path, &json!({}))))
            })
            .join()
        });
    }
}

#[tokio::test]
async fn neighbours_get_inotify_instances_while_an_agent_holds_all_it_can() {
    let test = "neighbours_get_inotify_instances_while_an_agent_holds_all_it_can";
    let Some(_g) = privileged_alone(test).await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"agents": {"max_sandboxes": 2}})),
        ..DaemonOpts::default()
    })
    .await;
    let (status, created) = agent_http(&d, "POST", "/sandboxes", &agent_sandbox()).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("sandbox id").to_owned();
    let _sandbox = SandboxGuard {
        d: &d,
        id: id.clone(),
    };
    let comm = fresh_comm();
    let _kill = KillOnDrop {
        comm: comm.clone(),
        cgroup_parent: d.cgroup_parent.clone(),
    };
    let code = program(&comm, HOLD_INOTIFY_INSTANCES);
    let brief =
        json!({"agentId": "a", "providerConfig": {"command": ["/usr/bin/python3", "-c", code]}});
    let (status, h) = agent_http(&d, "POST", &format!("/sandboxes/{id}/spawn"), &brief).await;
    assert_eq!(status, 200, "{h}");
    // The sandbox's tmpfs is mounted in the daemon's mount namespace.
    let in_daemon = Path::new(&format!("/proc/{}/root", d.pid()))
        .join(d.state_dir.strip_prefix("/").unwrap_or(&d.state_dir));
    let held = wait_until(
        "the agent to hold its inotify instances",
        Duration::from_secs(30),
        || async {
            let log = find_file(&in_daemon, "agent.log", 5).ok_or("no agent.log yet")?;
            let text =
                std::fs::read_to_string(&log).map_err(|e| format!("{}: {e}", log.display()))?;
            Some(held_line(&text)).filter(|v| !v.is_null()).ok_or(text)
        },
    )
    .await;
    let host = host_inotify_instance();
    let mut c = Client::connect(&d).await;
    let b = c
        .run(exec_json(
            "b",
            "python",
            &program("neighbour", ONE_INOTIFY_INSTANCE),
            30_000,
            128,
        ))
        .await;
    let (status, killed) = agent_http(
        &d,
        "POST",
        &format!("/sandboxes/{id}/kill"),
        &json!({"grace": false}),
    )
    .await;
    eprintln!(
        "agent inotify instances: agent held {held}; host root: {host:?}; kill: {status} {killed}"
    );
    assert_ne!(
        held["errno"], 0,
        "precondition: the agent took all it could: {held}"
    );
    let mut wrong = Vec::new();
    if let Err(e) = &host {
        wrong.push(format!("host root was refused: {e}"));
    }
    if (b.terminal_status(), b.stdout_text().as_str()) != (Some(ExecStatus::Completed), "ok\n") {
        wrong.push(format!("execution B was refused: {}", b.dump()));
    }
    assert!(
        wrong.is_empty(),
        "agent inotify instances: while the agent held {held}: {}",
        wrong.join("; ")
    );
    wait_until(
        "host root to get an instance after the kill",
        RELEASE_DEADLINE,
        || async { host_inotify_instance() },
    )
    .await;
}
