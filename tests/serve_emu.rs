//! The daemon's GPU path end to end, on the CUDA emulator (`--device emu`): the denoise
//! worker owns a `GpuBackend` whose kernels run on the CPU, templates are uploaded to
//! it and kept resident, and everything else is the real daemon over HTTP. On a
//! machine with a GPU the same paths run with `--device cuda:0`.
//!
//! The emulator is slow, so these use the built-in tiny model, few steps and a short
//! T5 sequence (`SEQ` tokens instead of 512).
#![cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// T5 tokens of every request here: the transformer's work scales with text + image
/// tokens, and 512 text tokens would dominate the tiny model's 256 image tokens.
const SEQ: u32 = 16;

/// Registers `id` as `Daemon::template` does, with the short text sequence.
fn template(d: &Daemon, id: &str, steps: u32) {
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": image_b64(), "id": id, "steps": steps, "seed": 3, "prompt": "a room", "max_sequence_length": SEQ}),
    );
    assert_eq!(s, 201, "{v}");
}

fn cli(args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(args)
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The template `template()` registers, captured by the CLI on the emulator; returns
/// the template directory.
fn cli_capture(dir: &std::path::Path, steps: &str, dtype: &str) -> std::path::PathBuf {
    let tdir = dir.join("tpl");
    let input = case("e2e_input.png");
    cli(&[
        "template",
        "capture",
        "--device",
        "emu",
        "--dtype",
        dtype,
        "--image",
        input.to_str().unwrap(),
        "--steps",
        steps,
        "--seed",
        "3",
        "--prompt",
        "a room",
        "--max-sequence-length",
        "16",
        "--out",
        tdir.to_str().unwrap(),
    ]);
    tdir
}

fn edit(d: &Daemon, mut body: Value) -> Value {
    body["max_sequence_length"] = json!(SEQ);
    let (s, v) = d.post("/v1/edits", &body);
    assert_eq!(s, 200, "{v}");
    v
}

#[test]
fn emu_daemon_equals_the_cli_and_keeps_the_identity_invariant() {
    let d = Daemon::start(&["--device", "emu"]);
    // /readyz says where each process computes and what it loaded.
    let t0 = Instant::now();
    let (ready, denoise) = loop {
        let (_, ready) = d.get("/readyz");
        let found = ready["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["role"] == "denoise")
            .cloned();
        if let Some(p) = found {
            break (ready, p);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no denoise worker in {ready}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let denoise = &denoise;
    assert_eq!(
        (denoise["device"].as_str(), denoise["dtype"].as_str()),
        (Some("emu"), Some("bf16")),
        "{ready}"
    );
    // The device memory budget: its parts add up within the device.
    let b = &denoise["device_budget"];
    let part = |k: &str| b[k].as_u64().unwrap_or_else(|| panic!("{k} in {ready}"));
    assert!(
        part("weights_bytes") > 0 && part("workspace_bytes") > 0,
        "{b}"
    );
    assert!(
        part("weights_bytes")
            + part("workspace_bytes")
            + part("reserve_bytes")
            + part("template_bytes")
            <= part("total_bytes"),
        "{b}"
    );
    let names = |p: &Value| -> Vec<String> {
        p["components"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(denoise), ["transformer"], "{ready}");

    template(&d, "room", 3);
    let served = edit_image(&edit(
        &d,
        json!({"template_id": "room", "mask": mask_b64(), "prompt": "a cat", "seed": 5}),
    ));

    let dir = tempfile::tempdir().unwrap();
    let tdir = cli_capture(dir.path(), "3", "bf16");
    let out = dir.path().join("out.png");
    let mask = case("e2e_mask.png");
    cli(&[
        "edit",
        "--device",
        "emu",
        "--template",
        tdir.to_str().unwrap(),
        "--mask",
        mask.to_str().unwrap(),
        "--prompt",
        "a cat",
        "--seed",
        "5",
        "--max-sequence-length",
        "16",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        png(&served),
        png(&std::fs::read(&out).unwrap()),
        "daemon and CLI images differ on the emulator"
    );

    // The identity invariant through the daemon: an empty mask (no boxes; an image
    // mask that selects nothing is a 400) computes no image token, so every latent is
    // the template's and the image is its reconstruction.
    let v = edit(
        &d,
        json!({"template_id": "room", "boxes": [], "paste_back": false, "prompt": "other", "seed": 11}),
    );
    assert_eq!(v["active_tokens"], 0, "{v}");
    let recon = png(&std::fs::read(tdir.join("reconstruction.png")).unwrap());
    assert_eq!(
        png(&edit_image(&v)),
        recon,
        "an empty-mask edit must reproduce the template's reconstruction"
    );
}

/// Every role that has a device on it (the VAE of the pre- and postprocess workers
/// follows the denoise worker's device by default) against the all-CPU daemon. Both
/// with the sparse VAE off: it runs only on the CPU, so with it on the CPU daemon's
/// template edit may decode sparse (within a few levels of dense, its own tests' bound)
/// where the device decodes dense, and this test is about the devices.
#[test]
fn emu_in_f32_equals_the_cpu_daemon_within_one_level() {
    let body = json!({"template_id": "t", "mask": mask_b64(), "prompt": "a cat", "seed": 2});
    let mut imgs = Vec::new();
    for (args, device) in [
        (&["--device", "cpu", "--sparse-vae", "off"][..], "cpu"),
        (
            &["--device", "emu", "--dtype", "f32", "--sparse-vae", "off"],
            "emu",
        ),
    ] {
        let d = Daemon::start(args);
        let t0 = Instant::now();
        loop {
            let (_, ready) = d.get("/readyz");
            let devices: Vec<(String, String)> = ready["processes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["role"] != "router" && p["role"] != "cache")
                .map(|p| (p["role"].to_string(), p["device"].to_string()))
                .collect();
            if devices.len() == 3 {
                let want = format!("\"{device}\"");
                assert!(devices.iter().all(|(_, d)| *d == want), "{devices:?}");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "{ready}");
            std::thread::sleep(Duration::from_millis(50));
        }
        template(&d, "t", 2);
        imgs.push(png(&edit_image(&edit(&d, body.clone()))));
    }
    let worst = imgs[0]
        .data
        .iter()
        .zip(&imgs[1].data)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    println!("emu f32 vs cpu: largest pixel difference {worst} levels");
    assert!(worst <= 1, "emu f32 differs from the CPU by {worst} levels");
}

#[test]
fn twelve_templates_batch_past_eight_on_emu() {
    // The VAE on the CPU: the emulator's encodes, one preprocess worker's at a time,
    // would trickle the edits into the denoise worker (this test is about its batch).
    let d = Daemon::start(&EMU_DENOISE_ONLY);
    let ids: Vec<String> = (0..12).map(|i| format!("t{i}")).collect();
    for id in &ids {
        template(&d, id, 3);
    }
    let input = png(&std::fs::read(case("e2e_input.png")).unwrap());
    let mask = png(&std::fs::read(case("e2e_mask.png")).unwrap());
    let results: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = ids
            .iter()
            .map(|id| {
                let d = &d;
                s.spawn(move || edit(d, json!({"template_id": id, "mask": mask_b64(), "seed": 1})))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let largest = results
        .iter()
        .map(|v| v["batch"]["max"].as_u64().unwrap())
        .max()
        .unwrap();
    println!("12 concurrent edits of 12 templates: largest batch {largest}");
    assert!(
        largest > 8,
        "the edits never shared a batch larger than 8 (largest {largest})"
    );
    step_times_on_the_device_clock(&d);
    for v in &results {
        let out = png(&edit_image(v));
        // Paste-back: every pixel outside the mask is the template image's.
        for (i, px) in out.data.chunks(3).enumerate() {
            if mask.data[3 * i] < 128 {
                assert_eq!(
                    px,
                    &input.data[3 * i..3 * i + 3],
                    "pixel {i} outside the mask changed"
                );
            }
        }
    }
}

/// A device worker times each step on the device's clock (the emulator's host clock;
/// CUDA events on a GPU) and waits for the step's end, so the device time is within
/// the step's wall time and is most of it.
fn step_times_on_the_device_clock(d: &Daemon) {
    let text = d.metrics();
    let sample = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    let (steps, wall) = (
        sample("denoised_denoise_step_duration_seconds_count"),
        sample("denoised_denoise_step_duration_seconds_sum"),
    );
    let (timed, device) = (
        sample("denoised_denoise_step_device_duration_seconds_count"),
        sample("denoised_denoise_step_device_duration_seconds_sum"),
    );
    println!(
        "{steps} steps: {:.2} ms wall, {:.2} ms on the device each",
        1e3 * wall / steps,
        1e3 * device / timed
    );
    assert!(
        steps > 0.0 && timed == steps,
        "{steps} steps, {timed} timed"
    );
    assert!(
        device <= wall && device > 0.5 * wall,
        "device {device} s of {wall} s"
    );
}

#[test]
fn a_killed_emu_denoise_worker_loses_nothing() {
    let d = Daemon::start(&["--device", "emu"]);
    template(&d, "t", 12);
    kill_denoise_mid_edit(&d, "t", SEQ);
}

/// A device too small for the configuration: the denoise worker says why, with the
/// figures, and the daemon refuses to start instead of restarting it forever.
#[test]
fn a_device_too_small_refuses_to_start() {
    // Room for the built-in model's weights (1 MB in bf16), not for a step.
    refuses_to_start("3000000", &["of workspace", "max_batch 16"]);
    // Room for the denoise worker alone (the streaming test below runs on 8 GB), not
    // for the VAE and text encoders of the pre- and postprocess workers beside it at
    // the default max_pixels (2048x2048).
    refuses_to_start(
        "8000000000",
        &["the pre- and postprocess workers on this device need"],
    );
}

/// Starts a daemon on an emulated device of `bytes`, which must refuse to start and
/// say the figures in `want`.
fn refuses_to_start(bytes: &str, want: &[&str]) {
    let cache = cache_dir();
    let mut child = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(["serve", "--listen", "127.0.0.1:0", "--device", "emu"])
        .env("DENOISED_CACHE_DIR", cache.path())
        .env("DENOISED_EMU_MEMORY", bytes)
        .env("DENOISED_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the daemon kept running on a device too small for it");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    for w in [
        "the device is too small for this configuration",
        "not starting",
    ]
    .iter()
    .chain(want)
    {
        assert!(err.contains(w), "`{w}` in {err}");
    }
}

/// `denoised selftest` as CI can run it: on the emulator, the daemon round trip and
/// the benchmarks at tiny size (the kernel, transformer, VAE and identity parts are the
/// library checks that `cuda/tests/kernels.rs` and `tests/gpu_transformer.rs` run).
/// A GPU server runs the same command with `--device cuda:0`.
#[test]
fn selftest_passes_on_the_emulator() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let o = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args([
            "selftest",
            "--device",
            "emu",
            "--only",
            "daemon,bench-step,bench-attn",
        ])
        .args(["--json", report.to_str().unwrap()])
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    println!("{stdout}");
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let parts: Vec<&str> = v["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["part"].as_str().unwrap())
        .collect();
    assert_eq!(parts, ["Daemon", "BenchStep", "BenchAttn"]);
    let checks = |i: usize| v["parts"][i]["checks"].as_array().unwrap().len();
    assert_eq!((checks(0), checks(1), checks(2)), (4, 6, 4), "{v}");

    // Only a GPU (or its emulator) can be self-tested.
    let o = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(["selftest", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("use --device cuda:N or emu"));
}

/// A template larger than all the device memory left for templates is streamed from
/// the cache process's shared memory (page-locked by the denoise worker) through
/// ping-pong buffers during each step, instead of being refused; the image equals the
/// one computed with the template resident.
#[test]
fn a_template_larger_than_the_device_budget_is_streamed() {
    const BIG: u64 = 8_000_000_000;
    let body = json!({"template_id": "t", "mask": mask_b64(), "prompt": "a cat", "seed": 4});
    let budget = |d: &Daemon| -> Value {
        let (_, ready) = d.get("/readyz");
        ready["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["role"] == "denoise")
            .map(|p| p["device_budget"].clone())
            .unwrap_or_else(|| panic!("no denoise worker in {ready}"))
    };
    let part = |b: &Value, k: &str| b[k].as_u64().unwrap_or_else(|| panic!("{k} in {b}"));
    // Loads priced free: the planner then reads every block from the cache, as the
    // resident run does, so the images are equal to the bit (a full prefix would
    // recompute the inactive K/V, equal to bf16 rounding).
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let mut p = denoised_models::profile::Profile::defaults("emu");
    p.load_host = denoised_models::profile::Fit::assumed(0.0, 0.0);
    p.write(&profile).unwrap();
    let profile = profile.to_str().unwrap();
    let big = BIG.to_string();
    // The VAE and text encoders on the CPU: this device is sized for the denoise
    // worker alone (see `a_device_too_small_refuses_to_start` for the stages).
    let args = EMU_DENOISE_ONLY;
    let d = Daemon::start_with_env(
        &args,
        &[("DENOISED_EMU_MEMORY", &big), ("DENOISED_PROFILE", profile)],
    );
    template(&d, "t", 2);
    let resident = png(&edit_image(&edit(&d, body.clone())));
    let (_, info) = d.get("/v1/templates/t");
    let steps = 2;
    let kv_bytes = info["cache_bytes"].as_u64().unwrap() - steps * 256 * 64 * 4;
    // What the worker holds besides templates does not depend on the device's size
    // (but the 5% reserve): size a device that leaves half the template's K/V.
    let b = budget(&d);
    let fixed =
        part(&b, "workspace_bytes") + part(&b, "requests_bytes") + part(&b, "slab_buffer_bytes");
    let loaded = BIG - BIG / 20 - fixed - part(&b, "template_bytes");
    drop(d);
    let total = ((kv_bytes / 2 + loaded + fixed) as f64 / 0.95) as u64;
    let small = total.to_string();
    let d = Daemon::start_with_env(
        &args,
        &[
            ("DENOISED_EMU_MEMORY", &small),
            ("DENOISED_PROFILE", profile),
        ],
    );
    let b = budget(&d);
    println!(
        "template K/V {kv_bytes} B, device template budget {}",
        part(&b, "template_bytes")
    );
    assert!(part(&b, "template_bytes") < kv_bytes, "{b}");
    template(&d, "t", 2);
    let streamed = png(&edit_image(&edit(&d, body)));
    assert_eq!(
        streamed, resident,
        "the streamed template gave another image"
    );
}
