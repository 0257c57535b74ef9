//! The router's cluster-facing actor, an edge beside the HTTP API: progress reports
//! and announcements from the workers, and edits from other services' actors (the
//! internal bus), which start through the same submission path as HTTP requests.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::router::flow::edit::{edit, EditInput};
use crate::router::service::submit_peer_edit;
use crate::router::state::jobs::Previews;
use crate::router::state::Ctx;
use crate::wire::{BusEditResult, ImageFormat, RouterMsg, Wire};

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
                let input = EditInput::of_template(e.template_id, e.mask_png, e.prompt, e.seed);
                // The caller gets the image in the reply.
                submit_peer_edit(
                    ctx,
                    ImageFormat::Png,
                    Previews::None,
                    move |ctx, job| async move { edit(&ctx, job, &input).await },
                    move |r| {
                        let _ = reply.send(Wire(r.map(|(job, o)| BusEditResult {
                            job,
                            png: o.image,
                            active_tokens: o.active,
                            tokens: o.tokens,
                        })));
                    },
                );
            }
        }
        Ok(())
    }
}
