//! The entry point of every worker process (`denoised worker --role ROLE`): settings
//! from the supervisor, the async runtime, the cluster node, and the role's actor.

use std::sync::Arc;
use std::time::Duration;

use denoised_models::pipeline::flux_fill::FluxFill;
use denoised_models::ModelSource;
use denoised_runtime::CpuBackend;
use ractor::Actor;

use crate::denoise::actor::{DenoiseActor, DenoiseArgs};
use crate::node::{self, Role, Shm, WorkerEnv};
use crate::scheduler::SchedulerConfig;
use crate::stages::Pipeline;
use crate::wire::groups;
use crate::workers::{
    cache::CacheActor, postprocess::PostprocessActor, preprocess::PreprocessActor,
};

/// Resolves when the process is asked to stop (SIGTERM from the supervisor or
/// systemd, or Ctrl-C).
pub async fn terminated() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn load_pipeline(env: &WorkerEnv) -> Result<Arc<Pipeline>, String> {
    let source: ModelSource = env
        .config
        .model
        .source
        .parse()
        .unwrap_or_else(|e| match e {});
    // The CUDA backend is not built yet (issue 6): every worker computes on the CPU.
    let p = FluxFill::load(&source, CpuBackend::new())
        .map_err(|e| format!("loading model `{source}`: {e}"))?;
    Ok(Arc::new(p))
}

/// Runs a worker process of `role` until it is told to stop.
pub fn run_worker(role: Role, index: usize, listen: Option<String>) -> Result<(), String> {
    let env = WorkerEnv::from_env()?;
    if (env.role, env.index) != (role, index) {
        return Err(format!(
            "--role {role} --index {index} disagrees with {} ({} {})",
            WorkerEnv::VAR,
            env.role,
            env.index
        ));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        if role == Role::Router {
            let listen = listen.unwrap_or_else(|| env.config.server.listen.clone());
            return crate::router::run(env, listen).await;
        }
        let shm = Arc::new(Shm::create(&env)?);
        let pipeline = match role {
            Role::Cache => None,
            _ => {
                let e = env.clone();
                Some(
                    tokio::task::spawn_blocking(move || load_pipeline(&e))
                        .await
                        .map_err(|e| e.to_string())??,
                )
            }
        };
        let node = node::start_node(&env, 0).await?;
        node::connect_router(&node, env.router_port, Duration::from_secs(60)).await?;
        let name = Some(env.name());
        let spawned = match (role, pipeline) {
            (Role::Preprocess, Some(p)) => Actor::spawn(name, PreprocessActor::new(), (p, shm))
                .await
                .map(|(a, _)| (groups::PREPROCESS, a.get_cell())),
            (Role::Postprocess, Some(p)) => Actor::spawn(name, PostprocessActor::new(), (p, shm))
                .await
                .map(|(a, _)| (groups::POSTPROCESS, a.get_cell())),
            (Role::Denoise, Some(p)) => {
                let d = &env.config.denoise;
                let sched = SchedulerConfig {
                    max_batch: d.max_batch,
                    token_budget: d.token_budget,
                    mode: d.batching,
                };
                sched.validate().map_err(|e| e.to_string())?;
                Actor::spawn(
                    name,
                    DenoiseActor,
                    DenoiseArgs {
                        pipeline: p,
                        shm,
                        sched,
                    },
                )
                .await
                .map(|(a, _)| (groups::DENOISE, a.get_cell()))
            }
            (Role::Cache, _) => Actor::spawn(name, CacheActor, shm)
                .await
                .map(|(a, _)| (groups::CACHE, a.get_cell())),
            _ => unreachable!("router handled above; pipelines loaded for compute roles"),
        };
        let (group, cell) = spawned.map_err(|e| e.to_string())?;
        node::register(group, cell);
        tracing::info!("{} ready", env.name());
        terminated().await;
        Ok(())
    })
}
