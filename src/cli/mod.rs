//! Command-line interface: one module per subcommand, shared options here.

mod adapters;
mod bench_approx;
mod bench_attn;
mod bench_controlnet;
mod bench_generate;
mod bench_launches;
mod bench_lora;
mod bench_overheads;
mod bench_pipeline;
mod bench_quality;
mod bench_serve;
mod bench_sparse_vae;
mod bench_step;
mod controlnet;
mod devices;
mod edit;
mod footprint;
mod forward;
mod generate;
mod profile;
mod profile_lora;
mod selftest;
mod serve;
mod simulate;

use clap::{Parser, Subcommand};
use denoised_cuda::{DeviceSpec, Resolved};
use denoised_runtime::CpuBackend;

pub type CliResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// denoised: a serving runtime for mask-aware image editing with diffusion
/// transformers (FLUX.1 Fill).
#[derive(Parser, Debug)]
#[command(name = "denoised", version, about, long_about = None)]
pub struct Cli {
    /// Worker threads for CPU compute (0 = one per core).
    #[arg(long, env = "DENOISED_THREADS", default_value_t = 0, global = true)]
    pub threads: usize,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one transformer forward on named input tensors and write `output`.
    ///
    /// Inputs use the tensor names of the reference cases: hidden_states,
    /// encoder_hidden_states, pooled_projections, timestep, guidance, img_ids, txt_ids.
    /// If the input file also holds `output` (a reference case), the result is
    /// compared with it and the difference printed: the bring-up check for a new
    /// checkpoint.
    Forward(forward::Args),
    /// Time one transformer step of a named config with random weights; prints a JSON line.
    BenchStep(bench_step::Args),
    /// Time the masked-query attention op alone (TFLOP/s per mask ratio).
    BenchAttn(bench_attn::Args),
    /// Edit an image: inpaint the masked region from a prompt (FLUX.1 Fill). With
    /// --template, only the masked tokens are computed.
    Edit(edit::EditArgs),
    /// Generate an image from a prompt (FLUX.1-dev or -schnell, as diffusers'
    /// FluxPipeline).
    Generate(generate::GenerateArgs),
    /// Template management.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Time each stage of a whole edit with seeded components; prints a JSON line.
    BenchPipeline(bench_pipeline::Args),
    /// What compressed template forms (fp8, step sharing) change in edits against the
    /// f32 template: latent error and PSNR inside the mask; JSON lines.
    BenchCacheQuality(bench_quality::Args),
    /// The approximate cache's eviction policies on a synthetic text-to-image prompt
    /// trace at equal capacity: hit rate per K and steps saved; one JSON line each.
    BenchApproxCache(bench_approx::Args),
    /// What an approximate-cache hit saves end to end against a running daemon serving
    /// a text-to-image model: a miss then a hit of the same prompt, per round; the hit's
    /// latency against the (N - K) / N bound; one JSON line.
    BenchGenerate(bench_generate::Args),
    /// What LoRAs cost on seeded weights: read, upload, merge and unmerge times, the
    /// unmerged step's overhead, and the time to first step of a request whose LoRA
    /// loads at a throttled bandwidth (synchronous against bounded asynchronous
    /// loading); one JSON line.
    BenchLora(bench_lora::Args),
    /// What moving a step's ControlNet residuals to the denoise worker costs at a real
    /// model's sizes: the service's shared-memory stream, block by block, against one
    /// cluster message; one JSON line.
    BenchControlnetStream(bench_controlnet::Args),
    /// Simulate a cluster of denoise workers (the real routing policies and batching
    /// scheduler, step times from a profile); one JSON line per policy.
    Simulate(simulate::Args),
    /// Load-test a running daemon: open-loop Poisson arrivals of edits with mask sizes
    /// from a trace; reports latency percentiles, server stage timings and batch sizes.
    BenchServe(bench_serve::Args),
    /// Measure this device's latency models for the planner (compute against FLOPs,
    /// loads against bytes per cache tier), report R², and write the profile file
    /// that `[denoise] profile` names.
    Profile(profile::Args),
    /// K of bounded asynchronous LoRA loading for a model and a LoRA: the first step
    /// whose latents with and without it fall below a cosine similarity; one JSON line
    /// (`--write` records it beside the adapter for the daemon).
    ProfileLora(profile_lora::Args),
    /// Print the template cache size of models at a resolution (computed, not allocated).
    Footprint(footprint::Args),
    /// List the compute devices this machine offers.
    Devices,
    /// Measure the serving runtime's own overheads: batch assembly per step, the
    /// shared-memory latent handoff, a cluster message round trip.
    BenchOverheads(bench_overheads::Args),
    /// Run the daemon: a supervisor that starts the router (HTTP API), preprocess,
    /// denoise, postprocess and cache processes, and restarts any that die.
    Serve(serve::ServeArgs),
    /// Verify a GPU in one run: kernels and the transformer against their references,
    /// the identity invariant, a daemon round trip on the device, and step and
    /// attention benchmarks at FLUX.1 size; prints a table, exits nonzero on a failure.
    Selftest(selftest::Args),
    /// One process of the daemon (started by `serve`; not for direct use).
    #[command(hide = true)]
    Worker(serve::WorkerArgs),
}

#[derive(Subcommand, Debug)]
pub enum TemplateCommand {
    /// Capture a template: a full run over the image whose activations edits reuse.
    Capture(edit::CaptureArgs),
}

pub fn run(cli: Cli) -> CliResult {
    if cli.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cli.threads)
            .build_global()?;
    }
    match cli.command {
        Command::Forward(a) => forward::run(a),
        Command::BenchStep(a) => bench_step::run(a),
        Command::Profile(a) => profile::run(a),
        Command::ProfileLora(a) => profile_lora::run(a),
        Command::BenchAttn(a) => bench_attn::run(a),
        Command::Edit(a) => edit::run_edit(a),
        Command::Generate(a) => generate::run(a),
        Command::Template(TemplateCommand::Capture(a)) => edit::run_capture(a),
        Command::BenchPipeline(a) => bench_pipeline::run(a),
        Command::BenchCacheQuality(a) => bench_quality::run(a),
        Command::BenchApproxCache(a) => bench_approx::run(a),
        Command::BenchGenerate(a) => bench_generate::run(a),
        Command::BenchLora(a) => bench_lora::run(a),
        Command::BenchControlnetStream(a) => bench_controlnet::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::BenchServe(a) => bench_serve::run(a),
        Command::Footprint(a) => footprint::run(a),
        Command::Devices => devices::run(),
        Command::Serve(a) => serve::run_serve(a, cli.threads),
        Command::BenchOverheads(a) => bench_overheads::run(a),
        Command::Selftest(a) => selftest::run(a),
        Command::Worker(a) => serve::run_worker(a),
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

/// Device and dtype of the commands that run the transformer through the serving
/// code (`edit`, `template capture`, `forward`).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelDeviceArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Storage dtype on a GPU or the emulator: bf16 or f32 (the CPU computes in f32).
    #[arg(long, env = "DENOISED_DTYPE", default_value = "bf16")]
    pub dtype: String,
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
