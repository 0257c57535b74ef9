//! `denoised bench simulate` as a user runs it: one JSON line per policy with the latency
//! figures, from the committed flux-small CPU profile on a fresh clone; bad input is
//! refused with a clear error.

use serde_json::Value;
use std::process::Command;

fn simulate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(["bench", "simulate"])
        .args(args)
        .env("DENOISED_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn simulate_prints_a_line_per_policy() {
    let o = simulate(&[
        "--workers",
        "3",
        "--rps",
        "0.15",
        "--requests",
        "300",
        "--policy",
        "round_robin,least_requests,least_tokens,mask_aware",
        "--seed",
        "4",
        "--json",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "{out}");
    for v in &lines {
        println!("{v}");
        for k in [
            "throughput_rps",
            "mean_s",
            "p50_s",
            "p95_s",
            "p99_s",
            "queue_mean_s",
        ] {
            assert!(
                v[k].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0),
                "{k}: {v}"
            );
        }
        assert!(
            v["p50_s"].as_f64() <= v["p95_s"].as_f64()
                && v["p95_s"].as_f64() <= v["p99_s"].as_f64()
        );
    }
    // Deterministic for a seed.
    let again = simulate(&[
        "--workers",
        "3",
        "--rps",
        "0.15",
        "--requests",
        "300",
        "--policy",
        "mask_aware",
        "--seed",
        "4",
    ]);
    let a: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(a["p95_s"], lines[3]["p95_s"]);

    let bad = simulate(&["--rps", "1", "--policy", "fastest"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("routing policy `fastest`"));
}

/// Pods: a line per pod policy with where the templates came from and the bytes that
/// crossed between pods; `--load` sets the rate from the fleet's saturated throughput.
#[test]
fn simulate_pods_reports_template_sources_and_transfers() {
    let o = simulate(&[
        "--profile",
        "tests/fixtures/profiles/flux1-dev-h100.json",
        "--config",
        "flux1-dev",
        "--text-tokens",
        "512",
        "--template-dtype",
        "fp8",
        "--pods",
        "4",
        "--gpus-per-pod",
        "2",
        "--templates",
        "30",
        "--template-skew",
        "1.1",
        "--device-templates",
        "1",
        "--host-templates",
        "4",
        "--load",
        "0.8",
        "--requests",
        "600",
        "--max-batch",
        "4",
        "--pod-policy",
        "round_robin,least_loaded,template_aware",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = lines
        .iter()
        .map(|l| l["pod_policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["round_robin", "least_loaded", "template_aware"]);
    for l in &lines {
        let from = l["template_from"].as_object().unwrap();
        let total: f64 = from.values().map(|v| v.as_f64().unwrap()).sum();
        assert!((total - 1.0).abs() < 1e-9, "{l}");
        // Every transfer feeds at least the request that started it.
        let transfers = l["transfers"].as_f64().unwrap();
        assert!(
            transfers <= from["peer"].as_f64().unwrap() * 600.0 + 1e-9,
            "{l}"
        );
        let bytes = l["bytes_transferred"].as_f64().unwrap();
        let want = transfers * l["template_bytes"].as_f64().unwrap();
        assert!((bytes - want).abs() <= 1e-6 * want.max(1.0), "{l}");
        assert_eq!(
            l["rps"], lines[0]["rps"],
            "one offered rate for every policy"
        );
    }
    // Routing by template keeps more of them on the devices and moves fewer bytes.
    let device = |l: &Value| l["template_from"]["device"].as_f64().unwrap();
    let moved = |l: &Value| l["bytes_transferred"].as_f64().unwrap();
    assert!(device(&lines[2]) > device(&lines[1]), "{:?}", lines);
    assert!(moved(&lines[2]) < moved(&lines[1]), "{:?}", lines);

    let bad = simulate(&["--load", "0.8", "--pods", "2", "--pod-policy", "nearest"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("pod policy `nearest`"));
}
