//! The prompt-embedding cache: a preprocess process keeps the text encoders' outputs of
//! the prompts it has encoded, so a repeated prompt (edits of one template mostly reuse
//! a handful) skips both encoders. On a CPU T5-XXL at 512 tokens is seconds of work; a
//! hit is a copy of its output (8 MB for FLUX.1).
//!
//! Keyed by (model fingerprint, prompt, max_sequence_length): what the embeddings are a
//! function of. Bounded by `[pipeline] prompt_cache_bytes`, least recently used out.

use std::sync::Arc;

use denoised_runtime::Tensor;

use crate::lru::ByteLru;

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct PromptKey {
    model: String,
    prompt: String,
    max_sequence_length: usize,
}

/// A prompt's text-encoder outputs.
pub struct PromptEmbedding {
    /// T5's `[max_sequence_length, joint_attention_dim]`.
    pub embeds: Tensor,
    /// CLIP's pooled output.
    pub pooled: Vec<f32>,
    /// Whether the prompt was cut to the encoders' maximum length.
    pub truncated: bool,
}

pub struct PromptCache {
    lru: ByteLru<PromptKey, PromptEmbedding>,
}

impl PromptCache {
    /// A cache of `bytes` (0: none).
    pub fn new(bytes: usize) -> Self {
        PromptCache {
            lru: ByteLru::new(bytes),
        }
    }

    fn key(model: &str, prompt: &str, max_sequence_length: usize) -> PromptKey {
        PromptKey {
            model: model.into(),
            prompt: prompt.into(),
            max_sequence_length,
        }
    }

    pub fn get(
        &self,
        model: &str,
        prompt: &str,
        max_sequence_length: usize,
    ) -> Option<Arc<PromptEmbedding>> {
        self.lru.get(&Self::key(model, prompt, max_sequence_length))
    }

    pub fn insert(
        &self,
        model: &str,
        prompt: &str,
        max_sequence_length: usize,
        e: PromptEmbedding,
    ) {
        let bytes = 4 * (e.embeds.len() + e.pooled.len()) + prompt.len() + model.len();
        let key = Self::key(model, prompt, max_sequence_length);
        self.lru.insert(key, Arc::new(e), bytes);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.lru.bytes()
    }
}

impl Default for PromptCache {
    /// `[pipeline] prompt_cache_bytes`' default.
    fn default() -> Self {
        let c = denoised_runtime::config::PipelineConfig::default();
        PromptCache::new(c.prompt_cache_bytes as usize)
    }
}
