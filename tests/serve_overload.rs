//! Backpressure: at about 5x saturation, the real daemon refuses the excess with 429
//! quickly and the requests it admits keep their latency. It runs alone in its own test
//! binary, so the latencies it compares are not disturbed by other tests' daemons.

mod common;

use common::*;

#[test]
fn overload_is_refused_fast_and_admitted_latency_holds() {
    // Admission at the saturation concurrency: 8 requests in flight, one denoise batch.
    let d = Daemon::start(&["--max-queued-requests", "8"]);
    // Saturation: a closed loop of 8 clients (every arrival at once, 8 in flight).
    let sat = d.bench_serve(&[
        "--rps",
        "1000",
        "--requests",
        "60",
        "--concurrency-limit",
        "8",
    ]);
    assert_eq!(sat["errors"], 0, "{sat}");
    assert_eq!(sat["rejected"], 0, "{sat}");
    let x = sat["throughput_rps"].as_f64().unwrap();
    let p95_sat = sat["p95_s"].as_f64().unwrap();
    let rss_before = d.rss_mb();
    // 5x saturation, open loop, for the same length of time.
    let rps = format!("{:.2}", 5.0 * x);
    let over = d.bench_serve(&["--rps", &rps, "--requests", "300"]);
    let rss_after = d.rss_mb();
    let p95_over = over["p95_s"].as_f64().unwrap();
    let rejected = over["rejected"].as_u64().unwrap();
    let rejected_p95 = over["rejected_p95_s"].as_f64().unwrap_or(0.0);
    println!(
        "saturation: {x:.2} req/s, p95 {p95_sat:.3} s; at {rps} req/s offered: {} admitted, served at {:.2} req/s (p95 {p95_over:.3} s = {:.2}x), {rejected} refused with 429 (p95 {:.1} ms); daemon RSS {rss_before:.0} -> {rss_after:.0} MB",
        over["ok"],
        over["throughput_rps"].as_f64().unwrap(),
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
