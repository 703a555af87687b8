//! The long-lived kind on the fake backend (tests only): a workspace is a plain directory laid out like the real
//! one (`code/`, `scratch/workspace`, `scratch/tmp`), a run's agent a plain child process in its own process group.
//! Paths under `/sandbox` and `/workspace` in the agent's command and environment are rewritten to the workspace's
//! directories, as the container's bind mounts would show them. `SIGKILL` ends the group (as the end of a pid
//! namespace would), other signals go to the agent alone (as the init passes them on); freeze and thaw stop and
//! continue the group, and they and the CPU quota are recorded. Usage is the recorder's script.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use runtime::init::ProgramExit;
use runtime::rootfs::{InputFile, CODE_DIR, WORKDIR};
use tokio::sync::watch;

use crate::agent::{BoxFuture, Ended, LongLivedError, RunContainer, RunPlan, RunUsage, Workspace};
use crate::fake_record::{lock, Call, Program, Recorder};
use crate::WorkspacePlan;

/// A workspace directory.
pub struct FakeWorkspace {
    id: String,
    dir: PathBuf,
    recorder: Arc<Recorder>,
}

impl FakeWorkspace {
    /// `<parent>/<id>/` with its layout.
    pub fn create(plan: WorkspacePlan<'_>, recorder: Arc<Recorder>) -> runtime::Result<Self> {
        let dir = plan.parent.join(plan.id);
        for sub in ["code", "scratch/tmp"] {
            let sub = dir.join(sub);
            std::fs::create_dir_all(&sub).map_err(|e| runtime::Error::io(sub, e))?;
        }
        let workspace = dir.join("scratch/workspace");
        // The real backend mounts a snapshot as an overlay's lower layer; the fake copies it.
        match (plan.snapshot, plan.subvolume) {
            (_, Some(_)) => Err(std::io::Error::other(
                "the fake backend has no copy-on-write workspaces",
            )),
            (Some(layer), None) => {
                runtime::tree::copy_tree(layer, &workspace, u64::MAX).map(|_| ())
            }
            (None, None) => std::fs::create_dir(&workspace),
        }
        .map_err(|e| runtime::Error::io(&workspace, e))?;
        recorder.record(Call::CreateWorkspace(plan.id.to_owned()));
        Ok(Self {
            id: plan.id.to_owned(),
            dir,
            recorder,
        })
    }

    /// `s` with a leading `/sandbox` or `/workspace` replaced by the host directory it stands for.
    fn host_path(&self, s: &str) -> String {
        for (inside, outside) in [
            (CODE_DIR, self.dir.join("code")),
            (WORKDIR, self.workspace()),
        ] {
            if let Some(rest) = s.strip_prefix(inside) {
                if rest.is_empty() || rest.starts_with('/') {
                    return format!("{}{rest}", outside.display());
                }
            }
        }
        s.to_owned()
    }
}

impl Workspace for FakeWorkspace {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn workspace(&self) -> PathBuf {
        self.dir.join("scratch/workspace")
    }

    fn host_id(&self) -> u32 {
        // The control socket is chowned to it: the test's own uid is the one it may chown to without root.
        nix::unistd::getuid().as_raw()
    }

    fn root_upper(&self) -> Option<PathBuf> {
        // The fake's runs have no root of their own.
        None
    }

    fn write_inputs(&self, name: &str, content: &[u8], files: &[InputFile]) -> runtime::Result<()> {
        let code = self.dir.join("code").join(name);
        std::fs::write(&code, content).map_err(|e| runtime::Error::io(code, e))?;
        for f in files {
            let path = self.workspace().join(&f.path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| runtime::Error::io(parent, e))?;
            }
            std::fs::write(&path, &f.content).map_err(|e| runtime::Error::io(path, e))?;
        }
        Ok(())
    }

    fn create_run<'a>(
        &'a self,
        plan: RunPlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn RunContainer>, LongLivedError>> {
        self.recorder.record(Call::Create(plan.cid.to_owned()));
        let env = plan
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), self.host_path(v)))
            .collect();
        let (ended_tx, ended) = watch::channel(None);
        let run = FakeRun {
            cid: plan.cid.to_owned(),
            args: plan.args.iter().map(|a| self.host_path(a)).collect(),
            env,
            cwd: self.workspace(),
            recorder: self.recorder.clone(),
            program: Arc::new(Mutex::new(Program::default())),
            ended_tx: Mutex::new(Some(ended_tx)),
            ended,
        };
        Box::pin(std::future::ready(Ok(
            Arc::new(run) as Arc<dyn RunContainer>
        )))
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        self.recorder.record(Call::RemoveWorkspace(self.id.clone()));
        let _ = std::fs::remove_dir_all(&self.dir);
        Box::pin(std::future::ready(()))
    }
}

/// A run: its agent as a child process.
struct FakeRun {
    cid: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    recorder: Arc<Recorder>,
    program: Arc<Mutex<Program>>,
    /// Taken by the launch (the reaper thread sends the end).
    ended_tx: Mutex<Option<watch::Sender<Option<Ended>>>>,
    ended: watch::Receiver<Option<Ended>>,
}

impl FakeRun {
    fn spawn(&self, stdio: [BorrowedFd<'_>; 3]) -> std::io::Result<()> {
        let Some(ended_tx) = lock(&self.ended_tx).take() else {
            return Err(std::io::Error::other("launched already"));
        };
        let [stdin, stdout, stderr]: [OwnedFd; 3] = [
            stdio[0].try_clone_to_owned()?,
            stdio[1].try_clone_to_owned()?,
            stdio[2].try_clone_to_owned()?,
        ];
        let (program, rest) = self
            .args
            .split_first()
            .ok_or_else(|| std::io::Error::other("no command"))?;
        let mut child = std::process::Command::new(program)
            .args(rest)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.cwd)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .spawn()?;
        *lock(&self.program) = Program::start(Pid::from_raw(child.id() as i32));
        let program = self.program.clone();
        std::thread::spawn(move || {
            let exit = match child.wait() {
                Ok(status) => match (status.code(), status.signal()) {
                    (Some(code), _) => ProgramExit::Code(code),
                    (_, Some(sig)) => ProgramExit::Signal(sig),
                    (None, None) => ProgramExit::Signal(libc::SIGKILL),
                },
                Err(_) => ProgramExit::Signal(libc::SIGKILL),
            };
            // What is left of the group goes with it, as a pid namespace's processes go with its init.
            let mut p = lock(&program);
            p.signal(Signal::SIGKILL);
            p.group = None;
            drop(p);
            let _ = ended_tx.send(Some(Ended {
                exit,
                setup_error: None,
            }));
        });
        Ok(())
    }

    fn record(&self, call: Call) -> BoxFuture<'static, Result<(), LongLivedError>> {
        let signal = match &call {
            Call::Freeze(_) => Some(Signal::SIGSTOP),
            Call::Thaw(_) => Some(Signal::SIGCONT),
            _ => None,
        };
        self.recorder.record(call);
        if let Some(signal) = signal {
            lock(&self.program).signal(signal);
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

impl RunContainer for FakeRun {
    fn cid(&self) -> &str {
        &self.cid
    }

    fn launch(
        &self,
        stdio: [BorrowedFd<'_>; 3],
        _control: Option<BorrowedFd<'_>>,
    ) -> Result<(), LongLivedError> {
        self.recorder.record(Call::Launch(self.cid.clone()));
        self.spawn(stdio)
            .map_err(|e| LongLivedError::Launch(Box::new(e)))
    }

    fn signal(&self, signal: Signal) {
        self.recorder.record(Call::Kill(self.cid.clone(), signal));
        let p = lock(&self.program);
        match (signal, p.group) {
            (Signal::SIGKILL, _) => p.signal(signal),
            // The group's leader is the agent (its pid is not reused while the group is tracked).
            (_, Some(agent)) => {
                let _ = nix::sys::signal::kill(agent, signal);
            }
            (_, None) => {}
        }
    }

    fn freeze(&self) -> BoxFuture<'static, Result<(), LongLivedError>> {
        self.record(Call::Freeze(self.cid.clone()))
    }

    fn thaw(&self) -> BoxFuture<'static, Result<(), LongLivedError>> {
        self.record(Call::Thaw(self.cid.clone()))
    }

    fn set_cpu_quota(&self, cores: f64) -> Result<(), LongLivedError> {
        self.recorder.record(Call::CpuQuota(
            self.cid.clone(),
            (cores * 1000.0).round() as u64,
        ));
        Ok(())
    }

    fn usage(&self) -> Result<RunUsage, LongLivedError> {
        let script = *lock(&self.recorder.script);
        Ok(RunUsage {
            memory_bytes: script.peak_memory_bytes,
            cpu_time_ns: script.cpu_time_ns,
        })
    }

    /// A fake run has no network namespace of its own: the listener is on the host's loopback, on a port the
    /// kernel picks (the requested one may be taken).
    fn listen_inside(
        &self,
        address: std::net::SocketAddr,
    ) -> std::io::Result<std::net::TcpListener> {
        crate::fake_record::loopback_listener(address)
    }

    fn ended(&self) -> BoxFuture<'_, Ended> {
        let mut rx = self.ended.clone();
        Box::pin(async move {
            let end = rx.wait_for(Option::is_some).await.map(|e| e.clone());
            match end {
                Ok(end) => end.unwrap_or_else(killed),
                // Never launched, and nothing can launch it any more.
                Err(_) => std::future::pending().await,
            }
        })
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        self.recorder.record(Call::Remove(self.cid.clone()));
        lock(&self.program).signal(Signal::SIGKILL);
        Box::pin(std::future::ready(()))
    }
}

fn killed() -> Ended {
    Ended {
        exit: ProgramExit::Signal(libc::SIGKILL),
        setup_error: None,
    }
}
