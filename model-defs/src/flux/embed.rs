//! Conditioning signals computed on the host: the sinusoidal timestep/guidance
//! projection and the 3-axis rotary position tables.
//!
//! These follow diffusers' float32/float64 islands exactly (see the fixture README,
//! "Timestep and guidance scaling" and "RoPE"): frequencies of the sinusoid in float32,
//! RoPE frequencies and angles in float64, both cast to float32 at the end.

use super::config::TIME_PROJ_DIM;

const MAX_PERIOD: f64 = 10000.0;
const ROPE_THETA: f64 = 10000.0;

/// The 128 frequencies of `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`:
/// `exp(f32(-ln 10000) * k / 128)` with the product and quotient in float32.
pub fn time_proj_freqs() -> Vec<f32> {
    let half = TIME_PROJ_DIM / 2;
    let c = -(MAX_PERIOD.ln() as f32);
    (0..half)
        .map(|k| {
            let e = c * k as f32 / half as f32;
            (e as f64).exp() as f32
        })
        .collect()
}

/// `cat(cos(x*f), sin(x*f))` for each value `x` (already multiplied by 1000 in
/// float32, as the model does), with `x*f` in float32. Returns `[xs.len(), 256]`.
pub fn sinusoid(xs: &[f32], freqs: &[f32]) -> Vec<f32> {
    let half = freqs.len();
    let mut out = Vec::with_capacity(xs.len() * 2 * half);
    for &x in xs {
        let args: Vec<f32> = freqs.iter().map(|f| x * f).collect();
        out.extend(args.iter().map(|a| (*a as f64).cos() as f32));
        out.extend(args.iter().map(|a| (*a as f64).sin() as f32));
    }
    out
}

/// RoPE tables for position ids `[n, 3]`: returns `(cos, sin)`, each `[n, head_dim]`,
/// axis by axis, each frequency repeated twice (interleaved pairs).
pub fn rope_tables(ids: &[f32], axes: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let hd: usize = axes.iter().sum();
    let n = ids.len() / axes.len().max(1);
    let freqs: Vec<Vec<f64>> = axes
        .iter()
        .map(|&d| {
            (0..d / 2)
                .map(|j| 1.0 / ROPE_THETA.powf((2 * j) as f64 / d as f64))
                .collect()
        })
        .collect();
    let mut cos = Vec::with_capacity(n * hd);
    let mut sin = Vec::with_capacity(n * hd);
    for r in 0..n {
        for (a, fs) in freqs.iter().enumerate() {
            let pos = ids[r * axes.len() + a] as f64;
            for f in fs {
                let ang = pos * f;
                let (s, c) = (ang.sin() as f32, ang.cos() as f32);
                cos.extend([c, c]);
                sin.extend([s, s]);
            }
        }
    }
    (cos, sin)
}

/// Position ids of a packed image token grid: `(0, row, col)` row-major, as
/// `FluxFillPipeline._prepare_latent_image_ids` builds them.
pub fn image_ids(rows: usize, cols: usize) -> Vec<f32> {
    let mut ids = Vec::with_capacity(rows * cols * 3);
    for r in 0..rows {
        for c in 0..cols {
            ids.extend([0.0, r as f32, c as f32]);
        }
    }
    ids
}
