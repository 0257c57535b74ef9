//! The CPU worker groups: preprocess, postprocess, and the cache actor.
//!
//! Preprocess and postprocess are one [`ComputeActor`] over their [`Stage`]: the actor
//! receives calls and hands the CPU work to one compute thread through a crossbeam
//! channel, so a long VAE pass never
//! blocks the actor (it keeps taking `Release`s) nor the process's async runtime. One
//! request at a time per process: parallelism comes from running N processes
//! (`[workers] preprocess`, `postprocess`).

pub mod cache;
pub mod postprocess;
pub mod preprocess;

use std::marker::PhantomData;
use std::sync::Arc;

use crossbeam_channel::{unbounded, Sender};
use denoised_runtime::shm::Handle;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::node::{self, Shm};
use crate::stages::Pipeline;
use crate::wire::{Reply, Wire, WireError};

/// What a message to a CPU worker asks for.
pub enum StageCommand<Req, Rep> {
    /// Compute `Req` and answer on the port.
    Work(Req, Reply<Rep>),
    /// The router is done with these slices of this worker's arena.
    Release(Vec<Handle>),
}

/// The one thing that differs between the CPU worker groups: their message type and
/// the work a request means.
pub trait Stage: Send + Sync + 'static {
    type Msg: ractor::Message;
    type Req: Send + 'static;
    type Rep: Send + 'static;
    /// Name of the compute thread.
    const THREAD: &'static str;
    fn command(msg: Self::Msg) -> StageCommand<Self::Req, Self::Rep>;
    fn run(p: &Pipeline, shm: &Shm, req: &Self::Req) -> Result<Self::Rep, WireError>;
    /// The request a call belongs to (its log lines name it).
    fn job(req: &Self::Req) -> crate::wire::JobId;
    /// The slices of this worker's arena a reply lends to the router.
    fn handles(rep: &Self::Rep) -> Vec<Handle>;
}

/// A CPU worker actor: takes calls, runs them in order on its compute thread, frees
/// released slices of its arena.
pub struct ComputeActor<S>(PhantomData<fn() -> S>);

impl<S> ComputeActor<S> {
    pub fn new() -> Self {
        ComputeActor(PhantomData)
    }
}

impl<S> Default for ComputeActor<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Stage> ComputeActor<S> {
    /// Starts a CPU worker's actor (a preprocess or postprocess process's) on its
    /// pipeline.
    pub async fn spawn(
        name: String,
        pipeline: Arc<Pipeline>,
        shm: Arc<Shm>,
    ) -> Result<ractor::ActorCell, String> {
        let (a, _) = ractor::Actor::spawn(Some(name), Self::new(), (pipeline, shm))
            .await
            .map_err(|e| e.to_string())?;
        Ok(a.get_cell())
    }
}

/// A request, where to answer it, and the router epoch it arrived in.
type WorkItem<S> = (<S as Stage>::Req, Reply<<S as Stage>::Rep>, u64);

pub struct ComputeState<S: Stage> {
    work: Sender<WorkItem<S>>,
    shm: Arc<Shm>,
}

impl<S: Stage> Actor for ComputeActor<S> {
    type Msg = S::Msg;
    type State = ComputeState<S>;
    type Arguments = (Arc<Pipeline>, Arc<Shm>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (pipeline, shm): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (work, rx) = unbounded::<WorkItem<S>>();
        let s = shm.clone();
        std::thread::Builder::new()
            .name(S::THREAD.into())
            .spawn(move || {
                for (req, reply, epoch) in rx {
                    let id = crate::daemon::job_name(S::job(&req));
                    let worker = crate::logging::worker();
                    let _span = tracing::info_span!("request", %id, %worker).entered();
                    let t0 = std::time::Instant::now();
                    let r = S::run(&pipeline, &s, &req);
                    match &r {
                        Ok(_) => tracing::info!(
                            "{}: done in {:.3} s",
                            S::THREAD,
                            t0.elapsed().as_secs_f64()
                        ),
                        Err(e) => tracing::warn!("{}: {e}", S::THREAD),
                    }
                    // The router that asked is gone (its connection was lost while this
                    // ran): nobody would release the result, so it is dropped here.
                    // Results written before the loss were freed with the arena sweep.
                    if node::router_epoch() != epoch {
                        if let Ok(rep) = &r {
                            s.release(&S::handles(rep));
                        }
                        continue;
                    }
                    let _ = reply.send(Wire(r));
                }
            })?;
        Ok(ComputeState { work, shm })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match S::command(msg) {
            StageCommand::Work(req, reply) => {
                let _ = st.work.send((req, reply, node::router_epoch()));
            }
            StageCommand::Release(handles) => st.shm.release(&handles),
        }
        Ok(())
    }
}
