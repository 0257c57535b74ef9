//! Host side of masked-query attention: turns the Backend's sequence description
//! (query spans in several buffers, K/V slices from fresh and cached buffers, by range
//! or by index) into the kernels' compact form, and picks the kernel.
//!
//! Every distinct (buffer, columns) pair becomes a *slot* (at most 8 per launch: a
//! double block uses 2 query buffers and about 3 K/V sources per request kind, plus
//! one per template an edit reads), and every row a packed `(slot, row)` reference.
//! A batch that needs more slots is split into launches by sequence. Each launch's
//! descriptors go up in one upload.

use denoised_runtime::backend::{AttnSeq, Src};
use denoised_runtime::{Error, Result};

use std::sync::atomic::Ordering::Relaxed;

use crate::backend::{GpuBackend, GpuTensor};
use crate::exec::{Dt, Exec, Grid};
use crate::params::{row_ref, AttnParams, AttnSlot};

/// Query rows per block of the tensor-core kernels (4 warps x 16 rows).
const MMA_TILE: usize = 64;
/// Key rows per shared-memory tile of the FlashAttention-2 kernel; it keeps K and V
/// double-buffered: 4 tiles of `FA2_KEYS x head_dim` bf16 (the wide kernel's are half
/// as tall at head dim 128).
const FA2_KEYS: usize = 64;

/// Which tensor-core kernel runs bf16 attention at head dims 64 and 128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AttnKernel {
    /// `attn_fa2_*`: ldmatrix fragments, cp.async double-buffered K/V tiles, swizzled
    /// shared memory with no bank conflicts.
    Fa2 = 0,
    /// `attn_mma_*`: the first version (synchronous tile loads, V transposed by
    /// scalar stores), kept so that one GPU run can time both on the same machine.
    Mma = 1,
    /// `attn_fa2w_*`: the FA2 kernel with 128-row blocks (32 query rows a warp), which
    /// reads half the shared memory per FLOP of K and V: faster than `Fa2` at every
    /// FLUX.1 shape on an H100 (4-11%; docs/performance.md), and what runs where the
    /// library below is absent or refuses a shape.
    Fa2Wide = 2,
    /// The executor's fused-attention library (cuDNN's SDPA forward, `crate::sdpa`):
    /// the default. Where there is none, or it refuses a shape, `Fa2Wide` runs.
    Cudnn = 3,
}

impl AttnKernel {
    /// The names `DENOISED_ATTN_KERNEL` and `bench attn --kernel` take.
    pub const NAMES: [&'static str; 4] = ["cudnn", "fa2", "fa2w", "mma"];

    pub fn named(name: &str) -> Option<Self> {
        match name {
            "cudnn" => Some(AttnKernel::Cudnn),
            "fa2" => Some(AttnKernel::Fa2),
            "fa2w" => Some(AttnKernel::Fa2Wide),
            "mma" => Some(AttnKernel::Mma),
            _ => None,
        }
    }

    /// The name [`named`](Self::named) takes.
    pub fn name(self) -> &'static str {
        match self {
            AttnKernel::Cudnn => "cudnn",
            AttnKernel::Fa2 => "fa2",
            AttnKernel::Fa2Wide => "fa2w",
            AttnKernel::Mma => "mma",
        }
    }

    /// `DENOISED_ATTN_KERNEL=fa2w|fa2|mma` picks one of our kernels; anything else the
    /// library first.
    pub fn from_env() -> Self {
        std::env::var("DENOISED_ATTN_KERNEL")
            .ok()
            .and_then(|n| Self::named(&n))
            .unwrap_or(AttnKernel::Cudnn)
    }

    /// Query rows per block, and the kernel's name at head dim `hd` (64 or 128): for
    /// `Cudnn`, its fallback's (fa2w).
    fn tensor_core(self, hd: usize) -> (usize, &'static str) {
        match (self, hd) {
            (AttnKernel::Fa2, 64) => (MMA_TILE, "attn_fa2_bf16_d64"),
            (AttnKernel::Fa2, _) => (MMA_TILE, "attn_fa2_bf16_d128"),
            (AttnKernel::Fa2Wide | AttnKernel::Cudnn, 64) => (2 * MMA_TILE, "attn_fa2w_bf16_d64"),
            (AttnKernel::Fa2Wide | AttnKernel::Cudnn, _) => (2 * MMA_TILE, "attn_fa2w_bf16_d128"),
            (AttnKernel::Mma, 64) => (MMA_TILE, "attn_mma_bf16_d64"),
            (AttnKernel::Mma, _) => (MMA_TILE, "attn_mma_bf16_d128"),
        }
    }

    /// Dynamic shared memory of a block: FA2's K and V tiles double-buffered, and the
    /// wide kernel's 128-row Q tile (its key tiles are 32 rows at head dim 128: see
    /// attention.cu); the first version's is static.
    fn smem(self, hd: usize) -> u32 {
        let bytes = match self {
            AttnKernel::Fa2 => 4 * FA2_KEYS * hd * 2,
            AttnKernel::Fa2Wide | AttnKernel::Cudnn => {
                let keys = if hd == 128 { FA2_KEYS / 2 } else { FA2_KEYS };
                4 * keys * hd * 2 + 2 * MMA_TILE * hd * 2
            }
            AttnKernel::Mma => 0,
        };
        bytes as u32
    }
}

impl<E: Exec> GpuBackend<E> {
    pub fn attn_kernel(&self) -> AttnKernel {
        match self.attn_kernel.load(std::sync::atomic::Ordering::Relaxed) {
            0 => AttnKernel::Fa2,
            1 => AttnKernel::Mma,
            2 => AttnKernel::Fa2Wide,
            _ => AttnKernel::Cudnn,
        }
    }
    /// Attention launches since start: `(by the library, by our kernels)`.
    pub fn attention_launches(&self) -> (u64, u64) {
        let [lib, ours] = &self.attn_launches;
        (lib.load(Relaxed), ours.load(Relaxed))
    }
    /// What runs bf16 attention at FLUX's head dims on this backend, in words: for the
    /// log at start, `/readyz` and `denoised devices`.
    pub fn attention_path(&self) -> String {
        match (self.attn_kernel(), self.exec().attn_library()) {
            (AttnKernel::Cudnn, Some(lib)) => {
                format!("{lib}; our fa2w kernel for shapes it refuses")
            }
            (AttnKernel::Cudnn, None) => {
                "our fa2w kernel (no attention library: cuDNN 9 absent, off or too old)".into()
            }
            (k, _) => format!("our {} kernel (DENOISED_ATTN_KERNEL)", k.name()),
        }
    }
    /// Switches the tensor-core attention kernel (checks and benchmarks run both).
    pub fn set_attn_kernel(&self, k: AttnKernel) {
        self.attn_kernel
            .store(k as u8, std::sync::atomic::Ordering::Relaxed);
    }
}
/// Query rows per block of the SIMT kernel (4 warps x 1 row).
const SIMT_TILE: usize = 4;

/// What the descriptors need from a tensor.
struct View {
    addr: u64,
    rows: usize,
    cols: usize,
    /// An fp8 slab's scales (0 otherwise): its elements are then bytes.
    fp8_scales: u64,
}

fn view<E: Exec>(t: &GpuTensor<E>) -> View {
    View {
        addr: t.addr(),
        rows: t.rows(),
        cols: t.cols(),
        fp8_scales: t.fp8_scales(),
    }
}

/// The tensor a K/V source reads: one of the call's buffers, or an external one.
fn src_view<E: Exec>(bufs: &[&GpuTensor<E>], s: &Src<'_, GpuTensor<E>>) -> Result<View> {
    match s {
        Src::Own(i) => bufs
            .get(*i)
            .map(|b| view(b))
            .ok_or_else(|| Error::shape("attention", format!("no buffer {i}"))),
        Src::Ext(t) => Ok(view(t)),
    }
}

/// Slots of the kernel's parameter block: the row references' 3-bit slot field.
const MAX_SLOTS: usize = 8;

struct Slots {
    slots: Vec<AttnSlot>,
}

impl Slots {
    /// The slot of `s`, added if new; `None` when the call is full.
    fn get(&mut self, s: AttnSlot) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(|x| {
            (x.k, x.v, x.stride, x.k_scales, x.v_scales)
                == (s.k, s.v, s.stride, s.k_scales, s.v_scales)
        }) {
            return Some(i);
        }
        if self.slots.len() == MAX_SLOTS {
            return None;
        }
        self.slots.push(s);
        Some(self.slots.len() - 1)
    }
}

/// The descriptors of one kernel launch: some sequences, their slots and rows.
#[derive(Default)]
struct Launch {
    slots: Vec<AttnSlot>,
    q_rows: Vec<u32>,
    kv_rows: Vec<u32>,
    /// Per sequence: query offset and count, K/V offset and count.
    descs: Vec<[usize; 4]>,
}

impl Launch {
    /// Adds `s`; false (and nothing added) when its buffers do not fit the slots left.
    fn add<E: Exec>(
        &mut self,
        bufs: &[&GpuTensor<E>],
        s: &AttnSeq<'_, GpuTensor<E>>,
        q_col: usize,
        width: usize,
        hd: usize,
        es: u64,
    ) -> Result<bool> {
        let mut slots = Slots {
            slots: std::mem::take(&mut self.slots),
        };
        let saved = (slots.slots.len(), self.q_rows.len(), self.kv_rows.len());
        let fits = self.describe(&mut slots, bufs, s, q_col, width, hd, es);
        if !matches!(fits, Ok(true)) {
            slots.slots.truncate(saved.0);
            self.q_rows.truncate(saved.1);
            self.kv_rows.truncate(saved.2);
        }
        self.slots = slots.slots;
        fits
    }

    #[allow(clippy::too_many_arguments)]
    fn describe<E: Exec>(
        &mut self,
        slots: &mut Slots,
        bufs: &[&GpuTensor<E>],
        s: &AttnSeq<'_, GpuTensor<E>>,
        q_col: usize,
        width: usize,
        hd: usize,
        es: u64,
    ) -> Result<bool> {
        let q_off = self.q_rows.len();
        for span in &s.q {
            let v = bufs
                .get(span.buf)
                .map(|b| view(b))
                .ok_or_else(|| Error::shape("attention", format!("no buffer {}", span.buf)))?;
            check_cols("query", &v, q_col, width)?;
            if span.rows.end > v.rows {
                return Err(Error::shape(
                    "attention",
                    format!("query rows {:?} of {}", span.rows, v.rows),
                ));
            }
            if v.fp8_scales != 0 {
                return Err(Error::shape("attention", "queries in an fp8 slab"));
            }
            let base = v.addr + q_col as u64 * es;
            let Some(slot) = slots.get(AttnSlot {
                k: base,
                v: base,
                stride: v.cols as i64,
                ..Default::default()
            }) else {
                return Ok(false);
            };
            self.q_rows
                .extend(span.rows.clone().map(|r| row_ref(slot, r)));
        }
        let kv_off = self.kv_rows.len();
        for kv in &s.kv {
            let v = src_view(bufs, &kv.src)?;
            check_cols("key", &v, kv.k_col, width)?;
            check_cols("value", &v, kv.v_col, width)?;
            // An fp8 slab's elements are bytes, with a scale per head: the K and V
            // columns must start at a head, whose scales follow in order.
            let fp8 = v.fp8_scales != 0;
            if fp8 && (kv.k_col % hd != 0 || kv.v_col % hd != 0) {
                return Err(Error::shape(
                    "attention",
                    format!(
                        "fp8 K/V at columns {} and {} of {hd}-wide heads",
                        kv.k_col, kv.v_col
                    ),
                ));
            }
            let e = if fp8 { 1 } else { es };
            let scales = |c: usize| {
                if fp8 {
                    v.fp8_scales + (c / hd * 4) as u64
                } else {
                    0
                }
            };
            let Some(slot) = slots.get(AttnSlot {
                k: v.addr + kv.k_col as u64 * e,
                v: v.addr + kv.v_col as u64 * e,
                stride: v.cols as i64,
                k_scales: scales(kv.k_col),
                v_scales: scales(kv.v_col),
            }) else {
                return Ok(false);
            };
            for i in 0..kv.rows.len() {
                let r = kv.rows.get(i);
                if r >= v.rows {
                    return Err(Error::shape(
                        "attention",
                        format!("key row {r} of {}", v.rows),
                    ));
                }
                self.kv_rows.push(row_ref(slot, r));
            }
        }
        self.descs.push([
            q_off,
            self.q_rows.len() - q_off,
            kv_off,
            self.kv_rows.len() - kv_off,
        ]);
        Ok(true)
    }
}

fn check_cols(what: &str, v: &View, col: usize, width: usize) -> Result<()> {
    if col + width > v.cols {
        return Err(Error::shape(
            "attention",
            format!(
                "{what} columns {col}..{} of a buffer {} wide",
                col + width,
                v.cols
            ),
        ));
    }
    Ok(())
}

pub(crate) fn run<E: Exec>(
    be: &GpuBackend<E>,
    bufs: &[&GpuTensor<E>],
    q_col: usize,
    width: usize,
    heads: usize,
    seqs: &[AttnSeq<'_, GpuTensor<E>>],
) -> Result<()> {
    if heads == 0 || width % heads != 0 {
        return Err(Error::shape(
            "attention",
            format!("width {width} in {heads} heads"),
        ));
    }
    let hd = width / heads;
    if hd > 256 || hd % 2 != 0 {
        return Err(Error::shape(
            "attention",
            format!("head dim {hd} (even, at most 256)"),
        ));
    }
    let es = be.dtype().size() as u64;
    // Sequences are independent, so a batch whose sequences read more distinct
    // buffers than one launch addresses (many templates' caches) is split into several
    // launches; usually there is one.
    let mut launch = Launch::default();
    for s in seqs {
        if launch.add(bufs, s, q_col, width, hd, es)? {
            continue;
        }
        if launch.descs.is_empty() {
            return Err(Error::shape(
                "attention",
                format!("one sequence reads more than {MAX_SLOTS} distinct buffers"),
            ));
        }
        self::launch(be, std::mem::take(&mut launch), heads, hd, es)?;
        if !launch.add(bufs, s, q_col, width, hd, es)? {
            return Err(Error::shape(
                "attention",
                format!("one sequence reads more than {MAX_SLOTS} distinct buffers"),
            ));
        }
    }
    self::launch(be, launch, heads, hd, es)
}

/// Launches the kernel over one set of sequences.
fn launch<E: Exec>(be: &GpuBackend<E>, l: Launch, heads: usize, hd: usize, es: u64) -> Result<()> {
    let Launch {
        slots,
        q_rows,
        kv_rows,
        descs,
    } = l;
    if q_rows.is_empty() {
        return Ok(());
    }

    // Tensor cores need bf16, a head dim of 64 or 128, and rows aligned for the tile
    // loads: 16 bytes of bf16, or 8 bytes of fp8 (decoded to 16 bytes of bf16).
    let aligned = slots.iter().all(|s| {
        let (a, e) = if s.k_scales != 0 { (8, 1) } else { (16, es) };
        s.k % a == 0 && s.v % a == 0 && (s.stride as u64 * e) % a == 0
    });
    let k = be.attn_kernel();
    let tensor_cores = be.dtype() == Dt::Bf16 && (hd == 64 || hd == 128);
    // cuDNN's fused attention takes bf16 head dims that are multiples of 8 up to 128.
    if k == AttnKernel::Cudnn && be.dtype() == Dt::Bf16 && hd % 8 == 0 && hd <= 128 {
        let described = crate::sdpa::Described {
            slots: &slots,
            q_rows: &q_rows,
            kv_rows: &kv_rows,
            descs: &descs,
        };
        if crate::sdpa::run(be, &described, heads, hd)? {
            be.attn_launches[0].fetch_add(1, Relaxed);
            return Ok(());
        }
    }
    be.attn_launches[1].fetch_add(1, Relaxed);
    let mma = tensor_cores && aligned;
    let ((tile, name), smem) = match (mma, be.dtype()) {
        (true, _) => (k.tensor_core(hd), k.smem(hd)),
        (false, Dt::Bf16) => ((SIMT_TILE, "attn_simt_bf16"), 0),
        (false, Dt::F32) => ((SIMT_TILE, "attn_simt_f32"), 0),
    };
    let mut tiles: Vec<u32> = vec![];
    for (si, d) in descs.iter().enumerate() {
        for q0 in (0..d[1]).step_by(tile) {
            tiles.extend([si as u32, q0 as u32]);
        }
    }
    // One upload: tiles (8-byte aligned int2 first), sequences, query refs, K/V refs.
    let n_tiles = tiles.len() / 2;
    let seq_off = tiles.len();
    let q_off = seq_off + descs.len() * 4;
    let kv_off = q_off + q_rows.len();
    let mut all = tiles;
    all.extend(descs.iter().flat_map(|d| d.map(|x| x as u32)));
    all.extend(&q_rows);
    all.extend(&kv_rows);
    let (_mem, base) = be.upload_u32(&all)?;
    let mut p = AttnParams {
        q_rows: base + 4 * q_off as u64,
        kv_rows: base + 4 * kv_off as u64,
        seqs: base + 4 * seq_off as u64,
        tiles: base,
        n_tiles: n_tiles as i32,
        heads: heads as i32,
        head_dim: hd as i32,
        scale_log2: std::f32::consts::LOG2_E / (hd as f32).sqrt(),
        ..Default::default()
    };
    p.slots[..slots.len()].copy_from_slice(&slots);
    let g = Grid {
        grid: [n_tiles as u32, heads as u32, 1],
        block: [128, 1, 1],
        smem,
    };
    be.launch(name, g, &p)
}
