//! Waiting on a 32-bit word of shared memory across processes: Linux futexes on a
//! `MAP_SHARED` mapping (not `FUTEX_PRIVATE_FLAG`, so waiters and wakers in different
//! processes meet at the same physical word). How the ControlNet service and a denoise
//! worker hand each other a step's latents and residuals without a message per block.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Blocks while `word` holds `current`, up to `timeout`; returns the value it holds
/// then (still `current` on a timeout). Spurious wake-ups are absorbed here.
pub fn wait_while(word: &AtomicU32, current: u32, timeout: Duration) -> u32 {
    let deadline = Instant::now() + timeout;
    loop {
        let v = word.load(Ordering::Acquire);
        if v != current {
            return v;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return v;
        }
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a valid, aligned u32 for the duration of the call; the
        // kernel only reads it. EAGAIN (changed meanwhile), EINTR and ETIMEDOUT all
        // lead back to the check above.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                current,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

/// Blocks until `done(word)` holds and returns the value; each time `every` passes
/// without it, `check` runs, and its error ends the wait (the writer is gone, the
/// wait was abandoned, it took too long).
pub fn wait_until<E>(
    word: &AtomicU32,
    done: impl Fn(u32) -> bool,
    every: Duration,
    mut check: impl FnMut() -> Result<(), E>,
) -> Result<u32, E> {
    loop {
        let v = word.load(Ordering::Acquire);
        if done(v) {
            return Ok(v);
        }
        if wait_while(word, v, every) == v {
            check()?;
        }
    }
}

/// Stores `value` into `word` and wakes every waiter on it, in any process.
pub fn store_and_wake(word: &AtomicU32, value: u32) {
    word.store(value, Ordering::Release);
    // SAFETY: as above; FUTEX_WAKE reads nothing but the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_waiter_wakes_on_a_store_and_times_out_without_one() {
        let w = Arc::new(AtomicU32::new(0));
        let t0 = Instant::now();
        assert_eq!(wait_while(&w, 0, Duration::from_millis(30)), 0);
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let w2 = w.clone();
        let h = std::thread::spawn(move || wait_while(&w2, 0, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        store_and_wake(&w, 7);
        assert_eq!(h.join().unwrap(), 7);
        // A value that already differs returns at once.
        assert_eq!(wait_while(&w, 3, Duration::from_secs(10)), 7);
    }
}
