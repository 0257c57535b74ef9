//! The transformer blocks, as diffusers writes them: `FluxTransformerBlock` (double
//! stream: text and image rows with their own weights, one joint attention) and
//! `FluxSingleTransformerBlock` (one stream over the joint `[txt; img]` rows).
//!
//! Every Linear runs once per block over the whole batch; modulation and attention go
//! per request (see model.rs). Each block also serves what the runtime adds to
//! diffusers' forward: the template's K/V or Y slabs (captured or read), the Y-mode
//! edits' inactive rows, LoRAs, ControlNet residuals and the observer.
//!
//! The buffers are those of the forward before it was split into these functions, no
//! more: the fused projections are written in place by norms, RoPE, attention and GELU
//! and read in place by the output projections ([`FluxTransformer::linear_cols_lora`]),
//! and each intermediate is dropped as soon as its consumer has run, which bounds the
//! step's workspace (tests/gpu_transformer.rs measures it on the emulator).

use std::ops::Range;

use denoised_runtime::{AttnSeq, Backend, HeadNorm, QSpan, Result};

use super::super::inactive::Inactive;
use super::super::weights::{DoubleBlock, DoubleLinear, Linear, SingleBlock, SingleLinear, Site};
use super::step::Step;
use super::{modl, FluxTransformer, NORM_EPS};
use crate::flux::template::CacheMode;

/// A double block's adaLN-Zero tables (`norm1`, `norm1_context`), `[B, 6d]` each:
/// shift, scale and gate of the attention, then of the MLP.
struct Ada<T> {
    img: T,
    txt: T,
}

impl<B: Backend> FluxTransformer<B> {
    /// `FluxTransformerBlock`: the image rows `x` and the text rows `ctx`, updated in
    /// place. Per stream, adaLN-Zero: norm1 → joint attention → gated residual, then
    /// norm2 (in one pass with that residual) → FeedForward → gated residual.
    pub(super) fn double_block(
        &self,
        st: &mut Step<'_, '_, B>,
        bi: usize,
        blk: &DoubleBlock<B>,
        x: &mut B::Tensor,
        ctx: &mut B::Tensor,
    ) -> Result<()> {
        let site = |k| Site::Double(bi, k);
        // The conditioning rows: one per request.
        let per_req = |r: usize| Some(r..r + 1);
        let (lo, temb_act) = (&st.lo, &st.temb_act);
        let (s_img, s_txt) = (site(DoubleLinear::Norm1), site(DoubleLinear::Norm1Context));
        let m = Ada {
            img: self.linear_lora(lo, s_img, &blk.norm1, temb_act, &per_req)?,
            txt: self.linear_lora(lo, s_txt, &blk.norm1_context, temb_act, &per_req)?,
        };
        let (a_img, a_txt) = self.double_attention(st, bi, blk, &m, x, ctx)?;
        let p = format_args!("double_block.{bi}.attn");
        self.emit(st.obs, format_args!("{p}.hidden_states"), &a_img)?;
        self.emit(st.obs, format_args!("{p}.encoder_hidden_states"), &a_txt)?;
        self.double_ff(st, bi, blk, &m, (x, a_img), (ctx, a_txt))?;
        self.after_double(st, bi, x, ctx)
    }

    /// The joint attention of a double block (diffusers' `FluxAttention` with added
    /// projections): attention per request over `[text; image]` and the cached tokens'
    /// K/V, then `to_out` and `to_add_out`: the (image, text) outputs.
    fn double_attention(
        &self,
        st: &mut Step<'_, '_, B>,
        bi: usize,
        blk: &DoubleBlock<B>,
        m: &Ada<B::Tensor>,
        x: &B::Tensor,
        ctx: &B::Tensor,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let (be, d) = (&self.backend, self.config.hidden());
        let site = |k| Site::Double(bi, k);
        // The inactive rows' K/V at a cached block of a Y-mode template.
        let s_qkv = site(DoubleLinear::Qkv);
        let side_kv = self.side_kv(st, &m.img, &blk.qkv, s_qkv, d..3 * d, &blk.norm_k)?;
        // Fused projections give [q | k | v] per stream; attention reads both streams
        // in place and writes its output over q, which the output projections read.
        let (mut qkv_i, mut qkv_t) = self.double_qkv(st, bi, blk, m, x, ctx)?;
        let lay = &st.rows.phase.layout;
        for (ri, rows) in lay.img.iter().enumerate() {
            if st.obs.captures(ri) == Some(CacheMode::Kv) {
                st.obs
                    .block_slab(ri, bi, &be.gather_cols(&qkv_i, rows.clone(), d..3 * d)?)?;
            }
        }
        let spans = |r: usize| {
            let (t, i) = (lay.txt[r].clone(), lay.img[r].clone());
            let q = vec![
                QSpan {
                    buf: 0,
                    rows: t.clone(),
                },
                QSpan {
                    buf: 1,
                    rows: i.clone(),
                },
            ];
            (q, vec![(0, t), (1, i)])
        };
        let seqs = self.seqs(st, bi, &side_kv, spans, d)?;
        let heads = self.config.num_attention_heads;
        be.attention(&mut [&mut qkv_t, &mut qkv_i], 0, d, heads, &seqs)?;
        drop(seqs);
        drop(side_kv);
        let img_rows = |r: usize| Some(lay.img[r].clone());
        let txt_rows = |r: usize| Some(lay.txt[r].clone());
        let (s_img, s_txt) = (site(DoubleLinear::ToOut), site(DoubleLinear::ToAddOut));
        let a_img = self.linear_cols_lora(&st.lo, s_img, &blk.to_out, &qkv_i, 0..d, &img_rows)?;
        let a_txt =
            self.linear_cols_lora(&st.lo, s_txt, &blk.to_add_out, &qkv_t, 0..d, &txt_rows)?;
        Ok((a_img, a_txt))
    }

    /// Each stream's `norm1` (adaLN chunks 0 and 1), fused `[q | k | v]` projection,
    /// and RMSNorm and RoPE of q and k: `(image, text)`.
    fn double_qkv(
        &self,
        st: &Step<'_, '_, B>,
        bi: usize,
        blk: &DoubleBlock<B>,
        m: &Ada<B::Tensor>,
        x: &B::Tensor,
        ctx: &B::Tensor,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let (be, d) = (&self.backend, self.config.hidden());
        let site = |k| Site::Double(bi, k);
        let (lay, text) = (&st.rows.phase.layout, &st.rows.text);
        let img_rows = |r: usize| Some(lay.img[r].clone());
        let txt_rows = |r: usize| Some(lay.txt[r].clone());
        let (mi, mt) = ((&m.img, &lay.img_seg), (&m.txt, &lay.txt_seg));
        let nx = be.layer_norm_modulate(x, NORM_EPS, modl(mi.0, 0, mi.1), modl(mi.0, 1, mi.1))?;
        let nc = be.layer_norm_modulate(ctx, NORM_EPS, modl(mt.0, 0, mt.1), modl(mt.0, 1, mt.1))?;
        let mut qkv_i =
            self.linear_lora(&st.lo, site(DoubleLinear::Qkv), &blk.qkv, &nx, &img_rows)?;
        let s = site(DoubleLinear::AddQkv);
        let mut qkv_t = self.linear_lora(&st.lo, s, &blk.add_qkv, &nc, &txt_rows)?;
        drop((nx, nc));
        let rope_img = Some((
            st.rows.phase.rope_img.0.get(),
            st.rows.phase.rope_img.1.get(),
        ));
        let rope_txt = Some((text.rope_cos.get(), text.rope_sin.get()));
        let (q, k) = (0..d, d..2 * d);
        let img = [hn(q.clone(), &blk.norm_q), hn(k.clone(), &blk.norm_k)];
        be.rms_norm_rope(&mut qkv_i, &img, NORM_EPS, rope_img)?;
        let txt = [hn(q, &blk.norm_added_q), hn(k, &blk.norm_added_k)];
        be.rms_norm_rope(&mut qkv_t, &txt, NORM_EPS, rope_txt)?;
        Ok((qkv_i, qkv_t))
    }

    /// The rest of a double block, per stream `(rows, attention output)`: the
    /// attention's gated residual (adaLN chunk 2) and `norm2` (chunks 3 and 4) in one
    /// pass (nothing reads the rows between them: the observer has seen the attention
    /// output, and ControlNet, observer and capture come after the block), the
    /// FeedForward, and its gated residual (chunk 5). That last residual is not fused
    /// with the next block's `norm1`: the ControlNet residuals, the observer and a
    /// Y-mode capture read the block's output between them.
    fn double_ff(
        &self,
        st: &mut Step<'_, '_, B>,
        bi: usize,
        blk: &DoubleBlock<B>,
        m: &Ada<B::Tensor>,
        (x, a_img): (&mut B::Tensor, B::Tensor),
        (ctx, a_txt): (&mut B::Tensor, B::Tensor),
    ) -> Result<()> {
        let be = &self.backend;
        let site = |k| Site::Double(bi, k);
        let lay = &st.rows.phase.layout;
        let img_rows = |r: usize| Some(lay.img[r].clone());
        let txt_rows = |r: usize| Some(lay.txt[r].clone());
        let (mi, mt) = ((&m.img, &lay.img_seg), (&m.txt, &lay.txt_seg));
        let (g, sh, sc) = (
            modl(mi.0, 2, mi.1),
            modl(mi.0, 3, mi.1),
            modl(mi.0, 4, mi.1),
        );
        let nx = be.residual_layer_norm_modulate(x, &a_img, g, NORM_EPS, sh, sc)?;
        drop(a_img);
        let (f_in, f_out) = (site(DoubleLinear::FfIn), site(DoubleLinear::FfOut));
        let ff = self.ff(
            &st.lo,
            &nx,
            (f_in, &blk.ff_in),
            (f_out, &blk.ff_out),
            &img_rows,
        )?;
        self.emit(st.obs, format_args!("double_block.{bi}.ff"), &ff)?;
        be.gated_residual(x, &ff, modl(mi.0, 5, mi.1))?;
        let (g, sh, sc) = (
            modl(mt.0, 2, mt.1),
            modl(mt.0, 3, mt.1),
            modl(mt.0, 4, mt.1),
        );
        let nc = be.residual_layer_norm_modulate(ctx, &a_txt, g, NORM_EPS, sh, sc)?;
        drop(a_txt);
        let ffc = self.ff(
            &st.lo,
            &nc,
            (site(DoubleLinear::FfContextIn), &blk.ff_context_in),
            (site(DoubleLinear::FfContextOut), &blk.ff_context_out),
            &txt_rows,
        )?;
        self.emit(st.obs, format_args!("double_block.{bi}.ff_context"), &ffc)?;
        be.gated_residual(ctx, &ffc, modl(mt.0, 5, mt.1))
    }

    /// After a double block: the ControlNet residuals, the observer's reports, a Y-mode
    /// capture's slab, and the inactive rows' next input.
    fn after_double(
        &self,
        st: &mut Step<'_, '_, B>,
        bi: usize,
        x: &mut B::Tensor,
        ctx: &B::Tensor,
    ) -> Result<()> {
        let (be, d, blocks) = (&self.backend, self.config.hidden(), self.num_blocks());
        let lay = &st.rows.phase.layout;
        for (r, req) in st.reqs.iter().enumerate() {
            if let Some((res, s)) = req.control.map(|c| c.double(bi)).transpose()?.flatten() {
                // An edit's residual rows are its active rows, which come first.
                let rows = lay.img[r].start..lay.img[r].start + st.rows.keep[r];
                be.add_block(x, rows, 0..d, res, s)?;
            }
        }
        if st.obs.wants_block_images() {
            st.obs.block_image(bi, x)?;
        }
        self.emit(
            st.obs,
            format_args!("double_block.{bi}.encoder_hidden_states"),
            ctx,
        )?;
        self.emit(st.obs, format_args!("double_block.{bi}.hidden_states"), x)?;
        for (ri, rows) in lay.img.iter().enumerate() {
            if st.obs.captures(ri) == Some(CacheMode::Y) && bi + 1 < blocks {
                st.obs
                    .block_slab(ri, bi, &be.gather_cols(x, rows.clone(), 0..d)?)?;
            }
        }
        st.rows.load_next(be, st.reqs, bi, blocks)
    }

    /// `FluxSingleTransformerBlock` over the joint `[txt; img]` rows `h`, updated in
    /// place. One fused projection gives `[k | v | q | gelu(mlp)]`; attention
    /// overwrites q, so columns `d..` hold `[k.. | attn | gelu(mlp)]` and `proj_out`
    /// reads `[attn | gelu(mlp)]` in place. Its gated residual is not fused with the
    /// next block's norm, for the reasons [`double_ff`](Self::double_ff) gives.
    pub(super) fn single_block(
        &self,
        st: &mut Step<'_, '_, B>,
        si: usize,
        blk: &SingleBlock<B>,
        h: &mut B::Tensor,
    ) -> Result<()> {
        let (be, d) = (&self.backend, self.config.hidden());
        let site = |k| Site::Single(si, k);
        let per_req = |r: usize| Some(r..r + 1);
        let s_norm = site(SingleLinear::Norm);
        let m = self.linear_lora(&st.lo, s_norm, &blk.norm, &st.temb_act, &per_req)?;
        let f = self.single_attention(st, si, blk, &m, h)?;
        if st.obs.wants_hidden() {
            let n_joint = st.rows.phase.layout.joint_seg.len();
            let attn = be.download(&be.gather_cols(&f, 0..n_joint, 2 * d..3 * d)?)?;
            st.obs.hidden(&format!("single_block.{si}.attn"), attn);
        }
        let lay = &st.rows.phase.layout;
        let joint_rows = |r: usize| Some(lay.joint[r].clone());
        let s_out = site(SingleLinear::ProjOut);
        let out =
            self.linear_cols_lora(&st.lo, s_out, &blk.proj_out, &f, 2 * d..7 * d, &joint_rows)?;
        drop(f);
        be.gated_residual(h, &out, modl(&m, 2, &lay.joint_seg))?;
        self.after_single(st, si, h)
    }

    /// A single block's `norm` (adaLN chunks 0 and 1), fused projection (GELU of the
    /// mlp columns included), RMSNorm and RoPE of q and k, and attention per request
    /// over its joint rows and the cached tokens' K/V: the projection with the
    /// attention output over q.
    fn single_attention(
        &self,
        st: &mut Step<'_, '_, B>,
        si: usize,
        blk: &SingleBlock<B>,
        m: &B::Tensor,
        h: &B::Tensor,
    ) -> Result<B::Tensor> {
        let (be, d) = (&self.backend, self.config.hidden());
        let bi = self.config.num_layers + si;
        let s_qkv = Site::Single(si, SingleLinear::QkvMlp);
        let side_kv = self.side_kv(st, m, &blk.qkv_mlp, s_qkv, 0..2 * d, &blk.norm_k)?;
        let phase = &st.rows.phase;
        let lay = &phase.layout;
        let (seg, n_joint) = (&lay.joint_seg, lay.joint_seg.len());
        let joint_rows = |r: usize| Some(lay.joint[r].clone());
        let n = be.layer_norm_modulate(h, NORM_EPS, modl(m, 0, seg), modl(m, 1, seg))?;
        let (l, mlp) = (&blk.qkv_mlp, 3 * d..7 * d);
        let mut f = if st.obs.wants_hidden() {
            // The observer reports the mlp columns before their GELU (`proj_mlp`).
            let mut f = self.linear_lora(&st.lo, s_qkv, l, &n, &joint_rows)?;
            let pre = be.download(&be.gather_cols(&f, 0..n_joint, mlp.clone())?)?;
            st.obs.hidden(&format!("single_block.{si}.proj_mlp"), pre);
            be.gelu_tanh(&mut f, mlp)?;
            f
        } else {
            self.linear_gelu_lora(&st.lo, s_qkv, l, &n, mlp.start, &joint_rows)?
        };
        drop(n);
        let rope = Some((phase.rope_joint.0.get(), phase.rope_joint.1.get()));
        let qk = [hn(2 * d..3 * d, &blk.norm_q), hn(0..d, &blk.norm_k)];
        be.rms_norm_rope(&mut f, &qk, NORM_EPS, rope)?;
        for (ri, jr) in lay.joint.iter().enumerate() {
            if st.obs.captures(ri) == Some(CacheMode::Kv) {
                let rows = jr.start + lay.txt[ri].len()..jr.end;
                st.obs
                    .block_slab(ri, bi, &be.gather_cols(&f, rows, 0..2 * d)?)?;
            }
        }
        let spans = |r: usize| {
            let j = lay.joint[r].clone();
            (
                vec![QSpan {
                    buf: 0,
                    rows: j.clone(),
                }],
                vec![(0, j)],
            )
        };
        let seqs = self.seqs(st, bi, &side_kv, spans, 0)?;
        let heads = self.config.num_attention_heads;
        be.attention(&mut [&mut f], 2 * d, d, heads, &seqs)?;
        // The K/V they read (`seqs`, `side_kv`) are dropped here, before `proj_out`.
        Ok(f)
    }

    /// After a single block: as [`after_double`](Self::after_double), on the image rows
    /// of the joint matrix.
    fn after_single(&self, st: &mut Step<'_, '_, B>, si: usize, h: &mut B::Tensor) -> Result<()> {
        let (be, d, blocks) = (&self.backend, self.config.hidden(), self.num_blocks());
        let bi = self.config.num_layers + si;
        let lay = &st.rows.phase.layout;
        for (r, req) in st.reqs.iter().enumerate() {
            if let Some((res, s)) = req.control.map(|c| c.single(si)).transpose()?.flatten() {
                let img0 = lay.joint[r].start + lay.txt[r].len();
                be.add_block(h, img0..img0 + st.rows.keep[r], 0..d, res, s)?;
            }
        }
        if st.obs.wants_block_images() {
            st.obs
                .block_image(bi, &be.gather_rows(&[&*h], &lay.img_in_joint)?)?;
        }
        let p = format_args!("single_block.{si}");
        self.emit_rows(
            st.obs,
            format_args!("{p}.encoder_hidden_states"),
            h,
            &lay.txt_in_joint,
        )?;
        self.emit_rows(
            st.obs,
            format_args!("{p}.hidden_states"),
            h,
            &lay.img_in_joint,
        )?;
        for (ri, jr) in lay.joint.iter().enumerate() {
            if st.obs.captures(ri) == Some(CacheMode::Y) && bi + 1 < blocks {
                let rows = jr.start + lay.txt[ri].len()..jr.end;
                st.obs.block_slab(ri, bi, &be.gather_cols(h, rows, 0..d)?)?;
            }
        }
        st.rows.load_next(be, st.reqs, bi, blocks)
    }

    /// At a cached block, the Y-mode rows' `[K | V]` (the columns `kv` of the block's
    /// fused projection `l` at `site`, modulated by `table`); `None` otherwise.
    fn side_kv(
        &self,
        st: &Step<'_, '_, B>,
        table: &B::Tensor,
        l: &Linear<B>,
        site: Site,
        kv: Range<usize>,
        norm_k: &B::Tensor,
    ) -> Result<Option<B::Tensor>> {
        match &st.rows.side {
            Some(s) if !st.rows.in_full => {
                let (w, b) = (&l.w, l.b.as_ref());
                let lora = self.side_lora(&st.lo, site, s, kv.clone());
                Ok(Some(s.kv(&self.backend, table, w, b, kv, norm_k, &lora)?))
            }
            _ => Ok(None),
        }
    }

    /// Each request's attention sequence at block `bi`: its queries and fresh K/V
    /// (`spans(r)`, K at column `k_col`), and its cached tokens' K/V (see `seq`).
    fn seqs<'t, Q>(
        &self,
        st: &'t Step<'_, '_, B>,
        bi: usize,
        side_kv: &'t Option<B::Tensor>,
        spans: Q,
        k_col: usize,
    ) -> Result<Vec<AttnSeq<'t, B::Tensor>>>
    where
        Q: Fn(usize) -> (Vec<QSpan>, Vec<(usize, Range<usize>)>),
    {
        (0..st.reqs.len())
            .map(|r| {
                let (q, fresh) = spans(r);
                let side = side_rows(side_kv, &st.rows.side, r);
                self.seq(&st.reqs[r], bi, st.rows.in_full, side, q, fresh, k_col)
            })
            .collect()
    }
}

/// A request's rows of the inactive rows' recomputed K/V at a cached block, with them.
fn side_rows<'s, T>(
    kv: &'s Option<T>,
    side: &Option<Inactive<'_, T>>,
    req: usize,
) -> Option<(&'s T, Range<usize>)> {
    Some((kv.as_ref()?, side.as_ref()?.rows[req].clone()?))
}

/// The RMSNorm of the heads in columns `cols`, with `weight`.
fn hn<T>(cols: Range<usize>, weight: &T) -> HeadNorm<'_, T> {
    HeadNorm { cols, weight }
}
