//! A cluster of pods on this machine for the cluster tests (docs/cluster.md): daemons
//! of the built-in model on 127.0.0.2, .3, .4 (and .5 for an intruder), each with its
//! own shared-memory and cache directories, so nothing passes between them except
//! through the cluster. Dropping a `Pod` stops its daemon and waits.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

/// One cluster at a time in a test binary: three pods of three processes each are as
/// much as a 2-core machine runs with timings that mean something (the tests measure
/// when a lost pod is marked down and served around).
pub fn one_cluster_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub const COOKIE: &str = "pods-of-a-test";

/// A pod: its directory (config, shared memory, cache, log) and its daemon. Fields drop
/// in order: the daemon stops before its directory goes.
pub struct Pod {
    pub name: String,
    pub ip: String,
    pub port: u16,
    pub d: Option<Daemon>,
    pub dir: tempfile::TempDir,
    /// `--model` (the built-in Fill model when `None`).
    pub model: Option<String>,
    /// `DENOISED_FAULT` (actors/src/fault.rs), when set.
    pub fault: Option<String>,
}

/// A free port on `ip` for a pod's cluster listener.
pub fn free_port(ip: &str) -> u16 {
    TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Pod {
    pub fn new(name: &str, ip: &str) -> Pod {
        Pod {
            name: name.into(),
            ip: ip.into(),
            port: free_port(ip),
            d: None,
            dir: tempfile::tempdir().unwrap(),
            model: None,
            fault: None,
        }
    }

    pub fn addr(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join(format!("{}.log", self.name))
    }

    /// Starts (or restarts) its daemon with these peers and cookie.
    pub fn start(&mut self, peers: &[String], cookie: &str) {
        self.start_with(peers, cookie, "");
    }

    /// [`Pod::start`] with more `[cluster]` keys.
    pub fn start_with(&mut self, peers: &[String], cookie: &str, more: &str) {
        let (dir, cache) = (self.dir.path(), self.dir.path().join("cache"));
        let config = self.config(peers, cookie, more);
        let log_level = std::env::var("DENOISED_TEST_LOG").unwrap_or_else(|_| "warn".into());
        self.d = Some(Daemon::start_at(
            &format!("{}:0", self.ip),
            &[
                ["--config", config.to_str().unwrap()].as_slice(),
                self.model
                    .as_deref()
                    .map(|m| ["--model", m])
                    .as_slice()
                    .concat()
                    .as_slice(),
            ]
            .concat(),
            &[
                ("DENOISED_CACHE_DIR", cache.to_str().unwrap()),
                // A switch the nemesis flips (actors/src/fault.rs): off unless it exists.
                ("DENOISED_FAULT_CUT", self.cut_switch().to_str().unwrap()),
                // The supervisor's status file, in the pod's directory: a pod killed
                // (-9) leaves it there, removed with the directory.
                ("RUNTIME_DIRECTORY", dir.to_str().unwrap()),
                ("DENOISED_FAULT", self.fault.as_deref().unwrap_or("")),
                // The pods' log level: warnings, unless a closer look asks for more.
                ("DENOISED_LOG", &log_level),
            ],
            &self.log(),
        ));
    }

    /// Writes its configuration file (what [`Pod::start_with`] starts it with).
    pub fn config(&self, peers: &[String], cookie: &str, more: &str) -> PathBuf {
        let shm = self.dir.path().join("shm");
        std::fs::create_dir_all(&shm).unwrap();
        let config = self.dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "[cluster]\npod = {:?}\nlisten = {:?}\npeers = {:?}\ncookie = {:?}\nshm_dir = {:?}\n{more}",
                self.name,
                self.addr(),
                peers,
                cookie,
                shm.to_str().unwrap()
            ),
        )
        .unwrap();
        config
    }

    /// While this file exists the pod is cut off its peers and registry.
    pub fn cut_switch(&self) -> PathBuf {
        self.dir.path().join("cut")
    }

    pub fn d(&self) -> &Daemon {
        self.d.as_ref().expect("the pod runs")
    }

    /// The peers its `/readyz` lists, with their state.
    pub fn peers(&self) -> Vec<(String, String, u64)> {
        let (_, v) = self.d().get("/readyz");
        v["pods"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| {
                        (
                            p["pod"].as_str().unwrap().to_string(),
                            p["state"].as_str().unwrap().to_string(),
                            p["templates"].as_u64().unwrap(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until `/readyz` satisfies `ok`, up to `limit`; the seconds it took.
    pub fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        ok: impl Fn(&[(String, String, u64)]) -> bool,
    ) -> f64 {
        let t0 = Instant::now();
        loop {
            let peers = self.peers();
            if ok(&peers) {
                return t0.elapsed().as_secs_f64();
            }
            assert!(
                t0.elapsed() < limit,
                "pod {}: {what} not within {limit:?}: {peers:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

/// Sends `sig` to every process of `d` (its supervisor and its workers).
pub fn signal_all(d: &Daemon, sig: i32) {
    let pids = std::iter::once(d.child.id()).chain(d.workers().into_iter().map(|(pid, _)| pid));
    for pid in pids {
        // SAFETY: plain kill(2) of the test's own daemon's processes.
        unsafe { libc::kill(pid as i32, sig) };
    }
}

pub fn up(peers: &[(String, String, u64)], name: &str) -> bool {
    peers.iter().any(|p| p.0 == name && p.1 == "up")
}

pub fn edit_body(template: &str, seed: u64) -> Value {
    json!({"template_id": template, "prompt": "a cat", "seed": seed, "mask": mask_b64()})
}

pub fn png_part(path: PathBuf) -> reqwest::blocking::multipart::Part {
    reqwest::blocking::multipart::Part::bytes(std::fs::read(path).unwrap())
        .file_name("image.png")
        .mime_str("image/png")
        .unwrap()
}

/// OpenAI's mask for the 64x64 template: a transparent square to edit, the rest opaque.
pub fn transparent_mask_part() -> reqwest::blocking::multipart::Part {
    let mask = image::RgbaImage::from_fn(64, 64, |x, y| {
        let edit = (16..40).contains(&x) && (20..44).contains(&y);
        image::Rgba([0, 0, 0, if edit { 0 } else { 255 }])
    });
    let mut png = std::io::Cursor::new(Vec::new());
    mask.write_to(&mut png, image::ImageFormat::Png).unwrap();
    reqwest::blocking::multipart::Part::bytes(png.into_inner())
        .file_name("mask.png")
        .mime_str("image/png")
        .unwrap()
}

pub fn counter(metrics: &str, name: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Three pods on 127.0.0.2-4, with these more `[cluster]` keys, each seeing the others.
pub fn start_three(more: &str) -> Vec<Pod> {
    start_three_of(None, more)
}

/// [`start_three`] serving `model` (`--model`).
pub fn start_three_of(model: Option<&str>, more: &str) -> Vec<Pod> {
    let mut pods = vec![
        Pod::new("a", "127.0.0.2"),
        Pod::new("b", "127.0.0.3"),
        Pod::new("c", "127.0.0.4"),
    ];
    for p in &mut pods {
        p.model = model.map(String::from);
    }
    let all: Vec<String> = pods.iter().map(Pod::addr).collect();
    for p in &mut pods {
        p.start_with(&all, COOKIE, more);
    }
    for p in &pods {
        let others: Vec<String> = pods
            .iter()
            .filter(|o| o.name != p.name)
            .map(|o| o.name.clone())
            .collect();
        p.wait_for("its peers up", Duration::from_secs(20), |v| {
            others.iter().all(|o| up(v, o))
        });
    }
    pods
}

/// Waits until pod `p`'s last report of peer `name` shows nothing in flight.
pub fn wait_idle(p: &Pod, name: &str) {
    let t0 = Instant::now();
    loop {
        let (_, v) = p.d().get("/readyz");
        let peers = v["pods"].as_array().cloned().unwrap_or_default();
        if peers
            .iter()
            .any(|x| x["pod"] == name && x["in_flight"] == 0)
        {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{name} busy: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until pod `p`'s metric `name` reaches `min`.
pub fn wait_metric(p: &Pod, name: &str, min: f64) {
    let t0 = Instant::now();
    loop {
        let m = p.d().metrics();
        if counter(&m, name, "") >= min {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{}: {name} < {min}:\n{m}",
            p.name
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pods whose own template list has `id`.
pub fn holders(pods: &[Pod], id: &str) -> Vec<usize> {
    (0..pods.len())
        .filter(|&i| {
            pods[i].d.as_ref().is_some_and(|d| {
                let (_, v) = d.get("/v1/templates");
                v.to_string().contains(&format!("\"id\":\"{id}\""))
            })
        })
        .collect()
}
