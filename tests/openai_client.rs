//! The official `openai` Python client (PyPI) against the real daemon: it edits a
//! 1080x1350 image with a transparent-area mask through `POST /v1/images/edits`, and it
//! comes back at 1080x1350 with the pixels outside the mask untouched; it generates images from a prompt through
//! `POST /v1/images/generations` on a text-to-image model; and it edits by instruction
//! (no mask) on a FLUX.1 Kontext model. `.ci/run` installs the client into
//! `target/pyclient` and sets `DENOISED_PYCLIENT`; where it is missing the test says so
//! and skips.

mod common;

use std::process::Command;

use common::*;
use denoised_runtime::skip::{skip, Need};
use image::{Rgba, RgbaImage};

/// `python3` with the client importable, or why not.
fn python() -> Result<Command, String> {
    let path = std::env::var("DENOISED_PYCLIENT").unwrap_or_default();
    let cmd = || {
        let mut c = Command::new("python3");
        if !path.is_empty() {
            c.env("PYTHONPATH", &path);
        }
        c
    };
    match cmd().args(["-c", "import openai"]).output() {
        Ok(o) if o.status.success() => Ok(cmd()),
        Ok(o) => Err(format!(
            "the openai package is not importable (DENOISED_PYCLIENT={path:?}): {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => Err(format!("no python3: {e}")),
    }
}

#[test]
fn the_openai_client_edits_an_image_with_a_transparent_mask() {
    let mut py = match python() {
        Ok(c) => c,
        Err(why) => {
            skip(
                "openai_client::the_openai_client_edits_an_image_with_a_transparent_mask",
                Need::Tool,
                &why,
            );
            return;
        }
    };
    // A phone photo's size (any size is taken: it is computed at a work size, capped
    // small here so that the tiny model is quick, and comes back at 1080x1350).
    let (_dir, d) = Daemon::with_config("[server]\nmax_megapixels = 0.25\n");
    let fixture = png(&std::fs::read(case("e2e_input.png")).unwrap());
    let (w, h) = (1080u32, 1350u32);
    // The fixture stretched over the photo (nearest pixel).
    let px = |x: u32, y: u32| {
        let (fx, fy) = (x * 64 / w, y * 64 / h);
        let i = 3 * (fy * 64 + fx) as usize;
        [fixture.data[i], fixture.data[i + 1], fixture.data[i + 2]]
    };
    // The area to edit: a transparent rectangle; the rest opaque.
    let edit = |x: u32, y: u32| (270..675).contains(&x) && (420..925).contains(&y);
    let image = RgbaImage::from_fn(w, h, |x, y| {
        let [r, g, b] = px(x, y);
        Rgba([r, g, b, 255])
    });
    let mask = RgbaImage::from_fn(w, h, |x, y| {
        Rgba([0, 0, 0, if edit(x, y) { 0 } else { 255 }])
    });
    let dir = tempfile::tempdir().unwrap();
    let (ip, mp, out) = (
        dir.path().join("image.png"),
        dir.path().join("mask.png"),
        dir.path().join("out"),
    );
    image.save(&ip).unwrap();
    mask.save(&mp).unwrap();
    let o = py
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai_client.py"
        ))
        .args([
            "edit",
            &d.url,
            ip.to_str().unwrap(),
            mp.to_str().unwrap(),
            out.to_str().unwrap(),
            &format!("{w}x{h}"),
        ])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "the client failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let model = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(
        !model.is_empty() && model != "any-name",
        "the reply names the served model: {model:?}"
    );
    let mut outputs = Vec::new();
    for i in 0..2 {
        let got = png(&std::fs::read(dir.path().join(format!("out.{i}.png"))).unwrap());
        assert_eq!((got.width, got.height), (w as usize, h as usize));
        let (mut outside_changed, mut inside_changed) = (0, 0);
        for y in 0..h {
            for x in 0..w {
                let i = 3 * (y * w + x) as usize;
                let same = got.data[i..i + 3] == px(x, y);
                match (edit(x, y), same) {
                    (false, false) => outside_changed += 1,
                    (true, false) => inside_changed += 1,
                    _ => {}
                }
            }
        }
        assert_eq!(outside_changed, 0, "pixels outside the mask changed");
        assert!(inside_changed > 0, "nothing was edited");
        outputs.push(got.data);
    }
    assert_ne!(outputs[0], outputs[1], "n = 2 gives two seeds");
}

#[test]
fn the_openai_client_generates_images() {
    let mut py = match python() {
        Ok(c) => c,
        Err(why) => {
            skip(
                "openai_client::the_openai_client_generates_images",
                Need::Tool,
                &why,
            );
            return;
        }
    };
    let d = Daemon::start(&["--model", "builtin:t2i"]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gen");
    let o = py
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai_client.py"
        ))
        .args(["generate", &d.url, out.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "the client failed:\n{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    let model = lines[3];
    assert!(!model.is_empty() && model != "any-name", "{model:?}");
    let images: Vec<Vec<u8>> = (0..3)
        .map(|i| {
            let img = png(&std::fs::read(dir.path().join(format!("gen.{i}.png"))).unwrap());
            assert_eq!((img.width, img.height), (64, 64));
            img.data
        })
        .collect();
    assert_ne!(images[0], images[1], "n = 2 gives two seeds");
    // The repeat hit the first image's noise states and gives its image.
    let approx: Vec<serde_json::Value> = lines[..3]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(approx[2]["hit"], true, "{stdout}");
    assert_eq!(images[2], images[0], "a hit of the same prompt and seed");
}

#[test]
fn the_openai_client_edits_by_instruction_on_a_kontext_model() {
    let mut py = match python() {
        Ok(c) => c,
        Err(why) => {
            skip(
                "openai_client::the_openai_client_edits_by_instruction_on_a_kontext_model",
                Need::Tool,
                &why,
            );
            return;
        }
    };
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/flux-kontext-tiny"
    );
    let d = Daemon::start(&["--model", model]);
    let input = png(&std::fs::read(case("e2e_input.png")).unwrap());
    // OpenAI's mask: the area to edit transparent, the rest opaque.
    let edit = |x: u32, y: u32| (16..48).contains(&x) && (8..40).contains(&y);
    let mask = RgbaImage::from_fn(64, 64, |x, y| {
        Rgba([0, 0, 0, if edit(x, y) { 0 } else { 255 }])
    });
    let dir = tempfile::tempdir().unwrap();
    let (mp, out) = (dir.path().join("mask.png"), dir.path().join("out"));
    mask.save(&mp).unwrap();
    let o = py
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai_client.py"
        ))
        .args(["instruct", &d.url, case("e2e_input.png").to_str().unwrap()])
        .args([mp.to_str().unwrap(), out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "the client failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let read = |i: usize| png(&std::fs::read(dir.path().join(format!("out.{i}.png"))).unwrap());
    // Without a mask: the image's size, and an image that differs from the input.
    let whole = read(0);
    assert_eq!((whole.width, whole.height), (64, 64));
    let (worst, off) = whole.level_diff(&input);
    assert!(
        worst > 10 && off > 1000,
        "the instruction changed little: {worst}, {off}"
    );
    // With a mask: the pixels outside it are the input's.
    let masked = read(1);
    for y in 0..64 {
        for x in 0..64 {
            let i = 3 * (y * 64 + x) as usize;
            if !edit(x, y) {
                assert_eq!(
                    masked.data[i..i + 3],
                    input.data[i..i + 3],
                    "({x}, {y}) changed"
                );
            }
        }
    }
    assert_ne!(masked.data, input.data, "nothing changed inside the mask");
}
