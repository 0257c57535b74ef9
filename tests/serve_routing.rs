//! Routing over several real denoise workers: the workers' load reports reach the
//! router, the policy spreads requests over the workers, the admin API switches it at
//! run time behind the API token, and a worker killed under load loses nothing.

mod common;

use std::time::{Duration, Instant};

use common::*;
use reqwest::blocking::Client;
use serde_json::{json, Value};

const TOKEN: &str = "routing-test-token";

fn admin(d: &Daemon, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
    let url = format!("{}/admin/routing", d.url);
    let c = Client::new();
    let mut r = match &body {
        Some(b) => c.put(url).json(b),
        None => c.get(url),
    };
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

/// `denoised_routed_requests_total` by (denoise worker, policy).
fn routed(d: &Daemon) -> Vec<(String, String, f64)> {
    let text = d.metrics();
    let label = |l: &str, k: &str| {
        l.split(&format!("{k}=\""))
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or_default()
            .to_string()
    };
    text.lines()
        .filter(|l| l.starts_with("denoised_routed_requests_total{"))
        .map(|l| {
            let n = l.rsplit(' ').next().unwrap().parse().unwrap();
            (label(l, "denoise_worker"), label(l, "policy"), n)
        })
        .collect()
}

fn bench(d: &Daemon, requests: &str) -> Value {
    let r = d.bench_serve(&["--token", TOKEN, "--rps", "20", "--requests", requests]);
    assert_eq!(r["errors"], 0, "{r}");
    assert_eq!(
        r["ok"].as_u64().unwrap(),
        requests.parse::<u64>().unwrap(),
        "{r}"
    );
    r
}

#[test]
fn two_workers_share_the_load_and_the_policy_switches_at_run_time() {
    let d = Daemon::start(&["--denoise-workers", "2", "--api-token", TOKEN]);
    // The admin API needs the token.
    assert_eq!(admin(&d, None, None).0, 401);
    assert_eq!(admin(&d, Some("wrong"), None).0, 401);
    let (s, v) = admin(&d, Some(TOKEN), None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["policy"], "mask_aware", "the default: {v}");
    let names: Vec<&str> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["denoise0", "denoise1"], "{v}");

    // A burst goes to both workers: what the router sent counts before any report.
    bench(&d, "24");
    let r = routed(&d);
    println!("mask_aware: {r:?}");
    for w in ["denoise0", "denoise1"] {
        assert!(
            r.iter()
                .any(|(n, p, c)| n == w && p == "mask_aware" && *c > 0.0),
            "{w} got no request: {r:?}"
        );
    }
    // The workers reported: their limit, the templates they hold, and (all done) no
    // requests left.
    let t0 = Instant::now();
    loop {
        let v = admin(&d, Some(TOKEN), None).1;
        let ws = v["workers"].as_array().unwrap();
        let idle = ws.iter().all(|w| w["requests"] == 0);
        if idle {
            for w in ws {
                assert_eq!(w["max_batch"], 16, "{v}");
                assert!(!w["device_templates"].as_array().unwrap().is_empty(), "{v}");
            }
            assert_eq!(v["waiting"], 0, "{v}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never idle: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Switched at run time; a bad policy is refused and changes nothing.
    let (s, v) = admin(&d, Some(TOKEN), Some(json!({"policy": "fastest"})));
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("least_requests"),
        "{v}"
    );
    assert_eq!(admin(&d, Some(TOKEN), None).1["policy"], "mask_aware");
    let (s, v) = admin(&d, Some(TOKEN), Some(json!({"policy": "least_requests"})));
    assert_eq!(
        (s, v["policy"].as_str()),
        (200, Some("least_requests")),
        "{v}"
    );
    assert_eq!(
        admin(&d, None, Some(json!({"policy": "round_robin"}))).0,
        401
    );
    bench(&d, "8");
    let r = routed(&d);
    let by = |p: &str| -> f64 { r.iter().filter(|x| x.1 == p).map(|x| x.2).sum() };
    // bench serve registers its templates first (captures are routed too).
    assert!(by("least_requests") >= 8.0, "{r:?}");
    assert!(by("mask_aware") >= 24.0, "{r:?}");

    // A denoise worker killed under load: the router routes around it (and to its
    // restart), and no request is lost.
    let victim = d.worker_pid("denoise");
    let r = std::thread::scope(|s| {
        let load = s.spawn(|| bench(&d, "30"));
        std::thread::sleep(Duration::from_millis(700));
        // SAFETY: plain kill(2) of a child of the daemon.
        unsafe { libc::kill(victim as i32, libc::SIGKILL) };
        load.join().unwrap()
    });
    println!("under a kill: {r}");
    let t0 = Instant::now();
    while d.get("/readyz").0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(60), "never ready again");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_admin_api_is_closed_without_a_token() {
    let d = Daemon::start(&["--routing-policy", "least_tokens"]);
    let (s, v) = admin(&d, None, None);
    assert_eq!(s, 403, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("api_token"),
        "{v}"
    );
    assert_eq!(
        admin(&d, None, Some(json!({"policy": "round_robin"}))).0,
        403
    );
    // Routing runs all the same (the configured policy; /v1 is open without a token).
    d.template("t", 8);
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"template_id": "t", "mask": mask_b64()}),
    );
    assert_eq!(s, 200, "{v}");
    let r = routed(&d);
    assert!(
        r.iter().any(|(_, p, c)| p == "least_tokens" && *c >= 2.0),
        "{r:?}"
    );
}

#[test]
fn a_bad_routing_policy_stops_the_daemon_at_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--routing-policy",
            "fastest",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routing policy `fastest`"), "{err}");
}
