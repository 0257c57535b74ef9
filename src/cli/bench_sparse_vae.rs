//! `denoised bench pipeline --sparse-vae`: the VAE of an edit, dense against
//! spatially sparse (SIGE), per mask ratio and sparse mode; one JSON line each.
//!
//! The template is a random image (encoder) and a random latent (decoder), traced once.
//! An edit's mask is random blobs of tokens covering the ratio; the encoder's input is
//! the template with the masked pixels zeroed (the Fill pipeline's masked image) and
//! only the active tokens' latents are kept; the decoder's input is the template latent
//! with new values at the active tokens and only the masked pixels are kept. Each
//! ratio runs the dense pass on the same input: its time (the median over the ratios
//! is reported as `dense_s`) and its output, against which the sparse error is measured
//! inside the kept region. The MAC bound is the dense time scaled by the MACs of the
//! region's pixels alone (no gather, no scatter). A `crop:HALO` mode runs
//! the dense decoder on the masked pixels' window grown by HALO latent pixels
//! (crop-with-halo; decoder only), its MACs the window's share.
//!
//! Seeded weights make the errors regression guards, not image-quality figures.

use std::time::Instant;

use denoised_models::flux::weights::SplitMix;
use denoised_models::mask::TokenMask;
use denoised_models::vae::crop::Window;
use denoised_models::vae::sparse::{kept_error, RegionMode, SparseOpts, SparseReport, StatsMode};
use denoised_models::vae::{AutoencoderKL, VaeConfig};
use denoised_runtime::Tensor;

use super::bench_pipeline::{pixel_mask, Args};
use super::CliResult;

/// A way to run an edit's VAE pass other than dense.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Sparse(SparseOpts),
    /// The decoder on the kept pixels' window, grown by this many latent pixels.
    Crop(usize),
}

/// `REGION/STATS[/crop]`, e.g. `local/incremental` or `dilated:2/frozen/crop`, or
/// `crop:HALO` (the plain crop).
fn parse_mode(s: &str, tile: usize) -> CliResult<Mode> {
    if let Some(h) = s.strip_prefix("crop:") {
        let halo = h
            .parse()
            .map_err(|_| format!("--sparse-modes {s:?}: crop:HALO takes latent pixels"))?;
        return Ok(Mode::Crop(halo));
    }
    let bad = || {
        format!(
            "--sparse-modes {s:?}: expected REGION/STATS[/crop] (e.g. local/incremental) or crop:HALO"
        )
    };
    let mut parts = s.split('/');
    let (Some(r), Some(st)) = (parts.next(), parts.next()) else {
        return Err(bad().into());
    };
    let crop = match parts.next() {
        None => false,
        Some("crop") => true,
        Some(_) => return Err(bad().into()),
    };
    Ok(Mode::Sparse(SparseOpts {
        region: r.parse::<RegionMode>()?,
        stats: st.parse::<StatsMode>()?,
        tile,
        crop,
    }))
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t0 = Instant::now();
    let v = f();
    (v, t0.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One edit's masks: `(pixels [n*n], latent pixels [ln*ln])`.
fn masks(n: usize, f: usize, ratio: f64, seed: u64) -> (Vec<bool>, Vec<bool>) {
    let tok = 2 * f;
    let (tr, ln) = (n / tok, n / f);
    let count = (ratio * (tr * tr) as f64).round().max(1.0) as usize;
    let tm = TokenMask::random_blobs(tr, tr, count, seed);
    let pix = pixel_mask(&tm, n, tok).data;
    let lat = (0..ln * ln)
        .map(|i| pix[(i / ln) * f * n + (i % ln) * f])
        .collect();
    (pix, lat)
}

struct Point {
    half: &'static str,
    ratio: f64,
    mode: Mode,
    dense_s: f64,
    sparse_s: f64,
    /// Median over the iterations of dense time / sparse time, each pair run back to
    /// back (this machine's speed drifts by tens of percent between minutes).
    speedup: f64,
    report: SparseReport,
    err: (f32, f32),
}

/// One half at one ratio: `iters` rounds of the dense pass then each mode's sparse
/// pass; the dense output of the last round is the error reference.
fn measure(
    half: &'static str,
    ratio: f64,
    modes: &[Mode],
    iters: usize,
    dense: impl Fn() -> CliResult<Tensor>,
    sparse: impl Fn(Mode) -> CliResult<(Tensor, SparseReport)>,
    keep: &[bool],
) -> CliResult<Vec<Point>> {
    let mut dense_t = Vec::new();
    let mut sparse_t = vec![Vec::new(); modes.len()];
    let mut out = vec![None; modes.len()];
    let mut want = None;
    for _ in 0..iters.max(1) {
        let (w, s) = timed(&dense);
        want = Some(w?);
        dense_t.push(s);
        for (k, &m) in modes.iter().enumerate() {
            let (o, s) = timed(|| sparse(m));
            out[k] = Some(o?);
            sparse_t[k].push(s);
        }
    }
    let want = want.expect("one round at least");
    Ok(modes
        .iter()
        .zip(out)
        .zip(sparse_t)
        .map(|((&mode, o), st)| {
            let (got, report) = o.expect("one round at least");
            let pairs = dense_t.iter().zip(&st).map(|(d, s)| d / s).collect();
            Point {
                half,
                ratio,
                mode,
                dense_s: median(dense_t.clone()),
                sparse_s: median(st),
                speedup: median(pairs),
                report,
                err: kept_error(&got, &want, keep),
            }
        })
        .collect())
}

pub(super) fn run(a: &Args) -> CliResult {
    let config = match a.pipeline.as_str() {
        "builtin" => VaeConfig::tiny(),
        "flux-small" => VaeConfig::flux1(),
        other => return Err(format!("unknown --pipeline `{other}`: builtin or flux-small").into()),
    };
    let modes = a
        .sparse_modes
        .iter()
        .map(|m| parse_mode(m, a.tile))
        .collect::<CliResult<Vec<_>>>()?;
    if let Some(bad) = a.mask_ratio.iter().find(|r| !(*r > &0.0 && *r <= &1.0)) {
        return Err(format!("--mask-ratio {bad} is not in (0, 1]").into());
    }
    // The VAE seeded as FluxFill::seeded_small seeds it (seed 0 ^ 1).
    let vae = AutoencoderKL::seeded(config, 1)?;
    let (n, f) = (a.size, vae.config().vae_scale_factor());
    if n == 0 || n % (2 * f) != 0 {
        return Err(format!("--size {n} must be a positive multiple of {}", 2 * f).into());
    }
    let ln = n / f;
    let mut rng = SplitMix::new(5);
    let mut random = |shape: [usize; 4]| {
        let len = shape.iter().product();
        Tensor::new(shape, (0..len).map(|_| rng.uniform() * 2.0 - 1.0).collect())
    };
    let image = random([1, 3, n, n])?;
    let z = random([1, 16, ln, ln])?;
    let mut points = Vec::new();
    let encoder_modes: Vec<Mode> = modes
        .iter()
        .copied()
        .filter(|m| matches!(m, Mode::Sparse(_)))
        .collect();

    let (trace, capture_s) = timed(|| vae.trace_encode(&image));
    let trace = trace?;
    println!(
        "{}",
        serde_json::json!({"half": "encoder", "size": n, "capture_s": capture_s, "trace_bytes": trace.bytes()})
    );
    for (k, &ratio) in a.mask_ratio.iter().enumerate() {
        let (pix, lat) = masks(n, f, ratio, 11 + k as u64);
        let mut edited = image.clone();
        let plane = n * n;
        for (i, v) in edited.data_mut().iter_mut().enumerate() {
            if pix[i % plane] {
                *v = 0.0;
            }
        }
        points.extend(measure(
            "encoder",
            ratio,
            &encoder_modes,
            a.iters,
            || Ok(vae.encode(&edited)?.0),
            |m| {
                let Mode::Sparse(m) = m else {
                    unreachable!("crop modes are the decoder's")
                };
                let ((mean, _), r) = vae.encode_sparse(&edited, &trace, &pix, &lat, m)?;
                Ok((mean, r))
            },
            &lat,
        )?);
    }
    drop(trace);

    let (trace, capture_s) = timed(|| vae.trace_decode(&z));
    let trace = trace?;
    println!(
        "{}",
        serde_json::json!({"half": "decoder", "size": n, "capture_s": capture_s, "trace_bytes": trace.bytes()})
    );
    let mut rng = SplitMix::new(6);
    for (k, &ratio) in a.mask_ratio.iter().enumerate() {
        let (pix, lat) = masks(n, f, ratio, 11 + k as u64);
        let mut edited = z.clone();
        let plane = ln * ln;
        for (i, v) in edited.data_mut().iter_mut().enumerate() {
            if lat[i % plane] {
                *v = rng.uniform() * 2.0 - 1.0;
            }
        }
        points.extend(measure(
            "decoder",
            ratio,
            &modes,
            a.iters,
            || Ok(vae.decode(&edited)?),
            |m| match m {
                Mode::Sparse(m) => Ok(vae.decode_sparse(&edited, &trace, &lat, &pix, m)?),
                Mode::Crop(halo) => {
                    let win = Window::covering(&pix, ln, ln, f, halo).ok_or("an empty mask")?;
                    let out = win.place(&vae.decode(&win.crop(&edited)?)?, n, n, f)?;
                    // MACs in units of latent pixels: the window's, at no waste.
                    let px = ((win.y1 - win.y0) * (win.x1 - win.x0)) as u64;
                    let report = SparseReport {
                        dense_macs: (ln * ln) as u64,
                        sparse_macs: px,
                        region_macs: px,
                    };
                    Ok((out, report))
                }
            },
            &pix,
        )?);
    }

    for p in points {
        let r = p.report;
        let bound_s = p.dense_s * r.region_macs as f64 / r.dense_macs as f64;
        let mut line = serde_json::json!({
            "half": p.half, "size": n, "mask_ratio": p.ratio,
            "mode": match p.mode {
                Mode::Sparse(m) => format!(
                    "{}/{}{} tile {}",
                    m.region,
                    m.stats,
                    if m.crop { "/crop" } else { "" },
                    m.tile
                ),
                Mode::Crop(halo) => format!("crop:{halo}"),
            },
            "dense_s": p.dense_s, "sparse_s": p.sparse_s, "speedup": p.speedup,
            "computed_mac_fraction": r.sparse_macs as f64 / r.dense_macs as f64,
            "region_mac_fraction": r.region_macs as f64 / r.dense_macs as f64,
            "mac_bound_s": bound_s,
            // The share of the MAC bound reached: bound speedup over measured speedup.
            "mac_bound_fraction": p.speedup * r.region_macs as f64 / r.dense_macs as f64,
            "max_abs_err": p.err.0, "max_abs_dense": p.err.1,
        });
        if p.half == "decoder" {
            // Decoded values map [-1, 1] to 0..255.
            line["max_err_levels"] = (p.err.0 as f64 * 127.5).into();
        }
        println!("{line}");
    }
    Ok(())
}
