//! Containers created ahead of time: the warm pool, and the cold path that creates one on demand.
//!
//! A container here is a scratch space (tmpfs, overlay root on an OCI image), an OCI bundle and a created and
//! started container whose init waits on its launch channel ([`runtime::launch`]). Creating one (a few ms of CPU:
//! namespaces, mounts and cgroups, see [`runtime::direct`]) is most of an execution's cost, so the pool keeps `pool.size`
//! containers ready, split evenly over the languages, created in the background by one refill task per language. An execution takes a
//! ready container when one of its class is there (language and `disk_mb`, which fixes the tmpfs, `/dev/shm` and
//! `RLIMIT_FSIZE` sizes); its memory, pids and cpu limits are written into the container's cgroup before launch.
//! Otherwise it creates one on the spot (the cold path), the same way.
//!
//! The refill yields to executions: while at most a quarter of a language's pool is missing, it creates only once no
//! execution has taken a container or ended for [`REFILL_QUIET`], so executions back to back do not share the CPU
//! with the creation of their replacements; with more missing it creates at once.
//!
//! A container is never used twice: after its execution it is removed in the background (helper: kill, delete,
//! reap; daemon: unmount the scratch tmpfs), off the execution's critical path. Each container holds one host uid
//! (container root) from [`Uids`] from creation to removal, so the number of containers that exist at once, pooled,
//! running or being removed, is bounded by the uid range.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use protocol::{Language, Limits};
use runtime::cgroups::Cgroups;
use tokio::sync::Notify;
use tracing::{debug, error, info, warn, Instrument};

use containers::agent::Workspace;
use containers::helper::{HelperBackend, Helpers};
use containers::image::LanguageRuntime;
use containers::{ContainerBackend, ContainerHandle, CreateError, Plan, VolumeBind, WorkspacePlan};
use runtime::error::Chain;

/// The `disk_mb` class pooled containers are created with: the protocol's default.
pub const POOL_DISK_MB: u64 = Limits::DEFAULTS.disk_mb;
/// The kernel's smallest `cpu.shares` (v2: `cpu.weight` 1), for containers while they wait in the pool.
const MIN_CPU_SHARES: u64 = 2;
/// How long a refill task waits after a failed creation before it tries again.
const REFILL_BACKOFF: Duration = Duration::from_secs(1);
/// How long no execution must have started or ended before a refill creates containers while at most a quarter of
/// the pool is missing: executions back to back do not share the CPU with the creation of their replacements (about
/// 0.8 ms of a shell `true` back to back). With more missing the refill does not wait, so a stream of executions
/// does not run the pool dry.
const REFILL_QUIET: Duration = Duration::from_millis(25);

/// Host uids for container root, one per existing container: the executions' containers take theirs from one
/// range, agent sandboxes from the range after it.
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

    /// A free uid, or `None` when all are taken.
    pub fn try_take(&self) -> Option<u32> {
        self.lock().pop()
    }

    /// Takes `uid` itself (a sandbox adopted from a previous daemon keeps its own); `false` when it is not free.
    pub fn take_exact(&self, uid: u32) -> bool {
        let mut free = self.lock();
        match free.iter().position(|&u| u == uid) {
            Some(i) => {
                free.remove(i);
                true
            }
            None => false,
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

/// A created container whose init waits for its program.
pub struct Container {
    /// Container id (the container's, the cgroup leaf's, the scratch directory's name).
    pub cid: String,
    /// Host uid of container root.
    pub host_id: u32,
    /// Taken from the pool (false: created for the execution).
    pub warm: bool,
    /// Its init started the language's warm interpreter, which waits for the launch ([`crate::exec::warm`]).
    pub interpreter: bool,
    /// The container itself, behind the backend's seam.
    pub handle: Box<dyn ContainerHandle>,
    /// The volumes it binds, released once it is removed (dropped with it).
    pub claims: Vec<agents::volumes::Claim>,
    /// The snapshot its workspace starts from (extension `snapshots`), given back after its removal.
    pub snapshot: Option<agents::snapshots::Hold>,
}

impl Container {
    /// Whether it holds volumes or a snapshot that other holders wait for (freed once it is removed).
    pub fn holds_shared_storage(&self) -> bool {
        !self.claims.is_empty() || self.snapshot.is_some()
    }
}

/// What the pool needs to create containers: the backend, host uids, ids, and the count of removals under way.
pub struct Factory {
    /// The limits a pooled container is created with, lowered to the request's at launch.
    pub max_limits: Limits,
    /// Host uids.
    pub uids: Uids,
    backend: Box<dyn ContainerBackend>,
    /// Removals under way, and a wake-up when one ends.
    removing: AtomicUsize,
    removed: Notify,
    nonce: String,
    seq: AtomicU64,
}

impl Factory {
    /// A factory creating containers through the helpers.
    pub fn new(
        helpers: Helpers,
        cgroups: Cgroups,
        run_dir: PathBuf,
        nofile: u64,
        max_limits: Limits,
        uids: Uids,
    ) -> Self {
        let backend = Arc::new(HelperBackend {
            helpers: Arc::new(helpers),
            cgroups,
            run_dir,
            nofile,
        });
        Self::with_backend(Box::new(backend), max_limits, uids)
    }

    /// A factory over any backend (tests use a fake one).
    pub fn with_backend(
        backend: Box<dyn ContainerBackend>,
        max_limits: Limits,
        uids: Uids,
    ) -> Self {
        Self {
            max_limits,
            uids,
            backend,
            removing: AtomicUsize::new(0),
            removed: Notify::new(),
            nonce: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
        }
    }

    /// Creates an agent sandbox's workspace (the long-lived kind of container; its host uid is the caller's).
    pub async fn create_workspace(
        &self,
        plan: WorkspacePlan<'_>,
    ) -> Result<Arc<dyn Workspace>, CreateError> {
        self.backend.create_workspace(plan).await
    }

    /// Takes back the workspace a previous daemon left mounted (see [`ContainerBackend::adopt_workspace`]).
    pub async fn adopt_workspace(
        &self,
        plan: WorkspacePlan<'_>,
    ) -> Result<Arc<dyn Workspace>, CreateError> {
        self.backend.adopt_workspace(plan).await
    }

    /// Ends a previous daemon's kept run that is not taken back (see [`ContainerBackend::end_kept_run`]).
    pub async fn end_kept_run(&self, cid: &str, init: containers::agent::InitIdentity) {
        self.backend.end_kept_run(cid, init).await
    }

    /// False once containers can no longer be created or removed (a helper process died): the daemon is
    /// unhealthy.
    pub fn alive(&self) -> bool {
        self.backend.alive()
    }

    /// Resolves once containers can no longer be created or removed (a helper process died).
    pub async fn gone(&self) {
        self.backend.gone().await
    }

    /// How many helper processes create containers (one creation at a time in each).
    pub fn helper_count(&self) -> usize {
        self.backend.parallelism()
    }

    /// Asks the backend to remove every container and stop (daemon shutdown).
    pub async fn shutdown(&self) {
        self.backend.shutdown().await
    }

    /// Creates a container for `lang` with `disk_mb` of scratch space and `limits` in its cgroup, and `volumes`
    /// bound under `/workspace`; `warm`: its init starts the language's warm interpreter, if it has one.
    pub async fn create(
        &self,
        lang: &LanguageRuntime,
        (disk_mb, limits): (u64, &Limits),
        warm: bool,
        (volumes, snapshot): (&[VolumeBind], Option<&Path>),
    ) -> Result<Container, CreateError> {
        let host_id = self.uids.take().await;
        let cid = format!(
            "sbx-{}-{}",
            self.nonce,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let plan = Plan {
            cid: &cid,
            host_id,
            lang,
            disk_mb,
            limits,
            warm: warm && lang.warm.is_some(),
            volumes,
            snapshot,
        };
        let interpreter = plan.warm;
        match self.backend.create(plan).await {
            Ok(handle) => Ok(Container {
                cid,
                host_id,
                warm: false,
                interpreter,
                handle,
                claims: Vec::new(),
                snapshot: None,
            }),
            Err(e) => {
                self.uids.give_back(host_id);
                Err(e)
            }
        }
    }

    /// Removes a container: the backend kills, deletes and reaps it and removes its scratch space, then the uid is
    /// free again, and its volumes are given back. Errors are logged: there is nobody left to tell.
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
            handle,
            claims,
            snapshot,
            ..
        } = c;
        handle.remove().await;
        // Its volumes are free for another writer only once nothing of it can write them.
        for claim in claims {
            claim.release().await;
        }
        drop(snapshot);
        self.uids.give_back(host_id);
        debug!(container = %cid, "container removed");
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
    /// When an execution last took a container or ended ([`Self::quiet_for`]).
    active: Mutex<tokio::time::Instant>,
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
            active: Mutex::new(tokio::time::Instant::now()),
        }
    }

    fn touch(&self) {
        *self.active.lock().unwrap_or_else(|p| p.into_inner()) = tokio::time::Instant::now();
    }

    /// How long no execution has taken a container or ended.
    fn quiet_for(&self) -> Duration {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Waits, while at most a quarter of `lang`'s pool is missing, until no execution has taken a container or ended
    /// for [`REFILL_QUIET`]; returns at once with more missing, or when woken (a take, a close). Returns how many
    /// containers are ready then.
    async fn wait_quiet(&self, lang: Language, wake: &Notify) -> usize {
        loop {
            let have = self.lock().get(&lang).map_or(0, VecDeque::len);
            let quiet = self.quiet_for();
            if have * 4 < self.size * 3
                || quiet >= REFILL_QUIET
                || self.closed.load(Ordering::SeqCst)
            {
                return have;
            }
            tokio::select! {
                _ = tokio::time::sleep(REFILL_QUIET - quiet) => {}
                _ = wake.notified() => {}
            }
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
        // most of a creation's CPU work (the cloned init's mounts and set-up; on the libcontainer start, also its
        // intermediate process) runs inside the new container's cgroup, so refills yield to the programs that run meanwhile. The launch writes the
        // request's `cpu_shares`.
        let max = Limits {
            cpu_shares: MIN_CPU_SHARES,
            ..self.factory.max_limits
        };
        // As many creations at once as there are helpers: each helper is single-threaded.
        let parallel = self.factory.backend.parallelism();
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
            let mut have = self.lock().get(&lang).map_or(0, VecDeque::len);
            if creating.is_empty() && have < self.size {
                have = self.wait_quiet(lang, &wake).await;
            }
            while have + creating.len() < self.size && creating.len() < parallel {
                let (factory, rt) = (self.factory.clone(), rt.clone());
                creating.spawn(async move {
                    factory
                        .create(&rt, (POOL_DISK_MB, &max), true, (&[], None))
                        .await
                });
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
                        warn!(language = lang.as_str(), error = %Chain(&e), "cannot create a pooled container; retrying in 1 s");
                        tokio::time::sleep(REFILL_BACKOFF).await;
                    }
                    Some(Err(e)) => error!(language = lang.as_str(), error = %e, "a pooled container's creation panicked"),
                    None => {}
                },
                _ = notified => {}
            }
        }
    }

    /// A container for an execution: a ready one of the class when there is one, else a new one. A request whose
    /// memory limit is below what a waiting interpreter may already hold ([`crate::exec::warm::MIN_MEMORY_MB`]) gets a
    /// new one: lowering a cgroup's limit below its usage is refused (v1) or kills the interpreter (v2).
    pub async fn take(
        &self,
        lang: Language,
        rt: &LanguageRuntime,
        limits: &Limits,
    ) -> Result<Container, CreateError> {
        self.touch();
        let fits = rt.warm.is_none() || limits.memory_mb >= crate::exec::warm::MIN_MEMORY_MB;
        if self.size > 0 && limits.disk_mb == POOL_DISK_MB && fits {
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
        self.factory
            .create(rt, (limits.disk_mb, limits), false, (&[], None))
            .await
    }

    /// A container created for an execution that mounts volumes or starts from a snapshot (never a pooled one:
    /// binds and the workspace's overlay are made at creation).
    pub async fn take_with_volumes(
        &self,
        rt: &LanguageRuntime,
        limits: &Limits,
        (volumes, snapshot): (&[VolumeBind], Option<&Path>),
    ) -> Result<Container, CreateError> {
        self.touch();
        self.factory
            .create(rt, (limits.disk_mb, limits), false, (volumes, snapshot))
            .await
    }

    /// Lets the language's refill task top the pool up (after an execution that took a ready container ended).
    pub fn replenish(&self, lang: Language) {
        self.touch();
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};
    use std::sync::Arc;
    use std::time::Duration;

    use protocol::{Language, Limits};

    use super::{Factory, Pool, Uids, POOL_DISK_MB};
    use containers::fake::{shell, Call, FakeBackend, Recorder};

    /// A started shell pool of `size` on the fake backend, with `uids` uids; and the pool class's limits.
    fn started(
        dir: &std::path::Path,
        uids: u32,
        size: usize,
    ) -> (Arc<Recorder>, Arc<Factory>, Arc<Pool>, Limits) {
        let recorder = Arc::new(Recorder::default());
        let factory = Arc::new(Factory::with_backend(
            Box::new(FakeBackend::new(dir, recorder.clone())),
            crate::config::Config::default().limits.max,
            Uids::new(900_000, uids),
        ));
        let languages: BTreeMap<Language, _> = [(Language::Shell, shell())].into_iter().collect();
        let pool = Arc::new(Pool::new(factory.clone(), size, &languages));
        pool.start(&languages);
        let limits = Limits {
            disk_mb: POOL_DISK_MB,
            ..factory.max_limits
        };
        (recorder, factory, pool, limits)
    }

    /// Takes many containers from a pool kept full by its refill task: every container is handed out once, and at
    /// the end every container ever created (taken, pooled or being created at close) is removed exactly once.
    #[tokio::test]
    async fn a_container_is_never_handed_out_twice_and_every_one_is_removed_once() {
        let dir = tempfile::tempdir().unwrap();
        let (recorder, factory, pool, limits) = started(dir.path(), 8, 3);
        let mut seen = HashSet::new();
        let mut warm = 0;
        for i in 0..20 {
            if i % 2 == 0 {
                // Half the takes find the pool full, the others race its refill.
                tokio::time::timeout(Duration::from_secs(20), async {
                    while pool.ready() < 3 {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
                .await
                .unwrap();
            }
            let c = pool.take(Language::Shell, &shell(), &limits).await.unwrap();
            assert!(seen.insert(c.cid.clone()), "{} handed out twice", c.cid);
            warm += usize::from(c.warm);
            factory.remove(c).await;
            pool.replenish(Language::Shell);
        }
        assert!(warm >= 10, "only {warm} warm");
        pool.close().await;
        factory.removals_done().await;
        assert_eq!(pool.ready(), 0);
        let calls = recorder.calls();
        for cid in recorder.created() {
            let removed = calls
                .iter()
                .filter(|c| **c == Call::Remove(cid.clone()))
                .count();
            assert_eq!(removed, 1, "{cid}: {calls:?}");
        }
        assert_eq!(factory.uids.available(), 8, "every uid is free again");
    }

    /// While at most a quarter of the pool is missing, its refill waits until no execution has taken a container or
    /// ended for `REFILL_QUIET`; with more missing it refills at once, whatever runs. (Tokio's clock is paused: time
    /// moves only when every task waits.)
    #[tokio::test(start_paused = true)]
    async fn a_refill_waits_for_a_quiet_moment_unless_the_pool_runs_low() {
        let dir = tempfile::tempdir().unwrap();
        let (_recorder, factory, pool, limits) = started(dir.path(), 16, 4);
        let step = super::REFILL_QUIET / 6;
        let ready_within = |n: usize, busy: bool| {
            let pool = pool.clone();
            async move {
                for _ in 0..200 {
                    if pool.ready() >= n {
                        return true;
                    }
                    tokio::time::sleep(step).await;
                    if busy {
                        pool.replenish(Language::Shell);
                    }
                }
                false
            }
        };
        assert!(ready_within(4, false).await, "the pool fills");

        // One taken and its execution over: 3 of 4 ready. While executions keep starting and ending, nothing is
        // created; once they stop for REFILL_QUIET, the fourth is.
        let c = pool.take(Language::Shell, &shell(), &limits).await.unwrap();
        factory.remove(c).await;
        pool.replenish(Language::Shell);
        for _ in 0..20 {
            tokio::time::sleep(step).await;
            pool.replenish(Language::Shell);
            assert_eq!(
                pool.ready(),
                3,
                "a refill while executions run back to back"
            );
        }
        assert!(ready_within(4, false).await, "refilled once quiet");

        // Three taken: 1 of 4. The refill does not wait for a quiet moment.
        for _ in 0..3 {
            let c = pool.take(Language::Shell, &shell(), &limits).await.unwrap();
            factory.remove(c).await;
        }
        pool.replenish(Language::Shell);
        assert!(ready_within(3, true).await, "refilled while busy");
        pool.close().await;
        factory.removals_done().await;
    }
}
