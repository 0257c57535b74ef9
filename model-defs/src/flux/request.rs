//! A request's inputs to the transformer, on the model's device.
//!
//! A serving loop runs a request for 28 steps or so. Everything the transformer reads
//! of it that does not change between steps is uploaded once, when it is admitted: its
//! text embeddings and the RoPE tables of its rows (both computed on the host from the
//! position ids). The computed image rows `[latent | conditioning]` are uploaded once
//! too, and the Euler update then writes the latent columns in place on the device
//! (`Backend::axpy_cols`), so a step moves no latents across PCIe; the final latent is
//! downloaded once at the end.

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::adapters::LoraUse;
use super::config::FluxConfig;
use super::embed;
use super::model::BlockCache;

/// One request's tensors on the model's device.
pub struct RequestTensors<T> {
    /// `[A, in_channels]`: the image tokens it computes (all of them for a full run),
    /// latent columns first.
    pub img: T,
    /// `[T, joint_attention_dim]`.
    pub txt: T,
    /// `[T + A, head_dim]` RoPE cos and sin of its joint rows `[text; image]`.
    pub rope_cos: T,
    pub rope_sin: T,
    /// `[pooled_projection_dim]` (kept on the host: it is packed with the timestep).
    pub pooled: Vec<f32>,
    txt_rows: usize,
    img_rows: usize,
}

impl<T> RequestTensors<T> {
    /// Uploads a request's host inputs: the computed image rows `img` `[A, in_channels]`
    /// and their position ids `[A, 3]`, the text `[T, joint_attention_dim]` and its ids
    /// `[T, 3]`, and the pooled projection.
    pub fn upload<B: Backend<Tensor = T>>(
        backend: &B,
        config: &FluxConfig,
        img: &Tensor,
        img_ids: &Tensor,
        txt: &Tensor,
        txt_ids: &Tensor,
        pooled: &[f32],
    ) -> Result<Self> {
        let (a, t) = (img.rows(), txt.rows());
        check_shape("image tokens", img, &[a, config.in_channels])?;
        check_shape("image ids", img_ids, &[a, 3])?;
        check_shape("text tokens", txt, &[t, config.joint_attention_dim])?;
        check_shape("text ids", txt_ids, &[t, 3])?;
        if pooled.len() != config.pooled_projection_dim {
            return Err(Error::Invalid(format!(
                "pooled projection: {} values, expected {}",
                pooled.len(),
                config.pooled_projection_dim
            )));
        }
        let mut ids = Vec::with_capacity((t + a) * 3);
        ids.extend_from_slice(txt_ids.data());
        ids.extend_from_slice(img_ids.data());
        let hd = config.attention_head_dim;
        let (cos, sin) = embed::rope_tables(&ids, &config.axes_dims_rope);
        Ok(RequestTensors {
            img: backend.upload(img)?,
            txt: backend.upload(txt)?,
            rope_cos: backend.upload(&Tensor::new([t + a, hd], cos)?)?,
            rope_sin: backend.upload(&Tensor::new([t + a, hd], sin)?)?,
            pooled: pooled.to_vec(),
            txt_rows: t,
            img_rows: a,
        })
    }

    pub fn txt_rows(&self) -> usize {
        self.txt_rows
    }
    /// Image tokens computed each step (`A`).
    pub fn img_rows(&self) -> usize {
        self.img_rows
    }
}

/// An edit's inactive image rows at one step, for the blocks a plan computes in full
/// (docs/design.md §Planner): their `[latent | conditioning]` rows `[R, in_channels]`, the
/// latent being the template's at that step, and their RoPE tables `[R, head_dim]`.
pub struct RestRows<T> {
    pub img: T,
    pub rope_cos: T,
    pub rope_sin: T,
    rows: usize,
}

impl<T> RestRows<T> {
    /// Uploads the RoPE tables of the rows with position ids `ids` `[R, 3]`; `img`
    /// (the rows' inputs at the first step) follows with [`RestRows::set_img`].
    pub fn upload<B: Backend<Tensor = T>>(
        backend: &B,
        config: &FluxConfig,
        img: &Tensor,
        ids: &Tensor,
    ) -> Result<Self> {
        let r = ids.rows();
        check_shape("inactive image ids", ids, &[r, 3])?;
        check_shape("inactive image tokens", img, &[r, config.in_channels])?;
        let hd = config.attention_head_dim;
        let (cos, sin) = embed::rope_tables(ids.data(), &config.axes_dims_rope);
        Ok(RestRows {
            img: backend.upload(img)?,
            rope_cos: backend.upload(&Tensor::new([r, hd], cos)?)?,
            rope_sin: backend.upload(&Tensor::new([r, hd], sin)?)?,
            rows: r,
        })
    }

    /// Replaces the rows' inputs (at a new step).
    pub fn set_img<B: Backend<Tensor = T>>(&mut self, backend: &B, img: &Tensor) -> Result<()> {
        if img.rows() != self.rows {
            return Err(Error::Invalid(format!(
                "{} inactive rows, expected {}",
                img.rows(),
                self.rows
            )));
        }
        self.img = backend.upload(img)?;
        Ok(())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// One request of a step: its tensors, where it is in its schedule, and for an edit
/// the template cache of the tokens it does not compute.
pub struct StepRequest<'a, T> {
    pub tensors: &'a RequestTensors<T>,
    /// Timestep as the pipeline passes it (scheduler timestep / 1000).
    pub timestep: f32,
    /// Guidance scale as the pipeline passes it (e.g. 30.0). Ignored by models
    /// without a guidance embedder.
    pub guidance: f32,
    pub cache: Option<&'a dyn BlockCache<T>>,
    /// An edit's inactive rows: for the full blocks of a plan, and always for a Y-mode
    /// template (their K/V are recomputed from them).
    pub rest: Option<&'a RestRows<T>>,
    /// The unmerged LoRAs it runs with at this step (registered on the model).
    pub loras: &'a [LoraUse],
    /// ControlNet residuals added to its computed image rows after each block (an
    /// edit's active rows: its inactive rows keep the template's values).
    pub control: Option<&'a dyn Control<T>>,
}

/// A request's ControlNet residuals at one step (docs/design.md §Adapters): for a block of
/// the transformer, `[A, hidden]` rows to add to its image rows after the block (the
/// residuals of several ControlNets already summed), or none for that block. Asked for
/// in block order, so a provider can stream them in and wait only for a late one.
pub trait Control<T>: Sync {
    /// After double block `block`: the rows, and the scale they are added with.
    fn double(&self, block: usize) -> Result<Option<(&T, f32)>>;
    /// After single block `block` (counted from the first single block).
    fn single(&self, block: usize) -> Result<Option<(&T, f32)>>;
}

pub(super) fn check_shape(what: &str, t: &Tensor, expected: &[usize]) -> Result<()> {
    if t.shape() != expected {
        return Err(Error::Invalid(format!(
            "{what}: shape {:?}, expected {expected:?}",
            t.shape()
        )));
    }
    Ok(())
}
