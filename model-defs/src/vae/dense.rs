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
use super::weights::{self, VaeWeights};
use super::AutoencoderKL;

struct Conv<T> {
    w: T,
    b: T,
}

struct Norm<T> {
    w: T,
    b: T,
}

struct Resnet<T> {
    norm1: Norm<T>,
    conv1: Conv<T>,
    norm2: Norm<T>,
    conv2: Conv<T>,
    shortcut: Option<Conv<T>>,
}

struct Attention<T, W> {
    norm: Norm<T>,
    qkv: W,
    qkv_b: T,
    out: W,
    out_b: T,
}

/// `UNetMidBlock2D`: resnet, optional attention, resnet.
type Mid<T, W> = (Resnet<T>, Option<Attention<T, W>>, Resnet<T>);

struct Block<T> {
    resnets: Vec<Resnet<T>>,
    resample: Option<Conv<T>>,
}

struct Coder<T, W> {
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
        })
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
        let mut x = self.conv(
            &b.upload_image(image)?,
            &e.conv_in,
            Conv2dOpts::same(3),
            None,
        )?;
        for block in &e.blocks {
            x = self.block(x, block, DOWNSAMPLE)?;
        }
        x = self.mid(x, &e.mid)?;
        let moments = b.download_image(&self.head(&x, e)?)?;
        split_moments(&moments, self.config.latent_channels)
    }

    /// `vae.decode(z).sample` as [`AutoencoderKL::decode`], on the host.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let d = self.decoder.as_ref().ok_or_else(|| missing("decoder"))?;
        check_input("decode", z, self.config.latent_channels, "latent_channels")?;
        let b = &self.backend;
        let mut x = self.conv(&b.upload_image(z)?, &d.conv_in, Conv2dOpts::same(3), None)?;
        x = self.mid(x, &d.mid)?;
        for block in &d.blocks {
            x = self.block(x, block, UPSAMPLE)?;
        }
        b.download_image(&self.head(&x, d)?)
    }

    fn conv(
        &self,
        x: &B::Tensor,
        c: &Conv<B::Tensor>,
        opts: Conv2dOpts,
        add: Option<&B::Tensor>,
    ) -> Result<B::Tensor> {
        self.backend.conv2d(x, &c.w, &c.b, opts, add)
    }

    fn norm(&self, x: &B::Tensor, n: &Norm<B::Tensor>, silu: bool) -> Result<B::Tensor> {
        let groups = self.config.norm_num_groups;
        self.backend.group_norm(x, groups, &n.w, &n.b, GN_EPS, silu)
    }

    fn block(
        &self,
        mut x: B::Tensor,
        b: &Block<B::Tensor>,
        resample: Conv2dOpts,
    ) -> Result<B::Tensor> {
        for r in &b.resnets {
            x = self.resnet(&x, r)?;
        }
        match &b.resample {
            Some(c) => self.conv(&x, c, resample, None),
            None => Ok(x),
        }
    }

    /// Resnet, attention (`x + out(attn(GN(x)))`), resnet.
    fn mid(&self, x: B::Tensor, m: &Mid<B::Tensor, B::Weight>) -> Result<B::Tensor> {
        let (r0, attn, r1) = m;
        let mut x = self.resnet(&x, r0)?;
        if let Some(a) = attn {
            let normed = self.norm(&x, &a.norm, false)?;
            x = self
                .backend
                .image_attention(&x, &normed, &a.qkv, &a.qkv_b, &a.out, &a.out_b)?;
        }
        self.resnet(&x, r1)
    }

    fn head(&self, x: &B::Tensor, c: &Coder<B::Tensor, B::Weight>) -> Result<B::Tensor> {
        let h = self.norm(x, &c.norm_out, true)?;
        self.conv(&h, &c.conv_out, Conv2dOpts::same(3), None)
    }

    /// `shortcut(x) + conv2(silu(gn2(conv1(silu(gn1(x))))))`.
    fn resnet(&self, x: &B::Tensor, r: &Resnet<B::Tensor>) -> Result<B::Tensor> {
        let h = self.norm(x, &r.norm1, true)?;
        let h = self.conv(&h, &r.conv1, Conv2dOpts::same(3), None)?;
        let h = self.norm(&h, &r.norm2, true)?;
        match &r.shortcut {
            Some(s) => {
                let sc = self.conv(x, s, Conv2dOpts::same(1), None)?;
                self.conv(&h, &r.conv2, Conv2dOpts::same(3), Some(&sc))
            }
            None => self.conv(&h, &r.conv2, Conv2dOpts::same(3), Some(x)),
        }
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
