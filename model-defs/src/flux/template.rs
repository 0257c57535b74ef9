//! The template cache: what a capture run records so that edits can skip the
//! unmasked tokens.
//!
//! A template caches, for every (step, block), one slab over every image token, in one
//! of two modes ([`CacheMode`], chosen per template):
//!
//! - **KV**: the block's K (post-norm, post-RoPE) and V rows, `[L, 2*hidden]` of `[K |
//!   V]` rows. An edit attends to them directly.
//! - **Y**: the block's output hidden states, `[L, hidden]`: half the bytes. An edit
//!   recomputes the K/V of its inactive tokens each step from the previous block's
//!   output (a projection of only the K and V columns), so any block may compute in
//!   full (docs/design.md §Planner). The last block's output is read by nothing (the head
//!   reads only computed tokens), so it is not stored: `blocks - 1` slabs per step.
//!
//! Then, for every step, the packed latent after that step, `[L, C]`. It is one flat
//! image in host memory, laid out by [`TemplateLayout`]: slabs step-major, block-minor,
//! in their storage dtype (by default the capturing device's: bf16 on a GPU, f32 on
//! the CPU; or fp8 E4M3, a KV-mode slab then ending with one f32 scale per head's K
//! and per head's V, see `denoised_runtime::fp8`), then the latents in f32. The same bytes are the shared-memory form the cache
//! process holds (which a GPU worker streams from in place), and the data file of a
//! template on disk. Cache size is a first-class number (docs/design.md §Costs): in KV mode
//! `steps x blocks x L x hidden x 2 x bytes`.

use std::sync::atomic::{AtomicU64, Ordering};

use denoised_runtime::backend::write_host;
use denoised_runtime::stored::encode;
use denoised_runtime::{fp8, DType, Error, HostSlice, Result, SlabShape, Stored, Tensor};

use super::config::FluxConfig;
use crate::pipeline::flux_fill::PipelineKind;
pub use crate::planner::CacheMode;

/// A template slab storage dtype by name: `f32`, `bf16` or `fp8` (E4M3 with a scale per
/// head's K and V).
pub fn storage_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "fp8" => Ok(DType::F8E4M3),
        other => Err(Error::Invalid(format!(
            "template storage dtype `{other}`: expected f32, bf16 or fp8"
        ))),
    }
}

/// The name [`storage_dtype`] reads.
pub fn storage_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F8E4M3 => "fp8",
        DType::F16 => "f16",
        DType::U8 => "u8",
    }
}

/// A served model as its templates' layouts depend on it: the transformer's config,
/// and its pipeline (a Kontext template's grid holds the reference tokens too).
#[derive(Clone, Debug)]
pub struct TemplateModel {
    pub config: FluxConfig,
    pub kind: PipelineKind,
}

impl TemplateModel {
    /// The model of `source`, read from its configs.
    pub fn of(source: &crate::ModelSource) -> Result<Self> {
        Ok(TemplateModel {
            config: source.transformer_config()?,
            kind: source.pipeline_kind()?,
        })
    }

    /// [`TemplateLayout::infer`] for a template of an image of `tokens` tokens.
    pub fn infer(
        &self,
        tokens: usize,
        steps: usize,
        step_stride: usize,
        bytes: u64,
    ) -> Option<TemplateLayout> {
        let grid = self.kind.template_tokens(tokens);
        TemplateLayout::infer(&self.config, grid, steps, step_stride, bytes)
    }
}

/// Shapes, mode and dtype of a template cache, and the flat byte layout derived from
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateLayout {
    pub steps: usize,
    /// Transformer blocks: double then single.
    pub blocks: usize,
    /// Image tokens L.
    pub tokens: usize,
    pub hidden: usize,
    /// Channels of the packed latent (the transformer's out_channels).
    pub latent_channels: usize,
    /// Storage dtype of the slabs (latents are f32).
    pub dtype: DType,
    /// What each slab holds.
    pub mode: CacheMode,
    /// Attention heads: an fp8 slab has a scale per head's K and per head's V.
    pub heads: usize,
    /// Slabs are stored for every `step_stride`-th step only (step sharing, KV mode);
    /// a step reads the nearest stored one ([`TemplateLayout::stored`]). Latents are
    /// stored for every step.
    pub step_stride: usize,
}

impl TemplateLayout {
    /// A KV-mode layout (see [`TemplateLayout::with_mode`]).
    pub fn for_model(c: &FluxConfig, tokens: usize, steps: usize, dtype: DType) -> Self {
        TemplateLayout {
            steps,
            blocks: c.num_layers + c.num_single_layers,
            tokens,
            hidden: c.hidden(),
            latent_channels: c.out_channels(),
            dtype,
            mode: CacheMode::Kv,
            heads: c.num_attention_heads,
            step_stride: 1,
        }
    }

    pub fn with_mode(self, mode: CacheMode) -> Self {
        TemplateLayout { mode, ..self }
    }

    pub fn with_step_stride(self, step_stride: usize) -> Self {
        TemplateLayout {
            step_stride,
            ..self
        }
    }

    /// Steps whose slabs are stored: 0, k, 2k, ... below `steps`.
    pub fn stored_steps(&self) -> usize {
        self.steps.div_ceil(self.step_stride.max(1))
    }
    /// The stored step (its index among the stored ones) that step `step` reads: the
    /// nearest one (ties go to the later, less noisy step).
    pub fn stored(&self, step: usize) -> usize {
        let k = self.step_stride.max(1);
        ((step + k / 2) / k).min(self.stored_steps().saturating_sub(1))
    }
    /// Whether step `step`'s slabs are stored (what a capture writes).
    pub fn stores(&self, step: usize) -> bool {
        step % self.step_stride.max(1) == 0
    }

    /// The layout for `c` of `tokens` x `steps` with slabs every `step_stride` steps
    /// whose flat image is `bytes` long: its storage dtype and mode are the ones whose
    /// layout has that size (only its size tells them; at one stride the sizes differ
    /// for any non-empty template).
    pub fn infer(
        c: &FluxConfig,
        tokens: usize,
        steps: usize,
        step_stride: usize,
        bytes: u64,
    ) -> Option<Self> {
        let kv = Self::for_model(c, tokens, steps, DType::F32).with_step_stride(step_stride);
        [DType::BF16, DType::F32, DType::F8E4M3]
            .into_iter()
            .flat_map(|dt| [CacheMode::Kv, CacheMode::Y].map(|m| (m, dt)))
            .map(|(m, dt)| TemplateLayout { dtype: dt, ..kv }.with_mode(m))
            .find(|l| l.check().is_ok() && l.total_bytes() as u64 == bytes)
    }

    /// Whether a template of this layout serves requests of `expected`'s shapes and
    /// model (its dtype and mode are its own). A file written before the head count
    /// was recorded (never fp8) has `heads` 0.
    pub fn fits(&self, expected: &TemplateLayout) -> bool {
        (
            self.steps,
            self.blocks,
            self.tokens,
            self.hidden,
            self.latent_channels,
        ) == (
            expected.steps,
            expected.blocks,
            expected.tokens,
            expected.hidden,
            expected.latent_channels,
        ) && (self.heads == expected.heads || (self.heads == 0 && self.dtype != DType::F8E4M3))
    }

    /// Whether the combination is one templates use: f32, bf16 or fp8 slabs, fp8 only
    /// for K/V (block outputs in fp8 lose too much: their outliers set the scale).
    pub fn check(&self) -> Result<()> {
        if self.step_stride == 0 || (self.step_stride > 1 && self.mode != CacheMode::Kv) {
            return Err(Error::Invalid(format!(
                "a step stride of {} (step sharing stores K/V every k >= 1 steps, cache mode kv)",
                self.step_stride
            )));
        }
        match (self.dtype, self.mode) {
            (DType::F32 | DType::BF16, _) | (DType::F8E4M3, CacheMode::Kv) => Ok(()),
            (DType::F8E4M3, CacheMode::Y) => Err(Error::Invalid(
                "fp8 templates cache K/V (cache mode kv), not block outputs".into(),
            )),
            (other, _) => Err(Error::Invalid(format!(
                "templates are stored in f32, bf16 or fp8, not {other:?}"
            ))),
        }
    }

    /// The form of one slab (with its scales in fp8).
    pub fn slab_shape(&self) -> SlabShape {
        SlabShape {
            rows: self.tokens,
            cols: self.slab_width(),
            dtype: self.dtype,
            groups: 2 * self.heads,
        }
    }

    /// The stored bytes of a slab of `values` (`[L, slab_width]`, row-major).
    pub fn encode_slab(&self, values: &[f32]) -> Vec<u8> {
        match self.dtype {
            DType::F8E4M3 => {
                let s = self.slab_shape();
                let (mut bytes, scales) = fp8::quantize(values, s.cols, s.groups);
                bytes.extend(scales.iter().flat_map(|v| v.to_le_bytes()));
                bytes
            }
            dt => encode(values, dt),
        }
    }

    /// The values of a stored slab.
    pub fn decode_slab(&self, bytes: &[u8]) -> Result<Vec<f32>> {
        let s = self.slab_shape();
        match self.dtype {
            DType::F8E4M3 => Ok(fp8::dequantize(
                &bytes[..s.data_bytes()],
                s.cols,
                &s.scales(bytes),
            )),
            dt => Ok(
                Stored::new("template slab", vec![s.rows, s.cols], dt, bytes)?
                    .to_f32()?
                    .into_data(),
            ),
        }
    }

    /// Columns of a slab: `[K | V]` or the block output.
    pub fn slab_width(&self) -> usize {
        match self.mode {
            CacheMode::Kv => 2 * self.hidden,
            CacheMode::Y => self.hidden,
        }
    }
    /// Slabs per step: one per block, or in Y mode one per block but the last.
    pub fn slabs_per_step(&self) -> usize {
        match self.mode {
            CacheMode::Kv => self.blocks,
            CacheMode::Y => self.blocks.saturating_sub(1),
        }
    }
    /// Slabs of the whole template.
    pub fn slab_count(&self) -> usize {
        self.stored_steps() * self.slabs_per_step()
    }
    /// Elements of one `[L, slab_width]` slab.
    pub fn slab_elems(&self) -> usize {
        self.tokens * self.slab_width()
    }
    /// Stored bytes of one slab (with an fp8 slab's scales).
    pub fn slab_bytes(&self) -> usize {
        self.slab_shape().bytes()
    }
    /// Bytes of one latent: f32, since the Euler update accumulates in it (a small
    /// share of a template).
    pub fn latent_bytes(&self) -> usize {
        self.tokens * self.latent_channels * 4
    }
    /// Byte offset of the slab of block `block` of stored step `stored` (an index
    /// among the stored steps, [`TemplateLayout::stored`]) in the flat image.
    pub fn slab_offset(&self, stored: usize, block: usize) -> usize {
        (stored * self.slabs_per_step() + block) * self.slab_bytes()
    }
    /// Byte offset of the latent after `step`, after all slabs.
    pub fn latent_offset(&self, step: usize) -> usize {
        self.slab_count() * self.slab_bytes() + step * self.latent_bytes()
    }
    /// Slab bytes of one step (what one step of an edit reads with every block
    /// cached).
    pub fn cache_bytes_per_step(&self) -> usize {
        self.slabs_per_step() * self.slab_bytes()
    }
    pub fn total_bytes(&self) -> usize {
        self.latent_offset(self.steps)
    }
}

/// A template's cache: the flat image of its layout in host memory.
#[derive(Clone, Debug)]
pub struct TemplateCache {
    layout: TemplateLayout,
    bytes: HostSlice,
    /// Identity for devices that keep templates: equal keys are the same bytes.
    key: u64,
    complete: bool,
}

/// Keys of templates made in this process (see [`TemplateCache::with_key`]).
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

impl TemplateCache {
    /// An empty cache in memory of its own, to be filled by a capture run.
    pub fn new(layout: TemplateLayout) -> Result<Self> {
        Self::empty_in(layout, HostSlice::zeroed(layout.total_bytes())?)
    }

    /// An empty cache in `bytes` (writable, e.g. a shared-memory slice), to be filled
    /// by a capture run.
    pub fn empty_in(layout: TemplateLayout, bytes: HostSlice) -> Result<Self> {
        let mut c = Self::view(layout, bytes)?;
        c.complete = false;
        Ok(c)
    }

    /// A complete cache whose image is `bytes` (read in place, not copied).
    pub fn view(layout: TemplateLayout, bytes: HostSlice) -> Result<Self> {
        if bytes.len() != layout.total_bytes() {
            return Err(Error::Invalid(format!(
                "a template image of {} bytes does not match a layout of {} bytes",
                bytes.len(),
                layout.total_bytes()
            )));
        }
        layout.check()?;
        Ok(TemplateCache {
            layout,
            bytes,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            complete: true,
        })
    }

    /// The same cache under `key`: how the views of one stored template (created per
    /// request) are known to be the same bytes. Keys from [`TemplateCache::new`] and
    /// [`TemplateCache::view`] count up from 1; callers choose keys outside that range.
    pub fn with_key(mut self, key: u64) -> Self {
        self.key = key;
        self
    }

    pub fn layout(&self) -> &TemplateLayout {
        &self.layout
    }
    pub fn key(&self) -> u64 {
        self.key
    }
    /// The flat image.
    pub fn bytes(&self) -> &HostSlice {
        &self.bytes
    }

    /// The bytes of the slab of block `block` that step `step` reads (its nearest
    /// stored step's, with a step stride).
    pub fn slab_slice(&self, step: usize, block: usize) -> Result<HostSlice> {
        let l = &self.layout;
        if step >= l.steps || block >= l.slabs_per_step() {
            return Err(Error::Invalid(format!(
                "template slab for step {step} block {block}, outside {} steps x {} slabs",
                l.steps,
                l.slabs_per_step()
            )));
        }
        self.bytes
            .sub(l.slab_offset(l.stored(step), block), l.slab_bytes())
    }

    /// The bytes of the latent after `step`.
    pub fn latent_slice(&self, step: usize) -> Result<HostSlice> {
        let l = &self.layout;
        if step >= l.steps {
            return Err(Error::Invalid(format!(
                "template latent for step {step} of {}",
                l.steps
            )));
        }
        self.bytes.sub(l.latent_offset(step), l.latent_bytes())
    }

    /// The `[L, slab_width]` slab of (step, block), decoded to f32.
    pub fn slab(&self, step: usize, block: usize) -> Result<Tensor> {
        let l = &self.layout;
        let b = self.slab_slice(step, block)?;
        Tensor::new([l.tokens, l.slab_width()], l.decode_slab(b.bytes())?)
    }

    /// The packed latent `[L, C]` after `step`.
    pub fn latent(&self, step: usize) -> Result<Tensor> {
        let l = &self.layout;
        let b = self.latent_slice(step)?;
        Stored::new(
            "template latent",
            vec![l.tokens, l.latent_channels],
            DType::F32,
            b.bytes(),
        )?
        .to_f32()
    }

    /// Writes the (step, block) slab from host values (tests, the CPU's stores go
    /// through `Backend::store`).
    pub fn set_slab(&mut self, step: usize, block: usize, slab: &Tensor) -> Result<()> {
        let l = self.layout;
        if slab.shape() != [l.tokens, l.slab_width()] || !l.stores(step) {
            return Err(Error::Invalid(format!(
                "template slab for step {step} block {block}: shape {:?}, expected [{}, {}], step stride {}",
                slab.shape(),
                l.tokens,
                l.slab_width(),
                l.step_stride
            )));
        }
        write_host(&self.slab_slice(step, block)?, &l.encode_slab(slab.data()))
    }

    pub fn set_latent(&mut self, step: usize, latent: &Tensor) -> Result<()> {
        let l = self.layout;
        if latent.shape() != [l.tokens, l.latent_channels] {
            return Err(Error::Invalid(format!(
                "template latent for step {step}: shape {:?}",
                latent.shape()
            )));
        }
        write_host(
            &self.latent_slice(step)?,
            &encode(latent.data(), DType::F32),
        )
    }

    /// This template stored another way (`layout`: another dtype or step stride, the
    /// same shapes): each stored slab re-encoded from this one's values, the latents
    /// copied. What a capture into `layout` would have stored, where this template is
    /// f32 (a capture quantises the f32 K/V it computes; step sharing keeps the slabs
    /// of the steps it stores).
    pub fn converted(&self, layout: TemplateLayout) -> Result<TemplateCache> {
        let l = self.layout;
        if !layout.fits(&l) || layout.mode != l.mode {
            return Err(Error::Invalid(
                "a template converts only to a layout of its own shapes and mode".into(),
            ));
        }
        let mut out = TemplateCache::new(layout)?;
        for si in 0..layout.stored_steps() {
            let step = si * layout.step_stride;
            for b in 0..layout.slabs_per_step() {
                out.set_slab(step, b, &self.slab(step, b)?)?;
            }
        }
        for s in 0..l.steps {
            out.set_latent(s, &self.latent(s)?)?;
        }
        out.complete = self.complete;
        Ok(out)
    }

    /// Declares the image complete (a capture run has written every part of it).
    pub fn mark_complete(&mut self) {
        self.complete = true;
    }

    /// Whether every step the cache covers has its slabs and latent.
    pub fn is_complete(&self) -> bool {
        self.complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_fill_dev_footprint() {
        // FLUX.1-Fill-dev at 1024x1024: 64x64 = 4096 tokens, 57 blocks, hidden 3072.
        let l = TemplateLayout::for_model(&FluxConfig::flux1_fill_dev(), 4096, 28, DType::BF16);
        assert_eq!(l.blocks, 57);
        assert_eq!(l.slab_bytes(), 4096 * 6144 * 2);
        assert_eq!(
            l.total_bytes(),
            28 * 57 * 4096 * 6144 * 2 + 28 * 4096 * 64 * 4
        );
        assert_eq!(l.slab_offset(1, 0), 57 * l.slab_bytes());
        assert_eq!(l.latent_offset(0), 28 * 57 * l.slab_bytes());
        // Y mode: 56 block outputs of [4096, 3072] per step, 49% of KV mode's bytes.
        let y = l.with_mode(CacheMode::Y);
        assert_eq!(y.slab_bytes(), 4096 * 3072 * 2);
        assert_eq!(y.cache_bytes_per_step(), 56 * 4096 * 3072 * 2);
        assert_eq!(y.slab_offset(1, 0), 56 * y.slab_bytes());
        assert_eq!(
            y.total_bytes(),
            28 * 56 * 4096 * 3072 * 2 + 28 * 4096 * 64 * 4
        );
    }

    #[test]
    fn infer_tells_every_mode_and_dtype_apart() {
        let c = FluxConfig::tiny();
        for mode in [CacheMode::Kv, CacheMode::Y] {
            for dt in [DType::F32, DType::BF16] {
                let l = TemplateLayout::for_model(&c, 16, 3, dt).with_mode(mode);
                assert_eq!(
                    TemplateLayout::infer(&c, 16, 3, 1, l.total_bytes() as u64),
                    Some(l)
                );
            }
        }
        assert_eq!(TemplateLayout::infer(&c, 16, 3, 1, 12345), None);
        // fp8 too, and a step stride, given.
        let l8 = TemplateLayout::for_model(&c, 16, 5, DType::F8E4M3).with_step_stride(2);
        assert_eq!(
            TemplateLayout::infer(&c, 16, 5, 2, l8.total_bytes() as u64),
            Some(l8)
        );
    }

    #[test]
    fn step_sharing_reads_the_nearest_stored_step() {
        for steps in 1..12 {
            for k in 1..6 {
                let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, steps, DType::F32)
                    .with_step_stride(k);
                let stored: Vec<usize> = (0..steps).filter(|s| l.stores(*s)).collect();
                assert_eq!(stored.len(), l.stored_steps(), "{steps} steps, k {k}");
                assert_eq!(l.slab_count(), stored.len() * l.blocks);
                for s in 0..steps {
                    // Brute force: the nearest stored step, ties to the later one.
                    let best = stored
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, &t)| (t.abs_diff(s), std::cmp::Reverse(t)))
                        .map(|(i, _)| i)
                        .unwrap();
                    assert_eq!(l.stored(s), best, "{steps} steps, k {k}, step {s}");
                }
            }
        }
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, 28, DType::BF16);
        assert_eq!(
            l.with_step_stride(2).total_bytes() - 28 * l.latent_bytes(),
            14 * l.blocks * l.slab_bytes()
        );
        assert!(l.with_step_stride(0).check().is_err());
        assert!(l
            .with_mode(CacheMode::Y)
            .with_step_stride(2)
            .check()
            .is_err());
        let mut c = TemplateCache::new(l.with_step_stride(2)).unwrap();
        let z = Tensor::zeros([4, 2 * l.hidden]);
        assert!(c.set_slab(2, 0, &z).is_ok());
        assert!(c.set_slab(3, 0, &z).is_err());
        // Step 1 reads step 2's slab (equally near 0 and 2: the later).
        assert_eq!(
            c.slab_slice(1, 0).unwrap().bytes().as_ptr(),
            c.slab_slice(2, 0).unwrap().bytes().as_ptr()
        );
    }

    #[test]
    fn slabs_and_latents_round_trip_in_the_storage_dtype() {
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, 2, DType::BF16);
        let mut c = TemplateCache::new(l).unwrap();
        assert!(!c.is_complete());
        let kv = Tensor::new(
            [4, 2 * l.hidden],
            (0..4 * 2 * l.hidden)
                .map(|i| (i % 64) as f32 * 0.25 - 3.0)
                .collect(),
        )
        .unwrap();
        c.set_slab(1, 2, &kv).unwrap();
        let lat = Tensor::new(
            [4, l.latent_channels],
            (0..4 * l.latent_channels)
                .map(|i| 1.0 / (i as f32 + 3.0))
                .collect(),
        )
        .unwrap();
        c.set_latent(1, &lat).unwrap();
        // bf16 K/V (these values are exact in bf16), f32 latents (bit for bit).
        assert_eq!(c.slab(1, 2).unwrap(), kv);
        assert_eq!(c.latent(1).unwrap(), lat);
        assert_eq!(c.slab_slice(1, 2).unwrap().len(), 4 * 2 * l.hidden * 2);
        let view = TemplateCache::view(l, c.bytes().clone()).unwrap();
        assert_eq!(view.latent(1).unwrap(), lat);
        assert_ne!(view.key(), c.key());
        assert!(TemplateCache::view(l, c.bytes().sub(1, l.total_bytes() - 1).unwrap()).is_err());
    }

    #[test]
    fn rejects_misshapen_slabs() {
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 16, 2, DType::F32);
        let mut c = TemplateCache::new(l).unwrap();
        assert!(c.set_slab(0, 0, &Tensor::zeros([16, 128])).is_ok());
        assert!(c.set_slab(0, 0, &Tensor::zeros([16, 64])).is_err());
        assert!(c.set_slab(2, 0, &Tensor::zeros([16, 128])).is_err());
        assert!(c
            .slab(2, 0)
            .unwrap_err()
            .to_string()
            .contains("step 2 block 0"));
        let y = TemplateLayout::for_model(&FluxConfig::tiny(), 16, 2, DType::F32)
            .with_mode(CacheMode::Y);
        let mut c = TemplateCache::new(y).unwrap();
        assert!(c.set_slab(0, 0, &Tensor::zeros([16, 64])).is_ok());
        assert!(c.set_slab(0, 0, &Tensor::zeros([16, 128])).is_err());
        // No slab for the last block.
        assert!(c
            .set_slab(0, y.blocks - 1, &Tensor::zeros([16, 64]))
            .is_err());
    }
}
