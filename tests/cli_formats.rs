//! The checkpoint files users hold, through the CLI as a user runs it: `denoised
//! inspect` on each, `--transformer`/`--vae` on `edit` (equal to the directory's image,
//! and to diffusers' on the same files), and clear errors for files that cannot be
//! loaded (truncated, unknown keys, an unsupported quantisation), from `edit` and from
//! `serve` before it starts anything. The files and diffusers' images come from
//! tests/fixtures/gen_format_fixtures.py.

mod common;

use std::path::PathBuf;

use common::{case, cli::*};
use serde_json::Value;

fn formats(name: &str) -> PathBuf {
    fixtures().join("formats").join(name)
}

fn inspect(file: &str) -> Value {
    let tiny = fixtures().join("flux-fill-tiny");
    let out = ok(&["inspect", s(&formats(file)), "--model", s(&tiny)]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("inspect {file}: {e}:\n{out}"))
}

#[test]
fn inspect_tells_what_each_file_is() {
    let t = inspect("flux1-fill-tiny.safetensors");
    assert_eq!(t["component"], "transformer");
    assert_eq!(t["layout"], "bfl");
    assert_eq!(t["container"], "safetensors");
    assert_eq!(t["model"], "FLUX.1 Fill");
    assert_eq!(t["config"]["in_channels"], 144);
    assert_eq!(t["config"]["num_layers"], 2);
    assert_eq!(t["config"]["num_single_layers"], 3);
    assert_eq!(t["config"]["attention_head_dim"], 16);
    assert_eq!(t["dtypes"]["F32"], t["tensors"]);

    let v = inspect("ae-tiny.safetensors");
    assert_eq!(v["component"], "vae");
    assert_eq!(v["layout"], "ldm");
    assert_eq!(
        v["config"]["block_out_channels"],
        serde_json::json!([32, 64])
    );
    assert_eq!(
        v["config"]["norm_num_groups"], 8,
        "from the directory's config"
    );

    let f = inspect("flux1-fill-tiny-fp8-scaled.safetensors");
    assert_eq!(f["prefix"], "model.diffusion_model.");
    assert!(f["dtypes"]["F8_E4M3"].as_u64().unwrap() > 0, "{f}");

    let g = inspect("flux1-fill-tiny-Q8_0.gguf");
    assert_eq!(g["container"], "gguf");
    assert_eq!(g["component"], "transformer");
    assert!(g["dtypes"]["Q8_0"].as_u64().unwrap() > 0, "{g}");
    // Head dim 128: FLUX.1's RoPE axes, whatever the directory says.
    let k = inspect("flux-d256-Q4_K.gguf");
    assert_eq!(
        k["config"]["axes_dims_rope"],
        serde_json::json!([16, 56, 56])
    );
    assert_eq!(k["config"]["num_attention_heads"], 2);
    assert!(k["dtypes"]["Q4_K"].as_u64().unwrap() > 0, "{k}");

    for (file, layout) in [
        ("t5-tiny.safetensors", "transformers"),
        ("t5-tiny-Q8_0.gguf", "llama.cpp"),
    ] {
        let t = inspect(file);
        assert_eq!(
            (t["component"].as_str(), t["layout"].as_str()),
            (Some("t5"), Some(layout))
        );
    }

    // LoRAs: the layout, and against a model whether it fits.
    let dev = fixtures().join("flux-dev-tiny");
    for (file, layout) in [("kohya", "kohya"), ("xlabs", "xlabs"), ("bfl", "bfl")] {
        let path = fixtures().join(format!("loras/formats/{file}.safetensors"));
        let out = ok(&["inspect", s(&path), "--model", s(&dev)]);
        let l: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (l["component"].as_str(), l["layout"].as_str()),
            (Some("lora"), Some(layout))
        );
        assert!(l["fits_model"]["modules"].as_u64().unwrap() > 0, "{l}");
    }

    // Without a model directory, a head size other than FLUX.1's leaves the RoPE axes
    // unknown: the layout is named all the same, and why there is no config.
    let out = ok(&["inspect", s(&formats("flux1-fill-tiny.safetensors"))]);
    let t: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (t["component"].as_str(), t["layout"].as_str()),
        (Some("transformer"), Some("bfl"))
    );
    assert!(t["config"].is_null(), "{t}");
    assert!(t["config_error"].as_str().unwrap().contains("RoPE"), "{t}");

    let (success, _, stderr) = denoised(&["inspect", s(&formats("unsupported-Q2_K.gguf"))]);
    assert!(!success);
    assert!(
        stderr.contains("Q2_K") && stderr.contains("unsupported-Q2_K.gguf"),
        "{stderr}"
    );
}

fn edit(out: &std::path::Path, extra: &[&str]) {
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
        "a blue ceramic teapot on a wooden table",
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
        s(out),
    ];
    args.extend_from_slice(extra);
    ok(&args);
}

#[test]
fn edit_with_single_files() {
    let dir = tempfile::tempdir().unwrap();
    let (base, files) = (dir.path().join("dir.png"), dir.path().join("files.png"));
    edit(&base, &[]);
    let (t, v) = (
        formats("flux1-fill-tiny.safetensors"),
        formats("ae-tiny.safetensors"),
    );
    edit(&files, &["--transformer", s(&t), "--vae", s(&v)]);
    assert_eq!(
        std::fs::read(&base).unwrap(),
        std::fs::read(&files).unwrap(),
        "BFL single files give the directory's PNG, byte for byte"
    );
    // A GGUF transformer on the CPU and through the emulated GPU backend: diffusers'
    // image on the same file within one level.
    let q = formats("flux1-fill-tiny-Q8_0.gguf");
    for device in [
        &["--device", "cpu"][..],
        &["--device", "emu", "--dtype", "f32"],
    ] {
        let out = dir.path().join("q8.png");
        let mut args = vec!["--transformer", s(&q)];
        args.extend_from_slice(device);
        edit(&out, &args);
        let want = png_file(&formats("q8_0_output.png"));
        let (worst, off) = png_file(&out).level_diff(&want);
        println!("Q8_0 {device:?} vs diffusers: max level diff {worst}, {off} values differ");
        assert!(worst <= 1, "Q8_0 {device:?}: max level diff {worst}");
    }
}

#[test]
fn unusable_files_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.png");
    let model = fixtures().join("flux-fill-tiny");
    let good = formats("flux1-fill-tiny.safetensors");
    // Truncated: the header promises bytes the file does not have.
    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    // Unknown keys: the BFL file plus a tensor no FLUX transformer has.
    let extra = dir.path().join("extra.safetensors");
    {
        use denoised_runtime::weights::{write_safetensors, SafetensorsFile};
        let f = SafetensorsFile::open(&good).unwrap();
        let mut tensors: Vec<(String, denoised_runtime::Tensor)> = f
            .names()
            .into_iter()
            .map(|n| {
                let t = f.tensor_f32(&n).unwrap();
                (n, t)
            })
            .collect();
        tensors.push((
            "double_blocks.0.img_attn.lora_up.weight".into(),
            denoised_runtime::Tensor::zeros(vec![4, 4]),
        ));
        let refs: Vec<(&str, &denoised_runtime::Tensor)> =
            tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&extra, &refs).unwrap();
    }
    let unsupported = formats("unsupported-Q2_K.gguf");
    let cases: [(&[&str], &str); 5] = [
        (&["--transformer", s(&truncated)], "truncated"),
        (
            &["--transformer", s(&extra)],
            "double_blocks.0.img_attn.lora_up.weight",
        ),
        (&["--transformer", s(&unsupported)], "Q2_K"),
        (&["--vae", s(&good)], "not an AutoencoderKL"),
        (&["--text-encoder-2", s(&good)], "not a T5 encoder"),
    ];
    let (image, mask) = (case("e2e_input.png"), case("e2e_mask.png"));
    for (flags, needle) in cases {
        let mut args = vec![
            "edit",
            "--model",
            s(&model),
            "--image",
            s(&image),
            "--mask",
            s(&mask),
            "--out",
            s(&out),
        ];
        args.extend_from_slice(flags);
        fails(&args, needle);
    }
    // The daemon checks before it starts any process.
    fails(
        &[
            "serve",
            "--model",
            s(&model),
            "--transformer",
            s(&truncated),
            "--listen",
            "127.0.0.1:0",
        ],
        "truncated",
    );
    // Files replace a directory's components, not a built-in model's.
    fails(
        &[
            "edit",
            "--transformer",
            s(&good),
            "--image",
            s(&image),
            "--mask",
            s(&mask),
            "--out",
            s(&out),
        ],
        "need a model directory",
    );
}
