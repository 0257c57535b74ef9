//! `denoised bench controlnet-stream`: what moving a step's ControlNet residuals to the
//! denoise worker costs (docs/design.md §Adapters), at a real model's sizes, without
//! ControlNet weights: the ControlNet service's stream (`denoised_actors::controlnet::
//! stream`) through a real `/dev/shm` arena, the service side on one thread and the
//! denoise side (a second, writable mapping, as another process maps it) on another,
//! against sending the same residuals as one cluster message (postcard-encoded and
//! decoded, as `Wire` does). One JSON line.
//!
//! - `copy_s`: the service's copies of a step's residuals into shared memory (for an
//!   edit, `--active-ratio` below 1, gathering its active rows out of the ControlNets'
//!   full residuals on the way);
//! - `stream_s`: from the denoise side's `begin` to its last residual read (copied out,
//!   as the CPU backend's upload does), the service writing block by block;
//! - `first_residual_s`: when the first block was readable (what a forward waits for
//!   before its first ControlNet-conditioned block, the ControlNet's own compute aside);
//! - `message_s`: encode + decode of the whole step as one message (before the first
//!   block could be used).

use std::sync::Arc;
use std::time::{Duration, Instant};

use denoised_actors::controlnet::stream::{Stream, StreamFeed, StreamLayout};
use denoised_actors::wire::Wire;
use denoised_models::flux::control_feed::ControlFeed;
use denoised_runtime::shm::{self, futex, Arena, ArenaView};
use denoised_runtime::{DType, Tensor};
use ractor::BytesConvertable;
use serde_json::json;

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Image tokens (4096: a 1024x1024 FLUX.1 image).
    #[arg(long, default_value_t = 4096)]
    pub rows: usize,
    /// The transformer's width (3072: FLUX.1).
    #[arg(long, default_value_t = 3072)]
    pub hidden: usize,
    /// ControlNet residual blocks (double + single; 5 + 10 for a common FLUX.1
    /// ControlNet).
    #[arg(long, default_value_t = 5)]
    pub doubles: usize,
    #[arg(long, default_value_t = 10)]
    pub singles: usize,
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// A template edit's share of active tokens: its residuals carry only those rows
    /// (1: a generation).
    #[arg(long, default_value_t = 1.0)]
    pub active_ratio: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(a: Args) -> CliResult {
    if !(a.active_ratio > 0.0 && a.active_ratio <= 1.0) {
        return Err("--active-ratio must be in (0, 1]".into());
    }
    // The active rows, spread over the image.
    let n = ((a.rows as f64 * a.active_ratio).round() as usize).clamp(1, a.rows);
    let kept: Arc<Vec<u32>> = Arc::new((0..n).map(|i| (i * a.rows / n) as u32).collect());
    let layout = StreamLayout {
        doubles: a.doubles as u32,
        singles: a.singles as u32,
        rows: a.rows as u32,
        cols: 64,
        residual_rows: kept.len() as u32,
        hidden: a.hidden as u32,
        scale: 1.0,
    };
    let blocks = layout.blocks();
    let dir = shm::default_dir();
    let ns = format!("bench{}", std::process::id());
    let mut arena = Arena::create(&dir, &ns, "cn", layout.total_bytes() as u64 + (1 << 20))?;
    let h = arena.alloc(DType::U8, &[layout.total_bytes()])?;
    let own = arena.shared_view().host_slice(&h)?;
    // SAFETY: a fresh slice nobody else uses yet.
    unsafe { own.bytes_mut() }.fill(0);
    let view = Arc::new(ArenaView::attach_rw(&dir, &ns, "cn")?);
    let service = Arc::new(Stream::new(own, layout.clone())?);
    let feed = StreamFeed::new(
        Stream::new(view.host_slice(&h)?, layout.clone())?,
        std::process::id(),
        None,
    );
    let residual: Vec<f32> = (0..a.rows * a.hidden).map(|i| (i % 97) as f32).collect();
    let residual = Arc::new(Tensor::new([a.rows, a.hidden], residual)?);
    let edit = kept.len() < a.rows;
    let latents = Tensor::new([a.rows, 64], vec![0.5; a.rows * 64])?;

    let (mut copy, mut stream, mut first, mut message) = (vec![], vec![], vec![], vec![]);
    for round in 0..a.rounds {
        let s = service.clone();
        let r = residual.clone();
        let rows = kept.clone();
        let worker = std::thread::spawn(move || {
            let last = round as u32;
            while futex::wait_while(s.step_word(), last, Duration::from_secs(10)) == last {}
            let t0 = Instant::now();
            for k in 0..s.layout().blocks() {
                // As `control_step` hands an edit's residuals over: its rows gathered.
                let g = edit.then(|| r.gather(&rows));
                s.put_residual(round, k, g.as_ref().unwrap_or(&r).data())
                    .expect("a residual fits its stream");
            }
            t0.elapsed().as_secs_f64()
        });
        let t0 = Instant::now();
        feed.begin(round, &latents)?;
        let mut out = vec![0f32; kept.len() * a.hidden];
        let mut t_first = 0.0;
        for k in 0..blocks {
            feed.with_residual(k, &mut |r| {
                out.copy_from_slice(r);
                Ok(())
            })?;
            if k == 0 {
                t_first = t0.elapsed().as_secs_f64();
            }
        }
        stream.push(t0.elapsed().as_secs_f64());
        first.push(t_first);
        copy.push(worker.join().map_err(|_| "the service thread panicked")?);
        // The same residuals as one message.
        let t1 = Instant::now();
        let all: Vec<Vec<f32>> = (0..blocks)
            .map(|_| residual.data()[..out.len()].to_vec())
            .collect();
        let bytes = Wire(all).into_bytes();
        let back = Wire::<Vec<Vec<f32>>>::from_bytes(bytes).0;
        message.push(t1.elapsed().as_secs_f64());
        assert_eq!(back.len(), blocks);
    }
    drop(feed);
    let _ = arena.free(&h);
    drop(arena);
    let bytes = blocks * kept.len() * a.hidden * 4;
    let (copy, stream, first, message) =
        (median(copy), median(stream), median(first), median(message));
    let line = json!({
        "bench": "controlnet-stream",
        "rows": a.rows, "residual_rows": kept.len(), "hidden": a.hidden, "blocks": blocks,
        "residual_bytes_per_step": bytes,
        "copy_s": copy,
        "copy_gb_per_s": bytes as f64 / copy / 1e9,
        "stream_s": stream,
        "first_residual_s": first,
        "message_s": message,
        "message_over_stream": message / stream,
        "rounds": a.rounds,
    });
    println!("{line}");
    Ok(())
}
