//! Device bytes of the pre- and postprocess stages (CLIP, T5 and the VAE encoder; the
//! VAE decoder) when they share a GPU with a denoise worker: its memory budget sets
//! them aside before it gives the rest to templates (docs/operations.md, "Device
//! memory").
//!
//! Computed from the components' configs, so the denoise worker needs none of their
//! weights: parameter counts (the embedding tables stay on the host) in the device
//! dtype, plus each stage's largest workspace for an image of `[server] max_pixels`.
//! The VAE's workspace is a bound on what `DenseVae` keeps alive at once (a test
//! checks it against the emulated device's peak): a few full-resolution activations
//! and one chunk of patch matrix.

use denoised_runtime::Result;

use super::components::text_configs;
use super::flux_fill::vae_config;
use crate::source::ModelSource;
use crate::text::{ClipTextConfig, T5Config};
use crate::vae::weights::{VaeHalves, VaeWeights};
use crate::vae::VaeConfig;

/// The most patch-matrix or score bytes one chunk of an image op takes on a device
/// (`denoised_cuda`'s `IMAGE_WORKSPACE_BYTES`).
pub const IMAGE_CHUNK_BYTES: u64 = 128 << 20;

/// The workspace a convolution library (cuDNN) may hold, for the life of a process
/// that has run a convolution on it (`denoised_cuda`'s `CUDNN_WORKSPACE_BYTES`).
pub const CONV_LIBRARY_BYTES: u64 = 64 << 20;

/// Device bytes of one preprocess and one postprocess worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageMemory {
    pub preprocess: u64,
    pub postprocess: u64,
}

/// [`StageMemory`] of `source`'s components for images of up to `max_pixels`, in a
/// dtype of `dtype_bytes`.
pub fn stage_memory(
    source: &ModelSource,
    max_pixels: usize,
    dtype_bytes: usize,
) -> Result<StageMemory> {
    let (clip, t5) = text_configs(source)?;
    let vae = vae_config(source)?;
    let s = dtype_bytes as u64;
    // Zero weights of the config's shapes, counted (pages of zeros are not touched).
    let w = VaeWeights::zeros(&vae, VaeHalves::BOTH)?;
    let (enc, dec) = (w.encoder_bytes / 4, w.decoder_bytes / 4);
    let (enc_ws, dec_ws) = vae_workspace(&vae, max_pixels, s);
    Ok(StageMemory {
        preprocess: (clip_params(&clip) + t5_params(&t5) + enc) * s
            + enc_ws.max(text_workspace(&clip, &t5, s))
            + CONV_LIBRARY_BYTES,
        postprocess: dec * s + dec_ws + CONV_LIBRARY_BYTES,
    })
}

/// Weights CLIP keeps on a device: every layer and the final norm (the token and
/// position embeddings stay on the host).
pub fn clip_params(c: &ClipTextConfig) -> u64 {
    let (d, i) = (c.hidden_size as u64, c.intermediate_size as u64);
    let layer = 4 * d * d + 4 * d + 2 * d * i + i + d + 4 * d;
    c.num_hidden_layers as u64 * layer + 2 * d
}

/// Weights T5 keeps on a device: every block and the final norm (the token embedding
/// and the position-bias table stay on the host).
pub fn t5_params(c: &T5Config) -> u64 {
    let (d, inner, ff) = (c.d_model as u64, c.inner_dim() as u64, c.d_ff as u64);
    c.num_layers as u64 * (4 * d * inner + 3 * d * ff + 2 * d) + d
}

/// The VAE encoder's and decoder's workspace for an image of `pixels`, the larger of
/// two phases. At full resolution the encoder holds about five activations of its
/// first level's channels (a resnet's input, norms, convolution outputs) next to the
/// input image, and the decoder's last up block reads the second level's channels
/// (its input and normalised copy) next to three of its own outputs; each adds one
/// patch chunk. In the mid block, at the latent resolution with the last level's
/// channels, the attention holds up to ten activations' worth (the block's input, the
/// attention's input and norm, q|k|v, K, V transposed, output, projection) and one
/// chunk of scores, `[rows, pixels]`.
pub fn vae_workspace(c: &VaeConfig, pixels: usize, s: u64) -> (u64, u64) {
    let p = pixels as u64;
    let ch = &c.block_out_channels;
    let c0 = ch[0] as u64;
    let c1 = ch.get(1).copied().unwrap_or(ch[0]) as u64;
    let cl = ch[ch.len() - 1] as u64;
    let chunk = |ch: u64| IMAGE_CHUNK_BYTES.min(p * 9 * ch * s);
    let f = c.vae_scale_factor() as u64;
    let n = p / (f * f);
    let mid = 10 * cl * n * s + IMAGE_CHUNK_BYTES.min(n * n * s);
    let enc = (5 * c0 + c.in_channels as u64) * p * s + chunk(c0);
    let dec = (2 * c1 + 3 * c0) * p * s + chunk(c1);
    (enc.max(mid), dec.max(mid))
}

/// The text encoders' workspace at their longest prompts (77 and 512 tokens): a few
/// activations of the widest projection and one head's scores.
fn text_workspace(clip: &ClipTextConfig, t5: &T5Config, s: u64) -> u64 {
    let one = |len: u64, widest: u64| (4 * len * widest + len * len) * s;
    let t5_widest = (3 * t5.inner_dim()).max(2 * t5.d_ff) as u64;
    let clip_widest = (3 * clip.hidden_size).max(clip.intermediate_size) as u64;
    one(512, t5_widest) + one(77, clip_widest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published parameter counts (docs/operations.md), less the embeddings kept
    /// on the host: CLIP-L 123,060,480 with 37,945,344 + 59,136 of embeddings; T5-XXL's
    /// encoder 4,762,310,656 with a 32128 x 4096 embedding and a 32 x 64 bias table.
    #[test]
    fn device_parameter_counts_match_the_published_models() {
        assert_eq!(
            clip_params(&ClipTextConfig::clip_l()),
            123_060_480 - 37_945_344 - 59_136
        );
        assert_eq!(
            t5_params(&T5Config::t5_v1_1_xxl()),
            4_762_310_656 - 32_128 * 4_096 - 32 * 64
        );
    }

    #[test]
    fn stages_of_the_built_in_models() {
        let m = stage_memory(&ModelSource::BuiltinSmall, 1024 * 1024, 2).unwrap();
        // FLUX.1's VAE at 1024x1024 in bf16: the decoder's workspace dominates.
        assert!(m.postprocess > 3 << 29 && m.postprocess < 3 << 30, "{m:?}");
        assert!(m.preprocess > m.postprocess / 2, "{m:?}");
        let tiny = stage_memory(&ModelSource::Builtin, 64 * 64, 2).unwrap();
        // Beside the convolution library's workspace, which does not scale.
        let small = 16 << 20;
        assert!(
            tiny.preprocess < CONV_LIBRARY_BYTES + small
                && tiny.postprocess < CONV_LIBRARY_BYTES + small,
            "{tiny:?}"
        );
    }
}
