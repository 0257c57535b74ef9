//! `denoised edit`, `denoised template capture` and `denoised generate` as a user runs
//! them: real processes, real files. Covers equality with diffusers through the CLI
//! (FluxFillPipeline and FluxPipeline), template capture and
//! mask-aware edits (paste-back, the identity invariant end to end), and clear errors
//! with a non-zero exit for bad inputs.

mod common;

use std::path::{Path, PathBuf};

use common::{case, cli::*, LIM};
use denoised_models::pipeline::image::{decode_mask, encode_png, Rgb8};

const PROMPT: &str = "a blue ceramic teapot on a wooden table";

#[test]
fn edit_matches_diffusers_through_the_cli() {
    // On the CPU, and with every model (CLIP, T5, VAE, transformer) on the emulated GPU
    // backend in f32.
    for device in [
        &["--device", "cpu"][..],
        &["--device", "emu", "--dtype", "f32"],
    ] {
        edit_matches_diffusers_on(device);
    }
}

fn edit_matches_diffusers_on(device: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.png");
    let model = fixtures().join("flux-fill-tiny");
    let (image, mask, noise) = (
        case("e2e_input.png"),
        case("e2e_mask.png"),
        case("e2e.safetensors"),
    );
    let mut args = vec![
        "edit",
        "--model",
        s(&model),
        "--image",
        s(&image),
        "--mask",
        s(&mask),
        "--prompt",
        PROMPT,
        "--steps",
        "4",
        "--guidance",
        "30",
        "--max-sequence-length",
        "32",
        "--noise",
        s(&noise),
        "--no-paste-back",
        "--out",
        s(&out),
    ];
    args.extend_from_slice(device);
    ok(&args);
    let (got, want) = (png_file(&out), png_file(&case("e2e_output.png")));
    let (worst, off) = got.level_diff(&want);
    println!(
        "CLI {device:?} vs diffusers: max level diff {worst}, {off} of {} values differ",
        got.data.len()
    );
    assert!(worst <= 1, "max level diff {worst}");
}

#[test]
fn instruction_edit_matches_diffusers_flux_kontext_through_the_cli() {
    // A FLUX.1 Kontext directory (tests/fixtures/gen_kontext_fixtures.py) edited without
    // a mask: the directory and the BFL single file of its transformer, on the CPU and
    // with every model on the emulated GPU backend in f32.
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case("kontext_cases.json")).unwrap()).unwrap();
    let c = &cases["cases"]["kontext_instruct"];
    let p = &c["params"];
    let model = fixtures().join(c["model_dir"].as_str().unwrap());
    let bfl = fixtures().join("formats/flux1-kontext-tiny.safetensors");
    let (steps, guidance, seq, area) = (
        p["num_inference_steps"].to_string(),
        p["guidance_scale"].to_string(),
        p["max_sequence_length"].to_string(),
        p["max_area"].to_string(),
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("kontext.png");
    let want = png_file(&case("kontext_instruct_output.png"));
    let (image, noise) = (case("e2e_input.png"), case(c["file"].as_str().unwrap()));
    for extra in [
        &["--device", "cpu"][..],
        &["--device", "emu", "--dtype", "f32"],
        &["--device", "cpu", "--transformer", s(&bfl)],
    ] {
        let mut args = vec![
            "edit",
            "--model",
            s(&model),
            "--image",
            s(&image),
            "--prompt",
            cases["prompt"].as_str().unwrap(),
            "--steps",
            &steps,
            "--guidance",
            &guidance,
            "--max-sequence-length",
            &seq,
            "--max-area",
            &area,
            "--no-auto-resize",
            // diffusers' noise as the fixture keeps it, [1, C, h, w], packed by the CLI.
            "--noise",
            s(&noise),
            "--out",
            s(&out),
        ];
        args.extend_from_slice(extra);
        let said = ok(&args);
        assert!(
            said.contains("instruction edit: reference 64x64, output 64x64"),
            "{said}"
        );
        let (worst, off) = png_file(&out).level_diff(&want);
        println!("kontext {extra:?} vs diffusers: max level diff {worst}, {off} values differ");
        assert!(worst <= 1, "{extra:?}: max level diff {worst}");
    }
    // With a mask: FluxKontextInpaintPipeline (strength 0.75, no paste-back, as the
    // fixture ran it).
    let c = &cases["cases"]["kontext_inpaint"];
    let (noise, mask) = (case(c["file"].as_str().unwrap()), case("e2e_mask.png"));
    let strength = c["params"]["strength"].to_string();
    let mut args = vec!["edit", "--model", s(&model), "--image", s(&image)];
    args.extend(["--mask", s(&mask), "--strength", &strength]);
    args.extend([
        "--prompt",
        cases["prompt"].as_str().unwrap(),
        "--steps",
        &steps,
    ]);
    args.extend(["--guidance", &guidance, "--max-sequence-length", &seq]);
    args.extend(["--noise", s(&noise), "--no-paste-back", "--out", s(&out)]);
    let said = ok(&args);
    assert!(
        said.contains("masked instruction edit: 64x64, strength 0.75"),
        "{said}"
    );
    let (worst, off) = png_file(&out).level_diff(&png_file(&case("kontext_inpaint_output.png")));
    println!("kontext inpaint vs diffusers: max level diff {worst}, {off} values differ");
    assert!(worst <= 1, "masked: max level diff {worst}");
    // With a separate reference image (diffusers' image_reference, at its own size).
    let c = &cases["cases"]["kontext_inpaint_reference"];
    let (noise, reference) = (
        case(c["file"].as_str().unwrap()),
        case("kontext_reference.png"),
    );
    let n = args.iter().position(|a| *a == "--noise").unwrap();
    args[n + 1] = s(&noise);
    args.extend(["--image-reference", s(&reference), "--no-auto-resize"]);
    let said = ok(&args);
    assert!(
        said.contains("reference image: 48x80 read at 48x80"),
        "{said}"
    );
    let want = png_file(&case("kontext_inpaint_reference_output.png"));
    let (worst, off) = png_file(&out).level_diff(&want);
    println!("kontext inpaint with a reference vs diffusers: max level diff {worst}, {off} values differ");
    assert!(
        worst <= 1,
        "masked with a reference: max level diff {worst}"
    );
    // A FLUX.1 Fill model needs the mask, and says what an edit without one needs.
    fails(
        &[
            "edit",
            "--image",
            s(&image),
            "--prompt",
            "a",
            "--out",
            s(&out),
        ],
        "needs a FLUX.1 Kontext model",
    );
}

#[test]
fn generate_matches_diffusers_flux_pipeline_through_the_cli() {
    // FLUX.1-dev and -schnell layouts (tests/fixtures/gen_t2i_fixtures.py), on the CPU
    // and with every model on the emulated GPU backend in f32.
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case("t2i_cases.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for variant in ["dev", "schnell"] {
        let c = &cases["cases"][format!("t2i_{variant}")];
        let p = &c["params"];
        let model = fixtures().join(c["model_dir"].as_str().unwrap());
        let noise = case(c["file"].as_str().unwrap());
        let (steps, guidance, seq) = (
            p["num_inference_steps"].to_string(),
            p["guidance_scale"].to_string(),
            p["max_sequence_length"].to_string(),
        );
        for device in [
            &["--device", "cpu"][..],
            &["--device", "emu", "--dtype", "f32"],
        ] {
            let out = dir.path().join(format!("{variant}.png"));
            let mut args = vec![
                "generate",
                "--model",
                s(&model),
                "--prompt",
                // The case names its prompt by key.
                cases["prompts"][p["prompt"].as_str().unwrap()]
                    .as_str()
                    .unwrap(),
                "--steps",
                &steps,
                "--guidance",
                &guidance,
                "--max-sequence-length",
                &seq,
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
            let want = png_file(&case(&format!("t2i_{variant}_output.png")));
            let (worst, off) = png_file(&out).level_diff(&want);
            println!(
                "generate {variant} {device:?} vs diffusers: max level diff {worst}, {off} values differ"
            );
            assert!(worst <= 1, "{variant} {device:?}: max level diff {worst}");
        }
    }
    // Each pipeline refuses the other's requests, saying what to serve instead.
    let out = dir.path().join("x.png");
    fails(
        &[
            "generate",
            "--model",
            "builtin",
            "--prompt",
            "a",
            "--out",
            s(&out),
        ],
        "does not generate from a prompt alone",
    );
    let img = solid_png(dir.path(), "i.png", 64, 64, 128);
    fails(
        &[
            "edit",
            "--model",
            "builtin:t2i",
            "--image",
            s(&img),
            "--mask",
            s(&img),
            "--out",
            s(&out),
        ],
        "does not edit them",
    );
    fails(
        &[
            "generate",
            "--prompt",
            "a",
            "--height",
            "63",
            "--width",
            "64",
            "--out",
            s(&out),
        ],
        "not a multiple of",
    );
}

#[test]
fn template_capture_and_mask_aware_edits() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("tpl");
    let input = case("e2e_input.png");
    let out = ok(&[
        "template",
        "capture",
        "--model",
        "builtin",
        "--image",
        s(&input),
        "--steps",
        "4",
        "--max-sequence-length",
        "32",
        "--out",
        s(&t),
        "--timings",
    ]);
    assert!(out.contains("tokenize_s"), "{out}");
    for f in [
        "template.json",
        "cache.bin",
        "image.png",
        "reconstruction.png",
    ] {
        assert!(t.join(f).exists(), "{f} missing");
    }

    // A mask-aware edit: outside the mask, the input pixels exactly; inside, new ones.
    let edited = dir.path().join("edited.png");
    let log = ok(&[
        "edit",
        "--model",
        "builtin",
        "--template",
        s(&t),
        "--mask",
        s(&case("e2e_mask.png")),
        "--prompt",
        "a red mug",
        "--max-sequence-length",
        "32",
        "--seed",
        "7",
        "--out",
        s(&edited),
    ]);
    assert!(
        log.contains("mask-aware edit:") && log.contains("of 256 tokens active"),
        "{log}"
    );
    // Which VAE passes ran (the sparse VAE, --sparse-vae auto by default).
    assert!(
        log.contains("VAE: encode ") && log.contains("(--sparse-vae auto)"),
        "{log}"
    );
    let (img, res) = (png_file(&input), png_file(&edited));
    let mask = decode_mask(
        &std::fs::read(case("e2e_mask.png")).unwrap(),
        64,
        64,
        &LIM,
        Default::default(),
    )
    .unwrap();
    let mut changed_inside = 0;
    for i in 0..64 * 64 {
        let (a, b) = (&res.data[i * 3..i * 3 + 3], &img.data[i * 3..i * 3 + 3]);
        if mask.data[i] {
            changed_inside += (a != b) as usize;
        } else {
            assert_eq!(a, b, "pixel {i} outside the mask changed");
        }
    }
    assert!(
        changed_inside > 100,
        "only {changed_inside} masked pixels changed"
    );

    // Identity end to end: an edit that computes no token reproduces the capture.
    let empty = solid_png(dir.path(), "empty.png", 64, 64, 0);
    let same = dir.path().join("same.png");
    let log = ok(&[
        "edit",
        "--model",
        "builtin",
        "--template",
        s(&t),
        "--mask",
        s(&empty),
        "--max-sequence-length",
        "32",
        "--no-paste-back",
        "--out",
        s(&same),
    ]);
    assert!(log.contains("0 of 256 tokens active"), "{log}");
    assert_eq!(png_file(&same), png_file(&t.join("reconstruction.png")));

    // The same with a Y-mode template (block outputs cached): half the bytes, and an
    // edit that computes no token still reproduces the capture.
    let ty = dir.path().join("tpl_y");
    ok(&[
        "template",
        "capture",
        "--model",
        "builtin",
        "--image",
        s(&input),
        "--steps",
        "4",
        "--max-sequence-length",
        "32",
        "--cache-mode",
        "y",
        "--out",
        s(&ty),
    ]);
    let size = |d: &Path| std::fs::metadata(d.join("cache.bin")).unwrap().len() as f64;
    assert!(size(&ty) < 0.6 * size(&t), "{} vs {}", size(&ty), size(&t));
    let header = std::fs::read_to_string(ty.join("template.json")).unwrap();
    assert!(header.contains("\"cache_mode\": \"y\""), "{header}");
    let same_y = dir.path().join("same_y.png");
    ok(&[
        "edit",
        "--model",
        "builtin",
        "--template",
        s(&ty),
        "--mask",
        s(&empty),
        "--max-sequence-length",
        "32",
        "--no-paste-back",
        "--out",
        s(&same_y),
    ]);
    assert_eq!(png_file(&same_y), png_file(&ty.join("reconstruction.png")));
    assert_eq!(
        png_file(&ty.join("reconstruction.png")),
        png_file(&t.join("reconstruction.png"))
    );

    // Steps that differ from the template's are refused.
    fails(
        &[
            "edit",
            "--model",
            "builtin",
            "--template",
            s(&t),
            "--mask",
            s(&empty),
            "--steps",
            "8",
            "--out",
            s(&same),
        ],
        "differs from the template",
    );
    // A template of another model is refused.
    let model = fixtures().join("flux-fill-tiny");
    fails(
        &[
            "edit",
            "--model",
            s(&model),
            "--template",
            s(&t),
            "--mask",
            s(&empty),
            "--max-sequence-length",
            "32",
            "--out",
            s(&same),
        ],
        "captured by model",
    );
    // Another resolution is refused.
    let small = solid_png(dir.path(), "small.png", 32, 32, 90);
    let small_mask = solid_png(dir.path(), "small_mask.png", 32, 32, 255);
    fails(
        &[
            "edit",
            "--model",
            "builtin",
            "--template",
            s(&t),
            "--image",
            s(&small),
            "--mask",
            s(&small_mask),
            "--out",
            s(&same),
        ],
        "template is for 256 tokens",
    );
    // A corrupted cache is refused.
    let data = t.join("cache.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[12345] ^= 0x10;
    std::fs::write(&data, bytes).unwrap();
    fails(
        &[
            "edit",
            "--model",
            "builtin",
            "--template",
            s(&t),
            "--mask",
            s(&empty),
            "--out",
            s(&same),
        ],
        "checksum mismatch",
    );
}

/// The fixture image doubled to 128x128 (see `common::doubled_image_b64`), as a file.
fn doubled_input(dir: &Path) -> PathBuf {
    let path = dir.join("big.png");
    std::fs::write(&path, common::unb64(&common::doubled_image_b64())).unwrap();
    path
}

/// A capture stores the template's VAE traces (`vae.bin`); an edit's sparse passes
/// read them (`sparse`) instead of recording them with a dense pass of the template
/// (`sparse_traced`, what an edit of a template without them does), with the same
/// image bit for bit.
#[test]
fn a_capture_stores_the_vae_traces_that_edits_run_sparse_against() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("tpl");
    let common = ["--model", "builtin", "--max-sequence-length", "32"];
    let capture = |sparse: &str| {
        let mut a = vec!["template", "capture", "--image"];
        let input = doubled_input(dir.path());
        let input = s(&input).to_string();
        a.push(&input);
        a.extend(["--steps", "3", "--sparse-vae", sparse, "--out", s(&t)]);
        a.extend(common);
        ok(&a)
    };
    let log = capture("auto");
    assert!(log.contains("VAE traces: "), "{log}");
    assert!(t.join("vae.bin").exists());
    // An 8x8 box: 4 of 1024 tokens.
    let mut m = Rgb8 {
        width: 128,
        height: 128,
        data: vec![0; 128 * 128 * 3],
    };
    for y in 40..48 {
        m.data[(y * 128 + 48) * 3..(y * 128 + 56) * 3].fill(255);
    }
    let mask = dir.path().join("mask.png");
    std::fs::write(&mask, encode_png(&m).unwrap()).unwrap();
    let edit = |out: &str| {
        let out = dir.path().join(out);
        let mut a = vec![
            "edit",
            "--template",
            s(&t),
            "--mask",
            s(&mask),
            "--seed",
            "4",
        ];
        a.extend(["--prompt", "x", "--out", s(&out)]);
        a.extend(common);
        (ok(&a), png_file(&out))
    };
    let (log, stored) = edit("stored.png");
    assert!(
        log.contains(r#"VAE: encode "sparse", decode "sparse""#),
        "{log}"
    );
    std::fs::remove_file(t.join("vae.bin")).unwrap();
    let (log, recorded) = edit("recorded.png");
    assert!(
        log.contains(r#"VAE: encode "sparse_traced", decode "sparse_traced""#),
        "{log}"
    );
    let diff: Vec<(usize, u8)> = stored
        .data
        .iter()
        .zip(&recorded.data)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, (a, b))| (i / 3, a.abs_diff(*b)))
        .collect();
    assert!(
        diff.is_empty(),
        "stored and recorded traces give different images at {} values, first {:?}",
        diff.len(),
        &diff[..diff.len().min(8)]
    );
    // `--sparse-vae off` captures store none.
    capture("off");
    assert!(!t.join("vae.bin").exists());
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.png");
    let input = case("e2e_input.png");
    let mask = case("e2e_mask.png");
    let base = |img: &Path, m: &Path| -> Vec<String> {
        [
            "edit",
            "--model",
            "builtin",
            "--image",
            s(img),
            "--mask",
            s(m),
            "--steps",
            "2",
            "--max-sequence-length",
            "32",
            "--out",
            s(&out),
        ]
        .map(String::from)
        .to_vec()
    };
    let run_fail = |args: Vec<String>, needle: &str| {
        fails(&args.iter().map(|a| a.as_str()).collect::<Vec<_>>(), needle)
    };

    let bytes = std::fs::read(&input).unwrap();
    let trunc = dir.path().join("trunc.png");
    std::fs::write(&trunc, &bytes[..bytes.len() / 2]).unwrap();
    run_fail(base(&trunc, &mask), "corrupt or truncated");

    let jpg = dir.path().join("bad.jpg");
    std::fs::write(
        &jpg,
        [0xFF, 0xD8, 0xFF, 0xE0, 0, 16, b'J', b'F', b'I', b'F', 0, 1],
    )
    .unwrap();
    run_fail(base(&jpg, &mask), "image");

    let text = dir.path().join("mask.txt");
    std::fs::write(&text, "this is not an image").unwrap();
    run_fail(base(&input, &text), "mask: not a PNG or JPEG");

    // (A mask of the image's aspect is resized to it; another is refused.)
    let small = solid_png(dir.path(), "small.png", 32, 16, 0);
    run_fail(base(&input, &small), "mask is 32x16 but the image is 64x64");

    let odd = solid_png(dir.path(), "odd.png", 30, 32, 0);
    run_fail(base(&odd, &mask), "not a multiple of 4 pixels");

    // A well-formed PNG header that claims 0 x 0 pixels (IHDR CRC recomputed).
    let mut zero = std::fs::read(&small).unwrap();
    zero[16..24].copy_from_slice(&[0; 8]);
    let crc = crc32fast::hash(&zero[12..29]);
    zero[29..33].copy_from_slice(&crc.to_be_bytes());
    let zero_path = dir.path().join("zero.png");
    std::fs::write(&zero_path, zero).unwrap();
    run_fail(base(&zero_path, &mask), "image:");
    let (_, _, stderr) = denoised(
        &base(&zero_path, &mask)
            .iter()
            .map(|a| a.as_str())
            .collect::<Vec<_>>(),
    );
    println!("zero-sized image: {stderr}");

    let mut big = base(&input, &mask);
    big.extend(["--max-pixels".to_string(), "1000".to_string()]);
    run_fail(big, "exceeds the limit of 1000");

    run_fail(base(&dir.path().join("missing.png"), &mask), "missing.png");

    // A prompt longer than the encoders take is truncated, as diffusers does, and the
    // edit succeeds.
    let long = "a very long prompt ".repeat(100);
    let mut args = base(&input, &mask);
    args.extend(["--prompt".to_string(), long]);
    let (success, _, stderr) = denoised(&args.iter().map(|a| a.as_str()).collect::<Vec<_>>());
    assert!(success, "{stderr}");
    assert!(png_file(&out).width == 64);
}

/// `bench pipeline --device` times every stage wherever the models are placed: on the
/// CPU and with every model on the emulated GPU backend (whose timings mean nothing;
/// this checks that each stage ran there and was timed).
#[test]
fn bench_pipeline_times_every_stage_on_any_device() {
    for (device, dtype) in [("cpu", "f32"), ("emu", "bf16")] {
        let (success, stdout, stderr) = denoised(&[
            "bench",
            "pipeline",
            "--device",
            device,
            "--dtype",
            dtype,
            "--size",
            "64",
            "--steps",
            "2",
            "--max-sequence-length",
            "32",
        ]);
        assert!(success, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(
            (v["device"].as_str(), v["dtype"].as_str()),
            (Some(device), Some(dtype)),
            "{v}"
        );
        for stage in ["encode_text_s", "vae_encode_s", "denoise_s", "vae_decode_s"] {
            let secs = v[stage].as_f64().unwrap_or(0.0);
            assert!(secs > 0.0, "{stage} in {v}");
        }
        println!("{device}: {v}");
    }
}

/// `--preview FILE` writes the image as it denoises (one pixel per latent pixel: 32x32
/// for the tiny model's 64x64 at its VAE's factor 2) and changes nothing in the result;
/// a preview of an unknown kind of file is refused with a clear error.
#[test]
fn the_preview_file_is_written_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (out, with, preview) = (
        dir.path().join("out.png"),
        dir.path().join("with.png"),
        dir.path().join("preview.jpg"),
    );
    let (image, mask) = (case("e2e_input.png"), case("e2e_mask.png"));
    let base = [
        "edit",
        "--image",
        s(&image),
        "--mask",
        s(&mask),
        "--prompt",
        PROMPT,
        "--steps",
        "4",
    ];
    ok(&[&base[..], &["--out", s(&out)]].concat());
    ok(&[&base[..], &["--out", s(&with), "--preview", s(&preview)]].concat());
    assert_eq!(
        png_file(&out),
        png_file(&with),
        "a preview changes the result"
    );
    let p = image::open(&preview).unwrap();
    assert_eq!((p.width(), p.height()), (32, 32));
    let bad = dir.path().join("preview.gif");
    fails(
        &[&base[..], &["--out", s(&out), "--preview", s(&bad)]].concat(),
        ".png or .jpg",
    );
}

/// fp8 transformer weights on the emulated GPU, as a user runs an edit with them: the
/// edit differs from the bf16 one (the weights and GEMM inputs are rounded to E4M3,
/// per tensor by default and per channel when asked) and, pasted back, leaves every
/// pixel outside the mask as the input's.
#[test]
fn an_fp8_edit_on_the_emulator_differs_from_bf16_and_keeps_the_unmasked_pixels() {
    let dir = tempfile::tempdir().unwrap();
    let (input, mask_png) = (case("e2e_input.png"), case("e2e_mask.png"));
    let edit = |name: &str, weights: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec![
            "edit",
            "--model",
            "builtin",
            "--device",
            "emu",
            "--dtype",
            "bf16",
            "--image",
            s(&input),
            "--mask",
            s(&mask_png),
            "--prompt",
            PROMPT,
            "--steps",
            "3",
            "--max-sequence-length",
            "32",
            "--seed",
            "5",
            "--out",
            s(&out),
        ];
        args.extend_from_slice(weights);
        ok(&args);
        png_file(&out)
    };
    let bf16 = edit("bf16.png", &[]);
    let img = png_file(&input);
    let mask = decode_mask(
        &std::fs::read(&mask_png).unwrap(),
        64,
        64,
        &LIM,
        Default::default(),
    )
    .unwrap();
    for scaling in ["tensor", "channel"] {
        let fp8 = edit(
            &format!("fp8_{scaling}.png"),
            &["--weight-dtype", "fp8", "--fp8-scaling", scaling],
        );
        let mut differ_inside = 0;
        for i in 0..64 * 64 {
            let px = |im: &Rgb8| im.data[i * 3..i * 3 + 3].to_vec();
            if mask.data[i] {
                differ_inside += (px(&fp8) != px(&bf16)) as usize;
            } else {
                assert_eq!(
                    px(&fp8),
                    px(&img),
                    "{scaling}: pixel {i} outside the mask changed"
                );
            }
        }
        println!("fp8 ({scaling}) vs bf16: {differ_inside} masked pixels differ");
        assert!(
            differ_inside > 0,
            "{scaling}: the fp8 edit equals the bf16 one"
        );
    }
}
