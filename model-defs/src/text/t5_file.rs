//! A T5 encoder in one file: transformers' names in a safetensors file (ComfyUI's
//! `t5xxl_fp16.safetensors`, `t5xxl_fp8_e4m3fn.safetensors`), or llama.cpp's in a GGUF
//! file (`enc.blk.N.attn_q.weight`, as city96's T5 quantisations name them).
//!
//! [`T5File`] is a [`Source`] of transformers' names; the config comes from the model
//! directory's `text_encoder_2/config.json`, and the shapes are checked against it.
//! The CPU text encoder computes in f32 host tensors, so a quantised or fp8 file is
//! dequantised once at load.

use std::path::Path;

use denoised_runtime::checkpoint::{self, TensorFile};
use denoised_runtime::{Error, Result, Tensor};

use crate::flux::weights::{released, Source};

pub struct T5File {
    file: Box<dyn TensorFile>,
    /// llama.cpp's names (a GGUF file) rather than transformers'.
    llama: bool,
}

impl T5File {
    pub fn open(path: &Path) -> Result<Self> {
        let file = checkpoint::open(path)?;
        let llama = file.info("token_embd.weight").is_some();
        if !llama
            && file
                .info("encoder.block.0.layer.0.SelfAttention.q.weight")
                .is_none()
        {
            return Err(Error::BadCheckpoint {
                path: path.to_path_buf(),
                reason: format!(
                    "not a T5 encoder: no `encoder.block.0.layer.0.SelfAttention.q.weight` (transformers' names) or `token_embd.weight` (llama.cpp's); it has {}",
                    checkpoint::first_few(file.names().iter().map(String::as_str).collect())
                ),
            });
        }
        Ok(T5File { file, llama })
    }

    /// `llama.cpp` (a GGUF's `enc.blk.N.*`) or `transformers`.
    pub fn layout(&self) -> &'static str {
        match self.llama {
            true => "llama.cpp",
            false => "transformers",
        }
    }

    pub fn file(&self) -> &dyn TensorFile {
        self.file.as_ref()
    }

    /// The file's key of transformers' tensor `name`.
    pub fn key_of(&self, name: &str) -> String {
        if !self.llama {
            return name.to_string();
        }
        if name == "shared.weight" || name == "encoder.embed_tokens.weight" {
            return "token_embd.weight".into();
        }
        if name == "encoder.final_layer_norm.weight" {
            return "enc.output_norm.weight".into();
        }
        // encoder.block.{i}.layer.{l}.{module}.weight
        let p: Vec<&str> = name.split('.').collect();
        let (Some(i), Some(l)) = (p.get(2), p.get(4)) else {
            return name.to_string();
        };
        let tail = p[5..].join(".");
        let layer = match (*l, tail.as_str()) {
            ("0", "layer_norm.weight") => "attn_norm",
            ("0", "SelfAttention.q.weight") => "attn_q",
            ("0", "SelfAttention.k.weight") => "attn_k",
            ("0", "SelfAttention.v.weight") => "attn_v",
            ("0", "SelfAttention.o.weight") => "attn_o",
            ("0", "SelfAttention.relative_attention_bias.weight") => "attn_rel_b",
            ("1", "layer_norm.weight") => "ffn_norm",
            ("1", "DenseReluDense.wi_0.weight") => "ffn_gate",
            ("1", "DenseReluDense.wi_1.weight") => "ffn_up",
            ("1", "DenseReluDense.wo.weight") => "ffn_down",
            _ => return name.to_string(),
        };
        format!("enc.blk.{i}.{layer}.weight")
    }

    pub fn contains(&self, name: &str) -> bool {
        self.file.info(&self.key_of(name)).is_some()
    }

    /// Fails on keys of the file that none of `used` (transformers' names) maps to.
    pub fn check_all_used(&self, used: &[String]) -> Result<()> {
        let mapped: std::collections::BTreeSet<String> =
            used.iter().map(|n| self.key_of(n)).collect();
        let names = self.file.names();
        let extra: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| !mapped.contains(*n))
            .collect();
        if extra.is_empty() {
            return Ok(());
        }
        Err(Error::BadCheckpoint {
            path: self.file.path().to_path_buf(),
            reason: format!(
                "keys no T5 encoder of the directory's text_encoder_2/config.json has: {}",
                checkpoint::first_few(extra)
            ),
        })
    }
}

impl Source for T5File {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let key = self.key_of(name);
        let t = self.file.stored(&key)?.to_f32()?;
        if t.shape() != shape {
            return Err(Error::BadCheckpoint {
                path: self.file.path().to_path_buf(),
                reason: format!(
                    "`{key}` has shape {:?}; text_encoder_2/config.json needs {shape:?}",
                    t.shape()
                ),
            });
        }
        Ok(t)
    }

    fn release(&self) {
        released(self.file.path(), self.file.release_pages());
    }
}
