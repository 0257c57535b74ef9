//! FP8 E4M3 (the OCP "e4m3fn" format of Hopper's tensor cores) for compressed template
//! caches: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN
//! at `S.1111.111`, largest finite value 448.
//!
//! A template slab is quantised in groups of columns (one attention head's K, or its
//! V), each with its own scale `amax / 448`, so that every group uses the format's
//! whole range: the relative error of a value is then at most 2^-4 (half a unit in
//! the last of 3 mantissa bits), except for values so small against their group's
//! largest that they fall among the subnormals. Kernels read the bytes and fold the
//! scales into their products (`cpu::attention`), so a slab is never expanded to a
//! full-size f32 copy.

/// The largest finite E4M3 value.
pub const MAX: f32 = 448.0;

/// `DECODE[b]` is the value of byte `b` (NaN for the two NaN codes).
pub static DECODE: [f32; 256] = decode_table();

const fn decode_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let e = (b >> 3) & 0xF;
        let m = (b & 7) as f32;
        let mag = if e == 15 && (b & 7) == 7 {
            f32::NAN
        } else if e == 0 {
            m / 512.0 // m x 2^-9: the subnormals
        } else {
            // (1 + m/8) x 2^(e-7), built without powf (not const).
            let mut p = 1.0f32;
            let mut k = 7;
            while k < e {
                p *= 2.0;
                k += 1;
            }
            while k > e {
                p /= 2.0;
                k -= 1;
            }
            (1.0 + m / 8.0) * p
        };
        t[b] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
}

/// The E4M3 byte nearest to `x` (ties to even), saturating at ±448; NaN stays NaN.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    // Below the smallest normal (2^-6), values are multiples of 2^-9: round the
    // multiple to even. A result of 8 is the smallest normal's code, 0x08.
    if a < 1.0 / 64.0 {
        let q = a * 512.0;
        let f = q.floor();
        let r = q - f;
        let mut n = f as u8;
        if r > 0.5 || (r == 0.5 && n & 1 == 1) {
            n += 1;
        }
        return sign | n;
    }
    let bits = a.to_bits();
    let mut exp = ((bits >> 23) & 0xFF) as i32 - 127;
    let mant = bits & 0x7F_FFFF;
    let mut keep = mant >> 20;
    let rem = mant & 0xF_FFFF;
    if rem > 0x8_0000 || (rem == 0x8_0000 && keep & 1 == 1) {
        keep += 1;
        if keep == 8 {
            keep = 0;
            exp += 1;
        }
    }
    let e = exp + 7;
    if e > 15 || (e == 15 && keep == 7) {
        return sign | 0x7E; // 448
    }
    sign | ((e as u8) << 3) | keep as u8
}

/// Checks the sizes of an fp8 matrix: `bytes` for `rows x cols`, whose columns form
/// `groups` equal scale groups.
pub fn check_matrix(
    op: &'static str,
    rows: usize,
    cols: usize,
    bytes: usize,
    groups: usize,
) -> crate::Result<()> {
    if bytes != rows * cols || groups == 0 || cols % groups != 0 {
        return Err(crate::Error::shape(
            op,
            format!("{bytes} bytes and {groups} scale groups for [{rows}, {cols}]"),
        ));
    }
    Ok(())
}

/// The scale of values whose largest magnitude is `amax`: `amax / 448`, so the largest
/// is E4M3's largest, or 1 for zeros (and a non-finite amax).
fn scale_for(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / MAX
    } else {
        1.0
    }
}

/// Quantises a row-major `[rows, cols]` matrix whose columns form `groups` equal
/// groups, each with its own scale: returns the bytes (row-major, like the input)
/// and the scales (`amax / 448`, or 1 for a group of zeros). Value `x` of group `g`
/// is `DECODE[byte] * scales[g]`.
pub fn quantize(values: &[f32], cols: usize, groups: usize) -> (Vec<u8>, Vec<f32>) {
    assert!(
        groups > 0 && cols % groups == 0 && values.len() % cols.max(1) == 0,
        "fp8::quantize: {} values of {cols} columns in {groups} groups",
        values.len()
    );
    let w = cols / groups;
    let mut amax = vec![0.0f32; groups];
    for row in values.chunks_exact(cols) {
        for (g, part) in row.chunks_exact(w).enumerate() {
            amax[g] = part.iter().fold(amax[g], |m, v| m.max(v.abs()));
        }
    }
    let scales: Vec<f32> = amax.iter().map(|&a| scale_for(a)).collect();
    let inv: Vec<f32> = scales.iter().map(|s| 1.0 / s).collect();
    let mut bytes = Vec::with_capacity(values.len());
    for row in values.chunks_exact(cols) {
        for (g, part) in row.chunks_exact(w).enumerate() {
            bytes.extend(part.iter().map(|&v| encode(v * inv[g])));
        }
    }
    (bytes, scales)
}

/// The values `quantize` stands for: `DECODE[byte] * scale` of each element's group.
pub fn dequantize(bytes: &[u8], cols: usize, scales: &[f32]) -> Vec<f32> {
    let w = cols / scales.len().max(1);
    bytes
        .chunks_exact(cols)
        .flat_map(|row| {
            row.chunks_exact(w)
                .zip(scales)
                .flat_map(|(part, s)| part.iter().map(move |&b| DECODE[b as usize] * s))
        })
        .collect()
}

/// Quantises a row-major `[rows, cols]` matrix with a scale per row (`amax / 448`,
/// 1 for a row of zeros, as [`quantize`] does per group): the fp8 weights' format (a
/// row is an output channel of a `[out, in]` Linear weight) and the activations'
/// (a row is a token). Per-row scales make a block of rows (a Y-mode step's K|V
/// outputs) a plain offset into the bytes and the scales.
pub fn quantize_rows(values: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert!(
        cols > 0 && values.len() % cols == 0,
        "fp8::quantize_rows: {} values of {cols} columns",
        values.len()
    );
    // Rows are independent: quantised in parallel (a FLUX.1-dev transformer is 12e9
    // values, quantised once at load; one thread took minutes), each into its own
    // slice of the output, so the result is the serial one.
    use rayon::prelude::*;
    let mut bytes = vec![0u8; values.len()];
    let mut scales = vec![0f32; values.len() / cols];
    bytes
        .par_chunks_mut(cols)
        .zip(scales.par_iter_mut())
        .zip(values.par_chunks(cols))
        .for_each(|((b, s), row)| {
            let (q, sc) = quantize(row, cols, 1);
            b.copy_from_slice(&q);
            *s = sc[0];
        });
    (bytes, scales)
}

/// How fp8 weights and the activations that multiply them are scaled
/// (`[device] fp8_scaling`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scaling {
    /// A scale per output channel of a weight and per token of its input: the finer
    /// rounding, but cuBLASLt on Hopper has no GEMM that applies outer-vector scales,
    /// so a pass rescales each GEMM's raw sums (docs/gpu.md, "fp8 weights").
    #[default]
    Channel,
    /// One scale per weight matrix and one per input matrix (its amax over the block
    /// the GEMM reads, found on the device by a reduction): what cuBLASLt applies
    /// inside the GEMM, with the bias and GELU epilogues, so no pass follows it.
    Tensor,
}

impl Scaling {
    pub fn name(self) -> &'static str {
        match self {
            Scaling::Channel => "channel",
            Scaling::Tensor => "tensor",
        }
    }
    pub fn named(s: &str) -> Option<Self> {
        match s {
            "channel" => Some(Scaling::Channel),
            "tensor" => Some(Scaling::Tensor),
            _ => None,
        }
    }
    /// `values` (`[rows, cols]` row-major) rounded to E4M3 as this scaling rounds them,
    /// as f32: the CPU reference of an fp8 weight or an fp8 GEMM's input.
    pub fn round(self, values: &[f32], cols: usize) -> Vec<f32> {
        match self {
            Scaling::Channel => round_rows(values, cols),
            Scaling::Tensor => {
                let (bytes, scale) = quantize_tensor(values);
                bytes.iter().map(|&b| DECODE[b as usize] * scale).collect()
            }
        }
    }
}

/// Quantises `values` with one scale (`amax / 448`, 1 for all zeros), as
/// [`quantize`] does for one group: the per-tensor form ([`Scaling::Tensor`]).
pub fn quantize_tensor(values: &[f32]) -> (Vec<u8>, f32) {
    use rayon::prelude::*;
    let amax = values
        .par_iter()
        .fold(|| 0f32, |m, v| m.max(v.abs()))
        .reduce(|| 0f32, f32::max);
    let scale = scale_for(amax);
    let inv = 1.0 / scale;
    (values.par_iter().map(|&v| encode(v * inv)).collect(), scale)
}

/// The values [`quantize_rows`] stands for: each row rounded to E4M3 under its own
/// scale, as f32. This is the CPU reference of fp8 weights (docs/gpu.md, "fp8
/// weights"): weights and activations rounded this way, then the f32 GEMM, is what
/// the device's fp8 GEMM computes up to f32 summation order.
pub fn round_rows(values: &[f32], cols: usize) -> Vec<f32> {
    let (bytes, scales) = quantize_rows(values, cols);
    bytes
        .chunks_exact(cols)
        .zip(&scales)
        .flat_map(|(row, s)| row.iter().map(move |&b| DECODE[b as usize] * s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite value of the format, by brute force from its definition.
    fn finite() -> Vec<(u8, f32)> {
        (0..=255u8)
            .filter(|b| b & 0x7F != 0x7F)
            .map(|b| {
                let (e, m) = ((b >> 3) & 0xF, (b & 7) as f64);
                let mag = if e == 0 {
                    m * 2f64.powi(-9)
                } else {
                    (1.0 + m / 8.0) * 2f64.powi(e as i32 - 7)
                };
                (b, if b & 0x80 != 0 { -mag } else { mag } as f32)
            })
            .collect()
    }

    #[test]
    fn decode_table_matches_the_definition() {
        for (b, v) in finite() {
            assert_eq!(DECODE[b as usize].to_bits(), v.to_bits(), "byte {b:#04x}");
        }
        assert!(DECODE[0x7F].is_nan() && DECODE[0xFF].is_nan());
        assert_eq!(DECODE[0x7E], MAX);
    }

    #[test]
    fn the_vectorised_decode_equals_the_table() {
        let bytes: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
        let mut out = vec![0.0; bytes.len()];
        crate::cpu::simd::fp8_decode(&bytes, &mut out);
        for (b, v) in bytes.iter().zip(&out) {
            assert_eq!(v.to_bits(), DECODE[*b as usize].to_bits(), "byte {b:#04x}");
        }
    }

    #[test]
    fn encode_is_the_nearest_value_ties_to_even() {
        let all = finite();
        // Every code round-trips (the negative zero code keeps its sign).
        for &(b, v) in &all {
            assert_eq!(encode(v), b, "value {v}");
        }
        // Random values, midpoints and values beyond the range against brute force.
        let mut x = 0x2545_f491u32;
        let mut probes: Vec<f32> = (0..20000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let u = x as f32 / u32::MAX as f32;
                (u - 0.5) * 2.0 * 2f32.powi((x % 24) as i32 - 12)
            })
            .collect();
        for w in all.windows(2) {
            probes.push((w[0].1 + w[1].1) / 2.0);
        }
        probes.extend([500.0, -1e9, 448.0, 463.9, 1e-12]);
        for p in probes {
            let got = DECODE[encode(p) as usize];
            let clamped = p.clamp(-MAX, MAX);
            let best = all
                .iter()
                .map(|&(_, v)| v)
                .min_by(|a, b| (a - clamped).abs().total_cmp(&(b - clamped).abs()))
                .unwrap();
            let (dg, db) = ((got - clamped).abs(), (best - clamped).abs());
            assert!(dg <= db, "{p}: encoded to {got}, nearest is {best}");
            if dg == db && got != best && got != -best {
                // A tie: the even mantissa wins.
                assert_eq!(encode(p) & 1, 0, "{p}: tie not to even ({got} vs {best})");
            }
        }
        assert_eq!(encode(f32::NAN), 0x7F);
    }

    #[test]
    fn quantize_per_group_bounds_the_relative_error() {
        // Two groups of very different magnitude: each gets its own scale.
        let cols = 8;
        let vals: Vec<f32> = (0..64)
            .map(|i| {
                let g = (i % cols) / 4;
                let v = ((i * 37 % 29) as f32 - 14.0) / 7.0;
                if g == 0 {
                    v * 1e-3
                } else {
                    v * 50.0
                }
            })
            .collect();
        let (bytes, scales) = quantize(&vals, cols, 2);
        assert_eq!((bytes.len(), scales.len()), (64, 2));
        let back = dequantize(&bytes, cols, &scales);
        for (g, s) in scales.iter().enumerate() {
            let amax = vals
                .iter()
                .enumerate()
                .filter(|(i, _)| (i % cols) / 4 == g)
                .fold(0.0f32, |m, (_, v)| m.max(v.abs()));
            assert_eq!(*s, amax / MAX);
        }
        for (v, b) in vals.iter().zip(&back) {
            // Normal range: within half a unit in the last place (2^-4 relative).
            assert!((v - b).abs() <= v.abs() / 16.0 + 1e-12, "{v} -> {b}");
        }
        let (zb, zs) = quantize(&[0.0; 8], 8, 2);
        assert_eq!((zb, zs), (vec![0; 8], vec![1.0, 1.0]));
    }

    #[test]
    fn rows_have_their_own_scales() {
        let vals = [1.0, -2.0, 0.5, 0.001, 0.002, -0.004, 0.0, 0.0, 0.0];
        let (bytes, scales) = quantize_rows(&vals, 3);
        assert_eq!(scales, vec![2.0 / MAX, 0.004 / MAX, 1.0]);
        assert_eq!(bytes[1], 0xFE, "the row's largest magnitude is -448");
        let back = round_rows(&vals, 3);
        for (v, b) in vals.iter().zip(&back) {
            assert!((v - b).abs() <= v.abs() / 16.0, "{v} -> {b}");
        }
        assert_eq!(&back[6..], &[0.0; 3]);
    }
}
