//! The configuration schema: what `config.toml` may hold.
//!
//! Unknown keys are errors (a typo must not silently fall back to a default), and every
//! key has a default, so an empty file is a valid configuration. The repository's
//! `config.toml` documents each key; a test keeps it in step with this schema.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod server;
mod templates;
pub use server::{ServerConfig, WebhooksConfig};
pub use templates::TemplatesConfig;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub device: DeviceConfig,
    pub server: ServerConfig,
    pub workers: WorkersConfig,
    pub denoise: DenoiseConfig,
    pub cluster: ClusterConfig,
    pub cache: CacheConfig,
    pub pipeline: PipelineConfig,
    pub approx_cache: ApproxCacheConfig,
    pub adapters: AdaptersConfig,
    pub webhooks: WebhooksConfig,
    pub templates: TemplatesConfig,
}

/// `[adapters]`: LoRAs of the transformer (docs/design.md §Adapters).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptersConfig {
    /// Where adapters live, one per name: `NAME.safetensors` or a directory `NAME/`
    /// holding `pytorch_lora_weights.safetensors`. Uploads are written here. Empty:
    /// `adapters` beside the template cache's directory (`[cache] dir`'s default
    /// parent).
    pub dir: String,
    /// K of bounded asynchronous loading: a request starts on the base weights while
    /// its LoRAs load and runs no step from this one on without them (it waits). 0 is
    /// synchronous loading. An adapter's own `denoised bench profile-lora` result (its
    /// `bal.json`) overrides it for the model it was profiled on.
    pub patch_by_step: u32,
    /// LoRAs a request may name.
    pub max_per_request: usize,
    /// Idle LoRAs each denoise worker keeps on its device (least recently used out).
    pub device_slots: usize,
    /// The loader's read bandwidth in MiB/s (0: unthrottled): how a shared disk or a
    /// network volume is modelled, and the benchmark's throttled load.
    pub throttle_mib_per_s: f64,
    /// Largest upload (`POST /v1/adapters`), bytes.
    pub max_upload_bytes: u64,
    /// A LoRA set merged into every denoise worker's weights at start (`NAME` or
    /// `NAME:SCALE` each): the daemon then serves that adapted model with no per-step
    /// cost, and refuses requests that name another set. Empty: none.
    pub merged: Vec<String>,
    /// Where the ControlNet service finds ControlNets: one diffusers
    /// `FluxControlNetModel` directory per name. Empty: `controlnets` in the
    /// adapters' directory. Needs `[workers] controlnet` processes.
    pub controlnets_dir: String,
    /// Bytes of ControlNet weights each ControlNet process keeps loaded (least
    /// recently used out; a request's own ControlNets stay while it runs).
    pub controlnet_cache_bytes: u64,
}

impl Default for AdaptersConfig {
    fn default() -> Self {
        AdaptersConfig {
            dir: String::new(),
            patch_by_step: 4,
            max_per_request: 4,
            device_slots: 16,
            throttle_mib_per_s: 0.0,
            max_upload_bytes: 2 << 30,
            merged: Vec::new(),
            controlnets_dir: String::new(),
            controlnet_cache_bytes: 8 << 30,
        }
    }
}

impl AdaptersConfig {
    /// `merged` as (name, scale) pairs.
    pub fn merged_set(&self) -> std::result::Result<Vec<(String, f64)>, String> {
        self.merged
            .iter()
            .map(|m| match m.rsplit_once(':') {
                Some((n, s)) => s
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && s.abs() <= f32::MAX as f64)
                    .map(|s| (n.to_string(), s))
                    .ok_or_else(|| format!("[adapters] merged: {m:?}: the scale is not a number")),
                None => Ok((m.clone(), 1.0)),
            })
            .collect()
    }

    /// The adapters' directory, resolved (see [`AdaptersConfig::dir`]).
    pub fn resolved_dir(&self, cache: &CacheConfig) -> std::path::PathBuf {
        if !self.dir.is_empty() {
            return self.dir.clone().into();
        }
        let templates = cache.resolved_dir();
        templates
            .parent()
            .map_or_else(|| templates.join("adapters"), |p| p.join("adapters"))
    }

    /// The ControlNets' directory, resolved (see [`AdaptersConfig::controlnets_dir`]).
    pub fn resolved_controlnets_dir(&self, cache: &CacheConfig) -> std::path::PathBuf {
        match self.controlnets_dir.as_str() {
            "" => self.resolved_dir(cache).join("controlnets"),
            d => d.into(),
        }
    }
}

/// `[approx_cache]`: reuse of text-to-image noise states across similar prompts
/// (NIRVANA; docs/design.md §"Approximate caching").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApproxCacheConfig {
    /// Bytes of noise states the cache process keeps in its arena (0: off).
    pub host_bytes: u64,
    /// Bytes of noise states beyond those, in `noise/` under `[cache] dir` (0: none).
    pub disk_bytes: u64,
    /// Eviction: `gdsf` (decayed frequency x K/N x observed hit rate at K, with
    /// inflation), `lcbfu` (the paper's frequency x K), `lru`, `lfu`.
    pub policy: String,
    /// `[similarity, fraction of the steps skipped]` rows; a match above a row's
    /// similarity skips that fraction (the first row it exceeds, highest first).
    pub thresholds: Vec<(f32, f64)>,
}

impl Default for ApproxCacheConfig {
    fn default() -> Self {
        ApproxCacheConfig {
            host_bytes: 1 << 30,
            disk_bytes: 16 << 30,
            policy: "gdsf".into(),
            thresholds: vec![
                (0.95, 0.5),
                (0.90, 0.4),
                (0.85, 0.3),
                (0.75, 0.2),
                (0.65, 0.1),
            ],
        }
    }
}

/// Whether template edits may run the VAE spatially sparse (`[pipeline] sparse_vae`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SparseVaeSetting {
    /// Sparse when its MAC estimate says it pays; dense otherwise.
    #[default]
    Auto,
    Off,
}

impl std::str::FromStr for SparseVaeSetting {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(SparseVaeSetting::Auto),
            "off" => Ok(SparseVaeSetting::Off),
            _ => Err(format!("sparse VAE setting {s:?}: expected auto or off")),
        }
    }
}

impl std::fmt::Display for SparseVaeSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SparseVaeSetting::Auto => "auto",
            SparseVaeSetting::Off => "off",
        })
    }
}

/// `[pipeline]`: the Fill pipeline's stages around the denoise loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    pub sparse_vae: SparseVaeSetting,
    /// Bytes of template VAE traces each preprocess (encoder) and postprocess
    /// (decoder) process keeps: those it recorded, in host memory, and where its VAE
    /// runs on a device, the templates' traces resident in device memory.
    pub sparse_vae_trace_bytes: u64,
    /// Bytes of prompt embeddings (T5 and CLIP outputs) each preprocess process keeps:
    /// a repeated prompt skips both text encoders. 0 turns the cache off.
    pub prompt_cache_bytes: u64,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            sparse_vae: SparseVaeSetting::Auto,
            sparse_vae_trace_bytes: 8 << 30,
            prompt_cache_bytes: 1 << 30,
        }
    }
}

/// `[cache]`: the template cache's tiers beyond memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Directory of the disk tier. Empty: `$STATE_DIRECTORY` (systemd's
    /// `StateDirectory`) when set, else `~/.cache/denoised/templates`.
    pub dir: String,
    /// Bytes the disk tier may hold; the least recently used templates beyond it are
    /// dropped. 0 turns the disk tier off (templates then live in memory only).
    pub disk_bytes: u64,
    /// What new templates cache per block unless their request says: `kv` (K and V)
    /// or `y` (block outputs: half the bytes, the K/V of unmasked tokens recomputed).
    pub mode: String,
    /// Storage dtype of new templates' slabs: empty for the capturing device's own
    /// (f32 on the CPU, bf16 on a GPU), or `f32`, `bf16`, `fp8` (E4M3 with a scale per
    /// head's K and V: a quarter of f32, KV mode only).
    pub kv_dtype: String,
    /// Step sharing: new templates store K/V every this many steps, and a step reads
    /// the nearest stored one (1: every step; KV mode only).
    pub kv_step_stride: u32,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            dir: String::new(),
            disk_bytes: 100 << 30,
            mode: "kv".into(),
            kv_dtype: String::new(),
            kv_step_stride: 1,
        }
    }
}

impl CacheConfig {
    /// The disk tier's directory, resolved (see [`CacheConfig::dir`]).
    pub fn resolved_dir(&self) -> std::path::PathBuf {
        if !self.dir.is_empty() {
            return self.dir.clone().into();
        }
        if let Some(d) = std::env::var_os("STATE_DIRECTORY") {
            // systemd may list several, separated by colons: the first is ours.
            let first = d
                .to_string_lossy()
                .split(':')
                .next()
                .unwrap_or("")
                .to_string();
            if !first.is_empty() {
                return std::path::PathBuf::from(first).join("templates");
            }
        }
        let home: std::path::PathBuf =
            std::env::var_os("HOME").map_or_else(std::env::temp_dir, Into::into);
        home.join(".cache/denoised/templates")
    }
}

/// `[workers]`: how many processes of each actor group the supervisor runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkersConfig {
    pub preprocess: usize,
    pub postprocess: usize,
    /// Where the preprocess workers run the VAE encoder: `auto` (the device of the
    /// denoise worker with the same index: its GPU, or the emulator, or the CPU),
    /// `cpu`, `emu` or `cuda:N`. Each device worker has its own process and context.
    pub preprocess_device: String,
    /// The same for the postprocess workers' VAE decoder.
    pub postprocess_device: String,
    /// Denoise workers: one per GPU; on a CPU-only machine, 1.
    pub denoise: usize,
    /// ControlNet service processes (`[adapters] controlnets_dir`); 0: requests that
    /// name ControlNets are refused.
    pub controlnet: usize,
    /// Bytes of the shared-memory arena of the router, preprocess and postprocess
    /// processes (requests in flight). Arenas are reserved when created, so that a full
    /// /dev/shm is an error at start-up rather than a SIGBUS later.
    pub arena_bytes: u64,
    /// Arena of each denoise worker: also holds a capture's template cache until the
    /// cache process has copied it.
    pub denoise_arena_bytes: u64,
    /// Arena of the cache process: every registered template.
    pub cache_arena_bytes: u64,
}

impl Default for WorkersConfig {
    fn default() -> Self {
        WorkersConfig {
            preprocess: 1,
            postprocess: 1,
            preprocess_device: "auto".into(),
            postprocess_device: "auto".into(),
            denoise: 1,
            controlnet: 0,
            arena_bytes: 256 << 20,
            denoise_arena_bytes: 1 << 30,
            cache_arena_bytes: 1 << 30,
        }
    }
}

/// How requests join the denoise batch (`[denoise] batching`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Batching {
    /// New requests join the running batch at the next step; finished ones leave at once.
    #[default]
    Continuous,
    /// Baseline: a batch runs to completion before new requests join.
    Static,
}

/// `[denoise]`: the batching loop of each denoise worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DenoiseConfig {
    /// Most requests in one batched step.
    pub max_batch: usize,
    /// Most rows (text + active image tokens over the batch) in one step.
    pub token_budget: usize,
    pub batching: Batching,
    /// false: pre- and post-processing run inside the denoise process, between steps
    /// (the baseline that disaggregation is measured against).
    pub disaggregate: bool,
    /// The device's latency models for the planner, written by `denoised profile`.
    /// Empty: conservative defaults for the device kind (logged at start).
    pub profile: String,
    /// Bytes of templates a denoise worker keeps resident on its device; a template
    /// beyond it is streamed from the host tier during each step. 0: what the device
    /// allows (on a GPU what its memory budget leaves; on the CPU `[workers]
    /// cache_arena_bytes`, no more than the host tier holds).
    pub resident_template_bytes: u64,
}

impl Default for DenoiseConfig {
    fn default() -> Self {
        DenoiseConfig {
            max_batch: 16,
            token_budget: 32768,
            batching: Batching::Continuous,
            disaggregate: true,
            profile: String::new(),
            resident_template_bytes: 0,
        }
    }
}

/// `[cluster]`: the ractor_cluster transport between the processes, and between pods
/// (docs/cluster.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// TCP port of the router's cluster node on 127.0.0.1; 0 picks a free one (logged).
    pub port: u16,
    /// Shared secret of the cluster; empty generates a random one per start (a pod of
    /// a cluster needs the one its peers have).
    pub cookie: String,
    /// Directory of the shared-memory arenas; empty means /dev/shm.
    pub shm_dir: String,
    /// This pod's name among its peers; empty: the host name.
    pub pod: String,
    /// `IP:PORT` of this pod's listener for its peers; empty: off (a single pod).
    pub listen: String,
    /// The peers: `HOST:PORT`, or `dns:NAME:PORT` for every address NAME resolves to
    /// (a Kubernetes headless service), re-resolved as pods come and go.
    pub peers: Vec<String>,
    /// PEM files: the cluster's CA, and this pod's certificate and key (all three or
    /// none). With them, pods speak TLS and refuse a peer whose certificate the CA did
    /// not sign.
    pub tls_ca: String,
    pub tls_cert: String,
    pub tls_key: String,
    /// How many pods keep a copy of each template on their disk (1: the one that
    /// captured it).
    pub template_replicas: u32,
    /// How many pods besides a template's holders keep its recipe (its description and
    /// image: what capturing it again needs), so it outlives every copy; the others
    /// ask for it when they need it.
    pub recipe_copies: u32,
    /// The most a pod sends of its templates to its peers, in MB (1e6 bytes) a second
    /// per transfer; 0: no cap.
    pub transfer_mb_per_s: f64,
    /// Which pod runs a template edit or a generation: `template_aware` (the pod where it would
    /// cost the least latency, the template's whereabouts priced), `least_loaded` (the
    /// same, its template ignored) or `round_robin`.
    pub policy: String,
    /// The bandwidth between pods, in MB a second, that routing prices a template copy
    /// at (the cap `transfer_mb_per_s` when lower).
    pub link_mb_per_s: f64,
    /// A holder that stopped being usable (restarting, draining) less than this long
    /// ago still counts as holding its templates: no copies are made for it (seconds).
    pub replicate_after_seconds: f64,
    /// The template registry: etcd's client endpoints (`HOST:PORT`, its v3 API), where
    /// each template's identity (version, digest, tombstone) is kept and changed by
    /// compare-and-swap. Empty: template identity is each pod's own (best effort).
    pub registry: Vec<String>,
    /// The key prefix of this cluster's records in etcd (several clusters may share one).
    pub registry_prefix: String,
    /// How long a pod serves the template versions it read from the registry without
    /// reading them again; an identity change is answered only after it (seconds).
    pub registry_lease_seconds: f64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            port: 0,
            cookie: String::new(),
            shm_dir: String::new(),
            pod: String::new(),
            listen: String::new(),
            peers: Vec::new(),
            tls_ca: String::new(),
            tls_cert: String::new(),
            tls_key: String::new(),
            template_replicas: 1,
            recipe_copies: 2,
            transfer_mb_per_s: 0.0,
            policy: "template_aware".into(),
            // A 10 Gb/s link.
            link_mb_per_s: 1250.0,
            replicate_after_seconds: 300.0,
            registry: Vec::new(),
            registry_prefix: "/denoised".into(),
            registry_lease_seconds: 3.0,
        }
    }
}

impl ClusterConfig {
    /// Whether this daemon is a pod of a cluster (its peer listener is on).
    pub fn is_pod(&self) -> bool {
        !self.listen.is_empty()
    }

    /// A `peers` entry's `HOST:PORT` (without `dns:`, which only says that the name may
    /// stand for several addresses) and its host, if it is well formed.
    pub fn peer(entry: &str) -> Option<(&str, &str)> {
        let hostport = entry.strip_prefix("dns:").unwrap_or(entry);
        let (host, port) = hostport.rsplit_once(':')?;
        (!host.is_empty() && port.parse::<u16>().is_ok()).then_some((hostport, host))
    }

    /// The MB a second a template copy is priced at: the link, or the cap when lower.
    pub fn copy_mb_per_s(&self) -> f64 {
        match self.transfer_mb_per_s > 0.0 {
            true => self.transfer_mb_per_s.min(self.link_mb_per_s),
            false => self.link_mb_per_s,
        }
    }

    /// Whether pods speak TLS to each other.
    pub fn tls(&self) -> bool {
        !self.tls_ca.is_empty()
    }

    /// The keys' consistency, before any process starts.
    pub fn check(&self) -> Result<(), String> {
        let tls = [&self.tls_ca, &self.tls_cert, &self.tls_key];
        if tls.iter().any(|f| f.is_empty()) && tls.iter().any(|f| !f.is_empty()) {
            return Err("[cluster] tls_ca, tls_cert and tls_key go together".into());
        }
        if !(self.transfer_mb_per_s >= 0.0) {
            return Err("[cluster] transfer_mb_per_s must be 0 (no cap) or more".into());
        }
        if !(self.link_mb_per_s > 0.0) {
            return Err("[cluster] link_mb_per_s must be above 0".into());
        }
        if !["template_aware", "least_loaded", "round_robin"].contains(&self.policy.as_str()) {
            return Err(format!(
                "[cluster] policy `{}`: expected template_aware, least_loaded or round_robin",
                self.policy
            ));
        }
        if self.template_replicas == 0 {
            return Err("[cluster] template_replicas must be at least 1".into());
        }
        if !(self.replicate_after_seconds >= 0.0) {
            return Err("[cluster] replicate_after_seconds must be 0 or more".into());
        }
        if !(self.registry_lease_seconds >= 0.3 && self.registry_lease_seconds <= 60.0) {
            return Err("[cluster] registry_lease_seconds must be within 0.3-60".into());
        }
        if !self.registry_prefix.starts_with('/') {
            return Err("[cluster] registry_prefix must start with `/`".into());
        }
        if let Some(bad) = self.registry.iter().find(|e| Self::peer(e).is_none()) {
            return Err(format!(
                "[cluster] registry entry {bad:?}: expected HOST:PORT"
            ));
        }
        if !self.is_pod() {
            if !self.peers.is_empty() || self.tls() || !self.registry.is_empty() {
                return Err("[cluster] peers, registry and tls_* need [cluster] listen".into());
            }
            return Ok(());
        }
        self.listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| format!("[cluster] listen {:?}: {e} (IP:PORT)", self.listen))?;
        if self.cookie.is_empty() {
            return Err(
                "[cluster] listen needs [cluster] cookie: the pods of a cluster share it".into(),
            );
        }
        for p in &self.peers {
            if Self::peer(p).is_none() {
                return Err(format!(
                    "[cluster] peers: {p:?} is not HOST:PORT or dns:NAME:PORT"
                ));
            }
        }
        for f in tls.into_iter().filter(|f| !f.is_empty()) {
            std::fs::metadata(f).map_err(|e| format!("[cluster] {f}: {e}"))?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A diffusers model directory, or `builtin`.
    pub source: String,
    /// A single file in place of the directory's transformer: BFL's
    /// `flux1-fill-dev.safetensors`, an fp8 file, a GGUF quantisation. Empty: none.
    pub transformer: String,
    /// A single file in place of the directory's VAE (BFL's `ae.safetensors`).
    pub vae: String,
    /// A single file in place of the directory's T5 (safetensors or GGUF).
    pub text_encoder_2: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            source: "builtin".into(),
            transformer: String::new(),
            vae: String::new(),
            text_encoder_2: String::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeviceConfig {
    /// `auto`, `cpu`, `emu`, `cuda:N` or a list `cuda:N,M`.
    pub device: String,
    /// Storage dtype on a GPU: `bf16` or `f32`.
    pub dtype: String,
    /// The transformer's large Linear weights: `fp8` (E4M3 with a scale per output
    /// channel, on GPUs with fp8 tensor cores; the CPU computes the reference), or
    /// empty / `bf16` / `f32` for the device dtype.
    pub weight_dtype: String,
    /// With fp8 weights, how they and each GEMM's input are scaled: `tensor` (one
    /// scale each, which cuBLASLt applies inside the GEMM with its bias and GELU
    /// epilogues; the default, empty) or `channel` (a scale per output channel and per
    /// token: finer, but Hopper's cuBLASLt runs it bare and a pass rescales).
    pub fp8_scaling: String,
    /// Threads of each CPU compute process; 0 = the cores split among them.
    pub threads: usize,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            device: "auto".into(),
            dtype: "bf16".into(),
            weight_dtype: String::new(),
            fp8_scaling: String::new(),
            threads: 0,
        }
    }
}

impl Config {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text).map_err(|reason| Error::BadConfig {
            path: path.to_path_buf(),
            reason,
        })
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

/// Reads a JSON config file (a diffusers `config.json`, a tokenizer config, ...);
/// errors name the file.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadConfig {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// [`read_json`], then a validation whose message becomes a `BadConfig` naming the file.
pub fn read_json_validated<T: serde::de::DeserializeOwned>(
    path: &Path,
    validate: impl FnOnce(&T) -> Result<(), String>,
) -> Result<T> {
    let cfg = read_json(path)?;
    validate(&cfg).map_err(|reason| Error::BadConfig {
        path: path.to_path_buf(),
        reason,
    })?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_config_is_the_default() {
        let shipped =
            Config::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../config.toml")).unwrap();
        assert_eq!(shipped, Config::default());
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn cluster_keys_are_checked_together() {
        let pod = |more: &str| {
            let text = format!("[cluster]\nlisten = \"127.0.0.2:7450\"\n{more}");
            let mut c = Config::parse(&text).unwrap().cluster;
            if !more.contains("cookie") {
                c.cookie = "k".into();
            }
            c.check()
        };
        assert!(pod("").is_ok());
        assert!(pod("policy = \"least_loaded\"\nlink_mb_per_s = 100.0\n").is_ok());
        for (bad, says) in [
            ("policy = \"nearest\"\n", "nearest"),
            ("link_mb_per_s = 0.0\n", "link_mb_per_s"),
            ("template_replicas = 0\n", "template_replicas"),
            ("tls_ca = \"ca.pem\"\n", "go together"),
            ("cookie = \"\"\n", "cookie"),
            ("peers = [\"nowhere\"]\n", "peers"),
        ] {
            let e = pod(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // A copy is priced at the link, or at the cap when lower.
        let mut c = ClusterConfig::default();
        assert_eq!(c.copy_mb_per_s(), 1250.0);
        c.transfer_mb_per_s = 100.0;
        assert_eq!(c.copy_mb_per_s(), 100.0);
    }

    /// The Kubernetes ConfigMap's config.toml (deploy/kubernetes/configmap.yaml) is one
    /// this build reads: every key known, the cluster's keys consistent (its cookie
    /// comes from a Secret).
    #[test]
    fn the_kubernetes_configmap_is_a_config_this_build_reads() {
        let yaml = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/kubernetes/configmap.yaml"
        ))
        .unwrap();
        let toml: String = yaml
            .lines()
            .skip_while(|l| !l.trim_start().starts_with("config.toml: |"))
            .skip(1)
            .take_while(|l| l.is_empty() || l.starts_with("    "))
            .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
            .collect();
        assert!(toml.contains("[cluster]"), "{toml}");
        let mut c = Config::parse(&toml).unwrap();
        c.cluster.cookie = "from-the-secret".into();
        // The TLS files are the Secret's, mounted in the pod: all three named.
        let tls = [&c.cluster.tls_ca, &c.cluster.tls_cert, &c.cluster.tls_key];
        assert!(tls.iter().all(|f| !f.is_empty()), "{tls:?}");
        c.cluster.tls_ca.clear();
        c.cluster.tls_cert.clear();
        c.cluster.tls_key.clear();
        c.cluster.check().unwrap();
        assert!(c.cluster.is_pod());
    }

    #[test]
    fn unknown_keys_are_errors() {
        let e = Config::parse("[device]\ndevise = \"cpu\"\n").unwrap_err();
        assert!(e.contains("devise"), "{e}");
    }
}
