//! FLUX ControlNets against diffusers (tests/fixtures/gen_controlnet_fixtures.py): a
//! tiny FluxControlNetModel's per-block residuals at step 0, and FluxControlNetPipeline
//! with one ControlNet and with two (their residuals summed), every step's latents and
//! the PNG.
//!
//! Tolerances: residuals and latents within 1e-5 of their largest magnitude (the
//! transformer tier of t2i_reference.rs), the PNG within 1 level.

use std::sync::Arc;

use denoised_models::flux::controlnet::{sum, ControlFor, ControlNet};
use denoised_models::flux::edit::{step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode};
use denoised_models::flux::FluxRequest;
use denoised_models::pipeline::flux_fill::{FluxFill, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::pipeline::image::{decode_image, from_model_space};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{CpuBackend, Tensor};

const N: usize = 256;

fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let mx = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / mx
}

/// `[latents | control]` rows.
fn joined(latents: &Tensor, control: &[f32]) -> Tensor {
    let mut x = Vec::with_capacity(N * 128);
    for r in 0..N {
        x.extend_from_slice(latents.row(r));
        x.extend_from_slice(&control[r * 64..(r + 1) * 64]);
    }
    Tensor::new([N, 128], x).unwrap()
}

/// The fixture's generation: its pipeline, tensors, inputs and schedule.
struct Case {
    source: ModelSource,
    fill: FluxFill<CpuBackend>,
    m: Arc<denoised_models::FluxTransformer<CpuBackend>>,
    f: SafetensorsFile,
    inputs: DenoiseInputs,
    s: Arc<FlowMatchEuler>,
    steps: usize,
}

impl Case {
    fn load() -> Case {
        let meta: serde_json::Value = serde_json::from_slice(
            &std::fs::read(fixtures_dir().join("cases/controlnet_cases.json")).unwrap(),
        )
        .unwrap();
        let dir = fixtures_dir().join(meta["model_dir"].as_str().unwrap());
        let source = ModelSource::dir(dir.clone());
        let fill = FluxFill::load(&source, CpuBackend::new()).unwrap();
        let m = fill.shared_transformer().unwrap();
        let f =
            SafetensorsFile::open(fixtures_dir().join("cases/controlnet_dev.safetensors")).unwrap();
        let p = &meta["params"];
        let steps = p["num_inference_steps"].as_u64().unwrap() as usize;
        let opts = GenerateOptions {
            steps,
            guidance: p["guidance_scale"].as_f64().unwrap() as f32,
            seed: 0,
            max_sequence_length: p["max_sequence_length"].as_u64().unwrap() as usize,
            width: 64,
            height: 64,
        };
        let inputs = fill
            .prepare_generate(
                meta["prompt"].as_str().unwrap(),
                &opts,
                Some(&f.tensor_f32("initial_latents").unwrap()),
                &mut Timings::default(),
            )
            .unwrap()
            .inputs;
        let sc = SchedulerConfig::from_file(dir.join("scheduler/scheduler_config.json")).unwrap();
        let s = Arc::new(FlowMatchEuler::new(&sc, steps, N).unwrap());
        Case {
            source,
            fill,
            m,
            f,
            inputs,
            s,
            steps,
        }
    }

    fn t(&self, n: &str) -> Tensor {
        self.f.tensor_f32(n).unwrap()
    }

    /// A step's latents against diffusers' (`case` names the run).
    fn check_step(&self, case: &str, i: usize, got: &Tensor) {
        let want = self.t(&format!("{case}_step_latents"));
        let d = rel(got.data(), &want.data()[i * N * 64..(i + 1) * N * 64]);
        println!("{case} step {i}: {d:.2e}");
        assert!(d <= 1e-5, "{case} step {i}: {d:e}");
    }

    /// The final latent's PNG against diffusers'.
    fn check_png(&self, case: &str, latents: &Tensor) {
        let raw = self.fill.decode_raw(latents, 64, 64).unwrap();
        let png =
            std::fs::read(fixtures_dir().join(format!("cases/controlnet_dev_{case}_output.png")))
                .unwrap();
        let (levels, _) = from_model_space(raw.data(), 64, 64)
            .level_diff(&decode_image(&png, &self.fill.limits).unwrap());
        println!("{case}: PNG within {levels} levels");
        assert!(levels <= 1, "{case}: PNG levels differ by {levels}");
    }
}

fn net(n: &str) -> ControlNet<CpuBackend> {
    ControlNet::load(
        CpuBackend::new(),
        fixtures_dir().join("controlnets").join(n),
    )
    .unwrap()
}

#[test]
fn controlnets_match_diffusers_flux_controlnet_pipeline() {
    let c = Case::load();
    let (m, inputs, s) = (&c.m, &c.inputs, &c.s);
    let t = |n: &str| c.t(n);
    let (canny, depth) = (net("canny-tiny"), net("depth-tiny"));

    // The residuals at step 0 against the ControlNet called alone (scaled by 0.7).
    let control_a = t("single_control_latents");
    let x0 = joined(&inputs.latents, control_a.data());
    let r = canny.residuals(&request(&x0, &inputs, &s, 0), 0.7).unwrap();
    let (want_d, want_s) = (t("step0_block_samples"), t("step0_single_samples"));
    let per = N * m.config.hidden();
    for (i, got) in r.double.iter().chain(&r.single).enumerate() {
        let want = if i < r.double.len() {
            &want_d.data()[i * per..(i + 1) * per]
        } else {
            &want_s.data()[(i - r.double.len()) * per..(i - r.double.len() + 1) * per]
        };
        let scaled: Vec<f32> = got.data().iter().map(|v| v * r.scale).collect();
        let d = rel(&scaled, want);
        println!("residual {i} at step 0: {d:.2e}");
        assert!(d <= 1e-5, "residual {i}: {d:e}");
    }

    let multi = t("multi_control_latents");
    for (case, nets) in [
        ("single", vec![(&canny, 0.7f32, 0usize)]),
        ("multi", vec![(&canny, 0.7, 0), (&depth, 0.5, 1)]),
    ] {
        let controls: Vec<&[f32]> = match case {
            "single" => vec![control_a.data()],
            _ => vec![&multi.data()[..N * 64], &multi.data()[N * 64..]],
        };
        let mut job = Job::new(&**m, inputs, s.clone(), Mode::Full).unwrap();
        let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
        while !job.done() {
            let i = job.step();
            let latents = if i == 0 {
                inputs.latents.clone()
            } else {
                job.computed_latents(&*m).unwrap()
            };
            let all = nets
                .iter()
                .map(|(net, scale, c)| {
                    let x = joined(&latents, controls[*c]);
                    net.residuals(&request(&x, &inputs, &s, i), *scale).unwrap()
                })
                .collect();
            let res = sum(m.backend(), all).unwrap().unwrap();
            job.set_control(Some(Arc::new(ControlFor::new(res, &m.config).unwrap())));
            step_batch_with(&*m, &mut [&mut job], &DeviceTemplates::new(), &plan).unwrap();
            c.check_step(case, i, &job.computed_latents(&**m).unwrap());
        }
        c.check_png(case, &job.finish(&**m).unwrap().0);
    }
}

/// The ControlNet's request at `step`: the generation's text, `img` its input rows.
fn request<'a>(
    img: &'a Tensor,
    inputs: &'a DenoiseInputs,
    s: &FlowMatchEuler,
    step: usize,
) -> FluxRequest<'a, Tensor> {
    FluxRequest {
        img,
        img_ids: &inputs.img_ids,
        txt: &inputs.txt,
        txt_ids: &inputs.txt_ids,
        pooled: &inputs.pooled,
        timestep: s.model_timestep(step),
        guidance: inputs.guidance,
        cache: None,
    }
}

/// The path the CLI and the ControlNet service take: control images VAE-encoded here
/// (with the run's posterior draws), residuals fed to the stepper step by step
/// (`LocalControl`, summed by `run_summed`), against the same diffusers runs.
#[test]
fn control_images_and_fed_residuals_match_diffusers() {
    use denoised_models::flux::control_feed::{ControlInputs, ControlUse, LocalControl};
    use denoised_models::flux::stepper::{ModelStepper, Stepper};
    use denoised_models::flux::weights::SplitMix;
    use denoised_models::pipeline::control::ControlEncoder;

    let c = Case::load();
    let (m, inputs, s) = (&c.m, &c.inputs, &c.s);
    let t = |n: &str| c.t(n);
    let encoder = ControlEncoder::load(&c.source).unwrap();
    let image = |n: &str| {
        let bytes = std::fs::read(fixtures_dir().join("controlnets").join(n)).unwrap();
        decode_image(&bytes, &c.fill.limits).unwrap()
    };
    let mut rng = SplitMix::new(0);
    let eps_per = N * 64;
    for (case, nets) in [
        ("single", vec![("canny-tiny", "control_a.png", 0.7f32)]),
        (
            "multi",
            vec![
                ("canny-tiny", "control_a.png", 0.7),
                ("depth-tiny", "control_b.png", 0.5),
            ],
        ),
    ] {
        let eps = t(&format!("{case}_control_eps"));
        let want_latents = t(&format!("{case}_control_latents"));
        let uses: Vec<ControlUse> = nets
            .iter()
            .enumerate()
            .map(|(i, (n, img, scale))| {
                let e = Tensor::new(
                    [1, 16, 32, 32],
                    eps.data()[i * eps_per..(i + 1) * eps_per].to_vec(),
                )
                .unwrap();
                let control = encoder.encode(&image(img), Some(&e), &mut rng).unwrap();
                let want = &want_latents.data()[i * N * 64..(i + 1) * N * 64];
                let d = rel(control.data(), want);
                println!("{case}: control latents of {img}: {d:.2e}");
                assert!(d <= 1e-5, "{case} {img}: {d:e}");
                ControlUse {
                    net: Arc::new(net(n)),
                    control,
                    scale: *scale,
                }
            })
            .collect();
        let feed = LocalControl::new(uses, ControlInputs::new(inputs, s))
            .unwrap()
            .unwrap();
        let mut st = ModelStepper::unbounded(m.clone(), 4);
        st.admit(1, inputs, s.clone(), Mode::Full).unwrap();
        st.set_control_feed(1, Arc::new(feed)).unwrap();
        for i in 0..c.steps {
            st.step(&[1]).unwrap();
            c.check_step(case, i, &st.latents(1).unwrap());
        }
        c.check_png(case, &st.finish(1).unwrap().0);
    }
}
