//! Vectorisable math for the CPU backend, compiled for the best ISA at run time.
//!
//! The crate is built for baseline x86-64 so the binary runs on any server, but the hot
//! element-wise loops should use AVX-512 where the machine has it (the CI machine and
//! most GPU hosts do). [`multiversion!`] compiles one body three times (AVX-512, AVX2+FMA,
//! baseline) and picks at run time; `is_x86_feature_detected!` caches its answer.
//!
//! libm's `expf` is a scalar call that stops auto-vectorisation, and softmax alone needs
//! hundreds of millions of exponentials per Flux step, so `exp` here is a branch-free
//! Cephes-style polynomial (about 1 ulp on the range softmax uses).

/// Defines `pub fn $name(args) -> ret` whose body is compiled per ISA.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn inner($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { inner($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { inner($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the features v4 was compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above, for AVX2 and FMA.
                    return unsafe { v3($($arg),*) };
                }
            }
            inner($($arg),*)
        }
    };
}
pub(crate) use multiversion;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer, vectorised.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x` for finite x, branch-free so loops over it vectorise. Inputs below -87.3
/// return about 1e-38 instead of 0, which is harmless in softmax and sigmoid.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.3);
    // t holds round(x*log2(e)) in its low mantissa bits; reading the integer from
    // the bits (instead of a saturating `as i32`, which LLVM scalarises) keeps the
    // whole function in vector registers.
    let t = x * LOG2E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let ni = t.to_bits() as i32 - ROUND_MAGIC.to_bits() as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes 5.0000001201e-1 rounds to 0.5 in f32
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    y * scale
}

/// `x * sigmoid(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// GELU with the tanh approximation, as `gelu(approximate="tanh")`. Uses the identity
/// `0.5*(1+tanh(u)) = sigmoid(2u)`, which is exact and avoids cancellation near 0.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2/pi)
    let u = K * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp(-2.0 * u))
}

multiversion! {
    /// `dst[i] = ` the value of FP8 E4M3 byte `src[i]` (unscaled; the NaN code, which
    /// template slabs never hold, reads as 480). Branch-free integer arithmetic, so
    /// the loop vectorises: a normal byte's exponent and mantissa are an f32's shifted
    /// by 20 bits and rebiased by 120; a subnormal one is its mantissa times 2^-9.
    pub fn fp8_decode(src: &[u8], dst: &mut [f32]) {
        for (d, &b) in dst.iter_mut().zip(src) {
            let b = b as u32;
            let em = b & 0x7F;
            let normal = (em << 20) + (120 << 23);
            let sub = (em as f32 * (1.0 / 512.0)).to_bits();
            let bits = if em >= 8 { normal } else { sub };
            *d = f32::from_bits(bits | ((b & 0x80) << 24));
        }
    }
}

multiversion! {
    /// In place: `x = silu(x)`.
    pub fn silu_inplace(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = silu(*v);
        }
    }
}

multiversion! {
    /// In place: `x = gelu_tanh(x)`.
    pub fn gelu_tanh_inplace(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = gelu_tanh(*v);
        }
    }
}

multiversion! {
    /// `x[i] = exp(x[i] - m)` and returns the sum: the inner step of softmax.
    pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        // Sixteen partial sums let the reduction vectorise without reassociation flags.
        let mut acc = [0.0f32; 16];
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
                *v = exp(*v - m);
                *a += *v;
            }
        }
        let mut s: f32 = 0.0;
        for v in chunks.into_remainder() {
            *v = exp(*v - m);
            s += *v;
        }
        s + acc.iter().sum::<f32>()
    }
}

multiversion! {
    /// Maximum of a slice (`-inf` when empty).
    pub fn max(x: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c) {
                *a = a.max(*v);
            }
        }
        let mut m = f32::NEG_INFINITY;
        for v in chunks.remainder() {
            m = m.max(*v);
        }
        acc.iter().fold(m, |m, v| m.max(*v))
    }
}

multiversion! {
    /// `y += a * x`.
    pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y += a * *x;
        }
    }
}

multiversion! {
    /// `x · y` over the shorter length, in 16 lanes (a summation order of its own).
    pub fn dot(x: &[f32], y: &[f32]) -> f32 {
        let mut acc = [0f32; 16];
        let (xc, yc) = (x.chunks_exact(16), y.chunks_exact(16));
        let tail: f32 = xc
            .remainder()
            .iter()
            .zip(yc.remainder())
            .map(|(a, b)| a * b)
            .sum();
        for (a, b) in xc.zip(yc) {
            for i in 0..16 {
                acc[i] += a[i] * b[i];
            }
        }
        acc.iter().sum::<f32>() + tail
    }
}

multiversion! {
    /// `y *= a`.
    pub fn scale(y: &mut [f32], a: f32) {
        for y in y.iter_mut() {
            *y *= a;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert!(exp(-200.0) < 1e-37);
        assert!(exp(0.0) == 1.0);
    }

    #[test]
    fn dot_matches_f64_over_every_tail_length() {
        for n in [0, 1, 15, 16, 17, 100, 768] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect();
            let y: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.3).collect();
            let want: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!((dot(&x, &y) as f64 - want).abs() < 1e-4, "n = {n}");
        }
    }

    #[test]
    fn activations_match_definitions() {
        for i in -400..400 {
            let x = i as f32 * 0.037;
            let xs = x as f64;
            let silu_ref = xs / (1.0 + (-xs).exp());
            assert!((silu(x) as f64 - silu_ref).abs() < 1e-6 * (1.0 + xs.abs()));
            let u = (2.0f64 / std::f64::consts::PI).sqrt() * (xs + 0.044715 * xs.powi(3));
            let gelu_ref = 0.5 * xs * (1.0 + u.tanh());
            assert!(
                (gelu_tanh(x) as f64 - gelu_ref).abs() < 1e-6 * (1.0 + xs.abs()),
                "{x}"
            );
        }
    }

    #[test]
    fn reductions() {
        let mut v: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).sin()).collect();
        let m = max(&v);
        assert_eq!(m, v.iter().cloned().fold(f32::NEG_INFINITY, f32::max));
        let expect: f32 = v.iter().map(|x| (x - m).exp()).sum();
        let s = exp_sub_sum(&mut v, m);
        assert!((s - expect).abs() < 1e-5);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
