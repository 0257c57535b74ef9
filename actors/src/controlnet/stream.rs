//! A ControlNet stream: one request's residuals, step by step, from the ControlNet
//! service to the denoise worker through one slice of the service's arena (docs/design.md
//! §Adapters).
//!
//! The slice holds, 64-byte aligned:
//!
//! | part | writer | what |
//! |---|---|---|
//! | `step` word | denoise | the step whose latents are in `latents`, plus 1 (0: none yet) |
//! | one word per residual block | service | the step it holds, plus 1; `FAILED` when the service could not compute it |
//! | `latents` | denoise | `[rows, cols]` f32 |
//! | residuals | service | `blocks x [residual_rows, hidden]` f32 |
//!
//! Per step the denoise worker writes the job's latents and bumps `step`; the service,
//! waiting on that word, copies them out and runs its ControlNets, writing residual
//! `k` and bumping its word as soon as block `k` is final; the transformer's forward
//! waits on a residual's word only when it reaches a block whose residual is not there
//! yet. Waits are futexes on the shared words. No message travels per step, and one
//! step's residuals are never overwritten while read: the next step's latents only
//! come after the forward that read them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use denoised_models::flux::control_feed::{ControlFeed, FeedLayout};
use denoised_runtime::shm::futex;
use denoised_runtime::{Error, HostSlice, Result, Tensor};
use prometheus_client::metrics::histogram::Histogram;

/// A block word's value when the service failed the step.
pub const FAILED: u32 = u32::MAX;
const ALIGN: usize = 64;

pub use crate::wire::controlnet::StreamLayout;

impl StreamLayout {
    pub fn blocks(&self) -> usize {
        (self.doubles + self.singles) as usize
    }
    fn words_bytes(&self) -> usize {
        (4 * (1 + self.blocks())).next_multiple_of(ALIGN)
    }
    fn latents_bytes(&self) -> usize {
        (4 * self.rows as usize * self.cols as usize).next_multiple_of(ALIGN)
    }
    fn residual_len(&self) -> usize {
        self.residual_rows as usize * self.hidden as usize
    }
    fn residual_bytes(&self) -> usize {
        4 * self.residual_len()
    }
    fn residual_offset(&self, k: usize) -> usize {
        self.words_bytes()
            + self.latents_bytes()
            + k * self.residual_bytes().next_multiple_of(ALIGN)
    }
    /// Bytes of the slice.
    pub fn total_bytes(&self) -> usize {
        self.residual_offset(self.blocks())
    }
    pub fn feed_layout(&self) -> FeedLayout {
        FeedLayout {
            doubles: self.doubles as usize,
            singles: self.singles as usize,
            rows: self.residual_rows as usize,
            hidden: self.hidden as usize,
            scale: self.scale,
        }
    }
}

/// A stream's slice, as either side maps it.
pub struct Stream {
    slice: HostSlice,
    layout: StreamLayout,
}

impl Stream {
    pub fn new(slice: HostSlice, layout: StreamLayout) -> Result<Self> {
        if slice.len() < layout.total_bytes() || !slice.writable() {
            return Err(Error::Invalid(format!(
                "a ControlNet stream of {} bytes (writable: {}) for a layout of {}",
                slice.len(),
                slice.writable(),
                layout.total_bytes()
            )));
        }
        if slice.as_ptr() as usize % ALIGN != 0 {
            return Err(Error::Invalid(
                "a ControlNet stream must be 64-byte aligned".into(),
            ));
        }
        Ok(Stream { slice, layout })
    }

    pub fn layout(&self) -> &StreamLayout {
        &self.layout
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        self.slice
            .word(i)
            .expect("the words lie inside the stream (checked in `new`)")
    }
    pub fn step_word(&self) -> &AtomicU32 {
        self.word(0)
    }
    pub fn block_word(&self, k: usize) -> &AtomicU32 {
        self.word(1 + k)
    }

    fn f32s(&self, offset: usize, n: usize) -> &[f32] {
        // SAFETY: in bounds and 64-aligned; the protocol above gives each region one
        // writer at a time, and a reader reads only after the word that publishes it.
        unsafe { std::slice::from_raw_parts(self.slice.as_ptr().add(offset) as *const f32, n) }
    }
    #[allow(clippy::mut_from_ref)]
    fn f32s_mut(&self, offset: usize, n: usize) -> &mut [f32] {
        // SAFETY: as `f32s`; the caller is the region's writer.
        unsafe { std::slice::from_raw_parts_mut(self.slice.as_ptr().add(offset) as *mut f32, n) }
    }
    fn latents_len(&self) -> usize {
        self.layout.rows as usize * self.layout.cols as usize
    }
    /// The latents of the step announced last.
    pub fn latents(&self) -> &[f32] {
        self.f32s(self.layout.words_bytes(), self.latents_len())
    }
    /// The denoise side: writes a step's latents and announces the step.
    pub fn put_latents(&self, step: usize, latents: &[f32]) -> Result<()> {
        if latents.len() != self.latents_len() {
            return Err(Error::Invalid(format!(
                "{} latent values for a ControlNet stream of {}",
                latents.len(),
                self.latents_len()
            )));
        }
        self.f32s_mut(self.layout.words_bytes(), latents.len())
            .copy_from_slice(latents);
        futex::store_and_wake(self.step_word(), step as u32 + 1);
        Ok(())
    }
    /// Residual `k`.
    pub fn residual(&self, k: usize) -> &[f32] {
        self.f32s(self.layout.residual_offset(k), self.layout.residual_len())
    }
    /// The service side: writes residual `k` of `step` and publishes it.
    pub fn put_residual(&self, step: usize, k: usize, r: &[f32]) -> Result<()> {
        let n = self.layout.residual_len();
        if r.len() != n || k >= self.layout.blocks() {
            return Err(Error::Invalid(format!(
                "residual {k} of {} values",
                r.len()
            )));
        }
        self.f32s_mut(self.layout.residual_offset(k), n)
            .copy_from_slice(r);
        futex::store_and_wake(self.block_word(k), step as u32 + 1);
        Ok(())
    }
    /// The service side: the step cannot be computed; its readers fail.
    pub fn fail(&self) {
        for k in 0..self.layout.blocks() {
            futex::store_and_wake(self.block_word(k), FAILED);
        }
    }
}

/// How long a forward waits for one residual before it checks that the service is
/// still there, and before it gives up.
const CHECK_EVERY: Duration = Duration::from_millis(500);
const GIVE_UP: Duration = Duration::from_secs(300);

/// The denoise worker's side of a stream: a [`ControlFeed`] whose residuals another
/// process computes while the transformer runs.
pub struct StreamFeed {
    stream: Stream,
    /// The service process (its death fails the wait at once, not after `GIVE_UP`).
    owner: u32,
    step: AtomicU32,
    /// Time this step's forward waited for residuals, µs, and where it goes.
    waited_us: AtomicU32,
    wait_metric: Option<Histogram>,
}

impl StreamFeed {
    pub fn new(stream: Stream, owner: u32, wait_metric: Option<Histogram>) -> Self {
        StreamFeed {
            stream,
            owner,
            step: AtomicU32::new(0),
            waited_us: AtomicU32::new(0),
            wait_metric,
        }
    }

    fn report_wait(&self) {
        let us = self.waited_us.swap(0, Ordering::Relaxed);
        if let Some(h) = &self.wait_metric {
            h.observe(us as f64 * 1e-6);
        }
    }
}

impl Drop for StreamFeed {
    fn drop(&mut self) {
        if self.step.load(Ordering::Relaxed) > 0 {
            self.report_wait();
        }
    }
}

impl ControlFeed for StreamFeed {
    fn layout(&self) -> FeedLayout {
        self.stream.layout.feed_layout()
    }
    fn begin(&self, step: usize, latents: &Tensor) -> Result<()> {
        if self.step.swap(step as u32 + 1, Ordering::Relaxed) > 0 {
            self.report_wait();
        }
        self.stream.put_latents(step, latents.data())
    }
    fn with_residual(&self, k: usize, f: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()> {
        let want = self.step.load(Ordering::Relaxed);
        let word = self.stream.block_word(k);
        let t0 = Instant::now();
        let v = futex::wait_until(
            word,
            |v| v == want || v == FAILED,
            CHECK_EVERY,
            || {
                if !denoised_runtime::shm::owner_alive(self.owner, 0) {
                    return Err(Error::Invalid(
                        "the ControlNet service process is gone".into(),
                    ));
                }
                if t0.elapsed() > GIVE_UP {
                    return Err(Error::Invalid(format!(
                        "no ControlNet residual {k} after {} s",
                        GIVE_UP.as_secs()
                    )));
                }
                Ok(())
            },
        )?;
        if v == FAILED {
            return Err(Error::Invalid(
                "the ControlNet service failed this step (its log says why)".into(),
            ));
        }
        let us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
        self.waited_us.fetch_add(us, Ordering::Relaxed);
        f(self.stream.residual(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use denoised_runtime::shm::{Arena, ArenaView};
    use denoised_runtime::DType;
    use std::sync::Arc;

    /// The two sides of one stream over a real arena: the owner's mapping (the
    /// service) and a second, writable mapping of the file (the denoise worker).
    fn pair(layout: &StreamLayout) -> (tempfile::TempDir, Arena, Stream, Stream) {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Arena::create(dir.path(), "t", "cn", 1 << 20).unwrap();
        let h = a.alloc(DType::U8, &[layout.total_bytes()]).unwrap();
        let own = a.shared_view().host_slice(&h).unwrap();
        // SAFETY: a fresh slice nobody else uses yet.
        unsafe { own.bytes_mut() }.fill(0);
        let rw = Arc::new(ArenaView::attach_rw(dir.path(), "t", "cn").unwrap());
        let other = rw.host_slice(&h).unwrap();
        let service = Stream::new(own, layout.clone()).unwrap();
        let denoise = Stream::new(other, layout.clone()).unwrap();
        (dir, a, service, denoise)
    }

    #[test]
    fn residuals_stream_block_by_block_and_a_failed_step_fails_its_reader() {
        let layout = StreamLayout {
            doubles: 2,
            singles: 1,
            rows: 3,
            cols: 4,
            // An edit's: 2 of its 3 tokens active.
            residual_rows: 2,
            hidden: 5,
            scale: 0.5,
        };
        let (_dir, _arena, service, denoise) = pair(&layout);
        let feed = StreamFeed::new(denoise, std::process::id(), None);
        assert_eq!(feed.layout().scale, 0.5);
        let service = Arc::new(service);
        let s = service.clone();
        // The service: per announced step, residual k = step * 100 + k + latents[0],
        // published one block at a time with a pause between blocks.
        let t = std::thread::spawn(move || {
            let mut last = 0;
            for _ in 0..2 {
                while futex::wait_while(s.step_word(), last, Duration::from_secs(5)) == last {}
                last = s.step_word().load(Ordering::Acquire);
                let step = last as usize - 1;
                let x0 = s.latents()[0];
                if step == 1 {
                    s.fail();
                    continue;
                }
                for k in 0..3 {
                    std::thread::sleep(Duration::from_millis(20));
                    let v = (step * 100 + k) as f32 + x0;
                    s.put_residual(step, k, &[v; 10]).unwrap();
                }
            }
        });
        let latents = Tensor::new([3, 4], vec![0.25; 12]).unwrap();
        feed.begin(0, &latents).unwrap();
        for k in 0..3 {
            let mut got = vec![];
            feed.with_residual(k, &mut |r| {
                got = r.to_vec();
                Ok(())
            })
            .unwrap();
            assert_eq!(got, vec![k as f32 + 0.25; 10], "residual {k}");
        }
        // The forward waited for the later blocks.
        assert!(feed.waited_us.load(Ordering::Relaxed) > 10_000);
        feed.begin(1, &latents).unwrap();
        let e = feed.with_residual(0, &mut |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("failed this step"), "{e}");
        t.join().unwrap();
        // A slice of the wrong size or a read-only one is refused.
        let small = HostSlice::zeroed(64).unwrap();
        assert!(Stream::new(small, layout).is_err());
    }
}
