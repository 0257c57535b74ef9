//! The CPU stages of a request around the denoise loop: preparation (decode, mask,
//! text, VAE encode, noise) and finishing (VAE decode, paste-back, encode).
//!
//! They are plain functions over a loaded pipeline so that the same code runs in the
//! preprocess and postprocess workers (disaggregated, the default) and inside the
//! denoise process between steps (`[denoise] disaggregate = false`, the baseline). They
//! do exactly what `denoised edit` and `denoised template capture` do, so the daemon's
//! images equal the CLI's on the same inputs.

use std::time::Instant;

use denoised_models::mask::TokenMask;
use denoised_models::pipeline::flux_fill::{
    EditOptions, FluxFill, Noise, PipelineKind, Prepared, Timings,
};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::pipeline::image::{
    decode_edit_mask, decode_image, encode_jpeg, encode_png, encode_webp, from_model_space,
    ImageLimits, Mask, Rgb8,
};
use denoised_models::pipeline::paste::paste_back;
use denoised_models::pipeline::sizing;
pub use denoised_models::pipeline::sizing::Source;
use denoised_models::pipeline::sparse_vae::VaePass;
use denoised_runtime::shm::Handle;
use denoised_runtime::{CpuBackend, HostSlice, Tensor};

use crate::wire::{
    ErrorKind, FinishParams, GenParams, ImageFormat, MaskChannel, MaskSpec, WireError,
};

pub type Pipeline = FluxFill<CpuBackend>;

/// The mask of a request, with encoded bytes already read from shared memory.
pub enum MaskInput<'a> {
    Image(&'a [u8], MaskChannel),
    Boxes(&'a [[u32; 4]]),
    Polygons(&'a [Vec<[f32; 2]>]),
    Empty,
    /// No mask: every pixel may change (a Kontext instruction edit).
    Whole,
}

impl<'a> MaskInput<'a> {
    /// The mask of a request: `image_mask` holds the bytes of a `MaskSpec::Image`.
    pub fn new(spec: &'a MaskSpec, image_mask: Option<&'a [u8]>) -> Self {
        match (spec, image_mask) {
            (MaskSpec::Image(_, channel), Some(b)) => MaskInput::Image(b, *channel),
            (MaskSpec::Boxes(b), _) => MaskInput::Boxes(b),
            (MaskSpec::Polygons(p), _) => MaskInput::Polygons(p),
            (MaskSpec::Whole, _) => MaskInput::Whole,
            _ => MaskInput::Empty,
        }
    }
}

/// A prepared request: the pipeline's conditioning plus the token mask.
pub struct Stage1 {
    pub prepared: Prepared,
    pub token_mask: TokenMask,
    pub seconds: f64,
    pub vae_pass: VaePass,
    /// The prompt's embeddings came from the prompt cache.
    pub prompt_cache_hit: bool,
    /// The negative prompt's embeddings (true CFG): `[T', joint]`, pooled.
    pub negative: Option<(denoised_runtime::Tensor, Vec<f32>)>,
    /// The input's image and mask, when the edit is computed at another size.
    pub source: Option<Source>,
}

/// The sizes an edit's image may have: `max_pixels` as uploaded, `max_tokens` (of the
/// model's) as computed (`denoised_models::pipeline::sizing`).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub max_pixels: usize,
    pub max_tokens: usize,
}

/// Maps an engine error on client data to a 4xx-class error.
fn input_error(e: denoised_runtime::Error) -> WireError {
    let msg = e.to_string();
    let kind = if msg.contains("exceeds the limit") {
        ErrorKind::TooLarge
    } else {
        ErrorKind::BadInput
    };
    WireError::new(kind, msg)
}

/// Most boxes one request may give.
pub const MAX_BOXES: usize = 1000;
/// Most polygons one request may give.
pub const MAX_POLYGONS: usize = 1000;
/// Most polygon vertices one request may give, all polygons together. Rasterising
/// costs O(pixels + rows crossed by edges), so this bounds its time: at 10,000 edges
/// over 2048 rows, about 20 million crossings, a fraction of a second.
pub const MAX_VERTICES: usize = 10_000;

/// Checks a request's boxes and polygons against the limits above (and for finite
/// coordinates), so that a hostile mask is refused before any work.
pub fn check_shapes(spec: &MaskInput<'_>) -> Result<(), WireError> {
    match spec {
        MaskInput::Boxes(b) if b.len() > MAX_BOXES => Err(WireError::bad_input(format!(
            "{} boxes; a mask may have at most {MAX_BOXES}",
            b.len()
        ))),
        MaskInput::Polygons(p) => {
            let vertices: usize = p.iter().map(Vec::len).sum();
            if p.len() > MAX_POLYGONS {
                return Err(WireError::bad_input(format!(
                    "{} polygons; a mask may have at most {MAX_POLYGONS}",
                    p.len()
                )));
            }
            if vertices > MAX_VERTICES {
                return Err(WireError::bad_input(format!(
                    "{vertices} polygon vertices; a mask may have at most {MAX_VERTICES} in all"
                )));
            }
            if p.iter().flatten().flatten().any(|v| !v.is_finite()) {
                return Err(WireError::bad_input("polygon coordinates must be finite"));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Rasterises boxes or polygons into a `width x height` mask.
///
/// A pixel is in a polygon when its centre is, by the even-odd rule (a polygon with
/// holes or self-intersections follows it); the mask is the union of the polygons.
/// Polygons are filled by scanline: for each row, the x-crossings of the edges that
/// span the row's centre, then the spans between them. Each edge is visited only for
/// the rows it crosses, so the cost is O(pixels + crossings), not O(pixels x vertices).
pub fn rasterize(spec: &MaskInput<'_>, width: usize, height: usize) -> Mask {
    let mut data = vec![false; width * height];
    match spec {
        MaskInput::Boxes(boxes) => {
            for &[x, y, w, h] in boxes.iter() {
                let (x0, y0) = ((x as usize).min(width), (y as usize).min(height));
                let x1 = (x as usize).saturating_add(w as usize).min(width);
                let y1 = (y as usize).saturating_add(h as usize).min(height);
                for row in y0..y1 {
                    data[row * width + x0..row * width + x1].fill(true);
                }
            }
        }
        MaskInput::Polygons(polys) => {
            for poly in polys.iter().filter(|p| p.len() >= 3) {
                fill_polygon(poly, width, height, &mut data);
            }
        }
        MaskInput::Whole => data.fill(true),
        MaskInput::Image(..) | MaskInput::Empty => {}
    }
    Mask {
        width,
        height,
        data,
    }
}

/// Scanline fill of one polygon (even-odd, pixel centres) into `data`.
fn fill_polygon(poly: &[[f32; 2]], width: usize, height: usize, data: &mut [bool]) {
    // Each edge with the rows whose centre it may cross (a row more on each side, so
    // float rounding never drops one; the exact test below decides).
    let mut edges: Vec<(usize, usize, [f32; 2], [f32; 2])> = (0..poly.len())
        .filter_map(|i| {
            let (a, b) = (poly[i], poly[(i + poly.len() - 1) % poly.len()]);
            let (lo, hi) = (a[1].min(b[1]), a[1].max(b[1]));
            if hi < 0.0 || lo > height as f32 || lo == hi {
                return None;
            }
            let r0 = (lo - 1.5).max(0.0) as usize;
            let r1 = ((hi + 1.5).max(0.0) as usize).min(height);
            Some((r0, r1, a, b))
        })
        .collect();
    edges.sort_unstable_by_key(|e| e.0);
    let mut next = 0;
    let mut active: Vec<(usize, usize, [f32; 2], [f32; 2])> = Vec::new();
    let mut xs: Vec<f32> = Vec::new();
    for row in 0..height {
        while next < edges.len() && edges[next].0 <= row {
            active.push(edges[next]);
            next += 1;
        }
        active.retain(|e| e.1 > row);
        if active.is_empty() {
            if next == edges.len() {
                break;
            }
            continue;
        }
        let y = row as f32 + 0.5;
        xs.clear();
        // The same predicate and arithmetic as the point-in-polygon test, so the
        // result equals it pixel for pixel.
        for &(_, _, [xi, yi], [xj, yj]) in &active {
            if (yi > y) != (yj > y) {
                xs.push((xj - xi) * (y - yi) / (yj - yi) + xi);
            }
        }
        xs.sort_unstable_by(f32::total_cmp);
        // A centre px is inside when an odd number of crossings lie right of it
        // (px < x), i.e. between consecutive crossings counted from the right.
        let line = &mut data[row * width..(row + 1) * width];
        let mut k = 0; // crossings with x <= px
        for (col, px) in line.iter_mut().enumerate() {
            let px_f = col as f32 + 0.5;
            while k < xs.len() && xs[k] <= px_f {
                k += 1;
            }
            if (xs.len() - k) % 2 == 1 {
                *px = true;
            }
        }
    }
}

/// What a request's VAE passes do with a template's traces
/// (`denoised_models::pipeline::sparse_vae`).
#[derive(Clone, Debug, Default)]
pub enum TemplateVae {
    /// Nothing: a dense pass (an inline image, or the inline baseline).
    #[default]
    None,
    /// A template edit: sparse when it pays, against the template's stored traces
    /// when they are in memory (else the worker's own, or one it records).
    Edit(Option<HostSlice>),
    /// A template capture: record the trace and return it, as stored.
    Capture,
}

impl TemplateVae {
    fn options(self, opts: &mut EditOptions) {
        match self {
            TemplateVae::None => {}
            TemplateVae::Edit(traces) => {
                opts.template_edit = true;
                opts.vae_traces = traces;
            }
            TemplateVae::Capture => opts.record_vae_trace = true,
        }
    }
}

/// Preparation of one request, as `denoised edit` / `template capture` do it, and
/// true CFG's negative prompt when it runs.
pub fn prepare(
    p: &Pipeline,
    image_bytes: &[u8],
    mask: MaskInput<'_>,
    params: &GenParams,
    sizes: Sizes,
    (vae, negative_prompt): (TemplateVae, Option<&str>),
) -> Result<Stage1, WireError> {
    let t0 = Instant::now();
    // Any size is taken up to the input limit; the work size is whole tokens.
    let limits = ImageLimits {
        max_pixels: sizes.max_pixels,
        multiple_of: 1,
    };
    let image = decode_image(image_bytes, &limits).map_err(input_error)?;
    let (iw, ih) = (image.width, image.height);
    if matches!(mask, MaskInput::Whole) && p.kind != PipelineKind::Kontext {
        return Err(input_error(
            p.kind.require(PipelineKind::Kontext).unwrap_err(),
        ));
    }
    let mask = match mask {
        MaskInput::Image(b, channel) => {
            decode_edit_mask(b, iw, ih, &limits, channel).map_err(input_error)?
        }
        other => {
            check_shapes(&other)?;
            rasterize(&other, iw, ih)
        }
    };
    let block = 2 * p.vae_scale_factor();
    let work = sizing::work_size(iw, ih, block, sizes.max_tokens * block * block);
    let (image, mask, source) = sizing::to_work(image, mask, work);
    let (w, h) = (image.width, image.height);
    let mut opts = EditOptions {
        steps: params.steps as usize,
        guidance: params.guidance,
        seed: params.seed,
        max_sequence_length: params.max_sequence_length as usize,
        dilation: params.dilation as usize,
        ..Default::default()
    };
    vae.options(&mut opts);
    let token_mask =
        TokenMask::from_pixels(&mask.data, h, w, block, opts.dilation).map_err(input_error)?;
    let mut t = Timings::default();
    let prepared = p
        .prepare(
            &image,
            &mask,
            &params.prompt,
            &opts,
            &Noise::default(),
            &mut t,
        )
        .map_err(input_error)?;
    let negative = encode_negative(p, negative_prompt, params, &mut t)?;
    Ok(Stage1 {
        prepared,
        token_mask,
        seconds: t0.elapsed().as_secs_f64(),
        vae_pass: t.vae_encode_pass,
        prompt_cache_hit: t.prompt_cache_hit,
        negative,
        source,
    })
}

/// True CFG's negative prompt's embeddings, when it runs.
fn encode_negative(
    p: &Pipeline,
    negative_prompt: Option<&str>,
    params: &GenParams,
    t: &mut Timings,
) -> Result<Option<(Tensor, Vec<f32>)>, WireError> {
    let Some(n) = negative_prompt else {
        return Ok(None);
    };
    let seq = params.max_sequence_length as usize;
    let (txt, pooled, _) = p.encode_prompt(n, seq, t).map_err(input_error)?;
    Ok(Some((txt, pooled)))
}

/// Preparation of a generation, as `denoised generate` does it: its token mask is the
/// whole image.
pub fn prepare_generate(
    p: &Pipeline,
    params: &GenParams,
    (width, height): (u32, u32),
    negative_prompt: Option<&str>,
    max_pixels: usize,
) -> Result<Stage1, WireError> {
    let t0 = Instant::now();
    let (w, h) = (width as usize, height as usize);
    if w * h > max_pixels {
        return Err(WireError::new(
            ErrorKind::TooLarge,
            format!(
                "{w}x{h} = {} pixels exceeds the limit of {max_pixels}",
                w * h
            ),
        ));
    }
    let opts = GenerateOptions {
        steps: params.steps as usize,
        guidance: params.guidance,
        seed: params.seed,
        max_sequence_length: params.max_sequence_length as usize,
        width: w,
        height: h,
    };
    let mut t = Timings::default();
    let prepared = p
        .prepare_generate(&params.prompt, &opts, None, &mut t)
        .map_err(input_error)?;
    let negative = encode_negative(p, negative_prompt, params, &mut t)?;
    let (rows, cols) = p.tokens(w, h);
    let token_mask =
        TokenMask::from_tokens(rows, cols, &vec![true; rows * cols]).map_err(input_error)?;
    Ok(Stage1 {
        prepared,
        token_mask,
        seconds: t0.elapsed().as_secs_f64(),
        vae_pass: VaePass::None,
        prompt_cache_hit: t.prompt_cache_hit,
        negative,
        source: None,
    })
}

/// A template edit's template, as the decoder reads it.
pub struct TemplateDecode<'a> {
    /// The template's final latent (same layout as the edit's).
    pub latent: &'a [f32],
    /// Its stored VAE traces, when they are in memory.
    pub traces: Option<&'a HostSlice>,
}

/// What [`finish`] gives: the encoded image, the decoder's pass, and a capture's
/// decoder trace as stored.
pub struct Finish {
    pub bytes: Vec<u8>,
    pub pass: VaePass,
    pub trace: Option<Vec<u8>>,
}

/// VAE decode, paste-back and encoding of a finished latent. For a template edit
/// (`template`) with paste-back, the decoder may run sparse against the template's
/// trace; a capture (`record_trace`) records it. With a `source` (an edit computed at
/// another size than its input's), the result is resized to the input's size and
/// pasted back over it there.
#[allow(clippy::too_many_arguments)]
pub fn finish(
    p: &Pipeline,
    (image, mask, source): (&Rgb8, &Mask, Option<&Source>),
    latents: &[f32],
    cols: usize,
    params: &FinishParams,
    template: Option<TemplateDecode<'_>>,
    record_trace: bool,
) -> Result<Finish, WireError> {
    let internal = |e: denoised_runtime::Error| WireError::internal(e.to_string());
    let (raw, pass, trace) = if record_trace {
        let (raw, trace) = p
            .decode_recording(latents, cols, image.width, image.height)
            .map_err(internal)?;
        (raw, VaePass::Dense, trace)
    } else {
        let (latent, traces) = template.map_or((None, None), |t| (Some(t.latent), t.traces));
        let (raw, pass) = p
            .decode_edit(latents, latent, cols, mask, params.paste_back, traces)
            .map_err(internal)?;
        (raw, pass, None)
    };
    let generated = from_model_space(raw.data(), image.width, image.height);
    // Pasted back at the input's resolution: its own pixels, not resampled ones.
    let (generated, image, mask) = match source {
        Some(s) => {
            let (w, h) = (s.image.width, s.image.height);
            (sizing::resize_rgb(&generated, w, h), &s.image, &s.mask)
        }
        None => (generated, image, mask),
    };
    let out = if params.paste_back {
        paste_back(image, &generated, mask, params.feather as usize)
    } else {
        generated
    };
    let quality = params.format.quality(params.compression);
    let bytes = match params.format {
        ImageFormat::Png => encode_png(&out).map_err(internal)?,
        ImageFormat::Jpeg => encode_jpeg(&out, quality).map_err(internal)?,
        // Its side limit is the client's to meet (a 400 naming it).
        ImageFormat::Webp => encode_webp(&out, quality).map_err(input_error)?,
    };
    Ok(Finish { bytes, pass, trace })
}

/// A capture's VAE trace into this worker's arena. Traces are an optimisation: one
/// that does not fit is left out (the template's edits record it when they need it),
/// never a failed capture.
pub fn trace_to_shm(shm: &crate::node::Shm, trace: &[u8], half: &str) -> Option<Handle> {
    shm.write_bytes(trace)
        .inspect_err(|e| {
            tracing::warn!(
                "the template's VAE {half} trace ({:.0} MB) does not fit this worker's shared memory ({}); it is stored without it: raise [workers] arena_bytes",
                trace.len() as f64 / 1e6,
                e.message
            )
        })
        .ok()
}

/// The pixel mask as bytes (0/1) for shared memory, and back.
pub fn mask_to_bytes(m: &Mask) -> Vec<u8> {
    m.data.iter().map(|&b| b as u8).collect()
}

pub fn mask_from_bytes(b: Vec<u8>, width: usize, height: usize) -> Result<Mask, WireError> {
    if b.len() != width * height {
        return Err(WireError::internal(format!(
            "pixel mask of {} bytes for a {width}x{height} image",
            b.len()
        )));
    }
    Ok(Mask {
        width,
        height,
        data: b.into_iter().map(|v| v != 0).collect(),
    })
}

pub fn rgb_from_bytes(b: Vec<u8>, width: usize, height: usize) -> Result<Rgb8, WireError> {
    if b.len() != width * height * 3 {
        return Err(WireError::internal(format!(
            "RGB image of {} bytes for {width}x{height}",
            b.len()
        )));
    }
    Ok(Rgb8 {
        width,
        height,
        data: b,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Even-odd point-in-polygon test: the reference the scanline fill must equal.
    fn inside(poly: &[[f32; 2]], x: f32, y: f32) -> bool {
        let mut c = false;
        let mut j = poly.len() - 1;
        for i in 0..poly.len() {
            let ([xi, yi], [xj, yj]) = (poly[i], poly[j]);
            if (yi > y) != (yj > y) && x < (xj - xi) * (y - yi) / (yj - yi) + xi {
                c = !c;
            }
            j = i;
        }
        c
    }

    fn brute(polys: &[Vec<[f32; 2]>], w: usize, h: usize) -> Vec<bool> {
        let mut out = vec![false; w * h];
        for p in polys.iter().filter(|p| p.len() >= 3) {
            for row in 0..h {
                for col in 0..w {
                    if inside(p, col as f32 + 0.5, row as f32 + 0.5) {
                        out[row * w + col] = true;
                    }
                }
            }
        }
        out
    }

    proptest! {
        /// Random polygons (self-intersecting, partly outside the image, vertices on
        /// pixel centres and edges) fill exactly as the per-pixel test.
        #[test]
        fn scanline_fill_equals_the_point_in_polygon_test(
            w in 1usize..24, h in 1usize..24,
            polys in prop::collection::vec(
                prop::collection::vec((-4i32..60, -4i32..60), 0..9), 1..4),
        ) {
            // Half-pixel coordinates hit centres and boundaries exactly.
            let polys: Vec<Vec<[f32; 2]>> = polys
                .iter()
                .map(|p| p.iter().map(|&(x, y)| [x as f32 / 2.0, y as f32 / 2.0]).collect())
                .collect();
            let m = rasterize(&MaskInput::Polygons(&polys), w, h);
            prop_assert_eq!(m.data, brute(&polys, w, h));
        }
    }

    #[test]
    fn hostile_shapes_are_refused_before_any_work() {
        let many = vec![vec![[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]; MAX_POLYGONS + 1];
        let huge = vec![(0..1_000_000).map(|i| [i as f32, (i % 7) as f32]).collect()];
        let boxes = vec![[0, 0, 1, 1]; MAX_BOXES + 1];
        let nan = vec![vec![[0.0, 0.0], [f32::NAN, 0.0], [0.0, 1.0]]];
        for spec in [
            MaskInput::Polygons(&many),
            MaskInput::Polygons(&huge),
            MaskInput::Boxes(&boxes),
            MaskInput::Polygons(&nan),
        ] {
            let e = check_shapes(&spec).unwrap_err();
            assert_eq!(e.kind, ErrorKind::BadInput, "{e:?}");
        }
        // At the limit, the worst case (every edge crossing every row) stays fast.
        let zigzag: Vec<[f32; 2]> = (0..MAX_VERTICES)
            .map(|i| [i as f32 * 0.2, if i % 2 == 0 { 0.0 } else { 2048.0 }])
            .collect();
        let polys = vec![zigzag];
        check_shapes(&MaskInput::Polygons(&polys)).unwrap();
        let t0 = std::time::Instant::now();
        let m = rasterize(&MaskInput::Polygons(&polys), 2048, 2048);
        let secs = t0.elapsed().as_secs_f64();
        assert!(m.data.iter().any(|&b| b));
        assert!(secs < 5.0, "rasterising took {secs:.2} s");
        eprintln!("worst-case polygon at the limits, 2048x2048: {secs:.3} s");
    }

    #[test]
    fn boxes_and_polygons_rasterize_like_brute_force() {
        let m = rasterize(&MaskInput::Boxes(&[[2, 1, 3, 2], [7, 7, 10, 10]]), 8, 8);
        for y in 0..8 {
            for x in 0..8 {
                let want = ((2..5).contains(&x) && (1..3).contains(&y)) || (x == 7 && y == 7);
                assert_eq!(m.data[y * 8 + x], want, "({x},{y})");
            }
        }
        // A square polygon from (1,1) to (5,5) covers pixel centres 1.5..4.5.
        let sq = vec![vec![[1.0, 1.0], [5.0, 1.0], [5.0, 5.0], [1.0, 5.0]]];
        let m = rasterize(&MaskInput::Polygons(&sq), 8, 8);
        for y in 0..8 {
            for x in 0..8 {
                assert_eq!(
                    m.data[y * 8 + x],
                    (1..5).contains(&x) && (1..5).contains(&y)
                );
            }
        }
    }
}
