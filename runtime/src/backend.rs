//! The Backend trait: every numerical operation the models need, and nothing else.
//!
//! Model code (`denoised-models`) is written once against this trait. The CPU backend
//! is the reference; the CUDA backend must agree with it op by op (docs/design.md §Devices).
//!
//! The ops are shaped for the *ragged* batch from the start: rows of many requests are
//! packed into one matrix, adaLN modulation picks its row through a per-row segment
//! index, and attention runs per sequence with keys and values that may come from
//! several buffers (fresh rows and cached rows addressed by index). A plain batch is
//! just the special case where every request has the same length.

use std::ops::Range;
use std::sync::Arc;

use crate::cpu::sparse_conv::PreAct;
use crate::error::{Error, Result};
use crate::host::{HostMemory, HostSlice};
use crate::stored::Stored;
use crate::tensor::{DType, Tensor};

/// Which rows of a key/value buffer a sequence attends to.
#[derive(Clone, Debug)]
pub enum Rows<'a> {
    Range(Range<usize>),
    /// Arbitrary rows by index: how cached K/V of inactive tokens are read without
    /// first copying them into a contiguous buffer.
    Index(&'a [u32]),
}

impl Rows<'_> {
    pub fn len(&self) -> usize {
        match self {
            Rows::Range(r) => r.len(),
            Rows::Index(i) => i.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    #[inline]
    pub fn get(&self, i: usize) -> usize {
        match self {
            Rows::Range(r) => r.start + i,
            Rows::Index(idx) => idx[i] as usize,
        }
    }
}

/// A buffer that attention reads: one of the mutable buffers passed to the call
/// (`Own(i)`, whose query columns are also overwritten by the output), or any other
/// tensor (`Ext`, e.g. a template's cached K/V).
#[derive(Clone, Copy, Debug)]
pub enum Src<'a, T> {
    Own(usize),
    Ext(&'a T),
}

/// Keys and values for one slice of a sequence: rows `rows` of `src`, keys in columns
/// `k_col..k_col+width` and values in `v_col..v_col+width`.
#[derive(Clone, Debug)]
pub struct KvSource<'a, T> {
    pub src: Src<'a, T>,
    pub k_col: usize,
    pub v_col: usize,
    pub rows: Rows<'a>,
}

/// Query rows `rows` of buffer `buf`.
#[derive(Clone, Debug)]
pub struct QSpan {
    pub buf: usize,
    pub rows: Range<usize>,
}

/// One attention sequence: its query rows (possibly in several buffers, e.g. the text
/// and image streams of a double block) and the key/value slices it attends to. Key
/// order does not matter to attention, so sources can be listed in any order.
#[derive(Clone, Debug)]
pub struct AttnSeq<'a, T> {
    pub q: Vec<QSpan>,
    pub kv: Vec<KvSource<'a, T>>,
}

/// Per-row modulation: row `r` of the target uses row `seg[r]` of `table`, columns
/// `chunk*width .. (chunk+1)*width`. `table` is the `[segments, k*width]` output of an
/// adaLN linear layer, so chunks are read in place.
#[derive(Clone, Copy, Debug)]
pub struct Modulation<'a, T> {
    pub table: &'a T,
    pub chunk: usize,
    pub seg: &'a [u32],
}

/// A running measurement of device work ([`Backend::device_timer`]).
pub trait DeviceTimer: Send {
    /// Marks the end of the timed work, waits until the device has done it, and
    /// returns the seconds it took on the device. An error in that work (a kernel
    /// fault) surfaces here, so it is attributed to what was timed.
    fn stop(self: Box<Self>) -> Result<f64>;
}

/// Columns `cols` of a fused projection, whole heads, that
/// [`Backend::rms_norm_rope`] normalises with `weight` (`[head_dim]`).
#[derive(Clone, Debug)]
pub struct HeadNorm<'a, T> {
    pub cols: Range<usize>,
    pub weight: &'a T,
}

/// Numerical backend. `Tensor` is the backend's own buffer type; the model never looks
/// inside it except through these methods.
pub trait Backend: Send + Sync {
    type Tensor: Send + Sync;
    /// A Linear layer's weight, in whatever layout the backend multiplies fastest.
    type Weight: Send + Sync;

    /// Short human-readable name, e.g. `cpu (2 threads, avx512)`.
    fn name(&self) -> String;

    fn upload(&self, t: &Tensor) -> Result<Self::Tensor>;
    /// Takes a Linear weight in PyTorch layout `[out, in]`.
    fn upload_weight(&self, w: &Tensor) -> Result<Self::Weight>;
    fn download(&self, t: &Self::Tensor) -> Result<Tensor>;

    /// Uploads the stack of `parts` along their first dimension (one part, or the
    /// projections a fused layer concatenates), each in its stored dtype. Device
    /// backends copy every part into place and convert only when the stored dtype is
    /// not the device's, so a bf16 checkpoint reaches a bf16 device with no host copy.
    /// The default, for backends that compute in f32 on the host, converts.
    fn upload_stored(&self, parts: &[Stored<'_>]) -> Result<Self::Tensor> {
        self.upload(&stack_f32(parts)?)
    }
    /// [`Backend::upload_stored`] for a Linear weight (`[out, in]` parts).
    /// The parts may be GGUF-quantised or fp8 ([`crate::StoredFormat`]): backends
    /// that keep such weights compressed override this; the default dequantises.
    fn upload_weight_stored(&self, parts: &[Stored<'_>]) -> Result<Self::Weight> {
        self.upload_weight(&stack_f32(parts)?)
    }

    /// Bytes a weight occupies on this backend (quantised blocks, fp8 bytes and
    /// scales, or its dense values), for memory reports. The default downloads it
    /// and counts f32 values: backends override it with what they hold.
    fn weight_bytes(&self, w: &Self::Weight) -> u64 {
        self.download_weight(w)
            .map(|t| 4 * t.len() as u64)
            .unwrap_or(0)
    }

    /// The form a weight is held in, for memory reports: `f32`, `bf16`, `fp8`, or a
    /// GGUF type's name (`Q4_K`) for a weight kept quantised.
    fn weight_form(&self, _w: &Self::Weight) -> &'static str {
        "f32"
    }

    /// The dtype of this backend's dense tensors (activations, biases, norms).
    fn dense_dtype(&self) -> crate::DType {
        crate::DType::F32
    }

    /// Whether the transformer's large Linear weights go to this backend as fp8
    /// E4M3 ([`Backend::upload_weight_fp8`]): `[device] weight_dtype = "fp8"`. The
    /// model asks, site by site, and uploads the others as usual.
    fn fp8_weights(&self) -> bool {
        false
    }
    /// [`Backend::upload_weight_stored`], quantised to fp8 E4M3 with a scale per
    /// output channel (`crate::fp8::quantize_rows`); `linear` on such a weight
    /// quantises its input per row with the same rule. Where there are fp8 tensor
    /// cores this halves the weights' bytes and runs fp8 GEMMs; the CPU computes the
    /// reference (the same rounding, then its f32 GEMM).
    fn upload_weight_fp8(&self, _parts: &[Stored<'_>]) -> Result<Self::Weight> {
        Err(crate::Error::Invalid(format!(
            "{} has no fp8 weights",
            self.name()
        )))
    }

    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];

    /// `x[n,k] @ w[o,k]^T + b[o]` (PyTorch Linear layout).
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor> {
        let k = self.shape(x).last().copied().unwrap_or(0);
        self.linear_cols(x, 0..k, w, b)
    }

    /// Linear over the column block `cols` of `x` (a view, not a copy): how fused
    /// projections feed the next layer without splitting buffers.
    fn linear_cols(
        &self,
        x: &Self::Tensor,
        cols: Range<usize>,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;

    /// Linear computing only the output features `outs` (a row block of the `[out,
    /// in]` weight and of the bias): how a Y-mode template step recomputes only the K
    /// and V columns of a fused projection for the tokens it does not compute
    /// (docs/design.md §Planner), at a fraction of the whole projection's cost.
    fn linear_out(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
        outs: Range<usize>,
    ) -> Result<Self::Tensor>;

    /// `linear(x, w, b)` with GELU (tanh) over its output columns `gelu_from..`: the
    /// first half of a FeedForward (`gelu_from` 0), or a fused projection whose tail is
    /// one (the single block's `[q | k | v | mlp]`). Device backends fuse the GELU into
    /// the GEMM's epilogue (a second GEMM for the columns before `gelu_from`, into the
    /// same output) instead of a second pass over the (4x wide) hidden activations.
    fn linear_gelu(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
        gelu_from: usize,
    ) -> Result<Self::Tensor> {
        let mut h = self.linear(x, w, b)?;
        let width = self.shape(&h).last().copied().unwrap_or(0);
        self.gelu_tanh(&mut h, gelu_from.min(width)..width)?;
        Ok(h)
    }

    /// LayerNorm without affine (eps given), then `x*(1+scale)+shift` per row segment.
    fn layer_norm_modulate(
        &self,
        x: &Self::Tensor,
        eps: f32,
        shift: Modulation<'_, Self::Tensor>,
        scale: Modulation<'_, Self::Tensor>,
    ) -> Result<Self::Tensor>;

    /// `x += gate[seg] * y` ([`gated_residual`](Self::gated_residual)), then the
    /// [`layer_norm_modulate`](Self::layer_norm_modulate) of the updated `x`: the
    /// adaLN-Zero residual and the next norm of the same rows, one pass on a device.
    fn residual_layer_norm_modulate(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        gate: Modulation<'_, Self::Tensor>,
        eps: f32,
        shift: Modulation<'_, Self::Tensor>,
        scale: Modulation<'_, Self::Tensor>,
    ) -> Result<Self::Tensor> {
        self.gated_residual(x, y, gate)?;
        self.layer_norm_modulate(x, eps, shift, scale)
    }

    /// Per-head RMSNorm over column ranges of `x` (q and k of a fused projection), each
    /// with its learned `[head_dim]` weight, in place, optionally followed by
    /// interleaved RoPE with per-row `cos`/`sin` tables `[rows, head_dim]`. Device
    /// backends do all the ranges in one launch.
    fn rms_norm_rope(
        &self,
        x: &mut Self::Tensor,
        heads: &[HeadNorm<'_, Self::Tensor>],
        eps: f32,
        rope: Option<(&Self::Tensor, &Self::Tensor)>,
    ) -> Result<()>;

    /// Multi-head softmax attention with scale `1/sqrt(head_dim)` and no mask.
    /// Queries are columns `q_col..q_col+width` of the buffers in `bufs`; each
    /// sequence's output overwrites its queries in place (every consumer of attention
    /// reads the output next, and this saves a buffer and a copy per block).
    fn attention(
        &self,
        bufs: &mut [&mut Self::Tensor],
        q_col: usize,
        width: usize,
        heads: usize,
        seqs: &[AttnSeq<'_, Self::Tensor>],
    ) -> Result<()>;

    /// `x += y`, same shapes.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// GELU (tanh approximation) in place over columns `cols`.
    fn gelu_tanh(&self, x: &mut Self::Tensor, cols: Range<usize>) -> Result<()>;
    fn silu(&self, x: &Self::Tensor) -> Result<Self::Tensor>;

    /// `x += gate[seg] * y`: the adaLN-Zero gated residual.
    fn gated_residual(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        gate: Modulation<'_, Self::Tensor>,
    ) -> Result<()>;

    /// Builds a matrix from rows of several sources: row `i` of the result is row
    /// `index[i].1` of `srcs[index[i].0]`. All sources have the same width.
    fn gather_rows(&self, srcs: &[&Self::Tensor], index: &[(u32, u32)]) -> Result<Self::Tensor>;

    /// Whether `e` (returned by this backend) leaves the device unusable: a sticky
    /// CUDA error (an illegal address, a failed launch) poisons the whole context, so
    /// the process owning it must end and be restarted. The CPU has none.
    fn is_fatal(&self, _e: &crate::Error) -> bool {
        false
    }

    /// Device memory in use now (every allocation of this backend's device context),
    /// where the backend has a device; `None` on the host.
    fn memory_in_use(&self) -> Option<u64> {
        None
    }

    /// Waits until all queued work has finished. Device backends queue kernels
    /// asynchronously; benchmarks call this before reading a clock. The CPU backend
    /// computes synchronously, so the default does nothing.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Starts timing the work queued from now on with the device's own clock (CUDA
    /// events on a GPU), where the work runs asynchronously to the caller; `None`
    /// where each call has finished its work when it returns (the CPU), so the host
    /// clock already measures it.
    fn device_timer(&self) -> Result<Option<Box<dyn DeviceTimer>>> {
        Ok(None)
    }

    /// `x[..n, cols] += alpha * v[v_rows, :]` with `n = v_rows.len()` (at most `x`'s
    /// rows), computed in f32 and stored in `x`'s type: a request's Euler update on the
    /// device its latents live on (`v_rows` is the request's window of a batch's packed
    /// velocity). Rows of `x` after the first `n` are left as they are: a Kontext
    /// request's reference tokens, which the transformer sees but the step does not move.
    fn axpy_cols(
        &self,
        x: &mut Self::Tensor,
        cols: Range<usize>,
        v: &Self::Tensor,
        v_rows: Range<usize>,
        alpha: f32,
    ) -> Result<()>;

    /// `y[rows, cols] += alpha * d`, `d` being `[rows.len(), cols.len()]`: how one
    /// request's LoRA delta lands on its rows of a batch's Linear output (unmerged
    /// adapters, docs/design.md §Adapters).
    fn add_block(
        &self,
        y: &mut Self::Tensor,
        rows: Range<usize>,
        cols: Range<usize>,
        d: &Self::Tensor,
        alpha: f32,
    ) -> Result<()>;

    /// The host copy of a Linear weight in PyTorch layout `[out, in]`: how a merged
    /// adapter's restore is checked bit for bit against the base.
    fn download_weight(&self, w: &Self::Weight) -> Result<Tensor>;

    /// Makes `mem` a source and target of asynchronous copies: a GPU page-locks the
    /// whole region once (later calls for it do nothing), so template slabs stream
    /// from it and captures store into it at link speed with no staging copy. Host
    /// backends read host memory in place and need nothing.
    fn pin_host(&self, _mem: &Arc<dyn HostMemory>) -> Result<()> {
        Ok(())
    }

    /// Copies `t` into `dst` in `dtype` (a template's storage dtype). A device queues
    /// the copy on its copy stream behind the work queued so far and returns at once;
    /// `dst` must not be read before [`flush_stores`](Self::flush_stores). The default
    /// downloads and converts.
    fn store(&self, t: &Self::Tensor, dst: &HostSlice, dtype: DType) -> Result<()> {
        let bytes = crate::stored::encode(self.download(t)?.data(), dtype);
        write_host(dst, &bytes)
    }

    /// Waits until every [`store`](Self::store) has landed in host memory.
    fn flush_stores(&self) -> Result<()> {
        Ok(())
    }

    /// A provider that streams the slabs of a template out of host memory while the
    /// model computes: `steps * blocks` slabs of form `slab`, step-major, at `src`,
    /// with `lanes` pairs of device buffers (the most distinct steps of the template
    /// one forward reads). `None` where the backend has no such path.
    fn stream_slabs(
        &self,
        _src: &HostSlice,
        _slab: &SlabShape,
        _steps: usize,
        _blocks: usize,
        _lanes: usize,
    ) -> Result<Option<Box<dyn SlabProvider<Self::Tensor>>>> {
        Ok(None)
    }

    /// An fp8 slab (`rows x cols` bytes, a scale per column group) in the form the
    /// attention kernel reads as a K/V source. `None` where the backend has no fp8
    /// attention yet.
    fn upload_fp8(
        &self,
        _rows: usize,
        _cols: usize,
        _bytes: &[u8],
        _scales: &[f32],
    ) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// Stores `t` (`[rows, cols]`) into `dst` as fp8 with a scale per column group:
    /// the bytes, then the `groups` f32 scales (a compressed template's slab, see
    /// [`SlabShape`]). The default quantises on the host.
    fn store_fp8(&self, t: &Self::Tensor, dst: &HostSlice, groups: usize) -> Result<()> {
        let v = self.download(t)?;
        let (bytes, scales) = crate::fp8::quantize(v.data(), v.cols(), groups);
        let mut out = bytes;
        out.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
        write_host(dst, &out)
    }

    // Image ops: the VAE's. An image tensor is `[B, C, H, W]` to `shape`, but its
    // memory layout is the backend's own (NCHW on the CPU, NHWC on a GPU, where a
    // convolution is one GEMM over pixel rows), so images enter and leave through
    // these, and only elementwise ops (`add`, `silu`) mix them with the others.

    /// An NCHW host image as this backend's image tensor.
    fn upload_image(&self, t: &Tensor) -> Result<Self::Tensor> {
        self.upload(t)
    }
    /// The NCHW host copy of an image tensor.
    fn download_image(&self, t: &Self::Tensor) -> Result<Tensor> {
        self.download(t)
    }
    /// A convolution weight `[O, I, kh, kw]` in the form [`conv2d`](Self::conv2d)
    /// reads.
    fn upload_conv(&self, w: &Tensor) -> Result<Self::Tensor> {
        self.upload(w)
    }
    /// `conv(x, w) + b`, plus `add` (a residual of the output's shape) when given, with
    /// the stride, padding and fused nearest 2x upsampling of `opts`.
    fn conv2d(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        opts: Conv2dOpts,
        add: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// GroupNorm of each image over `groups` channel groups, with the affine
    /// `weight`/`bias` `[C]`, then SiLU when `silu`.
    fn group_norm(
        &self,
        x: &Self::Tensor,
        groups: usize,
        weight: &Self::Tensor,
        bias: &Self::Tensor,
        eps: f32,
        silu: bool,
    ) -> Result<Self::Tensor>;
    /// The VAE mid block's attention: `x + out(softmax(q kᵀ / sqrt(C)) v)` over the
    /// pixels of each image, one head of width C, with `[q | k | v]` the Linear `qkv`
    /// (`[3C, C]`) of `normed` (x's GroupNorm) per pixel.
    fn image_attention(
        &self,
        x: &Self::Tensor,
        normed: &Self::Tensor,
        qkv: &Self::Weight,
        qkv_b: &Self::Tensor,
        out: &Self::Weight,
        out_b: &Self::Tensor,
    ) -> Result<Self::Tensor>;

    // The sparse VAE's ops on a device (SIGE; `denoised_models::vae::sparse`): a layer
    // of an edit's pass recomputed only at listed pixels (indices into its output
    // plane, batch 1) on top of the template's value of that layer. The CPU runs its
    // own tile-based pass (`cpu::sparse_conv`, the reference these are checked
    // against), so a backend without them says so.

    /// `base` (`[1, O, OH, OW]`, the template's output of this layer) with `pixels`
    /// recomputed as `conv(pre(x), w) + b (+ add)`: `pre` is a GroupNorm with its
    /// statistics folded in (`x * scale[c] + shift[c]`, then SiLU when asked), applied
    /// inside the image and not to the convolution's zero padding.
    #[allow(clippy::too_many_arguments)]
    fn sparse_conv2d(
        &self,
        _x: &Self::Tensor,
        _w: &Self::Tensor,
        _b: &Self::Tensor,
        _opts: Conv2dOpts,
        _pre: Option<PreAct<'_>>,
        _add: Option<&Self::Tensor>,
        _base: &Self::Tensor,
        _pixels: &[u32],
    ) -> Result<Self::Tensor> {
        Err(no_sparse_vae(&self.name()))
    }
    /// `base` with `src`'s values (same shape) at `pixels`.
    fn put_pixels(
        &self,
        _base: &Self::Tensor,
        _src: &Self::Tensor,
        _pixels: &[u32],
    ) -> Result<Self::Tensor> {
        Err(no_sparse_vae(&self.name()))
    }
    /// `pre(x)` at every pixel: a GroupNorm with given statistics (see
    /// [`sparse_conv2d`](Self::sparse_conv2d)).
    fn channel_affine(&self, _x: &Self::Tensor, _pre: PreAct<'_>) -> Result<Self::Tensor> {
        Err(no_sparse_vae(&self.name()))
    }
    /// How a GroupNorm's per-group sums move when `old`'s values at `pixels` become
    /// `new`'s (images of one shape): `(Σ (new - old), Σ (new² - old²))` per group.
    fn group_sum_deltas(
        &self,
        _new: &Self::Tensor,
        _old: &Self::Tensor,
        _pixels: &[u32],
        _groups: usize,
    ) -> Result<Vec<(f64, f64)>> {
        Err(no_sparse_vae(&self.name()))
    }

    // Text-encoder ops (T5, CLIP): the rows of a matrix are the tokens of one prompt.

    /// LayerNorm of each row with affine `weight` and `bias` `[width]` (CLIP).
    fn layer_norm_affine(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: &Self::Tensor,
        eps: f64,
    ) -> Result<Self::Tensor>;
    /// RMSNorm of each row with `weight` `[width]`: `w * x / sqrt(mean(x²) + eps)` (T5).
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f64) -> Result<Self::Tensor>;
    /// T5's gated-GELU of the fused `[rows, 2f]` `wi_0 | wi_1` output: `gelu_tanh(left) *
    /// right`, `[rows, f]`.
    fn gated_gelu(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// CLIP's quick_gelu, `x * sigmoid(1.702 x)`, in place.
    fn quick_gelu(&self, x: &mut Self::Tensor) -> Result<()>;
    /// `softmax(scale · q kᵀ + mask) v` per head over one sequence, from the fused
    /// `[len, 3 * heads * head_dim]` `q | k | v` rows; `[len, heads * head_dim]`, heads
    /// side by side.
    fn text_attention(
        &self,
        qkv: &Self::Tensor,
        heads: usize,
        head_dim: usize,
        scale: f32,
        mask: TextMask<'_, Self::Tensor>,
    ) -> Result<Self::Tensor>;

    /// Builds a matrix from rows `rows` of column block `cols` of `x` (used to take
    /// K/V out of fused projections for the template cache).
    fn gather_cols(
        &self,
        x: &Self::Tensor,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Self::Tensor>;
}

/// How a text encoder's attention scores are adjusted before the softmax.
#[derive(Clone, Copy, Debug)]
pub enum TextMask<'a, T> {
    /// CLIP: token i sees tokens 0..=i.
    Causal,
    /// T5: an additive `[heads * len, len]` bias (its relative position bias).
    Bias(&'a T),
}

/// Geometry of a 2-D convolution ([`Backend::conv2d`]; the kernel size is the
/// weight's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOpts {
    /// Stride in both directions (at least 1).
    pub stride: usize,
    /// Zero padding `[top, bottom, left, right]`, applied after upsampling.
    pub pad: [usize; 4],
    /// Upsample the input 2x (nearest neighbour) before the convolution, as diffusers'
    /// `Upsample2D` does with `F.interpolate(scale_factor=2, mode="nearest")`.
    pub upsample2x: bool,
}

impl Conv2dOpts {
    /// Stride 1 and symmetric padding `k/2`: output size = input size for odd `k`.
    pub fn same(k: usize) -> Self {
        let p = k / 2;
        Conv2dOpts {
            stride: 1,
            pad: [p; 4],
            upsample2x: false,
        }
    }
}

/// The form of one template slab in host memory: `rows x cols` elements of `dtype`,
/// then, for fp8, one little-endian f32 scale per column group (`groups`; a slab is
/// self-contained, so it streams and is checksummed as one piece).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabShape {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub groups: usize,
}

impl SlabShape {
    /// Bytes of the elements.
    pub fn data_bytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size_bytes()
    }
    /// Bytes of the whole slab.
    pub fn bytes(&self) -> usize {
        self.data_bytes()
            + match self.dtype {
                DType::F8E4M3 => 4 * self.groups,
                _ => 0,
            }
    }
    /// The scales of an fp8 slab's `bytes`.
    pub fn scales(&self, bytes: &[u8]) -> Vec<f32> {
        bytes[self.data_bytes()..self.bytes()]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect()
    }
}

/// The shape of `parts` stacked along their first dimension, checking that the other
/// dimensions agree.
pub fn stacked_shape(parts: &[Stored<'_>]) -> Result<Vec<usize>> {
    let first = parts
        .first()
        .ok_or_else(|| crate::Error::shape("upload_stored", "no parts"))?;
    let mut shape = first.shape.clone();
    if shape.is_empty() {
        return Err(crate::Error::shape("upload_stored", "a scalar part"));
    }
    shape[0] = 0;
    for p in parts {
        if p.shape.len() != shape.len() || p.shape[1..] != shape[1..] {
            return Err(crate::Error::shape(
                "upload_stored",
                format!(
                    "`{}` {:?} does not stack on {:?}",
                    p.name, p.shape, first.shape
                ),
            ));
        }
        shape[0] += p.shape[0];
    }
    Ok(shape)
}

/// Copies `bytes` into the writable host slice `dst` of the same length.
pub fn write_host(dst: &HostSlice, bytes: &[u8]) -> Result<()> {
    if !dst.writable() || dst.len() != bytes.len() {
        return Err(crate::Error::Invalid(format!(
            "storing {} bytes into a {} host slice of {} bytes",
            bytes.len(),
            if dst.writable() {
                "writable"
            } else {
                "read-only"
            },
            dst.len()
        )));
    }
    // SAFETY: writable and of the right length; the store contract makes the caller
    // the slice's only user until its stores are flushed.
    unsafe { dst.bytes_mut() }.copy_from_slice(bytes);
    Ok(())
}

/// `parts` stacked as one f32 host tensor.
pub(crate) fn stack_f32(parts: &[Stored<'_>]) -> Result<Tensor> {
    let shape = stacked_shape(parts)?;
    let mut data = Vec::with_capacity(shape.iter().product());
    for p in parts {
        data.extend_from_slice(p.to_f32()?.data());
    }
    Tensor::new(shape, data)
}

/// The cached K/V slabs of one template as tensors of a backend, by (step, block).
///
/// A device backend implements it to stream a template in while the model computes
/// (`denoised_cuda::StreamedTemplate`). Within one forward, the model asks for the
/// slabs of a step in the order `prepare` listed them, each after the previous
/// block's work has been queued: that is what lets a provider reuse a buffer as soon
/// as the next slab is asked for.
pub trait SlabProvider<T>: Send + Sync {
    /// Called before each forward that reads `step`: `slabs` are the blocks whose
    /// slabs it will ask for, strictly ascending (a plan may compute any block in full
    /// and skip its slab, docs/design.md §Planner). Only these are loaded.
    fn prepare(&self, step: usize, slabs: &[usize]) -> Result<()>;
    /// The slab of `block` at `step` (`[L, 2*hidden]` of `[K | V]`, or a Y-mode
    /// template's `[L, hidden]` block output). Asking for a block that
    /// `prepare` did not list, or out of the list's order, is an error.
    fn slab(&self, step: usize, block: usize) -> Result<&T>;
    /// Called once the forward's work is queued: its slabs are not asked for again.
    fn finish(&self) {}
    /// The time compute waited for slabs since the last call (the bubble), where the
    /// provider can tell: a loader thread measures its consumer's waits; a GPU copy
    /// stream's waits happen on the device, unseen by the host (`None`).
    fn take_wait(&self) -> Option<std::time::Duration> {
        None
    }
}

/// Checks a [`SlabProvider::prepare`] list against a template of `blocks` blocks.
/// Providers find a slab's buffer by its position in the list and tell an out-of-order
/// ask by comparing positions, which is only sound when each block appears once, in
/// order.
pub fn check_slab_list(slabs: &[usize], blocks: usize) -> Result<()> {
    let ascending = slabs.windows(2).all(|w| w[0] < w[1]);
    if !ascending || slabs.last().is_some_and(|&b| b >= blocks) {
        return Err(crate::Error::Invalid(format!(
            "slabs {slabs:?} are not strictly ascending blocks of a {blocks}-block template"
        )));
    }
    Ok(())
}

/// The list position a provider's `slab(step, block)` enters, given the prepared list
/// `slabs` and the position compute is at: the next one, which must hold `block`.
pub fn next_slab_position(
    slabs: &[usize],
    at: Option<usize>,
    step: usize,
    block: usize,
) -> Result<usize> {
    let p = at.map_or(0, |a| a + 1);
    if slabs.get(p) == Some(&block) {
        return Ok(p);
    }
    let why = if slabs.binary_search(&block).is_ok() {
        "asked out of order"
    } else {
        "not prepared"
    };
    Err(crate::Error::Invalid(format!(
        "block {block} of step {step} {why} (prepared {slabs:?}, next {:?})",
        slabs.get(p)
    )))
}

fn no_sparse_vae(backend: &str) -> Error {
    Error::Invalid(format!(
        "the {backend} backend has no device sparse VAE ops (the CPU runs cpu::sparse_conv's pass)"
    ))
}
