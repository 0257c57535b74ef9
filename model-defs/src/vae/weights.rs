//! The VAE's parameters: their diffusers names and shapes, loading them from a `vae/`
//! directory, and a seeded generator for the built-in model.
//!
//! One builder ([`VaeWeights::build`]) asks a [`Source`] for every tensor the config
//! implies, with the shape the config implies, so loading and seeding cannot drift
//! apart. Loading records the names it asked for and then rejects any tensor in the
//! directory that was never asked for (a checkpoint for another config or
//! architecture). The mid-block attention's `to_q|to_k|to_v` are fused into one
//! transposed `[C, 3C]` matrix so the three projections are one GEMM.

use std::cell::RefCell;
use std::path::Path;

use denoised_runtime::{Result, Tensor, WeightStore};

use super::config::VaeConfig;
use crate::flux::weights::{Counting, Seeded, Source};

/// A 2-D convolution: weight `[O, I, k, k]` (PyTorch layout, which is also the layout
/// the im2col GEMM reads) and bias `[O]`.
pub struct Conv {
    pub w: Tensor,
    pub b: Tensor,
}

/// GroupNorm affine parameters `[C]`.
pub struct Norm {
    pub w: Tensor,
    pub b: Tensor,
}

/// diffusers `ResnetBlock2D` (no time embedding).
pub struct Resnet {
    pub norm1: Norm,
    pub conv1: Conv,
    pub norm2: Norm,
    pub conv2: Conv,
    /// 1x1 projection of the input when the block changes the channel count.
    pub shortcut: Option<Conv>,
}

/// The mid block's single-head self-attention over pixels.
pub struct Attention {
    pub norm: Norm,
    /// `to_q|to_k|to_v` stacked and transposed: `[C, 3C]`, so `x[N, C] @ qkv_t` gives
    /// `[q | k | v]` per pixel.
    pub qkv_t: Tensor,
    /// `[3C]`.
    pub qkv_b: Tensor,
    /// `to_out.0`, PyTorch layout `[C_out, C_in]`.
    pub out_w: Tensor,
    pub out_b: Tensor,
}

/// `UNetMidBlock2D`: resnet, optional attention, resnet.
pub struct MidBlock {
    pub resnet0: Resnet,
    pub attn: Option<Attention>,
    pub resnet1: Resnet,
}

/// A `DownEncoderBlock2D` (`resample` = stride-2 downsampler) or `UpDecoderBlock2D`
/// (`resample` = conv after nearest 2x upsampling).
pub struct Block {
    pub resnets: Vec<Resnet>,
    pub resample: Option<Conv>,
}

pub struct Coder {
    pub conv_in: Conv,
    /// Encoder: down blocks; decoder: up blocks, in execution order.
    pub blocks: Vec<Block>,
    pub mid: MidBlock,
    pub norm_out: Norm,
    pub conv_out: Conv,
}

/// Which halves of the VAE a process holds: a preprocess worker only encodes, a
/// postprocess worker only decodes, so each loads (and pages in) only its half.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VaeHalves {
    pub encoder: bool,
    pub decoder: bool,
}

impl VaeHalves {
    pub const BOTH: VaeHalves = VaeHalves {
        encoder: true,
        decoder: true,
    };
    pub const ENCODER: VaeHalves = VaeHalves {
        encoder: true,
        decoder: false,
    };
    pub const DECODER: VaeHalves = VaeHalves {
        encoder: false,
        decoder: true,
    };
    /// A denoise worker's: the VAE's config only (its scale factor), no weights.
    pub const NONE: VaeHalves = VaeHalves {
        encoder: false,
        decoder: false,
    };
}

pub struct VaeWeights {
    pub encoder: Option<Coder>,
    pub decoder: Option<Coder>,
    /// Bytes of each half's weights (f32, on the host); 0 for a half not loaded.
    pub encoder_bytes: u64,
    pub decoder_bytes: u64,
}

/// Wraps a source and records every name asked for, so a loader can then reject the
/// tensors nobody asked for.
struct Recording<'a> {
    inner: &'a dyn Source,
    names: RefCell<Vec<String>>,
}

impl Source for Recording<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.names.borrow_mut().push(name.to_string());
        self.inner.get(name, shape)
    }
}

/// [`Seeded`] with the fan-in of convolutions right, plus the fixture generator's two
/// adjustments that keep a random VAE's outputs in a sane range.
///
/// `Seeded` draws 2-D+ weights from N(0, 1/shape[1]); for a conv weight `[O, I, k, k]`
/// the fan-in is `I*k*k`, so conv weights are drawn as `[O, I*k*k]` and reshaped.
/// As in `gen_fixtures.py`, the encoder's log-variance bias (second half of
/// `encoder.conv_out.bias`) is lowered by 4 (a narrow posterior, like a trained VAE),
/// and `decoder.conv_out.weight` is scaled by 0.6 (output mostly inside [-1, 1]).
struct SeededVae {
    seeded: Seeded,
    latent_channels: usize,
}

impl Source for SeededVae {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let mut t = if shape.len() == 4 {
            let fan_in = shape[1] * shape[2] * shape[3];
            self.seeded
                .get(name, &[shape[0], fan_in])?
                .reshape(shape.to_vec())?
        } else {
            self.seeded.get(name, shape)?
        };
        if name == "encoder.conv_out.bias" {
            let c = self.latent_channels;
            t.data_mut()[c..].iter_mut().for_each(|v| *v -= 4.0);
        } else if name == "decoder.conv_out.weight" {
            t.data_mut().iter_mut().for_each(|v| *v *= 0.6);
        }
        Ok(t)
    }
}

/// All-zero weights: the shapes of a VAE, for sizing (plans, trace footprints); the
/// zeroed allocations are not touched until something computes with them.
struct Zeros;

impl Source for Zeros {
    fn get(&self, _: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::zeros(shape.to_vec()))
    }
}

impl VaeWeights {
    /// Zero weights of `cfg`'s shapes (see [`Zeros`]).
    pub fn zeros(cfg: &VaeConfig, halves: VaeHalves) -> Result<Self> {
        Self::build(cfg, &Zeros, halves)
    }

    /// Loads from a diffusers `vae/` directory: every tensor's name and shape is
    /// checked against the config, and tensors the config does not use are rejected.
    pub fn load(cfg: &VaeConfig, dir: &Path, halves: VaeHalves) -> Result<Self> {
        if halves == VaeHalves::NONE {
            // Not even the safetensors header is opened: a process without the VAE
            // must not depend on its files.
            return Ok(VaeWeights {
                encoder: None,
                decoder: None,
                encoder_bytes: 0,
                decoder_bytes: 0,
            });
        }
        let store = WeightStore::open(dir, "diffusion_pytorch_model")?;
        let rec = Recording {
            inner: &store,
            names: RefCell::new(Vec::new()),
        };
        let w = Self::build(cfg, &rec, halves)?;
        let mut names = rec.names.into_inner();
        // The half left out is skipped on purpose, not unexpected.
        let skipped = |n: &str| {
            (!halves.encoder && n.starts_with("encoder."))
                || (!halves.decoder && n.starts_with("decoder."))
        };
        names.extend(store.names().filter(|n| skipped(n)).map(String::from));
        store.check_all_used(names.iter().map(|s| s.as_str()))?;
        Ok(w)
    }

    /// Loads from a single file (see `super::single_file`), which has checked at open
    /// that every key it holds is one of this config's.
    pub fn load_file(cfg: &VaeConfig, file: &dyn Source, halves: VaeHalves) -> Result<Self> {
        let w = Self::build(cfg, file, halves)?;
        file.release();
        Ok(w)
    }

    /// diffusers' names of every tensor of `cfg`'s VAE, both halves.
    pub fn param_names(cfg: &VaeConfig) -> Result<Vec<String>> {
        let rec = Recording {
            inner: &Zeros,
            names: RefCell::new(Vec::new()),
        };
        Self::build(cfg, &rec, VaeHalves::BOTH)?;
        Ok(rec.names.into_inner())
    }

    /// Deterministic random weights (the built-in model, tests, benchmarks).
    pub fn seeded(cfg: &VaeConfig, seed: u64, halves: VaeHalves) -> Result<Self> {
        Self::build(
            cfg,
            &SeededVae {
                seeded: Seeded { seed },
                latent_channels: cfg.latent_channels,
            },
            halves,
        )
    }

    /// Builds every parameter from `src`, asking for diffusers' names and the shapes
    /// the config implies (the config must be valid).
    pub fn build(c: &VaeConfig, src: &dyn Source, halves: VaeHalves) -> Result<Self> {
        let (encoder, encoder_bytes) = if halves.encoder {
            let counting = Counting::new(src);
            (Some(Self::encoder(c, &counting)?), 4 * counting.elements())
        } else {
            (None, 0)
        };
        let (decoder, decoder_bytes) = if halves.decoder {
            let counting = Counting::new(src);
            (Some(Self::decoder(c, &counting)?), 4 * counting.elements())
        } else {
            (None, 0)
        };
        Ok(VaeWeights {
            encoder,
            decoder,
            encoder_bytes,
            decoder_bytes,
        })
    }

    fn encoder(c: &VaeConfig, src: &dyn Source) -> Result<Coder> {
        let g = Getter { src };
        let ch = &c.block_out_channels;
        let top = *ch.last().expect("validated: at least one level");

        // Asked for in forward order, so a config that disagrees with the weights is
        // reported at the first layer where they part.
        let conv_in = g.conv("encoder.conv_in", ch[0], c.in_channels, 3)?;
        let mut down = Vec::with_capacity(ch.len());
        let mut prev = ch[0];
        for (i, &out) in ch.iter().enumerate() {
            let p = format!("encoder.down_blocks.{i}");
            let resnets = (0..c.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    g.resnet(&format!("{p}.resnets.{j}"), cin, out)
                })
                .collect::<Result<Vec<_>>>()?;
            let resample = if i + 1 < ch.len() {
                Some(g.conv(&format!("{p}.downsamplers.0.conv"), out, out, 3)?)
            } else {
                None
            };
            down.push(Block { resnets, resample });
            prev = out;
        }
        Ok(Coder {
            conv_in,
            blocks: down,
            mid: g.mid("encoder.mid_block", top, c.mid_block_add_attention)?,
            norm_out: g.norm("encoder.conv_norm_out", top)?,
            conv_out: g.conv("encoder.conv_out", 2 * c.latent_channels, top, 3)?,
        })
    }

    fn decoder(c: &VaeConfig, src: &dyn Source) -> Result<Coder> {
        let g = Getter { src };
        let ch = &c.block_out_channels;
        let top = *ch.last().expect("validated: at least one level");
        let conv_in = g.conv("decoder.conv_in", top, c.latent_channels, 3)?;
        let mid = g.mid("decoder.mid_block", top, c.mid_block_add_attention)?;
        let mut up = Vec::with_capacity(ch.len());
        let mut prev = top;
        for (i, &out) in ch.iter().rev().enumerate() {
            let p = format!("decoder.up_blocks.{i}");
            let resnets = (0..=c.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { out };
                    g.resnet(&format!("{p}.resnets.{j}"), cin, out)
                })
                .collect::<Result<Vec<_>>>()?;
            let resample = if i + 1 < ch.len() {
                Some(g.conv(&format!("{p}.upsamplers.0.conv"), out, out, 3)?)
            } else {
                None
            };
            up.push(Block { resnets, resample });
            prev = out;
        }
        Ok(Coder {
            conv_in,
            blocks: up,
            mid,
            norm_out: g.norm("decoder.conv_norm_out", ch[0])?,
            conv_out: g.conv("decoder.conv_out", c.out_channels, ch[0], 3)?,
        })
    }
}

/// Typed accessors over a source, one per layer kind.
struct Getter<'a> {
    src: &'a dyn Source,
}

impl Getter<'_> {
    fn conv(&self, p: &str, o: usize, i: usize, k: usize) -> Result<Conv> {
        Ok(Conv {
            w: self.src.get(&format!("{p}.weight"), &[o, i, k, k])?,
            b: self.src.get(&format!("{p}.bias"), &[o])?,
        })
    }

    fn norm(&self, p: &str, c: usize) -> Result<Norm> {
        Ok(Norm {
            w: self.src.get(&format!("{p}.weight"), &[c])?,
            b: self.src.get(&format!("{p}.bias"), &[c])?,
        })
    }

    fn resnet(&self, p: &str, cin: usize, cout: usize) -> Result<Resnet> {
        Ok(Resnet {
            norm1: self.norm(&format!("{p}.norm1"), cin)?,
            conv1: self.conv(&format!("{p}.conv1"), cout, cin, 3)?,
            norm2: self.norm(&format!("{p}.norm2"), cout)?,
            conv2: self.conv(&format!("{p}.conv2"), cout, cout, 3)?,
            shortcut: if cin != cout {
                Some(self.conv(&format!("{p}.conv_shortcut"), cout, cin, 1)?)
            } else {
                None
            },
        })
    }

    fn attention(&self, p: &str, c: usize) -> Result<Attention> {
        let mut stacked = Vec::with_capacity(3 * c * c);
        let mut qkv_b = Vec::with_capacity(3 * c);
        for n in ["to_q", "to_k", "to_v"] {
            stacked.extend_from_slice(self.src.get(&format!("{p}.{n}.weight"), &[c, c])?.data());
            qkv_b.extend_from_slice(self.src.get(&format!("{p}.{n}.bias"), &[c])?.data());
        }
        // [3C, C] -> [C, 3C].
        let mut qkv_t = vec![0.0f32; 3 * c * c];
        for (o, row) in stacked.chunks_exact(c).enumerate() {
            for (i, v) in row.iter().enumerate() {
                qkv_t[i * 3 * c + o] = *v;
            }
        }
        Ok(Attention {
            norm: self.norm(&format!("{p}.group_norm"), c)?,
            qkv_t: Tensor::new([c, 3 * c], qkv_t)?,
            qkv_b: Tensor::new([3 * c], qkv_b)?,
            out_w: self.src.get(&format!("{p}.to_out.0.weight"), &[c, c])?,
            out_b: self.src.get(&format!("{p}.to_out.0.bias"), &[c])?,
        })
    }

    fn mid(&self, p: &str, c: usize, attn: bool) -> Result<MidBlock> {
        Ok(MidBlock {
            resnet0: self.resnet(&format!("{p}.resnets.0"), c, c)?,
            attn: if attn {
                Some(self.attention(&format!("{p}.attentions.0"), c)?)
            } else {
                None
            },
            resnet1: self.resnet(&format!("{p}.resnets.1"), c, c)?,
        })
    }
}
