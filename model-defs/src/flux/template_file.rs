//! Template caches on disk: a versioned header, a flat data file, and a checksum per
//! slab.
//!
//! A template directory holds `template.json` (format name and version, the model
//! fingerprint, resolution, steps, guidance, the layout, the cache mode (`kv` or `y`),
//! the slabs' storage dtype and the CRC-32 of each (step, block) slab and of the
//! latents) and `cache.bin` (the flat image described by [`TemplateLayout`], exactly
//! as it is in memory: slabs step-major in the storage dtype, then the latents in f32,
//! little-endian). Loading refuses a file
//! of another format version, another model, another resolution or schedule, a size
//! that does not match its dtype, or a bad checksum, and says which (for a corrupt
//! slab, which slab); a silently wrong cache would produce silently wrong edits. The
//! per-slab checksums let a reader check each slab as it arrives (the cache process
//! loading a template from its disk tier into memory).
//!
//! The storage dtype is the capturing device's: bf16 for a GPU worker (half the bytes,
//! and lossless, since the device computed the K/V in bf16), f32 for the CPU.
//! Version 3 files (before the mode was recorded: KV), version 2 files (one checksum
//! for the whole data) and version 1 files (before the dtype was recorded: f32) still
//! load.

use std::io::{BufWriter, Read, Write};
use std::path::Path;

use denoised_runtime::direct::DirectFile;
use denoised_runtime::{DType, Error, HostSlice, Result};
use serde::{Deserialize, Serialize};

use super::template::{storage_dtype, storage_name, CacheMode, TemplateCache, TemplateLayout};

pub const FORMAT: &str = "denoised-template";
pub const VERSION: u32 = 5;
/// Versions this build reads: 1 had no `kv_dtype` (always f32), 2 one checksum, 3 no
/// `cache_mode` (always KV), 4 no `heads` (never fp8).
const READS: [u32; 5] = [1, 2, 3, 4, 5];
pub(crate) const HEADER: &str = "template.json";
pub(crate) const DATA: &str = "cache.bin";
/// The template's VAE traces, when it has them (the sparse VAE's; format and checksums
/// in `crate::vae::sparse::stored`). Optional, so every version above reads without.
pub const VAE_TRACES: &str = "vae.bin";

/// What a template was captured from; the cache key is (model, resolution, steps,
/// guidance).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TemplateMeta {
    /// Fingerprint of the model that captured it (see `ModelSource::fingerprint`).
    pub model: String,
    pub height: usize,
    pub width: usize,
    pub steps: usize,
    pub guidance: f32,
    pub seed: u64,
    pub prompt: String,
    /// The LoRA set it was captured with (`lora::set_key`); empty for none. An edit
    /// must run with the same set: the cached activations are the adapted model's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub adapters: String,
}

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    meta: TemplateMeta,
    steps: usize,
    blocks: usize,
    tokens: usize,
    hidden: usize,
    latent_channels: usize,
    /// `f32` or `bf16`.
    #[serde(default = "f32_name")]
    kv_dtype: String,
    /// `kv` or `y` (version 4).
    #[serde(default = "kv_name")]
    cache_mode: String,
    /// Attention heads: an fp8 slab's scale groups (version 5; 0 before).
    #[serde(default)]
    heads: usize,
    /// Slabs are stored every this many steps (version 5; 1 before).
    #[serde(default = "one")]
    kv_step_stride: usize,
    data_bytes: usize,
    /// Versions 3 and 4: the CRC-32 of each (step, block) slab, step-major, then of the
    /// latents.
    #[serde(default)]
    slab_crc32: Vec<u32>,
    /// Versions 1 and 2: the CRC-32 of the whole data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32: Option<u32>,
}

fn f32_name() -> String {
    "f32".into()
}

fn one() -> usize {
    1
}

fn kv_name() -> String {
    "kv".into()
}

fn bad(dir: &Path, reason: impl Into<String>) -> Error {
    Error::BadConfig {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// The checksummed regions of a layout's flat image: each (step, block) slab, then the
/// latents; their byte ranges in order.
pub(crate) fn regions(l: &TemplateLayout) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let slab = l.slab_bytes();
    (0..l.slab_count())
        .map(move |i| i * slab..(i + 1) * slab)
        .chain(std::iter::once(l.latent_offset(0)..l.total_bytes()))
}

/// Writes a template's VAE traces (records as `VaeTrace::to_record` makes them) beside
/// its cache in `dir`.
pub fn save_vae_traces(dir: &Path, traces: &[u8]) -> Result<()> {
    let path = dir.join(VAE_TRACES);
    std::fs::write(&path, traces).map_err(|e| Error::io(&path, e))
}

/// A template directory's VAE traces, None when it has none.
pub fn read_vae_traces(dir: &Path) -> Result<Option<Vec<u8>>> {
    let path = dir.join(VAE_TRACES);
    match std::fs::read(&path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&path, e)),
    }
}

/// Writes `cache` with `meta` to `dir` (created if needed), its slabs in `kv_dtype`
/// (the cache's own dtype is written as it is; another is converted slab by slab).
pub fn save(dir: &Path, cache: &TemplateCache, meta: &TemplateMeta, kv_dtype: DType) -> Result<()> {
    let kv_name = storage_name(kv_dtype);
    if !cache.is_complete() {
        return Err(Error::Invalid(
            "cannot save an incomplete template cache".into(),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let src = *cache.layout();
    let l = TemplateLayout {
        dtype: kv_dtype,
        ..src
    };
    l.check()?;
    let data_path = dir.join(DATA);
    let file = std::fs::File::create(&data_path).map_err(|e| Error::io(&data_path, e))?;
    let mut w = BufWriter::new(file);
    let mut slab_crc32 = Vec::with_capacity(l.slab_count() + 1);
    let bytes = cache.bytes().bytes();
    for (i, r) in regions(&src).enumerate() {
        let converted;
        let part = if i < l.slab_count() && kv_dtype != src.dtype {
            let (s, b) = (i / l.slabs_per_step(), i % l.slabs_per_step());
            converted = l.encode_slab(cache.slab(s * l.step_stride, b)?.data());
            &converted[..]
        } else {
            &bytes[r]
        };
        slab_crc32.push(crc32fast::hash(part));
        w.write_all(part).map_err(|e| Error::io(&data_path, e))?;
    }
    w.flush().map_err(|e| Error::io(&data_path, e))?;
    let header = Header {
        format: FORMAT.into(),
        version: VERSION,
        meta: meta.clone(),
        steps: l.steps,
        blocks: l.blocks,
        tokens: l.tokens,
        hidden: l.hidden,
        latent_channels: l.latent_channels,
        kv_dtype: kv_name.into(),
        cache_mode: l.mode.name().into(),
        heads: l.heads,
        kv_step_stride: l.step_stride,
        data_bytes: l.total_bytes(),
        slab_crc32,
        crc32: None,
    };
    let hp = dir.join(HEADER);
    let text = serde_json::to_string_pretty(&header).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(&hp, text).map_err(|e| Error::io(&hp, e))
}

/// A template file's header: what it was captured from, and its layout (with the K/V
/// storage dtype). Format and version are checked; the data is not read.
pub struct FileHeader {
    pub meta: TemplateMeta,
    pub layout: TemplateLayout,
    header: Header,
}

impl FileHeader {
    /// The file's format version.
    pub fn version(&self) -> u32 {
        self.header.version
    }
    /// The CRC-32 of each region ([`regions`]; version 3 and later, else empty).
    pub fn slab_crc32(&self) -> &[u32] {
        &self.header.slab_crc32
    }
}

/// Reads only the metadata of a template directory.
pub fn read_meta(dir: &Path) -> Result<TemplateMeta> {
    Ok(read_header(dir)?.meta)
}

/// Reads and checks a template directory's header.
pub fn read_header(dir: &Path) -> Result<FileHeader> {
    let hp = dir.join(HEADER);
    let text = std::fs::read_to_string(&hp).map_err(|e| Error::io(&hp, e))?;
    let h: Header =
        serde_json::from_str(&text).map_err(|e| bad(&hp, format!("not a template header: {e}")))?;
    if h.format != FORMAT {
        return Err(bad(
            &hp,
            format!("format `{}`, expected `{FORMAT}`", h.format),
        ));
    }
    if !READS.contains(&h.version) {
        return Err(bad(
            &hp,
            format!(
                "template format version {} is not supported (this build reads versions {READS:?})",
                h.version
            ),
        ));
    }
    let kv_dtype = storage_dtype(&h.kv_dtype).map_err(|e| bad(&hp, e.to_string()))?;
    let mode: CacheMode = h.cache_mode.parse().map_err(|e: String| bad(&hp, e))?;
    let layout = TemplateLayout {
        steps: h.steps,
        blocks: h.blocks,
        tokens: h.tokens,
        hidden: h.hidden,
        latent_channels: h.latent_channels,
        dtype: kv_dtype,
        mode,
        heads: h.heads,
        step_stride: h.kv_step_stride,
    };
    layout.check().map_err(|e| bad(&hp, e.to_string()))?;
    let checks = match h.version {
        3.. => h.slab_crc32.len() == layout.slab_count() + 1,
        _ => h.crc32.is_some(),
    };
    if !checks {
        return Err(bad(&hp, "the header's checksums do not match its layout"));
    }
    Ok(FileHeader {
        meta: h.meta.clone(),
        layout,
        header: h,
    })
}

/// Reads the data of the template at `dir` (whose header is `h`) into `dst`, checking
/// every slab's checksum as it arrives: a corrupt file is an error naming the slab,
/// and `dst` must then not be used.
pub fn read_into(dir: &Path, h: &FileHeader, dst: &HostSlice) -> Result<()> {
    let l = &h.layout;
    let dp = dir.join(DATA);
    let mut f = std::fs::File::open(&dp).map_err(|e| Error::io(&dp, e))?;
    let len = f.metadata().map_err(|e| Error::io(&dp, e))?.len() as usize;
    if len != h.header.data_bytes || len != l.total_bytes() || dst.len() != len {
        return Err(bad(
            &dp,
            format!(
                "{len} bytes, the header says {} and the layout {}",
                h.header.data_bytes,
                l.total_bytes()
            ),
        ));
    }
    if !dst.writable() {
        return Err(Error::Invalid(
            "reading a template into read-only memory".into(),
        ));
    }
    // SAFETY: writable and of the right length; the caller gave it to this read alone.
    let out = unsafe { dst.bytes_mut() };
    for (i, r) in regions(l).enumerate() {
        let part = &mut out[r];
        f.read_exact(part).map_err(|e| Error::io(&dp, e))?;
        if let Some(&want) = h.header.slab_crc32.get(i) {
            check_region(&dp, l, i, crc32fast::hash(part), want)?;
        }
    }
    if let Some(want) = h.header.crc32 {
        let got = crc32fast::hash(out);
        if got != want {
            return Err(bad(
                &dp,
                format!(
                    "checksum mismatch (crc32 {got:08x}, header {want:08x}): the file is corrupt"
                ),
            ));
        }
    }
    Ok(())
}

/// The K/V slabs of a template on disk, read one at a time (the disk tier streamed by
/// a loader thread, `denoised_runtime::cpu::stream`), bypassing the page cache where
/// the filesystem allows ([`DirectFile`]): each slab is checked against its checksum
/// as it arrives, so a corrupt slab is an error, never data.
pub struct SlabFile {
    file: DirectFile,
    path: std::path::PathBuf,
    header: FileHeader,
}

impl SlabFile {
    /// Opens the template at `dir` (a version 3 or later file: one checksum per slab).
    pub fn open(dir: &Path) -> Result<Self> {
        let header = read_header(dir)?;
        let path = dir.join(DATA);
        if header.header.version < 3 {
            return Err(bad(
                &path,
                "slab reads need a file with a checksum per slab (version 3 or later)",
            ));
        }
        let file = DirectFile::open(&path)?;
        Ok(SlabFile { file, path, header })
    }

    pub fn layout(&self) -> &TemplateLayout {
        &self.header.layout
    }

    /// The file, for benchmarks (dropping its pages from the page cache).
    pub fn file(&self) -> &DirectFile {
        &self.file
    }
}

impl denoised_runtime::cpu::stream::SlabRead for SlabFile {
    fn read(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let l = &self.header.layout;
        if index >= l.slab_count() || dst.len() != l.slab_bytes() {
            return Err(Error::Invalid(format!(
                "slab {index} of {} bytes is not in this template",
                dst.len()
            )));
        }
        let offset = (index * l.slab_bytes()) as u64;
        let got = self.file.read_crc(offset, dst)?;
        check_region(
            &self.path,
            l,
            index,
            got,
            self.header.header.slab_crc32[index],
        )
    }
}

/// Checks region `i` of a template file (a slab, or past the slabs the latents)
/// against its checksum, naming it when they differ.
fn check_region(path: &Path, l: &TemplateLayout, i: usize, got: u32, want: u32) -> Result<()> {
    if got == want {
        return Ok(());
    }
    let per = l.slabs_per_step();
    let what = if i < l.slab_count() {
        format!("slab (step {}, block {})", i / per * l.step_stride, i % per)
    } else {
        "the latents".to_string()
    };
    Err(bad(
        path,
        format!(
            "checksum mismatch in {what} (crc32 {got:08x}, header {want:08x}): the file is corrupt"
        ),
    ))
}

/// A template read from disk: the cache (its image as the file holds it), what it
/// was captured from, and the dtype its K/V are stored in.
pub struct Loaded {
    pub cache: TemplateCache,
    pub meta: TemplateMeta,
    pub kv_dtype: DType,
}

/// Loads a template and checks it was made by `model` with the layout `expected` (in
/// any storage dtype and cache mode).
pub fn load(dir: &Path, model: &str, expected: &TemplateLayout) -> Result<Loaded> {
    let h = read_header(dir)?;
    let got = h.layout;
    if h.meta.model != model {
        return Err(bad(
            dir,
            format!(
                "template was captured by model `{}`, not by the loaded model `{model}`",
                h.meta.model
            ),
        ));
    }
    if !got.fits(expected) {
        return Err(bad(
            dir,
            format!(
                "template is for {} tokens x {} steps ({}x{} pixels), the request needs {} tokens x {} steps",
                got.tokens, got.steps, h.meta.width, h.meta.height, expected.tokens, expected.steps
            ),
        ));
    }
    let got = TemplateLayout {
        heads: expected.heads,
        ..got
    };
    let image = HostSlice::zeroed(got.total_bytes())?;
    read_into(dir, &h, &image)?;
    Ok(Loaded {
        cache: TemplateCache::view(got, image)?,
        meta: h.meta,
        kv_dtype: got.dtype,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flux::FluxConfig;
    use denoised_runtime::Tensor;

    fn sample() -> (TemplateCache, TemplateMeta) {
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, 2, DType::F32);
        let mut c = TemplateCache::new(l).unwrap();
        for s in 0..2 {
            for b in 0..l.blocks {
                let v = (0..4 * 128)
                    .map(|i| (s * 1000 + b * 100 + i) as f32)
                    .collect();
                c.set_slab(s, b, &Tensor::new([4, 128], v).unwrap())
                    .unwrap();
            }
            c.set_latent(s, &Tensor::new([4, 64], vec![s as f32; 256]).unwrap())
                .unwrap();
        }
        c.mark_complete();
        let meta = TemplateMeta {
            model: "m1".into(),
            height: 8,
            width: 8,
            steps: 2,
            guidance: 30.0,
            seed: 1,
            prompt: "".into(),
            adapters: String::new(),
        };
        (c, meta)
    }

    #[test]
    fn bf16_storage_halves_the_kv_and_keeps_latents_exact() {
        let (mut c, meta) = sample();
        // Latents that bf16 cannot hold exactly.
        c.set_latent(1, &Tensor::new([4, 64], vec![1.0 + 1e-6; 256]).unwrap())
            .unwrap();
        let l = *c.layout();
        let (d32, d16) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        save(d32.path(), &c, &meta, DType::F32).unwrap();
        save(d16.path(), &c, &meta, DType::BF16).unwrap();
        let size = |d: &tempfile::TempDir| std::fs::metadata(d.path().join(DATA)).unwrap().len();
        let (kv, lat) = (
            (l.slab_count() * l.slab_elems()) as u64,
            (l.steps * l.tokens * l.latent_channels) as u64,
        );
        assert_eq!(
            (size(&d32), size(&d16)),
            (4 * kv + 4 * lat, 2 * kv + 4 * lat)
        );
        let back = load(d16.path(), "m1", &l).unwrap();
        assert_eq!(back.kv_dtype, DType::BF16);
        let round = |t: &Tensor| -> Vec<f32> {
            t.data()
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect()
        };
        assert_eq!(
            back.cache.slab(1, 3).unwrap().data(),
            &round(&c.slab(1, 3).unwrap())[..]
        );
        assert_eq!(back.cache.latent(1).unwrap(), c.latent(1).unwrap());
        assert_eq!(load(d32.path(), "m1", &l).unwrap().kv_dtype, DType::F32);

        // A header whose dtype does not match the data's size is refused.
        let hp = d16.path().join(HEADER);
        let text = std::fs::read_to_string(&hp)
            .unwrap()
            .replace("\"kv_dtype\": \"bf16\"", "\"kv_dtype\": \"f32\"");
        std::fs::write(&hp, text).unwrap();
        let e = load(d16.path(), "m1", &l).err().unwrap().to_string();
        assert!(e.contains("bytes, the header says"), "{e}");
        assert!(save(d16.path(), &c, &meta, DType::F16).is_err());
    }

    #[test]
    fn fp8_files_hold_quantised_slabs_with_their_scales() {
        let (c, meta) = sample();
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &c, &meta, DType::F8E4M3).unwrap();
        let l = *c.layout();
        let back = load(dir.path(), "m1", &l).unwrap();
        assert_eq!(back.kv_dtype, DType::F8E4M3);
        let bl = *back.cache.layout();
        // A quarter of the f32 bytes, plus a scale per (K|V, head) per slab.
        assert_eq!(bl.slab_bytes(), l.slab_elems() + 8 * l.heads);
        let v = c.slab(1, 3).unwrap();
        let (q, scales) = denoised_runtime::fp8::quantize(v.data(), 128, 2 * l.heads);
        let want = denoised_runtime::fp8::dequantize(&q, 128, &scales);
        assert_eq!(back.cache.slab(1, 3).unwrap().data(), &want[..]);
        assert_eq!(back.cache.latent(1).unwrap(), c.latent(1).unwrap());
        // fp8 block outputs (Y mode) are refused.
        let y8 = TemplateLayout {
            mode: CacheMode::Y,
            ..bl
        };
        let e = TemplateCache::new(y8).unwrap_err().to_string();
        assert!(e.contains("fp8 templates cache K/V"), "{e}");
    }

    #[test]
    fn version_1_files_are_f32_with_one_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let (c, meta) = sample();
        save(dir.path(), &c, &meta, DType::F32).unwrap();
        let hp = dir.path().join(HEADER);
        let mut h: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&hp).unwrap()).unwrap();
        let data = std::fs::read(dir.path().join(DATA)).unwrap();
        h["version"] = 1.into();
        h.as_object_mut().unwrap().remove("kv_dtype");
        h.as_object_mut().unwrap().remove("slab_crc32");
        h["crc32"] = crc32fast::hash(&data).into();
        std::fs::write(&hp, h.to_string()).unwrap();
        let back = load(dir.path(), "m1", c.layout()).unwrap();
        assert_eq!(back.kv_dtype, DType::F32);
        assert_eq!(back.cache.slab(1, 2).unwrap(), c.slab(1, 2).unwrap());
        // Its one checksum still catches a flipped byte.
        let mut bad = data.clone();
        bad[7] ^= 4;
        std::fs::write(dir.path().join(DATA), &bad).unwrap();
        let e = load(dir.path(), "m1", c.layout())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
    }

    #[test]
    fn round_trip_and_rejections() {
        let dir = tempfile::tempdir().unwrap();
        let (c, meta) = sample();
        save(dir.path(), &c, &meta, DType::F32).unwrap();
        let l = *c.layout();
        let Loaded {
            cache: back,
            meta: m,
            ..
        } = load(dir.path(), "m1", &l).unwrap();
        assert_eq!(m, meta);
        assert_eq!(back.slab(1, 3).unwrap(), c.slab(1, 3).unwrap());
        assert_eq!(back.latent(1).unwrap(), c.latent(1).unwrap());

        let e = load(dir.path(), "other-model", &l)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("other-model") && e.contains("m1"), "{e}");
        let e = load(dir.path(), "m1", &TemplateLayout { tokens: 16, ..l })
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("16 tokens"), "{e}");

        // Flip one byte: its slab's checksum catches it, and names the slab.
        let p = dir.path().join(DATA);
        let good = std::fs::read(&p).unwrap();
        let mut bytes = good.clone();
        let at = l.slab_offset(1, 2) + 100;
        bytes[at] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let e = load(dir.path(), "m1", &l).err().unwrap().to_string();
        assert!(
            e.contains("checksum mismatch in slab (step 1, block 2)"),
            "{e}"
        );
        let mut bytes = good.clone();
        bytes[l.latent_offset(1) + 3] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let e = load(dir.path(), "m1", &l).err().unwrap().to_string();
        assert!(e.contains("in the latents"), "{e}");
        // Truncate it.
        std::fs::write(&p, &bytes[..100]).unwrap();
        assert!(load(dir.path(), "m1", &l)
            .err()
            .unwrap()
            .to_string()
            .contains("100 bytes"));

        // Another version.
        let hp = dir.path().join(HEADER);
        let text = std::fs::read_to_string(&hp)
            .unwrap()
            .replace(&format!("\"version\": {VERSION}"), "\"version\": 99");
        std::fs::write(&hp, text).unwrap();
        assert!(load(dir.path(), "m1", &l)
            .err()
            .unwrap()
            .to_string()
            .contains("version 99"));
    }

    #[test]
    fn y_mode_templates_round_trip_with_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, 2, DType::F32)
            .with_mode(CacheMode::Y);
        let mut c = TemplateCache::new(l).unwrap();
        for s in 0..2 {
            for b in 0..l.slabs_per_step() {
                let v = (0..4 * 64)
                    .map(|i| (s * 1000 + b * 100 + i) as f32)
                    .collect();
                c.set_slab(s, b, &Tensor::new([4, 64], v).unwrap()).unwrap();
            }
            c.set_latent(s, &Tensor::new([4, 64], vec![s as f32; 256]).unwrap())
                .unwrap();
        }
        c.mark_complete();
        let (_, meta) = sample();
        save(dir.path(), &c, &meta, DType::F32).unwrap();
        assert_eq!(read_header(dir.path()).unwrap().layout, l);
        // Expected as a KV layout: the file's own mode wins (it is per template).
        let back = load(
            dir.path(),
            "m1",
            &TemplateLayout {
                mode: CacheMode::Kv,
                ..l
            },
        )
        .unwrap();
        assert_eq!(back.cache.layout().mode, CacheMode::Y);
        assert_eq!(back.cache.slab(1, 2).unwrap(), c.slab(1, 2).unwrap());
        // A flipped byte in the last slab is named.
        let p = dir.path().join(DATA);
        let mut bytes = std::fs::read(&p).unwrap();
        let bl = back.cache.layout();
        bytes[bl.slab_offset(1, bl.slabs_per_step() - 1) + 3] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let e = load(dir.path(), "m1", &l).err().unwrap().to_string();
        let last = bl.slabs_per_step() - 1;
        assert!(e.contains(&format!("slab (step 1, block {last})")), "{e}");
    }
}
