//! The Flux transformer's parameters: their names and shapes as diffusers stores them,
//! loading from a directory, and a seeded generator for the built-in model.
//!
//! [`param_specs`] is the single list of expected tensors. Loading checks every name
//! and shape against it (and rejects tensors it does not list); the built-in model
//! generates exactly the same set. After loading, projections that read the same input
//! are fused (`to_q|to_k|to_v`, and `|proj_mlp` in single blocks) so each becomes one
//! GEMM over the packed rows.

use std::path::Path;

use denoised_runtime::{Backend, Result, Stored, Tensor, WeightStore};
use rayon::prelude::*;

use super::config::{FluxConfig, TIME_PROJ_DIM};

/// A PyTorch Linear: weight (`[out, in]` on disk, the backend's layout in memory) and
/// optional bias `[out]`.
pub struct Linear<B: Backend> {
    pub w: B::Weight,
    pub b: Option<B::Tensor>,
}

pub struct DoubleBlock<B: Backend> {
    pub norm1: Linear<B>,
    pub norm1_context: Linear<B>,
    /// `to_q|to_k|to_v` fused: `[3d, d]`.
    pub qkv: Linear<B>,
    /// `add_q_proj|add_k_proj|add_v_proj` fused: `[3d, d]`.
    pub add_qkv: Linear<B>,
    pub norm_q: B::Tensor,
    pub norm_k: B::Tensor,
    pub norm_added_q: B::Tensor,
    pub norm_added_k: B::Tensor,
    pub to_out: Linear<B>,
    pub to_add_out: Linear<B>,
    pub ff_in: Linear<B>,
    pub ff_out: Linear<B>,
    pub ff_context_in: Linear<B>,
    pub ff_context_out: Linear<B>,
}

pub struct SingleBlock<B: Backend> {
    pub norm: Linear<B>,
    /// `to_k|to_v|to_q|proj_mlp` fused: `[7d, d]`. This order puts K and V side by
    /// side (the template cache's `[K|V]` row layout) and the attention output, which
    /// overwrites Q in place, right before the MLP activations, so `proj_out` reads
    /// `[attn | mlp]` as one column block without a concatenation.
    pub qkv_mlp: Linear<B>,
    pub norm_q: B::Tensor,
    pub norm_k: B::Tensor,
    pub proj_out: Linear<B>,
}

pub struct FluxWeights<B: Backend> {
    pub x_embedder: Linear<B>,
    pub context_embedder: Linear<B>,
    pub time_1: Linear<B>,
    pub time_2: Linear<B>,
    pub guidance: Option<(Linear<B>, Linear<B>)>,
    pub text_1: Linear<B>,
    pub text_2: Linear<B>,
    pub double: Vec<DoubleBlock<B>>,
    pub single: Vec<SingleBlock<B>>,
    pub norm_out: Linear<B>,
    pub proj_out: Linear<B>,
}

/// One Linear of the forward: a checkpoint Linear, or the projections a fused layer
/// stacks. The unit that adapters patch (docs/design.md §Adapters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Site {
    XEmbedder,
    ContextEmbedder,
    Time1,
    Time2,
    Guidance1,
    Guidance2,
    Text1,
    Text2,
    NormOut,
    ProjOut,
    Double(usize, DoubleLinear),
    Single(usize, SingleLinear),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DoubleLinear {
    Norm1,
    Norm1Context,
    Qkv,
    AddQkv,
    ToOut,
    ToAddOut,
    FfIn,
    FfOut,
    FfContextIn,
    FfContextOut,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SingleLinear {
    Norm,
    QkvMlp,
    ProjOut,
}

const EMBED_SITES: [Site; 10] = [
    Site::XEmbedder,
    Site::ContextEmbedder,
    Site::Time1,
    Site::Time2,
    Site::Guidance1,
    Site::Guidance2,
    Site::Text1,
    Site::Text2,
    Site::NormOut,
    Site::ProjOut,
];
const DOUBLE_SITES: [DoubleLinear; 10] = [
    DoubleLinear::Norm1,
    DoubleLinear::Norm1Context,
    DoubleLinear::Qkv,
    DoubleLinear::AddQkv,
    DoubleLinear::ToOut,
    DoubleLinear::ToAddOut,
    DoubleLinear::FfIn,
    DoubleLinear::FfOut,
    DoubleLinear::FfContextIn,
    DoubleLinear::FfContextOut,
];
const SINGLE_SITES: [SingleLinear; 3] = [
    SingleLinear::Norm,
    SingleLinear::QkvMlp,
    SingleLinear::ProjOut,
];

/// A site's checkpoint Linears, stacked in this order along the output (diffusers
/// names without `.weight`, and their output features), and its input features.
pub struct SiteSpec {
    pub parts: Vec<(String, usize)>,
    pub input: usize,
}

impl SiteSpec {
    pub fn out(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }
}

impl Site {
    /// Every site of a model of config `c`, in [`Site::index`] order.
    pub fn all(c: &FluxConfig) -> Vec<Site> {
        let mut v: Vec<Site> = EMBED_SITES
            .iter()
            .copied()
            .filter(|s| c.guidance_embeds || !matches!(s, Site::Guidance1 | Site::Guidance2))
            .collect();
        for i in 0..c.num_layers {
            v.extend(DOUBLE_SITES.iter().map(|&k| Site::Double(i, k)));
        }
        for i in 0..c.num_single_layers {
            v.extend(SINGLE_SITES.iter().map(|&k| Site::Single(i, k)));
        }
        v
    }

    /// A dense index over [`Site::all`] of any config (guidance sites keep theirs).
    pub fn index(self, c: &FluxConfig) -> usize {
        let e = EMBED_SITES.len();
        match self {
            Site::Double(i, k) => e + i * DOUBLE_SITES.len() + k as usize,
            Site::Single(i, k) => {
                e + c.num_layers * DOUBLE_SITES.len() + i * SINGLE_SITES.len() + k as usize
            }
            s => EMBED_SITES
                .iter()
                .position(|&x| x == s)
                .expect("an embed site"),
        }
    }

    /// The size of the [`Site::index`] space.
    pub fn count(c: &FluxConfig) -> usize {
        EMBED_SITES.len()
            + c.num_layers * DOUBLE_SITES.len()
            + c.num_single_layers * SINGLE_SITES.len()
    }

    /// Whether this site's weight goes to the device as fp8 when the backend takes
    /// fp8 weights ([`Backend::fp8_weights`]): the blocks' attention projections,
    /// feed-forwards and single-block linears, 72% of FLUX.1-dev's weights and almost
    /// all of a step's GEMM FLOPs. The adaLN modulation linears (`norm1`, `norm`) stay
    /// in the device dtype: they run on one row per segment, so fp8 would save no time,
    /// and every scale, shift and gate of a block comes from them; so do the
    /// embedders and the output layers, which are small.
    pub fn fp8(self) -> bool {
        match self {
            Site::Double(_, k) => !matches!(k, DoubleLinear::Norm1 | DoubleLinear::Norm1Context),
            Site::Single(_, k) => k != SingleLinear::Norm,
            _ => false,
        }
    }

    pub fn spec(self, c: &FluxConfig) -> SiteSpec {
        let d = c.hidden();
        let one = |n: &str, o: usize, i: usize| SiteSpec {
            parts: vec![(n.to_string(), o)],
            input: i,
        };
        let tte = "time_text_embed";
        match self {
            Site::XEmbedder => one("x_embedder", d, c.in_channels),
            Site::ContextEmbedder => one("context_embedder", d, c.joint_attention_dim),
            Site::Time1 => one(
                &format!("{tte}.timestep_embedder.linear_1"),
                d,
                TIME_PROJ_DIM,
            ),
            Site::Time2 => one(&format!("{tte}.timestep_embedder.linear_2"), d, d),
            Site::Guidance1 => one(
                &format!("{tte}.guidance_embedder.linear_1"),
                d,
                TIME_PROJ_DIM,
            ),
            Site::Guidance2 => one(&format!("{tte}.guidance_embedder.linear_2"), d, d),
            Site::Text1 => one(
                &format!("{tte}.text_embedder.linear_1"),
                d,
                c.pooled_projection_dim,
            ),
            Site::Text2 => one(&format!("{tte}.text_embedder.linear_2"), d, d),
            Site::NormOut => one("norm_out.linear", 2 * d, d),
            Site::ProjOut => one(
                "proj_out",
                c.patch_size * c.patch_size * c.out_channels(),
                d,
            ),
            Site::Double(i, k) => {
                let p = format!("transformer_blocks.{i}");
                let a = format!("{p}.attn");
                let parts = |names: &[&str]| SiteSpec {
                    parts: names.iter().map(|n| (format!("{a}.{n}"), d)).collect(),
                    input: d,
                };
                match k {
                    DoubleLinear::Norm1 => one(&format!("{p}.norm1.linear"), 6 * d, d),
                    DoubleLinear::Norm1Context => {
                        one(&format!("{p}.norm1_context.linear"), 6 * d, d)
                    }
                    DoubleLinear::Qkv => parts(&["to_q", "to_k", "to_v"]),
                    DoubleLinear::AddQkv => parts(&["add_q_proj", "add_k_proj", "add_v_proj"]),
                    DoubleLinear::ToOut => one(&format!("{a}.to_out.0"), d, d),
                    DoubleLinear::ToAddOut => one(&format!("{a}.to_add_out"), d, d),
                    DoubleLinear::FfIn => one(&format!("{p}.ff.net.0.proj"), 4 * d, d),
                    DoubleLinear::FfOut => one(&format!("{p}.ff.net.2"), d, 4 * d),
                    DoubleLinear::FfContextIn => {
                        one(&format!("{p}.ff_context.net.0.proj"), 4 * d, d)
                    }
                    DoubleLinear::FfContextOut => one(&format!("{p}.ff_context.net.2"), d, 4 * d),
                }
            }
            Site::Single(i, k) => {
                let p = format!("single_transformer_blocks.{i}");
                match k {
                    SingleLinear::Norm => one(&format!("{p}.norm.linear"), 3 * d, d),
                    // See `SingleBlock::qkv_mlp` for the order.
                    SingleLinear::QkvMlp => SiteSpec {
                        parts: vec![
                            (format!("{p}.attn.to_k"), d),
                            (format!("{p}.attn.to_v"), d),
                            (format!("{p}.attn.to_q"), d),
                            (format!("{p}.proj_mlp"), 4 * d),
                        ],
                        input: d,
                    },
                    SingleLinear::ProjOut => one(&format!("{p}.proj_out"), d, 5 * d),
                }
            }
        }
    }
}

/// Every parameter of the model: diffusers name and shape.
pub fn param_specs(c: &FluxConfig) -> Vec<(String, Vec<usize>)> {
    let hd = c.attention_head_dim;
    let mut v: Vec<(String, Vec<usize>)> = Vec::new();
    for site in Site::all(c) {
        let spec = site.spec(c);
        for (name, o) in spec.parts {
            v.push((format!("{name}.weight"), vec![o, spec.input]));
            v.push((format!("{name}.bias"), vec![o]));
        }
    }
    for i in 0..c.num_layers {
        for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
            v.push((format!("transformer_blocks.{i}.attn.{n}.weight"), vec![hd]));
        }
    }
    for i in 0..c.num_single_layers {
        for n in ["norm_q", "norm_k"] {
            v.push((
                format!("single_transformer_blocks.{i}.attn.{n}.weight"),
                vec![hd],
            ));
        }
    }
    v
}

/// Bytes of `c`'s weights on a device whose dtype takes `dtype_bytes` an element: with
/// `fp8`, the [`Site::fp8`] weights take one byte an element and a f32 scale per
/// output channel.
pub fn weight_bytes(c: &FluxConfig, dtype_bytes: usize, fp8: bool) -> u64 {
    let all: u64 = param_specs(c)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum();
    let quantised: Vec<(u64, u64)> = Site::all(c)
        .into_iter()
        .filter(|s| fp8 && s.fp8())
        .map(|s| {
            let spec = s.spec(c);
            (spec.out() as u64, (spec.out() * spec.input) as u64)
        })
        .collect();
    let fp8_elems: u64 = quantised.iter().map(|q| q.1).sum();
    let scales: u64 = quantised.iter().map(|q| q.0).sum();
    (all - fp8_elems) * dtype_bytes as u64 + fp8_elems + 4 * scales
}

/// Bytes of `c`'s weights on a bf16 device in each form a checkpoint can give them:
/// `bf16`, `fp8` ([`weight_bytes`]), and each GGUF type, quantised as city96's files
/// are (every Linear weight whose rows are whole blocks; the others and the 1-D
/// tensors in bf16). What `denoised footprint` reports, from the config alone.
pub fn weight_forms(c: &FluxConfig) -> std::collections::BTreeMap<String, u64> {
    let mut m = std::collections::BTreeMap::new();
    m.insert("bf16".to_string(), weight_bytes(c, 2, false));
    m.insert("fp8".to_string(), weight_bytes(c, 2, true));
    for q in denoised_runtime::quant::QuantType::ALL {
        let bytes: usize = param_specs(c)
            .iter()
            .map(|(_, s)| {
                let n: usize = s.iter().product();
                match s.as_slice() {
                    [_, k] if k % q.block_elems() == 0 => q.bytes_for(n, "").unwrap_or(2 * n),
                    _ => 2 * n,
                }
            })
            .sum();
        m.insert(q.name().to_string(), bytes as u64);
    }
    m
}

/// Host tensors by name, from a directory or a generator. Every model's loader takes
/// one, so the built-in (seeded) models and real checkpoints share one code path.
pub trait Source {
    /// `name` as an f32 host tensor (the CPU's compute dtype).
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor>;
    /// `name` in its stored dtype: borrowed from the mapped file for a checkpoint, so
    /// a device backend can take it without an f32 copy (see `Backend::upload_stored`).
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>> {
        Ok(Stored::from_tensor(name, &self.get(name, shape)?))
    }
    /// Drops the memory the source keeps resident from its reads while staying
    /// readable: a mapped checkpoint's pages (see `WeightStore::release_pages`). A
    /// model that keeps its source (to restore LoRA-merged sites) calls it after it
    /// has read its weights, so the source costs nothing beside the loaded copy.
    fn release(&self) {}
}

/// Wraps a source and counts the elements it hands out: how a loader learns the
/// weight bytes it holds (reported per component in `/readyz`).
pub struct Counting<'a> {
    inner: &'a dyn Source,
    elements: std::cell::Cell<u64>,
}

impl<'a> Counting<'a> {
    pub fn new(inner: &'a dyn Source) -> Self {
        Counting {
            inner,
            elements: std::cell::Cell::new(0),
        }
    }
    /// Elements handed out so far.
    pub fn elements(&self) -> u64 {
        self.elements.get()
    }
}

impl Counting<'_> {
    fn count(&self, shape: &[usize]) {
        self.elements
            .set(self.elements.get() + shape.iter().product::<usize>() as u64);
    }
}

impl Source for Counting<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.count(shape);
        self.inner.get(name, shape)
    }
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>> {
        self.count(shape);
        self.inner.stored(name, shape)
    }
    fn release(&self) {
        self.inner.release()
    }
}

impl Source for WeightStore {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        WeightStore::get(self, name, shape)
    }
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>> {
        WeightStore::stored(self, name, shape)
    }
    fn release(&self) {
        released(self.dir(), self.release_pages());
    }
}

/// Logs a failed release of a mapped checkpoint's pages (`Source::release`). Advisory:
/// a failure leaves the pages resident, never the weights wrong.
pub(crate) fn released(what: &Path, r: std::io::Result<()>) {
    if let Err(e) = r {
        tracing::warn!(
            "could not release the mapped pages of {}: {e}",
            what.display()
        );
    }
}

/// Deterministic weights from a seed, with the fixture generator's distributions:
/// Linear weights N(0, 1/fan_in), biases N(0, 0.05²), norm weights 1 + 0.15·N(0,1).
pub struct Seeded {
    pub seed: u64,
}

impl Source for Seeded {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        // Each tensor has its own stream (seed mixed with a hash of its name), so a
        // tensor's values do not depend on which others exist or their order.
        let base = self.seed ^ fnv1a(name.as_bytes());
        let (mean, std) = if name.ends_with(".bias") {
            (0.0, 0.05)
        } else if shape.len() == 1 {
            (1.0, 0.15)
        } else {
            (0.0, 1.0 / (shape[1] as f32).sqrt())
        };
        const CHUNK: usize = 1 << 16;
        let mut data = vec![0.0f32; n];
        data.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(ci, chunk)| {
                let mut rng = SplitMix::new(
                    base.wrapping_add((ci as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                );
                for v in chunk.iter_mut() {
                    *v = mean + std * rng.normal();
                }
            });
        Tensor::new(shape.to_vec(), data)
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64: tiny, fast, and good enough for synthetic weights and test data.
pub struct SplitMix {
    state: u64,
    spare: Option<f32>,
}

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix {
            state: seed,
            spare: None,
        }
    }
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 1.0) / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller; both values of a pair are used).
    pub fn normal(&mut self) -> f32 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        self.spare = Some(r * s);
        r * c
    }
}

impl<B: Backend> FluxWeights<B> {
    /// Opens a diffusers `transformer/` directory, checking that it holds exactly the
    /// tensors of `cfg`'s model.
    pub fn open(cfg: &FluxConfig, dir: &Path) -> Result<WeightStore> {
        let store = WeightStore::open(dir, "diffusion_pytorch_model")?;
        let specs = param_specs(cfg);
        store.check_all_used(specs.iter().map(|(n, _)| n.as_str()))?;
        Ok(store)
    }

    /// Uploads every weight of `c`'s model from `src` (an opened directory, or
    /// [`Seeded`] for the built-in model and benchmarks).
    pub fn build(backend: &B, c: &FluxConfig, src: &dyn Source) -> Result<Self> {
        let hd = c.attention_head_dim;
        let lin = |site: Site| upload_site(backend, c, src, site);
        let vecw = |name: &str| -> Result<B::Tensor> {
            backend.upload_stored(&[src.stored(name, &[hd])?])
        };
        let mut double = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let a = format!("transformer_blocks.{i}.attn");
            let s = |k| lin(Site::Double(i, k));
            double.push(DoubleBlock {
                norm1: s(DoubleLinear::Norm1)?,
                norm1_context: s(DoubleLinear::Norm1Context)?,
                qkv: s(DoubleLinear::Qkv)?,
                add_qkv: s(DoubleLinear::AddQkv)?,
                norm_q: vecw(&format!("{a}.norm_q.weight"))?,
                norm_k: vecw(&format!("{a}.norm_k.weight"))?,
                norm_added_q: vecw(&format!("{a}.norm_added_q.weight"))?,
                norm_added_k: vecw(&format!("{a}.norm_added_k.weight"))?,
                to_out: s(DoubleLinear::ToOut)?,
                to_add_out: s(DoubleLinear::ToAddOut)?,
                ff_in: s(DoubleLinear::FfIn)?,
                ff_out: s(DoubleLinear::FfOut)?,
                ff_context_in: s(DoubleLinear::FfContextIn)?,
                ff_context_out: s(DoubleLinear::FfContextOut)?,
            });
        }
        let mut single = Vec::with_capacity(c.num_single_layers);
        for i in 0..c.num_single_layers {
            let a = format!("single_transformer_blocks.{i}.attn");
            let s = |k| lin(Site::Single(i, k));
            single.push(SingleBlock {
                norm: s(SingleLinear::Norm)?,
                qkv_mlp: s(SingleLinear::QkvMlp)?,
                norm_q: vecw(&format!("{a}.norm_q.weight"))?,
                norm_k: vecw(&format!("{a}.norm_k.weight"))?,
                proj_out: s(SingleLinear::ProjOut)?,
            });
        }
        Ok(FluxWeights {
            x_embedder: lin(Site::XEmbedder)?,
            context_embedder: lin(Site::ContextEmbedder)?,
            time_1: lin(Site::Time1)?,
            time_2: lin(Site::Time2)?,
            guidance: if c.guidance_embeds {
                Some((lin(Site::Guidance1)?, lin(Site::Guidance2)?))
            } else {
                None
            },
            text_1: lin(Site::Text1)?,
            text_2: lin(Site::Text2)?,
            double,
            single,
            norm_out: lin(Site::NormOut)?,
            proj_out: lin(Site::ProjOut)?,
        })
    }

    /// Bytes of the weights by the form the backend holds them in (`bf16`, `fp8`,
    /// `Q4_K`, ...): the Linear weights by their own form, biases and norm weights in
    /// the backend's dense dtype.
    pub fn memory(&self, be: &B) -> std::collections::BTreeMap<String, u64> {
        let mut lins: Vec<&Linear<B>> = vec![
            &self.x_embedder,
            &self.context_embedder,
            &self.time_1,
            &self.time_2,
            &self.text_1,
            &self.text_2,
            &self.norm_out,
            &self.proj_out,
        ];
        if let Some((g1, g2)) = &self.guidance {
            lins.extend([g1, g2]);
        }
        let mut vecs: Vec<&B::Tensor> = Vec::new();
        for b in &self.double {
            lins.extend([
                &b.norm1,
                &b.norm1_context,
                &b.qkv,
                &b.add_qkv,
                &b.to_out,
                &b.to_add_out,
                &b.ff_in,
                &b.ff_out,
                &b.ff_context_in,
                &b.ff_context_out,
            ]);
            vecs.extend([&b.norm_q, &b.norm_k, &b.norm_added_q, &b.norm_added_k]);
        }
        for b in &self.single {
            lins.extend([&b.norm, &b.qkv_mlp, &b.proj_out]);
            vecs.extend([&b.norm_q, &b.norm_k]);
        }
        vecs.extend(lins.iter().filter_map(|l| l.b.as_ref()));
        let mut m = std::collections::BTreeMap::new();
        for l in lins {
            *m.entry(be.weight_form(&l.w).to_string()).or_default() += be.weight_bytes(&l.w);
        }
        let dense = be.dense_dtype();
        let elems: usize = vecs
            .iter()
            .map(|t| be.shape(t).iter().product::<usize>())
            .sum();
        *m.entry(format!("{dense:?}").to_lowercase()).or_default() +=
            (elems * dense.size_bytes()) as u64;
        m
    }

    /// The Linear of `site` (`None` for a guidance site of a model without one).
    pub fn site_mut(&mut self, site: Site) -> Option<&mut Linear<B>> {
        Some(match site {
            Site::XEmbedder => &mut self.x_embedder,
            Site::ContextEmbedder => &mut self.context_embedder,
            Site::Time1 => &mut self.time_1,
            Site::Time2 => &mut self.time_2,
            Site::Guidance1 => &mut self.guidance.as_mut()?.0,
            Site::Guidance2 => &mut self.guidance.as_mut()?.1,
            Site::Text1 => &mut self.text_1,
            Site::Text2 => &mut self.text_2,
            Site::NormOut => &mut self.norm_out,
            Site::ProjOut => &mut self.proj_out,
            Site::Double(i, k) => {
                let b = self.double.get_mut(i)?;
                match k {
                    DoubleLinear::Norm1 => &mut b.norm1,
                    DoubleLinear::Norm1Context => &mut b.norm1_context,
                    DoubleLinear::Qkv => &mut b.qkv,
                    DoubleLinear::AddQkv => &mut b.add_qkv,
                    DoubleLinear::ToOut => &mut b.to_out,
                    DoubleLinear::ToAddOut => &mut b.to_add_out,
                    DoubleLinear::FfIn => &mut b.ff_in,
                    DoubleLinear::FfOut => &mut b.ff_out,
                    DoubleLinear::FfContextIn => &mut b.ff_context_in,
                    DoubleLinear::FfContextOut => &mut b.ff_context_out,
                }
            }
            Site::Single(i, k) => {
                let b = self.single.get_mut(i)?;
                match k {
                    SingleLinear::Norm => &mut b.norm,
                    SingleLinear::QkvMlp => &mut b.qkv_mlp,
                    SingleLinear::ProjOut => &mut b.proj_out,
                }
            }
        })
    }
}

/// Uploads the Linear of `site` from `src`: every part in its stored dtype (see
/// `Backend::upload_stored`), so a bf16 checkpoint reaches a bf16 device without an
/// f32 host copy, and an adapter's restore repeats the load bit for bit.
pub(crate) fn upload_site<B: Backend>(
    backend: &B,
    c: &FluxConfig,
    src: &dyn Source,
    site: Site,
) -> Result<Linear<B>> {
    let spec = site.spec(c);
    let b: Vec<Stored<'_>> = spec
        .parts
        .iter()
        .map(|(n, o)| src.stored(&format!("{n}.bias"), &[*o]))
        .collect::<Result<_>>()?;
    Ok(Linear {
        w: upload_site_weight(backend, c, src, site)?,
        b: Some(backend.upload_stored(&b)?),
    })
}

/// The weight of `site` from `src`, as [`upload_site`] uploads it.
pub(crate) fn upload_site_weight<B: Backend>(
    backend: &B,
    c: &FluxConfig,
    src: &dyn Source,
    site: Site,
) -> Result<B::Weight> {
    let spec = site.spec(c);
    let w: Vec<Stored<'_>> = spec
        .parts
        .iter()
        .map(|(n, o)| src.stored(&format!("{n}.weight"), &[*o, spec.input]))
        .collect::<Result<_>>()?;
    upload_weight_at(backend, site, &w)
}

/// Uploads a weight of `site` (its stacked parts): as fp8 where the backend takes fp8
/// weights and the site is one of them ([`Site::fp8`]), else in the device dtype.
pub(crate) fn upload_weight_at<B: Backend>(
    backend: &B,
    site: Site,
    parts: &[Stored<'_>],
) -> Result<B::Weight> {
    if backend.fp8_weights() && site.fp8() {
        backend.upload_weight_fp8(parts)
    } else {
        backend.upload_weight_stored(parts)
    }
}
