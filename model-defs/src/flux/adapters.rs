//! The LoRAs a transformer serves (docs/design.md §Adapters).
//!
//! - **Unmerged** (the default in batches): adapters are registered on the model's
//!   backend ([`FluxTransformer::add_lora`]) and a request names the ones it uses
//!   ([`LoraUse`]) for each step. Every Linear then adds `s·(x Aᵀ) Bᵀ` over that
//!   request's rows only, so requests with different sets share one batch, each
//!   getting exactly what it would alone.
//! - **Merged** (a worker serving one set): `W += s·B A` into the weights themselves
//!   ([`FluxTransformer::merge_loras`]), with no per-step cost. The patched sites are
//!   restored by reloading them from the pristine checkpoint (the mapped file, or the
//!   built-in model's seed), never by subtracting, so unmerging is bit for bit.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use denoised_runtime::{Backend, Error, Result, Stored, Tensor};

use super::inactive::Inactive;
use super::lora::{merge_site, LoraAdapter, LoraFile};
use super::model::FluxTransformer;
use super::request::StepRequest;
use super::weights::{upload_site_weight, upload_weight_at, Site};

/// A LoRA registered on a transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LoraId(pub u32);

/// One LoRA of a request, with the scale it asks for (diffusers' adapter weight).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraUse {
    pub id: LoraId,
    pub scale: f32,
}

/// The registered LoRAs of a transformer.
pub(super) struct Registry<B: Backend> {
    map: RwLock<HashMap<LoraId, Arc<LoraAdapter<B>>>>,
    next: AtomicU32,
}

impl<B: Backend> Default for Registry<B> {
    fn default() -> Self {
        Registry {
            map: RwLock::new(HashMap::new()),
            next: AtomicU32::new(0),
        }
    }
}

/// The LoRAs of one forward: each distinct (adapter, scale) and the requests using it.
pub(super) struct StepLoras<B: Backend> {
    groups: Vec<(Arc<LoraAdapter<B>>, f32, Vec<usize>)>,
}

impl<B: Backend> StepLoras<B> {
    /// `None` when no request of the step uses a LoRA: the forward then adds nothing to
    /// any Linear.
    pub fn resolve(reg: &Registry<B>, reqs: &[StepRequest<'_, B::Tensor>]) -> Result<Option<Self>> {
        if reqs.iter().all(|r| r.loras.is_empty()) {
            return Ok(None);
        }
        let map = reg.map.read().map_err(|_| poisoned())?;
        let mut groups: Vec<(Arc<LoraAdapter<B>>, f32, Vec<usize>)> = vec![];
        for (ri, r) in reqs.iter().enumerate() {
            for u in r.loras {
                let a = map.get(&u.id).ok_or_else(|| {
                    Error::Invalid(format!(
                        "request {ri} uses LoRA {:?}, which is not loaded",
                        u.id
                    ))
                })?;
                match groups
                    .iter_mut()
                    .find(|g| Arc::ptr_eq(&g.0, a) && g.1 == u.scale)
                {
                    Some(g) => g.2.push(ri),
                    None => groups.push((a.clone(), u.scale, vec![ri])),
                }
            }
        }
        Ok(Some(StepLoras { groups }))
    }

    /// Whether any adapter of the step patches the site of index `site`.
    pub fn touches(&self, site: usize) -> bool {
        self.groups.iter().any(|g| g.0.touches(site))
    }

    /// Adds every request's deltas at site index `site` to `y` (the output features
    /// `outs` of the site's Linear over `x[:, x_cols]`), request `r` owning rows
    /// `rows(r)` of both. Adjacent requests with the same adapter and scale are one
    /// GEMM.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        be: &B,
        site: usize,
        y: &mut B::Tensor,
        x: &B::Tensor,
        x_cols: Range<usize>,
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
        outs: Range<usize>,
    ) -> Result<()> {
        for (adapter, scale, reqs) in &self.groups {
            if !adapter.touches(site) {
                continue;
            }
            let mut spans: Vec<Range<usize>> = reqs.iter().filter_map(|&r| rows(r)).collect();
            spans.sort_by_key(|s| s.start);
            let mut merged: Vec<Range<usize>> = Vec::with_capacity(spans.len());
            for s in spans {
                match merged.last_mut() {
                    Some(m) if m.end == s.start => m.end = s.end,
                    _ => merged.push(s),
                }
            }
            for span in merged {
                adapter.apply(be, site, y, x, x_cols.clone(), span, outs.clone(), *scale)?;
            }
        }
        Ok(())
    }
}

fn poisoned() -> Error {
    Error::Invalid("the adapter registry was poisoned by a panic".into())
}

impl<B: Backend> FluxTransformer<B> {
    /// Uploads a LoRA for the unmerged path and returns its id, which requests name
    /// in [`StepRequest::loras`].
    pub fn add_lora(&self, file: &LoraFile) -> Result<LoraId> {
        let a = LoraAdapter::upload(self.backend(), &self.config, file)?;
        let id = LoraId(self.loras.next.fetch_add(1, Ordering::Relaxed));
        self.loras
            .map
            .write()
            .map_err(|_| poisoned())?
            .insert(id, Arc::new(a));
        Ok(id)
    }

    /// Drops a registered LoRA (a step that still runs with it keeps its copy).
    pub fn remove_lora(&self, id: LoraId) -> Result<bool> {
        Ok(self
            .loras
            .map
            .write()
            .map_err(|_| poisoned())?
            .remove(&id)
            .is_some())
    }

    /// Merges `loras` (each file with its scale) into the weights, first restoring any
    /// set merged before. Each patched site is rebuilt on the host in f32 from the
    /// pristine checkpoint, `W + Σ s·scale·B A`, and uploaded in place of the old
    /// weight. Returns the sites patched.
    pub fn merge_loras(&self, loras: &[(&LoraFile, f32)]) -> Result<usize> {
        self.unmerge()?;
        let mut sites: Vec<Site> = loras
            .iter()
            .flat_map(|(f, _)| f.modules.iter().map(|m| m.site))
            .collect();
        sites.sort_by_key(|s| s.index(&self.config));
        sites.dedup();
        let mut w = self.w.write().map_err(|_| poisoned())?;
        let mut merged = self.merged.lock().map_err(|_| poisoned())?;
        for &site in &sites {
            let mut host = self.pristine_weight(site)?;
            merge_site(&mut host, site, loras)?;
            let lin = w
                .site_mut(site)
                .ok_or_else(|| Error::Invalid(format!("{site:?} is not in this model")))?;
            // In the site's format: a merged fp8 site is quantised again.
            let parts = [Stored::from_tensor("merged", &host)];
            lin.w = upload_weight_at(self.backend(), site, &parts)?;
            merged.push(site);
        }
        // The reads faulted the sites' mapped pages back in; the uploads hold them now.
        self.pristine.release();
        Ok(sites.len())
    }

    /// Restores every merged site from the pristine checkpoint, exactly as it was
    /// loaded.
    pub fn unmerge(&self) -> Result<()> {
        let mut w = self.w.write().map_err(|_| poisoned())?;
        let mut merged = self.merged.lock().map_err(|_| poisoned())?;
        for site in merged.drain(..) {
            let lin = w.site_mut(site).expect("merged sites exist");
            lin.w = upload_site_weight(self.backend(), &self.config, self.pristine.as_ref(), site)?;
        }
        self.pristine.release();
        Ok(())
    }

    /// Adds the step's LoRA deltas at `site` to `y`, the site's Linear over `x` (or its
    /// column block `x_cols`), request `r` owning rows `rows(r)` of both.
    pub(super) fn lora(
        &self,
        lo: &Option<StepLoras<B>>,
        site: Site,
        y: &mut B::Tensor,
        x: &B::Tensor,
        x_cols: Option<Range<usize>>,
        rows: &dyn Fn(usize) -> Option<Range<usize>>,
    ) -> Result<()> {
        let Some(lo) = lo else { return Ok(()) };
        let be = self.backend();
        let cols = x_cols.unwrap_or(0..be.shape(x).last().copied().unwrap_or(0));
        let outs = 0..be.shape(y).last().copied().unwrap_or(0);
        lo.apply(be, site.index(&self.config), y, x, cols, rows, outs)
    }

    /// The LoRA deltas of a Y-mode template's inactive rows at a cached block: the
    /// output features `outs` (K and V) of `site` over the batch's inactive rows
    /// (`side.rows[r]` for request `r`).
    pub(super) fn side_lora<'s>(
        &'s self,
        lo: &'s Option<StepLoras<B>>,
        site: Site,
        side: &'s Inactive<'_, B::Tensor>,
        outs: Range<usize>,
    ) -> impl Fn(&mut B::Tensor, &B::Tensor) -> Result<()> + 's {
        move |y, x| {
            let Some(lo) = lo else { return Ok(()) };
            let be = self.backend();
            let cols = 0..be.shape(x).last().copied().unwrap_or(0);
            let rows = |r: usize| side.rows.get(r).cloned().flatten();
            lo.apply(
                be,
                site.index(&self.config),
                y,
                x,
                cols,
                &rows,
                outs.clone(),
            )
        }
    }

    /// Whether a LoRA set is merged into the weights.
    pub fn is_merged(&self) -> bool {
        self.merged.lock().map(|m| !m.is_empty()).unwrap_or(true)
    }

    /// The weight of `site` as the backend holds it, `[out, in]` on the host.
    pub fn site_weight(&self, site: Site) -> Result<Tensor> {
        let mut w = self.w.write().map_err(|_| poisoned())?;
        let lin = w
            .site_mut(site)
            .ok_or_else(|| Error::Invalid(format!("{site:?} is not in this model")))?;
        self.backend().download_weight(&lin.w)
    }

    /// The `[out, in]` f32 weight of `site` from the pristine checkpoint.
    fn pristine_weight(&self, site: Site) -> Result<Tensor> {
        let spec = site.spec(&self.config);
        let mut data = Vec::with_capacity(spec.out() * spec.input);
        for (n, o) in &spec.parts {
            data.extend_from_slice(
                self.pristine
                    .get(&format!("{n}.weight"), &[*o, spec.input])?
                    .data(),
            );
        }
        Tensor::new([spec.out(), spec.input], data)
    }
}
