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

/// Every parameter of the model: diffusers name and shape.
pub fn param_specs(c: &FluxConfig) -> Vec<(String, Vec<usize>)> {
    let d = c.hidden();
    let hd = c.attention_head_dim;
    let mut v: Vec<(String, Vec<usize>)> = Vec::new();
    let mut lin = |name: &str, o: usize, i: usize| {
        v.push((format!("{name}.weight"), vec![o, i]));
        v.push((format!("{name}.bias"), vec![o]));
    };
    lin("x_embedder", d, c.in_channels);
    lin("context_embedder", d, c.joint_attention_dim);
    lin(
        "time_text_embed.timestep_embedder.linear_1",
        d,
        TIME_PROJ_DIM,
    );
    lin("time_text_embed.timestep_embedder.linear_2", d, d);
    if c.guidance_embeds {
        lin(
            "time_text_embed.guidance_embedder.linear_1",
            d,
            TIME_PROJ_DIM,
        );
        lin("time_text_embed.guidance_embedder.linear_2", d, d);
    }
    lin(
        "time_text_embed.text_embedder.linear_1",
        d,
        c.pooled_projection_dim,
    );
    lin("time_text_embed.text_embedder.linear_2", d, d);
    for i in 0..c.num_layers {
        let p = format!("transformer_blocks.{i}");
        lin(&format!("{p}.norm1.linear"), 6 * d, d);
        lin(&format!("{p}.norm1_context.linear"), 6 * d, d);
        for n in [
            "to_q",
            "to_k",
            "to_v",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_out.0",
            "to_add_out",
        ] {
            lin(&format!("{p}.attn.{n}"), d, d);
        }
        lin(&format!("{p}.ff.net.0.proj"), 4 * d, d);
        lin(&format!("{p}.ff.net.2"), d, 4 * d);
        lin(&format!("{p}.ff_context.net.0.proj"), 4 * d, d);
        lin(&format!("{p}.ff_context.net.2"), d, 4 * d);
    }
    for i in 0..c.num_single_layers {
        let p = format!("single_transformer_blocks.{i}");
        lin(&format!("{p}.norm.linear"), 3 * d, d);
        for n in ["to_q", "to_k", "to_v"] {
            lin(&format!("{p}.attn.{n}"), d, d);
        }
        lin(&format!("{p}.proj_mlp"), 4 * d, d);
        lin(&format!("{p}.proj_out"), d, 5 * d);
    }
    lin("norm_out.linear", 2 * d, d);
    lin(
        "proj_out",
        c.patch_size * c.patch_size * c.out_channels(),
        d,
    );
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
}

impl Source for WeightStore {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        WeightStore::get(self, name, shape)
    }
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>> {
        WeightStore::stored(self, name, shape)
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
    /// Loads from a diffusers `transformer/` directory, checking every tensor.
    pub fn load(backend: &B, cfg: &FluxConfig, dir: &Path) -> Result<Self> {
        let store = WeightStore::open(dir, "diffusion_pytorch_model")?;
        let specs = param_specs(cfg);
        store.check_all_used(specs.iter().map(|(n, _)| n.as_str()))?;
        Self::build(backend, cfg, &store)
    }

    /// Seeded random weights (the built-in model, benchmarks).
    pub fn seeded(backend: &B, cfg: &FluxConfig, seed: u64) -> Result<Self> {
        Self::build(backend, cfg, &Seeded { seed })
    }

    fn build(backend: &B, c: &FluxConfig, src: &dyn Source) -> Result<Self> {
        let d = c.hidden();
        let hd = c.attention_head_dim;
        // Every tensor goes to the backend in its stored dtype (see
        // `Backend::upload_stored`): a bf16 checkpoint reaches a bf16 device without
        // an f32 host copy.
        // Several names stack Linears that read the same input into one
        // `[sum(out), in]` Linear (the fused projections).
        let lin_parts = |names: &[(&str, usize)], i: usize| -> Result<Linear<B>> {
            let (mut w, mut b) = (Vec::new(), Vec::new());
            for &(n, o) in names {
                w.push(src.stored(&format!("{n}.weight"), &[o, i])?);
                b.push(src.stored(&format!("{n}.bias"), &[o])?);
            }
            Ok(Linear {
                w: backend.upload_weight_stored(&w)?,
                b: Some(backend.upload_stored(&b)?),
            })
        };
        let lin = |name: &str, o: usize, i: usize| lin_parts(&[(name, o)], i);
        let vecw = |name: &str| -> Result<B::Tensor> {
            backend.upload_stored(&[src.stored(name, &[hd])?])
        };

        let mut double = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("transformer_blocks.{i}");
            let a = format!("{p}.attn");
            double.push(DoubleBlock {
                norm1: lin(&format!("{p}.norm1.linear"), 6 * d, d)?,
                norm1_context: lin(&format!("{p}.norm1_context.linear"), 6 * d, d)?,
                qkv: lin_parts(
                    &[
                        (&format!("{a}.to_q"), d),
                        (&format!("{a}.to_k"), d),
                        (&format!("{a}.to_v"), d),
                    ],
                    d,
                )?,
                add_qkv: lin_parts(
                    &[
                        (&format!("{a}.add_q_proj"), d),
                        (&format!("{a}.add_k_proj"), d),
                        (&format!("{a}.add_v_proj"), d),
                    ],
                    d,
                )?,
                norm_q: vecw(&format!("{a}.norm_q.weight"))?,
                norm_k: vecw(&format!("{a}.norm_k.weight"))?,
                norm_added_q: vecw(&format!("{a}.norm_added_q.weight"))?,
                norm_added_k: vecw(&format!("{a}.norm_added_k.weight"))?,
                to_out: lin(&format!("{a}.to_out.0"), d, d)?,
                to_add_out: lin(&format!("{a}.to_add_out"), d, d)?,
                ff_in: lin(&format!("{p}.ff.net.0.proj"), 4 * d, d)?,
                ff_out: lin(&format!("{p}.ff.net.2"), d, 4 * d)?,
                ff_context_in: lin(&format!("{p}.ff_context.net.0.proj"), 4 * d, d)?,
                ff_context_out: lin(&format!("{p}.ff_context.net.2"), d, 4 * d)?,
            });
        }
        let mut single = Vec::with_capacity(c.num_single_layers);
        for i in 0..c.num_single_layers {
            let p = format!("single_transformer_blocks.{i}");
            let a = format!("{p}.attn");
            single.push(SingleBlock {
                norm: lin(&format!("{p}.norm.linear"), 3 * d, d)?,
                qkv_mlp: lin_parts(
                    &[
                        (&format!("{a}.to_k"), d),
                        (&format!("{a}.to_v"), d),
                        (&format!("{a}.to_q"), d),
                        (&format!("{p}.proj_mlp"), 4 * d),
                    ],
                    d,
                )?,
                norm_q: vecw(&format!("{a}.norm_q.weight"))?,
                norm_k: vecw(&format!("{a}.norm_k.weight"))?,
                proj_out: lin(&format!("{p}.proj_out"), d, 5 * d)?,
            });
        }
        let tte = "time_text_embed";
        Ok(FluxWeights {
            x_embedder: lin("x_embedder", d, c.in_channels)?,
            context_embedder: lin("context_embedder", d, c.joint_attention_dim)?,
            time_1: lin(
                &format!("{tte}.timestep_embedder.linear_1"),
                d,
                TIME_PROJ_DIM,
            )?,
            time_2: lin(&format!("{tte}.timestep_embedder.linear_2"), d, d)?,
            guidance: if c.guidance_embeds {
                Some((
                    lin(
                        &format!("{tte}.guidance_embedder.linear_1"),
                        d,
                        TIME_PROJ_DIM,
                    )?,
                    lin(&format!("{tte}.guidance_embedder.linear_2"), d, d)?,
                ))
            } else {
                None
            },
            text_1: lin(
                &format!("{tte}.text_embedder.linear_1"),
                d,
                c.pooled_projection_dim,
            )?,
            text_2: lin(&format!("{tte}.text_embedder.linear_2"), d, d)?,
            double,
            single,
            norm_out: lin("norm_out.linear", 2 * d, d)?,
            proj_out: lin(
                "proj_out",
                c.patch_size * c.patch_size * c.out_channels(),
                d,
            )?,
        })
    }
}
