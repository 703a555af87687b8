//! Containers created ahead of time: the warm pool, and the cold path that creates one on demand.
//!
//! A container here is a scratch space (tmpfs, overlay root on an OCI image), an OCI bundle and a created and
//! started container whose init waits on its launch channel ([`runtime::launch`]). Creating one (about 5 ms of
//! libcontainer work in the helper process) is most of an execution's cost, so the pool keeps `pool.size`
//! containers ready, split evenly over the languages, created in the background by one refill task per language. An execution takes a
//! ready container when one of its class is there (language and `disk_mb`, which fixes the tmpfs, `/dev/shm` and
//! `RLIMIT_FSIZE` sizes); its memory, pids and cpu limits are written into the container's cgroup before launch.
//! Otherwise it creates one on the spot (the cold path), the same way.
//!
//! A container is never used twice: after its execution it is removed in the background (helper: kill, delete,
//! reap; daemon: unmount the scratch tmpfs), off the execution's critical path. Each container holds one host uid
//! (container root) from [`Uids`] from creation to removal, so the number of containers that exist at once, pooled,
//! running or being removed, is bounded by the uid range.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use protocol::{Language, Limits};
use runtime::cgroups::Cgroups;
use runtime::helper::{Created, HelperClient};
use runtime::rootfs::{RootSource, Scratch, CODE_DIR, WORKDIR};
use runtime::spec::ContainerPlan;
use tokio::sync::Notify;
use tracing::{debug, error, info, warn, Instrument};

use crate::images::{LanguageRuntime, RootKind};

/// The `disk_mb` class pooled containers are created with: the protocol's default.
pub const POOL_DISK_MB: u64 = Limits::DEFAULTS.disk_mb;
/// The kernel's smallest `cpu.shares` (v2: `cpu.weight` 1), for containers while they wait in the pool.
const MIN_CPU_SHARES: u64 = 2;
/// How long a refill task waits after a failed creation before it tries again.
const REFILL_BACKOFF: Duration = Duration::from_secs(1);

/// Host uids for container root, one per existing container.
pub struct Uids {
    free: Mutex<Vec<u32>>,
    freed: Notify,
}

impl Uids {
    /// `count` uids from `base`.
    pub fn new(base: u32, count: u32) -> Self {
        Self {
            free: Mutex::new((base..base + count).rev().collect()),
            freed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free uid, waiting for a container's removal when none is free.
    pub async fn take(&self) -> u32 {
        loop {
            let notified = self.freed.notified();
            if let Some(uid) = self.lock().pop() {
                return uid;
            }
            notified.await;
        }
    }

    /// Gives a uid back (its container is gone).
    pub fn give_back(&self, uid: u32) {
        self.lock().push(uid);
        self.freed.notify_one();
    }

    /// How many are free.
    pub fn available(&self) -> usize {
        self.lock().len()
    }
}

/// The helper processes. Containers are spread over them round-robin, so creations and removals run in parallel
/// (each helper is single-threaded, and a creation is mostly CPU work in it); a container is removed by the helper
/// that created it (its init is that helper's child).
pub struct Helpers {
    all: Vec<HelperClient>,
    primary: HelperClient,
    next: AtomicUsize,
}

impl Helpers {
    /// Over `first` and `rest`.
    pub fn new(first: HelperClient, rest: Vec<HelperClient>) -> Self {
        let mut all = vec![first.clone()];
        all.extend(rest);
        Self {
            all,
            primary: first,
            next: AtomicUsize::new(0),
        }
    }

    /// The first helper: agent sandboxes' containers live there (they are few and long-lived).
    pub fn primary(&self) -> &HelperClient {
        &self.primary
    }

    fn pick(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.all.len().max(1)
    }

    fn get(&self, i: usize) -> Option<&HelperClient> {
        self.all.get(i)
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// True while every helper runs (one gone means its containers are gone: the daemon is unhealthy).
    pub fn all_alive(&self) -> bool {
        !self.all.is_empty() && self.all.iter().all(HelperClient::is_alive)
    }

    /// Asks every helper to remove its containers and exit.
    pub async fn shutdown(&self) {
        for h in &self.all {
            let _ = h.shutdown().await;
        }
    }
}

/// A created container whose init waits for its program.
pub struct Container {
    /// Container id (libcontainer's, the cgroup leaf's, the scratch directory's name).
    pub cid: String,
    /// Host uid of container root.
    pub host_id: u32,
    /// The helper that created it (index into [`Helpers`]).
    helper: usize,
    /// The scratch space (working directory, `/tmp`, code directory, overlay root).
    pub scratch: Scratch,
    /// The daemon's descriptors: launch channel, status pipe, pidfd.
    pub created: Created,
    /// Taken from the pool (false: created for the execution).
    pub warm: bool,
}

/// What the pool needs to create containers.
pub struct Factory {
    /// The helper processes.
    pub helpers: Helpers,
    /// Cgroup setup.
    pub cgroups: Cgroups,
    /// Per-execution state directory.
    pub run_dir: PathBuf,
    /// `RLIMIT_NOFILE` of programs.
    pub nofile: u64,
    /// The limits a pooled container is created with, lowered to the request's at launch.
    pub max_limits: Limits,
    /// Host uids.
    pub uids: Uids,
    /// Removals under way, and a wake-up when one ends.
    removing: AtomicUsize,
    removed: Notify,
    nonce: String,
    seq: AtomicU64,
}

impl Factory {
    /// A factory over `uids`.
    pub fn new(
        helpers: Helpers,
        cgroups: Cgroups,
        run_dir: PathBuf,
        nofile: u64,
        max_limits: Limits,
        uids: Uids,
    ) -> Self {
        Self {
            helpers,
            cgroups,
            run_dir,
            nofile,
            max_limits,
            uids,
            removing: AtomicUsize::new(0),
            removed: Notify::new(),
            nonce: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
        }
    }

    /// Creates a container for `lang` with `disk_mb` of scratch space and `limits` in its cgroup.
    pub async fn create(
        self: &Arc<Self>,
        lang: &LanguageRuntime,
        disk_mb: u64,
        limits: &Limits,
    ) -> Result<Container, runtime::Error> {
        let host_id = self.uids.take().await;
        let cid = format!(
            "sbx-{}-{}",
            self.nonce,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let this = self.clone();
        let (lang2, limits2, cid2) = (lang.clone(), *limits, cid.clone());
        let prepared = tokio::task::spawn_blocking(move || {
            this.prepare(&cid2, host_id, &lang2, disk_mb, &limits2)
        })
        .await
        .map_err(|source| runtime::Error::Task {
            task: "preparation",
            source,
        });
        let scratch = match prepared.and_then(|r| r) {
            Ok(s) => s,
            Err(e) => {
                self.uids.give_back(host_id);
                return Err(e);
            }
        };
        let helper = self.helpers.pick();
        let Some(client) = self.helpers.get(helper) else {
            self.remove_scratch(scratch, host_id).await;
            return Err(runtime::Error::HelperGone);
        };
        match client
            .create(&cid, scratch.dir().to_owned(), lang.image.landlock.clone())
            .await
        {
            Ok(created) => Ok(Container {
                cid,
                host_id,
                helper,
                scratch,
                created,
                warm: false,
            }),
            Err(e) => {
                // The helper removed whatever it created; the scratch space is ours.
                self.remove_scratch(scratch, host_id).await;
                Err(e)
            }
        }
    }

    /// Scratch space and the bundle's `config.json` (the program itself comes with the launch message).
    fn prepare(
        &self,
        cid: &str,
        host_id: u32,
        lang: &LanguageRuntime,
        disk_mb: u64,
        limits: &Limits,
    ) -> runtime::Result<Scratch> {
        let disk_bytes = disk_mb << 20;
        let scratch = Scratch::create(
            &self.run_dir,
            cid,
            disk_bytes,
            host_id,
            match &lang.image.kind {
                RootKind::Host(_) => RootSource::Shared,
                RootKind::Oci { lowers } => RootSource::Overlay(lowers),
            },
        )?;
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
            env: Vec::new(),
            cwd: WORKDIR.into(),
            binds,
            host_id,
            cgroups_path: self.cgroups.cgroups_path(cid),
            memory_bytes: (limits.memory_mb << 20) as i64,
            pids_max: limits.pids_max as i64,
            cpu_shares: limits.cpu_shares,
            nofile: self.nofile,
            fsize_bytes: disk_bytes,
            shm_bytes: disk_bytes,
        };
        let spec = runtime::spec::build(&plan)?;
        let config = scratch.dir().join("config.json");
        spec.save(&config)
            .map_err(|e| runtime::Error::save_spec(&config, e))?;
        Ok(scratch)
    }

    /// Removes a container: the helper kills, deletes and reaps it, then the scratch space goes and the uid is
    /// free again. Errors are logged: there is nobody left to tell.
    pub async fn remove(&self, c: Container) {
        self.removing.fetch_add(1, Ordering::SeqCst);
        self.remove_inner(c).await;
        self.removing.fetch_sub(1, Ordering::SeqCst);
        self.removed.notify_waiters();
    }

    /// [`Self::remove`] in a task of its own; counted as under way from this call on (not from the task's start).
    pub fn remove_in_background(self: &Arc<Self>, c: Container) {
        self.removing.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        tokio::spawn(
            async move {
                this.remove_inner(c).await;
                this.removing.fetch_sub(1, Ordering::SeqCst);
                this.removed.notify_waiters();
            }
            .in_current_span(),
        );
    }

    /// Waits until no removal is under way (the start-up self-test's containers are gone before the daemon serves).
    pub async fn removals_done(&self) {
        loop {
            let notified = self.removed.notified();
            if self.removing.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    async fn remove_inner(&self, c: Container) {
        let Container {
            cid,
            host_id,
            helper,
            scratch,
            created,
            ..
        } = c;
        // Closing the launch channel ends an init that never got a program.
        drop(created);
        let removed = match self.helpers.get(helper) {
            Some(h) => h.remove(&cid).await,
            None => Err(runtime::Error::HelperGone),
        };
        match removed {
            Ok(None) => {}
            Ok(Some(step)) => {
                error!(container = %cid, error = %step, "container removal reported an error")
            }
            Err(e) => error!(container = %cid, error = %e, "container not removed"),
        }
        self.remove_scratch(scratch, host_id).await;
        debug!(container = %cid, "container removed");
    }

    async fn remove_scratch(&self, mut scratch: Scratch, host_id: u32) {
        match tokio::task::spawn_blocking(move || scratch.remove()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => error!(error = %e, "scratch cleanup failed"),
            Err(e) => error!(error = %e, "scratch cleanup panicked"),
        }
        self.uids.give_back(host_id);
    }
}

/// The pool: ready containers per language, each language with a refill task.
pub struct Pool {
    factory: Arc<Factory>,
    /// Ready containers per language.
    size: usize,
    ready: Mutex<HashMap<Language, VecDeque<Container>>>,
    wake: HashMap<Language, Arc<Notify>>,
    /// The refill tasks ([`Self::close`] waits for them).
    refills: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    closed: std::sync::atomic::AtomicBool,
    /// Executions that found no ready container of their class.
    misses: AtomicU64,
    /// Executions that took a ready container.
    hits: AtomicU64,
}

impl Pool {
    /// A pool of `total` ready containers, split evenly over the languages (rounded up; 0: no pool, every
    /// execution takes the cold path). Call [`Self::start`] to begin filling it.
    pub fn new(
        factory: Arc<Factory>,
        total: usize,
        languages: &BTreeMap<Language, LanguageRuntime>,
    ) -> Self {
        Self {
            factory,
            size: total.div_ceil(languages.len().max(1)),
            ready: Mutex::new(HashMap::new()),
            wake: languages
                .keys()
                .map(|l| (*l, Arc::new(Notify::new())))
                .collect(),
            refills: Mutex::new(Vec::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            misses: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// The factory (cold path and removal).
    pub fn factory(&self) -> &Arc<Factory> {
        &self.factory
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Language, VecDeque<Container>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ready containers, all languages.
    pub fn ready(&self) -> usize {
        self.lock().values().map(VecDeque::len).sum()
    }

    /// For `/healthz`: size per language (`per_language`), ready containers, executions that took a ready one
    /// (hits) and that created their own (misses).
    pub fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "per_language": self.size,
            "ready": self.ready(),
            "hits": self.hits.load(Ordering::Relaxed),
            "misses": self.misses.load(Ordering::Relaxed),
        })
    }

    /// Starts one refill task per language.
    pub fn start(self: &Arc<Self>, languages: &BTreeMap<Language, LanguageRuntime>) {
        if self.size == 0 {
            return;
        }
        let mut refills = self.refills.lock().unwrap_or_else(|p| p.into_inner());
        for (lang, rt) in languages {
            let (pool, lang, rt) = (self.clone(), *lang, rt.clone());
            refills.push(tokio::spawn(async move { pool.refill(lang, rt).await }));
        }
    }

    async fn refill(self: Arc<Self>, lang: Language, rt: LanguageRuntime) {
        let Some(wake) = self.wake.get(&lang).cloned() else {
            return;
        };
        // Created with the largest memory and pids limits (lowered at launch) and the kernel's smallest cpu weight:
        // most of a creation's CPU work (libcontainer's intermediate process and the init) runs inside the new
        // container's cgroup, so refills yield to the programs that run meanwhile. The launch writes the
        // request's `cpu_shares`.
        let max = Limits {
            cpu_shares: MIN_CPU_SHARES,
            ..self.factory.max_limits
        };
        // As many creations at once as there are helpers: each helper is single-threaded.
        let parallel = self.factory.helpers.len().max(1);
        let mut creating = tokio::task::JoinSet::new();
        loop {
            let notified = wake.notified();
            if self.closed.load(Ordering::SeqCst) {
                // Never abandon a creation half-way (the helper would finish it): wait for each, then remove it.
                while let Some(done) = creating.join_next().await {
                    if let Ok(Ok(c)) = done {
                        self.factory.remove(c).await;
                    }
                }
                return;
            }
            let have = self.lock().get(&lang).map_or(0, VecDeque::len);
            while have + creating.len() < self.size && creating.len() < parallel {
                let (factory, rt) = (self.factory.clone(), rt.clone());
                creating.spawn(async move { factory.create(&rt, POOL_DISK_MB, &max).await });
            }
            if creating.is_empty() {
                notified.await;
                continue;
            }
            tokio::select! {
                done = creating.join_next() => match done {
                    Some(Ok(Ok(mut c))) => {
                        c.warm = true;
                        if self.closed.load(Ordering::SeqCst) {
                            self.factory.remove(c).await;
                        } else {
                            self.lock().entry(lang).or_default().push_back(c);
                        }
                    }
                    Some(Ok(Err(e))) => {
                        warn!(language = lang.as_str(), error = %e, "cannot create a pooled container; retrying in 1 s");
                        tokio::time::sleep(REFILL_BACKOFF).await;
                    }
                    Some(Err(e)) => error!(language = lang.as_str(), error = %e, "a pooled container's creation panicked"),
                    None => {}
                },
                _ = notified => {}
            }
        }
    }

    /// A container for an execution: a ready one of the class when there is one, else a new one.
    pub async fn take(
        &self,
        lang: Language,
        rt: &LanguageRuntime,
        limits: &Limits,
    ) -> Result<Container, runtime::Error> {
        if self.size > 0 && limits.disk_mb == POOL_DISK_MB {
            let taken = self.lock().get_mut(&lang).and_then(VecDeque::pop_front);
            if let Some(c) = taken {
                // The replacement is created once this execution is over ([`Self::replenish`]): creating it now
                // would take CPU from the program that is about to run.
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(c);
            }
            self.replenish(lang);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.factory.create(rt, limits.disk_mb, limits).await
    }

    /// Lets the language's refill task top the pool up (after an execution that took a ready container ended).
    pub fn replenish(&self, lang: Language) {
        if let Some(wake) = self.wake.get(&lang) {
            wake.notify_one();
        }
    }

    /// Stops refilling and removes every ready container, and every container a refill was still creating (the
    /// refill tasks are waited for, at most 10 s).
    pub async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for w in self.wake.values() {
            w.notify_one();
        }
        let all: Vec<Container> = self.lock().drain().flat_map(|(_, q)| q).collect();
        if !all.is_empty() {
            info!(containers = all.len(), "removing the pool");
        }
        for c in all {
            self.factory.remove(c).await;
        }
        let refills: Vec<_> = self
            .refills
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        let stopped = tokio::time::timeout(Duration::from_secs(10), async {
            for r in refills {
                let _ = r.await;
            }
        })
        .await;
        if stopped.is_err() {
            warn!("the pool's refill tasks did not stop within 10 s");
        }
    }
}
