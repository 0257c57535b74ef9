//! The CPU worker groups: preprocess, postprocess, and the cache actor.
//!
//! Preprocess and postprocess actors are small: the actor receives calls and hands the
//! CPU work to one compute thread through a crossbeam channel, so a long VAE pass never
//! blocks the actor (it keeps taking `Release`s) nor the process's async runtime. One
//! request at a time per process: parallelism comes from running N processes
//! (`[workers] preprocess`, `postprocess`).

pub mod cache;
pub mod postprocess;
pub mod preprocess;

use crossbeam_channel::{unbounded, Sender};

/// Starts the compute thread of a CPU worker: it runs `work` on each job in order.
pub(crate) fn compute_thread<J: Send + 'static>(
    name: &str,
    mut work: impl FnMut(J) + Send + 'static,
) -> Sender<J> {
    let (tx, rx) = unbounded::<J>();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for job in rx {
                work(job);
            }
        })
        .expect("spawn a compute thread");
    tx
}
