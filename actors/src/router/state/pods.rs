//! The peer pods this router sees (docs/cluster.md): their last reports, whether they
//! answer, where each template is, and the call that forwards an edit to one. The mesh
//! (`crate::router::mesh`) fills it; the edit flow reads it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ractor::ActorCell;
use serde::Serialize;

use crate::metrics::router::RouterMetrics;
use crate::node;
use crate::wire::pods::{EditOutput, PodEdit, PodMsg, PodReport};
use crate::wire::{ErrorKind, Wire, WireError};

/// A peer that has not answered a report for this long is down: its edits go
/// elsewhere until it answers again.
pub const DOWN_AFTER: Duration = Duration::from_secs(3);

struct Peer {
    cell: ActorCell,
    report: PodReport,
    seen: Instant,
    up: bool,
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
    peers: Mutex<BTreeMap<String, Peer>>,
    /// How long a forwarded edit may take (the pod that runs it has its own stage
    /// deadlines; this bounds a peer that stops answering mid-edit).
    pub forward_timeout: Duration,
    metrics: RouterMetrics,
}

impl Pods {
    pub fn new(me: String, forward_timeout: Duration, metrics: RouterMetrics) -> Self {
        Pods {
            me,
            peers: Mutex::new(BTreeMap::new()),
            forward_timeout,
            metrics,
        }
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Peer>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer's report arrived through `cell` (its pod actor). True when the peer is
    /// new or was down. A report of an older daemon of the same name (an orphaned
    /// router still draining after its pod restarted) is ignored while the newer one
    /// answers.
    pub fn reported(&self, cell: ActorCell, report: PodReport) -> bool {
        self.metrics
            .pod_reports
            .get_or_create(&[("pod", report.pod.clone())])
            .inc();
        let mut peers = self.peers();
        let name = report.pod.clone();
        if peers
            .get(&name)
            .is_some_and(|p| p.up && p.report.started_unix > report.started_unix)
        {
            return false;
        }
        let came_up = peers.get(&name).is_none_or(|p| !p.up);
        peers.insert(
            name,
            Peer {
                cell,
                report,
                seen: Instant::now(),
                up: true,
            },
        );
        self.count_up(&peers);
        came_up
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

    fn mark_down(&self, name: &str) {
        let mut peers = self.peers();
        if let Some(p) = peers.get_mut(name) {
            p.up = false;
        }
        self.count_up(&peers);
    }

    /// Whether some peer, up or not, holds template `id`.
    pub fn known(&self, id: &str) -> bool {
        self.peers()
            .values()
            .any(|p| p.report.templates.iter().any(|t| t.id == id))
    }

    /// The peer that should run an edit of template `id`, among those up and ready
    /// (not starting, not draining) that hold it (`exclude`: tried already): one
    /// holding it in memory before one with it on disk only, then the least busy (in
    /// flight over its limit), then by name.
    pub fn holder(&self, id: &str, exclude: &[String]) -> Option<String> {
        let peers = self.peers();
        peers
            .iter()
            .filter(|(name, p)| p.up && p.report.ready && !exclude.contains(name))
            .filter_map(|(name, p)| {
                let t = p.report.templates.iter().find(|t| t.id == id)?;
                let busy = p.report.in_flight as f64 / p.report.limit.max(1) as f64;
                Some(((t.host_bytes == 0) as u8, busy, name.clone()))
            })
            .min_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal))
            .map(|(_, _, name)| name)
    }

    /// Forwards an edit of a template this pod lacks to a peer that holds it, and on to
    /// another holder when that peer goes away mid-edit (it is marked down) or cannot
    /// take it (unavailable, overloaded). Its other errors (a bad mask) come back as
    /// they are.
    pub async fn forward(&self, edit: PodEdit) -> Result<EditOutput, WireError> {
        let mut tried: Vec<String> = vec![];
        loop {
            let Some(name) = self.holder(&edit.template, &tried) else {
                return Err(WireError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "template `{}`: no pod that holds it is up and ready ({}); retry later",
                        edit.template,
                        self.holders(&edit.template).join(", ")
                    ),
                ));
            };
            let Some(cell) = self.peers().get(&name).map(|p| p.cell.clone()) else {
                continue;
            };
            let e = edit.clone();
            let r = node::call(&cell, self.forward_timeout, |p| PodMsg::Edit(Wire(e), p)).await;
            // A pod that cannot take it now (going down, full) leaves it to another
            // holder; its other answers (a bad mask, say) are the edit's.
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
                .get_or_create(&[("pod", name.clone()), ("result", result.into())])
                .inc();
            match r {
                Ok(Err(e)) if elsewhere(&e) => {
                    tracing::info!("pod {name} refused an edit ({}); trying another", e.message);
                    tried.push(name);
                }
                Ok(answer) => return answer,
                Err(e) => {
                    tracing::warn!("pod {name} lost an edit forwarded to it: {e}; trying another");
                    self.mark_down(&name);
                    tried.push(name);
                }
            }
        }
    }

    /// The peers that hold template `id`, with their state.
    fn holders(&self, id: &str) -> Vec<String> {
        self.peers()
            .iter()
            .filter(|(_, p)| p.report.templates.iter().any(|t| t.id == id))
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
    pub fn placement(&self) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
        let peers = self.peers();
        let mut up = vec![];
        let mut held: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, p) in peers.iter().filter(|(_, p)| p.up && p.report.ready) {
            up.push(name.clone());
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
mod tests {
    use super::*;
    use crate::wire::pods::PodTemplate;
    use ractor::{Actor, ActorProcessingErr, ActorRef};

    struct Nobody;
    impl Actor for Nobody {
        type Msg = ();
        type State = ();
        type Arguments = ();
        async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
            Ok(())
        }
    }

    fn report(
        pod: &str,
        started: f64,
        ready: bool,
        busy: u32,
        templates: &[(&str, u64)],
    ) -> PodReport {
        PodReport {
            pod: pod.into(),
            started_unix: started,
            http: String::new(),
            ready,
            in_flight: busy,
            limit: 10,
            templates: templates
                .iter()
                .map(|&(id, host)| PodTemplate {
                    id: id.into(),
                    host_bytes: host,
                    disk_bytes: 1,
                })
                .collect(),
        }
    }

    #[tokio::test]
    async fn the_holder_is_the_ready_pod_with_the_template_in_memory_then_the_least_busy() {
        let (cell, _) = Actor::spawn(None, Nobody, ()).await.unwrap();
        let m = crate::metrics::router::RouterMetrics::register(
            &mut Default::default(),
            &mut Default::default(),
            Default::default(),
        );
        let pods = Pods::new("me".into(), Duration::from_secs(1), m);
        let c = || cell.get_cell();
        pods.reported(c(), report("a", 1.0, true, 5, &[("t", 0)]));
        pods.reported(c(), report("b", 1.0, true, 9, &[("t", 1)]));
        pods.reported(c(), report("c", 1.0, true, 0, &[("t", 0)]));
        pods.reported(c(), report("d", 1.0, false, 0, &[("t", 1)]));
        // In memory beats disk only; not ready is never chosen.
        assert_eq!(pods.holder("t", &[]).as_deref(), Some("b"));
        // Then the least busy.
        assert_eq!(pods.holder("t", &["b".into()]).as_deref(), Some("c"));
        assert_eq!(pods.holder("u", &[]), None);
        assert!(pods.known("t") && !pods.known("u"));
        // An older daemon of b (an orphan draining) does not displace the newer one.
        pods.reported(c(), report("b", 2.0, true, 0, &[("t", 1)]));
        assert!(!pods.reported(c(), report("b", 1.0, false, 0, &[])));
        assert_eq!(pods.holder("t", &[]).as_deref(), Some("b"));
        let (up, held) = pods.placement();
        assert_eq!(up, ["a", "b", "c"]);
        assert_eq!(held["t"], ["a", "b", "c"]);
        cell.stop(None);
    }
}
