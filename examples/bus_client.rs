//! A client of the daemon's internal actor bus: how another service's process edits an
//! image through `denoised` with no HTTP and no gRPC.
//!
//! The process starts its own ractor_cluster node, connects it to the daemon's router
//! node (`[cluster] port`, printed by `denoised serve` as `cluster node 127.0.0.1:PORT`)
//! with the shared cookie (`[cluster] cookie` / `DENOISED_COOKIE`), waits until the
//! router actor shows up in the `denoised.router` process group, and calls it with
//! `RouterMsg::BusEdit`: a registered template's id plus the mask's PNG bytes. The reply
//! carries the edited PNG itself.
//!
//! ```text
//! denoised serve --cluster-port 7611 --cookie secret &
//! curl -X POST http://127.0.0.1:8080/v1/templates -d '{"image":"<base64>","id":"t1"}'
//! cargo run --example bus_client -- --node 127.0.0.1:7611 --cookie secret \
//!     --template-id t1 --mask mask.png --out out.png --prompt "a red door"
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use denoised_actors::daemon::job_name;
use denoised_actors::node;
use denoised_actors::wire::{groups, BusEdit, ErrorKind, RouterMsg, Wire};
use ractor_cluster::NodeServer;

/// Edit an image through a running `denoised` daemon over its actor bus.
#[derive(Parser)]
struct Args {
    /// The daemon's cluster node, HOST:PORT (`cluster node ...` in its start-up line).
    #[arg(long)]
    node: String,
    /// The cluster's shared secret (the daemon's `[cluster] cookie`).
    #[arg(long, env = "DENOISED_COOKIE", hide_env_values = true)]
    cookie: String,
    /// Id of a template registered with `POST /v1/templates`.
    #[arg(long)]
    template_id: String,
    /// Mask image (PNG/JPEG) of the template's size: white = repaint.
    #[arg(long)]
    mask: PathBuf,
    /// Where to write the edited PNG.
    #[arg(long)]
    out: PathBuf,
    /// Prompt for the repainted region.
    #[arg(long, default_value = "")]
    prompt: String,
    /// Noise seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds to wait for the router to appear after connecting.
    #[arg(long, default_value_t = 10)]
    wait_s: u64,
    /// Seconds to wait for the edit's reply.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bus_client: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let mask_png = std::fs::read(&args.mask)
        .map_err(|e| format!("cannot read the mask {}: {e}", args.mask.display()))?;

    // Our own node: port 0 (any free port), on loopback. The name must be unique among
    // the daemon's peers: ractor_cluster keeps one session per peer name, so a second
    // client under the same name would have its session (or the first's) dropped.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("bus-client-{}-{nanos:08x}", std::process::id());
    let server = NodeServer::new(0, args.cookie.clone(), name, "127.0.0.1".into(), None, None)
        .with_listen_addr(std::net::Ipv4Addr::LOCALHOST.into());
    let (local, _) = ractor::Actor::spawn(None, server, ())
        .await
        .map_err(|e| format!("cannot start the local cluster node: {e}"))?;

    // Opens the TCP session; the cookie handshake then runs in the background.
    ractor_cluster::client_connect(&local, args.node.as_str())
        .await
        .map_err(|e| {
            let why = match e {
                ractor_cluster::ClientConnectErr::Socket(io) => io.to_string(),
                other => other.to_string(),
            };
            format!(
                "cannot connect to the daemon's cluster node {}: {why}",
                args.node
            )
        })?;

    // Once authenticated, the daemon's node mirrors its process groups to ours. With a
    // wrong cookie the handshake fails quietly and the router never shows up.
    let t0 = Instant::now();
    let router = loop {
        if let Some(r) = node::members(groups::ROUTER).into_iter().next() {
            break r;
        }
        if t0.elapsed() > Duration::from_secs(args.wait_s) {
            return Err(format!(
                "connected to {} but no router appeared within {} s: check the cookie",
                args.node, args.wait_s
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let req = BusEdit {
        template_id: args.template_id,
        mask_png,
        prompt: args.prompt,
        seed: args.seed,
    };
    let t1 = Instant::now();
    // A reply port the daemon drops (e.g. a request it cannot decode: another version)
    // is never reported across nodes, so the call itself has no end: bound it.
    let timeout = Duration::from_secs(args.timeout_s);
    let done = node::ask(&router, timeout, |reply| {
        RouterMsg::BusEdit(Wire(req), reply)
    })
    .await
    .map_err(|e| match e.kind {
        ErrorKind::Timeout => format!("no reply within {} s", args.timeout_s),
        ErrorKind::NotFound => format!("not found: {}", e.message),
        ErrorKind::WorkerLost => format!("lost the connection to the daemon: {}", e.message),
        _ => format!("edit failed: {e}"),
    })?;

    std::fs::write(&args.out, &done.png)
        .map_err(|e| format!("cannot write {}: {e}", args.out.display()))?;
    println!(
        "{}: {} of {} tokens recomputed, {} bytes to {} in {:.2} s",
        job_name(done.job),
        done.active_tokens,
        done.tokens,
        done.png.len(),
        args.out.display(),
        t1.elapsed().as_secs_f64()
    );
    Ok(())
}
