//! Adversarial suite, syscalls: every call the seccomp profile denies is tried from inside the sandbox with
//! raw `syscall(2)` and must fail with the profile's errno: `EPERM` for the known-dangerous ones and argument
//! patterns (namespace flags of `clone`, socket families and raw sockets, `TIOCSTI`/`TIOCLINUX` with or without high
//! bits), `ENOSYS` for `clone3` (so glibc falls back to `clone`) and for calls the profile does not list. The
//! arguments are chosen so that, without the filter, the call would succeed or fail with another errno: the errno
//! proves the filter, not just the missing capability. Each batch also shows the allowed calls with allowed
//! arguments still working.

use serde_json::{json, Value};

use super::attack::{x86_64_only, Arena, PY_SYSCALL};
use super::harness::{privileged, DaemonOpts};

/// One denied call: case name, the python call (`sc(NR, ...)`, names from [`SETUP`] available), the errno it
/// must fail with.
type Probe = (&'static str, &'static str, &'static str);

/// Objects the probes use.
const SETUP: &str = r#"
pid = os.getpid()
rfd, wfd = os.pipe()
AT_FDCWD = -100
buf = ctypes.create_string_buffer(4096)
fh = ctypes.create_string_buffer(8 + 128)
ctypes.c_uint.from_buffer(fh).value = 128
mnt_id = ctypes.c_int(0)
sv = (ctypes.c_int * 2)()
def try_clone(flags):
    # Raw clone(2) with fork semantics: the child (return value 0) leaves at once.
    r, e = sc(56, flags | 17, 0, 0, 0, 0)
    if r == 0:
        os._exit(0)
    if r > 0:
        os.waitpid(r, 0)
        return r, 0
    return r, e
"#;

/// Processes and memory of others.
const PROCESS_PROBES: &[Probe] = &[
    // PTRACE_TRACEME: allowed to anyone without the filter.
    ("ptrace(PTRACE_TRACEME)", "sc(101, 0, 0, 0, 0)", "EPERM"),
    // Zero iovecs of its own pid: returns 0 without the filter.
    ("process_vm_readv", "sc(310, pid, 0, 0, 0, 0, 0)", "EPERM"),
    ("process_vm_writev", "sc(311, pid, 0, 0, 0, 0, 0)", "EPERM"),
    // KCMP_FILE of its own fd 0 with itself: 0 without the filter.
    ("kcmp", "sc(312, pid, pid, 0, 0, 0)", "EPERM"),
    ("migrate_pages", "sc(256, pid, 0, 0, 0)", "EPERM"),
    ("move_pages", "sc(279, pid, 0, 0, 0, 0, 0)", "EPERM"),
    ("set_mempolicy_home_node", "sc(450, 0, 0, 0, 0)", "EPERM"),
];

/// The mount family.
const MOUNT_PROBES: &[Probe] = &[
    (
        "mount(tmpfs)",
        r#"sc(165, b"none", b"/tmp", b"tmpfs", 0, 0)"#,
        "EPERM",
    ),
    ("umount2", r#"sc(166, b"/tmp", 0)"#, "EPERM"),
    ("fsopen", r#"sc(430, b"tmpfs", 0)"#, "EPERM"),
    // EBADF without the filter.
    ("fsconfig", "sc(431, -1, 0, 0, 0, 0)", "EPERM"),
    ("fsmount", "sc(432, -1, 0, 0)", "EPERM"),
    ("fspick", r#"sc(433, AT_FDCWD, b"/tmp", 0)"#, "EPERM"),
    ("move_mount", r#"sc(429, -1, b"", -1, b"", 0)"#, "EPERM"),
    // Without OPEN_TREE_CLONE this is an O_PATH open anyone may do: only the filter refuses it.
    ("open_tree", r#"sc(428, AT_FDCWD, b"/tmp", 0)"#, "EPERM"),
    ("mount_setattr", r#"sc(442, -1, b"", 0, 0, 0)"#, "EPERM"),
    ("pivot_root", r#"sc(155, b"/tmp", b"/tmp")"#, "EPERM"),
    ("chroot", r#"sc(161, b"/tmp")"#, "EPERM"),
];

/// Namespaces: unshare, setns, clone with each CLONE_NEW* flag.
const NAMESPACE_PROBES: &[Probe] = &[
    // unshare(0) succeeds without the filter.
    ("unshare(0)", "sc(272, 0)", "EPERM"),
    ("unshare(CLONE_NEWUSER)", "sc(272, 0x10000000)", "EPERM"),
    ("unshare(CLONE_NEWNS)", "sc(272, 0x00020000)", "EPERM"),
    ("unshare(CLONE_NEWCGROUP)", "sc(272, 0x02000000)", "EPERM"),
    ("unshare(CLONE_NEWNET)", "sc(272, 0x40000000)", "EPERM"),
    // A pipe is not a namespace: EINVAL without the filter.
    ("setns", "sc(308, rfd, 0)", "EPERM"),
    ("setns(/proc/1/ns/mnt)", "setns_init()", "EPERM"),
    ("clone(CLONE_NEWNS)", "try_clone(0x00020000)", "EPERM"),
    ("clone(CLONE_NEWCGROUP)", "try_clone(0x02000000)", "EPERM"),
    ("clone(CLONE_NEWUTS)", "try_clone(0x04000000)", "EPERM"),
    ("clone(CLONE_NEWIPC)", "try_clone(0x08000000)", "EPERM"),
    ("clone(CLONE_NEWUSER)", "try_clone(0x10000000)", "EPERM"),
    ("clone(CLONE_NEWPID)", "try_clone(0x20000000)", "EPERM"),
    ("clone(CLONE_NEWNET)", "try_clone(0x40000000)", "EPERM"),
    // In clone(2) this bit is part of the exit signal (the kernel would say EINVAL); the filter says EPERM.
    ("clone(CLONE_NEWTIME bit)", "try_clone(0x00000080)", "EPERM"),
    (
        "clone(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWPID)",
        "try_clone(0x30020000)",
        "EPERM",
    ),
    // The kernel keeps the low 32 bits of the flags: high bits must not hide the namespace flag.
    (
        "clone(CLONE_NEWUSER | 1<<32)",
        "try_clone((1 << 32) | 0x10000000)",
        "EPERM",
    ),
    // clone3 answers ENOSYS so that glibc falls back to clone, where the flags are visible to the filter.
    ("clone3", "sc(435, 0, 0)", "ENOSYS"),
];

/// Keyrings, BPF, perf, userfaultfd, io_uring.
const KERNEL_SURFACE_PROBES: &[Probe] = &[
    // KEYCTL_GET_KEYRING_ID of the session keyring: works without the filter.
    ("keyctl", "sc(250, 0, -3, 0)", "EPERM"),
    (
        "add_key",
        r#"sc(248, b"user", b"sandboxd-test", b"x", 1, -2)"#,
        "EPERM",
    ),
    (
        "request_key",
        r#"sc(249, b"user", b"sandboxd-test", 0, 0)"#,
        "EPERM",
    ),
    // An unknown command: EINVAL without the filter.
    ("bpf", "sc(321, 1000, 0, 0)", "EPERM"),
    ("perf_event_open", "sc(298, 0, 0, -1, -1, 0)", "EPERM"),
    ("userfaultfd", "sc(323, 0)", "EPERM"),
    ("io_uring_setup", "sc(425, 1, buf)", "EPERM"),
    ("io_uring_enter", "sc(426, -1, 0, 0, 0, 0, 0)", "EPERM"),
    ("io_uring_register", "sc(427, -1, 0, 0, 0)", "EPERM"),
    ("fanotify_init", "sc(300, 0, 0)", "EPERM"),
];

/// Modules, kexec, reboot, swap, accounting, handles, quotas, clocks, the kernel log, I/O ports, obsolete calls.
const SYSTEM_PROBES: &[Probe] = &[
    ("init_module", r#"sc(175, 0, 0, b"")"#, "EPERM"),
    ("finit_module", r#"sc(313, -1, b"", 0)"#, "EPERM"),
    (
        "delete_module",
        r#"sc(176, b"sandboxd_test_none", 0)"#,
        "EPERM",
    ),
    ("kexec_load", "sc(246, 0, 0, 0, 0)", "EPERM"),
    ("kexec_file_load", r#"sc(320, -1, -1, 0, b"", 0)"#, "EPERM"),
    // A wrong magic number: never a real reboot, whatever happens.
    ("reboot", "sc(169, 0, 0, 0, 0)", "EPERM"),
    ("swapon", r#"sc(167, b"/tmp/none", 0)"#, "EPERM"),
    ("swapoff", r#"sc(168, b"/tmp/none")"#, "EPERM"),
    ("acct", "sc(163, 0)", "EPERM"),
    ("open_by_handle_at", "sc(304, AT_FDCWD, fh, 0)", "EPERM"),
    // Allowed to anyone without the filter.
    (
        "name_to_handle_at",
        r#"sc(303, AT_FDCWD, b"/tmp", fh, ctypes.byref(mnt_id), 0)"#,
        "EPERM",
    ),
    ("quotactl", "sc(179, 0, 0, 0, 0)", "EPERM"),
    ("quotactl_fd", "sc(443, -1, 0, 0, 0)", "EPERM"),
    // Both NULL: a no-op that succeeds without the filter.
    ("settimeofday", "sc(164, 0, 0)", "EPERM"),
    ("clock_settime", "sc(227, 0, 0)", "EPERM"),
    // modes 0 is a read-only query that succeeds without the filter.
    ("clock_adjtime", "sc(305, 0, buf)", "EPERM"),
    ("adjtimex", "sc(159, buf)", "EPERM"),
    // SYSLOG_ACTION_SIZE_BUFFER.
    ("syslog", "sc(103, 10, 0, 0)", "EPERM"),
    // Lowering the level to 0 succeeds without the filter.
    ("iopl", "sc(172, 0)", "EPERM"),
    ("ioperm", "sc(173, 0, 0, 0)", "EPERM"),
    ("lookup_dcookie", "sc(212, 0, 0, 0)", "EPERM"),
    ("vhangup", "sc(153)", "EPERM"),
    // sysfs(3): the number of filesystem types without the filter.
    ("sysfs", "sc(139, 3)", "EPERM"),
    ("ustat", "sc(136, 0, buf)", "EPERM"),
    ("uselib", r#"sc(134, b"/tmp/none")"#, "EPERM"),
];

/// Calls the profile does not list: ENOSYS. Several would succeed (or say EBADF/EFAULT) without the filter.
const UNLISTED_PROBES: &[Probe] = &[
    ("modify_ldt", "sc(154, 0, buf, 16)", "ENOSYS"),
    ("process_madvise", "sc(440, -1, 0, 0, 0, 0)", "ENOSYS"),
    ("process_mrelease", "sc(448, -1, 0)", "ENOSYS"),
    ("fanotify_mark", "sc(301, -1, 0, 0, 0, 0)", "ENOSYS"),
    ("remap_file_pages", "sc(216, 0, 0, 0, 0, 0)", "ENOSYS"),
    ("memfd_secret", "sc(447, 0)", "ENOSYS"),
    // Mount introspection (kernel 6.8+): would list the sandbox's mount ids.
    ("statmount", "sc(457, 0, 0, 0, 0)", "ENOSYS"),
    ("listmount", "sc(458, 0, 0, 0, 0)", "ENOSYS"),
    ("lsm_get_self_attr", "sc(459, 0, 0, 0, 0)", "ENOSYS"),
    // A mount-API call newer than the profile's syscall table (kernel 6.15): an O_PATH open without the filter.
    (
        "open_tree_attr",
        r#"sc(467, AT_FDCWD, b"/tmp", 0, 0, 0)"#,
        "ENOSYS",
    ),
];

/// Socket families and types.
const SOCKET_PROBES: &[Probe] = &[
    // AF_PACKET, SOCK_RAW, htons(ETH_P_ALL).
    (
        "socket(AF_PACKET, SOCK_RAW)",
        "sc(41, 17, 3, 0x0300)",
        "EPERM",
    ),
    (
        "socket(AF_PACKET, SOCK_DGRAM)",
        "sc(41, 17, 2, 0x0300)",
        "EPERM",
    ),
    // Netlink is allowed to anyone without the filter; the profile keeps NETLINK_ROUTE only (interface and
    // address listings of the loopback-only namespace; changes need CAP_NET_ADMIN).
    (
        "socket(AF_NETLINK, SOCK_DGRAM, NETLINK_AUDIT)",
        "sc(41, 16, 2, 9)",
        "EPERM",
    ),
    (
        "socket(AF_NETLINK, SOCK_RAW, NETLINK_SOCK_DIAG)",
        "sc(41, 16, 3, 4)",
        "EPERM",
    ),
    (
        "socket(AF_NETLINK, SOCK_RAW, NETLINK_KOBJECT_UEVENT)",
        "sc(41, 16, 3, 15)",
        "EPERM",
    ),
    (
        "socket(AF_NETLINK, SOCK_RAW, NETLINK_GENERIC)",
        "sc(41, 16, 3, 16)",
        "EPERM",
    ),
    (
        "socket(AF_NETLINK, SOCK_RAW, NETLINK_AUDIT | 1<<32)",
        "sc(41, 16, 3, (1 << 32) | 9)",
        "EPERM",
    ),
    // The hypervisor's channel on a microVM host.
    ("socket(AF_VSOCK, SOCK_STREAM)", "sc(41, 40, 1, 0)", "EPERM"),
    (
        "socket(AF_ALG, SOCK_SEQPACKET)",
        "sc(41, 38, 5, 0)",
        "EPERM",
    ),
    ("socket(AF_KEY, SOCK_RAW)", "sc(41, 15, 3, 2)", "EPERM"),
    ("socket(AF_XDP, SOCK_RAW)", "sc(41, 44, 3, 0)", "EPERM"),
    ("socket(AF_BLUETOOTH)", "sc(41, 31, 3, 0)", "EPERM"),
    ("socket(AF_TIPC, SOCK_RDM)", "sc(41, 30, 4, 0)", "EPERM"),
    ("socket(AF_CAN, SOCK_RAW)", "sc(41, 29, 3, 1)", "EPERM"),
    (
        "socket(AF_INET, SOCK_RAW, ICMP)",
        "sc(41, 2, 3, 1)",
        "EPERM",
    ),
    (
        "socket(AF_INET6, SOCK_RAW|SOCK_NONBLOCK|SOCK_CLOEXEC)",
        "sc(41, 10, 3 | 0x800 | 0x80000, 58)",
        "EPERM",
    ),
    (
        "socket(AF_INET, SOCK_PACKET)",
        "sc(41, 2, 10, 0x0300)",
        "EPERM",
    ),
    // The kernel reads family and type as int: the high 32 bits must not hide them from the filter.
    (
        "socket(AF_PACKET | 1<<32)",
        "sc(41, (1 << 32) | 17, 3, 0x0300)",
        "EPERM",
    ),
    (
        "socket(AF_INET, SOCK_RAW | 1<<32)",
        "sc(41, 2, (1 << 32) | 3, 1)",
        "EPERM",
    ),
];

/// Terminal ioctls (the request is compared as the 32-bit value the kernel uses).
const IOCTL_PROBES: &[Probe] = &[
    (
        "ioctl(pty, TIOCSTI)",
        r#"sc(16, pty_slave, 0x5412, b"x")"#,
        "EPERM",
    ),
    (
        "ioctl(pty, TIOCSTI | 1<<32)",
        r#"sc(16, pty_slave, 0x100005412, b"x")"#,
        "EPERM",
    ),
    (
        "ioctl(pty, TIOCSTI | 0xffffffff<<32)",
        r#"sc(16, pty_slave, 0xffffffff00005412, b"x")"#,
        "EPERM",
    ),
    // On a pipe: ENOTTY without the filter.
    (
        "ioctl(stdin, TIOCSTI)",
        r#"sc(16, 0, 0x5412, b"x")"#,
        "EPERM",
    ),
    (
        "ioctl(pty, TIOCLINUX)",
        "sc(16, pty_slave, 0x541C, buf)",
        "EPERM",
    ),
    (
        "ioctl(pty, TIOCLINUX | 1<<32)",
        "sc(16, pty_slave, 0x10000541C, buf)",
        "EPERM",
    ),
    // Setting N_TTY again succeeds on one's own pty without the filter; other line disciplines are kernel code
    // (n_gsm, n_hdlc, ...) with a history of bugs.
    (
        "ioctl(pty, TIOCSETD, N_TTY)",
        "sc(16, pty_slave, 0x5423, ctypes.byref(ctypes.c_int(0)))",
        "EPERM",
    ),
    (
        "ioctl(pty, TIOCSETD | 1<<32, N_TTY)",
        "sc(16, pty_slave, 0x100005423, ctypes.byref(ctypes.c_int(0)))",
        "EPERM",
    ),
];

/// `personality` beyond querying and `PER_LINUX`/`PER_LINUX32` (each succeeds without the filter), and
/// `RLIMIT_CORE` changes (lowering to 0 succeeds without the filter, and 0 does not stop a piped `core_pattern`).
const PERSONALITY_AND_CORE_PROBES: &[Probe] = &[
    (
        "personality(ADDR_NO_RANDOMIZE)",
        "sc(135, 0x0040000)",
        "EPERM",
    ),
    (
        "personality(READ_IMPLIES_EXEC)",
        "sc(135, 0x0400000)",
        "EPERM",
    ),
    ("personality(UNAME26)", "sc(135, 0x0020000)", "EPERM"),
    (
        "personality(ADDR_COMPAT_LAYOUT)",
        "sc(135, 0x0200000)",
        "EPERM",
    ),
    (
        "personality(PER_LINUX32 | ADDR_NO_RANDOMIZE)",
        "sc(135, 0x0040008)",
        "EPERM",
    ),
    (
        "personality(ADDR_NO_RANDOMIZE | 1<<32)",
        "sc(135, (1 << 32) | 0x0040000)",
        "EPERM",
    ),
    (
        "setrlimit(RLIMIT_CORE, 0/0)",
        "sc(160, 4, (ctypes.c_ulong * 2)(0, 0))",
        "EPERM",
    ),
    (
        "prlimit64(0, RLIMIT_CORE, 0/0)",
        "sc(302, 0, 4, (ctypes.c_ulong * 2)(0, 0), 0)",
        "EPERM",
    ),
    (
        "prlimit64(0, RLIMIT_CORE | 1<<32, 0/0)",
        "sc(302, 0, (1 << 32) | 4, (ctypes.c_ulong * 2)(0, 0), 0)",
        "EPERM",
    ),
];

/// A pty for the ioctls (devpts is mounted with newinstance; fall back to stdin if there is none).
const PTY_SETUP: &str = r#"
try:
    pty_master, pty_slave = os.openpty()
    pty_note = "pty"
except OSError as e:
    pty_master, pty_slave = 0, 0
    pty_note = "no pty: " + errname(e.errno)
def setns_init():
    try:
        fd = os.open("/proc/1/ns/mnt", os.O_RDONLY)
    except OSError as e:
        # The init is not dumpable: its namespace files cannot even be opened. Use our own.
        fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    return sc(308, fd, 0)
"#;

/// Builds the probe program: every probe's errno as a symbol, in one JSON object.
fn program(probes: &[Probe], extra: &str) -> String {
    let mut code = format!("{PY_SYSCALL}{SETUP}{PTY_SETUP}\nout = {{}}\n");
    for (case, call, _) in probes {
        code.push_str(&format!(
            "try:\n    out[{case:?}] = errname(({call})[1])\nexcept Exception as e:\n    out[{case:?}] = \"python: \" + repr(e)\n"
        ));
    }
    code.push_str(extra);
    code.push_str("\nout['_pty'] = pty_note\nprint(json.dumps(out))\n");
    code
}

/// Runs one batch of probes as one attack execution; every probe must fail with its errno.
async fn batch(a: &mut Arena, name: &str, probes: &[Probe]) -> Value {
    let out = a.attack_py(name, &program(probes, ""), json!({})).await;
    let mut wrong = Vec::new();
    for (case, call, want) in probes {
        let got = out[*case].as_str().unwrap_or("missing");
        if got == *want {
            a.contained(case);
        } else {
            wrong.push(format!("{case} [{call}]: {got}, expected {want}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: denied syscalls that did not fail as the profile says:\n  {}\n(all: {out})",
        wrong.join("\n  ")
    );
    out
}

async fn arena(test: &str) -> Option<(super::harness::Guard, Arena)> {
    let g = privileged(test).await?;
    if !x86_64_only(test) {
        return None;
    }
    Some((g, Arena::start("syscalls", DaemonOpts::default()).await))
}

#[tokio::test]
async fn denied_process_mount_and_namespace_syscalls_fail_with_eperm() {
    let Some((_g, mut a)) =
        arena("denied_process_mount_and_namespace_syscalls_fail_with_eperm").await
    else {
        return;
    };
    batch(&mut a, "process", PROCESS_PROBES).await;
    batch(&mut a, "mount", MOUNT_PROBES).await;
    batch(&mut a, "namespaces", NAMESPACE_PROBES).await;
    a.finish();
}

#[tokio::test]
async fn denied_kernel_surface_and_system_syscalls_fail_with_eperm() {
    let Some((_g, mut a)) =
        arena("denied_kernel_surface_and_system_syscalls_fail_with_eperm").await
    else {
        return;
    };
    batch(&mut a, "kernel-surface", KERNEL_SURFACE_PROBES).await;
    batch(&mut a, "system", SYSTEM_PROBES).await;
    batch(&mut a, "unlisted", UNLISTED_PROBES).await;
    a.finish();
}

#[tokio::test]
async fn raw_and_foreign_sockets_and_terminal_injection_fail_with_eperm() {
    let Some((_g, mut a)) =
        arena("raw_and_foreign_sockets_and_terminal_injection_fail_with_eperm").await
    else {
        return;
    };
    batch(&mut a, "sockets", SOCKET_PROBES).await;
    batch(&mut a, "personality and core", PERSONALITY_AND_CORE_PROBES).await;
    let out = batch(&mut a, "ioctl", IOCTL_PROBES).await;
    assert_eq!(
        out["_pty"], "pty",
        "the TIOCSTI probes ran on a pty (devpts newinstance): {out}"
    );

    // socketpair(2) is allowed without argument checks: it must not hand out a socket of another family either
    // (on this kernel only AF_UNIX and AF_TIPC implement socketpair).
    let code = format!(
        "{PY_SYSCALL}{SETUP}\nout = {{}}\nfor fam in (16, 17, 30, 38, 40, 44):\n    r, e = sc(53, fam, 2, 0, sv)\n    \
         out[str(fam)] = errname(e)\n    if r == 0:\n        os.close(sv[0]); os.close(sv[1])\nprint(json.dumps(out))\n"
    );
    let out = a
        .attack_py("socketpair(other families)", &code, json!({}))
        .await;
    let got: Vec<_> = out
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| *v == "OK")
        .collect();
    assert!(
        got.is_empty(),
        "socketpair created sockets of families the profile denies: {got:?} (all: {out})"
    );
    a.contained("socketpair(other families)");
    a.finish();
}

/// Every key of `want` has its value in `out`; otherwise fails with `what` and every difference.
fn assert_matches(out: &Value, want: &Value, what: &str) {
    let mut wrong = Vec::new();
    for (k, v) in want.as_object().unwrap() {
        if &out[k] != v {
            wrong.push(format!("{k}: {} (expected {v})", out[k]));
        }
    }
    assert!(
        wrong.is_empty(),
        "{what}:\n  {}\n(all: {out})",
        wrong.join("\n  ")
    );
}

#[tokio::test]
async fn allowed_syscalls_with_allowed_arguments_still_work() {
    let Some((_g, mut a)) = arena("allowed_syscalls_with_allowed_arguments_still_work").await
    else {
        return;
    };
    let code = format!(
        r#"{PY_SYSCALL}{SETUP}{PTY_SETUP}
import fcntl, socket, struct, subprocess, termios, threading
out = {{}}
def check(name, f):
    try:
        out[name] = f()
    except Exception as e:
        out[name] = "failed: " + repr(e)
# clone without namespace flags: fork, threads, posix_spawn (glibc tries clone3, gets ENOSYS, falls back to clone).
def fork():
    p = os.fork()
    if p == 0:
        os._exit(7)
    return os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
check("fork", fork)
check("raw clone(SIGCHLD)", lambda: "OK" if try_clone(0)[1] == 0 else "failed")
def thread():
    box = []
    t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
    t.start(); t.join()
    return len(box)
check("thread", thread)
check("subprocess", lambda: subprocess.run(["/bin/sh", "-c", "exit 3"]).returncode)
check("vfork+exec", lambda: subprocess.run(["true"], close_fds=False).returncode)
# sockets of the allowed families and types
def tcp():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0)); srv.listen(1)
    cli = socket.create_connection(srv.getsockname(), timeout=5)
    conn, _ = srv.accept()
    cli.sendall(b"ping"); return conn.recv(4).decode()
check("socket(AF_INET, SOCK_STREAM)", tcp)
check("socket(AF_INET6, SOCK_DGRAM)", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).family.name)
check("socket(AF_INET, SOCK_DGRAM|SOCK_CLOEXEC)", lambda: errname(sc(41, 2, 2 | 0x80000, 0)[1]))
def unix():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendall(b"hi"); return b.recv(2).decode()
check("socketpair(AF_UNIX)", unix)
# ioctl with allowed requests
def fionread():
    os.write(wfd, b"12345")
    n = struct.unpack("i", fcntl.ioctl(rfd, termios.FIONREAD, b"\0\0\0\0"))[0]
    os.read(rfd, 5); return n
check("ioctl(pipe, FIONREAD)", fionread)
check("ioctl(pty, TIOCGWINSZ)", lambda: len(fcntl.ioctl(pty_slave, termios.TIOCGWINSZ, b"\0" * 8)))
# the rest of everyday life
def time_ok():
    import time
    return time.clock_gettime(time.CLOCK_MONOTONIC) > 0
check("clock_gettime", time_ok)
check("getrandom", lambda: len(os.urandom(16)))
check("memfd_create", lambda: os.memfd_create("x") > 2)
check("mkfifo", lambda: (os.mkfifo("/tmp/fifo"), "OK")[1])
check("prctl(PR_GET_NO_NEW_PRIVS)", lambda: sc(157, 39, 0, 0, 0, 0)[0])
check("landlock_create_ruleset(version)", lambda: sc(444, 0, 0, 1)[0] >= 1)
check("setuid(0)", lambda: (os.setuid(0), "OK")[1])
check("personality(query)", lambda: sc(135, 0xffffffff)[0])
check("personality(PER_LINUX32), then PER_LINUX", lambda: [sc(135, 8)[0], sc(135, 0)[0], sc(135, 0xffffffff)[0]])
check("getrlimit(RLIMIT_CORE) via prlimit64", lambda: (lambda old: [sc(302, 0, 4, 0, old)[1] or "OK", list(old)])((ctypes.c_ulong * 2)()))
check("setrlimit(RLIMIT_NOFILE, 64)", lambda: errname(sc(160, 7, (ctypes.c_ulong * 2)(64, 64))[1]))
check("ioctl(pty, TIOCGETD)", lambda: struct.unpack("i", fcntl.ioctl(pty_slave, 0x5424, b"\0" * 4))[0])
def setuid1():
    try:
        os.setuid(1)
        return "OK"
    except OSError as e:
        return errname(e.errno)
check("setuid(1)", setuid1)
out["_pty"] = pty_note
print(json.dumps(out))
"#
    );
    let out = a.attack_py("allowed calls", &code, json!({})).await;
    let want = json!({
        "fork": 7,
        "raw clone(SIGCHLD)": "OK",
        "thread": 1,
        "subprocess": 3,
        "vfork+exec": 0,
        "socket(AF_INET, SOCK_STREAM)": "ping",
        "socket(AF_INET6, SOCK_DGRAM)": "AF_INET6",
        "socket(AF_INET, SOCK_DGRAM|SOCK_CLOEXEC)": "OK",
        "socketpair(AF_UNIX)": "hi",
        "ioctl(pipe, FIONREAD)": 5,
        "ioctl(pty, TIOCGWINSZ)": 8,
        "clock_gettime": true,
        "getrandom": 16,
        "memfd_create": true,
        "mkfifo": "OK",
        "prctl(PR_GET_NO_NEW_PRIVS)": 1,
        "landlock_create_ruleset(version)": true,
        "setuid(0)": "OK",
        "personality(query)": 0,
        "personality(PER_LINUX32), then PER_LINUX": [0, 8, 0],
        "getrlimit(RLIMIT_CORE) via prlimit64": ["OK", [1, 1]],
        "setrlimit(RLIMIT_NOFILE, 64)": "OK",
        "ioctl(pty, TIOCGETD)": 0,
        // Only uid 0 is mapped in the user namespace.
        "setuid(1)": "EINVAL",
        "_pty": "pty",
    });
    assert_matches(&out, &want, "allowed calls broken by the hardening");
    a.contained("allowed calls still work");
    a.finish();
}

/// The i386 ABI through `int 0x80` (after [`PY_SYSCALL`]): `int80(nr, ebx)` runs the call in a child and says how
/// the child ended.
const I386_PROBE: &str = r#"
import mmap, struct
def int80(nr, ebx=0):
    # mov eax, nr; mov ebx, arg; int 0x80; ret
    code = b"\xb8" + struct.pack("<I", nr) + b"\xbb" + struct.pack("<I", ebx) + b"\xcd\x80\xc3"
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, str(f()).encode())
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    ret = os.read(r, 100).decode()
    if os.WIFSIGNALED(status):
        return "killed by signal %d" % os.WTERMSIG(status)
    return "returned " + ret
out = {}
out["i386 getpid"] = int80(20)
out["i386 unshare(0)"] = int80(310)
out["i386 mount"] = int80(21)
print(json.dumps(out))
"#;

/// The x32 ABI (syscall number | 0x40000000), not in the allowlist; allowed calls with arguments that need
/// privileges the sandbox does not have; and a filter of the program's own. A probe may give its result as a third
/// element instead of an errno.
const X32_AND_PRIVILEGED_ARGUMENT_PROBES: &[Probe] = &[
    ("x32 unshare(0)", "sc(0x40000000 | 272, 0)", "ENOSYS"),
    (
        "x32 mount",
        r#"sc(0x40000000 | 165, b"none", b"/tmp", b"tmpfs", 0, 0)"#,
        "ENOSYS",
    ),
    (
        "x32 socket(AF_PACKET)",
        "sc(0x40000000 | 41, 17, 3, 0x0300)",
        "ENOSYS",
    ),
    (
        "x32 ioctl(TIOCSTI)",
        r#"sc(0x40000000 | 514, pty_slave, 0x5412, b"x")"#,
        "ENOSYS",
    ),
    (
        "x32 clone(CLONE_NEWUSER)",
        "sc(0x40000000 | 56, 0x10000000 | 17, 0, 0, 0, 0)",
        "ENOSYS",
    ),
    // Allowed calls with arguments that need privileges the sandbox does not have.
    (
        "sched_setscheduler(SCHED_FIFO)",
        "sc(144, 0, 1, ctypes.byref(ctypes.c_int(50)))",
        "EPERM",
    ),
    ("setpriority(-20)", "sc(141, 0, 0, -20)", "EACCES"),
    (
        "ioprio_set(IOPRIO_CLASS_RT)",
        "sc(251, 1, 0, (1 << 13) | 0)",
        "EPERM",
    ),
    ("sethostname", r#"sc(170, b"evil", 4)"#, "EPERM"),
    (
        "setrlimit(RLIMIT_NOFILE, 1M)",
        "sc(160, 7, (ctypes.c_ulong * 2)(1 << 20, 1 << 20))",
        "EPERM",
    ),
    (
        "prctl(PR_SET_NO_NEW_PRIVS, 0)",
        "sc(157, 38, 0, 0, 0, 0)",
        "EINVAL",
    ),
    (
        "prctl(PR_CAP_AMBIENT_RAISE, CAP_SYS_ADMIN)",
        "sc(157, 47, 2, 21, 0, 0)",
        "EPERM",
    ),
    // An allow-all filter of its own is stacked below the sandbox's: unshare stays denied.
    (
        "own allow-all seccomp filter, then unshare",
        "own_filter_then_unshare()",
        "EPERM",
    ),
];

/// `own_filter_then_unshare()`: installs an allow-all seccomp filter in a child, then tries `unshare(0)` there;
/// returns the errno's name as its third element.
const OWN_FILTER_SETUP: &str = r#"
def own_filter_then_unshare():
    import struct
    insn = struct.pack("<HBBI", 0x06, 0, 0, 0x7fff0000)  # BPF_RET | BPF_K, SECCOMP_RET_ALLOW
    prog_buf = ctypes.create_string_buffer(insn)
    prog = struct.pack("<HxxxxxxQ", 1, ctypes.addressof(prog_buf))
    prog_c = ctypes.create_string_buffer(prog)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        res, err = sc(317, 1, 0, prog_c)
        if res != 0:
            os.write(w, ("seccomp: " + errname(err)).encode())
            os._exit(0)
        os.write(w, errname(sc(272, 0)[1]).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    return 0, 0, os.read(r, 100).decode()
"#;

#[tokio::test]
async fn other_abis_own_filters_and_privileged_arguments_gain_nothing() {
    let Some((_g, mut a)) =
        arena("other_abis_own_filters_and_privileged_arguments_gain_nothing").await
    else {
        return;
    };

    i386_syscalls_kill_the_process(&mut a).await;
    x32_calls_and_privileged_arguments_fail(&mut a).await;
    a.finish();
}

/// The i386 ABI through `int 0x80`: the filters check the architecture first and kill the process (SIGSYS).
async fn i386_syscalls_kill_the_process(a: &mut Arena) {
    let case = "i386 ABI (int 0x80)";
    let code = format!("{PY_SYSCALL}{I386_PROBE}");
    let out = a.attack_py(case, &code, json!({})).await;
    for k in ["i386 getpid", "i386 unshare(0)", "i386 mount"] {
        assert_eq!(
            out[k], "killed by signal 31",
            "{case}: {k}: a foreign-architecture syscall kills the process with SIGSYS: {out}"
        );
    }
    a.contained(case);
}

/// Every one of [`X32_AND_PRIVILEGED_ARGUMENT_PROBES`] fails with its errno.
async fn x32_calls_and_privileged_arguments_fail(a: &mut Arena) {
    let probes = X32_AND_PRIVILEGED_ARGUMENT_PROBES;
    let mut code = format!("{PY_SYSCALL}{SETUP}{PTY_SETUP}{OWN_FILTER_SETUP}\nout = {{}}\n");
    for (case, call, _) in probes {
        code.push_str(&format!(
            "try:\n    res = ({call})\n    out[{case:?}] = res[2] if len(res) == 3 else errname(res[1])\n\
             except Exception as e:\n    out[{case:?}] = \"python: \" + repr(e)\n"
        ));
    }
    code.push_str("print(json.dumps(out))\n");
    let out = a
        .attack_py("other ABIs and privileged arguments", &code, json!({}))
        .await;
    let mut wrong = Vec::new();
    for (case, call, want) in probes {
        if out[*case] == *want {
            a.contained(case);
        } else {
            wrong.push(format!("{case} [{call}]: {}, expected {want}", out[*case]));
        }
    }
    assert!(
        wrong.is_empty(),
        "not contained:\n  {}\n(all: {out})",
        wrong.join("\n  ")
    );
}

#[tokio::test]
async fn pong_and_healthz_report_the_layers_in_effect() {
    let Some((_g, mut a)) = arena("pong_and_healthz_report_the_layers_in_effect").await else {
        return;
    };
    let pong = a.c.ping().await;
    let iso = pong
        .capabilities
        .as_ref()
        .expect("pong.capabilities")
        .isolation
        .clone();
    let mut ns = iso.namespaces.clone();
    ns.sort();
    assert_eq!(
        ns,
        ["cgroup", "ipc", "mount", "net", "pid", "user", "uts"],
        "{iso:?}"
    );
    assert!(iso.seccomp && iso.user_namespace, "{iso:?}");
    assert!(iso.landlock_abi.is_some_and(|abi| abi >= 3), "{iso:?}");
    assert_eq!(iso.network, "loopback-only", "{iso:?}");
    let (code, health) = a.d.healthz().await;
    assert_eq!(code, 200);
    assert_eq!(
        health["isolation"],
        serde_json::to_value(&iso).unwrap(),
        "/healthz and pong agree: {health}"
    );
    // What the program sees agrees with what is reported.
    let out = a
        .attack_py(
            "layers seen from inside",
            "import json\nst = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n\
             print(json.dumps({k: st[k].strip() for k in ('Seccomp', 'NoNewPrivs', 'CapEff')}))\n",
            json!({}),
        )
        .await;
    assert_eq!(
        out,
        json!({"Seccomp": "2", "NoNewPrivs": "1", "CapEff": "0000000000000000"})
    );
    a.contained("layers seen from inside");
    a.finish();
}
