//! Where a mask-aware edit reads its template's cached K/V from, on each backend.
//!
//! The CPU reads the host [`TemplateCache`] in place. A device needs the slabs in its
//! own memory: uploaded once ([`ResidentTemplates`]) or handed to a [`SlabProvider`]
//! per template ([`TemplateProviders`]), e.g. `denoised_cuda::StreamedTemplate`, which
//! streams blocks in on a copy stream while the model computes. The model asks for a
//! step's slabs block by block, in order, as the forward reaches each block.

use std::sync::Arc;

use denoised_runtime::{Backend, Error, Result, SlabProvider, Tensor};

use super::template::TemplateCache;

/// Where an edit's cached K/V slabs come from, as tensors of the model's backend.
///
/// On the CPU the host [`TemplateCache`] is read in place ([`HostSlabs`]). A device
/// backend needs the slabs in device memory: [`ResidentTemplates`] holds uploaded
/// copies of whole templates; [`TemplateProviders`] hands each template to a
/// [`SlabProvider`], e.g. one that streams blocks in on a copy stream while the model
/// computes.
pub trait SlabSource<T>: Sync {
    /// Called for each edit job before a forward that reads `step` of `cache`.
    fn prepare(&self, _cache: &TemplateCache, _step: usize) -> Result<()> {
        Ok(())
    }
    /// The `[L, 2*hidden]` `[K | V]` slab of `(step, block)` of `cache`. Within a
    /// forward, blocks are asked for in order.
    fn slab<'a>(&'a self, cache: &'a TemplateCache, step: usize, block: usize) -> Result<&'a T>;
    /// Called after the forward.
    fn finish(&self) {}
}

/// Host slabs, read where they lie (the CPU backend's tensors are host tensors).
pub struct HostSlabs;

impl SlabSource<Tensor> for HostSlabs {
    fn slab<'a>(
        &'a self,
        cache: &'a TemplateCache,
        step: usize,
        block: usize,
    ) -> Result<&'a Tensor> {
        // Job::new checked the layout, and step_batch checks completeness.
        cache.kv(step, block)
    }
}

/// Per-template entries found by the identity of their `Arc<TemplateCache>`.
struct ByTemplate<V> {
    entries: Vec<(Arc<TemplateCache>, V)>,
}

impl<V> ByTemplate<V> {
    fn get(&self, cache: &TemplateCache) -> Result<&V> {
        self.entries
            .iter()
            .find(|(c, _)| std::ptr::eq(Arc::as_ptr(c), cache))
            .map(|(_, v)| v)
            .ok_or_else(|| Error::Invalid("template is not on the device".into()))
    }
    fn contains(&self, cache: &Arc<TemplateCache>) -> bool {
        self.entries.iter().any(|(c, _)| Arc::ptr_eq(c, cache))
    }
    fn remove(&mut self, cache: &Arc<TemplateCache>) {
        self.entries.retain(|(c, _)| !Arc::ptr_eq(c, cache));
    }
}

/// Device-resident copies of whole templates.
pub struct ResidentTemplates<T> {
    templates: ByTemplate<Vec<T>>,
}

impl<T: Send + Sync> ResidentTemplates<T> {
    pub fn new() -> Self {
        ResidentTemplates {
            templates: ByTemplate { entries: vec![] },
        }
    }
    /// Uploads every slab of `cache` (step-major) unless it is already resident.
    pub fn make_resident<B: Backend<Tensor = T>>(
        &mut self,
        backend: &B,
        cache: &Arc<TemplateCache>,
    ) -> Result<()> {
        if self.templates.contains(cache) {
            return Ok(());
        }
        let slabs = cache
            .kv_slabs()?
            .into_iter()
            .map(|t| backend.upload(t))
            .collect::<Result<Vec<_>>>()?;
        self.templates.entries.push((cache.clone(), slabs));
        Ok(())
    }
    pub fn evict(&mut self, cache: &Arc<TemplateCache>) {
        self.templates.remove(cache);
    }
}

impl<T: Send + Sync> Default for ResidentTemplates<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Send + Sync> SlabSource<T> for ResidentTemplates<T> {
    fn slab<'a>(&'a self, cache: &'a TemplateCache, step: usize, block: usize) -> Result<&'a T> {
        let slabs = self.templates.get(cache)?;
        Ok(&slabs[step * cache.layout().blocks + block])
    }
}

/// Templates served by [`SlabProvider`]s (e.g. streamed to a device block by block).
pub struct TemplateProviders<T> {
    providers: ByTemplate<Box<dyn SlabProvider<T>>>,
}

impl<T> TemplateProviders<T> {
    pub fn new() -> Self {
        TemplateProviders {
            providers: ByTemplate { entries: vec![] },
        }
    }
    pub fn insert(&mut self, cache: &Arc<TemplateCache>, p: Box<dyn SlabProvider<T>>) {
        self.providers.remove(cache);
        self.providers.entries.push((cache.clone(), p));
    }
    pub fn remove(&mut self, cache: &Arc<TemplateCache>) {
        self.providers.remove(cache);
    }
}

impl<T> Default for TemplateProviders<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> SlabSource<T> for TemplateProviders<T> {
    fn prepare(&self, cache: &TemplateCache, step: usize) -> Result<()> {
        self.providers.get(cache)?.prepare(step)
    }
    fn slab<'a>(&'a self, cache: &'a TemplateCache, step: usize, block: usize) -> Result<&'a T> {
        self.providers.get(cache)?.slab(step, block)
    }
    fn finish(&self) {
        for (_, p) in &self.providers.entries {
            p.finish();
        }
    }
}
