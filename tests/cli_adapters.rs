//! `denoised generate`, `edit` and `template capture` with adapters, as a user runs
//! them: LoRAs (merged and unmerged, against diffusers), `bench profile-lora`, true CFG and
//! ControlNets through the CLI.

mod common;

use common::{case, cli::*};
use denoised_models::pipeline::image::Rgb8;

#[test]
fn loras_through_the_cli() {
    // diffusers' fused run of two LoRAs (tests/fixtures/gen_lora_fixtures.py), merged
    // and unmerged, on the CPU and unmerged on the emulated GPU backend in f32.
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case("lora_cases.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join(meta["model_dir"].as_str().unwrap());
    let loras = fixtures().join("loras");
    let style = format!("{}:0.7", s(&loras.join("style")));
    let detail = format!(
        "{}:1.3",
        s(&loras.join("detail/pytorch_lora_weights.safetensors"))
    );
    let want = png_file(&case("lora_dev_mix_output.png"));
    let noise = case("lora_dev.safetensors");
    for (mode, device) in [
        ("merged", &["--device", "cpu"][..]),
        ("unmerged", &["--device", "cpu"]),
        ("unmerged", &["--device", "emu", "--dtype", "f32"]),
    ] {
        let out = dir.path().join(format!("{mode}.png"));
        let mut args = vec![
            "generate",
            "--model",
            s(&model),
            "--prompt",
            meta["prompt"].as_str().unwrap(),
            "--steps",
            "6",
            "--guidance",
            "3.5",
            "--max-sequence-length",
            "32",
            "--height",
            "64",
            "--width",
            "64",
            "--noise",
            s(&noise),
            "--lora",
            &style,
            "--lora",
            &detail,
            "--lora-mode",
            mode,
            "--out",
            s(&out),
        ];
        args.extend_from_slice(device);
        let log = ok(&args);
        assert!(
            log.contains(&format!(
                "LoRA: 2 {}",
                if mode == "merged" {
                    "merged"
                } else {
                    "uploaded"
                }
            )),
            "{log}"
        );
        let (worst, off) = png_file(&out).level_diff(&want);
        println!(
            "LoRA {mode} {device:?} vs diffusers: max level diff {worst}, {off} values differ"
        );
        assert!(worst <= 1, "{mode} {device:?}: max level diff {worst}");
    }

    // A template captured with a LoRA serves only edits with the same LoRA set. The
    // attention-only `detail` LoRA fits the built-in Fill model's attention; `style`
    // adapts the embedders of a 64-channel model, which the Fill model's are not.
    let t = dir.path().join("tpl");
    let input = case("e2e_input.png");
    let common = |v: &mut Vec<String>| {
        for a in [
            "--model",
            "builtin",
            "--steps",
            "3",
            "--max-sequence-length",
            "32",
        ] {
            v.push(a.into());
        }
    };
    let detail_half = format!("{}:0.5", s(&loras.join("detail")));
    let mut capture: Vec<String> = vec!["template".into(), "capture".into()];
    common(&mut capture);
    capture
        .extend(["--image", s(&input), "--out", s(&t), "--lora", &detail_half].map(String::from));
    ok(&capture.iter().map(String::as_str).collect::<Vec<_>>());
    let edited = dir.path().join("edited.png");
    let mut edit: Vec<String> = vec!["edit".into()];
    common(&mut edit);
    edit.extend(
        [
            "--template",
            s(&t),
            "--mask",
            s(&case("e2e_mask.png")),
            "--out",
            s(&edited),
        ]
        .map(String::from),
    );
    let args = |extra: &[&str]| -> Vec<String> {
        edit.iter()
            .cloned()
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let plain = args(&[]);
    fails(
        &plain.iter().map(String::as_str).collect::<Vec<_>>(),
        "the template was captured with LoRAs lora-",
    );
    let other = args(&["--lora", &format!("{}:0.6", s(&loras.join("detail")))]);
    fails(
        &other.iter().map(String::as_str).collect::<Vec<_>>(),
        "this edit runs with LoRAs",
    );
    for mode in ["merged", "unmerged"] {
        let same = args(&["--lora", &detail_half, "--lora-mode", mode]);
        let log = ok(&same.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(log.contains("mask-aware edit:"), "{log}");
    }
    let out = dir.path().join("x.png");
    fails(
        &[
            "generate",
            "--model",
            "builtin:t2i",
            "--prompt",
            "a",
            "--steps",
            "1",
            "--lora",
            &format!("{}:x", s(&loras.join("style"))),
            "--out",
            s(&out),
        ],
        "No such file",
    );
    let mut bad: Vec<String> = vec!["edit".into()];
    common(&mut bad);
    bad.extend(
        [
            "--image",
            s(&input),
            "--mask",
            s(&case("e2e_mask.png")),
            "--out",
            s(&out),
            "--lora",
            s(&loras.join("style")),
        ]
        .map(String::from),
    );
    fails(
        &bad.iter().map(String::as_str).collect::<Vec<_>>(),
        "do not fit",
    );
}

#[test]
fn profile_lora_finds_k_and_records_it_beside_the_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let lora = dir.path().join("style");
    std::fs::create_dir(&lora).unwrap();
    std::fs::copy(
        fixtures().join("loras/style/pytorch_lora_weights.safetensors"),
        lora.join("pytorch_lora_weights.safetensors"),
    )
    .unwrap();
    let model = fixtures().join("flux-dev-tiny");
    let spec = format!("{}:0.8", s(&lora));
    let out = ok(&[
        "bench",
        "profile-lora",
        "--model",
        s(&model),
        "--lora",
        &spec,
        "--steps",
        "6",
        "--size",
        "64",
        "--max-sequence-length",
        "32",
        "--write",
    ]);
    let line: serde_json::Value =
        serde_json::from_str(out.lines().find(|l| l.starts_with('{')).unwrap()).unwrap();
    let sim: Vec<f64> = line["similarity"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let k = line["k"].as_u64().unwrap() as usize;
    assert_eq!(sim.len(), 6);
    assert_eq!(line["scale"], 0.8);
    // K is the first step below 0.99, and the steps before it are above.
    assert!(
        sim[k] < 0.99 && sim[..k].iter().all(|&s| s >= 0.99),
        "{sim:?} k {k}"
    );
    let bal: serde_json::Value =
        serde_json::from_slice(&std::fs::read(lora.join("bal.json")).unwrap()).unwrap();
    let fp = line["model"].as_str().unwrap();
    assert_eq!(bal[fp]["k"].as_u64(), Some(k as u64), "{bal}");
}

#[test]
fn true_cfg_through_the_cli() {
    // diffusers' FluxPipeline with negative_prompt and true_cfg_scale 4
    // (tests/fixtures/gen_cfg_fixtures.py), on the CPU and the emulated GPU in f32.
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case("cfg_cases.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join(meta["model_dir"].as_str().unwrap());
    let noise = case("cfg_dev.safetensors");
    let want = png_file(&case("cfg_dev_output.png"));
    for device in [
        &["--device", "cpu"][..],
        &["--device", "emu", "--dtype", "f32"],
    ] {
        let out = dir.path().join("cfg.png");
        let mut args = vec![
            "generate",
            "--model",
            s(&model),
            "--prompt",
            meta["prompt"].as_str().unwrap(),
            "--negative-prompt",
            meta["negative_prompt"].as_str().unwrap(),
            "--true-cfg-scale",
            "4",
            "--steps",
            "6",
            "--max-sequence-length",
            "32",
            "--height",
            "64",
            "--width",
            "64",
            "--noise",
            s(&noise),
            "--out",
            s(&out),
        ];
        args.extend_from_slice(device);
        ok(&args);
        let (worst, off) = png_file(&out).level_diff(&want);
        println!("true CFG {device:?} vs diffusers: max level diff {worst}, {off} values differ");
        assert!(worst <= 1, "{device:?}: {worst}");
    }
}

#[test]
fn controlnets_through_the_cli() {
    // The in-process path the daemon's streamed service equals byte for byte
    // (tests/serve_controlnet.rs); against diffusers in model-defs/tests/controlnet_reference.rs.
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join("flux-dev-tiny");
    let nets = fixtures().join("controlnets");
    let canny = format!(
        "{}:{}:0.7",
        s(&nets.join("canny-tiny")),
        s(&nets.join("control_a.png"))
    );
    let depth = format!(
        "{}:{}:0.5",
        s(&nets.join("depth-tiny")),
        s(&nets.join("control_b.png"))
    );
    let run = |name: &str, extra: &[&str]| -> Rgb8 {
        let out = dir.path().join(name);
        let mut args = vec![
            "generate",
            "--model",
            s(&model),
            "--prompt",
            "a red fox in the snow",
            "--steps",
            "4",
            "--height",
            "64",
            "--width",
            "64",
            "--max-sequence-length",
            "32",
            "--out",
            s(&out),
        ];
        args.extend(extra);
        ok(&args);
        png_file(&out)
    };
    let plain = run("plain.png", &[]);
    let cpu = run("cpu.png", &["--controlnet", &canny, "--controlnet", &depth]);
    assert_ne!(cpu.data, plain.data, "the ControlNets change the image");
    // On the emulated GPU in f32: the transformer takes the residuals on its device.
    let emu = run(
        "emu.png",
        &[
            "--controlnet",
            &canny,
            "--controlnet",
            &depth,
            "--device",
            "emu",
            "--dtype",
            "f32",
        ],
    );
    let (levels, _) = emu.level_diff(&cpu);
    println!("ControlNets on the emulated GPU (f32): within {levels} levels of the CPU");
    assert!(levels <= 1, "{levels} levels");

    let out = dir.path().join("x.png");
    let fails_with = |spec: &str, needle: &str| {
        fails(
            &[
                "generate",
                "--model",
                s(&model),
                "--prompt",
                "x",
                "--steps",
                "2",
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                s(&out),
                "--controlnet",
                spec,
            ],
            needle,
        )
    };
    fails_with("nodir", "expected DIR:IMAGE[:SCALE]");
    fails_with(
        &format!("{}:/nonexistent.png", s(&nets.join("canny-tiny"))),
        "/nonexistent.png",
    );
    let small = solid_png(dir.path(), "small.png", 32, 32, 128);
    fails_with(
        &format!("{}:{}", s(&nets.join("canny-tiny")), s(&small)),
        "the output is 64x64",
    );
    let not_a_net = format!(
        "{}:{}",
        s(&fixtures().join("loras")),
        s(&nets.join("control_a.png"))
    );
    fails_with(&not_a_net, "config.json");
}
