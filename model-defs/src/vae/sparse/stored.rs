//! A template's VAE traces as bytes: what the template cache keeps in its host and
//! disk tiers and what a template file holds (`vae.bin`), so that a worker that has
//! not seen a template reads its trace instead of recording it with a dense pass.
//!
//! The bytes are a sequence of records, one per traced half (a template has an
//! encoder trace and a decoder trace; either may be missing). A record is
//!
//! ```text
//! b"DNVT" | header length u32 LE | header (JSON, space-padded to 8 bytes) | payload
//! ```
//!
//! so that in a record that starts 8-byte aligned (a shared-memory slice, a file read
//! into memory) every tensor is 4-byte aligned: [`map_trace`] reads them in place.
//!
//! The header names the half, the storage dtype, every value's `[C, H, W]`, the group
//! count of every GroupNorm's sums, the attention K/V's shape, the payload's length and
//! its CRC-32. The payload is every value, then the K/V, in f32 little-endian, then
//! per GroupNorm its sums and sums of squares in f64.
//!
//! **Storage dtype: f32, the VAE's compute dtype.** The pre- and postprocess workers
//! run the VAE in f32 (on the CPU); a sparse pass reads the template's values exactly
//! where it recomputes nothing and next to every tile it recomputes, so a bf16 copy
//! would put a rounding step (up to 2^-9 relative) at every region border. The header
//! carries the dtype so that bf16 traces of a bf16 VAE (the GPU pipeline) are an
//! addition, not a format change.
//!
//! Reading checks the CRC and every shape against the plan that will read it; a trace
//! of other content is caught by its caller, which compares the traced input with the
//! edit's template (`crate::pipeline::sparse_vae`).

use denoised_runtime::cpu::sparse_conv::GroupSums;
use denoised_runtime::{Error, HostSlice, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::{Half, TraceValue, VaeTrace};

const MAGIC: &[u8; 4] = b"DNVT";
const F32: &str = "f32";

#[derive(Serialize, Deserialize)]
struct Header {
    half: String,
    dtype: String,
    /// `[C, H, W]` of every value, input first.
    values: Vec<[usize; 3]>,
    /// Per value, `[groups, elements per group]` of the sums of the GroupNorm input of
    /// the op producing it (None: it has none).
    sums: Vec<Option<[usize; 2]>>,
    /// `[pixels, 2C]` of the attention's K | V.
    kv: Option<[usize; 2]>,
    payload_bytes: u64,
    crc32: u32,
}

fn half_name(h: Half) -> &'static str {
    match h {
        Half::Encoder => "encoder",
        Half::Decoder => "decoder",
    }
}

fn bad(why: impl Into<String>) -> Error {
    Error::Invalid(format!("stored VAE trace: {}", why.into()))
}

impl VaeTrace {
    /// This trace of `half` as one record (see the module docs).
    pub fn to_record(&self, half: Half) -> Vec<u8> {
        let floats = self.values.iter().chain(&self.kv).map(|t| t.len());
        let sums_bytes: usize = self.sums.iter().flatten().map(|s| 16 * s.groups).sum();
        let mut payload = Vec::with_capacity(4 * floats.sum::<usize>() + sums_bytes);
        for t in self.values.iter().chain(&self.kv) {
            put_le(&mut payload, t.data());
        }
        for s in self.sums.iter().flatten() {
            put_le(&mut payload, &s.sum);
            put_le(&mut payload, &s.sumsq);
        }
        let header = Header {
            half: half_name(half).into(),
            dtype: F32.into(),
            values: self
                .values
                .iter()
                .map(|t| [t.shape()[1], t.shape()[2], t.shape()[3]])
                .collect(),
            sums: self
                .sums
                .iter()
                .map(|s| s.as_ref().map(|s| [s.groups, s.count]))
                .collect(),
            kv: self.kv.as_ref().map(|t| [t.shape()[0], t.shape()[1]]),
            payload_bytes: payload.len() as u64,
            crc32: crc32fast::hash(&payload),
        };
        let mut h = serde_json::to_vec(&header).expect("a header serialises");
        // JSON allows trailing whitespace: pad so the payload starts 8-byte aligned.
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut out = Vec::with_capacity(8 + h.len() + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(h.len() as u32).to_le_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(&payload);
        out
    }
}

/// A number that is stored little-endian.
trait Le: Copy {
    const SIZE: usize;
    fn to_le(self, out: &mut Vec<u8>);
    fn from_le(b: &[u8]) -> Self;
}

impl Le for f32 {
    const SIZE: usize = 4;
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes(b.try_into().expect("4 bytes"))
    }
}

impl Le for f64 {
    const SIZE: usize = 8;
    fn to_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn from_le(b: &[u8]) -> Self {
        f64::from_le_bytes(b.try_into().expect("8 bytes"))
    }
}

/// Appends `v` little-endian: one memcpy on a little-endian machine (a 512x512 decoder
/// trace is 2.2 GB: value by value it took seconds).
fn put_le<T: Le>(out: &mut Vec<u8>, v: &[T]) {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 and f64 have no padding and every bit pattern is valid bytes;
        // on a little-endian machine their bytes are their little-endian encoding.
        let b = unsafe {
            std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
        };
        out.extend_from_slice(b);
    } else {
        v.iter().for_each(|x| x.to_le(out));
    }
}

/// `b` (a whole number of values) read little-endian: one memcpy on a little-endian
/// machine.
fn get_le<T: Le + Default>(b: &[u8]) -> Vec<T> {
    let n = b.len() / T::SIZE;
    if cfg!(target_endian = "little") {
        let mut v = vec![T::default(); n];
        // SAFETY: `v` holds `n` values, `n * SIZE` bytes, and any bytes are a valid f32
        // or f64; `b` has at least that many (the caller passes exactly them).
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr() as *mut u8, n * T::SIZE)
        };
        v
    } else {
        b.chunks_exact(T::SIZE).map(T::from_le).collect()
    }
}

/// The records in `bytes`: `(header, payload, the payload's offset in bytes)`.
fn records(bytes: &[u8]) -> Result<Vec<(Header, &[u8], usize)>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < 8 || &rest[..4] != MAGIC {
            return Err(bad("not a trace record"));
        }
        let hl = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes")) as usize;
        let h: Header = rest
            .get(8..8 + hl)
            .ok_or_else(|| bad("truncated header"))
            .and_then(|h| serde_json::from_slice(h).map_err(|e| bad(e.to_string())))?;
        let end = 8 + hl + h.payload_bytes as usize;
        let payload = rest.get(8 + hl..end).ok_or_else(|| bad("truncated"))?;
        out.push((h, payload, at + 8 + hl));
        at += end;
    }
    Ok(out)
}

/// The halves `bytes` holds a trace of, each record's checksum checked (what the
/// template cache does when it reads traces from disk).
pub fn check_traces(bytes: &[u8]) -> Result<Vec<Half>> {
    records(bytes)?
        .iter()
        .map(|(h, payload, _)| {
            if crc32fast::hash(payload) != h.crc32 {
                return Err(bad(format!("the {} trace fails its checksum", h.half)));
            }
            match h.half.as_str() {
                "encoder" => Ok(Half::Encoder),
                "decoder" => Ok(Half::Decoder),
                o => Err(bad(format!("half {o:?}"))),
            }
        })
        .collect()
}

/// The record of `half` in `bytes`, checked against itself (shapes against the
/// payload's length); the payload's checksum only when `crc` says so.
fn find(bytes: &[u8], half: Half, crc: bool) -> Result<Option<(Header, &[u8], usize)>> {
    let Some((h, payload, at)) = records(bytes)?
        .into_iter()
        .find(|(h, _, _)| h.half == half_name(half))
    else {
        return Ok(None);
    };
    if h.dtype != F32 {
        return Err(bad(format!("dtype {:?}: this build reads f32", h.dtype)));
    }
    if crc && crc32fast::hash(payload) != h.crc32 {
        return Err(bad(format!("the {} trace fails its checksum", h.half)));
    }
    if h.sums.len() != h.values.len() {
        return Err(bad("sums and values differ in count"));
    }
    let floats = h
        .values
        .iter()
        .map(|[c, y, x]| c.checked_mul(*y)?.checked_mul(*x))
        .chain(h.kv.map(|[n, c]| n.checked_mul(c)))
        .try_fold(0usize, |a, n| a.checked_add(n?));
    let sums: usize = h.sums.iter().flatten().map(|[g, _]| 16 * g).sum();
    if floats.and_then(|f| f.checked_mul(4)?.checked_add(sums)) != Some(payload.len()) {
        return Err(bad(format!(
            "{} payload bytes do not hold its shapes",
            payload.len()
        )));
    }
    Ok(Some((h, payload, at)))
}

/// Reads a record's GroupNorm sums (after its `floats` f32s).
fn sums_of(h: &Header, payload: &[u8], floats: usize) -> Vec<Option<GroupSums>> {
    let mut at = 4 * floats;
    h.sums
        .iter()
        .map(|s| {
            s.map(|[groups, count]| {
                let mut f64s = || {
                    let v = get_le(&payload[at..at + 8 * groups]);
                    at += 8 * groups;
                    v
                };
                let sum = f64s();
                GroupSums {
                    groups,
                    count,
                    sum,
                    sumsq: f64s(),
                }
            })
        })
        .collect()
}

/// Every tensor's shape in a record, values then the K/V.
fn shapes(h: &Header) -> Vec<Vec<usize>> {
    h.values
        .iter()
        .map(|&[c, y, x]| vec![1, c, y, x])
        .chain(h.kv.map(|[n, c]| vec![n, c]))
        .collect()
}

fn assemble(h: &Header, mut tensors: Vec<TraceValue>, sums: Vec<Option<GroupSums>>) -> VaeTrace {
    let kv = h.kv.and_then(|_| tensors.pop());
    VaeTrace {
        values: tensors,
        sums,
        kv,
    }
}

/// The trace of `half` in `bytes` (records as [`VaeTrace::to_record`] writes them),
/// copied and its checksum checked; None when there is none; an error when it is
/// damaged.
pub fn read_trace(bytes: &[u8], half: Half) -> Result<Option<VaeTrace>> {
    let Some((h, payload, _)) = find(bytes, half, true)? else {
        return Ok(None);
    };
    let mut at = 0usize;
    let mut tensors = Vec::new();
    for shape in shapes(&h) {
        let n: usize = shape.iter().product();
        tensors.push(Tensor::new(shape, get_le(&payload[at..at + 4 * n]))?.into());
        at += 4 * n;
    }
    let sums = sums_of(&h, payload, at / 4);
    Ok(Some(assemble(&h, tensors, sums)))
}

/// The trace of `half` in a stored slice, its tensors read in place: no copy of a
/// multi-GB trace. The slice must outlive every use of the trace (the pinned
/// template's, for an edit). The checksum is not read here, a pass over every byte:
/// the cache checks it when it reads the template from disk, and a slice in shared
/// memory is written only by this daemon's processes. A slice that cannot be read in
/// place is copied ([`read_trace`]).
pub fn map_trace(slice: &HostSlice, half: Half) -> Result<Option<VaeTrace>> {
    let Some((h, payload, offset)) = find(slice.bytes(), half, false)? else {
        return Ok(None);
    };
    let mut at = 0usize;
    let mut tensors = Vec::new();
    for shape in shapes(&h) {
        let n: usize = shape.iter().product();
        let mem = slice.sub(offset + at, 4 * n)?;
        match TraceValue::mapped(shape, mem)? {
            Some(t) => tensors.push(t),
            None => return read_trace(slice.bytes(), half),
        }
        at += 4 * n;
    }
    let sums = sums_of(&h, payload, at / 4);
    Ok(Some(assemble(&h, tensors, sums)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vae::{AutoencoderKL, VaeConfig};

    fn traces() -> (VaeTrace, VaeTrace) {
        let vae = AutoencoderKL::seeded(VaeConfig::tiny(), 1).unwrap();
        let img: Vec<f32> = (0..3 * 16 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        let z: Vec<f32> = (0..16 * 8 * 8).map(|i| (i as f32 * 0.11).cos()).collect();
        (
            vae.trace_encode(&Tensor::new([1, 3, 16, 16], img).unwrap())
                .unwrap(),
            vae.trace_decode(&Tensor::new([1, 16, 8, 8], z).unwrap())
                .unwrap(),
        )
    }

    fn same(a: &VaeTrace, b: &VaeTrace) {
        let bits = |t: &TraceValue| -> (Vec<usize>, Vec<u32>) {
            (
                t.shape().to_vec(),
                t.data().iter().map(|v| v.to_bits()).collect(),
            )
        };
        assert_eq!(a.values.len(), b.values.len());
        for (x, y) in a.values.iter().zip(&b.values) {
            assert_eq!(bits(x), bits(y));
        }
        assert_eq!(a.kv.as_ref().map(bits), b.kv.as_ref().map(bits));
        assert_eq!(a.sums, b.sums);
    }

    #[test]
    fn a_stored_trace_reads_back_bit_for_bit_and_damage_is_caught() {
        let (enc, dec) = traces();
        let bytes = [enc.to_record(Half::Encoder), dec.to_record(Half::Decoder)].concat();
        assert_eq!(
            check_traces(&bytes).unwrap(),
            vec![Half::Encoder, Half::Decoder]
        );
        same(&read_trace(&bytes, Half::Encoder).unwrap().unwrap(), &enc);
        same(&read_trace(&bytes, Half::Decoder).unwrap().unwrap(), &dec);
        // One half alone: the other is missing, not an error.
        let only = dec.to_record(Half::Decoder);
        assert!(read_trace(&only, Half::Encoder).unwrap().is_none());
        // A flipped payload byte fails the checksum; a cut record is refused.
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n - 100] ^= 1;
        let e = read_trace(&bad, Half::Decoder).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        assert!(check_traces(&bad).is_err());
        let e = read_trace(&bytes[..n - 1], Half::Encoder)
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
        assert!(read_trace(b"PNG\0....", Half::Encoder).is_err());
    }

    #[test]
    fn a_stored_trace_in_shared_memory_is_read_in_place() {
        let (enc, dec) = traces();
        let bytes = [enc.to_record(Half::Encoder), dec.to_record(Half::Decoder)].concat();
        let slice = HostSlice::copy_of(&bytes).unwrap();
        for (half, want) in [(Half::Encoder, &enc), (Half::Decoder, &dec)] {
            let got = map_trace(&slice, half).unwrap().unwrap();
            assert!(got.is_mapped(), "{half:?} copied");
            same(&got, want);
        }
        // A slice that is not 4-byte aligned is copied, with the same values.
        let odd = HostSlice::copy_of(&[&[0u8][..], &bytes].concat()).unwrap();
        let odd = odd.sub(1, bytes.len()).unwrap();
        let got = map_trace(&odd, Half::Decoder).unwrap().unwrap();
        assert!(!got.is_mapped());
        same(&got, &dec);
    }
}
