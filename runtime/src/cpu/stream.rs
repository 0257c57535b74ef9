//! [`CpuStream`]: a template's cached K/V streamed into f32 staging buffers by a loader
//! thread while the CPU computes (docs/design.md §Planner), the CPU counterpart of the CUDA
//! backend's copy stream.
//!
//! The slabs come from wherever the template lies ([`SlabRead`]): the host tier (a
//! shared-memory arena: a copy) or the disk tier (a read, each slab checked against
//! its checksum). Each forward reads a list of blocks of one step (those the plan
//! does not compute in full); the loader keeps one slab ahead in a ping-pong pair of
//! buffers per step in flight, the list's position `p` going to buffer `p % 2`:
//!
//! ```text
//! loader:   load s0 → A, load s1 → B | (compute left s0) load s2 → A | ...
//! compute:  wait(A) slab s0          | wait(B) slab s1               | wait(A) ...
//! ```
//!
//! The time compute spends waiting is the step's bubble ([`SlabProvider::take_wait`]).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{check_slab_list, next_slab_position, SlabProvider, SlabShape};
use crate::error::{Error, Result};
use crate::host::HostSlice;
use crate::stored::to_f32;
use crate::tensor::{DType, Tensor};

/// Where a streamed template's slabs are read from. Slab `i` is (step `i / blocks`,
/// block `i % blocks`), `slab_bytes` long in the template's storage dtype.
pub trait SlabRead: Send + Sync {
    fn read(&self, index: usize, dst: &mut [u8]) -> Result<()>;
}

/// Slabs in host memory, step-major (the host tier).
pub struct HostSlabs {
    pub src: HostSlice,
    pub slab_bytes: usize,
}

impl SlabRead for HostSlabs {
    fn read(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let off = index * self.slab_bytes;
        let src = self
            .src
            .bytes()
            .get(off..off + dst.len())
            .ok_or_else(|| Error::Invalid(format!("slab {index} is past the template")))?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

struct Lane {
    /// Written only by the loader, only while the lane's state says the buffer is
    /// loading (see `CpuStream::slab`).
    bufs: [UnsafeCell<Tensor>; 2],
    st: Mutex<LaneState>,
    ready: Condvar,
}

#[derive(Default)]
struct LaneState {
    /// The step this lane serves in the current forward.
    step: Option<usize>,
    /// The blocks the forward reads, in order; kept across forwards so that preparing
    /// one does not allocate.
    slabs: Vec<usize>,
    /// The list position each buffer holds or is loading, and whether it has landed.
    /// Positions, not blocks, pick the buffer: two consecutive slabs of a list with
    /// holes may be blocks of the same parity.
    holds: [Option<usize>; 2],
    landed: [bool; 2],
    /// Loads sent and not yet done.
    pending: usize,
    /// The list position compute is at, and the next one to load.
    at: Option<usize>,
    next: usize,
    /// Why each buffer's latest load failed.
    failed: [Option<String>; 2],
}

struct Load {
    lane: usize,
    buf: usize,
    /// The list position loaded, to tell the load the buffer still waits for.
    pos: usize,
    step: usize,
    block: usize,
}

/// Streams one template's slabs for the CPU backend. `lanes` steps may be read in one
/// forward (requests of one template at different steps).
pub struct CpuStream {
    lanes: Arc<Vec<Lane>>,
    blocks: usize,
    steps: usize,
    send: Option<Sender<Load>>,
    loader: Option<JoinHandle<()>>,
    waited_ns: AtomicU64,
}

// SAFETY: the buffers in `UnsafeCell`s are written by the loader only between a load
// command and its completion, and read by compute only after completion and before the
// buffer's next load command, which compute itself sends (the protocol of `slab`).
unsafe impl Sync for Lane {}

impl CpuStream {
    /// Streams `steps * blocks` slabs of form `slab` from `src`.
    pub fn new(
        src: Arc<dyn SlabRead>,
        slab: &SlabShape,
        steps: usize,
        blocks: usize,
        lanes: usize,
    ) -> Result<Self> {
        let slab = *slab;
        // Staging in the form compute reads: f32, or fp8 as stored (the attention
        // kernel decodes it in its tile loads).
        let buffer = || -> Result<Tensor> {
            match slab.dtype {
                DType::F8E4M3 => Tensor::fp8(
                    slab.rows,
                    slab.cols,
                    vec![0; slab.rows * slab.cols],
                    vec![1.0; slab.groups],
                ),
                _ => Ok(Tensor::zeros([slab.rows, slab.cols])),
            }
        };
        let lanes: Arc<Vec<Lane>> = Arc::new(
            (0..lanes.max(1))
                .map(|_| -> Result<Lane> {
                    Ok(Lane {
                        bufs: [UnsafeCell::new(buffer()?), UnsafeCell::new(buffer()?)],
                        st: Mutex::default(),
                        ready: Condvar::new(),
                    })
                })
                .collect::<Result<_>>()?,
        );
        let (send, recv) = channel::<Load>();
        let ls = lanes.clone();
        let dtype = slab.dtype;
        let slab_bytes = slab.bytes();
        let loader = std::thread::Builder::new()
            .name("slab-loader".into())
            .spawn(move || {
                let mut staging = vec![0u8; if dtype == DType::F32 { 0 } else { slab_bytes }];
                let slab = slab;
                for job in recv {
                    let lane = &ls[job.lane];
                    // SAFETY: this buffer is loading (see the `Sync` note above).
                    let buf = unsafe { &mut *lane.bufs[job.buf].get() };
                    let r = read_slab(
                        &*src,
                        job.step * blocks + job.block,
                        &slab,
                        buf,
                        &mut staging,
                    );
                    let mut st = lane.st.lock().unwrap();
                    st.pending -= 1;
                    if st.holds[job.buf] == Some(job.pos) {
                        match r {
                            Ok(()) => st.landed[job.buf] = true,
                            Err(e) => st.failed[job.buf] = Some(e.to_string()),
                        }
                    }
                    lane.ready.notify_all();
                }
            })
            .map_err(|e| Error::Invalid(format!("cannot start the slab loader: {e}")))?;
        Ok(CpuStream {
            lanes,
            blocks,
            steps,
            send: Some(send),
            loader: Some(loader),
            waited_ns: AtomicU64::new(0),
        })
    }

    /// Sends the load of list position `pos` of the lane's forward.
    fn send(&self, lane: usize, st: &mut LaneState, step: usize, pos: usize) -> Result<()> {
        let buf = pos % 2;
        st.holds[buf] = Some(pos);
        st.landed[buf] = false;
        st.failed[buf] = None;
        st.pending += 1;
        self.send
            .as_ref()
            .expect("open until drop")
            .send(Load {
                lane,
                buf,
                pos,
                step,
                block: st.slabs[pos],
            })
            .map_err(|_| Error::Invalid("the slab loader has stopped".into()))
    }

    fn lane_of(&self, step: usize) -> Option<usize> {
        (0..self.lanes.len()).find(|&i| self.lanes[i].st.lock().unwrap().step == Some(step))
    }
}

/// Reads slab `index` into `out`: f32, or an fp8 matrix as stored.
fn read_slab(
    src: &dyn SlabRead,
    index: usize,
    slab: &SlabShape,
    out: &mut Tensor,
    staging: &mut [u8],
) -> Result<()> {
    let dtype = slab.dtype;
    if let Some(m) = out.as_fp8_mut() {
        src.read(index, staging)?;
        let n = slab.data_bytes();
        m.bytes.copy_from_slice(&staging[..n]);
        for (s, b) in m.scales.iter_mut().zip(staging[n..].chunks_exact(4)) {
            *s = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        return Ok(());
    }
    if dtype == DType::F32 {
        let data = out.data_mut();
        // SAFETY: any bytes are a valid f32 and the slice covers exactly `data`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), data.len() * 4)
        };
        src.read(index, bytes)?;
        if cfg!(target_endian = "big") {
            for v in data.iter_mut() {
                *v = f32::from_bits(v.to_bits().swap_bytes());
            }
        }
        return Ok(());
    }
    src.read(index, staging)?;
    out.data_mut().copy_from_slice(&to_f32(staging, dtype));
    Ok(())
}

impl SlabProvider<Tensor> for CpuStream {
    fn prepare(&self, step: usize, slabs: &[usize]) -> Result<()> {
        if step >= self.steps {
            return Err(Error::Invalid(format!(
                "step {step} of a {}-step template",
                self.steps
            )));
        }
        check_slab_list(slabs, self.blocks)?;
        if let Some(li) = self.lane_of(step) {
            // Another request at the same step in this forward shares the lane, whose
            // loads are already under way: only the same list can be served by it.
            let st = self.lanes[li].st.lock().unwrap();
            if st.slabs != slabs {
                return Err(Error::Invalid(format!(
                    "step {step} prepared twice in one forward with different slabs ({:?}, then {slabs:?})",
                    st.slabs
                )));
            }
            return Ok(());
        }
        let li = (0..self.lanes.len())
            .find(|&i| self.lanes[i].st.lock().unwrap().step.is_none())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "more than {} steps of one streamed template in one forward",
                    self.lanes.len()
                ))
            })?;
        let lane = &self.lanes[li];
        let mut st = lane.st.lock().unwrap();
        // Loads of a forward that stopped early may still be writing.
        while st.pending > 0 {
            st = lane.ready.wait(st).unwrap();
        }
        let mut list = std::mem::take(&mut st.slabs);
        list.clear();
        list.extend_from_slice(slabs);
        *st = LaneState {
            step: Some(step),
            slabs: list,
            next: slabs.len().min(2),
            ..Default::default()
        };
        for p in 0..st.next {
            self.send(li, &mut st, step, p)?;
        }
        Ok(())
    }

    fn slab(&self, step: usize, block: usize) -> Result<&Tensor> {
        let li = self
            .lane_of(step)
            .ok_or_else(|| Error::Invalid(format!("step {step} was not prepared")))?;
        let lane = &self.lanes[li];
        let mut st = lane.st.lock().unwrap();
        if let Some(p) = st.at.filter(|&p| st.slabs[p] == block) {
            // Another request at this step in the same forward: the slab is in place.
            // SAFETY: as below.
            return Ok(unsafe { &*lane.bufs[p % 2].get() });
        }
        let p = next_slab_position(&st.slabs, st.at, step, block)?;
        // Entering position p: compute is done with p-1 (the CPU runs a block to its
        // end before asking for the next), so its buffer takes p+1.
        if p + 1 < st.slabs.len() && st.next == p + 1 {
            self.send(li, &mut st, step, p + 1)?;
            st.next = p + 2;
        }
        let i = p % 2;
        debug_assert_eq!(st.holds[i], Some(p), "position {p} was sent");
        let t = Instant::now();
        while !st.landed[i] && st.failed[i].is_none() {
            st = lane.ready.wait(st).unwrap();
        }
        self.waited_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if let Some(e) = &st.failed[i] {
            // `at` stays put, so asking again reports the same failure rather than
            // handing out the buffer.
            return Err(Error::Invalid(format!("loading a template slab: {e}")));
        }
        st.at = Some(p);
        // SAFETY: landed, and the loader writes this buffer again only after compute
        // enters position p+1 (which sends the load of p+2).
        Ok(unsafe { &*lane.bufs[i].get() })
    }

    fn finish(&self) {
        for l in self.lanes.iter() {
            l.st.lock().unwrap().step = None;
        }
    }

    fn take_wait(&self) -> Option<Duration> {
        Some(Duration::from_nanos(
            self.waited_ns.swap(0, Ordering::Relaxed),
        ))
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        // The loader ends when its queue closes, after the loads already sent.
        self.send = None;
        if let Some(h) = self.loader.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(dtype: DType, rows: usize, cols: usize) -> SlabShape {
        SlabShape {
            rows,
            cols,
            dtype,
            groups: 1,
        }
    }

    /// Slabs whose every value is its index, read with a delay (a slow disk); the
    /// indices read are logged.
    struct Numbered {
        elems: usize,
        delay: Duration,
        read: Mutex<Vec<usize>>,
    }
    impl Numbered {
        fn new(elems: usize, delay: Duration) -> Arc<Self> {
            Arc::new(Numbered {
                elems,
                delay,
                read: Mutex::default(),
            })
        }
        fn take_read(&self) -> Vec<usize> {
            std::mem::take(&mut *self.read.lock().unwrap())
        }
    }
    impl SlabRead for Numbered {
        fn read(&self, index: usize, dst: &mut [u8]) -> Result<()> {
            std::thread::sleep(self.delay);
            let v = crate::stored::encode(&vec![index as f32; self.elems], DType::BF16);
            dst.copy_from_slice(&v);
            self.read.lock().unwrap().push(index);
            Ok(())
        }
    }

    #[test]
    fn streams_every_block_from_any_first_block_and_counts_the_wait() {
        let (steps, blocks) = (3, 5);
        let src = Numbered::new(6, Duration::from_millis(20));
        let s = CpuStream::new(src, &shape(DType::BF16, 2, 3), steps, blocks, 2).unwrap();
        for (step, first) in [(0, 0), (2, 3), (1, 4)] {
            let list: Vec<usize> = (first..blocks).collect();
            s.prepare(step, &list).unwrap();
            for b in first..blocks {
                let t = s.slab(step, b).unwrap();
                assert_eq!(
                    t.data(),
                    &[(step * blocks + b) as f32; 6],
                    "step {step} block {b}"
                );
            }
            s.finish();
        }
        // With no compute between blocks, compute waits for every load after the first
        // two were queued: most of the reads' time.
        let waited = s.take_wait().unwrap();
        assert!(waited >= Duration::from_millis(20 * 5), "waited {waited:?}");
        assert_eq!(s.take_wait(), Some(Duration::ZERO));
        // Two steps in one forward use two lanes; a third is refused.
        let all: Vec<usize> = (0..blocks).collect();
        s.prepare(0, &all).unwrap();
        s.prepare(1, &all).unwrap();
        assert!(s.prepare(2, &all).is_err());
        assert_eq!(s.slab(1, 0).unwrap().data()[0], blocks as f32);
        assert!(s.slab(0, 2).is_err(), "out of order");
        s.finish();
    }

    #[test]
    fn streams_only_the_listed_blocks_two_ahead_at_most() {
        let (steps, blocks) = (2, 8);
        let src = Numbered::new(6, Duration::from_millis(5));
        let s = CpuStream::new(src.clone(), &shape(DType::BF16, 2, 3), steps, blocks, 1).unwrap();
        let list = [0, 2, 3, 6];
        // The slabs read since the last call, once `n` were: waiting for the expected
        // reads keeps a busy machine from failing the test, and the pause after them
        // gives a load sent too early the time to show.
        let read = |n: usize| {
            let t = Instant::now();
            while src.read.lock().unwrap().len() < n && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(30));
            let r = src.take_read();
            assert_eq!(r.len(), n, "{r:?}");
            r
        };
        s.prepare(1, &list).unwrap();
        assert_eq!(read(2), [8, 10], "the first two positions, in two buffers");
        // Blocks of the same parity (2 after 0) in consecutive positions still get the
        // two buffers: each slab keeps its contents until compute has left it.
        for (p, &b) in list.iter().enumerate() {
            let t = s.slab(1, b).unwrap();
            assert_eq!(t.data(), &[(blocks + b) as f32; 6], "block {b}");
            // Another request at the same step reads the same slab.
            assert_eq!(s.slab(1, b).unwrap().data()[0], (blocks + b) as f32);
            // Entering position p sends p+1 only (p+1 < 2 was sent by `prepare`).
            let sent = if (1..list.len() - 1).contains(&p) {
                vec![blocks + list[p + 1]]
            } else {
                vec![]
            };
            assert_eq!(read(sent.len()), sent, "entering block {b}");
        }
        let e = s.slab(1, 7).unwrap_err().to_string();
        assert!(e.contains("not prepared"), "{e}");
        s.finish();

        // Blocks outside the list, or asked out of its order, are errors that leave the
        // stream where it was.
        s.prepare(0, &list).unwrap();
        let e = s.slab(0, 1).unwrap_err().to_string();
        assert!(e.contains("block 1 of step 0 not prepared"), "{e}");
        let e = s.slab(0, 2).unwrap_err().to_string();
        assert!(e.contains("asked out of order"), "{e}");
        assert_eq!(s.slab(0, 0).unwrap().data()[0], 0.0);
        assert!(s.slab(0, 3).is_err(), "2 comes first");
        assert_eq!(s.slab(0, 2).unwrap().data()[0], 2.0);
        assert!(s.slab(0, 0).is_err(), "already left");
        // Another request at the same step must read the same list.
        assert!(s.prepare(0, &list).is_ok());
        assert!(s.prepare(0, &[0, 2, 3]).is_err());
        s.finish();

        // An empty list loads nothing and serves nothing.
        s.prepare(0, &[]).unwrap();
        // The forward before read 0, 2 and (sent on entering 2) 3, the last of them
        // done by the time `prepare` takes the lane over.
        assert_eq!(src.take_read(), [0, 2, 3]);
        assert!(s.slab(0, 0).is_err());
        s.finish();
        assert_eq!(read(0), Vec::<usize>::new());

        // Lists that are not strictly ascending blocks of the template are refused.
        for bad in [&[2, 2][..], &[3, 1], &[0, 8]] {
            assert!(s.prepare(0, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_failed_read_is_an_error_not_data() {
        struct Broken;
        impl SlabRead for Broken {
            fn read(&self, index: usize, _: &mut [u8]) -> Result<()> {
                Err(Error::Invalid(format!("checksum mismatch in slab {index}")))
            }
        }
        let s = CpuStream::new(Arc::new(Broken), &shape(DType::F32, 1, 2), 1, 3, 1).unwrap();
        s.prepare(0, &[0, 2]).unwrap();
        // Both loads fail; each buffer reports its own slab, and asking again does not
        // hand out the buffer.
        for _ in 0..2 {
            let e = s.slab(0, 0).unwrap_err().to_string();
            assert!(e.contains("checksum mismatch in slab 0"), "{e}");
        }
        s.finish();
        s.prepare(0, &[2]).unwrap();
        let e = s.slab(0, 2).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch in slab 2"), "{e}");
    }
}
