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

use std::ops::Range;
use std::path::Path;
use std::sync::{Mutex, RwLock};

use denoised_runtime::backend::Modulation;
use denoised_runtime::{AttnSeq, Backend, Error, KvSource, QSpan, Result, Rows, Src, Tensor};

use super::adapters::{Registry, StepLoras};
use super::config::FluxConfig;
use super::embed;
pub use super::host::FluxInputs;
use super::inactive::{y_cache, Inactive};
pub use super::observer::{ForwardObserver, NoObserver};
use super::packing::{pack_text, PhaseInputs};
pub use super::request::{RequestTensors, RestRows, StepRequest};
use super::template::CacheMode;
use super::weights::{DoubleLinear, FluxWeights, Linear, Seeded, SingleLinear, Site, Source};
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

    fn emit(
        &self,
        obs: &mut dyn ForwardObserver<B::Tensor>,
        name: &str,
        t: &B::Tensor,
    ) -> Result<()> {
        if obs.wants_hidden() {
            obs.hidden(name, self.backend.download(t)?);
        }
        Ok(())
    }

    fn emit_rows(
        &self,
        obs: &mut dyn ForwardObserver<B::Tensor>,
        name: &str,
        t: &B::Tensor,
        rows: &[(u32, u32)],
    ) -> Result<()> {
        if obs.wants_hidden() {
            let g = self.backend.gather_rows(&[t], rows)?;
            obs.hidden(name, self.backend.download(&g)?);
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
    pub fn forward_step(
        &self,
        reqs: &[StepRequest<'_, B::Tensor>],
        plan: &[Choice],
        obs: &mut dyn ForwardObserver<B::Tensor>,
    ) -> Result<Velocity<B::Tensor>> {
        let c = &self.config;
        let be = &self.backend;
        let d = c.hidden();
        let heads = c.num_attention_heads;
        let w = self.w.read().map_err(|_| {
            Error::Invalid("the weights were poisoned by a panic while merging".into())
        })?;
        // Each request's unmerged LoRAs (None, and nothing added, when none has any).
        let lo = StepLoras::resolve(&self.loras, reqs)?;
        if reqs.is_empty() {
            return Ok(Velocity {
                packed: be.upload(&Tensor::zeros([0, c.out_channels()]))?,
                rows: vec![],
            });
        }

        // ---- packing: every request's rows, one matrix per stream ----------------
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
        // Edits' inactive rows start in the image matrix (the embedder computes them),
        // leave it at the first cached block and, for Y templates, rejoin it at the
        // next full block. Without such rows the step has one phase.
        let has_rest = reqs.iter().any(|r| r.rest.is_some());
        let mut side = Inactive::new(be, reqs)?;
        let mut phase = PhaseInputs::pack(be, reqs, has_rest, true)?;
        let text = pack_text(be, reqs)?;
        let rope_txt = (text.rope_cos.get(), text.rope_sin.get());
        // Image rows each request keeps when the full phase ends.
        let keep: Vec<usize> = reqs.iter().map(|r| r.tensors.img_rows()).collect();
        let mut in_full = has_rest;

        // ---- conditioning vector temb [B, d] ------------------------------------
        let nb = reqs.len();
        let ts: Vec<f32> = reqs.iter().map(|r| r.timestep * 1000.0).collect();
        let t_proj = Tensor::new([nb, 256], embed::sinusoid(&ts, &self.time_freqs))?;
        self.emit(obs, "timestep_proj", &be.upload(&t_proj)?)?;
        // The conditioning rows: one per request.
        let per_req = |r: usize| Some(r..r + 1);
        let mut temb = self.mlp2(
            &lo,
            &be.upload(&t_proj)?,
            (Site::Time1, &w.time_1),
            (Site::Time2, &w.time_2),
        )?;
        if let Some((g1, g2)) = &w.guidance {
            let gs: Vec<f32> = reqs.iter().map(|r| r.guidance * 1000.0).collect();
            let g_proj = be.upload(&Tensor::new(
                [nb, 256],
                embed::sinusoid(&gs, &self.time_freqs),
            )?)?;
            self.emit(obs, "guidance_proj", &g_proj)?;
            let g = self.mlp2(&lo, &g_proj, (Site::Guidance1, g1), (Site::Guidance2, g2))?;
            be.add(&mut temb, &g)?;
        }
        let pooled: Vec<f32> = reqs
            .iter()
            .flat_map(|r| r.tensors.pooled.iter().copied())
            .collect();
        let pooled = be.upload(&Tensor::new([nb, c.pooled_projection_dim], pooled)?)?;
        be.add(
            &mut temb,
            &self.mlp2(
                &lo,
                &pooled,
                (Site::Text1, &w.text_1),
                (Site::Text2, &w.text_2),
            )?,
        )?;
        self.emit(obs, "temb", &temb)?;
        let temb_act = be.silu(&temb)?;

        let img_in = phase.img.take().expect("packed with the image input");
        let mut x = self.linear(img_in.get(), &w.x_embedder)?;
        let lay = &phase.layout;
        let img_rows = |r: usize| Some(lay.img[r].clone());
        let txt_rows = |r: usize| Some(lay.txt[r].clone());
        self.lora(&lo, Site::XEmbedder, &mut x, img_in.get(), None, &img_rows)?;
        drop(img_in);
        let mut ctx = self.linear(text.txt.get(), &w.context_embedder)?;
        self.lora(
            &lo,
            Site::ContextEmbedder,
            &mut ctx,
            text.txt.get(),
            None,
            &txt_rows,
        )?;
        self.emit(obs, "x_embedder", &x)?;
        self.emit(obs, "context_embedder", &ctx)?;

        // ---- double-stream blocks ------------------------------------------------
        // Fused projections give [q | k | v] per stream; attention reads both streams
        // in place and writes its output over q, which the output projections read.
        for (bi, blk) in w.double.iter().enumerate() {
            let site = |k| Site::Double(bi, k);
            let full = plan[bi] == Choice::Full;
            if in_full && !full {
                if let Some(s) = &mut side {
                    s.take_from(be, &x, &phase.layout.img)?;
                }
                x = be.gather_rows(&[&x], &phase.layout.img_prefix(&keep))?;
                phase = PhaseInputs::pack(be, reqs, false, false)?;
                in_full = false;
            } else if !in_full && full && has_rest {
                let s = side.as_mut().expect("valid plans rejoin only Y-mode rows");
                x = s.merge_into(be, &x, &phase.layout.img)?;
                phase = PhaseInputs::pack(be, reqs, true, false)?;
                in_full = true;
            }
            let lay = &phase.layout;
            let rope_img = (phase.rope_img.0.get(), phase.rope_img.1.get());
            let img_rows = |r: usize| Some(lay.img[r].clone());
            let txt_rows = |r: usize| Some(lay.txt[r].clone());
            let mut m_img = self.linear(&temb_act, &blk.norm1)?;
            self.lora(
                &lo,
                site(DoubleLinear::Norm1),
                &mut m_img,
                &temb_act,
                None,
                &per_req,
            )?;
            let mut m_txt = self.linear(&temb_act, &blk.norm1_context)?;
            let s_nc = site(DoubleLinear::Norm1Context);
            self.lora(&lo, s_nc, &mut m_txt, &temb_act, None, &per_req)?;
            // The inactive rows' K/V at a cached block of a Y-mode template.
            let side_kv = match &side {
                Some(s) if !in_full => {
                    let (w, b) = (&blk.qkv.w, blk.qkv.b.as_ref());
                    let lora = self.side_lora(&lo, site(DoubleLinear::Qkv), s, d..3 * d);
                    Some(s.kv(be, &m_img, w, b, d..3 * d, &blk.norm_k, &lora)?)
                }
                _ => None,
            };
            let nx = be.layer_norm_modulate(
                &x,
                NORM_EPS,
                modl(&m_img, 0, &lay.img_seg),
                modl(&m_img, 1, &lay.img_seg),
            )?;
            let nc = be.layer_norm_modulate(
                &ctx,
                NORM_EPS,
                modl(&m_txt, 0, &lay.txt_seg),
                modl(&m_txt, 1, &lay.txt_seg),
            )?;
            let mut qkv_i = self.linear(&nx, &blk.qkv)?;
            self.lora(
                &lo,
                site(DoubleLinear::Qkv),
                &mut qkv_i,
                &nx,
                None,
                &img_rows,
            )?;
            let mut qkv_t = self.linear(&nc, &blk.add_qkv)?;
            self.lora(
                &lo,
                site(DoubleLinear::AddQkv),
                &mut qkv_t,
                &nc,
                None,
                &txt_rows,
            )?;
            drop((nx, nc));
            be.rms_norm_rope(&mut qkv_i, 0..d, &blk.norm_q, NORM_EPS, Some(rope_img))?;
            be.rms_norm_rope(&mut qkv_i, d..2 * d, &blk.norm_k, NORM_EPS, Some(rope_img))?;
            be.rms_norm_rope(
                &mut qkv_t,
                0..d,
                &blk.norm_added_q,
                NORM_EPS,
                Some(rope_txt),
            )?;
            be.rms_norm_rope(
                &mut qkv_t,
                d..2 * d,
                &blk.norm_added_k,
                NORM_EPS,
                Some(rope_txt),
            )?;
            for (ri, rows) in lay.img.iter().enumerate() {
                if obs.captures(ri) == Some(CacheMode::Kv) {
                    obs.block_slab(ri, bi, &be.gather_cols(&qkv_i, rows.clone(), d..3 * d)?)?;
                }
            }
            let seqs = (0..reqs.len())
                .map(|r| {
                    self.seq(
                        &reqs[r],
                        bi,
                        in_full,
                        side_rows(&side_kv, &side, r),
                        vec![
                            QSpan {
                                buf: 0,
                                rows: lay.txt[r].clone(),
                            },
                            QSpan {
                                buf: 1,
                                rows: lay.img[r].clone(),
                            },
                        ],
                        vec![(0, lay.txt[r].clone()), (1, lay.img[r].clone())],
                        d,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            be.attention(&mut [&mut qkv_t, &mut qkv_i], 0, d, heads, &seqs)?;
            drop(seqs);
            drop(side_kv);
            let mut a_img = be.linear_cols(&qkv_i, 0..d, &blk.to_out.w, blk.to_out.b.as_ref())?;
            let s_out = site(DoubleLinear::ToOut);
            self.lora(&lo, s_out, &mut a_img, &qkv_i, Some(0..d), &img_rows)?;
            let mut a_txt =
                be.linear_cols(&qkv_t, 0..d, &blk.to_add_out.w, blk.to_add_out.b.as_ref())?;
            let s_out = site(DoubleLinear::ToAddOut);
            self.lora(&lo, s_out, &mut a_txt, &qkv_t, Some(0..d), &txt_rows)?;
            drop((qkv_i, qkv_t));
            let p = format!("double_block.{bi}");
            self.emit(obs, &format!("{p}.attn.hidden_states"), &a_img)?;
            self.emit(obs, &format!("{p}.attn.encoder_hidden_states"), &a_txt)?;
            be.gated_residual(&mut x, &a_img, modl(&m_img, 2, &lay.img_seg))?;
            be.gated_residual(&mut ctx, &a_txt, modl(&m_txt, 2, &lay.txt_seg))?;

            let nx = be.layer_norm_modulate(
                &x,
                NORM_EPS,
                modl(&m_img, 3, &lay.img_seg),
                modl(&m_img, 4, &lay.img_seg),
            )?;
            let ff = self.ff(
                &lo,
                &nx,
                (site(DoubleLinear::FfIn), &blk.ff_in),
                (site(DoubleLinear::FfOut), &blk.ff_out),
                &img_rows,
            )?;
            self.emit(obs, &format!("{p}.ff"), &ff)?;
            be.gated_residual(&mut x, &ff, modl(&m_img, 5, &lay.img_seg))?;
            let nc = be.layer_norm_modulate(
                &ctx,
                NORM_EPS,
                modl(&m_txt, 3, &lay.txt_seg),
                modl(&m_txt, 4, &lay.txt_seg),
            )?;
            let ffc = self.ff(
                &lo,
                &nc,
                (site(DoubleLinear::FfContextIn), &blk.ff_context_in),
                (site(DoubleLinear::FfContextOut), &blk.ff_context_out),
                &txt_rows,
            )?;
            self.emit(obs, &format!("{p}.ff_context"), &ffc)?;
            be.gated_residual(&mut ctx, &ffc, modl(&m_txt, 5, &lay.txt_seg))?;
            for (r, req) in reqs.iter().enumerate() {
                if let Some((res, s)) = req.control.map(|c| c.double(bi)).transpose()?.flatten() {
                    // An edit's residual rows are its active rows, which come first.
                    let rows = lay.img[r].start..lay.img[r].start + keep[r];
                    be.add_block(&mut x, rows, 0..d, res, s)?;
                }
            }
            if obs.wants_block_images() {
                obs.block_image(bi, &x)?;
            }
            self.emit(obs, &format!("{p}.encoder_hidden_states"), &ctx)?;
            self.emit(obs, &format!("{p}.hidden_states"), &x)?;
            for (ri, rows) in lay.img.iter().enumerate() {
                if obs.captures(ri) == Some(CacheMode::Y) && bi + 1 < blocks {
                    obs.block_slab(ri, bi, &be.gather_cols(&x, rows.clone(), 0..d)?)?;
                }
            }
            if let Some(s) = side.as_mut().filter(|_| !in_full && bi + 1 < blocks) {
                s.load(be, reqs, bi)?;
            }
        }

        // ---- single-stream blocks over the joint [txt; img] rows ------------------
        // One fused projection gives [k | v | q | mlp]; attention overwrites q, so
        // columns d.. hold [k.. | attn | mlp] and proj_out reads [attn | mlp] in place.
        let mut h = be.gather_rows(&[&ctx, &x], &phase.layout.joint_index)?;
        drop((x, ctx));
        let nd = c.num_layers;
        for (si, blk) in w.single.iter().enumerate() {
            let bi = nd + si;
            let site = |k| Site::Single(si, k);
            let full = plan[bi] == Choice::Full;
            if in_full && !full {
                if let Some(s) = &mut side {
                    s.take_from(be, &h, &phase.layout.joint)?;
                }
                h = be.gather_rows(&[&h], &phase.layout.joint_prefix(&keep))?;
                phase = PhaseInputs::pack(be, reqs, false, false)?;
                in_full = false;
            } else if !in_full && full && has_rest {
                let s = side.as_mut().expect("valid plans rejoin only Y-mode rows");
                h = s.merge_into(be, &h, &phase.layout.joint)?;
                phase = PhaseInputs::pack(be, reqs, true, false)?;
                in_full = true;
            }
            let lay = &phase.layout;
            let n_joint = lay.joint_seg.len();
            let rope_joint = (phase.rope_joint.0.get(), phase.rope_joint.1.get());
            let joint_rows = |r: usize| Some(lay.joint[r].clone());
            let mut m = self.linear(&temb_act, &blk.norm)?;
            self.lora(
                &lo,
                site(SingleLinear::Norm),
                &mut m,
                &temb_act,
                None,
                &per_req,
            )?;
            let side_kv = match &side {
                Some(s) if !in_full => {
                    let (w, b) = (&blk.qkv_mlp.w, blk.qkv_mlp.b.as_ref());
                    let lora = self.side_lora(&lo, site(SingleLinear::QkvMlp), s, 0..2 * d);
                    Some(s.kv(be, &m, w, b, 0..2 * d, &blk.norm_k, &lora)?)
                }
                _ => None,
            };
            let n = be.layer_norm_modulate(
                &h,
                NORM_EPS,
                modl(&m, 0, &lay.joint_seg),
                modl(&m, 1, &lay.joint_seg),
            )?;
            let mut f = self.linear(&n, &blk.qkv_mlp)?;
            self.lora(
                &lo,
                site(SingleLinear::QkvMlp),
                &mut f,
                &n,
                None,
                &joint_rows,
            )?;
            drop(n);
            let p = format!("single_block.{si}");
            if obs.wants_hidden() {
                obs.hidden(
                    &format!("{p}.proj_mlp"),
                    be.download(&be.gather_cols(&f, 0..n_joint, 3 * d..7 * d)?)?,
                );
            }
            be.rms_norm_rope(
                &mut f,
                2 * d..3 * d,
                &blk.norm_q,
                NORM_EPS,
                Some(rope_joint),
            )?;
            be.rms_norm_rope(&mut f, 0..d, &blk.norm_k, NORM_EPS, Some(rope_joint))?;
            for (ri, jr) in lay.joint.iter().enumerate() {
                if obs.captures(ri) == Some(CacheMode::Kv) {
                    let rows = jr.start + lay.txt[ri].len()..jr.end;
                    obs.block_slab(ri, bi, &be.gather_cols(&f, rows, 0..2 * d)?)?;
                }
            }
            let seqs = (0..reqs.len())
                .map(|r| {
                    self.seq(
                        &reqs[r],
                        bi,
                        in_full,
                        side_rows(&side_kv, &side, r),
                        vec![QSpan {
                            buf: 0,
                            rows: lay.joint[r].clone(),
                        }],
                        vec![(0, lay.joint[r].clone())],
                        0,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            be.attention(&mut [&mut f], 2 * d, d, heads, &seqs)?;
            drop(seqs);
            drop(side_kv);
            if obs.wants_hidden() {
                obs.hidden(
                    &format!("{p}.attn"),
                    be.download(&be.gather_cols(&f, 0..n_joint, 2 * d..3 * d)?)?,
                );
            }
            be.gelu_tanh(&mut f, 3 * d..7 * d)?;
            let mut out =
                be.linear_cols(&f, 2 * d..7 * d, &blk.proj_out.w, blk.proj_out.b.as_ref())?;
            let s_out = site(SingleLinear::ProjOut);
            self.lora(&lo, s_out, &mut out, &f, Some(2 * d..7 * d), &joint_rows)?;
            drop(f);
            be.gated_residual(&mut h, &out, modl(&m, 2, &lay.joint_seg))?;
            for (r, req) in reqs.iter().enumerate() {
                if let Some((res, s)) = req.control.map(|c| c.single(si)).transpose()?.flatten() {
                    let img0 = lay.joint[r].start + lay.txt[r].len();
                    be.add_block(&mut h, img0..img0 + keep[r], 0..d, res, s)?;
                }
            }
            if obs.wants_block_images() {
                obs.block_image(bi, &be.gather_rows(&[&h], &lay.img_in_joint)?)?;
            }
            self.emit_rows(
                obs,
                &format!("{p}.encoder_hidden_states"),
                &h,
                &lay.txt_in_joint,
            )?;
            self.emit_rows(obs, &format!("{p}.hidden_states"), &h, &lay.img_in_joint)?;
            for (ri, jr) in lay.joint.iter().enumerate() {
                if obs.captures(ri) == Some(CacheMode::Y) && bi + 1 < blocks {
                    let rows = jr.start + lay.txt[ri].len()..jr.end;
                    obs.block_slab(ri, bi, &be.gather_cols(&h, rows, 0..d)?)?;
                }
            }
            if let Some(s) = side.as_mut().filter(|_| !in_full && bi + 1 < blocks) {
                s.load(be, reqs, bi)?;
            }
        }

        // ---- output head ----------------------------------------------------------
        if in_full {
            h = be.gather_rows(&[&h], &phase.layout.joint_prefix(&keep))?;
            phase = PhaseInputs::pack(be, reqs, false, false)?;
        }
        let lay = &phase.layout;
        let x = be.gather_rows(&[&h], &lay.img_in_joint)?;
        let mut m = self.linear(&temb_act, &w.norm_out)?;
        self.lora(&lo, Site::NormOut, &mut m, &temb_act, None, &per_req)?;
        // AdaLayerNormContinuous chunks are (scale, shift): reversed from adaLN-Zero.
        let nx = be.layer_norm_modulate(
            &x,
            NORM_EPS,
            modl(&m, 1, &lay.img_seg),
            modl(&m, 0, &lay.img_seg),
        )?;
        self.emit(obs, "norm_out", &nx)?;
        let mut packed = self.linear(&nx, &w.proj_out)?;
        let img_rows = |r: usize| Some(lay.img[r].clone());
        self.lora(&lo, Site::ProjOut, &mut packed, &nx, None, &img_rows)?;
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
        let mut h = self.linear(x, l1)?;
        self.lora(lo, s1, &mut h, x, None, &per_req)?;
        let h1 = self.backend.silu(&h)?;
        let mut y = self.linear(&h1, l2)?;
        self.lora(lo, s2, &mut y, &h1, None, &per_req)?;
        Ok(y)
    }

    /// FeedForward: Linear → GELU(tanh) → Linear. A LoRA on the first Linear adds to
    /// its pre-activation, so the fused GEMM+GELU is used only when none does.
    fn ff(
        &self,
        lo: &Option<StepLoras<B>>,
        x: &B::Tensor,
        (s1, l1): (Site, &Linear<B>),
        (s2, l2): (Site, &Linear<B>),
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
    ) -> Result<B::Tensor> {
        let be = &self.backend;
        let h = match lo {
            Some(l) if l.touches(s1.index(&self.config)) => {
                let mut h = self.linear(x, l1)?;
                self.lora(lo, s1, &mut h, x, None, rows)?;
                let width = be.shape(&h).last().copied().unwrap_or(0);
                be.gelu_tanh(&mut h, 0..width)?;
                h
            }
            _ => be.linear_gelu(x, &l1.w, l1.b.as_ref())?,
        };
        let mut y = self.linear(&h, l2)?;
        self.lora(lo, s2, &mut y, &h, None, rows)?;
        Ok(y)
    }
}

/// A request's rows of the inactive rows' recomputed K/V at a cached block, with them.
fn side_rows<'s, T>(
    kv: &'s Option<T>,
    side: &Option<Inactive<'_, T>>,
    req: usize,
) -> Option<(&'s T, Range<usize>)> {
    Some((kv.as_ref()?, side.as_ref()?.rows[req].clone()?))
}
