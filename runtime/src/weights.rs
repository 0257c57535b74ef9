//! Safetensors files and diffusers-format weight directories, memory-mapped.
//!
//! A diffusers component directory (`transformer/`, `vae/`, ...) holds `config.json`
//! and either one `<stem>.safetensors` or shards listed by `<stem>.safetensors.index.json`
//! (`weight_map`: tensor name -> shard file), as FLUX.1-Fill-dev ships. Files are
//! mmap'd; a tensor is converted to f32 only when asked for, so a 24 GB bf16 checkpoint
//! never needs a second full copy in its storage dtype.
//!
//! Errors name the file and the tensor: truncated files, unknown dtypes, shapes that
//! disagree with the model config, and tensors the config does not expect.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensorError, TensorView};
use safetensors::SafeTensors;

use crate::error::{Error, Result};
use crate::stored::Stored;
use crate::tensor::{DType, Tensor};

/// One memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    meta: Metadata,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .finish()
    }
}

impl SafetensorsFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the map is read-only and model files are not rewritten while a
        // process serves them; a concurrent truncation would be an operator error that
        // the OS reports as SIGBUS, as for every mmap-based loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (n, meta) = match SafeTensors::read_metadata(&mmap) {
            Ok(x) => x,
            Err(SafeTensorError::MetadataIncompleteBuffer) => {
                return Err(truncation_error(&path, &mmap))
            }
            Err(e) => {
                return Err(Error::BadSafetensors {
                    path,
                    reason: e.to_string(),
                })
            }
        };
        Ok(SafetensorsFile {
            path,
            mmap,
            data_start: 8 + n,
            meta,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the tensor data (the file less its header).
    pub fn data_bytes(&self) -> u64 {
        (self.mmap.len() - self.data_start) as u64
    }

    /// Drops this process's resident pages of the map, keeping it readable: a later
    /// read faults the same bytes back in from the file (the page cache). Tensors are
    /// read from the map once, while loading, and copied into the backend's layout;
    /// the pages those reads made resident would otherwise stay in the process's RSS
    /// (RssFile) for as long as the map is kept (a transformer keeps its checkpoint
    /// mapped to restore LoRA-merged sites from), a second copy of every weight.
    pub fn release_pages(&self) -> std::io::Result<()> {
        #[cfg(unix)]
        // SAFETY: `Mmap` is a read-only shared mapping of a file that is not rewritten
        // while it is served (see `open`). MADV_DONTNEED on it only unmaps this
        // process's pages: a slice borrowed from the map reads the same bytes after
        // it, faulted back in from the file, so no borrow observes a change.
        unsafe {
            self.mmap
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)?;
        }
        Ok(())
    }

    /// A value of the file's `__metadata__` header (e.g. a LoRA's
    /// `lora_adapter_metadata`).
    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.meta.metadata().as_ref()?.get(key).map(String::as_str)
    }

    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.meta.info(name).is_some()
    }

    /// Shape and dtype name of a tensor.
    pub fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        self.meta
            .info(name)
            .map(|i| (i.shape.clone(), format!("{:?}", i.dtype)))
    }

    fn raw(&self, name: &str) -> Result<(&[u8], Dtype, &[usize])> {
        let info = self.meta.info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.path.clone(),
        })?;
        let (s, e) = info.data_offsets;
        Ok((
            &self.mmap[self.data_start + s..self.data_start + e],
            info.dtype,
            &info.shape,
        ))
    }

    /// A floating-point tensor (F32, BF16, F16, F8_E4M3 or F64) converted to f32
    /// (fp8 unscaled: a `scale_weight` beside it is the caller's to apply).
    pub fn tensor_f32(&self, name: &str) -> Result<Tensor> {
        let (bytes, dtype, shape) = self.raw(name)?;
        let data = match dtype {
            Dtype::F64 => bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
                .collect(),
            _ => return self.weight(name),
        };
        Tensor::new(shape.to_vec(), data)
    }

    /// A weight tensor: only the dtypes checkpoints use (F32, BF16, F16, and
    /// F8_E4M3, decoded unscaled).
    pub fn weight(&self, name: &str) -> Result<Tensor> {
        self.stored(name)?.to_f32()
    }

    /// A weight tensor in its stored dtype, borrowed from the map (no copy). An
    /// F8_E4M3 tensor comes with scale 1: [`Stored::with_scale`] applies a
    /// checkpoint's `scale_weight`.
    pub fn stored(&self, name: &str) -> Result<Stored<'_>> {
        let (bytes, dtype, shape) = self.raw(name)?;
        Stored::new(name, shape.to_vec(), float_dtype(name, dtype)?, bytes)
    }

    pub fn tensor_f64(&self, name: &str) -> Result<Vec<f64>> {
        let (bytes, dtype, _) = self.raw(name)?;
        match dtype {
            Dtype::F64 => Ok(bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                .collect()),
            _ => Ok(self
                .tensor_f32(name)?
                .into_data()
                .into_iter()
                .map(f64::from)
                .collect()),
        }
    }

    pub fn tensor_i64(&self, name: &str) -> Result<Vec<i64>> {
        let (bytes, dtype, _) = self.raw(name)?;
        match dtype {
            Dtype::I64 => Ok(bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect()),
            Dtype::I32 => Ok(bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect()),
            other => Err(Error::UnsupportedDType {
                name: name.to_string(),
                dtype: format!("{other:?} (expected an integer type)"),
            }),
        }
    }
}

/// A checkpoint's float dtype as ours (weights are F32, BF16, F16 or F8_E4M3).
fn float_dtype(name: &str, dtype: Dtype) -> Result<DType> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F8_E4M3 => DType::F8E4M3,
        other => {
            return Err(Error::UnsupportedDType {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            })
        }
    })
}

/// Names the first tensor whose bytes lie past the end of a truncated file.
fn truncation_error(path: &Path, buf: &[u8]) -> Error {
    let bad = |reason: &str| Error::BadSafetensors {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let Some(n) = buf
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
    else {
        return bad("header too small");
    };
    let Some(header) = buf.get(8..8 + n) else {
        return bad("header length beyond the end of the file");
    };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header)
    else {
        return bad("header is not a JSON object");
    };
    let actual = buf.len() - 8 - n;
    let mut worst: Option<(String, usize)> = None;
    for (name, v) in map {
        let end = v
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(|e| e.as_u64())
            .unwrap_or(0) as usize;
        if end > actual && worst.as_ref().is_none_or(|(_, w)| end < *w) {
            worst = Some((name, end));
        }
    }
    match worst {
        Some((tensor, needed)) => Error::Truncated {
            path: path.to_path_buf(),
            tensor,
            needed,
            actual,
        },
        None => {
            bad("data section length does not match the header (extra bytes after the last tensor)")
        }
    }
}

/// The weights of one diffusers component directory, whole or sharded.
#[derive(Debug)]
pub struct WeightStore {
    dir: PathBuf,
    files: Vec<SafetensorsFile>,
    index: HashMap<String, usize>,
}

impl WeightStore {
    /// Opens `dir/<stem>.safetensors`, or the shards named by
    /// `dir/<stem>.safetensors.index.json` when that exists.
    pub fn open(dir: impl AsRef<Path>, stem: &str) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(format!("{stem}.safetensors.index.json"));
        let single = dir.join(format!("{stem}.safetensors"));
        let mut files = Vec::new();
        let mut index = HashMap::new();
        if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::BadConfig {
                    path: index_path.clone(),
                    reason: e.to_string(),
                })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::BadConfig {
                    path: index_path.clone(),
                    reason: "no `weight_map` object".into(),
                })?;
            let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
            let mut shard_idx = HashMap::new();
            for shard in shards {
                shard_idx.insert(shard.to_string(), files.len());
                files.push(SafetensorsFile::open(dir.join(shard))?);
            }
            for (name, shard) in map {
                let shard = shard.as_str().ok_or_else(|| Error::BadConfig {
                    path: index_path.clone(),
                    reason: format!("weight_map entry for `{name}` is not a file name"),
                })?;
                let fi = shard_idx[shard];
                if !files[fi].contains(name) {
                    return Err(Error::MissingTensor {
                        name: name.clone(),
                        dir: files[fi].path().to_path_buf(),
                    });
                }
                index.insert(name.clone(), fi);
            }
        } else if single.exists() {
            let f = SafetensorsFile::open(&single)?;
            for n in f.names() {
                index.insert(n, 0);
            }
            files.push(f);
        } else {
            return Err(Error::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("no {stem}.safetensors or {stem}.safetensors.index.json"),
                ),
            ));
        }
        Ok(WeightStore { dir, files, index })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// [`SafetensorsFile::release_pages`] of every file: call it once the weights
    /// are loaded (and after each later read) so that the mapped checkpoint costs no
    /// resident memory beyond the page cache.
    pub fn release_pages(&self) -> std::io::Result<()> {
        for f in &self.files {
            f.release_pages()?;
        }
        Ok(())
    }

    /// Loads `name` as f32 and checks its shape against what the config implies.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        self.stored(name, expected)?.to_f32()
    }

    /// `name` in its stored dtype, borrowed from the map, its shape checked against
    /// what the config implies.
    pub fn stored(&self, name: &str, expected: &[usize]) -> Result<Stored<'_>> {
        let fi = *self.index.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        let t = self.files[fi].stored(name)?;
        if t.shape != expected {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                actual: t.shape,
            });
        }
        Ok(t)
    }

    /// Fails if the directory holds tensors that the model never asked for: a sign of
    /// a checkpoint for a different architecture or config.
    pub fn check_all_used<'a>(&self, used: impl IntoIterator<Item = &'a str>) -> Result<()> {
        let used: BTreeSet<&str> = used.into_iter().collect();
        let extra: Vec<&str> = self.names().filter(|n| !used.contains(n)).collect();
        if extra.is_empty() {
            return Ok(());
        }
        Err(Error::UnexpectedTensors {
            dir: self.dir.clone(),
            names: crate::checkpoint::first_few(extra),
        })
    }
}

/// Writes f32 tensors to a safetensors file (the format of `denoised bench forward` outputs
/// and of test inputs).
pub fn write_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, t)| t.data().iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, t), b)| {
            TensorView::new(Dtype::F32, t.shape().to_vec(), b)
                .map(|v| (name.to_string(), v))
                .map_err(|e| Error::Invalid(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| Error::Write {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}
