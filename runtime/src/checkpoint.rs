//! A single checkpoint file, whatever its container: safetensors (diffusers' files, the
//! single files Black Forest Labs publish, ComfyUI's fp8 files) or GGUF (the
//! quantisations city96 and llama.cpp write). Model loaders map names and shapes over
//! [`TensorFile`] and never ask which container it is.

use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::stored::Stored;
use crate::weights::SafetensorsFile;

/// One mapped checkpoint file: its tensors by name, each borrowed in its stored form.
pub trait TensorFile: Send + Sync {
    fn path(&self) -> &Path;
    /// `safetensors` or `gguf`.
    fn container(&self) -> &'static str;
    fn names(&self) -> Vec<String>;
    /// A tensor's shape (PyTorch order: a Linear weight is `[out, in]`) and the name
    /// of its stored type (`BF16`, `F8_E4M3`, `Q4_K`, ...).
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)>;
    /// The tensor as stored, borrowed from the map.
    fn stored(&self, name: &str) -> Result<Stored<'_>>;
    /// Drops the resident pages of the map (see [`SafetensorsFile::release_pages`]).
    fn release_pages(&self) -> std::io::Result<()>;
    /// Bytes of the file's tensor data.
    fn data_bytes(&self) -> u64;
}

impl TensorFile for SafetensorsFile {
    fn path(&self) -> &Path {
        SafetensorsFile::path(self)
    }
    fn container(&self) -> &'static str {
        "safetensors"
    }
    fn names(&self) -> Vec<String> {
        SafetensorsFile::names(self)
    }
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        SafetensorsFile::info(self, name)
    }
    fn stored(&self, name: &str) -> Result<Stored<'_>> {
        SafetensorsFile::stored(self, name)
    }
    fn release_pages(&self) -> std::io::Result<()> {
        SafetensorsFile::release_pages(self)
    }
    fn data_bytes(&self) -> u64 {
        SafetensorsFile::data_bytes(self)
    }
}

/// Opens `path` as the container its first bytes say: `GGUF` magic, or a safetensors
/// header. A directory is refused here (diffusers directories go through
/// [`crate::WeightStore`]).
pub fn open(path: impl AsRef<Path>) -> Result<Box<dyn TensorFile>> {
    let path = path.as_ref();
    if path.is_dir() {
        return Err(Error::BadConfig {
            path: path.to_path_buf(),
            reason: "is a directory; expected a single .safetensors or .gguf file".into(),
        });
    }
    let mut magic = [0u8; 4];
    {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
        if n < 4 {
            return Err(Error::BadSafetensors {
                path: path.to_path_buf(),
                reason: format!("{n} bytes: too short for any checkpoint format"),
            });
        }
    }
    if &magic == b"GGUF" {
        return open_gguf(path);
    }
    Ok(Box::new(SafetensorsFile::open(path)?))
}

/// A GGUF file whose every tensor is of a type denoised reads: a type it does not
/// (Q2_K, IQ4_XS, ...) is refused at open, naming the tensor and the type, rather
/// than at the first read of that tensor.
fn open_gguf(path: &Path) -> Result<Box<dyn TensorFile>> {
    let f = GgufFile::open(path)?;
    for n in f.names() {
        f.stored(&n)?;
    }
    Ok(Box::new(f))
}

impl TensorFile for GgufFile {
    fn path(&self) -> &Path {
        GgufFile::path(self)
    }
    fn container(&self) -> &'static str {
        "gguf"
    }
    fn names(&self) -> Vec<String> {
        GgufFile::names(self)
    }
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        GgufFile::info(self, name)
    }
    fn stored(&self, name: &str) -> Result<Stored<'_>> {
        GgufFile::stored(self, name)
    }
    fn release_pages(&self) -> std::io::Result<()> {
        GgufFile::release_pages(self)
    }
    fn data_bytes(&self) -> u64 {
        self.names()
            .iter()
            .filter_map(|n| GgufFile::stored(self, n).ok())
            .map(|t| t.bytes.len() as u64)
            .sum()
    }
}

/// The first five of `names` (sorted), and how many more: how an error lists the keys
/// of a file that nothing maps.
pub fn first_few(mut names: Vec<&str>) -> String {
    names.sort_unstable();
    let more = match names.len() {
        n if n > 5 => format!(" (and {} more)", n - 5),
        _ => String::new(),
    };
    format!("{}{more}", names[..names.len().min(5)].join(", "))
}

/// How many numbered modules `<under>N.` the keys hold: one past the largest `N` (the
/// blocks of a transformer, the levels of a VAE).
pub fn indexed_count(names: &[String], under: &str) -> usize {
    names
        .iter()
        .filter_map(|n| {
            n.strip_prefix(under)?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |m| m + 1)
}

/// The stored types of a file's tensors (`BF16`, `F8_E4M3`, `Q4_K`, ...) and how many
/// of each.
pub fn stored_types(f: &dyn TensorFile) -> std::collections::BTreeMap<String, usize> {
    let mut n = std::collections::BTreeMap::new();
    for k in f.names() {
        if let Some((_, t)) = f.info(&k) {
            *n.entry(t).or_default() += 1;
        }
    }
    n
}
