//! The host tensor: a contiguous row-major `f32` buffer with a shape.
//!
//! It is deliberately plain. Compute is f32 on the CPU (docs/design.md §Devices); storage
//! dtypes (bf16, f16) exist only on disk and are converted when weights load. Device
//! backends keep their own buffer types and convert through `Backend::upload`.
//!
//! One exception: a compressed template's K/V slab on the CPU is an fp8 matrix with a
//! scale per column group ([`Tensor::fp8`]), which the attention kernel reads as it
//! is (decoding in its tile loads) so that no full-size f32 copy exists. Such a tensor
//! has a shape and no f32 data; attention is the only op that takes it.

use crate::error::{Error, Result};

/// Storage dtypes a checkpoint may use (compute is always f32 on the host), `U8` for
/// raw bytes (images, encoded files) in shared-memory slices, and `F8E4M3` for
/// compressed template caches ([`crate::fp8`]: scaled per column group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    U8,
    F8E4M3,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::F8E4M3 => 1,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
    /// The fp8 form (see the module documentation), with `data` empty.
    fp8: Option<Box<Fp8Matrix>>,
}

/// A row-major fp8 matrix whose columns form `scales.len()` equal groups: element
/// `(r, c)` is `fp8::DECODE[bytes[r * cols + c]] * scales[c / (cols / groups)]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Matrix {
    pub bytes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: impl Into<Vec<usize>>, data: Vec<f32>) -> Result<Self> {
        let shape = shape.into();
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::shape(
                "Tensor::new",
                format!("shape {shape:?} needs {n} elements, got {}", data.len()),
            ));
        }
        Ok(Tensor {
            shape,
            data,
            fp8: None,
        })
    }

    pub fn zeros(shape: impl Into<Vec<usize>>) -> Self {
        let shape = shape.into();
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
            fp8: None,
        }
    }

    /// An fp8 matrix `[rows, cols]` of `bytes` with one scale per column group.
    pub fn fp8(rows: usize, cols: usize, bytes: Vec<u8>, scales: Vec<f32>) -> Result<Self> {
        crate::fp8::check_matrix("Tensor::fp8", rows, cols, bytes.len(), scales.len())?;
        Ok(Tensor {
            shape: vec![rows, cols],
            data: vec![],
            fp8: Some(Box::new(Fp8Matrix { bytes, scales })),
        })
    }

    /// The fp8 form, if this is an fp8 matrix.
    pub fn as_fp8(&self) -> Option<&Fp8Matrix> {
        self.fp8.as_deref()
    }
    pub fn as_fp8_mut(&mut self) -> Option<&mut Fp8Matrix> {
        self.fp8.as_deref_mut()
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Number of rows when viewed as a matrix `[rows, last_dim]`: the product of the
    /// leading dimensions, also for a zero-width matrix (text-to-image's empty
    /// conditioning is `[L, 0]`).
    pub fn rows(&self) -> usize {
        match self.shape.split_last() {
            Some((_, lead)) => lead.iter().product(),
            None => 1,
        }
    }
    /// The last dimension (1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    pub fn row(&self, r: usize) -> &[f32] {
        let c = self.cols();
        &self.data[r * c..(r + 1) * c]
    }

    /// The matrix of rows `rows` (in that order) of this one viewed as `[rows, cols]`.
    pub fn gather(&self, rows: &[u32]) -> Tensor {
        let c = self.cols();
        let mut data = Vec::with_capacity(rows.len() * c);
        for &r in rows {
            data.extend_from_slice(self.row(r as usize));
        }
        Tensor {
            shape: vec![rows.len(), c],
            data,
            fp8: None,
        }
    }

    pub fn reshape(mut self, shape: impl Into<Vec<usize>>) -> Result<Self> {
        let shape = shape.into();
        let n: usize = shape.iter().product();
        if n != self.data.len() {
            return Err(Error::shape(
                "reshape",
                format!("{:?} -> {shape:?}", self.shape),
            ));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Largest absolute elementwise difference; used by tests and bring-up tools.
    pub fn max_abs_diff(&self, other: &Tensor) -> Result<f32> {
        if self.shape != other.shape {
            return Err(Error::shape(
                "max_abs_diff",
                format!("{:?} vs {:?}", self.shape, other.shape),
            ));
        }
        Ok(self
            .data
            .iter()
            .zip(&other.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, |m, d| {
                if m.is_nan() || d.is_nan() {
                    f32::NAN
                } else {
                    m.max(d)
                }
            }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_the_leading_dimensions_even_at_zero_width() {
        assert_eq!(Tensor::new([3, 0], vec![]).unwrap().rows(), 3);
        assert_eq!(Tensor::new([2, 3, 4], vec![0.0; 24]).unwrap().rows(), 6);
        assert_eq!(Tensor::new([0, 5], vec![]).unwrap().rows(), 0);
    }
}
