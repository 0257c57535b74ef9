//! FLUX ControlNets (diffusers' `FluxControlNetModel`; docs/design.md §Adapters).
//!
//! A ControlNet is the transformer's first N double and M single blocks with its own
//! weights, whose input adds `controlnet_x_embedder(control latents)` to the embedded
//! latents, and whose image rows after each block, through one Linear per block
//! (`controlnet_blocks`, `controlnet_single_blocks`) and scaled, are the residuals the
//! transformer adds after its own blocks (diffusers' `interval_control`: transformer
//! block `i` takes residual `i / ceil(blocks / N)`).
//!
//! It runs on the transformer's own code: `x_embedder([latents | control]) =
//! x_embedder(latents) + controlnet_x_embedder(control)` when the two weights sit side
//! by side along the input, which is how a Fill model already reads `[latent |
//! conditioning]`. So a ControlNet is a [`FluxTransformer`] with twice the input
//! channels (its output head is never read: zeros), and the residuals come from the
//! forward's block images ([`ForwardObserver::block_image`]).

use std::path::Path;

use denoised_runtime::{Backend, Error, Result, Stored, Tensor, WeightStore};

use super::config::FluxConfig;
use super::model::{FluxRequest, FluxTransformer, ForwardObserver};
use super::request::Control;
use super::weights::{param_specs, Linear, Source};

/// A ControlNet's checkpoint as the transformer's weights: `x_embedder` widened with
/// `controlnet_x_embedder` (biases summed), an output head of zeros.
struct AsTransformer {
    store: WeightStore,
    d: usize,
    input: usize,
}

impl Source for AsTransformer {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let (d, i) = (self.d, self.input);
        match name {
            "x_embedder.weight" => {
                let a = self.store.get("x_embedder.weight", &[d, i])?;
                let b = self.store.get("controlnet_x_embedder.weight", &[d, i])?;
                let mut w = Vec::with_capacity(2 * d * i);
                for r in 0..d {
                    w.extend_from_slice(a.row(r));
                    w.extend_from_slice(b.row(r));
                }
                Tensor::new([d, 2 * i], w)
            }
            "x_embedder.bias" => {
                let a = self.store.get("x_embedder.bias", &[d])?;
                let b = self.store.get("controlnet_x_embedder.bias", &[d])?;
                let sum = a.data().iter().zip(b.data()).map(|(x, y)| x + y).collect();
                Tensor::new([d], sum)
            }
            n if n.starts_with("norm_out.") || n.starts_with("proj_out.") => {
                Ok(Tensor::zeros(shape.to_vec()))
            }
            n => self.store.get(n, shape),
        }
    }
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Stored<'_>> {
        if name.starts_with("x_embedder.")
            || name.starts_with("norm_out.")
            || name.starts_with("proj_out.")
        {
            return Ok(Stored::from_tensor(name, &self.get(name, shape)?));
        }
        self.store.stored(name, shape)
    }
    fn release(&self) {
        self.store.release()
    }
}

/// A loaded ControlNet.
pub struct ControlNet<B: Backend> {
    /// The blocks, run as a transformer over `[latents | control latents]`.
    body: FluxTransformer<B>,
    /// `controlnet_blocks` then `controlnet_single_blocks`.
    out: Vec<Linear<B>>,
    doubles: usize,
}

impl<B: Backend> ControlNet<B> {
    /// Loads a diffusers `FluxControlNetModel` directory, checking every tensor.
    pub fn load(backend: B, dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let own = FluxConfig::from_file(dir.join("config.json"))?;
        let store = WeightStore::open(dir, "diffusion_pytorch_model")?;
        let d = own.hidden();
        // What the checkpoint holds: the transformer's parameters but the output head,
        // and the ControlNet's own Linears. (Union ControlNets and input hint blocks,
        // which this does not run, fail here by name.)
        let mut names: Vec<String> = param_specs(&own)
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !n.starts_with("norm_out.") && !n.starts_with("proj_out."))
            .collect();
        for (p, n) in [
            ("controlnet_blocks", own.num_layers),
            ("controlnet_single_blocks", own.num_single_layers),
        ] {
            for i in 0..n {
                names.extend(["weight", "bias"].map(|w| format!("{p}.{i}.{w}")));
            }
        }
        names.extend(["weight", "bias"].map(|w| format!("controlnet_x_embedder.{w}")));
        store.check_all_used(names.iter().map(String::as_str))?;
        let config = FluxConfig {
            in_channels: 2 * own.in_channels,
            out_channels: Some(own.in_channels),
            ..own.clone()
        };
        let src = AsTransformer {
            store,
            d,
            input: own.in_channels,
        };
        let lin = |name: String| -> Result<Linear<B>> {
            let w = src.store.stored(&format!("{name}.weight"), &[d, d])?;
            let b = src.store.stored(&format!("{name}.bias"), &[d])?;
            Ok(Linear {
                w: backend.upload_weight_stored(&[w])?,
                b: Some(backend.upload_stored(&[b])?),
            })
        };
        let mut out = Vec::new();
        for i in 0..own.num_layers {
            out.push(lin(format!("controlnet_blocks.{i}"))?);
        }
        for i in 0..own.num_single_layers {
            out.push(lin(format!("controlnet_single_blocks.{i}"))?);
        }
        let body = FluxTransformer::from_source(backend, config, Box::new(src))?;
        Ok(ControlNet {
            body,
            out,
            doubles: own.num_layers,
        })
    }

    pub fn backend(&self) -> &B {
        self.body.backend()
    }

    /// The ControlNet's own config (its input: the latents' channels).
    pub fn latent_channels(&self) -> usize {
        self.body.config.in_channels / 2
    }

    /// The residuals of one request at one step, at conditioning scale `scale`:
    /// `req.img` is `[latents | control latents]` (the packed VAE encoding of the
    /// control image), the rest as the transformer's request. One `[A, hidden]` tensor
    /// per double block, then per single block (unscaled; the scale travels with them
    /// and is applied where they are added).
    pub fn residuals(
        &self,
        req: &FluxRequest<'_, B::Tensor>,
        scale: f32,
    ) -> Result<Residuals<B::Tensor>> {
        let mut got = Vec::with_capacity(self.out.len());
        self.residuals_streamed(req, &mut |_, r| {
            got.push(r);
            Ok(())
        })?;
        let single = got.split_off(self.doubles);
        Ok(Residuals {
            double: got,
            single,
            scale,
        })
    }

    /// As [`ControlNet::residuals`], handing residual `k` (double blocks first) to
    /// `sink` as soon as its block is done: what a consumer waiting block by block
    /// needs (the ControlNet service streams them).
    pub fn residuals_streamed(
        &self,
        req: &FluxRequest<'_, B::Tensor>,
        sink: &mut dyn FnMut(usize, B::Tensor) -> Result<()>,
    ) -> Result<()> {
        let mut obs = BlockImages {
            be: self.body.backend(),
            out: &self.out,
            sink,
        };
        self.body.forward(std::slice::from_ref(req), &mut obs)?;
        Ok(())
    }

    /// Its residual blocks: double, single.
    pub fn blocks(&self) -> (usize, usize) {
        (self.doubles, self.out.len() - self.doubles)
    }

    /// Its width (a residual's columns).
    pub fn hidden(&self) -> usize {
        self.body.config.hidden()
    }
}

/// Turns each block's image rows into the ControlNet's residual.
struct BlockImages<'a, 's, B: Backend> {
    be: &'a B,
    out: &'a [Linear<B>],
    sink: &'s mut dyn FnMut(usize, B::Tensor) -> Result<()>,
}

impl<B: Backend> ForwardObserver<B::Tensor> for BlockImages<'_, '_, B> {
    fn wants_block_images(&self) -> bool {
        true
    }
    fn block_image(&mut self, block: usize, img: &B::Tensor) -> Result<()> {
        let l = &self.out[block];
        (self.sink)(block, self.be.linear(img, &l.w, l.b.as_ref())?)
    }
}

/// One step of several ControlNets for one request, summed exactly as [`sum`] sums
/// them (the same additions in the same order), handing summed residual `k` (double
/// blocks first) to `sink` as soon as it is final. Every ControlNet but the last runs
/// first; the last one's block `k` completes residual `k`, so a consumer waits for
/// the first residual only one block's time after the last ControlNet starts. Returns
/// the scale the residuals are added with, or `None` when every scale is 0 (nothing
/// was sunk).
pub fn run_summed<B: Backend>(
    be: &B,
    nets: &[(&ControlNet<B>, &FluxRequest<'_, B::Tensor>, f32)],
    sink: &mut dyn FnMut(usize, &B::Tensor) -> Result<()>,
) -> Result<Option<f32>> {
    let live: Vec<_> = nets.iter().filter(|n| n.2 != 0.0).collect();
    let Some(((last, req, last_scale), first)) = live.split_last() else {
        return Ok(None);
    };
    let firsts = first
        .iter()
        .map(|(n, r, s)| n.residuals(r, *s))
        .collect::<Result<Vec<_>>>()?;
    let mut acc: Option<Vec<B::Tensor>> = None;
    let mut scale = *last_scale;
    if let Some(a) = sum(be, firsts)? {
        if (a.double.len(), a.single.len()) != last.blocks() {
            return Err(Error::Invalid(
                "ControlNets of different block counts are not summed".into(),
            ));
        }
        scale = a.scale;
        acc = Some(a.double.into_iter().chain(a.single).collect());
    }
    let alpha = last_scale / scale;
    last.residuals_streamed(req, &mut |k, r| match &mut acc {
        None => sink(k, &r),
        Some(blocks) => {
            let a = &mut blocks[k];
            let (rows, cols) = (be.shape(&r)[0], be.shape(&r)[1]);
            be.add_block(a, 0..rows, 0..cols, &r, alpha)?;
            sink(k, a)
        }
    })?;
    Ok(Some(scale))
}

/// One ControlNet's (or several's, summed) residuals of one request at one step:
/// `scale` times these is what the transformer adds.
pub struct Residuals<T> {
    pub double: Vec<T>,
    pub single: Vec<T>,
    pub scale: f32,
}

/// The residuals a transformer of `blocks` double and `singles` single blocks reads:
/// diffusers' mapping of its blocks onto the ControlNet's.
pub struct ControlFor<T> {
    res: Residuals<T>,
    double_interval: usize,
    single_interval: usize,
}

impl<T> ControlFor<T> {
    pub fn new(res: Residuals<T>, config: &FluxConfig) -> Result<Self> {
        let (double_interval, single_interval) =
            intervals(config, res.double.len(), res.single.len())?;
        Ok(ControlFor {
            double_interval,
            single_interval,
            res,
        })
    }
}

/// Diffusers' `interval_control` for a ControlNet of `doubles` and `singles` blocks on
/// a transformer of `config`: transformer block `i` takes residual `i / interval`.
pub fn intervals(config: &FluxConfig, doubles: usize, singles: usize) -> Result<(usize, usize)> {
    let interval = |blocks: usize, n: usize| {
        if n == 0 {
            usize::MAX
        } else {
            blocks.div_ceil(n)
        }
    };
    if doubles > config.num_layers || singles > config.num_single_layers {
        return Err(Error::Invalid(format!(
            "a ControlNet of {doubles} double and {singles} single blocks for a transformer of {} and {}",
            config.num_layers, config.num_single_layers
        )));
    }
    Ok((
        interval(config.num_layers, doubles),
        interval(config.num_single_layers, singles),
    ))
}

impl<T: Sync> Control<T> for ControlFor<T> {
    fn double(&self, block: usize) -> Result<Option<(&T, f32)>> {
        let r = self.res.double.get(block / self.double_interval);
        Ok(r.map(|t| (t, self.res.scale)))
    }
    fn single(&self, block: usize) -> Result<Option<(&T, f32)>> {
        let r = self.res.single.get(block / self.single_interval);
        Ok(r.map(|t| (t, self.res.scale)))
    }
}

/// Several ControlNets' residuals summed (diffusers' `FluxMultiControlNetModel`):
/// `Σ s_i r_i` per block, kept as `s_0 (r_0 + Σ (s_i / s_0) r_i)` so that no scaling
/// pass is needed (ControlNets of the same block counts; a zero scale drops one).
pub fn sum<B: Backend>(
    be: &B,
    all: Vec<Residuals<B::Tensor>>,
) -> Result<Option<Residuals<B::Tensor>>> {
    let mut all = all.into_iter().filter(|r| r.scale != 0.0);
    let Some(mut acc) = all.next() else {
        return Ok(None);
    };
    for r in all {
        if r.double.len() != acc.double.len() || r.single.len() != acc.single.len() {
            return Err(Error::Invalid(
                "ControlNets of different block counts are not summed".into(),
            ));
        }
        let alpha = r.scale / acc.scale;
        let pairs = acc.double.iter_mut().zip(&r.double);
        for (a, b) in pairs.chain(acc.single.iter_mut().zip(&r.single)) {
            let (rows, cols) = (be.shape(b)[0], be.shape(b)[1]);
            be.add_block(a, 0..rows, 0..cols, b, alpha)?;
        }
    }
    Ok(Some(acc))
}
