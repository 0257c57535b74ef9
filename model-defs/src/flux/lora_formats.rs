//! LoRA files in the layouts of the original (BFL) FLUX code rather than diffusers':
//! what most FLUX LoRAs in circulation use, and what diffusers' `FluxLoraLoaderMixin.
//! lora_state_dict` converts (`_convert_kohya_flux_lora_to_diffusers`,
//! `_convert_xlabs_flux_lora_to_diffusers`, the BFL converters in
//! `loaders/lora_conversion_utils.py`).
//!
//! - **kohya** (sd-scripts, ComfyUI): `lora_unet_<BFL name with . as _>.lora_down.weight`
//!   `[r, in]`, `.lora_up.weight` `[out, r]`, `.alpha` (scale `alpha / r`, 1 without),
//!   e.g. `lora_unet_double_blocks_0_img_attn_qkv`; ComfyUI's
//!   `diffusion_model.<BFL name>.lora_down.weight` alike. Text-encoder factors
//!   (`lora_te_*`, `lora_te1_*`, ...) are refused: diffusers loads them into CLIP.
//! - **XLabs**: `double_blocks.N.processor.{qkv_lora1,qkv_lora2,proj_lora1,proj_lora2}` and
//!   `single_blocks.N.processor.{qkv_lora,proj_lora}` `.down.weight` / `.up.weight`
//!   (img qkv, txt qkv, img proj, txt proj; the single blocks' q|k|v of `linear1` and
//!   `linear2`), scale 1 (XLabs files hold no alpha; diffusers uses 1).
//! - **BFL**: `<BFL name>.lora_A.weight` / `.lora_B.weight` (and `.alpha`, as kohya),
//!   optionally prefixed `diffusion_model.`, `model.diffusion_model.`, `transformer.` or
//!   `base_model.model.` (fal's Kontext LoRAs).
//!
//! A BFL Linear's factor pair is split onto the diffusers Linears it stacks through the
//! one table, [`super::bfl::linears`]: each part gets the shared `down` and its rows
//! of `up` ([`super::bfl::part_rows`], which also swaps the final modulation's halves,
//! BFL `shift|scale` against diffusers `scale|shift`), exactly diffusers' conversion.
//! The parts then land on our fused sites by their diffusers names like a PEFT file's,
//! so a single block's `linear1` (BFL rows `q|k|v|mlp`) reaches our `to_k|to_v|to_q|
//! proj_mlp` projection reordered. The unmerged path computes a down shared by a
//! site's parts once ([`super::lora::LoraAdapter::upload`]).

use std::collections::HashMap;
use std::ops::Range;

use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{Error, Result, Tensor};

use super::bfl::{self, BflLinear};
use super::config::FluxConfig;
use super::lora::LoraModule;
use super::weights::Site;

/// The key layout of a LoRA file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraFormat {
    /// diffusers/PEFT: `transformer.<diffusers module>.lora_A.weight`.
    Peft,
    Kohya,
    XLabs,
    Bfl,
}

/// The top-level module names of the BFL layout.
const BFL_ROOTS: [&str; 8] = [
    "double_blocks.",
    "single_blocks.",
    "final_layer.",
    "img_in.",
    "txt_in.",
    "time_in.",
    "vector_in.",
    "guidance_in.",
];

/// Prefixes BFL-named keys carry (ComfyUI, ai-toolkit, fal's Kontext trainer).
const BFL_PREFIXES: [&str; 4] = [
    "model.diffusion_model.",
    "diffusion_model.",
    "transformer.",
    "base_model.model.",
];

fn strip_bfl_prefix(key: &str) -> &str {
    BFL_PREFIXES
        .iter()
        .find_map(|p| key.strip_prefix(p))
        .unwrap_or(key)
}

impl LoraFormat {
    /// The layout of a file from its tensor names, tested in diffusers' order: any
    /// `.lora_down.weight` is kohya, any `.processor.` XLabs, a BFL module name with
    /// PEFT factors BFL, anything else PEFT.
    pub fn detect<S: AsRef<str>>(names: &[S]) -> LoraFormat {
        let any = |f: &dyn Fn(&str) -> bool| names.iter().any(|n| f(n.as_ref()));
        if any(&|n| n.ends_with(".lora_down.weight") || n.ends_with(".lora_up.weight")) {
            LoraFormat::Kohya
        } else if any(&|n| n.contains(".processor.") && n.contains("_lora")) {
            LoraFormat::XLabs
        } else if any(&|n| {
            let k = strip_bfl_prefix(n);
            BFL_ROOTS.iter().any(|r| k.starts_with(r))
        }) {
            LoraFormat::Bfl
        } else {
            LoraFormat::Peft
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            LoraFormat::Peft => "PEFT/diffusers",
            LoraFormat::Kohya => "kohya",
            LoraFormat::XLabs => "XLabs",
            LoraFormat::Bfl => "BFL",
        }
    }

    /// A key's module stem and factor, or `None` if it is not a factor of this layout.
    fn split(self, key: &str) -> Option<(&str, Factor)> {
        let suffixes: &[(&str, Factor)] = match self {
            LoraFormat::Kohya => &[
                (".lora_down.weight", Factor::Down),
                (".lora_up.weight", Factor::Up),
                (".alpha", Factor::Alpha),
            ],
            LoraFormat::XLabs => &[(".down.weight", Factor::Down), (".up.weight", Factor::Up)],
            LoraFormat::Bfl => &[
                (".lora_A.weight", Factor::Down),
                (".lora_B.weight", Factor::Up),
                (".alpha", Factor::Alpha),
            ],
            LoraFormat::Peft => &[],
        };
        suffixes
            .iter()
            .find_map(|&(s, f)| key.strip_suffix(s).map(|stem| (stem, f)))
    }
}

#[derive(Clone, Copy)]
enum Factor {
    Down,
    Up,
    Alpha,
}

/// Where a module stem of a file lands: a BFL Linear and how many of its leading
/// parts the factor covers (all but XLabs' single-block `qkv_lora`, which is `q|k|v`
/// of `linear1` without the MLP).
struct Target<'t> {
    lin: &'t BflLinear,
    parts: usize,
}

/// Resolves module stems of `format` through the BFL table of `cfg`.
struct Resolver {
    linears: Vec<BflLinear>,
    /// BFL name, and kohya's `lora_unet_` + the name with `.` as `_`, to its index.
    by_name: HashMap<String, usize>,
}

impl Resolver {
    fn new(cfg: &FluxConfig) -> Self {
        let linears = bfl::linears(cfg);
        let mut by_name = HashMap::new();
        for (i, l) in linears.iter().enumerate() {
            by_name.insert(l.name.clone(), i);
            by_name.insert(format!("lora_unet_{}", l.name.replace('.', "_")), i);
        }
        Resolver { linears, by_name }
    }

    fn linear(&self, name: &str) -> Option<&BflLinear> {
        self.by_name.get(name).map(|&i| &self.linears[i])
    }

    fn resolve(&self, format: LoraFormat, stem: &str) -> Option<Target<'_>> {
        fn all(lin: &BflLinear) -> Target<'_> {
            Target {
                parts: lin.parts.len(),
                lin,
            }
        }
        match format {
            LoraFormat::Kohya if stem.starts_with("lora_unet_") => self.linear(stem).map(all),
            LoraFormat::Kohya | LoraFormat::Bfl => self.linear(strip_bfl_prefix(stem)).map(all),
            LoraFormat::XLabs => {
                let s = strip_bfl_prefix(stem);
                let (block, module) = s.split_once(".processor.")?;
                let (name, parts) = if block.starts_with("double_blocks.") {
                    let n = match module {
                        "qkv_lora1" => "img_attn.qkv",
                        "qkv_lora2" => "txt_attn.qkv",
                        "proj_lora1" => "img_attn.proj",
                        "proj_lora2" => "txt_attn.proj",
                        _ => return None,
                    };
                    (n, None)
                } else if block.starts_with("single_blocks.") {
                    match module {
                        "qkv_lora" => ("linear1", Some(3)),
                        "proj_lora" => ("linear2", None),
                        _ => return None,
                    }
                } else {
                    return None;
                };
                let lin = self.linear(&format!("{block}.{name}"))?;
                Some(Target {
                    parts: parts.unwrap_or(lin.parts.len()),
                    lin,
                })
            }
            LoraFormat::Peft => None,
        }
    }
}

/// Why a key no layout accepts is refused, when there is a known reason.
pub(super) fn refusal(key: &str) -> Option<&'static str> {
    if key.starts_with("lora_te") || key.starts_with("text_encoder") {
        Some("adapts a text encoder; only transformer LoRAs are served")
    } else if key.contains("dora_scale") || key.contains("lora_magnitude_vector") {
        Some("DoRA is not supported")
    } else if key.contains(".lora_B.bias") || key.contains(".diff_b") || key.ends_with(".diff") {
        Some("LoRA biases and weight differences are not supported")
    } else if key.contains("query_norm.scale") || key.contains("key_norm.scale") {
        Some("norm scales (a BFL Control LoRA) are not supported")
    } else {
        None
    }
}

/// The error for keys of a file that are not factors of its layout: the first with a
/// known reason, or the first few.
pub(super) fn unknown_keys(format: LoraFormat, keys: &[String]) -> String {
    if let Some((k, why)) = keys.iter().find_map(|k| refusal(k).map(|w| (k, w))) {
        return format!("`{k}`: {why}");
    }
    let mut sorted: Vec<&String> = keys.iter().collect();
    sorted.sort();
    let shown: Vec<String> = sorted.iter().take(4).map(|k| format!("`{k}`")).collect();
    let more = if keys.len() > 4 {
        format!(" (and {} more)", keys.len() - 4)
    } else {
        String::new()
    };
    format!(
        "{} key(s) are not {} LoRA factors of this transformer: {}{more}",
        keys.len(),
        format.label(),
        shown.join(", ")
    )
}

#[derive(Default)]
struct Pair {
    /// The file's stem for this module (for messages).
    stem: String,
    down: Option<Tensor>,
    up: Option<Tensor>,
    alpha: Option<f32>,
}

/// Reads the factors of a kohya, XLabs or BFL file `st` and splits them onto the
/// diffusers Linears of `cfg`'s model (`sites`: diffusers name to site, rows, input).
pub(super) fn read(
    st: &SafetensorsFile,
    format: LoraFormat,
    cfg: &FluxConfig,
    sites: &HashMap<String, (Site, Range<usize>, usize)>,
    bad: &dyn Fn(String) -> Error,
) -> Result<Vec<LoraModule>> {
    let resolver = Resolver::new(cfg);
    // By BFL name (and part count), in key order.
    let mut pairs: Vec<((String, usize), Pair)> = Vec::new();
    let mut unknown = Vec::new();
    let mut names = st.names();
    names.sort();
    for name in &names {
        let Some((stem, factor)) = format.split(name) else {
            unknown.push(name.clone());
            continue;
        };
        let Some(t) = resolver.resolve(format, stem) else {
            unknown.push(name.clone());
            continue;
        };
        let id = (t.lin.name.clone(), t.parts);
        let at = match pairs.iter().position(|(k, _)| *k == id) {
            Some(i) => i,
            None => {
                pairs.push((
                    id,
                    Pair {
                        stem: stem.to_string(),
                        ..Pair::default()
                    },
                ));
                pairs.len() - 1
            }
        };
        let (id, p) = &mut pairs[at];
        if p.stem != stem {
            return Err(bad(format!(
                "`{stem}` and `{}` both adapt `{}`",
                p.stem, id.0
            )));
        }
        match factor {
            Factor::Down => p.down = Some(st.weight(name)?),
            Factor::Up => p.up = Some(st.weight(name)?),
            Factor::Alpha => {
                let a = st.tensor_f32(name)?;
                if a.data().len() != 1 {
                    return Err(bad(format!("`{name}` is not a scalar")));
                }
                p.alpha = Some(a.data()[0]);
            }
        }
    }
    if !unknown.is_empty() {
        return Err(bad(unknown_keys(format, &unknown)));
    }
    let (down_s, up_s) = match format {
        LoraFormat::Kohya => ("lora_down", "lora_up"),
        LoraFormat::XLabs => ("down", "up"),
        _ => ("lora_A", "lora_B"),
    };
    let mut modules = Vec::new();
    for ((bfl_name, parts), p) in pairs {
        let lin = resolver.linear(&bfl_name).expect("resolved above");
        let (down, up) = match (p.down, p.up) {
            (Some(d), Some(u)) => (d, u),
            (Some(_), None) => return Err(bad(format!("`{}` has {down_s} but no {up_s}", p.stem))),
            (None, Some(_)) => return Err(bad(format!("`{}` has {up_s} but no {down_s}", p.stem))),
            (None, None) => return Err(bad(format!("`{}` has an alpha only", p.stem))),
        };
        let out = lin.parts[parts - 1].1.end;
        let r = down.rows();
        if r == 0 || down.shape() != [r, lin.input] || up.shape() != [out, r] {
            return Err(bad(format!(
                "`{}`: {down_s} is {:?} and {up_s} {:?}, but `{bfl_name}` ({}) wants [r, {}] and [{out}, r]",
                p.stem,
                down.shape(),
                up.shape(),
                if parts < lin.parts.len() {
                    format!("its first {parts} parts")
                } else {
                    format!("a [{}, {}] Linear", lin.out(), lin.input)
                },
                lin.input
            )));
        }
        let scale = match format {
            LoraFormat::XLabs => 1.0,
            _ => p.alpha.map_or(1.0, |a| a / r as f32),
        };
        for part in 0..parts {
            let name = &lin.parts[part].0;
            let mut rows_up = Vec::new();
            for rows in bfl::part_rows(lin, part) {
                rows_up.extend_from_slice(&up.data()[rows.start * r..rows.end * r]);
            }
            let &(site, ref rows, input) = sites
                .get(name.as_str())
                .ok_or_else(|| bad(format!("`{name}` is not a Linear of this transformer")))?;
            debug_assert_eq!(input, lin.input);
            modules.push(LoraModule {
                name: name.clone(),
                site,
                rows: rows.clone(),
                down: down.clone(),
                up: Tensor::new([rows.len(), r], rows_up)?,
                scale,
            });
        }
    }
    Ok(modules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_each_layout_from_its_keys() {
        let f = |k: &str| LoraFormat::detect(&[k]);
        assert_eq!(
            f("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"),
            LoraFormat::Kohya
        );
        assert_eq!(
            f("diffusion_model.single_blocks.0.linear1.lora_up.weight"),
            LoraFormat::Kohya
        );
        assert_eq!(
            f("double_blocks.0.processor.qkv_lora1.down.weight"),
            LoraFormat::XLabs
        );
        assert_eq!(
            f("diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"),
            LoraFormat::Bfl
        );
        assert_eq!(
            f("transformer.final_layer.linear.lora_B.weight"),
            LoraFormat::Bfl
        );
        assert_eq!(
            f("base_model.model.single_blocks.3.linear2.lora_A.weight"),
            LoraFormat::Bfl
        );
        for peft in [
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
            "base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight",
        ] {
            assert_eq!(f(peft), LoraFormat::Peft);
        }
    }

    #[test]
    fn every_bfl_linear_resolves_in_kohya_and_bfl_names() {
        let cfg = FluxConfig::tiny();
        let r = Resolver::new(&cfg);
        for l in bfl::linears(&cfg) {
            let kohya = format!("lora_unet_{}", l.name.replace('.', "_"));
            for (fmt, stem) in [
                (LoraFormat::Kohya, kohya),
                (LoraFormat::Kohya, format!("diffusion_model.{}", l.name)),
                (LoraFormat::Bfl, l.name.clone()),
                (LoraFormat::Bfl, format!("transformer.{}", l.name)),
            ] {
                let t = r.resolve(fmt, &stem).unwrap_or_else(|| panic!("{stem}"));
                assert_eq!(t.lin.name, l.name);
                assert_eq!(t.parts, l.parts.len());
            }
        }
        let t = r
            .resolve(LoraFormat::XLabs, "single_blocks.1.processor.qkv_lora")
            .unwrap();
        assert_eq!(
            (t.lin.name.as_str(), t.parts),
            ("single_blocks.1.linear1", 3)
        );
        assert!(r
            .resolve(LoraFormat::Kohya, "lora_unet_double_blocks_9_img_attn_qkv")
            .is_none());
    }
}
