//! Property tests of the batch scheduler against a brute-force reference that plans
//! by scanning every request ever submitted.

use crate::wire::JobId;
use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RefState {
    Waiting,
    Running,
    Done,
    Cancelled,
}

#[derive(Clone, Debug)]
struct RefReq {
    req: SchedRequest,
    state: RefState,
    /// Submission order.
    sub: usize,
    /// Admission order (valid once running).
    adm: usize,
}

/// The reference: every request ever submitted, with its state; plans by scanning all.
struct Reference {
    config: BatchConfig,
    reqs: Vec<RefReq>,
    admissions: usize,
    /// Held running requests, by submission index.
    held: HashSet<usize>,
}

impl Reference {
    fn in_state(&self, st: RefState) -> Vec<&RefReq> {
        let mut v: Vec<&RefReq> = self.reqs.iter().filter(|r| r.state == st).collect();
        match st {
            RefState::Running => v.sort_by_key(|r| r.adm),
            _ => v.sort_by_key(|r| r.sub),
        }
        v
    }

    fn live(&self, id: JobId) -> Option<usize> {
        self.reqs.iter().position(|r| {
            r.req.id == id && matches!(r.state, RefState::Waiting | RefState::Running)
        })
    }

    fn submit(&mut self, req: SchedRequest) -> Result<(), SubmitError> {
        if req.rows_per_step == 0 {
            return Err(SubmitError::ZeroRows(req.id));
        }
        if req.steps_done >= req.steps_total {
            return Err(SubmitError::NoStepsLeft(req.id));
        }
        if let Some(t) = req.template {
            if t.bytes > self.config.template_bytes {
                return Err(SubmitError::TemplateTooLarge {
                    id: req.id,
                    bytes: t.bytes,
                    budget: self.config.template_bytes,
                });
            }
        }
        if self.live(req.id).is_some() {
            return Err(SubmitError::DuplicateId(req.id));
        }
        let sub = self.reqs.len();
        self.reqs.push(RefReq {
            req,
            state: RefState::Waiting,
            sub,
            adm: 0,
        });
        Ok(())
    }

    fn cancel(&mut self, id: JobId) -> bool {
        match self.live(id) {
            Some(i) => {
                self.reqs[i].state = RefState::Cancelled;
                self.held.remove(&i);
                true
            }
            None => false,
        }
    }

    fn hold(&mut self, id: JobId) -> bool {
        match self.live(id) {
            Some(i) if self.reqs[i].state == RefState::Running => self.held.insert(i),
            _ => false,
        }
    }

    fn release(&mut self, id: JobId) -> bool {
        match self.live(id) {
            Some(i) => self.held.remove(&i),
            None => false,
        }
    }

    /// Returns (plan ids, admitted ids); the plan is every running request afterwards.
    fn plan(&mut self) -> (Vec<JobId>, Vec<JobId>) {
        let running = self.in_state(RefState::Running);
        let mut count = running.len();
        let mut rows: usize = running.iter().map(|r| r.req.rows_per_step).sum();
        let mut batch: Vec<SchedRequest> = running.iter().map(|r| r.req).collect();
        let mut admit = Vec::new();
        if !(self.config.mode == Batching::Static && count > 0) {
            for w in self.in_state(RefState::Waiting) {
                let with: Vec<SchedRequest> = batch.iter().copied().chain([w.req]).collect();
                let fits = count < self.config.max_batch
                    && (count == 0 || rows + w.req.rows_per_step <= self.config.token_budget)
                    && distinct_template_bytes(&with) <= self.config.template_bytes;
                if !fits {
                    break;
                }
                count += 1;
                rows += w.req.rows_per_step;
                batch.push(w.req);
                admit.push(w.sub);
            }
        }
        let mut admitted = Vec::new();
        for sub in admit {
            let r = &mut self.reqs[sub];
            r.state = RefState::Running;
            r.adm = self.admissions;
            self.admissions += 1;
            admitted.push(r.req.id);
        }
        let ids = self
            .in_state(RefState::Running)
            .iter()
            .filter(|r| !self.held.contains(&r.sub))
            .map(|r| r.req.id)
            .collect();
        (ids, admitted)
    }

    /// Advances the running requests of `ids` (by submission index, to tell apart
    /// incarnations of one id) and returns the finished ones in batch order.
    fn complete(&mut self, subs: &[usize]) -> Vec<JobId> {
        let mut fin = Vec::new();
        let mut subs = subs.to_vec();
        subs.sort_by_key(|&s| self.reqs[s].adm);
        for s in subs {
            let r = &mut self.reqs[s];
            if r.state != RefState::Running {
                continue;
            }
            r.req.steps_done += 1;
            if r.req.steps_done >= r.req.steps_total {
                r.state = RefState::Done;
                fin.push(r.req.id);
            }
        }
        fin
    }
}

/// Bytes of the distinct templates (by key) a batch reads, counted from scratch.
fn distinct_template_bytes(batch: &[SchedRequest]) -> u64 {
    let mut seen: HashMap<u64, u64> = HashMap::new();
    for t in batch.iter().filter_map(|r| r.template) {
        seen.insert(t.key, t.bytes);
    }
    seen.values().sum()
}

/// A template's bytes as a function of its key, as in the daemon (one template, one
/// size).
fn template(key: u8) -> TemplateUse {
    TemplateUse {
        key: key as u64,
        bytes: 10 + 7 * key as u64,
    }
}

#[derive(Clone, Debug)]
enum Op {
    Submit {
        id: u8,
        rows: usize,
        steps: u32,
        done: u32,
        template: Option<u8>,
    },
    Cancel(u8),
    Step,
    /// Plan, cancel a request while the step "runs", then complete.
    CancelDuringStep(u8),
    Hold(u8),
    Release(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24, 0usize..=40, 0u32..=6, 0u32..=3, prop::option::of(0u8..6))
            .prop_map(|(id, rows, steps, done, template)| Op::Submit { id, rows, steps, done, template }),
        1 => (0u8..24).prop_map(Op::Cancel),
        5 => Just(Op::Step),
        1 => (0u8..24).prop_map(Op::CancelDuringStep),
        1 => (0u8..24).prop_map(Op::Hold),
        1 => (0u8..24).prop_map(Op::Release),
    ]
}

fn config() -> impl Strategy<Value = BatchConfig> {
    (
        1usize..=6,
        1usize..=80,
        prop_oneof![Just(Batching::Continuous), Just(Batching::Static)],
        // Template budgets from "one template at most" to "every template fits".
        prop_oneof![Just(u64::MAX), 0u64..=120],
    )
        .prop_map(|(m, b, mode, t)| BatchConfig {
            template_bytes: t,
            ..cfg(m, b, mode)
        })
}

/// Runs one step on both and checks the invariants; `cancel` is cancelled mid-step.
struct Harness {
    s: BatchScheduler,
    r: Reference,
    /// Steps each submission (by submission index) took part in.
    executed: HashMap<usize, u32>,
    /// Initial steps_done of each submission.
    initial_done: HashMap<usize, u32>,
}

impl Harness {
    fn new(config: BatchConfig) -> Self {
        Harness {
            s: BatchScheduler::new(config).unwrap(),
            r: Reference {
                config,
                reqs: Vec::new(),
                admissions: 0,
                held: HashSet::new(),
            },
            executed: HashMap::new(),
            initial_done: HashMap::new(),
        }
    }

    fn submit(&mut self, req: SchedRequest) -> Result<(), TestCaseError> {
        let got = self.s.submit(req);
        let want = self.r.submit(req);
        prop_assert_eq!(got, want);
        if got.is_ok() {
            self.initial_done
                .insert(self.r.reqs.len() - 1, req.steps_done);
        }
        Ok(())
    }

    fn cancel(&mut self, id: JobId) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.s.cancel(id), self.r.cancel(id));
        prop_assert!(!self.s.contains(id));
        prop_assert!(self.s.running().iter().all(|r| r.id != id));
        prop_assert!(self.s.waiting().all(|r| r.id != id));
        Ok(())
    }

    fn hold(&mut self, id: JobId, on: bool) -> Result<(), TestCaseError> {
        if on {
            prop_assert_eq!(self.s.hold(id), self.r.hold(id));
        } else {
            prop_assert_eq!(self.s.release(id), self.r.release(id));
        }
        prop_assert_eq!(
            self.s.is_held(id),
            on && self.s.running().iter().any(|r| r.id == id)
        );
        Ok(())
    }

    fn step(&mut self, cancel: Option<JobId>) -> Result<(), TestCaseError> {
        let c = self.r.config;
        let held: Vec<JobId> = self
            .s
            .running()
            .iter()
            .map(|r| r.id)
            .filter(|&id| self.s.is_held(id))
            .collect();
        let prev_running: Vec<JobId> = self
            .s
            .running()
            .iter()
            .map(|r| r.id)
            .filter(|id| !held.contains(id))
            .collect();
        let held_done: Vec<u32> = held
            .iter()
            .map(|id| {
                self.s
                    .running()
                    .iter()
                    .find(|r| r.id == *id)
                    .unwrap()
                    .steps_done
            })
            .collect();
        let waiting_before: Vec<JobId> = self.s.waiting().map(|r| r.id).collect();

        let plan = self.s.plan();
        let (ref_ids, ref_admitted) = self.r.plan();
        prop_assert_eq!(plan.ids(), &ref_ids[..]);
        prop_assert_eq!(plan.admitted(), &ref_admitted[..]);

        // Limits: held requests keep their rows and templates but are not planned.
        prop_assert!(plan.len() <= c.max_batch);
        let rows: usize = self.s.running().iter().map(|r| r.rows_per_step).sum();
        let held_rows: usize = self
            .s
            .running()
            .iter()
            .filter(|r| held.contains(&r.id))
            .map(|r| r.rows_per_step)
            .sum();
        prop_assert_eq!(plan.rows(), rows - held_rows);
        prop_assert_eq!(self.s.running_rows(), rows);
        prop_assert!(plan.ids().iter().all(|id| !held.contains(id)));
        prop_assert!(
            rows <= c.token_budget || self.s.running().len() == 1,
            "rows {} over budget",
            rows
        );
        let running: Vec<SchedRequest> = self.s.running().to_vec();
        prop_assert_eq!(
            self.s.running_template_bytes(),
            distinct_template_bytes(&running)
        );
        prop_assert!(self.s.running_template_bytes() <= c.template_bytes);
        // Running requests kept, in order, and first; the admitted are the FIFO head.
        prop_assert_eq!(&plan.ids()[..prev_running.len()], &prev_running[..]);
        prop_assert_eq!(plan.admitted(), &plan.ids()[prev_running.len()..]);
        prop_assert_eq!(plan.admitted(), &waiting_before[..plan.admitted().len()]);
        // Static: no admission while running.
        if c.mode == Batching::Static && !prev_running.is_empty() {
            prop_assert!(plan.admitted().is_empty());
        }
        // Continuous: if the head is still waiting, it really did not fit.
        if c.mode == Batching::Continuous {
            if let Some(head) = self.s.waiting().next() {
                let with: Vec<SchedRequest> = running.iter().copied().chain([*head]).collect();
                prop_assert!(
                    self.s.running().len() == c.max_batch
                        || rows + head.rows_per_step > c.token_budget
                        || distinct_template_bytes(&with) > c.template_bytes
                );
            }
        }
        // An empty plan only when nothing is waiting (or all that runs is held).
        if plan.is_empty() && held.is_empty() {
            prop_assert_eq!(self.s.num_waiting(), 0);
        }

        let subs: Vec<usize> = plan
            .ids()
            .iter()
            .map(|&id| self.r.live(id).expect("planned id is live"))
            .collect();
        if let Some(id) = cancel {
            self.cancel(id)?;
        }
        for &sub in &subs {
            if self.r.reqs[sub].state == RefState::Running {
                *self.executed.entry(sub).or_default() += 1;
            }
        }
        let fin = self.s.complete_step(&plan);
        prop_assert_eq!(&fin, &self.r.complete(&subs));
        // Held requests did not advance.
        for (id, done) in held.iter().zip(held_done) {
            if let Some(r) = self.s.running().iter().find(|r| r.id == *id) {
                prop_assert_eq!(r.steps_done, done, "held request {} advanced", id);
            }
        }
        for id in &fin {
            prop_assert!(!self.s.contains(*id));
        }
        Ok(())
    }

    /// Steps until idle: nothing starves, and each request ran exactly its steps.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        let held: Vec<JobId> = self.s.running().iter().map(|r| r.id).collect();
        for id in held {
            self.hold(id, false)?;
        }
        let bound: u32 = self.r.reqs.iter().map(|r| r.req.steps_left()).sum::<u32>() + 1;
        let mut n = 0;
        while !self.s.is_idle() {
            prop_assert!(n <= bound, "not idle after {} steps", n);
            self.step(None)?;
            n += 1;
        }
        for (sub, r) in self.r.reqs.iter().enumerate() {
            prop_assert!(matches!(r.state, RefState::Done | RefState::Cancelled));
            if r.state == RefState::Done {
                let ran = self.executed.get(&sub).copied().unwrap_or(0);
                prop_assert_eq!(ran, r.req.steps_total - self.initial_done[&sub]);
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn scheduler_matches_reference(c in config(), ops in prop::collection::vec(op(), 0..150)) {
        let mut h = Harness::new(c);
        for op in ops {
            match op {
                Op::Submit { id, rows, steps, done, template: t } => {
                    let mut r = req(id as JobId, rows, steps);
                    r.template = t.map(template);
                    r.steps_done = done;
                    r.arrival = h.r.reqs.len() as u64;
                    h.submit(r)?;
                }
                Op::Cancel(id) => h.cancel(id as JobId)?,
                Op::Step => h.step(None)?,
                Op::CancelDuringStep(id) => h.step(Some(id as JobId))?,
                Op::Hold(id) => h.hold(id as JobId, true)?,
                Op::Release(id) => h.hold(id as JobId, false)?,
            }
        }
        h.drain()?;
    }

    /// Continuous batching never starves a request: under a steady stream of new
    /// arrivals, every request is admitted within the steps left of those ahead of it.
    #[test]
    fn continuous_admits_every_request_under_load(
        budget in 1usize..=80,
        max_batch in 1usize..=6,
        reqs in prop::collection::vec((1usize..=60, 1u32..=5), 1..60),
    ) {
        let mut s = sched(max_batch, budget, Batching::Continuous);
        let mut admitted_at = HashMap::new();
        let mut work_ahead: HashMap<JobId, u32> = HashMap::new();
        let mut pending: u32 = 0;
        for (i, &(rows, steps)) in reqs.iter().enumerate() {
            // One arrival per step keeps the queue busy.
            let id = i as JobId;
            work_ahead.insert(id, pending);
            pending += steps;
            s.submit(req(id, rows, steps)).unwrap();
            let plan = s.plan();
            for &a in plan.admitted() {
                admitted_at.insert(a, s.steps_completed());
            }
            s.complete_step(&plan);
        }
        while !s.is_idle() {
            let plan = s.plan();
            for &a in plan.admitted() {
                admitted_at.insert(a, s.steps_completed());
            }
            s.complete_step(&plan);
        }
        for (i, _) in reqs.iter().enumerate() {
            let id = i as JobId;
            let at = admitted_at.get(&id).copied();
            prop_assert!(at.is_some(), "request {} never ran", id);
            // Submitted at step i; the work of all earlier requests bounds the wait.
            prop_assert!(at.unwrap() <= i as u64 + work_ahead[&id] as u64);
        }
    }

    /// The simulation agrees with stepping the scheduler by hand: with a unit step,
    /// a request's latency is at least its steps, and FIFO holds for admissions.
    #[test]
    fn sim_outcomes_are_consistent(
        c in config(),
        reqs in prop::collection::vec((0u32..20, 1usize..=60, 1u32..=5), 1..40),
    ) {
        let arrivals: Vec<(f64, SchedRequest)> = reqs
            .iter()
            .enumerate()
            .map(|(i, &(t, rows, steps))| (t as f64, req(i as JobId, rows, steps)))
            .collect();
        let out = simulate(BatchScheduler::new(c).unwrap(), 0.0, &arrivals, |b| {
            assert!(!b.is_empty() && b.len() <= c.max_batch);
            1.0
        })
        .unwrap();
        prop_assert_eq!(out.len(), arrivals.len());
        for o in &out {
            let (_, r) = arrivals[o.id as usize];
            prop_assert!(o.admit >= o.arrival);
            prop_assert_eq!(o.finish - o.admit, r.steps_total as f64);
        }
        // FIFO: outcomes come in arrival order; admissions never go backwards.
        for w in out.windows(2) {
            prop_assert!(w[0].arrival <= w[1].arrival);
            prop_assert!(w[0].admit <= w[1].admit);
        }
    }
}
