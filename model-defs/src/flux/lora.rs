//! LoRA adapters of the Flux transformer (docs/design.md §Adapters), in the PEFT/diffusers
//! format `FluxPipeline.save_lora_weights` writes: `transformer.<module>.lora_A.weight`
//! `[r, in]` and `.lora_B.weight` `[out, r]` per adapted Linear, and the adapter's
//! `LoraConfig` as JSON in the safetensors metadata (`lora_adapter_metadata`, keys
//! prefixed `transformer.`), from which each module's scale `lora_alpha / r` comes
//! (`alpha_pattern` per module, `alpha / sqrt(r)` with rsLoRA). A file without metadata
//! has scale 1 (diffusers' convention), or `alpha / r` from `<module>.alpha` tensors.
//!
//! The kohya, XLabs and BFL layouts most FLUX LoRAs circulate in are converted onto the
//! same diffusers module names by [`super::lora_formats`].
//!
//! A module maps onto our weights by its site (the Linear the forward runs, a fused
//! projection for `to_q|to_k|to_v` and the single blocks' `to_k|to_v|to_q|proj_mlp`)
//! and its rows within it, from the one table in `weights.rs`.
//!
//! [`LoraFile`] is the host copy; [`LoraAdapter`] its form on a backend for the
//! unmerged path, `y += s·(x Aᵀ) Bᵀ` over a request's rows; [`merge_site`] the merged
//! path's arithmetic.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use denoised_runtime::cpu::matmul::{matmul, MatRef};
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{Backend, Error, Result, Tensor};

use super::config::FluxConfig;
use super::lora_formats::{self, LoraFormat};
use super::weights::Site;

/// diffusers' file name inside an adapter directory.
pub const LORA_FILE: &str = "pytorch_lora_weights.safetensors";
/// The safetensors metadata key holding the adapter's `LoraConfig`.
const METADATA_KEY: &str = "lora_adapter_metadata";

/// One adapted Linear of a LoRA file.
pub struct LoraModule {
    /// The diffusers module name, e.g. `transformer_blocks.0.attn.to_q`.
    pub name: String,
    pub site: Site,
    /// The module's output features within its site's (fused) weight.
    pub rows: Range<usize>,
    /// `lora_A` `[r, in]`.
    pub down: Tensor,
    /// `lora_B` `[out, r]`.
    pub up: Tensor,
    /// `alpha / r` (or `alpha / sqrt(r)` with rsLoRA): the file's own scale, before
    /// the one a request asks for.
    pub scale: f32,
}

impl LoraModule {
    pub fn rank(&self) -> usize {
        self.down.rows()
    }
}

/// A LoRA file read onto the host, checked against a transformer config.
pub struct LoraFile {
    pub path: PathBuf,
    /// Ordered by site, then rows.
    pub modules: Vec<LoraModule>,
    /// The key layout it was read from.
    pub format: LoraFormat,
    /// Identity of its contents (names, factors and scales): what template keys record
    /// of an adapter, so a file renamed is the same adapter and one retrained is not.
    pub fingerprint: String,
}

impl LoraFile {
    /// Reads `path`: a `.safetensors` file, or a directory holding
    /// `pytorch_lora_weights.safetensors`, in the PEFT/diffusers layout or the kohya,
    /// XLabs or BFL one ([`LoraFormat::detect`], [`super::lora_formats`]). Every tensor
    /// must be a transformer LoRA factor of a Linear of `cfg`'s model with matching
    /// shapes; anything else (a text encoder's LoRA, DoRA, LoRA biases, unknown keys) is
    /// refused by name.
    pub fn open(path: impl AsRef<Path>, cfg: &FluxConfig) -> Result<Self> {
        let path = path.as_ref();
        let file = if path.is_dir() {
            path.join(LORA_FILE)
        } else {
            path.to_path_buf()
        };
        let st = SafetensorsFile::open(&file)?;
        let bad = |reason: String| Error::BadAdapter {
            path: file.clone(),
            reason,
        };
        let names = st.names();
        let sites = module_sites(cfg);
        let format = LoraFormat::detect(&names);
        let mut modules = match format {
            LoraFormat::Peft => read_peft(&st, &names, &sites, &bad)?,
            f => lora_formats::read(&st, f, cfg, &sites, &bad)?,
        };
        if modules.is_empty() {
            return Err(bad("no transformer LoRA tensors".into()));
        }
        modules.sort_by_key(|m| (m.site.index(cfg), m.rows.start));
        let mut h = crc32fast::Hasher::new();
        for m in &modules {
            h.update(m.name.as_bytes());
            h.update(&m.scale.to_le_bytes());
            for t in [&m.down, &m.up] {
                for v in t.data() {
                    h.update(&v.to_le_bytes());
                }
            }
        }
        let params: usize = modules.iter().map(|m| m.down.len() + m.up.len()).sum();
        Ok(LoraFile {
            path: file,
            modules,
            format,
            fingerprint: format!("lora-{:08x}-{params}", h.finalize()),
        })
    }

    /// Elements of the factors.
    pub fn params(&self) -> u64 {
        self.modules
            .iter()
            .map(|m| (m.down.len() + m.up.len()) as u64)
            .sum()
    }

    /// The largest rank of its modules.
    pub fn rank(&self) -> usize {
        self.modules.iter().map(LoraModule::rank).max().unwrap_or(0)
    }
}

/// The modules of a PEFT/diffusers file (the keys `names` of `st`).
fn read_peft(
    st: &SafetensorsFile,
    names: &[String],
    sites: &HashMap<String, (Site, Range<usize>, usize)>,
    bad: &dyn Fn(String) -> Error,
) -> Result<Vec<LoraModule>> {
    let meta = st
        .metadata_value(METADATA_KEY)
        .map(|m| PeftConfig::parse(m).map_err(bad))
        .transpose()?;
    let (mut downs, mut ups, mut alphas) = (HashMap::new(), HashMap::new(), HashMap::new());
    let mut unknown = Vec::new();
    for name in names {
        let key = ["transformer.", "base_model.model."]
            .iter()
            .find_map(|p| name.strip_prefix(p));
        let Some(key) = key.filter(|_| lora_formats::refusal(name).is_none()) else {
            unknown.push(name.clone());
            continue;
        };
        if let Some(m) = key.strip_suffix(".lora_A.weight") {
            downs.insert(m.to_string(), st.weight(name)?);
        } else if let Some(m) = key.strip_suffix(".lora_B.weight") {
            ups.insert(m.to_string(), st.weight(name)?);
        } else if let Some(m) = key.strip_suffix(".alpha") {
            let a = st.tensor_f32(name)?;
            if a.data().len() != 1 {
                return Err(bad(format!("`{name}` is not a scalar")));
            }
            alphas.insert(m.to_string(), a.data()[0]);
        } else {
            unknown.push(name.clone());
        }
    }
    if !unknown.is_empty() {
        return Err(bad(lora_formats::unknown_keys(LoraFormat::Peft, &unknown)));
    }
    let mut modules = Vec::with_capacity(downs.len());
    for (m, down) in downs {
        let up = ups
            .remove(&m)
            .ok_or_else(|| bad(format!("`{m}` has lora_A but no lora_B")))?;
        let &(site, ref rows, input) = sites
            .get(m.as_str())
            .ok_or_else(|| bad(format!("`{m}` is not a Linear of this transformer")))?;
        let r = down.rows();
        if down.shape() != [r, input] || up.shape() != [rows.len(), r] || r == 0 {
            return Err(bad(format!(
                "`{m}`: lora_A {:?} and lora_B {:?} do not fit a [{}, {input}] Linear",
                down.shape(),
                up.shape(),
                rows.len()
            )));
        }
        let scale = match (&meta, alphas.get(&m)) {
            (Some(c), _) => c.scale(&m, r),
            (None, Some(a)) => a / r as f32,
            (None, None) => 1.0,
        };
        modules.push(LoraModule {
            name: m,
            site,
            rows: rows.clone(),
            down,
            up,
            scale,
        });
    }
    if let Some(m) = ups.keys().next() {
        return Err(bad(format!("`{m}` has lora_B but no lora_A")));
    }
    Ok(modules)
}

/// The key of a LoRA set with its scales, in order (e.g. `lora-1a2b3c4d-5120*0.8`):
/// what a template captured with it records, and an edit must match. Empty for none.
pub fn set_key<'a>(set: impl IntoIterator<Item = (&'a LoraFile, f32)>) -> String {
    set.into_iter()
        .map(|(f, s)| format!("{}*{s}", f.fingerprint))
        .collect::<Vec<_>>()
        .join("+")
}

/// Every checkpoint Linear of `cfg`'s model by diffusers module name: its site, its
/// rows within the site, and its input features.
fn module_sites(cfg: &FluxConfig) -> HashMap<String, (Site, Range<usize>, usize)> {
    let mut map = HashMap::new();
    for site in Site::all(cfg) {
        let spec = site.spec(cfg);
        let mut at = 0;
        for (name, o) in spec.parts {
            map.insert(name, (site, at..at + o, spec.input));
            at += o;
        }
    }
    map
}

/// The part of PEFT's `LoraConfig` that decides a module's scale.
struct PeftConfig {
    lora_alpha: f32,
    alpha_pattern: Vec<(regex::Regex, f32)>,
    use_rslora: bool,
}

impl PeftConfig {
    fn parse(json: &str) -> std::result::Result<Self, String> {
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("{METADATA_KEY}: {e}"))?;
        // diffusers prefixes each key with the component; PEFT's own files do not.
        let get = |k: &str| v.get(format!("transformer.{k}")).or_else(|| v.get(k));
        let flag = |k: &str| get(k).and_then(|x| x.as_bool()).unwrap_or(false);
        if flag("use_dora") {
            return Err("DoRA (use_dora) is not supported".into());
        }
        if get("lora_bias").and_then(|x| x.as_bool()) == Some(true) {
            return Err("LoRA biases (lora_bias) are not supported".into());
        }
        let lora_alpha = get("lora_alpha")
            .and_then(|x| x.as_f64())
            .ok_or_else(|| format!("{METADATA_KEY} has no lora_alpha"))?
            as f32;
        let mut alpha_pattern = vec![];
        if let Some(p) = get("alpha_pattern").and_then(|x| x.as_object()) {
            for (k, a) in p {
                // PEFT's `get_pattern_key`: the key matches a whole dotted suffix.
                let re = regex::Regex::new(&format!(r"^(.*\.)?({k})$"))
                    .map_err(|e| format!("alpha_pattern `{k}`: {e}"))?;
                let a = a
                    .as_f64()
                    .ok_or_else(|| format!("alpha_pattern `{k}` is not a number"))?;
                alpha_pattern.push((re, a as f32));
            }
        }
        Ok(PeftConfig {
            lora_alpha,
            alpha_pattern,
            use_rslora: flag("use_rslora"),
        })
    }

    fn scale(&self, module: &str, rank: usize) -> f32 {
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(re, _)| re.is_match(module))
            .map_or(self.lora_alpha, |p| p.1);
        if self.use_rslora {
            alpha / (rank as f32).sqrt()
        } else {
            alpha / rank as f32
        }
    }
}

/// `w` (the `[out, in]` host weight of `site`) `+= Σ s·scale·B A` over the modules of
/// each `(file, s)` at that site, in f32: the merged mode's arithmetic.
pub fn merge_site(w: &mut Tensor, site: Site, loras: &[(&LoraFile, f32)]) -> Result<()> {
    let cols = w.cols();
    for (file, s) in loras {
        for m in file.modules.iter().filter(|m| m.site == site) {
            let r = m.rank();
            if m.down.cols() != cols || m.rows.end > w.rows() {
                return Err(Error::shape(
                    "merge_site",
                    format!("`{}` does not fit {:?}", m.name, w.shape()),
                ));
            }
            let f = s * m.scale;
            let up: Vec<f32> = m.up.data().iter().map(|v| v * f).collect();
            let dst = &mut w.data_mut()[m.rows.start * cols..m.rows.end * cols];
            matmul(
                m.rows.len(),
                cols,
                r,
                dst,
                cols,
                MatRef::row_major(&up, r),
                MatRef::row_major(m.down.data(), cols),
                true,
                true,
            );
        }
    }
    Ok(())
}

/// A LoRA file on a backend, for the unmerged path: per site, the stacked `lora_A`s of
/// its modules (one GEMM reads the input once for all of them) and each module's
/// `lora_B` with the rows it adds to.
pub struct LoraAdapter<B: Backend> {
    sites: Vec<Option<SitePatch<B>>>,
    params: u64,
}

struct SitePatch<B: Backend> {
    /// `[Σr, in]`.
    down: B::Weight,
    parts: Vec<Part<B>>,
}

struct Part<B: Backend> {
    /// The module's columns of the stacked down projection's output.
    r: Range<usize>,
    /// `[out, r]`.
    up: B::Weight,
    /// The output features it adds to.
    rows: Range<usize>,
    scale: f32,
}

impl<B: Backend> LoraAdapter<B> {
    pub fn upload(be: &B, cfg: &FluxConfig, file: &LoraFile) -> Result<Self> {
        let mut sites: Vec<Option<SitePatch<B>>> = (0..Site::count(cfg)).map(|_| None).collect();
        let mut at = 0;
        while at < file.modules.len() {
            let site = file.modules[at].site;
            let n = file.modules[at..]
                .iter()
                .take_while(|m| m.site == site)
                .count();
            let group = &file.modules[at..at + n];
            at += n;
            let input = group[0].down.cols();
            let mut down = Vec::with_capacity(group.iter().map(|m| m.down.len()).sum());
            let mut parts = Vec::with_capacity(n);
            let mut r0 = 0;
            for (k, m) in group.iter().enumerate() {
                // The parts of a fused factor (kohya/XLabs/BFL `qkv`, `linear1`) share
                // their down projection: it is stacked, and computed, once.
                let shared = group[..k]
                    .iter()
                    .zip(&parts)
                    .find(|(o, _)| {
                        o.down.shape() == m.down.shape() && o.down.data() == m.down.data()
                    })
                    .map(|(_, p): (_, &Part<B>)| p.r.clone());
                let r = match shared {
                    Some(r) => r,
                    None => {
                        down.extend_from_slice(m.down.data());
                        r0 += m.rank();
                        r0 - m.rank()..r0
                    }
                };
                parts.push(Part {
                    r,
                    up: be.upload_weight(&m.up)?,
                    rows: m.rows.clone(),
                    scale: m.scale,
                });
            }
            sites[site.index(cfg)] = Some(SitePatch {
                down: be.upload_weight(&Tensor::new([r0, input], down)?)?,
                parts,
            });
        }
        Ok(LoraAdapter {
            sites,
            params: file.params(),
        })
    }

    /// Elements of the factors.
    pub fn params(&self) -> u64 {
        self.params
    }

    /// Whether it patches the site of index `site`.
    pub fn touches(&self, site: usize) -> bool {
        self.sites.get(site).is_some_and(Option::is_some)
    }

    /// `y[rows, ·] += s · scale · (x[rows, x_cols] Aᵀ) Bᵀ` for each module at the site
    /// of index `site` whose output features lie in `outs` (`y` holds exactly the
    /// features `outs` of the site's output, as `Backend::linear_out` computes them).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        be: &B,
        site: usize,
        y: &mut B::Tensor,
        x: &B::Tensor,
        x_cols: Range<usize>,
        rows: Range<usize>,
        outs: Range<usize>,
        s: f32,
    ) -> Result<()> {
        let Some(p) = self.sites.get(site).and_then(Option::as_ref) else {
            return Ok(());
        };
        let inside = |q: &&Part<B>| q.rows.start >= outs.start && q.rows.end <= outs.end;
        if rows.is_empty() || !p.parts.iter().any(|q| inside(&q)) {
            return Ok(());
        }
        let n = be.shape(x).first().copied().unwrap_or(0);
        let gathered;
        let xr = if rows == (0..n) {
            x
        } else {
            let index: Vec<(u32, u32)> = rows.clone().map(|r| (0, r as u32)).collect();
            gathered = be.gather_rows(&[x], &index)?;
            &gathered
        };
        let h = be.linear_cols(xr, x_cols, &p.down, None)?;
        for q in p.parts.iter().filter(inside) {
            let d = be.linear_cols(&h, q.r.clone(), &q.up, None)?;
            let cols = q.rows.start - outs.start..q.rows.end - outs.start;
            be.add_block(y, rows.clone(), cols, &d, s * q.scale)?;
        }
        Ok(())
    }
}
