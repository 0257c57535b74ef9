//! What every serving process shares: its identity and settings from the supervisor,
//! its ractor_cluster node, its shared-memory arena, and typed calls to other groups.
//!
//! The topology is a star: the router's node listens on 127.0.0.1 (`[cluster] port`)
//! and every worker connects to it with the cookie. Workers register their actor in a
//! process group ([`crate::wire::groups`]); ractor_cluster mirrors group membership to
//! the router, which finds workers with [`members`] and talks to them through typed
//! calls ([`ask`]). A call to a worker whose process dies fails with
//! [`ErrorKind::WorkerLost`], which the router answers by retrying elsewhere.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use denoised_runtime::config::Config;
use denoised_runtime::shm::{self, Arena, ArenaView, Handle};
use denoised_runtime::{DType, HostSlice, Tensor};
use ractor::rpc::CallResult;
use ractor::{ActorCell, ActorRef, Message};
use ractor_cluster::{NodeServer, NodeServerMessage};
use serde::{Deserialize, Serialize};

use crate::wire::{ErrorKind, Res, WireError};

/// The actor groups, one process each (several for preprocess, denoise, postprocess).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Router,
    Preprocess,
    Denoise,
    Postprocess,
    Cache,
    #[serde(rename = "controlnet")]
    ControlNet,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Router,
        Role::Preprocess,
        Role::Denoise,
        Role::Postprocess,
        Role::Cache,
        Role::ControlNet,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Preprocess => "preprocess",
            Role::Denoise => "denoise",
            Role::Postprocess => "postprocess",
            Role::Cache => "cache",
            Role::ControlNet => "controlnet",
        }
    }
    /// How many processes of this role the configuration asks for.
    pub fn count(self, c: &Config) -> usize {
        match self {
            Role::Router | Role::Cache => 1,
            Role::Preprocess => c.workers.preprocess,
            Role::Denoise => c.workers.denoise,
            Role::Postprocess => c.workers.postprocess,
            Role::ControlNet => c.workers.controlnet,
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| {
                format!("unknown role `{s}` (router, preprocess, denoise, postprocess, cache, controlnet)")
            })
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything a worker process needs to know, handed over by the supervisor as JSON in
/// the [`WorkerEnv::VAR`] environment variable (the role and index also come as flags,
/// so that `ps` shows which process is which).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerEnv {
    pub config: Config,
    pub role: Role,
    pub index: usize,
    /// Shared-memory namespace of this daemon instance.
    pub namespace: String,
    pub cookie: String,
    /// The router's cluster node port on 127.0.0.1.
    pub router_port: u16,
    pub shm_dir: PathBuf,
    /// Where this process computes the transformer (`cpu`, `emu`, `cuda:N`): a denoise
    /// worker's own device; `cpu` for the others.
    pub device: String,
    /// Threads of this process's CPU compute pool.
    pub threads: usize,
    /// How many times the supervisor restarted this process's slot (0: the first).
    #[serde(default)]
    pub incarnation: u32,
    /// When the daemon (the supervisor) started, Unix seconds.
    #[serde(default)]
    pub started_unix: f64,
    /// Where the supervisor writes its [`crate::daemon::SupervisorStatus`] (read by the
    /// router for `/readyz`).
    #[serde(default)]
    pub status_file: PathBuf,
    /// A denoise worker's: the pre- and postprocess workers placed on its device,
    /// which its memory budget sets aside.
    #[serde(default)]
    pub stages_on_device: StagesOnDevice,
}

impl WorkerEnv {
    pub const VAR: &'static str = "DENOISED_WORKER_ENV";

    /// `[model]`: the source and its single-file components (checked by `denoised
    /// serve` before any worker starts).
    pub fn model_source(&self) -> denoised_models::ModelSource {
        denoised_models::ModelSource::from_config(&self.config.model)
            .expect("[model] was checked when the daemon started")
    }

    pub fn from_env() -> Result<Self, String> {
        let text = std::env::var(Self::VAR).map_err(|_| {
            format!(
                "{} is not set: worker processes are started by `denoised serve`",
                Self::VAR
            )
        })?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", Self::VAR))
    }

    /// The node and arena name of this process, e.g. `preprocess0`.
    pub fn name(&self) -> String {
        format!("{}{}", self.role, self.index)
    }
}

/// Starts this process's cluster node on 127.0.0.1:`port` (0: any free port).
pub async fn start_node(env: &WorkerEnv, port: u16) -> Result<ActorRef<NodeServerMessage>, String> {
    start_named_node(&env.name(), &env.cookie, port).await
}

/// Starts a cluster node named `name` on 127.0.0.1:`port` (also for clients of the
/// daemon: benchmarks, other services).
pub async fn start_named_node(
    name: &str,
    cookie: &str,
    port: u16,
) -> Result<ActorRef<NodeServerMessage>, String> {
    let server = NodeServer::new(
        port,
        cookie.to_string(),
        name.to_string(),
        "127.0.0.1".into(),
        None,
        None,
    )
    .with_listen_addr(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    let (node, _) = ractor::Actor::spawn(None, server, ())
        .await
        .map_err(|e| format!("cannot start the cluster node: {e}"))?;
    Ok(node)
}

/// Connects to the router's node, retrying while it starts (up to `patience`).
pub async fn connect_router(
    node: &ActorRef<NodeServerMessage>,
    port: u16,
    patience: Duration,
) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        match ractor_cluster::client_connect(node, ("127.0.0.1", port)).await {
            Ok(()) => return Ok(()),
            Err(e) if t0.elapsed() < patience => {
                tracing::debug!("router node not reachable yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("cannot reach the router node on port {port}: {e}")),
        }
    }
}

/// Connections to the router lost so far in this process: work that arrived in an
/// earlier epoch was for a router that is gone, and nobody will release its results.
static ROUTER_EPOCH: AtomicU64 = AtomicU64::new(0);

pub fn router_epoch() -> u64 {
    ROUTER_EPOCH.load(Ordering::SeqCst)
}

/// Keeps this worker connected to the router's node, forever. When the router process
/// dies its session ends: this starts a new [`router_epoch`] and calls `lost` (which
/// drops what the old router held), then reconnects once the supervisor has restarted
/// the router on the same port, and calls `rejoined` (which announces the worker
/// again). Group membership is exchanged on every new session, so the new router sees
/// this worker's group at once. Workers connect only to the router (isolated mode), so
/// an outgoing session is the router's.
pub async fn stay_connected(
    node: ActorRef<NodeServerMessage>,
    port: u16,
    mut lost: impl FnMut(),
    mut rejoined: impl FnMut(),
) {
    let mut connected = true;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let sessions = ractor::call_t!(node, NodeServerMessage::GetSessions, 1000);
        let up = sessions.is_ok_and(|s| s.values().any(|s| !s.is_server));
        if up {
            connected = true;
            continue;
        }
        if connected {
            tracing::warn!("lost the router's node; reconnecting");
            connected = false;
            ROUTER_EPOCH.fetch_add(1, Ordering::SeqCst);
            lost();
        }
        if connect_router(&node, port, Duration::ZERO).await.is_ok() {
            tracing::info!("reconnected to the router's node");
            connected = true;
            rejoined();
        }
    }
}

/// This host's name (a pod's name when `[cluster] pod` is empty).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it
    // (or truncates, which the length check below handles).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if rc != 0 || end == 0 {
        return "localhost".into();
    }
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Registers an actor in its group, so the router (and bus clients) can find it.
pub fn register(group: &str, cell: ActorCell) {
    ractor::pg::join(group.to_string(), vec![cell]);
}

/// The actors of a group, local and remote. (A pod's router meets its peers' routers
/// in another node; ractor_cluster tells a node's peers of its own actors only, so the
/// peers' workers never appear here: tests/serve_cluster.rs counts them.)
pub fn members(group: &str) -> Vec<ActorCell> {
    ractor::pg::get_members(&group.to_string())
}

/// A typed call: the reply, or a typed error. A failed send or a dropped reply port
/// means the worker process went away ([`ErrorKind::WorkerLost`]); no reply within
/// `timeout` is [`ErrorKind::Timeout`], so no caller waits forever on a hung worker.
pub async fn ask<M, T>(
    cell: &ActorCell,
    timeout: Duration,
    build: impl FnOnce(ractor::RpcReplyPort<Res<T>>) -> M,
) -> Result<T, WireError>
where
    M: Message,
    T: Send + 'static,
{
    call(cell, timeout, build).await.and_then(|r| r)
}

/// [`ask`], telling the call's own failure (outer: the worker is gone, or timed out)
/// from the worker's answer (inner: which may itself say that something the worker
/// read, such as another process's shared memory, went away).
pub async fn call<M, T>(
    cell: &ActorCell,
    timeout: Duration,
    build: impl FnOnce(ractor::RpcReplyPort<Res<T>>) -> M,
) -> Result<Result<T, WireError>, WireError>
where
    M: Message,
    T: Send + 'static,
{
    let actor: ActorRef<M> = cell.clone().into();
    // The deadline is kept here, not handed to ractor: a remote call's own timeout
    // comes back as a closed port, which would read as a lost worker (and be retried).
    match tokio::time::timeout(timeout, actor.call(build, None))
        .await
        .unwrap_or(Ok(CallResult::Timeout))
    {
        Ok(CallResult::Success(reply)) => Ok(reply.0),
        Ok(CallResult::Timeout) => Err(WireError::new(
            ErrorKind::Timeout,
            format!(
                "worker {} did not answer within {} s ([server] stage_timeout_seconds)",
                cell.get_id(),
                timeout.as_secs()
            ),
        )),
        Ok(CallResult::SenderError) | Err(_) => Err(WireError::new(
            ErrorKind::WorkerLost,
            format!("worker {} went away", cell.get_id()),
        )),
    }
}

/// Casts a message; a failure (the receiver is gone) is logged, not fatal.
pub fn tell<M: Message>(cell: &ActorCell, msg: M) {
    let actor: ActorRef<M> = cell.clone().into();
    if let Err(e) = actor.cast(msg) {
        tracing::debug!("message to {} not delivered: {e}", cell.get_id());
    }
}

/// An arena allocation error as the client sees it: a full arena is a busy server
/// (429, retry: slices free up as requests finish), anything else a bug.
fn space_error(e: shm::ShmError) -> WireError {
    match e {
        shm::ShmError::OutOfSpace { .. } | shm::ShmError::TooManySlices { .. } => WireError::new(
            ErrorKind::Overloaded,
            format!("shared memory is full, retry later: {e}"),
        ),
        e => WireError::internal(e.to_string()),
    }
}

/// This process's arena plus read access to everyone else's.
///
/// Only the owner allocates and frees in an arena, so the allocator is behind a mutex
/// here (the worker thread allocates, the actor frees on `Release`). Views of other
/// arenas are attached lazily and kept; a worker restarted by the supervisor recreates
/// its arena under the same name, so a read that fails through a kept view re-attaches
/// once before giving up.
pub struct Shm {
    dir: PathBuf,
    namespace: String,
    own: Mutex<Arena>,
    views: Mutex<HashMap<String, Arc<ArenaView>>>,
}

impl Shm {
    pub fn create(env: &WorkerEnv) -> Result<Shm, String> {
        let w = &env.config.workers;
        let bytes = match env.role {
            Role::Denoise => w.denoise_arena_bytes,
            Role::Cache => w.cache_arena_bytes,
            _ => w.arena_bytes,
        };
        let arena = Arena::create(&env.shm_dir, &env.namespace, &env.name(), bytes)
            .map_err(|e| e.to_string())?;
        Ok(Shm {
            dir: env.shm_dir.clone(),
            namespace: env.namespace.clone(),
            own: Mutex::new(arena),
            views: Mutex::new(HashMap::new()),
        })
    }

    pub fn own_name(&self) -> String {
        self.arena().name().to_string()
    }

    fn arena(&self) -> std::sync::MutexGuard<'_, Arena> {
        // A panic while holding the lock leaves the allocator consistent (every method
        // completes its bookkeeping before it can fail), so poisoning is ignored.
        self.own.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn view(&self, name: &str, fresh: bool) -> Result<Arc<ArenaView>, WireError> {
        let mut views = self.views.lock().unwrap_or_else(|p| p.into_inner());
        if !fresh {
            if let Some(v) = views.get(name) {
                return Ok(v.clone());
            }
        }
        let v = Arc::new(
            ArenaView::attach(&self.dir, &self.namespace, name)
                .map_err(|e| WireError::new(ErrorKind::WorkerLost, e.to_string()))?,
        );
        views.insert(name.to_string(), v.clone());
        Ok(v)
    }

    /// Runs `f` on a view of the handle's arena (this process's own arena included).
    pub fn with<R>(
        &self,
        h: &Handle,
        f: impl Fn(&ArenaView) -> shm::Result<R>,
    ) -> Result<R, WireError> {
        if h.arena == self.own_name() {
            return f(&self.arena()).map_err(|e| WireError::internal(e.to_string()));
        }
        match f(&*self.view(&h.arena, false)?) {
            Ok(r) => Ok(r),
            Err(_) => f(&*self.view(&h.arena, true)?)
                .map_err(|e| WireError::new(ErrorKind::WorkerLost, e.to_string())),
        }
    }

    /// Zero-copy: runs `f` on an F32 slice borrowed straight from shared memory (the
    /// handle protocol guarantees nobody frees or writes it until this reader releases
    /// it; see `denoised_runtime::shm`).
    pub fn borrow_f32<R>(&self, h: &Handle, f: impl FnOnce(&[f32]) -> R) -> Result<R, WireError> {
        let lost = |e: shm::ShmError| WireError::new(ErrorKind::WorkerLost, e.to_string());
        if h.arena == self.own_name() {
            let a = self.arena();
            return Ok(f(a.slice_f32(h).map_err(lost)?));
        }
        let mut view = self.view(&h.arena, false)?;
        if !view.is_live(h) {
            view = self.view(&h.arena, true)?;
        }
        Ok(f(view.slice_f32(h).map_err(lost)?))
    }

    /// A slice's bytes in place, in any arena (this process's own included), as a
    /// [`HostSlice`] that keeps the mapping: how a denoise worker reads a template
    /// without copying it (and a device streams it from there). The handle protocol
    /// keeps the slice unchanged while its reader holds it (edits pin their template).
    pub fn host_slice(&self, h: &Handle) -> Result<HostSlice, WireError> {
        let lost = |e: shm::ShmError| WireError::new(ErrorKind::WorkerLost, e.to_string());
        if h.arena == self.own_name() {
            return self.arena().shared_view().host_slice(h).map_err(lost);
        }
        let mut view = self.view(&h.arena, false)?;
        if !view.is_live(h) {
            view = self.view(&h.arena, true)?;
        }
        view.host_slice(h).map_err(lost)
    }

    /// A slice another process allocated in its arena for this one to write into (a
    /// ControlNet stream's latents), mapped writable, and the pid of that process.
    pub fn host_slice_rw(&self, h: &Handle) -> Result<(HostSlice, u32), WireError> {
        let lost = |e: shm::ShmError| WireError::new(ErrorKind::WorkerLost, e.to_string());
        let v = Arc::new(ArenaView::attach_rw(&self.dir, &self.namespace, &h.arena).map_err(lost)?);
        let s = v.host_slice(h).map_err(lost)?;
        Ok((s, v.owner_pid()))
    }

    /// Allocates `len` bytes in this process's arena for a writer in this process (a
    /// capture filling its template in place): the handle, and the bytes.
    pub fn alloc_host(&self, len: usize) -> Result<(Handle, HostSlice), WireError> {
        let mut a = self.arena();
        let h = a.alloc(DType::U8, &[len]).map_err(space_error)?;
        match a.shared_view().host_slice(&h) {
            Ok(s) => Ok((h, s)),
            Err(e) => {
                let _ = a.free(&h);
                Err(WireError::internal(e.to_string()))
            }
        }
    }

    pub fn read_tensor(&self, h: &Handle) -> Result<Tensor, WireError> {
        self.with(h, |v| v.read_tensor(h))
    }

    pub fn read_bytes(&self, h: &Handle) -> Result<Vec<u8>, WireError> {
        self.with(h, |v| v.read_bytes(h))
    }

    pub fn write_tensor(&self, t: &Tensor) -> Result<Handle, WireError> {
        self.arena().write_tensor(t).map_err(space_error)
    }

    pub fn write_bytes(&self, b: &[u8]) -> Result<Handle, WireError> {
        self.arena().write_bytes(b).map_err(space_error)
    }

    /// The largest slice this process's arena could give now, and its capacity.
    pub fn room(&self) -> (u64, u64) {
        let a = self.arena();
        (a.largest_free(), a.capacity())
    }

    /// Frees slices of this process's arena; handles of other arenas and stale ones
    /// are ignored (a release can race with a restart).
    pub fn release(&self, handles: &[Handle]) {
        let own = self.own_name();
        let mut a = self.arena();
        for h in handles.iter().filter(|h| h.arena == own) {
            if let Err(e) = a.free(h) {
                tracing::debug!("release: {e}");
            }
        }
    }

    /// Frees every slice of this process's arena: what a router that is gone held, or
    /// was about to be given (see [`stay_connected`]).
    pub fn release_all(&self) {
        match self.arena().free_all() {
            Ok(0) => {}
            Ok(n) => tracing::info!("released {n} slices the lost router held"),
            Err(e) => tracing::error!("releasing the lost router's slices: {e}"),
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.arena().used_bytes()
    }
}

/// How many pre- and postprocess workers share a denoise worker's device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StagesOnDevice {
    pub preprocess: usize,
    pub postprocess: usize,
}
