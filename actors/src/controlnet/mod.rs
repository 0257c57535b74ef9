//! The ControlNet service (docs/design.md §Adapters): the `controlnet` actor group, in its
//! own processes (`[workers] controlnet`).
//!
//! A generation that names ControlNets gets a stream here after preprocessing
//! ([`ControlNetMsg::Start`]): the process loads its ControlNets (an LRU of weights in
//! memory, `[adapters] controlnet_cache_bytes`), VAE-encodes its control images, and
//! gives one thread to the stream ([`stream`]), which from then on runs the ControlNets
//! on every step's latents the denoise worker writes, streaming the summed residuals
//! block by block. The router closes it when the generation ends
//! ([`ControlNetMsg::Stop`]).
//!
//! The ControlNets run on the host's CPU backend (the process's rayon pool): a
//! `GpuBackend` per process would let them run on a GPU, which nothing here has been
//! measured on yet.

pub mod stream;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use denoised_models::flux::control_feed::{control_step, layout_of, ControlInputs, ControlUse};
use denoised_models::flux::controlnet::ControlNet;
use denoised_models::lru::ByteLru;
use denoised_models::pipeline::control::{control_rng, ControlEncoder};
use denoised_models::pipeline::flux_fill::FluxFill;
use denoised_models::pipeline::image::decode_image;
use denoised_runtime::shm::{futex, Handle};
use denoised_runtime::{CpuBackend, Tensor};
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::metrics::controlnet::ControlNetMetrics;
use crate::node::Shm;
use crate::wire::{ControlNetMsg, ControlStart, ControlStreamRef, JobId, Reply, Wire, WireError};
use stream::{Stream, StreamLayout};

pub struct ControlNetActor;

/// What a ControlNet process serves with.
pub struct ControlNetArgs {
    pub shm: Arc<Shm>,
    /// `[adapters] controlnets_dir`.
    pub dir: PathBuf,
    pub cache_bytes: u64,
    /// The model's pipeline without weights (sizes and schedules), and its VAE encoder.
    pub pipeline: Arc<FluxFill<CpuBackend>>,
    pub encoder: ControlEncoder,
    pub metrics: ControlNetMetrics,
}

struct Shared {
    shm: Arc<Shm>,
    dir: PathBuf,
    nets: ByteLru<String, ControlNet<CpuBackend>>,
    pipeline: Arc<FluxFill<CpuBackend>>,
    encoder: ControlEncoder,
    metrics: ControlNetMetrics,
}

pub struct ControlNetState {
    shared: Arc<Shared>,
    /// Open streams: their stop flags.
    streams: HashMap<JobId, Arc<AtomicBool>>,
}

impl Actor for ControlNetActor {
    type Msg = ControlNetMsg;
    type State = ControlNetState;
    type Arguments = ControlNetArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        a: ControlNetArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ControlNetState {
            shared: Arc::new(Shared {
                shm: a.shm,
                dir: a.dir,
                nets: ByteLru::new(a.cache_bytes as usize),
                pipeline: a.pipeline,
                encoder: a.encoder,
                metrics: a.metrics,
            }),
            streams: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ControlNetMsg::Start(Wire(req), reply) => {
                let stop = Arc::new(AtomicBool::new(false));
                st.streams.insert(req.job, stop.clone());
                let shared = st.shared.clone();
                // Loading, encoding and every step run on the stream's own thread.
                std::thread::Builder::new()
                    .name(format!("controlnet-{:x}", req.job))
                    .spawn(move || serve(&shared, req, reply, &stop))?;
            }
            ControlNetMsg::Stop(Wire(job)) => {
                if let Some(stop) = st.streams.remove(&job) {
                    stop.store(true, Ordering::Release);
                }
            }
            ControlNetMsg::RouterLost(_) => {
                for (_, stop) in st.streams.drain() {
                    stop.store(true, Ordering::Release);
                }
            }
        }
        Ok(())
    }
}

/// A loaded ControlNet of `name`: from the LRU, or from disk into it.
fn net(sh: &Shared, name: &str) -> Result<Arc<ControlNet<CpuBackend>>, WireError> {
    if let Some(n) = sh.nets.get(&name.to_string()) {
        return Ok(n);
    }
    crate::denoise::adapters::check_name(name).map_err(WireError::bad_input)?;
    let dir = sh.dir.join(name);
    if !dir.is_dir() {
        return Err(WireError::bad_input(format!(
            "no ControlNet `{name}` in {}",
            sh.dir.display()
        )));
    }
    let t0 = Instant::now();
    let loaded = ControlNet::load(CpuBackend::new(), &dir);
    let result = if loaded.is_ok() { "ok" } else { "error" };
    sh.metrics.loads.get_or_create(&[("result", result)]).inc();
    let n =
        Arc::new(loaded.map_err(|e| WireError::bad_input(format!("ControlNet `{name}`: {e}")))?);
    sh.metrics.load.observe(t0.elapsed().as_secs_f64());
    let bytes = weight_bytes(&dir);
    if !sh.nets.insert(name.to_string(), n.clone(), bytes) {
        tracing::warn!(
            "ControlNet `{name}` ({bytes} bytes) is larger than [adapters] controlnet_cache_bytes: loaded for this request only"
        );
    }
    Ok(n)
}

/// A ControlNet directory's weight bytes (what the LRU counts).
fn weight_bytes(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len() as usize)
        .sum()
}

/// Prepares a stream: its ControlNets, control latents and text inputs, and its slice.
fn open(
    sh: &Shared,
    req: &ControlStart,
) -> Result<Option<(Vec<ControlUse>, ControlInputs, Handle, Stream)>, WireError> {
    let bad = |e: denoised_runtime::Error| WireError::bad_input(e.to_string());
    let shm = &sh.shm;
    let (w, h) = (req.width as usize, req.height as usize);
    let mut rng = control_rng(req.seed);
    let mut uses = Vec::with_capacity(req.nets.len());
    for n in &req.nets {
        let net = net(sh, &n.name)?;
        let image = decode_image(&shm.read_bytes(&n.image)?, &sh.pipeline.limits).map_err(bad)?;
        if (image.width, image.height) != (w, h) {
            return Err(WireError::bad_input(format!(
                "the control image of `{}` is {}x{}; the output is {w}x{h}",
                n.name, image.width, image.height
            )));
        }
        let control = sh.encoder.encode(&image, None, &mut rng).map_err(bad)?;
        uses.push(ControlUse {
            net,
            control,
            scale: n.scale as f32,
        });
    }
    let i = &req.inputs;
    let schedule = sh
        .pipeline
        .schedule(req.steps as usize, w, h)
        .map_err(bad)?;
    let inputs = ControlInputs {
        img_ids: shm.read_tensor(&i.img_ids)?,
        txt: shm.read_tensor(&i.txt)?,
        txt_ids: shm.read_tensor(&i.txt_ids)?,
        pooled: shm.read_tensor(&i.pooled)?.into_data(),
        guidance: i.guidance,
        timesteps: ControlInputs::timesteps(&schedule),
        keep: req.active.clone(),
    };
    let Some(fl) = layout_of(&uses, &inputs).map_err(bad)? else {
        return Ok(None);
    };
    let layout = StreamLayout {
        doubles: fl.doubles as u32,
        singles: fl.singles as u32,
        rows: inputs.img_ids.rows() as u32,
        residual_rows: fl.rows as u32,
        cols: sh.pipeline.config.out_channels() as u32,
        hidden: fl.hidden as u32,
        scale: fl.scale,
    };
    let (handle, slice) = shm.alloc_host(layout.total_bytes())?;
    // Fresh words: no step announced, no residual published.
    // SAFETY: a slice just allocated, seen by nobody else yet.
    unsafe { slice.bytes_mut() }.fill(0);
    match Stream::new(slice, layout) {
        Ok(s) => Ok(Some((uses, inputs, handle, s))),
        Err(e) => {
            shm.release(&[handle]);
            Err(WireError::internal(e.to_string()))
        }
    }
}

/// How often a stream's thread looks at its stop flag while no step comes.
const POLL: Duration = Duration::from_millis(100);

/// A stream's thread: opens it, answers the start, then runs every step announced
/// until stopped.
fn serve(
    sh: &Shared,
    req: ControlStart,
    reply: Reply<Option<ControlStreamRef>>,
    stop: &AtomicBool,
) {
    let id = crate::daemon::job_name(req.job);
    let _span = tracing::info_span!("request", %id).entered();
    let (uses, inputs, handle, s) = match open(sh, &req) {
        Ok(Some(o)) => o,
        Ok(None) => {
            let _ = reply.send(Wire(Ok(None)));
            return;
        }
        Err(e) => {
            tracing::warn!("controlnet: {e}");
            let _ = reply.send(Wire(Err(e)));
            return;
        }
    };
    let r = ControlStreamRef {
        slot: handle.clone(),
        layout: s.layout().clone(),
    };
    if reply.send(Wire(Ok(Some(r)))).is_err() {
        sh.shm.release(&[handle]);
        return;
    }
    let mut last = 0;
    while !stop.load(Ordering::Acquire) {
        let v = futex::wait_while(s.step_word(), last, POLL);
        if v == last {
            continue;
        }
        last = v;
        let step = v as usize - 1;
        let t0 = Instant::now();
        let latents = Tensor::new(
            [s.layout().rows as usize, s.layout().cols as usize],
            s.latents().to_vec(),
        );
        let mut copy = Duration::ZERO;
        let r = latents.and_then(|l| {
            control_step(&uses, &inputs, step, &l, &mut |k, res| {
                let c0 = Instant::now();
                let r = s.put_residual(step, k, res.data());
                copy += c0.elapsed();
                r
            })
        });
        if let Err(e) = r {
            tracing::warn!("controlnet: step {step}: {e}");
            s.fail();
            continue;
        }
        sh.metrics.step.observe(t0.elapsed().as_secs_f64());
        sh.metrics.copy.observe(copy.as_secs_f64());
    }
    sh.shm.release(&[handle]);
}
/// Starts the ControlNet service's actor: its weights directory and LRU, the VAE
/// encoder its control images go through, and its metrics.
pub async fn spawn(
    env: &crate::node::WorkerEnv,
    pipeline: Arc<FluxFill<CpuBackend>>,
    shm: Arc<Shm>,
    registry: &mut crate::metrics::ProcessRegistry,
) -> Result<ractor::ActorCell, String> {
    let encoder = ControlEncoder::load(&env.model_source())
        .map_err(|e| format!("loading the VAE encoder for control images: {e}"))?;
    let ad = &env.config.adapters;
    let args = ControlNetArgs {
        shm,
        dir: ad.resolved_controlnets_dir(&env.config.cache),
        cache_bytes: ad.controlnet_cache_bytes,
        pipeline,
        encoder,
        metrics: ControlNetMetrics::register(registry.registry()),
    };
    let (a, _) = Actor::spawn(Some(env.name()), ControlNetActor, args)
        .await
        .map_err(|e| e.to_string())?;
    Ok(a.get_cell())
}
