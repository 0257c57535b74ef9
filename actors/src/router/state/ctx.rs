//! The state the router's request flows share ([`Ctx`]): the configuration, the
//! router's arena, the job table, admission, the routing of denoise work, metrics, and
//! the calls to workers (deadlines, workers found gone, waiting for a restart).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use denoised_models::flux::cost::StepShape;
use denoised_runtime::config::Config;
use ractor::ActorCell;

use super::jobs::Jobs;
use crate::daemon::unix_now;
use crate::node::{self, Shm, WorkerEnv};
use crate::routing::Running;
use crate::wire::pods::{PodReport, PodRun, PodTemplate, PodWorker};
use crate::wire::*;

/// Workers found gone that [`Ctx::ask`] remembers.
const LOST_KEPT: usize = 64;
/// How long a request waits for a group to have a live member (a restart).
const WORKER_WAIT: Duration = Duration::from_secs(60);

/// The model facts generations need (the router loads no weights).
#[derive(Clone, Debug)]
pub struct GenerationModel {
    /// FluxPipeline's default side (`128 * vae_scale_factor`) and the side's multiple.
    pub default_side: u32,
    pub multiple_of: u32,
    /// The scheduler's config, hashed into the approximate cache's exact key.
    pub scheduler: String,
}

/// Which templates a pod's report lists.
#[derive(Clone, Copy, Debug)]
pub enum Listed<'a> {
    All,
    Only(&'a str),
    Omitted,
}

/// What the router knows of the served adapters.
pub struct AdapterDir {
    pub dir: std::path::PathBuf,
    /// The served transformer's config: uploads are checked against it.
    pub transformer: denoised_models::FluxConfig,
}

/// State shared by the router's request flows.
pub struct Ctx {
    pub config: Config,
    pub shm: Shm,
    pub jobs: Jobs,
    /// Fingerprint of the served model (recorded in template descriptions).
    pub model: String,
    /// An edit's default guidance: FluxFillPipeline's, or FluxKontextPipeline's when
    /// the model is a Kontext one (read from its `model_index.json` at start).
    pub edit_guidance: f32,
    /// Captures of uploads as templates under way (`[templates] auto`), by template
    /// id: an edit of the same image waits for one instead of running in full beside it.
    pub auto_captures: super::keyed::KeyedLocks,
    next_job: AtomicU64,
    /// Ids an earlier router of this daemon gave out, when this one is a restart: their
    /// jobs died with it, and `GET /v1/jobs/{id}` says so instead of "unknown".
    pub lost_jobs: Option<std::ops::Range<JobId>>,
    /// Requests in flight, bounded by `[server] max_queued_requests`.
    pub admission: super::admission::Admission,
    /// The supervisor's status (`crate::daemon::SupervisorStatus`): slots it gave up on.
    pub status_file: std::path::PathBuf,
    /// Workers found gone by a call, newest first (see [`Ctx::ask`]).
    lost: std::sync::Mutex<std::collections::VecDeque<ractor::ActorId>>,
    rr: [AtomicUsize; 3],
    /// What each worker process loaded, as it announced itself (by process name; a
    /// restarted process replaces its entry).
    pub processes: std::sync::Mutex<std::collections::BTreeMap<String, WorkerInfo>>,
    /// The router's metrics, its registry, and the daemon-wide one (the build, every
    /// process's restarts).
    pub metrics: crate::metrics::router::RouterMetrics,
    pub registry: crate::metrics::ProcessRegistry,
    pub daemon_registry: prometheus_client::registry::Registry,
    /// The denoise workers' loads and the routing policy.
    pub balancer: super::balance::Balancer,
    /// A text-to-image model's facts (`None`: a Fill model, which serves no
    /// generations).
    pub generation: Option<GenerationModel>,
    /// Where the served LoRAs are (`None`: none are served).
    pub adapters: Option<AdapterDir>,
    /// The peer pods, when this daemon is a pod of a cluster (`[cluster] listen`).
    pub pods: Option<super::pods::Pods>,
    /// The supervisor's process id (this process's parent while it lives).
    supervisor: libc::pid_t,
    /// When the daemon started (Unix seconds).
    pub started_unix: f64,
    /// Images given by URL (`response_format: "url"`).
    pub images: super::images::Images,
    /// Idempotency keys (`Idempotency-Key`), kept across this daemon's routers.
    pub keys: super::idempotency::Keys,
    /// The uploaded images seen, toward templates that make themselves (`[templates]`).
    pub sightings: std::sync::Mutex<super::sightings::Sightings>,
}

impl Ctx {
    /// The router of the daemon `env` describes.
    pub fn new(
        env: &WorkerEnv,
        shm: Shm,
        jobs: Jobs,
        model: String,
        balancer: super::balance::Balancer,
    ) -> Ctx {
        // Job ids start from the clock (microseconds, shifted), so that ids of a
        // restarted router do not repeat and those of its predecessors are recognised.
        let id_at = |unix: f64| ((unix * 1e6) as u64) << 8;
        let first = id_at(unix_now());
        // When this router replaces one that died, the ids given out since the daemon
        // started were its predecessors'.
        let restart_of = (env.incarnation > 0).then_some(env.started_unix);
        let config = env.config.clone();
        let limit = config.server.max_queued_requests;
        let mut registry = crate::metrics::ProcessRegistry::new(&env.name(), "router");
        let mut daemon_registry = prometheus_client::registry::Registry::with_prefix("denoised");
        let metrics = crate::metrics::router::RouterMetrics::register(
            registry.registry(),
            &mut daemon_registry,
            env.status_file.clone(),
        );
        let t = &config.templates;
        let sightings = super::sightings::Sightings::new(
            t.auto_admit_after,
            t.auto_window_seconds,
            t.auto_track,
        );
        let kind = denoised_models::ModelSource::from_config(&config.model)
            .and_then(|s| s.pipeline_kind())
            .unwrap_or(denoised_models::pipeline::flux_fill::PipelineKind::Fill);
        Ctx {
            edit_guidance: kind.edit_guidance(),
            auto_captures: Default::default(),
            sightings: std::sync::Mutex::new(sightings),
            shm,
            jobs,
            model,
            status_file: env.status_file.clone(),
            lost: Default::default(),
            next_job: AtomicU64::new(first),
            lost_jobs: restart_of.map(|t| id_at(t)..first),
            admission: super::admission::Admission::new(limit),
            rr: Default::default(),
            processes: Default::default(),
            metrics,
            registry,
            daemon_registry,
            balancer,
            generation: None,
            adapters: None,
            pods: None,
            // SAFETY: getppid has no preconditions.
            supervisor: unsafe { libc::getppid() },
            started_unix: env.started_unix,
            keys: super::idempotency::Keys::open(
                Some(crate::daemon::idempotency_file(&env.status_file)),
                config.server.idempotency_window_seconds as f64,
                unix_now(),
            ),
            images: super::images::Images::new(
                Duration::from_secs(config.server.image_url_ttl_seconds),
                config.server.image_store_bytes as usize,
            ),
            config,
        }
    }

    /// Every process's metrics, as one OpenMetrics exposition: the router's own, and
    /// each worker's, gathered now (a worker that does not answer within `deadline` is
    /// left out of this scrape).
    pub async fn scrape(&self, deadline: Duration) -> String {
        self.metrics
            .in_flight
            .set(self.admission.in_flight() as i64);
        let (_, capacity) = self.shm.room();
        let mut texts = vec![self.registry.encode(self.shm.used_bytes(), capacity), {
            let mut t = String::new();
            let _ =
                prometheus_client::encoding::text::encode_registry(&mut t, &self.daemon_registry);
            t
        }];
        // Asked at once, so a scrape takes one deadline at most.
        let mut asks = tokio::task::JoinSet::new();
        for cell in node::members(crate::wire::groups::METRICS) {
            asks.spawn(async move {
                node::ask(&cell, deadline, |p| {
                    crate::wire::MetricsMsg::Scrape(crate::wire::Wire(()), p)
                })
                .await
            });
        }
        while let Some(r) = asks.join_next().await {
            match r {
                Ok(Ok(t)) => texts.push(t),
                Ok(Err(e)) => tracing::debug!("metrics: a worker did not answer the scrape: {e}"),
                Err(e) => tracing::debug!("metrics: {e}"),
            }
        }
        crate::metrics::merge(texts.iter().map(String::as_str))
    }

    /// A call to a worker ([`node::ask`]) within `[server] stage_timeout_seconds`. A
    /// worker found gone is remembered, so that the retry goes to another one even
    /// before the cluster's membership has caught up with its death.
    pub(crate) async fn ask<M, T>(
        &self,
        cell: &ActorCell,
        build: impl FnOnce(ractor::RpcReplyPort<Res<T>>) -> M,
    ) -> Result<T, WireError>
    where
        M: ractor::Message,
        T: Send + 'static,
    {
        let timeout = Duration::from_secs(self.config.server.stage_timeout_seconds);
        let r = node::call(cell, timeout, build).await;
        // Only the call's own failure blames the worker: an answer saying that
        // something it read went away (another process restarted) is retried, but
        // this worker is fine.
        if r.as_ref().is_err_and(|e| e.kind == ErrorKind::WorkerLost) {
            let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
            lost.push_front(cell.get_id());
            // Process ids are never reused, so a short memory suffices.
            lost.truncate(LOST_KEPT);
        }
        r.and_then(|r| r)
    }

    /// The live members of `group`, without those found gone.
    pub(crate) fn members(&self, group: &str) -> Vec<ActorCell> {
        let lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        let mut m = node::members(group);
        m.retain(|c| !lost.contains(&c.get_id()));
        m
    }

    /// An error once `job` was cancelled: a flow checks before and after every stage,
    /// so a cancelled request starts no further work.
    pub async fn check_cancel(&self, job: JobId) -> Result<(), WireError> {
        if self.jobs.is_cancelled(job).await {
            return Err(WireError::new(
                ErrorKind::Cancelled,
                "the request was cancelled",
            ));
        }
        Ok(())
    }

    pub fn next_job(&self) -> JobId {
        self.next_job.fetch_add(1, Ordering::Relaxed)
    }

    /// Round-robin pick of a live member of `group` (waiting for one while workers
    /// restart): pre- and postprocess workers, and the denoise workers of the
    /// in-process baseline (`[denoise] disaggregate = false`), whose router cannot
    /// route by a request's shape: the worker itself prepares it. Denoise workers are
    /// otherwise chosen by the routing policy ([`Ctx::pick_denoise`]).
    pub(crate) async fn pick(
        &self,
        group: &'static str,
        slot: usize,
    ) -> Result<ActorCell, WireError> {
        let t0 = Instant::now();
        loop {
            let mut m = self.members(group);
            if !m.is_empty() {
                m.sort_by_key(|c| c.get_id().to_string());
                let i = self.rr[slot].fetch_add(1, Ordering::Relaxed) % m.len();
                return Ok(m.swap_remove(i));
            }
            self.check_group(group, t0)?;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The denoise worker that takes `job`, as the routing policy chooses among the
    /// live workers with room (see [`super::balance`]); waits, in arrival order, while
    /// none has room, up to `[server] stage_timeout_seconds`.
    pub(crate) async fn pick_denoise(
        &self,
        job: JobId,
        shape: StepShape,
        steps: u32,
        template: Option<&TemplateRef>,
    ) -> Result<ActorCell, WireError> {
        let t0 = Instant::now();
        let limit = Duration::from_secs(self.config.server.stage_timeout_seconds);
        let _place = self.balancer.enqueue(job, shape, steps);
        loop {
            // Armed before looking, so that a change while we look is not missed.
            let changed = self.balancer.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let m = self.members(groups::DENOISE);
            if m.is_empty() {
                self.check_group(groups::DENOISE, t0)?;
            } else if let Some(p) = self.balancer.place(&m, job, shape, steps, template) {
                let policy = self.balancer.policy().name();
                let worker = p.worker.get_name().unwrap_or_default();
                self.metrics
                    .observe_route(&worker, policy, p.decision_s, t0.elapsed());
                return Ok(p.worker);
            }
            if t0.elapsed() > limit {
                return Err(WireError::new(
                    ErrorKind::Timeout,
                    format!("no denoise worker had room for {} s", limit.as_secs()),
                ));
            }
            // Reports come every step; the poll only covers membership changes.
            let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
            self.check_cancel(job).await?;
        }
    }

    pub(crate) async fn cache(&self) -> Result<ActorCell, WireError> {
        let t0 = Instant::now();
        loop {
            if let Some(c) = self.members(groups::CACHE).into_iter().next() {
                return Ok(c);
            }
            self.check_group(groups::CACHE, t0)?;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// While `group` has no live member: an error once waiting is pointless, because
    /// the supervisor gave up every one of its slots (at once, with the reason), or
    /// after [`WORKER_WAIT`] (a restart taking too long).
    fn check_group(&self, group: &str, t0: Instant) -> Result<(), WireError> {
        let role = group.trim_start_matches("denoised.");
        let slots = match role {
            "preprocess" => self.config.workers.preprocess,
            "denoise" => self.config.workers.denoise,
            "postprocess" => self.config.workers.postprocess,
            _ => 1,
        };
        // A router whose supervisor died (kill -9) is an orphan: no worker will be
        // restarted, so a request waiting for one ends now rather than after the wait.
        // SAFETY: getppid has no preconditions.
        if self.supervisor != unsafe { libc::getppid() } {
            return Err(WireError::new(
                ErrorKind::Unavailable,
                format!("no live {role} worker, and the daemon's supervisor is gone"),
            ));
        }
        let failed = crate::daemon::SupervisorStatus::read(&self.status_file).failed;
        let reasons: Vec<String> = (0..slots)
            .filter_map(|i| {
                let name = format!("{role}{i}");
                failed.get(&name).map(|why| format!("{name} {why}"))
            })
            .collect();
        if reasons.len() == slots {
            return Err(WireError::new(
                ErrorKind::Unavailable,
                format!("no {role} worker: {}", reasons.join("; ")),
            ));
        }
        if t0.elapsed() > WORKER_WAIT {
            return Err(WireError::new(
                ErrorKind::Unavailable,
                format!("no live {role} worker"),
            ));
        }
        Ok(())
    }

    pub async fn template(&self, id: &str) -> Result<TemplateEntry, WireError> {
        let c = self.cache().await?;
        self.ask(&c, |p| CacheMsg::Get(Wire(id.to_string()), p))
            .await
    }

    /// The template an edit reads, pinned until [`Ctx::unpin`].
    pub(crate) async fn pin_template(&self, id: &str) -> Result<TemplateEntry, WireError> {
        let c = self.cache().await?;
        self.ask(&c, |p| CacheMsg::Pin(Wire(id.to_string()), p))
            .await
    }

    pub(crate) async fn unpin(&self, t: &TemplateEntry) {
        if let Ok(c) = self.cache().await {
            node::tell(&c, CacheMsg::Unpin(Wire(t.version)));
        }
    }

    /// A pinned template with its cache (and VAE traces) in the host tier: at once
    /// when they are there, else once the cache has brought them from disk (a load that
    /// started when the edit pinned it, so it overlapped preprocessing; what is left of
    /// it is waited for here and counted in `denoised_template_load_wait_seconds`).
    pub(crate) async fn template_loaded(
        &self,
        t: &TemplateEntry,
    ) -> Result<TemplateEntry, WireError> {
        if t.blob.is_some() {
            return Ok(t.clone());
        }
        let t0 = Instant::now();
        let c = self.cache().await?;
        let version = t.version;
        let r = self.ask(&c, |p| CacheMsg::Load(Wire(version), p)).await;
        self.metrics.load_wait.observe(t0.elapsed().as_secs_f64());
        r
    }

    pub async fn templates(&self) -> Result<Vec<TemplateInfo>, WireError> {
        let c = self.cache().await?;
        self.ask(&c, |p| CacheMsg::List(Wire(()), p)).await
    }

    /// Deletes this pod's copy of template `id` (`up_to`: only a version up to it).
    pub async fn delete_template(
        &self,
        id: &str,
        up_to: Option<u64>,
    ) -> Result<TemplateInfo, WireError> {
        let c = self.cache().await?;
        let r = self
            .ask(&c, |p| CacheMsg::Delete(Wire((id.to_string(), up_to)), p))
            .await;
        self.templates_changed();
        r
    }

    /// This pod's templates changed (a capture, a copy, a delete): its next beat tells
    /// its peers without waiting for a heartbeat.
    pub fn templates_changed(&self) {
        if let Some(p) = &self.pods {
            p.touch();
        }
    }

    /// The template registry, when this pod has one (`[cluster] registry`).
    pub fn template_registry(&self) -> Option<&super::registry::Registry> {
        self.pods.as_ref().and_then(|p| p.registry.as_ref())
    }

    /// This pod's name in its cluster (empty outside one).
    pub fn pod_name(&self) -> &str {
        match self.config.cluster.is_pod() {
            true => &self.config.cluster.pod,
            false => "",
        }
    }

    /// This pod's report: what its peers see of it every second, and what its own router
    /// weighs against theirs.
    /// What prices a template's miss between pods (the routing profile, the link).
    pub fn pricing(&self) -> super::pod_route::Pricing {
        let (model, profile) = self.balancer.pricing();
        super::pod_route::Pricing {
            model,
            profile,
            copy_mb_per_s: self.config.cluster.copy_mb_per_s(),
        }
    }

    /// `templates`: which of its templates it lists (a routing decision reads only its
    /// own; a pod may hold thousands).
    pub async fn pod_report(&self, templates: Listed<'_>) -> PodReport {
        let draining = self.admission.is_draining();
        let whole = matches!(templates, Listed::All);
        let groups_live = self.ready().iter().all(|(_, have, want)| have >= want)
            && self.template_registry().is_none_or(|r| r.reconciled());
        let listed = match templates {
            Listed::Only(id) => match self.template(id).await {
                Ok(t) => Ok(vec![t.info]),
                Err(e) if e.kind == ErrorKind::NotFound => Ok(vec![]),
                Err(e) => Err(e),
            },
            Listed::All => self.templates().await,
            Listed::Omitted => Ok(vec![]),
        };
        let templates = match listed {
            Ok(t) => t
                .into_iter()
                .map(|t| PodTemplate {
                    id: t.id,
                    version: t.version,
                    host_bytes: t.tiers.host,
                    disk_bytes: t.tiers.disk,
                    tokens: t.tokens,
                    steps: t.steps,
                })
                .collect(),
            Err(e) => {
                tracing::debug!("report without templates: {e}");
                vec![]
            }
        };
        let listing = fingerprint(&templates);
        let run = |r: &Running| PodRun {
            text: r.shape.text as u32,
            active: r.shape.active as u32,
            image: r.shape.image as u32,
            steps_left: r.steps_left,
        };
        let (workers, queued) = self.balancer.pod_load();
        let pods = self.pods.as_ref();
        PodReport {
            pod: self.config.cluster.pod.clone(),
            started_unix: self.started_unix,
            http: pods.and_then(|p| p.http.get().cloned()).unwrap_or_default(),
            ready: groups_live && !draining,
            in_flight: self.admission.in_flight() as u32,
            limit: self.admission.limit() as u32,
            templates,
            listed: whole,
            listing,
            workers: workers
                .iter()
                .map(|(running, max_batch)| PodWorker {
                    max_batch: *max_batch as u32,
                    running: running.iter().map(run).collect(),
                })
                .collect(),
            queued: queued
                .iter()
                .map(run)
                .chain(pods.map_or(vec![], |p| p.pending_here(|job| self.balancer.has(job))))
                .collect(),
            fetching: pods
                .map(crate::router::state::pods::Pods::fetching)
                .unwrap_or_default(),
        }
    }

    /// Whether every group has its configured number of live members.
    pub fn ready(&self) -> Vec<(&'static str, usize, usize)> {
        let c = &self.config;
        [
            (groups::PREPROCESS, c.workers.preprocess),
            (groups::DENOISE, c.workers.denoise),
            (groups::POSTPROCESS, c.workers.postprocess),
            (groups::CACHE, 1),
            (groups::CONTROLNET, c.workers.controlnet),
        ]
        .into_iter()
        .filter(|(_, want)| *want > 0)
        .map(|(g, want)| (g, node::members(g).len(), want))
        .collect()
    }
}

/// A fingerprint of a pod's template list (what its beats carry in its place while it
/// does not change).
fn fingerprint(templates: &[PodTemplate]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    postcard::to_allocvec(templates)
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}
