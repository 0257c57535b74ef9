//! The ControlNet service's metrics (its processes), and the residual waits of the
//! denoise workers that read its streams.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::{LATENCY_SECONDS, STEP_SECONDS};

#[derive(Clone)]
pub struct ControlNetMetrics {
    /// ControlNet weight loads into the process's LRU, by result.
    pub loads: Family<[(&'static str, &'static str); 1], Counter>,
    pub load: Histogram,
    /// One generation's step: every ControlNet of it, residuals written.
    pub step: Histogram,
    /// Of which copying the residuals into shared memory.
    pub copy: Histogram,
}

impl ControlNetMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = ControlNetMetrics {
            loads: Family::default(),
            load: Histogram::new(LATENCY_SECONDS.iter().copied()),
            step: Histogram::new(STEP_SECONDS.iter().copied()),
            copy: Histogram::new(STEP_SECONDS.iter().copied()),
        };
        for result in ["ok", "error"] {
            let _ = m.loads.get_or_create(&[("result", result)]);
        }
        r.register(
            "controlnet_loads",
            "ControlNet weights loaded into the process's memory, by result (ok, error); a ControlNet in memory is not loaded again until the LRU drops it",
            m.loads.clone(),
        );
        r.register_with_unit(
            "controlnet_load_duration",
            "Time to load one ControlNet's weights",
            Unit::Seconds,
            m.load.clone(),
        );
        r.register_with_unit(
            "controlnet_step_duration",
            "Time the service took for one step of one generation: its ControlNets run, residuals written to shared memory",
            Unit::Seconds,
            m.step.clone(),
        );
        r.register_with_unit(
            "controlnet_residual_copy_duration",
            "Of a step, the time spent copying its residuals into shared memory (the transfer to the denoise worker)",
            Unit::Seconds,
            m.copy.clone(),
        );
        m
    }
}

/// A denoise worker's side: how long a step's forward waited for residuals.
pub fn register_wait(r: &mut Registry) -> Histogram {
    let h = Histogram::new(super::BUBBLE_SECONDS.iter().copied());
    r.register_with_unit(
        "controlnet_residual_wait",
        "Time one step of a generation with ControlNets waited for residuals the service had not streamed yet (0: hidden behind the transformer's blocks)",
        Unit::Seconds,
        h.clone(),
    );
    h
}
