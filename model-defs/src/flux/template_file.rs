//! Template caches on disk: a versioned header, a flat data file, and a checksum.
//!
//! A template directory holds `template.json` (format name and version, the model
//! fingerprint, resolution, steps, guidance, the layout, and the CRC-32 of the data) and
//! `cache.bin` (the flat image described by [`TemplateLayout`]: K|V slabs step-major,
//! then the latents, little-endian f32). Loading refuses a file of another format
//! version, another model, another resolution or schedule, or with a bad checksum, and
//! says which; a silently wrong cache would produce silently wrong edits.

use std::io::{BufWriter, Read, Write};
use std::path::Path;

use denoised_runtime::{DType, Error, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::template::{TemplateCache, TemplateLayout};

pub const FORMAT: &str = "denoised-template";
pub const VERSION: u32 = 1;
const HEADER: &str = "template.json";
const DATA: &str = "cache.bin";

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
    data_bytes: usize,
    crc32: u32,
}

fn bad(dir: &Path, reason: impl Into<String>) -> Error {
    Error::BadConfig {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// Writes `cache` with `meta` to `dir` (created if needed).
pub fn save(dir: &Path, cache: &TemplateCache, meta: &TemplateMeta) -> Result<()> {
    if !cache.is_complete() {
        return Err(Error::Invalid(
            "cannot save an incomplete template cache".into(),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let l = *cache.layout();
    let data_path = dir.join(DATA);
    let file = std::fs::File::create(&data_path).map_err(|e| Error::io(&data_path, e))?;
    let mut w = BufWriter::new(file);
    let mut crc = crc32fast::Hasher::new();
    let mut put = |t: &Tensor| -> Result<()> {
        let bytes: Vec<u8> = t.data().iter().flat_map(|v| v.to_le_bytes()).collect();
        crc.update(&bytes);
        w.write_all(&bytes).map_err(|e| Error::io(&data_path, e))
    };
    for s in 0..l.steps {
        for b in 0..l.blocks {
            put(cache.kv(s, b)?)?;
        }
    }
    for s in 0..l.steps {
        put(cache.latent(s)?)?;
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
        data_bytes: l.total_bytes(),
        crc32: crc.finalize(),
    };
    let hp = dir.join(HEADER);
    let text = serde_json::to_string_pretty(&header).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(&hp, text).map_err(|e| Error::io(&hp, e))
}

/// Reads only the metadata of a template directory.
pub fn read_meta(dir: &Path) -> Result<TemplateMeta> {
    Ok(read_header(dir)?.meta)
}

fn read_header(dir: &Path) -> Result<Header> {
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
    if h.version != VERSION {
        return Err(bad(
            &hp,
            format!(
                "template format version {} is not supported (this build reads version {VERSION})",
                h.version
            ),
        ));
    }
    Ok(h)
}

/// Loads a template and checks it was made by `model` with the layout `expected`.
pub fn load(
    dir: &Path,
    model: &str,
    expected: &TemplateLayout,
) -> Result<(TemplateCache, TemplateMeta)> {
    let h = read_header(dir)?;
    if h.meta.model != model {
        return Err(bad(
            dir,
            format!(
                "template was captured by model `{}`, not by the loaded model `{model}`",
                h.meta.model
            ),
        ));
    }
    let got = TemplateLayout {
        steps: h.steps,
        blocks: h.blocks,
        tokens: h.tokens,
        hidden: h.hidden,
        latent_channels: h.latent_channels,
        dtype: DType::F32,
    };
    if got != *expected {
        return Err(bad(
            dir,
            format!(
                "template is for {} tokens x {} steps ({}x{} pixels), the request needs {} tokens x {} steps",
                got.tokens, got.steps, h.meta.width, h.meta.height, expected.tokens, expected.steps
            ),
        ));
    }
    let dp = dir.join(DATA);
    let mut bytes = Vec::with_capacity(h.data_bytes);
    std::fs::File::open(&dp)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| Error::io(&dp, e))?;
    if bytes.len() != h.data_bytes || bytes.len() != got.total_bytes() {
        return Err(bad(
            &dp,
            format!("{} bytes, the header says {}", bytes.len(), h.data_bytes),
        ));
    }
    let crc = crc32fast::hash(&bytes);
    if crc != h.crc32 {
        return Err(bad(
            &dp,
            format!(
                "checksum mismatch (crc32 {crc:08x}, header {:08x}): the file is corrupt",
                h.crc32
            ),
        ));
    }
    let floats = |off: usize, n: usize| -> Vec<f32> {
        bytes[off..off + 4 * n]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect()
    };
    let mut cache = TemplateCache::new(got);
    for s in 0..got.steps {
        for b in 0..got.blocks {
            let t = Tensor::new(
                [got.tokens, 2 * got.hidden],
                floats(got.kv_offset(s, b), got.kv_slab_elems()),
            )?;
            cache.set_kv(s, b, t)?;
        }
        let lat = Tensor::new(
            [got.tokens, got.latent_channels],
            floats(got.latent_offset(s), got.tokens * got.latent_channels),
        )?;
        cache.set_latent(s, lat)?;
    }
    Ok((cache, h.meta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flux::FluxConfig;

    fn sample() -> (TemplateCache, TemplateMeta) {
        let l = TemplateLayout::for_model(&FluxConfig::tiny(), 4, 2, DType::F32);
        let mut c = TemplateCache::new(l);
        for s in 0..2 {
            for b in 0..l.blocks {
                let v = (0..4 * 128)
                    .map(|i| (s * 1000 + b * 100 + i) as f32)
                    .collect();
                c.set_kv(s, b, Tensor::new([4, 128], v).unwrap()).unwrap();
            }
            c.set_latent(s, Tensor::new([4, 64], vec![s as f32; 256]).unwrap())
                .unwrap();
        }
        let meta = TemplateMeta {
            model: "m1".into(),
            height: 8,
            width: 8,
            steps: 2,
            guidance: 30.0,
            seed: 1,
            prompt: "".into(),
        };
        (c, meta)
    }

    #[test]
    fn round_trip_and_rejections() {
        let dir = tempfile::tempdir().unwrap();
        let (c, meta) = sample();
        save(dir.path(), &c, &meta).unwrap();
        let l = *c.layout();
        let (back, m) = load(dir.path(), "m1", &l).unwrap();
        assert_eq!(m, meta);
        assert_eq!(back.kv(1, 3).unwrap(), c.kv(1, 3).unwrap());
        assert_eq!(back.latent(1).unwrap(), c.latent(1).unwrap());

        let e = load(dir.path(), "other-model", &l).unwrap_err().to_string();
        assert!(e.contains("other-model") && e.contains("m1"), "{e}");
        let e = load(dir.path(), "m1", &TemplateLayout { tokens: 16, ..l })
            .unwrap_err()
            .to_string();
        assert!(e.contains("16 tokens"), "{e}");

        // Flip one byte: the checksum catches it.
        let p = dir.path().join(DATA);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[100] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let e = load(dir.path(), "m1", &l).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        // Truncate it.
        std::fs::write(&p, &bytes[..100]).unwrap();
        assert!(load(dir.path(), "m1", &l)
            .unwrap_err()
            .to_string()
            .contains("100 bytes"));

        // Another version.
        let hp = dir.path().join(HEADER);
        let text = std::fs::read_to_string(&hp)
            .unwrap()
            .replace("\"version\": 1", "\"version\": 99");
        std::fs::write(&hp, text).unwrap();
        assert!(load(dir.path(), "m1", &l)
            .unwrap_err()
            .to_string()
            .contains("version 99"));
    }
}
