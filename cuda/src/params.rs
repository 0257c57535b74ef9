//! Kernel parameter structs, field for field the structs in `kernels/common.cuh`.
//!
//! Every kernel takes exactly one of these by value, so a launch is "kernel name +
//! one plain struct" on both executors: the driver copies it into the kernel's
//! parameter space, and the CPU emulator hands the kernel a pointer to it. A test
//! compares each size with the C++ compiler's `sizeof` (tests/kernels.rs).

use cudarc::driver::DeviceRepr;

/// Marker for the structs above: plain old data with a C layout.
///
/// # Safety
/// Implementors must be `#[repr(C)]` and match their C++ twin exactly.
pub unsafe trait KernelParams: DeviceRepr + Copy + Send + Sync + 'static {}

macro_rules! params {
    ($($t:ident),*) => { $( unsafe impl DeviceRepr for $t {} unsafe impl KernelParams for $t {} )* };
}
params!(
    EwParams,
    LnModParams,
    RmsRopeParams,
    GatherParams,
    TimestepParams,
    AttnParams,
    AttnPackParams,
    TextAttnParams,
    ImgParams,
    EpilogueParams
);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EwParams {
    pub x: u64,
    pub y: u64,
    pub table: u64,
    pub seg: u64,
    pub rows: i32,
    pub cols: i32,
    pub c0: i32,
    pub c1: i32,
    pub table_cols: i32,
    pub n: i32,
    pub alpha: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LnModParams {
    pub x: u64,
    pub out: u64,
    pub shift: u64,
    pub scale: u64,
    pub seg: u64,
    pub in_index: u64,
    pub out_index: u64,
    pub y: u64,
    pub gate: u64,
    pub rows: i32,
    pub width: i32,
    pub table_cols: i32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RmsRopeParams {
    pub x: u64,
    pub weight: [u64; 2],
    pub cos: u64,
    pub sin: u64,
    pub rows: i32,
    pub stride: i32,
    pub c0: [i32; 2],
    pub heads: [i32; 2],
    pub head_dim: i32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GatherParams {
    pub srcs: [u64; 8],
    pub src_stride: [i32; 8],
    /// When non-zero, the sources are `(u64 address, u64 row stride)` pairs here.
    pub src_table: u64,
    pub index: u64,
    pub out: u64,
    pub rows: i32,
    pub cols: i32,
    pub r0: i32,
    pub c0: i32,
}

/// A GEMM's epilogue as a pass of its own (`linear_epilogue_*`), where cuBLASLt has no
/// algorithm with it: `dst[r, c] = act(src[r, c] * xs[r] * ws[c] + bias[c])` over
/// `rows x cols`, each of `xs`, `ws` and `bias` left out where 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EpilogueParams {
    pub src: u64,
    pub dst: u64,
    pub xs: u64,
    pub ws: u64,
    pub bias: u64,
    pub rows: i32,
    pub cols: i32,
    pub ld_src: i32,
    pub ld_dst: i32,
    pub gelu: i32,
    /// `xs` and `ws` are one value each (per-tensor fp8 scales), not a vector.
    pub scalar: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TimestepParams {
    pub xs: u64,
    pub freqs: u64,
    pub out: u64,
    pub n: i32,
    pub half: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnSlot {
    pub k: u64,
    pub v: u64,
    pub stride: i64,
    /// fp8 K/V (an fp8 template slab): the per-head scales of the K columns and of
    /// the V columns (`f32[heads]` each); 0 for K/V in the compute dtype.
    pub k_scales: u64,
    pub v_scales: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnParams {
    pub slots: [AttnSlot; 8],
    pub q_rows: u64,
    pub kv_rows: u64,
    pub seqs: u64,
    pub tiles: u64,
    pub n_tiles: i32,
    pub heads: i32,
    pub head_dim: i32,
    pub scale_log2: f32,
}

/// The gather into, and scatter out of, the contiguous scratch of attention through a
/// library (`crate::sdpa`): rows by the same packed references as [`AttnParams`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnPackParams {
    pub slots: [AttnSlot; 8],
    /// `const u32*`: `rows` row references.
    pub refs: u64,
    /// The contiguous side: `padded` rows `ld` elements apart, `width` used.
    pub dense: u64,
    pub rows: i32,
    pub padded: i32,
    pub ld: i32,
    pub width: i32,
    pub head_dim: i32,
    /// 1: the referenced rows' V columns (`slot.v`, `v_scales`); 0: K (or queries).
    pub values: i32,
}

impl AttnPackParams {
    /// Parameters over `slots` (at most 8), the rest zero.
    pub fn with_slots(slots: &[AttnSlot]) -> Self {
        let mut p = AttnPackParams::default();
        p.slots[..slots.len()].copy_from_slice(slots);
        p
    }
}

/// The text encoders' attention, one launch per layer (`crate::text`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TextAttnParams {
    /// `[len, 3 * heads * head_dim]`: q | k | v.
    pub qkv: u64,
    /// `[len, heads * head_dim]`.
    pub out: u64,
    /// T5's position bias `[heads * len, len]`, or 0.
    pub bias: u64,
    pub len: i32,
    pub heads: i32,
    pub head_dim: i32,
    /// CLIP's causal mask: row i sees keys `0..=i`.
    pub causal: i32,
    pub scale: f32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ImgParams {
    pub x: u64,
    pub y: u64,
    pub z: u64,
    pub wt: u64,
    pub bias: u64,
    pub batch: i32,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub oh: i32,
    pub ow: i32,
    pub kh: i32,
    pub kw: i32,
    pub stride: i32,
    pub pad_t: i32,
    pub pad_l: i32,
    pub up: i32,
    pub p0: i32,
    pub rows: i32,
    pub cols: i32,
    pub ld: i32,
    pub groups: i32,
    pub splits: i32,
    pub silu: i32,
    pub causal: i32,
    pub ldy: i32,
    pub eps: f32,
    pub scale: f32,
}

/// Packs a row reference: `slot` (0..8) in the top 3 bits, the row below.
pub fn row_ref(slot: usize, row: usize) -> u32 {
    debug_assert!(slot < 8 && row < (1 << 29));
    ((slot as u32) << 29) | row as u32
}
