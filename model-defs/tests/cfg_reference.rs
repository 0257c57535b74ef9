//! True classifier-free guidance (FluxPipeline's `negative_prompt` with
//! `true_cfg_scale > 1`) against diffusers (tests/fixtures/gen_cfg_fixtures.py) and
//! against sequential execution: the two branches in one batched forward per step
//! (`Job::set_true_cfg`) against two forwards per step combined as diffusers combines
//! them, `neg + s (pos - neg)`.
//!
//! Tolerances: the fixture's latents within 1e-5 of their largest magnitude (the
//! transformer tier of t2i_reference.rs), the PNG within 1 level; batched against
//! sequential within 1e-6 relative (one forward of two requests against two of one:
//! the GEMMs' blocking differs, and the update is computed as `dt s pos + dt (1 - s)
//! neg` instead of `dt (neg + s (pos - neg))`).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use denoised_models::flux::edit::{
    step_batch_with, CfgPartner, DenoiseInputs, DeviceTemplates, Job, Mode, TrueCfg,
};
use denoised_models::flux::model::NoObserver;
use denoised_models::flux::{FluxRequest, FluxTransformer};
use denoised_models::pipeline::flux_fill::{FluxFill, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::pipeline::image::{decode_image, from_model_space};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{CpuBackend, Tensor};

const PER: usize = 256 * 64;

fn rel(got: &[f32], want: &[f32]) -> f32 {
    let mx = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / mx
}

/// Diffusers' order of operations, one request per forward.
fn sequential(
    m: &FluxTransformer<CpuBackend>,
    inputs: &DenoiseInputs,
    cfg: &TrueCfg,
    s: &FlowMatchEuler,
) -> Vec<Tensor> {
    let mut x = inputs.latents.clone();
    let mut out = vec![];
    for i in 0..s.steps() {
        let run = |txt: &Tensor, txt_ids: &Tensor, pooled: &[f32]| {
            let r = FluxRequest {
                img: &x,
                img_ids: &inputs.img_ids,
                txt,
                txt_ids,
                pooled,
                timestep: s.model_timestep(i),
                guidance: inputs.guidance,
                cache: None,
            };
            m.forward(&[r], &mut NoObserver).unwrap().remove(0)
        };
        let pos = run(&inputs.txt, &inputs.txt_ids, &inputs.pooled);
        let neg = run(&cfg.txt, &cfg.txt_ids, &cfg.pooled);
        let dt = s.sigmas[i + 1] - s.sigmas[i];
        let next: Vec<f32> = x
            .data()
            .iter()
            .zip(pos.data().iter().zip(neg.data()))
            .map(|(x, (p, n))| x + dt * (n + cfg.scale * (p - n)))
            .collect();
        x = Tensor::new([256, 64], next).unwrap();
        out.push(x.clone());
    }
    out
}

#[test]
fn true_cfg_matches_diffusers_and_sequential_execution() {
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("cases/cfg_cases.json")).unwrap(),
    )
    .unwrap();
    let dir = fixtures_dir().join(meta["model_dir"].as_str().unwrap());
    let fill = FluxFill::load(&ModelSource::dir(dir.clone()), CpuBackend::new()).unwrap();
    let m = fill.shared_transformer().unwrap();
    let p = &meta["params"];
    let steps = p["num_inference_steps"].as_u64().unwrap() as usize;
    let seq = p["max_sequence_length"].as_u64().unwrap() as usize;
    let f = SafetensorsFile::open(fixtures_dir().join("cases/cfg_dev.safetensors")).unwrap();
    let opts = GenerateOptions {
        steps,
        guidance: p["guidance_scale"].as_f64().unwrap() as f32,
        seed: 0,
        max_sequence_length: seq,
        width: 64,
        height: 64,
    };
    let mut t = Timings::default();
    let inputs = fill
        .prepare_generate(
            meta["prompt"].as_str().unwrap(),
            &opts,
            Some(&f.tensor_f32("initial_latents").unwrap()),
            &mut t,
        )
        .unwrap()
        .inputs;
    let scale = p["true_cfg_scale"].as_f64().unwrap() as f32;
    let neg = meta["negative_prompt"].as_str().unwrap();
    assert!(
        fill.prepare_true_cfg(Some(neg), 1.0, seq, &mut t)
            .unwrap()
            .is_none()
            && fill
                .prepare_true_cfg(None, scale, seq, &mut t)
                .unwrap()
                .is_none(),
        "diffusers runs true CFG only with a scale above 1 and a negative prompt"
    );
    let cfg = fill
        .prepare_true_cfg(Some(neg), scale, seq, &mut t)
        .unwrap()
        .unwrap();
    let sc = SchedulerConfig::from_file(dir.join("scheduler/scheduler_config.json")).unwrap();
    let s = Arc::new(FlowMatchEuler::new(&sc, steps, 256).unwrap());

    // Batched: both branches in one forward, beside a plain request.
    let mut job = Job::new(&*m, &inputs, s.clone(), Mode::Full).unwrap();
    job.set_true_cfg(&*m, &inputs, &cfg).unwrap();
    let mut plain = Job::new(&*m, &inputs, s.clone(), Mode::Full).unwrap();
    let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
    let want = f.tensor_f32("step_latents").unwrap();
    let reference = sequential(&m, &inputs, &cfg, &s);
    let mut worst = (0f32, 0f32);
    while !job.done() {
        let i = job.step();
        step_batch_with(
            &*m,
            &mut [&mut job, &mut plain],
            &DeviceTemplates::new(),
            &plan,
        )
        .unwrap();
        let got = job.computed_latents(&*m).unwrap();
        let d_fix = rel(got.data(), &want.data()[i * PER..(i + 1) * PER]);
        let d_seq = rel(got.data(), reference[i].data());
        let d_ref = rel(reference[i].data(), &want.data()[i * PER..(i + 1) * PER]);
        println!("step {i}: {d_fix:.2e} from diffusers, {d_seq:.2e} from sequential (which is {d_ref:.2e} from diffusers)");
        assert!(d_fix <= 1e-5, "step {i}: {d_fix:e} from diffusers");
        assert!(
            d_seq <= 1e-6,
            "step {i}: {d_seq:e} from sequential execution"
        );
        worst = (worst.0.max(d_fix), worst.1.max(d_seq));
    }
    // The guidance changes the result (the comparisons are not vacuous).
    let unguided = plain.computed_latents(&*m).unwrap();
    assert!(rel(unguided.data(), reference[steps - 1].data()) > 1e-2);
    let latents = job.finish(&*m).unwrap().0;
    let raw = fill.decode_raw(&latents, 64, 64).unwrap();
    let png = std::fs::read(fixtures_dir().join("cases/cfg_dev_output.png")).unwrap();
    let (levels, _) =
        from_model_space(raw.data(), 64, 64).level_diff(&decode_image(&png, &fill.limits).unwrap());
    println!(
        "worst {:.2e} / {:.2e}; PNG {levels} levels",
        worst.0, worst.1
    );
    assert!(levels <= 1, "PNG levels differ by {levels}");

    // Split: each branch a job of its own (on its own thread, as on two workers), the
    // velocities exchanged every step (`CfgPartner`).
    let neg_inputs = DenoiseInputs {
        txt: cfg.txt.clone(),
        txt_ids: cfg.txt_ids.clone(),
        pooled: cfg.pooled.clone(),
        ..inputs.clone()
    };
    let board = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
    let branch = |positive: bool, inputs: DenoiseInputs| {
        let (m, s, board) = (m.clone(), s.clone(), board.clone());
        std::thread::spawn(move || {
            let mut job = Job::new(&*m, &inputs, s, Mode::Full).unwrap();
            let partner = Board {
                positive,
                scale,
                board,
            };
            job.set_cfg_partner(Arc::new(partner)).unwrap();
            let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
            let mut steps = vec![];
            while !job.done() {
                step_batch_with(&*m, &mut [&mut job], &DeviceTemplates::new(), &plan).unwrap();
                steps.push(job.computed_latents(&*m).unwrap());
            }
            steps
        })
    };
    let pos = branch(true, inputs.clone());
    let neg = branch(false, neg_inputs);
    let (pos, neg) = (pos.join().unwrap(), neg.join().unwrap());
    for (i, (p, n)) in pos.iter().zip(&neg).enumerate() {
        assert!(
            p.data() == n.data(),
            "step {i}: the branches' latents differ"
        );
        let d_fix = rel(p.data(), &want.data()[i * PER..(i + 1) * PER]);
        let d_seq = rel(p.data(), reference[i].data());
        println!("split step {i}: {d_fix:.2e} from diffusers, {d_seq:.2e} from sequential");
        assert!(d_fix <= 1e-5, "split step {i}: {d_fix:e} from diffusers");
        assert!(d_seq <= 1e-6, "split step {i}: {d_seq:e} from sequential");
    }
}

/// The two branches' meeting point, in memory: each step's velocity of each branch.
type Velocities = HashMap<(bool, usize), Vec<f32>>;

struct Board {
    positive: bool,
    scale: f32,
    board: Arc<(Mutex<Velocities>, Condvar)>,
}

impl CfgPartner for Board {
    fn positive(&self) -> bool {
        self.positive
    }
    fn scale(&self) -> f32 {
        self.scale
    }
    fn exchange(&self, step: usize, mine: &[f32]) -> denoised_runtime::Result<Vec<f32>> {
        let (lock, cv) = &*self.board;
        let mut b = lock.lock().unwrap();
        b.insert((self.positive, step), mine.to_vec());
        cv.notify_all();
        loop {
            if let Some(v) = b.get(&(!self.positive, step)) {
                return Ok(v.clone());
            }
            b = cv.wait(b).unwrap();
        }
    }
}
