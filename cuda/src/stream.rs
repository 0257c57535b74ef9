//! [`StreamedTemplate`]: a template's cached K/V streamed to the device block by block
//! on the copy stream, into ping-pong buffers, while the compute stream works.
//!
//! A FLUX.1 template is ~2.9 GB of bf16 K/V per step at 1024²; keeping every hot
//! template resident would fill the device. Instead the slabs stay where they are in
//! host memory (the cache process's shared-memory arena, page-locked once by this
//! device, see `crate::host`), and each forward loads only the step it reads, two
//! blocks' worth of device memory at a time, with no host copy:
//!
//! ```text
//! copy:     load b0 → A, load b1 → B | wait(compute done with b0) load b2 → A | ...
//! compute:  ... wait(A loaded) block 0 | wait(B loaded) block 1 | wait(A loaded) block 2
//! ```
//!
//! The model asks for block `b`'s slab only after queuing all work of block `b-1`
//! (the `KvCache` contract), so an event recorded on the compute stream at that moment
//! marks the end of the last reader of the buffer that block `b+1` will overwrite.
//! With every block using its cache, the transfer per block (~50 MB for FLUX.1 at
//! 1024², ~2 ms over PCIe 5 / ~0.1 ms over NVLink-C2C) hides behind the block's
//! compute when that is longer; the planner (a later issue) decides which blocks
//! compute fully instead.

use std::sync::{Arc, Mutex};

use denoised_runtime::{Backend, Error, HostSlice, Result, SlabProvider};

use crate::backend::{dev, GpuBackend, GpuTensor};
use crate::exec::{Exec, Stream};

pub struct StreamedTemplate<E: Exec> {
    exec: Arc<E>,
    /// Every slab, step-major, in the device's storage type.
    host: HostSlice,
    steps: usize,
    blocks: usize,
    slab_bytes: usize,
    /// One buffer pair per step read in the same forward (requests on one template
    /// are usually at different steps).
    lanes: Vec<Lane<E>>,
}

struct Lane<E: Exec> {
    bufs: [GpuTensor<E>; 2],
    st: Mutex<LaneState<E>>,
}

struct LaneState<E: Exec> {
    /// The step this lane serves in the current forward.
    step: Option<usize>,
    /// Which block each buffer holds (or is loading).
    holds: [Option<usize>; 2],
    /// Completion of each buffer's latest load.
    loaded: [Option<E::Event>; 2],
    /// The block the forward is at, and the next block to load.
    at: Option<usize>,
    next: usize,
}

impl<E: Exec> StreamedTemplate<E> {
    /// Streams `steps * blocks` slabs of `shape`, step-major, in the device's storage
    /// type, from `host` (page-locked here if it is not yet), with `lanes` buffer
    /// pairs: the most distinct steps of this template one forward may read.
    pub fn new(
        be: &GpuBackend<E>,
        host: HostSlice,
        shape: &[usize],
        steps: usize,
        blocks: usize,
        lanes: usize,
    ) -> Result<Self> {
        let dt = be.dtype();
        let slab_bytes = shape.iter().product::<usize>() * dt.size();
        if host.len() < slab_bytes * steps * blocks || blocks == 0 || lanes == 0 {
            return Err(Error::Invalid(format!(
                "a streamed template needs {steps} x {blocks} slabs of {slab_bytes} bytes and at least one lane, got {} bytes",
                host.len()
            )));
        }
        be.pin_host(host.memory())?;
        let exec = be.exec().clone();
        let lanes = (0..lanes)
            .map(|_| {
                Ok(Lane {
                    bufs: [
                        GpuTensor::alloc(&*exec, shape.to_vec(), dt)?,
                        GpuTensor::alloc(&*exec, shape.to_vec(), dt)?,
                    ],
                    st: Mutex::new(LaneState {
                        step: None,
                        holds: [None; 2],
                        loaded: [None, None],
                        at: None,
                        next: 0,
                    }),
                })
            })
            .collect::<Result<_>>()?;
        Ok(StreamedTemplate {
            exec,
            host,
            steps,
            blocks,
            slab_bytes,
            lanes,
        })
    }

    /// Queues the load of `block` of the lane's step into buffer `block % 2`.
    fn load(&self, lane: &Lane<E>, st: &mut LaneState<E>, block: usize) -> Result<()> {
        let step = st.step.expect("a prepared lane");
        let i = block % 2;
        let offset = (step * self.blocks + block) * self.slab_bytes;
        // SAFETY: in bounds (checked in `new`); the slice keeps its mapping alive, and
        // `Drop` waits for queued loads before it goes.
        unsafe {
            self.exec.load(
                lane.bufs[i].mem(),
                0,
                self.host.as_ptr().add(offset),
                self.slab_bytes,
            )
        }
        .map_err(dev)?;
        st.loaded[i] = Some(self.exec.record(Stream::Copy).map_err(dev)?);
        st.holds[i] = Some(block);
        Ok(())
    }

    /// Makes the copy stream wait until everything queued on compute so far is done:
    /// before overwriting a buffer that queued kernels may still read.
    fn after_compute(&self) -> Result<()> {
        let e = self.exec.record(Stream::Compute).map_err(dev)?;
        self.exec.wait(Stream::Copy, &e).map_err(dev)
    }

    fn lane_of(&self, step: usize) -> Option<&Lane<E>> {
        self.lanes
            .iter()
            .find(|l| l.st.lock().unwrap().step == Some(step))
    }
}

impl<E: Exec> SlabProvider<GpuTensor<E>> for StreamedTemplate<E> {
    fn prepare(&self, step: usize, first: usize) -> Result<()> {
        if step >= self.steps {
            return Err(Error::Invalid(format!(
                "step {step} of a {}-step template",
                self.steps
            )));
        }
        if self.lane_of(step).is_some() {
            return Ok(()); // another request at the same step in this forward
        }
        let lane = self
            .lanes
            .iter()
            .find(|l| l.st.lock().unwrap().step.is_none())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "more than {} steps of one streamed template in one forward",
                    self.lanes.len()
                ))
            })?;
        let mut st = lane.st.lock().unwrap();
        *st = LaneState {
            step: Some(step),
            holds: [None; 2],
            loaded: [None, None],
            at: None,
            next: (first + 2).min(self.blocks),
        };
        // The previous forward's kernels may still read both buffers.
        self.after_compute()?;
        for b in first..st.next {
            self.load(lane, &mut st, b)?;
        }
        Ok(())
    }

    fn slab(&self, step: usize, block: usize) -> Result<&GpuTensor<E>> {
        let lane = self
            .lane_of(step)
            .ok_or_else(|| Error::Invalid(format!("step {step} was not prepared")))?;
        let mut st = lane.st.lock().unwrap();
        if st.at != Some(block) {
            // Entering `block`: all work of block-1 is queued, so the buffer it read
            // can take block+1 once that work is done.
            if block + 1 < self.blocks && st.next == block + 1 {
                self.after_compute()?;
                self.load(lane, &mut st, block + 1)?;
                st.next = block + 2;
            }
            let i = block % 2;
            if st.holds[i] != Some(block) {
                return Err(Error::Invalid(format!(
                    "block {block} asked out of order (buffer holds {:?})",
                    st.holds[i]
                )));
            }
            if let Some(e) = &st.loaded[i] {
                self.exec.wait(Stream::Compute, e).map_err(dev)?;
            }
            st.at = Some(block);
        }
        Ok(&lane.bufs[block % 2])
    }

    fn finish(&self) {
        for l in &self.lanes {
            l.st.lock().unwrap().step = None;
        }
    }
}

impl<E: Exec> Drop for StreamedTemplate<E> {
    fn drop(&mut self) {
        // Queued loads read the host buffer: let them finish before it is freed.
        if let Ok(e) = self.exec.record(Stream::Copy) {
            let _ = self.exec.wait(Stream::Compute, &e);
        }
        let _ = self.exec.synchronize();
    }
}
