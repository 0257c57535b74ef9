//! A template's recorded VAE pass ([`VaeTrace`]) and its tensors ([`TraceValue`]): owned
//! (recorded in this process, or read by copy), or views of a stored trace in shared
//! memory, read in place (the cache's slice of a template an edit has pinned), so a
//! worker needs no copy of a multi-GB trace it reads once per edit.

use denoised_runtime::cpu::sparse_conv::{GroupSums, Plane};
use denoised_runtime::{Error, HostSlice, Result, Tensor};

/// One tensor of a trace.
#[derive(Clone, Debug)]
pub struct TraceValue {
    shape: Vec<usize>,
    store: Store,
}

#[derive(Clone, Debug)]
enum Store {
    Owned(Vec<f32>),
    /// f32 little-endian, 4-byte aligned, exactly the tensor's bytes.
    Mapped(HostSlice),
}

impl From<Tensor> for TraceValue {
    fn from(t: Tensor) -> Self {
        TraceValue {
            shape: t.shape().to_vec(),
            store: Store::Owned(t.into_data()),
        }
    }
}

impl TraceValue {
    /// `mem` in place as a tensor of `shape`; None when it cannot be read in place (a
    /// big-endian machine, a misaligned slice), and the caller copies.
    pub(crate) fn mapped(shape: Vec<usize>, mem: HostSlice) -> Result<Option<Self>> {
        let n: usize = shape.iter().product();
        if mem.len() != 4 * n {
            return Err(Error::Invalid(format!(
                "a trace tensor of {shape:?} in {} bytes",
                mem.len()
            )));
        }
        let aligned = (mem.as_ptr() as usize) % std::mem::align_of::<f32>() == 0;
        Ok(
            (cfg!(target_endian = "little") && aligned).then_some(TraceValue {
                shape,
                store: Store::Mapped(mem),
            }),
        )
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn data(&self) -> &[f32] {
        match &self.store {
            Store::Owned(v) => v,
            // SAFETY: `mapped` checked the length and the alignment, any bits are a
            // valid f32, the bytes are little-endian f32s on a little-endian machine,
            // and the HostSlice keeps the mapping alive. Nobody writes a stored trace
            // while it is read: the cache fills a slice before it hands it out and
            // frees it only after the last edit that pinned its template.
            Store::Mapped(m) => unsafe {
                std::slice::from_raw_parts(m.as_ptr() as *const f32, m.len() / 4)
            },
        }
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy as a tensor.
    pub fn to_tensor(&self) -> Tensor {
        Tensor::new(self.shape.clone(), self.data().to_vec()).expect("a consistent shape")
    }

    /// The value of one image (`[1, C, H, W]`) as a plane.
    pub(crate) fn plane(&self) -> Result<Plane<'_>> {
        match *self.shape.as_slice() {
            [1, c, h, w] => Ok(Plane {
                base: self.data(),
                c,
                h,
                w,
                new: None,
            }),
            ref s => Err(Error::shape(
                "VAE trace",
                format!("expected one image [1, C, H, W], got {s:?}"),
            )),
        }
    }
}

/// A template's recorded VAE pass (see the module docs of `vae::sparse`).
#[derive(Clone, Debug)]
pub struct VaeTrace {
    /// Every value of the pass: its input, then each op's output.
    pub(super) values: Vec<TraceValue>,
    /// Per value, the sums of the GroupNorm input of the op producing it, if it has one.
    pub(super) sums: Vec<Option<GroupSums>>,
    /// The mid-block attention's `[pixels, K | V]`.
    pub(super) kv: Option<TraceValue>,
}

impl VaeTrace {
    /// The traced input: the template image, or the template's final latent.
    pub fn input(&self) -> &TraceValue {
        &self.values[0]
    }

    /// The pass's output: the decoded image, or the encoder's moments.
    pub fn output(&self) -> &TraceValue {
        self.values
            .last()
            .expect("a trace holds its input at least")
    }

    /// Whether it reads a stored trace in place (it then lives only as long as the
    /// template's pin: never cache it).
    pub fn is_mapped(&self) -> bool {
        self.values
            .iter()
            .any(|v| matches!(v.store, Store::Mapped(_)))
    }

    /// Bytes held, as f32.
    pub fn bytes(&self) -> usize {
        let t: usize = self.values.iter().chain(&self.kv).map(|t| t.len()).sum();
        // Sums and sums of squares, f64 per group.
        let s: usize = self.sums.iter().flatten().map(|s| s.sum.len() * 16).sum();
        t * 4 + s
    }
}
