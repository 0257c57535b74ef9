//! What the blocks of one forward step share.
//!
//! A step's blocks read the same batch, LoRAs, conditioning and observer; what changes
//! from block to block is where the rows are: a step whose edits pass their inactive
//! rows starts in the full phase (those rows in the image matrix), leaves it at the
//! first cached block and, for Y-mode templates, rejoins it at the next full block
//! (docs/design.md §Planner). [`Packing`] holds that state and makes the moves.

use std::ops::Range;

use denoised_runtime::{Backend, Result};

use super::super::adapters::StepLoras;
use super::super::inactive::Inactive;
use super::super::packing::{pack_text, Layout, PhaseInputs, TextInputs};
use super::{ForwardObserver, StepRequest};

/// One forward step's state, passed from block to block.
pub(super) struct Step<'s, 'a, B: Backend> {
    pub reqs: &'s [StepRequest<'a, B::Tensor>],
    /// Each request's unmerged LoRAs (None, and nothing added, when none has any).
    pub lo: Option<StepLoras<B>>,
    /// SiLU(temb) `[B, d]`: the input of every modulation Linear.
    pub temb_act: B::Tensor,
    pub rows: Packing<'a, B::Tensor>,
    pub obs: &'s mut dyn ForwardObserver<B::Tensor>,
}

/// Where the batch's rows are: the current phase's packing, the text's, and the Y-mode
/// edits' inactive rows while they are out of the image matrix.
pub(super) struct Packing<'a, T> {
    pub phase: PhaseInputs<'a, T>,
    /// The text rows and their RoPE tables (the same in both phases).
    pub text: TextInputs<'a, T>,
    pub side: Option<Inactive<'a, T>>,
    /// Image rows each request keeps when the full phase ends (its computed rows).
    pub keep: Vec<usize>,
    /// Whether any request passes its inactive rows (then a full phase exists).
    pub has_rest: bool,
    pub in_full: bool,
}

/// The matrix a phase change gathers: the image rows (double blocks) or the joint
/// `[txt; img]` rows (single blocks).
#[derive(Clone, Copy)]
pub(super) enum Stream {
    Img,
    Joint,
}

impl Stream {
    /// Each request's rows of the matrix.
    fn spans(self, l: &Layout) -> &[Range<usize>] {
        match self {
            Stream::Img => &l.img,
            Stream::Joint => &l.joint,
        }
    }

    /// The rows that remain when each request keeps its first `keep[r]` image rows.
    fn prefix(self, l: &Layout, keep: &[usize]) -> Vec<(u32, u32)> {
        match self {
            Stream::Img => l.img_prefix(keep),
            Stream::Joint => l.joint_prefix(keep),
        }
    }
}

impl<'a, T> Packing<'a, T> {
    /// Packs every request's rows, one matrix per stream (the image input included).
    /// Edits' inactive rows start in the image matrix: the embedder computes them.
    /// Without such rows the step has one phase.
    pub fn new<B: Backend<Tensor = T>>(be: &B, reqs: &[StepRequest<'a, T>]) -> Result<Self> {
        let has_rest = reqs.iter().any(|r| r.rest.is_some());
        let side = Inactive::new(be, reqs)?;
        let phase = PhaseInputs::pack(be, reqs, has_rest, true)?;
        Ok(Packing {
            phase,
            text: pack_text(be, reqs)?,
            side,
            keep: reqs.iter().map(|r| r.tensors.img_rows()).collect(),
            has_rest,
            in_full: has_rest,
        })
    }

    /// Before a block: leaves the full phase if the block is cached (the Y-mode rows
    /// taken out of `m` first), or takes the Y-mode rows back into `m` if it is full.
    pub fn enter<B: Backend<Tensor = T>>(
        &mut self,
        be: &B,
        reqs: &[StepRequest<'a, T>],
        full: bool,
        m: &mut T,
        s: Stream,
    ) -> Result<()> {
        if self.in_full && !full {
            if let Some(side) = &mut self.side {
                side.take_from(be, m, s.spans(&self.phase.layout))?;
            }
            self.leave_full(be, reqs, m, s)
        } else if !self.in_full && full && self.has_rest {
            let side = self
                .side
                .as_mut()
                .expect("valid plans rejoin only Y-mode rows");
            *m = side.merge_into(be, m, s.spans(&self.phase.layout))?;
            self.phase = PhaseInputs::pack(be, reqs, true, false)?;
            self.in_full = true;
            Ok(())
        } else {
            Ok(())
        }
    }

    /// Keeps each request's computed rows of `m` (one row gather: they come first)
    /// and repacks without the inactive ones.
    pub fn leave_full<B: Backend<Tensor = T>>(
        &mut self,
        be: &B,
        reqs: &[StepRequest<'a, T>],
        m: &mut T,
        s: Stream,
    ) -> Result<()> {
        *m = be.gather_rows(&[&*m], &s.prefix(&self.phase.layout, &self.keep))?;
        self.phase = PhaseInputs::pack(be, reqs, false, false)?;
        self.in_full = false;
        Ok(())
    }

    /// After block `bi` of `blocks`: the Y-mode rows' input to the next block (their
    /// template's output of this one), while they are out of the image matrix.
    pub fn load_next<B: Backend<Tensor = T>>(
        &mut self,
        be: &B,
        reqs: &[StepRequest<'a, T>],
        bi: usize,
        blocks: usize,
    ) -> Result<()> {
        if let Some(s) = self
            .side
            .as_mut()
            .filter(|_| !self.in_full && bi + 1 < blocks)
        {
            s.load(be, reqs, bi)?;
        }
        Ok(())
    }
}
