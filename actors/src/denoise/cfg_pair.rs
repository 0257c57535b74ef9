//! True CFG's two branches on two denoise workers (docs/design.md §Adapters, parallel CFG
//! branches): the velocity exchange between them, through one slice of the router's
//! arena that both map writable.
//!
//! | part | writer | what |
//! |---|---|---|
//! | `positive` word | positive worker | the step whose velocity it published, plus 1 |
//! | `negative` word | negative worker | the same |
//! | `abandoned` word | router | set when the generation failed: a waiting branch stops |
//! | velocities | each its own | `[N, C]` f32, two buffers per branch by step parity |
//!
//! Each step both branches publish their velocity and wait for the other's. A buffer is
//! rewritten two steps later, which needs the other branch's next velocity, which it
//! publishes only after it has read this one: so nobody reads a buffer being rewritten.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use denoised_models::flux::edit::CfgPartner;
use denoised_runtime::shm::futex;
use denoised_runtime::{Error, HostSlice, Result};

const ALIGN: usize = 64;
/// The words: each branch's published step, and the router's abandonment.
const POSITIVE: usize = 0;
const NEGATIVE: usize = 1;
const ABANDONED: usize = 2;
const CHECK_EVERY: Duration = Duration::from_millis(500);
const GIVE_UP: Duration = Duration::from_secs(300);

pub use crate::wire::CfgPairRef;

/// Bytes of a pair's slice for `[rows, cols]` velocities.
pub fn pair_bytes(rows: usize, cols: usize) -> usize {
    ALIGN + 4 * (4 * rows * cols).next_multiple_of(ALIGN)
}

/// One branch's side of a pair.
pub struct PairPartner {
    slice: HostSlice,
    rows: usize,
    cols: usize,
    positive: bool,
    scale: f32,
}

impl PairPartner {
    pub fn new(slice: HostSlice, r: &CfgPairRef) -> Result<Self> {
        let (rows, cols) = (r.rows as usize, r.cols as usize);
        if slice.len() < pair_bytes(rows, cols)
            || !slice.writable()
            || slice.as_ptr() as usize % ALIGN != 0
        {
            return Err(Error::Invalid(format!(
                "a true-CFG pair of {} bytes for [{rows}, {cols}] velocities",
                slice.len()
            )));
        }
        Ok(PairPartner {
            slice,
            rows,
            cols,
            positive: r.positive,
            scale: r.scale,
        })
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        self.slice
            .word(i)
            .expect("the words lie inside the pair (checked in `new`)")
    }

    /// The velocity buffer of a branch for a step.
    fn buffer(&self, positive: bool, step: usize) -> *mut f32 {
        let n = (4 * self.rows * self.cols).next_multiple_of(ALIGN);
        let i = 2 * usize::from(!positive) + step % 2;
        // SAFETY: in bounds (checked in `new`).
        unsafe { self.slice.as_ptr().add(ALIGN + i * n) as *mut f32 }
    }

    /// The router's side: the generation failed; a branch waiting for the other stops.
    pub fn abandon(slice: &HostSlice) {
        if let Ok(w) = slice.word(ABANDONED) {
            futex::store_and_wake(w, 1);
        }
        // Wake the branches waiting on each other's word.
        for i in [POSITIVE, NEGATIVE] {
            if let Ok(w) = slice.word(i) {
                futex::store_and_wake(w, w.load(Ordering::Acquire));
            }
        }
    }
}

impl CfgPartner for PairPartner {
    fn positive(&self) -> bool {
        self.positive
    }
    fn scale(&self) -> f32 {
        self.scale
    }
    fn exchange(&self, step: usize, mine: &[f32]) -> Result<Vec<f32>> {
        let n = self.rows * self.cols;
        if mine.len() != n {
            return Err(Error::Invalid(format!(
                "a velocity of {} values, expected {n}",
                mine.len()
            )));
        }
        // SAFETY: this branch's buffer for this step, which only it writes; the other
        // branch reads it only after the word below says so (module docs).
        unsafe { std::slice::from_raw_parts_mut(self.buffer(self.positive, step), n) }
            .copy_from_slice(mine);
        let (me, other) = match self.positive {
            true => (self.word(POSITIVE), self.word(NEGATIVE)),
            false => (self.word(NEGATIVE), self.word(POSITIVE)),
        };
        futex::store_and_wake(me, step as u32 + 1);
        let want = step as u32 + 1;
        let abandoned = self.word(ABANDONED);
        let t0 = Instant::now();
        // The other branch may be a step ahead already (it read ours before).
        futex::wait_until(
            other,
            |v| v >= want || abandoned.load(Ordering::Acquire) != 0,
            CHECK_EVERY,
            || match t0.elapsed() > GIVE_UP {
                true => Err(Error::Invalid(format!(
                    "the other true-CFG branch gave no velocity for step {step} in {} s",
                    GIVE_UP.as_secs()
                ))),
                false => Ok(()),
            },
        )?;
        if abandoned.load(Ordering::Acquire) != 0 {
            return Err(Error::Invalid(
                "the other true-CFG branch failed (its worker says why)".into(),
            ));
        }
        // SAFETY: the other branch published it (word above) and rewrites it only two
        // steps on, after reading ours of the next step.
        let theirs = unsafe { std::slice::from_raw_parts(self.buffer(!self.positive, step), n) };
        Ok(theirs.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn two_branches_exchange_every_step_and_an_abandoned_pair_stops_a_waiter() {
        let (rows, cols) = (3, 2);
        let slice = HostSlice::zeroed(pair_bytes(rows, cols)).unwrap();
        let r = |positive| CfgPairRef {
            slot: denoised_runtime::shm::Handle {
                arena: "test".into(),
                slot: 0,
                offset: 0,
                len: 0,
                dtype: denoised_runtime::DType::U8,
                shape: vec![],
                generation: 0,
            },
            rows: rows as u32,
            cols: cols as u32,
            positive,
            scale: 4.0,
        };
        let pos = Arc::new(PairPartner::new(slice.clone(), &r(true)).unwrap());
        let neg = Arc::new(PairPartner::new(slice.clone(), &r(false)).unwrap());
        let n = neg.clone();
        // The negative branch runs ahead by a few ms each step.
        let t = std::thread::spawn(move || {
            (0..5)
                .map(|s| n.exchange(s, &[-(s as f32); 6]).unwrap())
                .collect::<Vec<_>>()
        });
        for s in 0..5 {
            std::thread::sleep(Duration::from_millis(3));
            assert_eq!(
                pos.exchange(s, &[s as f32; 6]).unwrap(),
                vec![-(s as f32); 6]
            );
        }
        let got = t.join().unwrap();
        for (s, v) in got.iter().enumerate() {
            assert_eq!(v, &vec![s as f32; 6], "step {s}");
        }
        let p = pos.clone();
        let t = std::thread::spawn(move || p.exchange(5, &[0.0; 6]));
        std::thread::sleep(Duration::from_millis(20));
        PairPartner::abandon(&slice);
        let e = t.join().unwrap().unwrap_err();
        assert!(
            e.to_string().contains("other true-CFG branch failed"),
            "{e}"
        );
    }
}
