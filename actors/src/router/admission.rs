//! Admission control: the router takes at most `[server] max_queued_requests`
//! requests at once (edits and template registrations, waiting or running, over HTTP
//! or the bus). Beyond that a request gets 429 with `Retry-After` at once, before its
//! body is read, instead of queueing without bound until the daemon runs out of memory.
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

/// One admitted request; dropping it makes room for the next.
pub struct Permit(Arc<Counter>);

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
            .map(|_| Permit(c.clone()))
            .map_err(|n| {
                WireError::new(
                    ErrorKind::Overloaded,
                    format!(
                        "the server is at its limit of {n} requests in flight ([server] max_queued_requests); retry after {RETRY_AFTER_S} s"
                    ),
                )
            })
    }

    /// Requests admitted and not yet finished.
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

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
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
