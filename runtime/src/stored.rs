//! [`Stored`]: a tensor as a checkpoint stores it, in its own dtype, usually borrowed
//! straight from a memory-mapped safetensors file.
//!
//! Loaders hand weights to a backend in this form so that a device backend can copy
//! them as they are: bf16 weights go from the mmap to a bf16 device with no host copy
//! at all, and a conversion (f32 → bf16, say) runs in bounded chunks instead of
//! materialising an f32 copy of the whole tensor. The CPU backend computes in f32 and
//! converts with [`Stored::to_f32`].

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

#[derive(Clone, Debug)]
pub struct Stored<'a> {
    /// The tensor's name, for error messages.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Little-endian elements, as safetensors stores them.
    pub bytes: Cow<'a, [u8]>,
}

impl<'a> Stored<'a> {
    /// Borrows `bytes` of a `dtype` tensor, checking that the sizes agree.
    pub fn new(name: &str, shape: Vec<usize>, dtype: DType, bytes: &'a [u8]) -> Result<Self> {
        check_float(name, dtype)?;
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
        })
    }

    /// An f32 host tensor in stored form (generated weights, tests).
    pub fn from_tensor(name: &str, t: &Tensor) -> Stored<'static> {
        Stored {
            name: name.to_string(),
            shape: t.shape().to_vec(),
            dtype: DType::F32,
            bytes: Cow::Owned(t.data().iter().flat_map(|v| v.to_le_bytes()).collect()),
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
        Tensor::new(self.shape.clone(), to_f32(&self.bytes, self.dtype))
    }

    /// The elements in `target`'s little-endian encoding, at most `chunk` elements at
    /// a time, in order. When the dtypes agree this is the stored bytes themselves
    /// (one borrowed slice, no copy); otherwise each chunk is converted on its own.
    pub fn chunks_as(
        &self,
        target: DType,
        chunk: usize,
    ) -> Result<impl Iterator<Item = Cow<'_, [u8]>> + '_> {
        check_float(&self.name, target)?;
        let (src, same) = (self.dtype.size_bytes(), self.dtype == target);
        let step = if same {
            self.bytes.len().max(1)
        } else {
            chunk.max(1) * src
        };
        Ok(self.bytes.chunks(step).map(move |c| {
            if same {
                Cow::Borrowed(c)
            } else {
                Cow::Owned(encode(&to_f32(c, self.dtype), target))
            }
        }))
    }
}

impl<'a> Stored<'a> {
    /// Rows `r` of the first dimension: borrowed from the same buffer as `self` when
    /// that is borrowed (a mapped file), else copied.
    pub fn rows(&self, r: std::ops::Range<usize>) -> Result<Stored<'a>> {
        let rows = self.shape.first().copied().unwrap_or(0);
        if r.start > r.end || r.end > rows {
            return Err(Error::shape(
                "Stored::rows",
                format!("`{}`: rows {r:?} of {rows}", self.name),
            ));
        }
        let row_bytes = self.bytes.len() / rows.max(1);
        let mut shape = self.shape.clone();
        shape[0] = r.len();
        Ok(Stored {
            name: self.name.clone(),
            shape,
            dtype: self.dtype,
            bytes: match &self.bytes {
                Cow::Borrowed(b) => Cow::Borrowed(&b[r.start * row_bytes..r.end * row_bytes]),
                Cow::Owned(v) => Cow::Owned(v[r.start * row_bytes..r.end * row_bytes].to_vec()),
            },
        })
    }

    /// A per-tensor scale (fp8 weights only).
    pub fn with_scale(self, _scale: f32) -> Result<Self> {
        Err(Error::UnsupportedDType {
            name: self.name,
            dtype: format!("{:?} with a scale", self.dtype),
        })
    }

    /// `parts` stacked along the first dimension (one dtype), in an owned buffer.
    pub fn concat_rows(parts: &[Stored<'_>]) -> Result<Stored<'static>> {
        let first = parts
            .first()
            .ok_or_else(|| Error::Invalid("concat_rows of nothing".into()))?;
        let mut shape = first.shape.clone();
        shape[0] = 0;
        let mut bytes = Vec::new();
        for p in parts {
            if p.dtype != first.dtype || p.shape[1..] != first.shape[1..] {
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
