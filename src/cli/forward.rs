//! `denoised bench forward`: one transformer forward on tensors from a safetensors file.

use std::path::PathBuf;

use denoised_cuda::{CudaExec, DeviceSpec, EmuExec, GpuBackend};
use denoised_models::flux::model::{FluxInputs, NoObserver};
use denoised_models::ModelSource;
use denoised_runtime::weights::{write_safetensors, SafetensorsFile};
use denoised_runtime::{Backend, CpuBackend};

use super::{CliResult, ModelDeviceArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model: a diffusers directory (pipeline root or its transformer/), or `builtin`.
    #[arg(long, env = "DENOISED_MODEL", default_value = "builtin")]
    pub model: ModelSource,
    /// Safetensors file with the named input tensors.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Where to write the result (a safetensors file with one tensor, `output`).
    #[arg(long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub device: ModelDeviceArgs,
}

pub fn run(a: Args) -> CliResult {
    match a.device.spec()? {
        DeviceSpec::Cpu => forward(&a, CpuBackend::new()),
        DeviceSpec::Emu => forward(&a, GpuBackend::new(EmuExec::open()?, a.device.dtype()?)),
        DeviceSpec::Cuda(n) => forward(&a, GpuBackend::new(CudaExec::new(n)?, a.device.dtype()?)),
        DeviceSpec::Auto => unreachable!("resolved by spec()"),
    }
}

fn forward<B: Backend>(a: &Args, backend: B) -> CliResult {
    let t0 = std::time::Instant::now();
    let model = a.model.load_transformer(backend)?;
    let load_s = t0.elapsed().as_secs_f64();
    let f = SafetensorsFile::open(&a.inputs)?;
    let inputs = FluxInputs::from_file(&f)?;
    if model.config.guidance_embeds && inputs.guidance.is_empty() {
        return Err(format!(
            "{}: this model embeds guidance, but the inputs have no `guidance` tensor",
            a.inputs.display()
        )
        .into());
    }
    let t1 = std::time::Instant::now();
    let out = model.forward_inputs(&inputs, &mut NoObserver)?;
    let fwd_s = t1.elapsed().as_secs_f64();
    write_safetensors(&a.output, &[("output", &out)])?;
    eprintln!(
        "model {} on {}: loaded in {load_s:.3}s, forward in {fwd_s:.3}s; wrote output {:?} to {}",
        a.model,
        model.backend().name(),
        out.shape(),
        a.output.display()
    );
    if f.contains("output") {
        if a.model == ModelSource::Builtin {
            println!("inputs hold a reference `output`; not compared: the built-in model's weights are seeded, not the reference checkpoint's");
        } else {
            let want = f.tensor_f32("output")?;
            if want.shape() == out.shape() {
                let diff = out.max_abs_diff(&want)?;
                let scale = want.data().iter().fold(0.0f32, |m, v| m.max(v.abs()));
                println!("reference `output` in inputs: max abs diff {diff:.3e} (reference max abs {scale:.3})");
            } else {
                println!(
                    "reference `output` in inputs has shape {:?}, ours {:?}: not compared",
                    want.shape(),
                    out.shape()
                );
            }
        }
    }
    Ok(())
}
