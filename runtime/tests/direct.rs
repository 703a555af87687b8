//! The direct start through a real helper, as root: a container runs a program with no privileges left; a spec
//! the start refuses and a set-up step that fails both leave nothing behind (no cgroup leaf, no process).
//!
//! `harness = false`: the helper must be forked while the process is still single-threaded, which the libtest
//! harness (a thread per test) never is. The process first enters a private mount namespace, so nothing it mounts
//! reaches the host.

// A test binary without libtest's harness: clippy does not see it as tests, but a failed set-up is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use runtime::cgroups::Cgroups;
use runtime::helper::{spawn_helper, HelperClient, HelperConfig, StartMethod};
use runtime::launch::Launch;
use runtime::rootfs::HostImage;
use runtime::spec::{build, ContainerPlan};

const TEST: &str = "direct_start_through_a_real_helper";

fn main() {
    if !test_support::require_root(TEST, "creates namespaces, cgroups and mounts") {
        return;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare(mount)");
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .expect("make mounts private");
    let tmp = tempfile::tempdir().expect("tempdir");
    let parent = format!("sandboxd-direct-test-{}", std::process::id());
    let cgroups =
        Cgroups::detect(Path::new(runtime::cgroups::DEFAULT_ROOT), &parent).expect("cgroups");
    cgroups.ensure_parent().expect("cgroup parent");
    let image = HostImage::prepare(&tmp.path().join("image"), Path::new("/")).expect("host image");
    let (text, arch) = runtime::seccomp::native_profile().expect("seccomp profile");
    let (pid, sock) = spawn_helper(HelperConfig {
        state_root: tmp.path().join("state"),
        cgroups: cgroups.clone(),
        seccomp: runtime::seccomp::compile(text, arch).expect("compile seccomp"),
        start: StartMethod::Direct,
    })
    .expect("spawn helper");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio");
    let helper = rt
        .block_on(async { HelperClient::new(sock, pid) })
        .expect("helper client");
    let t = Test {
        tmp: tmp.path().to_owned(),
        image,
        cgroups: cgroups.clone(),
        helper_pid: pid.as_raw(),
    };
    let results = [
        (
            "a_program_runs_with_no_privileges_and_leaves_nothing",
            rt.block_on(t.runs(&helper)),
        ),
        (
            "a_refused_spec_creates_nothing",
            rt.block_on(t.refused(&helper)),
        ),
        (
            "a_failed_set_up_step_is_named_and_cleaned_up",
            rt.block_on(t.failed_step(&helper)),
        ),
        (
            "a_taken_id_is_refused_and_its_cgroup_left_alone",
            rt.block_on(t.taken(&helper)),
        ),
        (
            "a_symlink_at_proc_is_refused",
            rt.block_on(t.proc_symlink(&helper)),
        ),
        (
            "bind_flags_hold_on_every_submount",
            rt.block_on(t.recursive_bind_flags(&helper)),
        ),
        (
            "the_init_says_alone_only_when_nothing_else_is_left",
            rt.block_on(t.alone(&helper)),
        ),
        (
            "a_program_that_cannot_be_executed_says_why_and_exits_127",
            rt.block_on(t.not_executable(&helper)),
        ),
        (
            "a_warm_interpreters_reported_end_is_taken_only_when_nothing_else_is_left",
            rt.block_on(t.reported_end(&helper)),
        ),
        (
            "a_serving_init_runs_many_programs_in_one_pid_namespace",
            rt.block_on(t.serves(&helper)),
        ),
        (
            "a_kept_serving_init_is_taken_over_by_a_later_daemon",
            rt.block_on(t.serves_kept(&helper)),
        ),
    ];
    let _ = rt.block_on(helper.shutdown());
    let _ = nix::sys::wait::waitpid(pid, None);
    let _ = cgroups.remove_parent();
    let mut failed = 0;
    for (name, r) in &results {
        match r {
            Ok(()) => println!("test {name} ... ok"),
            Err(e) => {
                failed += 1;
                println!("test {name} ... FAILED: {e}");
            }
        }
    }
    println!(
        "test result: {} passed; {failed} failed",
        results.len() - failed
    );
    if failed > 0 {
        std::process::exit(101);
    }
}

/// The host uid owning the user namespace of process `pid` (`ioctl(NS_GET_OWNER_UID)`).
fn user_namespace_owner(pid: i32) -> Result<u32, String> {
    use std::os::fd::AsRawFd;
    const NS_GET_OWNER_UID: libc::c_ulong = 0xb7 << 8 | 4;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/user")).map_err(|e| e.to_string())?;
    let mut uid: libc::uid_t = 0;
    // SAFETY: NS_GET_OWNER_UID writes one uid_t through the pointer, which points at a live uid_t; `ns` is open.
    let rc = unsafe {
        libc::ioctl(
            ns.as_raw_fd(),
            NS_GET_OWNER_UID,
            &mut uid as *mut libc::uid_t,
        )
    };
    if rc != 0 {
        return Err(format!(
            "NS_GET_OWNER_UID: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(uid)
}

struct Test {
    tmp: PathBuf,
    image: HostImage,
    cgroups: Cgroups,
    helper_pid: i32,
}

impl Test {
    fn plan(&self, id: &str, host_id: u32) -> ContainerPlan {
        ContainerPlan {
            rootfs: self.image.rootfs.clone(),
            readonly_root: true,
            hostname: "sandbox".into(),
            args: vec!["/bin/sh".into()],
            env: Vec::new(),
            cwd: "/".into(),
            binds: self.image.binds.clone(),
            host_id,
            cgroups_path: self.cgroups.cgroups_path(id),
            memory_bytes: 64 << 20,
            pids_max: 32,
            cpu_shares: 512,
            nofile: 256,
            fsize_bytes: 1 << 20,
            shm_bytes: 1 << 20,
        }
    }

    /// Writes the bundle of `id` with `spec`.
    fn bundle(&self, id: &str, spec: &oci_spec::runtime::Spec) -> PathBuf {
        let dir = self.tmp.join("bundles").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        spec.save(dir.join("config.json")).unwrap();
        dir
    }

    fn policy(&self) -> runtime::landlock::Policy {
        let mut read_only: Vec<PathBuf> = self
            .image
            .binds
            .iter()
            .map(|b| b.destination.clone())
            .collect();
        read_only.push("/proc".into());
        runtime::landlock::Policy::for_execution(runtime::sys::landlock_abi(), read_only)
    }

    /// No leaf of `id` in any hierarchy, and no child of the helper.
    fn nothing_left(&self, id: &str) -> Result<(), String> {
        for h in self.cgroups.hierarchies() {
            let leaf = h.join(self.cgroups.parent()).join(id);
            if leaf.exists() {
                return Err(format!("{} is left", leaf.display()));
            }
        }
        let children =
            std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", self.helper_pid))
                .unwrap_or_default();
        if children.trim().is_empty() {
            Ok(())
        } else {
            Err(format!("the helper still has children: {children}"))
        }
    }

    /// Creates container `id` with host uid `uid` from the plain plan.
    async fn create(
        &self,
        helper: &HelperClient,
        id: &str,
        uid: u32,
    ) -> Result<runtime::helper::Created, String> {
        let spec = build(&self.plan(id, uid)).map_err(|e| e.to_string())?;
        helper
            .create(id, self.bundle(id, &spec), self.policy(), None)
            .await
            .map_err(|e| format!("create: {}", runtime::error::Chain(&e)))
    }

    async fn runs(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-ok";
        let created = self.create(helper, id, 3_900_001).await?;
        let checked = self.run_program(id, created);
        let removed = match helper.remove(id).await {
            Ok(None) => Ok(()),
            Ok(Some(step)) => Err(format!("remove: {step}")),
            Err(e) => Err(format!("remove: {e}")),
        };
        checked.and(removed).and_then(|()| self.nothing_left(id))
    }

    /// Runs a probe of the program's privileges in a created container.
    fn run_program(&self, id: &str, created: runtime::helper::Created) -> Result<(), String> {
        // Created: its cgroup leaves exist and hold the init.
        for leaf in self.cgroups.joined_leaves(id).map_err(|e| e.to_string())? {
            let procs = std::fs::read_to_string(leaf.join("cgroup.procs")).unwrap_or_default();
            if procs.trim() != created.pid.to_string() {
                return Err(format!("{} holds {procs:?}, not the init", leaf.display()));
            }
        }
        // Its user namespace is owned by the container's host uid, not by root: the kernel charges the namespace's
        // per-user counters (inotify, message queues, queued signals) to that owner.
        let owner = user_namespace_owner(created.pid)?;
        if owner != 3_900_001 {
            return Err(format!(
                "the init's user namespace is owned by uid {owner}, not its host uid 3900001"
            ));
        }
        // The waiting init holds /dev/null as its own stdio, nothing of the helper's.
        for fd in 0..=2 {
            let link = std::fs::read_link(format!("/proc/{}/fd/{fd}", created.pid))
                .map_err(|e| format!("init fd {fd}: {e}"))?;
            if link != Path::new("/dev/null") {
                return Err(format!("the init's fd {fd} is {}", link.display()));
            }
        }
        let script =
            "grep -E '^(Cap|NoNewPrivs|Seccomp:|Uid|Gid|Groups)' /proc/self/status; hostname; \
                      cat /proc/self/cgroup | grep -c ':/$'; wc -l < /proc/self/cgroup";
        let (out, _) = launch(created, script)?;
        for want in [
            "CapInh:\t0000000000000000",
            "CapPrm:\t0000000000000000",
            "CapEff:\t0000000000000000",
            "CapBnd:\t0000000000000000",
            "CapAmb:\t0000000000000000",
            "NoNewPrivs:\t1",
            "Seccomp:\t2",
            "Uid:\t0\t0\t0\t0",
            "Gid:\t0\t0\t0\t0",
            "sandbox",
        ] {
            if !out.lines().any(|l| l == want) {
                return Err(format!("{want:?} missing from {out:?}"));
            }
        }
        // Supplementary groups dropped; every cgroup line shows the namespace root.
        let groups = out.lines().find(|l| l.starts_with("Groups:")).unwrap_or("");
        if groups.trim() != "Groups:" {
            return Err(format!("supplementary groups kept: {groups:?}"));
        }
        let counts: Vec<&str> = out.lines().rev().take(2).collect();
        if counts.len() != 2 || counts[0] != counts[1] {
            return Err(format!(
                "a cgroup outside the namespace root is visible: {out:?}"
            ));
        }
        Ok(())
    }

    /// The init's record says it was left alone (so the daemon takes the record as the end, without waiting for
    /// the init's exit) after a program that leaves nothing behind, and not after one that leaves a process
    /// running: that process still runs until the init's exit ends the pid namespace.
    async fn alone(&self, helper: &HelperClient) -> Result<(), String> {
        let cases = [
            ("direct-alone", 3_900_007, "true", true),
            (
                "direct-not-alone",
                3_900_008,
                "sleep 30 </dev/null >/dev/null 2>&1 &",
                false,
            ),
        ];
        for (id, uid, script, alone) in cases {
            let created = self.create(helper, id, uid).await?;
            let ran = launch(created, script);
            let removed = helper.remove(id).await;
            let (_, status) = ran?;
            if runtime::init::ended_alone(status.as_bytes()) != alone {
                return Err(format!("{script:?}: alone should be {alone}: {status:?}"));
            }
            match removed {
                Ok(None) => {}
                Ok(Some(step)) => return Err(format!("remove: {step}")),
                Err(e) => return Err(format!("remove: {e}")),
            }
            self.nothing_left(id)?;
        }
        Ok(())
    }

    /// A program that does not exist: the init's child says so on its stderr and exits 127, as a shell does.
    async fn not_executable(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-enoent";
        let created = self.create(helper, id, 3_900_009).await?;
        let ran = launch_args(created, vec!["/no/such-program".into(), "x".into()]);
        let removed = helper.remove(id).await;
        let (out, status) = ran?;
        let report = runtime::init::Report::decode(&status);
        if report.exit != Some(runtime::init::ProgramExit::Code(runtime::init::EXEC_FAILED)) {
            return Err(format!("not 127: {status:?}"));
        }
        if out != "sandboxd: cannot execute /no/such-program: No such file or directory\n" {
            return Err(format!("stderr: {out:?}"));
        }
        match removed {
            Ok(None) => self.nothing_left(id),
            Ok(Some(step)) => Err(format!("remove: {step}")),
            Err(e) => Err(format!("remove: {e}")),
        }
    }

    async fn refused(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-refused";
        let mut spec = build(&self.plan(id, 3_900_002)).map_err(|e| e.to_string())?;
        let mut linux = spec.linux().clone().unwrap_or_default();
        linux.set_sysctl(Some(
            [("kernel.domainname".to_string(), "x".to_string())].into(),
        ));
        spec.set_linux(Some(linux));
        self.refused_with(helper, id, &spec, "sysctl").await
    }

    async fn failed_step(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-failed";
        let mut plan = self.plan(id, 3_900_003);
        plan.binds.push(runtime::spec::BindMount {
            source: self.tmp.join("does-not-exist"),
            destination: "/tmp".into(),
            readonly: true,
        });
        let spec = build(&plan).map_err(|e| e.to_string())?;
        self.refused_with(helper, id, &spec, "mount /tmp").await
    }

    /// Creating `id` from `spec` must fail with an error naming `want`, and leave nothing behind.
    async fn refused_with(
        &self,
        helper: &HelperClient,
        id: &str,
        spec: &oci_spec::runtime::Spec,
        want: &str,
    ) -> Result<(), String> {
        match helper
            .create(id, self.bundle(id, spec), self.policy(), None)
            .await
        {
            Ok(_) => Err(format!(
                "{id} was started; expected a failure naming {want:?}"
            )),
            Err(e) => {
                let e = runtime::error::Chain(&e).to_string();
                if e.contains(want) {
                    self.nothing_left(id)
                } else {
                    Err(format!("{id} failed for another reason: {e}"))
                }
            }
        }
    }

    async fn taken(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-taken";
        // A leaf the start would create itself (the memory hierarchy's).
        let leaf = self.cgroups.joined_leaves(id).map_err(|e| e.to_string())?[0].clone();
        std::fs::create_dir(&leaf).map_err(|e| format!("{}: {e}", leaf.display()))?;
        let spec = build(&self.plan(id, 3_900_004)).map_err(|e| e.to_string())?;
        let answer = helper
            .create(id, self.bundle(id, &spec), self.policy(), None)
            .await;
        let still_there = leaf.is_dir();
        let _ = std::fs::remove_dir(&leaf);
        match answer {
            Ok(_) => Err("a container was created under a taken id".into()),
            Err(e)
                if !runtime::error::Chain(&e)
                    .to_string()
                    .contains("exists already") =>
            {
                Err(format!(
                    "refused for another reason: {}",
                    runtime::error::Chain(&e)
                ))
            }
            Err(_) if !still_there => Err("the taken id's cgroup was removed".into()),
            Err(_) => self.nothing_left(id),
        }
    }

    /// An image whose `/proc` is a symlink (here to its `/tmp`): the start must refuse it rather than mount proc
    /// wherever the link points.
    async fn proc_symlink(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-proc-link";
        let image = HostImage::prepare(&self.tmp.join("image-proc-link"), Path::new("/"))
            .map_err(|e| e.to_string())?;
        let proc_dir = image.rootfs.join("proc");
        std::fs::remove_dir(&proc_dir).map_err(|e| e.to_string())?;
        std::os::unix::fs::symlink("tmp", &proc_dir).map_err(|e| e.to_string())?;
        let mut plan = self.plan(id, 3_900_005);
        plan.rootfs = image.rootfs.clone();
        plan.binds = image.binds.clone();
        let spec = build(&plan).map_err(|e| e.to_string())?;
        self.refused_with(helper, id, &spec, "mount /proc: not a plain directory")
            .await
    }

    /// A read-only bind whose source has a mount below it: the submount is read-only, nosuid and nodev in the
    /// container too (the flags are set on the whole detached tree before it is attached).
    async fn recursive_bind_flags(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-rbind";
        let source = self.tmp.join("rbind-source");
        let sub = source.join("sub");
        std::fs::create_dir_all(&sub).map_err(|e| e.to_string())?;
        nix::mount::mount(
            Some("tmpfs"),
            &sub,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=64k"),
        )
        .map_err(|e| format!("mount a tmpfs on {}: {e}", sub.display()))?;
        let mut plan = self.plan(id, 3_900_006);
        plan.binds.push(runtime::spec::BindMount {
            source: source.clone(),
            destination: "/sandbox".into(),
            readonly: true,
        });
        let spec = build(&plan).map_err(|e| e.to_string())?;
        let created = helper
            .create(id, self.bundle(id, &spec), self.policy(), None)
            .await
            .map_err(|e| format!("create: {}", runtime::error::Chain(&e)));
        let checked = created.and_then(|c| {
            launch(
                c,
                "awk '$5 == \"/sandbox\" || $5 == \"/sandbox/sub\" { print $5, $6 }' /proc/self/mountinfo",
            )
        });
        let _ = helper.remove(id).await;
        let _ = nix::mount::umount2(&sub, nix::mount::MntFlags::MNT_DETACH);
        let (out, _) = checked?;
        let mounts: Vec<(&str, &str)> = out.lines().filter_map(|l| l.split_once(' ')).collect();
        if mounts.len() != 2 {
            return Err(format!("expected /sandbox and /sandbox/sub: {out:?}"));
        }
        for (point, opts) in mounts {
            let opts: Vec<&str> = opts.split(',').collect();
            for want in ["ro", "nosuid", "nodev"] {
                if !opts.contains(&want) {
                    return Err(format!("{point} is mounted {opts:?}, without {want}"));
                }
            }
        }
        self.nothing_left(id)
    }
}

/// A stand-in for a relayed warm interpreter (`sh -c script sh FD`): it reads the launch from its channel to end of
/// file, prints, then reports and goes on.
const REPORTER: &str = "cat <&\"$1\" >/dev/null; echo out; ";

impl Test {
    /// A warm interpreter that reports its end (`exit N` on its channel) and then lingers: with nothing else left,
    /// the init takes the reported code as the end at once (its record says `alone`, its timing marks `reported`)
    /// and ends the interpreter; with a process the interpreter started still running, it waits for the
    /// interpreter (killed) to be reaped and says the reported code without `alone`; a report that is not one is
    /// ignored.
    async fn reported_end(&self, helper: &HelperClient) -> Result<(), String> {
        let cases = [
            // (host uid, the rest of the script, exit code, taken from the report, alone)
            (
                3_900_010,
                "echo 'exit 3' >&\"$1\"; exec sleep 30",
                3,
                true,
                true,
            ),
            (
                3_900_011,
                "sleep 30 </dev/null >/dev/null 2>&1 & echo 'exit 4' >&\"$1\"; exec sleep 30",
                4,
                false,
                false,
            ),
            (
                3_900_012,
                "echo 'exit 300' >&\"$1\"; exit 5",
                5,
                false,
                true,
            ),
        ];
        for (i, (uid, rest, code, reported, alone)) in cases.into_iter().enumerate() {
            let id = format!("direct-reported-{i}");
            let script = format!("{REPORTER}{rest}");
            let warm = Launch {
                relay: true,
                ..Launch::program(
                    vec!["/bin/sh".into(), "-c".into(), script.clone(), "sh".into()],
                    vec!["PATH=/usr/bin:/bin".into()],
                )
            };
            let spec = build(&self.plan(&id, uid)).map_err(|e| e.to_string())?;
            let created = helper
                .create(&id, self.bundle(&id, &spec), self.policy(), Some(warm))
                .await
                .map_err(|e| format!("create: {}", runtime::error::Chain(&e)))?;
            let ran = launch_with(created, vec!["/unused".into()], true);
            let removed = helper.remove(&id).await;
            let (out, status) = ran?;
            let report = runtime::init::Report::decode(&status);
            let took_report = report.marks.iter().any(|(name, _)| name == "reported");
            if report.exit != Some(runtime::init::ProgramExit::Code(code))
                || took_report != reported
                || runtime::init::ended_alone(status.as_bytes()) != alone
                || out != "out\n"
            {
                return Err(format!(
                    "{script:?}: want exit {code}, reported {reported}, alone {alone}, output \"out\": {status:?}, {out:?}"
                ));
            }
            match removed {
                Ok(None) => {}
                Ok(Some(step)) => return Err(format!("remove: {step}")),
                Err(e) => return Err(format!("remove: {e}")),
            }
            self.nothing_left(&id)?;
        }
        Ok(())
    }
}

impl Test {
    /// A serving init ([`runtime::init::serve`]) starts a program per launch, all in one pid namespace: a second
    /// program sees the first by the pid the daemon was told, a signal reaches only a program it started, a
    /// missing program or directory ends with 127 and says why, and closing the channel ends the container.
    async fn serves(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-serve";
        let created = self.create(helper, id, 3_900_011).await?;
        let served = serve_checks(&created).await;
        drop(created.launch);
        let mut status = String::new();
        std::fs::File::from(created.status)
            .read_to_string(&mut status)
            .map_err(|e| e.to_string())?;
        let ended = match runtime::init::Report::decode(&status).exit {
            Some(runtime::init::ProgramExit::Code(0)) => Ok(()),
            _ => Err(format!(
                "the serving init did not end with exit 0: {status:?}"
            )),
        };
        let removed = match helper.remove(id).await {
            Ok(None) => Ok(()),
            Ok(Some(step)) => Err(format!("remove: {step}")),
            Err(e) => Err(format!("remove: {e}")),
        };
        served
            .and(ended)
            .and(removed)
            .and_then(|()| self.nothing_left(id))
    }
}

impl Test {
    /// A kept serving init ([`runtime::init::serve`]) outlives its daemon's end of the channel: a later daemon
    /// takes a copy of that end from the init (`pidfd_getfd`), skips what was meant for the one before, lists the
    /// program still running with the pipes the init held for it, writes to its stdin and reads its output (nothing
    /// written meanwhile is lost), and signals it; a program that ended meanwhile is not listed.
    async fn serves_kept(&self, helper: &HelperClient) -> Result<(), String> {
        let id = "direct-serve-kept";
        let spec = build(&self.plan(id, 3_900_012)).map_err(|e| e.to_string())?;
        let created = helper
            .create_kept(id, self.bundle(id, &spec), self.policy())
            .await
            .map_err(|e| format!("create: {}", runtime::error::Chain(&e)))?;
        let checked = kept_checks(&created).await;
        let removed = match helper.remove(id).await {
            Ok(None) => Ok(()),
            Ok(Some(step)) => Err(format!("remove: {step}")),
            Err(e) => Err(format!("remove: {e}")),
        };
        checked.and(removed).and_then(|()| self.nothing_left(id))
    }
}

/// The checks of [`Test::serves_kept`] on a container created kept.
async fn kept_checks(created: &runtime::helper::Created) -> Result<(), String> {
    use runtime::init::ProgramExit;
    use runtime::processes::Processes;
    use std::io::{BufRead, Write};
    let e = |e: std::io::Error| e.to_string();
    let null = std::fs::File::open("/dev/null").map_err(e)?;
    let serve = Launch {
        keep: true,
        serve: true,
        ..Launch::program(vec![], vec![])
    };
    let status_copy = created.status.try_clone().map_err(e)?;
    runtime::launch::send_keeping(
        created.launch.as_fd(),
        &serve,
        [null.as_fd(), null.as_fd(), null.as_fd()],
        &[created.launch.as_fd(), status_copy.as_fd(), null.as_fd()],
    )
    .map_err(|e| format!("serve: {e}"))?;
    let first = Processes::new(created.launch.try_clone().map_err(e)?).map_err(e)?;
    let sh = |script: &str| {
        Launch::program(
            vec!["/bin/sh".into(), "-c".into(), script.into()],
            vec!["PATH=/usr/bin:/bin".into()],
        )
    };
    let (in_r, in_w) = nix::unistd::pipe().map_err(|e| e.to_string())?;
    let (out_r, out_w) = nix::unistd::pipe().map_err(|e| e.to_string())?;
    let talker = first
        .start(
            &sh("echo one; read x; echo two $x; exec sleep 60"),
            [in_r.as_fd(), out_w.as_fd(), out_w.as_fd()],
            Some([in_w.as_fd(), out_r.as_fd(), out_r.as_fd()]),
        )
        .await
        .map_err(|e| format!("start: {e}"))?;
    let quick = first
        .start(
            &sh("exit 3"),
            [null.as_fd(), null.as_fd(), null.as_fd()],
            None,
        )
        .await
        .map_err(|e| format!("start: {e}"))?;
    drop((in_r, out_w));
    let mut out = std::io::BufReader::new(std::fs::File::from(out_r));
    let mut line = String::new();
    out.read_line(&mut line).map_err(e)?;
    if line != "one\n" {
        return Err(format!("first line {line:?}"));
    }
    // The daemon is gone: its ends of everything close, and the channel is left open.
    first.leave();
    drop((out, in_w));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    // A later daemon.
    let pidfd = runtime::sys::pidfd_open(nix::unistd::Pid::from_raw(created.pid))
        .map_err(|e| e.to_string())?;
    let chan = runtime::sys::pidfd_getfd(pidfd.as_fd(), runtime::init::serve::CHANNEL_FD)
        .map_err(|e| format!("pidfd_getfd(channel): {e}"))?;
    let later = Processes::adopt(chan)
        .await
        .map_err(|e| format!("adopt: {e}"))?;
    let running = later.list().await.map_err(|e| format!("list: {e}"))?;
    let pids: Vec<i32> = running.iter().map(|r| r.pid).collect();
    if pids != vec![talker.pid] {
        return Err(format!(
            "running {pids:?}, not only the talker {} (the quick one {} ended)",
            talker.pid, quick.pid
        ));
    }
    let [stdin, stdout, _] = running[0].held;
    let get = |fd: i32| runtime::sys::pidfd_getfd(pidfd.as_fd(), fd).map_err(|e| e.to_string());
    let mut stdin = std::fs::File::from(get(stdin)?);
    let mut stdout = std::io::BufReader::new(std::fs::File::from(get(stdout)?));
    stdin.write_all(b"x\n").map_err(e)?;
    let mut line = String::new();
    stdout.read_line(&mut line).map_err(e)?;
    if line != "two x\n" {
        return Err(format!("after the takeover the talker said {line:?}"));
    }
    match later
        .signal(talker.pid, nix::sys::signal::Signal::SIGKILL)
        .await
    {
        Ok(true) => {}
        other => return Err(format!("SIGKILL after the takeover: {other:?}")),
    }
    let mut exit = running[0].exit.clone();
    exit.wait_for(Option::is_some)
        .await
        .map_err(|e| e.to_string())?;
    if *exit.borrow() != Some(ProgramExit::Signal(9)) {
        return Err(format!("the talker ended {:?}", *exit.borrow()));
    }
    Ok(())
}

/// The checks of [`Test::serves`] on a created container.
async fn serve_checks(created: &runtime::helper::Created) -> Result<(), String> {
    use runtime::init::ProgramExit;
    use runtime::processes::Processes;
    let null = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
    let serve = Launch {
        serve: true,
        ..Launch::program(vec![], vec![])
    };
    runtime::launch::send(
        created.launch.as_fd(),
        &serve,
        [null.as_fd(), null.as_fd(), null.as_fd()],
    )
    .map_err(|e| format!("serve: {e}"))?;
    let chan = created.launch.try_clone().map_err(|e| e.to_string())?;
    let processes = Processes::new(chan).map_err(|e| e.to_string())?;
    let sh = |script: &str, cwd: Option<&str>| Launch {
        cwd: cwd.map(str::to_owned),
        ..Launch::program(
            vec!["/bin/sh".into(), "-c".into(), script.into()],
            vec!["PATH=/usr/bin:/bin".into()],
        )
    };
    // The first program says its own pid and stays.
    let (a_r, a_w) = nix::unistd::pipe().map_err(|e| e.to_string())?;
    let mut first = processes
        .start(
            &sh("echo $$; exec sleep 60", None),
            [null.as_fd(), a_w.as_fd(), a_w.as_fd()],
            None,
        )
        .await
        .map_err(|e| format!("start: {e}"))?;
    drop(a_w);
    let mut reader = std::io::BufReader::new(std::fs::File::from(a_r));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut reader, &mut line).map_err(|e| e.to_string())?;
    if line.trim() != first.pid.to_string() {
        return Err(format!(
            "the program says its pid is {line:?}, the init said {}",
            first.pid
        ));
    }
    // A second one sees it, in the directory it was given.
    let script = format!("kill -0 {} && echo seen; pwd", first.pid);
    let (out, exit) = run(&processes, &null, &sh(&script, Some("/tmp"))).await?;
    if out != "seen\n/tmp\n" || exit != ProgramExit::Code(0) {
        return Err(format!("second program: {out:?}, {exit:?}"));
    }
    // Signals reach only the init's own running programs.
    match processes
        .signal(first.pid, nix::sys::signal::Signal::SIGKILL)
        .await
    {
        Ok(true) => {}
        other => return Err(format!("SIGKILL of the first program: {other:?}")),
    }
    first
        .exit
        .wait_for(Option::is_some)
        .await
        .map_err(|e| e.to_string())?;
    let ended = *first.exit.borrow();
    if ended != Some(ProgramExit::Signal(9)) {
        return Err(format!("the first program ended {ended:?}, not by SIGKILL"));
    }
    match processes
        .signal(first.pid, nix::sys::signal::Signal::SIGTERM)
        .await
    {
        Ok(false) => {}
        other => return Err(format!("a signal to an ended program: {other:?}")),
    }
    match processes.signal(1, nix::sys::signal::Signal::SIGKILL).await {
        Ok(false) | Err(_) => {}
        other => return Err(format!("a signal to the init itself: {other:?}")),
    }
    // A missing program or directory: 127, and why on stderr.
    let missing = Launch {
        args: vec!["/no/such/program".into()],
        ..sh("", None)
    };
    let (out, exit) = run(&processes, &null, &missing).await?;
    if exit != ProgramExit::Code(127) || !out.contains("cannot execute /no/such/program") {
        return Err(format!("a missing program: {out:?}, {exit:?}"));
    }
    let (out, exit) = run(&processes, &null, &sh("pwd", Some("/no/such/dir"))).await?;
    if exit != ProgramExit::Code(127) || !out.contains("cannot change to directory /no/such/dir") {
        return Err(format!("a missing directory: {out:?}, {exit:?}"));
    }
    Ok(())
}

/// Starts `launch` through `processes` and waits for its end; its output (stdout and stderr) and how it ended.
async fn run(
    processes: &runtime::processes::Processes,
    null: &std::fs::File,
    launch: &Launch,
) -> Result<(String, runtime::init::ProgramExit), String> {
    let (r, w) = nix::unistd::pipe().map_err(|e| e.to_string())?;
    let mut started = processes
        .start(launch, [null.as_fd(), w.as_fd(), w.as_fd()], None)
        .await
        .map_err(|e| format!("start: {e}"))?;
    drop(w);
    let mut out = String::new();
    std::fs::File::from(r)
        .read_to_string(&mut out)
        .map_err(|e| e.to_string())?;
    started
        .exit
        .wait_for(Option::is_some)
        .await
        .map_err(|e| e.to_string())?;
    let exit = (*started.exit.borrow()).ok_or("no end")?;
    Ok((out, exit))
}

/// Launches `/bin/sh -c script` in a created container; its output and what the init wrote on its status pipe,
/// once it exited 0.
fn launch(created: runtime::helper::Created, script: &str) -> Result<(String, String), String> {
    let args = vec!["/bin/sh".into(), "-c".into(), script.into()];
    let (out, status) = launch_args(created, args)?;
    let report = runtime::init::Report::decode(&status);
    if report.exit != Some(runtime::init::ProgramExit::Code(0)) {
        return Err(format!(
            "program did not exit 0: {status:?}; output {out:?}"
        ));
    }
    Ok((out, status))
}

/// Launches `args` in a created container; its output (stdout and stderr) and what the init wrote on its status
/// pipe.
fn launch_args(
    created: runtime::helper::Created,
    args: Vec<String>,
) -> Result<(String, String), String> {
    launch_with(created, args, false)
}

/// [`launch_args`], handed to the container's warm interpreter when `warm`.
fn launch_with(
    created: runtime::helper::Created,
    args: Vec<String>,
    warm: bool,
) -> Result<(String, String), String> {
    let (out_r, out_w) = nix::unistd::pipe().map_err(|e| e.to_string())?;
    let null = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
    runtime::launch::send(
        created.launch.as_fd(),
        &Launch {
            warm,
            ..Launch::program(args, vec!["PATH=/usr/bin:/bin".into()])
        },
        [null.as_fd(), out_w.as_fd(), out_w.as_fd()],
    )
    .map_err(|e| format!("launch: {e}"))?;
    drop(out_w);
    let mut out = String::new();
    std::fs::File::from(out_r)
        .read_to_string(&mut out)
        .map_err(|e| e.to_string())?;
    let mut status = String::new();
    std::fs::File::from(created.status)
        .read_to_string(&mut status)
        .map_err(|e| e.to_string())?;
    Ok((out, status))
}
