//! `denoised inspect FILE`: what a checkpoint file is, before a user points `--transformer`,
//! `--vae`, `--text-encoder-2` or `--lora` at it. One JSON object on stdout: the
//! container, the component and key layout, the stored types (dtypes or GGUF
//! quantisations, with counts), the config read off its shapes, and its bytes.

use std::path::PathBuf;

use denoised_models::flux::lora::LoraFile;
use denoised_models::flux::lora_formats::LoraFormat;
use denoised_models::flux::single_file::{key_layout, TransformerFile};
use denoised_models::text::t5_file::T5File;
use denoised_models::vae::single_file::VaeFile;
use denoised_models::ModelSource;
use denoised_runtime::checkpoint;
use serde_json::{json, Value};

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A .safetensors or .gguf file.
    pub file: PathBuf,
    /// A model directory whose configs fill in what shapes cannot tell (a small
    /// transformer's RoPE axes, the VAE's GroupNorm groups and latent scaling).
    #[arg(long, env = "DENOISED_MODEL")]
    pub model: Option<ModelSource>,
}

pub fn run(a: Args) -> CliResult {
    println!("{}", serde_json::to_string_pretty(&inspect(&a)?)?);
    Ok(())
}

pub fn inspect(a: &Args) -> CliResult<Value> {
    let file = checkpoint::open(&a.file)?;
    let names = file.names();
    let dir = a.model.as_ref().and_then(|m| m.model_dir());
    let out = json!({
        "file": a.file.display().to_string(),
        "container": file.container(),
        "tensors": names.len(),
        "bytes": file.data_bytes(),
        "dtypes": checkpoint::stored_types(file.as_ref()),
    });
    let has = |p: &str| names.iter().any(|n| n.starts_with(p) || n.contains(p));
    let component = if has("lora") || names.iter().any(|n| n.ends_with(".alpha")) {
        let layout = LoraFormat::detect(&names);
        let mut v = json!({
            "component": "lora",
            "layout": format!("{layout:?}").to_lowercase(),
            "use": "--lora FILE[:SCALE], `loras` in requests, /v1/adapters",
        });
        // Against the model, when given: whether it fits, and what it adapts.
        if let Some(m) = &a.model {
            v["fits_model"] = match LoraFile::open(&a.file, &m.transformer_config()?) {
                Ok(l) => {
                    json!({"modules": l.modules.len(), "rank": l.rank(), "params": l.params()})
                }
                Err(e) => json!({"error": e.to_string()}),
            };
        }
        v
    } else if denoised_models::flux::bfl::is_bfl(names.iter().map(String::as_str))
        || has("transformer_blocks.")
    {
        let hint = dir.and_then(|d| d.transformer_hint());
        let t = match TransformerFile::open(&a.file, hint.as_ref()) {
            Ok(t) => t,
            // Its layout still, when its config cannot be read off its shapes (a head
            // size whose RoPE axes no model directory gives).
            Err(e) => match key_layout(&names) {
                Some((layout, prefix)) => {
                    let v = json!({
                        "component": "transformer",
                        "layout": format!("{layout:?}").to_lowercase(),
                        "prefix": prefix,
                        "config": null,
                        "config_error": e.to_string(),
                        "use": "--transformer FILE (with --model DIR for the other components)",
                    });
                    return Ok(merged(out, v));
                }
                None => return Err(e.into()),
            },
        };
        let kind = match (t.config.in_channels, t.config.guidance_embeds) {
            (i, _) if i != t.config.out_channels() => "FLUX.1 Fill",
            (_, true) => "FLUX.1-dev (text to image, guidance embedding)",
            (_, false) => "FLUX.1-schnell (text to image, no guidance embedding)",
        };
        json!({
            "component": "transformer",
            "layout": format!("{:?}", t.layout).to_lowercase(),
            "prefix": t.prefix,
            "model": kind,
            "config": t.config,
            "use": "--transformer FILE (with --model DIR for the other components)",
        })
    } else if has("encoder.down") {
        let hint = dir.and_then(|d| {
            denoised_models::vae::VaeConfig::from_file(d.root.join("vae/config.json")).ok()
        });
        let v = VaeFile::open(&a.file, hint.as_ref())?;
        json!({
            "component": "vae",
            "layout": format!("{:?}", v.layout).to_lowercase(),
            "prefix": v.prefix,
            "config": v.config,
            "use": "--vae FILE",
        })
    } else if has("token_embd.") || has("encoder.block.") {
        let t5 = T5File::open(&a.file)?;
        json!({"component": "t5", "layout": t5.layout(), "use": "--text-encoder-2 FILE"})
    } else {
        json!({"component": "unknown"})
    };
    Ok(merged(out, component))
}

/// `out` with `component`'s fields added.
fn merged(mut out: Value, component: Value) -> Value {
    if let (Value::Object(o), Value::Object(c)) = (&mut out, component) {
        o.extend(c);
    }
    out
}
