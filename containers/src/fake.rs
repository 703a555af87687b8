//! A recording fake backend for unit tests: each "container" is a directory under a temporary root and its program
//! a plain child process (`sh -c <code>` in its own process group, with the stdio the engine hands over), so the
//! engine's paths run without root, namespaces or cgroups. Every call is recorded ([`Call`]) for the tests'
//! assertions, and usage is scripted ([`Script`]): a scripted OOM kills the program with `SIGKILL` and then reports
//! an OOM kill, as the kernel's OOM killer and the cgroup's counter would.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use runtime::cgroups::{CgroupLimits, Usage};
use runtime::init::ProgramExit;
use runtime::launch::Launch;
use runtime::rootfs::InputFile;
use tokio::sync::oneshot;

use crate::agent::Workspace;
use crate::image::{LanguageRuntime, RootImage, RootKind};
use crate::{
    BoxFuture, ContainerBackend, ContainerHandle, CreateError, EndRecord, LaunchError, Plan,
    PrepareError, WorkspacePlan,
};

use crate::fake_record::{lock, Program};
pub use crate::fake_record::{Call, Recorder, Script};

/// The fake backend: containers are directories under `root`.
pub struct FakeBackend {
    root: PathBuf,
    recorder: Arc<Recorder>,
}

impl FakeBackend {
    /// A backend creating its containers under `root`.
    pub fn new(root: &Path, recorder: Arc<Recorder>) -> Self {
        Self {
            root: root.to_owned(),
            recorder,
        }
    }
}

impl ContainerBackend for FakeBackend {
    fn create<'a>(
        &'a self,
        plan: Plan<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn ContainerHandle>, CreateError>> {
        Box::pin(async move {
            let dir = self.root.join(plan.cid);
            for sub in ["code", "workspace"] {
                let sub = dir.join(sub);
                std::fs::create_dir_all(&sub)
                    .map_err(|e| CreateError::Prepare(runtime::Error::io(sub, e)))?;
            }
            // The real backend mounts a snapshot as an overlay's lower layer; the fake copies it.
            if let Some(layer) = plan.snapshot {
                let to = dir.join("workspace");
                std::fs::remove_dir(&to)
                    .and_then(|()| runtime::tree::copy_tree(layer, &to, u64::MAX).map(|_| ()))
                    .map_err(|e| CreateError::Prepare(runtime::Error::io(to, e)))?;
            }
            self.recorder.record(Call::Create(plan.cid.to_owned()));
            Ok(Box::new(FakeContainer {
                cid: plan.cid.to_owned(),
                dir,
                recorder: self.recorder.clone(),
                script: *lock(&self.recorder.script),
                code: Mutex::new(String::new()),
                program: Arc::new(Mutex::new(Program::default())),
                end: Mutex::new(None),
                oom_killed: Arc::new(AtomicBool::new(false)),
            }) as Box<dyn ContainerHandle>)
        })
    }

    fn create_workspace<'a>(
        &'a self,
        plan: WorkspacePlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, CreateError>> {
        let made = crate::fake_runs::FakeWorkspace::create(plan, self.recorder.clone())
            .map(|w| Arc::new(w) as Arc<dyn Workspace>)
            .map_err(CreateError::Prepare);
        Box::pin(std::future::ready(made))
    }

    fn parallelism(&self) -> usize {
        2
    }

    fn alive(&self) -> bool {
        true
    }

    fn gone(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::pending())
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

struct FakeContainer {
    cid: String,
    dir: PathBuf,
    recorder: Arc<Recorder>,
    script: Script,
    code: Mutex<String>,
    program: Arc<Mutex<Program>>,
    end: Mutex<Option<oneshot::Receiver<EndRecord>>>,
    oom_killed: Arc<AtomicBool>,
}

impl FakeContainer {
    fn spawn(&self, stdio: [BorrowedFd<'_>; 3]) -> std::io::Result<()> {
        let [stdin, stdout, stderr]: [OwnedFd; 3] = [
            stdio[0].try_clone_to_owned()?,
            stdio[1].try_clone_to_owned()?,
            stdio[2].try_clone_to_owned()?,
        ];
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(&*lock(&self.code))
            .current_dir(self.dir.join("workspace"))
            .stdin(stdin)
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .spawn()?;
        let group = Pid::from_raw(child.id() as i32);
        lock(&self.program).group = Some(group);
        let (tx, rx) = oneshot::channel();
        *lock(&self.end) = Some(rx);
        let program = self.program.clone();
        std::thread::spawn(move || {
            // Like the init's report: `exit N` or `signal N`.
            let record = match child.wait() {
                Ok(status) => match (status.code(), status.signal()) {
                    (Some(code), _) => ProgramExit::Code(code).encode(),
                    (None, Some(sig)) => ProgramExit::Signal(sig).encode(),
                    (None, None) => String::new(),
                },
                Err(_) => String::new(),
            };
            // What is left of the group goes with it, as a pid namespace's processes go with its init.
            let mut p = lock(&program);
            p.signal(Signal::SIGKILL);
            p.group = None;
            drop(p);
            let _ = tx.send((record, runtime::init::monotonic_ns()));
        });
        if let Some(after) = self.script.oom_after {
            let (program, oom) = (self.program.clone(), self.oom_killed.clone());
            std::thread::spawn(move || {
                std::thread::sleep(after);
                let p = lock(&program);
                if p.group.is_some() {
                    oom.store(true, Ordering::SeqCst);
                    p.signal(Signal::SIGKILL);
                }
            });
        }
        Ok(())
    }
}

impl ContainerHandle for FakeContainer {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn workspace(&self) -> PathBuf {
        self.dir.join("workspace")
    }

    fn prepare(
        &self,
        limits: CgroupLimits,
        _code_name: &'static str,
        code: Vec<u8>,
        files: Vec<InputFile>,
    ) -> BoxFuture<'static, Result<(), PrepareError>> {
        self.recorder
            .record(Call::SetLimits(self.cid.clone(), limits));
        *lock(&self.code) = String::from_utf8_lossy(&code).into_owned();
        let written = files.iter().try_for_each(|f| {
            let path = self.workspace().join(&f.path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| runtime::Error::io(parent, e))?;
            }
            std::fs::write(&path, &f.content).map_err(|e| runtime::Error::io(path, e))
        });
        let written = written.map_err(PrepareError::Failed);
        Box::pin(std::future::ready(written))
    }

    fn launch(&self, _launch: &Launch, stdio: [BorrowedFd<'_>; 3]) -> Result<(), LaunchError> {
        self.recorder.record(Call::Launch(self.cid.clone()));
        self.spawn(stdio)
            .map_err(|e| LaunchError::Send(runtime::Error::io("sh", e)))
    }

    fn watch_end(&self) -> std::io::Result<oneshot::Receiver<EndRecord>> {
        lock(&self.end)
            .take()
            .ok_or_else(|| std::io::Error::other("not launched"))
    }

    fn kill(&self, signal: Signal) {
        self.recorder.record(Call::Kill(self.cid.clone(), signal));
        lock(&self.program).signal(signal);
    }

    fn usage(&self) -> runtime::Result<Usage> {
        Ok(Usage {
            peak_memory_bytes: self.script.peak_memory_bytes,
            cpu_time_ns: self.script.cpu_time_ns,
            oom_kills: u64::from(self.oom_killed.load(Ordering::SeqCst)),
        })
    }

    /// A fake container has no network namespace of its own: the listener is on the host's loopback, on a port
    /// the kernel picks (the requested one may be taken).
    fn listen_inside(
        &self,
        address: std::net::SocketAddr,
    ) -> std::io::Result<std::net::TcpListener> {
        crate::fake_record::loopback_listener(address)
    }

    fn remove(self: Box<Self>) -> BoxFuture<'static, ()> {
        self.recorder.record(Call::Remove(self.cid.clone()));
        // The helper kills whatever still runs before it deletes a container.
        lock(&self.program).signal(Signal::SIGKILL);
        let _ = std::fs::remove_dir_all(&self.dir);
        Box::pin(std::future::ready(()))
    }
}

/// A language runtime for the fake: `shell`, on an image nothing reads.
pub fn shell() -> LanguageRuntime {
    LanguageRuntime {
        image: Arc::new(RootImage {
            name: "fake".into(),
            digest: "sha256:fake".into(),
            kind: RootKind::Oci { lowers: Vec::new() },
            landlock: runtime::landlock::Policy {
                abi: 0,
                read_only: Vec::new(),
                read_write: Vec::new(),
                devices: Vec::new(),
            },
            env: Vec::new(),
            preload: Vec::new(),
        }),
        command: vec!["/bin/sh".into()],
        file_name: "main.sh",
        warm: None,
    }
}
