//! Where a mask-aware edit reads its template's cached slabs from, on each device.
//!
//! A template's slabs live in host memory ([`TemplateCache`]: a shared-memory arena
//! slice in the daemon). A backend computes on its own tensors, so each device keeps
//! the templates its batch reads in one of two forms ([`DeviceTemplates`]):
//!
//! - **resident**: every slab uploaded once (on the CPU: decoded to f32), so the edits
//!   of a hot template pay the copy once;
//! - **streamed**: a [`SlabProvider`] that copies each step's slabs in block by block
//!   on a copy stream while the model computes (`Backend::stream_slabs`), for templates
//!   larger than what the device can keep.
//!
//! The model asks for a step's slabs block by block, in order, as the forward reaches
//! each block.

use std::sync::Arc;

use denoised_runtime::{Backend, DType, Error, Result, SlabProvider, Stored};

use super::template::TemplateCache;

/// Where an edit's cached slabs come from, as tensors of the model's backend.
pub trait SlabSource<T>: Sync {
    /// Called for each edit job before a forward that reads the slabs `slabs`
    /// (ascending) of `step` of `cache` (the plan's other blocks need none).
    fn prepare(&self, _cache: &TemplateCache, _step: usize, _slabs: &[usize]) -> Result<()> {
        Ok(())
    }
    /// The `[L, slab_width]` slab of `(step, block)` of `cache`. Within a forward,
    /// blocks are asked for in order.
    fn slab<'a>(&'a self, cache: &'a TemplateCache, step: usize, block: usize) -> Result<&'a T>;
    /// Called after the forward.
    fn finish(&self) {}
}

enum Form<T> {
    /// Every slab, step-major.
    Resident(Vec<T>),
    /// Streamed with this many buffer pairs (distinct steps per forward).
    Streamed {
        provider: Box<dyn SlabProvider<T>>,
        lanes: usize,
    },
}

/// The templates one device reads, each resident or streamed, found by
/// [`TemplateCache::key`].
pub struct DeviceTemplates<T> {
    entries: Vec<(Arc<TemplateCache>, Form<T>)>,
}

impl<T: Send + Sync> DeviceTemplates<T> {
    pub fn new() -> Self {
        DeviceTemplates { entries: vec![] }
    }

    /// The templates of `caches` resident on `backend` (the CLI and tests).
    pub fn resident<B: Backend<Tensor = T>>(
        backend: &B,
        caches: &[&Arc<TemplateCache>],
    ) -> Result<Self> {
        let mut t = Self::new();
        for c in caches {
            t.make_resident(backend, c)?;
        }
        Ok(t)
    }

    fn find(&self, cache: &TemplateCache) -> Option<&Form<T>> {
        self.entries
            .iter()
            .find(|(c, _)| c.key() == cache.key())
            .map(|(_, f)| f)
    }

    pub fn is_resident(&self, cache: &TemplateCache) -> bool {
        matches!(self.find(cache), Some(Form::Resident(_)))
    }

    /// Buffer pairs of a streamed template (0 if it is not streamed).
    pub fn streamed_lanes(&self, cache: &TemplateCache) -> usize {
        match self.find(cache) {
            Some(Form::Streamed { lanes, .. }) => *lanes,
            _ => 0,
        }
    }

    /// Uploads every slab of `cache` (step-major), in its stored dtype (converted on
    /// the way when the device's differs), unless it is resident already.
    pub fn make_resident<B: Backend<Tensor = T>>(
        &mut self,
        backend: &B,
        cache: &Arc<TemplateCache>,
    ) -> Result<()> {
        if self.is_resident(cache) {
            return Ok(());
        }
        // Page-locked once, so a device copies every slab from where it lies.
        backend.pin_host(cache.bytes().memory())?;
        let l = cache.layout();
        let shape = l.slab_shape();
        let mut slabs = Vec::with_capacity(l.slab_count());
        for s in 0..l.stored_steps() {
            for b in 0..l.slabs_per_step() {
                let bytes = cache.slab_slice(s * l.step_stride, b)?;
                let bytes = bytes.bytes();
                slabs.push(match l.dtype {
                    // fp8 stays fp8: the attention kernel reads it as it is.
                    DType::F8E4M3 => backend
                        .upload_fp8(
                            shape.rows,
                            shape.cols,
                            &bytes[..shape.data_bytes()],
                            &shape.scales(bytes),
                        )?
                        .ok_or_else(|| {
                            Error::Invalid(format!(
                                "{} cannot read fp8 templates yet: capture with [cache] kv_dtype f32 or bf16",
                                backend.name()
                            ))
                        })?,
                    dt => {
                        let dims = vec![shape.rows, shape.cols];
                        backend.upload_stored(&[Stored::new("template slab", dims, dt, bytes)?])?
                    }
                });
            }
        }
        self.evict(cache);
        self.entries.push((cache.clone(), Form::Resident(slabs)));
        Ok(())
    }

    /// Streams `cache` from its host memory with `lanes` buffer pairs (replacing a
    /// streamed form with fewer). Returns false where the backend cannot stream.
    pub fn stream<B: Backend<Tensor = T>>(
        &mut self,
        backend: &B,
        cache: &Arc<TemplateCache>,
        lanes: usize,
    ) -> Result<bool> {
        if self.streamed_lanes(cache) >= lanes {
            return Ok(true);
        }
        let l = cache.layout();
        let slabs = cache.bytes().sub(0, l.latent_offset(0))?;
        let per_step = l.slabs_per_step();
        let steps = l.stored_steps();
        match backend.stream_slabs(&slabs, &l.slab_shape(), steps, per_step, lanes)? {
            Some(provider) => {
                self.insert_streamed(cache, provider, lanes);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The time compute waited for streamed slabs since the last call, where the
    /// streams measure it.
    pub fn take_wait(&self) -> Option<std::time::Duration> {
        self.entries
            .iter()
            .filter_map(|(_, f)| match f {
                Form::Streamed { provider, .. } => provider.take_wait(),
                Form::Resident(_) => None,
            })
            .reduce(|a, b| a + b)
    }

    /// Streams `cache` through `provider` (one the caller built, e.g. reading the disk
    /// tier) with `lanes` buffer pairs.
    pub fn insert_streamed(
        &mut self,
        cache: &Arc<TemplateCache>,
        provider: Box<dyn SlabProvider<T>>,
        lanes: usize,
    ) {
        self.evict(cache);
        self.entries
            .push((cache.clone(), Form::Streamed { provider, lanes }));
    }

    pub fn evict(&mut self, cache: &TemplateCache) {
        self.entries.retain(|(c, _)| c.key() != cache.key());
    }

    /// Drops the templates `keep` says no to.
    pub fn retain(&mut self, mut keep: impl FnMut(&Arc<TemplateCache>) -> bool) {
        self.entries.retain(|(c, _)| keep(c));
    }
}

impl<T: Send + Sync> Default for DeviceTemplates<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Send + Sync> SlabSource<T> for DeviceTemplates<T> {
    fn prepare(&self, cache: &TemplateCache, step: usize, slabs: &[usize]) -> Result<()> {
        match self.find(cache) {
            Some(Form::Streamed { provider, .. }) => {
                provider.prepare(cache.layout().stored(step), slabs)
            }
            Some(Form::Resident(_)) => Ok(()),
            None => Err(not_here()),
        }
    }
    fn slab<'a>(&'a self, cache: &'a TemplateCache, step: usize, block: usize) -> Result<&'a T> {
        match self.find(cache) {
            Some(Form::Resident(slabs)) => {
                let l = cache.layout();
                if block >= l.slabs_per_step() {
                    return Err(Error::Invalid(format!(
                        "slab {block} of a template with {} per step",
                        l.slabs_per_step()
                    )));
                }
                Ok(&slabs[l.stored(step) * l.slabs_per_step() + block])
            }
            Some(Form::Streamed { provider, .. }) => {
                provider.slab(cache.layout().stored(step), block)
            }
            None => Err(not_here()),
        }
    }
    fn finish(&self) {
        for (_, f) in &self.entries {
            if let Form::Streamed { provider, .. } = f {
                provider.finish();
            }
        }
    }
}

fn not_here() -> Error {
    Error::Invalid("template is not on the device".into())
}
