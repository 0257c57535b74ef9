//! Shared by the daemon's end-to-end tests: starting `denoised serve` on an ephemeral
//! port, HTTP helpers, and the reference inputs.
#![allow(dead_code)] // each test crate uses its own subset

pub mod cli;
pub mod etcd;
pub mod pods;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use denoised_models::pipeline::image::{decode_image, encode_png, ImageLimits, Rgb8};
use reqwest::blocking::Client;
use serde_json::{json, Value};

pub const LIM: ImageLimits = ImageLimits {
    max_pixels: 1 << 24,
    multiple_of: 1,
};

pub fn case(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/cases")
        .join(name)
}

pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn unb64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

pub fn image_b64() -> String {
    b64(&std::fs::read(case("e2e_input.png")).unwrap())
}

/// The fixture image doubled to 128x128, base64 PNG: at 64x64 the tiny VAE's receptive
/// field covers most of the image and the sparse VAE never pays (no traces are stored).
pub fn doubled_image_b64() -> String {
    let small = png(&unb64(&image_b64()));
    let mut big = Rgb8 {
        width: 128,
        height: 128,
        data: vec![0; 128 * 128 * 3],
    };
    for (i, px) in big.data.chunks_exact_mut(3).enumerate() {
        let (x, y) = (i % 128 / 2, i / 128 / 2);
        px.copy_from_slice(&small.data[(y * 64 + x) * 3..][..3]);
    }
    b64(&encode_png(&big).unwrap())
}

pub fn mask_b64() -> String {
    b64(&std::fs::read(case("e2e_mask.png")).unwrap())
}

/// A running daemon; dropping it stops it (SIGTERM) and waits for every process.
pub struct Daemon {
    pub child: Child,
    pub url: String,
    pub http: Client,
    /// The template cache's disk tier: the test's own (daemons keep templates across
    /// restarts there).
    pub cache_dir: PathBuf,
    _cache_dir: Option<tempfile::TempDir>,
    /// How long the daemon took from its start to a ready `/readyz`: every worker
    /// started and loaded, on this machine under its present load (a yardstick for
    /// the time a restarted worker may take).
    pub startup: Duration,
}

/// `serve` arguments for the denoise worker on the emulator with the pre- and
/// postprocess models on the CPU: for tests about the denoise worker, which the
/// emulator's (slow) VAE and text encoders would only slow down.
pub const EMU_DENOISE_ONLY: [&str; 6] = [
    "--device",
    "emu",
    "--preprocess-device",
    "cpu",
    "--postprocess-device",
    "cpu",
];

/// A fresh directory for a daemon's disk tier, removed with the guard.
pub fn cache_dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

impl Daemon {
    pub fn start(args: &[&str]) -> Daemon {
        Self::start_with_env(args, &[])
    }

    /// [`Daemon::start`] with extra environment variables (e.g. `DENOISED_FAULT`).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::spawn(args, env, Stdio::inherit())
    }

    /// A daemon started with this config.toml (the directory holding it must outlive
    /// the daemon).
    pub fn with_config(toml: &str) -> (tempfile::TempDir, Daemon) {
        Self::with_config_env(toml, &[])
    }

    /// [`Daemon::with_config`] with extra environment variables (e.g.
    /// `DENOISED_FAULT`).
    pub fn with_config_env(toml: &str, env: &[(&str, &str)]) -> (tempfile::TempDir, Daemon) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, toml).unwrap();
        let d = Daemon::start_with_env(&["--config", cfg.to_str().unwrap()], env);
        (dir, d)
    }

    /// [`Daemon::start_with_env`], every process's log lines (stderr) going to `log`.
    pub fn start_logging(args: &[&str], env: &[(&str, &str)], log: &Path) -> Daemon {
        let f = std::fs::File::create(log).unwrap();
        Self::spawn(args, env, Stdio::from(f))
    }

    fn spawn(args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Daemon {
        Self::spawn_at("127.0.0.1:0", args, env, stderr)
    }

    /// A daemon whose HTTP API listens on `listen` (a loopback address of its own: the
    /// pods of tests/serve_cluster.rs), its log lines going to `log`.
    pub fn start_at(listen: &str, args: &[&str], env: &[(&str, &str)], log: &Path) -> Daemon {
        let f = std::fs::File::create(log).unwrap();
        Self::spawn_at(listen, args, env, Stdio::from(f))
    }

    fn spawn_at(listen: &str, args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Daemon {
        // Unless the test names one, a disk tier of its own.
        let named = env.iter().any(|(k, _)| *k == "DENOISED_CACHE_DIR");
        let guard = (!named).then(cache_dir);
        let dir = match &guard {
            Some(g) => g.path().to_path_buf(),
            None => PathBuf::from(
                env.iter()
                    .find(|(k, _)| *k == "DENOISED_CACHE_DIR")
                    .unwrap()
                    .1,
            ),
        };
        let started = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_denoised"))
            .args(["serve", "--listen", listen])
            .args(args)
            .env("DENOISED_LOG", "warn")
            .env("DENOISED_CACHE_DIR", &dir)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("denoised: listening on ") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap().to_string());
                }
            }
        });
        // A daemon that exits at start (a refused configuration) fails the test at
        // once instead of after the whole wait.
        let t0 = Instant::now();
        let url = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(url) => break url,
                Err(_) => {
                    if let Some(status) = child.try_wait().unwrap() {
                        panic!("the daemon exited before listening ({status}); see its log above");
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(60),
                        "the daemon did not print its address"
                    );
                }
            }
        };
        let mut d = Daemon {
            child,
            url,
            cache_dir: dir,
            _cache_dir: guard,
            startup: Duration::ZERO,
            http: Client::builder()
                .timeout(Duration::from_secs(300))
                .build()
                .unwrap(),
        };
        let t0 = Instant::now();
        while d.get("/readyz").0 != 200 {
            if let Some(status) = d.child.try_wait().unwrap() {
                panic!("the daemon exited before it was ready ({status}); see its log above");
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "never ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        d.startup = started.elapsed();
        d
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        match self.http.get(format!("{}{path}", self.url)).send() {
            Ok(r) => (r.status().as_u16(), r.json().unwrap_or(Value::Null)),
            Err(_) => (0, Value::Null),
        }
    }

    pub fn delete(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .delete(format!("{}{path}", self.url))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json().unwrap_or(Value::Null))
    }

    pub fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .unwrap();
        (r.status().as_u16(), r.json().unwrap_or(Value::Null))
    }

    /// `GET /metrics`: every process's metrics, in the Prometheus text format.
    pub fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.url))
            .send()
            .unwrap()
            .text()
            .unwrap()
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, serde_json::to_vec(body).unwrap())
    }

    pub fn template(&self, id: &str, steps: u32) {
        let (s, v) = self.post(
            "/v1/templates",
            &json!({"image": image_b64(), "id": id, "steps": steps, "seed": 3, "prompt": "a room"}),
        );
        assert_eq!(s, 201, "{v}");
    }

    /// PID of one of the daemon's worker processes.
    pub fn worker_pid(&self, role: &str) -> u32 {
        self.worker_pid_opt(role)
            .unwrap_or_else(|| panic!("no {role} worker"))
    }

    /// PID of one of the daemon's worker processes, if one runs.
    pub fn worker_pid_opt(&self, role: &str) -> Option<u32> {
        let role = format!("--role {role}");
        self.workers()
            .into_iter()
            .find(|(_, cmd)| cmd.contains(&role))
            .map(|(pid, _)| pid)
    }

    /// The daemon's worker processes (the supervisor's children): PID and command line.
    pub fn workers(&self) -> Vec<(u32, String)> {
        let sup = self.child.id().to_string();
        let mut out = vec![];
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().nth(1));
            if ppid == Some(sup.as_str()) {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                out.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
            }
        }
        out
    }
}

impl Daemon {
    /// `denoised bench serve` against this daemon (8-step templates); its JSON report.
    pub fn bench_serve(&self, args: &[&str]) -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_denoised"))
            .args([
                "bench", "serve", "--url", &self.url, "--json", "--steps", "8",
            ])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "bench serve failed: {stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    }

    /// Resident memory (VmRSS) in MB of the supervisor and each worker, by command line
    /// role (`supervisor`, `router`, `preprocess`, ...).
    pub fn rss_by_process(&self) -> Vec<(String, f64)> {
        let sup = self.child.id() as u64;
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u64>() else {
                continue;
            };
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let field = |k: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(k))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<u64>().ok())
            };
            let name = if pid == sup {
                "supervisor".to_string()
            } else if field("PPid:") == Some(sup) {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                let role = cmd.split("--role ").nth(1).unwrap_or("?");
                role.split_whitespace()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join("")
                    .replace("--index", "")
            } else {
                continue;
            };
            out.push((name, field("VmRSS:").unwrap_or(0) as f64 / 1024.0));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Resident memory of the daemon's processes together, in MB.
    pub fn rss_mb(&self) -> f64 {
        self.rss_by_process().iter().map(|p| p.1).sum()
    }

    /// [`shm_live`](Self::shm_live) once it has settled (releases are messages, so
    /// the count moves for a moment after a request's reply): the same in two reads
    /// 300 ms apart.
    pub fn shm_settled(&self) -> (u32, u64) {
        let mut before = self.shm_live();
        loop {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.shm_live();
            if now == before {
                return now;
            }
            before = now;
        }
    }

    /// Live slices and their bytes in all of the daemon's shared-memory arenas.
    pub fn shm_live(&self) -> (u32, u64) {
        self.shm_by_arena()
            .iter()
            .fold((0, 0), |(n, b), (_, (n2, b2))| (n + n2, b + b2))
    }

    /// Live slices and their bytes per arena.
    pub fn shm_by_arena(&self) -> Vec<(String, (u32, u64))> {
        use denoised_runtime::shm::{self, ArenaView};
        let (dir, ns) = (shm::default_dir(), format!("s{}", self.child.id()));
        shm::list_arenas(&dir, &ns)
            .unwrap()
            .iter()
            .filter(|a| a.owner_alive && a.capacity > 0)
            .filter_map(|a| ArenaView::attach(&dir, &ns, &a.name).ok())
            .map(|v| (v.name().to_string(), v.live()))
            .collect()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

pub fn png(bytes: &[u8]) -> Rgb8 {
    decode_image(bytes, &LIM).unwrap()
}

pub fn edit_image(v: &Value) -> Vec<u8> {
    unb64(
        v["image"]
            .as_str()
            .unwrap_or_else(|| panic!("no image in {v}")),
    )
}

/// Waits for an async job to reach a final status.
pub fn wait_job(d: &Daemon, id: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let (s, v) = d.get(&format!("/v1/jobs/{id}"));
        assert_eq!(s, 200, "{v}");
        if ["succeeded", "failed", "cancelled"].contains(&v["status"].as_str().unwrap()) {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "job {id} stuck: {v}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts an edit of `template`, kills -9 the denoise worker once the edit is in its
/// loop, and checks that the edit is retried and succeeds and that the worker was
/// restarted. The template lives in the cache process, so the retry still finds it.
/// `seq` is the edit's T5 sequence length.
pub fn kill_denoise_mid_edit(d: &Daemon, template: &str, seq: u32) {
    let victim = d.worker_pid("denoise");
    let (_, v) = d.post(
        "/v1/edits",
        &serde_json::json!({"template_id": template, "mask": mask_b64(), "async": true, "max_sequence_length": seq}),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let t0 = Instant::now();
    while d.get(&format!("/v1/jobs/{id}")).1["step"].as_u64().unwrap() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: plain kill(2) of a child of the daemon.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let j = wait_job(d, &id);
    assert_eq!(j["status"], "succeeded", "{j}");
    assert!(j["result"]["attempts"].as_u64().unwrap() >= 2, "{j}");
    assert_ne!(
        d.worker_pid("denoise"),
        victim,
        "the supervisor did not restart the worker"
    );
}

/// `(event, data)` pairs of a Server-Sent Events body, up to `stop` (inclusive) or
/// the end of the stream.
pub fn read_events(r: impl std::io::Read, stop: Option<&str>) -> Vec<(String, Value)> {
    let mut out = vec![];
    let (mut name, mut data) = (String::new(), String::new());
    for line in std::io::BufRead::lines(std::io::BufReader::new(r)) {
        let line = line.unwrap();
        if let Some(v) = line.strip_prefix("event:") {
            name = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.trim_start());
        } else if line.is_empty() && !data.is_empty() {
            out.push((name.clone(), serde_json::from_str(&data).unwrap()));
            data.clear();
            if stop == Some(name.as_str()) {
                break;
            }
        }
    }
    out
}
