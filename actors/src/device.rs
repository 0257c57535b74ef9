//! Where a process computes the transformer, and the model placed there.
//!
//! The supervisor resolves `[device] device` once (`auto` to every GPU found, or the
//! CPU) and hands each denoise worker its own device: the worker owns it for its whole
//! life (docs/design.md, "Devices and roles"). On a GPU the transformer's weights go to the
//! device in `[device] dtype`, bf16 by default; on the CPU it computes in f32 and
//! shares the weights with the CPU stages of the same process.

use denoised_cuda::{CudaExec, DeviceSpec, Dt, EmuExec, Exec, GpuBackend, Priority};
use denoised_runtime::fp8::Scaling;

use crate::budget::{BudgetInputs, DeviceBudget};
use denoised_models::flux::stepper::{ModelStepper, Stepper};
use denoised_models::pipeline::flux_fill::{Component, FluxFill, Parts};
use denoised_models::pipeline::stage_memory::stage_memory;
use denoised_models::profile::Profile;
use denoised_models::text::device::{ClipOn, T5On, TextOn};
use denoised_models::vae::DenseVae;
use denoised_models::ModelSource;
use denoised_runtime::{Backend, CpuBackend};
use std::sync::Arc;

/// The most text tokens of a request (T5's `max_sequence_length` limit).
const MAX_TEXT_TOKENS: usize = 512;

/// The largest step a device must hold: what its memory budget is computed for.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    pub max_batch: usize,
    pub token_budget: usize,
    /// `[server] max_pixels`: the largest image of one request.
    pub max_pixels: usize,
    /// Host bytes the CPU may keep decoded templates in (`[workers]
    /// cache_arena_bytes`: no more templates than the host tier holds).
    pub host_template_bytes: u64,
    /// `[denoise] resident_template_bytes`: a cap on resident templates (0: none).
    pub resident_template_bytes: u64,
    /// Pre- and postprocess workers computing on the same device (the daemon's
    /// placement; a command that places its stages beside the transformer: one each).
    pub stages_on_device: StagesOnDevice,
}

pub use crate::node::StagesOnDevice;

impl StepLimits {
    /// Resident template bytes within `allowed` (what the device leaves).
    fn resident(&self, allowed: u64) -> u64 {
        match self.resident_template_bytes {
            0 => allowed,
            cap => cap.min(allowed),
        }
    }
}

/// The storage dtype of a device's weights and activations: `bf16` or `f32`.
pub fn parse_dtype(s: &str) -> Result<Dt, String> {
    match s {
        "bf16" => Ok(Dt::Bf16),
        "f32" => Ok(Dt::F32),
        other => Err(format!("dtype `{other}`: use bf16 or f32")),
    }
}

/// `[device] weight_dtype` and `fp8_scaling` (`--weight-dtype`, `--fp8-scaling`):
/// whether the transformer's large Linear weights are fp8 (`fp8`), and then how they
/// and their inputs are scaled (`tensor`, the default, or `channel`), or in the device
/// dtype (empty, `bf16`, `f32`: `None`).
pub fn parse_weight_dtype(s: &str, scaling: &str) -> Result<Option<Scaling>, String> {
    let scaling = match scaling {
        "" => Scaling::Tensor,
        other => Scaling::named(other)
            .ok_or_else(|| format!("fp8 scaling `{other}`: use tensor or channel"))?,
    };
    match s {
        "fp8" => Ok(Some(scaling)),
        "" | "bf16" | "f32" => Ok(None),
        other => Err(format!("weight dtype `{other}`: use fp8 or bf16")),
    }
}

pub fn dtype_name(dt: Dt) -> &'static str {
    match dt {
        Dt::Bf16 => "bf16",
        Dt::F32 => "f32",
    }
}

/// A transformer placed on its device.
pub struct Placed {
    pub stepper: Box<dyn Stepper>,
    /// `cpu`, `emu` or `cuda:N NAME (ARCH)`.
    pub device: String,
    /// `f32` on the CPU, else the device dtype.
    pub dtype: &'static str,
    pub component: Component,
    /// The device memory budget (GPU and emulator only).
    pub budget: Option<DeviceBudget>,
    /// What runs its attention (GPU and emulator only): cuDNN's fused SDPA, or our
    /// kernel and why (`GpuBackend::attention_path`).
    pub attention: Option<String>,
}

impl Placed {
    /// The dtype templates are stored in for this device: its own (bf16 on a GPU in
    /// bf16), so that storing K/V the device computed loses nothing.
    pub fn template_dtype(&self) -> denoised_runtime::DType {
        if self.dtype == "bf16" {
            denoised_runtime::DType::BF16
        } else {
            denoised_runtime::DType::F32
        }
    }
}

/// The backend of a process's host parts. On the CPU the transformer is one of them,
/// so fp8 weights are set here: the CPU computes their reference
/// (`CpuBackend::with_fp8_weights`).
pub fn host_backend(device: DeviceSpec, fp8_weights: Option<Scaling>) -> CpuBackend {
    match fp8_weights.filter(|_| device == DeviceSpec::Cpu) {
        Some(s) => CpuBackend::new().with_fp8_weights(s),
        None => CpuBackend::new(),
    }
}

/// The parts of the pipeline a process keeps on the host when its transformer
/// computes on `device`: with a GPU, none of the transformer.
pub fn host_parts(device: DeviceSpec, parts: Parts) -> Parts {
    match device {
        DeviceSpec::Cpu => parts,
        _ => parts.without_transformer(),
    }
}

/// Puts the transformer on `device`. On the CPU it is the one `cpu` already holds
/// (loaded with the host parts); on a GPU or the emulator it is loaded from `source`
/// straight into device memory, and the device's memory budget is computed for steps
/// within `limits` (an error if they cannot fit).
///
/// With `fp8_weights`, the transformer's large Linears are fp8 (the CPU's come from
/// `cpu`, loaded with a `CpuBackend::with_fp8_weights`); a GPU without fp8 tensor
/// cores refuses them.
pub fn place(
    source: &ModelSource,
    device: DeviceSpec,
    dtype: Dt,
    fp8_weights: Option<Scaling>,
    cpu: &FluxFill<CpuBackend>,
    limits: StepLimits,
) -> Result<Placed, String> {
    let err = |e: denoised_runtime::Error| format!("loading the transformer of `{source}`: {e}");
    match device {
        DeviceSpec::Cpu => {
            let t = cpu.shared_transformer().map_err(err)?;
            let component = Component::with_forms("transformer", t.memory());
            Ok(Placed {
                // Templates beyond the budget are streamed from the cache's arena by a
                // loader thread.
                stepper: Box::new(ModelStepper::new(
                    t,
                    limits.resident(limits.host_template_bytes),
                    4,
                    true,
                )),
                device: "cpu".into(),
                dtype: "f32",
                component,
                budget: None,
                attention: None,
            })
        }
        DeviceSpec::Emu => {
            let exec = EmuExec::open().map_err(|e| e.to_string())?;
            let backend = GpuBackend::new(exec, dtype).with_fp8_weights(fp8_weights);
            on_gpu(source, backend, "emu".into(), cpu, limits)
        }
        DeviceSpec::Cuda(n) => {
            let exec = CudaExec::new(n).map_err(|e| format!("cuda:{n}: {e}"))?;
            // Compile (or load from the kernel cache) every kernel before serving, so
            // the first request does not pay for NVRTC.
            exec.warm_up().map_err(|e| format!("cuda:{n}: {e}"))?;
            let name = exec.describe();
            let backend = GpuBackend::new(exec, dtype).with_fp8_weights(fp8_weights);
            on_gpu(source, backend, name, cpu, limits)
        }
        DeviceSpec::Auto => Err("device `auto` must be resolved before placing a model".into()),
    }
}

/// Puts what a pre- or postprocess worker's `pipeline` computes on `device` (the
/// worker's own process and CUDA context), in `dtype`: the VAE halves it holds, and the
/// text encoders if it holds them, on one backend.
pub fn place_stages(
    device: DeviceSpec,
    dtype: Dt,
    pipeline: &mut FluxFill<CpuBackend>,
) -> Result<(), String> {
    match device {
        DeviceSpec::Emu => {
            let exec = EmuExec::open().map_err(|e| e.to_string())?;
            stages_on(Arc::new(GpuBackend::new(exec, dtype)), pipeline)
        }
        DeviceSpec::Cuda(n) => {
            let exec = CudaExec::open(n, Priority::Low).map_err(|e| format!("cuda:{n}: {e}"))?;
            exec.warm_up().map_err(|e| format!("cuda:{n}: {e}"))?;
            stages_on(Arc::new(GpuBackend::new(exec, dtype)), pipeline)
        }
        DeviceSpec::Cpu => Ok(()),
        DeviceSpec::Auto => Err("device `auto` must be resolved before placing a model".into()),
    }
}

fn stages_on<E: Exec + 'static>(
    backend: Arc<GpuBackend<E>>,
    pipeline: &mut FluxFill<CpuBackend>,
) -> Result<(), String> {
    let name = backend.name();
    // Opens cuDNN now where it is present (not at the first request) and says which
    // convolution path the VAE takes.
    tracing::info!("VAE convolutions on {name}: {}", backend.conv_path());
    let err = |what: &str, e: denoised_runtime::Error| format!("loading {what} on {name}: {e}");
    let vae = DenseVae::new(backend.clone(), &pipeline.vae)
        .map_err(|e| err("the VAE", e))?
        .with_trace_bytes(pipeline.sparse_vae.trace_bytes());
    pipeline.place_vae(Arc::new(vae));
    let mut placed = vec!["VAE"];
    if let Ok(t) = pipeline.text() {
        let text = TextOn {
            clip: ClipOn::new(backend.clone(), t.clip.clone()).map_err(|e| err("CLIP", e))?,
            t5: T5On::new(backend, t.t5.clone()).map_err(|e| err("T5", e))?,
        };
        pipeline.place_text(Arc::new(text));
        placed.extend(["CLIP", "T5"]);
    }
    tracing::info!("{} on {name}", placed.join(", "));
    Ok(())
}

/// Device bytes of `on`'s pre- and postprocess workers for `source`'s models.
fn stage_bytes(
    source: &ModelSource,
    on: StagesOnDevice,
    max_pixels: usize,
    dt: Dt,
) -> Result<u64, String> {
    if on == StagesOnDevice::default() {
        return Ok(0);
    }
    let m = stage_memory(source, max_pixels, dt.size())
        .map_err(|e| format!("sizing the pre- and postprocess stages of `{source}`: {e}"))?;
    Ok(on.preprocess as u64 * m.preprocess + on.postprocess as u64 * m.postprocess)
}

fn on_gpu<E: Exec + 'static>(
    source: &ModelSource,
    backend: GpuBackend<E>,
    device: String,
    cpu: &FluxFill<CpuBackend>,
    limits: StepLimits,
) -> Result<Placed, String> {
    let dt = backend.dtype();
    let attention = backend.attention_path();
    tracing::info!("attention on {device}: {attention}");
    let model = source
        .load_transformer(backend)
        .map_err(|e| format!("loading the transformer of `{source}` on {device}: {e}"))?;
    let held = model.memory();
    let weights = held.values().sum();
    let mem = model
        .backend()
        .exec()
        .memory()
        .map_err(|e| format!("{device}: {e}"))?;
    // Rows of the largest request: all its text and image tokens.
    let token_px = 2 * cpu.vae_scale_factor();
    let image_tokens = limits.max_pixels / (token_px * token_px);
    let largest = MAX_TEXT_TOKENS + image_tokens;
    let c = &cpu.config;
    // Its tensors: [latent | cond] rows, the text, RoPE cos/sin of every row.
    let request_elems = image_tokens * c.in_channels
        + MAX_TEXT_TOKENS * c.joint_attention_dim
        + 2 * largest * c.attention_head_dim;
    // The attention library's plans for every query bucket of the largest request and
    // of a 1024² one (the most common size), at the default 512 text tokens: no step
    // after this builds one (a step of another size builds its own on first use).
    let t0 = std::time::Instant::now();
    let keys = [largest, MAX_TEXT_TOKENS + 4096];
    match model
        .backend()
        .warm_attention_plans(c.num_attention_heads, c.attention_head_dim, &keys)
    {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            "attention plans on {device}: {n} built in {:.2} s",
            t0.elapsed().as_secs_f64()
        ),
        Err(e) => {
            tracing::warn!("attention plans on {device}: {e} (steps build them on first use)")
        }
    }
    let budget = DeviceBudget::compute(&BudgetInputs {
        free: mem.free,
        total: mem.total,
        weights,
        hidden: cpu.config.hidden(),
        dtype_bytes: dt.size(),
        max_batch: limits.max_batch,
        token_budget: limits.token_budget,
        largest_rows: largest,
        largest_context: largest,
        request_bytes: (request_elems * dt.size()) as u64,
        slab_bytes: (image_tokens * 2 * c.hidden() * dt.size()) as u64,
        stage_bytes: stage_bytes(source, limits.stages_on_device, limits.max_pixels, dt)?,
    })
    .map_err(|e| format!("{device}: {e}"))?;
    tracing::info!("device memory budget on {device}: {}", budget.describe());
    let component = Component::with_forms("transformer", held);
    Ok(Placed {
        stepper: Box::new(ModelStepper::new(
            std::sync::Arc::new(model),
            limits.resident(budget.template_bytes),
            dt.size(),
            true,
        )),
        device,
        dtype: dtype_name(dt),
        component,
        budget: Some(budget),
        attention: Some(attention),
    })
}

/// The planner's latency models for `device`: the profile file at `path`, or (empty)
/// the defaults, said in the log. A profile of another device kind is used, with a
/// warning: its figures are still better than none.
pub fn planner_profile(path: &str, device: &str) -> Result<Profile, String> {
    if path.is_empty() {
        tracing::info!(
            "planner: no [denoise] profile, using conservative defaults for {device}; `denoised profile` measures this device"
        );
        return Ok(Profile::defaults(device));
    }
    let p =
        Profile::read(std::path::Path::new(path)).map_err(|e| format!("[denoise] profile: {e}"))?;
    if p.device != device {
        tracing::warn!(
            "planner: profile {path} was measured on `{}`, this worker runs on `{device}`",
            p.device
        );
    }
    tracing::info!(
        "planner: profile {path} (compute R² {:.3}, host load R² {:.3})",
        p.compute.r2,
        p.load_host.r2
    );
    Ok(p)
}

/// What `/readyz` shows of a process's model: the components it loaded on the host,
/// and the transformer where it was placed.
pub fn components(host: &FluxFill<CpuBackend>, placed: Option<&Placed>) -> Vec<Component> {
    let mut v: Vec<Component> = host
        .components()
        .into_iter()
        .filter(|c| placed.is_none() || c.name != "transformer")
        .collect();
    v.extend(placed.map(|p| p.component.clone()));
    v
}

/// What the supervisor decides for each process: its device and its CPU threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The device of each denoise worker, by index.
    pub denoise: Vec<DeviceSpec>,
    /// The device of each preprocess worker's VAE encoder, by index.
    pub preprocess: Vec<DeviceSpec>,
    /// The device of each postprocess worker's VAE decoder, by index.
    pub postprocess: Vec<DeviceSpec>,
    /// Threads of each CPU compute process.
    pub threads: usize,
}

/// Resolves `[device]` for the daemon and fixes `[workers] denoise` to match: one
/// worker per GPU, or the configured count on the CPU and the emulator. The cores are
/// split among the processes that compute on the CPU unless `[device] threads` says
/// how many each takes. `cores` is the machine's.
pub fn place_workers(
    config: &mut denoised_runtime::config::Config,
    cores: usize,
) -> Result<Placement, String> {
    parse_dtype(&config.device.dtype).map_err(|e| format!("[device] {e}"))?;
    let specs = denoised_cuda::parse_list(&config.device.device).map_err(|e| e.to_string())?;
    let resolved = denoised_cuda::resolve_list(&specs).map_err(|e| e.to_string())?;
    use denoised_cuda::Resolved;
    let denoise: Vec<DeviceSpec> = match &resolved[..] {
        [Resolved::Cpu] => vec![DeviceSpec::Cpu; config.workers.denoise],
        [Resolved::Emu] => vec![DeviceSpec::Emu; config.workers.denoise],
        gpus => gpus
            .iter()
            .map(|r| match r {
                Resolved::Cuda(g) => Ok(DeviceSpec::Cuda(g.ordinal)),
                _ => Err(format!(
                    "[device] device `{}`: a list names GPUs only",
                    config.device.device
                )),
            })
            .collect::<Result<_, _>>()?,
    };
    config.workers.denoise = denoise.len();
    let w = &config.workers;
    let preprocess = stage_devices(
        "preprocess_device",
        &w.preprocess_device,
        w.preprocess,
        &denoise,
    )?;
    let postprocess = stage_devices(
        "postprocess_device",
        &w.postprocess_device,
        w.postprocess,
        &denoise,
    )?;
    // The emulator computes on the CPU's cores too.
    let on_cpu = [&preprocess, &postprocess, &denoise]
        .iter()
        .flat_map(|v| v.iter())
        .filter(|d| !matches!(d, DeviceSpec::Cuda(_)))
        .count();
    let threads = match config.device.threads {
        0 => cores.div_ceil(on_cpu.max(1)).max(1),
        n => n,
    };
    Ok(Placement {
        denoise,
        preprocess,
        postprocess,
        threads,
    })
}

impl Placement {
    /// The pre- and postprocess workers on denoise worker `index`'s device (none on
    /// the CPU, whose memory is not budgeted this way).
    pub fn stages_on(&self, index: usize) -> StagesOnDevice {
        let d = self.denoise[index];
        if d == DeviceSpec::Cpu {
            return StagesOnDevice::default();
        }
        StagesOnDevice {
            preprocess: self.preprocess.iter().filter(|&&p| p == d).count(),
            postprocess: self.postprocess.iter().filter(|&&p| p == d).count(),
        }
    }
}

/// The devices of `count` pre- or postprocess workers: `auto` follows the denoise
/// worker of the same index (the last one's, beyond their count); anything else is
/// one device for all of them.
fn stage_devices(
    key: &str,
    spec: &str,
    count: usize,
    denoise: &[DeviceSpec],
) -> Result<Vec<DeviceSpec>, String> {
    if spec.trim() == "auto" {
        return Ok((0..count)
            .map(|i| denoise[i.min(denoise.len().saturating_sub(1))])
            .collect());
    }
    let parsed: DeviceSpec = spec
        .parse()
        .map_err(|e| format!("[workers] {key} = \"{spec}\": {e}"))?;
    let resolved = denoised_cuda::resolve(parsed).map_err(|e| format!("[workers] {key}: {e}"))?;
    let one = match resolved {
        denoised_cuda::Resolved::Cpu => DeviceSpec::Cpu,
        denoised_cuda::Resolved::Emu => DeviceSpec::Emu,
        denoised_cuda::Resolved::Cuda(g) => DeviceSpec::Cuda(g.ordinal),
    };
    Ok(vec![one; count])
}

#[cfg(test)]
mod tests {
    use super::*;
    use denoised_runtime::config::Config;

    /// A preprocess worker on a device keeps only the text encoders' embeddings on the
    /// host: the layers are dropped once uploaded, the host forward says so, and the
    /// prompt is still encoded (on the device) as the host encoders did.
    #[test]
    #[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
    fn text_encoders_on_a_device_keep_no_host_layers() {
        let source: ModelSource = "builtin".parse().unwrap();
        let mut p = FluxFill::load_parts(&source, CpuBackend::new(), Parts::PREPROCESS).unwrap();
        let text = p.text().unwrap();
        let (t5_bytes, clip_bytes) = (text.t5.weight_bytes(), text.clip.weight_bytes());
        let ids = text.t5_tokenizer.encode("a red hat", 32).unwrap().ids;
        let want = text.t5.forward(&ids).unwrap();
        place_stages(DeviceSpec::Emu, Dt::F32, &mut p).unwrap();
        let text = p.text().unwrap();
        assert!(
            text.t5.weight_bytes() < t5_bytes,
            "{} of {t5_bytes}",
            text.t5.weight_bytes()
        );
        assert!(text.clip.weight_bytes() < clip_bytes);
        let e = text.t5.forward(&ids).unwrap_err().to_string();
        assert!(e.contains("embeddings only"), "{e}");
        assert!(text.clip.forward(&[1, 2]).is_err());
        let mut t = Default::default();
        let (got, _, _) = p.encode_prompt("a red hat", 32, &mut t).unwrap();
        assert!(
            got.max_abs_diff(&want).unwrap() < 1e-4,
            "{}",
            got.max_abs_diff(&want).unwrap()
        );
    }

    #[test]
    fn placement_splits_cores_and_follows_the_device() {
        let mut c = Config::default();
        c.device.device = "cpu".into();
        let p = place_workers(&mut c, 16).unwrap();
        assert_eq!(p.denoise, [DeviceSpec::Cpu]);
        assert_eq!(p.threads, 6, "16 cores over 3 CPU processes, rounded up");
        c.device.device = "cpu".into();
        c.device.threads = 3;
        assert_eq!(place_workers(&mut c, 16).unwrap().threads, 3);
        c.device.threads = 0;
        c.workers.denoise = 2;
        c.device.device = "emu".into();
        let p = place_workers(&mut c, 2).unwrap();
        assert_eq!(p.denoise, [DeviceSpec::Emu, DeviceSpec::Emu]);
        assert_eq!((c.workers.denoise, p.threads), (2, 1));
        // The VAE workers follow the denoise worker of their index by default.
        assert_eq!(
            (p.preprocess.clone(), p.postprocess.clone()),
            (vec![DeviceSpec::Emu], vec![DeviceSpec::Emu])
        );
        c.workers.preprocess = 3;
        c.workers.postprocess_device = "cpu".into();
        let p = place_workers(&mut c, 8).unwrap();
        assert_eq!(p.preprocess, [DeviceSpec::Emu; 3]);
        assert_eq!(p.postprocess, [DeviceSpec::Cpu]);
        assert_eq!(
            p.threads, 2,
            "8 cores over 2 + 3 + 1 CPU or emulator processes"
        );
        c.workers.preprocess_device = "gpu0".into();
        let e = place_workers(&mut c, 8).unwrap_err();
        assert!(e.contains("preprocess_device"), "{e}");
        c.workers.preprocess_device = "auto".into();
        c.device.dtype = "fp8".into();
        assert!(place_workers(&mut c, 2).unwrap_err().contains("fp8"));
    }
}
