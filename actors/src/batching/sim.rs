//! Discrete-event replay of the scheduler: what the denoise loop would do with a queue,
//! given a cost model for a step, without a model or a clock.

use crate::wire::JobId;
use std::collections::HashMap;

use super::{BatchScheduler, SchedRequest, SubmitError};

/// When one request was admitted and finished in a simulation (in the time unit of the
/// latency function).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimOutcome {
    pub id: JobId,
    /// Arrival time (the simulation's start for requests the scheduler already held).
    pub arrival: f64,
    /// Start of its first step (the simulation's start for requests already running).
    pub admit: f64,
    /// End of its last step.
    pub finish: f64,
}

impl SimOutcome {
    /// Arrival to finish.
    pub fn latency(&self) -> f64 {
        self.finish - self.arrival
    }

    /// Arrival to admission.
    pub fn queue_delay(&self) -> f64 {
        self.admit - self.arrival
    }
}

/// Runs `sched` from time `start` until every request has finished, submitting each of
/// `arrivals` (time, request) when the clock reaches its time (requests arriving during a
/// step join at the next one, as in the denoise loop). `step_latency` gives the duration
/// of a step of the batch it is given (the running requests, in batch order, before the
/// step advances them); it must return a finite, non-negative number.
///
/// Returns one outcome per request: those `sched` already ran, those it had waiting,
/// then `arrivals` in time order (stable). Fails if an arrival cannot be submitted
/// (duplicate id, no rows, no step left).
///
/// The router prices "this worker with the new request added" by simulating a clone of
/// the worker's scheduler with one arrival at `start`.
pub fn simulate<F>(
    mut sched: BatchScheduler,
    start: f64,
    arrivals: &[(f64, SchedRequest)],
    mut step_latency: F,
) -> Result<Vec<SimOutcome>, SubmitError>
where
    F: FnMut(&[SchedRequest]) -> f64,
{
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by(|&a, &b| arrivals[a].0.total_cmp(&arrivals[b].0));

    let mut out: Vec<(JobId, f64, Option<f64>, Option<f64>)> = Vec::new();
    out.extend(
        sched
            .running()
            .iter()
            .map(|r| (r.id, start, Some(start), None)),
    );
    out.extend(sched.waiting().map(|r| (r.id, start, None, None)));
    let mut index: HashMap<JobId, usize> = out.iter().enumerate().map(|(i, o)| (o.0, i)).collect();

    let mut now = start;
    let mut next = 0;
    loop {
        while next < order.len() && arrivals[order[next]].0 <= now {
            let (t, req) = arrivals[order[next]];
            sched.submit(req)?;
            index.insert(req.id, out.len());
            out.push((req.id, t, None, None));
            next += 1;
        }
        if sched.is_idle() {
            match order.get(next) {
                Some(&i) => {
                    now = now.max(arrivals[i].0);
                    continue;
                }
                None => break,
            }
        }
        let plan = sched.plan();
        assert!(
            !plan.is_empty(),
            "simulate: requests wait but none is admitted"
        );
        for id in plan.admitted() {
            out[index[id]].2 = Some(now);
        }
        let dt = step_latency(sched.running());
        assert!(
            dt.is_finite() && dt >= 0.0,
            "simulate: step latency {dt} is not a finite non-negative number"
        );
        now += dt;
        for id in sched.complete_step(&plan) {
            out[index[&id]].3 = Some(now);
        }
    }
    Ok(out
        .into_iter()
        .map(|(id, arrival, admit, finish)| SimOutcome {
            id,
            arrival,
            admit: admit.expect("every request is admitted"),
            finish: finish.expect("every request finishes"),
        })
        .collect())
}
