//! A request's token grid as a denoising job ([`super::edit`]) lays it out: the rows
//! a job computes, with a Kontext request's reference rows after them, and an edit's
//! inactive rows on the host (a Kontext template's reference rows among them).

use denoised_runtime::{Error, Result, Tensor};

use super::edit::DenoiseInputs;
use super::template::TemplateCache;

/// A job's image rows `[A (+ R), C + K]` and their position ids: the computed `rows`
/// of `[latent | conditioning]`, then, with `reference`, a Kontext request's
/// reference rows.
pub(super) fn job_rows(
    inputs: &DenoiseInputs,
    rows: &[u32],
    reference: bool,
) -> Result<(Tensor, Tensor)> {
    let grid = Grid::new(inputs)?;
    let refs = grid.l..grid.l + if reference { grid.reference_rows() } else { 0 };
    let rows: Vec<u32> = rows.iter().copied().chain(refs.map(|t| t as u32)).collect();
    Ok((grid.inputs(&rows)?, grid.ids(&rows)?))
}

/// A request's token grid: its `L` noisy tokens, then a Kontext request's `R`
/// reference tokens (whose latents never change), as a Kontext template lays them out.
#[derive(Clone, Copy)]
struct Grid<'a> {
    inputs: &'a DenoiseInputs,
    l: usize,
}

impl<'a> Grid<'a> {
    fn new(inputs: &'a DenoiseInputs) -> Result<Self> {
        let (c, k) = (inputs.latents.cols(), inputs.cond.cols());
        if let Some(r) = inputs
            .reference
            .as_ref()
            .filter(|r| r.latents.cols() != c + k || r.ids.shape() != [r.latents.rows(), 3])
        {
            return Err(Error::Invalid(format!(
                "reference latents {:?} and ids {:?} for {c} latent and {k} conditioning channels",
                r.latents.shape(),
                r.ids.shape(),
            )));
        }
        Ok(Grid {
            inputs,
            l: inputs.tokens(),
        })
    }

    fn reference_rows(&self) -> usize {
        self.inputs
            .reference
            .as_ref()
            .map_or(0, |r| r.latents.rows())
    }

    /// Row `t`'s `[latent | conditioning]` (a reference row's is its latents').
    fn row(&self, t: usize) -> (&'a [f32], &'a [f32]) {
        let i = self.inputs;
        match i.reference.as_ref().filter(|_| t >= self.l) {
            Some(r) => r.latents.row(t - self.l).split_at(i.latents.cols()),
            None => (i.latents.row(t), i.cond.row(t)),
        }
    }

    fn gather(&self, rows: &[u32], cols: usize, f: impl Fn(usize) -> &'a [f32]) -> Result<Tensor> {
        let data = rows.iter().flat_map(|&t| f(t as usize)).copied().collect();
        Tensor::new([rows.len(), cols], data)
    }

    /// `[rows, C + K]` inputs at the start.
    fn inputs(&self, rows: &[u32]) -> Result<Tensor> {
        let w = self.inputs.latents.cols() + self.inputs.cond.cols();
        let mut x = Vec::with_capacity(rows.len() * w);
        for &t in rows {
            let (lat, cond) = self.row(t as usize);
            x.extend_from_slice(lat);
            x.extend_from_slice(cond);
        }
        Tensor::new([rows.len(), w], x)
    }

    /// `[rows, C]` initial latents.
    fn latents(&self, rows: &[u32]) -> Result<Tensor> {
        self.gather(rows, self.inputs.latents.cols(), |t| self.row(t).0)
    }

    /// `[rows, K]` conditioning.
    fn cond(&self, rows: &[u32]) -> Result<Tensor> {
        self.gather(rows, self.inputs.cond.cols(), |t| self.row(t).1)
    }

    /// `[rows, 3]` position ids.
    fn ids(&self, rows: &[u32]) -> Result<Tensor> {
        let (i, l) = (self.inputs, self.l);
        self.gather(rows, 3, |t| match i.reference.as_ref().filter(|_| t >= l) {
            Some(r) => r.ids.row(t - l),
            None => i.img_ids.row(t),
        })
    }
}

/// An edit's inactive rows on the host: what the full blocks of a plan compute them
/// from. Their latent at step `s` is the template's (the latent it captured after
/// step `s - 1`; at step 0 the edit's own initial noise), so with a capture's inputs
/// they reproduce the captured K/V exactly.
pub(super) struct RestHost {
    /// `[R, C]` initial latents, `[R, K]` conditioning, `[R, 3]` position ids.
    latent0: Tensor,
    cond: Tensor,
    pub(super) ids: Tensor,
}

impl RestHost {
    pub(super) fn new(inputs: &DenoiseInputs, rows: &[u32]) -> Result<Self> {
        let grid = Grid::new(inputs)?;
        Ok(RestHost {
            latent0: grid.latents(rows)?,
            cond: grid.cond(rows)?,
            ids: grid.ids(rows)?,
        })
    }

    /// `[R, C]` latents of the rows at `step` of `cache`.
    pub(super) fn latent(
        &self,
        cache: &TemplateCache,
        rows: &[u32],
        step: usize,
    ) -> Result<Tensor> {
        Ok(match step {
            0 => self.latent0.clone(),
            s => cache.latent(s - 1)?.gather(rows),
        })
    }

    /// `[R, C + K]` inputs of the rows at `step` of `cache`.
    pub(super) fn rows(&self, cache: &TemplateCache, rows: &[u32], step: usize) -> Result<Tensor> {
        let latent = self.latent(cache, rows, step)?;
        let (c, k) = (latent.cols(), self.cond.cols());
        let mut x = Vec::with_capacity(rows.len() * (c + k));
        for r in 0..rows.len() {
            x.extend_from_slice(latent.row(r));
            x.extend_from_slice(self.cond.row(r));
        }
        Tensor::new([rows.len(), c + k], x)
    }
}
