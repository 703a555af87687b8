//! Adversarial suite, filesystem: writes outside the working directory, the host's `/etc/shadow`, symlink
//! and `..` tricks in `files` and in artifacts, a run-time symlink to `/etc/passwd`, hard links to host files, the
//! `/proc/self/exe` overwrite of CVE-2019-5736, the leaked-fd working directory of CVE-2024-21626, the cgroup v1
//! `release_agent` escape of CVE-2022-0492, device nodes, masked and read-only `/proc` paths, and a minimal `/dev`.
//!
//! Deliberate deviation from the issue's list: `/sys` is not mounted at all (an empty directory), which is stricter
//! than a read-only `/sys`; so `/sys/firmware` and `/sys/fs/cgroup` do not exist rather than being masked or
//! read-only.

use protocol::{ErrorCode, ServerMessage};
use serde_json::{json, Value};

use super::attack::{x86_64_only, Arena, PY_SYSCALL};
use super::harness::{exec_json, privileged, with, DaemonOpts};

/// One probe of a batch: case name, python expression (helpers of [`PY_FS`]), the results that mean "contained".
type Probe = (&'static str, &'static str, &'static [&'static str]);

/// Python helpers: `e(f)` runs `f` and gives `OK` (or its value) or the errno's symbol.
const PY_FS: &str = r#"
import stat
def e(f):
    try:
        r = f()
        return "OK" if r is None else r
    except OSError as x:
        return errno.errorcode.get(x.errno, str(x.errno))
def write(path, data=b"pwned", mode="wb"):
    with open(path, mode) as f:
        f.write(data)
def read(path, n=4096):
    with open(path, "rb") as f:
        return "READ %d bytes" % len(f.read(n))
def opened(path, flags):
    os.close(os.open(path, flags))
"#;

/// Refused writes (read-only mounts, Landlock, or both).
const DENIED_WRITE: &[&str] = &["EROFS", "EACCES", "EPERM"];

const WRITE_PROBES: &[Probe] = &[
    (
        "create /usr/bin/evil",
        r#"e(lambda: write("/usr/bin/evil"))"#,
        DENIED_WRITE,
    ),
    (
        "append /usr/bin/python3",
        r#"e(lambda: write("/usr/bin/python3", mode="ab"))"#,
        &["EROFS", "EACCES", "EPERM", "ETXTBSY"],
    ),
    (
        "append /etc/passwd",
        r#"e(lambda: write("/etc/passwd", mode="ab"))"#,
        DENIED_WRITE,
    ),
    (
        "create /etc/cron.d-evil",
        r#"e(lambda: write("/etc/evil"))"#,
        DENIED_WRITE,
    ),
    ("create /evil", r#"e(lambda: write("/evil"))"#, DENIED_WRITE),
    (
        "mkdir /evil",
        r#"e(lambda: os.mkdir("/evil"))"#,
        DENIED_WRITE,
    ),
    (
        "overwrite /sandbox/main.py",
        r#"e(lambda: write("/sandbox/main.py"))"#,
        DENIED_WRITE,
    ),
    (
        "create /sandbox/evil",
        r#"e(lambda: write("/sandbox/evil"))"#,
        DENIED_WRITE,
    ),
    (
        "unlink /etc/passwd",
        r#"e(lambda: os.unlink("/etc/passwd"))"#,
        DENIED_WRITE,
    ),
    (
        "rename /etc/passwd",
        r#"e(lambda: os.rename("/etc/passwd", "/etc/passwd2"))"#,
        DENIED_WRITE,
    ),
    (
        "rename /etc/passwd into /tmp",
        r#"e(lambda: os.rename("/etc/passwd", "/tmp/passwd"))"#,
        &["EROFS", "EACCES", "EPERM", "EXDEV"],
    ),
    (
        "chmod /usr/bin/python3",
        r#"e(lambda: os.chmod("/usr/bin/python3", 0o4777))"#,
        DENIED_WRITE,
    ),
    (
        "utime /etc/passwd",
        r#"e(lambda: os.utime("/etc/passwd", (0, 0)))"#,
        DENIED_WRITE,
    ),
    (
        "truncate /etc/passwd",
        r#"e(lambda: os.truncate("/etc/passwd", 0))"#,
        DENIED_WRITE,
    ),
    (
        "write /proc/sys/kernel/hostname",
        r#"e(lambda: write("/proc/sys/kernel/hostname", b"evil"))"#,
        DENIED_WRITE,
    ),
    (
        "write /proc/sys/kernel/core_pattern",
        r#"e(lambda: write("/proc/sys/kernel/core_pattern", b"|/tmp/x"))"#,
        DENIED_WRITE,
    ),
    (
        "write /proc/sys/vm/drop_caches",
        r#"e(lambda: write("/proc/sys/vm/drop_caches", b"3"))"#,
        DENIED_WRITE,
    ),
    // Absent on kernels without CONFIG_MAGIC_SYSRQ.
    (
        "write /proc/sysrq-trigger",
        r#"e(lambda: write("/proc/sysrq-trigger", b"h"))"#,
        &["EROFS", "EACCES", "EPERM", "ENOENT"],
    ),
    (
        "write /proc/self/attr/current",
        r#"e(lambda: write("/proc/self/attr/current", b"unconfined"))"#,
        &["EROFS", "EACCES", "EPERM", "EINVAL", "ENOENT"],
    ),
    (
        "create /dev/evil",
        r#"e(lambda: write("/dev/evil"))"#,
        DENIED_WRITE,
    ),
    (
        "create /sys/evil",
        r#"e(lambda: write("/sys/evil"))"#,
        DENIED_WRITE,
    ),
    // The host path of the test's canary does not exist inside: at most a file in the sandbox's own /tmp appears.
    (
        "write the host canary's path",
        "e(lambda: (os.makedirs(os.path.dirname(CANARY), exist_ok=True), write(CANARY))[1])",
        &["OK", "EACCES", "ENOENT", "EROFS"],
    ),
];

/// Reading what belongs to the host.
const READ_PROBES: &[Probe] = &[
    // The generated /etc has no shadow file.
    (
        "read /etc/shadow",
        r#"e(lambda: read("/etc/shadow"))"#,
        &["ENOENT"],
    ),
    (
        "read /etc/gshadow",
        r#"e(lambda: read("/etc/gshadow"))"#,
        &["ENOENT"],
    ),
    (
        "read /etc/sudoers",
        r#"e(lambda: read("/etc/sudoers"))"#,
        &["ENOENT"],
    ),
    (
        "read /root/.ssh",
        r#"e(lambda: os.listdir("/root/.ssh"))"#,
        &["ENOENT"],
    ),
    (
        "read /proc/1/root/etc/shadow",
        r#"e(lambda: read("/proc/1/root/etc/shadow"))"#,
        &["EACCES", "ENOENT"],
    ),
    (
        "read /proc/1/environ",
        r#"e(lambda: read("/proc/1/environ"))"#,
        &["EACCES"],
    ),
    (
        "read /proc/1/mem",
        r#"e(lambda: read("/proc/1/mem"))"#,
        &["EACCES", "EIO"],
    ),
    (
        "list /proc/1/fd",
        r#"e(lambda: os.listdir("/proc/1/fd"))"#,
        &["EACCES"],
    ),
    (
        "readlink /proc/1/cwd",
        r#"e(lambda: os.readlink("/proc/1/cwd"))"#,
        &["EACCES"],
    ),
    (
        "list /var/lib/sandboxd",
        r#"e(lambda: os.listdir("/var/lib/sandboxd"))"#,
        &["ENOENT"],
    ),
    (
        "read the host canary",
        "e(lambda: read(CANARY))",
        &["ENOENT"],
    ),
    (
        // The host image holds /home/user, empty: the mount point of an E2B sandbox's home. Nothing of the host's
        // /home is there.
        "list /home",
        r#"e(lambda: "only an empty user" if os.listdir("/home") == ["user"] and os.listdir("/home/user") == [] else os.listdir("/home"))"#,
        &["ENOENT", "only an empty user"],
    ),
];

/// Masked paths: read empty or refused (or absent on this kernel).
const MASKED: &[&str] = &["", "READ 0 bytes", "EACCES", "EPERM", "ENOENT"];
const MASK_PROBES: &[Probe] = &[
    (
        "read /proc/kcore",
        r#"e(lambda: read("/proc/kcore"))"#,
        MASKED,
    ),
    (
        "read /proc/keys",
        r#"e(lambda: read("/proc/keys"))"#,
        MASKED,
    ),
    (
        "read /proc/timer_list",
        r#"e(lambda: read("/proc/timer_list"))"#,
        MASKED,
    ),
    (
        "read /proc/sched_debug",
        r#"e(lambda: read("/proc/sched_debug"))"#,
        MASKED,
    ),
    (
        "read /proc/latency_stats",
        r#"e(lambda: read("/proc/latency_stats"))"#,
        MASKED,
    ),
    (
        "read /proc/timer_stats",
        r#"e(lambda: read("/proc/timer_stats"))"#,
        MASKED,
    ),
    (
        "list /proc/acpi",
        r#"e(lambda: "%d entries" % len(os.listdir("/proc/acpi")))"#,
        &["0 entries", "ENOENT", "EACCES"],
    ),
    (
        "list /proc/scsi",
        r#"e(lambda: "%d entries" % len(os.listdir("/proc/scsi")))"#,
        &["0 entries", "ENOENT", "EACCES"],
    ),
    (
        "list /sys/firmware",
        r#"e(lambda: os.listdir("/sys/firmware"))"#,
        &["ENOENT"],
    ),
    (
        "read /proc/kmsg",
        r#"e(lambda: read("/proc/kmsg"))"#,
        &["EACCES", "EPERM", "ENOENT"],
    ),
    (
        "read /dev/kmsg",
        r#"e(lambda: read("/dev/kmsg"))"#,
        &["ENOENT"],
    ),
    (
        "read /dev/mem",
        r#"e(lambda: read("/dev/mem"))"#,
        &["ENOENT"],
    ),
];

/// Device nodes: none can be created, anywhere.
const MKNOD_PROBES: &[Probe] = &[
    (
        "mknod char /tmp/null",
        "e(lambda: os.mknod('/tmp/null', stat.S_IFCHR | 0o666, os.makedev(1, 3)))",
        &["EPERM", "EACCES"],
    ),
    (
        "mknod char /workspace/mem",
        "e(lambda: os.mknod('/workspace/mem', stat.S_IFCHR | 0o600, os.makedev(1, 1)))",
        &["EPERM", "EACCES"],
    ),
    (
        "mknod block /tmp/sda",
        "e(lambda: os.mknod('/tmp/sda', stat.S_IFBLK | 0o600, os.makedev(8, 0)))",
        &["EPERM", "EACCES"],
    ),
    (
        "mknod char /dev/shm/kmsg",
        "e(lambda: os.mknod('/dev/shm/kmsg', stat.S_IFCHR | 0o600, os.makedev(1, 11)))",
        &["EPERM", "EACCES"],
    ),
    (
        "mknod char /dev/evil",
        "e(lambda: os.mknod('/dev/evil', stat.S_IFCHR | 0o600, os.makedev(1, 1)))",
        &["EPERM", "EACCES", "EROFS"],
    ),
];

/// Runs a batch of probes as one attack; every probe must give one of its contained results.
async fn batch(a: &mut Arena, name: &str, probes: &[Probe], extra_setup: &str) -> Value {
    let mut code = format!(
        "{PY_SYSCALL}{PY_FS}{extra_setup}\nCANARY = {:?}\nout = {{}}\n",
        a.canary.display().to_string()
    );
    for (case, expr, _) in probes {
        code.push_str(&format!("out[{case:?}] = {expr}\n"));
    }
    code.push_str("print(json.dumps(out))\n");
    let out = a.attack_py(name, &code, json!({})).await;
    let mut wrong = Vec::new();
    for (case, expr, ok) in probes {
        let got = out[*case].as_str().unwrap_or("not a string");
        if ok.contains(&got) {
            a.contained(case);
        } else {
            wrong.push(format!(
                "{case} [{expr}]: {}, expected one of {ok:?}",
                out[*case]
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: not contained:\n  {}\n(all: {out})",
        wrong.join("\n  ")
    );
    out
}

#[tokio::test]
async fn writes_reads_masks_and_device_nodes_outside_the_working_dir_are_refused() {
    let Some(_g) =
        privileged("writes_reads_masks_and_device_nodes_outside_the_working_dir_are_refused").await
    else {
        return;
    };
    let mut a = Arena::start("filesystem", DaemonOpts::default()).await;
    batch(&mut a, "writes outside the working dir", WRITE_PROBES, "").await;
    batch(&mut a, "host files", READ_PROBES, "").await;
    batch(&mut a, "masked paths", MASK_PROBES, "").await;
    batch(&mut a, "device nodes", MKNOD_PROBES, "").await;

    // The allowed side: the working dir, /tmp and /dev/shm are writable, fifos may be made, /dev is minimal.
    let case = "writable dirs and a minimal /dev";
    let code = format!(
        r#"{PY_SYSCALL}{PY_FS}
out = {{}}
for d in ("/workspace", "/tmp", "/dev/shm"):
    out[d] = e(lambda: write(d + "/ok"))
out["mkfifo"] = e(lambda: os.mkfifo("/tmp/fifo"))
out["dev"] = sorted(os.listdir("/dev"))
out["dev/null"] = e(lambda: write("/dev/null"))
out["sys"] = os.listdir("/sys")
out["passwd"] = open("/etc/passwd").read()
print(json.dumps(out))
"#
    );
    let out = a.attack_py(case, &code, json!({})).await;
    for k in ["/workspace", "/tmp", "/dev/shm", "mkfifo", "dev/null"] {
        assert_eq!(out[k], "OK", "{case}: {k}: {out}");
    }
    let allowed = [
        "null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "ptmx", "fd", "stdin",
        "stdout", "stderr", "core", "console", "mqueue",
    ];
    let dev: Vec<&str> = out["dev"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let extra: Vec<_> = dev.iter().filter(|n| !allowed.contains(n)).collect();
    assert!(
        extra.is_empty(),
        "{case}: /dev holds more than the minimal set: {extra:?}"
    );
    for n in [
        "null", "zero", "full", "random", "urandom", "tty", "pts", "shm",
    ] {
        assert!(dev.contains(&n), "{case}: /dev/{n} is missing: {dev:?}");
    }
    assert_eq!(out["sys"], json!([]), "{case}: /sys is not mounted: {out}");
    let passwd = out["passwd"].as_str().unwrap();
    assert!(
        passwd.starts_with("root:x:0:0:root:/workspace:/bin/sh\n"),
        "{case}: the generated /etc/passwd: {out}"
    );
    a.contained(case);
    a.finish();
}

/// Paths of `files` that would leave the working directory, each written as one file.
const ESCAPING_FILE_PATHS: &[&str] = &[
    "../escape",
    "../../../../etc/cron.d/evil",
    "/etc/passwd",
    "a/../../escape",
    "a/..",
    "./x",
    "a//b",
    "a/",
    "",
    "nul\u{0}byte",
];

/// `(case, files)` of executions whose `files` must be refused: [`ESCAPING_FILE_PATHS`], then the cases that take
/// more than one path.
fn refused_files() -> Vec<(String, Value)> {
    let mut cases: Vec<(String, Value)> = ESCAPING_FILE_PATHS
        .iter()
        .map(|path| {
            (
                format!("files path {path:?}"),
                json!([{"path": path, "content": "pwned"}]),
            )
        })
        .collect();
    cases.push((
        "files: a file used as a directory".into(),
        json!([{"path": "a", "content": "x"}, {"path": "a/b", "content": "y"}]),
    ));
    cases.push((
        "files: path longer than PATH_MAX".into(),
        json!([{"path": "d/".repeat(2100) + "f", "content": "x"}]),
    ));
    cases
}

/// Symlinks made at run time resolve inside the container; hard links to the image fail. The first probe has no
/// contained results listed: its result is the file content, checked by the test.
const LINK_PROBES: &[Probe] = &[
    (
        "symlink to /etc/passwd, read",
        r#"e(lambda: (os.symlink("/etc/passwd", "/workspace/pw"), open("/workspace/pw").read())[1])"#,
        &[],
    ),
    (
        "symlink to /etc/shadow, read",
        r#"e(lambda: (os.symlink("/etc/shadow", "/tmp/sh"), read("/tmp/sh"))[1])"#,
        &["ENOENT"],
    ),
    (
        "symlink to ../../../etc/passwd, write",
        r#"e(lambda: (os.symlink("../../../../etc/passwd", "/workspace/up"), write("/workspace/up", mode="ab"))[1])"#,
        DENIED_WRITE,
    ),
    (
        "symlink to /proc/1/root, list",
        r#"e(lambda: (os.symlink("/proc/1/root", "/workspace/root1"), os.listdir("/workspace/root1/"))[1])"#,
        &["EACCES"],
    ),
    (
        "hard link /usr/bin/python3",
        r#"e(lambda: os.link("/usr/bin/python3", "/workspace/py"))"#,
        &["EXDEV", "EPERM", "EACCES"],
    ),
    (
        "hard link /etc/passwd",
        r#"e(lambda: os.link("/etc/passwd", "/tmp/passwd"))"#,
        &["EXDEV", "EPERM", "EACCES"],
    ),
    (
        "hard link /sandbox/main.py",
        r#"e(lambda: os.link("/sandbox/main.py", "/workspace/main.py"))"#,
        &["EXDEV", "EPERM", "EACCES"],
    ),
    (
        "linkat an open fd of python3",
        "e(lambda: link_fd('/usr/bin/python3', '/workspace/py2'))",
        &["EXDEV", "EPERM", "EACCES", "ENOENT"],
    ),
    (
        "rename /usr/bin/python3 into /workspace",
        r#"e(lambda: os.rename("/usr/bin/python3", "/workspace/py3"))"#,
        &["EXDEV", "EROFS", "EPERM", "EACCES"],
    ),
];
/// `link_fd(src, dst)` for [`LINK_PROBES`]: hard-links an open descriptor of `src`.
const LINK_SETUP: &str = r#"
def link_fd(src, dst):
    fd = os.open(src, os.O_RDONLY)
    # linkat(fd, "", AT_FDCWD, dst, AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH; via /proc/self/fd it does not.
    r, err = sc(265, -100, ("/proc/self/fd/%d" % fd).encode(), -100, dst.encode(), 0x400)
    if r < 0:
        raise OSError(err, os.strerror(err))
"#;
/// Makes /workspace/out a symlink to /etc, and `leak` and `shadow` symlinks to host files.
const ARTIFACT_SYMLINKS: &str = "import os\nos.symlink('/etc', '/workspace/out')\nos.symlink('/etc/passwd', '/workspace/leak')\n\
                                 os.symlink('/proc/1/root/etc/shadow', '/workspace/shadow')\nprint('linked')\n";

#[tokio::test]
async fn symlinks_hard_links_and_dot_dot_tricks_stay_inside() {
    let Some(_g) = privileged("symlinks_hard_links_and_dot_dot_tricks_stay_inside").await else {
        return;
    };
    if !x86_64_only("symlinks_hard_links_and_dot_dot_tricks_stay_inside") {
        return;
    }
    let mut a = Arena::start("filesystem", DaemonOpts::default()).await;
    let host_passwd = std::fs::read_to_string("/etc/passwd").unwrap();

    files_outside_the_working_dir_are_refused(&mut a).await;
    run_time_links_resolve_inside_the_container(&mut a, &host_passwd).await;
    artifact_symlinks_are_skipped_not_followed(&mut a).await;
    a.finish();
}

/// `files` that would leave the working directory, a file and a directory of the same name, and a path longer
/// than PATH_MAX: refused with INVALID_REQUEST before anything runs.
async fn files_outside_the_working_dir_are_refused(a: &mut Arena) {
    for (case, files) in refused_files() {
        let r = a
            .attack(&case, |id| {
                with(
                    exec_json(id, "shell", "echo ran", 10_000, 64),
                    json!({ "files": files }),
                )
            })
            .await;
        match r.messages.as_slice() {
            [ServerMessage::Error(e)] => {
                assert_eq!(e.code, ErrorCode::InvalidRequest, "{case}: {}", r.dump())
            }
            _ => panic!(
                "{case}: not refused with INVALID_REQUEST alone: {}",
                r.dump()
            ),
        }
        a.contained(&case);
    }
}

/// [`LINK_PROBES`]; the symlink to /etc/passwd shows the container's generated file, not `host_passwd`.
async fn run_time_links_resolve_inside_the_container(a: &mut Arena, host_passwd: &str) {
    let out = batch_allowing_content(a, "symlinks and hard links", LINK_PROBES, LINK_SETUP).await;
    let seen = out["symlink to /etc/passwd, read"].as_str().unwrap();
    assert!(
        seen.starts_with("root:x:0:0:root:/workspace:/bin/sh\n") && seen != host_passwd,
        "the run-time symlink to /etc/passwd shows the container's generated file, not the host's: {seen:?}"
    );
    a.contained("symlink to /etc/passwd, read");
}

/// Artifacts that are symlinks to host files, or a symlinked directory: skipped, never followed.
async fn artifact_symlinks_are_skipped_not_followed(a: &mut Arena) {
    let case = "artifact symlinks to host files";
    let r = a
        .attack(case, |id| {
            with(
                exec_json(id, "python", ARTIFACT_SYMLINKS, 20_000, 128),
                json!({"artifacts": {"paths": ["out/**", "leak", "shadow"]}}),
            )
        })
        .await;
    let manifest = r.result_raw()["artifacts"].clone();
    eprintln!("{case}: {manifest}");
    assert_eq!(
        manifest["artifacts"],
        json!([]),
        "{case}: nothing is collected through a symlink: {manifest}"
    );
    let skipped: Vec<(String, String)> = manifest["skipped"]
        .as_array()
        .unwrap_or_else(|| panic!("{case}: a manifest with `skipped`: {}", r.dump()))
        .iter()
        .map(|s| {
            (
                s["path"].as_str().unwrap_or("").to_owned(),
                s["reason"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    for p in ["leak", "shadow"] {
        assert!(
            skipped.contains(&(p.to_owned(), "symlink".to_owned())),
            "{case}: {p} is skipped as a symlink: {manifest}"
        );
    }
    a.contained(case);
}

/// Like [`batch`], but a probe with no contained results listed is returned as is (its content is checked by the
/// caller).
async fn batch_allowing_content(a: &mut Arena, name: &str, probes: &[Probe], setup: &str) -> Value {
    let open: Vec<Probe> = probes.iter().filter(|p| p.2.is_empty()).copied().collect();
    let checked: Vec<Probe> = probes.iter().filter(|p| !p.2.is_empty()).copied().collect();
    let mut all = open.clone();
    all.extend(checked.iter().copied());
    let mut code = format!(
        "{PY_SYSCALL}{PY_FS}{setup}\nCANARY = {:?}\nout = {{}}\n",
        a.canary.display().to_string()
    );
    for (case, expr, _) in &all {
        code.push_str(&format!("out[{case:?}] = {expr}\n"));
    }
    code.push_str("print(json.dumps(out))\n");
    let out = a.attack_py(name, &code, json!({})).await;
    let mut wrong = Vec::new();
    for (case, expr, ok) in &checked {
        let got = out[*case].as_str().unwrap_or("not a string");
        if ok.contains(&got) {
            a.contained(case);
        } else {
            wrong.push(format!(
                "{case} [{expr}]: {}, expected one of {ok:?}",
                out[*case]
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: not contained:\n  {}\n(all: {out})",
        wrong.join("\n  ")
    );
    out
}

/// CVE-2019-5736: overwrite the runtime's binary through /proc/<pid>/exe. Here pid 1 is sandboxd's own init (a
/// fork of the daemon: its exe is the host's sandboxd binary) and the program's exe is the host's python.
const PROC_EXE_PROBES: &[Probe] = &[
    (
        "open /proc/self/exe for writing",
        "e(lambda: opened('/proc/self/exe', os.O_WRONLY))",
        &["ETXTBSY", "EROFS", "EACCES", "EPERM"],
    ),
    (
        "open /proc/self/exe O_RDWR|O_TRUNC",
        "e(lambda: opened('/proc/self/exe', os.O_RDWR | os.O_TRUNC))",
        &["ETXTBSY", "EROFS", "EACCES", "EPERM"],
    ),
    (
        "open /proc/1/exe for writing",
        "e(lambda: opened('/proc/1/exe', os.O_WRONLY))",
        &["EACCES", "EPERM"],
    ),
    (
        "open /proc/1/exe for reading",
        "e(lambda: opened('/proc/1/exe', os.O_RDONLY))",
        &["EACCES", "EPERM"],
    ),
    (
        "readlink /proc/1/exe",
        "e(lambda: os.readlink('/proc/1/exe'))",
        &["EACCES", "EPERM"],
    ),
    (
        "O_PATH /proc/self/exe, reopen for writing",
        "e(lambda: reopen_exe())",
        &["ETXTBSY", "EROFS", "EACCES", "EPERM"],
    ),
    (
        "write a child's /proc/<pid>/exe after it exits",
        "e(lambda: child_exe())",
        &["ETXTBSY", "EROFS", "EACCES", "EPERM", "ENOENT"],
    ),
    (
        "ptrace pid 1",
        "errname(sc(101, 16, 1, 0, 0)[1])",
        &["EPERM"],
    ),
];
/// `reopen_exe()` and `child_exe()` for [`PROC_EXE_PROBES`].
const PROC_EXE_SETUP: &str = r#"
def reopen_exe():
    fd = os.open("/proc/self/exe", os.O_PATH)
    opened("/proc/self/fd/%d" % fd, os.O_WRONLY)
def child_exe():
    import subprocess
    p = subprocess.Popen(["/bin/sh", "-c", "read x"], stdin=subprocess.PIPE)
    fd = os.open("/proc/%d/exe" % p.pid, os.O_PATH)
    p.stdin.close(); p.wait()
    opened("/proc/self/fd/%d" % fd, os.O_WRONLY)
"#;
/// The program's cwd, the descriptors open above 2 and those `fchdir` accepts, and a `chdir` to pid 1's cwd (after
/// [`PY_SYSCALL`]).
const LEAKED_FD_PROBE: &str = r#"
out = {}
out["cwd"] = os.getcwd()
out["proc cwd"] = os.readlink("/proc/self/cwd")
open_fds = []
fchdir = []
for fd in range(3, 1024):
    try:
        os.fstat(fd)
        open_fds.append(fd)
    except OSError:
        pass
    r, err = sc(81, fd)
    if r == 0:
        fchdir.append(fd)
out["open fds above 2"] = open_fds
out["fchdir ok"] = fchdir
out["proc self fd"] = sorted(int(x) for x in os.listdir("/proc/self/fd"))
out["fd targets"] = [os.readlink("/proc/self/fd/%d" % i) for i in (0, 1, 2)]
try:
    os.chdir("/proc/1/cwd")
    out["chdir /proc/1/cwd"] = "OK " + os.getcwd()
except OSError as e:
    out["chdir /proc/1/cwd"] = errname(e.errno)
print(json.dumps(out))
"#;
/// Mounts of cgroup v1 and v2, what of cgroupfs is visible, and `unshare` of user and cgroup namespaces (after
/// [`PY_SYSCALL`]).
const CGROUP_RELEASE_AGENT_PROBE: &str = r#"
import subprocess
out = {}
os.makedirs("/tmp/cg", exist_ok=True)
for opt in (b"rdma", b"memory", b"none,name=x"):
    out["mount cgroup " + opt.decode()] = errname(sc(165, b"cgroup", b"/tmp/cg", b"cgroup", 0, opt)[1])
out["mount cgroup2"] = errname(sc(165, b"cgroup2", b"/tmp/cg", b"cgroup2", 0, 0)[1])
out["fsopen cgroup"] = errname(sc(430, b"cgroup", 0)[1])
out["/sys/fs/cgroup"] = os.path.exists("/sys/fs/cgroup")
out["release_agent anywhere"] = [p for p in ("/sys/fs/cgroup/release_agent", "/sys/fs/cgroup/rdma/release_agent")
                                 if os.path.exists(p)]
out["/proc/self/cgroup"] = sorted(set(l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines()))
for args in (["unshare", "-UrmC", "sh", "-c", "mount -t cgroup -o rdma cgroup /tmp/cg && echo mounted"],
             ["unshare", "-C", "true"], ["unshare", "-U", "true"], ["unshare", "-r", "true"]):
    p = subprocess.run(args, capture_output=True, text=True)
    out[" ".join(args[:2])] = [p.returncode, p.stdout.strip(), p.stderr.strip()[-80:]]
print(json.dumps(out))
"#;

#[tokio::test]
async fn container_breakout_cves_are_contained() {
    let Some(_g) = privileged("container_breakout_cves_are_contained").await else {
        return;
    };
    if !x86_64_only("container_breakout_cves_are_contained") {
        return;
    }
    let mut a = Arena::start("filesystem", DaemonOpts::default()).await;

    cve_2019_5736_proc_exe_cannot_be_overwritten(&mut a).await;
    cve_2024_21626_no_descriptor_leaks_in(&mut a).await;
    cve_2022_0492_no_cgroup_release_agent_is_reachable(&mut a).await;
    a.finish();
}

/// CVE-2019-5736: [`PROC_EXE_PROBES`] fail, and the host's binaries are unchanged.
async fn cve_2019_5736_proc_exe_cannot_be_overwritten(a: &mut Arena) {
    let name = "CVE-2019-5736 /proc/self/exe overwrite";
    batch(a, name, PROC_EXE_PROBES, PROC_EXE_SETUP).await;
    a.assert_binaries_unchanged(name);
}

/// CVE-2024-21626: a descriptor of the runtime leaked into the container (a host directory as cwd via
/// /proc/self/fd/N). The program starts with fds 0, 1 and 2 only, in /workspace, from python and from a shell.
async fn cve_2024_21626_no_descriptor_leaks_in(a: &mut Arena) {
    let case = "CVE-2024-21626 leaked fd cwd";
    let code = format!("{PY_SYSCALL}{LEAKED_FD_PROBE}");
    let out = a.attack_py(case, &code, json!({})).await;
    assert_eq!(out["cwd"], "/workspace", "{case}: {out}");
    assert_eq!(out["proc cwd"], "/workspace", "{case}: {out}");
    assert_eq!(
        out["open fds above 2"],
        json!([]),
        "{case}: only fds 0, 1, 2 at start: {out}"
    );
    assert_eq!(out["fchdir ok"], json!([]), "{case}: {out}");
    // listdir's own descriptor is the 4th.
    assert_eq!(out["proc self fd"], json!([0, 1, 2, 3]), "{case}: {out}");
    assert_eq!(out["chdir /proc/1/cwd"], "EACCES", "{case}: {out}");
    a.contained(case);
    // The same from a shell: its cwd and descriptors.
    let case = "CVE-2024-21626 leaked fd cwd (shell)";
    let r = a
        .attack(case, |id| {
            exec_json(
                id,
                "shell",
                "pwd; ls /proc/self/fd | tr '\\n' ' '",
                20_000,
                64,
            )
        })
        .await;
    // `ls` itself holds fd 3 (the directory it lists).
    assert_eq!(
        r.stdout_text(),
        "/workspace\n0 1 2 3 ",
        "{case}: {}",
        r.dump()
    );
    a.contained(case);
}

/// CVE-2022-0492: mount a cgroup v1 hierarchy and set its release_agent. Mounting fails (seccomp, no caps), no
/// cgroupfs is visible, and new user or cgroup namespaces cannot be made to get the capability.
async fn cve_2022_0492_no_cgroup_release_agent_is_reachable(a: &mut Arena) {
    let case = "CVE-2022-0492 cgroup release_agent";
    let code = format!("{PY_SYSCALL}{CGROUP_RELEASE_AGENT_PROBE}");
    let out = a.attack_py(case, &code, json!({})).await;
    for k in [
        "mount cgroup rdma",
        "mount cgroup memory",
        "mount cgroup none,name=x",
        "mount cgroup2",
        "fsopen cgroup",
    ] {
        assert_eq!(out[k], "EPERM", "{case}: {k}: {out}");
    }
    assert_eq!(out["/sys/fs/cgroup"], false, "{case}: {out}");
    assert_eq!(out["release_agent anywhere"], json!([]), "{case}: {out}");
    assert_eq!(
        out["/proc/self/cgroup"],
        json!(["/"]),
        "{case}: the cgroup namespace hides the host's cgroup paths: {out}"
    );
    for k in ["unshare -UrmC", "unshare -C", "unshare -U", "unshare -r"] {
        let r = &out[k];
        assert!(
            r[0] != 0 && r[1] != "mounted",
            "{case}: `{k}` must fail: {out}"
        );
    }
    a.contained(case);
}
