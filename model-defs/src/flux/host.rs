//! Forwards over host inputs: the reference cases' batched layout ([`FluxInputs`],
//! `denoised bench forward`) and one-off requests ([`FluxRequest`]: the reference tests,
//! ControlNets). Serving uploads a request once instead and steps it with
//! [`FluxTransformer::forward_step`].

use denoised_runtime::{Backend, Error, Result, Tensor};

use super::model::{FluxRequest, FluxTransformer, ForwardObserver};
use super::request::{check_shape, RequestTensors, StepRequest};
use crate::planner::Choice;

/// Plain batched inputs in the layout of the reference cases (`[B, N, C]` tensors).
pub struct FluxInputs {
    pub hidden_states: Tensor,
    pub encoder_hidden_states: Tensor,
    pub pooled_projections: Tensor,
    pub timestep: Vec<f32>,
    pub guidance: Vec<f32>,
    pub img_ids: Tensor,
    pub txt_ids: Tensor,
}

impl FluxInputs {
    /// Reads the inputs from a safetensors file under the reference cases' tensor names
    /// (`hidden_states`, `encoder_hidden_states`, `pooled_projections`, `timestep`,
    /// `guidance` (optional: empty when absent), `img_ids`, `txt_ids`).
    pub fn from_file(f: &denoised_runtime::weights::SafetensorsFile) -> Result<Self> {
        Ok(FluxInputs {
            hidden_states: f.tensor_f32("hidden_states")?,
            encoder_hidden_states: f.tensor_f32("encoder_hidden_states")?,
            pooled_projections: f.tensor_f32("pooled_projections")?,
            timestep: f.tensor_f32("timestep")?.into_data(),
            guidance: if f.contains("guidance") {
                f.tensor_f32("guidance")?.into_data()
            } else {
                vec![]
            },
            img_ids: f.tensor_f32("img_ids")?,
            txt_ids: f.tensor_f32("txt_ids")?,
        })
    }
}

impl<B: Backend> FluxTransformer<B> {
    /// Runs the reference-case layout: `[B, N, C]` inputs, one output `[B, N_img, out]`.
    pub fn forward_inputs(
        &self,
        x: &FluxInputs,
        obs: &mut dyn ForwardObserver<B::Tensor>,
    ) -> Result<Tensor> {
        let hs = x.hidden_states.shape();
        if hs.len() != 3 {
            return Err(Error::Invalid(format!(
                "hidden_states: expected [B, N, C], got {hs:?}"
            )));
        }
        let (b, n) = (hs[0], hs[1]);
        let ts = x.encoder_hidden_states.shape();
        if ts.len() != 3 || ts[0] != b {
            return Err(Error::Invalid(format!(
                "encoder_hidden_states: expected [{b}, T, C], got {ts:?}"
            )));
        }
        let t = ts[1];
        let split = |t: &Tensor, rows: usize| -> Result<Vec<Tensor>> {
            let c = t.cols();
            (0..b)
                .map(|i| {
                    Tensor::new(
                        [rows, c],
                        t.data()[i * rows * c..(i + 1) * rows * c].to_vec(),
                    )
                })
                .collect()
        };
        let imgs = split(&x.hidden_states, n)?;
        let txts = split(&x.encoder_hidden_states, t)?;
        let pooled = x.pooled_projections.data();
        let pd = self.config.pooled_projection_dim;
        check_shape("pooled_projections", &x.pooled_projections, &[b, pd])?;
        let per_batch = |v: &[f32], what: &str| -> Result<Vec<f32>> {
            match v.len() {
                1 => Ok(vec![v[0]; b]),
                l if l == b => Ok(v.to_vec()),
                l => Err(Error::Invalid(format!("{what}: {l} values for batch {b}"))),
            }
        };
        let timestep = per_batch(&x.timestep, "timestep")?;
        let guidance = if x.guidance.is_empty() {
            vec![0.0; b]
        } else {
            per_batch(&x.guidance, "guidance")?
        };
        let reqs: Vec<FluxRequest<'_, B::Tensor>> = (0..b)
            .map(|i| FluxRequest {
                img: &imgs[i],
                img_ids: &x.img_ids,
                txt: &txts[i],
                txt_ids: &x.txt_ids,
                pooled: &pooled[i * pd..(i + 1) * pd],
                timestep: timestep[i],
                guidance: guidance[i],
                cache: None,
            })
            .collect();
        let outs = self.forward(&reqs, obs)?;
        let oc = self.config.out_channels();
        let data: Vec<f32> = outs.into_iter().flat_map(|t| t.into_data()).collect();
        Tensor::new([b, n, oc], data)
    }

    /// One forward over a batch of host inputs; returns each request's output
    /// `[A_r, out_channels]`.
    pub fn forward(
        &self,
        reqs: &[FluxRequest<'_, B::Tensor>],
        obs: &mut dyn ForwardObserver<B::Tensor>,
    ) -> Result<Vec<Tensor>> {
        let tensors = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                RequestTensors::upload(
                    self.backend(),
                    &self.config,
                    r.img,
                    r.img_ids,
                    r.txt,
                    r.txt_ids,
                    r.pooled,
                )
                .map_err(|e| Error::Invalid(format!("request {i}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let steps: Vec<StepRequest<'_, B::Tensor>> = reqs
            .iter()
            .zip(&tensors)
            .map(|(r, t)| StepRequest {
                tensors: t,
                timestep: r.timestep,
                guidance: r.guidance,
                cache: r.cache,
                rest: None,
                loras: &[],
                control: None,
            })
            .collect();
        let v = self.forward_step(&steps, &vec![Choice::Cached; self.num_blocks()], obs)?;
        let out = self.backend().download(&v.packed)?;
        let oc = self.config.out_channels();
        v.rows
            .iter()
            .map(|r| Tensor::new([r.len(), oc], out.data()[r.start * oc..r.end * oc].to_vec()))
            .collect()
    }
}
