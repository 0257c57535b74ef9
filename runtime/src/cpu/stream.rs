//! [`CpuStream`]: a template's cached K/V streamed into f32 staging buffers by a loader
//! thread while the CPU computes (DESIGN.md §Planner), the CPU counterpart of the CUDA
//! backend's copy stream.
//!
//! The slabs come from wherever the template lies ([`SlabRead`]): the host tier (a
//! shared-memory arena: a copy) or the disk tier (a read, each slab checked against
//! its checksum). Each forward reads one step from a first block on; the loader keeps
//! one block ahead in a ping-pong pair of buffers per step in flight:
//!
//! ```text
//! loader:   load b → A, load b+1 → B | (compute left b) load b+2 → A | ...
//! compute:  wait(A) block b          | wait(B) block b+1             | wait(A) ...
//! ```
//!
//! The time compute spends waiting is the step's bubble ([`SlabProvider::take_wait`]).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::SlabProvider;
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
    /// The block each buffer holds or is loading, and whether it has landed.
    holds: [Option<usize>; 2],
    landed: [bool; 2],
    /// Loads sent and not yet done.
    pending: usize,
    at: Option<usize>,
    next: usize,
    /// Why each buffer's latest load failed.
    failed: [Option<String>; 2],
}

struct Load {
    lane: usize,
    buf: usize,
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
    /// Streams `steps * blocks` slabs of `shape` stored as `dtype` from `src`.
    pub fn new(
        src: Arc<dyn SlabRead>,
        dtype: DType,
        shape: &[usize],
        steps: usize,
        blocks: usize,
        lanes: usize,
    ) -> Result<Self> {
        let elems: usize = shape.iter().product();
        let lanes: Arc<Vec<Lane>> = Arc::new(
            (0..lanes.max(1))
                .map(|_| Lane {
                    bufs: [(); 2].map(|_| UnsafeCell::new(Tensor::zeros(shape.to_vec()))),
                    st: Mutex::default(),
                    ready: Condvar::new(),
                })
                .collect(),
        );
        let (send, recv) = channel::<Load>();
        let ls = lanes.clone();
        let slab_bytes = elems * dtype.size_bytes();
        let loader = std::thread::Builder::new()
            .name("slab-loader".into())
            .spawn(move || {
                let mut staging = vec![0u8; if dtype == DType::F32 { 0 } else { slab_bytes }];
                for job in recv {
                    let lane = &ls[job.lane];
                    // SAFETY: this buffer is loading (see the `Sync` note above).
                    let buf = unsafe { &mut *lane.bufs[job.buf].get() };
                    let r = read_slab(
                        &*src,
                        job.step * blocks + job.block,
                        dtype,
                        buf,
                        &mut staging,
                    );
                    let mut st = lane.st.lock().unwrap();
                    st.pending -= 1;
                    if st.holds[job.buf] == Some(job.block) {
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

    fn send(&self, lane: usize, st: &mut LaneState, step: usize, block: usize) -> Result<()> {
        let buf = block % 2;
        st.holds[buf] = Some(block);
        st.landed[buf] = false;
        st.failed[buf] = None;
        st.pending += 1;
        self.send
            .as_ref()
            .expect("open until drop")
            .send(Load {
                lane,
                buf,
                step,
                block,
            })
            .map_err(|_| Error::Invalid("the slab loader has stopped".into()))
    }

    fn lane_of(&self, step: usize) -> Option<usize> {
        (0..self.lanes.len()).find(|&i| self.lanes[i].st.lock().unwrap().step == Some(step))
    }
}

/// Reads slab `index` into `out` as f32.
fn read_slab(
    src: &dyn SlabRead,
    index: usize,
    dtype: DType,
    out: &mut Tensor,
    staging: &mut [u8],
) -> Result<()> {
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
        *st = LaneState {
            step: Some(step),
            next: (first + 2).min(self.blocks),
            ..Default::default()
        };
        for b in first..st.next {
            self.send(li, &mut st, step, b)?;
        }
        Ok(())
    }

    fn slab(&self, step: usize, block: usize) -> Result<&Tensor> {
        let li = self
            .lane_of(step)
            .ok_or_else(|| Error::Invalid(format!("step {step} was not prepared")))?;
        let lane = &self.lanes[li];
        let mut st = lane.st.lock().unwrap();
        let i = block % 2;
        if st.at != Some(block) {
            // Entering `block`: compute is done with block-1 (the CPU runs a block to
            // its end before asking for the next), so its buffer takes block+1.
            if block + 1 < self.blocks && st.next == block + 1 {
                self.send(li, &mut st, step, block + 1)?;
                st.next = block + 2;
            }
            if st.holds[i] != Some(block) {
                return Err(Error::Invalid(format!(
                    "block {block} asked out of order (buffer holds {:?})",
                    st.holds[i]
                )));
            }
            let t = Instant::now();
            while !st.landed[i] && st.failed[i].is_none() {
                st = lane.ready.wait(st).unwrap();
            }
            self.waited_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Some(e) = &st.failed[i] {
                return Err(Error::Invalid(format!("loading a template slab: {e}")));
            }
            st.at = Some(block);
        }
        // SAFETY: landed, and the loader writes this buffer again only after compute
        // enters block+1 (which sends that load).
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

    /// Slabs whose every value is its index, read with a delay (a slow disk).
    struct Numbered {
        elems: usize,
        delay: Duration,
    }
    impl SlabRead for Numbered {
        fn read(&self, index: usize, dst: &mut [u8]) -> Result<()> {
            std::thread::sleep(self.delay);
            let v = crate::stored::encode(&vec![index as f32; self.elems], DType::BF16);
            dst.copy_from_slice(&v);
            Ok(())
        }
    }

    #[test]
    fn streams_every_block_from_any_first_block_and_counts_the_wait() {
        let (steps, blocks) = (3, 5);
        let src = Arc::new(Numbered {
            elems: 6,
            delay: Duration::from_millis(20),
        });
        let s = CpuStream::new(src, DType::BF16, &[2, 3], steps, blocks, 2).unwrap();
        for (step, first) in [(0, 0), (2, 3), (1, 4)] {
            s.prepare(step, first).unwrap();
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
        s.prepare(0, 0).unwrap();
        s.prepare(1, 0).unwrap();
        assert!(s.prepare(2, 0).is_err());
        assert_eq!(s.slab(1, 0).unwrap().data()[0], blocks as f32);
        assert!(s.slab(0, 2).is_err(), "out of order");
        s.finish();
    }

    #[test]
    fn a_failed_read_is_an_error_not_data() {
        struct Broken;
        impl SlabRead for Broken {
            fn read(&self, index: usize, _: &mut [u8]) -> Result<()> {
                Err(Error::Invalid(format!("checksum mismatch in slab {index}")))
            }
        }
        let s = CpuStream::new(Arc::new(Broken), DType::F32, &[1, 2], 1, 2, 1).unwrap();
        s.prepare(0, 0).unwrap();
        // Both loads fail; each block reports its own slab.
        let e = s.slab(0, 0).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch in slab 0"), "{e}");
        s.finish();
        s.prepare(0, 1).unwrap();
        let e = s.slab(0, 1).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch in slab 1"), "{e}");
    }
}
