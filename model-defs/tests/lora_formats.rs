//! LoRA files in the kohya, XLabs and BFL key layouts against diffusers
//! (tests/fixtures/gen_lora_formats.py): three random LoRAs on the tiny FLUX.1-dev
//! transformer, run through FluxPipeline with `load_lora_weights` + `fuse_lora`.
//!
//! - each file's conversion equals diffusers' own (`lora_state_dict`, saved as a PEFT
//!   file beside it): the same `scale·B·A` at every site, within f32 rounding;
//! - merged (`merge_loras`) and unmerged (registered adapter, per-request rows) runs
//!   equal diffusers' fused run: final latents within 1e-5 of their largest magnitude
//!   and the PNG within 1 level;
//! - unknown keys, text-encoder factors and shapes that do not fit are refused by name.

use std::sync::Arc;

use denoised_models::flux::adapters::LoraUse;
use denoised_models::flux::edit::{step_batch_with, DenoiseInputs, DeviceTemplates, Job, Mode};
use denoised_models::flux::lora::{merge_site, LoraFile};
use denoised_models::flux::lora_formats::LoraFormat;
use denoised_models::flux::weights::{DoubleLinear, SingleLinear, Site};
use denoised_models::flux::{FluxConfig, FluxTransformer};
use denoised_models::pipeline::flux_fill::{FluxFill, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::pipeline::image::{decode_image, from_model_space};
use denoised_models::scheduler::{FlowMatchEuler, SchedulerConfig};
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::weights::{write_safetensors, SafetensorsFile};
use denoised_runtime::{CpuBackend, Error, Tensor};

const CASES: [&str; 3] = ["kohya", "xlabs", "bfl"];

fn meta() -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("cases/lora_formats_cases.json")).unwrap(),
    )
    .unwrap()
}

fn file(name: &str) -> std::path::PathBuf {
    fixtures_dir()
        .join("loras/formats")
        .join(format!("{name}.safetensors"))
}

fn tiny_config() -> FluxConfig {
    let dir = fixtures_dir().join("flux-dev-tiny/transformer/config.json");
    FluxConfig::from_file(dir).unwrap()
}

/// `Σ scale·B·A` of `f` at `site`: the delta merging it at scale 1 adds.
fn delta(f: &LoraFile, site: Site, cfg: &FluxConfig) -> Tensor {
    let spec = site.spec(cfg);
    let mut w = Tensor::zeros([spec.out(), spec.input]);
    merge_site(&mut w, site, &[(f, 1.0)]).unwrap();
    w
}

#[test]
fn each_layout_converts_like_diffusers() {
    let cfg = tiny_config();
    let d = cfg.hidden();
    for (case, format) in [
        ("kohya", LoraFormat::Kohya),
        ("xlabs", LoraFormat::XLabs),
        ("bfl", LoraFormat::Bfl),
    ] {
        let ours = LoraFile::open(file(case), &cfg).unwrap();
        let theirs = LoraFile::open(file(&format!("{case}_peft")), &cfg).unwrap();
        assert_eq!(ours.format, format, "{case}");
        assert_eq!(theirs.format, LoraFormat::Peft);
        let mut names: Vec<&str> = ours.modules.iter().map(|m| m.name.as_str()).collect();
        let mut want: Vec<&str> = theirs.modules.iter().map(|m| m.name.as_str()).collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "{case}: the same diffusers modules");
        let mut worst = 0.0f32;
        for site in Site::all(&cfg) {
            let (a, b) = (delta(&ours, site, &cfg), delta(&theirs, site, &cfg));
            let mx = b.data().iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = a
                .data()
                .iter()
                .zip(b.data())
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            if mx > 0.0 {
                worst = worst.max(diff / mx);
            } else {
                assert_eq!(diff, 0.0, "{case} {site:?} adapted by us only");
            }
        }
        println!(
            "{case}: {} modules, worst site delta {worst:.1e} relative",
            names.len()
        );
        assert!(worst <= 1e-6, "{case}: {worst:.2e}");
    }
    // kohya: alpha / r, with r 6 alpha 12 on one linear1 and no alpha (1) on one linear2;
    // linear1 (BFL q|k|v|mlp) lands on the single blocks' k|v|q|mlp site.
    let kohya = LoraFile::open(file("kohya"), &cfg).unwrap();
    let get = |n: &str| kohya.modules.iter().find(|m| m.name == n).unwrap();
    assert_eq!(get("transformer_blocks.0.attn.to_q").scale, 0.5);
    assert_eq!(get("single_transformer_blocks.1.attn.to_q").scale, 2.0);
    assert_eq!(get("single_transformer_blocks.2.proj_out").scale, 1.0);
    let q = get("single_transformer_blocks.0.attn.to_q");
    assert_eq!(q.site, Site::Single(0, SingleLinear::QkvMlp));
    assert_eq!(q.rows, 2 * d..3 * d);
    assert_eq!(
        get("single_transformer_blocks.0.proj_mlp").rows,
        3 * d..7 * d
    );
    assert_eq!(
        get("transformer_blocks.1.attn.add_v_proj").site,
        Site::Double(1, DoubleLinear::AddQkv)
    );
    let st = SafetensorsFile::open(file("kohya")).unwrap();
    let up = st
        .tensor_f32("lora_unet_single_blocks_0_linear1.lora_up.weight")
        .unwrap();
    assert_eq!(q.up.data(), &up.data()[0..d * 4], "q is BFL rows 0..d");
    let xlabs = LoraFile::open(file("xlabs"), &cfg).unwrap();
    assert!(xlabs.modules.iter().all(|m| m.scale == 1.0));
    assert!(!xlabs.modules.iter().any(|m| m.name.ends_with("proj_mlp")));
    // BFL: the final modulation's up halves are swapped (shift|scale -> scale|shift).
    let bfl = LoraFile::open(file("bfl"), &cfg).unwrap();
    let m = bfl
        .modules
        .iter()
        .find(|m| m.name == "norm_out.linear")
        .unwrap();
    let st = SafetensorsFile::open(file("bfl")).unwrap();
    let up = st
        .tensor_f32("diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight")
        .unwrap();
    let r = m.rank();
    assert_eq!(&m.up.data()[..d * r], &up.data()[d * r..]);
    assert_eq!(&m.up.data()[d * r..], &up.data()[..d * r]);
}

struct Setup {
    fill: FluxFill<CpuBackend>,
    model: Arc<FluxTransformer<CpuBackend>>,
    inputs: DenoiseInputs,
    schedule: Arc<FlowMatchEuler>,
    cases: SafetensorsFile,
}

fn setup() -> Setup {
    let meta = meta();
    let dir = fixtures_dir().join(meta["model_dir"].as_str().unwrap());
    let fill = FluxFill::load(&ModelSource::dir(dir.clone()), CpuBackend::new()).unwrap();
    let model = fill.shared_transformer().unwrap();
    let p = &meta["params"];
    let steps = p["num_inference_steps"].as_u64().unwrap() as usize;
    let sc = SchedulerConfig::from_file(dir.join("scheduler/scheduler_config.json")).unwrap();
    let schedule = Arc::new(FlowMatchEuler::new(&sc, steps, 256).unwrap());
    let cases =
        SafetensorsFile::open(fixtures_dir().join("cases/lora_formats_dev.safetensors")).unwrap();
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

/// The final latents of one run.
fn run(s: &Setup, loras: Vec<LoraUse>) -> Tensor {
    let m = &*s.model;
    let mut j = Job::new(m, &s.inputs, s.schedule.clone(), Mode::Full).unwrap();
    j.set_loras(loras);
    let plan = denoised_models::planner::prefix(m.num_blocks(), 0);
    while !j.done() {
        step_batch_with(m, &mut [&mut j], &DeviceTemplates::new(), &plan).unwrap();
    }
    j.computed_latents(m).unwrap()
}

/// The largest difference from `want`, relative to its largest magnitude.
fn rel_diff(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.len(), want.len());
    let mx = want.data().iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = got
        .data()
        .iter()
        .zip(want.data())
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    d / mx
}

/// The largest level difference of the decoded latents from diffusers' PNG of `case`.
fn png_levels(s: &Setup, latents: &Tensor, case: &str) -> u8 {
    let raw = s.fill.decode_raw(latents, 64, 64).unwrap();
    let png = std::fs::read(
        fixtures_dir()
            .join("cases")
            .join(format!("lora_formats_{case}_output.png")),
    )
    .unwrap();
    from_model_space(raw.data(), 64, 64)
        .level_diff(&decode_image(&png, &s.fill.limits).unwrap())
        .0
}

#[test]
fn kohya_xlabs_and_bfl_loras_match_diffusers_merged_and_unmerged() {
    let s = setup();
    let meta = meta();
    let m = &*s.model;
    let base = s.cases.tensor_f32("base_final_latents").unwrap();
    assert!(rel_diff(&run(&s, vec![]), &base) <= 1e-5, "the base run");
    for case in CASES {
        let scale = meta["cases"][case]["scale"].as_f64().unwrap() as f32;
        let f = LoraFile::open(file(case), &m.config).unwrap();
        let want = s
            .cases
            .tensor_f32(&format!("{case}_final_latents"))
            .unwrap();
        // The LoRA moves the result well beyond the tolerance (the checks bite).
        assert!(rel_diff(&want, &base) > 1e-2, "{case} changes the image");

        let sites = m.merge_loras(&[(&f, scale)]).unwrap();
        let merged = run(&s, vec![]);
        m.unmerge().unwrap();
        let id = m.add_lora(&f).unwrap();
        let unmerged = run(&s, vec![LoraUse { id, scale }]);
        assert!(m.remove_lora(id).unwrap());

        for (mode, got) in [("merged", &merged), ("unmerged", &unmerged)] {
            let d = rel_diff(got, &want);
            let levels = png_levels(&s, got, case);
            println!(
                "{case} {mode} ({sites} sites): final latents {d:.2e} of the largest, PNG {levels} level(s)"
            );
            assert!(d <= 1e-5, "{case} {mode}: latents {d:.2e}");
            assert!(levels <= 1, "{case} {mode}: PNG levels differ by {levels}");
        }
    }
}

#[test]
fn bad_layout_files_are_refused_by_name() {
    let cfg = tiny_config();
    let d = cfg.hidden();
    let dir = tempfile::tempdir().unwrap();
    let a = Tensor::zeros([4, d]);
    let up3 = Tensor::zeros([3 * d, 4]);
    let up2 = Tensor::zeros([2 * d, 4]);
    let alpha = Tensor::new(Vec::<usize>::new(), vec![2.0]).unwrap();
    let k = "lora_unet_double_blocks_0_img_attn_qkv";
    let shape_msg = [
        format!("`{k}`: lora_down is [4, {d}] and lora_up [{}, 4]", 2 * d),
        format!("`double_blocks.0.img_attn.qkv` (a [{}, {d}] Linear)", 3 * d),
        format!("wants [r, {d}] and [{}, r]", 3 * d),
    ];
    let no_up = format!("`{k}` has lora_down but no lora_up");
    type Case<'a> = (&'a str, Vec<(String, &'a Tensor)>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "kohya unknown",
            vec![
                (format!("{k}.lora_down.weight"), &a),
                (format!("{k}.lora_up.weight"), &up3),
                (
                    "lora_unet_double_blocks_0_img_attn_nope.lora_down.weight".into(),
                    &a,
                ),
                (
                    "lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight".into(),
                    &a,
                ),
                ("something_else".into(), &a),
            ],
            vec![
                "3 key(s) are not kohya LoRA factors",
                "`lora_unet_double_blocks_0_img_attn_nope.lora_down.weight`",
                "`lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight`",
                "`something_else`",
            ],
        ),
        (
            "kohya text encoder",
            vec![
                (format!("{k}.lora_down.weight"), &a),
                (format!("{k}.lora_up.weight"), &up3),
                (
                    "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight".into(),
                    &a,
                ),
            ],
            vec![
                "lora_te1_text_model_encoder_layers_0_mlp_fc1",
                "adapts a text encoder",
            ],
        ),
        (
            "kohya shape",
            vec![
                (format!("{k}.lora_down.weight"), &a),
                (format!("{k}.lora_up.weight"), &up2),
                (format!("{k}.alpha"), &alpha),
            ],
            vec![&shape_msg[0], &shape_msg[1], &shape_msg[2]],
        ),
        (
            "kohya no up",
            vec![(format!("{k}.lora_down.weight"), &a)],
            vec![&no_up],
        ),
        (
            "xlabs unknown",
            vec![
                ("double_blocks.0.processor.qkv_lora1.down.weight".into(), &a),
                ("double_blocks.0.processor.qkv_lora1.up.weight".into(), &up3),
                ("double_blocks.0.processor.mlp_lora.down.weight".into(), &a),
            ],
            vec!["1 key(s) are not XLabs LoRA factors", "processor.mlp_lora"],
        ),
        (
            "bfl control norm",
            vec![
                ("double_blocks.0.img_attn.qkv.lora_A.weight".into(), &a),
                ("double_blocks.0.img_attn.qkv.lora_B.weight".into(), &up3),
                ("double_blocks.0.img_attn.norm.query_norm.scale".into(), &a),
            ],
            vec!["query_norm.scale`: norm scales"],
        ),
        (
            "peft unknown",
            vec![
                (
                    "transformer.transformer_blocks.0.attn.to_q.lora_A.weight".into(),
                    &a,
                ),
                (
                    "transformer.transformer_blocks.0.attn.to_q.lora_B.weight".into(),
                    &a,
                ),
                ("unet.down.0.lora_A.weight".into(), &a),
            ],
            vec![
                "1 key(s) are not PEFT/diffusers LoRA factors",
                "`unet.down.0",
            ],
        ),
    ];
    for (label, tensors, wants) in cases {
        let path = dir
            .path()
            .join(format!("{}.safetensors", label.replace(' ', "_")));
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        write_safetensors(&path, &named).unwrap();
        let err = LoraFile::open(&path, &cfg).err().expect(label);
        let msg = err.to_string();
        assert!(matches!(err, Error::BadAdapter { .. }), "{label}: {msg}");
        assert!(
            msg.contains(&*path.to_string_lossy()),
            "{label} names the file: {msg}"
        );
        for w in wants {
            assert!(msg.contains(w), "{label}: `{w}` not in: {msg}");
        }
    }
}

/// The factors diffusers 0.42.1 drops from kohya files without a word (the embedders'
/// and the final layer's, left without the `transformer.` prefix by its converter)
/// apply here, at `alpha / r`, exactly as the same factors in the BFL layout.
#[test]
fn kohya_embedders_and_final_layer_apply_like_the_bfl_layout() {
    let cfg = tiny_config();
    let d = cfg.hidden();
    let dir = tempfile::tempdir().unwrap();
    let seq = |shape: [usize; 2], k: f32| {
        let n = shape[0] * shape[1];
        Tensor::new(shape, (0..n).map(|i| (i as f32 * k).sin()).collect()).unwrap()
    };
    let mods = [
        (
            "final_layer.adaLN_modulation.1",
            seq([4, d], 0.37),
            seq([2 * d, 4], 0.11),
        ),
        ("img_in", seq([4, cfg.in_channels], 0.53), seq([d, 4], 0.29)),
        (
            "guidance_in.in_layer",
            seq([4, 256], 0.71),
            seq([d, 4], 0.13),
        ),
    ];
    let alpha = Tensor::new(Vec::<usize>::new(), vec![2.0]).unwrap();
    let (mut kohya, mut bfl): (Vec<(String, &Tensor)>, Vec<(String, &Tensor)>) = (vec![], vec![]);
    for (name, down, up) in &mods {
        let k = format!("lora_unet_{}", name.replace('.', "_"));
        kohya.push((format!("{k}.lora_down.weight"), down));
        kohya.push((format!("{k}.lora_up.weight"), up));
        kohya.push((format!("{k}.alpha"), &alpha));
        bfl.push((format!("diffusion_model.{name}.lora_A.weight"), down));
        bfl.push((format!("diffusion_model.{name}.lora_B.weight"), up));
    }
    let open = |label: &str, tensors: &[(String, &Tensor)]| {
        let path = dir.path().join(format!("{label}.safetensors"));
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        write_safetensors(&path, &named).unwrap();
        LoraFile::open(&path, &cfg).unwrap()
    };
    let (k, b) = (open("kohya", &kohya), open("bfl", &bfl));
    assert_eq!((k.format, b.format), (LoraFormat::Kohya, LoraFormat::Bfl));
    assert_eq!(k.modules.len(), 3);
    for (x, y) in k.modules.iter().zip(&b.modules) {
        assert_eq!((&x.name, x.site, &x.rows), (&y.name, y.site, &y.rows));
        assert_eq!((x.down.data(), x.up.data()), (y.down.data(), y.up.data()));
        assert_eq!((x.scale, y.scale), (0.5, 1.0), "{}", x.name);
    }
    let names: Vec<&str> = k.modules.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "x_embedder",
            "time_text_embed.guidance_embedder.linear_1",
            "norm_out.linear"
        ]
    );
    // norm_out.linear is diffusers' scale|shift: BFL rows d..2d first.
    let up = &mods[0].2;
    assert_eq!(&k.modules[2].up.data()[..d * 4], &up.data()[d * 4..]);
}
