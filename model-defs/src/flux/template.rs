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

    /// Every K|V slab, step-major (`step * blocks + block`); an error if any is
    /// missing.
    pub fn kv_slabs(&self) -> Result<Vec<&Tensor>> {
        let b = self.layout.blocks;
        (0..self.kv.len()).map(|i| self.kv(i / b, i % b)).collect()
    }

    /// The packed latent `[L, C]` after `step`.
    pub fn latent(&self, step: usize) -> Result<&Tensor> {
        self.latents
            .get(step)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| Error::Invalid(format!("template cache has no latent for step {step}")))
    }

    /// Writes the cache into a flat f32 buffer of `layout.total_bytes() / 4` elements in
    /// the [`TemplateLayout`] order (the shared-memory form the cache actor holds).
    pub fn write_flat(&self, out: &mut [f32]) -> Result<()> {
        let l = self.layout;
        if out.len() * 4 != l.total_bytes() || !self.is_complete() || l.dtype != DType::F32 {
            return Err(Error::Invalid(format!(
                "cannot flatten a template cache (complete: {}) into {} floats; it needs {}",
                self.is_complete(),
                out.len(),
                l.total_bytes() / 4
            )));
        }
        for s in 0..l.steps {
            for b in 0..l.blocks {
                let off = l.kv_offset(s, b) / 4;
                out[off..off + l.kv_slab_elems()].copy_from_slice(self.kv(s, b)?.data());
            }
            let off = l.latent_offset(s) / 4;
            out[off..off + l.tokens * l.latent_channels].copy_from_slice(self.latent(s)?.data());
        }
        Ok(())
    }

    /// The inverse of [`write_flat`](Self::write_flat).
    pub fn from_flat(layout: TemplateLayout, flat: &[f32]) -> Result<Self> {
        let l = layout;
        if flat.len() * 4 != l.total_bytes() || l.dtype != DType::F32 {
            return Err(Error::Invalid(format!(
                "flat template of {} floats does not match a layout of {} bytes",
                flat.len(),
                l.total_bytes()
            )));
        }
        let mut c = TemplateCache::new(l);
        for s in 0..l.steps {
            for b in 0..l.blocks {
                let off = l.kv_offset(s, b) / 4;
                let kv = flat[off..off + l.kv_slab_elems()].to_vec();
                c.set_kv(s, b, Tensor::new([l.tokens, 2 * l.hidden], kv)?)?;
            }
            let off = l.latent_offset(s) / 4;
            let lat = flat[off..off + l.tokens * l.latent_channels].to_vec();
            c.set_latent(s, Tensor::new([l.tokens, l.latent_channels], lat)?)?;
        }
        Ok(c)
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
    fn flat_form_round_trips() {
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, 2, DType::F32);
        let n = l.total_bytes() / 4;
        let flat: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let c = TemplateCache::from_flat(l, &flat).unwrap();
        assert!(c.is_complete());
        let mut back = vec![0.0; n];
        c.write_flat(&mut back).unwrap();
        assert_eq!(back, flat);
        assert!(TemplateCache::from_flat(l, &flat[1..]).is_err());
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
