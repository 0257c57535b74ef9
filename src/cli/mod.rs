//! Command-line interface: one module per subcommand, shared options here.

mod adapters;
mod bench_approx;
mod bench_attn;
mod bench_controlnet;
mod bench_edit;
mod bench_generate;
mod bench_kernels;
mod bench_launches;
mod bench_lora;
mod bench_mask_aware;
mod bench_overheads;
mod bench_pipeline;
mod bench_quality;
mod bench_serve;
mod bench_sparse_vae;
mod bench_step;
mod bench_weights;
mod controlnet;
mod devices;
mod edit;
mod footprint;
mod forward;
mod generate;
mod inspect;
mod preview;
mod profile;
mod profile_lora;
mod selftest;
mod serve;
mod simulate;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use denoised_cuda::{DeviceSpec, Resolved};
use denoised_models::ModelSource;
use denoised_runtime::CpuBackend;

pub type CliResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// denoised: a serving runtime for mask-aware image editing with diffusion
/// transformers (FLUX.1 Fill).
#[derive(Parser, Debug)]
#[command(name = "denoised", version, about, long_about = None)]
pub struct Cli {
    /// Threads for CPU compute (0: one per core). For `serve`, the threads of each CPU
    /// compute process (`[device] threads`; 0 splits the cores among them).
    #[arg(long, env = "DENOISED_THREADS", default_value_t = 0, global = true)]
    pub threads: usize,
    #[command(subcommand)]
    pub command: Command,
}

/// The commands that operate the service; the benchmarks and tools are under `bench`.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon: a supervisor, its worker processes and the HTTP API.
    ///
    /// The supervisor starts the router (HTTP API), preprocess, denoise, postprocess,
    /// cache and ControlNet processes, and restarts any that die.
    Serve(serve::ServeArgs),
    /// Edit an image: inpaint the masked region from a prompt (FLUX.1 Fill).
    ///
    /// With --template, only the masked tokens are computed, against a captured template.
    Edit(edit::EditArgs),
    /// Generate an image from a prompt (FLUX.1-dev or -schnell).
    ///
    /// Equal to diffusers' FluxPipeline.
    Generate(generate::GenerateArgs),
    /// Template management: capture a template that edits reuse.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Measure this device's latency models and write the planner's profile file.
    ///
    /// Compute against FLOPs, loads against bytes per cache tier; reports R² and writes
    /// the profile file that `[denoise] profile` names.
    Profile(profile::Args),
    /// Verify a GPU in one run; prints a table, exits nonzero on a failure.
    ///
    /// Kernels and the transformer against their references, the identity invariant,
    /// a daemon round trip on the device, and step and attention benchmarks at FLUX.1
    /// size.
    Selftest(selftest::Args),
    /// List the compute devices this machine offers.
    Devices,
    /// Print the template cache size of models at a resolution (computed, not allocated).
    Footprint(footprint::Args),
    /// Tell what a checkpoint file is: transformer, VAE, T5 or LoRA, its key layout,
    /// stored types or quantisation, the config its shapes give, and its bytes.
    Inspect(inspect::Args),
    /// Benchmarks and tools: time the parts, load-test a daemon, simulate a cluster.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// One process of the daemon (started by `serve`; not for direct use).
    #[command(hide = true)]
    Worker(serve::WorkerArgs),
}

#[derive(Subcommand, Debug)]
pub enum TemplateCommand {
    /// Capture a template: a full run over the image whose activations edits reuse.
    Capture(edit::CaptureArgs),
}

/// `denoised bench NAME`: the benchmarks (most print JSON lines) and the tools for
/// whoever develops or sizes the service.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Time one transformer step of a named config with seeded weights (mask-aware too).
    ///
    /// With mask ratios, also mask-aware edit steps against a cached template, with the
    /// speedup beside the FLOP bound; one JSON line per measurement.
    Step(bench_step::Args),
    /// Memory and CPU step time of one transformer from several files (f32, fp8, GGUF)
    Weights(bench_weights::Args),
    /// Time the masked-query attention op alone (TFLOP/s per mask ratio).
    Attn(bench_attn::Args),
    /// Time each stage of a whole edit with seeded components (--sparse-vae: the VAE).
    ///
    /// Tokenize, text encoders, VAE encode, denoise, VAE decode, PNG encode; one JSON
    /// line. With --sparse-vae, the VAE of an edit dense against spatially sparse, per
    /// mask ratio and sparse mode.
    Pipeline(bench_pipeline::Args),
    /// One template edit timed end to end by parts, as the daemon serves it.
    ///
    /// A template captured first, then an edit of it (mask of --mask-ratio tokens):
    /// text encoders, sparse VAE encode, the steps against the resident template,
    /// sparse VAE decode, PNG encode. One JSON line with `total_s` and `parts`.
    Edit(bench_edit::Args),
    /// What compressed template forms (fp8, step sharing) change in edits.
    ///
    /// Latent error and PSNR inside the mask against the f32 template; JSON lines.
    CacheQuality(bench_quality::Args),
    /// Template edits against dense ones (Fill, Kontext): PSNR in and outside the mask.
    MaskAwareQuality(bench_mask_aware::Args),
    /// What LoRAs cost on seeded weights: merge, unmerged steps, asynchronous loading.
    ///
    /// Read, upload, merge and unmerge times, the unmerged step's overhead, and the time
    /// to first step of a request whose LoRA loads at a throttled bandwidth (synchronous
    /// against bounded asynchronous loading); one JSON line.
    Lora(bench_lora::Args),
    /// What moving a step's ControlNet residuals to the denoise worker costs.
    ///
    /// At a real model's sizes: the service's shared-memory stream, block by block,
    /// against one cluster message; one JSON line.
    ControlnetStream(bench_controlnet::Args),
    /// The serving runtime's own costs: batch assembly, latent handoff, a message round trip.
    ///
    /// Batch assembly per step, the shared-memory latent handoff, a cluster message round
    /// trip (against a running daemon's cluster port).
    Overheads(bench_overheads::Args),
    /// Load-test a running daemon with open-loop Poisson arrivals of edits.
    ///
    /// Mask sizes from a trace; reports latency percentiles, server stage timings and
    /// batch sizes.
    Serve(bench_serve::Args),
    /// What an approximate-cache hit saves end to end, against a running daemon.
    ///
    /// The daemon serves a text-to-image model: a miss then a hit of the same prompt, per
    /// round; the hit's latency against the (N - K) / N bound; one JSON line.
    Generate(bench_generate::Args),
    /// The approximate cache's eviction policies on a synthetic prompt trace.
    ///
    /// At equal capacity: hit rate per K and steps saved; one JSON line each.
    ApproxCache(bench_approx::Args),
    /// Simulate a cluster of denoise workers: the real routing policies and scheduler.
    ///
    /// The routing policies and the batching scheduler are the daemon's; step times come
    /// from a profile; one JSON line per policy.
    Simulate(simulate::Args),
    /// K of bounded asynchronous LoRA loading for a model and a LoRA; --write keeps it.
    ///
    /// K is the first step whose latents with and without the LoRA fall below a cosine
    /// similarity; one JSON line (`--write` records it beside the adapter, where the
    /// daemon reads it).
    ProfileLora(profile_lora::Args),
    /// Run one transformer forward on named input tensors and write `output`.
    ///
    /// Inputs use the tensor names of the reference cases: hidden_states,
    /// encoder_hidden_states, pooled_projections, timestep, guidance, img_ids, txt_ids.
    /// If the input file also holds `output` (a reference case), the result is
    /// compared with it and the difference printed: the bring-up check for a new
    /// checkpoint.
    Forward(forward::Args),
}

pub fn run(cli: Cli) -> CliResult {
    // A daemon process sizes its own pool (its share of the cores, from the supervisor):
    // the `--threads` it inherits through DENOISED_THREADS is the whole daemon's, and a
    // pool built here would make its own fail to build.
    let worker = matches!(cli.command, Command::Worker(_));
    if cli.threads > 0 && !worker {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cli.threads)
            .build_global()?;
    }
    match cli.command {
        Command::Serve(a) => serve::run_serve(a, cli.threads),
        Command::Edit(mut a) => {
            a.common.model = a.common.components.apply(a.common.model)?;
            edit::run_edit(a)
        }
        Command::Generate(mut a) => {
            a.model = a.components.apply(a.model)?;
            generate::run(a)
        }
        Command::Template(TemplateCommand::Capture(mut a)) => {
            a.common.model = a.common.components.apply(a.common.model)?;
            edit::run_capture(a)
        }
        Command::Inspect(a) => inspect::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Selftest(a) => selftest::run(a),
        Command::Devices => devices::run(),
        Command::Footprint(a) => footprint::run(a),
        Command::Bench(b) => run_bench(b),
        Command::Worker(a) => serve::run_worker(a),
    }
}

fn run_bench(b: BenchCommand) -> CliResult {
    match b {
        BenchCommand::Step(a) => bench_step::run(a),
        BenchCommand::Weights(a) => bench_weights::run(a),
        BenchCommand::Attn(a) => bench_attn::run(a),
        BenchCommand::Pipeline(a) => bench_pipeline::run(a),
        BenchCommand::Edit(a) => bench_edit::run(a),
        BenchCommand::CacheQuality(a) => bench_quality::run(a),
        BenchCommand::MaskAwareQuality(a) => bench_mask_aware::run(a),
        BenchCommand::Lora(a) => bench_lora::run(a),
        BenchCommand::ControlnetStream(a) => bench_controlnet::run(a),
        BenchCommand::Overheads(a) => bench_overheads::run(a),
        BenchCommand::Serve(a) => bench_serve::run(a),
        BenchCommand::Generate(a) => bench_generate::run(a),
        BenchCommand::ApproxCache(a) => bench_approx::run(a),
        BenchCommand::Simulate(a) => simulate::run(a),
        BenchCommand::ProfileLora(a) => profile_lora::run(a),
        BenchCommand::Forward(a) => forward::run(a),
    }
}

/// Device options shared by compute commands.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Compute device: auto (a GPU when usable, else the CPU), cpu, cuda:N, or emu
    /// (the GPU backend on the CPU emulator: for tests, slow).
    #[arg(long, env = "DENOISED_DEVICE", default_value = "auto")]
    pub device: DeviceSpec,
}

/// The device a command computes on.
pub enum Selected {
    Cpu,
    Cuda(Box<denoised_cuda::CudaExec>),
}

/// Single files in place of a model directory's components (`[model] transformer`,
/// `vae`, `text_encoder_2` in config.toml).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ComponentArgs {
    /// The transformer from one file: BFL's single file (`flux1-fill-dev.safetensors`),
    /// an fp8 file, a GGUF quantisation, or a diffusers-layout file. `denoised inspect`
    /// tells what a file is.
    #[arg(long, env = "DENOISED_TRANSFORMER", value_name = "FILE")]
    pub transformer: Option<PathBuf>,
    /// The VAE from one file (BFL's `ae.safetensors`).
    #[arg(long, env = "DENOISED_VAE", value_name = "FILE")]
    pub vae: Option<PathBuf>,
    /// The T5 encoder from one file (safetensors or GGUF).
    #[arg(
        long = "text-encoder-2",
        env = "DENOISED_TEXT_ENCODER_2",
        value_name = "FILE"
    )]
    pub text_encoder_2: Option<PathBuf>,
}

impl ComponentArgs {
    /// `model` with these files in place of its components.
    pub fn apply(&self, model: ModelSource) -> CliResult<ModelSource> {
        Ok(model.with_files(denoised_models::source::ComponentFiles {
            transformer: self.transformer.clone(),
            vae: self.vae.clone(),
            text_encoder_2: self.text_encoder_2.clone(),
        })?)
    }
}

/// Device and dtype of the commands that run the transformer through the serving
/// code (`edit`, `template capture`, `bench forward`).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelDeviceArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Storage dtype on a GPU or the emulator: bf16 or f32 (the CPU computes in f32).
    #[arg(long, env = "DENOISED_DTYPE", default_value = "bf16")]
    pub dtype: String,
    /// The transformer's large Linear weights: `fp8` (E4M3 with a scale per output
    /// channel; GPUs with fp8 tensor cores, sm_89+, the emulator, and the CPU as the
    /// reference computation) or `bf16` (the device dtype).
    #[arg(long, env = "DENOISED_WEIGHT_DTYPE", default_value = "bf16")]
    pub weight_dtype: String,
    /// With fp8 weights: `tensor` (one scale per weight and per GEMM input, applied
    /// inside cuBLASLt's GEMM) or `channel` (per output channel and per token).
    #[arg(long, env = "DENOISED_FP8_SCALING", default_value = "tensor", value_parser = ["tensor", "channel"])]
    pub fp8_scaling: String,
}

impl ModelDeviceArgs {
    /// The device the transformer goes to: `auto` becomes the first GPU or the CPU.
    pub fn spec(&self) -> CliResult<DeviceSpec> {
        Ok(match denoised_cuda::resolve(self.device.device)? {
            Resolved::Cpu => DeviceSpec::Cpu,
            Resolved::Emu => DeviceSpec::Emu,
            Resolved::Cuda(g) => DeviceSpec::Cuda(g.ordinal),
        })
    }

    pub fn dtype(&self) -> CliResult<denoised_cuda::Dt> {
        Ok(denoised_actors::device::parse_dtype(&self.dtype)?)
    }

    /// Whether `--weight-dtype` asks for fp8 weights, and how `--fp8-scaling` scales
    /// them.
    pub fn fp8_weights(&self) -> CliResult<Option<denoised_runtime::fp8::Scaling>> {
        Ok(denoised_actors::device::parse_weight_dtype(
            &self.weight_dtype,
            &self.fp8_scaling,
        )?)
    }
}

impl DeviceArgs {
    /// Opens the device for commands that have a GPU path. `auto` takes a usable GPU
    /// and otherwise the CPU, saying why in one log line; an explicit `cuda:N` that
    /// cannot be opened is an error.
    pub fn select(&self) -> CliResult<Selected> {
        match (self.device, denoised_cuda::resolve(self.device)?) {
            (_, Resolved::Cpu) => Ok(Selected::Cpu),
            (_, Resolved::Emu) => Err(
                "the emulator runs the GPU code for tests; its timings mean nothing here (use cpu or cuda:N)".into(),
            ),
            (spec, Resolved::Cuda(g)) => match denoised_cuda::CudaExec::new(g.ordinal) {
                Ok(exec) => {
                    tracing::info!("computing on {}", denoised_cuda::Exec::describe(&exec));
                    Ok(Selected::Cuda(Box::new(exec)))
                }
                Err(e) if spec == DeviceSpec::Auto => {
                    tracing::info!("device auto: {} unusable ({e}); using the CPU", g.name);
                    Ok(Selected::Cpu)
                }
                Err(e) => Err(e.into()),
            },
        }
    }

    /// The backend for commands that run on the CPU only so far (the pipelines: the
    /// VAE and text encoders have no GPU path yet).
    pub fn cpu_backend(&self) -> CliResult<CpuBackend> {
        cpu_only(self.device, "this command")?;
        Ok(CpuBackend::new())
    }
}

/// For the benchmarks: `None` for `--device emu`, which they accept (so that one-shot
/// GPU script can be rehearsed on the emulator: benches/gpu/oneshot.sh) with a note
/// that its timings mean nothing; otherwise the device as [`DeviceArgs::select`] picks it.
pub fn emu_or_select(d: &DeviceArgs) -> CliResult<Option<Selected>> {
    if d.device == DeviceSpec::Emu {
        eprintln!("note: the emulator runs the GPU code on the CPU; its timings mean nothing");
        return Ok(None);
    }
    d.select().map(Some)
}

/// For a part that computes only on the CPU so far: `auto` on a GPU machine says so
/// in the log; an explicit `cuda:N` is an error, because an operator who asked for a
/// GPU must not silently get a CPU. `who` names the part in the messages.
pub fn cpu_only(spec: DeviceSpec, who: &str) -> CliResult {
    match (spec, denoised_cuda::resolve(spec)?) {
        (_, Resolved::Cpu) => Ok(()),
        (_, Resolved::Emu) => Err(format!("{who} computes on the CPU in this build").into()),
        (DeviceSpec::Auto, Resolved::Cuda(g)) => {
            tracing::info!(
                "device auto: found {}, but {who} computes on the CPU in this build",
                g.name
            );
            Ok(())
        }
        (spec, Resolved::Cuda(g)) => Err(format!(
            "{spec} ({}) requested, but {who} computes on the CPU in this build; use device \
             cpu or auto",
            g.name
        )
        .into()),
    }
}
