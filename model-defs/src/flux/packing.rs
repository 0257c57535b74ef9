//! How a batch's rows are packed into one matrix per stream, for the two phases of a
//! planned step.
//!
//! A step runs its first `full_blocks` blocks over every image token of each edit (the
//! planner's full prefix, docs/design.md §Planner) and the rest over the active tokens only,
//! reading the template's K/V for the others. In the full phase an edit's image rows
//! are its active rows followed by its inactive ("rest") rows, so leaving the phase
//! keeps the first `A` image rows of each request: one row gather, no reordering.

use std::ops::Range;

use denoised_runtime::{Backend, Result};

use super::request::StepRequest;

/// Where each request's rows sit in the packed matrices.
pub(super) struct Layout {
    pub txt: Vec<Range<usize>>,
    pub img: Vec<Range<usize>>,
    /// Rows of the joint `[txt_r; img_r]` matrix, request after request.
    pub joint: Vec<Range<usize>>,
    pub txt_seg: Vec<u32>,
    pub img_seg: Vec<u32>,
    pub joint_seg: Vec<u32>,
    /// Joint row i = (0: txt, 1: img, row).
    pub joint_index: Vec<(u32, u32)>,
    /// Positions of text and image rows in the joint matrix.
    pub txt_in_joint: Vec<(u32, u32)>,
    pub img_in_joint: Vec<(u32, u32)>,
}

impl Layout {
    pub fn new(txt_lens: &[usize], img_lens: &[usize]) -> Self {
        let mut l = Layout {
            txt: vec![],
            img: vec![],
            joint: vec![],
            txt_seg: vec![],
            img_seg: vec![],
            joint_seg: vec![],
            joint_index: vec![],
            txt_in_joint: vec![],
            img_in_joint: vec![],
        };
        let (mut t0, mut i0) = (0, 0);
        for (r, (&t, &a)) in txt_lens.iter().zip(img_lens).enumerate() {
            let j0 = l.joint_index.len();
            l.txt.push(t0..t0 + t);
            l.img.push(i0..i0 + a);
            l.joint.push(j0..j0 + t + a);
            l.txt_seg.extend(std::iter::repeat_n(r as u32, t));
            l.img_seg.extend(std::iter::repeat_n(r as u32, a));
            l.joint_seg.extend(std::iter::repeat_n(r as u32, t + a));
            for k in 0..t {
                l.txt_in_joint.push((0, (j0 + k) as u32));
                l.joint_index.push((0, (t0 + k) as u32));
            }
            for k in 0..a {
                l.img_in_joint.push((0, (j0 + t + k) as u32));
                l.joint_index.push((1, (i0 + k) as u32));
            }
            t0 += t;
            i0 += a;
        }
        l
    }

    /// Rows of this layout's image matrix that keep the first `keep[r]` image rows of
    /// each request (leaving the full phase in the double blocks).
    pub fn img_prefix(&self, keep: &[usize]) -> Vec<(u32, u32)> {
        self.img
            .iter()
            .zip(keep)
            .flat_map(|(r, &k)| (r.start..r.start + k).map(|i| (0, i as u32)))
            .collect()
    }

    /// Rows of this layout's joint matrix that keep each request's text and its first
    /// `keep[r]` image rows (leaving the full phase in the single blocks).
    pub fn joint_prefix(&self, keep: &[usize]) -> Vec<(u32, u32)> {
        self.joint
            .iter()
            .zip(&self.txt)
            .zip(keep)
            .flat_map(|((j, t), &k)| (j.start..j.start + t.len() + k).map(|i| (0, i as u32)))
            .collect()
    }
}

/// A packed input: one request's tensor read in place, or a batch's gathered.
pub(super) enum Packed<'a, T> {
    One(&'a T),
    Gathered(T),
}

impl<T> Packed<'_, T> {
    pub fn get(&self) -> &T {
        match self {
            Packed::One(t) => t,
            Packed::Gathered(t) => t,
        }
    }
}

/// Row ranges of tensors, in packing order.
pub(super) type Segments<'a, T> = Vec<(&'a T, Range<usize>)>;

/// Packs row ranges of several tensors, request after request (each request's
/// segments in order). A single segment covering a whole tensor is read in place; a
/// batch is gathered (a device copy of a few MB, no host transfer).
pub(super) fn pack_segments<'a, B: Backend>(
    be: &B,
    segs: &[Segments<'a, B::Tensor>],
) -> Result<Packed<'a, B::Tensor>> {
    if let [one] = segs {
        if let [(t, rows)] = one.as_slice() {
            if *rows == (0..be.shape(t)[0]) {
                return Ok(Packed::One(t));
            }
        }
    }
    let mut srcs: Vec<&B::Tensor> = vec![];
    let mut index = vec![];
    for (t, rows) in segs.iter().flatten() {
        let s = srcs.len() as u32;
        srcs.push(t);
        index.extend(rows.clone().map(|k| (s, k as u32)));
    }
    Ok(Packed::Gathered(be.gather_rows(&srcs, &index)?))
}

/// The packed inputs of one phase: image rows, and the RoPE tables of the joint, text
/// and image rows.
pub(super) struct PhaseInputs<'a, T> {
    pub layout: Layout,
    pub img: Option<Packed<'a, T>>,
    pub rope_joint: (Packed<'a, T>, Packed<'a, T>),
    pub rope_img: (Packed<'a, T>, Packed<'a, T>),
}

impl<'a, T> PhaseInputs<'a, T> {
    /// Packs `reqs` with their rest rows (`full`, the full phase) or without them.
    /// The image input itself is packed only where `with_img` (the phase a step
    /// starts in).
    pub fn pack<B: Backend<Tensor = T>>(
        be: &B,
        reqs: &[StepRequest<'a, T>],
        full: bool,
        with_img: bool,
    ) -> Result<Self> {
        let rest = |r: &StepRequest<'a, T>| if full { r.rest } else { None };
        let txt_lens: Vec<usize> = reqs.iter().map(|r| r.tensors.txt_rows()).collect();
        let img_lens: Vec<usize> = reqs
            .iter()
            .map(|r| r.tensors.img_rows() + rest(r).map_or(0, |x| x.rows()))
            .collect();
        let img = |r: &StepRequest<'a, T>| {
            let mut s = vec![(&r.tensors.img, 0..r.tensors.img_rows())];
            if let Some(x) = rest(r) {
                s.push((&x.img, 0..x.rows()));
            }
            s
        };
        // RoPE rows of the image part (`with_text`: preceded by the text rows).
        let rope = |r: &StepRequest<'a, T>, sin: bool, with_text: bool| {
            let (t, a) = (r.tensors.txt_rows(), r.tensors.img_rows());
            let own = if sin {
                &r.tensors.rope_sin
            } else {
                &r.tensors.rope_cos
            };
            let mut s = vec![(own, if with_text { 0 } else { t }..t + a)];
            if let Some(x) = rest(r) {
                s.push((if sin { &x.rope_sin } else { &x.rope_cos }, 0..x.rows()));
            }
            s
        };
        let segs = |f: &dyn Fn(&StepRequest<'a, T>) -> Segments<'a, T>| {
            pack_segments(be, &reqs.iter().map(f).collect::<Vec<_>>())
        };
        Ok(PhaseInputs {
            layout: Layout::new(&txt_lens, &img_lens),
            img: if with_img { Some(segs(&img)?) } else { None },
            rope_joint: (
                segs(&|r| rope(r, false, true))?,
                segs(&|r| rope(r, true, true))?,
            ),
            rope_img: (
                segs(&|r| rope(r, false, false))?,
                segs(&|r| rope(r, true, false))?,
            ),
        })
    }
}

/// The text rows and their RoPE tables (the same in both phases).
pub(super) struct TextInputs<'a, T> {
    pub txt: Packed<'a, T>,
    pub rope_cos: Packed<'a, T>,
    pub rope_sin: Packed<'a, T>,
}

pub(super) fn pack_text<'a, B: Backend>(
    be: &B,
    reqs: &[StepRequest<'a, B::Tensor>],
) -> Result<TextInputs<'a, B::Tensor>> {
    let txt = |f: &dyn Fn(&StepRequest<'a, B::Tensor>) -> &'a B::Tensor| {
        pack_segments(
            be,
            &reqs
                .iter()
                .map(|r| vec![(f(r), 0..r.tensors.txt_rows())])
                .collect::<Vec<_>>(),
        )
    };
    Ok(TextInputs {
        txt: txt(&|r| &r.tensors.txt)?,
        rope_cos: txt(&|r| &r.tensors.rope_cos)?,
        rope_sin: txt(&|r| &r.tensors.rope_sin)?,
    })
}
