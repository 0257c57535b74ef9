//! `denoised bench lora`: what LoRAs cost (docs/design.md §Adapters), on seeded weights of a
//! named config and a random rank-r LoRA on every Linear, in one run; one JSON line.
//!
//! - `read_s`, `upload_s`: reading and checking the file; uploading it for the
//!   unmerged path;
//! - `merge_s`, `unmerge_s`: patching every adapted weight in place (`W += s·B A`,
//!   rebuilt on the host from the pristine weights) and restoring them;
//! - `step_base_s`, `step_unmerged_s`: a step of one request without and with the
//!   unmerged LoRA (medians), and their ratio against the FLOP ratio;
//! - time to first step and to the end of a request whose LoRA loads at
//!   `--throttle-mib-per-s`, through the denoise loop: without a LoRA, with
//!   synchronous loading (K = 0) and with bounded asynchronous loading at `--k`
//!   (medians over `--rounds`, each round loading the LoRA afresh).
//!
//! CPU only: the figures that matter on a GPU (merge on the device, overlap of the
//! load with device compute) need one; `denoised selftest` checks the GPU path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use denoised_actors::batching::BatchConfig;
use denoised_actors::denoise::{
    AdapterOptions, DenoiseLoop, DenoiseRequest, Event, LoopOptions, LoraRequest,
};
use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::edit::{DenoiseInputs, Mode};
use denoised_models::flux::embed::image_ids;
use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::stepper::{ModelStepper, Stepper};
use denoised_models::flux::weights::{Site, SplitMix};
use denoised_models::{FlowMatchEuler, FluxConfig, FluxTransformer};
use denoised_runtime::weights::write_safetensors;
use denoised_runtime::{CpuBackend, Tensor};
use serde_json::json;

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Named transformer config (flux-small, flux-tiny, flux1-dev, ...).
    #[arg(long, default_value = "flux-small")]
    pub config: String,
    /// Image side in tokens (`side x side` image tokens).
    #[arg(long, default_value_t = 16)]
    pub side: usize,
    #[arg(long, default_value_t = 64)]
    pub text_tokens: usize,
    /// The LoRA's rank (every Linear of the transformer adapted).
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// Steps of each request through the loop.
    #[arg(long, default_value_t = 8)]
    pub steps: usize,
    /// K of the bounded asynchronous loads.
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    /// The loader's bandwidth, MiB/s (the throttled load).
    #[arg(long, default_value_t = 50.0)]
    pub throttle_mib_per_s: f64,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A random LoRA of `rank` on every checkpoint Linear of `c`'s model, in the PEFT
/// format (no metadata: scale 1), at `path`.
fn write_lora(c: &FluxConfig, rank: usize, seed: u64, path: &std::path::Path) -> CliResult {
    let mut rng = SplitMix::new(seed);
    let mut tensors: Vec<(String, Tensor)> = vec![];
    for site in Site::all(c) {
        let spec = site.spec(c);
        for (name, out) in spec.parts {
            let mut randn =
                |n: usize, std: f32| -> Vec<f32> { (0..n).map(|_| std * rng.normal()).collect() };
            let a = Tensor::new(
                [rank, spec.input],
                randn(rank * spec.input, (spec.input as f32).powf(-0.5)),
            )?;
            let b = Tensor::new([out, rank], randn(out * rank, 0.1 / (rank as f32).sqrt()))?;
            tensors.push((format!("transformer.{name}.lora_A.weight"), a));
            tensors.push((format!("transformer.{name}.lora_B.weight"), b));
        }
    }
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(path, &named)?;
    Ok(())
}

fn inputs(c: &FluxConfig, side: usize, text: usize, seed: u64) -> CliResult<Arc<DenoiseInputs>> {
    let l = side * side;
    let oc = c.out_channels();
    let mut rng = SplitMix::new(seed);
    let mut rand = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
    Ok(Arc::new(DenoiseInputs {
        latents: Tensor::new([l, oc], rand(l * oc))?,
        cond: Tensor::new([l, c.in_channels - oc], rand(l * (c.in_channels - oc)))?,
        img_ids: Tensor::new([l, 3], image_ids(side, side))?,
        txt: Tensor::new(
            [text, c.joint_attention_dim],
            rand(text * c.joint_attention_dim),
        )?,
        txt_ids: Tensor::zeros([text, 3]),
        pooled: rand(c.pooled_projection_dim),
        guidance: 3.5,
        reference: None,
    }))
}

pub fn run(a: Args) -> CliResult {
    let c = FluxConfig::named(&a.config).ok_or_else(|| format!("unknown config {}", a.config))?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.safetensors");
    write_lora(&c, a.rank, a.seed ^ 0x10a, &path)?;
    let bytes = std::fs::metadata(&path)?.len();
    let model = Arc::new(FluxTransformer::seeded(
        CpuBackend::new(),
        c.clone(),
        a.seed,
    )?);

    let t0 = Instant::now();
    let file = LoraFile::open(&path, &c)?;
    let read_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let id = model.add_lora(&file)?;
    let upload_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let sites = model.merge_loras(&[(&file, 1.0)])?;
    let merge_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    model.unmerge()?;
    let unmerge_s = t0.elapsed().as_secs_f64();

    // One request's step, without and with the unmerged LoRA, alternated.
    let inp = inputs(&c, a.side, a.text_tokens, a.seed)?;
    let schedule = Arc::new(FlowMatchEuler::new(
        &Default::default(),
        1 << 20,
        a.side * a.side,
    )?);
    let mut st = ModelStepper::unbounded(model.clone(), 4);
    st.admit(0, &inp, schedule.clone(), Mode::Full)?;
    st.admit(1, &inp, schedule, Mode::Full)?;
    st.set_loras(1, vec![LoraUse { id, scale: 1.0 }])?;
    let (mut base, mut lora) = (vec![], vec![]);
    for i in 0..2 * a.rounds + 2 {
        for (key, v) in [(0, &mut base), (1, &mut lora)] {
            let t0 = Instant::now();
            st.step(&[key])?;
            if i > 0 {
                v.push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let (step_base_s, step_unmerged_s) = (median(base), median(lora));
    let tokens = (a.side * a.side + a.text_tokens) as f64;
    let lora_flops = 2.0
        * tokens
        * file
            .modules
            .iter()
            .map(|m| (m.down.cols() + m.rows.len()) * m.rank())
            .sum::<usize>() as f64;
    let base_flops = denoised_models::flux::cost::forward_flops(
        &c,
        denoised_models::flux::cost::StepShape {
            text: a.text_tokens,
            active: a.side * a.side,
            image: a.side * a.side,
        },
    );
    drop(st);

    // Through the loop: a request with a LoRA read at the throttled bandwidth.
    let lp = DenoiseLoop::spawn(
        Box::new(ModelStepper::unbounded(model, 4)),
        BatchConfig::default(),
        LoopOptions {
            adapters: Some(AdapterOptions {
                config: c.clone(),
                // Nothing stays on the device: each round loads afresh.
                slots: 0,
                throttle_bytes_per_s: Some(a.throttle_mib_per_s * (1u64 << 20) as f64),
            }),
            ..LoopOptions::default()
        },
    )?;
    let schedule = Arc::new(FlowMatchEuler::new(
        &Default::default(),
        a.steps,
        a.side * a.side,
    )?);
    let mut next_id = 0u64;
    let mut run = |k: Option<usize>| -> CliResult<(f64, f64, Option<usize>)> {
        next_id += 1;
        let t0 = Instant::now();
        lp.submit(DenoiseRequest {
            preview: None,
            id: next_id,
            inputs: inp.clone(),
            schedule: schedule.clone(),
            work: Mode::Full,
            start_at: 0,
            store_at: vec![],
            loras: k
                .map(|k| LoraRequest {
                    name: format!("bench-{next_id}"),
                    path: path.clone(),
                    scale: 1.0,
                    patch_by: k,
                })
                .into_iter()
                .collect(),
            true_cfg: None,
            control: None,
            partner: None,
        });
        let (mut first, mut applied) = (None, None);
        loop {
            match lp.events().recv_timeout(Duration::from_secs(3600))? {
                Event::Step { batch, .. } if first.is_none() && batch.contains(&next_id) => {
                    first = Some(t0.elapsed().as_secs_f64())
                }
                Event::LoraApplied { step, .. } => applied = Some(step),
                Event::Finished { .. } => {
                    return Ok((first.unwrap_or(0.0), t0.elapsed().as_secs_f64(), applied))
                }
                Event::Failed { error, .. } => return Err(error.into()),
                _ => {}
            }
        }
    };
    let mut rows = vec![];
    for (label, k) in [("none", None), ("sync", Some(0)), ("bal", Some(a.k))] {
        let mut firsts = vec![];
        let mut totals = vec![];
        let mut applied = None;
        for _ in 0..a.rounds {
            let (f, t, ap) = run(k)?;
            firsts.push(f);
            totals.push(t);
            applied = ap;
        }
        rows.push((label, median(firsts), median(totals), applied));
    }
    let get = |l: &str| rows.iter().find(|r| r.0 == l).expect("a row");
    let line = json!({
        "config": a.config, "image_tokens": a.side * a.side, "text_tokens": a.text_tokens,
        "rank": a.rank, "lora_bytes": bytes, "adapted_sites": sites, "steps": a.steps,
        "read_s": read_s, "upload_s": upload_s, "merge_s": merge_s, "unmerge_s": unmerge_s,
        "step_base_s": step_base_s, "step_unmerged_s": step_unmerged_s,
        "unmerged_step_ratio": step_unmerged_s / step_base_s,
        "unmerged_flop_ratio": 1.0 + lora_flops / base_flops,
        "throttle_mib_per_s": a.throttle_mib_per_s,
        "load_s_at_throttle": bytes as f64 / (a.throttle_mib_per_s * (1u64 << 20) as f64),
        "first_step_s": {"none": get("none").1, "sync": get("sync").1, "bal": get("bal").1},
        "total_s": {"none": get("none").2, "sync": get("sync").2, "bal": get("bal").2},
        "bal_k": a.k, "bal_applied_at_step": get("bal").3,
    });
    println!("{line}");
    Ok(())
}
