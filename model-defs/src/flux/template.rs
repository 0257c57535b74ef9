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
//!   full (DESIGN.md §Planner). The last block's output is read by nothing (the head
//!   reads only computed tokens), so it is not stored: `blocks - 1` slabs per step.
//!
//! Then, for every step, the packed latent after that step, `[L, C]`. It is one flat
//! image in host memory, laid out by [`TemplateLayout`]: slabs step-major, block-minor,
//! in the storage dtype of the device that captured them (bf16 on a GPU, f32 on the
//! CPU), then the latents in f32. The same bytes are the shared-memory form the cache
//! process holds (which a GPU worker streams from in place), and the data file of a
//! template on disk. Cache size is a first-class number (DESIGN.md §Costs): in KV mode
//! `steps x blocks x L x hidden x 2 x bytes`.

use std::sync::atomic::{AtomicU64, Ordering};

use denoised_runtime::backend::write_host;
use denoised_runtime::stored::encode;
use denoised_runtime::{DType, Error, HostSlice, Result, Stored, Tensor};

use super::config::FluxConfig;
pub use crate::planner::CacheMode;

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
        }
    }

    pub fn with_mode(self, mode: CacheMode) -> Self {
        TemplateLayout { mode, ..self }
    }

    /// The layout for `c` of `tokens` x `steps` whose flat image is `bytes` long: its
    /// storage dtype and mode are the ones whose layout has that size (a template is
    /// stored in its capturing device's dtype, which only its size tells; the four
    /// sizes differ for any non-empty template).
    pub fn infer(c: &FluxConfig, tokens: usize, steps: usize, bytes: u64) -> Option<Self> {
        [CacheMode::Kv, CacheMode::Y]
            .into_iter()
            .flat_map(|m| [DType::BF16, DType::F32].map(|dt| (m, dt)))
            .map(|(m, dt)| Self::for_model(c, tokens, steps, dt).with_mode(m))
            .find(|l| l.total_bytes() as u64 == bytes)
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
        self.steps * self.slabs_per_step()
    }
    /// Elements of one `[L, slab_width]` slab.
    pub fn slab_elems(&self) -> usize {
        self.tokens * self.slab_width()
    }
    pub fn slab_bytes(&self) -> usize {
        self.slab_elems() * self.dtype.size_bytes()
    }
    /// Bytes of one latent: f32, since the Euler update accumulates in it (a small
    /// share of a template).
    pub fn latent_bytes(&self) -> usize {
        self.tokens * self.latent_channels * 4
    }
    /// Byte offset of the (step, block) slab in the flat image.
    pub fn slab_offset(&self, step: usize, block: usize) -> usize {
        (step * self.slabs_per_step() + block) * self.slab_bytes()
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
        if !matches!(layout.dtype, DType::F32 | DType::BF16) {
            return Err(Error::Invalid(format!(
                "templates are stored in f32 or bf16, not {:?}",
                layout.dtype
            )));
        }
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

    /// The bytes of the `(step, block)` slab.
    pub fn slab_slice(&self, step: usize, block: usize) -> Result<HostSlice> {
        let l = &self.layout;
        if step >= l.steps || block >= l.slabs_per_step() {
            return Err(Error::Invalid(format!(
                "template slab for step {step} block {block}, outside {} steps x {} slabs",
                l.steps,
                l.slabs_per_step()
            )));
        }
        self.bytes.sub(l.slab_offset(step, block), l.slab_bytes())
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
        Stored::new(
            "template slab",
            vec![l.tokens, l.slab_width()],
            l.dtype,
            b.bytes(),
        )?
        .to_f32()
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
        if slab.shape() != [l.tokens, l.slab_width()] {
            return Err(Error::Invalid(format!(
                "template slab for step {step} block {block}: shape {:?}, expected [{}, {}]",
                slab.shape(),
                l.tokens,
                l.slab_width()
            )));
        }
        write_host(
            &self.slab_slice(step, block)?,
            &encode(slab.data(), l.dtype),
        )
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
                    TemplateLayout::infer(&c, 16, 3, l.total_bytes() as u64),
                    Some(l)
                );
            }
        }
        assert_eq!(TemplateLayout::infer(&c, 16, 3, 12345), None);
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
