//! The text encoders on any [`Backend`] (a GPU's, for preprocess workers on a device):
//! [`T5On`] and [`ClipOn`], built from the loaded CPU models, running the same
//! forward through the Backend's text ops.
//!
//! The token and position embeddings stay on the host (a lookup of at most 512 rows,
//! uploaded once per prompt), as does T5's position-bias table, computed on the host
//! and uploaded as one `[heads * len, len]` tensor per prompt. The CPU models stay the
//! reference (their kernels are the CPU backend's text ops).

use std::sync::Arc;

use denoised_runtime::{Backend, Result, Tensor, TextMask};

use super::clip::ClipTextModel;
use super::ops::Linear;
use super::t5::T5Encoder;

struct Lin<B: Backend> {
    w: B::Weight,
    b: Option<B::Tensor>,
}

fn lin<B: Backend>(be: &B, l: &Linear) -> Result<Lin<B>> {
    Ok(Lin {
        w: be.upload_weight(&l.weight()?)?,
        b: l.bias().transpose()?.map(|b| be.upload(&b)).transpose()?,
    })
}

fn vec_up<B: Backend>(be: &B, v: &[f32]) -> Result<B::Tensor> {
    be.upload(&Tensor::new([v.len()], v.to_vec())?)
}

impl<B: Backend> Lin<B> {
    fn run(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.w, self.b.as_ref())
    }
}

struct T5Layer<B: Backend> {
    attn_norm: B::Tensor,
    qkv: Lin<B>,
    o: Lin<B>,
    ff_norm: B::Tensor,
    wi: Lin<B>,
    wo: Lin<B>,
}

/// T5 v1.1's encoder on a backend.
pub struct T5On<B: Backend> {
    backend: Arc<B>,
    cpu: Arc<T5Encoder>,
    layers: Vec<T5Layer<B>>,
    final_norm: B::Tensor,
}

impl<B: Backend> T5On<B> {
    /// Uploads `cpu`'s weights and keeps on the host only what the forward looks up
    /// there (the embedding and the bias table; [`T5Encoder::embeddings_only`]).
    pub fn new(backend: Arc<B>, cpu: Arc<T5Encoder>) -> Result<Self> {
        let be = &*backend;
        let layers = cpu
            .blocks
            .iter()
            .map(|b| {
                Ok(T5Layer {
                    attn_norm: vec_up(be, &b.attn_norm)?,
                    qkv: lin(be, &b.qkv)?,
                    o: lin(be, &b.o)?,
                    ff_norm: vec_up(be, &b.ff_norm)?,
                    wi: lin(be, &b.wi)?,
                    wo: lin(be, &b.wo)?,
                })
            })
            .collect::<Result<_>>()?;
        let final_norm = vec_up(be, &cpu.final_norm)?;
        Ok(T5On {
            layers,
            final_norm,
            cpu: Arc::new(cpu.embeddings_only()),
            backend,
        })
    }

    /// [`T5Encoder::forward`] on the backend: `last_hidden_state [len, d_model]`.
    pub fn forward(&self, ids: &[i64]) -> Result<Tensor> {
        let (be, c) = (&*self.backend, self.cpu.config());
        let (d, len) = (c.d_model, ids.len());
        let mut x = be.upload(&Tensor::new([len, d], self.cpu.input_embeddings(ids)?)?)?;
        let bias = be.upload(&Tensor::new(
            [c.num_heads * len, len],
            self.cpu.position_bias(len),
        )?)?;
        let eps = c.layer_norm_epsilon;
        for l in &self.layers {
            let h = be.rms_norm(&x, &l.attn_norm, eps)?;
            let qkv = l.qkv.run(be, &h)?;
            // T5 folds the 1/sqrt(d_kv) into its initialisation: scale 1.
            let a = be.text_attention(&qkv, c.num_heads, c.d_kv, 1.0, TextMask::Bias(&bias))?;
            be.add(&mut x, &l.o.run(be, &a)?)?;
            let h = be.rms_norm(&x, &l.ff_norm, eps)?;
            let act = be.gated_gelu(&l.wi.run(be, &h)?)?;
            be.add(&mut x, &l.wo.run(be, &act)?)?;
        }
        be.download(&be.rms_norm(&x, &self.final_norm, eps)?)
    }
}

struct ClipLayer<B: Backend> {
    ln1: (B::Tensor, B::Tensor),
    qkv: Lin<B>,
    out: Lin<B>,
    ln2: (B::Tensor, B::Tensor),
    fc1: Lin<B>,
    fc2: Lin<B>,
}

/// CLIP's text model on a backend.
pub struct ClipOn<B: Backend> {
    backend: Arc<B>,
    cpu: Arc<ClipTextModel>,
    layers: Vec<ClipLayer<B>>,
    final_ln: (B::Tensor, B::Tensor),
}

impl<B: Backend> ClipOn<B> {
    /// Uploads `cpu`'s weights and keeps on the host only the embeddings
    /// ([`ClipTextModel::embeddings_only`]).
    pub fn new(backend: Arc<B>, cpu: Arc<ClipTextModel>) -> Result<Self> {
        let be = &*backend;
        let pair = |w: &[f32], b: &[f32]| -> Result<(B::Tensor, B::Tensor)> {
            Ok((vec_up(be, w)?, vec_up(be, b)?))
        };
        let layers = cpu
            .layers
            .iter()
            .map(|l| {
                Ok(ClipLayer {
                    ln1: pair(&l.ln1_w, &l.ln1_b)?,
                    qkv: lin(be, &l.qkv)?,
                    out: lin(be, &l.out)?,
                    ln2: pair(&l.ln2_w, &l.ln2_b)?,
                    fc1: lin(be, &l.fc1)?,
                    fc2: lin(be, &l.fc2)?,
                })
            })
            .collect::<Result<_>>()?;
        let final_ln = pair(&cpu.final_w, &cpu.final_b)?;
        Ok(ClipOn {
            layers,
            final_ln,
            cpu: Arc::new(cpu.embeddings_only()),
            backend,
        })
    }

    /// [`ClipTextModel::forward`] on the backend: `last_hidden_state [len, hidden]`
    /// and `pooler_output [hidden]`.
    pub fn forward(&self, ids: &[i64]) -> Result<(Tensor, Vec<f32>)> {
        let (be, c) = (&*self.backend, self.cpu.config());
        let (d, len) = (c.hidden_size, ids.len());
        let mut x = be.upload(&Tensor::new([len, d], self.cpu.input_embeddings(ids)?)?)?;
        let (heads, hd) = (c.num_attention_heads, c.head_dim());
        let scale = (hd as f32).powf(-0.5);
        let eps = c.layer_norm_eps;
        for l in &self.layers {
            let h = be.layer_norm_affine(&x, &l.ln1.0, &l.ln1.1, eps)?;
            let qkv = l.qkv.run(be, &h)?;
            let a = be.text_attention(&qkv, heads, hd, scale, TextMask::Causal)?;
            be.add(&mut x, &l.out.run(be, &a)?)?;
            let h = be.layer_norm_affine(&x, &l.ln2.0, &l.ln2.1, eps)?;
            let mut f = l.fc1.run(be, &h)?;
            be.quick_gelu(&mut f)?;
            be.add(&mut x, &l.fc2.run(be, &f)?)?;
        }
        let x =
            be.download(&be.layer_norm_affine(&x, &self.final_ln.0, &self.final_ln.1, eps)?)?;
        let at = self.cpu.pooled_index(ids);
        let pooled = x.data()[at * d..(at + 1) * d].to_vec();
        Ok((x, pooled))
    }
}

/// Both text encoders on one device, behind one type (the pipeline is not generic over
/// the text encoders' backend).
pub trait PromptEncoder: Send + Sync {
    /// See [`ClipOn::forward`].
    fn clip(&self, ids: &[i64]) -> Result<(Tensor, Vec<f32>)>;
    /// See [`T5On::forward`].
    fn t5(&self, ids: &[i64]) -> Result<Tensor>;
}

/// [`ClipOn`] and [`T5On`] of one backend.
pub struct TextOn<B: Backend> {
    pub clip: ClipOn<B>,
    pub t5: T5On<B>,
}

impl<B: Backend> PromptEncoder for TextOn<B> {
    fn clip(&self, ids: &[i64]) -> Result<(Tensor, Vec<f32>)> {
        self.clip.forward(ids)
    }
    fn t5(&self, ids: &[i64]) -> Result<Tensor> {
        self.t5.forward(ids)
    }
}
