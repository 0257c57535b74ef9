//! CPU building blocks shared by the CLIP and T5 text encoders: a bias-optional
//! Linear over `gemm`, loading helpers, and an embedding lookup that rejects bad ids
//! instead of panicking. The norms and the attention are the CPU backend's reference
//! kernels (`denoised_runtime::cpu::text`), which the Backend's text ops also run.

use denoised_runtime::cpu::matmul::{matmul, MatRef};
use denoised_runtime::{Error, Result, Tensor};

use crate::flux::weights::Source;

/// A PyTorch Linear kept in its on-disk `[out, in]` layout; `gemm` reads it as its
/// own transpose through strides, so no copy is made at load time.
pub(crate) struct Linear {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    in_f: usize,
    out_f: usize,
}

impl Linear {
    /// Loads one or more Linears that read the same input and stacks them along the
    /// output dimension (`q|k|v` become one GEMM). `names` are parameter prefixes
    /// (without `.weight`); each has `rows` outputs. Every loaded name is pushed onto
    /// `used` so the caller can reject unexpected tensors afterwards.
    pub(crate) fn load(
        src: &dyn Source,
        names: &[(&str, usize)],
        in_f: usize,
        bias: bool,
        used: &mut Vec<String>,
    ) -> Result<Self> {
        let mut w = Vec::new();
        let mut b = Vec::new();
        let mut out_f = 0;
        for &(name, rows) in names {
            let wn = format!("{name}.weight");
            w.extend_from_slice(src.get(&wn, &[rows, in_f])?.data());
            used.push(wn);
            if bias {
                let bn = format!("{name}.bias");
                b.extend_from_slice(src.get(&bn, &[rows])?.data());
                used.push(bn);
            }
            out_f += rows;
        }
        Ok(Linear {
            w,
            b: bias.then_some(b),
            in_f,
            out_f,
        })
    }

    pub(crate) fn out_features(&self) -> usize {
        self.out_f
    }

    /// The weight, `[out, in]`.
    pub(crate) fn weight(&self) -> Result<Tensor> {
        Tensor::new([self.out_f, self.in_f], self.w.clone())
    }

    /// The bias `[out]`, if the layer has one.
    pub(crate) fn bias(&self) -> Option<Result<Tensor>> {
        self.b
            .as_ref()
            .map(|b| Tensor::new([self.out_f], b.clone()))
    }

    /// `x [rows, in] -> [rows, out]`.
    pub(crate) fn forward(&self, x: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.in_f;
        let mut out = Vec::with_capacity(rows * self.out_f);
        match &self.b {
            Some(b) => (0..rows).for_each(|_| out.extend_from_slice(b)),
            None => out.resize(rows * self.out_f, 0.0),
        }
        matmul(
            rows,
            self.out_f,
            self.in_f,
            &mut out,
            self.out_f,
            MatRef::row_major(x, self.in_f),
            MatRef::transposed(&self.w, self.in_f),
            self.b.is_some(),
            true,
        );
        out
    }
}

/// Loads a parameter of any shape and records its name.
pub(crate) fn load_tensor(
    src: &dyn Source,
    name: &str,
    shape: &[usize],
    used: &mut Vec<String>,
) -> Result<Tensor> {
    let t = src.get(name, shape)?;
    used.push(name.to_string());
    Ok(t)
}

/// Loads a 1-D parameter (a norm weight or bias) and records its name.
pub(crate) fn load_vec(
    src: &dyn Source,
    name: &str,
    len: usize,
    used: &mut Vec<String>,
) -> Result<Vec<f32>> {
    let t = src.get(name, &[len])?;
    used.push(name.to_string());
    Ok(t.into_data())
}

/// Rows of `table [vocab, d]` for `ids`. An id outside the table is an input error
/// (a tokenizer/model mismatch), reported rather than panicking.
pub(crate) fn embed(table: &Tensor, ids: &[i64], what: &str) -> Result<Vec<f32>> {
    let (vocab, d) = (table.rows(), table.cols());
    let mut out = Vec::with_capacity(ids.len() * d);
    for (pos, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(Error::Invalid(format!(
                "{what}: token id {id} at position {pos} is outside the embedding table \
                 ({vocab} rows); the tokenizer does not match the model"
            )));
        }
        out.extend_from_slice(table.row(id as usize));
    }
    Ok(out)
}

pub(crate) use denoised_runtime::cpu::text::{attention, layer_norm, rms_norm, Mask, Qkv};

pub(crate) use denoised_runtime::config::read_json;
