//! Text-to-image generations end to end: the real daemon serving a FluxPipeline
//! directory (the tiny FLUX.1-dev fixture, tests/fixtures/gen_t2i_fixtures.py) over
//! HTTP, against `denoised generate`, and the approximate cache of noise states:
//! identity (the same prompt and seed from a cached state gives the uncached image, bit
//! for bit), similar prompts, the exact fields, the opt-out, the metrics.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

const STEPS: u32 = 6;

fn dev_model() -> String {
    case("../flux-dev-tiny").to_str().unwrap().to_string()
}

fn generate(d: &Daemon, prompt: &str, seed: u64, approx: &str, side: u32) -> Value {
    let (s, v) = d.post(
        "/v1/generations",
        &json!({
            "prompt": prompt, "seed": seed, "steps": STEPS, "width": side, "height": side,
            "max_sequence_length": 32, "approx_cache": approx,
        }),
    );
    assert_eq!(s, 200, "{v}");
    v
}

fn image(v: &Value) -> Vec<u8> {
    png(&unb64(v["image"].as_str().unwrap())).data
}

fn approx(v: &Value) -> (bool, u64) {
    let a = &v["approx_cache"];
    (a["hit"].as_bool().unwrap(), a["k"].as_u64().unwrap())
}

/// An `exact` generation of `prompt` and `seed` misses and stores its states (its image
/// the uncached one, `off`); the same again hits at the deepest K its similarity (1)
/// allows, half the steps, and gives the uncached image bit for bit. The hit's reply.
fn exact_miss_then_hit(d: &Daemon, prompt: &str, seed: u64, side: u32, off: &Value) -> Value {
    let miss = generate(d, prompt, seed, "exact", side);
    assert_eq!(approx(&miss), (false, 0));
    assert_eq!(image(&miss), image(off));
    let hit = generate(d, prompt, seed, "exact", side);
    assert_eq!(
        approx(&hit),
        (true, STEPS as u64 / 2),
        "{}",
        hit["approx_cache"]
    );
    assert_eq!(
        image(&hit),
        image(off),
        "a hit at K reproduces the uncached image bit for bit"
    );
    hit
}

#[test]
fn generations_equal_the_cli_and_reuse_cached_noise_states() {
    let model = dev_model();
    let d = Daemon::start(&["--model", &model]);
    let prompt = "a red fox in the snow";

    // Uncached, the daemon's image is the CLI's (the same noise from the same seed).
    let off = generate(&d, prompt, 5, "off", 64);
    assert_eq!(approx(&off), (false, 0));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cli.png");
    let o = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args([
            "generate", "--model", &model, "--prompt", prompt, "--seed", "5",
        ])
        .args(["--steps", "6", "--height", "64", "--width", "64"])
        .args([
            "--max-sequence-length",
            "32",
            "--out",
            out.to_str().unwrap(),
        ])
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        png(&std::fs::read(&out).unwrap()).data,
        image(&off),
        "daemon = CLI"
    );
    // An opt-out stored nothing; the first `exact` request misses and stores its
    // states (after steps 1, 2, 3 of 6); the same prompt and seed then hits at the
    // deepest K its similarity (1) allows, 3 of 6, and gives the uncached image.
    let hit = exact_miss_then_hit(&d, prompt, 5, 64, &off);
    assert_eq!(hit["approx_cache"]["similarity"].as_f64().unwrap(), 1.0);
    assert_eq!(
        hit["batch"]["sizes"].as_array().unwrap().len(),
        3,
        "it ran the 3 steps left"
    );

    // A similar prompt takes the state too (`auto`), at the K its similarity gives; an
    // `exact` request of it does not.
    let similar = "a red fox in the deep snow";
    let v = generate(&d, similar, 5, "exact", 64);
    assert_eq!(approx(&v), (false, 0), "exact takes only its own prompt");
    let other = "a red fox in the snow at night";
    let v = generate(&d, other, 9, "auto", 64);
    let (h, k) = approx(&v);
    let s = v["approx_cache"]["similarity"].as_f64().unwrap_or(0.0);
    println!("similar prompt: hit {h}, k {k}, similarity {s:.4}");
    assert!(
        h && (1..=3).contains(&k) && s > 0.65 && s < 1.0,
        "{}",
        v["approx_cache"]
    );
    assert_ne!(image(&v), image(&off));
    // Another size is another exact key: a miss.
    let v = generate(&d, prompt, 5, "auto", 32);
    assert_eq!(approx(&v), (false, 0));

    let m = d.metrics();
    // The sum of a metric's samples whose labels include `label`.
    let count = |name: &str, label: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let lookups = "denoised_approx_cache_lookups_total";
    assert_eq!(count(lookups, "result=\"hit\""), 2.0, "{m}");
    assert_eq!(count(lookups, "result=\"miss\""), 3.0);
    assert_eq!(count(lookups, "result=\"off\""), 1.0);
    assert_eq!(
        count("denoised_approx_cache_skipped_steps_total", ""),
        3.0 + k as f64
    );
    let stages = "denoised_generation_stage_duration_seconds_count";
    assert_eq!(count(stages, "stage=\"total\""), 6.0);

    // The cache only saves work: with the cache process killed, a generation runs in
    // full (and gives the uncached image), and once it is back the cache refills.
    let pid = d.worker_pid("cache");
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let v = generate(&d, prompt, 5, "exact", 64);
    assert_eq!(approx(&v), (false, 0));
    assert_eq!(image(&v), image(&off));
    let t0 = std::time::Instant::now();
    while d.worker_pid_opt("cache").is_none_or(|p| p == pid) || d.get("/readyz").0 != 200 {
        assert!(
            t0.elapsed().as_secs() < 60,
            "the cache process was not restarted"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    generate(&d, prompt, 5, "exact", 64);
    let v = generate(&d, prompt, 5, "exact", 64);
    assert_eq!(
        approx(&v),
        (true, STEPS as u64 / 2),
        "the restarted cache refills"
    );

    // A text-to-image model edits nothing, and says what to serve instead.
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"image": image_b64(), "mask": mask_b64(), "steps": 2}),
    );
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not edit"),
        "{v}"
    );
}

#[test]
fn noise_states_move_to_disk_and_hit_from_there() {
    // Room in memory for one generation's states (3 of 64 KiB at 64x64, 6 steps): the
    // next miss moves the first one's to disk, and its repeat hits from there.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        "[approx_cache]\nhost_bytes = 196608\ndisk_bytes = 10000000\n",
    )
    .unwrap();
    let model = dev_model();
    let d = Daemon::start(&["--model", &model, "--config", cfg.to_str().unwrap()]);
    let files = || -> usize {
        std::fs::read_dir(d.cache_dir.join("noise"))
            .map(|r| r.count())
            .unwrap_or(0)
    };
    let first = generate(&d, "a lighthouse at dusk", 1, "exact", 64);
    assert_eq!(files(), 0, "the first generation's states fit in memory");
    generate(&d, "an orchard in spring", 2, "exact", 64);
    assert_eq!(files(), 3, "the first generation's states moved to disk");
    let again = generate(&d, "a lighthouse at dusk", 1, "exact", 64);
    assert_eq!(
        approx(&again),
        (true, STEPS as u64 / 2),
        "{}",
        again["approx_cache"]
    );
    assert_eq!(
        image(&again),
        image(&first),
        "the state read back from disk"
    );
}

#[test]
fn generations_and_cache_hits_on_the_emulated_gpu() {
    // The denoise worker on the GPU backend (the emulator, bf16 as on a GPU): a miss
    // downloads its states from the device mid-run, a hit uploads one and starts at K.
    let mut args = vec!["--model", "builtin:t2i"];
    args.extend(EMU_DENOISE_ONLY);
    let d = Daemon::start(&args);
    let prompt = "a red fox in the snow";
    let off = generate(&d, prompt, 3, "off", 32);
    exact_miss_then_hit(&d, prompt, 3, 32, &off);
}
