//! When the supervisor restarts a worker that exited, and when it gives up.
//!
//! A worker that dies after running a while (a kill, a device fault, a panic) is
//! restarted at once: its requests are being retried and wait for it. One that dies
//! again soon after each start is crash-looping (a bad model file, a broken device):
//! each restart then waits twice as long as the last, so the log stays readable and
//! the machine is not kept busy; and after [`MAX_QUICK_CRASHES`] in a row its slot is
//! marked failed: the supervisor stops restarting it, and `/readyz` says why. Each
//! slot keeps its own schedule, so one crash-looping worker never delays the restart
//! of another, nor shutdown.

use std::time::{Duration, Instant};

/// An exit within this long of the start counts as a quick crash.
pub const QUICK: Duration = Duration::from_secs(5);
/// Quick crashes in a row after which a slot is failed.
pub const MAX_QUICK_CRASHES: u32 = 5;
/// The wait before the restart that follows the first quick crash; it doubles with
/// each further one, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(250);
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What to do after a worker's exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Start it again at this time.
    RestartAt(Instant),
    /// Stop restarting it; the reason is shown in `/readyz`.
    GiveUp(String),
}

/// One slot's recent history.
#[derive(Clone, Debug, Default)]
pub struct Restarts {
    /// Quick crashes in a row (0 after a run longer than [`QUICK`]).
    pub quick: u32,
    /// Why the slot was given up, once it is.
    pub failed: Option<String>,
}

impl Restarts {
    /// The decision after an exit at `now` of a process that started at `started`;
    /// `status` describes the exit (for the reason).
    pub fn after_exit(&mut self, started: Instant, now: Instant, status: &str) -> Next {
        if now.duration_since(started) >= QUICK {
            self.quick = 0;
            return Next::RestartAt(now);
        }
        self.quick += 1;
        if self.quick >= MAX_QUICK_CRASHES {
            return Next::GiveUp(format!(
                "exited {} times in a row within {} s of starting (last: {status}); not restarted: see its log, fix the cause and restart the daemon",
                self.quick,
                QUICK.as_secs()
            ));
        }
        Next::RestartAt(now + backoff(self.quick))
    }
}

/// The wait before the restart that follows the `n`-th quick crash in a row (n >= 1).
pub fn backoff(n: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << (n - 1).min(16))
        .min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_runs_restart_at_once_and_quick_crashes_back_off_then_give_up() {
        let t0 = Instant::now();
        let mut r = Restarts::default();
        // A worker killed after running a while comes back at once, every time.
        for i in 0..10 {
            let start = t0 + QUICK * (2 * i);
            let end = start + QUICK;
            assert_eq!(r.after_exit(start, end, "killed"), Next::RestartAt(end));
        }
        // Crashing right after start: waits that double, then failure.
        let mut start = t0;
        for n in 1..MAX_QUICK_CRASHES {
            let end = start + Duration::from_millis(100);
            let want = end + FIRST_BACKOFF * 2u32.pow(n - 1);
            assert_eq!(r.after_exit(start, end, "exit 1"), Next::RestartAt(want));
            start = want;
        }
        match r.after_exit(start, start + Duration::from_millis(100), "exit status: 1") {
            Next::GiveUp(why) => assert!(why.contains("5 times") && why.contains("exit status: 1")),
            other => panic!("{other:?}"),
        }
        // One long run resets the count.
        let mut r = Restarts {
            quick: 4,
            failed: None,
        };
        let end = t0 + QUICK;
        assert_eq!(r.after_exit(t0, end, "killed"), Next::RestartAt(end));
        assert_eq!(r.quick, 0);
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        assert_eq!(backoff(1), FIRST_BACKOFF);
        assert_eq!(backoff(2), FIRST_BACKOFF * 2);
        assert_eq!(backoff(6), FIRST_BACKOFF * 32);
        assert_eq!(backoff(40), MAX_BACKOFF);
    }
}
