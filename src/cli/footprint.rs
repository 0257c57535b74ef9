//! `denoised footprint`: the template cache size of a model at a resolution, computed
//! from the layout (nothing is allocated), and the size of the VAE traces a template
//! stores beside it for sparse VAE passes (from the VAE's shapes). Capacity planning
//! for the cache tiers starts here.

use denoised_models::flux::template::{storage_dtype, CacheMode, TemplateLayout};
use denoised_models::flux::weights::weight_forms;
use denoised_models::vae::sparse::Half;
use denoised_models::vae::{AutoencoderKL, VaeConfig};
use denoised_models::FluxConfig;
use denoised_runtime::DType;

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Named configs to report, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "flux-small,flux1-fill-dev"
    )]
    pub config: Vec<String>,
    /// Image height and width in pixels.
    #[arg(long, default_value_t = 1024)]
    pub height: usize,
    #[arg(long, default_value_t = 1024)]
    pub width: usize,
    /// VAE downsampling factor (8 for FLUX.1; the tiny fixture model uses 2).
    #[arg(long, default_value_t = 8)]
    pub vae_scale_factor: usize,
    /// Denoising steps the template is captured for.
    #[arg(long, default_value_t = 28)]
    pub steps: usize,
    /// Storage dtype of the cache: f32, bf16 or fp8 (E4M3 with a scale per head's K
    /// and V; KV mode only).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Cache modes to report, comma-separated: `kv` (K and V of every block) and `y`
    /// (the output of every block but the last: about half).
    #[arg(long, value_delimiter = ',', default_value = "kv,y", value_parser = ["kv", "y"])]
    pub cache_mode: Vec<String>,
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(a: Args) -> CliResult {
    let dtype = storage_dtype(&a.dtype).map_err(|e| format!("--dtype: {e}"))?;
    let tok = 2 * a.vae_scale_factor;
    if a.height == 0 || a.width == 0 || a.height % tok != 0 || a.width % tok != 0 {
        return Err(format!(
            "{}x{} is not a positive multiple of the {tok}-pixel token size",
            a.width, a.height
        )
        .into());
    }
    let tokens = (a.height / tok) * (a.width / tok);
    // The FLUX.1 VAE (the tiny fixture's at its scale factor): traces of the template
    // image's encode and of its final latent's decode, stored in f32 (the VAE's
    // compute dtype; `[pipeline] sparse_vae = "off"` stores none).
    let vae_cfg = [VaeConfig::flux1(), VaeConfig::tiny()]
        .into_iter()
        .find(|c| c.vae_scale_factor() == a.vae_scale_factor);
    let traces = match vae_cfg {
        Some(c) => {
            let lc = c.latent_channels;
            let vae = AutoencoderKL::shapes_only(c)?;
            let (h, w, f) = (a.height, a.width, a.vae_scale_factor);
            Some((
                vae.trace_bytes(Half::Encoder, [3, h, w])?,
                vae.trace_bytes(Half::Decoder, [lc, h / f, w / f])?,
            ))
        }
        None => None,
    };
    for name in &a.config {
        let cfg = FluxConfig::named(name).ok_or_else(|| {
            format!(
                "unknown config `{name}`; known: {}",
                FluxConfig::NAMES.join(", ")
            )
        })?;
        let kv = TemplateLayout::for_model(&cfg, tokens, a.steps, dtype);
        for mode in &a.cache_mode {
            let l = kv.with_mode(if mode == "y" {
                CacheMode::Y
            } else {
                CacheMode::Kv
            });
            if let Err(e) = l.check() {
                eprintln!("{name}, cache mode {mode}, {}: {e}", a.dtype);
                continue;
            }
            let bf16_kv = TemplateLayout {
                dtype: DType::BF16,
                ..kv
            };
            println!(
                "{}",
                serde_json::json!({
                    "config": name, "height": a.height, "width": a.width, "image_tokens": tokens,
                    "steps": a.steps, "blocks": l.blocks, "hidden": l.hidden, "dtype": a.dtype,
                    "cache_mode": mode, "slabs_per_step": l.slabs_per_step(),
                    "slab_bytes": l.slab_bytes(),
                    "bytes_per_step": l.cache_bytes_per_step() + l.latent_bytes(),
                    "total_bytes": l.total_bytes(), "total_gib": l.total_bytes() as f64 / GIB,
                    "total_gb": l.total_bytes() as f64 / 1e9,
                    "vs_kv": l.total_bytes() as f64 / kv.total_bytes() as f64,
                    "vs_bf16_kv": l.total_bytes() as f64 / bf16_kv.total_bytes() as f64,
                    "vae_trace_bytes": traces.map(|(e, d)| e + d),
                    "vae_trace_encoder_bytes": traces.map(|t| t.0),
                    "vae_trace_decoder_bytes": traces.map(|t| t.1),
                    "with_vae_traces_gib": traces.map(|(e, d)| (l.total_bytes() as u64 + e + d) as f64 / GIB),
                    "transformer_weight_bytes": weight_forms(&cfg),
                })
            );
        }
    }
    Ok(())
}
