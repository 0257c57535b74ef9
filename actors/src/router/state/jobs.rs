//! The job table: every request the router has accepted, its stage and progress, and
//! for async jobs the result until it expires. One local actor owns the table; HTTP
//! handlers, request flows and the router actor (progress from denoise workers) talk
//! to it through [`Jobs`], a small handle.
//!
//! A job can be watched ([`Jobs::watch`]): each watcher gets the job's events (its
//! stages, steps, previews, and its end) on a bounded channel. A watcher that falls
//! behind misses steps and previews, never the end (it reads the final view from the
//! table when its channel closes); one that goes away is dropped at the next event, and
//! every watcher is dropped when the job ends, so nothing outlives the job.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::daemon::{job_name, unix_now};
use crate::wire::{JobId, WireError};
// Statuses and previews cross pods with a forwarded edit (`crate::wire::pods`).
pub use crate::wire::pods::{JobStatus, Previews};

/// What `GET /v1/jobs/{id}` shows.
#[derive(Clone, Debug, Serialize)]
pub struct JobView {
    pub id: String,
    pub kind: &'static str,
    pub status: JobStatus,
    pub step: u32,
    pub steps: u32,
    pub created_unix: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<WireError>,
}

struct Entry {
    view: JobView,
    /// The denoise worker holding the request, for cancellation.
    worker: Option<ActorCell>,
    cancel: bool,
    finished: Option<Instant>,
    /// The previews the request asked for.
    previews: Previews,
    created: Instant,
    watchers: Vec<mpsc::Sender<JobEvent>>,
}

/// What a watcher of a job sees, in order.
#[derive(Clone, Debug)]
pub enum JobEvent {
    /// Its status, and while it waits (queued or preprocessing) the jobs accepted
    /// before it that wait too: its place in the queue.
    Status(JobStatus, Option<u32>),
    Step {
        step: u32,
        steps: u32,
        elapsed_s: f64,
    },
    Preview {
        step: u32,
        steps: u32,
        jpeg: std::sync::Arc<Vec<u8>>,
    },
}

/// Events a watcher may have unread before it misses steps and previews.
const WATCH_BACKLOG: usize = 64;

impl Entry {
    /// Sends `e` to every watcher still there (a full channel misses it).
    fn tell(&mut self, e: JobEvent) {
        self.watchers.retain(|w| match w.try_send(e.clone()) {
            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        });
    }
}

#[derive(RactorMessage)]
pub enum JobsMsg {
    /// A new job: its kind, its steps as far as known, and its previews.
    Create(JobId, &'static str, u32, Previews),
    Stage(JobId, JobStatus, Option<ActorCell>),
    Progress(JobId, u32),
    Preview(JobId, u32, Vec<u8>),
    /// The step count, once the flow knows it (a template edit takes the template's).
    Steps(JobId, u32),
    Finish(JobId, Result<serde_json::Value, WireError>),
    Get(JobId, RpcReplyPort<Option<JobView>>),
    /// Marks the job cancelled; replies with its status before, and the denoise worker
    /// to tell, if any.
    Cancel(JobId, RpcReplyPort<Option<(JobStatus, Option<ActorCell>)>>),
    IsCancelled(JobId, RpcReplyPort<bool>),
    PreviewEvery(JobId, RpcReplyPort<u32>),
    /// The previews the job's request asked for.
    Previews(JobId, RpcReplyPort<Previews>),
    /// The job now, and its events from here on (none for a job that has ended).
    Watch(JobId, RpcReplyPort<Option<Watched>>),
}

/// A job as a new watcher finds it.
pub struct Watched {
    pub view: JobView,
    /// Its place in the queue while it waits (see [`JobEvent::Status`]).
    pub ahead: Option<u32>,
    /// Its events from here on; `None` for a job that has ended.
    pub events: Option<mpsc::Receiver<JobEvent>>,
}

/// Whether a job of this status waits for its turn (admitted, not yet denoising).
fn waits(s: JobStatus) -> bool {
    matches!(s, JobStatus::Queued | JobStatus::Preprocessing)
}

/// Handle to the job table.
#[derive(Clone)]
pub struct Jobs(ActorRef<JobsMsg>);

impl Jobs {
    /// A job table keeping finished jobs for `ttl`, at most `max_finished` of them.
    pub async fn start(ttl: Duration, max_finished: usize) -> Result<Jobs, String> {
        let (r, _) = Actor::spawn(None, JobsActor, (ttl, max_finished))
            .await
            .map_err(|e| e.to_string())?;
        Ok(Jobs(r))
    }
    pub fn create(&self, id: JobId, kind: &'static str, steps: u32, previews: Previews) {
        let _ = self.0.cast(JobsMsg::Create(id, kind, steps, previews));
    }
    pub fn preview(&self, id: JobId, step: u32, jpeg: Vec<u8>) {
        let _ = self.0.cast(JobsMsg::Preview(id, step, jpeg));
    }
    /// The preview interval of the job's request, for its steps as the table knows
    /// them by now (0: none).
    pub async fn preview_every(&self, id: JobId) -> u32 {
        self.ask(|p| JobsMsg::PreviewEvery(id, p))
            .await
            .unwrap_or(0)
    }
    /// The previews the job's request asked for (none for an unknown job).
    pub async fn previews(&self, id: JobId) -> Previews {
        self.ask(|p| JobsMsg::Previews(id, p))
            .await
            .unwrap_or_default()
    }
    /// The job as it is, and a channel of its events from here on; `None` for an
    /// unknown job.
    pub async fn watch(&self, id: JobId) -> Option<Watched> {
        self.ask(|p| JobsMsg::Watch(id, p)).await.flatten()
    }
    async fn ask<T: Send + 'static>(
        &self,
        m: impl FnOnce(RpcReplyPort<T>) -> JobsMsg,
    ) -> Option<T> {
        self.0
            .call(m, None)
            .await
            .ok()
            .and_then(|r| r.success_or(()).ok())
    }
    pub fn stage(&self, id: JobId, s: JobStatus, worker: Option<ActorCell>) {
        let _ = self.0.cast(JobsMsg::Stage(id, s, worker));
    }
    pub fn steps(&self, id: JobId, steps: u32) {
        let _ = self.0.cast(JobsMsg::Steps(id, steps));
    }
    pub fn progress(&self, id: JobId, step: u32) {
        let _ = self.0.cast(JobsMsg::Progress(id, step));
    }
    pub fn finish(&self, id: JobId, r: Result<serde_json::Value, WireError>) {
        let _ = self.0.cast(JobsMsg::Finish(id, r));
    }
    pub async fn get(&self, id: JobId) -> Option<JobView> {
        self.ask(|p| JobsMsg::Get(id, p)).await.flatten()
    }
    pub async fn cancel(&self, id: JobId) -> Option<(JobStatus, Option<ActorCell>)> {
        self.ask(|p| JobsMsg::Cancel(id, p)).await.flatten()
    }
    pub async fn is_cancelled(&self, id: JobId) -> bool {
        self.ask(|p| JobsMsg::IsCancelled(id, p))
            .await
            .unwrap_or(false)
    }
}

struct JobsActor;

struct Table {
    jobs: HashMap<JobId, Entry>,
    ttl: Duration,
    /// Finished jobs, oldest first, for dropping beyond `max_finished`.
    finished: std::collections::VecDeque<JobId>,
    max_finished: usize,
}

impl Table {
    /// The waiting jobs accepted before `id`, while `id` waits.
    fn ahead(&self, id: JobId) -> Option<u32> {
        let j = self.jobs.get(&id).filter(|j| waits(j.view.status))?;
        let before = |o: &Entry| waits(o.view.status) && o.created < j.created;
        Some(self.jobs.values().filter(|o| before(o)).count() as u32)
    }

    /// A job left the queue: every watched job still in it moves up (one pass over the
    /// table per watched waiting job, which admission bounds).
    fn queue_moved(&mut self) {
        let watched: Vec<(JobId, JobStatus)> = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.watchers.is_empty() && waits(j.view.status))
            .map(|(&id, j)| (id, j.view.status))
            .collect();
        for (id, status) in watched {
            let ahead = self.ahead(id);
            if let Some(j) = self.jobs.get_mut(&id) {
                j.tell(JobEvent::Status(status, ahead));
            }
        }
    }

    /// Drops finished jobs older than the TTL, and the oldest beyond `max_finished`.
    /// Unfinished jobs are bounded by admission (`[server] max_queued_requests`), so
    /// the table is too. Amortised O(1) per job: each finished id is popped once.
    fn expire(&mut self) {
        while let Some(&id) = self.finished.front() {
            let old = self
                .jobs
                .get(&id)
                .and_then(|j| j.finished)
                .is_none_or(|t| t.elapsed() >= self.ttl);
            if !old && self.finished.len() <= self.max_finished {
                break;
            }
            self.finished.pop_front();
            self.jobs.remove(&id);
        }
    }
}

impl Actor for JobsActor {
    type Msg = JobsMsg;
    type State = Table;
    type Arguments = (Duration, usize);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (ttl, max_finished): (Duration, usize),
    ) -> Result<Table, ActorProcessingErr> {
        Ok(Table {
            jobs: HashMap::new(),
            ttl,
            finished: Default::default(),
            max_finished,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: JobsMsg,
        t: &mut Table,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            JobsMsg::Create(id, kind, steps, previews) => {
                t.expire();
                t.jobs.insert(
                    id,
                    Entry {
                        view: JobView {
                            id: job_name(id),
                            kind,
                            status: JobStatus::Queued,
                            step: 0,
                            steps,
                            created_unix: unix_now(),
                            result: None,
                            error: None,
                        },
                        worker: None,
                        cancel: false,
                        finished: None,
                        previews,
                        created: Instant::now(),
                        watchers: Vec::new(),
                    },
                );
            }
            JobsMsg::Stage(id, s, worker) => {
                let Some(j) = t.jobs.get_mut(&id) else {
                    return Ok(());
                };
                if !j.view.status.is_final() && j.view.status != s {
                    let left = waits(j.view.status) && !waits(s);
                    j.view.status = s;
                    j.worker = worker;
                    let ahead = t.ahead(id);
                    if let Some(j) = t.jobs.get_mut(&id) {
                        j.tell(JobEvent::Status(s, ahead));
                    }
                    if left {
                        t.queue_moved();
                    }
                }
            }
            JobsMsg::Steps(id, steps) => {
                if let Some(j) = t.jobs.get_mut(&id) {
                    j.view.steps = steps;
                }
            }
            JobsMsg::Progress(id, step) => {
                if let Some(j) = t.jobs.get_mut(&id) {
                    j.view.step = j.view.step.max(step);
                    let (step, steps) = (j.view.step, j.view.steps);
                    let elapsed_s = j.created.elapsed().as_secs_f64();
                    j.tell(JobEvent::Step {
                        step,
                        steps,
                        elapsed_s,
                    });
                }
            }
            JobsMsg::Preview(id, step, jpeg) => {
                if let Some(j) = t.jobs.get_mut(&id).filter(|j| !j.watchers.is_empty()) {
                    let steps = j.view.steps;
                    let jpeg = std::sync::Arc::new(jpeg);
                    j.tell(JobEvent::Preview { step, steps, jpeg });
                }
            }
            JobsMsg::PreviewEvery(id, reply) => {
                let every = t
                    .jobs
                    .get(&id)
                    .map_or(0, |j| j.previews.every(j.view.steps));
                let _ = reply.send(every);
            }
            JobsMsg::Previews(id, reply) => {
                let _ = reply.send(t.jobs.get(&id).map(|j| j.previews).unwrap_or_default());
            }
            JobsMsg::Watch(id, reply) => {
                let ahead = t.ahead(id);
                let r = t.jobs.get_mut(&id).map(|j| {
                    let events = (!j.view.status.is_final()).then(|| {
                        let (tx, rx) = mpsc::channel(WATCH_BACKLOG);
                        j.watchers.push(tx);
                        rx
                    });
                    Watched {
                        view: j.view.clone(),
                        ahead,
                        events,
                    }
                });
                let _ = reply.send(r);
            }
            JobsMsg::Finish(id, r) => {
                let was_waiting = t.jobs.get(&id).is_some_and(|j| waits(j.view.status));
                if let Some(j) = t.jobs.get_mut(&id).filter(|j| j.finished.is_none()) {
                    j.finished = Some(Instant::now());
                    t.finished.push_back(id);
                    j.worker = None;
                    // Watchers read the end from the table once their channel closes.
                    j.watchers.clear();
                    match r {
                        Ok(v) => {
                            j.view.status = JobStatus::Succeeded;
                            j.view.step = j.view.steps;
                            j.view.result = Some(v);
                        }
                        Err(e) => {
                            j.view.status = if e.kind == crate::wire::ErrorKind::Cancelled {
                                JobStatus::Cancelled
                            } else {
                                JobStatus::Failed
                            };
                            j.view.error = Some(e);
                        }
                    }
                }
                if was_waiting {
                    t.queue_moved();
                }
            }
            JobsMsg::Get(id, reply) => {
                let _ = reply.send(t.jobs.get(&id).map(|j| j.view.clone()));
            }
            JobsMsg::Cancel(id, reply) => {
                let r = t.jobs.get_mut(&id).map(|j| {
                    let before = j.view.status;
                    if !before.is_final() {
                        j.cancel = true;
                    }
                    (before, j.worker.clone())
                });
                let _ = reply.send(r);
            }
            JobsMsg::IsCancelled(id, reply) => {
                let _ = reply.send(t.jobs.get(&id).is_some_and(|j| j.cancel));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: JobId, finished: Option<Instant>) -> Entry {
        Entry {
            view: JobView {
                id: job_name(id),
                kind: "edit",
                status: JobStatus::Queued,
                step: 0,
                steps: 1,
                created_unix: 0.0,
                result: None,
                error: None,
            },
            worker: None,
            cancel: false,
            finished,
            previews: Previews::None,
            created: Instant::now(),
            watchers: Vec::new(),
        }
    }

    /// Finished jobs beyond the cap go oldest first, expired ones go whatever the cap,
    /// and unfinished ones always stay; against what must stay, computed directly.
    /// A watcher of a waiting job learns its place in the queue, and sees it move up
    /// when a job accepted before it starts denoising or ends; a job accepted after it
    /// does not count.
    #[tokio::test]
    async fn a_waiting_job_sees_its_place_in_the_queue_move() {
        let jobs = Jobs::start(Duration::from_secs(60), 10).await.unwrap();
        for id in 1..=4 {
            jobs.create(id, "edit", 4, Previews::None);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let w = jobs.watch(3).await.unwrap();
        assert_eq!(w.ahead, Some(2));
        let mut rx = w.events.unwrap();
        jobs.stage(1, JobStatus::Preprocessing, None);
        jobs.stage(1, JobStatus::Denoising, None);
        jobs.finish(2, Err(WireError::internal("gone")));
        let mut seen = vec![];
        while seen.len() < 2 {
            match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
                Ok(Some(JobEvent::Status(JobStatus::Queued, ahead))) => seen.push(ahead),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(seen, [Some(1), Some(0)]);
        jobs.stage(3, JobStatus::Denoising, None);
        let e = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
        assert!(
            matches!(e, Ok(Some(JobEvent::Status(JobStatus::Denoising, None)))),
            "{e:?}"
        );
    }

    /// `partial_images` of n gives at most n previews before the last step (OpenAI
    /// allows fewer), at least one, and n when n + 1 divides the steps; against
    /// counting them directly. (No single interval gives exactly n always: 9 steps
    /// make 2 of 3 at every 3 steps, 4 at every 2.)
    #[test]
    fn a_count_of_previews_spreads_at_most_that_many_over_the_steps() {
        for steps in 1..60u32 {
            for n in 1..=3u32 {
                let every = Previews::Count(n).every(steps);
                let made = (1..steps).filter(|k| k % every == 0).count() as u32;
                assert!(made <= n, "{steps} steps, {n} asked: {made}");
                assert!(steps < 2 || made >= 1, "{steps} steps, {n} asked");
                if steps % (n + 1) == 0 {
                    assert_eq!(made, n, "{steps} steps, {n} asked");
                }
            }
        }
        assert_eq!(Previews::Every(3).every(10), 3);
        assert_eq!(Previews::None.every(10), 0);
    }

    #[test]
    fn the_table_keeps_the_newest_finished_jobs_within_cap_and_ttl() {
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        for cap in 0..12 {
            let mut t = Table {
                jobs: HashMap::new(),
                ttl,
                finished: Default::default(),
                max_finished: cap,
            };
            // Ids 0..10 finish in this order; the first 4 long ago (expired). Ids
            // 100..103 are still running.
            for id in 0..10u64 {
                let ago = if id < 4 { 120 } else { 0 };
                let at = now.checked_sub(Duration::from_secs(ago)).unwrap();
                t.jobs.insert(id, job(id, Some(at)));
                t.finished.push_back(id);
            }
            for id in 100..103 {
                t.jobs.insert(id, job(id, None));
            }
            t.expire();
            let mut kept: Vec<u64> = t.jobs.keys().copied().filter(|&id| id < 100).collect();
            kept.sort();
            let want: Vec<u64> = (10u64.saturating_sub(cap as u64).max(4)..10).collect();
            assert_eq!(kept, want, "cap {cap}");
            assert!((100..103).all(|id| t.jobs.contains_key(&id)));
        }
    }
}
