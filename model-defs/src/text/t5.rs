//! `T5EncoderModel` (T5 v1.1, transformers) on the CPU: the encoder whose last hidden
//! state becomes FLUX's `prompt_embeds`.
//!
//! T5 differs from a textbook transformer in ways that are each easy to get wrong,
//! so they are spelled out where they happen: RMSNorm without mean or bias, attention
//! scores with no 1/sqrt(d_kv) scaling, a bucketed bidirectional relative position
//! bias that only block 0 owns and every block reuses, and a gated-GELU
//! (`gelu_new`, the tanh form) feed-forward. As in FluxFillPipeline no attention mask
//! is applied: padding tokens attend and are attended to, so the output depends on
//! the padded length (always exactly `max_sequence_length`).

use std::path::Path;

use denoised_runtime::{Error, Result, Tensor, WeightStore};
use serde::{Deserialize, Serialize};

use denoised_runtime::cpu::text::gelu_new;

use super::ops::{attention, embed, load_tensor, load_vec, read_json, rms_norm, Linear, Mask, Qkv};
use crate::flux::weights::{Counting, Seeded, Source};

/// `T5Config` fields that matter for the encoder, as in `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct T5Config {
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    #[serde(default = "default_buckets")]
    pub relative_attention_num_buckets: usize,
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// transformers' default is `relu` (original T5); v1.1 says `gated-gelu`.
    #[serde(default = "default_ff")]
    pub feed_forward_proj: String,
    /// Derived by transformers from `feed_forward_proj` (`gated-gelu` -> `gelu_new`).
    #[serde(default)]
    pub dense_act_fn: Option<String>,
    #[serde(default)]
    pub is_decoder: bool,
    #[serde(default)]
    pub model_type: Option<String>,
}

fn default_buckets() -> usize {
    32
}
fn default_max_distance() -> usize {
    128
}
fn default_eps() -> f64 {
    1e-6
}
fn default_ff() -> String {
    "relu".into()
}

impl T5Config {
    /// `black-forest-labs/FLUX.1-Fill-dev` `text_encoder_2/config.json` (T5 v1.1 XXL).
    pub fn t5_v1_1_xxl() -> Self {
        T5Config {
            vocab_size: 32128,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "gated-gelu".into(),
            dense_act_fn: Some("gelu_new".into()),
            is_decoder: false,
            model_type: Some("t5".into()),
        }
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let cfg: T5Config = read_json(path)?;
        cfg.validate().map_err(|reason| Error::BadConfig {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(cfg)
    }

    pub fn inner_dim(&self) -> usize {
        self.num_heads * self.d_kv
    }

    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.model_type {
            if t != "t5" {
                return Err(format!(
                    "model_type `{t}` is not supported (expected `t5`; umT5 and others differ)"
                ));
            }
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("d_ff", self.d_ff),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
        ] {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.feed_forward_proj != "gated-gelu" {
            return Err(format!(
                "feed_forward_proj `{}` is not supported (T5 v1.1 uses `gated-gelu`)",
                self.feed_forward_proj
            ));
        }
        if let Some(act) = &self.dense_act_fn {
            if act != "gelu_new" {
                return Err(format!(
                    "dense_act_fn `{act}` is not supported with gated-gelu (expected `gelu_new`)"
                ));
            }
        }
        if self.is_decoder {
            return Err("is_decoder is true; this is the encoder only".into());
        }
        let nb = self.relative_attention_num_buckets;
        if nb < 4 || nb % 2 != 0 {
            return Err(format!(
                "relative_attention_num_buckets must be even and at least 4, got {nb}"
            ));
        }
        if self.relative_attention_max_distance <= nb / 4 {
            return Err(format!(
                "relative_attention_max_distance {} must exceed num_buckets/4 = {}",
                self.relative_attention_max_distance,
                nb / 4
            ));
        }
        if !(self.layer_norm_epsilon > 0.0 && self.layer_norm_epsilon.is_finite()) {
            return Err(format!(
                "layer_norm_epsilon must be positive, got {}",
                self.layer_norm_epsilon
            ));
        }
        Ok(())
    }

    /// transformers' `_relative_position_bucket` with `bidirectional=True` for
    /// `rel = key_pos - query_pos`. Half the buckets are for keys after the query;
    /// within a half, small distances get a bucket each and larger ones share
    /// logarithmically sized buckets up to `max_distance`. The logarithm is taken in
    /// float32 as torch does, so that distances on a bucket edge (16, 32, 64 with
    /// the standard config) land where transformers puts them.
    pub fn relative_bucket(&self, rel: i64) -> usize {
        let half = self.relative_attention_num_buckets / 2;
        let max_exact = half / 2;
        let base = if rel > 0 { half } else { 0 };
        let n = rel.unsigned_abs() as usize;
        if n < max_exact {
            return base + n;
        }
        let ratio = (n as f32 / max_exact as f32).ln();
        let denom = (self.relative_attention_max_distance as f64 / max_exact as f64).ln() as f32;
        let large = max_exact + ((ratio / denom) * (half - max_exact) as f32) as usize;
        base + large.min(half - 1)
    }
}

pub(super) struct T5Block {
    pub(super) attn_norm: Vec<f32>,
    /// `q|k|v` fused: `[3*inner, d_model]`, no bias.
    pub(super) qkv: Linear,
    pub(super) o: Linear,
    pub(super) ff_norm: Vec<f32>,
    /// `wi_0|wi_1` fused: `[2*d_ff, d_model]`.
    pub(super) wi: Linear,
    pub(super) wo: Linear,
}

/// `T5EncoderModel` (v1.1) with float32 CPU weights.
pub struct T5Encoder {
    pub(super) config: T5Config,
    pub(super) embedding: Tensor,
    /// `[num_buckets, num_heads]`, from block 0.
    pub(super) relative_bias: Tensor,
    pub(super) blocks: Vec<T5Block>,
    pub(super) final_norm: Vec<f32>,
    /// Bytes of the weights held (f32, on the host).
    pub(super) weight_bytes: u64,
}

const SHARED: &str = "shared.weight";
const EMBED_TOKENS: &str = "encoder.embed_tokens.weight";

impl T5Encoder {
    /// Loads a diffusers `text_encoder_2/` directory: `config.json` and
    /// `model.safetensors` or its shards, checking every tensor's name and shape.
    /// The token embedding is `shared.weight` (tied weights are saved once) or, in
    /// checkpoints that store it under its encoder name, `encoder.embed_tokens.weight`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = T5Config::from_file(dir.join("config.json"))?;
        let store = WeightStore::open(dir, "model")?;
        let embed_name = if store.contains(SHARED) || !store.contains(EMBED_TOKENS) {
            SHARED
        } else {
            EMBED_TOKENS
        };
        let mut used = Vec::new();
        let model = Self::build(config, &store, embed_name, &mut used)?;
        // A checkpoint with both names holds the same tied matrix twice.
        if store.contains(EMBED_TOKENS) {
            used.push(EMBED_TOKENS.to_string());
        }
        store.check_all_used(used.iter().map(|s| s.as_str()))?;
        Ok(model)
    }

    /// Loads a single T5 file (see [`super::t5_file`]) of `config`'s shapes.
    pub fn load_file(path: impl AsRef<Path>, config: T5Config) -> Result<Self> {
        let file = super::t5_file::T5File::open(path.as_ref())?;
        let embed_name = if file.contains(SHARED) || !file.contains(EMBED_TOKENS) {
            SHARED
        } else {
            EMBED_TOKENS
        };
        let mut used = Vec::new();
        let model = Self::build(config, &file, embed_name, &mut used)?;
        if file.contains(EMBED_TOKENS) {
            used.push(EMBED_TOKENS.to_string());
        }
        file.check_all_used(&used)?;
        file.release();
        Ok(model)
    }

    /// Seeded random weights with the fixture generator's distributions.
    pub fn seeded(config: T5Config, seed: u64) -> Result<Self> {
        config.validate().map_err(Error::Invalid)?;
        Self::build(config, &Seeded { seed }, SHARED, &mut Vec::new())
    }

    fn build(
        config: T5Config,
        src: &dyn Source,
        embed_name: &str,
        used: &mut Vec<String>,
    ) -> Result<Self> {
        let counting = Counting::new(src);
        let src: &dyn Source = &counting;
        let c = &config;
        let (d, inner) = (c.d_model, c.inner_dim());
        let embedding = load_tensor(src, embed_name, &[c.vocab_size, d], used)?;
        let relative_bias = load_tensor(
            src,
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            &[c.relative_attention_num_buckets, c.num_heads],
            used,
        )?;
        let mut blocks = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let b = format!("encoder.block.{i}");
            let a = format!("{b}.layer.0.SelfAttention");
            let f = format!("{b}.layer.1.DenseReluDense");
            blocks.push(T5Block {
                attn_norm: load_vec(src, &format!("{b}.layer.0.layer_norm.weight"), d, used)?,
                qkv: Linear::load(
                    src,
                    &[
                        (&format!("{a}.q"), inner),
                        (&format!("{a}.k"), inner),
                        (&format!("{a}.v"), inner),
                    ],
                    d,
                    false,
                    used,
                )?,
                o: Linear::load(src, &[(&format!("{a}.o"), d)], inner, false, used)?,
                ff_norm: load_vec(src, &format!("{b}.layer.1.layer_norm.weight"), d, used)?,
                wi: Linear::load(
                    src,
                    &[
                        (&format!("{f}.wi_0"), c.d_ff),
                        (&format!("{f}.wi_1"), c.d_ff),
                    ],
                    d,
                    false,
                    used,
                )?,
                wo: Linear::load(src, &[(&format!("{f}.wo"), d)], c.d_ff, false, used)?,
            });
        }
        let final_norm = load_vec(src, "encoder.final_layer_norm.weight", d, used)?;
        Ok(T5Encoder {
            config,
            embedding,
            relative_bias,
            blocks,
            final_norm,
            weight_bytes: 4 * counting.elements(),
        })
    }

    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// Bytes of the weights held (f32, on the host).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// What a device copy of this encoder reads on the host (`text::device::T5On`):
    /// the token embedding and the position-bias table, without the layers (for
    /// T5-XXL, 0.5 GB of its 19 GB in f32). Its own [`forward`](Self::forward) is then
    /// an error.
    pub fn embeddings_only(&self) -> T5Encoder {
        T5Encoder {
            config: self.config.clone(),
            embedding: self.embedding.clone(),
            relative_bias: self.relative_bias.clone(),
            blocks: Vec::new(),
            final_norm: Vec::new(),
            weight_bytes: 4 * (self.embedding.len() + self.relative_bias.len()) as u64,
        }
    }

    /// The additive attention bias `[heads, len, len]`: block 0's
    /// `relative_attention_bias` looked up at each (query, key) bucket.
    pub fn position_bias(&self, len: usize) -> Vec<f32> {
        let heads = self.config.num_heads;
        // Buckets depend only on key - query, so look each distance up once.
        let buckets: Vec<usize> = (0..2 * len.max(1) - 1)
            .map(|k| self.config.relative_bucket(k as i64 - (len as i64 - 1)))
            .collect();
        let mut out = vec![0.0f32; heads * len * len];
        for h in 0..heads {
            for i in 0..len {
                let row = &mut out[(h * len + i) * len..(h * len + i + 1) * len];
                for (j, v) in row.iter_mut().enumerate() {
                    let bucket = buckets[j + len - 1 - i];
                    *v = self.relative_bias.data()[bucket * heads + h];
                }
            }
        }
        out
    }

    /// Token embeddings of `ids`, `[len, d_model]` (an error for no tokens): the input
    /// of the first block, on any backend.
    pub(super) fn input_embeddings(&self, ids: &[i64]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::Invalid("T5 encoder: no tokens given".into()));
        }
        embed(&self.embedding, ids, "T5 encoder")
    }

    /// Runs one (already padded) prompt: `last_hidden_state [len, d_model]`.
    pub fn forward(&self, ids: &[i64]) -> Result<Tensor> {
        let c = &self.config;
        if self.blocks.len() != c.num_layers {
            return Err(Error::Invalid(
                "T5 encoder: this host copy holds the embeddings only (its layers are on a device)"
                    .into(),
            ));
        }
        let (d, len, inner) = (c.d_model, ids.len(), c.inner_dim());
        let mut x = self.input_embeddings(ids)?;
        let bias = self.position_bias(len);
        let eps = c.layer_norm_epsilon;
        for b in &self.blocks {
            let h = rms_norm(&x, d, &b.attn_norm, eps);
            let qkv = b.qkv.forward(&h);
            let qkv = Qkv {
                data: &qkv,
                rs: 3 * inner,
                q: 0,
                k: inner,
                v: 2 * inner,
            };
            // T5 folds the 1/sqrt(d_kv) into its initialisation: scale 1.
            let a = attention(qkv, len, c.num_heads, c.d_kv, 1.0, Mask::Bias(&bias));
            add_into(&mut x, &b.o.forward(&a));

            let h = rms_norm(&x, d, &b.ff_norm, eps);
            let g = b.wi.forward(&h);
            let dff = c.d_ff;
            let mut act = vec![0.0f32; len * dff];
            for (ar, gr) in act.chunks_exact_mut(dff).zip(g.chunks_exact(2 * dff)) {
                let (gate, lin) = gr.split_at(dff);
                for ((a, &g0), &g1) in ar.iter_mut().zip(gate).zip(lin) {
                    *a = gelu_new(g0) * g1;
                }
            }
            add_into(&mut x, &b.wo.forward(&act));
        }
        let x = rms_norm(&x, d, &self.final_norm, eps);
        Tensor::new([len, d], x)
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
