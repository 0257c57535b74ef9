//! Text encoders and tokenizers of FLUX.1: CLIP-L (pooled) and T5 v1.1.
//!
//! FluxFillPipeline encodes each prompt twice: CLIP gives `pooled_prompt_embeds`
//! (the pooled vector feeds the transformer's time/text embedding) and T5 gives
//! `prompt_embeds` (the text tokens of the joint attention). The CPU models here are
//! the reference and match transformers on the fixtures; [`device`] runs the same
//! forwards on any `Backend` (a GPU's).
//!
//! - [`tokenizer`]: [`ClipTokenizer`] and [`T5Tokenizer`] (padding, truncation).
//! - [`clip`]: [`ClipTextModel`], `last_hidden_state` and `pooler_output`.
//! - [`t5`]: [`T5Encoder`], `last_hidden_state` (= `prompt_embeds`).
//! - [`device`]: [`device::T5On`] and [`device::ClipOn`] on a backend.

pub mod clip;
pub mod device;
mod ops;
pub mod t5;
pub mod t5_file;
pub mod tokenizer;

pub use clip::{ClipTextConfig, ClipTextModel};
pub use t5::{T5Config, T5Encoder};
pub use tokenizer::{ClipTokenizer, T5Tokenizer, TokenIds, CLIP_MAX_LENGTH, T5_DEFAULT_MAX_LENGTH};
