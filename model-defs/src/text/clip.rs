//! `CLIPTextModel` (transformers) on the CPU: the encoder whose pooled output becomes
//! FLUX's `pooled_prompt_embeds`.
//!
//! FLUX only uses `pooler_output`; `last_hidden_state` is returned as well because it
//! costs nothing extra and the fixtures pin it, which localises a bug to a layer.
//! The architecture is fixed by what FLUX ships (CLIP-L): pre-LN blocks, quick_gelu,
//! causal self-attention, learned absolute positions, no attention mask (the
//! pipeline passes none; causality alone keeps padding from reaching the pooled
//! token). Config options that would change the math are rejected at load.

use std::path::Path;

use denoised_runtime::{Error, Result, Tensor, WeightStore};
use serde::{Deserialize, Serialize};

use denoised_runtime::cpu::text::quick_gelu;

use super::ops::{
    attention, embed, layer_norm, load_tensor, load_vec, read_json, Linear, Mask, Qkv,
};
use crate::flux::weights::{Counting, Seeded, Source};

/// `CLIPTextConfig` fields that matter for the forward pass, as in `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// transformers' default is 49407; FLUX's CLIP-L config says 2, which selects
    /// the legacy pooling (see [`ClipTextModel::pooled_index`]).
    #[serde(default = "default_eos")]
    pub eos_token_id: i64,
    #[serde(default)]
    pub model_type: Option<String>,
}

fn default_act() -> String {
    "quick_gelu".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_eos() -> i64 {
    49407
}

impl ClipTextConfig {
    /// `black-forest-labs/FLUX.1-Fill-dev` `text_encoder/config.json` (CLIP ViT-L/14).
    pub fn clip_l() -> Self {
        ClipTextConfig {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            hidden_act: default_act(),
            layer_norm_eps: 1e-5,
            eos_token_id: 2,
            model_type: Some("clip_text_model".into()),
        }
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let raw: serde_json::Value = read_json(path)?;
        let bad = |reason: String| Error::BadConfig {
            path: path.to_path_buf(),
            reason,
        };
        if raw.get("text_config").is_some() {
            return Err(bad(
                "this is a full CLIPConfig (text + vision); expected the text_encoder's \
                 CLIPTextConfig"
                    .into(),
            ));
        }
        let cfg: ClipTextConfig = serde_json::from_value(raw).map_err(|e| bad(e.to_string()))?;
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.model_type {
            if t != "clip_text_model" {
                return Err(format!(
                    "model_type `{t}` is not supported (expected `clip_text_model`)"
                ));
            }
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_act != "quick_gelu" {
            return Err(format!(
                "hidden_act `{}` is not supported (CLIP-L uses `quick_gelu`)",
                self.hidden_act
            ));
        }
        if !(self.layer_norm_eps > 0.0 && self.layer_norm_eps.is_finite()) {
            return Err(format!(
                "layer_norm_eps must be positive, got {}",
                self.layer_norm_eps
            ));
        }
        Ok(())
    }
}

pub(super) struct ClipLayer {
    pub(super) ln1_w: Vec<f32>,
    pub(super) ln1_b: Vec<f32>,
    /// `q_proj|k_proj|v_proj` fused: `[3d, d]`.
    pub(super) qkv: Linear,
    pub(super) out: Linear,
    pub(super) ln2_w: Vec<f32>,
    pub(super) ln2_b: Vec<f32>,
    pub(super) fc1: Linear,
    pub(super) fc2: Linear,
}

/// `CLIPTextModel` with float32 CPU weights.
pub struct ClipTextModel {
    pub(super) config: ClipTextConfig,
    pub(super) token_embedding: Tensor,
    pub(super) position_embedding: Tensor,
    pub(super) layers: Vec<ClipLayer>,
    pub(super) final_w: Vec<f32>,
    pub(super) final_b: Vec<f32>,
    /// Bytes of the weights held (f32, on the host).
    pub(super) weight_bytes: u64,
}

/// Checkpoints name parameters `text_model.…` (every published CLIP, and FLUX);
/// transformers 5 writes them without the prefix. Both load.
const PREFIX: &str = "text_model.";
/// A buffer older checkpoints store next to the weights; it is `arange(77)`.
const POSITION_IDS: &str = "embeddings.position_ids";

impl ClipTextModel {
    /// Loads a diffusers `text_encoder/` directory: `config.json` + `model.safetensors`
    /// (or shards), checking every tensor's name and shape.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ClipTextConfig::from_file(dir.join("config.json"))?;
        let store = WeightStore::open(dir, "model")?;
        let prefix = if store.contains(&format!("{PREFIX}embeddings.token_embedding.weight")) {
            PREFIX
        } else {
            ""
        };
        let mut used = Vec::new();
        let model = Self::build(config, &store, prefix, &mut used)?;
        let pos_ids = format!("{prefix}{POSITION_IDS}");
        if store.contains(&pos_ids) {
            used.push(pos_ids);
        }
        store.check_all_used(used.iter().map(|s| s.as_str()))?;
        Ok(model)
    }

    /// Seeded random weights with the fixture generator's distributions (tests,
    /// benchmarks, the built-in model).
    pub fn seeded(config: ClipTextConfig, seed: u64) -> Result<Self> {
        config.validate().map_err(Error::Invalid)?;
        Self::build(config, &Seeded { seed }, PREFIX, &mut Vec::new())
    }

    fn build(
        config: ClipTextConfig,
        src: &dyn Source,
        p: &str,
        used: &mut Vec<String>,
    ) -> Result<Self> {
        let counting = Counting::new(src);
        let src: &dyn Source = &counting;
        let c = &config;
        let d = c.hidden_size;
        let token_embedding = load_tensor(
            src,
            &format!("{p}embeddings.token_embedding.weight"),
            &[c.vocab_size, d],
            used,
        )?;
        let position_embedding = load_tensor(
            src,
            &format!("{p}embeddings.position_embedding.weight"),
            &[c.max_position_embeddings, d],
            used,
        )?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = format!("{p}encoder.layers.{i}");
            let a = format!("{l}.self_attn");
            layers.push(ClipLayer {
                ln1_w: load_vec(src, &format!("{l}.layer_norm1.weight"), d, used)?,
                ln1_b: load_vec(src, &format!("{l}.layer_norm1.bias"), d, used)?,
                qkv: Linear::load(
                    src,
                    &[
                        (&format!("{a}.q_proj"), d),
                        (&format!("{a}.k_proj"), d),
                        (&format!("{a}.v_proj"), d),
                    ],
                    d,
                    true,
                    used,
                )?,
                out: Linear::load(src, &[(&format!("{a}.out_proj"), d)], d, true, used)?,
                ln2_w: load_vec(src, &format!("{l}.layer_norm2.weight"), d, used)?,
                ln2_b: load_vec(src, &format!("{l}.layer_norm2.bias"), d, used)?,
                fc1: Linear::load(
                    src,
                    &[(&format!("{l}.mlp.fc1"), c.intermediate_size)],
                    d,
                    true,
                    used,
                )?,
                fc2: Linear::load(
                    src,
                    &[(&format!("{l}.mlp.fc2"), d)],
                    c.intermediate_size,
                    true,
                    used,
                )?,
            });
        }
        let final_w = load_vec(src, &format!("{p}final_layer_norm.weight"), d, used)?;
        let final_b = load_vec(src, &format!("{p}final_layer_norm.bias"), d, used)?;
        Ok(ClipTextModel {
            config,
            token_embedding,
            position_embedding,
            layers,
            final_w,
            final_b,
            weight_bytes: 4 * counting.elements(),
        })
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.config
    }

    /// Bytes of the weights held (f32, on the host).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// What a device copy of this model reads on the host (`text::device::ClipOn`):
    /// the token and position embeddings, without the layers. Its own
    /// [`forward`](Self::forward) is then an error.
    pub fn embeddings_only(&self) -> ClipTextModel {
        ClipTextModel {
            config: self.config.clone(),
            token_embedding: self.token_embedding.clone(),
            position_embedding: self.position_embedding.clone(),
            layers: Vec::new(),
            final_w: Vec::new(),
            final_b: Vec::new(),
            weight_bytes: 4 * (self.token_embedding.len() + self.position_embedding.len()) as u64,
        }
    }

    /// The position whose hidden state is `pooler_output`, exactly as transformers
    /// picks it. With `eos_token_id == 2` (FLUX's config) the legacy rule applies:
    /// `argmax(input_ids)`, the first maximal id, which is the first `<|endoftext|>`
    /// because it is the largest id of the vocabulary. Otherwise it is the first
    /// position equal to `eos_token_id` (0 when there is none, as torch's argmax over
    /// an all-false mask gives).
    pub fn pooled_index(&self, ids: &[i64]) -> usize {
        let mut best = 0;
        if self.config.eos_token_id == 2 {
            for (i, &id) in ids.iter().enumerate() {
                if id > ids[best] {
                    best = i;
                }
            }
        } else if let Some(i) = ids.iter().position(|&id| id == self.config.eos_token_id) {
            best = i;
        }
        best
    }

    /// Token plus position embeddings of `ids`, `[len, hidden]` (an error for a length
    /// the model does not take): the input of the first layer, on any backend.
    pub(super) fn input_embeddings(&self, ids: &[i64]) -> Result<Vec<f32>> {
        let c = &self.config;
        let (d, len) = (c.hidden_size, ids.len());
        if len == 0 || len > c.max_position_embeddings {
            return Err(Error::Invalid(format!(
                "CLIP text encoder: {len} tokens given; it takes 1 to {} (max_position_embeddings)",
                c.max_position_embeddings
            )));
        }
        let mut x = embed(&self.token_embedding, ids, "CLIP text encoder")?;
        let pos = &self.position_embedding.data()[..len * d];
        x.iter_mut().zip(pos).for_each(|(v, p)| *v += p);
        Ok(x)
    }

    /// Runs one prompt. Returns `last_hidden_state [len, hidden]` (after
    /// `final_layer_norm`) and `pooler_output [hidden]`.
    pub fn forward(&self, ids: &[i64]) -> Result<(Tensor, Vec<f32>)> {
        let c = &self.config;
        if self.layers.len() != c.num_hidden_layers {
            return Err(Error::Invalid(
                "CLIP text encoder: this host copy holds the embeddings only (its layers are on a device)"
                    .into(),
            ));
        }
        let (d, len) = (c.hidden_size, ids.len());
        let mut x = self.input_embeddings(ids)?;

        let (heads, hd) = (c.num_attention_heads, c.head_dim());
        let scale = (hd as f32).powf(-0.5);
        for l in &self.layers {
            let h = layer_norm(&x, d, &l.ln1_w, &l.ln1_b, c.layer_norm_eps);
            let qkv = l.qkv.forward(&h);
            let qkv = Qkv {
                data: &qkv,
                rs: l.qkv.out_features(),
                q: 0,
                k: d,
                v: 2 * d,
            };
            let a = attention(qkv, len, heads, hd, scale, Mask::Causal);
            add_into(&mut x, &l.out.forward(&a));

            let h = layer_norm(&x, d, &l.ln2_w, &l.ln2_b, c.layer_norm_eps);
            let mut f = l.fc1.forward(&h);
            f.iter_mut().for_each(|v| *v = quick_gelu(*v));
            add_into(&mut x, &l.fc2.forward(&f));
        }
        let x = layer_norm(&x, d, &self.final_w, &self.final_b, c.layer_norm_eps);
        let at = self.pooled_index(ids);
        let pooled = x[at * d..(at + 1) * d].to_vec();
        Ok((Tensor::new([len, d], x)?, pooled))
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
