//! The template cache: what a capture run records so that edits can skip the
//! unmasked tokens.
//!
//! For every (step, block) it holds the K (post-norm, post-RoPE) and V rows of every
//! image token, as one `[L, 2*hidden]` slab of `[K | V]` rows, and for every step the
//! packed latent after that step, `[L, C]`. Slabs are contiguous and ordered step-major,
//! block-minor, and [`TemplateLayout`] gives each one's byte offset in a flat image of
//! the cache: the form it takes in a shared-memory arena or on disk, where a loader
//! streams one (step, block) slab at a time while compute runs. Cache size is a
//! first-class number (DESIGN.md §Costs): `steps x blocks x L x hidden x 2 x bytes`.

use denoised_runtime::{DType, Error, Result, Tensor};

use super::config::FluxConfig;

/// Shapes and dtype of a template cache, and the flat byte layout derived from them.
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
    /// Storage dtype of the slabs (compute reads them as f32).
    pub dtype: DType,
}

impl TemplateLayout {
    pub fn for_model(c: &FluxConfig, tokens: usize, steps: usize, dtype: DType) -> Self {
        TemplateLayout {
            steps,
            blocks: c.num_layers + c.num_single_layers,
            tokens,
            hidden: c.hidden(),
            latent_channels: c.out_channels(),
            dtype,
        }
    }

    /// Elements of one `[L, 2*hidden]` K|V slab.
    pub fn kv_slab_elems(&self) -> usize {
        self.tokens * 2 * self.hidden
    }
    pub fn kv_slab_bytes(&self) -> usize {
        self.kv_slab_elems() * self.dtype.size_bytes()
    }
    pub fn latent_bytes(&self) -> usize {
        self.tokens * self.latent_channels * self.dtype.size_bytes()
    }
    /// Byte offset of the (step, block) slab in the flat image.
    pub fn kv_offset(&self, step: usize, block: usize) -> usize {
        (step * self.blocks + block) * self.kv_slab_bytes()
    }
    /// Byte offset of the latent after `step`, after all K/V slabs.
    pub fn latent_offset(&self, step: usize) -> usize {
        self.steps * self.blocks * self.kv_slab_bytes() + step * self.latent_bytes()
    }
    /// K/V bytes one step of an edit reads from the cache (all blocks).
    pub fn kv_bytes_per_step(&self) -> usize {
        self.blocks * self.kv_slab_bytes()
    }
    pub fn total_bytes(&self) -> usize {
        self.latent_offset(self.steps)
    }
}

/// A captured template, held in memory as f32 slabs.
#[derive(Clone, Debug)]
pub struct TemplateCache {
    layout: TemplateLayout,
    kv: Vec<Option<Tensor>>,
    latents: Vec<Option<Tensor>>,
}

impl TemplateCache {
    /// An empty cache to be filled by a capture run.
    pub fn new(layout: TemplateLayout) -> Self {
        TemplateCache {
            layout,
            kv: vec![None; layout.steps * layout.blocks],
            latents: vec![None; layout.steps],
        }
    }

    pub fn layout(&self) -> &TemplateLayout {
        &self.layout
    }

    pub fn set_kv(&mut self, step: usize, block: usize, kv: Tensor) -> Result<()> {
        let l = &self.layout;
        if step >= l.steps || block >= l.blocks || kv.shape() != [l.tokens, 2 * l.hidden] {
            return Err(Error::Invalid(format!(
                "template K/V for step {step} block {block}: shape {:?}, expected [{}, {}] within {} steps x {} blocks",
                kv.shape(),
                l.tokens,
                2 * l.hidden,
                l.steps,
                l.blocks
            )));
        }
        self.kv[step * l.blocks + block] = Some(kv);
        Ok(())
    }

    pub fn set_latent(&mut self, step: usize, latent: Tensor) -> Result<()> {
        let l = &self.layout;
        if step >= l.steps || latent.shape() != [l.tokens, l.latent_channels] {
            return Err(Error::Invalid(format!(
                "template latent for step {step}: shape {:?}",
                latent.shape()
            )));
        }
        self.latents[step] = Some(latent);
        Ok(())
    }

    /// The `[L, 2*hidden]` K|V slab of (step, block).
    pub fn kv(&self, step: usize, block: usize) -> Result<&Tensor> {
        self.kv
            .get(step * self.layout.blocks + block)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "template cache has no K/V for step {step} block {block}"
                ))
            })
    }

    /// The packed latent `[L, C]` after `step`.
    pub fn latent(&self, step: usize) -> Result<&Tensor> {
        self.latents
            .get(step)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| Error::Invalid(format!("template cache has no latent for step {step}")))
    }

    /// Whether every step the cache covers has its K/V and latent.
    pub fn is_complete(&self) -> bool {
        self.kv.iter().all(Option::is_some) && self.latents.iter().all(Option::is_some)
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
        assert_eq!(l.kv_slab_bytes(), 4096 * 6144 * 2);
        assert_eq!(
            l.total_bytes(),
            28 * 57 * 4096 * 6144 * 2 + 28 * 4096 * 64 * 2
        );
        assert_eq!(l.kv_offset(1, 0), 57 * l.kv_slab_bytes());
        assert_eq!(l.latent_offset(0), 28 * 57 * l.kv_slab_bytes());
    }

    #[test]
    fn rejects_misshapen_slabs() {
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 16, 2, DType::F32);
        let mut c = TemplateCache::new(l);
        assert!(c.set_kv(0, 0, Tensor::zeros([16, 128])).is_ok());
        assert!(c.set_kv(0, 0, Tensor::zeros([16, 64])).is_err());
        assert!(c.set_kv(2, 0, Tensor::zeros([16, 128])).is_err());
        assert!(!c.is_complete());
        assert!(c
            .kv(1, 0)
            .unwrap_err()
            .to_string()
            .contains("step 1 block 0"));
    }
}
