//! The execution engine: turns one accepted `execute` into a container run and a stream of protocol messages.
//!
//! One task per execution. It waits for a slot, prepares the scratch space and the OCI bundle, asks the helper to
//! create and start the container, streams stdout/stderr with the output limit enforced to the byte, enforces the
//! wall-clock timeout, obeys cancel and disconnect, then reports the terminal status and the result, and removes
//! everything it created. Every path out of [`Engine::run`] goes through the same cleanup.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{
    Capabilities, ErrorCode, ErrorMessage, ExecStatus, ExecuteRequest, Isolation, Language, Limits,
    Load, OutputChunk, Pong, Reason, ResourceUsage, ResultMessage, ServerMessage, Utf8Chunker,
};
use runtime::cgroups::Cgroups;
use runtime::helper::{Event, HelperClient, InitStatus, Request};
use runtime::init::ProgramExit;
use runtime::rootfs::{InputFile, RootSource, Scratch, CODE_DIR, WORKDIR};
use runtime::spec::ContainerPlan;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn, Instrument};

use crate::capacity::{Admission, Capacity, Slot};
use crate::config::Config;
use crate::images::{LanguageRuntime, RootKind};
use crate::server::Registration;
use crate::store::Store;

/// Bytes read from a pipe at once; also the largest output chunk sent.
const READ_CHUNK: usize = 64 * 1024;
/// How long output may keep flowing after the init exited (the pipes close when the pid namespace is gone).
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);
/// Messages an execution buffers while the connection is slow before it stops reading the program's output.
const MAX_PENDING: usize = 4;

/// Why the daemon killed an execution (the first reason wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillReason {
    Timeout,
    OutputLimit,
    Cancelled,
}

/// Sent by the connection to a running execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Keep going.
    Run,
    /// The client asked to cancel.
    Cancel,
}

/// Everything executions share.
pub struct Engine {
    /// The configuration in force.
    pub config: Config,
    /// The container helper.
    pub helper: HelperClient,
    /// Cgroup setup.
    pub cgroups: Cgroups,
    /// Languages, each with its image and interpreter.
    pub languages: BTreeMap<Language, LanguageRuntime>,
    /// Per-execution state directory (a private tmpfs).
    pub run_dir: PathBuf,
    /// Admission control.
    pub capacity: Capacity,
    /// Isolation layers in effect.
    pub isolation: Isolation,
    /// When the daemon started.
    pub started: Instant,
    /// Set at the end of the shutdown grace period: every running execution is killed.
    pub kill_all: watch::Sender<bool>,
    /// The artifact store.
    pub store: Arc<Store>,
    /// sha256 of the seccomp profile in force (part of every environment fingerprint).
    pub seccomp_digest: String,
    nonce: String,
    seq: AtomicU64,
}

impl Engine {
    /// Assembles the engine.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: Config,
        helper: HelperClient,
        cgroups: Cgroups,
        languages: BTreeMap<Language, LanguageRuntime>,
        run_dir: PathBuf,
        isolation: Isolation,
        store: Arc<Store>,
        seccomp_digest: String,
    ) -> Self {
        let capacity = Capacity::new(config.capacity.max_concurrent, config.capacity.max_queue);
        Self {
            config,
            helper,
            cgroups,
            languages,
            run_dir,
            capacity,
            isolation,
            started: Instant::now(),
            kill_all: watch::channel(false).0,
            store,
            seccomp_digest,
            nonce: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
        }
    }

    /// The configured maximum of every limit.
    pub fn max_limits(&self) -> Limits {
        self.config.limits.max.to_limits()
    }

    /// Protocol extensions this server implements.
    pub fn extensions(&self) -> Vec<String> {
        vec!["files".into(), "base64_output".into(), "artifacts".into()]
    }

    /// The `pong` for a `ping`.
    pub fn pong(&self) -> Pong {
        Pong {
            load: Load {
                active_executions: self.capacity.active() as u64,
                queue_depth: self.capacity.queued() as u64,
            },
            capabilities: Some(Capabilities {
                languages: self.languages.keys().copied().collect(),
                max_limits: self.max_limits(),
                extensions: self.extensions(),
                isolation: self.isolation.clone(),
            }),
        }
    }

    /// Admission for a new execution (decided at once).
    pub fn admit(&self) -> Admission {
        self.capacity.admit()
    }

    /// Runs one accepted execution to its end. `out` is the connection's ordered message queue for executions,
    /// `control` tells of a cancel; a dropped `control` sender means the client is gone.
    pub async fn run(
        self: Arc<Self>,
        req: ExecuteRequest,
        limits: Limits,
        admission: Admission,
        out: mpsc::Sender<ServerMessage>,
        mut control: watch::Receiver<Control>,
        registration: Registration,
    ) {
        let id = req.id.clone();
        let timer = crate::metrics::ExecutionTimer::begin(req.language); // metrics hook
        let queued = matches!(admission, Admission::Queued(_));
        let environment = self
            .languages
            .get(&req.language)
            .map(|l| Box::new(l.environment(&self.seccomp_digest)));
        let _ = out
            .send(ServerMessage::Ack {
                id: id.clone(),
                limits: Some(limits),
                queued: Some(queued),
                environment_fingerprint: environment.as_ref().map(|e| e.fingerprint(&limits)),
                environment,
            })
            .await;
        let slot = match admission {
            Admission::Run(slot) => slot,
            Admission::Queued(ticket) => {
                tokio::select! {
                    slot = ticket.wait() => match slot {
                        Some(s) => s,
                        None => {
                            registration.release();
                            timer.ended_without_slot("error"); // metrics hook
                            let _ = out.send(ServerMessage::Error(ErrorMessage::internal(&id, "The daemon is shutting down"))).await;
                            return;
                        }
                    },
                    _ = cancelled(&mut control) => {
                        // Cancelled (or the client left) while queued: it never ran.
                        registration.release();
                        timer.ended_without_slot("cancelled"); // metrics hook
                        let _ = out.send(ServerMessage::Status { id: id.clone(), status: ExecStatus::Cancelled }).await;
                        let _ = out.send(ServerMessage::Result(result(&id, None, Reason::Cancelled, 0, ResourceUsage::default(), [0, 0], false))).await;
                        return;
                    }
                }
            }
            Admission::Overloaded => {
                registration.release();
                timer.ended_without_slot("overloaded"); // metrics hook
                let _ = out
                    .send(ServerMessage::Error(ErrorMessage::overloaded(&id)))
                    .await;
                return;
            }
        };
        let cid = format!(
            "sbx-{}-{}",
            self.nonce,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        timer.slot_acquired(&cid); // metrics hook
        let span = tracing::info_span!("container", container = %cid, slot = slot.index());
        self.run_in_slot(req, limits, slot, cid, out, control, registration)
            .instrument(span)
            .await
    }

    #[allow(clippy::too_many_arguments)] // one call site; every argument is a distinct part of the execution
    async fn run_in_slot(
        self: Arc<Self>,
        req: ExecuteRequest,
        limits: Limits,
        slot: Slot,
        cid: String,
        out: mpsc::Sender<ServerMessage>,
        control: watch::Receiver<Control>,
        registration: Registration,
    ) {
        let id = req.id.clone();
        let host_id = self.config.sandbox.uid_base + slot.index() as u32;
        let mut events = self.helper.subscribe(&cid);
        let outcome = self
            .clone()
            .execute(&req, &limits, &cid, host_id, &mut events, &out, control)
            .await;
        registration.release();
        let mut scratch = match outcome {
            Ok((scratch, messages)) => {
                for m in messages {
                    let _ = out.send(m).await;
                }
                scratch
            }
            Err((scratch, message)) => {
                let _ = out.send(ServerMessage::Error(message)).await;
                scratch
            }
        };
        crate::metrics::finished(&cid); // metrics hook

        // Cleanup: the container (helper), then the scratch space; the slot is freed last.
        if let Some(created) = scratch.as_ref().map(|s| s.created) {
            if created {
                wait_removed(&mut events, &cid).await;
            }
        }
        self.helper.unsubscribe(&cid);
        if let Some(mut s) = scratch.take() {
            let res = tokio::task::spawn_blocking(move || s.scratch.remove()).await;
            match res {
                Ok(Ok(())) => {}
                Ok(Err(e)) => error!(error = %e, "scratch cleanup failed"),
                Err(e) => error!(error = %e, "scratch cleanup panicked"),
            }
        }
        debug!(%id, "execution cleaned up");
        drop(slot);
    }

    /// The body of an execution. Returns the final messages (terminal status and result) or the error to send, and
    /// in both cases what must be cleaned up.
    #[allow(clippy::too_many_arguments)]
    async fn execute(
        self: Arc<Self>,
        req: &ExecuteRequest,
        limits: &Limits,
        cid: &str,
        host_id: u32,
        events: &mut mpsc::UnboundedReceiver<Event>,
        out: &mpsc::Sender<ServerMessage>,
        mut control: watch::Receiver<Control>,
    ) -> Result<(Option<Prepared>, Vec<ServerMessage>), (Option<Prepared>, ErrorMessage)> {
        let id = req.id.as_str();
        let internal = |m: String| ErrorMessage::internal(id, m);
        let Some(lang) = self.languages.get(&req.language).cloned() else {
            return Err((
                None,
                ErrorMessage::new(
                    Some(id.into()),
                    ErrorCode::LanguageNotSupported,
                    "Language not available",
                ),
            ));
        };

        // Scratch space, input files, code and bundle: blocking filesystem work.
        let engine = self.clone();
        let req2 = req.clone();
        let limits2 = *limits;
        let cid2 = cid.to_owned();
        let lang2 = lang.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            engine.prepare(&req2, &limits2, &cid2, host_id, &lang2)
        })
        .await
        .map_err(|e| (None, internal(format!("Preparation panicked: {e}"))))?;
        let mut prepared = match prepared {
            Ok(p) => p,
            Err(runtime::Error::InputFile { path, reason }) => {
                return Err((
                    None,
                    ErrorMessage::new(
                        Some(id.into()),
                        ErrorCode::InvalidRequest,
                        format!("Field files: {path}: {reason}"),
                    ),
                ))
            }
            Err(e) => return Err((None, internal(format!("Cannot prepare the sandbox: {e}")))),
        };

        // Stdio: stdin is a memfd holding the whole input (read to EOF, never blocks the daemon); stdout and
        // stderr are pipes the daemon reads.
        let stdio = match make_stdio(req.stdin.as_deref().unwrap_or("").as_bytes()) {
            Ok(s) => s,
            Err(e) => {
                return Err((
                    Some(prepared),
                    internal(format!("Cannot create pipes: {e}")),
                ))
            }
        };
        let create = Request::Create {
            id: cid.to_owned(),
            bundle: prepared.scratch.dir().to_owned(),
            landlock: lang.image.landlock.clone(),
        };
        if let Err(e) = self
            .helper
            .request(
                &create,
                &[
                    stdio.stdin.as_fd(),
                    stdio.stdout_w.as_fd(),
                    stdio.stderr_w.as_fd(),
                ],
            )
            .await
        {
            return Err((
                Some(prepared),
                internal(format!("Cannot reach the container helper: {e}")),
            ));
        }
        let Stdio {
            stdin,
            stdout_r,
            stderr_r,
            stdout_w,
            stderr_w,
        } = stdio;
        // The container holds its own copies now; ours would keep the pipes from ever closing.
        drop((stdin, stdout_w, stderr_w));
        prepared.created = true;
        match events.recv().await {
            Some(Event::Created { pid, .. }) => {
                crate::metrics::created(cid); // metrics hook
                debug!(pid, "container created")
            }
            Some(Event::Failed { message, .. }) => {
                prepared.created = false;
                return Err((
                    Some(prepared),
                    internal(format!("Cannot create the container: {message}")),
                ));
            }
            other => {
                prepared.created = false;
                return Err((
                    Some(prepared),
                    internal(format!("Unexpected helper event {other:?}")),
                ));
            }
        }
        if *control.borrow() == Control::Cancel || control.has_changed().is_err() {
            // Cancelled while the container was being created: it never runs.
            let _ = self.helper.request(&kill(cid), &[]).await;
            return Ok((
                Some(prepared),
                vec![
                    ServerMessage::Status {
                        id: id.into(),
                        status: ExecStatus::Cancelled,
                    },
                    ServerMessage::Result(result(
                        id,
                        None,
                        Reason::Cancelled,
                        0,
                        ResourceUsage::default(),
                        [0, 0],
                        false,
                    )),
                ],
            ));
        }
        if let Err(e) = self
            .helper
            .request(&Request::Start { id: cid.to_owned() }, &[])
            .await
        {
            return Err((
                Some(prepared),
                internal(format!("Cannot reach the container helper: {e}")),
            ));
        }
        match events.recv().await {
            Some(Event::Started { .. }) => {}
            Some(Event::Failed { message, .. }) => {
                prepared.created = false;
                return Err((
                    Some(prepared),
                    internal(format!("Cannot start the container: {message}")),
                ));
            }
            other => {
                return Err((
                    Some(prepared),
                    internal(format!("Unexpected helper event {other:?}")),
                ))
            }
        }
        let started = Instant::now();
        info!(language = req.language.as_str(), "program started");
        if out
            .send(ServerMessage::Status {
                id: id.into(),
                status: ExecStatus::Running,
            })
            .await
            .is_err()
        {
            // The client is gone; the loop below sees it too and kills.
        }

        let mut stream = Streams::new(id, stdout_r, stderr_r, limits.max_output_bytes);
        let deadline = tokio::time::sleep(Duration::from_millis(limits.timeout_ms));
        tokio::pin!(deadline);
        let mut kill_reason: Option<KillReason> = None;
        let mut exited: Option<Event> = None;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        let mut pending: VecDeque<ServerMessage> = VecDeque::new();
        let mut client_gone = false;
        let mut kill_all = self.kill_all.subscribe();
        let mut shut_down = false;

        loop {
            if exited.is_some() && stream.done() && pending.is_empty() {
                break;
            }
            let want_output = pending.len() < MAX_PENDING && !stream.done();
            tokio::select! {
                biased;
                ev = events.recv(), if exited.is_none() => match ev {
                    Some(ev @ Event::Exited { .. }) => {
                        exited = Some(ev);
                        drain_deadline = Some(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
                    }
                    Some(other) => debug!(?other, "helper event while running"),
                    None => return Err((Some(prepared), internal("The container helper died".into()))),
                },
                permit = out.reserve(), if !pending.is_empty() && !client_gone => match permit {
                    Ok(p) => { if let Some(m) = pending.pop_front() { p.send(m) } }
                    Err(_) => { client_gone = true; pending.clear(); }
                },
                _ = &mut deadline, if kill_reason.is_none() && exited.is_none() => {
                    kill_reason = Some(KillReason::Timeout);
                    let _ = self.helper.request(&kill(cid), &[]).await;
                },
                _ = cancelled(&mut control), if kill_reason.is_none() && exited.is_none() => {
                    kill_reason = Some(KillReason::Cancelled);
                    let _ = self.helper.request(&kill(cid), &[]).await;
                },
                _ = killed(&mut kill_all), if !shut_down && exited.is_none() => {
                    shut_down = true;
                    kill_reason.get_or_insert(KillReason::Cancelled);
                    let _ = self.helper.request(&kill(cid), &[]).await;
                },
                _ = sleep_until(drain_deadline), if drain_deadline.is_some() && !stream.done() => {
                    warn!("output pipes still open after the container exited; closing them");
                    pending.extend(stream.close());
                },
                msgs = stream.read(), if want_output => {
                    let (msgs, over) = msgs;
                    pending.extend(msgs);
                    if over && kill_reason.is_none() && exited.is_none() {
                        kill_reason = Some(KillReason::OutputLimit);
                        let _ = self.helper.request(&kill(cid), &[]).await;
                    }
                },
            }
            if client_gone {
                // Nobody will read it: keep draining the pipes (so the program is not blocked) but drop the output.
                pending.clear();
            }
            if client_gone && kill_reason.is_none() && exited.is_none() {
                kill_reason = Some(KillReason::Cancelled);
                let _ = self.helper.request(&kill(cid), &[]).await;
            }
        }
        let wall = started.elapsed();
        if shut_down {
            return Err((
                Some(prepared),
                internal("The daemon shut down before the execution finished".into()),
            ));
        }

        let Some(Event::Exited {
            program,
            setup_error,
            init,
            usage,
            usage_error,
            duration_us,
            ..
        }) = exited
        else {
            return Err((Some(prepared), internal("No exit event".into())));
        };
        if let Some(e) = setup_error {
            error!(error = %e, "sandbox setup failed; the program did not run");
            return Err((
                Some(prepared),
                internal(format!("Sandbox setup failed: {e}")),
            ));
        }
        if let Some(e) = usage_error {
            error!(error = %e, "cgroup usage unreadable; reporting zeros");
        }
        let usage = usage.unwrap_or_default();
        let resource_usage = ResourceUsage {
            peak_memory_mb: usage.peak_memory_bytes.div_ceil(1 << 20),
            cpu_time_ms: usage.cpu_time_ns / 1_000_000,
        };
        let duration_ms = if duration_us > 0 {
            duration_us / 1000
        } else {
            wall.as_millis() as u64
        };
        let killed_by_kernel = |p: Option<ProgramExit>| {
            matches!(p, Some(ProgramExit::Signal(9)))
                || (p.is_none() && init == InitStatus::Signaled(9))
        };
        let reason = match kill_reason {
            Some(KillReason::Timeout) => Reason::Timeout,
            Some(KillReason::OutputLimit) => Reason::OutputLimit,
            Some(KillReason::Cancelled) => Reason::Cancelled,
            None if usage.oom_kills > 0 && killed_by_kernel(program) => Reason::Oom,
            None => match program {
                Some(ProgramExit::Code(_)) => Reason::Exited,
                Some(ProgramExit::Signal(_)) => Reason::Signaled,
                None => {
                    return Err((
                        Some(prepared),
                        internal(format!(
                            "The container's init ended without reporting the program ({init:?})"
                        )),
                    ))
                }
            },
        };
        crate::metrics::exited(cid, reason, Duration::from_millis(duration_ms)); // metrics hook
        let exit = match (reason, program) {
            (Reason::Exited, Some(ProgramExit::Code(c))) => Exit::Code(c),
            (_, Some(ProgramExit::Signal(s))) => Exit::Signal(s),
            (_, Some(ProgramExit::Code(c))) if kill_reason.is_none() => Exit::Code(c),
            _ => Exit::Signal(9),
        };
        info!(
            reason = reason.as_str(),
            ?exit,
            duration_ms,
            peak_memory_mb = resource_usage.peak_memory_mb,
            "program ended"
        );
        let environment = lang.environment(&self.seccomp_digest);
        let fingerprint = environment.fingerprint(limits);
        let artifacts = match (&req.artifacts, reason) {
            // A cancelled execution's files are not collected (artifact-manifest.md).
            (Some(_), Reason::Cancelled) | (None, _) => None,
            (Some(wanted), _) => {
                let engine = self.clone();
                let wanted = wanted.clone();
                let workspace = prepared.scratch.workspace();
                let (exec_id, fp) = (id.to_owned(), fingerprint.clone());
                let t0 = Instant::now();
                let manifest = tokio::task::spawn_blocking(move || {
                    engine.collect_artifacts(&wanted, &workspace, &exec_id, &fp)
                })
                .await
                .map_err(|e| internal(format!("Artifact collection panicked: {e}")));
                match manifest {
                    Ok(Ok(mut m)) => {
                        debug!(ms = t0.elapsed().as_millis() as u64, "artifacts collected");
                        if let Some(cfg) = &self.config.artifacts.upload {
                            self.upload_artifacts(cfg, &mut m).await;
                        }
                        Some(m)
                    }
                    Ok(Err(e)) => {
                        return Err((
                            Some(prepared),
                            internal(format!("Artifact collection failed: {e}")),
                        ))
                    }
                    Err(e) => return Err((Some(prepared), e)),
                }
            }
        };
        let mut messages: Vec<ServerMessage> = pending.into_iter().collect();
        if client_gone {
            messages.clear();
        }
        let status = match (reason, exit) {
            (Reason::Exited, Exit::Code(0)) => ExecStatus::Completed,
            (Reason::Exited | Reason::Signaled | Reason::OutputLimit, _) => ExecStatus::Failed,
            (Reason::Timeout, _) => ExecStatus::Timeout,
            (Reason::Oom, _) => ExecStatus::Oom,
            (Reason::Cancelled, _) => ExecStatus::Cancelled,
        };
        messages.push(ServerMessage::Status {
            id: id.into(),
            status,
        });
        let mut res = result(
            id,
            Some(exit),
            reason,
            duration_ms,
            resource_usage,
            [stream.sent[0], stream.sent[1]],
            stream.truncated,
        );
        res.artifacts = artifacts;
        res.environment_fingerprint = Some(fingerprint);
        res.environment = Some(Box::new(environment));
        messages.push(ServerMessage::Result(res));
        Ok((Some(prepared), messages))
    }

    /// Collects the requested files from the working directory into the store and returns the manifest.
    fn collect_artifacts(
        &self,
        wanted: &protocol::ArtifactsRequest,
        workspace: &std::path::Path,
        exec_id: &str,
        fingerprint: &str,
    ) -> Result<serde_json::Value, String> {
        let cfg = &self.config.artifacts;
        let patterns = runtime::artifacts::Patterns::new(
            &wanted.paths,
            &wanted.types.clone().unwrap_or_default(),
        )
        .map_err(|e| e.to_string())?;
        let limits = runtime::artifacts::Limits {
            max_files: cfg.max_files,
            max_file_bytes: cfg.max_file_bytes,
            max_total_bytes: cfg.max_total_bytes,
            max_listed_skips: 256,
        };
        let collection =
            runtime::artifacts::collect(workspace, &patterns, limits).map_err(|e| e.to_string())?;
        let _writing = self.store.writing();
        let mut artifacts = Vec::new();
        let mut skipped: Vec<serde_json::Value> = collection
            .skipped
            .iter()
            .map(|s| serde_json::json!({"path": s.path, "reason": s.reason}))
            .collect();
        let mut staged = Vec::with_capacity(collection.found.len());
        for mut f in collection.found {
            let path = f.path.clone();
            match self
                .store
                .stage(&mut f.file, f.size, |head| content_type(&path, head))
            {
                Ok(st) => staged.push((f.path, f.artifact_type, st)),
                Err(e) => {
                    warn!(path = %f.path, error = %e, "artifact not stored");
                    skipped.push(serde_json::json!({"path": f.path, "reason": "unreadable"}));
                }
            }
        }
        let (meta, blobs): (Vec<_>, Vec<_>) =
            staged.into_iter().map(|(p, t, s)| ((p, t), s)).unzip();
        let stored = self
            .store
            .commit(blobs)
            .map_err(|e| format!("cannot store artifacts: {e}"))?;
        for ((path, artifact_type), st) in meta.into_iter().zip(stored) {
            let mime = content_type(&path, &st.head);
            let mut entry = serde_json::json!({
                "type": artifact_type,
                "path": path,
                "ref": format!("artifact://sha256/{}", st.hex),
                "checksum": format!("sha256:{}", st.hex),
                "size_bytes": st.size,
                "mime_type": mime,
            });
            if let Some(p) = preview(&st.head) {
                entry["preview"] = p.into();
            }
            artifacts.push(entry);
        }
        let manifest_id = format!("am_{:x}{:08x}", unix_millis(), rand::random::<u32>());
        let mut manifest = serde_json::json!({
            "manifest_id": manifest_id,
            "execution_id": exec_id,
            "generated_at": protocol::now_ts(),
            "environment_fingerprint": fingerprint,
            "artifacts": artifacts,
            "skipped": skipped,
        });
        let listed = manifest["skipped"]
            .as_array()
            .map(|a| a.len() as u64)
            .unwrap_or(0);
        let total_skipped: u64 = collection.skipped_counts.values().sum();
        if total_skipped > listed || collection.walk_truncated {
            manifest["dropped"] = serde_json::json!({
                "by_reason": collection.skipped_counts,
                "not_listed": total_skipped.saturating_sub(listed),
                "walk_truncated": collection.walk_truncated,
            });
        }
        self.store
            .save_manifest(&manifest_id, &manifest)
            .map_err(|e| format!("cannot save the manifest: {e}"))?;
        Ok(manifest)
    }

    /// Uploads every artifact of a manifest eagerly; the returned URI replaces the ref, a failure is reported on the
    /// artifact and the content stays in the local store. The manifest is saved again with the outcome.
    async fn upload_artifacts(
        &self,
        cfg: &crate::upload::UploadConfig,
        manifest: &mut serde_json::Value,
    ) {
        let mut failures = 0u64;
        for a in manifest["artifacts"].as_array_mut().into_iter().flatten() {
            let Some(hex) = a["checksum"]
                .as_str()
                .and_then(|c| c.strip_prefix("sha256:"))
                .map(str::to_owned)
            else {
                continue;
            };
            let Some(blob) = self.store.blob(&hex) else {
                continue;
            };
            let mime = a["mime_type"]
                .as_str()
                .unwrap_or("application/octet-stream")
                .to_owned();
            match crate::upload::upload(cfg, &blob, &hex, &mime).await {
                Ok(uri) => {
                    a["ref"] = uri.into();
                    a["uploaded"] = true.into();
                }
                Err(e) => {
                    failures += 1;
                    a["upload_error"] = e.into();
                }
            }
        }
        if failures > 0 {
            manifest["upload_failures"] = failures.into();
        }
        let (store, id, m) = (
            self.store.clone(),
            manifest["manifest_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            manifest.clone(),
        );
        let saved = tokio::task::spawn_blocking(move || store.save_manifest(&id, &m)).await;
        if !matches!(saved, Ok(Ok(()))) {
            warn!("the manifest could not be saved again after the upload");
        }
    }

    /// Scratch space with the input files and the code, and the bundle's `config.json`.
    fn prepare(
        &self,
        req: &ExecuteRequest,
        limits: &Limits,
        cid: &str,
        host_id: u32,
        lang: &LanguageRuntime,
    ) -> runtime::Result<Prepared> {
        let mut files = Vec::with_capacity(req.files.len());
        for f in &req.files {
            let content = f.decoded().map_err(|e| runtime::Error::InputFile {
                path: f.path.clone(),
                reason: e.to_string(),
            })?;
            files.push(InputFile {
                path: f.path.clone(),
                content,
            });
        }
        let disk_bytes = limits.disk_mb << 20;
        let scratch = Scratch::create(
            &self.run_dir,
            cid,
            disk_bytes,
            host_id,
            lang.file_name,
            req.code.as_bytes(),
            &files,
            match &lang.image.kind {
                RootKind::Host(_) => RootSource::Shared,
                RootKind::Oci { lowers } => RootSource::Overlay(lowers),
            },
        )?;
        let mut env: BTreeMap<String, String> = [
            ("PATH", "/usr/local/bin:/usr/bin:/bin"),
            ("HOME", WORKDIR),
            ("TMPDIR", "/tmp"),
            ("LANG", "C.UTF-8"),
            ("PYTHONUNBUFFERED", "1"),
            ("PYTHONDONTWRITEBYTECODE", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        env.extend(lang.image.env.iter().cloned());
        env.extend(req.env.clone());
        let (rootfs, readonly_root, mut binds) = match &lang.image.kind {
            RootKind::Host(host) => (host.rootfs.clone(), true, host.binds.clone()),
            RootKind::Oci { .. } => (scratch.rootfs(), false, Vec::new()),
        };
        binds.extend(scratch.binds());
        let mut args = lang.command.clone();
        args.push(format!("{CODE_DIR}/{}", lang.file_name));
        let plan = ContainerPlan {
            rootfs,
            readonly_root,
            hostname: "sandbox".into(),
            args,
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            cwd: WORKDIR.into(),
            binds,
            host_id,
            cgroups_path: self.cgroups.cgroups_path(cid),
            memory_bytes: (limits.memory_mb << 20) as i64,
            pids_max: limits.pids_max as i64,
            cpu_shares: limits.cpu_shares,
            nofile: self.config.sandbox.nofile,
            fsize_bytes: disk_bytes,
            shm_bytes: disk_bytes,
        };
        let spec = runtime::spec::build(&plan)?;
        let config = scratch.dir().join("config.json");
        spec.save(&config).map_err(|e| {
            runtime::Error::Container(format!("cannot write {}: {e}", config.display()))
        })?;
        Ok(Prepared {
            scratch,
            created: false,
        })
    }
}

/// What an execution must clean up.
struct Prepared {
    scratch: Scratch,
    /// The helper has (or may have) a container for it; wait for `Removed` before removing the scratch space.
    created: bool,
}

#[derive(Debug, Clone, Copy)]
enum Exit {
    Code(i32),
    Signal(i32),
}

fn kill(cid: &str) -> Request {
    Request::Kill {
        id: cid.to_owned(),
        signal: libc::SIGKILL,
    }
}

fn result(
    id: &str,
    exit: Option<Exit>,
    reason: Reason,
    duration_ms: u64,
    resource_usage: ResourceUsage,
    sent: [u64; 2],
    truncated: bool,
) -> ResultMessage {
    let (exit_code, signal) = match exit {
        Some(Exit::Code(c)) => (Some(c), None),
        Some(Exit::Signal(s)) => (None, Some(signal_name(s))),
        None => (None, None),
    };
    ResultMessage {
        id: id.to_owned(),
        exit_code,
        duration_ms,
        resource_usage,
        reason,
        signal,
        stdout_bytes: sent[0],
        stderr_bytes: sent[1],
        truncated,
        artifacts: None,
        environment_fingerprint: None,
        environment: None,
    }
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The content type of an artifact: from its name, else text or binary by its first bytes.
fn content_type(path: &str, head: &[u8]) -> String {
    match mime_guess::from_path(path).first() {
        Some(m) => m.essence_str().to_owned(),
        None if preview(head).is_some() => "text/plain".into(),
        None => "application/octet-stream".into(),
    }
}

/// The first bytes as text, if they are text (valid UTF-8 up to a cut character, no NUL).
fn preview(head: &[u8]) -> Option<String> {
    if head.contains(&0) {
        return None;
    }
    let valid = match std::str::from_utf8(head) {
        Ok(s) => s,
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()]).ok()?,
        Err(_) => return None,
    };
    Some(valid.to_owned())
}

/// `SIGKILL` for 9; `SIG<n>` for numbers nix has no name for.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("SIG{sig}"))
}

/// Resolves when the client cancels or goes away.
async fn cancelled(control: &mut watch::Receiver<Control>) {
    loop {
        if *control.borrow_and_update() == Control::Cancel {
            return;
        }
        if control.changed().await.is_err() {
            return;
        }
    }
}

/// Resolves when the daemon kills every execution (end of the shutdown grace period).
async fn killed(kill_all: &mut watch::Receiver<bool>) {
    let _ = kill_all.wait_for(|k| *k).await;
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn wait_removed(events: &mut mpsc::UnboundedReceiver<Event>, cid: &str) {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv()).await {
            Ok(Some(Event::Removed { error: None, .. })) => return,
            Ok(Some(Event::Removed { error: Some(e), .. })) => {
                error!(container = cid, error = %e, "container removal reported an error");
                return;
            }
            Ok(Some(Event::Failed { .. })) => return,
            Ok(Some(_)) => continue,
            Ok(None) => {
                error!(
                    container = cid,
                    "helper gone before the container was removed"
                );
                return;
            }
            Err(_) => {
                error!(container = cid, "container not removed within 30 s");
                return;
            }
        }
    }
}

struct Stdio {
    stdin: OwnedFd,
    stdout_r: OwnedFd,
    stdout_w: OwnedFd,
    stderr_r: OwnedFd,
    stderr_w: OwnedFd,
}

fn make_stdio(input: &[u8]) -> nix::Result<Stdio> {
    use nix::fcntl::OFlag;
    let memfd = nix::sys::memfd::memfd_create(
        c"sandboxd-stdin",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )?;
    let mut written = 0;
    while written < input.len() {
        written += nix::unistd::write(&memfd, &input[written..])?;
    }
    nix::unistd::lseek(memfd.as_raw_fd(), 0, nix::unistd::Whence::SeekSet)?;
    let (stdout_r, stdout_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let (stderr_r, stderr_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    Ok(Stdio {
        stdin: memfd,
        stdout_r,
        stdout_w,
        stderr_r,
        stderr_w,
    })
}

/// The program's stdout and stderr: read, chunked without splitting UTF-8, counted against the output limit.
struct Streams {
    id: String,
    pipes: [Option<tokio::net::unix::pipe::Receiver>; 2],
    chunkers: [Utf8Chunker; 2],
    bufs: [Vec<u8>; 2],
    /// Raw bytes accepted for sending, per stream (stdout, stderr).
    sent: [u64; 2],
    limit: u64,
    truncated: bool,
}

impl Streams {
    fn new(id: &str, stdout: OwnedFd, stderr: OwnedFd, limit: u64) -> Self {
        let open = |fd: OwnedFd| match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
            Ok(p) => Some(p),
            Err(e) => {
                error!(error = %e, "cannot watch an output pipe");
                None
            }
        };
        Self {
            id: id.to_owned(),
            pipes: [open(stdout), open(stderr)],
            chunkers: [Utf8Chunker::new(), Utf8Chunker::new()],
            bufs: [vec![0; READ_CHUNK], vec![0; READ_CHUNK]],
            sent: [0, 0],
            limit,
            truncated: false,
        }
    }

    /// Both pipes reached end of file (or were closed).
    fn done(&self) -> bool {
        self.pipes.iter().all(Option::is_none)
    }

    fn message(&self, which: usize, chunk: protocol::Chunk) -> ServerMessage {
        let c = OutputChunk::new(self.id.clone(), chunk);
        if which == 0 {
            ServerMessage::Stdout(c)
        } else {
            ServerMessage::Stderr(c)
        }
    }

    /// Stops reading both pipes; returns what the chunkers still held.
    fn close(&mut self) -> Vec<ServerMessage> {
        let mut out = Vec::new();
        for which in 0..2 {
            self.pipes[which] = None;
            if let Some(c) = self.chunkers[which].finish() {
                out.push(self.message(which, c));
            }
        }
        out
    }

    /// Waits for output on either pipe. Returns the messages to send and whether the output limit was crossed
    /// (then only the bytes up to the limit are in the messages, and reading stops).
    async fn read(&mut self) -> (Vec<ServerMessage>, bool) {
        let [out_pipe, err_pipe] = &mut self.pipes;
        let [out_buf, err_buf] = &mut self.bufs;
        let (which, res) = tokio::select! {
            r = read_pipe(out_pipe, out_buf) => (0, r),
            r = read_pipe(err_pipe, err_buf) => (1, r),
        };
        let n = match res {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, stream = which, "reading program output failed");
                0
            }
        };
        if n == 0 {
            self.pipes[which] = None;
            let flushed = self.chunkers[which].finish();
            return (
                flushed
                    .map(|c| vec![self.message(which, c)])
                    .unwrap_or_default(),
                false,
            );
        }
        let room = self.limit.saturating_sub(self.sent[0] + self.sent[1]);
        let take = (n as u64).min(room) as usize;
        let over = take < n;
        self.sent[which] += take as u64;
        let mut msgs = Vec::new();
        if take > 0 {
            let bytes = self.bufs[which][..take].to_vec();
            if let Some(c) = self.chunkers[which].push(&bytes) {
                msgs.push(self.message(which, c));
            }
        }
        if over {
            self.truncated = true;
            msgs.extend(self.close());
        }
        (msgs, over)
    }
}

async fn read_pipe(
    pipe: &mut Option<tokio::net::unix::pipe::Receiver>,
    buf: &mut [u8],
) -> std::io::Result<usize> {
    match pipe {
        Some(p) => p.read(buf).await,
        None => std::future::pending().await,
    }
}
