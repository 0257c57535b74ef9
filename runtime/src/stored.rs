//! [`Stored`]: a tensor as a checkpoint stores it, in its own dtype, usually borrowed
//! straight from a memory-mapped safetensors file.
//!
//! Loaders hand weights to a backend in this form so that a device backend can copy
//! them as they are: bf16 weights go from the mmap to a bf16 device with no host copy
//! at all, and a conversion (f32 → bf16, say) runs in bounded chunks instead of
//! materialising an f32 copy of the whole tensor. The CPU backend computes in f32 and
//! converts with [`Stored::to_f32`].
//!
//! Besides the float dtypes a `Stored` carries the two compressed forms single-file
//! checkpoints use ([`StoredFormat`]):
//! - GGUF block quantisations ([`QuantType`]; `dtype` is then [`DType::U8`] and
//!   `quant` names the type): the bytes are whole blocks along the innermost
//!   dimension, as in the GGUF file, and stay so in memory where a backend keeps
//!   quantised weights;
//! - fp8 E4M3FN ([`DType::F8E4M3`]) with a per-tensor `scale` (ComfyUI's
//!   `scale_weight`; 1 where the file has none): value = `fp8::DECODE[byte] * scale`.
//!
//! A separate `quant` field rather than a `DType` variant: `DType` is a plain
//! element type shared with shared-memory headers and templates, where a
//! block-quantised type has no per-element size and no place.

use std::borrow::Cow;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::quant::{self, QuantType};
use crate::tensor::{DType, Tensor};

#[derive(Clone, Debug)]
pub struct Stored<'a> {
    /// The tensor's name, for error messages.
    pub name: String,
    pub shape: Vec<usize>,
    /// F32, BF16, F16, F8E4M3 (scaled by `scale`), or U8 for GGUF blocks (`quant`).
    pub dtype: DType,
    /// Little-endian elements, as safetensors stores them, or GGUF blocks.
    pub bytes: Cow<'a, [u8]>,
    /// The GGUF block quantisation of `bytes` (with `dtype` U8).
    pub quant: Option<QuantType>,
    /// The per-tensor scale of an fp8 tensor (1 otherwise).
    pub scale: f32,
}

/// How a [`Stored`]'s bytes encode its values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StoredFormat {
    /// F32, BF16 or F16 elements.
    Float(DType),
    /// fp8 E4M3FN bytes times a per-tensor scale.
    Fp8 { scale: f32 },
    /// GGUF blocks.
    Quant(QuantType),
}

impl<'a> Stored<'a> {
    /// Borrows `bytes` of a `dtype` tensor (F32, BF16, F16, or F8E4M3 with scale 1:
    /// see [`Stored::with_scale`]), checking that the sizes agree.
    pub fn new(name: &str, shape: Vec<usize>, dtype: DType, bytes: &'a [u8]) -> Result<Self> {
        if dtype != DType::F8E4M3 {
            check_float(name, dtype)?;
        }
        let n: usize = shape.iter().product();
        if n * dtype.size_bytes() != bytes.len() {
            return Err(Error::shape(
                "Stored::new",
                format!("`{name}`: {shape:?} {dtype:?} is not {} bytes", bytes.len()),
            ));
        }
        Ok(Stored {
            name: name.to_string(),
            shape,
            dtype,
            bytes: Cow::Borrowed(bytes),
            quant: None,
            scale: 1.0,
        })
    }

    /// Borrows the GGUF blocks of a `ty`-quantised tensor of `shape` (PyTorch order:
    /// the innermost dimension, a multiple of the block size, last).
    pub fn quantised(
        name: &str,
        shape: Vec<usize>,
        ty: QuantType,
        bytes: &'a [u8],
    ) -> Result<Self> {
        let inner = shape.last().copied().unwrap_or(1);
        if inner % ty.block_elems() != 0 {
            return Err(Error::shape(
                "Stored::quantised",
                format!(
                    "`{name}`: {shape:?} {ty}: the inner dimension is not a multiple of the block size {}",
                    ty.block_elems()
                ),
            ));
        }
        let n: usize = shape.iter().product();
        let want = ty.bytes_for(n, name)?;
        if want != bytes.len() {
            return Err(Error::shape(
                "Stored::quantised",
                format!(
                    "`{name}`: {shape:?} {ty} is {want} bytes, not {}",
                    bytes.len()
                ),
            ));
        }
        Ok(Stored {
            name: name.to_string(),
            shape,
            dtype: DType::U8,
            bytes: Cow::Borrowed(bytes),
            quant: Some(ty),
            scale: 1.0,
        })
    }

    /// An fp8 tensor's per-tensor scale (ComfyUI's `scale_weight`): its values are
    /// `fp8::DECODE[byte] * scale`. An error for other dtypes.
    pub fn with_scale(mut self, scale: f32) -> Result<Self> {
        if !matches!(self.format(), StoredFormat::Fp8 { .. }) {
            return Err(Error::Invalid(format!(
                "`{}`: a scale applies to fp8 tensors, not {}",
                self.name,
                self.format_name()
            )));
        }
        self.scale = scale;
        Ok(self)
    }

    pub fn format(&self) -> StoredFormat {
        match (self.quant, self.dtype) {
            (Some(q), _) => StoredFormat::Quant(q),
            (None, DType::F8E4M3) => StoredFormat::Fp8 { scale: self.scale },
            (None, d) => StoredFormat::Float(d),
        }
    }

    /// `F32`, `BF16`, `F16`, `F8_E4M3` or the GGUF type's name (`Q4_K`).
    pub fn format_name(&self) -> String {
        match self.format() {
            StoredFormat::Quant(q) => q.name().to_string(),
            StoredFormat::Fp8 { .. } => "F8_E4M3".to_string(),
            StoredFormat::Float(d) => format!("{d:?}"),
        }
    }

    /// Bytes of one first-dimension row.
    pub fn row_bytes(&self) -> usize {
        match self.shape.first() {
            Some(&r) if r > 0 => self.bytes.len() / r,
            _ => 0,
        }
    }

    /// The rows `r` of the first dimension: borrowed from the same buffer as `self`
    /// when that is borrowed (a mapped file), else copied. Every row of a quantised
    /// tensor is whole blocks (its inner dimension is a multiple of the block size).
    pub fn rows(&self, r: Range<usize>) -> Result<Stored<'a>> {
        let rows =
            self.shape.first().copied().ok_or_else(|| {
                Error::shape("Stored::rows", format!("`{}` is a scalar", self.name))
            })?;
        if r.start > r.end || r.end > rows {
            return Err(Error::shape(
                "Stored::rows",
                format!("`{}`: rows {r:?} of {rows}", self.name),
            ));
        }
        let rb = self.row_bytes();
        let mut shape = self.shape.clone();
        shape[0] = r.len();
        Ok(Stored {
            name: self.name.clone(),
            shape,
            dtype: self.dtype,
            bytes: match &self.bytes {
                Cow::Borrowed(b) => Cow::Borrowed(&b[r.start * rb..r.end * rb]),
                Cow::Owned(v) => Cow::Owned(v[r.start * rb..r.end * rb].to_vec()),
            },
            quant: self.quant,
            scale: self.scale,
        })
    }

    /// An f32 host tensor in stored form (generated weights, tests).
    pub fn from_tensor(name: &str, t: &Tensor) -> Stored<'static> {
        Stored {
            name: name.to_string(),
            shape: t.shape().to_vec(),
            dtype: DType::F32,
            bytes: Cow::Owned(t.data().iter().flat_map(|v| v.to_le_bytes()).collect()),
            quant: None,
            scale: 1.0,
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as an f32 host tensor.
    pub fn to_f32(&self) -> Result<Tensor> {
        Tensor::new(self.shape.clone(), self.decode(&self.bytes))
    }

    /// Values of whole elements (blocks for a quantised tensor) of this tensor.
    fn decode(&self, bytes: &[u8]) -> Vec<f32> {
        match self.format() {
            StoredFormat::Quant(q) => quant::dequantize_vec(q, bytes),
            StoredFormat::Fp8 { scale } => bytes
                .iter()
                .map(|&b| crate::fp8::DECODE[b as usize] * scale)
                .collect(),
            StoredFormat::Float(d) => to_f32(bytes, d),
        }
    }

    /// The elements in `target`'s little-endian encoding, at most `chunk` elements at
    /// a time, in order. When the dtypes agree this is the stored bytes themselves
    /// (one borrowed slice, no copy); otherwise each chunk is converted on its own.
    /// A quantised tensor is dequantised a whole number of first-dimension rows at a
    /// time (at least one row, however long); an fp8 one element by element.
    pub fn chunks_as(
        &self,
        target: DType,
        chunk: usize,
    ) -> Result<impl Iterator<Item = Cow<'_, [u8]>> + '_> {
        check_float(&self.name, target)?;
        let same = self.format() == StoredFormat::Float(target);
        let step = if same {
            self.bytes.len().max(1)
        } else if self.quant.is_some() {
            let row_elems = self.len() / self.shape.first().copied().unwrap_or(1).max(1);
            (chunk / row_elems.max(1)).max(1) * self.row_bytes().max(1)
        } else {
            chunk.max(1) * self.dtype.size_bytes()
        };
        Ok(self.bytes.chunks(step).map(move |c| {
            if same {
                Cow::Borrowed(c)
            } else {
                Cow::Owned(encode(&self.decode(c), target))
            }
        }))
    }
}

impl Stored<'_> {
    /// `parts` stacked along the first dimension (one dtype), in an owned buffer.
    pub fn concat_rows(parts: &[Stored<'_>]) -> Result<Stored<'static>> {
        let first = parts
            .first()
            .ok_or_else(|| Error::Invalid("concat_rows of nothing".into()))?;
        let mut shape = first.shape.clone();
        shape[0] = 0;
        let mut bytes = Vec::new();
        for p in parts {
            if p.format() != first.format() || p.shape[1..] != first.shape[1..] {
                return Err(Error::shape(
                    "Stored::concat_rows",
                    format!(
                        "`{}` {:?} {:?} vs {:?} {:?}",
                        p.name, p.shape, p.dtype, first.shape, first.dtype
                    ),
                ));
            }
            shape[0] += p.shape[0];
            bytes.extend_from_slice(&p.bytes);
        }
        Ok(Stored {
            name: first.name.clone(),
            shape,
            dtype: first.dtype,
            bytes: Cow::Owned(bytes),
            quant: first.quant,
            scale: first.scale,
        })
    }
}

fn check_float(name: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => Err(Error::UnsupportedDType {
            name: name.to_string(),
            dtype: format!("{other:?}"),
        }),
    }
}

/// Little-endian `dtype` elements (a float dtype) to f32.
pub(crate) fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        DType::U8 | DType::F8E4M3 => unreachable!("checked by check_float"),
    }
}

/// f32 values in `dtype`'s little-endian encoding (round to nearest even). `dtype` is
/// a float dtype.
pub fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        DType::U8 => panic!("encode: u8 is not a float dtype"),
        DType::F8E4M3 => panic!("encode: fp8 needs scales (fp8::quantize)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_dtype_chunks_are_the_stored_bytes_themselves() {
        let bytes: Vec<u8> = [1.5f32, -2.0, 3.25]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let s = Stored::new("w", vec![3], DType::BF16, &bytes).unwrap();
        let chunks: Vec<_> = s.chunks_as(DType::BF16, 1).unwrap().collect();
        assert_eq!(chunks.len(), 1);
        assert!(matches!(&chunks[0], Cow::Borrowed(b) if b.as_ptr() == bytes.as_ptr()));
        assert_eq!(s.to_f32().unwrap().data(), &[1.5, -2.0, 3.25]);
    }

    #[test]
    fn converted_chunks_round_to_nearest_even_in_order() {
        let v: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 1.37e-3).collect();
        let t = Tensor::new([1001], v.clone()).unwrap();
        let s = Stored::from_tensor("w", &t);
        let out: Vec<u8> = s
            .chunks_as(DType::BF16, 64)
            .unwrap()
            .flat_map(|c| c.into_owned())
            .collect();
        let want: Vec<u8> = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        assert_eq!(out, want);
        assert!(Stored::new("w", vec![2], DType::F32, &[0u8; 4]).is_err());
        assert!(s.chunks_as(DType::U8, 8).is_err());
    }
}
