//! The peer pods this router sees (docs/cluster.md): their last reports, whether they
//! answer, where each template is, and the call that forwards an edit to one. The mesh
//! (`crate::router::mesh`) fills it; the edit flow reads it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ractor::{ActorCell, RpcReplyPort};
use serde::Serialize;

use super::pod_route::{self, Pricing, TemplateSize};
use super::recipes::Recipes;
use super::registry::{record, Held};
use super::sessions::Sessions;
use crate::metrics::router::RouterMetrics;
use crate::routing::pods::{PodPolicy, PodRouter};
use crate::wire::pods::{FromPeer, PodMsg, PodOrigin, PodReport, PodRun, PodTemplate};
use crate::wire::{ErrorKind, JobId, Res, TemplateInfo, WireError};

/// A peer that has not answered a report for this long is down: its edits go
/// elsewhere until it answers again.
pub const DOWN_AFTER: Duration = Duration::from_secs(3);

/// How often a forwarded request looks whether its pod was marked down.
const DOWN_CHECK: Duration = Duration::from_millis(250);

struct Peer {
    cell: ActorCell,
    /// Its last report, with the template list it last sent (`listing`: that list's
    /// fingerprint; `None`: this pod has not had it whole).
    report: PodReport,
    listing: Option<u64>,
    seen: Instant,
    up: bool,
    /// When it last reported ready (or when it first reported).
    ready_at: Instant,
}

impl Peer {
    /// Whether edits and copies may go to it: it answers and is ready (not starting,
    /// not draining).
    fn usable(&self) -> bool {
        self.up && self.report.ready
    }

    /// Template `id` as it holds it.
    fn template(&self, id: &str) -> Option<&PodTemplate> {
        self.report.templates.iter().find(|t| t.id == id)
    }
}

/// The usable peers (see [`Peer::usable`]) except those in `exclude`.
fn usable<'a>(
    peers: &'a BTreeMap<String, Peer>,
    exclude: &'a [String],
) -> impl Iterator<Item = (&'a String, &'a Peer)> {
    peers
        .iter()
        .filter(move |(name, p)| p.usable() && !exclude.contains(name))
}

/// A peer as `/readyz` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct PeerStatus {
    pub pod: String,
    /// `up` or `down`.
    pub state: &'static str,
    /// Seconds since its last report.
    pub last_report_s: f64,
    pub http: String,
    pub ready: bool,
    pub in_flight: u32,
    pub limit: u32,
    pub templates: usize,
}

/// The peers, by pod name.
pub struct Pods {
    /// This pod's name.
    pub me: String,
    /// The sessions with the peers: every message to a peer leaves through them.
    pub sessions: Arc<Sessions>,
    peers: Mutex<BTreeMap<String, Peer>>,
    /// How long a forwarded edit may take (the pod that runs it has its own stage
    /// deadlines; this bounds a peer that stops answering mid-edit).
    pub forward_timeout: Duration,
    metrics: RouterMetrics,
    /// This pod's HTTP address (in its reports), once it listens.
    pub http: OnceLock<String>,
    /// The pod policy, with its round-robin turn.
    router: Mutex<PodRouter>,
    /// The recipes of the templates this pod's peers hold.
    pub recipes: Recipes,
    /// The template registry (`[cluster] registry`), where template identity is kept;
    /// without one each pod keeps its own.
    pub registry: Option<super::registry::Registry>,
    /// One lock per template this pod brings in (a copy, a capture again): edits
    /// and replication that need the same template wait for one another's copy.
    obtaining: super::keyed::KeyedLocks,
    /// Template edits routed here that have not reached the balancer yet (they are
    /// being brought in or preprocessed): they count in this pod's queue, as forwarded
    /// ones count in a peer's until its next report.
    here: Mutex<Vec<(JobId, PodRun)>>,
    /// Forwarded edits running here: (the pod, its job there) to the job here.
    relayed: Mutex<HashMap<(String, JobId), JobId>>,
    /// Templates deleted lately, whose recipes are not learnt again from a peer that
    /// has not dropped its copy yet.
    forgotten: Mutex<HashMap<String, Instant>>,
    /// Rounds of asking every peer for its report out of turn: one at a time, and how
    /// many have ended.
    refreshing: tokio::sync::Mutex<()>,
    refreshes: std::sync::atomic::AtomicU64,
    /// This router changed the pod's templates (a capture, a copy, a delete) since
    /// the last beat: the next one goes without waiting for a heartbeat.
    touched: std::sync::atomic::AtomicBool,
}

/// How long a deleted template's recipe is not learnt again (its peers drop their
/// copies within a report or two).
const FORGOTTEN_FOR: Duration = Duration::from_secs(10);

/// An edit routed here, counted in this pod's load until it drops.
pub struct Counted<'a> {
    pods: &'a Pods,
    job: JobId,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let mut here = self.pods.here.lock().unwrap_or_else(|p| p.into_inner());
        here.retain(|h| h.0 != self.job);
    }
}

/// What a peer's report told ([`Pods::reported`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Heard {
    /// The peer is new, or was down.
    pub came_up: bool,
    /// This pod lacks the peer's current template list: ask it for its report.
    pub stale: bool,
}

/// What a request asks of the pod that runs it.
#[derive(Clone, Copy, Debug)]
pub enum Need<'a> {
    /// An edit of template `id`, with `text` prompt tokens.
    Template { id: &'a str, text: u32 },
    /// Work of this shape and steps, no template (a generation).
    Load(PodRun),
}

/// Where a request should run.
#[derive(Debug, PartialEq)]
pub enum Route {
    /// Here, with what the request costs this pod (none for an edit of a template no
    /// pod holds).
    Here(Option<PodRun>),
    Peer(String),
}

impl Pods {
    pub fn new(
        me: String,
        policy: PodPolicy,
        forward_timeout: Duration,
        recipes: Recipes,
        registry: Option<super::registry::Registry>,
        metrics: RouterMetrics,
        tls: bool,
    ) -> Self {
        Pods {
            sessions: Arc::new(Sessions::new(me.clone(), tls)),
            me,
            peers: Mutex::new(BTreeMap::new()),
            forward_timeout,
            metrics,
            http: OnceLock::new(),
            router: Mutex::new(PodRouter::new(policy)),
            recipes,
            registry,
            obtaining: Default::default(),
            here: Mutex::new(Vec::new()),
            relayed: Mutex::new(HashMap::new()),
            forgotten: Mutex::new(HashMap::new()),
            refreshing: tokio::sync::Mutex::new(()),
            refreshes: std::sync::atomic::AtomicU64::new(0),
            touched: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// This pod's templates changed: its peers are told at its next beat.
    pub fn touch(&self) {
        self.touched
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether this pod's templates changed since the last call.
    pub fn take_touched(&self) -> bool {
        self.touched
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Template `id` was deleted (here or on a peer): its recipe goes, and is not
    /// learnt again for a while.
    pub fn forgotten(&self, id: &str) {
        self.recipes.remove(id);
        let mut m = self.forgotten.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, t| t.elapsed() < FORGOTTEN_FOR);
        m.insert(id.to_string(), Instant::now());
    }

    /// Whether template `id` was deleted lately.
    pub fn was_forgotten(&self, id: &str) -> bool {
        let m = self.forgotten.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id).is_some_and(|t| t.elapsed() < FORGOTTEN_FOR)
    }

    /// Whether template `id` was deleted at or after `t`: a recipe asked of a peer at
    /// `t` and answered after such a delete is of what was deleted, and is not kept.
    pub fn forgotten_since(&self, id: &str, t: Instant) -> bool {
        let m = self.forgotten.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id).is_some_and(|at| *at >= t)
    }

    /// Notes that job `here` runs the edit `origin` forwarded (`None`: it ended).
    pub fn relaying(&self, origin: (String, JobId), here: Option<JobId>) {
        let mut m = self.relayed.lock().unwrap_or_else(|p| p.into_inner());
        match here {
            Some(job) => m.insert(origin, job),
            None => m.remove(&origin),
        };
    }

    /// The job here running the edit `origin` forwarded.
    pub fn relayed(&self, origin: &(String, JobId)) -> Option<JobId> {
        let m = self.relayed.lock().unwrap_or_else(|p| p.into_inner());
        m.get(origin).copied()
    }

    /// Counts edit `job`, routed here, in this pod's load while the returned guard
    /// lives (the edit flow holds it until the edit ends).
    pub fn count_here(&self, job: JobId, run: PodRun) -> Counted<'_> {
        let mut here = self.here.lock().unwrap_or_else(|p| p.into_inner());
        here.push((job, run));
        Counted { pods: self, job }
    }

    /// The edits routed here that `placed` (the balancer) does not hold yet.
    pub fn pending_here(&self, placed: impl Fn(JobId) -> bool) -> Vec<PodRun> {
        let here = self.here.lock().unwrap_or_else(|p| p.into_inner());
        here.iter().filter(|h| !placed(h.0)).map(|h| h.1).collect()
    }

    /// The lock of bringing template `id` into this pod.
    pub fn obtaining(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.obtaining.of(id)
    }

    /// The templates this pod is bringing in now.
    pub fn fetching(&self) -> Vec<String> {
        self.obtaining.held()
    }

    /// Where a request should run, by the pod policy ([`pod_route::choose`]) over this
    /// pod (`me`, its report now) and the peers up and ready, except those in `tried`.
    /// A template edit runs here when no pod holds its template and no recipe of it is
    /// known (the edit's 404 is this pod's to give).
    pub fn route(
        &self,
        me: &PodReport,
        need: Need<'_>,
        tried: &[String],
        pricing: &Pricing,
    ) -> Route {
        let mut peers = self.peers();
        let mut pods: Vec<&PodReport> = vec![me];
        pods.extend(usable(&peers, tried).map(|(_, p)| &p.report));
        let mut router = self.router.lock().unwrap_or_else(|p| p.into_inner());
        let (chosen, run) = match need {
            Need::Template { id, text } => {
                // Its size as the pods report it, else as its recipe says (the recipe's
                // description is read only then).
                let reported = TemplateSize::reported(id, pods.iter().copied());
                let recipe = || {
                    self.recipes.info(id).map(|info| TemplateSize {
                        bytes: info.cache_bytes + info.vae_trace_bytes,
                        tokens: info.tokens,
                        steps: info.steps,
                    })
                };
                let (size, recapture) = match reported {
                    Some(size) => (size, self.recipes.has(id)),
                    None => match recipe() {
                        Some(size) => (size, true),
                        None => return Route::Here(None),
                    },
                };
                let need = (size, text, recapture);
                let chosen = pod_route::choose(&mut router, &pods, id, need, pricing);
                (chosen, size.run(text))
            }
            Need::Load(run) => (
                pod_route::choose_load(&mut router, &pods, run, pricing),
                run,
            ),
        };
        let route = match chosen {
            Some(i) if i > 0 => Route::Peer(pods[i].pod.clone()),
            _ => Route::Here(Some(run)),
        };
        let pod = match &route {
            Route::Here(_) => self.me.clone(),
            Route::Peer(name) => {
                // It counts in the peer's queue until the peer's next report (which
                // lists it, or has run it), so a burst does not all go to the pod
                // that looked idle a moment ago.
                if let Some(p) = peers.get_mut(name) {
                    p.report.queued.push(run);
                }
                name.clone()
            }
        };
        self.metrics
            .pod_routes
            .get_or_create(&[("policy", router.policy.name().into()), ("pod", pod)])
            .inc();
        route
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Peer>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer's report arrived through `cell` (its pod actor), asked for or pushed as a
    /// beat. A report of an older daemon of the same name (an orphaned router still
    /// draining after its pod restarted) is ignored while the newer one answers. A beat
    /// without its template list keeps the list this pod has of that peer; when that is
    /// not the one the beat's fingerprint names (a beat with a change was missed), the
    /// answer says to ask the peer for its whole report. With a registry, templates of
    /// versions it superseded or deleted are left out (the peer drops them soon).
    pub fn reported(&self, cell: ActorCell, mut report: PodReport) -> Heard {
        if !self.sessions.names(&cell, &report.pod) {
            return Heard::default();
        }
        self.metrics
            .pod_reports
            .get_or_create(&[("pod", report.pod.clone())])
            .inc();
        let mut peers = self.peers();
        let name = report.pod.clone();
        let old = peers.get(&name);
        if old.is_some_and(|p| p.up && p.report.started_unix > report.started_unix) {
            return Heard::default();
        }
        let same = old.filter(|p| p.report.started_unix == report.started_unix);
        let listing = match (report.listed, same) {
            (true, _) => Some(report.listing),
            (false, Some(p)) => {
                report.templates = p.report.templates.clone();
                p.listing.filter(|&l| l == report.listing)
            }
            (false, None) => None,
        };
        if let Some(reg) = &self.registry {
            report.templates.retain(|t| {
                reg.record(&t.id)
                    .is_none_or(|r| record::judge(Some(&r), t.version) == Held::Current)
            });
        }
        let came_up = old.is_none_or(|p| !p.up);
        let now = Instant::now();
        let ready_at = match (report.ready, old) {
            (false, Some(p)) => p.ready_at,
            _ => now,
        };
        peers.insert(
            name,
            Peer {
                cell,
                report,
                listing,
                seen: now,
                up: true,
                ready_at,
            },
        );
        self.count_up(&peers);
        Heard {
            came_up,
            stale: listing.is_none(),
        }
    }

    /// A beat from peer `report.pod`, through the pod actor this pod knows it by; `None`
    /// from a pod (or a daemon of it) this pod has not asked for its report yet.
    pub fn beat(&self, report: PodReport) -> Option<(ActorCell, Heard)> {
        let cell = self
            .peers()
            .get(&report.pod)
            .filter(|p| p.report.started_unix == report.started_unix)
            .map(|p| p.cell.clone())?;
        Some((cell.clone(), self.reported(cell, report)))
    }

    /// Whether `cell` is the pod actor of a peer this pod has heard from.
    pub fn knows(&self, cell: &ActorCell) -> bool {
        self.peers()
            .values()
            .any(|p| p.cell.get_id() == cell.get_id())
    }

    fn count_up(&self, peers: &BTreeMap<String, Peer>) {
        let up = peers.values().filter(|p| p.up).count();
        self.metrics.pods_up.set(up as i64);
    }

    /// Marks down the peers silent for [`DOWN_AFTER`]; returns their names.
    pub fn sweep(&self) -> Vec<String> {
        let mut peers = self.peers();
        let mut down = vec![];
        for (name, p) in peers.iter_mut() {
            if p.up && p.seen.elapsed() > DOWN_AFTER {
                p.up = false;
                down.push(name.clone());
            }
        }
        self.count_up(&peers);
        down
    }

    /// Whether peer `name` is up (it reported within [`DOWN_AFTER`] as of the last
    /// sweep).
    fn is_up(&self, name: &str) -> bool {
        self.peers().get(name).is_some_and(|p| p.up)
    }

    /// Returns once peer `name` is marked down: what a call to it races, so that a
    /// peer that stops answering (paused, cut off: no TCP reset) ends the call within
    /// [`DOWN_AFTER`] instead of its timeout.
    pub async fn until_down(&self, name: &str) {
        while self.is_up(name) {
            tokio::time::sleep(DOWN_CHECK).await;
        }
    }

    fn mark_down(&self, name: &str) {
        let mut peers = self.peers();
        if let Some(p) = peers.get_mut(name) {
            p.up = false;
        }
        self.count_up(&peers);
    }

    /// The peer to copy template `id` from, among those up and ready (not starting,
    /// not draining) whose disk holds it (a copy is read from the sender's disk;
    /// `exclude`: tried already): the least busy (in flight over its limit), then by
    /// name.
    pub fn holder(&self, id: &str, exclude: &[String]) -> Option<String> {
        let peers = self.peers();
        usable(&peers, exclude)
            .filter(|(_, p)| p.template(id).is_some_and(|t| t.disk_bytes > 0))
            .map(|(name, p)| {
                let busy = p.report.in_flight as f64 / p.report.limit.max(1) as f64;
                (busy, name.clone())
            })
            .min_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal))
            .map(|(_, name)| name)
    }

    /// Whether a peer up and ready (not in `exclude`) holds template `id` in memory
    /// only: captured a moment ago, its copy on its disk still being written.
    pub fn writing(&self, id: &str, exclude: &[String]) -> bool {
        let peers = self.peers();
        let mut holders = usable(&peers, exclude).filter_map(|(_, p)| p.template(id));
        holders.any(|t| t.disk_bytes == 0)
    }

    /// Forwards a request (`msg`: an edit, a generation; `origin`: its pod and job
    /// here) to peer `name`. `None` when the peer went away mid-request (it is marked
    /// down) or could not take it (unavailable, overloaded): the request goes elsewhere.
    /// Its other answers (a bad mask) are the request's.
    pub async fn forward_to<T: Send + 'static>(
        &self,
        name: &str,
        (origin, msg): (&PodOrigin, impl FnOnce(RpcReplyPort<Res<T>>) -> PodMsg),
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Option<Result<T, WireError>> {
        let cell = self.cell(name)?;
        if crate::fault::cut() {
            self.mark_down(name);
            return None;
        }
        let call = self.sessions.call(&cell, self.forward_timeout, msg);
        tokio::pin!(call, cancelled);
        let mut told = false;
        let cancel = || {
            self.sessions.tell(
                &cell,
                PodMsg::Cancel(FromPeer::of((origin.pod.clone(), origin.job))),
            )
        };
        // Whether the peer still reports: a pod that stops (paused, or a host gone
        // without a TCP reset) keeps its connection open, so the call alone could wait
        // out `forward_timeout`.
        let mut heartbeat = tokio::time::interval(DOWN_CHECK);
        // A cancel here goes on to the pod running it; its answer (cancelled, or done
        // before it could stop) ends the request.
        let r = loop {
            tokio::select! {
                r = &mut call => break r,
                () = &mut cancelled, if !told => {
                    told = true;
                    cancel();
                }
                _ = heartbeat.tick() => if !self.is_up(name) {
                    // Marked down mid-edit: the edit ends now, with the pod's name.
                    // Whether it ran there is unknown, so it is not run again
                    // elsewhere; the pod is told to stop it should it come back.
                    cancel();
                    self.metrics
                        .pod_forwards
                        .get_or_create(&[("pod", name.to_string()), ("result", "down".into())])
                        .inc();
                    return Some(Err(WireError::new(
                        ErrorKind::Unavailable,
                        format!(
                            "pod {name}, which was running this request, stopped reporting \
                             (down after {} s without a report); retry it",
                            DOWN_AFTER.as_secs()
                        ),
                    )));
                }
            }
        };
        let elsewhere =
            |e: &WireError| matches!(e.kind, ErrorKind::Unavailable | ErrorKind::Overloaded);
        let result = match &r {
            Ok(Ok(_)) => "ok",
            Ok(Err(e)) if elsewhere(e) => "refused",
            Ok(Err(_)) => "error",
            Err(_) => "lost",
        };
        self.metrics
            .pod_forwards
            .get_or_create(&[("pod", name.to_string()), ("result", result.into())])
            .inc();
        if r.is_ok() {
            self.refresh(name, cell.clone()).await;
        }
        match r {
            Ok(Err(e)) if elsewhere(&e) => {
                tracing::info!("pod {name} refused an edit ({}); trying another", e.message);
                None
            }
            Ok(answer) => Some(answer),
            Err(e) => {
                tracing::warn!("pod {name} lost an edit forwarded to it: {e}; trying another");
                self.mark_down(name);
                None
            }
        }
    }

    /// Asks peer `name` for its report now: an edit this router forwarded there has
    /// ended, so its last report (the edit counted in it) is stale where the next
    /// decision looks; or a beat said this pod missed a change of its templates.
    pub async fn refresh(&self, name: &str, cell: ActorCell) {
        if crate::fault::cut() {
            return;
        }
        let timeout = Duration::from_secs(1);
        match self
            .sessions
            .ask(&cell, timeout, |p| PodMsg::Report(FromPeer::of(()), p))
            .await
        {
            Ok(report) if report.pod == name => {
                self.reported(cell, report);
            }
            Ok(_) => {}
            Err(e) => tracing::debug!("pod {name} did not report: {e}"),
        }
    }

    /// Asks every peer up for its report now (a decision that needs a fresher view
    /// than the last second's). Callers that come while a round is under way wait for
    /// the next one to end, not each for a round of its own.
    pub async fn refresh_all(&self) {
        let seen = self.refreshes.load(std::sync::atomic::Ordering::Acquire);
        let _round = self.refreshing.lock().await;
        if self.refreshes.load(std::sync::atomic::Ordering::Acquire) > seen + 1 {
            // A whole round started and ended after this call came.
            return;
        }
        let up: Vec<(String, ActorCell)> = self
            .peers()
            .iter()
            .filter(|(_, p)| p.up)
            .map(|(name, p)| (name.clone(), p.cell.clone()))
            .collect();
        let asks = up.into_iter().map(|(name, cell)| async move {
            self.refresh(&name, cell).await;
        });
        futures_util::future::join_all(asks).await;
        self.refreshes
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// Template `id` was deleted here: every peer up drops its copy and recipe, and
    /// this pod its recipe. (A peer down misses it, and reports its copy again when it
    /// returns.)
    pub fn forget(&self, id: &str) {
        self.forgotten(id);
        for p in self.peers().values().filter(|p| p.up) {
            self.sessions
                .tell(&p.cell, PodMsg::Forget(FromPeer::of(id.to_string())));
        }
    }

    /// Whether capturing template `id` (`info`, its recipe's description) again here is
    /// cheaper than copying it from a peer up that holds it (always, when none does).
    pub fn recapture_is_cheaper(&self, id: &str, info: &TemplateInfo, pricing: &Pricing) -> bool {
        let peers = self.peers();
        let up = usable(&peers, &[]).map(|(_, p)| &p.report);
        let Some(size) = TemplateSize::reported(id, up) else {
            return true;
        };
        let m = pricing.miss(size, info.max_sequence_length, true);
        m.recapture_s < m.fetch_s
    }

    /// The error of a template edit no pod can run: no holder up and no recipe.
    pub fn no_holder(&self, id: &str) -> WireError {
        WireError::new(
            ErrorKind::Unavailable,
            format!(
                "template `{id}`: no pod that holds it is up and ready ({}); retry later",
                self.holders(id).join(", ")
            ),
        )
    }

    /// The peers that hold template `id`, with their state.
    pub fn holders(&self, id: &str) -> Vec<String> {
        self.peers()
            .iter()
            .filter(|(_, p)| p.template(id).is_some())
            .map(|(name, p)| {
                let state = match (p.up, p.report.ready) {
                    (false, _) => "down",
                    (true, false) => "not ready",
                    (true, true) => "up",
                };
                format!("{name}: {state}")
            })
            .collect()
    }

    /// The pod actor of peer `name`.
    pub fn cell(&self, name: &str) -> Option<ActorCell> {
        self.peers().get(name).map(|p| p.cell.clone())
    }

    /// The peers up and ready, and each template they hold with its holders among them.
    /// A peer that stopped being usable less than `grace` ago (restarting, draining,
    /// briefly cut off) still counts as holding its templates: a rolling restart does
    /// not copy every template it holds elsewhere (`[cluster] replicate_after_seconds`).
    pub fn placement(&self, grace: Duration) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
        let peers = self.peers();
        let mut up = vec![];
        let mut held: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, p) in peers.iter() {
            let usable = p.usable();
            if !usable && p.ready_at.elapsed() >= grace {
                continue;
            }
            if usable {
                up.push(name.clone());
            }
            for t in &p.report.templates {
                held.entry(t.id.clone()).or_default().push(name.clone());
            }
        }
        (up, held)
    }

    /// Every peer, for `/readyz`.
    pub fn status(&self) -> Vec<PeerStatus> {
        self.peers()
            .iter()
            .map(|(name, p)| PeerStatus {
                pod: name.clone(),
                state: if p.up { "up" } else { "down" },
                last_report_s: p.seen.elapsed().as_secs_f64(),
                http: p.report.http.clone(),
                ready: p.report.ready,
                in_flight: p.report.in_flight,
                limit: p.report.limit,
                templates: p.report.templates.len(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
