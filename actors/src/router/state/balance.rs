//! The router's picture of its denoise workers, and the routing decision
//! ([`crate::routing`]) taken on it.
//!
//! Each denoise worker reports its load ([`WorkerLoad`]) after every step and every
//! change of its requests, so the router decides without asking anyone. Between two
//! reports, the requests this router sent a worker that its reports do not list yet
//! count as the worker's own, so a burst of arrivals does not all go to the worker that
//! looked idle a moment ago.
//!
//! A request goes to a worker with room (requests running and waiting below its
//! `max_batch`). While no worker has room, requests wait here, in arrival order, and
//! the policy places the first of them when a worker frees a slot, on what the workers
//! report then: the late binding the cluster simulator (`crate::routing::sim`) models.
//! A worker that has not reported yet (just started or restarted) counts as idle.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use denoised_models::flux::cost::StepShape;
use denoised_models::flux::FluxConfig;
use denoised_models::profile::{Profile, Tier};
use ractor::ActorCell;
use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::routing::{
    Dispatcher, Incoming, Policy, ProfileCost, Running, TemplateNeed, WorkerView,
};
use crate::wire::{JobId, TemplateRef, WorkerLoad};

/// What the router knows of one denoise worker.
#[derive(Default)]
struct Worker {
    /// Its latest report.
    load: WorkerLoad,
    /// Requests sent to it that its reports do not list yet.
    sent: Vec<(JobId, Running)>,
}

impl Worker {
    fn view(&self, template: Option<&TemplateRef>, default_max_batch: usize) -> WorkerView {
        let running: Vec<Running> = self
            .load
            .requests
            .iter()
            .map(|e| Running {
                shape: StepShape {
                    text: e.text as usize,
                    active: e.active as usize,
                    image: e.image as usize,
                },
                steps_left: e.steps_left,
            })
            .chain(self.sent.iter().map(|(_, r)| *r))
            .collect();
        // Unreported: the daemon's configured limit.
        let max_batch = match self.load.max_batch {
            0 => default_max_batch,
            n => n as usize,
        };
        WorkerView {
            room: running.len() < max_batch,
            running,
            device_templates: self.load.device_templates.clone(),
            // The host tier is the cache process's, one for every worker of the daemon,
            // and a request is routed once its template is there (the router waited
            // for its load from disk, which overlapped preprocessing).
            host_templates: template.map(|t| t.version).into_iter().collect(),
        }
    }
}

struct State {
    dispatcher: Dispatcher,
    /// By worker (process) name: the name of its actor.
    workers: BTreeMap<String, Worker>,
    /// The latency models routing prices steps with: the first denoise worker's that
    /// announced one (a daemon's workers share `[denoise] profile`), else the CPU's
    /// defaults.
    profile: Arc<Profile>,
    announced: bool,
    /// Requests waiting for a worker with room, in arrival order, with their shapes
    /// and steps (the pod's load as its peers price it).
    queue: VecDeque<(JobId, Running)>,
}

/// The decision of [`Balancer::place`].
pub struct Placement {
    pub worker: ActorCell,
    pub decision_s: f64,
}

pub struct Balancer {
    state: Mutex<State>,
    /// Signalled when a worker's load or the queue changes.
    changed: Notify,
    model: FluxConfig,
    /// `[denoise] max_batch`, for workers that have not reported theirs yet.
    max_batch: usize,
}

impl Balancer {
    pub fn new(model: FluxConfig, policy: Policy, max_batch: usize) -> Self {
        Balancer {
            state: Mutex::new(State {
                dispatcher: Dispatcher::new(policy),
                workers: BTreeMap::new(),
                profile: Arc::new(Profile::defaults("cpu")),
                announced: false,
                queue: VecDeque::new(),
            }),
            changed: Notify::new(),
            model,
            max_batch,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn policy(&self) -> Policy {
        self.lock().dispatcher.policy
    }

    pub fn set_policy(&self, policy: Policy) {
        self.lock().dispatcher = Dispatcher::new(policy);
    }

    /// A denoise worker (re)started: what the router knew of its name is gone with the
    /// process, and its profile prices steps if none does yet.
    pub fn announce(&self, name: &str, profile: Option<Profile>) {
        let mut st = self.lock();
        st.workers.insert(name.to_string(), Worker::default());
        if let Some(p) = profile.filter(|_| !st.announced) {
            st.profile = Arc::new(p);
            st.announced = true;
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// A worker's report: its load replaces the last one, and the requests it lists are
    /// no longer only "sent".
    pub fn report(&self, load: WorkerLoad) {
        let mut st = self.lock();
        let w = st.workers.entry(load.worker.clone()).or_default();
        w.sent
            .retain(|(job, _)| !load.requests.iter().any(|e| e.job == *job));
        w.load = load;
        drop(st);
        self.changed.notify_waiters();
    }

    /// The call that sent `job` to `worker` returned: whatever its reports said, it is
    /// not there any more.
    pub fn settle(&self, worker: &str, job: JobId) {
        let mut st = self.lock();
        if let Some(w) = st.workers.get_mut(worker) {
            w.sent.retain(|(j, _)| *j != job);
            w.load.requests.retain(|e| e.job != job);
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// Takes a place in the queue of requests waiting for a worker; the place is given
    /// up when the returned guard drops.
    pub fn enqueue(&self, job: JobId, shape: StepShape, steps: u32) -> QueuePlace<'_> {
        let run = Running {
            shape,
            steps_left: steps,
        };
        self.lock().queue.push_back((job, run));
        QueuePlace { b: self, job }
    }

    /// Completes when something [`Balancer::place`] reads changes next.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// The worker among `members` that takes `job`, if it is first in the queue and
    /// some worker has room; the request then counts as that worker's until its
    /// reports list it.
    pub fn place(
        &self,
        members: &[ActorCell],
        job: JobId,
        shape: StepShape,
        steps: u32,
        template: Option<&TemplateRef>,
    ) -> Option<Placement> {
        let t0 = Instant::now();
        let mut st = self.lock();
        if st.queue.front().map(|q| q.0) != Some(job) {
            return None;
        }
        // In name order, so that ties (which go to the lowest index) are broken the
        // same way whatever order the cluster lists its members in.
        let mut members: Vec<(String, &ActorCell)> = members
            .iter()
            .map(|c| (c.get_name().unwrap_or_default(), c))
            .collect();
        members.sort_by(|a, b| a.0.cmp(&b.0));
        let profile = st.profile.clone();
        let need = template.map(|t| {
            let bytes = t.blob.len as f64;
            TemplateNeed {
                version: t.version,
                host_load_s: profile.load_s(Tier::Host, bytes),
                disk_load_s: profile.load_s(Tier::Disk, bytes),
            }
        });
        let req = Incoming {
            shape,
            steps,
            template: need,
        };
        let views: Vec<WorkerView> = members
            .iter()
            .map(|(name, _)| {
                st.workers
                    .get(name)
                    .map_or_else(WorkerView::idle, |w| w.view(template, self.max_batch))
            })
            .collect();
        let cost = ProfileCost {
            config: &self.model,
            profile: &profile,
        };
        let i = st.dispatcher.choose(&views, &req, &cost)?;
        let (name, cell) = &members[i];
        st.workers.entry(name.clone()).or_default().sent.push((
            job,
            Running {
                shape,
                steps_left: steps,
            },
        ));
        st.queue.pop_front();
        drop(st);
        self.changed.notify_waiters();
        Some(Placement {
            worker: (*cell).clone(),
            decision_s: t0.elapsed().as_secs_f64(),
        })
    }

    /// Two different workers among `members` for the two branches of a true-CFG
    /// generation split across workers, when `job` is first in the queue and the policy
    /// finds room for a branch on one and then on another; `None` otherwise (nothing
    /// booked: the branches then batch on one worker).
    pub fn place_pair(
        &self,
        members: &[ActorCell],
        job: JobId,
        shape: StepShape,
        steps: u32,
    ) -> Option<(Placement, Placement)> {
        let a = self.place(members, job, shape, steps, None)?;
        let rest: Vec<ActorCell> = members
            .iter()
            .filter(|c| c.get_id() != a.worker.get_id())
            .cloned()
            .collect();
        let run = Running {
            shape,
            steps_left: steps,
        };
        self.lock().queue.push_front((job, run));
        let b = self.place(&rest, job, shape, steps, None);
        if b.is_none() {
            self.lock().queue.retain(|q| q.0 != job);
            self.settle(&a.worker.get_name().unwrap_or_default(), job);
        }
        Some((a, b?))
    }

    /// The pod's load as its peers' routers price it: each worker's requests (with those
    /// sent to it since its report) and batch limit, and the requests waiting for room.
    pub fn pod_load(&self) -> (Vec<(Vec<Running>, usize)>, Vec<Running>) {
        let st = self.lock();
        let workers = st
            .workers
            .values()
            .map(|w| {
                let v = w.view(None, self.max_batch);
                let max_batch = match w.load.max_batch {
                    0 => self.max_batch,
                    n => n as usize,
                };
                (v.running, max_batch)
            })
            .collect();
        (workers, st.queue.iter().map(|q| q.1).collect())
    }

    /// Whether `job` is in this balancer's hands: waiting for a worker, or on one.
    pub fn has(&self, job: JobId) -> bool {
        let st = self.lock();
        st.queue.iter().any(|q| q.0 == job)
            || st.workers.values().any(|w| {
                w.sent.iter().any(|s| s.0 == job) || w.load.requests.iter().any(|e| e.job == job)
            })
    }

    /// What prices a step: the served model and the profile routing uses.
    pub fn pricing(&self) -> (FluxConfig, Arc<Profile>) {
        (self.model.clone(), self.lock().profile.clone())
    }

    /// What `GET /admin/routing` shows: the policy, and each worker's load as the
    /// router sees it.
    pub fn describe(&self) -> Value {
        let st = self.lock();
        let workers: Vec<Value> = st
            .workers
            .iter()
            .map(|(name, w)| {
                let v = w.view(None, self.max_batch);
                json!({
                    "worker": name,
                    "max_batch": match w.load.max_batch {
                        0 => self.max_batch,
                        n => n as usize,
                    },
                    "requests": v.running.len(),
                    "unreported": w.sent.len(),
                    "rows_per_step": v.rows(),
                    "steps_left": v.running.iter().map(|r| r.steps_left).max().unwrap_or(0),
                    "device_templates": w.load.device_templates,
                })
            })
            .collect();
        json!({
            "policy": st.dispatcher.policy.name(),
            "waiting": st.queue.len(),
            "profile": st.profile.device,
            "workers": workers,
        })
    }
}

/// A request's place in the routing queue (see [`Balancer::enqueue`]).
pub struct QueuePlace<'a> {
    b: &'a Balancer,
    job: JobId,
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        let mut st = self.b.lock();
        if let Some(i) = st.queue.iter().position(|q| q.0 == self.job) {
            st.queue.remove(i);
            drop(st);
            self.b.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::LoadEntry;
    use ractor::{Actor, ActorProcessingErr, ActorRef};

    struct Idle;
    impl Actor for Idle {
        type Msg = ();
        type State = ();
        type Arguments = ();
        async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
            Ok(())
        }
    }

    /// Named actors standing for denoise workers (the balancer reads only names).
    async fn cells(names: &[&str]) -> Vec<ActorCell> {
        let mut v = vec![];
        for n in names {
            let (a, _) = Actor::spawn(Some(format!("{n}-{}", rand_suffix())), Idle, ())
                .await
                .unwrap();
            v.push(a.get_cell());
        }
        v
    }

    /// Actor names are global in a process; tests run in parallel.
    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }

    fn shape(active: usize) -> StepShape {
        StepShape {
            text: 64,
            active,
            image: 4096,
        }
    }

    fn load(worker: &ActorCell, reqs: &[(JobId, usize, u32)], max_batch: u32) -> WorkerLoad {
        WorkerLoad {
            worker: worker.get_name().unwrap(),
            max_batch,
            requests: reqs
                .iter()
                .map(|&(job, active, steps_left)| LoadEntry {
                    job,
                    text: 64,
                    active: active as u32,
                    image: 4096,
                    steps_left,
                })
                .collect(),
            device_templates: vec![],
        }
    }

    fn balancer(policy: Policy) -> Balancer {
        Balancer::new(FluxConfig::named("flux-small").unwrap(), policy, 16)
    }

    fn place(b: &Balancer, m: &[ActorCell], job: JobId, active: usize) -> Option<String> {
        let _q = b.enqueue(job, shape(active), 28);
        b.place(m, job, shape(active), 28, None)
            .map(|p| p.worker.get_name().unwrap())
    }

    #[tokio::test]
    async fn a_heavy_mask_goes_to_the_idle_worker() {
        let m = cells(&["a", "b"]).await;
        let b = balancer(Policy::MaskAware);
        b.report(load(&m[0], &[(1, 3000, 20)], 16));
        b.report(load(&m[1], &[], 16));
        assert_eq!(place(&b, &m, 2, 4000), m[1].get_name());
        // least_requests sees one running request against none: the same here...
        b.set_policy(Policy::LeastRequests);
        b.settle(&m[1].get_name().unwrap(), 2);
        assert_eq!(place(&b, &m, 3, 4000), m[1].get_name());
        // ...but not when the idle-looking worker runs two small edits and the other
        // one huge edit: mask_aware counts the work.
        let b = balancer(Policy::MaskAware);
        b.report(load(&m[0], &[(1, 4096, 27)], 16));
        b.report(load(&m[1], &[(4, 100, 27), (5, 100, 27)], 16));
        assert_eq!(place(&b, &m, 6, 2000), m[1].get_name());
        b.set_policy(Policy::LeastRequests);
        assert_eq!(place(&b, &m, 7, 2000), m[0].get_name());
    }

    #[tokio::test]
    async fn sent_requests_count_until_reported_and_settled() {
        let m = cells(&["a", "b"]).await;
        let b = balancer(Policy::LeastRequests);
        // Unreported workers count as idle; a burst spreads over them because what
        // was sent counts before any report.
        assert_eq!(place(&b, &m, 1, 500), m[0].get_name());
        assert_eq!(place(&b, &m, 2, 500), m[1].get_name());
        assert_eq!(place(&b, &m, 3, 500), m[0].get_name());
        // A report listing job 1 replaces its "sent" entry (not counted twice).
        b.report(load(&m[0], &[(1, 500, 27), (3, 500, 28)], 16));
        let d = b.describe();
        assert_eq!(d["workers"][0]["requests"], 2, "{d}");
        assert_eq!(d["workers"][0]["unreported"], 0, "{d}");
        // Once the call returns, the request is gone even before the next report.
        b.settle(&m[0].get_name().unwrap(), 1);
        b.settle(&m[0].get_name().unwrap(), 3);
        assert_eq!(b.describe()["workers"][0]["requests"], 0);
        assert_eq!(b.describe()["workers"][1]["requests"], 1);
        // A restarted worker starts empty.
        b.announce(&m[1].get_name().unwrap(), None);
        assert_eq!(b.describe()["workers"][1]["requests"], 0);
    }

    #[tokio::test]
    async fn full_workers_hold_requests_in_arrival_order() {
        let m = cells(&["a"]).await;
        let b = balancer(Policy::MaskAware);
        b.report(load(&m[0], &[(1, 100, 5), (2, 100, 5)], 2));
        let q3 = b.enqueue(3, shape(10), 28);
        let q4 = b.enqueue(4, shape(30), 28);
        assert!(b.place(&m, 3, shape(10), 28, None).is_none(), "no room");
        // The pod's load as its peers see it: the worker's two requests, the two waiting.
        let (workers, queued) = b.pod_load();
        assert_eq!(workers.len(), 1);
        assert_eq!((workers[0].0.len(), workers[0].1), (2, 2));
        assert_eq!(
            queued.iter().map(|r| r.shape.active).collect::<Vec<_>>(),
            [10, 30]
        );
        b.report(load(&m[0], &[(1, 100, 4)], 2));
        // Room for one: job 4 may not overtake job 3.
        assert!(b.place(&m, 4, shape(10), 28, None).is_none());
        assert!(b.place(&m, 3, shape(10), 28, None).is_some());
        drop(q3);
        assert!(b.place(&m, 4, shape(10), 28, None).is_none(), "full again");
        assert_eq!(b.describe()["waiting"], 1);
        // A request that gives up leaves the queue.
        drop(q4);
        assert_eq!(b.describe()["waiting"], 0);
    }

    #[tokio::test]
    async fn template_locality_is_honoured() {
        let m = cells(&["a", "b"]).await;
        let b = balancer(Policy::MaskAware);
        // Host-to-device copies at 1 GB/s.
        let mut p = Profile::defaults("cpu");
        p.load_host = denoised_models::profile::Fit::assumed(0.0, 1e-9);
        b.announce(&m[0].get_name().unwrap(), Some(p));
        // Worker b holds the template on its device; worker a would load 8 GB of it.
        b.report(load(&m[0], &[], 16));
        let mut lb = load(&m[1], &[(1, 10, 2)], 16);
        b.report(lb.clone());
        lb.device_templates = vec![42];
        let t = TemplateRef {
            id: "t".into(),
            version: 42,
            blob: denoised_runtime::shm::Handle {
                arena: String::new(),
                slot: 0,
                offset: 0,
                len: 8 << 30,
                dtype: denoised_runtime::DType::U8,
                shape: vec![8 << 30],
                generation: 0,
            },
            steps: 28,
            tokens: 4096,
            step_stride: 1,
        };
        // Neither holds it: the idle worker.
        let q = b.enqueue(2, shape(300), 28);
        let p = b.place(&m, 2, shape(300), 28, Some(&t)).unwrap();
        assert_eq!(p.worker.get_name(), m[0].get_name());
        drop(q);
        b.settle(&m[0].get_name().unwrap(), 2);
        // b holds it: b, busy as it is.
        b.report(lb);
        let _q = b.enqueue(3, shape(300), 28);
        let p = b.place(&m, 3, shape(300), 28, Some(&t)).unwrap();
        assert_eq!(p.worker.get_name(), m[1].get_name());
        assert!(p.decision_s < 0.01, "{}", p.decision_s);
    }
}
