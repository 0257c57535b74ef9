//! Starting the cache process's actor: the served model's template layout, the disk
//! tier, and the approximate cache of noise states (a text-to-image model's).

use std::sync::Arc;

use denoised_models::flux::template::TemplateModel;
use denoised_models::pipeline::flux_fill::PipelineKind;
use ractor::{Actor, ActorCell};

use super::{noise, CacheActor, CacheArgs};
use crate::fault::Faults;
use crate::metrics::cache::CacheMetrics;
use crate::metrics::ProcessRegistry;
use crate::node::{Shm, WorkerEnv};

/// Starts the cache actor of this daemon.
pub async fn spawn(
    env: &WorkerEnv,
    shm: Arc<Shm>,
    registry: &mut ProcessRegistry,
    faults: Faults,
) -> Result<ActorCell, String> {
    let metrics = CacheMetrics::register(registry.registry());
    let source = env.model_source();
    let model = TemplateModel::of(&source).map_err(|e| e.to_string())?;
    // Noise states are a text-to-image model's generations'.
    let noise = match model.kind {
        PipelineKind::TextToImage => crate::approx::from_config(&env.config.approx_cache)?,
        _ => None,
    };
    let a = &env.config.approx_cache;
    let noise = noise.map(|index| {
        let disk = (a.disk_bytes > 0)
            .then(|| (env.config.cache.resolved_dir().join("noise"), a.disk_bytes));
        let tiers = noise::Tiers {
            host_bytes: a.host_bytes,
            disk,
        };
        (index, tiers)
    });
    let args = CacheArgs {
        shm,
        metrics,
        model,
        fingerprint: source.fingerprint().map_err(|e| e.to_string())?,
        dir: env.config.cache.resolved_dir(),
        disk_bytes: env.config.cache.disk_bytes,
        noise,
        faults,
    };
    let (a, _) = Actor::spawn(Some(env.name()), CacheActor, args)
        .await
        .map_err(|e| e.to_string())?;
    Ok(a.get_cell())
}
