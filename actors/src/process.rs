//! The entry point of every worker process (`denoised worker --role ROLE`): settings
//! from the supervisor, the async runtime, the cluster node, and the role's actor.

use std::sync::Arc;
use std::time::Duration;

use denoised_cuda::DeviceSpec;
use denoised_models::pipeline::flux_fill::{FluxFill, Parts};
use denoised_models::pipeline::prompts::PromptCache;
use denoised_models::pipeline::sparse_vae::SparseVae;
use denoised_models::vae::VaeHalves;
use ractor::{Actor, ActorCell};

use crate::device::{self, Placed};
use crate::fault::Faults;
use crate::metrics::actor::MetricsActor;
use crate::metrics::ProcessRegistry;
use crate::node::{self, Role, Shm, WorkerEnv};
use crate::stages::Pipeline;
use crate::wire::{groups, CacheMsg, ControlNetMsg, DenoiseMsg, RouterMsg, Wire, WorkerInfo};
use crate::workers::{postprocess::PostprocessActor, preprocess::PreprocessActor};

/// The components a role computes with (docs/design.md, "Devices and roles"). A denoise
/// worker of the in-process baseline also runs the CPU stages.
pub fn role_parts(role: Role, disaggregate: bool) -> Parts {
    match role {
        Role::Preprocess => Parts::PREPROCESS,
        Role::Postprocess => Parts::POSTPROCESS,
        Role::Denoise if disaggregate => Parts::DENOISE,
        Role::Denoise => Parts::DENOISE
            .union(Parts::PREPROCESS)
            .union(Parts::POSTPROCESS),
        Role::Router | Role::Cache | Role::ControlNet => Parts {
            text: false,
            vae: VaeHalves::NONE,
            transformer: false,
        },
    }
}

/// A compute process's model: the host parts of its role, and for a denoise worker
/// the transformer placed on its device.
struct Loaded {
    pipeline: Arc<Pipeline>,
    placed: Option<Placed>,
    /// A denoise worker's planner profile (also the router's model of its steps).
    profile: Option<denoised_models::profile::Profile>,
}

fn load(env: &WorkerEnv) -> Result<Loaded, String> {
    let source = env.model_source();
    let device: DeviceSpec = env.device.parse().map_err(|e| format!("{e}"))?;
    let parts = device::host_parts(
        device,
        role_parts(env.role, env.config.denoise.disaggregate),
    );
    let dc = &env.config.device;
    let fp8_weights = device::parse_weight_dtype(&dc.weight_dtype, &dc.fp8_scaling)?;
    let cpu = device::host_backend(device, fp8_weights);
    let mut pipeline = FluxFill::load_parts(&source, cpu, parts)
        .map_err(|e| format!("loading model `{source}`: {e}"))?;
    let pc = &env.config.pipeline;
    pipeline.sparse_vae = SparseVae::new(pc.sparse_vae, pc.sparse_vae_trace_bytes as usize);
    pipeline.prompts = PromptCache::new(pc.prompt_cache_bytes as usize);
    if matches!(env.role, Role::Preprocess | Role::Postprocess) && device != DeviceSpec::Cpu {
        let dt = device::parse_dtype(&env.config.device.dtype)?;
        device::place_stages(device, dt, &mut pipeline)?;
    }
    let mut profile = None;
    let placed = match env.role {
        Role::Denoise => {
            let dt = device::parse_dtype(&env.config.device.dtype)?;
            let limits = device::StepLimits {
                max_batch: env.config.denoise.max_batch,
                token_budget: env.config.denoise.token_budget,
                max_pixels: env.config.server.max_pixels,
                host_template_bytes: env.config.workers.cache_arena_bytes,
                resident_template_bytes: env.config.denoise.resident_template_bytes,
                stages_on_device: env.stages_on_device,
            };
            let mut placed = device::place(&source, device, dt, fp8_weights, &pipeline, limits)?;
            merge_adapters(env, &pipeline, &mut placed)?;
            let p =
                device::planner_profile(&env.config.denoise.profile, &placed.stepper.backend())?;
            placed.stepper.set_profile(p.clone());
            profile = Some(p);
            Some(placed)
        }
        _ => None,
    };
    Ok(Loaded {
        pipeline: Arc::new(pipeline),
        placed,
        profile,
    })
}

/// Merges `[adapters] merged` into the worker's weights, before it serves anything.
fn merge_adapters(env: &WorkerEnv, pipeline: &Pipeline, placed: &mut Placed) -> Result<(), String> {
    let ad = &env.config.adapters;
    let set = ad.merged_set()?;
    if set.is_empty() {
        return Ok(());
    }
    let dir = ad.resolved_dir(&env.config.cache);
    let files = set
        .iter()
        .map(|(name, _)| {
            let path = crate::denoise::adapters::adapter_path(&dir, name)
                .map_err(|e| format!("[adapters] merged: {e}"))?;
            denoised_models::flux::lora::LoraFile::open(&path, &pipeline.config)
                .map_err(|e| format!("[adapters] merged: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let pairs: Vec<_> = files
        .iter()
        .zip(&set)
        .map(|(f, (_, s))| (f, *s as f32))
        .collect();
    let t0 = std::time::Instant::now();
    let sites = placed
        .stepper
        .merge_loras(&pairs)
        .map_err(|e| e.to_string())?;
    tracing::info!(
        "merged {:?} into {sites} Linears in {:.2} s",
        ad.merged,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Tells the router what this process loaded (for `/readyz`), once the router is
/// visible in the cluster's groups.
async fn announce(info: WorkerInfo) {
    for _ in 0..600 {
        if let Some(r) = node::members(groups::ROUTER).first() {
            node::tell(r, RouterMsg::Announce(Wire(info)));
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::warn!("the router never appeared; /readyz will not list this worker's model");
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
    crate::logging::set_format(&env.config.server.log_format)?;
    crate::logging::set_worker(env.name());
    // Before any thread starts: a panic anywhere in this process ends it (crate::fault),
    // and a terminal's Ctrl-C is the supervisor's to handle (see `crate::daemon::terminated`).
    crate::fault::exit_on_panic(env.name());
    // SAFETY: setting a signal disposition before any thread exists.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    let faults = Faults::from_env(role, env.incarnation)?;
    if faults.exit_at_start {
        eprintln!("error: {}: fault injection: exiting at start", env.name());
        std::process::exit(1);
    }
    if role != Role::Router && role != Role::Cache {
        // Each CPU compute process takes its share of the cores (the supervisor
        // computed it), instead of every process assuming it has the machine.
        rayon::ThreadPoolBuilder::new()
            .num_threads(env.threads)
            .build_global()
            .map_err(|e| e.to_string())?;
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
        serve(env, faults).await
    })
}

/// A worker's life after its settings: its model loaded, its actor started and
/// announced to the router, until it is told to stop.
async fn serve(env: WorkerEnv, faults: Faults) -> Result<(), String> {
    let role = env.role;
    if role == Role::Cache {
        // Before its arena replaces the one a crashed cache process left: the
        // templates that one had not written to disk yet are written from there.
        let e = env.clone();
        tokio::task::spawn_blocking(move || crate::workers::cache::recover::finish_writes(&e))
            .await
            .map_err(|e| e.to_string())?;
    }
    let shm = Arc::new(Shm::create(&env)?);
    let loaded = match role {
        Role::Cache => None,
        _ => Some(load_or_exit(&env).await?),
    };
    let info = worker_info(&env, loaded.as_ref());
    tracing::info!(
        "{}: {} on {} ({}), {:.1} MB of weights",
        info.name,
        info.components
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        info.device,
        info.dtype,
        info.components.iter().map(|c| c.weight_bytes).sum::<u64>() as f64 / 1e6
    );
    let node = node::start_node(&env, 0).await?;
    node::connect_router(&node, env.router_port, Duration::from_secs(60)).await?;
    let mut registry = ProcessRegistry::new(&env.name(), role.name());
    let (group, cell) = spawn_actor(&env, loaded, shm.clone(), &mut registry, faults).await?;
    let (metrics, _) = Actor::spawn(
        Some(format!("{}-metrics", env.name())),
        MetricsActor,
        (Arc::new(registry), shm.clone()),
    )
    .await
    .map_err(|e| e.to_string())?;
    node::register(groups::METRICS, metrics.get_cell());
    // Announced before joining the group, so that a /readyz that counts this worker
    // as live has (almost always) its entry too.
    announce(info.clone()).await;
    node::register(group, cell.clone());
    tracing::info!("{} ready", env.name());
    // When the router is lost, what this worker lent it is freed: its slices (the
    // cache's templates are not the router's, they stay, but the router's pins on
    // them go) and a denoise worker's running requests.
    let lost = move || {
        if role != Role::Cache {
            shm.release_all();
        }
        match role {
            Role::Denoise => node::tell(&cell, DenoiseMsg::RouterLost(Wire(()))),
            Role::Cache => node::tell(&cell, CacheMsg::RouterLost(Wire(()))),
            Role::ControlNet => node::tell(&cell, ControlNetMsg::RouterLost(Wire(()))),
            _ => {}
        }
    };
    let rejoined = move || {
        tokio::spawn(announce(info.clone()));
    };
    let rejoin = node::stay_connected(node, env.router_port, lost, rejoined);
    tokio::select! {
        _ = crate::daemon::terminated() => {}
        _ = rejoin => {}
    }
    Ok(())
}

/// The role's model, loaded off the async threads; a worker that cannot load it exits
/// with [`crate::daemon::EXIT_CANNOT_LOAD`] (the supervisor then stops at start
/// instead of restarting it forever).
async fn load_or_exit(env: &WorkerEnv) -> Result<Loaded, String> {
    let e = env.clone();
    match tokio::task::spawn_blocking(move || load(&e))
        .await
        .map_err(|e| e.to_string())?
    {
        Ok(l) => Ok(l),
        Err(e) => {
            eprintln!("error: {}: {e}", env.name());
            std::process::exit(crate::daemon::EXIT_CANNOT_LOAD);
        }
    }
}

/// What a worker announces to the router: where it computes and what it loaded.
fn worker_info(env: &WorkerEnv, loaded: Option<&Loaded>) -> WorkerInfo {
    let role = env.role;
    let placed = loaded.and_then(|l| l.placed.as_ref());
    // A pre- or postprocess worker's device is its VAE's (the placement's).
    let vae_device = (matches!(role, Role::Preprocess | Role::Postprocess) && env.device != "cpu")
        .then(|| (env.device.clone(), env.config.device.dtype.clone()));
    WorkerInfo {
        name: env.name(),
        role: role.name().into(),
        device: placed
            .map(|p| p.device.clone())
            .or_else(|| vae_device.as_ref().map(|v| v.0.clone()))
            .unwrap_or_else(|| "cpu".into()),
        dtype: placed
            .map(|p| p.dtype.to_string())
            .or_else(|| vae_device.as_ref().map(|v| v.1.clone()))
            .unwrap_or_else(|| "f32".into()),
        threads: env.threads as u32,
        components: loaded
            .map(|l| device::components(&l.pipeline, l.placed.as_ref()))
            .unwrap_or_default(),
        device_budget: placed.and_then(|p| p.budget.clone()),
        attention: placed.and_then(|p| p.attention.clone()),
        profile: loaded.and_then(|l| l.profile.clone()),
    }
}

/// Starts the role's actor (each role's spawn lives beside its actor) and names the
/// group it joins.
async fn spawn_actor(
    env: &WorkerEnv,
    loaded: Option<Loaded>,
    shm: Arc<Shm>,
    registry: &mut ProcessRegistry,
    faults: Faults,
) -> Result<(&'static str, ActorCell), String> {
    let name = env.name();
    match (env.role, loaded) {
        (Role::Preprocess, Some(l)) => {
            let cell = PreprocessActor::spawn(name, l.pipeline, shm).await?;
            Ok((groups::PREPROCESS, cell))
        }
        (Role::Postprocess, Some(l)) => {
            let cell = PostprocessActor::spawn(name, l.pipeline, shm).await?;
            Ok((groups::POSTPROCESS, cell))
        }
        (
            Role::Denoise,
            Some(Loaded {
                pipeline,
                placed: Some(placed),
                ..
            }),
        ) => {
            let cell =
                crate::denoise::actor::spawn(env, pipeline, placed, shm, faults, registry).await?;
            Ok((groups::DENOISE, cell))
        }
        (Role::ControlNet, Some(l)) => {
            let cell = crate::controlnet::spawn(env, l.pipeline, shm, registry).await?;
            Ok((groups::CONTROLNET, cell))
        }
        (Role::Cache, _) => {
            let cell = crate::workers::cache::start::spawn(env, shm, registry, faults).await?;
            Ok((groups::CACHE, cell))
        }
        (role, _) => Err(format!(
            "{role}: no model loaded (the router starts no actor here)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use denoised_models::ModelSource;
    use denoised_runtime::CpuBackend;

    /// Copies the reference model directory without the given component directories
    /// (their weight files, or the whole directory for tokenizers), so loading can only
    /// succeed if the role never opens them.
    fn model_without(dropped: &[&str]) -> tempfile::TempDir {
        let src = denoised_runtime::fixtures::tiny_model_dir();
        let dir = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(&src).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let to = dir.path().join(&name);
            if e.path().is_file() {
                std::fs::copy(e.path(), &to).unwrap();
                continue;
            }
            std::fs::create_dir(&to).unwrap();
            for f in std::fs::read_dir(e.path()).unwrap().flatten() {
                let weights = f.path().extension().is_some_and(|x| x == "safetensors");
                let tokenizer = name.starts_with("tokenizer");
                if dropped.contains(&name.as_str()) && (weights || tokenizer) {
                    continue;
                }
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        }
        dir
    }

    fn names(p: &Pipeline) -> Vec<String> {
        p.components().into_iter().map(|c| c.name).collect()
    }

    #[test]
    fn each_role_loads_only_its_components() {
        let text = ["tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2"];
        let cases: [(Role, Vec<&str>, Vec<&str>); 3] = [
            (
                Role::Preprocess,
                vec!["transformer"],
                vec!["tokenizers", "clip", "t5", "vae_encoder"],
            ),
            (
                Role::Denoise,
                [&text[..], &["vae"]].concat(),
                vec!["transformer"],
            ),
            (
                Role::Postprocess,
                [&text[..], &["transformer"]].concat(),
                vec!["vae_decoder"],
            ),
        ];
        for (role, dropped, want) in cases {
            let dir = model_without(&dropped);
            let source = ModelSource::dir(dir.path());
            let p = FluxFill::load_parts(&source, CpuBackend::new(), role_parts(role, true))
                .unwrap_or_else(|e| panic!("{role} opened another role's files: {e}"));
            assert_eq!(names(&p), want, "{role}");
            assert!(p
                .components()
                .iter()
                .all(|c| c.name == "tokenizers" || c.weight_bytes > 0));
            // Asking a role for another role's work is a clear error, not a panic.
            match role {
                Role::Preprocess => assert!(p.transformer().is_err()),
                _ => assert!(p.text().is_err()),
            }
            // The whole pipeline does need the files this role skipped.
            assert!(
                FluxFill::load(&source, CpuBackend::new()).is_err(),
                "{role}"
            );
        }
        // The in-process baseline's denoise worker runs every stage.
        let all = FluxFill::load_parts(
            &ModelSource::Builtin,
            CpuBackend::new(),
            role_parts(Role::Denoise, false),
        )
        .unwrap();
        assert_eq!(
            names(&all),
            [
                "tokenizers",
                "clip",
                "t5",
                "vae_encoder",
                "vae_decoder",
                "transformer"
            ]
        );
    }
}
