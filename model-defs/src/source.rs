//! Where a model comes from: a diffusers directory on disk, or the built-in tiny model.
//!
//! The built-in model has the fixture model's config and deterministic seeded weights,
//! so the daemon and every CLI command run on a fresh machine with no model files.
//!
//! A directory's transformer, VAE and T5 can each come from a single file instead
//! ([`ComponentFiles`]: `--transformer`, `--vae`, `--text-encoder-2`): the files most
//! FLUX users hold (BFL's single files, fp8 files, GGUF quantisations). The directory
//! still gives the tokenizers, CLIP, the scheduler, and the config fields a file's
//! shapes cannot tell.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use denoised_runtime::{Backend, Error, Result};

use crate::flux::single_file::TransformerFile;
use crate::flux::{FluxConfig, FluxTransformer};

/// Seed of the built-in model's weights. Changing it changes every built-in output.
pub const BUILTIN_SEED: u64 = 0x00de_0015_ed00_0001;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Builtin,
    /// `builtin:flux-small`: seeded weights at benchmark scale (the flux-small
    /// transformer, FLUX.1's VAE, CLIP-L, a T5 of width 768); see
    /// `FluxFill::seeded_small`. For serving benchmarks without model files.
    BuiltinSmall,
    /// `builtin:t2i`: the built-in tiny model as a text-to-image (FLUX.1-dev layout:
    /// 64 input channels, guidance embedding) pipeline, same encoders and VAE.
    BuiltinT2i,
    /// `builtin:flux-small-t2i`: `builtin:flux-small` as a text-to-image pipeline.
    BuiltinSmallT2i,
    /// `builtin:flux1-fill-dev`: seeded weights at FLUX.1-Fill-dev's size (the 12B
    /// transformer, FLUX.1's VAE, CLIP-L, T5-XXL): what `bench edit` times on a GPU
    /// machine without model files. About 17e9 values to seed at load.
    BuiltinFillDev,
    /// A diffusers pipeline directory (with `transformer/`) or a transformer
    /// directory itself, and the components single files replace.
    Dir(ModelDir),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelDir {
    pub root: PathBuf,
    pub files: ComponentFiles,
}

/// Single files that replace a directory's components (`[model] transformer`, `vae`,
/// `text_encoder_2`; the CLI's `--transformer`, `--vae`, `--text-encoder-2`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComponentFiles {
    /// A FLUX transformer: BFL or diffusers layout, safetensors (bf16, f16, f32, fp8)
    /// or GGUF.
    pub transformer: Option<PathBuf>,
    /// An AutoencoderKL: BFL's `ae.safetensors` or a diffusers-layout file.
    pub vae: Option<PathBuf>,
    /// A T5 encoder: safetensors in transformers' layout, or GGUF.
    pub text_encoder_2: Option<PathBuf>,
}

impl ComponentFiles {
    pub fn is_empty(&self) -> bool {
        self == &ComponentFiles::default()
    }
}

impl FromStr for ModelSource {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(if s == "builtin" {
            ModelSource::Builtin
        } else if s == "builtin:flux-small" {
            ModelSource::BuiltinSmall
        } else if s == "builtin:t2i" {
            ModelSource::BuiltinT2i
        } else if s == "builtin:flux-small-t2i" {
            ModelSource::BuiltinSmallT2i
        } else if s == "builtin:flux1-fill-dev" {
            ModelSource::BuiltinFillDev
        } else {
            ModelSource::dir(s)
        })
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Builtin => write!(f, "builtin"),
            ModelSource::BuiltinSmall => write!(f, "builtin:flux-small"),
            ModelSource::BuiltinT2i => write!(f, "builtin:t2i"),
            ModelSource::BuiltinSmallT2i => write!(f, "builtin:flux-small-t2i"),
            ModelSource::BuiltinFillDev => write!(f, "builtin:flux1-fill-dev"),
            ModelSource::Dir(d) => {
                write!(f, "{}", d.root.display())?;
                let files = &d.files;
                for (what, p) in [
                    ("transformer", &files.transformer),
                    ("vae", &files.vae),
                    ("text_encoder_2", &files.text_encoder_2),
                ] {
                    if let Some(p) = p {
                        write!(f, " ({what} {})", p.display())?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// The `transformer/` directory of a pipeline directory, or `dir` itself when it holds
/// a transformer `config.json`.
pub fn transformer_dir(dir: &Path) -> Result<PathBuf> {
    let sub = dir.join("transformer");
    if sub.join("config.json").exists() {
        Ok(sub)
    } else if dir.join("config.json").exists() {
        Ok(dir.to_path_buf())
    } else if !dir.exists() {
        Err(Error::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "model directory does not exist",
            ),
        ))
    } else {
        Err(Error::BadConfig {
            path: dir.to_path_buf(),
            reason: "neither transformer/config.json nor config.json found (expected a diffusers model directory)".into(),
        })
    }
}

impl ModelSource {
    /// A diffusers directory with no component replaced.
    pub fn dir(root: impl Into<PathBuf>) -> Self {
        ModelSource::Dir(ModelDir {
            root: root.into(),
            files: ComponentFiles::default(),
        })
    }

    /// This source with `files` replacing its components. Only a directory's can be
    /// replaced: it gives the tokenizers, CLIP and the scheduler a file does not.
    pub fn with_files(self, files: ComponentFiles) -> Result<Self> {
        match self {
            _ if files.is_empty() => Ok(self),
            ModelSource::Dir(d) => Ok(ModelSource::Dir(ModelDir { files, ..d })),
            builtin => Err(Error::Invalid(format!(
                "single-file components ({files:?}) need a model directory (--model DIR: it gives the tokenizers, CLIP and the scheduler), not `{builtin}`"
            ))),
        }
    }

    /// `[model]` of config.toml: `source` and its single-file components.
    pub fn from_config(m: &denoised_runtime::config::ModelConfig) -> Result<Self> {
        let file = |s: &String| (!s.is_empty()).then(|| PathBuf::from(s));
        let source: ModelSource = m.source.parse().unwrap_or_else(|e| match e {});
        source.with_files(ComponentFiles {
            transformer: file(&m.transformer),
            vae: file(&m.vae),
            text_encoder_2: file(&m.text_encoder_2),
        })
    }

    /// The directory, for a directory source.
    pub fn model_dir(&self) -> Option<&ModelDir> {
        match self {
            ModelSource::Dir(d) => Some(d),
            _ => None,
        }
    }

    /// The diffusers pipeline class its directory's `model_index.json` names
    /// (`FluxFillPipeline`, `FluxKontextPipeline`, ...); `None` for a built-in model
    /// or a directory without one (a transformer directory).
    pub fn pipeline_class(&self) -> Result<Option<String>> {
        let Some(d) = self.model_dir() else {
            return Ok(None);
        };
        let path = d.root.join("model_index.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
        Ok(v["_class_name"].as_str().map(str::to_string))
    }

    /// Whether it is a FLUX.1 Kontext pipeline (its `model_index.json` says so).
    pub fn is_kontext(&self) -> Result<bool> {
        Ok(self
            .pipeline_class()?
            .is_some_and(|c| c.starts_with("FluxKontext")))
    }

    /// Which pipeline it is for, read from its configs without loading weights: what
    /// `FluxFill::load` decides (Kontext by its `model_index.json`, else by the
    /// transformer's input channels).
    pub fn pipeline_kind(&self) -> Result<crate::pipeline::flux_fill::PipelineKind> {
        use crate::pipeline::flux_fill::PipelineKind;
        if self.is_kontext()? {
            return Ok(PipelineKind::Kontext);
        }
        let c = self.transformer_config()?;
        Ok(match c.in_channels == c.out_channels() {
            true => PipelineKind::TextToImage,
            false => PipelineKind::Fill,
        })
    }

    /// Whether it is one of the seeded models at benchmark scale (`flux-small`,
    /// `flux1-fill-dev`), whose encoders and VAE are CLIP-L, a T5 (of width 768, or
    /// T5-XXL) and FLUX.1's VAE; the tiny built-ins take the fixture model's. `None`
    /// for a directory.
    pub fn builtin_small(&self) -> Option<bool> {
        match self {
            ModelSource::Builtin | ModelSource::BuiltinT2i => Some(false),
            ModelSource::BuiltinSmall
            | ModelSource::BuiltinSmallT2i
            | ModelSource::BuiltinFillDev => Some(true),
            ModelSource::Dir(_) => None,
        }
    }

    /// A short identity of the model's weights, recorded in template caches so that a
    /// cache is never used with a model it was not captured by. For a directory it
    /// hashes the transformer's config, and each weight file's size, header and first
    /// and last 64 KiB: cheap on a 24 GB checkpoint, and different for a fine-tune.
    pub fn fingerprint(&self) -> Result<String> {
        match self {
            ModelSource::Builtin => Ok(format!("builtin-flux-tiny-{BUILTIN_SEED:016x}")),
            ModelSource::BuiltinSmall => Ok(format!("seeded-flux-small-{BUILTIN_SEED:016x}")),
            ModelSource::BuiltinT2i => Ok(format!("builtin-flux-tiny-t2i-{BUILTIN_SEED:016x}")),
            ModelSource::BuiltinSmallT2i => {
                Ok(format!("seeded-flux-small-t2i-{BUILTIN_SEED:016x}"))
            }
            ModelSource::BuiltinFillDev => Ok(format!("seeded-flux1-fill-dev-{BUILTIN_SEED:016x}")),
            ModelSource::Dir(d) => {
                let mut h = crc32fast::Hasher::new();
                let mut files: Vec<PathBuf> = match &d.files.transformer {
                    Some(f) => vec![f.clone()],
                    None => {
                        let t = transformer_dir(&d.root)?;
                        std::fs::read_dir(&t)
                            .map_err(|e| Error::io(&t, e))?
                            .filter_map(|e| e.ok().map(|e| e.path()))
                            .filter(|p| {
                                p.extension()
                                    .is_some_and(|x| x == "safetensors" || x == "json")
                            })
                            .collect()
                    }
                };
                files.sort();
                for f in files {
                    hash_file_edges(&mut h, &f)?;
                }
                Ok(format!("dir-{:08x}", h.finalize()))
            }
        }
    }

    /// The transformer's config, without its weights (a single file's header is read
    /// for its shapes).
    pub fn transformer_config(&self) -> Result<FluxConfig> {
        match self {
            ModelSource::Builtin => Ok(FluxConfig::tiny()),
            ModelSource::BuiltinSmall => Ok(FluxConfig::small()),
            ModelSource::BuiltinT2i => Ok(FluxConfig::tiny().text_to_image()),
            ModelSource::BuiltinSmallT2i => Ok(FluxConfig::small().text_to_image()),
            ModelSource::BuiltinFillDev => Ok(FluxConfig::flux1_fill_dev()),
            ModelSource::Dir(d) => match &d.files.transformer {
                Some(f) => Ok(TransformerFile::open(f, d.transformer_hint().as_ref())?.config),
                None => FluxConfig::from_file(transformer_dir(&d.root)?.join("config.json")),
            },
        }
    }

    pub fn load_transformer<B: Backend>(&self, backend: B) -> Result<FluxTransformer<B>> {
        match self {
            ModelSource::Dir(d) => match &d.files.transformer {
                Some(f) => {
                    let file = TransformerFile::open(f, d.transformer_hint().as_ref())?;
                    FluxTransformer::from_source(backend, file.config.clone(), Box::new(file))
                }
                None => FluxTransformer::load(backend, transformer_dir(&d.root)?),
            },
            _ => FluxTransformer::seeded(backend, self.transformer_config()?, BUILTIN_SEED),
        }
    }
}

impl ModelDir {
    /// The directory's own transformer config, if it has one: what a single file's
    /// shapes cannot tell (its RoPE axes).
    pub fn transformer_hint(&self) -> Option<FluxConfig> {
        let dir = transformer_dir(&self.root).ok()?;
        FluxConfig::from_file(dir.join("config.json")).ok()
    }
}

/// Hashes a file's name, size, and first and last 64 KiB: cheap on a 24 GB checkpoint,
/// and different for a fine-tune.
fn hash_file_edges(h: &mut crc32fast::Hasher, f: &Path) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    const EDGE: u64 = 64 * 1024;
    let mut file = std::fs::File::open(f).map_err(|e| Error::io(f, e))?;
    let len = file.metadata().map_err(|e| Error::io(f, e))?.len();
    h.update(f.file_name().unwrap_or_default().as_encoded_bytes());
    h.update(&len.to_le_bytes());
    let mut buf = vec![0u8; EDGE.min(len) as usize];
    file.read_exact(&mut buf).map_err(|e| Error::io(f, e))?;
    h.update(&buf);
    if len > EDGE {
        // The tail, not overlapping the head.
        let tail = EDGE.min(len - EDGE);
        file.seek(SeekFrom::Start(len - tail))
            .map_err(|e| Error::io(f, e))?;
        buf.resize(tail as usize, 0);
        file.read_exact(&mut buf).map_err(|e| Error::io(f, e))?;
        h.update(&buf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_tell_models_apart() {
        let fixture = ModelSource::dir(denoised_runtime::fixtures::tiny_model_dir());
        let a = fixture.fingerprint().unwrap();
        assert_eq!(a, fixture.fingerprint().unwrap(), "stable");
        assert_ne!(a, ModelSource::Builtin.fingerprint().unwrap());
        // A copy with one weight byte changed is another model.
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("transformer");
        std::fs::create_dir(&t).unwrap();
        for e in std::fs::read_dir(denoised_runtime::fixtures::tiny_model_dir().join("transformer"))
            .unwrap()
        {
            let p = e.unwrap().path();
            std::fs::copy(&p, t.join(p.file_name().unwrap())).unwrap();
        }
        assert_eq!(
            ModelSource::dir(dir.path()).fingerprint().unwrap(),
            a,
            "same bytes, same fingerprint"
        );
        let shard = t.join("diffusion_pytorch_model-00001-of-00003.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0x40;
        std::fs::write(&shard, bytes).unwrap();
        assert_ne!(ModelSource::dir(dir.path()).fingerprint().unwrap(), a);
    }
}
