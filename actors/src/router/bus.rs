//! The router's cluster-facing actor, an edge beside the HTTP API: progress reports
//! and announcements from the workers, and edits from other services' actors (the
//! internal bus), which start through the same submission path as HTTP requests.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::router::flow::edit::{edit, EditInput};
use crate::router::service::{submit, EditReply, Submitted};
use crate::router::state::jobs::Previews;
use crate::router::state::Ctx;
use crate::wire::{BusEditResult, ImageFormat, RouterMsg, Wire, WireError};

/// The router's cluster-facing actor: progress reports from denoise workers, and
/// requests from other services' actors (the internal bus).
pub struct RouterActor;

impl Actor for RouterActor {
    type Msg = RouterMsg;
    type State = Arc<Ctx>;
    type Arguments = Arc<Ctx>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        ctx: Arc<Ctx>,
    ) -> Result<Arc<Ctx>, ActorProcessingErr> {
        Ok(ctx)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: RouterMsg,
        ctx: &mut Arc<Ctx>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RouterMsg::Progress(Wire(p)) => ctx.jobs.progress(p.job, p.step),
            RouterMsg::Preview(Wire(p)) => ctx.jobs.preview(p.job, p.step, p.jpeg),
            RouterMsg::Announce(Wire(info)) => {
                if info.role == "denoise" {
                    ctx.balancer.announce(&info.name, info.profile.clone());
                }
                let mut m = ctx.processes.lock().unwrap_or_else(|p| p.into_inner());
                m.insert(info.name.clone(), info);
            }
            RouterMsg::Load(Wire(load)) => ctx.balancer.report(load),
            RouterMsg::Ping(Wire(x), reply) => {
                let _ = reply.send(Wire(Ok(x)));
            }
            RouterMsg::BusEdit(Wire(e), reply) => {
                let permit = match ctx.admission.try_admit() {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = reply.send(Wire(Err(e)));
                        return Ok(());
                    }
                };
                let input = EditInput::of_template(e.template_id, e.mask_png, e.prompt, e.seed);
                // The flow runs on its own task, holding the permit until it ends: the
                // actor keeps taking progress reports. The caller gets the image in the
                // reply; the job table keeps only the description.
                let Submitted { job, task } = submit(
                    ctx,
                    permit,
                    "edit",
                    0,
                    Previews::None,
                    move |ctx, job| async move { edit(&ctx, job, &input).await },
                    |job, o| EditReply::new(job, o, ImageFormat::Png, false),
                );
                tokio::spawn(async move {
                    let r = match task.await {
                        Ok(r) => r,
                        Err(e) => Err(WireError::internal(format!("request task failed: {e}"))),
                    };
                    let _ = reply.send(Wire(r.map(|o| BusEditResult {
                        job,
                        png: o.image,
                        active_tokens: o.active,
                        tokens: o.tokens,
                    })));
                });
            }
        }
        Ok(())
    }
}
