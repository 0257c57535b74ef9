//! `denoised selftest --device cuda:N`: every GPU check in one command, printed as a
//! table, so a GPU server is verified in one run before it takes traffic:
//!
//! - `kernels`: every kernel against the CPU backend, f32 and bf16;
//! - `transformer`: the transformer against diffusers' fixtures, f32 and bf16;
//! - `vae`: the VAE's dense encode and decode against diffusers' fixtures, f32 and bf16;
//! - `text`: CLIP and T5 against transformers' fixtures, f32 and bf16;
//! - `identity`: the identity invariant with the template resident and streamed;
//! - `lora`: LoRAs unmerged in a mixed batch and merged, against the CPU;
//! - `edit-adapters`: ControlNets and true CFG on a template edit, against the CPU;
//! - `daemon`: a real `denoised serve` on the device, over HTTP: a template, an edit
//!   whose pixels outside the mask are untouched, and the identity invariant through
//!   the daemon (two empty-mask edits with different prompts and seeds are equal);
//! - `bench-step`: one step of a flux1-dev-sized model at 1024² (4096 image and 512
//!   text tokens), full and mask-aware at m = 0.1, 0.2, 0.4 (seeded weights);
//! - `bench-attn`: the masked-query attention op at FLUX.1's shape.
//!
//! The first seven are the library checks the test suite runs on the emulator
//! (`denoised_cuda::selfcheck`, `denoised::selfcheck`), so a GPU is held to exactly
//! what CI holds the emulator to. `--device emu` runs everything on the emulator,
//! with the benchmarks at the tiny model's size (their timings mean nothing there):
//! that is how CI exercises this command. The exit status is nonzero if any check
//! fails; a part that errors or panics is reported as a failed row and the rest go on.

use std::io::{BufRead, BufReader};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use denoised_cuda::selfcheck::Check;
use denoised_cuda::{CudaExec, DeviceSpec, Dt, EmuExec, Exec, GpuBackend};
use denoised_models::pipeline::image::{decode_image, encode_png, ImageLimits, Rgb8};
use denoised_models::FluxConfig;
use denoised_runtime::{Error, Result};
use serde_json::{json, Value};

use super::{bench_attn, bench_step, CliResult, DeviceArgs};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Kernels,
    Transformer,
    Vae,
    Text,
    Identity,
    Lora,
    EditAdapters,
    Daemon,
    BenchStep,
    BenchAttn,
}

const ALL: [Part; 10] = [
    Part::Kernels,
    Part::Transformer,
    Part::Vae,
    Part::Text,
    Part::Identity,
    Part::Lora,
    Part::EditAdapters,
    Part::Daemon,
    Part::BenchStep,
    Part::BenchAttn,
];

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The device to verify: cuda:N, or emu (the GPU code on the CPU emulator, for CI:
    /// the benchmarks then run at the tiny model's size).
    #[arg(long, env = "DENOISED_DEVICE", default_value = "cuda:0")]
    pub device: DeviceSpec,
    /// Parts to run, comma-separated (default: all of them).
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Part>,
    /// Also write the report to this file as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The device under test.
#[derive(Clone, Copy)]
enum Target {
    Emu,
    Cuda(usize),
}

impl Target {
    fn flag(self) -> String {
        match self {
            Target::Emu => "emu".into(),
            Target::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

fn cuda(n: usize) -> Result<CudaExec> {
    CudaExec::new(n).map_err(|e| Error::Device(e.to_string()))
}

struct Section {
    part: Part,
    seconds: f64,
    checks: Vec<Check>,
}

pub fn run(a: Args) -> CliResult {
    let target = match a.device {
        DeviceSpec::Emu => Target::Emu,
        DeviceSpec::Cuda(n) => Target::Cuda(n),
        other => {
            return Err(
                format!("selftest verifies a GPU: use --device cuda:N or emu, not {other}").into(),
            )
        }
    };
    let device = match target {
        Target::Emu => EmuExec::default().describe(),
        Target::Cuda(n) => {
            let exec = cuda(n)?;
            // Compile every kernel (or load the cache) up front: a compile error is
            // the first thing to know, and no timing below includes it.
            exec.warm_up()?;
            exec.describe()
        }
    };
    println!("denoised selftest on {device}");
    let convs = match target {
        Target::Emu => "im2col + GEMM (the emulator has no cuDNN)".to_string(),
        Target::Cuda(n) => GpuBackend::new(cuda(n)?, Dt::F32).conv_path(),
    };
    println!("VAE convolutions: {convs}");
    let attention = match target {
        Target::Emu => GpuBackend::new(EmuExec::open()?, Dt::Bf16).attention_at_flux(),
        Target::Cuda(n) => GpuBackend::new(cuda(n)?, Dt::Bf16).attention_at_flux(),
    };
    println!("attention: {attention}");
    let paths = Paths {
        convs: &convs,
        attention: &attention,
    };
    // In a fixed order: cheap correctness first, so a broken device fails fast.
    let parts: Vec<Part> = ALL
        .into_iter()
        .filter(|p| a.only.is_empty() || a.only.contains(p))
        .collect();
    let t_all = Instant::now();
    let mut sections = Vec::new();
    for part in parts {
        let t0 = Instant::now();
        let checks = match std::panic::catch_unwind(AssertUnwindSafe(|| run_part(part, target))) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => vec![Check::fail(format!("{part:?}"), format!("error: {e}"))],
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                vec![Check::fail(format!("{part:?}"), format!("panicked: {msg}"))]
            }
        };
        let s = Section {
            part,
            seconds: t0.elapsed().as_secs_f64(),
            checks,
        };
        print_section(&s);
        sections.push(s);
        // After every part, so a run cut short (a timeout) still leaves its report.
        if let Some(path) = &a.json {
            write_report(
                path,
                &device,
                &paths,
                t_all.elapsed().as_secs_f64(),
                &sections,
            )?;
        }
    }
    let total: usize = sections.iter().map(|s| s.checks.len()).sum();
    let failed: usize = sections
        .iter()
        .flat_map(|s| &s.checks)
        .filter(|c| !c.pass)
        .count();
    let seconds = t_all.elapsed().as_secs_f64();
    println!(
        "\n{} of {total} checks passed in {seconds:.0} s on {device}",
        total - failed
    );
    if let Some(path) = &a.json {
        write_report(path, &device, &paths, seconds, &sections)?;
    }
    if failed > 0 {
        return Err(format!("{failed} of {total} checks failed").into());
    }
    Ok(())
}

/// What ran the VAE's convolutions and the transformer's attention, in words.
struct Paths<'a> {
    convs: &'a str,
    attention: &'a str,
}

fn write_report(
    path: &std::path::Path,
    device: &str,
    paths: &Paths<'_>,
    seconds: f64,
    sections: &[Section],
) -> CliResult {
    let report = json!({
        "device": device,
        "vae_convolutions": paths.convs,
        "attention": paths.attention,
        "seconds": seconds,
        "parts": sections.iter().map(|s| json!({
            "part": format!("{:?}", s.part),
            "seconds": s.seconds,
            "checks": s.checks.iter().map(|c| json!({
                "name": c.name, "measured": c.measured, "bound": c.bound, "pass": c.pass,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    Ok(())
}

fn print_section(s: &Section) {
    println!("\n{:?} ({:.1} s)", s.part, s.seconds);
    for c in &s.checks {
        println!("  {c}");
    }
}

fn run_part(part: Part, target: Target) -> CliResult<Vec<Check>> {
    use denoised::selfcheck as model_checks;
    use denoised_cuda::selfcheck as kernel_checks;
    let emu = || Ok(EmuExec::default());
    Ok(match (part, target) {
        (Part::Kernels, Target::Emu) => kernel_checks::kernels(emu)?,
        (Part::Kernels, Target::Cuda(n)) => kernel_checks::kernels(|| cuda(n))?,
        (Part::Transformer, Target::Emu) => model_checks::transformer(emu)?,
        (Part::Transformer, Target::Cuda(n)) => model_checks::transformer(|| cuda(n))?,
        (Part::Vae, Target::Emu) => model_checks::vae(emu)?,
        (Part::Vae, Target::Cuda(n)) => model_checks::vae(|| cuda(n))?,
        (Part::Text, Target::Emu) => model_checks::text_encoders(emu)?,
        (Part::Text, Target::Cuda(n)) => model_checks::text_encoders(|| cuda(n))?,
        (Part::Identity, Target::Emu) => model_checks::identity(emu)?,
        (Part::Identity, Target::Cuda(n)) => model_checks::identity(|| cuda(n))?,
        (Part::Lora, Target::Emu) => model_checks::lora(emu)?,
        (Part::Lora, Target::Cuda(n)) => model_checks::lora(|| cuda(n))?,
        (Part::EditAdapters, Target::Emu) => model_checks::edit_adapters(emu)?,
        (Part::EditAdapters, Target::Cuda(n)) => model_checks::edit_adapters(|| cuda(n))?,
        (Part::Daemon, t) => daemon(t)?,
        (Part::BenchStep, t) => bench_steps(t)?,
        (Part::BenchAttn, t) => bench_attention(t)?,
    })
}

/// Informational rows (benchmarks): always pass; the figures are the point.
fn info(name: String, measured: String) -> Check {
    Check {
        name,
        measured,
        bound: "-".into(),
        pass: true,
    }
}

fn bench_steps(t: Target) -> CliResult<Vec<Check>> {
    let (config, image, text, iters) = match t {
        Target::Emu => ("flux-tiny", 256, 16, 1),
        Target::Cuda(_) => ("flux1-dev", 4096, 512, 5),
    };
    let args = bench_step::Args {
        config: config.into(),
        image_tokens: image,
        text_tokens: text,
        mask_ratio: vec![0.1, 0.2, 0.4],
        batch: 1,
        mask_trace: None,
        iters,
        seed: 0,
        device: DeviceArgs {
            device: DeviceSpec::Emu,
        },
        dtype: "bf16".into(),
        weight_dtype: "bf16".into(),
        fp8_scaling: "tensor".into(),
        cache_tier: "memory".into(),
        plan: vec!["pipelined".into()],
        profile: None,
        disk_dir: std::env::temp_dir(),
        cache_mode: vec!["kv".into()],
        cache_dtype: vec![],
        report_launches: false,
        kernel_table: None,
    };
    let cfg = FluxConfig::named(config).expect("a known config");
    let lines = match t {
        Target::Emu => bench_step::measure_gpu(&args, cfg.clone(), EmuExec::default())?,
        Target::Cuda(n) => bench_step::measure_gpu(&args, cfg.clone(), cuda(n)?)?,
    };
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let mut out = Vec::new();
    if let Some(first) = lines.first() {
        let full = f(first, "full_median_s");
        out.push(info(
            format!("{config} full step, {image}+{text} tokens (bf16)"),
            format!("median {:.1} ms", full * 1e3),
        ));
    }
    for v in &lines {
        out.push(info(
            format!("{config} edit step, m = {}", v["mask_ratio"]),
            format!(
                "median {:.1} ms, {:.2}x full ({:.0}% of bound)",
                f(v, "median_s") * 1e3,
                f(v, "speedup"),
                100.0 * f(v, "fraction_of_bound")
            ),
        ));
    }
    if out.len() != 4 {
        out.push(Check::fail(
            "bench-step".into(),
            format!("expected 3 edit measurements, got {}", lines.len()),
        ));
    }
    // Templates streamed from page-locked host memory, bf16 and fp8 K/V: the load of
    // one step's slabs alone, and the m = 0.2 step that hides it.
    let streamed = bench_step::Args {
        mask_ratio: vec![0.2],
        cache_tier: "host".into(),
        cache_dtype: vec!["bf16".into(), "fp8".into()],
        ..args
    };
    let lines = match t {
        Target::Emu => bench_step::measure_gpu(&streamed, cfg, EmuExec::default())?,
        Target::Cuda(n) => bench_step::measure_gpu(&streamed, cfg, cuda(n)?)?,
    };
    let tiered: Vec<&Value> = lines.iter().filter(|v| v["cache_tier"] == "host").collect();
    for v in &tiered {
        out.push(info(
            format!("{config} template streamed from host, {}", v["cache"]),
            format!(
                "load {:.2} ms per step; m = 0.2 step {:.1} ms ({:+.1}% over resident)",
                f(v, "load_step_s") * 1e3,
                f(v, "median_s") * 1e3,
                100.0 * f(v, "over_ideal")
            ),
        ));
    }
    if tiered.len() != 2 {
        out.push(Check::fail(
            "bench-step, host tier".into(),
            format!("expected 2 streamed measurements, got {}", tiered.len()),
        ));
    }
    Ok(out)
}

fn bench_attention(t: Target) -> CliResult<Vec<Check>> {
    let (heads, head_dim, image, text, iters) = match t {
        Target::Emu => (2, 64, 256, 16, 1),
        Target::Cuda(_) => (24, 128, 4096, 512, 20),
    };
    let args = bench_attn::Args {
        heads,
        head_dim,
        text_tokens: text,
        image_tokens: image,
        mask_ratio: vec![0.1, 0.2, 0.4, 1.0],
        iters,
        device: DeviceArgs {
            device: DeviceSpec::Emu,
        },
        dtype: "bf16".into(),
        kernel: vec!["fa2".into()],
        report_conflicts: false,
    };
    let lines = match t {
        Target::Emu => {
            let be = GpuBackend::new(EmuExec::default(), Dt::Bf16);
            bench_attn::measure(&args, &be, &|f| be.gpu_seconds(f))?
        }
        Target::Cuda(n) => {
            let be = GpuBackend::new(cuda(n)?, Dt::Bf16);
            bench_attn::measure(&args, &be, &|f| be.gpu_seconds(f))?
        }
    };
    Ok(lines
        .iter()
        .map(|v| {
            info(
                format!(
                    "attention {heads}x{head_dim}, {image}+{text} tokens, m = {}",
                    v["mask_ratio"]
                ),
                format!(
                    "median {:.2} ms, {:.1} TFLOP/s",
                    v["median_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
                    v["tflops"].as_f64().unwrap_or(f64::NAN)
                ),
            )
        })
        .collect())
}

/// A `denoised serve` child on the device; dropping it stops it (SIGTERM) and waits.
struct Daemon {
    child: Child,
    url: String,
    http: reqwest::blocking::Client,
    /// Its template cache's disk tier: a directory of its own, removed with it (a
    /// check leaves no templates behind).
    cache_dir: std::path::PathBuf,
}

impl Daemon {
    fn start(device: &str) -> CliResult<Daemon> {
        let cache_dir =
            std::env::temp_dir().join(format!("denoised-selftest-{}", std::process::id()));
        let mut child = Command::new(std::env::current_exe()?)
            .args(["serve", "--listen", "127.0.0.1:0", "--model", "builtin"])
            .args(["--device", device, "--dtype", "bf16"])
            .arg("--cache-dir")
            .arg(&cache_dir)
            // The operator's own config must not change what is verified.
            .env_remove("DENOISED_CONFIG")
            .env_remove("DENOISED_API_TOKEN")
            .env("DENOISED_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Some(rest) = line.strip_prefix("denoised: listening on ") {
                    let addr = rest.split_whitespace().next().unwrap_or_default();
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let mut d = Daemon {
            child,
            url: String::new(),
            http: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(300))
                .build()?,
            cache_dir,
        };
        d.url = rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| "the daemon did not print its address within 120 s")?;
        Ok(d)
    }

    fn get(&self, path: &str) -> CliResult<(u16, Value)> {
        let r = self.http.get(format!("{}{path}", self.url)).send()?;
        Ok((r.status().as_u16(), r.json().unwrap_or(Value::Null)))
    }

    fn post(&self, path: &str, body: &Value) -> CliResult<(u16, Value)> {
        let r = self
            .http
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()?;
        Ok((r.status().as_u16(), r.json().unwrap_or(Value::Null)))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.cache_dir);
    }
}

/// `/readyz`'s device budget in GB.
fn budget(b: &Value) -> String {
    let gb = |k: &str| b[k].as_f64().unwrap_or(f64::NAN) / 1e9;
    format!(
        "budget: weights {:.2} + workspace {:.2} + templates {:.1} of {:.1} GB",
        gb("weights_bytes"),
        gb("workspace_bytes"),
        gb("template_bytes"),
        gb("total_bytes")
    )
}

const SIDE: usize = 64;
/// T5 tokens per request: the built-in model's 256 image tokens would be swamped by
/// the default 512.
const SEQ: u32 = 16;

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn image_of(v: &Value) -> CliResult<Rgb8> {
    use base64::Engine;
    let s = v["image"]
        .as_str()
        .ok_or_else(|| format!("no image in {v}"))?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(s)?;
    let limits = ImageLimits {
        max_pixels: 1 << 20,
        multiple_of: 1,
    };
    Ok(decode_image(&bytes, &limits)?)
}

/// Whether a worker's announced device (`cpu`, `emu` or `cuda:N NAME (ARCH)`, as
/// `/readyz` lists it) is `flag` (`emu`, `cuda:N`).
fn on_device(announced: &Value, flag: &str) -> bool {
    announced.as_str().is_some_and(|d| {
        d == flag
            || d.strip_prefix(flag)
                .is_some_and(|rest| rest.starts_with(' '))
    })
}

#[cfg(test)]
mod tests {
    use super::on_device;
    use serde_json::json;

    #[test]
    fn a_worker_on_a_gpu_is_found_by_its_ordinal() {
        // What a denoise worker on the first GPU run announced.
        let h100 = json!("cuda:0 NVIDIA H100 80GB HBM3 (sm_90a)");
        assert!(on_device(&h100, "cuda:0"));
        assert!(!on_device(&h100, "cuda:1"));
        assert!(!on_device(
            &json!("cuda:10 NVIDIA H100 80GB HBM3 (sm_90a)"),
            "cuda:1"
        ));
        assert!(on_device(&json!("emu"), "emu"));
        assert!(!on_device(&json!("cpu"), "emu"));
        assert!(!on_device(&json!(null), "emu"));
    }
}

fn daemon(t: Target) -> CliResult<Vec<Check>> {
    let mut out = Vec::new();
    let t0 = Instant::now();
    let d = Daemon::start(&t.flag())?;
    // Ready, with a denoise worker on the device under test.
    let denoise = loop {
        let (status, ready) = d.get("/readyz")?;
        let found = ready["processes"].as_array().and_then(|ps| {
            ps.iter()
                .find(|p| p["role"] == "denoise" && on_device(&p["device"], &t.flag()))
                .cloned()
        });
        if let (200, Some(p)) = (status, found) {
            break p;
        }
        if t0.elapsed() > Duration::from_secs(180) {
            return Err(format!(
                "not ready with a denoise worker on {} in 180 s: {ready}",
                t.flag()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    out.push(info(
        format!("daemon ready, denoise worker on {}", t.flag()),
        format!(
            "{:.1} s, {}",
            t0.elapsed().as_secs_f64(),
            budget(&denoise["device_budget"])
        ),
    ));

    // A template: a smooth image with stripes, so every region differs.
    let data: Vec<u8> = (0..SIDE * SIDE)
        .flat_map(|i| {
            let (y, x) = (i / SIDE, i % SIDE);
            [
                (4 * x) as u8,
                (4 * y) as u8,
                if (x / 8 + y / 8) % 2 == 0 { 40 } else { 200 },
            ]
        })
        .collect();
    let input = Rgb8 {
        width: SIDE,
        height: SIDE,
        data,
    };
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": b64(&encode_png(&input)?), "id": "selftest", "steps": 4, "seed": 1,
                "prompt": "a pattern", "max_sequence_length": SEQ}),
    )?;
    if s != 201 {
        return Err(format!("template registration: HTTP {s}: {v}").into());
    }

    // An edit of a square: every pixel outside the mask is the template image's.
    let inside = |i: usize| {
        let (y, x) = (i / SIDE, i % SIDE);
        (16..40).contains(&y) && (24..48).contains(&x)
    };
    let mask_png = |on: &dyn Fn(usize) -> bool| -> CliResult<String> {
        let data = (0..SIDE * SIDE)
            .flat_map(|i| [if on(i) { 255 } else { 0 }; 3])
            .collect();
        let img = Rgb8 {
            width: SIDE,
            height: SIDE,
            data,
        };
        Ok(b64(&encode_png(&img)?))
    };
    let t1 = Instant::now();
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"template_id": "selftest", "mask": mask_png(&inside)?, "prompt": "a cat",
                "seed": 5, "max_sequence_length": SEQ}),
    )?;
    if s != 200 {
        return Err(format!("edit: HTTP {s}: {v}").into());
    }
    let edited = image_of(&v)?;
    let changed_outside = (0..SIDE * SIDE)
        .filter(|&i| !inside(i) && edited.data[3 * i..3 * i + 3] != input.data[3 * i..3 * i + 3])
        .count();
    let changed_inside = (0..SIDE * SIDE)
        .filter(|&i| inside(i) && edited.data[3 * i..3 * i + 3] != input.data[3 * i..3 * i + 3])
        .count();
    out.push(Check::within(
        format!(
            "edit over HTTP ({:.1} s), pixels outside the mask",
            t1.elapsed().as_secs_f64()
        ),
        "changed",
        changed_outside as f64,
        0.0,
    ));
    out.push(Check {
        name: "edit over HTTP, pixels inside the mask".into(),
        measured: format!("changed {changed_inside} of {}", 24 * 24),
        bound: "> 0".into(),
        pass: changed_inside > 0,
    });

    // The identity invariant through the daemon: with an empty mask (no boxes; an image
    // mask that selects nothing is a 400) no image token is computed, so the prompt
    // and seed cannot matter and both images are the template's reconstruction.
    let mut images = Vec::new();
    for (prompt, seed) in [("a dog", 7), ("something else", 8)] {
        let (s, v) = d.post(
            "/v1/edits",
            &json!({"template_id": "selftest", "boxes": [], "paste_back": false,
                    "prompt": prompt, "seed": seed, "max_sequence_length": SEQ}),
        )?;
        if s != 200 || v["active_tokens"] != 0 {
            return Err(format!("empty-mask edit: HTTP {s}: {v}").into());
        }
        images.push(image_of(&v)?);
    }
    let worst = images[0]
        .data
        .iter()
        .zip(&images[1].data)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap_or(u8::MAX);
    out.push(Check::within(
        "identity through the daemon (two empty-mask edits)".into(),
        "max pixel diff",
        worst as f64,
        0.0,
    ));
    Ok(out)
}
