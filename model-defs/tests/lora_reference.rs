//! LoRA adapters against diffusers + peft (tests/fixtures/gen_lora_fixtures.py): two
//! random LoRAs in the PEFT/diffusers format on the tiny FLUX.1-dev transformer, run
//! through FluxPipeline with `load_lora_weights` + `fuse_lora`.
//!
//! - merged (`FluxTransformer::merge_loras`) equals diffusers' fused run at every step
//!   (latents within 1e-5 of their largest magnitude, the transformer tier of
//!   t2i_reference.rs) and in the PNG (1 level);
//! - unmerged (registered adapters, per-request rows) equals merged within 1e-5;
//! - unmerging restores every weight bit for bit;
//! - a batch mixing LoRA sets equals each request run alone (within 1e-6 relative, the
//!   tolerance of any batched request: a different row count changes GEMM blocking).

use std::sync::Arc;

use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::edit::{step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode};
use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::weights::{SingleLinear, Site};
use denoised_models::flux::FluxTransformer;
use denoised_models::pipeline::flux_fill::{FluxFill, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::pipeline::image::{decode_image, from_model_space};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::weights::{write_safetensors, SafetensorsFile};
use denoised_runtime::{CpuBackend, Error, Tensor};

const PER: usize = 256 * 64;

struct Setup {
    fill: FluxFill<CpuBackend>,
    model: Arc<FluxTransformer<CpuBackend>>,
    inputs: DenoiseInputs,
    schedule: Arc<FlowMatchEuler>,
    cases: SafetensorsFile,
}

fn setup() -> Setup {
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("cases/lora_cases.json")).unwrap(),
    )
    .unwrap();
    let dir = fixtures_dir().join(meta["model_dir"].as_str().unwrap());
    let fill = FluxFill::load(&ModelSource::dir(dir.clone()), CpuBackend::new()).unwrap();
    let model = fill.shared_transformer().unwrap();
    let p = &meta["params"];
    let steps = p["num_inference_steps"].as_u64().unwrap() as usize;
    let sc = SchedulerConfig::from_file(dir.join("scheduler/scheduler_config.json")).unwrap();
    let schedule = Arc::new(FlowMatchEuler::new(&sc, steps, 256).unwrap());
    let cases = SafetensorsFile::open(fixtures_dir().join("cases/lora_dev.safetensors")).unwrap();
    let opts = GenerateOptions {
        steps,
        guidance: p["guidance_scale"].as_f64().unwrap() as f32,
        seed: 0,
        max_sequence_length: p["max_sequence_length"].as_u64().unwrap() as usize,
        width: 64,
        height: 64,
    };
    let initial = cases.tensor_f32("initial_latents").unwrap();
    let inputs = fill
        .prepare_generate(
            meta["prompt"].as_str().unwrap(),
            &opts,
            Some(&initial),
            &mut Timings::default(),
        )
        .unwrap()
        .inputs;
    Setup {
        fill,
        model,
        inputs,
        schedule,
        cases,
    }
}

fn lora(name: &str, m: &FluxTransformer<CpuBackend>) -> LoraFile {
    LoraFile::open(fixtures_dir().join("loras").join(name), &m.config).unwrap()
}

/// Runs the jobs in one batch to their end; each job's latents after every step.
fn run(m: &FluxTransformer<CpuBackend>, mut jobs: Vec<Job<Tensor>>) -> Vec<Vec<Tensor>> {
    let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
    let mut out = vec![vec![]; jobs.len()];
    while !jobs[0].done() {
        let mut refs: Vec<&mut Job<Tensor>> = jobs.iter_mut().collect();
        step_batch_with(m, &mut refs, &DeviceTemplates::new(), &plan).unwrap();
        for (o, j) in out.iter_mut().zip(&jobs) {
            o.push(j.computed_latents(m).unwrap());
        }
    }
    out
}

fn job(s: &Setup, loras: Vec<LoraUse>) -> Job<Tensor> {
    let mut j = Job::new(&*s.model, &s.inputs, s.schedule.clone(), Mode::Full).unwrap();
    j.set_loras(loras);
    j
}

/// The largest difference of `got`'s steps from `want` (`[S, 1, 256, 64]` or a run),
/// relative to the largest magnitude.
fn rel_diff(got: &[Tensor], want: &[f32]) -> f32 {
    assert_eq!(got.len() * PER, want.len());
    let mut worst = 0.0f32;
    for (i, g) in got.iter().enumerate() {
        let w = &want[i * PER..(i + 1) * PER];
        let mx = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = g
            .data()
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(d / mx);
    }
    worst
}

fn flat(steps: &[Tensor]) -> Vec<f32> {
    steps
        .iter()
        .flat_map(|t| t.data().iter().copied())
        .collect()
}

#[test]
fn lora_files_map_onto_the_fused_weights_with_peft_scales() {
    let s = setup();
    let style = lora("style", &s.model);
    assert_eq!(style.modules.len(), 56, "every Linear of the transformer");
    assert_eq!(style.rank(), 4);
    for m in &style.modules {
        // lora_alpha 8 / r 4, and alpha_pattern's 2 / 4 on the single blocks' proj_out.
        let want = if matches!(m.site, Site::Single(_, SingleLinear::ProjOut)) {
            0.5
        } else {
            2.0
        };
        assert_eq!(m.scale, want, "{}", m.name);
    }
    let d = s.model.config.hidden();
    // The single blocks' fused projection is to_k | to_v | to_q | proj_mlp.
    let rows = |name: &str| {
        style
            .modules
            .iter()
            .find(|m| m.name == name)
            .unwrap()
            .rows
            .clone()
    };
    assert_eq!(rows("single_transformer_blocks.1.attn.to_k"), 0..d);
    assert_eq!(rows("single_transformer_blocks.1.attn.to_q"), 2 * d..3 * d);
    assert_eq!(rows("single_transformer_blocks.1.proj_mlp"), 3 * d..7 * d);
    assert_eq!(rows("transformer_blocks.0.attn.to_v"), 2 * d..3 * d);
    let detail = lora("detail", &s.model);
    assert_eq!(detail.modules.len(), 25, "attention only");
    assert!(detail
        .modules
        .iter()
        .all(|m| m.scale == 0.5 && m.rank() == 8));
}

#[test]
fn merged_loras_match_diffusers_fuse_lora_and_unmerge_restores_the_base() {
    let s = setup();
    let m = &*s.model;
    let (style, detail) = (lora("style", m), lora("detail", m));
    let want = |n: &str| s.cases.tensor_f32(n).unwrap();
    let base_weights: Vec<(Site, Tensor)> = Site::all(&m.config)
        .into_iter()
        .map(|site| (site, m.site_weight(site).unwrap()))
        .collect();
    for (case, set) in [
        ("style", vec![(&style, 0.8)]),
        ("mix", vec![(&style, 0.7), (&detail, 1.3)]),
    ] {
        let patched = m.merge_loras(&set).unwrap();
        assert!(m.is_merged());
        let steps = run(m, vec![job(&s, vec![])]).remove(0);
        let d = rel_diff(&steps, want(&format!("{case}_step_latents")).data());
        println!("merged {case}: worst step {d:.2e} of the largest latent ({patched} sites)");
        assert!(d <= 1e-5, "merged {case}: {d:.2e}");
        let raw = s.fill.decode_raw(steps.last().unwrap(), 64, 64).unwrap();
        let png = std::fs::read(
            fixtures_dir()
                .join("cases")
                .join(format!("lora_dev_{case}_output.png")),
        )
        .unwrap();
        let (worst, _) = from_model_space(raw.data(), 64, 64)
            .level_diff(&decode_image(&png, &s.fill.limits).unwrap());
        assert!(worst <= 1, "merged {case}: PNG levels differ by {worst}");
    }
    m.unmerge().unwrap();
    assert!(!m.is_merged());
    for (site, w) in &base_weights {
        let now = m.site_weight(*site).unwrap();
        assert!(
            now.data()
                .iter()
                .zip(w.data())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{site:?} is not restored bit for bit"
        );
    }
    let steps = run(m, vec![job(&s, vec![])]).remove(0);
    let d = rel_diff(&steps, want("base_step_latents").data());
    assert!(d <= 1e-5, "the base after unmerging: {d:.2e}");
}

#[test]
fn unmerged_loras_equal_merged_and_batch_with_other_sets() {
    let s = setup();
    let m = &*s.model;
    let (style, detail) = (lora("style", m), lora("detail", m));
    let ids = (m.add_lora(&style).unwrap(), m.add_lora(&detail).unwrap());
    let style_use = vec![LoraUse {
        id: ids.0,
        scale: 0.8,
    }];
    let mix_use = vec![
        LoraUse {
            id: ids.0,
            scale: 0.7,
        },
        LoraUse {
            id: ids.1,
            scale: 1.3,
        },
    ];
    let want = |n: &str| s.cases.tensor_f32(n).unwrap();
    // Each set alone, unmerged, against the merged model and diffusers.
    let mut alone = vec![];
    for (case, uses, set) in [
        ("style", &style_use, vec![(&style, 0.8)]),
        ("mix", &mix_use, vec![(&style, 0.7), (&detail, 1.3)]),
    ] {
        let unmerged = run(m, vec![job(&s, uses.clone())]).remove(0);
        m.merge_loras(&set).unwrap();
        let merged = run(m, vec![job(&s, vec![])]).remove(0);
        m.unmerge().unwrap();
        let d = rel_diff(&unmerged, &flat(&merged));
        let f = rel_diff(&unmerged, want(&format!("{case}_step_latents")).data());
        println!("unmerged {case}: {d:.2e} from merged, {f:.2e} from diffusers");
        assert!(d <= 1e-5, "unmerged {case} vs merged: {d:.2e}");
        assert!(f <= 1e-5, "unmerged {case} vs diffusers: {f:.2e}");
        alone.push(unmerged);
    }
    let base = run(m, vec![job(&s, vec![])]).remove(0);
    // One batch: the base, the mix, the style and the base again (LoRA rows between
    // and beside rows without).
    let batch = run(
        m,
        vec![
            job(&s, vec![]),
            job(&s, mix_use.clone()),
            job(&s, style_use.clone()),
            job(&s, vec![]),
        ],
    );
    for (i, want) in [&base, &alone[1], &alone[0], &base].into_iter().enumerate() {
        let d = rel_diff(&batch[i], &flat(want));
        println!("batch member {i}: {d:.2e} from its run alone");
        assert!(d <= 1e-6, "batch member {i}: {d:.2e}");
    }
    // The LoRA changes the result (the comparisons above are not vacuous).
    assert!(rel_diff(&alone[0], &flat(&base)) > 1e-2);
    assert!(m.remove_lora(ids.0).unwrap());
    let err = Job::new(m, &s.inputs, s.schedule.clone(), Mode::Full).map(|mut j| {
        j.set_loras(style_use.clone());
        let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
        step_batch_with(m, &mut [&mut j], &DeviceTemplates::new(), &plan)
    });
    let msg = err.unwrap().unwrap_err().to_string();
    assert!(msg.contains("not loaded"), "{msg}");
}

#[test]
fn bad_lora_files_are_refused_by_name() {
    let s = setup();
    let cfg = &s.model.config;
    let dir = tempfile::tempdir().unwrap();
    let d = cfg.hidden();
    let a = Tensor::zeros([4, d]);
    let b = Tensor::zeros([d, 4]);
    let b_short = Tensor::zeros([d - 1, 4]);
    let q = "transformer.transformer_blocks.0.attn.to_q";
    type Case<'a> = (&'a str, Vec<(String, &'a Tensor)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "text encoder",
            vec![("text_encoder.x.lora_A.weight".into(), &a)],
            "adapts a text encoder",
        ),
        (
            "kohya",
            vec![(
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight".into(),
                &a,
            )],
            "has lora_down but no lora_up",
        ),
        (
            "no up",
            vec![(format!("{q}.lora_A.weight"), &a)],
            "has lora_A but no lora_B",
        ),
        (
            "shape",
            vec![
                (format!("{q}.lora_A.weight"), &a),
                (format!("{q}.lora_B.weight"), &b_short),
            ],
            "do not fit",
        ),
        (
            "module",
            vec![
                ("transformer.nope.lora_A.weight".into(), &a),
                ("transformer.nope.lora_B.weight".into(), &b),
            ],
            "`nope` is not a Linear",
        ),
        (
            "dora",
            vec![(format!("{q}.lora_magnitude_vector"), &b)],
            "DoRA",
        ),
    ];
    for (label, tensors, want) in cases {
        let path = dir.path().join(format!("{label}.safetensors"));
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        write_safetensors(&path, &named).unwrap();
        let err = LoraFile::open(&path, cfg).err().expect(label);
        let msg = err.to_string();
        assert!(
            matches!(err, Error::BadAdapter { .. }) && msg.contains(want),
            "{label}: {msg}"
        );
        assert!(
            msg.contains(&*path.to_string_lossy()),
            "{label} names the file: {msg}"
        );
    }
    // A file without metadata has scale 1 (diffusers' convention).
    let path = dir.path().join("plain.safetensors");
    write_safetensors(
        &path,
        &[
            (&format!("{q}.lora_A.weight"), &a),
            (&format!("{q}.lora_B.weight"), &b),
        ],
    )
    .unwrap();
    let f = LoraFile::open(&path, cfg).unwrap();
    assert_eq!(f.modules.len(), 1);
    assert_eq!(f.modules[0].scale, 1.0);
    assert_eq!(f.modules[0].rows, 0..d);
}
