//! `denoised serve` (the daemon's supervisor) and `denoised worker` (one of its
//! processes, started by the supervisor).

use std::path::PathBuf;

use denoised_actors::node::Role;
use denoised_runtime::config::{Batching, Config, SparseVaeSetting};

use super::CliResult;

/// Flags mirror config keys; a flag (or its environment variable) overrides the file.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Configuration file (see the documented config.toml). Without one, defaults.
    #[arg(long, env = "DENOISED_CONFIG")]
    pub config: Option<PathBuf>,
    /// `[model] source`: a diffusers FLUX.1 Fill directory, `builtin`, or
    /// `builtin:flux-small`.
    #[arg(long, env = "DENOISED_MODEL")]
    pub model: Option<String>,
    /// `[model] transformer`, `vae`, `text_encoder_2`: single files in place of the
    /// directory's components.
    #[command(flatten)]
    pub components: super::ComponentArgs,
    /// `[server] listen`: address of the HTTP API (port 0 picks a free port; the
    /// chosen address is printed).
    #[arg(long, env = "DENOISED_LISTEN")]
    pub listen: Option<String>,
    /// `[server] api_token`: require `Authorization: Bearer <token>` on /v1.
    #[arg(long, env = "DENOISED_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// `[server] max_queued_requests`: most requests in flight; beyond it, 429.
    #[arg(long, env = "DENOISED_MAX_QUEUED_REQUESTS")]
    pub max_queued_requests: Option<usize>,
    /// `[workers] denoise`: denoise workers on the CPU or the emulator (a GPU list
    /// runs one per GPU).
    #[arg(long, env = "DENOISED_DENOISE_WORKERS")]
    pub denoise_workers: Option<usize>,
    /// `[workers] preprocess_device`: where the VAE encoder runs (auto, cpu, emu, cuda:N).
    #[arg(long, env = "DENOISED_PREPROCESS_DEVICE")]
    pub preprocess_device: Option<String>,
    /// `[workers] postprocess_device`: where the VAE decoder runs (auto, cpu, emu, cuda:N).
    #[arg(long, env = "DENOISED_POSTPROCESS_DEVICE")]
    pub postprocess_device: Option<String>,
    /// `[denoise] batching`: continuous or static.
    #[arg(long, env = "DENOISED_BATCHING")]
    pub batching: Option<String>,
    /// `[denoise] disaggregate`: false runs pre/post-processing in the denoise process.
    #[arg(long, env = "DENOISED_DISAGGREGATE")]
    pub disaggregate: Option<bool>,
    /// `[denoise] max_batch`.
    #[arg(long, env = "DENOISED_MAX_BATCH")]
    pub max_batch: Option<usize>,
    /// `[denoise] token_budget`.
    #[arg(long, env = "DENOISED_TOKEN_BUDGET")]
    pub token_budget: Option<usize>,
    /// `[denoise] profile`: the planner's latency models (from `denoised profile`).
    #[arg(long, env = "DENOISED_PROFILE")]
    pub profile: Option<String>,
    /// `[device] device`: auto, cpu, emu, cuda:N or a list cuda:N,M (one denoise
    /// worker per GPU).
    #[arg(long, env = "DENOISED_DEVICE")]
    pub device: Option<String>,
    /// `[device] dtype`: bf16 or f32, the storage dtype on a GPU.
    #[arg(long, env = "DENOISED_DTYPE")]
    pub dtype: Option<String>,
    /// `[device] weight_dtype`: fp8 (the transformer's large Linears in E4M3 with a
    /// scale per output channel; GPUs with fp8 tensor cores) or bf16 (the device dtype).
    #[arg(long, env = "DENOISED_WEIGHT_DTYPE")]
    pub weight_dtype: Option<String>,
    /// `[device] fp8_scaling`: tensor or channel (with fp8 weights).
    #[arg(long, env = "DENOISED_FP8_SCALING")]
    pub fp8_scaling: Option<String>,
    /// `[cluster] port`: the router's cluster node port (0: a free one).
    #[arg(long, env = "DENOISED_CLUSTER_PORT")]
    pub cluster_port: Option<u16>,
    /// `[cluster] cookie`: the cluster's shared secret (empty: random per start).
    #[arg(long, env = "DENOISED_COOKIE", hide_env_values = true)]
    pub cookie: Option<String>,
    /// `[cluster] pod`: this pod's name among its peers (empty: the host name).
    #[arg(long, env = "DENOISED_POD")]
    pub pod: Option<String>,
    /// `[cluster] listen`: IP:PORT of this pod's listener for its peers (off when empty).
    #[arg(long, env = "DENOISED_CLUSTER_LISTEN")]
    pub cluster_listen: Option<String>,
    /// `[cluster] peers`: HOST:PORT or dns:NAME:PORT, comma-separated.
    #[arg(long, env = "DENOISED_PEERS", value_delimiter = ',')]
    pub peers: Option<Vec<String>>,
    /// `[cluster] registry`: etcd's HOST:PORT endpoints, comma-separated.
    #[arg(long, env = "DENOISED_REGISTRY", value_delimiter = ',')]
    pub registry: Option<Vec<String>>,
    /// `[server] log_format`: text or json.
    #[arg(long, env = "DENOISED_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// `[server] routing_policy`: mask_aware, least_requests, least_tokens or
    /// round_robin.
    #[arg(long, env = "DENOISED_ROUTING_POLICY")]
    pub routing_policy: Option<String>,
    /// `[cache] dir`: the template cache's disk tier.
    #[arg(long, env = "DENOISED_CACHE_DIR")]
    pub cache_dir: Option<String>,
    /// `[adapters] dir`: where the served LoRAs are (and uploads go).
    #[arg(long, env = "DENOISED_ADAPTERS_DIR")]
    pub adapters_dir: Option<String>,
    /// `[adapters] patch_by_step`: K of bounded asynchronous LoRA loading.
    #[arg(long, env = "DENOISED_LORA_PATCH_BY_STEP")]
    pub lora_patch_by_step: Option<u32>,
    /// `[cache] mode`: what new templates cache per block, `kv` or `y`.
    #[arg(long, env = "DENOISED_CACHE_MODE")]
    pub cache_mode: Option<String>,
    /// `[cache] kv_dtype`: storage dtype of new templates (`f32`, `bf16`, `fp8`).
    #[arg(long, env = "DENOISED_KV_DTYPE")]
    pub kv_dtype: Option<String>,
    /// `[pipeline] sparse_vae`: `auto` (template edits run the VAE sparse when it pays)
    /// or `off`.
    #[arg(long, env = "DENOISED_SPARSE_VAE")]
    pub sparse_vae: Option<SparseVaeSetting>,
}

impl ServeArgs {
    /// The configuration: the file (if any) with the flags applied.
    /// `threads` is the global `--threads` flag (`[device] threads`).
    pub fn resolve(&self, threads: usize) -> CliResult<Config> {
        let mut c = match &self.config {
            Some(p) => Config::from_file(p)?,
            None => Config::default(),
        };
        if let Some(m) = &self.model {
            c.model.source = m.clone();
        }
        let path = |p: &PathBuf| p.display().to_string();
        if let Some(p) = &self.components.transformer {
            c.model.transformer = path(p);
        }
        if let Some(p) = &self.components.vae {
            c.model.vae = path(p);
        }
        if let Some(p) = &self.components.text_encoder_2 {
            c.model.text_encoder_2 = path(p);
        }
        if let Some(l) = &self.listen {
            c.server.listen = l.clone();
        }
        if let Some(t) = &self.api_token {
            c.server.api_token = t.clone();
        }
        if let Some(n) = self.max_queued_requests {
            c.server.max_queued_requests = n;
        }
        if let Some(b) = &self.batching {
            c.denoise.batching = match b.as_str() {
                "continuous" => Batching::Continuous,
                "static" => Batching::Static,
                other => return Err(format!("--batching {other}: use continuous or static").into()),
            };
        }
        if let Some(n) = self.denoise_workers {
            c.workers.denoise = n;
        }
        if let Some(d) = &self.preprocess_device {
            c.workers.preprocess_device = d.clone();
        }
        if let Some(d) = &self.postprocess_device {
            c.workers.postprocess_device = d.clone();
        }
        if let Some(s) = self.sparse_vae {
            c.pipeline.sparse_vae = s;
        }
        if let Some(d) = self.disaggregate {
            c.denoise.disaggregate = d;
        }
        if let Some(n) = self.max_batch {
            c.denoise.max_batch = n;
        }
        if let Some(p) = &self.profile {
            c.denoise.profile = p.clone();
        }
        if let Some(n) = self.token_budget {
            c.denoise.token_budget = n;
        }
        if let Some(d) = &self.device {
            c.device.device = d.clone();
        }
        if let Some(d) = &self.dtype {
            c.device.dtype = d.clone();
        }
        if let Some(d) = &self.weight_dtype {
            c.device.weight_dtype = d.clone();
        }
        if let Some(s) = &self.fp8_scaling {
            c.device.fp8_scaling = s.clone();
        }
        if threads > 0 {
            c.device.threads = threads;
        }
        // Fail here, before any process starts, on a bad device or dtype.
        denoised_cuda::parse_list(&c.device.device)?;
        denoised_actors::device::parse_dtype(&c.device.dtype)?;
        denoised_actors::device::parse_weight_dtype(&c.device.weight_dtype, &c.device.fp8_scaling)?;
        if let Some(p) = self.cluster_port {
            c.cluster.port = p;
        }
        if let Some(k) = &self.cookie {
            c.cluster.cookie = k.clone();
        }
        if let Some(p) = &self.pod {
            c.cluster.pod = p.clone();
        }
        if let Some(l) = &self.cluster_listen {
            c.cluster.listen = l.clone();
        }
        if let Some(r) = &self.registry {
            c.cluster.registry = r.clone();
        }
        if let Some(p) = &self.peers {
            c.cluster.peers = p.clone();
        }
        c.cluster.check()?;
        c.server.check()?;
        c.webhooks.check()?;
        c.templates.check()?;
        if c.cluster.is_pod() && c.cluster.pod.is_empty() {
            // Every process of the daemon gets the same name (in a StatefulSet: its pod's).
            c.cluster.pod = denoised_actors::node::host_name();
        }
        // Its certificate must name the pod: refused here, not by a router that
        // restarts in a loop.
        denoised_actors::router::check_tls(&c.cluster)?;
        if let Some(f) = &self.log_format {
            c.server.log_format = f.clone();
        }
        if let Some(p) = &self.routing_policy {
            c.server.routing_policy = p.clone();
        }
        c.server
            .routing_policy
            .parse::<denoised_actors::routing::Policy>()
            .map_err(|e| format!("[server] {e}"))?;
        denoised_actors::approx::from_config(&c.approx_cache)
            .map_err(|e| format!("[approx_cache] {e}"))?;
        if let Some(d) = &self.cache_dir {
            c.cache.dir = d.clone();
        }
        if let Some(d) = &self.adapters_dir {
            c.adapters.dir = d.clone();
        }
        if let Some(k) = self.lora_patch_by_step {
            c.adapters.patch_by_step = k;
        }
        if let Some(m) = &self.cache_mode {
            c.cache.mode = m.clone();
        }
        if let Some(d) = &self.kv_dtype {
            c.cache.kv_dtype = d.clone();
        }
        let mode = c
            .cache
            .mode
            .parse::<denoised_models::planner::CacheMode>()
            .map_err(|e| format!("[cache] mode: {e}"))?;
        if c.cache.kv_step_stride == 0
            || (c.cache.kv_step_stride > 1 && mode != denoised_models::planner::CacheMode::Kv)
        {
            return Err("[cache] kv_step_stride must be at least 1, and 1 in cache mode y".into());
        }
        if !c.cache.kv_dtype.is_empty() {
            let dt = denoised_models::flux::template::storage_dtype(&c.cache.kv_dtype)
                .map_err(|e| format!("[cache] kv_dtype: {e}"))?;
            if dt == denoised_runtime::DType::F8E4M3
                && mode != denoised_models::planner::CacheMode::Kv
            {
                return Err("[cache] kv_dtype = \"fp8\" needs [cache] mode = \"kv\"".into());
            }
        }
        denoised_actors::logging::set_format(&c.server.log_format)
            .map_err(|e| format!("[server] {e}"))?;
        if c.workers.preprocess == 0 || c.workers.postprocess == 0 || c.workers.denoise == 0 {
            return Err("[workers] counts must be at least 1".into());
        }
        if c.server.max_queued_requests == 0 {
            return Err("[server] max_queued_requests must be at least 1".into());
        }
        // Fail here, with the path, rather than in every worker.
        let source = denoised_models::ModelSource::from_config(&c.model)?;
        source.fingerprint()?;
        // A single file's header: its layout, config and keys are checked here too.
        source.transformer_config()?;
        denoised_models::pipeline::flux_fill::vae_config(&source)?;
        Ok(c)
    }
}

pub fn run_serve(a: ServeArgs, threads: usize) -> CliResult {
    let config = a.resolve(threads)?;
    denoised_actors::supervisor::serve(config, None)?;
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// router, preprocess, denoise, postprocess or cache.
    #[arg(long)]
    pub role: Role,
    /// Index of this process within its group.
    #[arg(long, default_value_t = 0)]
    pub index: usize,
    /// Router only: the HTTP address.
    #[arg(long)]
    pub listen: Option<String>,
}

pub fn run_worker(a: WorkerArgs) -> CliResult {
    denoised_actors::process::run_worker(a.role, a.index, a.listen)?;
    Ok(())
}
