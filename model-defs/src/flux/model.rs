//! The Flux transformer forward over a packed batch of requests.
//!
//! Rows of all requests are packed into one matrix per stream (text and image), so
//! every Linear runs once per block over the whole batch. adaLN modulation reads the
//! request's row of the modulation table through a per-row segment index, and
//! attention runs per request over `[text; image]`.
//!
//! A request may compute only some of its image tokens (a masked edit): it then passes
//! only those rows, and a [`BlockCache`] that supplies, for every block, the cached K/V
//! of the other tokens (KV mode) or their cached block outputs, from which the K/V are
//! recomputed (Y mode, see `inactive.rs`). A step's plan says which blocks compute
//! every token instead (docs/design.md §Planner). With all tokens passed and no cache, this
//! is exactly `FluxTransformer2DModel.forward`.
//!
//! [`FluxTransformer::forward_step`] reads as diffusers' forward: the embedders here,
//! then `FluxTransformerBlock` and `FluxSingleTransformerBlock` (`blocks.rs`), then
//! `norm_out` and `proj_out` here; what the blocks share (the batch's packing, the
//! inactive rows, the observer) is one `Step` (`step.rs`).

mod blocks;
mod step;

use std::fmt::Display;
use std::ops::Range;
use std::path::Path;
use std::sync::{Mutex, RwLock};

use denoised_runtime::backend::Modulation;
use denoised_runtime::{AttnSeq, Backend, Error, KvSource, QSpan, Result, Rows, Src, Tensor};

use self::step::{Packing, Step, Stream};
use super::adapters::{Registry, StepLoras};
use super::config::FluxConfig;
use super::embed;
pub use super::host::FluxInputs;
use super::inactive::y_cache;
pub use super::observer::{ForwardObserver, NoObserver};
pub use super::request::{RequestTensors, RestRows, StepRequest};
use super::template::CacheMode;
use super::weights::{FluxWeights, Linear, Seeded, Site, Source};
use crate::planner::{valid, Choice};

pub(super) const NORM_EPS: f32 = 1e-6;

/// One request of a batch with host inputs (the reference cases, `denoised bench forward`).
/// Serving uploads a request once instead ([`RequestTensors`]) and steps it with
/// [`FluxTransformer::forward_step`].
pub struct FluxRequest<'a, T> {
    /// `[A, in_channels]`: the image tokens to compute (all of them for a full run).
    pub img: &'a Tensor,
    /// `[A, 3]` position ids of those tokens.
    pub img_ids: &'a Tensor,
    /// `[T, joint_attention_dim]`.
    pub txt: &'a Tensor,
    /// `[T, 3]`.
    pub txt_ids: &'a Tensor,
    /// `[pooled_projection_dim]`.
    pub pooled: &'a [f32],
    /// Timestep as the pipeline passes it (scheduler timestep / 1000).
    pub timestep: f32,
    /// Guidance scale as the pipeline passes it (e.g. 30.0). Ignored by models
    /// without a guidance embedder.
    pub guidance: f32,
    /// The template cache of the image tokens not in `img` (mask-aware edits).
    pub cache: Option<&'a dyn BlockCache<T>>,
}

/// A step's output: the velocity of every computed row, packed request after request
/// (`[sum A_r, out_channels]` on the model's device), and each request's rows.
pub struct Velocity<T> {
    pub packed: T,
    pub rows: Vec<Range<usize>>,
}

/// One request's template cache at its current step: what it holds of the image
/// tokens the request does not compute.
pub trait BlockCache<T>: Sync {
    /// Indices (rows of the cached slabs) of the tokens not computed.
    fn inactive(&self) -> &[u32];
    fn mode(&self) -> CacheMode;
    /// The slab of block `b` (double blocks first, then single blocks): in KV mode
    /// `[L, 2*hidden]` rows of `[K | V]`, K post-norm and post-RoPE, asked for by the
    /// blocks that read it; in Y mode `[L, hidden]` rows of the block's output, asked
    /// for after the block (the next block's input). Asked for in block order, each
    /// after the previous block's work was queued (so a device can stream them in).
    fn block(&self, b: usize) -> Result<&T>;
}

pub struct FluxTransformer<B: Backend> {
    pub config: FluxConfig,
    backend: B,
    /// Written only to merge or unmerge LoRAs (between steps); every forward reads.
    pub(super) w: RwLock<FluxWeights<B>>,
    /// Where the weights came from, kept to restore merged sites bit for bit: the
    /// mapped checkpoint or the seed. Its pages are released after every read
    /// ([`Source::release`]): without that, the mapped pages the load touched stay in
    /// the process's resident memory beside the loaded weights, a second copy.
    pub(super) pristine: Box<dyn Source + Send + Sync>,
    pub(super) loras: Registry<B>,
    /// The sites a merged LoRA set has patched.
    pub(super) merged: Mutex<Vec<Site>>,
    time_freqs: Vec<f32>,
}

fn modl<'a, T>(table: &'a T, chunk: usize, seg: &'a [u32]) -> Modulation<'a, T> {
    Modulation { table, chunk, seg }
}

impl<B: Backend> FluxTransformer<B> {
    /// Loads a diffusers `transformer/` directory (`config.json` + safetensors).
    pub fn load(backend: B, dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = FluxConfig::from_file(dir.join("config.json"))?;
        let store = FluxWeights::<B>::open(&config, dir)?;
        let w = FluxWeights::build(&backend, &config, &store)?;
        Ok(Self::from_parts(backend, config, w, Box::new(store)))
    }

    /// Weights from any source (a ControlNet's checkpoint read as a transformer's),
    /// kept as the pristine copy that merged LoRAs are restored from.
    pub fn from_source(
        backend: B,
        config: FluxConfig,
        src: Box<dyn Source + Send + Sync>,
    ) -> Result<Self> {
        config.validate().map_err(Error::Invalid)?;
        let w = FluxWeights::build(&backend, &config, src.as_ref())?;
        Ok(Self::from_parts(backend, config, w, src))
    }

    /// Seeded random weights for `config`.
    pub fn seeded(backend: B, config: FluxConfig, seed: u64) -> Result<Self> {
        config.validate().map_err(Error::Invalid)?;
        let src = Seeded { seed };
        let w = FluxWeights::build(&backend, &config, &src)?;
        Ok(Self::from_parts(backend, config, w, Box::new(src)))
    }

    /// Parameters (elements) of the weights, as the checkpoint stores them.
    pub fn params(&self) -> u64 {
        super::weights::param_specs(&self.config)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// Bytes of the weights as this backend holds them, by form (`bf16`, `fp8`, `Q8_0`,
    /// ...): what `/readyz` and `denoised bench weights` report.
    pub fn memory(&self) -> std::collections::BTreeMap<String, u64> {
        match self.w.read() {
            Ok(w) => w.memory(&self.backend),
            Err(_) => Default::default(),
        }
    }

    fn from_parts(
        backend: B,
        config: FluxConfig,
        w: FluxWeights<B>,
        pristine: Box<dyn Source + Send + Sync>,
    ) -> Self {
        // The weights are in the backend's own buffers now: the checkpoint's pages the
        // load read are no longer needed in memory (they fault back in from the file
        // if a LoRA restore reads them).
        pristine.release();
        FluxTransformer {
            config,
            backend,
            w: RwLock::new(w),
            pristine,
            loras: Registry::default(),
            merged: Mutex::new(vec![]),
            time_freqs: embed::time_proj_freqs(),
        }
    }

    /// Replaces the 128 sinusoid frequencies. Torch's float32 `exp` is 1 ulp off the
    /// correctly rounded value for a few of them; passing torch's own table (the
    /// fixtures' `time_proj_freqs`) reproduces diffusers to float32 noise, which
    /// bring-up comparisons use to tell real bugs from this known difference.
    pub fn set_time_proj_freqs(&mut self, freqs: Vec<f32>) -> Result<()> {
        if freqs.len() != self.time_freqs.len() {
            return Err(Error::Invalid(format!(
                "{} sinusoid frequencies, expected {}",
                freqs.len(),
                self.time_freqs.len()
            )));
        }
        self.time_freqs = freqs;
        Ok(())
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Total number of blocks (double then single): the block index space of caches.
    pub fn num_blocks(&self) -> usize {
        self.config.num_layers + self.config.num_single_layers
    }

    fn linear(&self, x: &B::Tensor, l: &Linear<B>) -> Result<B::Tensor> {
        self.backend.linear(x, &l.w, l.b.as_ref())
    }

    /// The Linear `l` at `site` over `x`, plus the step's LoRA deltas there (request
    /// `r` owning rows `rows(r)` of both).
    fn linear_lora(
        &self,
        lo: &Option<StepLoras<B>>,
        site: Site,
        l: &Linear<B>,
        x: &B::Tensor,
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
    ) -> Result<B::Tensor> {
        let mut y = self.linear(x, l)?;
        self.lora(lo, site, &mut y, x, None, rows)?;
        Ok(y)
    }

    /// [`linear_lora`](Self::linear_lora) with GELU (tanh) over its output columns
    /// `gelu_from..`. A LoRA delta adds to the pre-activation, so the GELU is in the
    /// GEMM's epilogue ([`Backend::linear_gelu`]) only where no LoRA of the step
    /// touches `site`; else it is a pass after the delta.
    fn linear_gelu_lora(
        &self,
        lo: &Option<StepLoras<B>>,
        site: Site,
        l: &Linear<B>,
        x: &B::Tensor,
        gelu_from: usize,
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
    ) -> Result<B::Tensor> {
        let be = &self.backend;
        match lo {
            Some(lr) if lr.touches(site.index(&self.config)) => {
                let mut h = self.linear_lora(lo, site, l, x, rows)?;
                let width = be.shape(&h).last().copied().unwrap_or(0);
                be.gelu_tanh(&mut h, gelu_from.min(width)..width)?;
                Ok(h)
            }
            _ => be.linear_gelu(x, &l.w, l.b.as_ref(), gelu_from),
        }
    }

    /// [`linear_lora`](Self::linear_lora) over the column block `cols` of `x`, read in
    /// place (attention writes its output over q's columns of a fused projection).
    fn linear_cols_lora(
        &self,
        lo: &Option<StepLoras<B>>,
        site: Site,
        l: &Linear<B>,
        x: &B::Tensor,
        cols: Range<usize>,
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
    ) -> Result<B::Tensor> {
        let mut y = self
            .backend
            .linear_cols(x, cols.clone(), &l.w, l.b.as_ref())?;
        self.lora(lo, site, &mut y, x, Some(cols), rows)?;
        Ok(y)
    }

    /// Reports a hidden state to an observer that wants them. `name` is formatted only
    /// then (callers pass `format_args!`): no string is built per block otherwise.
    fn emit(
        &self,
        obs: &mut dyn ForwardObserver<B::Tensor>,
        name: impl Display,
        t: &B::Tensor,
    ) -> Result<()> {
        if obs.wants_hidden() {
            obs.hidden(&name.to_string(), self.backend.download(t)?);
        }
        Ok(())
    }

    /// [`emit`](Self::emit) of the rows `rows` of `t`.
    fn emit_rows(
        &self,
        obs: &mut dyn ForwardObserver<B::Tensor>,
        name: impl Display,
        t: &B::Tensor,
        rows: &[(u32, u32)],
    ) -> Result<()> {
        if obs.wants_hidden() {
            let g = self.backend.gather_rows(&[t], rows)?;
            obs.hidden(&name.to_string(), self.backend.download(&g)?);
        }
        Ok(())
    }

    /// One forward over a batch of requests whose tensors are on the device; returns
    /// the velocity of every computed row, still on the device.
    ///
    /// `plan` has one choice per block. A [`Choice::Full`] block computes the inactive
    /// rows of the edits that pass them (`StepRequest::rest`) as well, and reads no
    /// cache; a cached block computes the active rows against the cache. Edits of KV
    /// templates that pass their inactive rows need the full blocks to be a prefix
    /// (their inactive rows cannot rejoin once they have left); edits of Y templates
    /// pass them always, and may follow any pattern.
    ///
    /// The blocks are in `blocks.rs` (one function per diffusers module), the state they
    /// share in `step.rs`.
    pub fn forward_step(
        &self,
        reqs: &[StepRequest<'_, B::Tensor>],
        plan: &[Choice],
        obs: &mut dyn ForwardObserver<B::Tensor>,
    ) -> Result<Velocity<B::Tensor>> {
        let be = &self.backend;
        let w = self.w.read().map_err(|_| {
            Error::Invalid("the weights were poisoned by a panic while merging".into())
        })?;
        // Each request's unmerged LoRAs (None, and nothing added, when none has any).
        let lo = StepLoras::resolve(&self.loras, reqs)?;
        if reqs.is_empty() {
            return Ok(Velocity {
                packed: be.upload(&Tensor::zeros([0, self.config.out_channels()]))?,
                rows: vec![],
            });
        }
        self.validate(reqs, plan)?;
        let rows = Packing::new(be, reqs)?;
        let temb_act = self.time_text_embed(&w, &lo, reqs, obs)?;
        let mut st = Step {
            reqs,
            lo,
            temb_act,
            rows,
            obs,
        };
        let (mut x, mut ctx) = self.embed(&w, &mut st)?;
        for (bi, blk) in w.double.iter().enumerate() {
            let full = plan[bi] == Choice::Full;
            st.rows.enter(be, reqs, full, &mut x, Stream::Img)?;
            self.double_block(&mut st, bi, blk, &mut x, &mut ctx)?;
        }
        // The single blocks run over each request's joint [txt; img] rows.
        let mut h = be.gather_rows(&[&ctx, &x], &st.rows.phase.layout.joint_index)?;
        drop((x, ctx));
        for (si, blk) in w.single.iter().enumerate() {
            let full = plan[self.config.num_layers + si] == Choice::Full;
            st.rows.enter(be, reqs, full, &mut h, Stream::Joint)?;
            self.single_block(&mut st, si, blk, &mut h)?;
        }
        self.head(&w, &mut st, h)
    }

    /// Refuses a plan of another length, an edit without image tokens, and a KV-mode
    /// edit passing its inactive rows to a plan they could not follow.
    fn validate(&self, reqs: &[StepRequest<'_, B::Tensor>], plan: &[Choice]) -> Result<()> {
        let blocks = self.num_blocks();
        if plan.len() != blocks {
            return Err(Error::Invalid(format!(
                "a plan of {} blocks for a model of {blocks}",
                plan.len()
            )));
        }
        for (i, r) in reqs.iter().enumerate() {
            if let Some(cache) = r.cache {
                if cache.inactive().len() + r.tensors.img_rows() == 0 {
                    return Err(Error::Invalid(format!("request {i} has no image tokens")));
                }
            }
            let kv_rest = r.rest.is_some() && y_cache(r).is_none();
            if kv_rest && !valid(CacheMode::Kv, plan) {
                return Err(Error::Invalid(format!(
                    "request {i} passes the inactive rows of a KV-mode template to a plan whose full blocks are not a prefix"
                )));
            }
        }
        Ok(())
    }

    /// diffusers' `time_text_embed` (`CombinedTimestepGuidanceTextProjEmbeddings`): the
    /// conditioning vector temb `[B, d]`, one row per request. Returns SiLU(temb), the
    /// input of every block's modulation Linear and of `norm_out`'s.
    fn time_text_embed(
        &self,
        w: &FluxWeights<B>,
        lo: &Option<StepLoras<B>>,
        reqs: &[StepRequest<'_, B::Tensor>],
        obs: &mut dyn ForwardObserver<B::Tensor>,
    ) -> Result<B::Tensor> {
        let (c, be) = (&self.config, &self.backend);
        let nb = reqs.len();
        let ts: Vec<f32> = reqs.iter().map(|r| r.timestep * 1000.0).collect();
        let t_proj = be.upload(&Tensor::new(
            [nb, 256],
            embed::sinusoid(&ts, &self.time_freqs),
        )?)?;
        self.emit(obs, "timestep_proj", &t_proj)?;
        let t = (Site::Time1, &w.time_1);
        let mut temb = self.mlp2(lo, &t_proj, t, (Site::Time2, &w.time_2))?;
        if let Some((g1, g2)) = &w.guidance {
            let gs: Vec<f32> = reqs.iter().map(|r| r.guidance * 1000.0).collect();
            let g_proj = be.upload(&Tensor::new(
                [nb, 256],
                embed::sinusoid(&gs, &self.time_freqs),
            )?)?;
            self.emit(obs, "guidance_proj", &g_proj)?;
            let g = self.mlp2(lo, &g_proj, (Site::Guidance1, g1), (Site::Guidance2, g2))?;
            be.add(&mut temb, &g)?;
        }
        let pooled: Vec<f32> = reqs
            .iter()
            .flat_map(|r| r.tensors.pooled.iter().copied())
            .collect();
        let pooled = be.upload(&Tensor::new([nb, c.pooled_projection_dim], pooled)?)?;
        let text = (Site::Text1, &w.text_1);
        be.add(
            &mut temb,
            &self.mlp2(lo, &pooled, text, (Site::Text2, &w.text_2))?,
        )?;
        self.emit(obs, "temb", &temb)?;
        be.silu(&temb)
    }

    /// `x_embedder` and `context_embedder`: the packed image and text rows in the
    /// model's width, `(x, ctx)`.
    fn embed(
        &self,
        w: &FluxWeights<B>,
        st: &mut Step<'_, '_, B>,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let phase = &mut st.rows.phase;
        let img_in = phase.img.take().expect("packed with the image input");
        let lay = &phase.layout;
        let img_rows = |r: usize| Some(lay.img[r].clone());
        let txt_rows = |r: usize| Some(lay.txt[r].clone());
        let (lo, txt) = (&st.lo, st.rows.text.txt.get());
        let x = self.linear_lora(lo, Site::XEmbedder, &w.x_embedder, img_in.get(), &img_rows)?;
        drop(img_in);
        let s_ctx = Site::ContextEmbedder;
        let ctx = self.linear_lora(lo, s_ctx, &w.context_embedder, txt, &txt_rows)?;
        self.emit(st.obs, "x_embedder", &x)?;
        self.emit(st.obs, "context_embedder", &ctx)?;
        Ok((x, ctx))
    }

    /// `norm_out` (AdaLayerNormContinuous) and `proj_out` over the image rows of the
    /// joint matrix `h`: the step's velocity.
    fn head(
        &self,
        w: &FluxWeights<B>,
        st: &mut Step<'_, '_, B>,
        mut h: B::Tensor,
    ) -> Result<Velocity<B::Tensor>> {
        let be = &self.backend;
        if st.rows.in_full {
            // The velocity is of the computed rows only.
            st.rows.leave_full(be, st.reqs, &mut h, Stream::Joint)?;
        }
        let lay = &st.rows.phase.layout;
        let x = be.gather_rows(&[&h], &lay.img_in_joint)?;
        let per_req = |r: usize| Some(r..r + 1);
        let m = self.linear_lora(&st.lo, Site::NormOut, &w.norm_out, &st.temb_act, &per_req)?;
        // AdaLayerNormContinuous chunks are (scale, shift): reversed from adaLN-Zero.
        let nx = be.layer_norm_modulate(
            &x,
            NORM_EPS,
            modl(&m, 1, &lay.img_seg),
            modl(&m, 0, &lay.img_seg),
        )?;
        self.emit(st.obs, "norm_out", &nx)?;
        let img_rows = |r: usize| Some(lay.img[r].clone());
        let packed = self.linear_lora(&st.lo, Site::ProjOut, &w.proj_out, &nx, &img_rows)?;
        Ok(Velocity {
            packed,
            rows: lay.img.clone(),
        })
    }

    /// The attention sequence of one request at one block: queries `q`, fresh keys
    /// and values from `fresh` (buffer, rows) with K at column `k_col` and V right
    /// after it, plus the K/V of the tokens it does not compute where they are not
    /// among the fresh rows (`in_full` with its inactive rows passed): recomputed
    /// from a Y-mode template (`side`: the `[K | V]` of the batch's inactive rows and
    /// this request's rows of it), or read from a KV-mode template.
    #[allow(clippy::too_many_arguments)]
    fn seq<'a>(
        &self,
        req: &StepRequest<'a, B::Tensor>,
        block: usize,
        in_full: bool,
        side: Option<(&'a B::Tensor, Range<usize>)>,
        q: Vec<QSpan>,
        fresh: Vec<(usize, Range<usize>)>,
        k_col: usize,
    ) -> Result<AttnSeq<'a, B::Tensor>> {
        let d = self.config.hidden();
        let mut kv: Vec<KvSource<'a, B::Tensor>> = fresh
            .into_iter()
            .map(|(b, rows)| KvSource {
                src: Src::Own(b),
                k_col,
                v_col: k_col + d,
                rows: Rows::Range(rows),
            })
            .collect();
        let Some(cache) = req.cache.filter(|c| !c.inactive().is_empty()) else {
            return Ok(AttnSeq { q, kv });
        };
        if in_full && req.rest.is_some() {
            return Ok(AttnSeq { q, kv });
        }
        kv.push(match cache.mode() {
            CacheMode::Kv => KvSource {
                src: Src::Ext(cache.block(block)?),
                k_col: 0,
                v_col: d,
                rows: Rows::Index(cache.inactive()),
            },
            CacheMode::Y => {
                let (kvs, rows) = side.ok_or_else(|| {
                    Error::Invalid("a Y-mode template's K/V were not recomputed".into())
                })?;
                KvSource {
                    src: Src::Ext(kvs),
                    k_col: 0,
                    v_col: d,
                    rows: Rows::Range(rows),
                }
            }
        });
        Ok(AttnSeq { q, kv })
    }

    /// Linear → SiLU → Linear (the timestep, guidance and text embedders), over one
    /// row per request.
    fn mlp2(
        &self,
        lo: &Option<StepLoras<B>>,
        x: &B::Tensor,
        (s1, l1): (Site, &Linear<B>),
        (s2, l2): (Site, &Linear<B>),
    ) -> Result<B::Tensor> {
        let per_req = |r: usize| Some(r..r + 1);
        let h = self.linear_lora(lo, s1, l1, x, &per_req)?;
        let h1 = self.backend.silu(&h)?;
        self.linear_lora(lo, s2, l2, &h1, &per_req)
    }

    /// FeedForward: Linear → GELU(tanh) → Linear.
    fn ff(
        &self,
        lo: &Option<StepLoras<B>>,
        x: &B::Tensor,
        (s1, l1): (Site, &Linear<B>),
        (s2, l2): (Site, &Linear<B>),
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
    ) -> Result<B::Tensor> {
        let h = self.linear_gelu_lora(lo, s1, l1, x, 0, rows)?;
        self.linear_lora(lo, s2, l2, &h, rows)
    }
}
