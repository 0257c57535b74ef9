//! Device time, measured with the executor's timing events (CUDA events on a GPU): for
//! the benchmarks, and for the denoise loop's step metric, which would otherwise time
//! only the host's queueing of the step's kernels.

use denoised_runtime::{DeviceTimer, Result};

use super::{dev, GpuBackend};
use crate::exec::Exec;

impl<E: Exec> GpuBackend<E> {
    /// Runs `f` (which queues work on the compute stream) and returns the device time
    /// it took in seconds (waits for the work); `None` on an executor without a clock.
    pub fn gpu_seconds(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<f64>> {
        let timer = self.start_timer()?;
        f()?;
        timer.map(|t| t.stop()).transpose()
    }

    /// `Backend::device_timer`: an event recorded on the compute stream now.
    pub(super) fn start_timer(&self) -> Result<Option<Box<dyn DeviceTimer>>> {
        let start = self.exec().timing_event().map_err(dev)?;
        Ok(start.map(|start| {
            Box::new(Timer {
                exec: self.exec().clone(),
                start,
            }) as Box<dyn DeviceTimer>
        }))
    }
}

struct Timer<E: Exec> {
    exec: std::sync::Arc<E>,
    start: E::Event,
}

impl<E: Exec> DeviceTimer for Timer<E> {
    fn stop(self: Box<Self>) -> Result<f64> {
        let end = self.exec.timing_event().map_err(dev)?;
        let end = end.expect("an executor that started a timer has a clock");
        // Waits for the end event: a fault in the timed work is reported here.
        Ok(self.exec.elapsed_ms(&self.start, &end).map_err(dev)? / 1e3)
    }
}
