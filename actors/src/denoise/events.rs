//! The denoise worker's event thread: it drains what the loop thread reports (a
//! request submitted, a step done, a request finished, failed or cancelled, a state
//! stored, a LoRA loaded or applied) and turns it into metrics, per-request statistics,
//! progress and load reports to the router, results written to this process's arena,
//! and a `Done` message back to the actor ([`super::actor`]), which answers the
//! router's call. It owns its state (the statistics and results in progress); the
//! only tables it shares with the actor are the captures' and the inline jobs'.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crossbeam_channel::Receiver;
use denoised_models::flux::stepper::StepperStats;
use denoised_models::flux::template::TemplateCache;
use denoised_runtime::shm::Handle;
use denoised_runtime::Tensor;
use ractor::ActorRef;

use super::actor::{lock, Captures};
use super::inline::{self, InlineJobs};
use super::Event;
use crate::daemon::job_name;
use crate::node::{self, Shm};
use crate::stages::Pipeline;
use crate::wire::{
    groups, DenoiseMsg, DenoiseStats, Denoised, ErrorKind, JobId, LoadEntry, Preview, Progress,
    RouterMsg, Wire, WireError, WorkerLoad,
};

/// Starts the event thread, which runs until the loop (the sender of `events`) is
/// gone.
pub(super) fn spawn(events: Receiver<Event>, ctx: EventCtx) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("denoise-events".into())
        .spawn(move || drain_events(events, ctx))
        .map(drop)
}

/// What the event thread needs.
pub(super) struct EventCtx {
    pub shm: Arc<Shm>,
    pub pipeline: Arc<Pipeline>,
    pub inline: InlineJobs,
    pub captures: Captures,
    pub metrics: crate::metrics::denoise::DenoiseMetrics,
    pub loop_tx: super::LoopSender,
    pub myself: ActorRef<DenoiseMsg>,
    /// For the load reports: this worker's name, batch limit and device templates.
    pub name: String,
    pub max_batch: u32,
    pub stats: Arc<StepperStats>,
    pub previews: super::preview::Previewer,
}

/// Tells the router this worker's load (see [`WorkerLoad`]): after every step and
/// every change of its requests, so the router routes on fresh data.
fn report_load(
    ctx: &EventCtx,
    router: Option<&ractor::ActorCell>,
    load: &BTreeMap<JobId, LoadEntry>,
) {
    let Some(r) = router else {
        return;
    };
    // Keys are versions with the top bit set (see `DenoiseState::template`).
    let device_templates = lock(&ctx.stats.resident_keys)
        .iter()
        .map(|k| k & !(1 << 63))
        .collect();
    node::tell(
        r,
        RouterMsg::Load(Wire(WorkerLoad {
            worker: ctx.name.clone(),
            max_batch: ctx.max_batch,
            requests: load.values().copied().collect(),
            device_templates,
        })),
    );
}

/// Per-request statistics the event thread accumulates from step events.
#[derive(Default)]
struct Acc {
    stats: DenoiseStats,
    steps_done: u32,
}

/// Drains the loop's events until the loop is gone.
fn drain_events(events: Receiver<Event>, ctx: EventCtx) {
    let mut acc: HashMap<JobId, Acc> = HashMap::new();
    // Finished results arrive just before the step event that finished them; they are
    // held until that event has been counted.
    let mut ready: Vec<(JobId, Tensor, Option<TemplateCache>)> = Vec::new();
    // Generations' stored states, written to the arena as they come.
    let mut stored: HashMap<JobId, Vec<(u32, Handle)>> = HashMap::new();
    let drop_stored = |stored: &mut HashMap<JobId, Vec<(u32, Handle)>>, id: JobId| {
        let handles: Vec<Handle> = stored
            .remove(&id)
            .into_iter()
            .flatten()
            .map(|s| s.1)
            .collect();
        ctx.shm.release(&handles);
    };
    // The requests in the loop, as the load reports describe them.
    let mut load: BTreeMap<JobId, LoadEntry> = BTreeMap::new();
    let router = || node::members(groups::ROUTER).into_iter().next();
    for ev in events {
        match ev {
            Event::Submitted { id, shape, steps } => {
                let n = |x: usize| x as u32;
                load.insert(
                    id,
                    LoadEntry {
                        job: id,
                        text: n(shape.text),
                        active: n(shape.active),
                        image: n(shape.image),
                        steps_left: steps,
                    },
                );
                report_load(&ctx, router().as_ref(), &load);
            }
            Event::Step {
                batch,
                seconds,
                ended_unix: now,
                assembly_seconds,
                rows,
                running,
                waiting,
                report,
                ..
            } => {
                let m = &ctx.metrics;
                m.step.observe(seconds);
                if let Some(d) = report.device_s {
                    m.step_device.observe(d);
                }
                m.full_blocks.observe(report.full_blocks as f64);
                if let Some(p) = report.predicted_s {
                    m.predicted.observe(p);
                }
                if let Some(b) = report.bubble_s {
                    m.bubble.observe(b);
                }
                m.batch_requests.observe(batch.len() as f64);
                m.batch_tokens.observe(rows as f64);
                m.running.set(running as i64);
                m.waiting.set(waiting as i64);
                let router = router();
                for &id in &batch {
                    if let Some(e) = load.get_mut(&id) {
                        e.steps_left = e.steps_left.saturating_sub(1);
                    }
                    let a = acc.entry(id).or_default();
                    if a.steps_done == 0 {
                        a.stats.first_step_unix = now - seconds;
                    }
                    a.steps_done += 1;
                    a.stats.batch_sizes.push(batch.len() as u32);
                    a.stats.assembly_max_s = a.stats.assembly_max_s.max(assembly_seconds);
                    a.stats.denoise_s = now - a.stats.first_step_unix;
                    a.stats.finished_unix = now;
                    if let Some(r) = &router {
                        node::tell(
                            r,
                            RouterMsg::Progress(Wire(Progress {
                                job: id,
                                step: a.steps_done,
                                steps: 0,
                                batch: batch.len() as u32,
                            })),
                        );
                    }
                }
                for (id, latents, cache) in ready.drain(..) {
                    load.remove(&id);
                    let a = acc.remove(&id).unwrap_or_default();
                    outcome(&ctx, "finished");
                    let worker = crate::logging::worker();
                    let _span =
                        tracing::info_span!("request", id = %job_name(id), %worker).entered();
                    tracing::info!(
                        "denoised: {} steps in {:.3} s, mean batch {:.1}",
                        a.steps_done,
                        a.stats.denoise_s,
                        a.stats.batch_sizes.iter().sum::<u32>() as f64
                            / a.stats.batch_sizes.len().max(1) as f64
                    );
                    let states = stored.remove(&id).unwrap_or_default();
                    finished(&ctx, id, latents, cache, states, a.stats);
                }
                report_load(&ctx, router.as_ref(), &load);
            }
            Event::Finished { id, latents, cache } => ready.push((id, latents, cache)),
            Event::LoraApplied { id, step } => {
                acc.entry(id).or_default().stats.loras_applied_at = Some(step as u32);
            }
            Event::LoraLoaded {
                name,
                seconds,
                error,
            } => {
                let m = &ctx.metrics;
                m.lora_load.observe(seconds);
                let result = if error.is_none() { "ok" } else { "error" };
                m.lora_loads.get_or_create(&[("result", result)]).inc();
                match error {
                    None => tracing::info!(lora = %name, seconds, "LoRA loaded"),
                    Some(e) => tracing::warn!(lora = %name, seconds, "LoRA not loaded: {e}"),
                }
            }
            Event::Preview {
                id,
                k,
                latents,
                spec,
            } => {
                if let (Some(jpeg), Some(r)) = (ctx.previews.draw(&latents, spec), router()) {
                    let p = Preview {
                        job: id,
                        step: k as u32,
                        jpeg,
                    };
                    node::tell(&r, RouterMsg::Preview(Wire(p)));
                }
            }
            Event::Stored { id, k, latents } => match ctx.shm.write_tensor(&latents) {
                Ok(h) => stored.entry(id).or_default().push((k as u32, h)),
                // The arena is full: the state is not cached, the request goes on.
                Err(e) => tracing::warn!(id = %job_name(id), "state after step {k} not kept: {e}"),
            },
            Event::Failed { id, error } => {
                drop_stored(&mut stored, id);
                acc.remove(&id);
                load.remove(&id);
                report_load(&ctx, router().as_ref(), &load);
                outcome(&ctx, "failed");
                let worker = crate::logging::worker();
                tracing::warn!(id = %job_name(id), %worker, "denoise failed: {error}");
                failed(&ctx, id, WireError::internal(error));
            }
            Event::Cancelled { id } => {
                drop_stored(&mut stored, id);
                acc.remove(&id);
                load.remove(&id);
                report_load(&ctx, router().as_ref(), &load);
                outcome(&ctx, "cancelled");
                failed(
                    &ctx,
                    id,
                    WireError::new(ErrorKind::Cancelled, "the request was cancelled"),
                );
            }
        }
    }
}

fn outcome(ctx: &EventCtx, what: &'static str) {
    ctx.metrics
        .requests
        .get_or_create(&[("outcome", what)])
        .inc();
}

fn failed(ctx: &EventCtx, id: JobId, e: WireError) {
    if let Some(h) = lock(&ctx.captures).remove(&id) {
        ctx.shm.release(&[h]);
    }
    if let Some(job) = inline::take(&ctx.inline, id) {
        let _ = job.reply.send(Wire(Err(e)));
    } else {
        let _ = ctx.myself.cast(DenoiseMsg::Done(Wire((id, Err(e)))));
    }
}

fn finished(
    ctx: &EventCtx,
    id: JobId,
    latents: Tensor,
    cache: Option<TemplateCache>,
    states: Vec<(u32, Handle)>,
    stats: DenoiseStats,
) {
    // A capture wrote its template into its arena slice; one made elsewhere (the
    // in-process baseline's) is copied in.
    let captured = lock(&ctx.captures).remove(&id);
    let cache = match (cache, captured) {
        (Some(_), Some(h)) => Some(h),
        (Some(c), None) => match ctx.shm.write_bytes(c.bytes().bytes()) {
            Ok(h) => Some(h),
            Err(e) => return failed(ctx, id, e),
        },
        (None, h) => {
            ctx.shm.release(&h.into_iter().collect::<Vec<_>>());
            None
        }
    };
    if let Some(job) = inline::take(&ctx.inline, id) {
        inline::finish(ctx, job, latents, cache, stats);
        return;
    }
    let result = match ctx.shm.write_tensor(&latents) {
        Ok(latents) => Ok(Denoised {
            latents,
            cache,
            states,
            stats,
        }),
        Err(e) => {
            let mut h: Vec<Handle> = cache.into_iter().collect();
            h.extend(states.into_iter().map(|s| s.1));
            ctx.shm.release(&h);
            Err(e)
        }
    };
    let _ = ctx.myself.cast(DenoiseMsg::Done(Wire((id, result))));
}
