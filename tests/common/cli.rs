//! Running the `denoised` binary as a user does (the CLI tests).

use std::path::{Path, PathBuf};
use std::process::Command;

use denoised_models::pipeline::image::{decode_image, encode_png, Rgb8};

use super::LIM;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Runs the binary; returns (success, stdout, stderr).
pub fn denoised(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(args)
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

pub fn ok(args: &[&str]) -> String {
    let (success, stdout, stderr) = denoised(args);
    assert!(success, "denoised {args:?} failed:\n{stderr}");
    stdout + &stderr
}

pub fn fails(args: &[&str], needle: &str) {
    let (success, _, stderr) = denoised(args);
    assert!(!success, "denoised {args:?} should fail");
    assert!(
        stderr.contains(needle),
        "stderr of {args:?} lacks `{needle}`:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "panic:\n{stderr}");
}

pub fn png_file(path: &Path) -> Rgb8 {
    decode_image(&std::fs::read(path).unwrap(), &LIM).unwrap()
}

/// Writes a `w x h` PNG of one grey level; returns its path.
pub fn solid_png(dir: &Path, name: &str, w: usize, h: usize, level: u8) -> PathBuf {
    let path = dir.join(name);
    let img = Rgb8 {
        width: w,
        height: h,
        data: vec![level; w * h * 3],
    };
    std::fs::write(&path, encode_png(&img).unwrap()).unwrap();
    path
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The CLI's twin of the daemon tests' template `Daemon::template(id, 4)`: `template
/// capture` of the e2e image (4 steps, seed 3, "a room") into `dir` with `model`.
pub fn capture_room(model: &Path, dir: &Path) {
    ok(&[
        "template",
        "capture",
        "--model",
        s(model),
        "--image",
        s(&fixtures().join("cases/e2e_input.png")),
        "--steps",
        "4",
        "--seed",
        "3",
        "--prompt",
        "a room",
        "--out",
        s(dir),
    ]);
}

/// `denoised edit` with `model` of the e2e mask, prompt "a cat", seed 5 (the daemon
/// tests' edits), and `args`: the output's pixels.
pub fn edit_cat(model: &Path, args: &[String]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.png");
    let mut all: Vec<&str> = vec![
        "edit",
        "--model",
        s(model),
        "--prompt",
        "a cat",
        "--seed",
        "5",
        "--mask",
    ];
    let mask = fixtures().join("cases/e2e_mask.png");
    all.extend([s(&mask), "--out", s(&out)]);
    all.extend(args.iter().map(String::as_str));
    ok(&all);
    png_file(&out).data
}
