//! A transformer in one file: the single files Black Forest Labs publish
//! (`flux1-fill-dev.safetensors`, in their own key layout), ComfyUI's fp8 files (the
//! same layout under `model.diffusion_model.`, E4M3 weights, some with a per-tensor
//! `scale_weight`), GGUF quantisations of them, and diffusers-layout single files.
//!
//! [`TransformerFile`] reads the layout and the model's config off the keys and shapes
//! and is a [`Source`] of diffusers' names: each tensor the model asks for is the rows
//! of a file tensor that [`super::bfl`]'s table names, borrowed from the map in its
//! stored form (a quantised or fp8 weight stays so), so loading makes no f32 copy.
//! Every key of the file must be mapped: a file for another architecture is refused
//! with the keys nothing maps.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::Path;

use denoised_runtime::checkpoint::{self, first_few, TensorFile};
use denoised_runtime::{Error, Result, Stored, Tensor};

use super::bfl;
use super::config::FluxConfig;
use super::weights::{param_specs, released, Source};

/// The key layout of a transformer file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Black Forest Labs' original names (`double_blocks.N.img_attn.qkv`).
    Bfl,
    /// diffusers' names (`transformer_blocks.N.attn.to_q`).
    Diffusers,
}

/// Where a diffusers tensor comes from: rows of a file tensor (two ranges for the
/// final modulation's swapped halves), and the per-tensor scale of an fp8 weight.
#[derive(Clone, Debug)]
struct Origin {
    name: String,
    /// `None`: the whole tensor.
    rows: Option<Vec<Range<usize>>>,
    scale: Option<String>,
}

pub struct TransformerFile {
    file: Box<dyn TensorFile>,
    pub layout: Layout,
    /// The prefix every key carries (`model.diffusion_model.` in ComfyUI's files).
    pub prefix: String,
    pub config: FluxConfig,
    origins: HashMap<String, Origin>,
}

/// Keys a file may carry that the model does not read: ComfyUI's marker of a scaled
/// fp8 file, and its per-layer input scales (for its own fp8 matmuls; denoised
/// quantises activations itself, per token, see `Gemm::fp8`).
fn ignorable(key: &str) -> bool {
    key == "scaled_fp8" || key.ends_with(".scale_input")
}

/// The key layout of a transformer file whose keys are `names`, and the prefix they
/// carry; `None` for keys of neither layout. Read off the names alone, so it names the
/// layout of a file whose config cannot be inferred.
pub fn key_layout(names: &[String]) -> Option<(Layout, String)> {
    let layout = if bfl::is_bfl(names.iter().map(String::as_str)) {
        Layout::Bfl
    } else if names.iter().any(|n| n.starts_with("transformer_blocks.")) {
        Layout::Diffusers
    } else {
        return None;
    };
    let comfy = names
        .iter()
        .any(|n| n.starts_with("model.diffusion_model."));
    let prefix = match layout {
        Layout::Bfl if comfy => "model.diffusion_model.",
        _ => "",
    };
    Some((layout, prefix.to_string()))
}

impl TransformerFile {
    /// Opens `path` (safetensors or GGUF) and infers the config from its shapes. The
    /// shapes cannot tell the RoPE axes: they come from `hint` (the model
    /// directory's `transformer/config.json`) when its head dim agrees, else from
    /// FLUX.1's (16, 56, 56) at head dim 128.
    pub fn open(path: &Path, hint: Option<&FluxConfig>) -> Result<Self> {
        let file = checkpoint::open(path)?;
        let names = file.names();
        let bad = |reason: String| Error::BadCheckpoint {
            path: path.to_path_buf(),
            reason,
        };
        let Some((layout, prefix)) = key_layout(&names) else {
            return Err(bad(format!(
                "not a FLUX transformer: no `double_blocks.*` (BFL layout) or `transformer_blocks.*` (diffusers layout) keys; it has {}",
                first_few(names.iter().map(String::as_str).collect())
            )));
        };
        let shape = |key: &str| -> Option<Vec<usize>> {
            file.info(&format!("{prefix}{key}")).map(|(s, _)| s)
        };
        let config = infer_config(layout, &names, &prefix, &shape, hint).map_err(bad)?;
        let origins = origins(layout, &prefix, &config, |k| file.info(k).is_some());
        let mapped: BTreeSet<&str> = origins
            .values()
            .flat_map(|o| std::iter::once(o.name.as_str()).chain(o.scale.as_deref()))
            .collect();
        let unknown: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| !mapped.contains(n) && !ignorable(n))
            .collect();
        if !unknown.is_empty() {
            return Err(bad(format!(
                "keys no FLUX transformer of the inferred config ({} double, {} single blocks, {} in, {} out channels) has: {}",
                config.num_layers,
                config.num_single_layers,
                config.in_channels,
                config.out_channels(),
                first_few(unknown)
            )));
        }
        Ok(TransformerFile {
            file,
            layout,
            prefix,
            config,
            origins,
        })
    }

    pub fn file(&self) -> &dyn TensorFile {
        self.file.as_ref()
    }
}

/// The config of a transformer whose keys are `names`, from the shapes (`shape` reads
/// one by its name without the prefix).
fn infer_config(
    layout: Layout,
    names: &[String],
    prefix: &str,
    shape: &dyn Fn(&str) -> Option<Vec<usize>>,
    hint: Option<&FluxConfig>,
) -> std::result::Result<FluxConfig, String> {
    let keys: [&str; 7] = match layout {
        Layout::Bfl => [
            "img_in.weight",
            "txt_in.weight",
            "vector_in.in_layer.weight",
            "guidance_in.in_layer.weight",
            "double_blocks.0.img_attn.norm.query_norm.scale",
            "final_layer.linear.weight",
            "double_blocks.",
        ],
        Layout::Diffusers => [
            "x_embedder.weight",
            "context_embedder.weight",
            "time_text_embed.text_embedder.linear_1.weight",
            "time_text_embed.guidance_embedder.linear_1.weight",
            "transformer_blocks.0.attn.norm_q.weight",
            "proj_out.weight",
            "transformer_blocks.",
        ],
    };
    let single = match layout {
        Layout::Bfl => "single_blocks.",
        Layout::Diffusers => "single_transformer_blocks.",
    };
    let need = |k: &str, dims: usize| -> std::result::Result<Vec<usize>, String> {
        match shape(k) {
            Some(s) if s.len() == dims => Ok(s),
            Some(s) => Err(format!(
                "`{prefix}{k}` has shape {s:?}, expected {dims} dims"
            )),
            None => Err(format!("no `{prefix}{k}`: not a complete FLUX transformer")),
        }
    };
    let img_in = need(keys[0], 2)?;
    let (d, in_channels) = (img_in[0], img_in[1]);
    let joint = need(keys[1], 2)?[1];
    let pooled = need(keys[2], 2)?[1];
    let guidance_embeds = shape(keys[3]).is_some();
    let hd = need(keys[4], 1)?[0];
    let out_channels = need(keys[5], 2)?[0];
    let count = |blocks: &str| checkpoint::indexed_count(names, &format!("{prefix}{blocks}"));
    if hd == 0 || d % hd != 0 {
        return Err(format!(
            "hidden size {d} is not a multiple of the head dim {hd}"
        ));
    }
    let axes_dims_rope = match hint {
        Some(h) if h.axes_dims_rope.iter().sum::<usize>() == hd => h.axes_dims_rope.clone(),
        _ if hd == 128 => vec![16, 56, 56],
        _ => {
            return Err(format!(
                "head dim {hd}: its RoPE axes cannot be read off the shapes (FLUX.1's are 16, 56, 56 at head dim 128); give a model directory whose transformer/config.json has `axes_dims_rope`"
            ))
        }
    };
    let c = FluxConfig {
        patch_size: 1,
        in_channels,
        out_channels: Some(out_channels),
        num_layers: count(keys[6]),
        num_single_layers: count(single),
        attention_head_dim: hd,
        num_attention_heads: d / hd,
        joint_attention_dim: joint,
        pooled_projection_dim: pooled,
        guidance_embeds,
        axes_dims_rope,
    };
    c.validate()?;
    Ok(c)
}

/// Every diffusers tensor of `c`'s model and where the file holds it. `has` tells
/// whether the file has a key (an fp8 weight's `scale_weight`).
fn origins(
    layout: Layout,
    prefix: &str,
    c: &FluxConfig,
    has: impl Fn(&str) -> bool,
) -> HashMap<String, Origin> {
    let scale_of = |weight: &str| {
        let s = format!("{}.scale_weight", weight.strip_suffix(".weight")?);
        has(&s).then_some(s)
    };
    let mut m = HashMap::new();
    match layout {
        Layout::Diffusers => {
            for (name, _) in param_specs(c) {
                let key = format!("{prefix}{name}");
                let scale = scale_of(&key);
                m.insert(
                    name,
                    Origin {
                        name: key,
                        rows: None,
                        scale,
                    },
                );
            }
        }
        Layout::Bfl => {
            for l in bfl::linears(c) {
                let whole = l.parts.len() == 1 && !l.swap_halves;
                for (i, (part, _)) in l.parts.iter().enumerate() {
                    let rows = (!whole).then(|| bfl::part_rows(&l, i));
                    for suffix in ["weight", "bias"] {
                        let key = format!("{prefix}{}.{suffix}", l.name);
                        let scale = scale_of(&key);
                        m.insert(
                            format!("{part}.{suffix}"),
                            Origin {
                                name: key,
                                rows: rows.clone(),
                                scale,
                            },
                        );
                    }
                }
            }
            for (theirs, ours) in bfl::vectors(c) {
                m.insert(
                    ours,
                    Origin {
                        name: format!("{prefix}{theirs}"),
                        rows: None,
                        scale: None,
                    },
                );
            }
        }
    }
    m
}

impl Source for TransformerFile {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.stored(name, shape)?.to_f32()
    }

    fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>> {
        let o = self.origins.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.file.path().to_path_buf(),
        })?;
        let whole = self.file.stored(&o.name)?;
        let mut t = match &o.rows {
            None => whole,
            Some(ranges) => {
                let parts = ranges
                    .iter()
                    .map(|r| whole.rows(r.clone()))
                    .collect::<Result<Vec<_>>>()?;
                match <[Stored<'_>; 1]>::try_from(parts) {
                    Ok([one]) => one,
                    Err(parts) => Stored::concat_rows(&parts)?,
                }
            }
        };
        if let Some(s) = &o.scale {
            let v = self.file.stored(s)?.to_f32()?;
            let [scale] = v.data() else {
                return Err(Error::BadCheckpoint {
                    path: self.file.path().to_path_buf(),
                    reason: format!("`{s}` has {} values, expected one", v.len()),
                });
            };
            t = t.with_scale(*scale)?;
        }
        if t.shape != shape {
            return Err(Error::BadCheckpoint {
                path: self.file.path().to_path_buf(),
                reason: format!(
                    "`{}` gives `{name}` the shape {:?}, the inferred config {shape:?}",
                    o.name, t.shape
                ),
            });
        }
        t.name = name.to_string();
        Ok(t)
    }

    fn release(&self) {
        released(self.file.path(), self.file.release_pages());
    }
}
