//! The ControlNet service through the real daemon (docs/design.md §Adapters): a generation
//! with `controlnets` runs its ControlNets in a `controlnet` process, which streams the
//! residuals block by block through shared memory to the denoise worker; the image
//! equals `denoised generate --controlnet ...` (the same ControlNets in process,
//! sequentially) byte for byte, single and multi. The CLI path equals diffusers'
//! FluxControlNetPipeline (model-defs/tests/controlnet_reference.rs). The process's
//! weight LRU loads, keeps and evicts ControlNets as its byte budget says.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn fixtures() -> std::path::PathBuf {
    case("..")
}

const PROMPT: &str = "a red fox in the snow, watercolor";

fn generate(d: &Daemon, controlnets: Value) -> (u16, Value) {
    d.post(
        "/v1/generations",
        &json!({
            "prompt": PROMPT, "seed": 7, "steps": 6, "width": 64, "height": 64,
            "max_sequence_length": 32, "controlnets": controlnets,
        }),
    )
}

/// A ControlNet of a request: its name, control image and scale.
type Net = (&'static str, &'static str, f32);

const SINGLE: [Net; 1] = [("canny-tiny", "control_a.png", 0.7)];
const MULTI: [Net; 2] = [
    ("canny-tiny", "control_a.png", 0.7),
    ("depth-tiny", "control_b.png", 0.5),
];

/// `nets` as a request's `controlnets`.
fn nets_json(nets: &[Net]) -> Value {
    let v: Vec<Value> = nets
        .iter()
        .map(|(id, img, scale)| json!({"id": id, "image": control(img), "scale": scale}))
        .collect();
    Value::Array(v)
}

/// `nets` as the CLI's `--controlnet DIR:IMAGE:SCALE` flags.
fn nets_args(nets: &[Net]) -> Vec<String> {
    let dir = fixtures().join("controlnets");
    nets.iter()
        .flat_map(|(n, i, scale)| {
            let spec = format!(
                "{}:{}:{scale}",
                dir.join(n).display(),
                dir.join(i).display()
            );
            ["--controlnet".to_string(), spec]
        })
        .collect()
}

fn cli_generate(model: &str, controlnets: &[Net], extra: &[&str]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cli.png");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_denoised"));
    cmd.args(["generate", "--model", model, "--prompt", PROMPT])
        .args([
            "--seed", "7", "--steps", "6", "--height", "64", "--width", "64",
        ])
        .args([
            "--max-sequence-length",
            "32",
            "--out",
            out.to_str().unwrap(),
        ]);
    let o = cmd
        .args(nets_args(controlnets))
        .args(extra)
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    png(&std::fs::read(&out).unwrap()).data
}

fn image(v: &Value) -> Vec<u8> {
    png(&unb64(v["image"].as_str().unwrap())).data
}

fn control(name: &str) -> String {
    b64(&std::fs::read(fixtures().join("controlnets").join(name)).unwrap())
}

/// The value of a counter series of the scrape (summed over processes).
fn counter(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn controlnet_service_streams_residuals_equal_to_the_cli_and_its_lru_evicts() {
    let model = fixtures().join("flux-dev-tiny");
    let nets = fixtures().join("controlnets");
    let one_net = std::fs::metadata(nets.join("canny-tiny/diffusion_pytorch_model.safetensors"))
        .unwrap()
        .len();
    // Room for one ControlNet's weights: a second one evicts the first.
    let (_cfg, d) = Daemon::with_config(&format!(
        "[model]\nsource = {:?}\n[workers]\ncontrolnet = 1\n[adapters]\ncontrolnets_dir = {:?}\ncontrolnet_cache_bytes = {}\n",
        model.to_str().unwrap(),
        nets.to_str().unwrap(),
        one_net + one_net / 2
    ));
    let loads = |d: &Daemon| counter(&d.metrics(), "denoised_controlnet_loads_total{");

    let (s, plain) = generate(&d, json!([]));
    assert_eq!(s, 200, "{plain}");
    let single = nets_json(&SINGLE);
    let (s, v) = generate(&d, single.clone());
    assert_eq!(s, 200, "{v}");
    assert_ne!(image(&v), image(&plain), "the ControlNet changes the image");
    let model = model.to_str().unwrap();
    let cli = cli_generate(model, &SINGLE, &[]);
    assert!(
        image(&v) == cli,
        "single: the streamed service differs from the CLI"
    );
    assert_eq!(loads(&d), 1.0);
    // Kept: no second load.
    let (s, again) = generate(&d, single.clone());
    assert_eq!(s, 200, "{again}");
    assert!(image(&again) == cli);
    assert_eq!(loads(&d), 1.0, "a ControlNet in memory is not loaded again");

    let multi = nets_json(&MULTI);
    let (s, v) = generate(&d, multi);
    assert_eq!(s, 200, "{v}");
    let cli = cli_generate(model, &MULTI, &[]);
    assert!(
        image(&v) == cli,
        "multi: the streamed service differs from the CLI"
    );
    // depth-tiny loaded, evicting canny-tiny (least recently used) ...
    assert_eq!(loads(&d), 2.0);
    let (s, v) = generate(&d, single);
    assert_eq!(s, 200, "{v}");
    // ... which comes back from disk.
    assert_eq!(loads(&d), 3.0, "the LRU kept more than its budget");

    // What each step's residual transfer cost: the service's copies into shared
    // memory, and the denoise worker's waits for residuals not there yet.
    let m = d.metrics();
    let per_step = |name: &str| {
        counter(&m, &format!("{name}_sum")) / counter(&m, &format!("{name}_count")).max(1.0)
    };
    println!(
        "residuals per step: service step {:.2} ms, copy into shared memory {:.3} ms, denoise wait {:.3} ms",
        1e3 * per_step("denoised_controlnet_step_duration_seconds"),
        1e3 * per_step("denoised_controlnet_residual_copy_duration_seconds"),
        1e3 * per_step("denoised_controlnet_residual_wait_seconds"),
    );
    assert_eq!(
        counter(&m, "denoised_controlnet_step_duration_seconds_count"),
        24.0
    );

    // Bad requests: clear errors, nothing run.
    for (body, want) in [
        (
            json!([{"id": "nope", "image": control("control_a.png")}]),
            "no ControlNet `nope`",
        ),
        (
            json!([{"id": "../x", "image": control("control_a.png")}]),
            "controlnets:",
        ),
        (
            json!([{"id": "canny-tiny", "image": "!!"}]),
            "invalid base64",
        ),
    ] {
        let (s, v) = generate(&d, body);
        assert_eq!(s, 400, "{v}");
        assert!(v.to_string().contains(want), "{v}");
    }
    let gray = denoised_models::pipeline::image::Rgb8 {
        width: 32,
        height: 32,
        data: vec![128; 32 * 32 * 3],
    };
    let small = b64(&denoised_models::pipeline::image::encode_png(&gray).unwrap());
    let (s, v) = generate(&d, json!([{"id": "canny-tiny", "image": small}]));
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("the output is 64x64"), "{v}");
}

/// ControlNets on edits: a template edit's ControlNets run over every token (the
/// inactive ones at the template's latents) and its residuals carry only the active
/// rows; an inline image's edit runs them over every token. Both equal `denoised edit
/// --controlnet ...` byte for byte (model-defs/tests/controlnet_edit.rs checks the
/// model's invariants).
#[test]
fn edits_with_controlnets_equal_the_cli() {
    let model = fixtures().join("flux-fill-tiny");
    let nets = fixtures().join("controlnets");
    let (_cfg, d) = Daemon::with_config(&format!(
        "[model]\nsource = {:?}\n[workers]\ncontrolnet = 1\n[adapters]\ncontrolnets_dir = {:?}\n",
        model.to_str().unwrap(),
        nets.to_str().unwrap(),
    ));
    d.template("room", 4);
    let multi = nets_json(&MULTI);
    let edit = |source: Value, controlnets: &Value| {
        let mut body = json!({
            "mask": mask_b64(), "prompt": "a cat", "seed": 5, "steps": 4,
            "controlnets": controlnets,
        });
        for (k, v) in source.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (s, v) = d.post("/v1/edits", &body);
        assert_eq!(s, 200, "{v}");
        v
    };
    let steps = |d: &Daemon| {
        counter(
            &d.metrics(),
            "denoised_controlnet_step_duration_seconds_count",
        )
    };

    let tpl = json!({"template_id": "room"});
    let plain = edit(tpl.clone(), &json!([]));
    let v = edit(tpl, &multi);
    assert!(v["active_tokens"].as_u64().unwrap() < v["tokens"].as_u64().unwrap());
    assert_ne!(image(&v), image(&plain), "the ControlNets change the edit");
    assert_eq!(steps(&d), 4.0, "one service step per denoising step");

    let dir = tempfile::tempdir().unwrap();
    let tdir = dir.path().join("tpl");
    cli::capture_room(&model, &tdir);
    let with_nets = |args: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        a.extend(nets_args(&MULTI));
        a
    };
    let cli = cli::edit_cat(&model, &with_nets(&["--template", cli::s(&tdir)]));
    assert!(
        image(&v) == cli,
        "template edit: the daemon differs from the CLI"
    );

    let v = edit(json!({"image": image_b64()}), &multi);
    let input = case("e2e_input.png");
    let cli = cli::edit_cat(
        &model,
        &with_nets(&["--image", cli::s(&input), "--steps", "4"]),
    );
    assert!(
        image(&v) == cli,
        "image edit: the daemon differs from the CLI"
    );
    assert_eq!(steps(&d), 8.0);

    let (s, v) = d.post(
        "/v1/edits",
        &json!({
            "template_id": "room", "mask": mask_b64(), "controlnets": multi,
            "negative_prompt": "blurry", "true_cfg_scale": 4.0,
        }),
    );
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("do not run together"), "{v}");
}

#[test]
fn a_daemon_without_the_service_refuses_controlnets() {
    let model = fixtures().join("flux-dev-tiny");
    let d = Daemon::start(&["--model", model.to_str().unwrap()]);
    let (s, v) = generate(
        &d,
        json!([{"id": "canny-tiny", "image": control("control_a.png")}]),
    );
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("[workers] controlnet = 0"), "{v}");
}

/// The GPU path on the CUDA emulator: the denoise worker's transformer (bf16) takes the
/// streamed residuals on its device, as `denoised generate --device emu` takes the
/// in-process ones: the same image, byte for byte.
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
#[test]
fn streamed_residuals_on_the_emulated_gpu_equal_the_cli_there() {
    let model = fixtures().join("flux-dev-tiny");
    let nets = fixtures().join("controlnets");
    let (_cfg, d) = Daemon::with_config(&format!(
        "[model]\nsource = {:?}\n[device]\ndevice = \"emu\"\n[workers]\ncontrolnet = 1\n[adapters]\ncontrolnets_dir = {:?}\n",
        model.to_str().unwrap(),
        nets.to_str().unwrap(),
    ));
    let multi = nets_json(&MULTI);
    let (s, v) = generate(&d, multi);
    assert_eq!(s, 200, "{v}");
    let cli = cli_generate(model.to_str().unwrap(), &MULTI, &["--device", "emu"]);
    assert!(
        image(&v) == cli,
        "emu: the streamed service differs from the CLI"
    );
}
