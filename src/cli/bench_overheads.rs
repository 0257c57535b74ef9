//! `denoised bench overheads`: the serving runtime's own costs, measured: per-step
//! batch assembly in the denoise loop, the shared-memory handoff of a finished latent,
//! and (against a running daemon) one message round trip between cluster nodes.

use denoised_actors::overheads::{self, Summary};
use serde_json::json;

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Concurrent requests in the denoise loop for the batch-assembly measurement.
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// Steps of each of those requests.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Tokens of the latent handed over (4096 = a 1024x1024 FLUX image, 1 MiB).
    #[arg(long, default_value_t = 4096)]
    pub handoff_tokens: usize,
    /// Repetitions of the handoff and of the round trip.
    #[arg(long, default_value_t = 200)]
    pub iters: usize,
    /// A running daemon's cluster node (`127.0.0.1:PORT`, printed at start-up) to
    /// measure message round trips against; needs `--cookie`.
    #[arg(long)]
    pub cluster: Option<String>,
    /// The daemon's cluster cookie (`[cluster] cookie`).
    #[arg(long, env = "DENOISED_COOKIE", hide_env_values = true)]
    pub cookie: Option<String>,
    /// Print one JSON line instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn us(s: &Summary) -> String {
    format!(
        "mean {:8.1} µs  p50 {:8.1} µs  p99 {:8.1} µs  (n={})",
        s.mean_s * 1e6,
        s.p50_s * 1e6,
        s.p99_s * 1e6,
        s.n
    )
}

pub fn run(a: Args) -> CliResult {
    let assembly = overheads::batch_assembly(a.requests, a.steps)?;
    let (write, borrow, copy, bytes) = overheads::handoff(a.handoff_tokens, a.iters)?;
    let rtt = match (&a.cluster, &a.cookie) {
        (Some(addr), Some(cookie)) => {
            let port: u16 = addr
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("--cluster {addr}: expected HOST:PORT"))?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            Some(rt.block_on(overheads::round_trips(port, cookie, a.iters))?)
        }
        (Some(_), None) => return Err("--cluster needs --cookie".into()),
        _ => None,
    };
    let gbps = |s: &Summary| bytes as f64 / s.p50_s / 1e9;
    if a.json {
        println!(
            "{}",
            json!({
                "batch_assembly": assembly,
                "handoff_bytes": bytes,
                "handoff_write": write,
                "handoff_borrow": borrow,
                "handoff_copy": copy,
                "handoff_write_gb_s": gbps(&write),
                "round_trip": rtt,
            })
        );
        return Ok(());
    }
    println!(
        "batch assembly per step ({} requests): {}",
        a.requests,
        us(&assembly)
    );
    println!(
        "latent handoff, {} KiB: write {} ({:.1} GB/s)",
        bytes / 1024,
        us(&write),
        gbps(&write)
    );
    println!("  zero-copy map by the reader: {}", us(&borrow));
    println!("  (a reader's own copy:        {})", us(&copy));
    match rtt {
        Some(r) => println!("cluster message round trip: {}", us(&r)),
        None => println!(
            "cluster message round trip: skipped (give --cluster and --cookie of a running daemon)"
        ),
    }
    Ok(())
}
