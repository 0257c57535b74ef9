//! GGUF files (v2 and v3), memory-mapped: the single-file FLUX transformers and T5
//! encoders people hold as GGUF quantisations (city96's files).
//!
//! A small reader of our own rather than a crate: the format is a short header, a
//! list of typed metadata key/values, a list of tensor infos, and aligned tensor
//! data, about 300 lines to read completely. candle's reader (`candle_core::quantized
//! ::gguf_file`) would drag candle-core (and its own tensor and device types) into
//! every crate; the `gguf`/`gguf-rs` crates read into owned buffers or lack the
//! mmap borrowing our [`Stored`] relies on (weights go from the map to the backend
//! with no host copy). Errors name the file, and the tensor where one is concerned.
//!
//! Shapes are reported in PyTorch order (GGUF stores ggml's `ne`, innermost first, so
//! they are reversed): a Linear weight is `[out, in]`, and a quantised tensor's
//! blocks run along its last dimension.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::quant::QuantType;
use crate::stored::Stored;
use crate::tensor::DType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml type ids, names, and (values, bytes) per block, as `gguf.GGML_QUANT_SIZES`.
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

/// The types [`GgufFile::stored`] reads, for error messages.
pub const SUPPORTED: &str = "F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_0, Q4_K, Q4_0";

/// The name ggml gives type `id` (`type42` for ids it does not know).
pub fn ggml_type_name(id: u32) -> String {
    GGML_TYPES
        .iter()
        .find(|t| t.0 == id)
        .map(|t| t.1.to_string())
        .unwrap_or_else(|| format!("type{id}"))
}

/// A metadata value. Arrays are kept as their element type and length only (a T5
/// file's tokenizer vocabulary is not needed here).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array { elem_type: u32, len: u64 },
}

#[derive(Clone, Debug)]
struct TensorInfo {
    /// PyTorch order.
    shape: Vec<usize>,
    ggml_type: u32,
    /// Absolute byte range in the file.
    start: usize,
    /// `None` for a type whose size this reader does not know.
    len: Option<usize>,
}

/// One memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: HashMap<String, MetaValue>,
    /// In file order.
    order: Vec<String>,
    tensors: HashMap<String, TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.order.len())
            .finish()
    }
}

/// A cursor over the header, whose errors say what it was reading.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn bad(&self, reason: String) -> Error {
        Error::BadGguf {
            path: self.path.to_path_buf(),
            reason,
        }
    }
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        match self.pos.checked_add(n).filter(|&e| e <= self.buf.len()) {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.bad(format!(
                "truncated: the header ends at byte {} while reading {} ({n} bytes at {})",
                self.buf.len(),
                what(),
                self.pos
            ))),
        }
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.buf.len() as u64 {
            return Err(self.bad(format!("{}: string length {n} is past the file", what())));
        }
        let b = self.take(n as usize, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad(format!("{}: not UTF-8", what())))
    }
    /// One value of metadata type `ty`.
    fn value(&mut self, ty: u32, what: &dyn Fn() -> String) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::UInt(self.take(1, what)?[0] as u64),
            1 => MetaValue::Int(self.take(1, what)?[0] as i8 as i64),
            2 => {
                MetaValue::UInt(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()) as u64)
            }
            3 => MetaValue::Int(i16::from_le_bytes(self.take(2, what)?.try_into().unwrap()) as i64),
            4 => MetaValue::UInt(self.u32(what)? as u64),
            5 => MetaValue::Int(self.u32(what)? as i32 as i64),
            6 => MetaValue::Float(f32::from_bits(self.u32(what)?) as f64),
            7 => MetaValue::Bool(self.take(1, what)?[0] != 0),
            8 => MetaValue::Str(self.string(what)?),
            9 => {
                let elem_type = self.u32(what)?;
                let len = self.u64(what)?;
                if elem_type == 9 {
                    return Err(self.bad(format!("{}: nested arrays are not supported", what())));
                }
                if len > self.buf.len() as u64 {
                    return Err(
                        self.bad(format!("{}: array length {len} is past the file", what()))
                    );
                }
                for _ in 0..len {
                    self.value(elem_type, what)?;
                }
                MetaValue::Array { elem_type, len }
            }
            10 => MetaValue::UInt(self.u64(what)?),
            11 => MetaValue::Int(self.u64(what)? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64(what)?)),
            other => return Err(self.bad(format!("{}: unknown value type {other}", what()))),
        })
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: as `SafetensorsFile::open`: a read-only map of a model file that is
        // not rewritten while it is served.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let mut c = Cursor {
            buf: &mmap,
            pos: 0,
            path: &path,
        };
        let magic = c.take(4, &|| "the magic".into())?;
        if magic != MAGIC {
            return Err(c.bad(format!(
                "bad magic {magic:02x?} (expected \"GGUF\"); is it a safetensors or ggml file?"
            )));
        }
        let version = c.u32(&|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(c.bad(format!(
                "version {version} is not supported (supported: 2, 3)"
            )));
        }
        let n_tensors = c.u64(&|| "the tensor count".into())?;
        let n_kv = c.u64(&|| "the metadata count".into())?;
        if n_tensors > mmap.len() as u64 || n_kv > mmap.len() as u64 {
            return Err(c.bad(format!(
                "{n_tensors} tensors and {n_kv} metadata entries cannot fit in {} bytes",
                mmap.len()
            )));
        }
        let mut metadata = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key {i}"))?;
            let ty = c.u32(&|| format!("the type of metadata `{key}`"))?;
            let v = c.value(ty, &|| format!("metadata `{key}`"))?;
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(MetaValue::UInt(a)) if *a > 0 && a.is_power_of_two() => *a,
            Some(v) => return Err(c.bad(format!("general.alignment {v:?} is not a power of two"))),
        };
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&|| format!("the name of tensor {i}"))?;
            let what = || format!("the info of tensor `{name}`");
            let n_dims = c.u32(&what)?;
            if n_dims > 8 {
                return Err(c.bad(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(c.u64(&what)?);
            }
            let ty = c.u32(&what)?;
            let offset = c.u64(&what)?;
            raw.push((name, ne, ty, offset));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = HashMap::new();
        let mut order = Vec::new();
        // The tensor nearest the start whose bytes lie past the end.
        let mut truncated: Option<(String, u64)> = None;
        for (name, ne, ty, offset) in raw {
            let bad = |reason: String| Error::BadGguf {
                path: path.clone(),
                reason: format!("tensor `{name}`: {reason}"),
            };
            let n = ne
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n <= 1 << 48)
                .ok_or_else(|| bad(format!("dimensions {ne:?} overflow")))?;
            if offset % alignment != 0 {
                return Err(bad(format!(
                    "offset {offset} is not aligned to {alignment}"
                )));
            }
            let start = data_start
                .checked_add(offset)
                .ok_or_else(|| bad(format!("offset {offset} overflows")))?;
            let len = match GGML_TYPES.iter().find(|t| t.0 == ty) {
                Some(&(_, tname, be, bb)) => {
                    if ne.first().is_some_and(|&d| d % be != 0) {
                        return Err(bad(format!(
                            "{tname}: the inner dimension {} is not a multiple of the block size {be}",
                            ne[0]
                        )));
                    }
                    let len = n / be * bb;
                    let end = start + len;
                    if end > mmap.len() as u64 && truncated.as_ref().is_none_or(|t| end < t.1) {
                        truncated = Some((name.clone(), end));
                    }
                    Some(len as usize)
                }
                None => None,
            };
            order.push(name.clone());
            let shape = ne.iter().rev().map(|&d| d as usize).collect();
            let info = TensorInfo {
                shape,
                ggml_type: ty,
                start: start as usize,
                len,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(bad("appears twice".into()));
            }
        }
        if let Some((tensor, needed)) = truncated {
            return Err(Error::Truncated {
                path,
                tensor,
                needed: needed as usize,
                actual: mmap.len(),
            });
        }
        Ok(GgufFile {
            path,
            mmap,
            version,
            metadata,
            order,
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Tensor names in file order.
    pub fn names(&self) -> Vec<String> {
        self.order.clone()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Shape (PyTorch order) and ggml type name (`Q4_K`, `F16`, ...) of a tensor.
    pub fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        self.tensors
            .get(name)
            .map(|t| (t.shape.clone(), ggml_type_name(t.ggml_type)))
    }

    /// A metadata value (`general.architecture`, ...).
    pub fn metadata(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A string metadata value, e.g. `general.architecture` (`flux`, `t5encoder`).
    pub fn metadata_str(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key)? {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An integer metadata value (of any integer width and sign, if non-negative).
    pub fn metadata_u64(&self, key: &str) -> Option<u64> {
        match *self.metadata.get(key)? {
            MetaValue::UInt(v) => Some(v),
            MetaValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Metadata keys, sorted.
    pub fn metadata_keys(&self) -> Vec<&str> {
        let mut k: Vec<&str> = self.metadata.keys().map(String::as_str).collect();
        k.sort();
        k
    }

    /// A tensor in its stored form, borrowed from the map: F32/F16/BF16 elements or
    /// GGUF blocks ([`Stored::quantised`]). Other types are refused, naming the file,
    /// the tensor and the type.
    pub fn stored(&self, name: &str) -> Result<Stored<'_>> {
        let t = self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.path.clone(),
        })?;
        let unsupported = || Error::UnsupportedQuant {
            path: self.path.clone(),
            tensor: name.to_string(),
            ty: ggml_type_name(t.ggml_type),
            supported: SUPPORTED.to_string(),
        };
        let len = t.len.ok_or_else(unsupported)?;
        let bytes = &self.mmap[t.start..t.start + len];
        let shape = t.shape.clone();
        match t.ggml_type {
            0 => Stored::new(name, shape, DType::F32, bytes),
            1 => Stored::new(name, shape, DType::F16, bytes),
            30 => Stored::new(name, shape, DType::BF16, bytes),
            id => match QuantType::from_ggml_type(id) {
                Some(q) => Stored::quantised(name, shape, q, bytes),
                None => Err(unsupported()),
            },
        }
    }

    /// As [`crate::weights::SafetensorsFile::release_pages`]: drops this process's
    /// resident pages of the map, keeping it readable.
    pub fn release_pages(&self) -> std::io::Result<()> {
        #[cfg(unix)]
        // SAFETY: as `SafetensorsFile::release_pages`: a read-only shared map of a
        // file that is not rewritten; borrowed slices read the same bytes after it.
        unsafe {
            self.mmap
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)?;
        }
        Ok(())
    }
}
