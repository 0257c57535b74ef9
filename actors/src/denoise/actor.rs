//! The denoise actor: the cluster-facing side of a denoise worker.
//!
//! The actor feeds the step loop ([`DenoiseLoop`], its own OS thread, which owns the
//! model) and an event thread drains it ([`super::events`]): per-step statistics and
//! progress reports to the router, finished latents written to this process's arena,
//! and a `Done` message back to the actor, which answers the router's call. Neither side ever waits on the
//! other's work: the actor only reads inputs from shared memory and enqueues, so the
//! loop runs step after step.
//!
//! Templates are never copied here: an edit reads its template where the cache process
//! keeps it (a view of that arena, which a GPU streams from in place), and a capture
//! writes its template straight into a slice of this process's arena, allocated when
//! the request arrives, in the device's storage dtype.
//!
//! With `[denoise] disaggregate = false` (the baseline) the same actor also prepares
//! and finishes requests itself, as `LoopCommand::Run` work on the loop thread between
//! steps (see [`super::inline`]).

use denoised_models::flux::control_feed::ControlFeed;
use denoised_models::flux::edit::CfgPartner;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use denoised_models::flux::edit::{DenoiseInputs, Mode, TrueCfg};
use denoised_models::flux::stepper::{Stepper, StepperStats};
use denoised_models::flux::template::{CacheMode, TemplateCache, TemplateLayout};
use denoised_models::mask::TokenMask;
use denoised_models::FlowMatchEuler;
use denoised_runtime::shm::Handle;
use denoised_runtime::{DType, Tensor};
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::adapters::{adapter_path, AdapterOptions, LoraRequest};
use super::events::{self, EventCtx};
use super::inline::{self, InlineCtx, InlineJobs};
use super::{DenoiseLoop, DenoiseRequest, LoopOptions};
use crate::batching::BatchConfig;
use crate::daemon::unix_now;
use crate::node::{self, Shm};
use crate::stages::Pipeline;
use crate::wire::{
    DenoiseMsg, DenoiseReq, DenoiseWork, Denoised, ErrorKind, InputHandles, JobId, Reply,
    TemplateRef, Wire, WireError,
};

/// Template views a worker keeps (most recently used first): cheap (a view is a
/// mapping and a layout), and they let consecutive edits share one `TemplateCache`.
const TEMPLATE_VIEWS: usize = 64;
/// Cancels remembered for requests that have not arrived (more than can be in
/// flight between the router's tasks).
const CANCELLED_KEPT: usize = 256;

pub struct DenoiseActor;

pub struct DenoiseArgs {
    /// The host side: configs, and the CPU stages of the in-process baseline.
    pub pipeline: Arc<Pipeline>,
    /// The transformer on this worker's device; the loop thread takes it over.
    pub stepper: Box<dyn Stepper>,
    pub shm: Arc<Shm>,
    pub sched: BatchConfig,
    /// Faults to inject (tests and drills; none when serving).
    pub faults: crate::fault::Faults,
    /// `[workers] cache_arena_bytes`: a capture whose template cannot fit it is
    /// refused before it runs.
    pub cache_arena_bytes: u64,
    /// The storage dtype of this worker's templates: its device's.
    pub template_dtype: DType,
    pub metrics: crate::metrics::denoise::DenoiseMetrics,
    /// The stepper's counters: which templates its device holds, for the load reports.
    pub stats: Arc<StepperStats>,
    /// How the loop serves LoRAs, and the directory requests name them in.
    pub adapters: AdapterOptions,
    pub adapters_dir: PathBuf,
    /// Draws previews (its factors fitted to the model's VAE).
    pub(super) previews: super::preview::Previewer,
}

/// Captures running in the loop: the arena slice each one writes its template into.
pub(super) type Captures = Arc<Mutex<HashMap<JobId, Handle>>>;

pub struct DenoiseState {
    lp: DenoiseLoop,
    pipeline: Arc<Pipeline>,
    shm: Arc<Shm>,
    /// Requests in the loop: where to answer, when they arrived, and the router epoch
    /// they arrived in (`node::router_epoch`).
    pending: HashMap<JobId, (Reply<Denoised>, f64, u64)>,
    inline: InlineCtx,
    templates: VecDeque<(Handle, Arc<TemplateCache>)>,
    captures: Captures,
    cache_arena_bytes: u64,
    template_dtype: DType,
    /// Cancels of requests not (yet) here, newest first.
    cancelled: VecDeque<JobId>,
    adapters_dir: PathBuf,
    /// Where generations with ControlNets report their waits for residuals.
    control_wait: prometheus_client::metrics::histogram::Histogram,
}

impl Actor for DenoiseActor {
    type Msg = DenoiseMsg;
    type State = DenoiseState;
    type Arguments = DenoiseArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        a: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let options = LoopOptions {
            panic_at_step: a.faults.panic_at_step,
            slow_step: a.faults.slow_step,
            adapters: Some(a.adapters),
            ..LoopOptions::default()
        };
        let lp = DenoiseLoop::spawn(a.stepper, a.sched, options)?;
        let inline: InlineJobs = Arc::new(Mutex::new(HashMap::new()));
        let captures: Captures = Arc::new(Mutex::new(HashMap::new()));
        let events = lp.events().clone();
        // The name the router knows this worker's actor by.
        let name = myself.get_name().unwrap_or_default();
        let ctx = EventCtx {
            shm: a.shm.clone(),
            pipeline: a.pipeline.clone(),
            inline: inline.clone(),
            captures: captures.clone(),
            loop_tx: lp.sender(),
            myself,
            metrics: a.metrics.clone(),
            name,
            max_batch: a.sched.max_batch as u32,
            stats: a.stats,
            previews: a.previews,
        };
        events::spawn(events, ctx)?;
        let inline = InlineCtx {
            loop_tx: lp.sender(),
            pipeline: a.pipeline.clone(),
            shm: a.shm.clone(),
            jobs: inline,
            template_dtype: a.template_dtype,
        };
        Ok(DenoiseState {
            lp,
            pipeline: a.pipeline,
            shm: a.shm,
            pending: HashMap::new(),
            inline,
            templates: VecDeque::new(),
            captures,
            cache_arena_bytes: a.cache_arena_bytes,
            template_dtype: a.template_dtype,
            cancelled: VecDeque::new(),
            adapters_dir: a.adapters_dir,
            control_wait: a.metrics.control_wait.clone(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DenoiseMsg::Denoise(Wire(req), reply) => {
                let job = req.job;
                if let Some(i) = st.cancelled.iter().position(|&c| c == job) {
                    st.cancelled.remove(i);
                    let e = WireError::new(ErrorKind::Cancelled, "the request was cancelled");
                    let _ = reply.send(Wire(Err(e)));
                    return Ok(());
                }
                match st.request(&req) {
                    Ok(r) => {
                        st.pending
                            .insert(job, (reply, unix_now(), node::router_epoch()));
                        st.lp.submit(r);
                    }
                    Err(e) => {
                        let _ = reply.send(Wire(Err(e)));
                    }
                }
            }
            DenoiseMsg::Inline(Wire(req), reply) => {
                let template = match &req.work {
                    DenoiseWork::Edit { template, .. } => match st.template(template, &req) {
                        Ok(t) => Some(t),
                        Err(e) => {
                            let _ = reply.send(Wire(Err(e)));
                            return Ok(());
                        }
                    },
                    _ => None,
                };
                inline::submit(&st.inline, req, template, reply);
            }
            DenoiseMsg::Cancel(Wire(job)) => {
                if st.pending.contains_key(&job) {
                    st.lp.cancel(job);
                } else {
                    // The cancel overtook its request (sent from another task of the
                    // router): remembered, so the request is refused when it comes.
                    st.cancelled.push_front(job);
                    st.cancelled.truncate(CANCELLED_KEPT);
                }
            }
            DenoiseMsg::Release(Wire(handles)) => st.shm.release(&handles),
            DenoiseMsg::Done(Wire((job, result))) => {
                if let Some((reply, arrived, epoch)) = st.pending.remove(&job) {
                    if epoch != node::router_epoch() {
                        // For a router that is gone: nobody would release the result.
                        if let Ok(d) = &result {
                            st.shm.release(&d.handles());
                        }
                        return Ok(());
                    }
                    let result = result.map(|mut d| {
                        d.stats.queue_s = (d.stats.first_step_unix - arrived).max(0.0);
                        d
                    });
                    let _ = reply.send(Wire(result));
                }
            }
            DenoiseMsg::RouterLost(_) => {
                // Stop computing for the lost router; the cancellations come back as
                // `Done` and are dropped there.
                for job in st.pending.keys() {
                    st.lp.cancel(*job);
                }
            }
        }
        Ok(())
    }
}

impl DenoiseState {
    /// The feed of a request's ControlNet residuals: the stream the ControlNet
    /// service opened for it, mapped writable (this worker writes the latents).
    fn control_feed(
        &self,
        c: &crate::wire::ControlStreamRef,
    ) -> Result<Arc<dyn ControlFeed>, WireError> {
        use crate::controlnet::stream::{Stream, StreamFeed};
        let (slice, owner) = self.shm.host_slice_rw(&c.slot)?;
        let stream =
            Stream::new(slice, c.layout.clone()).map_err(|e| WireError::internal(e.to_string()))?;
        Ok(Arc::new(StreamFeed::new(
            stream,
            owner,
            Some(self.control_wait.clone()),
        )))
    }

    /// What steers a request besides its prompt: true CFG's negative branch (read out
    /// of the preprocess arena) and its ControlNets' residual stream.
    #[allow(clippy::type_complexity)]
    fn steering(
        &self,
        cfg: &Option<(crate::wire::NegativeHandles, f32)>,
        stream: &Option<crate::wire::ControlStreamRef>,
    ) -> Result<(Option<Box<TrueCfg>>, Option<Arc<dyn ControlFeed>>), WireError> {
        let control = stream.as_ref().map(|c| self.control_feed(c)).transpose()?;
        let Some((n, scale)) = cfg else {
            return Ok((None, control));
        };
        let txt = self.shm.read_tensor(&n.txt)?;
        let cfg = TrueCfg {
            txt_ids: Tensor::zeros([txt.rows(), 3]),
            txt,
            pooled: self.shm.read_tensor(&n.pooled)?.into_data(),
            scale: *scale,
        };
        Ok((Some(Box::new(cfg)), control))
    }

    /// Builds the loop request of a call: inputs copied out of the preprocess arena,
    /// the schedule, and for an edit the template cache and token mask; for a capture,
    /// the arena slice its template is written into.
    fn request(&mut self, req: &DenoiseReq) -> Result<DenoiseRequest, WireError> {
        let inputs = read_inputs(&self.shm, &req.inputs)?;
        let n = (req.rows * req.cols) as usize;
        let schedule = FlowMatchEuler::new(&self.pipeline.scheduler, req.steps as usize, n)
            .map_err(|e| WireError::bad_input(e.to_string()))?;
        let (mut start_at, mut store_at, mut true_cfg, mut control, mut partner) =
            (0, Vec::new(), None, None, None);
        let work = match &req.work {
            DenoiseWork::Full {
                true_cfg: cfg,
                control: stream,
            } => {
                (true_cfg, control) = self.steering(cfg, stream)?;
                Mode::Full
            }
            DenoiseWork::Generate {
                start_at: k,
                store_at: ks,
                true_cfg: cfg,
                control: stream,
                cfg_pair,
            } => {
                if let Some(p) = cfg_pair {
                    let (slice, _) = self.shm.host_slice_rw(&p.slot)?;
                    let pair = crate::denoise::cfg_pair::PairPartner::new(slice, p)
                        .map_err(|e| WireError::internal(e.to_string()))?;
                    partner = Some(Arc::new(pair) as Arc<dyn CfgPartner>);
                }
                (true_cfg, control) = self.steering(cfg, stream)?;
                start_at = *k as usize;
                store_at = ks.iter().map(|&k| k as usize).collect();
                Mode::Full
            }
            DenoiseWork::Capture { mode, step_stride } => {
                let layout = self.capture_layout(n, req.steps, *mode, *step_stride)?;
                let (handle, bytes) = self.shm.alloc_host(layout.total_bytes())?;
                let cache = TemplateCache::empty_in(layout, bytes)
                    .map_err(|e| WireError::internal(e.to_string()));
                if cache.is_err() {
                    self.shm.release(&[handle]);
                } else {
                    lock(&self.captures).insert(req.job, handle);
                }
                Mode::Capture(cache?)
            }
            DenoiseWork::Edit {
                template,
                true_cfg: cfg,
                control: stream,
            } => {
                (true_cfg, control) = self.steering(cfg, stream)?;
                Mode::Edit {
                    mask: Arc::new(token_mask(req.rows, req.cols, &req.active)?),
                    cache: self.template(template, req)?,
                }
            }
        };
        Ok(DenoiseRequest {
            id: req.job,
            inputs: Arc::new(inputs),
            schedule: Arc::new(schedule),
            work,
            start_at,
            store_at,
            true_cfg,
            control,
            partner,
            preview: (req.preview_every > 0).then_some(crate::denoise::PreviewSpec {
                every: req.preview_every as usize,
                rows: req.rows as usize,
                cols: req.cols as usize,
            }),
            loras: req
                .loras
                .iter()
                .filter(|l| !l.merged)
                .map(|l| {
                    Ok(LoraRequest {
                        path: adapter_path(&self.adapters_dir, &l.name)
                            .map_err(WireError::bad_input)?,
                        name: l.name.clone(),
                        scale: l.scale as f32,
                        patch_by: l.patch_by as usize,
                    })
                })
                .collect::<Result<_, WireError>>()?,
        })
    }

    /// The layout of a capture's template, once it is known to fit where it goes:
    /// this worker's arena (where the result is written) and the cache's. Checked
    /// before the capture runs, so a template that cannot be stored costs no compute.
    fn capture_layout(
        &self,
        tokens: usize,
        steps: u32,
        mode: CacheMode,
        step_stride: u32,
    ) -> Result<TemplateLayout, WireError> {
        let layout = self
            .layout(tokens, steps, self.template_dtype)
            .with_mode(mode)
            .with_step_stride(step_stride as usize);
        layout
            .check()
            .map_err(|e| WireError::bad_input(e.to_string()))?;
        let bytes = layout.total_bytes() as u64;
        let (free, own) = self.shm.room();
        let mb = |b: u64| b as f64 / 1e6;
        let limit = own.min(self.cache_arena_bytes);
        if bytes > limit {
            return Err(WireError::new(
                ErrorKind::TooLarge,
                format!(
                    "this template's cache ({:.0} MB for {tokens} tokens x {steps} steps) cannot fit the shared-memory arenas ({:.0} MB): raise [workers] cache_arena_bytes and denoise_arena_bytes, or use a smaller image or fewer steps",
                    mb(bytes),
                    mb(limit)
                ),
            ));
        }
        if bytes > free {
            return Err(WireError::new(
                ErrorKind::Overloaded,
                format!(
                    "no room for this template's cache now ({:.0} MB, {:.0} MB free): retry later",
                    mb(bytes),
                    mb(free)
                ),
            ));
        }
        Ok(layout)
    }

    /// The layout of a template of an image of `tokens` tokens (a Kontext template
    /// also holds its reference tokens).
    fn layout(&self, tokens: usize, steps: u32, dtype: DType) -> TemplateLayout {
        let grid = self.pipeline.kind.template_tokens(tokens);
        TemplateLayout::for_model(&self.pipeline.config, grid, steps as usize, dtype)
    }

    /// The template's cache, read in place in the cache process's arena. Its key (how
    /// the device recognises a template it keeps) is its version, the same in every
    /// tier of the cache, with the top bit set to stay clear of locally counted keys.
    fn template(
        &mut self,
        t: &TemplateRef,
        req: &impl Shape,
    ) -> Result<Arc<TemplateCache>, WireError> {
        if let Some(i) = self.templates.iter().position(|(h, _)| *h == t.blob) {
            let hit = self.templates.remove(i).expect("index from position");
            self.templates.push_front(hit.clone());
            return Ok(hit.1);
        }
        let (tokens, steps) = req.tokens_steps();
        if (t.tokens, t.steps) != (tokens, steps) {
            return Err(WireError::bad_input(format!(
                "template `{}` is for {} tokens x {} steps, the request has {tokens} x {steps}",
                t.id, t.tokens, t.steps
            )));
        }
        let layout = TemplateLayout::infer(
            &self.pipeline.config,
            self.pipeline.kind.template_tokens(tokens as usize),
            steps as usize,
            t.step_stride as usize,
            t.blob.len,
        )
        .ok_or_else(|| {
            WireError::internal(format!(
                "template `{}` holds {} bytes, which no layout of {tokens} tokens x {steps} steps has",
                t.id, t.blob.len
            ))
        })?;
        let bytes = self.shm.host_slice(&t.blob)?;
        let cache = TemplateCache::view(layout, bytes)
            .map_err(|e| WireError::internal(e.to_string()))?
            .with_key(t.version | 1 << 63);
        let cache = Arc::new(cache);
        self.templates.push_front((t.blob.clone(), cache.clone()));
        self.templates.truncate(TEMPLATE_VIEWS);
        Ok(cache)
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Token count and steps of a request, for checking a template against it.
pub(super) trait Shape {
    fn tokens_steps(&self) -> (u32, u32);
}

impl Shape for DenoiseReq {
    fn tokens_steps(&self) -> (u32, u32) {
        (self.rows * self.cols, self.steps)
    }
}

impl Shape for crate::wire::InlineReq {
    fn tokens_steps(&self) -> (u32, u32) {
        // The template and the request share the image, so the template's own token
        // count is the request's; only the steps can disagree.
        match &self.work {
            DenoiseWork::Edit { template, .. } => (template.tokens, self.prepare.params.steps),
            _ => (0, self.prepare.params.steps),
        }
    }
}

pub(super) fn token_mask(rows: u32, cols: u32, active: &[u32]) -> Result<TokenMask, WireError> {
    let (rows, cols) = (rows as usize, cols as usize);
    let mut on = vec![false; rows * cols];
    for &a in active {
        *on.get_mut(a as usize).ok_or_else(|| {
            WireError::bad_input(format!("active token {a} outside {rows}x{cols}"))
        })? = true;
    }
    TokenMask::from_tokens(rows, cols, &on).map_err(|e| WireError::bad_input(e.to_string()))
}

fn read_inputs(shm: &Shm, h: &InputHandles) -> Result<DenoiseInputs, WireError> {
    Ok(DenoiseInputs {
        latents: shm.read_tensor(&h.latents)?,
        cond: shm.read_tensor(&h.cond)?,
        img_ids: shm.read_tensor(&h.img_ids)?,
        txt: shm.read_tensor(&h.txt)?,
        txt_ids: shm.read_tensor(&h.txt_ids)?,
        pooled: shm.read_tensor(&h.pooled)?.data().to_vec(),
        guidance: h.guidance,
        reference: match &h.reference {
            Some(r) => Some(denoised_models::flux::edit::Reference {
                latents: shm.read_tensor(&r.latents)?,
                ids: shm.read_tensor(&r.ids)?,
                inpaint: match &r.inpaint {
                    Some([mask, image, noise]) => Some(denoised_models::flux::edit::Inpaint {
                        mask: shm.read_tensor(mask)?,
                        image: shm.read_tensor(image)?,
                        noise: shm.read_tensor(noise)?,
                    }),
                    None => None,
                },
            }),
            None => None,
        },
    })
}

/// Starts a denoise worker's actor on its placed transformer: the batch scheduler's
/// limits, the template storage dtype, the adapter slots, and its metrics.
pub async fn spawn(
    env: &crate::node::WorkerEnv,
    pipeline: Arc<Pipeline>,
    placed: crate::device::Placed,
    shm: Arc<Shm>,
    faults: crate::fault::Faults,
    registry: &mut crate::metrics::ProcessRegistry,
) -> Result<ractor::ActorCell, String> {
    let d = &env.config.denoise;
    let sched = BatchConfig {
        max_batch: d.max_batch,
        token_budget: d.token_budget,
        mode: d.batching,
        template_bytes: placed
            .budget
            .as_ref()
            .map_or(u64::MAX, |b| b.template_bytes),
    };
    sched.validate().map_err(|e| e.to_string())?;
    let template_dtype = match env.config.cache.kv_dtype.as_str() {
        "" => placed.template_dtype(),
        name => denoised_models::flux::template::storage_dtype(name)
            .map_err(|e| format!("[cache] kv_dtype: {e}"))?,
    };
    let stats = placed.stepper.stats();
    let ad = &env.config.adapters;
    let adapters = AdapterOptions {
        config: pipeline.config.clone(),
        slots: ad.device_slots,
        throttle_bytes_per_s: (ad.throttle_mib_per_s > 0.0)
            .then_some(ad.throttle_mib_per_s * (1u64 << 20) as f64),
    };
    let metrics = crate::metrics::denoise::DenoiseMetrics::register(
        registry.registry(),
        stats.clone(),
        placed.budget.clone(),
    );
    let args = DenoiseArgs {
        pipeline,
        stepper: placed.stepper,
        shm,
        sched,
        faults,
        cache_arena_bytes: env.config.workers.cache_arena_bytes,
        template_dtype,
        metrics,
        stats,
        adapters,
        adapters_dir: ad.resolved_dir(&env.config.cache),
        previews: super::preview::Previewer::start(env.model_source()),
    };
    let (a, _) = Actor::spawn(Some(env.name()), DenoiseActor, args)
        .await
        .map_err(|e| e.to_string())?;
    Ok(a.get_cell())
}
