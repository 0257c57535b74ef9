//! GGUF (ggml) block quantisations: the types FLUX GGUF files use and their exact
//! dequantisation.
//!
//! A quantised tensor is a sequence of blocks along its innermost dimension; a block
//! of [`QuantType::block_elems`] values takes [`QuantType::block_bytes`] bytes. Weights
//! stay in this form in memory ([`crate::Stored`], the CPU backend's quantised
//! weights); GEMMs dequantise tiles of rows on the fly.
//!
//! [`dequantize`] reproduces `gguf.quants.dequantize` (gguf-py) bit for bit: the
//! scales are f16 (or i8 for Q6_K's sub-scales) widened to f32, and each value is
//! computed with the same f32 operations in the same order, e.g. Q4_K's
//! `(d * sc) * q - (dmin * m)` (two roundings of products, one of the difference;
//! never a fused multiply-add). `runtime/tests/gguf.rs` checks every type against
//! values gguf-py wrote (`tests/fixtures/gen_gguf_types.py`).

use half::f16;

use crate::error::{Error, Result};

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

/// A ggml block quantisation denoised reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q5_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl QuantType {
    pub const ALL: [QuantType; 6] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q5_0,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
    ];

    /// The ggml type id (`enum ggml_type`, `GGMLQuantizationType`).
    pub fn ggml_type(self) -> u32 {
        match self {
            QuantType::Q4_0 => 2,
            QuantType::Q5_0 => 6,
            QuantType::Q8_0 => 8,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
        }
    }

    pub fn from_ggml_type(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|q| q.ggml_type() == id)
    }

    /// The name ggml gives the type (`Q4_K`, ...).
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q4_K => "Q4_K",
            QuantType::Q5_K => "Q5_K",
            QuantType::Q6_K => "Q6_K",
        }
    }

    /// Values per block: 32, or [`QK_K`] for the K-quants.
    pub fn block_elems(self) -> usize {
        match self {
            QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => 32,
            QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => 2 + 32,
            QuantType::Q4_0 => 2 + 16,
            QuantType::Q5_0 => 2 + 4 + 16,
            QuantType::Q4_K => 2 + 2 + 12 + QK_K / 2,
            QuantType::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            QuantType::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes of `n` values (`n` a multiple of the block size), or an error naming
    /// `what`.
    pub fn bytes_for(self, n: usize, what: &str) -> Result<usize> {
        if n % self.block_elems() != 0 {
            return Err(Error::Invalid(format!(
                "`{what}`: {n} values are not whole {} blocks of {}",
                self.name(),
                self.block_elems()
            )));
        }
        Ok(n / self.block_elems() * self.block_bytes())
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantises whole blocks: `bytes` holds `out.len() / block_elems` blocks of `ty`.
/// Panics when the lengths disagree (callers check sizes when they build a
/// [`crate::Stored`]).
pub fn dequantize(ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    assert!(
        out.len() % be == 0 && bytes.len() == out.len() / be * bb,
        "dequantize {ty}: {} bytes for {} values",
        bytes.len(),
        out.len()
    );
    for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match ty {
            QuantType::Q8_0 => block_q8_0(b, o),
            QuantType::Q4_0 => block_q4_0(b, o),
            QuantType::Q5_0 => block_q5_0(b, o),
            QuantType::Q4_K => block_q4_k(b, o),
            QuantType::Q5_K => block_q5_k(b, o),
            QuantType::Q6_K => block_q6_k(b, o),
        }
    }
}

/// [`dequantize`] into a new vector.
pub fn dequantize_vec(ty: QuantType, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / ty.block_bytes() * ty.block_elems()];
    dequantize(ty, bytes, &mut out);
    out
}

fn block_q8_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in o.iter_mut().zip(&b[2..34]) {
        *v = (q as i8) as f32 * d;
    }
}

fn block_q4_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        o[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        o[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

fn block_q5_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..32 {
        let ql = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        let h = ((qh >> j) & 1) as u8;
        o[j] = d * ((ql | (h << 4)) as i32 - 16) as f32;
    }
}

/// The 8 six-bit scales and mins of a Q4_K/Q5_K super-block (`get_scale_min`).
#[inline]
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        m[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

fn block_q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qs = &b[16..16 + QK_K / 2];
    // Sub-block s (32 values) = nibble s % 2 of the 32 bytes qs[32 * (s / 2)..].
    for s in 0..8 {
        let dl = d * sc[s] as f32;
        let ml = dmin * m[s] as f32;
        let (chunk, shift) = (&qs[32 * (s / 2)..32 * (s / 2) + 32], 4 * (s % 2));
        for (l, v) in o[32 * s..32 * s + 32].iter_mut().enumerate() {
            let q = ((chunk[l] >> shift) & 0x0F) as f32;
            *v = dl * q - ml;
        }
    }
}

fn block_q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qh = &b[16..16 + QK_K / 8];
    let qs = &b[16 + QK_K / 8..16 + QK_K / 8 + QK_K / 2];
    for s in 0..8 {
        let dl = d * sc[s] as f32;
        let ml = dmin * m[s] as f32;
        let (chunk, shift) = (&qs[32 * (s / 2)..32 * (s / 2) + 32], 4 * (s % 2));
        for (l, v) in o[32 * s..32 * s + 32].iter_mut().enumerate() {
            let ql = (chunk[l] >> shift) & 0x0F;
            let h = (qh[l] >> s) & 1;
            *v = dl * (ql | (h << 4)) as f32 - ml;
        }
    }
}

fn block_q6_k(b: &[u8], o: &mut [f32]) {
    let ql = &b[..QK_K / 2];
    let qh = &b[QK_K / 2..QK_K / 2 + QK_K / 4];
    let scales = &b[QK_K / 2 + QK_K / 4..QK_K / 2 + QK_K / 4 + QK_K / 16];
    let d = f16_at(b, QK_K / 2 + QK_K / 4 + QK_K / 16);
    for (e, v) in o.iter_mut().enumerate() {
        let (a, r) = (e / 128, e % 128);
        let low = (ql[64 * a + r % 64] >> (4 * (r / 64))) & 0x0F;
        let high = (qh[32 * a + r % 32] >> (2 * (r / 32))) & 0x03;
        let q = (low | (high << 4)) as i32 - 32;
        let dl = d * (scales[e / 16] as i8) as f32;
        *v = dl * q as f32;
    }
}

/// Pseudo-random blocks of `ty` for `n` values (a multiple of the block size), with
/// modest positive f16 scales (0.001 to 0.011) so every value is finite: inputs for
/// tests and device self-checks (gguf-py cannot quantise K-quants to make real ones).
pub fn random_blocks(ty: QuantType, n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    let (bb, nb) = (ty.block_bytes(), n / ty.block_elems());
    let mut bytes: Vec<u8> = (0..nb * bb).map(|_| next() as u8).collect();
    for blk in bytes.chunks_exact_mut(bb) {
        let mut scale = || {
            f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5)
                .to_bits()
                .to_le_bytes()
        };
        match ty {
            QuantType::Q6_K => blk[bb - 2..].copy_from_slice(&scale()),
            QuantType::Q4_K | QuantType::Q5_K => {
                blk[0..2].copy_from_slice(&scale());
                blk[2..4].copy_from_slice(&scale());
            }
            _ => blk[0..2].copy_from_slice(&scale()),
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_ids_are_ggmls() {
        let want = [
            (QuantType::Q8_0, 8, 32, 34),
            (QuantType::Q4_0, 2, 32, 18),
            (QuantType::Q5_0, 6, 32, 22),
            (QuantType::Q4_K, 12, 256, 144),
            (QuantType::Q5_K, 13, 256, 176),
            (QuantType::Q6_K, 14, 256, 210),
        ];
        for (q, id, be, bb) in want {
            assert_eq!(
                (q.ggml_type(), q.block_elems(), q.block_bytes()),
                (id, be, bb)
            );
            assert_eq!(QuantType::from_ggml_type(id), Some(q));
        }
        assert_eq!(QuantType::from_ggml_type(11), None); // Q3_K
    }

    #[test]
    fn q8_0_block_by_hand() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        for i in 0..32 {
            b[2 + i] = (i as i8 - 16) as u8;
        }
        let v = dequantize_vec(QuantType::Q8_0, &b);
        assert_eq!(v[0], -8.0);
        assert_eq!(v[31], 7.5);
    }
}
