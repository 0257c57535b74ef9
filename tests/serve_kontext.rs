//! A daemon serving a FLUX.1 Kontext model (the tiny seeded directory diffusers saved,
//! tests/fixtures/flux-kontext-tiny): `POST /v1/edits` without a mask is an instruction
//! edit, equal to `denoised edit` of the same image, seed and parameters (which equals
//! diffusers' FluxKontextPipeline: tests/cli_edit.rs); with a mask, the pixels outside
//! it are the input's; templates of it are refused, saying so; and a Fill daemon
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

    // Templates of a Kontext model are not built yet: refused, saying so.
    let (status, v) = d.post(
        "/v1/templates",
        &json!({"id": "k", "image": b64(&input), "prompt": "a room", "steps": 4}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("not built yet"), "{v}");
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
