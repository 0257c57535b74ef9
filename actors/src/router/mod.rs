//! The router process: the HTTP API, the internal bus endpoint, the job table, and
//! the flows that take each request through the worker groups.

pub mod adapters;
mod admin;
pub mod admission;
pub mod balance;
mod cfg_split;
pub mod controlnets;
pub mod ctx;
mod edits;
pub mod flow;
pub mod generate;
mod generations;
pub mod http;
pub mod jobs;
mod openai;
mod submit;
mod watchdog;

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::node::{self, Shm, WorkerEnv};
use crate::wire::{groups, BusEditResult, ImageFormat, RouterMsg, Wire};
use flow::{Ctx, EditInput, MaskIn, Source};

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
                let input = EditInput {
                    source: Source::Template(e.template_id),
                    mask: MaskIn::Image(e.mask_png),
                    steps: None,
                    guidance: None,
                    prompt: e.prompt,
                    seed: e.seed,
                    dilation: 0,
                    max_sequence_length: 512,
                    finish: crate::wire::FinishParams {
                        paste_back: true,
                        feather: 3,
                        format: ImageFormat::Png,
                    },
                    // A template edit runs with its template's LoRAs.
                    loras: vec![],
                    controlnets: vec![],
                    negative_prompt: None,
                    true_cfg_scale: 1.0,
                };
                // The flow runs on its own task, holding the permit until it ends: the
                // actor keeps taking progress reports. The caller gets the image in the
                // reply; the job table keeps only the description.
                let submit::Submitted { job, task } = submit::submit(
                    ctx,
                    permit,
                    "edit",
                    0,
                    move |ctx, job| async move { flow::edit(&ctx, job, &input).await },
                    |job, o| edits::edit_json(job, o, ImageFormat::Png, false),
                );
                tokio::spawn(async move {
                    let r = match task.await {
                        Ok(r) => r,
                        Err(e) => Err(crate::wire::WireError::internal(format!(
                            "request task failed: {e}"
                        ))),
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

/// Runs the router process until SIGTERM/SIGINT.
pub async fn run(env: WorkerEnv, listen: String) -> Result<(), String> {
    let model = env.model_source();
    let fingerprint = model.fingerprint().map_err(|e| e.to_string())?;
    let flux = model.transformer_config().map_err(|e| e.to_string())?;
    let policy: crate::routing::Policy = env
        .config
        .server
        .routing_policy
        .parse()
        .map_err(|e| format!("[server] {e}"))?;
    let shm = Shm::create(&env)?;
    let server = &env.config.server;
    let jobs = jobs::Jobs::start(
        Duration::from_secs(server.job_ttl_seconds),
        server.max_finished_jobs,
    )
    .await?;
    let text_to_image = flux.in_channels == flux.out_channels();
    let adapters = adapters::AdapterDir {
        dir: env.config.adapters.resolved_dir(&env.config.cache),
        transformer: flux.clone(),
    };
    let balancer = balance::Balancer::new(flux, policy, env.config.denoise.max_batch);
    let mut ctx = Ctx::new(&env, shm, jobs, fingerprint, balancer);
    ctx.adapters = Some(adapters);
    // A text-to-image model (its transformer reads the packed latents alone) serves
    // generations.
    if text_to_image {
        let vsf = denoised_models::pipeline::flux_fill::vae_config(&model)
            .map_err(|e| e.to_string())?
            .vae_scale_factor() as u32;
        let scheduler = denoised_models::pipeline::flux_fill::scheduler_config(&model)
            .map_err(|e| e.to_string())?;
        ctx.generation = Some(generate::GenerationModel {
            default_side: 128 * vsf,
            multiple_of: 2 * vsf,
            scheduler: format!("{scheduler:?}"),
        });
    }
    let ctx = Arc::new(ctx);
    let _node = node::start_node(&env, env.router_port).await?;
    let (router, _) = Actor::spawn(Some("router".into()), RouterActor, ctx.clone())
        .await
        .map_err(|e| e.to_string())?;
    node::register(groups::ROUTER, router.get_cell());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    // The supervisor (and tests, systemd logs) read this line to learn the address.
    println!(
        "denoised: listening on http://{addr} (cluster node 127.0.0.1:{})",
        env.router_port
    );
    tracing::info!("HTTP API on http://{addr}");
    tokio::spawn(watchdog::run(ctx.clone(), router.clone(), addr.to_string()));
    // Graceful drain on SIGTERM: /readyz turns 503 and new requests get 503 at once,
    // the requests in flight finish (up to `[server] drain_timeout_seconds`), then the
    // HTTP server stops once their responses are sent. The supervisor stops the other
    // workers only after this process has exited.
    let drain = {
        let ctx = ctx.clone();
        async move {
            crate::process::terminated().await;
            ctx.admission.drain();
            let n = ctx.admission.in_flight();
            tracing::info!("draining: {n} requests in flight");
            crate::notify::notify(&format!("STATUS=draining {n} requests"));
            let limit = Duration::from_secs(ctx.config.server.drain_timeout_seconds);
            let left = ctx.admission.idle(limit).await;
            if left > 0 {
                tracing::warn!("drain timeout: {left} requests still in flight are dropped");
            }
        }
    };
    axum::serve(listener, http::app(ctx))
        .with_graceful_shutdown(drain)
        .await
        .map_err(|e| e.to_string())
}
