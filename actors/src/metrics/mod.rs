//! Metrics: one recipe for every process (docs/metrics.md lists every metric).
//!
//! Each process keeps its metrics in a prometheus-client [`Registry`] whose every
//! sample carries the process's `worker` and `role` labels. The router serves
//! `GET /metrics`: it encodes its own registry and gathers every other process's on
//! scrape (each registers a [`actor::MetricsActor`] in [`crate::wire::groups::METRICS`]),
//! then merges the expositions family by family ([`merge`]), so that a metric reported
//! by several processes is one family with one sample set per process. A process that
//! does not answer within the scrape deadline is left out of that scrape (its counters
//! continue where they were at the next one).
//!
//! Names start with `denoised_` and carry their unit (prometheus-client appends the unit
//! and `_total` for counters). Histogram buckets are the named constants below.

pub mod actor;
pub mod cache;
pub mod controlnet;
pub mod denoise;
pub mod router;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

/// Request and stage latencies, seconds: 10 ms to 10 minutes (a 28-step FLUX edit on a
/// CPU takes minutes, on a GPU about a second).
pub const LATENCY_SECONDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0, 600.0,
];
/// One denoising step, seconds: 1 ms (a tiny model) to 60 s (a big batch on a CPU).
pub const STEP_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// A step's wait for template loads, seconds: 0 (hidden behind compute) to 10 s.
pub const BUBBLE_SECONDS: &[f64] = &[
    0.0, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];
/// Blocks a step computes in full (FLUX.1 has 57).
pub const FULL_BLOCKS: &[f64] = &[0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];
/// Requests in a step's batch.
pub const BATCH_REQUESTS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0];
/// Token rows a step computes (text plus active image tokens of every request).
pub const BATCH_TOKENS: &[f64] = &[
    64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
];
/// A routing decision, seconds: 1 µs to 10 ms (the policies take microseconds).
pub const DECISION_SECONDS: &[f64] = &[1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 1e-3, 1e-2];
/// Shares: the mask ratio of an edit (the traces' means are 0.11 and 0.19).
pub const RATIO: &[f64] = &[0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0];

/// The template cache's families, `(name, help)`: one meaning each, reported with a
/// `tier` label by the cache process (host, disk) and by each denoise worker
/// (device). The names take their unit (`_bytes`) and counters `_total` when encoded.
pub mod template_cache {
    pub const ENTRIES: (&str, &str) = (
        "template_cache_entries",
        "Templates held in a tier of the template cache",
    );
    pub const BYTES: (&str, &str) = (
        "template_cache",
        "Bytes of the templates held in a tier of the template cache",
    );
    pub const HITS: (&str, &str) = (
        "template_cache_hits",
        "Uses of a template found in the tier",
    );
    pub const MISSES: (&str, &str) = (
        "template_cache_misses",
        "Uses of a template not in the tier (then loaded into it, or streamed)",
    );
    pub const EVICTIONS: (&str, &str) = (
        "template_cache_evictions",
        "Templates evicted from the tier to make room",
    );
    pub const LOADED: (&str, &str) = ("template_cache_loaded", "Bytes loaded into the tier");
}

/// A process's registry, labelled with the process.
pub struct ProcessRegistry {
    registry: Registry,
    /// This process's shared-memory arena: bytes in use, and its capacity.
    shm_used: Gauge<i64>,
    shm_capacity: Gauge<i64>,
}

impl ProcessRegistry {
    /// The registry of process `worker` (e.g. `denoise0`) of `role`.
    pub fn new(worker: &str, role: &str) -> Self {
        let labels = [
            (Cow::Borrowed("worker"), Cow::Owned(worker.to_string())),
            (Cow::Borrowed("role"), Cow::Owned(role.to_string())),
        ];
        let mut registry = Registry::with_prefix_and_labels("denoised", labels.into_iter());
        let (shm_used, shm_capacity) = (Gauge::default(), Gauge::default());
        registry.register_with_unit(
            "shm_arena_used",
            "Bytes of this process's shared-memory arena in use",
            Unit::Bytes,
            shm_used.clone(),
        );
        registry.register_with_unit(
            "shm_arena_capacity",
            "Bytes of this process's shared-memory arena",
            Unit::Bytes,
            shm_capacity.clone(),
        );
        ProcessRegistry {
            registry,
            shm_used,
            shm_capacity,
        }
    }

    /// Where role-specific metrics register.
    pub fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The exposition of this process's metrics (without `# EOF`), after updating
    /// what is read at scrape time: the arena's use.
    pub fn encode(&self, shm_used: u64, shm_capacity: u64) -> String {
        self.shm_used.set(shm_used as i64);
        self.shm_capacity.set(shm_capacity as i64);
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &self.registry);
        out
    }
}

/// A registry shared between the code that records and the actor that encodes.
pub type Shared = Arc<ProcessRegistry>;

/// Merges OpenMetrics expositions (each one process's, without `# EOF`) into one:
/// every family once, with its descriptor from the first exposition that has it and
/// the samples of all of them, then `# EOF`. Families keep the order in which they are
/// first seen; within an exposition a family's samples follow its descriptor lines,
/// which is how the text encoder writes them.
pub fn merge<'a>(expositions: impl IntoIterator<Item = &'a str>) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: BTreeMap<String, (Vec<&'a str>, Vec<&'a str>)> = BTreeMap::new();
    for text in expositions {
        let mut current: Option<String> = None;
        for line in text.lines() {
            if line.is_empty() || line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# ") {
                // `# HELP name ...`, `# TYPE name type`, `# UNIT name unit`.
                let name = rest
                    .split_whitespace()
                    .nth(1)
                    .unwrap_or_default()
                    .to_string();
                let entry = families.entry(name.clone()).or_insert_with(|| {
                    order.push(name.clone());
                    (Vec::new(), Vec::new())
                });
                // The first exposition's descriptor of a family is kept.
                if entry.1.is_empty() && !entry.0.contains(&line) {
                    entry.0.push(line);
                }
                current = Some(name);
            } else if let Some(name) = &current {
                families
                    .get_mut(name)
                    .expect("a family is created with its descriptor")
                    .1
                    .push(line);
            }
        }
    }
    let mut out = String::new();
    for name in order {
        let (desc, samples) = &families[&name];
        for line in desc.iter().chain(samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str("# EOF\n");
    out
}

/// The content type of [`merge`]'s output.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of [`to_prometheus_text`]'s output.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// An OpenMetrics exposition in the Prometheus text format (0.0.4), for scrapers and
/// tools that do not read OpenMetrics (`promtool check metrics`, older Prometheus
/// servers): a counter family `x` is described as `x_total`, an info family `x` as the
/// gauge `x_info`, and `# UNIT` and `# EOF` lines go.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    // First pass: the type of each family.
    let mut kinds: BTreeMap<&str, &str> = BTreeMap::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                kinds.insert(name, kind);
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "]
            .iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (*p, rest)));
        let Some((prefix, rest)) = descriptor else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
        let (name, tail) = match kinds.get(name) {
            Some(&"counter") => (format!("{name}_total"), tail.to_string()),
            Some(&"info") => (
                format!("{name}_info"),
                if prefix == "# TYPE " {
                    "gauge".into()
                } else {
                    tail.to_string()
                },
            ),
            _ => (name.to_string(), tail.to_string()),
        };
        out.push_str(prefix);
        out.push_str(&name);
        out.push(' ');
        out.push_str(&tail);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::histogram::Histogram;

    fn process(worker: &str, n: u64) -> String {
        let mut p = ProcessRegistry::new(worker, "denoise");
        let c: Counter = Counter::default();
        c.inc_by(n);
        let h = Histogram::new(STEP_SECONDS.iter().copied());
        h.observe(0.02);
        p.registry().register("steps", "Steps run", c);
        p.registry()
            .register_with_unit("step_duration", "One step", Unit::Seconds, h);
        p.encode(10, 100)
    }

    #[test]
    fn merged_families_hold_every_process_once() {
        let m = merge([
            process("denoise0", 3).as_str(),
            process("denoise1", 5).as_str(),
        ]);
        // One descriptor per family, both processes' samples under it.
        assert_eq!(m.matches("# TYPE denoised_steps counter").count(), 1, "{m}");
        assert_eq!(
            m.matches("# TYPE denoised_step_duration_seconds histogram")
                .count(),
            1
        );
        assert!(
            m.contains(r#"denoised_steps_total{worker="denoise0",role="denoise"} 3"#),
            "{m}"
        );
        assert!(
            m.contains(r#"denoised_steps_total{worker="denoise1",role="denoise"} 5"#),
            "{m}"
        );
        assert!(m.contains(r#"denoised_shm_arena_used_bytes{worker="denoise1",role="denoise"} 10"#));
        // Samples follow their own family's descriptor.
        let steps = m.find("# TYPE denoised_steps counter").unwrap();
        let duration = m.find("# TYPE denoised_step_duration_seconds").unwrap();
        let sample = m.find(r#"denoised_steps_total{worker="denoise1""#).unwrap();
        assert!(
            steps < sample && (sample < duration || duration < steps),
            "{m}"
        );
        assert!(m.ends_with("# EOF\n"));
        assert_eq!(m.matches("# EOF").count(), 1);

        // The Prometheus text format names counters by their samples.
        let t = to_prometheus_text(&m);
        assert!(t.contains("# TYPE denoised_steps_total counter\n"), "{t}");
        assert!(t.contains("# HELP denoised_steps_total Steps run."), "{t}");
        assert!(t.contains("# TYPE denoised_step_duration_seconds histogram\n"));
        assert!(!t.contains("# UNIT") && !t.contains("# EOF"), "{t}");
    }
}
