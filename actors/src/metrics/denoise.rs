//! A denoise worker's metrics: its steps and batches (recorded by the event thread
//! from the loop's step events, so the loop itself does no metrics work), its queue,
//! and its device: the memory budget, the memory in use, and the device tier of the
//! template cache (read at scrape time from the stepper's counters).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use denoised_models::flux::stepper::StepperStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::{
    BATCH_REQUESTS, BATCH_TOKENS, BUBBLE_SECONDS, FULL_BLOCKS, LATENCY_SECONDS, STEP_SECONDS,
};
use crate::budget::DeviceBudget;

/// How a request left the denoise loop.
pub type Outcome = [(&'static str, &'static str); 1];

#[derive(Clone)]
pub struct DenoiseMetrics {
    pub step: Histogram,
    /// The step's time on the device's own clock (GPU workers: CUDA events).
    pub step_device: Histogram,
    /// The planner's predicted step latency, the blocks it computed in full, and the
    /// time compute waited for template loads.
    pub predicted: Histogram,
    pub full_blocks: Histogram,
    pub bubble: Histogram,
    pub batch_requests: Histogram,
    pub batch_tokens: Histogram,
    pub running: Gauge,
    pub waiting: Gauge,
    pub requests: Family<Outcome, Counter>,
    /// LoRA loads by result, and how long each took (read and checked, throttled).
    pub lora_loads: Family<[(&'static str, &'static str); 1], Counter>,
    pub lora_load: Histogram,
    /// A step's wait for ControlNet residuals (generations with ControlNets).
    pub control_wait: Histogram,
}

impl DenoiseMetrics {
    /// Registers a denoise worker's metrics; `device` is what its stepper counts and
    /// the memory budget it computed (GPU and emulator workers).
    pub fn register(
        r: &mut Registry,
        stats: Arc<StepperStats>,
        budget: Option<DeviceBudget>,
    ) -> Self {
        let m = DenoiseMetrics {
            step: Histogram::new(STEP_SECONDS.iter().copied()),
            step_device: Histogram::new(STEP_SECONDS.iter().copied()),
            predicted: Histogram::new(STEP_SECONDS.iter().copied()),
            full_blocks: Histogram::new(FULL_BLOCKS.iter().copied()),
            bubble: Histogram::new(BUBBLE_SECONDS.iter().copied()),
            batch_requests: Histogram::new(BATCH_REQUESTS.iter().copied()),
            batch_tokens: Histogram::new(BATCH_TOKENS.iter().copied()),
            running: Gauge::default(),
            waiting: Gauge::default(),
            requests: Family::default(),
            lora_loads: Family::default(),
            lora_load: Histogram::new(LATENCY_SECONDS.iter().copied()),
            control_wait: super::controlnet::register_wait(r),
        };
        r.register_with_unit(
            "denoise_step_duration",
            "Duration of one batched denoising step",
            Unit::Seconds,
            m.step.clone(),
        );
        r.register_with_unit(
            "denoise_step_device_duration",
            "Duration of one batched denoising step on the device's own clock (GPU workers: CUDA events); the rest of denoise_step_duration is the host's",
            Unit::Seconds,
            m.step_device.clone(),
        );
        r.register_with_unit(
            "denoise_step_predicted_duration",
            "The planner's predicted duration of a step that reads a template (compare with denoise_step_duration)",
            Unit::Seconds,
            m.predicted.clone(),
        );
        r.register(
            "denoise_step_full_blocks",
            "Blocks a step computed over every token (the planner's full prefix)",
            m.full_blocks.clone(),
        );
        r.register_with_unit(
            "denoise_step_bubble",
            "Time a step's compute waited for template loads (where the device measures it: the CPU loader thread)",
            Unit::Seconds,
            m.bubble.clone(),
        );
        r.register(
            "denoise_batch_requests",
            "Requests in a step's batch",
            m.batch_requests.clone(),
        );
        r.register(
            "denoise_batch_tokens",
            "Token rows a step computes (text and active image tokens of its requests)",
            m.batch_tokens.clone(),
        );
        r.register(
            "denoise_running_requests",
            "Requests in the running batch after the latest step",
            m.running.clone(),
        );
        r.register(
            "denoise_waiting_requests",
            "Requests waiting to join the running batch after the latest step",
            m.waiting.clone(),
        );
        r.register(
            "denoise_requests",
            "Requests that left the denoise loop, by outcome (finished, failed, cancelled)",
            m.requests.clone(),
        );
        r.register(
            "lora_loads",
            "LoRA loads of the worker's loader, by result (ok, error)",
            m.lora_loads.clone(),
        );
        r.register_with_unit(
            "lora_load_duration",
            "Time the loader took to read and check a LoRA (with [adapters] throttle_mib_per_s)",
            Unit::Seconds,
            m.lora_load.clone(),
        );
        r.register_collector(Box::new(DeviceCollector { stats, budget }));
        m
    }
}

/// The device's figures, read from the stepper's counters at scrape time.
#[derive(Debug)]
struct DeviceCollector {
    stats: Arc<StepperStats>,
    budget: Option<DeviceBudget>,
}

fn tier() -> [(&'static str, &'static str); 1] {
    [("tier", "device")]
}

impl Collector for DeviceCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        use super::template_cache::*;
        // The registry appends the period to help texts; a collector writes its own.
        let help = |h: &str| format!("{h}.");
        let gauges = [
            (ENTRIES, None, get(&s.entries)),
            (BYTES, Some(Unit::Bytes), get(&s.bytes)),
        ];
        for ((name, h), unit, v) in gauges {
            let mut m = e.encode_descriptor(name, &help(h), unit.as_ref(), MetricType::Gauge)?;
            ConstGauge::new(v as i64).encode(m.encode_family(&tier())?)?;
        }
        let counters = [
            (HITS, None, get(&s.hits)),
            (MISSES, None, get(&s.misses)),
            (EVICTIONS, None, get(&s.evictions)),
            (LOADED, Some(Unit::Bytes), get(&s.loaded_bytes)),
        ];
        for ((name, h), unit, v) in counters {
            let mut m = e.encode_descriptor(name, &help(h), unit.as_ref(), MetricType::Counter)?;
            ConstCounter::new(v).encode(m.encode_family(&tier())?)?;
        }
        let m = e.encode_descriptor(
            "template_streamed",
            "Bytes of template K/V streamed to the device during steps (templates larger than its template budget).",
            Some(&Unit::Bytes),
            MetricType::Counter,
        )?;
        ConstCounter::new(get(&s.streamed_bytes)).encode(m)?;
        if let Some(b) = &self.budget {
            let mut m = e.encode_descriptor(
                "device_memory_budget",
                "The device memory budget computed at start, by part.",
                Some(&Unit::Bytes),
                MetricType::Gauge,
            )?;
            for (part, v) in [
                ("total", b.total_bytes),
                ("weights", b.weights_bytes),
                ("workspace", b.workspace_bytes),
                ("requests", b.requests_bytes),
                ("slab_buffers", b.slab_buffer_bytes),
                ("reserve", b.reserve_bytes),
                ("templates", b.template_bytes),
            ] {
                ConstGauge::new(v as i64).encode(m.encode_family(&[("part", part)])?)?;
            }
            let m = e.encode_descriptor(
                "device_memory_used",
                "Device memory in use (all allocations of the worker's context), sampled at most once a second by the step loop.",
                Some(&Unit::Bytes),
                MetricType::Gauge,
            )?;
            ConstGauge::new(get(&s.device_used_bytes) as i64).encode(m)?;
        }
        Ok(())
    }
}
