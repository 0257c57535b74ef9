//! Measurements of the serving runtime's own overheads (`denoised bench overheads`):
//! per-step batch assembly in the denoise loop, the shared-memory handoff of a
//! finished latent, and a message round trip between cluster nodes. The design budget
//! (docs/design.md) is 1.2 ms per step for batching, 2.4 ms for a latent handoff and 0.6 ms
//! per routing decision; the serving issue asks for under 0.1 ms for the first two.

use std::sync::Arc;
use std::time::{Duration, Instant};

use denoised_models::flux::edit::DenoiseInputs;
use denoised_models::flux::edit::Mode;
use denoised_models::flux::embed::image_ids;
use denoised_models::flux::stepper::ModelStepper;
use denoised_models::flux::weights::SplitMix;
use denoised_models::{FlowMatchEuler, FluxConfig, ModelSource};
use denoised_runtime::shm::{Arena, ArenaView};
use denoised_runtime::{CpuBackend, Tensor};
use ractor::rpc::CallResult;
use ractor::ActorRef;
use serde::Serialize;

use crate::batching::BatchConfig;
use crate::denoise::{DenoiseLoop, DenoiseRequest, Event, LoopOptions};
use crate::wire::{groups, RouterMsg, Wire};

/// Order statistics of a sample, in seconds.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub n: usize,
    pub mean_s: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub max_s: f64,
}

impl Summary {
    pub fn of(mut v: Vec<f64>) -> Summary {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let at = |q: f64| {
            if n == 0 {
                0.0
            } else {
                v[((q * n as f64).ceil() as usize).clamp(1, n) - 1]
            }
        };
        Summary {
            n,
            mean_s: v.iter().sum::<f64>() / n.max(1) as f64,
            p50_s: at(0.5),
            p99_s: at(0.99),
            max_s: v.last().copied().unwrap_or(0.0),
        }
    }
}

/// Per-step batch assembly of the real denoise loop: `requests` concurrent requests
/// (8x8 tokens each, the built-in tiny transformer) for `steps` steps.
pub fn batch_assembly(requests: usize, steps: usize) -> Result<Summary, String> {
    let model = Arc::new(
        ModelSource::Builtin
            .load_transformer(CpuBackend::new())
            .map_err(|e| e.to_string())?,
    );
    let cfg = BatchConfig {
        max_batch: requests.max(1),
        ..Default::default()
    };
    let stepper = ModelStepper::unbounded(model, 4);
    let lp = DenoiseLoop::spawn(Box::new(stepper), cfg, LoopOptions::default())?;
    let c = FluxConfig::tiny();
    let side = 8;
    let l = side * side;
    for id in 0..requests as u64 {
        let mut rng = SplitMix::new(id);
        let mut rand = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
        let t = |shape: [usize; 2], d| Tensor::new(shape, d).map_err(|e| e.to_string());
        let inputs = DenoiseInputs {
            latents: t([l, 64], rand(l * 64))?,
            cond: t([l, c.in_channels - 64], rand(l * (c.in_channels - 64)))?,
            img_ids: t([l, 3], image_ids(side, side))?,
            txt: t([8, c.joint_attention_dim], rand(8 * c.joint_attention_dim))?,
            txt_ids: Tensor::zeros([8, 3]),
            pooled: rand(c.pooled_projection_dim),
            guidance: 30.0,
            reference: None,
        };
        let schedule =
            FlowMatchEuler::new(&Default::default(), steps, l).map_err(|e| e.to_string())?;
        lp.submit(DenoiseRequest {
            id,
            inputs: Arc::new(inputs),
            schedule: Arc::new(schedule),
            work: Mode::Full,
            start_at: 0,
            store_at: Vec::new(),
            preview: None,
            loras: vec![],
            true_cfg: None,
            control: None,
            partner: None,
        });
    }
    let mut times = Vec::new();
    let mut finished = 0;
    // Finished events precede the step event that finished them, so the loop ends on
    // the first step event after the last request finished.
    loop {
        match lp.events().recv_timeout(Duration::from_secs(120)) {
            Ok(Event::Step {
                assembly_seconds, ..
            }) => {
                times.push(assembly_seconds);
                if finished == requests {
                    break;
                }
            }
            Ok(Event::Finished { .. }) => finished += 1,
            Ok(Event::Failed { error, .. }) => return Err(error),
            Ok(Event::Cancelled { .. }) => finished += 1,
            Ok(
                Event::Submitted { .. }
                | Event::Stored { .. }
                | Event::Preview { .. }
                | Event::LoraApplied { .. }
                | Event::LoraLoaded { .. },
            ) => {}
            Err(e) => return Err(format!("denoise loop stalled: {e}")),
        }
    }
    Ok(Summary::of(times))
}

/// The shared-memory handoff of a finished latent of `tokens x 64` f32 (4096 tokens is
/// a 1024x1024 FLUX image): the denoise worker writes it into its arena (one memcpy),
/// the postprocess worker maps it and decodes from the borrowed slice (zero-copy); a
/// reader that wants its own copy pays a second memcpy. Returns (write, borrow, copy).
pub fn handoff(tokens: usize, iters: usize) -> Result<(Summary, Summary, Summary, usize), String> {
    let dir = denoised_runtime::shm::default_dir();
    let ns = format!("bench{}", std::process::id());
    let mut arena = Arena::create(&dir, &ns, "denoise0", 64 << 20).map_err(|e| e.to_string())?;
    let view = ArenaView::attach(&dir, &ns, "denoise0").map_err(|e| e.to_string())?;
    let latent = Tensor::new(
        [tokens, 64],
        (0..tokens * 64).map(|i| (i % 97) as f32).collect(),
    )
    .map_err(|e| e.to_string())?;
    let (mut w, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    let mut sink = 0.0f32;
    for _ in 0..iters {
        let t0 = Instant::now();
        let h = arena.write_tensor(&latent).map_err(|e| e.to_string())?;
        w.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let s = view.slice_f32(&h).map_err(|e| e.to_string())?;
        b.push(t0.elapsed().as_secs_f64());
        sink += s[s.len() - 1];
        let t0 = Instant::now();
        let copy = view.read_tensor(&h).map_err(|e| e.to_string())?;
        c.push(t0.elapsed().as_secs_f64());
        sink += copy.data()[0];
        arena.free(&h).map_err(|e| e.to_string())?;
    }
    std::hint::black_box(sink);
    drop(view);
    arena.destroy().map_err(|e| e.to_string())?;
    Ok((
        Summary::of(w),
        Summary::of(b),
        Summary::of(c),
        tokens * 64 * 4,
    ))
}

/// Round trips of a small call to the router actor of a running daemon over
/// ractor_cluster (TCP on loopback, postcard): the same path as every router → worker
/// call. The daemon must have a known cookie (`--cookie`) and node port.
pub async fn round_trips(port: u16, cookie: &str, iters: usize) -> Result<Summary, String> {
    let node =
        crate::node::start_named_node(&format!("bench{}", std::process::id()), cookie, 0).await?;
    crate::node::connect_router(&node, port, Duration::from_secs(5)).await?;
    let t0 = Instant::now();
    let router = loop {
        if let Some(r) = crate::node::members(groups::ROUTER).into_iter().next() {
            break r;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err("the router never appeared: check the port and the cookie".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let actor: ActorRef<RouterMsg> = router.into();
    let mut times = Vec::new();
    for i in 0..iters as u64 + 10 {
        let t0 = Instant::now();
        match actor.call(|p| RouterMsg::Ping(Wire(i), p), None).await {
            Ok(CallResult::Success(Wire(Ok(x)))) if x == i => {}
            other => return Err(format!("ping failed: {:?}", other.map(|_| ()))),
        }
        // The first calls warm up the connection.
        if i >= 10 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(Summary::of(times))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_matches_nearest_rank() {
        let s = Summary::of((1..=100).rev().map(|i| i as f64).collect());
        assert_eq!((s.n, s.p50_s, s.p99_s, s.max_s), (100, 50.0, 99.0, 100.0));
        assert!((s.mean_s - 50.5).abs() < 1e-12);
    }

    #[test]
    fn assembly_is_measured_on_every_step() {
        let s = batch_assembly(3, 2).unwrap();
        // At least the 2 steps of the batch; more when the loop started before all
        // three requests arrived.
        assert!((2..=6).contains(&s.n), "{} steps", s.n);
        assert!(s.max_s > 0.0 && s.max_s < 1.0);
    }
}
