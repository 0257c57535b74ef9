//! [`StreamedTemplate`]: a template's cached K/V streamed to the device block by block
//! on the copy stream, into ping-pong buffers, while the compute stream works.
//!
//! A FLUX.1 template is ~2.9 GB of bf16 K/V per step at 1024²; keeping every hot
//! template resident would fill the device. Instead the slabs stay where they are in
//! host memory (the cache process's shared-memory arena, page-locked once by this
//! device, see `crate::host`), and each forward loads only the slabs it reads (the
//! blocks of its step that the plan does not compute in full), two slabs' worth of
//! device memory at a time, with no host copy. Position `p` of the forward's list
//! `s0, s1, ...` goes to buffer `p % 2`:
//!
//! ```text
//! copy:     load s0 → A, load s1 → B | wait(compute done with s0) load s2 → A | ...
//! compute:  ... wait(A loaded) slab s0 | wait(B loaded) slab s1 | wait(A loaded) slab s2
//! ```
//!
//! The model asks for a slab only after queuing all work of the block before it (the
//! `KvCache` contract), so an event recorded on the compute stream at that moment
//! marks the end of the last reader of the previous slab's buffer, which the slab
//! after this one overwrites.
//! With every block using its cache, the transfer per block (~50 MB for FLUX.1 at
//! 1024², ~2 ms over PCIe 5 / ~0.1 ms over NVLink-C2C) hides behind the block's
//! compute when that is longer; the planner decides which blocks compute fully
//! instead, and their slabs are not loaded.

use std::sync::{Arc, Mutex};

use denoised_runtime::backend::{check_slab_list, next_slab_position};
use denoised_runtime::{Backend, DType, Error, HostSlice, Result, SlabProvider, SlabShape};

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
    /// The blocks the forward reads, in order; kept across forwards so that preparing
    /// one does not allocate.
    slabs: Vec<usize>,
    /// Which list position each buffer holds (or is loading). Positions, not blocks,
    /// pick the buffer: two consecutive slabs of a list with holes may be blocks of
    /// the same parity.
    holds: [Option<usize>; 2],
    /// Completion of each buffer's latest load.
    loaded: [Option<E::Event>; 2],
    /// The list position the forward is at, and the next one to load.
    at: Option<usize>,
    next: usize,
}

impl<E: Exec> StreamedTemplate<E> {
    /// Streams `steps * blocks` slabs of form `slab`, step-major, from `host`
    /// (page-locked here if it is not yet), with `lanes` buffer pairs: the most
    /// distinct steps of this template one forward may read. The slabs are in the
    /// device's storage type, or fp8 (copied as they are, scales included: the
    /// attention kernel reads them so).
    pub fn new(
        be: &GpuBackend<E>,
        host: HostSlice,
        slab: &SlabShape,
        steps: usize,
        blocks: usize,
        lanes: usize,
    ) -> Result<Self> {
        let dt = be.dtype();
        let fp8 = slab.dtype == DType::F8E4M3;
        let slab_bytes = match fp8 {
            true => slab.bytes(),
            false => slab.rows * slab.cols * dt.size(),
        };
        let buffer = |exec: &E| match fp8 {
            true => GpuTensor::alloc_fp8(exec, slab.rows, slab.cols, slab.groups),
            false => GpuTensor::alloc(exec, vec![slab.rows, slab.cols], dt),
        };
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
                    bufs: [buffer(&exec)?, buffer(&exec)?],
                    st: Mutex::new(LaneState {
                        step: None,
                        slabs: Vec::new(),
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

    /// Queues the load of list position `pos` of the lane's forward into buffer
    /// `pos % 2`.
    fn load(&self, lane: &Lane<E>, st: &mut LaneState<E>, pos: usize) -> Result<()> {
        let step = st.step.expect("a prepared lane");
        let block = st.slabs[pos];
        let i = pos % 2;
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
        st.holds[i] = Some(pos);
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
    fn prepare(&self, step: usize, slabs: &[usize]) -> Result<()> {
        if step >= self.steps {
            return Err(Error::Invalid(format!(
                "step {step} of a {}-step template",
                self.steps
            )));
        }
        check_slab_list(slabs, self.blocks)?;
        if let Some(lane) = self.lane_of(step) {
            // Another request at the same step in this forward shares the lane, whose
            // loads are already queued: only the same list can be served by it.
            let st = lane.st.lock().unwrap();
            if st.slabs != slabs {
                return Err(Error::Invalid(format!(
                    "step {step} prepared twice in one forward with different slabs ({:?}, then {slabs:?})",
                    st.slabs
                )));
            }
            return Ok(());
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
        let mut list = std::mem::take(&mut st.slabs);
        list.clear();
        list.extend_from_slice(slabs);
        *st = LaneState {
            step: Some(step),
            slabs: list,
            holds: [None; 2],
            loaded: [None, None],
            at: None,
            next: slabs.len().min(2),
        };
        if st.next > 0 {
            // The previous forward's kernels may still read both buffers.
            self.after_compute()?;
        }
        for p in 0..st.next {
            self.load(lane, &mut st, p)?;
        }
        Ok(())
    }

    fn slab(&self, step: usize, block: usize) -> Result<&GpuTensor<E>> {
        let lane = self
            .lane_of(step)
            .ok_or_else(|| Error::Invalid(format!("step {step} was not prepared")))?;
        let mut st = lane.st.lock().unwrap();
        if let Some(p) = st.at.filter(|&p| st.slabs[p] == block) {
            // Another request at this step in the same forward: compute already waits
            // for the slab.
            return Ok(&lane.bufs[p % 2]);
        }
        let p = next_slab_position(&st.slabs, st.at, step, block)?;
        // Entering position p: the work queued so far includes every read of p-1's
        // slab, so its buffer can take p+1 once that work is done.
        if p + 1 < st.slabs.len() && st.next == p + 1 {
            self.after_compute()?;
            self.load(lane, &mut st, p + 1)?;
            st.next = p + 2;
        }
        let i = p % 2;
        debug_assert_eq!(st.holds[i], Some(p), "position {p} was queued");
        if let Some(e) = &st.loaded[i] {
            self.exec.wait(Stream::Compute, e).map_err(dev)?;
        }
        st.at = Some(p);
        Ok(&lane.bufs[i])
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emu::{EmuExec, EmuMem, EmuPinned};
    use crate::exec::{Dt, Gemm, Grid, MemInfo};
    use crate::params::KernelParams;
    use std::time::Instant;

    /// What the stream queued, in order.
    #[derive(Debug)]
    enum Op {
        Load { dst: u64, src: usize },
        Record(Stream),
        Wait(Stream),
    }

    /// The emulator, logging the copies and events the stream queues. The emulator
    /// runs everything in the call, so the slabs' contents alone cannot show a missing
    /// event; the log can.
    #[derive(Default)]
    struct Logged {
        emu: EmuExec,
        log: Mutex<Vec<Op>>,
    }

    impl Exec for Logged {
        type Mem = EmuMem;
        type Pinned = EmuPinned;
        type Event = Instant;
        fn describe(&self) -> String {
            self.emu.describe()
        }
        fn alloc(&self, bytes: usize) -> crate::exec::Result<EmuMem> {
            self.emu.alloc(bytes)
        }
        fn addr(&self, m: &EmuMem) -> u64 {
            self.emu.addr(m)
        }
        fn upload(&self, dst: &EmuMem, offset: usize, bytes: &[u8]) -> crate::exec::Result<()> {
            self.emu.upload(dst, offset, bytes)
        }
        fn download(&self, src: &EmuMem, offset: usize, out: &mut [u8]) -> crate::exec::Result<()> {
            self.emu.download(src, offset, out)
        }
        fn launch<P: KernelParams>(
            &self,
            name: &'static str,
            g: Grid,
            params: &P,
        ) -> crate::exec::Result<()> {
            self.emu.launch(name, g, params)
        }
        fn gemm(&self, g: &Gemm) -> crate::exec::Result<()> {
            self.emu.gemm(g)
        }
        fn synchronize(&self) -> crate::exec::Result<()> {
            self.emu.synchronize()
        }
        unsafe fn register(
            &self,
            base: *mut u8,
            len: usize,
            read_only: bool,
        ) -> crate::exec::Result<EmuPinned> {
            self.emu.register(base, len, read_only)
        }
        unsafe fn load(
            &self,
            dst: &EmuMem,
            offset: usize,
            src: *const u8,
            len: usize,
        ) -> crate::exec::Result<()> {
            self.log.lock().unwrap().push(Op::Load {
                dst: self.emu.addr(dst) + offset as u64,
                src: src as usize,
            });
            self.emu.load(dst, offset, src, len)
        }
        unsafe fn store(
            &self,
            dst: *mut u8,
            src: &EmuMem,
            offset: usize,
            len: usize,
        ) -> crate::exec::Result<()> {
            self.emu.store(dst, src, offset, len)
        }
        fn is_done(&self, e: &Instant) -> crate::exec::Result<bool> {
            self.emu.is_done(e)
        }
        fn sync_event(&self, e: &Instant) -> crate::exec::Result<()> {
            self.emu.sync_event(e)
        }
        fn record(&self, on: Stream) -> crate::exec::Result<Instant> {
            self.log.lock().unwrap().push(Op::Record(on));
            self.emu.record(on)
        }
        fn wait(&self, on: Stream, e: &Instant) -> crate::exec::Result<()> {
            self.log.lock().unwrap().push(Op::Wait(on));
            self.emu.wait(on, e)
        }
        fn memory(&self) -> crate::exec::Result<MemInfo> {
            self.emu.memory()
        }
    }

    #[test]
    fn streams_only_the_listed_blocks_into_buffers_by_position() {
        let (steps, blocks, elems) = (2, 8, 6);
        // Slab i holds the value i everywhere, in bf16 as the device stores it.
        let bytes: Vec<u8> = (0..steps * blocks)
            .flat_map(|i| {
                let v = half::bf16::from_f32(i as f32).to_bits().to_le_bytes();
                std::iter::repeat_n(v, elems).flatten()
            })
            .collect();
        let host = HostSlice::copy_of(&bytes).unwrap();
        let be = GpuBackend::new(Logged::default(), Dt::Bf16);
        let slab = SlabShape {
            rows: 2,
            cols: 3,
            dtype: DType::BF16,
            groups: 1,
        };
        let t = StreamedTemplate::new(&be, host.clone(), &slab, steps, blocks, 1).unwrap();
        let exec = be.exec().clone();
        let bufs = t.lanes[0].bufs.each_ref().map(|b| b.addr());
        // The log since the last call: `c`/`y` for the compute and copy streams,
        // `record`/`wait` for events, and `<block><buffer>` for a load.
        let log = || {
            let ops = std::mem::take(&mut *exec.log.lock().unwrap());
            ops.iter()
                .map(|op| match op {
                    Op::Load { dst, src } => {
                        let slab = (src - host.as_ptr() as usize) / (elems * 2);
                        let buf = ["A", "B"][bufs.iter().position(|b| b == dst).unwrap()];
                        format!("{}{buf}", slab % blocks)
                    }
                    Op::Record(s) => format!("record-{}", stream(*s)),
                    Op::Wait(s) => format!("wait-{}", stream(*s)),
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        log();
        let read = |g: &GpuTensor<Logged>| {
            let mut out = vec![0u8; elems * 2];
            exec.download(g.mem(), 0, &mut out).unwrap();
            half::bf16::from_le_bytes([out[0], out[1]]).to_f32()
        };

        let list = [0, 2, 3, 6];
        t.prepare(1, &list).unwrap();
        // The copy stream waits for the previous forward's compute, then loads the
        // first two positions into the two buffers, though 0 and 2 are both even.
        assert_eq!(log(), "record-c wait-y 0A record-y 2B record-y");
        // Entering a position loads the one after it into the buffer compute just
        // left, once the compute queued so far is done; compute then waits for its
        // own slab's load.
        let want = [
            "wait-c",
            "record-c wait-y 3A record-y wait-c",
            "record-c wait-y 6B record-y wait-c",
            "wait-c",
        ];
        for (&b, want) in list.iter().zip(want) {
            let g = t.slab(1, b).unwrap();
            assert_eq!(read(g), (blocks + b) as f32, "block {b}");
            assert_eq!(log(), want, "entering block {b}");
            // Another request at the same step gets the same slab, queuing nothing.
            assert_eq!(t.slab(1, b).unwrap().addr(), g.addr());
            assert_eq!(log(), "");
        }
        let e = t.slab(1, 7).err().unwrap().to_string();
        assert!(e.contains("not prepared"), "{e}");
        t.finish();

        // Blocks outside the list, or asked out of its order, are errors that leave the
        // stream where it was.
        t.prepare(0, &list).unwrap();
        let e = t.slab(0, 1).err().unwrap().to_string();
        assert!(e.contains("block 1 of step 0 not prepared"), "{e}");
        let e = t.slab(0, 2).err().unwrap().to_string();
        assert!(e.contains("asked out of order"), "{e}");
        assert_eq!(read(t.slab(0, 0).unwrap()), 0.0);
        assert!(t.slab(0, 3).is_err(), "2 comes first");
        assert_eq!(read(t.slab(0, 2).unwrap()), 2.0);
        assert!(t.slab(0, 0).is_err(), "already left");
        // Another request at the same step must read the same list.
        assert!(t.prepare(0, &list).is_ok());
        assert!(t.prepare(0, &[0, 2, 3]).is_err());
        t.finish();
        log();

        // An empty list loads nothing and serves nothing.
        t.prepare(0, &[]).unwrap();
        assert_eq!(log(), "");
        assert!(t.slab(0, 0).is_err());
        t.finish();

        // Lists that are not strictly ascending blocks of the template are refused.
        for bad in [&[2, 2][..], &[3, 1], &[0, 8]] {
            assert!(t.prepare(0, bad).is_err(), "{bad:?}");
        }
    }

    fn stream(s: Stream) -> &'static str {
        match s {
            Stream::Compute => "c",
            Stream::Copy => "y",
        }
    }
}
