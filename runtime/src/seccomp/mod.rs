//! Seccomp: the syscall profile of every program, as data.
//!
//! `seccomp-profiles/default.<arch>.json` (seccompiler's JSON format, a comment on every rule) holds two filters:
//! `allowlist` (listed syscalls allowed, everything else `ENOSYS`, so `clone3` falls back to `clone` in glibc) and
//! `denylist` (known-dangerous syscalls and argument patterns: `EPERM`; among them the socket families but
//! `AF_UNIX`, `AF_INET`, `AF_INET6` and `NETLINK_ROUTE`, `TIOCSETD`, btrfs subvolume creation, personality flags, and
//! setting `RLIMIT_CORE`).
//! They answer as if both were installed, the allowlist first: for the same action class the kernel returns the
//! most recently installed filter's value, so a dangerous call answers `EPERM` whether or not the allowlist lists
//! it. The profiles are compiled at daemon start-up (the allowlist then laid out as a search tree, [`search`], and
//! the two chained into one program that answers the same, [`chain`]: one filter for the kernel to install and run)
//! and installed by the container's init on itself before it waits for its program; a failure stops the execution.

mod chain;
mod search;

use seccompiler::{BpfProgram, TargetArch};
use sha2::{Digest, Sha256};

use crate::error::Result;

pub use crate::error::SeccompError;

/// The x86_64 profile.
pub const X86_64: &str = include_str!("../../../seccomp-profiles/default.x86_64.json");
/// The aarch64 profile.
pub const AARCH64: &str = include_str!("../../../seccomp-profiles/default.aarch64.json");

/// A compiled profile.
#[derive(Debug, Clone)]
pub struct Profile {
    /// Allowed syscalls; everything else `ENOSYS`.
    pub allow: BpfProgram,
    /// Dangerous syscalls and argument patterns: `EPERM`.
    pub deny: BpfProgram,
    /// Both as one program, the one installed: the denylist, then where it allows, the allowlist.
    pub program: BpfProgram,
    /// `sha256:<hex>` of the profile text (part of an environment fingerprint).
    pub digest: String,
}

/// The profile text for the architecture sandboxd was built for.
pub fn native_profile() -> Result<(&'static str, TargetArch)> {
    match std::env::consts::ARCH {
        "x86_64" => Ok((X86_64, TargetArch::x86_64)),
        "aarch64" => Ok((AARCH64, TargetArch::aarch64)),
        other => Err(SeccompError::Arch(other).into()),
    }
}

/// Compiles a profile text for an architecture.
pub fn compile(text: &str, arch: TargetArch) -> Result<Profile> {
    let mut map =
        seccompiler::compile_from_json(text.as_bytes(), arch).map_err(SeccompError::Compile)?;
    let mut take = |name: &'static str| map.remove(name).ok_or(SeccompError::MissingFilter(name));
    let allow = take("allowlist")?;
    // The same allowlist as a search tree: much cheaper for the kernel to install (see `search`).
    let allow = search::relayout(&allow)?.unwrap_or(allow);
    let deny = take("denylist")?;
    if !map.is_empty() {
        return Err(SeccompError::ExtraFilters.into());
    }
    let program = chain::chain(&deny, &allow)?;
    Ok(Profile {
        allow,
        deny,
        program,
        digest: format!("sha256:{:x}", Sha256::digest(text.as_bytes())),
    })
}

impl Profile {
    /// Installs the profile's one program on the calling thread; every process it forks afterwards inherits it.
    /// Only for a single-threaded process (the container's init): without `TSYNC`, which costs a lock round on
    /// every install and showed up in the profile of container creation.
    pub fn install(&self) -> Result<()> {
        seccompiler::apply_filter(&self.program).map_err(|source| SeccompError::Install {
            filter: "profile",
            source,
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use serde_json::Value;

    use super::*;

    /// Syscalls the issue requires to answer EPERM whatever their arguments.
    const MUST_DENY: &[&str] = &[
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "mount",
        "umount2",
        "fsopen",
        "fsmount",
        "move_mount",
        "open_tree",
        "pivot_root",
        "unshare",
        "setns",
        "keyctl",
        "add_key",
        "request_key",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "init_module",
        "finit_module",
        "delete_module",
        "kexec_load",
        "kexec_file_load",
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "open_by_handle_at",
        "name_to_handle_at",
        "quotactl",
        "settimeofday",
        "clock_settime",
        "adjtimex",
        "syslog",
        "iopl",
        "ioperm",
    ];

    /// Unconditional syscalls, and conditional rules (without comments) per syscall.
    type FilterRules = (BTreeSet<String>, BTreeMap<String, BTreeSet<String>>);

    fn profiles() -> [(&'static str, &'static str, TargetArch); 2] {
        [
            ("x86_64", X86_64, TargetArch::x86_64),
            ("aarch64", AARCH64, TargetArch::aarch64),
        ]
    }

    fn rules<'a>(doc: &'a Value, filter: &str) -> &'a Vec<Value> {
        doc[filter]["filter"].as_array().unwrap()
    }

    #[test]
    fn both_profiles_compile() {
        for (name, text, arch) in profiles() {
            let p = compile(text, arch).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!p.allow.is_empty() && !p.deny.is_empty());
            assert!(p.digest.starts_with("sha256:"));
        }
    }

    #[test]
    fn actions_are_enosys_for_unknown_and_eperm_for_denied() {
        for (name, text, _) in profiles() {
            let doc: Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                doc["allowlist"]["mismatch_action"],
                serde_json::json!({"errno": 38}),
                "{name}"
            );
            assert_eq!(doc["allowlist"]["match_action"], "allow", "{name}");
            assert_eq!(doc["denylist"]["mismatch_action"], "allow", "{name}");
            assert_eq!(
                doc["denylist"]["match_action"],
                serde_json::json!({"errno": 1}),
                "{name}"
            );
        }
    }

    #[test]
    fn every_rule_and_condition_has_a_comment() {
        for (name, text, _) in profiles() {
            let doc: Value = serde_json::from_str(text).unwrap();
            for filter in ["allowlist", "denylist"] {
                for r in rules(&doc, filter) {
                    let c = r["comment"].as_str().unwrap_or_default();
                    assert!(c.len() > 3, "{name} {filter}: rule without a comment: {r}");
                    for a in r["args"].as_array().into_iter().flatten() {
                        assert!(
                            a["comment"].as_str().is_some_and(|c| !c.is_empty()),
                            "{name}: {a}"
                        );
                    }
                }
            }
        }
    }

    /// Redundant: a syscall listed twice unconditionally in one filter, the same conditional rule twice, or a
    /// conditional rule next to an unconditional one. Contradictory: a syscall unconditionally in both filters
    /// (the denylist would always win, so the allow entry lies), or a conditional deny of a syscall the allowlist
    /// does not list (it would answer ENOSYS anyway, so the rule is dead).
    #[test]
    fn no_redundant_or_contradictory_rules() {
        for (name, text, _) in profiles() {
            let doc: Value = serde_json::from_str(text).unwrap();
            let mut per_filter: BTreeMap<&str, FilterRules> = BTreeMap::new();
            for filter in ["allowlist", "denylist"] {
                let (plain, conditional) = per_filter.entry(filter).or_default();
                for r in rules(&doc, filter) {
                    let sys = r["syscall"].as_str().unwrap().to_owned();
                    match r.get("args") {
                        None => assert!(
                            plain.insert(sys.clone()),
                            "{name} {filter}: {sys} listed twice"
                        ),
                        Some(args) => {
                            let mut key = args.clone();
                            for a in key.as_array_mut().unwrap() {
                                a.as_object_mut().unwrap().remove("comment");
                            }
                            assert!(
                                conditional
                                    .entry(sys.clone())
                                    .or_default()
                                    .insert(key.to_string()),
                                "{name} {filter}: the same conditional rule for {sys} twice"
                            );
                        }
                    }
                }
                for sys in conditional.keys() {
                    assert!(
                        !plain.contains(sys),
                        "{name} {filter}: {sys} both with and without conditions"
                    );
                }
            }
            let (allow, allow_cond) = &per_filter["allowlist"];
            let (deny, deny_cond) = &per_filter["denylist"];
            assert!(
                allow_cond.is_empty(),
                "{name}: the allowlist allows by argument: keep conditions in the denylist"
            );
            for sys in deny {
                assert!(
                    !allow.contains(sys),
                    "{name}: {sys} is both allowed and denied"
                );
            }
            for sys in deny_cond.keys() {
                assert!(
                    allow.contains(sys),
                    "{name}: conditional deny of {sys}, which the allowlist does not allow"
                );
            }
        }
    }

    /// A call by argument: case name, syscall numbers of (x86_64, aarch64), arguments, expected answer.
    type ArgCase = (&'static str, (u32, u32), &'static [u64], &'static str);

    /// Syscall numbers of (x86_64, aarch64).
    const SOCKET: (u32, u32) = (41, 198);
    const IOCTL: (u32, u32) = (16, 29);
    const PERSONALITY: (u32, u32) = (135, 92);
    const SETRLIMIT: (u32, u32) = (160, 164);
    const PRLIMIT64: (u32, u32) = (302, 261);
    const EPERM: u32 = 0x0005_0001;
    const ALLOW: u32 = 0x7fff_0000;

    const HI: u64 = 1 << 32;
    const ARG_CASES: &[ArgCase] = &[
        ("socket(AF_UNIX, SOCK_STREAM)", SOCKET, &[1, 1, 0], "allow"),
        ("socket(AF_INET, SOCK_STREAM)", SOCKET, &[2, 1, 0], "allow"),
        ("socket(AF_INET6, SOCK_DGRAM)", SOCKET, &[10, 2, 0], "allow"),
        ("socket(AF_INET, SOCK_RAW)", SOCKET, &[2, 3, 1], "EPERM"),
        (
            "socket(AF_PACKET, SOCK_DGRAM)",
            SOCKET,
            &[17, 2, 0],
            "EPERM",
        ),
        ("socket(AF_VSOCK)", SOCKET, &[40, 1, 0], "EPERM"),
        (
            "socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE)",
            SOCKET,
            &[16, 3 | 0x80000, 0],
            "allow",
        ),
        (
            "socket(AF_NETLINK, SOCK_DGRAM, NETLINK_ROUTE)",
            SOCKET,
            &[16, 2, 0],
            "allow",
        ),
        (
            "socket(AF_NETLINK, SOCK_RAW, NETLINK_AUDIT)",
            SOCKET,
            &[16, 3, 9],
            "EPERM",
        ),
        (
            "socket(AF_NETLINK, .., NETLINK_KOBJECT_UEVENT)",
            SOCKET,
            &[16, 2, 15],
            "EPERM",
        ),
        (
            "socket(AF_NETLINK, .., NETLINK_AUDIT | 1<<32)",
            SOCKET,
            &[16, 2, HI | 9],
            "EPERM",
        ),
        (
            "socket(AF_NETLINK | 1<<32, .., NETLINK_AUDIT)",
            SOCKET,
            &[HI | 16, 2, 9],
            "EPERM",
        ),
        ("ioctl(TIOCSTI)", IOCTL, &[0, 0x5412], "EPERM"),
        ("ioctl(TIOCSETD)", IOCTL, &[0, 0x5423], "EPERM"),
        ("ioctl(TIOCSETD | 1<<32)", IOCTL, &[0, HI | 0x5423], "EPERM"),
        ("ioctl(TIOCGETD)", IOCTL, &[0, 0x5424], "allow"),
        (
            "ioctl(BTRFS_IOC_SUBVOL_CREATE)",
            IOCTL,
            &[0, 0x5000_940e],
            "EPERM",
        ),
        (
            "ioctl(BTRFS_IOC_SUBVOL_CREATE_V2)",
            IOCTL,
            &[0, 0x5000_9418],
            "EPERM",
        ),
        (
            "ioctl(BTRFS_IOC_SNAP_CREATE)",
            IOCTL,
            &[0, 0x5000_9401],
            "EPERM",
        ),
        (
            "ioctl(BTRFS_IOC_SNAP_CREATE_V2 | 1<<32)",
            IOCTL,
            &[0, HI | 0x5000_9417],
            "EPERM",
        ),
        (
            "ioctl(BTRFS_IOC_SNAP_DESTROY)",
            IOCTL,
            &[0, 0x5000_940f],
            "allow",
        ),
        ("ioctl(FIONREAD)", IOCTL, &[0, 0x541B], "allow"),
        ("personality(query)", PERSONALITY, &[0xffff_ffff], "allow"),
        ("personality(PER_LINUX)", PERSONALITY, &[0], "allow"),
        ("personality(PER_LINUX32)", PERSONALITY, &[8], "allow"),
        (
            "personality(ADDR_NO_RANDOMIZE)",
            PERSONALITY,
            &[0x0040000],
            "EPERM",
        ),
        (
            "personality(READ_IMPLIES_EXEC)",
            PERSONALITY,
            &[0x0400000],
            "EPERM",
        ),
        ("personality(UNAME26)", PERSONALITY, &[0x0020000], "EPERM"),
        (
            "personality(ADDR_NO_RANDOMIZE | 1<<32)",
            PERSONALITY,
            &[HI | 0x0040000],
            "EPERM",
        ),
        ("setrlimit(RLIMIT_CORE)", SETRLIMIT, &[4, 0x1000], "EPERM"),
        (
            "setrlimit(RLIMIT_CORE | 1<<32)",
            SETRLIMIT,
            &[HI | 4, 0x1000],
            "EPERM",
        ),
        ("setrlimit(RLIMIT_NOFILE)", SETRLIMIT, &[7, 0x1000], "allow"),
        (
            "prlimit64(0, RLIMIT_CORE, new)",
            PRLIMIT64,
            &[0, 4, 0x1000, 0],
            "EPERM",
        ),
        (
            "prlimit64(0, RLIMIT_CORE, new at 1<<32)",
            PRLIMIT64,
            &[0, 4, HI, 0],
            "EPERM",
        ),
        (
            "prlimit64(0, RLIMIT_CORE, NULL, old)",
            PRLIMIT64,
            &[0, 4, 0, 0x1000],
            "allow",
        ),
        (
            "prlimit64(0, RLIMIT_NOFILE, new)",
            PRLIMIT64,
            &[0, 7, 0x1000, 0],
            "allow",
        ),
    ];

    /// The compiled filters' answers to calls by argument: what the denylist refuses (`EPERM`) and what both
    /// filters let through. High bits of 32-bit arguments must not hide a value from the filter.
    #[test]
    fn the_filters_answer_by_argument() {
        for (name, text, arch) in profiles() {
            let p = compile(text, arch).unwrap();
            let audit = p.deny[1].k;
            let pick = |nr: (u32, u32)| if name == "x86_64" { nr.0 } else { nr.1 };
            let answer = |nr: (u32, u32), args: &[u64]| {
                let mut a = [0u64; 6];
                a[..args.len()].copy_from_slice(args);
                let nr = pick(nr);
                let deny = search::emulate_call(&p.deny, audit, nr, &a).unwrap();
                let allow = search::emulate_call(&p.allow, audit, nr, &a).unwrap();
                // The installed program answers as the two filters installed in turn.
                let installed = search::emulate_call(&p.program, audit, nr, &a).unwrap();
                assert_eq!(
                    installed,
                    chain::installed_in_turn(allow, deny),
                    "{nr} {a:?}"
                );
                if installed == EPERM {
                    "EPERM"
                } else if installed == ALLOW {
                    "allow"
                } else {
                    "other"
                }
            };
            let wrong: Vec<String> = ARG_CASES
                .iter()
                .filter_map(|(case, nr, args, want)| {
                    let got = answer(*nr, args);
                    (got != *want).then(|| format!("{case}: {got}, expected {want}"))
                })
                .collect();
            assert!(wrong.is_empty(), "{name}:\n  {}", wrong.join("\n  "));
        }
    }

    #[test]
    fn the_required_denials_are_there() {
        for (name, text, _) in profiles() {
            let doc: Value = serde_json::from_str(text).unwrap();
            let deny: BTreeSet<&str> = rules(&doc, "denylist")
                .iter()
                .filter(|r| r.get("args").is_none())
                .map(|r| r["syscall"].as_str().unwrap())
                .collect();
            let allow: BTreeSet<&str> = rules(&doc, "allowlist")
                .iter()
                .map(|r| r["syscall"].as_str().unwrap())
                .collect();
            let table = match name {
                "x86_64" => TargetArch::x86_64,
                _ => TargetArch::aarch64,
            };
            for sys in MUST_DENY {
                // Some syscalls do not exist on every architecture (iopl, ioperm on aarch64).
                let exists = seccompiler::compile_from_json(
                    format!(r#"{{"t":{{"mismatch_action":"allow","match_action":"allow","filter":[{{"syscall":"{sys}"}}]}}}}"#)
                        .as_bytes(),
                    table,
                )
                .is_ok();
                if exists {
                    assert!(
                        deny.contains(sys),
                        "{name}: {sys} must be denied with EPERM"
                    );
                }
            }
            assert!(
                !allow.contains("clone3"),
                "{name}: clone3 must answer ENOSYS so glibc falls back to clone"
            );
            let clone_rules = rules(&doc, "denylist")
                .iter()
                .filter(|r| r["syscall"] == "clone")
                .count();
            assert_eq!(clone_rules, 8, "{name}: one clone rule per CLONE_NEW* flag");
            let ioctl: Vec<_> = rules(&doc, "denylist")
                .iter()
                .filter(|r| r["syscall"] == "ioctl")
                .collect();
            assert_eq!(
                ioctl.len(),
                7,
                "{name}: TIOCSTI, TIOCLINUX, TIOCSETD and the four btrfs subvolume creations"
            );
            for r in ioctl {
                assert_eq!(
                    r["args"][0]["type"], "dword",
                    "{name}: ioctl requests compare 32 bits (high-bit variants)"
                );
            }
        }
    }
}
