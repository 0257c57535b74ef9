//! The sparse pass on a device: [`DenseVae::run_sparse`] runs a [`SparsePlan`] with the
//! device's weights against a template's trace uploaded to the device
//! ([`DeviceTrace`]), through the backend's sparse ops (`Backend::sparse_conv2d` and
//! its siblings: SIGE's gather, GEMM and scatter as kernels on a GPU).
//!
//! It walks the dense pass's own [`forward`] with sparse ops in place of dense ones, so
//! the two cannot disagree on the order of the ops, and it takes each op's pixels
//! from the plan the CPU pass would run: the same regions, the same statistics (the
//! template's, or its sums moved by the changed pixels' old and new values, reduced on
//! the device), the same values outside the regions. The differences from the CPU's
//! tile-based pass (`exec::run`) are in summation order only, and in the mid block's
//! attention, which on the device runs dense at its small level (every query against
//! every key, with the pass's statistics) and keeps the region's queries: the CPU
//! recomputes only the keys and values it must, to the same values.

use denoised_runtime::cpu::conv::group_norm;
use denoised_runtime::cpu::matmul::{matmul, MatRef};
use denoised_runtime::cpu::sparse_conv::{GroupSums, PreAct};
use denoised_runtime::{Backend, Conv2dOpts, Error, Result, Tensor};

use super::super::config::GN_EPS;
use super::super::dense::{forward, Attention, Conv, DenseOps, DenseVae, Norm, VaeOps};
use super::super::{weights, AutoencoderKL};
use super::{Half, SparsePlan, StatsMode, TraceValue, VaeTrace};

/// A template's trace on a device: every value of its pass as the backend's image
/// tensors, and the GroupNorm sums (on the host: a few KB).
pub struct DeviceTrace<B: Backend> {
    values: Vec<B::Tensor>,
    sums: Vec<Option<GroupSums>>,
    bytes: usize,
}

impl<B: Backend> DeviceTrace<B> {
    /// The device memory the trace's values take (in the backend's storage type).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl<B: Backend> DenseVae<B> {
    /// `trace`'s values on this VAE's device (the attention's K and V are not needed:
    /// the device recomputes them).
    pub fn upload_trace(&self, trace: &VaeTrace) -> Result<DeviceTrace<B>> {
        let values = trace
            .values
            .iter()
            .map(|v| self.backend().upload_image(&v.to_tensor()))
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceTrace {
            values,
            sums: trace.sums.clone(),
            bytes: trace.values.iter().map(|v| v.data().len()).sum::<usize>()
                * self.backend().dense_dtype().size_bytes(),
        })
    }

    /// The sparse pass of `plan` (made by the CPU model's
    /// [`super::super::AutoencoderKL::plan_sparse`] for this VAE's config) on `input`,
    /// against `trace`: what [`super::super::AutoencoderKL::run_sparse`] returns, up to
    /// summation order.
    pub fn run_sparse(
        &self,
        plan: &SparsePlan,
        input: &Tensor,
        trace: &DeviceTrace<B>,
    ) -> Result<Tensor> {
        let b = self.backend();
        if trace.values.len() != plan.tiles.len() || input.shape()[1..] != plan.input {
            return Err(Error::shape(
                "sparse VAE",
                format!(
                    "input {:?} and a trace of {} values for a {:?} plan of {} values on {:?}",
                    input.shape(),
                    trace.values.len(),
                    plan.half,
                    plan.tiles.len(),
                    plan.input
                ),
            ));
        }
        let mut ops = SparseOps {
            b,
            groups: self.config().norm_num_groups,
            plan,
            trace,
            next: 0,
        };
        let x = Value::Fresh {
            v: 0,
            t: b.upload_image(input)?,
            pixels: Vec::new(),
        };
        let out = forward(&mut ops, plan.half, self.coder(plan.half)?, &x)?;
        if ops.next + 1 != plan.tiles.len() {
            return Err(Error::Invalid(format!(
                "sparse VAE: the device pass ran {} ops of the plan's {}",
                ops.next,
                plan.tiles.len() - 1
            )));
        }
        b.download_image(out.tensor(trace))
    }
}

impl<B: Backend> DenseVae<B> {
    /// The dense pass of `half` on `input` on the device, recording the template's
    /// trace as [`AutoencoderKL::trace_encode`] / [`AutoencoderKL::trace_decode`] do, up
    /// to summation order: every value downloaded as the pass makes it (a template's
    /// trace lives in host memory, with the template), and the GroupNorm sums and the
    /// attention's K and V made on the host from them (`cpu`: this VAE's host model,
    /// for the attention's weights; its K and V projection is one GEMM at the smallest
    /// level, the sums one read of each value).
    pub fn trace(&self, cpu: &AutoencoderKL, half: Half, input: &Tensor) -> Result<VaeTrace> {
        let b = self.backend();
        let coder = cpu.weights();
        let attn = match half {
            Half::Encoder => coder.encoder.as_ref(),
            Half::Decoder => coder.decoder.as_ref(),
        }
        .and_then(|c| c.mid.attn.as_ref());
        let mut ops = TraceOps {
            dense: self.dense_ops(),
            attn,
            values: vec![input.clone()],
            sums: vec![None],
            kv: None,
        };
        let x = (b.upload_image(input)?, 0);
        forward(&mut ops, half, self.coder(half)?, &x)?;
        Ok(VaeTrace {
            values: ops.values.into_iter().map(TraceValue::from).collect(),
            sums: ops.sums,
            kv: ops.kv.map(TraceValue::from),
        })
    }
}

/// The dense pass, recording (see [`DenseVae::trace`]). A value is the device tensor
/// and its index in the trace.
struct TraceOps<'a, B: Backend> {
    dense: DenseOps<'a, B>,
    attn: Option<&'a weights::Attention>,
    values: Vec<Tensor>,
    sums: Vec<Option<GroupSums>>,
    kv: Option<Tensor>,
}

impl<B: Backend> TraceOps<'_, B> {
    fn keep(&mut self, t: &B::Tensor, sums_of: Option<usize>) -> Result<usize> {
        let sums = sums_of
            .map(|v| GroupSums::of(&self.values[v], self.dense.groups))
            .transpose()?;
        self.values.push(self.dense.b.download_image(t)?);
        self.sums.push(sums);
        Ok(self.values.len() - 1)
    }
}

impl<B: Backend> VaeOps<B::Tensor, B::Weight> for TraceOps<'_, B> {
    type Value = (B::Tensor, usize);

    fn conv(
        &mut self,
        x: &Self::Value,
        c: &Conv<B::Tensor>,
        opts: Conv2dOpts,
        pre: Option<(&Norm<B::Tensor>, bool)>,
        add: Option<&Self::Value>,
    ) -> Result<Self::Value> {
        let out = self.dense.conv(&x.0, c, opts, pre, add.map(|a| &a.0))?;
        let v = self.keep(&out, pre.map(|_| x.1))?;
        Ok((out, v))
    }

    fn attention(
        &mut self,
        x: &Self::Value,
        a: &Attention<B::Tensor, B::Weight>,
    ) -> Result<Self::Value> {
        let w = self.attn.ok_or_else(|| {
            Error::Invalid("VAE trace: the host model has no mid-block attention".into())
        })?;
        self.kv = Some(attention_kv(&self.values[x.1], w, self.dense.groups)?);
        let out = self.dense.attention(&x.0, a)?;
        let v = self.keep(&out, Some(x.1))?;
        Ok((out, v))
    }
}

/// The mid-block attention's `[pixels, K | V]` of `x` (`[1, C, H, W]`), as the CPU
/// pass records them: its GroupNorm, then the K and V columns of the `qkv` projection.
fn attention_kv(x: &Tensor, a: &weights::Attention, groups: usize) -> Result<Tensor> {
    let normed = group_norm(x, groups, &a.norm.w, &a.norm.b, GN_EPS, false)?;
    let (c, px) = (x.shape()[1], x.shape()[2] * x.shape()[3]);
    let mut kv = vec![0f32; px * 2 * c];
    let qkv = a.qkv_t.data();
    let rhs = MatRef {
        data: &qkv[c..],
        rs: 3 * c,
        cs: 1,
    };
    matmul(
        px,
        2 * c,
        c,
        &mut kv,
        2 * c,
        MatRef::transposed(normed.data(), px),
        rhs,
        false,
        true,
    );
    let bias = &a.qkv_b.data()[c..];
    for row in kv.chunks_exact_mut(2 * c) {
        row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
    }
    Tensor::new([px, 2 * c], kv)
}

/// A value of the device pass: the template's (trace value `v` as it is), or the
/// template's with `pixels` recomputed (the input counts as fresh: it is the edit's
/// own everywhere, and no statistics are taken of it).
enum Value<T> {
    Template(usize),
    Fresh { v: usize, t: T, pixels: Vec<u32> },
}

impl<T> Value<T> {
    fn tensor<'a, B: Backend<Tensor = T>>(&'a self, trace: &'a DeviceTrace<B>) -> &'a T {
        match self {
            Value::Template(v) => &trace.values[*v],
            Value::Fresh { t, .. } => t,
        }
    }
}

struct SparseOps<'a, B: Backend> {
    b: &'a B,
    groups: usize,
    plan: &'a SparsePlan,
    trace: &'a DeviceTrace<B>,
    /// The op the pass is at: its output is value `next + 1`.
    next: usize,
}

impl<B: Backend> SparseOps<'_, B> {
    /// The next op's output value and the pixels it recomputes (None: it keeps the
    /// template's).
    fn step(&mut self) -> Result<(usize, Option<Vec<u32>>)> {
        self.next += 1;
        let v = self.next;
        let tiles = self.plan.tiles.get(v).ok_or_else(|| {
            Error::Invalid(format!(
                "sparse VAE: the device pass has more ops than the plan's {}",
                v - 1
            ))
        })?;
        Ok((
            v,
            tiles.as_ref().map(|t| {
                t.all_runs()
                    .iter()
                    .flat_map(|r| (r.x0..r.x1).map(move |x| (r.y * t.w + x) as u32))
                    .collect()
            }),
        ))
    }

    /// The scale and shift of value `v`'s GroupNorm (`norm` over `x`): the template's
    /// statistics, moved by `x`'s recomputed pixels under incremental statistics.
    fn pre(
        &self,
        v: usize,
        x: &Value<B::Tensor>,
        norm: &Norm<B::Tensor>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut sums = self.trace.sums[v]
            .clone()
            .ok_or_else(|| Error::Invalid(format!("VAE trace: no GroupNorm sums for value {v}")))?;
        if let (StatsMode::Incremental, Value::Fresh { v: xv, t, pixels }) = (self.plan.stats, x) {
            let old = &self.trace.values[*xv];
            for (g, (ds, dq)) in self
                .b
                .group_sum_deltas(t, old, pixels, self.groups)?
                .into_iter()
                .enumerate()
            {
                sums.sum[g] += ds;
                sums.sumsq[g] += dq;
            }
        }
        Ok(sums.scale_shift(&norm.host.0, &norm.host.1, GN_EPS))
    }
}

impl<B: Backend> VaeOps<B::Tensor, B::Weight> for SparseOps<'_, B> {
    type Value = Value<B::Tensor>;

    fn conv(
        &mut self,
        x: &Self::Value,
        c: &Conv<B::Tensor>,
        opts: Conv2dOpts,
        pre: Option<(&Norm<B::Tensor>, bool)>,
        add: Option<&Self::Value>,
    ) -> Result<Self::Value> {
        let (v, pixels) = self.step()?;
        let Some(pixels) = pixels else {
            return Ok(Value::Template(v));
        };
        let ss = pre.map(|(n, _)| self.pre(v, x, n)).transpose()?;
        let pre = pre
            .zip(ss.as_ref())
            .map(|((_, silu), (scale, shift))| PreAct { scale, shift, silu });
        let t = self.b.sparse_conv2d(
            x.tensor(self.trace),
            &c.w,
            &c.b,
            opts,
            pre,
            add.map(|a| a.tensor(self.trace)),
            &self.trace.values[v],
            &pixels,
        )?;
        Ok(Value::Fresh { v, t, pixels })
    }

    fn attention(
        &mut self,
        x: &Self::Value,
        a: &Attention<B::Tensor, B::Weight>,
    ) -> Result<Self::Value> {
        let (v, pixels) = self.step()?;
        let Some(pixels) = pixels else {
            return Ok(Value::Template(v));
        };
        let (scale, shift) = self.pre(v, x, &a.norm)?;
        let xt = x.tensor(self.trace);
        let normed = self.b.channel_affine(
            xt,
            PreAct {
                scale: &scale,
                shift: &shift,
                silu: false,
            },
        )?;
        let full = self
            .b
            .image_attention(xt, &normed, &a.qkv, &a.qkv_b, &a.out, &a.out_b)?;
        let t = self.b.put_pixels(&self.trace.values[v], &full, &pixels)?;
        Ok(Value::Fresh { v, t, pixels })
    }
}
