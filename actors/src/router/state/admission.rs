//! Admission control: the router runs at most `[server] max_queued_requests` flows at
//! once (edits, template registrations and generations, waiting or running, over HTTP
//! or the bus; a request of `n` images is `n` flows). Beyond that a request gets 429
//! with `Retry-After` at once, before its body is read, instead of queueing without
//! bound until the daemon runs out of memory. A request holds its units until its
//! flows end, not until its HTTP handler returns: `crate::router::service` is the one way a
//! route starts work, and it moves each unit into its flow's task.
//!
//! This one bound also bounds every queue behind the router: a worker's mailbox and a
//! denoise worker's scheduler queue hold only requests the router admitted, so none
//! can exceed it, and the job table holds at most this many unfinished jobs (finished
//! ones are bounded by `max_finished_jobs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::wire::{ErrorKind, WireError};

/// Seconds a client refused for overload is told to wait (`Retry-After`). Requests
/// here take seconds, so a one-second back-off spreads retries without idling.
pub const RETRY_AFTER_S: u64 = 1;

#[derive(Clone)]
pub struct Admission(Arc<Counter>);

struct Counter {
    limit: usize,
    in_flight: AtomicUsize,
    /// Set on SIGTERM: new requests are refused while those in flight finish.
    draining: std::sync::atomic::AtomicBool,
}

/// Units of admission (one per flow) an admitted request holds; dropping it makes room
/// for the next.
pub struct Permit {
    counter: Arc<Counter>,
    units: usize,
}

impl Admission {
    pub fn new(limit: usize) -> Self {
        Admission(Arc::new(Counter {
            limit,
            in_flight: AtomicUsize::new(0),
            draining: Default::default(),
        }))
    }

    /// A permit, or an `Overloaded` error when `limit` requests are in flight (an
    /// `Unavailable` one while draining).
    pub fn try_admit(&self) -> Result<Permit, WireError> {
        let c = &self.0;
        if self.is_draining() {
            return Err(WireError::new(
                ErrorKind::Unavailable,
                "the server is shutting down: it finishes the requests it has and takes no new ones",
            ));
        }
        c.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < c.limit).then_some(n + 1)
            })
            .map(|_| Permit {
                counter: c.clone(),
                units: 1,
            })
            .map_err(|_| overloaded(c.limit))
    }

    /// Units (flows) admitted and not yet finished.
    /// `[server] max_queued_requests`.
    pub fn limit(&self) -> usize {
        self.0.limit
    }
    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Acquire)
    }

    /// Refuses new requests from now on (graceful shutdown).
    pub fn drain(&self) {
        self.0.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.0.draining.load(Ordering::Acquire)
    }

    /// Waits until no request is in flight, or `limit` has passed; returns how many
    /// are still in flight.
    pub async fn idle(&self, limit: std::time::Duration) -> usize {
        let t0 = std::time::Instant::now();
        while self.in_flight() > 0 && t0.elapsed() < limit {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        self.in_flight()
    }
}

fn overloaded(limit: usize) -> WireError {
    WireError::new(
        ErrorKind::Overloaded,
        format!(
            "the server is at its limit of {limit} requests in flight ([server] max_queued_requests); retry after {RETRY_AFTER_S} s"
        ),
    )
}

impl Permit {
    /// How many units this permit holds.
    pub fn units(&self) -> usize {
        self.units
    }

    /// This permit grown to `n` units, then split into `n` permits of one unit each
    /// (one per flow of a request of `n` images). `n` above the limit can never be
    /// admitted: a `BadInput` error (400), not a 429 to retry. No room for the units
    /// beyond those held: `Overloaded`, and the permit is released.
    pub fn into_units(mut self, n: usize) -> Result<Vec<Permit>, WireError> {
        let c = self.counter.clone();
        if n == 0 || n > c.limit {
            return Err(WireError::new(
                ErrorKind::BadInput,
                format!(
                    "`n` = {n}: a request may ask for 1 to {} images here, the server's limit of flows in flight ([server] max_queued_requests)",
                    c.limit
                ),
            ));
        }
        if n > self.units {
            let more = n - self.units;
            c.in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |k| {
                    (k + more <= c.limit).then_some(k + more)
                })
                .map_err(|_| overloaded(c.limit))?;
            self.units = n;
        }
        let mut out = Vec::with_capacity(n);
        while self.units > 1 {
            self.units -= 1;
            out.push(Permit {
                counter: c.clone(),
                units: 1,
            });
        }
        out.push(self);
        Ok(out)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.counter
            .in_flight
            .fetch_sub(self.units, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_frees_on_drop() {
        let a = Admission::new(2);
        let p1 = a.try_admit().unwrap();
        let _p2 = a.try_admit().unwrap();
        let e = a.try_admit().err().expect("a third is refused");
        assert_eq!(e.kind, ErrorKind::Overloaded);
        assert_eq!(a.in_flight(), 2);
        drop(p1);
        assert_eq!(a.in_flight(), 1);
        let _p3 = a.try_admit().unwrap();
        assert!(a.try_admit().is_err());
        // Draining refuses everything new, whatever the room.
        drop(_p3);
        a.drain();
        assert_eq!(a.try_admit().err().unwrap().kind, ErrorKind::Unavailable);
    }

    #[test]
    fn n_units_are_held_one_per_flow_until_each_ends() {
        let a = Admission::new(3);
        let units = a.try_admit().unwrap().into_units(2).unwrap();
        assert_eq!(units.len(), 2);
        assert!(units.iter().all(|p| p.units() == 1));
        assert_eq!(a.in_flight(), 2);
        // Grown beyond the room there is: refused, and the door's unit is released.
        let p = a.try_admit().unwrap();
        assert_eq!(a.in_flight(), 3);
        assert_eq!(p.into_units(2).err().unwrap().kind, ErrorKind::Overloaded);
        assert_eq!(a.in_flight(), 2);
        // More than the limit could ever admit: bad input, not overload.
        let p = a.try_admit().unwrap();
        assert_eq!(p.into_units(4).err().unwrap().kind, ErrorKind::BadInput);
        assert_eq!(a.in_flight(), 2);
        // Each unit is released by its own flow.
        let mut units = units;
        drop(units.pop());
        assert_eq!(a.in_flight(), 1);
        drop(units);
        assert_eq!(a.in_flight(), 0);
        // One unit stays one.
        assert_eq!(a.try_admit().unwrap().into_units(1).unwrap().len(), 1);
        assert_eq!(a.in_flight(), 0);
    }

    #[test]
    fn concurrent_admission_never_exceeds_the_limit() {
        let a = Admission::new(5);
        let peak = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..2000 {
                        if let Ok(p) = a.try_admit() {
                            peak.fetch_max(a.in_flight(), Ordering::AcqRel);
                            drop(p);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Acquire) <= 5);
        assert_eq!(a.in_flight(), 0);
    }
}
