//! Attention through the executor's fused-attention library (cuDNN's SDPA forward on a
//! GPU), beside our own kernels (docs/gpu.md, "Attention through cuDNN").
//!
//! A launch's sequences come described as our kernels take them: query and K/V rows as
//! packed `(slot, row)` references into a few buffers (`crate::attention`). A library
//! takes strided tensors instead, so each sequence goes one of two ways:
//!
//! - **dense**: its queries are consecutive rows of one buffer and its keys and values
//!   consecutive rows of one (a single block of a full step: `[k | v | q | mlp]` over
//!   the same rows). The library reads Q, K and V where they lie, as strided views of
//!   the buffer's columns, and writes O over Q (the Backend contract), with no copy;
//! - **packed**: anything else (a double block's two streams, an edit's fresh rows
//!   beside its template's cached ones, fp8 templates). `attn_pack_*` gathers the
//!   rows into a scratch Q and a scratch `[K | V]` (decoding fp8 with its head scales
//!   on the way), the library runs on them, and `attn_unpack_*` scatters O back over
//!   the queries. The scratch is taken once per launch, sized for its largest
//!   sequence, and reused sequence after sequence (stream order).
//!
//! Query counts are padded to a bucket ([`query_bucket`]) so that the few plans a
//! library builds per shape cover every mask: padded query rows are zeros whose
//! outputs are never scattered back (each query row's attention is independent of
//! the others'). Key counts are exact: an edit attends to every token of its image.
//!
//! The planning here is plain functions of the descriptors ([`route`], [`packed`],
//! [`query_bucket`]), unit-tested without a device.

use denoised_runtime::Result;

use crate::backend::{dev, GpuBackend};
use crate::exec::{Dt, Exec, Grid, Sdpa, Strided};
use crate::params::{AttnPackParams, AttnSlot};

/// Query rows up to which buckets are multiples of [`SMALL_STEP`]; above it, eight
/// buckets per doubling, so padding wastes at most 1/8 of the queries.
const SMALL: usize = 512;
const SMALL_STEP: usize = 64;

/// The query count a sequence of `n` queries is padded to: a multiple of 64 up to 512,
/// then the next of eight steps per power of two (576, 640, ... 1024, 1152, ...).
pub fn query_bucket(n: usize) -> usize {
    if n <= SMALL {
        return n.div_ceil(SMALL_STEP).max(1) * SMALL_STEP;
    }
    let octave = 1usize << (usize::BITS - 1 - (n - 1).leading_zeros());
    let step = octave / 8;
    n.div_ceil(step) * step
}

/// How one sequence reaches the library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Read in place: the call with its views (O over Q).
    Dense(Sdpa),
    /// Gathered into scratch: `nq` queries padded to `padded`, `nkv` keys.
    Packed {
        nq: usize,
        padded: usize,
        nkv: usize,
    },
}

/// The slot and first row of `refs` if they are consecutive rows of one slot.
fn contiguous(refs: &[u32]) -> Option<(usize, usize)> {
    let first = *refs.first()?;
    let (slot, row) = ((first >> 29) as usize, (first & 0x1fff_ffff) as usize);
    let ok = refs
        .iter()
        .enumerate()
        .all(|(i, &r)| r == ((slot as u32) << 29 | (row + i) as u32));
    ok.then_some((slot, row))
}

/// How the sequence with query references `q` and K/V references `kv` runs, over
/// `slots`, with `heads` heads of `hd` bf16 columns. Dense needs 16-byte aligned
/// rows (the library's tensor alignment) and K/V in bf16, not an fp8 slab.
pub(crate) fn route(slots: &[AttnSlot], q: &[u32], kv: &[u32], heads: usize, hd: usize) -> Route {
    let es = Dt::Bf16.size() as u64;
    let packed = Route::Packed {
        nq: q.len(),
        padded: query_bucket(q.len()),
        nkv: kv.len(),
    };
    let (Some((qs, qr)), Some((ks, kr))) = (contiguous(q), contiguous(kv)) else {
        return packed;
    };
    let (qslot, kslot) = (&slots[qs], &slots[ks]);
    if kslot.k_scales != 0 || kslot.v_scales != 0 {
        return packed;
    }
    let view = |base: u64, row: usize, stride: i64, rows: usize| {
        let addr = base + row as u64 * stride as u64 * es;
        let stride = stride as usize;
        (addr % 16 == 0 && (stride as u64 * es) % 16 == 0).then_some(Strided {
            addr,
            strides: [rows * stride, hd, stride],
        })
    };
    let (nq, nkv) = (q.len(), kv.len());
    let views = (
        view(qslot.k, qr, qslot.stride, nq),
        view(kslot.k, kr, kslot.stride, nkv),
        view(kslot.v, kr, kslot.stride, nkv),
    );
    let (Some(qv), Some(kv), Some(vv)) = views else {
        return packed;
    };
    Route::Dense(Sdpa {
        batch: 1,
        heads,
        sq: nq,
        skv: nkv,
        head_dim: hd,
        q: qv,
        k: kv,
        v: vv,
        o: qv,
    })
}

/// Scratch buffers of a launch's packed sequences: queries `[padded, width]`, keys and
/// values side by side `[nkv, 2 * width]`, output `[padded, width]`, bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scratch {
    pub q: u64,
    pub kv: u64,
    pub o: u64,
}

impl Scratch {
    /// Bytes of each buffer for sequences of at most `padded` queries and `nkv` keys.
    pub fn bytes(padded: usize, nkv: usize, width: usize) -> [usize; 3] {
        let es = Dt::Bf16.size();
        [
            padded * width * es,
            nkv * 2 * width * es,
            padded * width * es,
        ]
    }
}

/// The call of a packed sequence over `scratch`.
pub(crate) fn packed(scratch: Scratch, padded: usize, nkv: usize, heads: usize, hd: usize) -> Sdpa {
    let (w, es) = (heads * hd, Dt::Bf16.size() as u64);
    let rows = |addr: u64, n: usize, stride: usize| Strided {
        addr,
        strides: [n * stride, hd, stride],
    };
    Sdpa {
        batch: 1,
        heads,
        sq: padded,
        skv: nkv,
        head_dim: hd,
        q: rows(scratch.q, padded, w),
        k: rows(scratch.kv, nkv, 2 * w),
        v: rows(scratch.kv + w as u64 * es, nkv, 2 * w),
        o: rows(scratch.o, padded, w),
    }
}

impl<E: Exec> GpuBackend<E> {
    /// What runs bf16 attention at FLUX.1's full step (24 heads of 128, 512 + 4096
    /// tokens) on this device, the library asked to plan it: for `denoised devices`
    /// and the self-test's report.
    pub fn attention_at_flux(&self) -> String {
        let (heads, hd, tokens) = (24, 128, 4608);
        let path = self.attention_path();
        let Some(lib) = self.exec().attn_library() else {
            return path;
        };
        let none = Scratch { q: 0, kv: 0, o: 0 };
        let call = packed(none, query_bucket(tokens), tokens, heads, hd);
        match self.exec().sdpa_plan(&call) {
            Ok(true) => format!("{path} (a plan for FLUX.1's {heads} x {tokens} x {hd} built)"),
            Ok(false) => format!(
                "our fa2w kernel: {lib} refused FLUX.1's {heads} x {tokens} x {hd} (the log says why)"
            ),
            Err(e) => format!("{path} (planning failed: {e})"),
        }
    }
}

impl<E: Exec> GpuBackend<E> {
    /// Builds the attention library's plans for the packed calls of every query bucket
    /// up to `keys` queries, against `keys` keys, for each count in `key_counts` (bf16,
    /// `heads` of `hd`): the shapes a step of that many tokens makes (a full step's
    /// double blocks, and edits at any mask), so that no step builds one after
    /// warm-up. Returns how many plans the library holds for them (0 where the
    /// library is off, absent or not used for this head size). A shape the library
    /// refuses is logged once, as at a step, and our kernel will run it.
    pub fn warm_attention_plans(
        &self,
        heads: usize,
        hd: usize,
        key_counts: &[usize],
    ) -> Result<usize> {
        let used = self.attn_kernel() == crate::AttnKernel::Cudnn
            && self.dtype() == Dt::Bf16
            && hd % 8 == 0
            && hd <= 128;
        if !used || self.exec().attn_library().is_none() {
            return Ok(0);
        }
        let none = Scratch { q: 0, kv: 0, o: 0 };
        let mut built = 0;
        for &nkv in key_counts {
            for bucket in buckets_up_to(nkv) {
                let call = packed(none, bucket, nkv, heads, hd);
                built += self.exec().sdpa_plan(&call).map_err(dev)? as usize;
            }
        }
        Ok(built)
    }
}

/// Every query bucket of 1 to `n` queries, smallest first.
pub(crate) fn buckets_up_to(n: usize) -> Vec<usize> {
    let mut out = vec![query_bucket(1)];
    while *out.last().expect("one") < query_bucket(n) {
        out.push(query_bucket(out.last().expect("one") + 1));
    }
    out
}

/// What the library path needs of a launch: its slots, row references and sequences
/// (`[q_off, q_len, kv_off, kv_len]`), as `crate::attention` built them.
pub(crate) struct Described<'a> {
    pub slots: &'a [AttnSlot],
    pub q_rows: &'a [u32],
    pub kv_rows: &'a [u32],
    pub descs: &'a [[usize; 4]],
}

impl Described<'_> {
    fn seq(&self, d: &[usize; 4]) -> (&[u32], &[u32]) {
        (
            &self.q_rows[d[0]..d[0] + d[1]],
            &self.kv_rows[d[2]..d[2] + d[3]],
        )
    }
}

/// Runs every sequence of `l` through the executor's library. `Ok(false)`, with
/// nothing written, when the library has no plan for one of them (our kernel runs
/// the launch then).
pub(crate) fn run<E: Exec>(
    be: &GpuBackend<E>,
    l: &Described<'_>,
    heads: usize,
    hd: usize,
) -> Result<bool> {
    let exec = be.exec();
    let routes: Vec<Route> = l
        .descs
        .iter()
        .map(|d| {
            let (q, kv) = l.seq(d);
            route(l.slots, q, kv, heads, hd)
        })
        .collect();
    // Every shape planned before anything runs: a refusal leaves the launch whole.
    let shape_only = Scratch { q: 0, kv: 0, o: 0 };
    for r in &routes {
        let call = match *r {
            Route::Dense(call) => call,
            Route::Packed { padded, nkv, .. } => packed(shape_only, padded, nkv, heads, hd),
        };
        if !exec.sdpa_plan(&call).map_err(dev)? {
            return Ok(false);
        }
    }
    let (mut padded_max, mut nkv_max) = (0, 0);
    for r in &routes {
        if let Route::Packed { padded, nkv, .. } = *r {
            padded_max = padded_max.max(padded);
            nkv_max = nkv_max.max(nkv);
        }
    }
    let width = heads * hd;
    // Freed when this returns, which on a GPU is stream-ordered after the work.
    let alloc = |n: usize| exec.alloc(n).map_err(dev);
    let mem = if padded_max > 0 {
        let [q, kv, o] = Scratch::bytes(padded_max, nkv_max, width);
        Some((alloc(q)?, alloc(kv)?, alloc(o)?))
    } else {
        None
    };
    let scratch = mem.as_ref().map_or(shape_only, |(q, kv, o)| Scratch {
        q: exec.addr(q),
        kv: exec.addr(kv),
        o: exec.addr(o),
    });
    let refs = be.upload_u32(&[l.q_rows, l.kv_rows].concat())?;
    let (q_refs, kv_refs) = (refs.1, refs.1 + 4 * l.q_rows.len() as u64);
    for (d, r) in l.descs.iter().zip(&routes) {
        match *r {
            Route::Dense(call) => exec.sdpa(&call).map_err(dev)?,
            Route::Packed { nq, padded, nkv } => {
                let base = |refs: u64, off: usize| refs + 4 * off as u64;
                let p = AttnPackParams {
                    head_dim: hd as i32,
                    width: width as i32,
                    ..AttnPackParams::with_slots(l.slots)
                };
                let pack = |refs, rows, padded, dense, ld, values| {
                    let p = AttnPackParams {
                        refs,
                        dense,
                        rows: rows as i32,
                        padded: padded as i32,
                        ld: ld as i32,
                        values,
                        ..p
                    };
                    be.launch("attn_pack_bf16", Grid::linear(padded * width / 8, 256), &p)
                };
                let es = Dt::Bf16.size() as u64;
                pack(base(q_refs, d[0]), nq, padded, scratch.q, width, 0)?;
                pack(base(kv_refs, d[2]), nkv, nkv, scratch.kv, 2 * width, 0)?;
                let v = scratch.kv + width as u64 * es;
                pack(base(kv_refs, d[2]), nkv, nkv, v, 2 * width, 1)?;
                exec.sdpa(&packed(scratch, padded, nkv, heads, hd))
                    .map_err(dev)?;
                let p = AttnPackParams {
                    refs: base(q_refs, d[0]),
                    dense: scratch.o,
                    rows: nq as i32,
                    padded: nq as i32,
                    ld: width as i32,
                    ..p
                };
                be.launch("attn_unpack_bf16", Grid::linear(nq * width / 8, 256), &p)?;
            }
        }
    }
    drop(refs);
    drop(mem);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::row_ref;

    #[test]
    fn the_warm_up_plans_every_bucket_a_step_can_ask_for() {
        for n in [1, 63, 64, 512, 513, 4608, 16384] {
            let b = buckets_up_to(n);
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
            for q in 1..=n {
                assert!(b.contains(&query_bucket(q)), "{q} of {n}: {b:?}");
            }
            assert_eq!(*b.last().unwrap(), query_bucket(n));
        }
        // FLUX.1 at 1024²: 8 buckets to 512, 8 per doubling to 4096, then 4608.
        assert_eq!(buckets_up_to(4608).len(), 33);
    }

    #[test]
    fn buckets_cover_pad_little_and_are_few() {
        let mut distinct = std::collections::BTreeSet::new();
        for n in 1..=16384 {
            let b = query_bucket(n);
            assert!(b >= n, "{n} -> {b}");
            assert_eq!(
                query_bucket(b),
                b,
                "a bucket is its own bucket ({n} -> {b})"
            );
            assert!(b % 64 == 0, "{n} -> {b}: tiles of 64 rows");
            if n > SMALL {
                assert!(b - n < n / 8 + 1, "{n} -> {b}: more than 1/8 padding");
            } else {
                assert!(b - n < 64, "{n} -> {b}");
            }
            if n > 1 {
                assert!(b >= query_bucket(n - 1), "monotone at {n}");
            }
            distinct.insert(b);
        }
        // 8 up to 512, then 8 per doubling to 16384: few plans per key count.
        assert_eq!(distinct.len(), 8 + 5 * 8);
        // FLUX.1 at 1024²: 512 text + 4096 image rows, a full step, is its own bucket.
        assert_eq!(query_bucket(4608), 4608);
    }

    fn slot(base: u64, stride: i64) -> AttnSlot {
        AttnSlot {
            k: base,
            v: base + 256,
            stride,
            ..Default::default()
        }
    }

    #[test]
    fn a_single_blocks_sequence_is_read_in_place() {
        // [k | v | q | mlp] of 7 * 128 columns, 2 heads of 64: q at column 256.
        let (heads, hd, cols) = (2, 64, 7 * 128);
        let buf = 1 << 20;
        let slots = [
            AttnSlot {
                k: buf + 2 * 256,
                v: buf + 2 * 256,
                stride: cols,
                ..Default::default()
            },
            AttnSlot {
                k: buf,
                v: buf + 2 * 128,
                stride: cols,
                ..Default::default()
            },
        ];
        let q: Vec<u32> = (10..30).map(|r| row_ref(0, r)).collect();
        let kv: Vec<u32> = (10..30).map(|r| row_ref(1, r)).collect();
        let Route::Dense(call) = route(&slots, &q, &kv, heads, hd) else {
            panic!("not dense");
        };
        let row = 10 * cols as u64 * 2;
        assert_eq!(call.q.addr, buf + 512 + row);
        assert_eq!(call.k.addr, buf + row);
        assert_eq!(call.v.addr, buf + 256 + row);
        assert_eq!(call.q.strides, [20 * cols as usize, 64, cols as usize]);
        assert_eq!(call.o, call.q, "the output overwrites the queries");
        assert_eq!(
            (call.sq, call.skv, call.heads, call.head_dim),
            (20, 20, 2, 64)
        );
    }

    #[test]
    fn gathered_rows_fp8_and_misaligned_views_are_packed() {
        let (heads, hd) = (2, 64);
        let slots = [slot(1 << 20, 384), slot(2 << 20, 256)];
        let q: Vec<u32> = (0..5).map(|r| row_ref(0, r)).collect();
        let kv: Vec<u32> = (0..9).map(|r| row_ref(1, r)).collect();
        assert!(matches!(route(&slots, &q, &kv, heads, hd), Route::Dense(_)));
        // Rows by index (a template's inactive tokens): not consecutive.
        let every_other: Vec<u32> = (0..9).map(|r| row_ref(1, 2 * r)).collect();
        // Rows from two buffers (a double block's text and image streams).
        let two: Vec<u32> = [row_ref(0, 0), row_ref(1, 1)].into();
        for (q, kv) in [(&q, &every_other), (&two, &kv), (&q, &two)] {
            let r = route(&slots, q, kv, heads, hd);
            assert_eq!(
                r,
                Route::Packed {
                    nq: q.len(),
                    padded: 64,
                    nkv: kv.len()
                }
            );
        }
        // An fp8 template slab, decoded by the pack kernel.
        let mut fp8 = slots;
        fp8[1].k_scales = 4096;
        fp8[1].v_scales = 4096 + 8;
        assert!(matches!(
            route(&fp8, &q, &kv, heads, hd),
            Route::Packed { .. }
        ));
        // A row stride that is not a multiple of 16 bytes.
        let mut odd = slots;
        odd[1].stride = 260;
        assert!(matches!(
            route(&odd, &q, &kv, heads, hd),
            Route::Packed { .. }
        ));
        // A first row that starts off a 16-byte boundary.
        let mut off = slots;
        off[0].k += 2;
        assert!(matches!(
            route(&off, &q, &kv, heads, hd),
            Route::Packed { .. }
        ));
    }

    #[test]
    fn packed_views_tile_the_scratch() {
        let (heads, hd) = (3, 128);
        let w = heads * hd;
        let s = Scratch {
            q: 1 << 20,
            kv: 2 << 20,
            o: 3 << 20,
        };
        let call = packed(s, 640, 4608, heads, hd);
        assert_eq!((call.sq, call.skv), (640, 4608));
        assert_eq!(call.q.strides, [640 * w, hd, w]);
        assert_eq!(call.k.strides, [4608 * 2 * w, hd, 2 * w]);
        assert_eq!(call.v.addr - call.k.addr, (w * 2) as u64, "V right after K");
        assert_eq!(call.o.addr, s.o);
        // The last element of each view lies inside its buffer.
        let bytes = Scratch::bytes(640, 4608, w);
        let last = |t: &Strided, n: usize| {
            let (h, r, d) = (heads - 1, n - 1, hd - 1);
            (h * t.strides[1] + r * t.strides[2] + d) * 2
        };
        assert!(last(&call.q, 640) < bytes[0]);
        assert!(last(&call.v, 4608) + (call.v.addr - call.k.addr) as usize <= bytes[1]);
        assert!(last(&call.o, 640) < bytes[2]);
        // Plans are by shape: two scratch sets of one shape share one.
        let other = Scratch {
            q: 5 << 20,
            kv: 6 << 20,
            o: 7 << 20,
        };
        assert_eq!(call.shape(), packed(other, 640, 4608, heads, hd).shape());
        assert_ne!(call.shape(), packed(s, 704, 4608, heads, hd).shape());
    }
}
