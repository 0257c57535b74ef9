//! The sparse VAE (SIGE, `crate::vae::sparse`) in the Fill pipeline: when an edit's
//! VAE passes run sparse, and the template traces they read.
//!
//! A template edit's masked image differs from the template's image only inside the
//! mask, and its final latent from the template's only at the active tokens. The
//! encoder then runs against the trace of the template image's pass and keeps only the
//! active tokens' latents; the decoder runs against the trace of the template's final
//! latent and keeps only the masked pixels (paste-back restores the rest).
//!
//! A template's capture records both traces and stores them with the template (the
//! cache's host and disk tiers, the template file's `vae.bin`; format in
//! `crate::vae::sparse::stored`). The process that runs a pass (a preprocess worker the
//! encoder's, a postprocess worker the decoder's) reads the template's stored trace in
//! place from the cache's shared memory (the edit pins the template, so the slice stays
//! while the pass runs): no copy, whatever its size. Only when the template has none in
//! memory (captured with `sparse_vae = "off"`, or still loading from disk) does it record
//! one (one dense pass of the template, then the sparse pass of the edit), kept in a
//! least-recently-used cache of `[pipeline] sparse_vae_trace_bytes`. Recorded traces are
//! keyed by the content they trace (the template image's pixels, the final latent's
//! values), not by a name, and a stored trace is used only if its input is that content
//! bit for bit, so a stale trace can never be read.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use denoised_runtime::{Backend, HostSlice, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::fill::unpack_and_denormalize;
use super::flux_fill::FluxFill;
use super::image::Mask;
use crate::lru::ByteLru;
use crate::vae::sparse::{map_trace, Half, SparseOpts, StatsMode, VaeTrace};

pub use denoised_runtime::config::SparseVaeSetting;

/// Which pass a request's VAE encode or decode ran, as its timings report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VaePass {
    #[default]
    Dense,
    /// Sparse against a trace this process held or read from the template.
    Sparse,
    /// Sparse, after recording the template's trace (its first edit in this process).
    SparseTraced,
    /// No pass: a generation encodes no image.
    None,
}

impl VaePass {
    /// The name replies and metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            VaePass::Dense => "dense",
            VaePass::Sparse => "sparse",
            VaePass::SparseTraced => "sparse_traced",
            VaePass::None => "none",
        }
    }
}

/// Sparse runs when it computes at most this share of the dense pass's MACs. On this
/// CPU (docs/performance.md, `bench pipeline --sparse-vae`) a sparse MAC costs
/// 1.25-1.6x a dense one (0.62-0.80 of the MAC bound at 512x512), so sparse passes of
/// 0.52-0.54 of the MACs run 1.37-1.49x faster than dense and 0.6 still about 1.2x; the
/// break-even is near 0.75.
pub const SPARSE_MAX_MAC_FRACTION: f64 = 0.6;

/// The sparse VAE's settings in a process, and its traces.
pub struct SparseVae {
    pub setting: SparseVaeSetting,
    /// The encoder's mode: local regions, frozen statistics. An edit zeroes its masked
    /// pixels, which moves the first layers' statistics far; recomputed tiles normalised
    /// with updated statistics then disagree with the template values around them, and
    /// measured 2-5x the frozen error (docs/performance.md, "Sparse VAE").
    pub encoder: SparseOpts,
    /// The decoder's: local regions, incremental statistics (half the frozen error).
    pub decoder: SparseOpts,
    traces: TraceCache,
}

impl SparseVae {
    pub fn new(setting: SparseVaeSetting, trace_bytes: usize) -> Self {
        SparseVae {
            setting,
            encoder: SparseOpts {
                stats: StatsMode::Frozen,
                ..SparseOpts::default()
            },
            decoder: SparseOpts::default(),
            traces: TraceCache::new(trace_bytes),
        }
    }
}

impl SparseVae {
    /// `[pipeline] sparse_vae_trace_bytes`: the bound of this process's recorded
    /// traces, and of the traces resident on its device when its VAE is on one.
    pub fn trace_bytes(&self) -> usize {
        self.traces.lru.capacity()
    }
}

impl Default for SparseVae {
    /// Auto, with `[pipeline] sparse_vae_trace_bytes`' default.
    fn default() -> Self {
        let c = denoised_runtime::config::PipelineConfig::default();
        SparseVae::new(c.sparse_vae, c.sparse_vae_trace_bytes as usize)
    }
}

/// The traces this process recorded, by (content hash, half). Stored traces are read
/// in place from the template's slice and never land here.
struct TraceCache {
    lru: ByteLru<(u64, Half), VaeTrace>,
}

impl TraceCache {
    fn new(capacity: usize) -> Self {
        TraceCache {
            lru: ByteLru::new(capacity),
        }
    }

    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.lru.bytes()
    }

    /// The trace a pass of `half` on `input` reads, and the pass it makes: one this
    /// process recorded before, else the template's stored one (`stored`, read in
    /// place), else one recorded now with `record` (a dense pass) and kept. None when
    /// it would have to be recorded and `bytes` (its size) exceed the whole cache: a
    /// trace that cannot be kept would be recorded again for every edit, so the caller
    /// runs dense.
    fn trace_for(
        &self,
        key: (u64, Half),
        bytes: usize,
        stored: Option<&HostSlice>,
        input: &Tensor,
        record: impl FnOnce() -> Result<VaeTrace>,
    ) -> Result<Option<(Arc<VaeTrace>, VaePass)>> {
        if let Some(t) = self.lru.get(&key) {
            return Ok(Some((t, VaePass::Sparse)));
        }
        if let Some(t) = stored_trace(stored, key.1, input) {
            return Ok(Some((Arc::new(t), VaePass::Sparse)));
        }
        if bytes > self.lru.capacity() {
            return Ok(None);
        }
        let t = Arc::new(record()?);
        self.lru.insert(key, t.clone(), t.bytes());
        Ok(Some((t, VaePass::SparseTraced)))
    }
}

/// The trace of `half` in a template's stored traces, read in place, if it traces
/// `input` bit for bit. A damaged or foreign one is logged and not used (the caller
/// records its own).
fn stored_trace(stored: Option<&HostSlice>, half: Half, input: &Tensor) -> Option<VaeTrace> {
    let t = match map_trace(stored?, half) {
        Ok(t) => t?,
        Err(e) => {
            tracing::warn!("{e}; recording the trace instead");
            return None;
        }
    };
    let same = t.input().shape() == input.shape()
        && t.input()
            .data()
            .iter()
            .zip(input.data())
            .all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        tracing::warn!(
            "the template's stored {half:?} trace traces other content; recording the trace instead"
        );
        return None;
    }
    Some(t)
}

fn content_hash(shape: &[usize], data: &[f32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    shape.hash(&mut h);
    for v in data {
        v.to_bits().hash(&mut h);
    }
    h.finish()
}

/// The latent pixels (`[2 * rows x 2 * cols]`) of `tokens` on a `rows x cols` token
/// grid: a token packs 2x2 latent pixels.
pub(super) fn token_latent_pixels(
    tokens: impl Iterator<Item = usize>,
    rows: usize,
    cols: usize,
) -> Vec<bool> {
    let w = 2 * cols;
    let mut out = vec![false; 2 * rows * w];
    for t in tokens {
        let (r, c) = (t / cols, t % cols);
        for y in 2 * r..2 * r + 2 {
            out[y * w + 2 * c..y * w + 2 * c + 2].fill(true);
        }
    }
    out
}

/// The latent pixels of the tokens whose packed rows (`cols` values each) differ
/// between `a` and `b`, on a grid of `rows` token rows.
fn changed_tokens(a: &[f32], b: &[f32], cols: usize, rows: usize) -> Vec<bool> {
    let tcols = a.len() / cols / rows.max(1);
    let changed = a
        .chunks_exact(cols)
        .zip(b.chunks_exact(cols))
        .enumerate()
        .filter(|(_, (ra, rb))| ra.iter().zip(*rb).any(|(x, y)| x.to_bits() != y.to_bits()))
        .map(|(t, _)| t);
    token_latent_pixels(changed, rows, tcols)
}

impl<B: Backend<Tensor = Tensor>> FluxFill<B> {
    /// The posterior `(mean, logvar)` of a template edit's masked image (`masked`,
    /// `[1, 3, H, W]`), whose unmasked image is `full`; only the latent pixels of
    /// `keep` (the active tokens) are kept when the pass runs sparse. `stored`: the
    /// template's stored traces, if it has them.
    pub(super) fn encode_edit(
        &self,
        masked: &Tensor,
        full: &Tensor,
        keep: &[bool],
        stored: Option<&HostSlice>,
    ) -> Result<((Tensor, Tensor), VaePass)> {
        let sv = &self.sparse_vae;
        if !self.sparse_vae_on() {
            return Ok((self.vae_encode(masked)?, VaePass::Dense));
        }
        let diff: Vec<bool> = pixel_diff(masked, full);
        let shape = [masked.shape()[1], masked.shape()[2], masked.shape()[3]];
        let plan = self
            .vae
            .plan_sparse(Half::Encoder, shape, &diff, keep, sv.encoder)?;
        if plan.report.fraction() > SPARSE_MAX_MAC_FRACTION {
            return Ok((self.vae_encode(masked)?, VaePass::Dense));
        }
        let key = (content_hash(full.shape(), full.data()), Half::Encoder);
        let traced = sv
            .traces
            .trace_for(key, plan.trace_bytes(), stored, full, || {
                self.vae_trace(Half::Encoder, full)
            })?;
        let Some((trace, pass)) = traced else {
            return Ok((self.vae_encode(masked)?, VaePass::Dense));
        };
        let moments = self.vae_sparse(&plan, masked, &trace, key)?;
        Ok((self.vae.latent_dist(&moments)?, pass))
    }

    /// The raw decoder output `[1, 3, H, W]` of an edit's packed latents (`[L, cols]`)
    /// for an image of `mask`'s size. For a template edit (`template`: the template's
    /// final latent, same layout) with paste-back, sparse when it pays: exact at the
    /// masked pixels, the template's decoded pixels elsewhere (paste-back restores
    /// those). Dense otherwise. `stored`: the template's stored traces, if it has them.
    pub fn decode_edit(
        &self,
        latents: &[f32],
        template: Option<&[f32]>,
        cols: usize,
        mask: &Mask,
        paste_back: bool,
        stored: Option<&HostSlice>,
    ) -> Result<(Tensor, VaePass)> {
        let (w, h) = (mask.width, mask.height);
        let sv = &self.sparse_vae;
        let template =
            template.filter(|t| paste_back && self.sparse_vae_on() && t.len() == latents.len());
        let Some(template) = template else {
            return Ok((self.decode_packed(latents, cols, w, h)?, VaePass::Dense));
        };
        let vsf = self.vae_scale_factor();
        let (lh, lw) = (h / vsf, w / vsf);
        let diff = changed_tokens(latents, template, cols, lh / 2);
        let lc = self.vae.config().latent_channels;
        let plan =
            self.vae
                .plan_sparse(Half::Decoder, [lc, lh, lw], &diff, &mask.data, sv.decoder)?;
        if plan.report.fraction() > SPARSE_MAX_MAC_FRACTION {
            return Ok((self.decode_packed(latents, cols, w, h)?, VaePass::Dense));
        }
        let cfg = self.vae.config();
        let unpack = |l: &[f32]| -> Result<Tensor> {
            let z = unpack_and_denormalize(l, cols, lh, lw, cfg.shift(), cfg.scale())?;
            Tensor::new([1, lc, lh, lw], z)
        };
        let key = (content_hash(&[cols, lh, lw], template), Half::Decoder);
        let z = unpack(template)?;
        let traced = sv
            .traces
            .trace_for(key, plan.trace_bytes(), stored, &z, || {
                self.vae_trace(Half::Decoder, &z)
            })?;
        let Some((trace, pass)) = traced else {
            return Ok((self.decode_packed(latents, cols, w, h)?, VaePass::Dense));
        };
        let out = self.vae_sparse(&plan, &unpack(latents)?, &trace, key)?;
        Ok((out, pass))
    }
}

impl<B: Backend<Tensor = Tensor>> FluxFill<B> {
    /// Whether any edit of a `width x height` template can run `half` sparse: the
    /// smallest edit (one token, in the middle) costs at most
    /// [`SPARSE_MAX_MAC_FRACTION`] of the dense pass. A capture records only the traces
    /// that can pay (a small image under a large receptive field never runs sparse).
    pub fn sparse_vae_can_pay(&self, half: Half, width: usize, height: usize) -> Result<bool> {
        if !self.sparse_vae_on() {
            return Ok(false);
        }
        let sv = &self.sparse_vae;
        let vsf = self.vae_scale_factor();
        let (rows, cols) = (height / vsf / 2, width / vsf / 2);
        let token = (rows / 2) * cols + cols / 2;
        let latent = token_latent_pixels(std::iter::once(token), rows, cols);
        // The token's pixels: its latent pixels, each vsf x vsf.
        let lw = 2 * cols;
        let pixels: Vec<bool> = (0..height * width)
            .map(|i| latent[(i / width / vsf) * lw + (i % width) / vsf])
            .collect();
        let lc = self.vae.config().latent_channels;
        let plan = match half {
            Half::Encoder => {
                self.vae
                    .plan_sparse(half, [3, height, width], &pixels, &latent, sv.encoder)?
            }
            Half::Decoder => self.vae.plan_sparse(
                half,
                [lc, 2 * rows, 2 * cols],
                &latent,
                &pixels,
                sv.decoder,
            )?,
        };
        Ok(plan.report.fraction() <= SPARSE_MAX_MAC_FRACTION)
    }

    /// A capture's decode of the template's final latent (packed, `[L, cols]`): the
    /// decoder output, as [`FluxFill::decode_packed`] gives it, and the stored record of
    /// its trace (what the template's edits decode against) when sparse decodes of its
    /// edits can pay.
    pub fn decode_recording(
        &self,
        latents: &[f32],
        cols: usize,
        width: usize,
        height: usize,
    ) -> Result<(Tensor, Option<Vec<u8>>)> {
        if !self.sparse_vae_can_pay(Half::Decoder, width, height)? {
            return Ok((self.decode_packed(latents, cols, width, height)?, None));
        }
        let vsf = self.vae_scale_factor();
        let cfg = self.vae.config();
        let (lh, lw) = (height / vsf, width / vsf);
        let z = unpack_and_denormalize(latents, cols, lh, lw, cfg.shift(), cfg.scale())?;
        let z = Tensor::new([1, cfg.latent_channels, lh, lw], z)?;
        let trace = self.vae_trace(Half::Decoder, &z)?;
        Ok((
            trace.output().to_tensor(),
            Some(trace.to_record(Half::Decoder)),
        ))
    }
}

/// The pixels (`[H * W]`) where `a` and `b` (`[1, C, H, W]`) differ in any channel.
fn pixel_diff(a: &Tensor, b: &Tensor) -> Vec<bool> {
    let plane = a.shape()[2] * a.shape()[3];
    let mut out = vec![false; plane];
    for (i, (x, y)) in a.data().iter().zip(b.data()).enumerate() {
        if x.to_bits() != y.to_bits() {
            out[i % plane] = true;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vae::{AutoencoderKL, VaeConfig};

    fn trace(seed: u64) -> VaeTrace {
        let vae = AutoencoderKL::seeded(VaeConfig::tiny(), 1).unwrap();
        let z = Tensor::new(
            [1, 16, 4, 4],
            (0..256).map(|i| (i as f32 + seed as f32).sin()).collect(),
        );
        vae.trace_decode(&z.unwrap()).unwrap()
    }

    #[test]
    fn recorded_traces_are_kept_least_recently_used_first_out_within_capacity() {
        let one = trace(0).bytes();
        let c = TraceCache::new(2 * one);
        let z = Tensor::zeros([1]);
        let get = |k: u64| {
            let key = (k, Half::Decoder);
            c.trace_for(key, one, None, &z, || Ok(trace(k)))
                .unwrap()
                .unwrap()
                .1
        };
        let (rec, kept) = (VaePass::SparseTraced, VaePass::Sparse);
        assert!(get(1) == rec && get(2) == rec, "recorded on first use");
        assert_eq!(get(1), kept);
        assert_eq!(get(3), rec, "recorded; evicts 2, the least recently used");
        assert!(get(1) == kept && get(3) == kept && get(2) == rec);
        assert!(c.bytes() <= 2 * one);
        // A trace larger than the whole cache is never recorded: the caller runs dense.
        let big = c.trace_for((9, Half::Decoder), 3 * one, None, &z, || {
            panic!("not recorded")
        });
        assert!(big.unwrap().is_none());
    }

    /// A stored trace is read in place and not kept; one of other content is ignored
    /// (and the trace recorded).
    #[test]
    fn a_stored_trace_is_read_when_it_traces_the_same_content() {
        let c = TraceCache::new(1 << 30);
        let t = trace(5);
        let slice = HostSlice::copy_of(&t.to_record(Half::Decoder)).unwrap();
        let input = t.input().to_tensor();
        let (got, pass) = c
            .trace_for((5, Half::Decoder), 1, Some(&slice), &input, || {
                panic!("recorded")
            })
            .unwrap()
            .unwrap();
        assert_eq!(pass, VaePass::Sparse);
        assert!(got.is_mapped() && c.bytes() == 0, "read in place, not kept");
        let other = trace(6).input().to_tensor();
        let (_, pass) = c
            .trace_for((6, Half::Decoder), 1, Some(&slice), &other, || Ok(trace(6)))
            .unwrap()
            .unwrap();
        assert_eq!(pass, VaePass::SparseTraced);
    }

    #[test]
    fn a_plan_knows_its_trace_size_before_the_trace_exists() {
        let vae = AutoencoderKL::seeded(VaeConfig::tiny(), 1).unwrap();
        let t = trace(0);
        let plan = vae
            .plan_sparse(
                Half::Decoder,
                [16, 4, 4],
                &[true; 16],
                &[true; 64],
                SparseOpts::default(),
            )
            .unwrap();
        // The estimate leaves out the GroupNorm sums (16 bytes a group).
        assert!(plan.trace_bytes() <= t.bytes() && t.bytes() - plan.trace_bytes() < 4096);
    }
}
