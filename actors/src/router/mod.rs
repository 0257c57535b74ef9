//! The router process: the HTTP API, the internal bus endpoint, the job table, and
//! the flows that take each request through the worker groups. Its layers, top to
//! bottom, each importing only those below it (docs/architecture.md, "The router's
//! layers"; `tests/layering.rs` checks it):
//!
//! - edges: [`http`] (the route table, one module per resource), [`bus`] (the
//!   cluster-facing actor), `mesh` and `transfer` (a pod's peers: docs/cluster.md),
//!   [`watchdog`] (systemd);
//! - [`service`]: the one submission path (admission held by the flow) and the
//!   replies' JSON;
//! - [`flow`]: the life of an edit, a capture, a generation, through the workers;
//!   nothing there knows HTTP;
//! - [`state`]: `Ctx`, the job table, admission, the balancer.
//!
//! Below them, shared with the workers: `crate::wire` (messages), `crate::node`
//! (cluster calls, arenas) and `crate::daemon` (clock, job names, exit codes). No
//! worker module imports this one.

pub mod bus;
pub mod flow;
pub mod http;
mod mesh;
pub mod service;
pub mod state;
mod watchdog;

pub use mesh::check_tls;

use std::sync::Arc;
use std::time::Duration;

use ractor::Actor;

use crate::node::{self, Shm, WorkerEnv};
use crate::wire::groups;
use bus::RouterActor;
use state::balance::Balancer;
use state::jobs::Jobs;
use state::{AdapterDir, Ctx, GenerationModel};

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
    let jobs = Jobs::start(
        Duration::from_secs(server.job_ttl_seconds),
        server.max_finished_jobs,
    )
    .await?;
    let text_to_image = flux.in_channels == flux.out_channels();
    let adapters = AdapterDir {
        dir: env.config.adapters.resolved_dir(&env.config.cache),
        transformer: flux.clone(),
    };
    let balancer = Balancer::new(flux, policy, env.config.denoise.max_batch);
    let mut ctx = Ctx::new(&env, shm, jobs, fingerprint, balancer);
    ctx.adapters = Some(adapters);
    if env.config.cluster.is_pod() {
        // A forwarded edit runs through the three stages on its pod.
        let forward_timeout = Duration::from_secs(3 * server.stage_timeout_seconds);
        let policy = env.config.cluster.policy.parse()?;
        let recipes = state::recipes::Recipes::new(env.config.cache.resolved_dir());
        let c = &env.config.cluster;
        let registry = match c.registry.is_empty() {
            true => {
                tracing::warn!(
                    "no [cluster] registry: template identity is best effort (each pod \
                     checks ids, replaces and deletes against its own copies; docs/cluster.md)"
                );
                None
            }
            false => {
                let lease = Duration::from_secs_f64(c.registry_lease_seconds);
                let r = state::registry::Registry::new(
                    &c.registry,
                    &c.registry_prefix,
                    lease,
                    &ctx.model,
                    &c.pod,
                )?;
                tracing::info!(
                    "template identity is kept in the registry, {}",
                    r.describe()
                );
                Some(r)
            }
        };
        ctx.pods = Some(state::pods::Pods::new(
            c.pod.clone(),
            policy,
            forward_timeout,
            recipes,
            registry,
            ctx.metrics.clone(),
            c.tls(),
        ));
    }
    // A text-to-image model (its transformer reads the packed latents alone) serves
    // generations.
    if text_to_image {
        let vsf = denoised_models::pipeline::flux_fill::vae_config(&model)
            .map_err(|e| e.to_string())?
            .vae_scale_factor() as u32;
        let scheduler = denoised_models::pipeline::flux_fill::scheduler_config(&model)
            .map_err(|e| e.to_string())?;
        ctx.generation = Some(GenerationModel {
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
    if ctx.pods.is_some() {
        mesh::join(ctx.clone(), addr.to_string()).await?;
    }
    tokio::spawn(watchdog::run(ctx.clone(), router.clone(), addr.to_string()));
    // Graceful drain on SIGTERM: /readyz turns 503 and new requests get 503 at once,
    // the requests in flight finish (up to `[server] drain_timeout_seconds`), then the
    // HTTP server stops once their responses are sent. The supervisor stops the other
    // workers only after this process has exited.
    let drain = {
        let ctx = ctx.clone();
        async move {
            crate::daemon::terminated().await;
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
