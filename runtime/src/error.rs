//! Errors of the runtime crate: one enum per module (cgroups: [`CgroupError`], caps: [`CapsError`], landlock:
//! [`LandlockError`], direct start: [`StartError`], seccomp: [`SeccompError`], rootfs: [`RootfsError`], launch: [`LaunchError`], helper client:
//! [`HelperError`]; each module re-exports its own), gathered into [`Error`], the error every public function
//! returns. They are defined here rather than in their modules so that this module depends on no other: every
//! module uses `crate::error`, and nothing here uses a module back (no module cycle).
//!
//! Messages follow one rule: a message says what failed and does not repeat its `#[source]`; [`Chain`] prints an
//! error with all its sources when the whole story has to fit on one line (a log field, a status pipe record).

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while preparing, running or cleaning up a container.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem operation failed on a named path.
    #[error("I/O error on {path}")]
    Io {
        /// The path the operation was about.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A system call failed.
    #[error("System call {call} failed")]
    Sys {
        /// What was called (and on what).
        call: String,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// The cgroup hierarchy is not usable, or lacks a controller sandboxd requires.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The process holds capabilities it must not hold.
    #[error(transparent)]
    Caps(#[from] CapsError),
    /// Landlock cannot be enforced.
    #[error(transparent)]
    Landlock(#[from] LandlockError),
    /// The seccomp profile cannot be compiled or installed.
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    /// An image's root cannot be mounted safely.
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    /// Building the OCI spec failed.
    #[error("Invalid container spec")]
    Spec(#[from] oci_spec::OciSpecError),
    /// The bundle's `config.json` could not be written.
    #[error("Cannot write the container spec {path}")]
    SaveSpec {
        /// Where it was to be written.
        path: PathBuf,
        /// Why it was not.
        #[source]
        source: oci_spec::OciSpecError,
    },
    /// libcontainer failed to build or start a container (in the helper process).
    #[cfg(feature = "libcontainer")]
    #[error("Cannot {op} the container")]
    Container {
        /// The step that failed.
        op: ContainerOp,
        /// libcontainer's error.
        #[source]
        source: libcontainer::error::LibcontainerError,
    },
    /// The direct start could not create a container.
    #[error(transparent)]
    Start(#[from] StartError),
    /// libcontainer created a container but knows no pid for its init.
    #[cfg(feature = "libcontainer")]
    #[error("The created container has no pid")]
    NoPid,
    /// The configured container start (its `sandbox.start` name; the cargo feature has the same name) is not
    /// compiled into this build (`sandbox.start: libcontainer` without the
    /// `libcontainer` cargo feature). Refused before any helper starts, never replaced by another start.
    #[error("This build has no {0} start; rebuild with --features {0}")]
    StartNotBuilt(&'static str),
    /// A message on the launch channel could not be encoded, decoded or trusted.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The helper answered something unexpected, or could not create a container.
    #[error(transparent)]
    Helper(#[from] HelperError),
    /// The helper process is gone.
    #[error("The container helper process is gone")]
    HelperGone,
    /// A blocking task the daemon ran for a container panicked or was cancelled.
    #[error("The {task} task did not finish")]
    Task {
        /// What the task did.
        task: &'static str,
        /// Why it ended early.
        #[source]
        source: tokio::task::JoinError,
    },
    /// Files given for the working directory do not fit or are malformed.
    #[error("Invalid input file {path}: {reason}")]
    InputFile {
        /// Path relative to the working directory.
        path: String,
        /// Why it was refused.
        reason: String,
    },
}

/// The libcontainer step of [`Error::Container`].
#[cfg(feature = "libcontainer")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerOp {
    /// Configuring the builder (state directory, id).
    Configure,
    /// Creating the container (namespaces, cgroup, rootfs, init).
    Create,
    /// Starting the created container's init.
    Start,
}

#[cfg(feature = "libcontainer")]
impl std::fmt::Display for ContainerOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Configure => "configure",
            Self::Create => "create",
            Self::Start => "start",
        })
    }
}

// Errors of the direct start (`crate::direct`).

/// Why the direct start could not create a container.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The spec asks for something the direct start does not do (it refuses rather than skips).
    #[error("The container spec asks for {0}, which the direct start does not do")]
    Unsupported(String),
    /// The bundle's `config.json` could not be read.
    #[error("Cannot read the container spec {path}")]
    ReadSpec {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: oci_spec::OciSpecError,
    },
    /// A container with this id exists already (its cgroup leaf, state or process): nothing of it is touched.
    #[error("A container {0} exists already")]
    Exists(String),
    /// The helper could not take the container's host ids (or its effective capabilities back) to create the
    /// container's user namespace as its owner.
    #[error("Cannot create the container's namespaces as its host uid: {step}")]
    Owner {
        /// The step (`setresuid`, `raise the effective capabilities`, ...).
        step: &'static str,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// `clone3` refused to create the container's init.
    #[error("clone3 of the container's init failed")]
    Clone(#[source] nix::Error),
    /// The user namespace's id map could not be written.
    #[error("Cannot write {path}")]
    IdMap {
        /// The map file.
        path: PathBuf,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// The cloned init reported a set-up step that failed (namespaces, mounts, privileges).
    #[error("Container set-up failed: {0}")]
    Setup(String),
    /// The cloned init ended (or closed its channel) before it reported its set-up.
    #[error("The container's init ended during set-up")]
    Gone,
    /// The cloned init did not report its set-up in time.
    #[error("The container's init did not finish set-up within {} ms", .0.as_millis())]
    Timeout(std::time::Duration),
}

// Errors of cgroups (`crate::cgroups`).

/// Why a cgroup operation failed, or why the host's cgroups cannot enforce what sandboxd requires.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// libcgroups could not tell which hierarchy the host runs.
    #[error("Cannot detect the cgroup setup under {root}")]
    Detect {
        /// The cgroupfs root.
        root: PathBuf,
        /// libcgroups' error.
        #[source]
        source: libcgroups::common::GetCgroupSetupError,
    },
    /// The configured parent is not a plain relative path.
    #[error("Invalid cgroup parent {0:?}")]
    InvalidParent(String),
    /// v1 controllers sandboxd needs are not mounted.
    #[error(
        "The host does not mount cgroup v1 controller(s) {} under {}; mount them or boot with the unified hierarchy",
        .missing.join(", "),
        .root.display()
    )]
    V1ControllersMissing {
        /// The controllers missing.
        missing: Vec<&'static str>,
        /// The cgroupfs root.
        root: PathBuf,
    },
    /// v2 controllers sandboxd needs are not available.
    #[error("The host does not offer cgroup v2 controller(s) {} in {}", .missing.join(", "), .file.display())]
    V2ControllersMissing {
        /// The controllers missing.
        missing: Vec<&'static str>,
        /// The `cgroup.controllers` file read.
        file: PathBuf,
    },
    /// v2 controllers sandboxd needs are not enabled for the cgroup its parent is created in (the daemon runs
    /// outside a delegating unit and nothing enabled them there).
    #[error(
        "cgroup v2 controller(s) {} are not enabled in {}, so sandbox.cgroup_parent cannot use them: run sandboxd \
         under systemd/sandboxd.service (Delegate=yes enables them), or enable them with `echo '{}' > {}`",
        .missing.join(", "), .file.display(), .missing.iter().map(|c| format!("+{c}")).collect::<Vec<_>>().join(" "),
        .file.display()
    )]
    V2ControllersNotEnabled {
        /// The controllers missing.
        missing: Vec<&'static str>,
        /// The `cgroup.subtree_control` file read.
        file: PathBuf,
    },
    /// The host has swap but no memory+swap accounting, so a memory limit cannot forbid swap.
    #[error(
        "The host has swap but memory.memsw is missing (boot with swapaccount=1), so \"no swap\" cannot be enforced"
    )]
    NoSwapAccounting,
    /// No hierarchy carries a controller an operation needs.
    #[error("No {controller} cgroup hierarchy: {needed_for} cannot be enforced")]
    NoHierarchy {
        /// The controller.
        controller: &'static str,
        /// What needed it.
        needed_for: &'static str,
    },
    /// A cgroup directory that must exist does not.
    #[error("Cgroup {} does not exist", .0.display())]
    Missing(PathBuf),
    /// A cgroup refused a change (a value, a process) or a read; cgroups-rs's error names the file.
    #[error("Cgroup {} refused {what}", .leaf.display())]
    Refused {
        /// What was refused.
        what: &'static str,
        /// The cgroup directory.
        leaf: PathBuf,
        /// cgroups-rs's error.
        #[source]
        source: cgroups_rs::fs::error::Error,
    },
    /// A cgroup file could not be opened, or refused a value written to it.
    #[error("Cannot write {what} to {}", .path.display())]
    File {
        /// What was written.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// A limit that does not fit a cgroup file (`i64`).
    #[error("Invalid {what} {value}")]
    InvalidLimit {
        /// Which limit.
        what: &'static str,
        /// The value.
        value: u64,
    },
    /// A pid that cannot name a process.
    #[error("Invalid pid {0}")]
    InvalidPid(i32),
    /// The kernel did not report a freeze or thaw in time.
    #[error("Cgroup of {id} not {} within {} ms", if *.frozen { "frozen" } else { "thawed" }, .timeout.as_millis())]
    FreezeTimeout {
        /// The container.
        id: String,
        /// The state asked for.
        frozen: bool,
        /// How long was waited.
        timeout: std::time::Duration,
    },
    /// A cpu quota that is not a positive number of cores.
    #[error("Invalid cpu quota {0}")]
    InvalidQuota(f64),
    /// Processes of a cgroup outlived the kill rounds.
    #[error("Processes in {} survive SIGKILL", .0.display())]
    Unkillable(PathBuf),
}

// Errors of caps (`crate::caps`).

/// Why the capability check failed.
#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    /// A set could not be read.
    #[error("Cannot read the {set:?} capability set")]
    Read {
        /// The set.
        set: ::caps::CapSet,
        /// The caps crate's error.
        #[source]
        source: caps::errors::CapsError,
    },
    /// A set holds capabilities (named, sorted).
    #[error("The {set:?} capability set is not empty: {}", .held.join(", "))]
    Held {
        /// The set.
        set: ::caps::CapSet,
        /// What it holds.
        held: Vec<String>,
    },
    /// The daemon's effective set lacks capabilities its container helper uses.
    #[error("The daemon lacks {} in its effective capability set; {}", .missing.join(", "), missing_fix(*.in_bounding))]
    Missing {
        /// What is missing, in the order checked.
        missing: Vec<String>,
        /// Whether the bounding set still holds all of them.
        in_bounding: bool,
    },
}

fn missing_fix(in_bounding: bool) -> &'static str {
    if in_bounding {
        "the bounding set still has them, so they were dropped before sandboxd started and no_new_privs kept \
         execve from restoring them. systemd 255 and later drop CAP_SETUID from a unit that names User= (even \
         root) and sets a seccomp-based directive (ProtectKernelModules=, SystemCallFilter=, ...): leave User= out, \
         system services run as root by default"
    } else {
        "add them to the service's capability bounding set (CapabilityBoundingSet=, docker --cap-add)"
    }
}

// Errors of landlock (`crate::landlock`).

/// Why landlock cannot confine the program.
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    /// The kernel's ABI is too old or landlock is disabled.
    #[error("Landlock ABI {0} is not usable")]
    Abi(i32),
    /// Building or applying the ruleset failed.
    #[error("Cannot apply the landlock ruleset")]
    Ruleset(#[from] ::landlock::RulesetError),
    /// The kernel applied the ruleset only partly, or without `no_new_privs`.
    #[error(
        "Landlock ruleset {status:?} (no_new_privs {no_new_privs}): refusing to run the program"
    )]
    NotEnforced {
        /// What the kernel reported.
        status: ::landlock::RulesetStatus,
        /// Whether `no_new_privs` is set.
        no_new_privs: bool,
    },
}

// Errors of seccomp (`crate::seccomp`).

/// Why the syscall profile cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// sandboxd has no profile for the architecture it was built for.
    #[error("No seccomp profile for architecture {0}")]
    Arch(&'static str),
    /// The profile text does not compile.
    #[error("The seccomp profile does not compile")]
    Compile(#[source] seccompiler::Error),
    /// A filter the profile must hold is missing.
    #[error("The seccomp profile has no `{0}` filter")]
    MissingFilter(&'static str),
    /// The allowlist laid out as a search tree does not answer like seccompiler's program (a bug: nothing is
    /// installed).
    #[error(
        "The seccomp allowlist's search tree answers syscall {nr} (arch {arch:#x}) with {tree:?}, the compiled \
         filter with {compiled:?}"
    )]
    Relayout {
        /// The syscall number.
        nr: u32,
        /// The architecture asked about.
        arch: u32,
        /// The tree's return value (`None`: the emulator could not tell).
        tree: Option<u32>,
        /// seccompiler's return value.
        compiled: Option<u32>,
    },
    /// The two filters chained are longer than the kernel takes.
    #[error("The seccomp filters chained are {0} instructions, over the kernel's 4096")]
    ChainTooLong(usize),
    /// The chained program does not answer like the two filters installed in turn (a bug: nothing is installed).
    #[error(
        "The chained seccomp program answers syscall {nr} (arch {arch:#x}) with {chained:?}, the two filters with \
         {separate:?}"
    )]
    Chain {
        /// The syscall number.
        nr: u32,
        /// The architecture asked about.
        arch: u32,
        /// The chained program's return value (`None`: the emulator could not tell).
        chained: Option<u32>,
        /// The filters' return value installed in turn (`None`: the emulator could not tell).
        separate: Option<u32>,
    },
    /// The profile holds filters nothing would install.
    #[error("The seccomp profile has filters other than allowlist and denylist")]
    ExtraFilters,
    /// The kernel refused a filter.
    #[error("Cannot install the seccomp {filter}")]
    Install {
        /// What was installed: `profile` (both filters chained).
        filter: &'static str,
        /// seccompiler's error.
        #[source]
        source: seccompiler::Error,
    },
}

// Errors of rootfs (`crate::rootfs`).

/// Why an image's overlay root cannot be mounted safely.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// overlayfs options cannot carry the path of a layer.
    #[error("An image layer path holds a ',' or ':' or is not UTF-8")]
    LayerPath,
    /// The overlay options do not fit the kernel's page of mount options.
    #[error(
        "{layers} image layers make overlay options of {bytes} bytes, more than the kernel's 4 KiB"
    )]
    TooManyLayers {
        /// Layers of the image.
        layers: usize,
        /// Length of the options.
        bytes: usize,
    },
    /// A runtime mount point in the image is a symlink or a file.
    #[error("The image's /{0} is not a directory; refusing to mount over it")]
    MountPoint(&'static str),
}

// Errors of launch (`crate::launch`).

/// Why a launch could not be sent or was refused.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The launch could not be encoded.
    #[error("Cannot encode the launch")]
    Encode(#[source] serde_json::Error),
    /// The launch is larger than [`crate::launch::MAX_LAUNCH`].
    #[error("Launch over {max} bytes")]
    TooLarge {
        /// The largest launch accepted.
        max: usize,
    },
    /// The launch message carries the wrong number of descriptors.
    #[error("Launch carries {0} descriptors, not 4")]
    Descriptors(usize),
    /// The datagram is not the launch message.
    #[error("Malformed launch message")]
    Malformed,
    /// The payload is not a launch.
    #[error("Cannot decode the launch")]
    Decode(#[source] serde_json::Error),
    /// The program is not an absolute path.
    #[error("Launch args must start with an absolute program path")]
    RelativeProgram,
    /// The working directory is not an absolute path.
    #[error("The launch's working directory must be an absolute path")]
    RelativeDirectory,
    /// An argument or environment string holds a NUL (no program can take it).
    #[error("A launch argument or environment string holds a NUL byte")]
    Nul,
}

// Errors of the container's init (`crate::init`).

/// Why the container's init could not become the init or fork the program; reported on the status pipe.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The program, an argument or an environment entry is empty where it may not be, or holds a NUL byte.
    #[error("Invalid program, argument or environment entry")]
    InvalidArg,
    /// Closing descriptors, the parent-death signal or the dumpable flag failed.
    #[error("Cannot become the container's init")]
    Become(#[source] Box<Error>),
    /// A system call of the init failed.
    #[error("{call} failed in the container's init")]
    Sys {
        /// The call.
        call: &'static str,
        /// Its error.
        #[source]
        source: nix::Error,
    },
    /// The init returned to its caller, which it never does once it runs.
    #[error("The init returned")]
    Returned,
}

// Errors of the helper client (`crate::helper`).

/// What went wrong between the daemon and the helper.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// A request could not be encoded.
    #[error("Cannot encode a request to the helper")]
    Encode(#[source] serde_json::Error),
    /// The helper answered a create with the wrong number of descriptors.
    #[error("The helper's created event carries {0} descriptors, not 3")]
    Descriptors(usize),
    /// The helper answered a request with an event of another kind.
    #[error("Unexpected answer from the helper to {request}: {event:?}")]
    Unexpected {
        /// The request (`create`, `remove`).
        request: &'static str,
        /// What came back.
        event: String,
    },
    /// The helper could not create or start the container. `message` is the helper's error with its sources
    /// ([`crate::error::Chain`]): it crossed a process boundary, so it is text, shown as it is.
    #[error("{message}")]
    CreateFailed {
        /// The helper's report.
        message: String,
    },
}

impl Error {
    /// Wraps an `io::Error` with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// Wraps an errno with the call that returned it.
    pub fn sys(call: impl Into<String>, source: nix::Error) -> Self {
        Self::Sys {
            call: call.into(),
            source,
        }
    }

    /// Wraps a failed `config.json` write.
    pub fn save_spec(path: impl Into<PathBuf>, source: oci_spec::OciSpecError) -> Self {
        Self::SaveSpec {
            path: path.into(),
            source,
        }
    }

    /// Wraps a libcontainer failure with the step it happened in.
    #[cfg(feature = "libcontainer")]
    pub fn container(op: ContainerOp, source: libcontainer::error::LibcontainerError) -> Self {
        Self::Container { op, source }
    }
}

/// Displays an error followed by each of its sources, `": "`-separated, on one line: `Cannot create the container:
/// failed to ...: No such file or directory`.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'a));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_prints_every_source_once() {
        let e = Error::io(
            "/x",
            std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
        );
        assert_eq!(e.to_string(), "I/O error on /x");
        assert_eq!(Chain(&e).to_string(), "I/O error on /x: gone");
        let e = Error::from(CgroupError::InvalidParent("a/../b".into()));
        assert_eq!(Chain(&e).to_string(), e.to_string());
    }
}
