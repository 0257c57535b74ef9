//! Observability against the real daemon: `/metrics` under load passes `promtool check
//! metrics`; a real Prometheus server, configured with deploy/prometheus.yml and
//! deploy/alerts.yml, scrapes it and answers every query of deploy/grafana-dashboard.json;
//! the systemd notification protocol (READY, WATCHDOG, STOPPING) played by the test; the
//! unit passes `systemd-analyze verify`; one request's id in every process's log.
//!
//! Prometheus, promtool and systemd-analyze come from Debian's packages (`prometheus`,
//! `systemd`; .ci/run installs them). Where one is missing, its test says so and skips.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use denoised_runtime::skip::{skip, Need};
use serde_json::{json, Value};

fn tool(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn promtool_check(text: &str) -> Result<(), String> {
    let mut c = Command::new(tool("promtool").unwrap())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut c.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ))
    }
}

#[test]
fn metrics_under_load_pass_promtool() {
    let Some(_) = tool("promtool") else {
        skip(
            "serve_observability::metrics_under_load_pass_promtool",
            Need::Tool,
            "no promtool on PATH (Debian's prometheus package has it)",
        );
        return;
    };
    let d = Daemon::start(&[]);
    let scrapes = std::thread::scope(|s| {
        let load = s.spawn(|| d.bench_serve(&["--rps", "6", "--requests", "30"]));
        let mut scrapes = Vec::new();
        while !load.is_finished() {
            scrapes.push(d.metrics());
            std::thread::sleep(Duration::from_millis(300));
        }
        let report = load.join().unwrap();
        assert_eq!(report["errors"], 0, "{report}");
        scrapes.push(d.metrics());
        scrapes
    });
    println!("{} scrapes under load", scrapes.len());
    assert!(scrapes.len() >= 3);
    for text in &scrapes {
        promtool_check(text).unwrap_or_else(|e| panic!("promtool: {e}\n{text}"));
    }
    let last = scrapes.last().unwrap();
    // Every process reports, labelled with its worker and role.
    for (worker, role) in [
        ("router0", "router"),
        ("preprocess0", "preprocess"),
        ("denoise0", "denoise"),
        ("postprocess0", "postprocess"),
        ("cache0", "cache"),
    ] {
        let l = format!(r#"denoised_shm_arena_capacity_bytes{{worker="{worker}",role="{role}"}}"#);
        assert!(last.contains(&l), "{l} in\n{last}");
    }
    for family in [
        "denoised_http_requests_total",
        "denoised_http_request_duration_seconds_bucket",
        "denoised_edit_stage_duration_seconds_bucket",
        "denoised_edit_mask_ratio_bucket",
        "denoised_denoise_step_duration_seconds_bucket",
        "denoised_denoise_batch_requests_bucket",
        "denoised_denoise_batch_tokens_bucket",
        "denoised_denoise_waiting_requests",
        "denoised_template_cache_hits_total",
        "denoised_process_restarts_total",
        "denoised_routed_requests_total",
        "denoised_routing_decision_seconds_bucket",
        "denoised_routing_wait_seconds_bucket",
        "denoised_build_info",
    ] {
        assert!(last.contains(family), "{family} in\n{last}");
    }
    // The served edits were counted (bench serve registers its templates too).
    let served = last
        .lines()
        .find(|l| {
            l.starts_with("denoised_http_requests_total")
                && l.contains(r#"route="/v1/edits""#)
                && l.contains(r#"status="200""#)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(served, Some(30.0), "{last}");
}

/// A Prometheus server on loopback with a free port, scraping `target` every second.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        // deploy/prometheus.yml, with the daemon's port and a fast scrape.
        let config = std::fs::read_to_string(repo("deploy/prometheus.yml"))
            .unwrap()
            .replace("127.0.0.1:8080", target)
            .replace("scrape_interval: 15s", "scrape_interval: 1s")
            .replace("evaluation_interval: 15s", "evaluation_interval: 1s");
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        std::fs::copy(repo("deploy/alerts.yml"), dir.path().join("alerts.yml")).unwrap();
        // A port outside the ephemeral range, which no outgoing connection can take
        // before Prometheus binds it.
        let port =
            denoised_actors::supervisor::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
        let child = Command::new(tool("prometheus").unwrap())
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        let t0 = Instant::now();
        while reqwest::blocking::get(format!("{}/-/ready", p.url))
            .map_or(true, |r| !r.status().is_success())
        {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "prometheus never ready"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// The result vector of an instant query.
    fn query(&self, q: &str) -> Vec<Value> {
        let v: Value = reqwest::blocking::Client::new()
            .get(format!("{}/api/v1/query?query={}", self.url, percent(q)))
            .send()
            .unwrap()
            .json()
            .unwrap();
        assert_eq!(v["status"], "success", "{q}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Polls `q` until it returns data (samples take a few scrapes to arrive, and rates
    /// need two).
    fn query_until_data(&self, q: &str, limit: Duration) -> Vec<Value> {
        let t0 = Instant::now();
        loop {
            let r = self.query(q);
            if !r.is_empty() || t0.elapsed() > limit {
                return r;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `s` percent-encoded for a URL's query string.
fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every PromQL expression of the Grafana dashboard.
fn dashboard_queries() -> Vec<(String, String)> {
    let d: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            out.push((
                p["title"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

/// On the emulated GPU, so that the device's metrics (memory budget and use, the device
/// tier of the template cache) exist too.
#[test]
fn a_real_prometheus_answers_every_dashboard_query() {
    let Some(_) = tool("prometheus") else {
        skip(
            "serve_observability::a_real_prometheus_answers_every_dashboard_query",
            Need::Tool,
            "no prometheus on PATH (Debian's prometheus package)",
        );
        return;
    };
    // The denoise worker on the emulator (its device metrics), the VAE on the CPU: the
    // emulator's VAE passes would leave too few edits in the few seconds of traffic.
    let d = Daemon::start(&EMU_DENOISE_ONLY);
    let target = d.url.trim_start_matches("http://").to_string();
    let prom = Prometheus::start(&target);
    let body = json!({"template_id": "t", "mask": mask_b64(), "max_sequence_length": 16});
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": image_b64(), "id": "t", "steps": 2, "max_sequence_length": 16}),
    );
    assert_eq!(s, 201, "{v}");
    // Traffic for a few scrapes: edits, and one error of each of two classes.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(6) {
        assert_eq!(d.post("/v1/edits", &body).0, 200);
        assert_eq!(d.get("/v1/templates/nope").0, 404);
    }
    assert_eq!(d.post("/v1/edits", &json!({"template_id": "t"})).0, 400);
    let up = prom.query_until_data(r#"up{job="denoised"} == 1"#, Duration::from_secs(30));
    assert!(!up.is_empty(), "prometheus never scraped the daemon");
    let count = prom.query_until_data(
        r#"sum(denoised_http_requests_total{route="/v1/edits",status="200"})"#,
        Duration::from_secs(30),
    );
    let n: f64 = count[0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(n >= 2.0, "{count:?}");
    let p95 = prom.query_until_data(
        r#"histogram_quantile(0.95, sum by (le) (rate(denoised_http_request_duration_seconds_bucket{route="/v1/edits"}[1m])))"#,
        Duration::from_secs(30),
    );
    let p95: f64 = p95[0]["value"][1].as_str().unwrap().parse().unwrap();
    println!("edits counted by prometheus: {n}; p95 {p95:.3} s");
    assert!(p95 > 0.0 && p95.is_finite(), "{p95}");
    let mut empty = Vec::new();
    for (panel, q) in dashboard_queries() {
        let r = prom.query_until_data(&q, Duration::from_secs(20));
        println!("{panel}: {} series: {q}", r.len());
        if r.is_empty() {
            empty.push(format!("{panel}: {q}"));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data: {empty:#?}"
    );
    // The alert rules loaded.
    let rules: Value = reqwest::blocking::get(format!("{}/api/v1/rules", prom.url))
        .unwrap()
        .json()
        .unwrap();
    let n = rules["data"]["groups"][0]["rules"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(n, 6, "{rules}");
}

#[test]
fn systemd_notifications_ready_watchdog_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let cache = cache_dir();
    let mut child = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("DENOISED_LOG", "warn")
        .env("DENOISED_CACHE_DIR", cache.path())
        .env("NOTIFY_SOCKET", &sock_path)
        // A one-second watchdog: pings every half second.
        .env("WATCHDOG_USEC", "1000000")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut seen: Vec<String> = Vec::new();
    let mut buf = [0u8; 4096];
    let mut recv = |seen: &mut Vec<String>| {
        let n = sock.recv(&mut buf).expect("a notification");
        let msg = String::from_utf8_lossy(&buf[..n]).to_string();
        seen.push(msg.clone());
        msg
    };
    while !recv(&mut seen).contains("READY=1") {}
    // The times of the first 5 pings after READY=1, and the 4 intervals between them.
    let mut pings: Vec<Instant> = Vec::new();
    while pings.len() < 5 {
        if recv(&mut seen).contains("WATCHDOG=1") {
            pings.push(Instant::now());
        }
    }
    let intervals: Vec<Duration> = pings.windows(2).map(|w| w[1] - w[0]).collect();
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    while !recv(&mut seen).contains("STOPPING=1") {}
    let status = child.wait().unwrap();
    println!("{seen:#?}\nwatchdog intervals {intervals:?}; exit {status}");
    assert!(status.success(), "{status}");
    let ready = seen.iter().position(|m| m.contains("READY=1")).unwrap();
    let first_ping = seen.iter().position(|m| m.contains("WATCHDOG=1")).unwrap();
    assert!(ready < first_ping, "{seen:?}");
    assert!(
        seen.iter().any(|m| m.contains("STATUS=serving")),
        "{seen:?}"
    );
    // Twice per WatchdogSec (a second here): every 0.5 s plus the router's liveness
    // check. A loaded machine delays some pings, never all: the shortest of 4
    // intervals is under 0.75 s, halfway to the 1 s a daemon that pinged once per
    // WatchdogSec would show (and systemd would kill). (Measured on a 2-core machine
    // shared with other builds: 500 to 503 ms each.)
    let shortest = intervals.iter().min().unwrap();
    assert!(*shortest < Duration::from_millis(750), "{intervals:?}");
}

#[test]
fn the_systemd_unit_verifies() {
    let Some(analyze) = tool("systemd-analyze") else {
        skip(
            "serve_observability::the_systemd_unit_verifies",
            Need::Tool,
            "no systemd-analyze on PATH",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // The unit as installed, with ExecStart at this build's binary (verify checks that
    // the command exists).
    let unit = std::fs::read_to_string(repo("deploy/denoised.service"))
        .unwrap()
        .replace("/usr/local/bin/denoised", env!("CARGO_BIN_EXE_denoised"));
    let path = dir.path().join("denoised.service");
    std::fs::write(&path, unit).unwrap();
    let o = Command::new(analyze)
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success() && out.trim().is_empty(), "{out}");
}

/// An edit's log lines and their processes.
fn lines_of(log: &Path, id: &str) -> Vec<String> {
    BufReader::new(std::fs::File::open(log).unwrap())
        .lines()
        .map_while(Result::ok)
        .filter(|l| l.contains(id))
        .collect()
}

fn edit_id(d: &Daemon) -> String {
    d.template("t", 4);
    let r = d
        .http
        .post(format!("{}/v1/edits", d.url))
        .json(&json!({"template_id": "t", "mask": mask_b64()}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.headers()["x-request-id"].to_str().unwrap().to_string()
}

#[test]
fn one_request_id_in_every_process_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("daemon.log");
    let d = Daemon::start_logging(&[], &[("DENOISED_LOG", "info")], &log);
    let id = edit_id(&d);
    drop(d);
    let lines = lines_of(&log, &id);
    println!("{}", lines.join("\n"));
    for worker in ["router0", "preprocess0", "denoise0", "postprocess0"] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("worker={worker}"))),
            "no line of {worker} names {id}:\n{}",
            lines.join("\n")
        );
    }
    let access: Vec<_> = lines
        .iter()
        .filter(|l| l.contains("denoised::access"))
        .collect();
    assert_eq!(access.len(), 1, "{access:?}");
    for field in ["route=/v1/edits", "status=200", "seconds="] {
        assert!(access[0].contains(field), "{field} in {}", access[0]);
    }

    // The same as JSON objects, one per line.
    let log = dir.path().join("daemon.json");
    let d = Daemon::start_logging(&["--log-format", "json"], &[("DENOISED_LOG", "info")], &log);
    let id = edit_id(&d);
    drop(d);
    let mut workers = std::collections::BTreeSet::new();
    for l in lines_of(&log, &id) {
        let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}"));
        let w = v["span"]["worker"]
            .as_str()
            .or(v["fields"]["worker"].as_str())
            .unwrap_or_default();
        workers.insert(w.to_string());
    }
    for w in ["router0", "preprocess0", "denoise0", "postprocess0"] {
        assert!(workers.contains(w), "{w} in {workers:?}");
    }
}
