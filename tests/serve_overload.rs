//! Backpressure: at about 5x saturation, the real daemon refuses the excess with 429
//! quickly and the requests it admits keep their latency. It runs alone in its own test
//! binary, so the latencies it compares are not disturbed by other tests' daemons.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

/// `denoised bench-serve` against the daemon; its JSON report.
fn bench(d: &Daemon, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(["bench-serve", "--url", &d.url, "--json", "--steps", "8"])
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-serve failed: {stderr}");
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_string();
    serde_json::from_str(&line).unwrap()
}

/// Resident memory of the daemon's processes together, in MB.
fn rss_mb(d: &Daemon) -> f64 {
    let sup = d.child.id();
    let mut kb = 0u64;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
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
        if pid == sup || field("PPid:") == Some(sup as u64) {
            kb += field("VmRSS:").unwrap_or(0);
        }
    }
    kb as f64 / 1024.0
}

#[test]
fn overload_is_refused_fast_and_admitted_latency_holds() {
    // Admission at the saturation concurrency: 8 requests in flight, one denoise batch.
    let d = Daemon::start(&["--max-queued-requests", "8"]);
    // Saturation: a closed loop of 8 clients (every arrival at once, 8 in flight).
    let sat = bench(
        &d,
        &[
            "--rps",
            "1000",
            "--requests",
            "60",
            "--concurrency-limit",
            "8",
        ],
    );
    assert_eq!(sat["errors"], 0, "{sat}");
    assert_eq!(sat["rejected"], 0, "{sat}");
    let x = sat["throughput_rps"].as_f64().unwrap();
    let p95_sat = sat["p95_s"].as_f64().unwrap();
    let rss_before = rss_mb(&d);
    // 5x saturation, open loop, for the same length of time.
    let rps = format!("{:.2}", 5.0 * x);
    let over = bench(&d, &["--rps", &rps, "--requests", "300"]);
    let rss_after = rss_mb(&d);
    let p95_over = over["p95_s"].as_f64().unwrap();
    let rejected = over["rejected"].as_u64().unwrap();
    let rejected_p95 = over["rejected_p95_s"].as_f64().unwrap_or(0.0);
    println!(
        "saturation: {x:.2} req/s, p95 {p95_sat:.3} s; at {rps} req/s offered: {} admitted (p95 {p95_over:.3} s = {:.2}x), {rejected} refused with 429 (p95 {:.1} ms); daemon RSS {rss_before:.0} -> {rss_after:.0} MB",
        over["ok"],
        p95_over / p95_sat,
        rejected_p95 * 1e3
    );
    assert_eq!(over["errors"], 0, "{over}");
    assert!(rejected > 100, "the excess was not refused: {over}");
    assert!(rejected_p95 < 0.25, "429s were slow: {over}");
    assert!(
        p95_over <= 1.5 * p95_sat,
        "admitted p95 {p95_over} vs {p95_sat} at saturation"
    );
    assert!(
        rss_after <= rss_before + 64.0,
        "resident memory grew from {rss_before:.0} to {rss_after:.0} MB"
    );
}
