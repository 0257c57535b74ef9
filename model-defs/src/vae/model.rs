//! `AutoencoderKL` forward passes on the CPU: encode an image to its latent posterior
//! and decode a latent back to an image, as diffusers' `Encoder` / `Decoder` compute
//! them.
//!
//! Activations are NCHW f32 host tensors throughout, the layout of diffusers and of
//! the im2col convolution in `denoised_runtime::cpu::conv`. The mid block's attention
//! is the only place pixels become rows: one GEMM reads the normalised activations
//! through a transposed view into a `[pixels, q|k|v]` buffer, the runtime's tiled
//! attention kernel (one head of width C, no mask) runs on it in place, and the output
//! projection writes straight back into NCHW on top of the residual.
//!
//! The CPU model here is the reference, and the only one with traces and sparse passes
//! (`super::sparse`); [`super::dense::DenseVae`] runs the same dense forward on any
//! `Backend` (the GPU's).
//!
//! An observer sees the intermediate tensors diffusers' forward hooks see, under the
//! same names (`encoder.conv_in`, `encoder.down_blocks.{i}`, `encoder.mid_block`,
//! `encoder`, `decoder.conv_in`, `decoder.mid_block`, `decoder.up_blocks.{i}`), so the
//! reference tests can localise a mismatch to one block.

use std::path::Path;

use denoised_runtime::cpu::conv::{conv2d, group_norm, Conv2dOpts};
use denoised_runtime::cpu::image_attention::image_attention;
use denoised_runtime::cpu::matmul::MatRef;
use denoised_runtime::{Error, Result, Tensor};

use super::config::{VaeConfig, GN_EPS, LOGVAR_RANGE};
use super::weights::{
    Attention, Block, Coder, Conv, MidBlock, Norm, Resnet, VaeHalves, VaeWeights,
};

/// The VAE of FLUX.1: 16 latent channels, no quant convs, mid-block attention.
pub struct AutoencoderKL {
    config: VaeConfig,
    weights: VaeWeights,
}

/// The error of a call into a half this process did not load (a worker of another role).
pub(super) fn missing(half: &str) -> Error {
    Error::Invalid(format!(
        "the VAE {half} is not loaded in this process (each worker loads only its role's components)"
    ))
}

/// Receives `(name, tensor)` for each intermediate of a forward pass.
pub type Observer<'a> = &'a mut dyn FnMut(&str, &Tensor);

impl AutoencoderKL {
    /// Loads a diffusers `vae/` directory (`config.json` +
    /// `diffusion_pytorch_model.safetensors`).
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::load_halves(dir, VaeHalves::BOTH)
    }

    /// Loads only the halves a process uses (see [`VaeHalves`]).
    pub fn load_halves(dir: impl AsRef<Path>, halves: VaeHalves) -> Result<Self> {
        let dir = dir.as_ref();
        let config = VaeConfig::from_file(dir.join("config.json"))?;
        let weights = VaeWeights::load(&config, dir, halves)?;
        Ok(AutoencoderKL { config, weights })
    }

    /// Loads the `halves` of a single-file VAE (BFL's `ae.safetensors`), its config
    /// inferred from the shapes with `hint`'s for what shapes cannot tell (see
    /// [`super::single_file`]).
    pub fn load_file(
        path: impl AsRef<Path>,
        hint: Option<&VaeConfig>,
        halves: VaeHalves,
    ) -> Result<Self> {
        let file = super::single_file::VaeFile::open(path.as_ref(), hint)?;
        let config = file.config.clone();
        let weights = VaeWeights::load_file(&config, &file, halves)?;
        Ok(AutoencoderKL { config, weights })
    }

    /// The halves this VAE holds.
    pub fn halves(&self) -> VaeHalves {
        VaeHalves {
            encoder: self.weights.encoder.is_some(),
            decoder: self.weights.decoder.is_some(),
        }
    }

    /// A VAE with deterministic random weights (see `weights::SeededVae` for the
    /// distributions).
    pub fn seeded(config: VaeConfig, seed: u64) -> Result<Self> {
        Self::seeded_halves(config, seed, VaeHalves::BOTH)
    }

    /// [`seeded`](Self::seeded), with only the given halves.
    pub fn seeded_halves(config: VaeConfig, seed: u64, halves: VaeHalves) -> Result<Self> {
        config.validate().map_err(|reason| {
            Error::Invalid(format!("invalid VAE config for a seeded model: {reason}"))
        })?;
        let weights = VaeWeights::seeded(&config, seed, halves)?;
        Ok(AutoencoderKL { config, weights })
    }

    /// A VAE of `config`'s shapes with zero weights: for sizing plans and traces
    /// (`denoised footprint`), never for images.
    pub fn shapes_only(config: VaeConfig) -> Result<Self> {
        config
            .validate()
            .map_err(|reason| Error::Invalid(format!("invalid VAE config: {reason}")))?;
        let weights = VaeWeights::zeros(&config, VaeHalves::BOTH)?;
        Ok(AutoencoderKL { config, weights })
    }

    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    pub fn weights(&self) -> &VaeWeights {
        &self.weights
    }

    /// `vae.encode(image).latent_dist`: `image` is `[B, in_channels, H, W]` in [-1, 1];
    /// returns `(mean, logvar)`, each `[B, latent_channels, H/f, W/f]` (f =
    /// `vae_scale_factor`), with logvar clamped to [-30, 20].
    pub fn encode(&self, image: &Tensor) -> Result<(Tensor, Tensor)> {
        self.encode_observed(image, &mut |_, _| {})
    }

    /// [`encode`](Self::encode), reporting intermediates to `obs`.
    pub fn encode_observed(&self, image: &Tensor, obs: Observer<'_>) -> Result<(Tensor, Tensor)> {
        let c = &self.config;
        check_input("encode", image, c.in_channels, "in_channels")?;
        let e = self
            .weights
            .encoder
            .as_ref()
            .ok_or_else(|| missing("encoder"))?;
        let mut x = conv(image, &e.conv_in, Conv2dOpts::same(3), None)?;
        obs("encoder.conv_in", &x);
        for (i, block) in e.blocks.iter().enumerate() {
            x = self.block(x, block, DOWNSAMPLE)?;
            obs(&format!("encoder.down_blocks.{i}"), &x);
        }
        x = self.mid(x, &e.mid)?;
        obs("encoder.mid_block", &x);
        let moments = self.head(&x, e)?;
        obs("encoder", &moments);
        split_moments(&moments, c.latent_channels)
    }

    /// `vae.decode(z).sample`: `z` is `[B, latent_channels, h, w]`, already in VAE space
    /// (see [`denormalize`](Self::denormalize)); returns the raw decoder output
    /// `[B, out_channels, h*f, w*f]`, before any clamping.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.decode_observed(z, &mut |_, _| {})
    }

    /// [`decode`](Self::decode), reporting intermediates to `obs`.
    pub fn decode_observed(&self, z: &Tensor, obs: Observer<'_>) -> Result<Tensor> {
        check_input("decode", z, self.config.latent_channels, "latent_channels")?;
        let d = self
            .weights
            .decoder
            .as_ref()
            .ok_or_else(|| missing("decoder"))?;
        let mut x = conv(z, &d.conv_in, Conv2dOpts::same(3), None)?;
        obs("decoder.conv_in", &x);
        x = self.mid(x, &d.mid)?;
        obs("decoder.mid_block", &x);
        for (i, block) in d.blocks.iter().enumerate() {
            x = self.block(x, block, UPSAMPLE)?;
            obs(&format!("decoder.up_blocks.{i}"), &x);
        }
        self.head(&x, d)
    }

    /// The posterior `(mean, logvar)` of the encoder's `[B, 2C, h, w]` moments (the
    /// output of a traced or sparse encoder pass), logvar clamped as in `encode`.
    pub fn latent_dist(&self, moments: &Tensor) -> Result<(Tensor, Tensor)> {
        split_moments(moments, self.config.latent_channels)
    }

    /// The pipeline's latent normalisation: `(mean - shift_factor) * scaling_factor`.
    pub fn normalize(&self, latent: &Tensor) -> Tensor {
        let (s, f) = (self.config.shift(), self.config.scale());
        map(latent, |v| (v - s) * f)
    }

    /// The inverse, before decoding: `latent / scaling_factor + shift_factor`.
    pub fn denormalize(&self, latent: &Tensor) -> Tensor {
        let (s, f) = (self.config.shift(), self.config.scale());
        map(latent, |v| v / f + s)
    }

    /// `std = exp(0.5 * logvar)` of the posterior.
    pub fn std_from_logvar(logvar: &Tensor) -> Tensor {
        map(logvar, |v| (0.5 * v).exp())
    }

    /// The resnets of a block, then its resampler (if any).
    fn block(&self, mut x: Tensor, b: &Block, resample: Conv2dOpts) -> Result<Tensor> {
        for r in &b.resnets {
            x = self.resnet(&x, r)?;
        }
        match &b.resample {
            Some(c) => conv(&x, c, resample, None),
            None => Ok(x),
        }
    }

    fn mid(&self, x: Tensor, m: &MidBlock) -> Result<Tensor> {
        let mut x = self.resnet(&x, &m.resnet0)?;
        if let Some(a) = &m.attn {
            x = self.attention(&x, a)?;
        }
        self.resnet(&x, &m.resnet1)
    }

    /// `conv_norm_out → SiLU → conv_out`.
    fn head(&self, x: &Tensor, c: &Coder) -> Result<Tensor> {
        let h = self.norm(x, &c.norm_out, true)?;
        conv(&h, &c.conv_out, Conv2dOpts::same(3), None)
    }

    fn norm(&self, x: &Tensor, n: &Norm, silu: bool) -> Result<Tensor> {
        group_norm(x, self.config.norm_num_groups, &n.w, &n.b, GN_EPS, silu)
    }

    /// `ResnetBlock2D`: `shortcut(x) + conv2(silu(gn2(conv1(silu(gn1(x))))))`.
    fn resnet(&self, x: &Tensor, r: &Resnet) -> Result<Tensor> {
        let h = self.norm(x, &r.norm1, true)?;
        let h = conv(&h, &r.conv1, Conv2dOpts::same(3), None)?;
        let h = self.norm(&h, &r.norm2, true)?;
        match &r.shortcut {
            Some(s) => {
                let sc = conv(x, s, Conv2dOpts::same(1), None)?;
                conv(&h, &r.conv2, Conv2dOpts::same(3), Some(&sc))
            }
            None => conv(&h, &r.conv2, Conv2dOpts::same(3), Some(x)),
        }
    }

    /// Single-head self-attention over the pixels of each image, plus the residual:
    /// `x + out(softmax(q kᵀ / sqrt(C)) v)` with q, k, v projected from `GN(x)`.
    fn attention(&self, x: &Tensor, a: &Attention) -> Result<Tensor> {
        self.attention_traced(x, a).map(|(out, _)| out)
    }

    /// [`attention`](Self::attention), also returning its `[B*N, 3C]` buffer: the
    /// attention output in the q columns, then every pixel's K and V (what a template
    /// trace keeps for the sparse VAE).
    pub(super) fn attention_traced(&self, x: &Tensor, a: &Attention) -> Result<(Tensor, Vec<f32>)> {
        let normed = self.norm(x, &a.norm, false)?;
        let c = a.out_b.len();
        image_attention(
            x,
            &normed,
            a.qkv_t.data(),
            a.qkv_b.data(),
            MatRef::row_major(a.out_w.data(), c),
            a.out_b.data(),
        )
    }
}

/// diffusers `Downsample2D(padding=0)`: pad right and bottom by one, conv 3x3 stride 2.
pub(super) const DOWNSAMPLE: Conv2dOpts = Conv2dOpts {
    stride: 2,
    pad: [0, 1, 0, 1],
    upsample2x: false,
};

/// diffusers `Upsample2D`: nearest 2x, then conv 3x3 padding 1 (fused into one call).
pub(super) const UPSAMPLE: Conv2dOpts = Conv2dOpts {
    stride: 1,
    pad: [1; 4],
    upsample2x: true,
};

fn conv(x: &Tensor, c: &Conv, opts: Conv2dOpts, add: Option<&Tensor>) -> Result<Tensor> {
    conv2d(x, &c.w, Some(&c.b), opts, add)
}

fn dims(x: &Tensor) -> Result<[usize; 4]> {
    match *x.shape() {
        [b, c, h, w] => Ok([b, c, h, w]),
        ref s => Err(Error::shape(
            "vae",
            format!("expected [B, C, H, W], got {s:?}"),
        )),
    }
}

/// Checks a model input's rank and channel count, and that it is finite-sized.
pub(super) fn check_input(
    op: &'static str,
    x: &Tensor,
    channels: usize,
    field: &str,
) -> Result<()> {
    let [b, c, h, w] = dims(x).map_err(|_| {
        Error::shape(
            op,
            format!("expected [B, {channels}, H, W], got {:?}", x.shape()),
        )
    })?;
    if c != channels {
        return Err(Error::shape(
            op,
            format!(
                "input {:?} has {c} channels, the VAE's {field} is {channels}",
                x.shape()
            ),
        ));
    }
    if b == 0 || h == 0 || w == 0 {
        return Err(Error::shape(op, format!("empty input {:?}", x.shape())));
    }
    Ok(())
}

/// Splits the encoder's `[B, 2C, h, w]` moments into mean and clamped logvar.
pub(super) fn split_moments(m: &Tensor, c: usize) -> Result<(Tensor, Tensor)> {
    let [b, c2, h, w] = dims(m)?;
    if c2 != 2 * c {
        return Err(Error::shape(
            "encode",
            format!("moments {:?}, expected {} channels", m.shape(), 2 * c),
        ));
    }
    let half = c * h * w;
    let mut mean = Vec::with_capacity(b * half);
    let mut logvar = Vec::with_capacity(b * half);
    let (lo, hi) = LOGVAR_RANGE;
    for img in m.data().chunks_exact(2 * half) {
        mean.extend_from_slice(&img[..half]);
        logvar.extend(img[half..].iter().map(|v| v.clamp(lo, hi)));
    }
    Ok((
        Tensor::new([b, c, h, w], mean)?,
        Tensor::new([b, c, h, w], logvar)?,
    ))
}

fn map(t: &Tensor, f: impl Fn(f32) -> f32) -> Tensor {
    let data = t.data().iter().map(|&v| f(v)).collect();
    Tensor::new(t.shape().to_vec(), data).expect("same shape")
}
