//! `sandboxd doctor`: checks that this host can provide every isolation layer, and says how to fix what is missing.
//! The daemon makes the same checks at start-up and refuses to run without a required layer; this command shows
//! them all at once without starting anything.

use std::path::Path;

use runtime::error::Chain;

use crate::config::Config;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Present.
    Ok,
    /// Missing and required: the daemon will refuse to start.
    Missing,
    /// Missing but optional (a feature is unavailable, isolation is not weaker).
    Warn,
}

/// One line of the report.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked.
    pub name: &'static str,
    /// The outcome.
    pub verdict: Verdict,
    /// What was found.
    pub detail: String,
    /// How to fix it (empty when fine).
    pub fix: &'static str,
}

fn check(name: &'static str, ok: bool, detail: String, fix: &'static str, required: bool) -> Check {
    Check {
        name,
        verdict: match (ok, required) {
            (true, _) => Verdict::Ok,
            (false, true) => Verdict::Missing,
            (false, false) => Verdict::Warn,
        },
        detail,
        fix: if ok { "" } else { fix },
    }
}

/// Runs every check.
pub fn run(config: &Config) -> Vec<Check> {
    let mut out = process_checks();
    out.push(start_check(config.sandbox.start));
    out.push(cgroup_check(config));
    out.extend(confinement_checks(config));
    out.extend(filesystem_checks());
    out.push(core_dump_check(
        std::fs::read_to_string("/proc/sys/kernel/core_pattern")
            .ok()
            .as_deref(),
    ));
    out.push(pty_check(
        config,
        read_number("/proc/sys/kernel/pty/max"),
        read_number("/proc/sys/kernel/pty/reserve"),
    ));
    out.extend(language_checks());
    out
}

fn read_number(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether every container this daemon may hold at once (running, pooled, agent sandboxes) can have its
/// [`runtime::spec::PTY_MAX`] ptys: all devpts instances but the host's share `kernel.pty.max` less
/// `kernel.pty.reserve`. Beyond it a container's pty may be refused while others hold theirs (never the host's:
/// the reserve is the host's own). A warning: executions without ptys are not affected.
fn pty_check(config: &Config, max: Option<u64>, reserve: Option<u64>) -> Check {
    let containers = (config.capacity.max_concurrent
        + config.pool_size()
        + crate::config::MAX_LANGUAGES
        + config.agents.max_sandboxes) as u64;
    let wanted = containers * u64::from(runtime::spec::PTY_MAX);
    let (Some(max), Some(reserve)) = (max, reserve) else {
        return check(
            "ptys",
            false,
            "kernel.pty.max or kernel.pty.reserve unreadable".into(),
            "check /proc/sys/kernel/pty",
            false,
        );
    };
    let shared = max.saturating_sub(reserve);
    check(
        "ptys",
        wanted <= shared,
        format!(
            "{containers} containers at once x {} ptys = {wanted}; kernel.pty.max {max} less reserve {reserve} = {shared}",
            runtime::spec::PTY_MAX
        ),
        "raise kernel.pty.max (sysctl) or lower capacity.max_concurrent, pool.size or agents.max_sandboxes",
        false,
    )
}

/// What a crash inside an execution would do with the host's `core_pattern` (`None`: unreadable). A pattern that
/// pipes (`|/usr/lib/systemd/systemd-coredump ...`, apport) makes the kernel start that helper as root on the host,
/// outside every cgroup, for each crash, and ignores `RLIMIT_CORE=0` for it; executions run with `RLIMIT_CORE=1`,
/// the value the kernel reads as "no piped dump" (and below a page, so no core file either), which their seccomp
/// profile does not let them change. Reported, not refused: sandboxd does not change the host's setting.
fn core_dump_check(pattern: Option<&str>) -> Check {
    let Some(pattern) = pattern.map(str::trim) else {
        return check(
            "core dumps",
            false,
            "kernel.core_pattern unreadable".into(),
            "check /proc/sys/kernel/core_pattern; executions run with RLIMIT_CORE=1 whatever it says",
            false,
        );
    };
    let detail = match pattern.strip_prefix('|') {
        Some(helper) => format!(
            "kernel.core_pattern pipes to {}: a crash would start it as root on the host; executions run with \
             RLIMIT_CORE=1 (fixed by seccomp), which stops a piped dump (0 would not)",
            helper.split_whitespace().next().unwrap_or("a helper")
        ),
        None => format!(
            "kernel.core_pattern {pattern:?}: executions run with RLIMIT_CORE=1 (below a page: no core file)"
        ),
    };
    check("core dumps", true, detail, "", false)
}

/// Root and the kernel version.
fn process_checks() -> Vec<Check> {
    let mut out = Vec::new();
    let root = nix::unistd::geteuid().is_root();
    out.push(check(
        "root",
        root,
        format!("euid {}", nix::unistd::geteuid()),
        "run sandboxd as root (it creates namespaces, cgroups and mounts)",
        true,
    ));
    let held = runtime::caps::ensure_held(&runtime::caps::HELPER_NEEDS);
    out.push(check(
        "capabilities",
        held.is_ok(),
        match &held {
            Ok(()) => "CAP_SYS_ADMIN, CAP_SETGID and CAP_SETUID in the effective set".into(),
            Err(e) => Chain(e).to_string(),
        },
        "start sandboxd with these capabilities (the detail says what took them away)",
        true,
    ));

    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let (major, minor) = parse_kernel(&release);
    out.push(check(
        "kernel",
        (major, minor) >= (5, 13),
        format!("Linux {release}"),
        "use Linux 5.13 or newer (landlock, close_range with CLOEXEC, memory.peak on v2 needs 5.19)",
        true,
    ));
    out
}

/// The hierarchy and the controllers executions need.
fn cgroup_check(config: &Config) -> Check {
    match runtime::cgroups::Cgroups::detect(
        &config.sandbox.cgroup_root,
        &config.sandbox.cgroup_parent,
    ) {
        Ok(cg) => {
            let controllers = cg.check_controllers();
            check(
                "cgroups",
                controllers.is_ok(),
                match &controllers {
                    Ok(()) => format!("cgroup {} with memory, pids, cpu", cg.version().as_str()),
                    Err(e) => Chain(e).to_string(),
                },
                "mount the memory, pids, cpu and cpuacct controllers (v1) or enable them in cgroup.subtree_control (v2)",
                true,
            )
        }
        Err(e) => check(
            "cgroups",
            false,
            Chain(&e).to_string(),
            "mount cgroupfs at /sys/fs/cgroup",
            true,
        ),
    }
}

/// The configured container start is compiled into this binary (`libcontainer` needs the cargo feature).
fn start_check(start: runtime::helper::StartMethod) -> Check {
    check(
        "container start",
        start.is_built(),
        match start.ensure_built() {
            Ok(()) => format!("sandbox.start: {start}"),
            Err(e) => Chain(&e).to_string(),
        },
        "rebuild with `cargo build -p sandboxd --features libcontainer`, or use `sandbox.start: direct`",
        true,
    )
}

/// User namespaces, landlock and seccomp (the profile must compile).
fn confinement_checks(config: &Config) -> Vec<Check> {
    let mut out = Vec::new();
    let userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    out.push(check(
        "user namespaces",
        userns > 0,
        format!("user.max_user_namespaces = {userns}"),
        "sysctl -w user.max_user_namespaces=15000 (and CONFIG_USER_NS=y)",
        true,
    ));

    let abi = runtime::sys::landlock_abi();
    out.push(check(
        "landlock",
        abi >= config.sandbox.landlock_min_abi,
        format!("ABI {abi} (required: {})", config.sandbox.landlock_min_abi),
        "ABI 0: enable CONFIG_SECURITY_LANDLOCK and add landlock to the lsm= boot parameter; an older ABI: boot a newer \
         kernel, or accept the weaker layer by lowering sandbox.landlock_min_abi to the ABI found",
        true,
    ));

    let seccomp_field = std::fs::read_to_string("/proc/self/status")
        .map(|s| s.contains("Seccomp:"))
        .unwrap_or(false);
    let profile =
        runtime::seccomp::native_profile().and_then(|(t, a)| runtime::seccomp::compile(t, a));
    out.push(check(
        "seccomp",
        seccomp_field && profile.is_ok(),
        match &profile {
            Ok(p) => format!("filter mode available; profile {}", p.digest),
            Err(e) => Chain(e).to_string(),
        },
        "enable CONFIG_SECCOMP_FILTER",
        true,
    ));
    out
}

/// tmpfs (required) and overlayfs (OCI images only).
fn filesystem_checks() -> Vec<Check> {
    let mut out = Vec::new();
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let has = |fs: &str| {
        filesystems
            .lines()
            .any(|l| l.split_whitespace().last() == Some(fs))
    };
    out.push(check(
        "tmpfs",
        has("tmpfs"),
        "scratch space and /dev".into(),
        "enable CONFIG_TMPFS",
        true,
    ));
    out.push(check(
        "overlayfs",
        has("overlay"),
        "image roots (OCI images)".into(),
        "modprobe overlay (needed for OCI images, not for the host image)",
        false,
    ));
    let volumes = crate::storage::volumes::Ext4Disks::probe();
    out.push(check(
        "volumes",
        volumes.is_ok(),
        volumes.err().unwrap_or_else(|| "ext4 files on loop devices".into()),
        "install e2fsprogs and mount, and give the daemon loop devices (needed for POST /volumes only)",
        false,
    ));
    let store = crate::storage::cow::probe();
    out.push(check(
        "workspace store",
        has("btrfs") && store.is_ok(),
        store
            .err()
            .unwrap_or_else(|| "btrfs in a file on a loop device".into()),
        "modprobe btrfs, install btrfs-progs (needed for agents.workspace_store: btrfs only)",
        false,
    ));
    out
}

/// The interpreters of the host image (warnings: a language without one is simply not offered).
fn language_checks() -> Vec<Check> {
    let mut out = Vec::new();
    for (name, path) in [
        ("python", "/usr/bin/python3"),
        ("javascript", "/usr/bin/node"),
    ] {
        let present = Path::new(path).exists();
        out.push(Check {
            name: if name == "python" {
                "language python"
            } else {
                "language javascript"
            },
            verdict: if present { Verdict::Ok } else { Verdict::Warn },
            detail: format!("{path} {}", if present { "present" } else { "absent" }),
            fix: if present {
                ""
            } else if name == "python" {
                "apt-get install python3"
            } else {
                "apt-get install nodejs"
            },
        });
    }
    out
}

fn parse_kernel(release: &str) -> (u32, u32) {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let major = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (major, minor)
}

/// Why the daemon refuses to start on a kernel whose Landlock ABI `abi` is below `min_abi`, and the fix: without
/// Landlock, enable it; with an older ABI, a newer kernel or (accepting what that ABI leaves unrestricted) a lower
/// `sandbox.landlock_min_abi`.
pub fn landlock_refusal(abi: i32, min_abi: i32) -> String {
    let found = format!("landlock ABI {abi} found, sandbox.landlock_min_abi requires {min_abi}");
    if abi < 1 {
        format!(
            "{found}: Landlock is not enabled in this kernel (enable CONFIG_SECURITY_LANDLOCK and add landlock to \
             the lsm= boot parameter)"
        )
    } else {
        format!(
            "{found}: boot a kernel with a newer Landlock ABI, or accept ABI {abi} (it restricts fewer file-system \
             rights) with `landlock_min_abi: {abi}` under `sandbox:` in the config"
        )
    }
}

/// Prints the report; returns whether every required check passed.
pub fn print(checks: &[Check]) -> bool {
    for c in checks {
        let tag = match c.verdict {
            Verdict::Ok => "ok     ",
            Verdict::Missing => "MISSING",
            Verdict::Warn => "warn   ",
        };
        println!("{tag} {:<20} {}", c.name, c.detail);
        if !c.fix.is_empty() {
            println!("        {:<20} fix: {}", "", c.fix);
        }
    }
    let ok = checks.iter().all(|c| c.verdict != Verdict::Missing);
    println!(
        "{}",
        if ok {
            "sandboxd can run here with every isolation layer."
        } else {
            "sandboxd will refuse to start until the MISSING items are fixed."
        }
    );
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(parse_kernel("6.18.44-fc-v657"), (6, 18));
        assert_eq!(parse_kernel("5.4.0-150-generic"), (5, 4));
        assert_eq!(parse_kernel("garbage"), (0, 0));
    }

    /// A piped `core_pattern` is reported, with what stops it; a file pattern is fine as it is.
    #[test]
    fn a_pty_pool_too_small_for_the_containers_is_a_warning() {
        let config = Config::default();
        // Defaults: 8 running + 8 pooled + 4 rounding + 16 agent sandboxes = 36 containers x 64 = 2304.
        let fits = pty_check(&config, Some(4096), Some(1024));
        assert_eq!(fits.verdict, Verdict::Ok, "{}", fits.detail);
        assert!(fits.detail.contains("= 2304"), "{}", fits.detail);
        let short = pty_check(&config, Some(2048), Some(1024));
        assert_eq!(short.verdict, Verdict::Warn, "{}", short.detail);
        assert!(short.fix.contains("kernel.pty.max"));
        assert_eq!(pty_check(&config, None, Some(1)).verdict, Verdict::Warn);
    }

    #[test]
    fn landlock_refusal_names_the_key_and_the_fix() {
        let none = landlock_refusal(0, 3);
        assert!(
            none.contains("ABI 0 found") && none.contains("lsm="),
            "{none}"
        );
        let old = landlock_refusal(2, 3);
        assert!(
            old.contains("sandbox.landlock_min_abi requires 3")
                && old.contains("`landlock_min_abi: 2`"),
            "{old}"
        );
    }

    #[test]
    fn the_configured_start_must_be_in_the_build() {
        use runtime::helper::StartMethod;
        let direct = start_check(StartMethod::Direct);
        assert_eq!(direct.verdict, Verdict::Ok, "{direct:?}");
        let libcontainer = start_check(StartMethod::Libcontainer);
        if cfg!(feature = "libcontainer") {
            assert_eq!(libcontainer.verdict, Verdict::Ok, "{libcontainer:?}");
        } else {
            assert_eq!(libcontainer.verdict, Verdict::Missing, "{libcontainer:?}");
            assert!(
                libcontainer.detail.contains(
                    "This build has no libcontainer start; rebuild with --features libcontainer"
                ),
                "{libcontainer:?}"
            );
        }
    }

    #[test]
    fn a_piped_core_pattern_is_reported() {
        let checks = run(&Config::default());
        let core = checks
            .iter()
            .find(|c| c.name == "core dumps")
            .expect("a core dumps check");
        assert_eq!(core.verdict, Verdict::Ok, "{core:?}");
        assert!(core.detail.contains("core_pattern"), "{core:?}");
        let piped = core_dump_check(Some(
            "|/usr/lib/systemd/systemd-coredump %P %u %g %s %t %c %h\n",
        ));
        assert_eq!(piped.verdict, Verdict::Ok, "{piped:?}");
        assert!(
            piped
                .detail
                .contains("pipes to /usr/lib/systemd/systemd-coredump")
                && piped.detail.contains("RLIMIT_CORE=1"),
            "{piped:?}"
        );
        let file = core_dump_check(Some("core\n"));
        assert!(!file.detail.contains("pipes"), "{file:?}");
        let unreadable = core_dump_check(None);
        assert_eq!(unreadable.verdict, Verdict::Warn, "{unreadable:?}");
    }

    #[test]
    fn this_host_passes_every_required_check() {
        if !test_support::require_root(
            "this_host_passes_every_required_check",
            "the doctor's host check",
        ) {
            return;
        }
        let checks = run(&Config::default());
        for c in &checks {
            assert_ne!(c.verdict, Verdict::Missing, "{c:?}");
        }
        // The layers the daemon reports are the ones doctor checks.
        for name in ["cgroups", "landlock", "seccomp", "user namespaces"] {
            assert!(checks.iter().any(|c| c.name == name), "{name}");
        }
    }
}
