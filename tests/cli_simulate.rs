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
