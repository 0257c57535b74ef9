//! Where uploads are staged in the pinned ring of [`crate::gpu::CudaExec`]: which bytes
//! of the ring the next copy takes, and which earlier copies must have finished first.
//!
//! An upload is copied into page-locked memory and queued as an asynchronous copy on the
//! compute stream, with an event recorded after it. The ring hands out its bytes in
//! order, wrapping at the end, so the host waits only when it is about to overwrite the
//! bytes of a copy the GPU has not made yet: a ring's worth of uploads can be in flight
//! behind the kernels already queued, and compute never waits for a copy it does not
//! read. (Before the ring, every upload over 256 KB synchronised the compute stream once
//! per 64 MiB chunk, so each admission or template made resident drained the GPU.)
//!
//! Pure bookkeeping over an event type `E`, so the policy is tested without a GPU.

use std::collections::VecDeque;
use std::ops::Range;

/// Placement in the ring; copies are aligned so that each starts on a cache line.
const ALIGN: usize = 64;
/// Most copies remembered at once: each holds a driver event, and a ring of small
/// uploads (a step's few hundred bytes) would otherwise keep a million of them. The
/// oldest is retired first; it has long finished.
const MAX_INFLIGHT: usize = 1024;

pub(crate) struct Ring<E> {
    cap: usize,
    /// The next free byte.
    head: usize,
    /// Copies that may still read the ring, oldest first, each with the event recorded
    /// after it. One stream runs them in order, so a finished copy has every older one
    /// finished too.
    inflight: VecDeque<(Range<usize>, E)>,
}

impl<E> Ring<E> {
    pub fn new(cap: usize) -> Ring<E> {
        assert!(cap >= ALIGN);
        Ring {
            cap,
            head: 0,
            inflight: VecDeque::new(),
        }
    }

    /// The largest copy one reservation takes (a quarter of the ring: a big upload goes
    /// in chunks, and four of them are in flight before the host waits for the first).
    pub fn chunk(&self) -> usize {
        (self.cap / 4).max(ALIGN)
    }

    /// Takes `len` bytes (at most [`chunk`](Self::chunk)): their offset in the ring, and
    /// the events of the copies that read them, oldest first. The caller waits for the
    /// last of those (the others finished before it), writes the bytes, queues the copy
    /// and hands its event to [`queued`](Self::queued). The events it gets back are free
    /// for reuse once waited for.
    pub fn reserve(&mut self, len: usize) -> (usize, Vec<E>) {
        assert!(len <= self.chunk(), "{len} bytes in a ring of {}", self.cap);
        let at = if self.head + len > self.cap {
            0
        } else {
            self.head
        };
        let want = at..at + len;
        let newest = self
            .inflight
            .iter()
            .rposition(|(r, _)| r.start < want.end && want.start < r.end);
        let overflow = (self.inflight.len() + 1).saturating_sub(MAX_INFLIGHT);
        let retire = newest.map_or(overflow, |i| (i + 1).max(overflow));
        let retired = self.inflight.drain(..retire).map(|(_, e)| e).collect();
        self.head = (at + len).next_multiple_of(ALIGN).min(self.cap);
        (at, retired)
    }

    /// Records the copy just queued from `range` and the event recorded after it.
    pub fn queued(&mut self, range: Range<usize>, event: E) {
        self.inflight.push_back((range, event));
    }

    /// Forgets every copy: the caller has synchronised the stream.
    pub fn drained(&mut self) -> Vec<E> {
        self.inflight.drain(..).map(|(_, e)| e).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for the GPU: copies finish in order, and only when waited for (the
    /// worst case for the host). Events are copy numbers.
    struct Sim {
        ring: Ring<usize>,
        /// Every copy's bytes and whether it may still be running.
        copies: Vec<(Range<usize>, bool)>,
        waits: usize,
    }

    impl Sim {
        fn upload(&mut self, len: usize) -> Range<usize> {
            let (at, retired) = self.ring.reserve(len);
            if let Some(&last) = retired.last() {
                self.waits += 1;
                for c in &mut self.copies[..=last] {
                    c.1 = false;
                }
            }
            let r = at..at + len;
            // No copy still running reads the bytes about to be written.
            for (other, running) in &self.copies {
                assert!(
                    !(*running && other.start < r.end && r.start < other.end),
                    "{r:?} overwrites {other:?} in flight"
                );
            }
            assert!(r.end <= self.ring.cap);
            self.ring.queued(r.clone(), self.copies.len());
            self.copies.push((r.clone(), true));
            r
        }
    }

    fn sim(cap: usize) -> Sim {
        Sim {
            ring: Ring::new(cap),
            copies: vec![],
            waits: 0,
        }
    }

    #[test]
    fn a_ring_of_uploads_goes_in_flight_before_the_host_waits() {
        let mut s = sim(1024);
        for _ in 0..4 {
            s.upload(256);
        }
        assert_eq!(s.waits, 0, "four chunks fit in the ring");
        s.upload(256);
        assert_eq!(s.waits, 1, "the fifth reuses the first one's bytes");
        // Small uploads share the ring without waiting for each other, up to the cap
        // on copies remembered, which then retires the oldest.
        let mut s = sim(1 << 20);
        for _ in 0..MAX_INFLIGHT {
            s.upload(100);
        }
        assert_eq!(s.waits, 0);
        s.upload(100);
        assert_eq!((s.waits, s.ring.inflight.len()), (1, MAX_INFLIGHT));
        assert!(
            !s.copies[0].1 && s.copies[1].1,
            "only the oldest was retired"
        );
    }

    #[test]
    fn no_copy_in_flight_is_overwritten_and_waits_are_only_for_overlaps() {
        // Pseudo-random sizes against the brute-force check in `Sim::upload`; a wait
        // must be for a copy whose bytes the new one takes.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for cap in [256usize, 1000, 4096] {
            let mut s = sim(cap);
            for _ in 0..5000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let len = 1 + (x as usize) % s.ring.chunk();
                let before: Vec<_> = s.copies.iter().map(|c| c.1).collect();
                let waits = s.waits;
                let r = s.upload(len);
                if s.waits > waits {
                    let overlapped = s.copies[..before.len()]
                        .iter()
                        .zip(&before)
                        .any(|((o, _), &running)| running && o.start < r.end && r.start < o.end);
                    assert!(overlapped, "waited for {r:?} with nothing in its way");
                }
            }
        }
    }
}
