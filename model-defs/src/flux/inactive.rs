//! The inactive rows of Y-mode edits inside a step (docs/design.md §Planner).
//!
//! A Y-mode template caches each block's output over every image token. An edit's
//! inactive rows then follow the step block by block outside the image matrix: their
//! input to the current block is here, and
//!
//! - a **cached** block recomputes only their K and V from it (a LayerNorm, the K|V
//!   columns of the block's projection, the K norm and RoPE: a sixth of a block's
//!   Linear work for a single block, a third of the double block's image stream), for
//!   the computed rows to attend to, and then reads their output from the template:
//!   the next block's input;
//! - a **full** block takes them back into the image matrix (one row gather), computes
//!   them with everything else, and the next cached block takes them out again.
//!
//! Any pattern of cached and full blocks is therefore valid, and a full block costs
//! nothing to load. At step 0 their input is the embedder's output for the edit's own
//! inputs; afterwards the template's latent at that step (`RestRows`).

use std::ops::Range;

use denoised_runtime::backend::{HeadNorm, Modulation};
use denoised_runtime::{Backend, Error, Result};

use super::model::BlockCache;
use super::packing::{pack_segments, Packed};
use super::request::StepRequest;
use super::template::CacheMode;

pub(super) struct Inactive<'a, T> {
    /// Per request of the step: its rows in `x` (a Y-mode edit with inactive rows).
    pub rows: Vec<Option<Range<usize>>>,
    /// The request of each row (the modulation segment).
    pub seg: Vec<u32>,
    pub rope: (Packed<'a, T>, Packed<'a, T>),
    /// Their input to the current block, while they are out of the image matrix.
    pub x: Option<T>,
}

/// The Y-mode cache a request reads, if any.
pub(super) fn y_cache<'a, T>(r: &StepRequest<'a, T>) -> Option<&'a dyn BlockCache<T>> {
    r.cache
        .filter(|c| c.mode() == CacheMode::Y && !c.inactive().is_empty())
}

impl<'a, T> Inactive<'a, T> {
    /// The inactive rows of the Y-mode edits among `reqs` (`None` if there are none).
    /// Each such edit must pass its inactive rows' inputs (`StepRequest::rest`).
    pub fn new<B: Backend<Tensor = T>>(
        be: &B,
        reqs: &[StepRequest<'a, T>],
    ) -> Result<Option<Self>> {
        let mut rows = Vec::with_capacity(reqs.len());
        let mut seg = vec![];
        let mut cos = vec![];
        let mut sin = vec![];
        for (i, r) in reqs.iter().enumerate() {
            let Some(cache) = y_cache(r) else {
                rows.push(None);
                continue;
            };
            let rest = r.rest.ok_or_else(|| {
                Error::Invalid(format!(
                    "request {i} reads a Y-mode template without its inactive rows"
                ))
            })?;
            if rest.rows() != cache.inactive().len() {
                return Err(Error::Invalid(format!(
                    "request {i}: {} inactive rows passed for {} inactive tokens",
                    rest.rows(),
                    cache.inactive().len()
                )));
            }
            rows.push(Some(seg.len()..seg.len() + rest.rows()));
            seg.extend(std::iter::repeat_n(i as u32, rest.rows()));
            cos.push(vec![(&rest.rope_cos, 0..rest.rows())]);
            sin.push(vec![(&rest.rope_sin, 0..rest.rows())]);
        }
        if seg.is_empty() {
            return Ok(None);
        }
        Ok(Some(Inactive {
            rows,
            seg,
            rope: (pack_segments(be, &cos)?, pack_segments(be, &sin)?),
            x: None,
        }))
    }

    /// Takes the rows out of a full-phase matrix `m` in which each request's rows are
    /// `spans[r]`, its inactive rows last.
    pub fn take_from<B: Backend<Tensor = T>>(
        &mut self,
        be: &B,
        m: &T,
        spans: &[Range<usize>],
    ) -> Result<()> {
        let index: Vec<(u32, u32)> = self
            .rows
            .iter()
            .zip(spans)
            .filter_map(|(rows, span)| rows.as_ref().map(|r| (span.end - r.len())..span.end))
            .flatten()
            .map(|i| (0, i as u32))
            .collect();
        self.x = Some(be.gather_rows(&[m], &index)?);
        Ok(())
    }

    /// Puts the rows back after each request's rows of a cached-phase matrix `m`
    /// (whose request rows are `spans[r]`): the full-phase matrix.
    pub fn merge_into<B: Backend<Tensor = T>>(
        &mut self,
        be: &B,
        m: &T,
        spans: &[Range<usize>],
    ) -> Result<T> {
        let x = self
            .x
            .take()
            .ok_or_else(|| Error::Invalid("no inactive rows to merge".into()))?;
        let mut index = vec![];
        for (rows, span) in self.rows.iter().zip(spans) {
            index.extend(span.clone().map(|i| (0, i as u32)));
            if let Some(r) = rows {
                index.extend(r.clone().map(|i| (1, i as u32)));
            }
        }
        be.gather_rows(&[m, &x], &index)
    }

    /// `[K | V]` of the rows at a cached block: LayerNorm with the block's first
    /// modulation chunks (`table`, shift then scale), the K|V output columns `kv` of
    /// the block's fused projection `(w, b)` plus what `lora(out, input)` adds (the
    /// requests' LoRA deltas), then the K norm and RoPE on the K half.
    #[allow(clippy::too_many_arguments)]
    pub fn kv<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        table: &T,
        w: &B::Weight,
        b: Option<&T>,
        kv: Range<usize>,
        k_norm: &T,
        lora: &dyn Fn(&mut T, &T) -> Result<()>,
    ) -> Result<T> {
        let x = self
            .x
            .as_ref()
            .ok_or_else(|| Error::Invalid("no inactive rows at a cached block".into()))?;
        let d = kv.len() / 2;
        let modl = |chunk| Modulation {
            table,
            chunk,
            seg: &self.seg,
        };
        let n = be.layer_norm_modulate(x, super::model::NORM_EPS, modl(0), modl(1))?;
        let mut out = be.linear_out(&n, w, b, kv)?;
        lora(&mut out, &n)?;
        be.rms_norm_rope(
            &mut out,
            &[HeadNorm {
                cols: 0..d,
                weight: k_norm,
            }],
            super::model::NORM_EPS,
            Some((self.rope.0.get(), self.rope.1.get())),
        )?;
        Ok(out)
    }

    /// The next block's input: each Y-mode edit's inactive rows of its template's
    /// output of `block`.
    pub fn load<B: Backend<Tensor = T>>(
        &mut self,
        be: &B,
        reqs: &[StepRequest<'a, T>],
        block: usize,
    ) -> Result<()> {
        let mut srcs = vec![];
        let mut index = vec![];
        for (r, rows) in reqs.iter().zip(&self.rows) {
            if rows.is_none() {
                continue;
            }
            let cache = y_cache(r).expect("rows only for Y-mode caches");
            let s = srcs.len() as u32;
            srcs.push(cache.block(block)?);
            index.extend(cache.inactive().iter().map(|&t| (s, t)));
        }
        self.x = Some(be.gather_rows(&srcs, &index)?);
        Ok(())
    }
}
