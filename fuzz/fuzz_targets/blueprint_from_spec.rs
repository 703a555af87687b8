//! `runtime::direct::plan::Blueprint::from_spec`, the check between a bundle's `config.json` and the direct start,
//! fed specs made by mutating what `runtime::spec::build` produces: the input picks a `ContainerPlan`, builds its
//! spec, turns it into JSON and applies a few structure-aware edits (set, remove, insert a key of the OCI schema,
//! push, swap, graft another part of the spec), then parses the result as an OCI `Spec` (as the helper does).
//!
//! Property: a spec the direct start accepts asks for nothing it would not apply, and nothing spec::build's output
//! rules out. Precisely, when `from_spec` accepts the mutated spec:
//! - every setting present in it (after the OCI types' own parsing: a key they do not know is dropped, as the
//!   helper drops it) is one `from_spec` reads, refuses or checks empty ([`READ`]), or one the start has no use for
//!   by design ([`NOT_NEEDED`]: the program and environment travel on the launch channel, metadata, other
//!   platforms). Anything else would be silently skipped;
//! - the Blueprint keeps what every spec::build output gives: uid and gid mapped to the same single host id, every
//!   OCI default masked and read-only path, binds with nosuid and nodev, a fresh tmpfs at `/dev` if anything is
//!   mounted there, proc only as a fresh proc.
//!
//! Any other difference from the original spec is applied as written (a mount option is a flag or mount data, an
//! rlimit is set), which the start does with libcontainer's meaning.
#![no_main]

use std::path::{Path, PathBuf};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nix::mount::MsFlags;
use oci_spec::runtime::{get_default_maskedpaths, get_default_readonly_paths, Spec};
use runtime::direct::plan::{Blueprint, MountKind};
use runtime::spec::{build, BindMount, ContainerPlan};
use serde_json::{Map, Value};

/// The container's cgroup, as the helper passes it.
const CGROUPS_PATH: &str = "/sandboxd/e1";

/// Settings `from_spec` reads, refuses, or checks empty: a key path (`[]` for any array element) with everything
/// under it.
const READ: &[&str] = &[
    "root.path",
    "root.readonly",
    "hostname",
    "domainname",
    "hooks",
    "mounts[].destination",
    "mounts[].type",
    "mounts[].source",
    "mounts[].options",
    "process.terminal",
    "process.user.uid",
    "process.user.gid",
    "process.user.umask",
    "process.user.additionalGids",
    "process.cwd",
    "process.capabilities",
    "process.rlimits",
    "process.noNewPrivileges",
    "process.apparmorProfile",
    "process.oomScoreAdj",
    "process.selinuxLabel",
    "process.ioPriority",
    "process.scheduler",
    "process.execCPUAffinity",
    "linux.namespaces",
    "linux.uidMappings",
    "linux.gidMappings",
    "linux.cgroupsPath",
    "linux.sysctl",
    "linux.devices",
    "linux.seccomp",
    "linux.intelRdt",
    "linux.mountLabel",
    "linux.memoryPolicy",
    "linux.personality",
    "linux.timeOffsets",
    "linux.netDevices",
    "linux.rootfsPropagation",
    "linux.maskedPaths",
    "linux.readonlyPaths",
    "linux.resources.devices",
    "linux.resources.memory",
    "linux.resources.cpu",
    "linux.resources.pids",
    "linux.resources.blockIO",
    "linux.resources.hugepageLimits",
    "linux.resources.network",
    "linux.resources.rdma",
    "linux.resources.unified",
];

/// Settings the direct start has no use for, by design.
const NOT_NEEDED: &[&str] = &[
    // The launch channel carries the program and its environment (runtime::launch).
    "process.args",
    "process.env",
    // Metadata.
    "ociVersion",
    "annotations",
    // Only with a terminal, which is refused.
    "process.consoleSize",
    // Windows, Solaris, VM and z/OS settings, which no Linux runtime applies.
    "process.commandLine",
    "process.user.username",
    "windows",
    "solaris",
    // oci-spec's deprecated top-level mappings: not in the OCI spec, read by no runtime (libcontainer neither).
    "uidMappings",
    "gidMappings",
    "vm",
    "zos",
];

/// Keys of the OCI runtime schema (and a few near misses), so edits reach fields spec::build never writes.
const KEYS: &[&str] = &[
    "access",
    "additionalGids",
    "allow",
    "ambient",
    "annotations",
    "apparmorProfile",
    "args",
    "blockIO",
    "bounding",
    "capabilities",
    "cgroupsPath",
    "classID",
    "commandLine",
    "consoleSize",
    "containerID",
    "cpu",
    "cpus",
    "createContainer",
    "createRuntime",
    "cwd",
    "defaultAction",
    "destination",
    "devices",
    "disableOOMKiller",
    "domainname",
    "effective",
    "env",
    "execCPUAffinity",
    "fileMode",
    "flags",
    "gid",
    "gidMappings",
    "hard",
    "height",
    "hooks",
    "hostID",
    "hostname",
    "hugepageLimits",
    "idle",
    "inheritable",
    "intelRdt",
    "ioPriority",
    "kernel",
    "kernelTCP",
    "limit",
    "linux",
    "major",
    "maskedPaths",
    "memory",
    "memoryPolicy",
    "mems",
    "minor",
    "mode",
    "mountLabel",
    "mounts",
    "namespaces",
    "netDevices",
    "network",
    "nice",
    "noNewPrivileges",
    "ociVersion",
    "oomScoreAdj",
    "options",
    "path",
    "period",
    "permitted",
    "personality",
    "pids",
    "policy",
    "poststart",
    "poststop",
    "prestart",
    "priority",
    "process",
    "quota",
    "rdma",
    "readonly",
    "readonlyPaths",
    "realtimePeriod",
    "realtimeRuntime",
    "reservation",
    "resources",
    "rlimits",
    "root",
    "rootfsPropagation",
    "scheduler",
    "seccomp",
    "selinuxLabel",
    "shares",
    "size",
    "soft",
    "solaris",
    "source",
    "startContainer",
    "swap",
    "swappiness",
    "syscalls",
    "sysctl",
    "terminal",
    "timeOffsets",
    "type",
    "uid",
    "uidMappings",
    "umask",
    "unified",
    "useHierarchy",
    "user",
    "username",
    "vm",
    "weight",
    "width",
    "windows",
    "zos",
    "class",
    "domain",
    "name",
    "names",
    "nodes",
    "secs",
    "nanosecs",
    "architectures",
    "errnoRet",
    "value",
    "op",
    "timeout",
];

/// Strings worth trying: paths, mount types and options, capabilities, namespaces, rlimits.
const STRINGS: &[&str] = &[
    "/",
    "/proc",
    "/dev",
    "/dev/pts",
    "/dev/shm",
    "/sys",
    "/usr",
    "/etc/shadow",
    "..",
    "/a/../b",
    "a/b",
    "",
    "bind",
    "rbind",
    "tmpfs",
    "proc",
    "devpts",
    "sysfs",
    "mqueue",
    "cgroup",
    "cgroup2",
    "overlay",
    "ro",
    "rw",
    "suid",
    "dev",
    "exec",
    "nosuid",
    "nodev",
    "noexec",
    "strictatime",
    "relatime",
    "noatime",
    "shared",
    "rshared",
    "private",
    "rprivate",
    "slave",
    "unbindable",
    "remount",
    "sync",
    "mode=755",
    "size=1k",
    "newinstance",
    "ptmxmode=0666",
    "gid=0",
    "hidepid=2",
    "CAP_SYS_ADMIN",
    "CAP_NET_RAW",
    "CAP_SETUID",
    "pid",
    "network",
    "mount",
    "ipc",
    "uts",
    "user",
    "cgroup",
    "time",
    "RLIMIT_NPROC",
    "RLIMIT_CORE",
    "RLIMIT_AS",
    "RLIMIT_RTPRIO",
    "RLIMIT_NOFILE",
    "/proc/kcore",
    "/proc/sys",
    "/proc/sched_debug",
    "/sandboxd/e1",
    "/proc/self/ns/net",
    "/proc/1/ns/pid",
    "sandbox",
    "1.0.2",
    "a\0b",
    "max",
    "10:200",
    "SCMP_ACT_ALLOW",
];

#[derive(Arbitrary, Debug)]
enum Str {
    Known(u8),
    Any(String),
}

impl Str {
    fn get(&self, table: &[&str]) -> String {
        match self {
            Str::Known(i) => table[usize::from(*i) % table.len()].to_owned(),
            Str::Any(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Num {
    Small(i8),
    Special(u8),
    Any(i64),
    Big(u64),
}

const SPECIAL: &[i64] = &[
    0,
    1,
    -1,
    65534,
    200_003,
    4_294_967_295,
    4_294_967_296,
    i64::MAX,
    i64::MIN,
];

/// A JSON value to put in the spec.
#[derive(Arbitrary, Debug)]
enum Gen {
    Null,
    Bool(bool),
    Num(Num),
    Str(Str),
    Array(Vec<Gen>),
    Object(Vec<(Str, Gen)>),
}

impl Gen {
    fn value(&self) -> Value {
        match self {
            Gen::Null => Value::Null,
            Gen::Bool(b) => Value::Bool(*b),
            Gen::Num(Num::Small(n)) => Value::from(*n),
            Gen::Num(Num::Special(i)) => Value::from(SPECIAL[usize::from(*i) % SPECIAL.len()]),
            Gen::Num(Num::Any(n)) => Value::from(*n),
            Gen::Num(Num::Big(n)) => Value::from(*n),
            Gen::Str(s) => Value::String(s.get(STRINGS)),
            Gen::Array(items) => items.iter().map(Gen::value).collect(),
            Gen::Object(fields) => Value::Object(
                fields
                    .iter()
                    .map(|(k, v)| (k.get(KEYS), v.value()))
                    .collect(),
            ),
        }
    }
}

/// One edit, at the node `at` leads to (each byte picks a child; the walk stops at a leaf).
#[derive(Arbitrary, Debug)]
struct Edit {
    at: Vec<u8>,
    op: Op,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Set(Gen),
    Remove,
    Insert(Str, Gen),
    Push(Gen),
    Swap(u8, u8),
    /// Copy of the original spec's node at this path.
    Graft(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    host_id: u32,
    readonly_root: bool,
    binds: Vec<(u8, bool)>,
    memory_bytes: u32,
    pids_max: u16,
    cpu_shares: u16,
    nofile: u16,
    shm_bytes: u32,
    edits: Vec<Edit>,
}

const BINDS: &[(&str, &str)] = &[
    ("/usr", "/usr"),
    ("/var/lib/sandboxd/x/work", "/workspace"),
    ("/lib", "/lib"),
    ("/var/lib/sandboxd/x/code", "/sandbox"),
];

fn plan(input: &Input) -> ContainerPlan {
    ContainerPlan {
        rootfs: "/var/lib/sandboxd/rootfs".into(),
        readonly_root: input.readonly_root,
        hostname: "sandbox".into(),
        args: vec!["/bin/sh".into()],
        env: vec!["PATH=/usr/bin:/bin".into()],
        cwd: "/workspace".into(),
        binds: input
            .binds
            .iter()
            .take(4)
            .map(|(i, readonly)| {
                let (source, destination) = BINDS[usize::from(*i) % BINDS.len()];
                BindMount {
                    source: source.into(),
                    destination: destination.into(),
                    readonly: *readonly,
                }
            })
            .collect(),
        host_id: input.host_id.max(1),
        cgroups_path: CGROUPS_PATH.into(),
        memory_bytes: i64::from(input.memory_bytes) + 1,
        pids_max: i64::from(input.pids_max) + 1,
        cpu_shares: u64::from(input.cpu_shares) + 2,
        nofile: u64::from(input.nofile) + 1,
        fsize_bytes: 1 << 30,
        shm_bytes: u64::from(input.shm_bytes),
    }
}

/// The node `at` leads to: each byte picks a child (modulo their number); the walk stops early at a leaf.
fn walk<'a>(node: &'a mut Value, at: &[u8]) -> &'a mut Value {
    let Some((first, rest)) = at.split_first() else {
        return node;
    };
    let children = match &*node {
        Value::Object(m) => m.len(),
        Value::Array(a) => a.len(),
        _ => 0,
    };
    if children == 0 {
        return node;
    }
    let i = usize::from(*first) % children;
    match node {
        Value::Object(m) => match m.values_mut().nth(i) {
            Some(v) => walk(v, rest),
            None => unreachable!("index below the map's length"),
        },
        Value::Array(a) => walk(&mut a[i], rest),
        _ => unreachable!("only objects and arrays have children"),
    }
}

fn apply(spec: &mut Value, original: &Value, edit: &Edit) {
    let graft = match &edit.op {
        Op::Graft(from) => Some(walk(&mut original.clone(), from).clone()),
        _ => None,
    };
    // Remove acts on the parent's entry: walk to the parent, drop the child the last byte picks.
    if let (Op::Remove, Some((last, parent_at))) = (&edit.op, edit.at.split_last()) {
        match walk(spec, parent_at) {
            Value::Object(m) if !m.is_empty() => {
                if let Some(k) = m.keys().nth(usize::from(*last) % m.len()).cloned() {
                    m.remove(&k);
                }
            }
            Value::Array(a) if !a.is_empty() => {
                let n = a.len();
                a.remove(usize::from(*last) % n);
            }
            _ => {}
        }
        return;
    }
    let node = walk(spec, &edit.at);
    match &edit.op {
        Op::Set(g) => *node = g.value(),
        Op::Remove => *node = Value::Null,
        Op::Insert(k, g) => {
            if let Value::Object(m) = node {
                m.insert(k.get(KEYS), g.value());
            }
        }
        Op::Push(g) => {
            if let Value::Array(a) = node {
                a.push(g.value());
            }
        }
        Op::Swap(i, j) => {
            if let Value::Array(a) = node {
                if !a.is_empty() {
                    let n = a.len();
                    a.swap(usize::from(*i) % n, usize::from(*j) % n);
                }
            }
        }
        Op::Graft(_) => {
            if let Some(g) = graft {
                *node = g;
            }
        }
    }
}

/// Whether a value asks for nothing: absent, null, or an empty array or object.
fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

fn covered(path: &str) -> bool {
    READ.iter().chain(NOT_NEEDED).any(|p| {
        path == *p || (path.starts_with(p) && matches!(path.as_bytes()[p.len()], b'.' | b'['))
    })
}

/// Every non-empty setting of the accepted spec is one `from_spec` reads or one the start does not need.
fn no_setting_skipped(v: &Map<String, Value>, prefix: &str) {
    for (k, child) in v {
        if empty(child) {
            continue;
        }
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if covered(&path) {
            continue;
        }
        match child {
            Value::Object(m) => no_setting_skipped(m, &path),
            Value::Array(items) => {
                let path = format!("{path}[]");
                for item in items {
                    match item {
                        Value::Object(m) => no_setting_skipped(m, &path),
                        _ => panic!(
                            "accepted spec has {path} = {item}, which the direct start skips"
                        ),
                    }
                }
            }
            _ => panic!("accepted spec has {path} = {child}, which the direct start skips"),
        }
    }
}

/// What every spec::build output gives, kept by an accepted spec.
fn keeps_build_invariants(b: &Blueprint) {
    assert_eq!(
        b.host_uid, b.host_gid,
        "uid and gid mapped to different host ids"
    );
    for p in get_default_maskedpaths() {
        assert!(b.masked.contains(&PathBuf::from(&p)), "{p} not masked");
    }
    for p in get_default_readonly_paths() {
        assert!(b.readonly.contains(&PathBuf::from(&p)), "{p} not read-only");
    }
    for m in &b.mounts {
        match &m.kind {
            MountKind::Bind { .. } => {
                assert!(
                    m.flags.contains(MsFlags::MS_NOSUID | MsFlags::MS_NODEV),
                    "{m:?}"
                );
                assert_ne!(m.destination, Path::new("/dev"), "{m:?}");
            }
            MountKind::Fresh { fstype, .. } => {
                if m.destination == Path::new("/dev") {
                    assert_eq!(*fstype, "tmpfs", "{m:?}");
                }
            }
        }
    }
}

fuzz_target!(|input: Input| {
    let Ok(original) = build(&plan(&input)) else {
        return;
    };
    let Ok(original) = serde_json::to_value(&original) else {
        panic!("a built spec does not serialise");
    };
    let mut json = original.clone();
    for edit in input.edits.iter().take(4) {
        apply(&mut json, &original, edit);
    }
    let Ok(spec) = serde_json::from_value::<Spec>(json) else {
        return;
    };
    let Ok(blueprint) = Blueprint::from_spec(&spec, CGROUPS_PATH) else {
        return;
    };
    let Ok(Value::Object(parsed)) = serde_json::to_value(&spec) else {
        panic!("a parsed spec does not serialise to an object");
    };
    no_setting_skipped(&parsed, "");
    keeps_build_invariants(&blueprint);
});
