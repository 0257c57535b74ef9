//! Which pod runs a request, in a cluster (docs/cluster.md): the pod policy chooses
//! among this pod and its peers ([`crate::router::state::pods::Pods::route`]); the
//! request runs here, or goes whole to the chosen peer, which tells this pod's job its
//! events and takes its cancel. A peer that goes away or cannot take it is passed over
//! for the next choice. Template edits and generations without adapters of their own
//! go this way.

use std::future::Future;

use ractor::RpcReplyPort;

use crate::router::state::pods::{Need, Pods, Route};
use crate::router::state::{Ctx, Listed};
use crate::wire::pods::{PodMsg, PodOrigin};
use crate::wire::{JobId, Res, WireError};

/// Runs job `job` on the pod the policy chooses for `need`: `here` in this pod, or
/// `forward(origin)`'s message to a peer.
pub async fn on_pod<T, Fut>(
    (ctx, pods, job): (&Ctx, &Pods, JobId),
    need: Need<'_>,
    forward: impl Fn(PodOrigin, RpcReplyPort<Res<T>>) -> PodMsg,
    here: impl FnOnce() -> Fut,
) -> Result<T, WireError>
where
    T: Send + 'static,
    Fut: Future<Output = Result<T, WireError>>,
{
    // The pod that runs it tells this job its progress and previews.
    let origin = PodOrigin {
        pod: pods.me.clone(),
        job,
        previews: ctx.jobs.previews(job).await,
    };
    let listed = match need {
        Need::Template { id, .. } => Listed::Only(id),
        Need::Load(_) => Listed::Omitted,
    };
    let me = ctx.pod_report(listed).await;
    let pricing = ctx.pricing();
    let mut tried = vec![];
    let run = loop {
        match pods.route(&me, need, &tried, &pricing) {
            Route::Here(run) => break run,
            Route::Peer(name) => {
                let msg = |p| forward(origin.clone(), p);
                let forwarded = pods.forward_to(&name, (&origin, msg), cancelled(ctx, job));
                match forwarded.await {
                    Some(r) => return r,
                    None => tried.push(name),
                }
            }
        }
    };
    let _counted = run.map(|run| pods.count_here(job, run));
    here().await
}

/// Completes once job `job` is cancelled (looked at every 100 ms, as the flows look
/// while they wait for a worker).
async fn cancelled(ctx: &Ctx, job: JobId) {
    while !ctx.jobs.is_cancelled(job).await {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
