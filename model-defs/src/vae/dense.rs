//! [`DenseVae`]: the VAE's dense encode and decode on any [`Backend`] (a GPU's, for
//! the pre- and postprocess workers on a device).
//!
//! The forward is the CPU model's ([`super::AutoencoderKL`]), block for block, written
//! against the Backend's image ops, so on the CPU backend it runs the very same
//! kernels in the same order and gives the same bits (a test checks it). The CPU
//! model stays the reference and keeps what only it has: observers, traces and the
//! sparse passes of an edit.

use std::sync::Arc;

use denoised_runtime::{Backend, Conv2dOpts, Result, Tensor};

use super::config::{VaeConfig, GN_EPS};
use super::model::{check_input, missing, split_moments, DOWNSAMPLE, UPSAMPLE};
use super::sparse::{DeviceTrace, Half, SparsePlan, VaeTrace};
use super::weights::{self, VaeWeights};
use super::AutoencoderKL;
use crate::lru::ByteLru;

pub(super) struct Conv<T> {
    pub w: T,
    pub b: T,
}

pub(super) struct Norm<T> {
    pub w: T,
    pub b: T,
    /// The affine weight and bias on the host too (a few KB): a sparse pass folds its
    /// own statistics into a per-channel scale and shift there.
    pub host: (Vec<f32>, Vec<f32>),
}

pub(super) struct Resnet<T> {
    norm1: Norm<T>,
    conv1: Conv<T>,
    norm2: Norm<T>,
    conv2: Conv<T>,
    shortcut: Option<Conv<T>>,
}

pub(super) struct Attention<T, W> {
    pub norm: Norm<T>,
    pub qkv: W,
    pub qkv_b: T,
    pub out: W,
    pub out_b: T,
}

/// `UNetMidBlock2D`: resnet, optional attention, resnet.
pub(super) type Mid<T, W> = (Resnet<T>, Option<Attention<T, W>>, Resnet<T>);

pub(super) struct Block<T> {
    resnets: Vec<Resnet<T>>,
    resample: Option<Conv<T>>,
}

pub(super) struct Coder<T, W> {
    conv_in: Conv<T>,
    blocks: Vec<Block<T>>,
    mid: Mid<T, W>,
    norm_out: Norm<T>,
    conv_out: Conv<T>,
}

/// The VAE's halves on a backend (either may be absent, as in [`VaeWeights`]).
pub struct DenseVae<B: Backend> {
    /// Shared with the other models of the process on the same device.
    backend: Arc<B>,
    config: VaeConfig,
    encoder: Option<Coder<B::Tensor, B::Weight>>,
    decoder: Option<Coder<B::Tensor, B::Weight>>,
    /// Template traces resident on the device for the sparse passes, by the key the
    /// pipeline's trace cache uses (see [`DenseCoder::run_sparse`]).
    traces: ByteLru<(u64, Half), DeviceTrace<B>>,
}

impl<B: Backend> DenseVae<B> {
    /// Uploads the halves `vae` holds to `backend`.
    pub fn new(backend: Arc<B>, vae: &AutoencoderKL) -> Result<Self> {
        let w: &VaeWeights = vae.weights();
        let up = Uploader { b: &*backend };
        let encoder = w.encoder.as_ref().map(|c| up.coder(c)).transpose()?;
        let decoder = w.decoder.as_ref().map(|c| up.coder(c)).transpose()?;
        Ok(DenseVae {
            config: vae.config().clone(),
            encoder,
            decoder,
            backend,
            traces: ByteLru::new(0),
        })
    }

    /// This VAE keeping up to `bytes` of template traces resident on its device (0:
    /// each sparse pass uploads its trace and drops it).
    pub fn with_trace_bytes(mut self, bytes: usize) -> Self {
        self.traces = ByteLru::new(bytes);
        self
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// `vae.encode(image).latent_dist` as [`AutoencoderKL::encode`]: `(mean, logvar)`
    /// on the host.
    pub fn encode(&self, image: &Tensor) -> Result<(Tensor, Tensor)> {
        let e = self.encoder.as_ref().ok_or_else(|| missing("encoder"))?;
        check_input("encode", image, self.config.in_channels, "in_channels")?;
        let b = &self.backend;
        let mut ops = self.dense_ops();
        let moments = forward(&mut ops, Half::Encoder, e, &b.upload_image(image)?)?;
        split_moments(&b.download_image(&moments)?, self.config.latent_channels)
    }

    /// `vae.decode(z).sample` as [`AutoencoderKL::decode`], on the host.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let d = self.decoder.as_ref().ok_or_else(|| missing("decoder"))?;
        check_input("decode", z, self.config.latent_channels, "latent_channels")?;
        let b = &self.backend;
        let mut ops = self.dense_ops();
        b.download_image(&forward(&mut ops, Half::Decoder, d, &b.upload_image(z)?)?)
    }

    pub(super) fn dense_ops(&self) -> DenseOps<'_, B> {
        DenseOps {
            b: &self.backend,
            groups: self.config.norm_num_groups,
        }
    }

    /// The half's weights on the device.
    pub(super) fn coder(&self, half: Half) -> Result<&Coder<B::Tensor, B::Weight>> {
        match half {
            Half::Encoder => self.encoder.as_ref().ok_or_else(|| missing("encoder")),
            Half::Decoder => self.decoder.as_ref().ok_or_else(|| missing("decoder")),
        }
    }
}

/// What a pass does at each of the VAE's operations: a convolution with the GroupNorm
/// (and SiLU) before it folded in, or the mid block's attention with its residual.
/// The dense pass ([`DenseOps`]) and the sparse one (`super::sparse::device`) walk the
/// same [`forward`], in the order of the sparse program's ops (`sparse::program`):
/// conv_in, then the blocks and the mid block in the half's order (a resnet as conv1,
/// its shortcut, conv2), then conv_out.
pub(super) trait VaeOps<T, W> {
    type Value;
    fn conv(
        &mut self,
        x: &Self::Value,
        c: &Conv<T>,
        opts: Conv2dOpts,
        pre: Option<(&Norm<T>, bool)>,
        add: Option<&Self::Value>,
    ) -> Result<Self::Value>;
    fn attention(&mut self, x: &Self::Value, a: &Attention<T, W>) -> Result<Self::Value>;
}

/// One half's forward pass over `ops`.
pub(super) fn forward<T, W, O: VaeOps<T, W>>(
    ops: &mut O,
    half: Half,
    c: &Coder<T, W>,
    input: &O::Value,
) -> Result<O::Value> {
    let mut x = ops.conv(input, &c.conv_in, Conv2dOpts::same(3), None, None)?;
    let resample = match half {
        Half::Encoder => DOWNSAMPLE,
        Half::Decoder => UPSAMPLE,
    };
    if half == Half::Decoder {
        x = mid(ops, x, &c.mid)?;
    }
    for block in &c.blocks {
        for r in &block.resnets {
            x = resnet(ops, &x, r)?;
        }
        if let Some(s) = &block.resample {
            x = ops.conv(&x, s, resample, None, None)?;
        }
    }
    if half == Half::Encoder {
        x = mid(ops, x, &c.mid)?;
    }
    ops.conv(
        &x,
        &c.conv_out,
        Conv2dOpts::same(3),
        Some((&c.norm_out, true)),
        None,
    )
}

/// Resnet, attention (`x + out(attn(GN(x)))`), resnet.
fn mid<T, W, O: VaeOps<T, W>>(ops: &mut O, x: O::Value, m: &Mid<T, W>) -> Result<O::Value> {
    let (r0, attn, r1) = m;
    let mut x = resnet(ops, &x, r0)?;
    if let Some(a) = attn {
        x = ops.attention(&x, a)?;
    }
    resnet(ops, &x, r1)
}

/// `shortcut(x) + conv2(silu(gn2(conv1(silu(gn1(x))))))`.
fn resnet<T, W, O: VaeOps<T, W>>(ops: &mut O, x: &O::Value, r: &Resnet<T>) -> Result<O::Value> {
    let same3 = Conv2dOpts::same(3);
    let h = ops.conv(x, &r.conv1, same3, Some((&r.norm1, true)), None)?;
    let sc = match &r.shortcut {
        Some(s) => Some(ops.conv(x, s, Conv2dOpts::same(1), None, None)?),
        None => None,
    };
    ops.conv(
        &h,
        &r.conv2,
        same3,
        Some((&r.norm2, true)),
        Some(sc.as_ref().unwrap_or(x)),
    )
}

/// The dense pass: each op as the backend's GroupNorm, then its convolution.
pub(super) struct DenseOps<'a, B: Backend> {
    pub b: &'a B,
    pub groups: usize,
}

impl<B: Backend> DenseOps<'_, B> {
    fn norm(&self, x: &B::Tensor, n: &Norm<B::Tensor>, silu: bool) -> Result<B::Tensor> {
        self.b.group_norm(x, self.groups, &n.w, &n.b, GN_EPS, silu)
    }
}

impl<B: Backend> VaeOps<B::Tensor, B::Weight> for DenseOps<'_, B> {
    type Value = B::Tensor;

    fn conv(
        &mut self,
        x: &B::Tensor,
        c: &Conv<B::Tensor>,
        opts: Conv2dOpts,
        pre: Option<(&Norm<B::Tensor>, bool)>,
        add: Option<&B::Tensor>,
    ) -> Result<B::Tensor> {
        match pre {
            Some((n, silu)) => self
                .b
                .conv2d(&self.norm(x, n, silu)?, &c.w, &c.b, opts, add),
            None => self.b.conv2d(x, &c.w, &c.b, opts, add),
        }
    }

    fn attention(
        &mut self,
        x: &B::Tensor,
        a: &Attention<B::Tensor, B::Weight>,
    ) -> Result<B::Tensor> {
        let normed = self.norm(x, &a.norm, false)?;
        self.b
            .image_attention(x, &normed, &a.qkv, &a.qkv_b, &a.out, &a.out_b)
    }
}

/// A dense VAE on some device, behind one type: what a pipeline holds to run its
/// dense encodes and decodes off the CPU (the pipeline is not generic over the VAE's
/// backend).
pub trait DenseCoder: Send + Sync {
    /// See [`DenseVae::encode`].
    fn encode(&self, image: &Tensor) -> Result<(Tensor, Tensor)>;
    /// See [`DenseVae::decode`].
    fn decode(&self, z: &Tensor) -> Result<Tensor>;
    /// The backend, for logs and replies (e.g. `emu (F32)`).
    fn device(&self) -> String;
    /// [`DenseVae::run_sparse`] against `trace`, which is uploaded to the device on
    /// first use and kept there under `key` (the content it traces, and the half) while
    /// the device's trace budget holds it.
    fn run_sparse(
        &self,
        plan: &SparsePlan,
        input: &Tensor,
        trace: &VaeTrace,
        key: (u64, Half),
    ) -> Result<Tensor>;
    /// [`DenseVae::trace`]: the dense pass of `half` on the device, recording the
    /// template's trace (`cpu`: the same VAE on the host, for the attention's K and V).
    fn trace(&self, cpu: &AutoencoderKL, half: Half, input: &Tensor) -> Result<VaeTrace>;
}

impl<B: Backend> DenseCoder for DenseVae<B> {
    fn encode(&self, image: &Tensor) -> Result<(Tensor, Tensor)> {
        DenseVae::encode(self, image)
    }
    fn decode(&self, z: &Tensor) -> Result<Tensor> {
        DenseVae::decode(self, z)
    }
    fn device(&self) -> String {
        self.backend.name()
    }
    fn run_sparse(
        &self,
        plan: &SparsePlan,
        input: &Tensor,
        trace: &VaeTrace,
        key: (u64, Half),
    ) -> Result<Tensor> {
        let on_device = match self.traces.get(&key) {
            Some(t) => t,
            None => {
                let t = Arc::new(self.upload_trace(trace)?);
                self.traces.insert(key, t.clone(), t.bytes());
                t
            }
        };
        DenseVae::run_sparse(self, plan, input, &on_device)
    }
    fn trace(&self, cpu: &AutoencoderKL, half: Half, input: &Tensor) -> Result<VaeTrace> {
        DenseVae::trace(self, cpu, half, input)
    }
}

struct Uploader<'a, B: Backend> {
    b: &'a B,
}

impl<B: Backend> Uploader<'_, B> {
    fn conv(&self, c: &weights::Conv) -> Result<Conv<B::Tensor>> {
        Ok(Conv {
            w: self.b.upload_conv(&c.w)?,
            b: self.b.upload(&c.b)?,
        })
    }

    fn norm(&self, n: &weights::Norm) -> Result<Norm<B::Tensor>> {
        Ok(Norm {
            w: self.b.upload(&n.w)?,
            b: self.b.upload(&n.b)?,
            host: (n.w.data().to_vec(), n.b.data().to_vec()),
        })
    }

    fn resnet(&self, r: &weights::Resnet) -> Result<Resnet<B::Tensor>> {
        Ok(Resnet {
            norm1: self.norm(&r.norm1)?,
            conv1: self.conv(&r.conv1)?,
            norm2: self.norm(&r.norm2)?,
            conv2: self.conv(&r.conv2)?,
            shortcut: r.shortcut.as_ref().map(|s| self.conv(s)).transpose()?,
        })
    }

    fn attention(&self, a: &weights::Attention) -> Result<Attention<B::Tensor, B::Weight>> {
        // The CPU model keeps `to_q|to_k|to_v` transposed, `[C, 3C]`; a Linear weight
        // is uploaded in the PyTorch `[out, in]` layout.
        let [c, c3] = [a.qkv_t.shape()[0], a.qkv_t.shape()[1]];
        let t = a.qkv_t.data();
        let mut qkv = vec![0f32; c * c3];
        for i in 0..c {
            for o in 0..c3 {
                qkv[o * c + i] = t[i * c3 + o];
            }
        }
        Ok(Attention {
            norm: self.norm(&a.norm)?,
            qkv: self.b.upload_weight(&Tensor::new([c3, c], qkv)?)?,
            qkv_b: self.b.upload(&a.qkv_b)?,
            out: self.b.upload_weight(&a.out_w)?,
            out_b: self.b.upload(&a.out_b)?,
        })
    }

    fn coder(&self, c: &weights::Coder) -> Result<Coder<B::Tensor, B::Weight>> {
        let blocks = c
            .blocks
            .iter()
            .map(|b| {
                Ok(Block {
                    resnets: b
                        .resnets
                        .iter()
                        .map(|r| self.resnet(r))
                        .collect::<Result<_>>()?,
                    resample: b.resample.as_ref().map(|s| self.conv(s)).transpose()?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Coder {
            conv_in: self.conv(&c.conv_in)?,
            blocks,
            mid: (
                self.resnet(&c.mid.resnet0)?,
                c.mid.attn.as_ref().map(|a| self.attention(a)).transpose()?,
                self.resnet(&c.mid.resnet1)?,
            ),
            norm_out: self.norm(&c.norm_out)?,
            conv_out: self.conv(&c.conv_out)?,
        })
    }
}
