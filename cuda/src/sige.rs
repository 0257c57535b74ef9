//! The sparse VAE's ops (SIGE) of [`GpuBackend`]: an edit's VAE layer recomputed only
//! at the pixels its region lists, on top of the template's value of that layer, with
//! the template's trace resident on the device (`kernels/image.cu`, "sige_*").
//!
//! A sparse convolution is the layer's own three steps, as SIGE has them: a **gather**
//! of the listed output pixels' patch rows (the preceding GroupNorm, with the
//! statistics the pass computed, and SiLU applied on the way), the executor's **GEMM**
//! with the weight and bias (the dense im2col path's operands), and a **scatter** of
//! the rows into a copy of the template's output with the residual added. A copy of
//! the template value, not the value itself: a trace is read by every edit of its
//! template. The CPU reference is `denoised_runtime::cpu::sparse_conv`, which does the
//! same tile by tile; the pass that calls these is `denoised_models::vae::sparse`'s.

use denoised_runtime::cpu::sparse_conv::PreAct;
use denoised_runtime::{Conv2dOpts, Error, Result};

use crate::backend::{dev, GpuBackend, GpuTensor};
use crate::exec::{Exec, Gemm, Grid};
use crate::image::i32_of;
use crate::params::ImgParams;

const OP: &str = "sparse VAE";

/// Threads per block.
const BLOCK: u32 = 256;

/// Elements of a group-sum split (as for the dense GroupNorm's statistics).
const SPLIT_ELEMS: usize = 1 << 14;

fn image(what: &str, s: &[usize]) -> Result<[usize; 3]> {
    match *s {
        [1, c, h, w] => Ok([c, h, w]),
        _ => Err(Error::shape(
            OP,
            format!("{what} must be one image [1, C, H, W], got {s:?}"),
        )),
    }
}

fn check_pixels(pixels: &[u32], plane: usize) -> Result<()> {
    match pixels.iter().find(|&&p| p as usize >= plane) {
        Some(p) => Err(Error::shape(
            OP,
            format!("pixel {p} outside a plane of {plane}"),
        )),
        None => Ok(()),
    }
}

impl<E: Exec> GpuBackend<E> {
    /// A device copy of an image (the template's value a sparse layer writes into).
    fn copy_image(&self, t: &GpuTensor<E>) -> Result<GpuTensor<E>> {
        let [c, h, w] = image("a copied value", t.shape())?;
        let out = self.empty(t.shape().to_vec())?;
        let p = ImgParams {
            x: t.addr(),
            y: out.addr(),
            rows: i32_of(OP, h * w)?,
            cols: c as i32,
            ld: c as i32,
            ldy: c as i32,
            ..Default::default()
        };
        i32_of(OP, h * w * c)?;
        self.launch(self.kernel("copy2d"), Grid::linear(h * w * c, BLOCK), &p)?;
        Ok(out)
    }

    /// The per-channel scale and shift as f32 on the device (the gather reads f32 in
    /// either storage type).
    fn upload_pre(&self, pre: Option<PreAct<'_>>, c: usize) -> Result<Option<(E::Mem, u64, u64)>> {
        let Some(pre) = pre else { return Ok(None) };
        if pre.scale.len() != c || pre.shift.len() != c {
            return Err(Error::shape(
                OP,
                format!(
                    "GroupNorm scale {} and shift {} for {c} channels",
                    pre.scale.len(),
                    pre.shift.len()
                ),
            ));
        }
        let bytes: Vec<u8> = pre
            .scale
            .iter()
            .chain(pre.shift)
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let mem = self.exec().alloc(bytes.len()).map_err(dev)?;
        self.exec().upload(&mem, 0, &bytes).map_err(dev)?;
        let a = self.exec().addr(&mem);
        Ok(Some((mem, a, a + 4 * c as u64)))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sige_conv2d(
        &self,
        x: &GpuTensor<E>,
        w: &GpuTensor<E>,
        b: &GpuTensor<E>,
        opts: Conv2dOpts,
        pre: Option<PreAct<'_>>,
        add: Option<&GpuTensor<E>>,
        base: &GpuTensor<E>,
        pixels: &[u32],
    ) -> Result<GpuTensor<E>> {
        let [c, h, wd] = image("input", x.shape())?;
        let [o, oh, ow] = image("template value", base.shape())?;
        let (kh, kw, wc) = match *w.shape() {
            [wo, kh, kw, wc] if wo == o => (kh, kw, wc),
            ref s => {
                return Err(Error::shape(
                    OP,
                    format!("weight [O, kh, kw, I] {s:?} for {o} outputs"),
                ))
            }
        };
        let (eh, ew) = denoised_runtime::cpu::sparse_conv::out_size(h, wd, kh, opts);
        if wc != c
            || kh != kw
            || b.shape() != [o]
            || (eh, ew) != (oh, ow)
            || add.is_some_and(|a| a.shape() != base.shape())
        {
            return Err(Error::shape(
                OP,
                format!(
                    "input {:?}, weight {:?}, bias {:?}, template value {:?}, residual {:?}, {opts:?}",
                    x.shape(),
                    w.shape(),
                    b.shape(),
                    base.shape(),
                    add.map(|a| a.shape())
                ),
            ));
        }
        check_pixels(pixels, oh * ow)?;
        let out = self.copy_image(base)?;
        if pixels.is_empty() {
            return Ok(out);
        }
        let (_pix, pix) = self.upload_u32(pixels)?;
        let pre_dev = self.upload_pre(pre, c)?;
        let (k, sz, n) = (kh * kw * c, self.dtype().size(), pixels.len());
        let chunk = (self.image_workspace / (k * sz)).clamp(1, n);
        let cols = self.empty(vec![chunk, k])?;
        let rows = self.empty(vec![chunk, o])?;
        i32_of(OP, chunk * k.max(o))?;
        let [pt, _, pl, _] = opts.pad;
        for p0 in (0..n).step_by(chunk) {
            let m = chunk.min(n - p0);
            let g = ImgParams {
                x: x.addr(),
                y: cols.addr(),
                z: pix,
                wt: pre_dev.as_ref().map_or(0, |p| p.1),
                bias: pre_dev.as_ref().map_or(0, |p| p.2),
                batch: 1,
                h: h as i32,
                w: wd as i32,
                c: c as i32,
                oh: oh as i32,
                ow: ow as i32,
                kh: kh as i32,
                kw: kw as i32,
                stride: opts.stride as i32,
                pad_t: pt as i32,
                pad_l: pl as i32,
                up: if opts.upsample2x { 2 } else { 1 },
                p0: i32_of(OP, p0)?,
                rows: m as i32,
                silu: pre.is_some_and(|p| p.silu) as i32,
                ..Default::default()
            };
            self.launch(self.kernel("sige_gather"), Grid::linear(m * k, BLOCK), &g)?;
            self.run_gemm(&Gemm {
                dt: self.dtype(),
                n: m,
                m: o,
                k,
                x: cols.addr(),
                ldx: k,
                w: w.addr(),
                bias: Some(b.addr()),
                gelu: false,
                out: rows.addr(),
                ldo: o,
                fp8: None,
            })?;
            self.scatter(&rows, pix + 4 * p0 as u64, m, &out, add)?;
        }
        Ok(out)
    }

    /// Rows `0..n` of `rows` into the pixels listed at `pix` of `out`, plus `add` there.
    fn scatter(
        &self,
        rows: &GpuTensor<E>,
        pix: u64,
        n: usize,
        out: &GpuTensor<E>,
        add: Option<&GpuTensor<E>>,
    ) -> Result<()> {
        let c = out.shape()[1];
        let p = ImgParams {
            x: rows.addr(),
            y: out.addr(),
            z: pix,
            wt: add.map_or(0, |a| a.addr()),
            c: c as i32,
            rows: i32_of(OP, n)?,
            ..Default::default()
        };
        self.launch(self.kernel("sige_scatter"), Grid::linear(n * c, BLOCK), &p)
    }

    pub(crate) fn sige_put_pixels(
        &self,
        base: &GpuTensor<E>,
        src: &GpuTensor<E>,
        pixels: &[u32],
    ) -> Result<GpuTensor<E>> {
        let [c, h, w] = image("template value", base.shape())?;
        if src.shape() != base.shape() {
            return Err(Error::shape(
                OP,
                format!("values {:?} onto {:?}", src.shape(), base.shape()),
            ));
        }
        check_pixels(pixels, h * w)?;
        let out = self.copy_image(base)?;
        if pixels.is_empty() {
            return Ok(out);
        }
        let index: Vec<(u32, u32)> = pixels.iter().map(|&p| (0, p)).collect();
        let rows =
            denoised_runtime::Backend::gather_rows(self, &[&src.view(vec![h * w, c])], &index)?;
        let (_pix, pix) = self.upload_u32(pixels)?;
        self.scatter(&rows, pix, pixels.len(), &out, None)?;
        Ok(out)
    }

    pub(crate) fn sige_channel_affine(
        &self,
        x: &GpuTensor<E>,
        pre: PreAct<'_>,
    ) -> Result<GpuTensor<E>> {
        let [c, h, w] = image("input", x.shape())?;
        let (_mem, scale, shift) = self.upload_pre(Some(pre), c)?.expect("given");
        let out = self.empty(x.shape().to_vec())?;
        let p = ImgParams {
            x: x.addr(),
            y: out.addr(),
            wt: scale,
            bias: shift,
            batch: 1,
            h: h as i32,
            w: w as i32,
            c: c as i32,
            oh: h as i32,
            ow: w as i32,
            kh: 1,
            kw: 1,
            stride: 1,
            up: 1,
            rows: i32_of(OP, h * w)?,
            silu: pre.silu as i32,
            ..Default::default()
        };
        i32_of(OP, h * w * c)?;
        self.launch(
            self.kernel("sige_gather"),
            Grid::linear(h * w * c, BLOCK),
            &p,
        )?;
        Ok(out)
    }

    pub(crate) fn sige_group_sum_deltas(
        &self,
        new: &GpuTensor<E>,
        old: &GpuTensor<E>,
        pixels: &[u32],
        groups: usize,
    ) -> Result<Vec<(f64, f64)>> {
        let [c, h, w] = image("new value", new.shape())?;
        if old.shape() != new.shape() || groups == 0 || c % groups != 0 {
            return Err(Error::shape(
                OP,
                format!(
                    "new {:?}, old {:?}, {groups} groups",
                    new.shape(),
                    old.shape()
                ),
            ));
        }
        check_pixels(pixels, h * w)?;
        if pixels.is_empty() {
            return Ok(vec![(0.0, 0.0); groups]);
        }
        let n = pixels.len();
        let splits = (n * (c / groups)).div_ceil(SPLIT_ELEMS).clamp(1, n);
        let (_pix, pix) = self.upload_u32(pixels)?;
        let partial = self.exec().alloc(groups * splits * 2 * 4).map_err(dev)?;
        let p = ImgParams {
            x: new.addr(),
            y: old.addr(),
            z: pix,
            wt: self.exec().addr(&partial),
            c: c as i32,
            groups: groups as i32,
            splits: splits as i32,
            rows: i32_of(OP, n)?,
            ..Default::default()
        };
        let g = Grid {
            grid: [groups as u32, splits as u32, 1],
            block: [BLOCK, 1, 1],
            smem: 0,
        };
        self.launch(self.kernel("sige_group_delta"), g, &p)?;
        let mut bytes = vec![0u8; groups * splits * 2 * 4];
        self.exec().download(&partial, 0, &mut bytes).map_err(dev)?;
        let f: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect();
        Ok(f.chunks_exact(2 * splits)
            .map(|g| {
                g.chunks_exact(2)
                    .fold((0.0, 0.0), |(s, q), d| (s + d[0] as f64, q + d[1] as f64))
            })
            .collect())
    }
}
