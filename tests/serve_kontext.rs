//! A daemon serving a FLUX.1 Kontext model (the tiny seeded directory diffusers saved,
//! tests/fixtures/flux-kontext-tiny): `POST /v1/edits` without a mask is an instruction
//! edit, equal to `denoised edit` of the same image, seed and parameters (which equals
//! diffusers' FluxKontextPipeline: tests/cli_edit.rs); with a mask, the pixels outside
//! it are the input's; a template of an image serves masked edits that compute only
//! their masked tokens (registered by hand, or made by `[templates] auto`); and a Fill daemon
//! answers an edit without a mask with what it needs. The official client's
//! instruction edits are in tests/openai_client.rs.

mod common;

use common::cli::{fixtures, ok, s};
use common::*;
use serde_json::json;

#[test]
fn a_kontext_daemon_edits_by_instruction_as_the_cli_does() {
    let model = fixtures().join("flux-kontext-tiny");
    let d = Daemon::start(&["--model", s(&model)]);
    let input = std::fs::read(case("e2e_input.png")).unwrap();
    let body = |mask: Option<&str>| {
        let mut b = json!({"image": b64(&input), "prompt": "make the walls blue", "steps": 4,
                           "seed": 7, "max_sequence_length": 32});
        if let Some(m) = mask {
            b["mask"] = json!(m);
        }
        b
    };
    let (status, v) = d.post("/v1/edits", &body(None));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["width"].as_u64(), v["tokens"].as_u64()),
        (Some(64), Some(256))
    );
    let served = png(&edit_image(&v));

    // The same edit through the CLI: the daemon's default guidance on a Kontext model
    // is FluxKontextPipeline's (3.5), and an image at a work size is its own reference.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cli.png");
    ok(&[
        "edit",
        "--model",
        s(&model),
        "--image",
        s(&case("e2e_input.png")),
        "--prompt",
        "make the walls blue",
        "--steps",
        "4",
        "--seed",
        "7",
        "--max-sequence-length",
        "32",
        "--max-area",
        "4096",
        "--no-auto-resize",
        "--out",
        s(&out),
    ]);
    let cli = png(&std::fs::read(&out).unwrap());
    let (worst, off) = served.level_diff(&cli);
    println!("served vs CLI: max level diff {worst}, {off} values differ");
    assert_eq!(
        worst, 0,
        "the daemon's instruction edit differs from the CLI's"
    );
    let original = png(&input);
    let (changed, _) = served.level_diff(&original);
    assert!(changed > 10, "the instruction changed nothing ({changed})");

    // With a mask: the instruction edit, pasted back inside the mask only.
    let mask_png = std::fs::read(case("e2e_mask.png")).unwrap();
    let (status, v) = d.post("/v1/edits", &body(Some(&b64(&mask_png))));
    assert_eq!(status, 200, "{v}");
    let masked = png(&edit_image(&v));
    let mask = png(&mask_png);
    let (mut outside, mut inside) = (0, 0);
    for p in 0..64 * 64 {
        let px = |img: &denoised_models::pipeline::image::Rgb8| img.data[3 * p..3 * p + 3].to_vec();
        match (mask.data[3 * p] >= 128, px(&masked) == px(&original)) {
            (false, false) => outside += 1,
            (true, false) => inside += 1,
            _ => {}
        }
    }
    assert_eq!(outside, 0, "pixels outside the mask changed");
    assert!(inside > 0, "nothing changed inside the mask");

    // A generation is not what it does.
    let (status, v) = d.post("/v1/generations", &json!({"prompt": "a cat", "steps": 2}));
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("Kontext"), "{v}");
}

#[test]
fn a_fill_daemon_says_an_edit_without_a_mask_needs_kontext() {
    let d = Daemon::start(&[]);
    let input = std::fs::read(case("e2e_input.png")).unwrap();
    let (status, v) = d.post(
        "/v1/edits",
        &json!({"image": b64(&input), "prompt": "make the walls blue", "steps": 2}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("need a FLUX.1 Kontext model"), "{v}");
    // A template edit still needs its mask.
    let (status, v) = d.post("/v1/edits", &json!({"template_id": "t", "prompt": "x"}));
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("give exactly one of `mask`"), "{v}");
}

/// The pixels of `edited` that differ from `original`'s, outside and inside `mask`.
fn changed(
    edited: &denoised_models::pipeline::image::Rgb8,
    original: &denoised_models::pipeline::image::Rgb8,
    mask: &denoised_models::pipeline::image::Rgb8,
) -> (usize, usize) {
    let (mut outside, mut inside) = (0, 0);
    for p in 0..original.width * original.height {
        let px = |img: &denoised_models::pipeline::image::Rgb8| img.data[3 * p..3 * p + 3].to_vec();
        match (mask.data[3 * p] >= 128, px(edited) == px(original)) {
            (false, false) => outside += 1,
            (true, false) => inside += 1,
            _ => {}
        }
    }
    (outside, inside)
}

/// A Kontext template (the image's reference tokens and its noisy tokens held to the
/// image's, cached): a masked edit of it computes only its masked tokens, keeps every
/// pixel outside the mask, and equals the CLI's edit of the same template directory
/// (`denoised template` + `denoised edit --template`) bit for bit. With `[templates]
/// auto`, the second edit of an uploaded image captures it and the third is a hit.
#[test]
fn kontext_templates_serve_masked_edits_registered_or_made_by_themselves() {
    let model = fixtures().join("flux-kontext-tiny");
    let toml = format!(
        "[model]\nsource = \"{}\"\n[templates]\nauto = true\n",
        model.display()
    );
    let (_cfg, d) = Daemon::with_config(&toml);
    let input = std::fs::read(case("e2e_input.png")).unwrap();
    let mask_png = std::fs::read(case("e2e_mask.png")).unwrap();
    let (original, mask) = (png(&input), png(&mask_png));

    let (status, v) = d.post(
        "/v1/templates",
        &json!({"id": "room", "image": b64(&input), "prompt": "a room", "steps": 4, "seed": 3,
                "max_sequence_length": 32}),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(
        v["guidance"].as_f64(),
        Some(3.5),
        "FluxKontextPipeline's default: {v}"
    );
    let (status, v) = d.post(
        "/v1/edits",
        &json!({"template_id": "room", "mask": b64(&mask_png), "prompt": "a red armchair",
                "seed": 5, "max_sequence_length": 32}),
    );
    assert_eq!(status, 200, "{v}");
    let (active, tokens) = (
        v["active_tokens"].as_u64().unwrap(),
        v["tokens"].as_u64().unwrap(),
    );
    assert_eq!(tokens, 256, "{v}");
    assert!(active < tokens / 2, "not a template edit: {v}");
    let served = png(&edit_image(&v));
    let (outside, inside) = changed(&served, &original, &mask);
    assert_eq!(outside, 0, "pixels outside the mask changed");
    assert!(inside > 0, "nothing changed inside the mask");

    // The CLI's capture and template edit with the same parameters.
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("room");
    let out = dir.path().join("cli.png");
    let common = [
        "--model",
        s(&model),
        "--steps",
        "4",
        "--max-sequence-length",
        "32",
    ];
    let (image_path, mask_path) = (case("e2e_input.png"), case("e2e_mask.png"));
    let mut capture = vec!["template", "capture", "--image", s(&image_path)];
    capture.extend(["--prompt", "a room", "--seed", "3", "--out", s(&tpl)]);
    capture.extend(common);
    ok(&capture);
    let mut edit = vec!["edit", "--template", s(&tpl), "--mask", s(&mask_path)];
    edit.extend([
        "--prompt",
        "a red armchair",
        "--seed",
        "5",
        "--out",
        s(&out),
    ]);
    edit.extend(common);
    ok(&edit);
    let cli = png(&std::fs::read(&out).unwrap());
    assert_eq!(
        served.level_diff(&cli).0,
        0,
        "the daemon's template edit differs from the CLI's"
    );

    // Auto templates: an upload edited again becomes a template.
    let upload = |prompt: &str, seed: u64| {
        let (status, v) = d.post(
            "/v1/edits",
            &json!({"image": b64(&input), "mask": b64(&mask_png), "prompt": prompt,
                    "steps": 4, "seed": seed, "max_sequence_length": 32}),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    let outcomes: Vec<(bool, bool, u64)> = [("a cat", 1), ("a dog", 2), ("a bird", 3)]
        .iter()
        .map(|(p, seed)| {
            let v = upload(p, *seed);
            let (o, i) = changed(&png(&edit_image(&v)), &original, &mask);
            assert_eq!(o, 0, "pixels outside the mask changed: {v}");
            assert!(i > 0, "{v}");
            let a = &v["auto_template"];
            let hit = a["hit"]
                .as_bool()
                .unwrap_or_else(|| panic!("no auto_template: {v}"));
            (
                hit,
                a["captured"].as_bool().unwrap(),
                v["active_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        outcomes.iter().map(|o| (o.0, o.1)).collect::<Vec<_>>(),
        [(false, false), (false, true), (true, false)],
        "miss, capture, hit"
    );
    assert_eq!(outcomes[0].2, 256, "the first edit runs in full");
    assert!(
        outcomes[2].2 < 128,
        "the hit computes its masked tokens only"
    );
    // An instruction edit (no mask) computes every token: never a template edit.
    for _ in 0..2 {
        let (status, v) = d.post(
            "/v1/edits",
            &json!({"image": b64(&input), "prompt": "make the walls blue", "steps": 4,
                    "max_sequence_length": 32}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["active_tokens"], v["tokens"], "{v}");
        assert!(v.get("auto_template").is_none(), "{v}");
    }
}
