//! The host and disk tiers of the template cache, as the cache process counts them:
//! the same families as the denoise workers' device tier (`tier="device"`), with
//! `tier="host"` and `tier="disk"`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

type Tier = [(&'static str, &'static str); 1];

pub const HOST: &str = "host";
pub const DISK: &str = "disk";

#[derive(Clone)]
pub struct CacheMetrics {
    entries: Family<Tier, Gauge>,
    bytes: Family<Tier, Gauge>,
    hits: Family<Tier, Counter>,
    misses: Family<Tier, Counter>,
    evictions: Family<Tier, Counter>,
    loaded: Family<Tier, Counter>,
    /// Reads of a template from the disk tier into the host tier.
    disk_load: Histogram,
}

impl CacheMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = CacheMetrics {
            entries: Family::default(),
            bytes: Family::default(),
            hits: Family::default(),
            misses: Family::default(),
            evictions: Family::default(),
            loaded: Family::default(),
            disk_load: Histogram::new(super::LATENCY_SECONDS.iter().copied()),
        };
        use super::template_cache::*;
        r.register(ENTRIES.0, ENTRIES.1, m.entries.clone());
        r.register_with_unit(BYTES.0, BYTES.1, Unit::Bytes, m.bytes.clone());
        r.register(HITS.0, HITS.1, m.hits.clone());
        r.register(MISSES.0, MISSES.1, m.misses.clone());
        r.register(EVICTIONS.0, EVICTIONS.1, m.evictions.clone());
        r.register_with_unit(LOADED.0, LOADED.1, Unit::Bytes, m.loaded.clone());
        r.register_with_unit(
            "template_disk_load_duration",
            "Time the cache process took to read a template (and its VAE traces) from the disk tier into memory, checksums included",
            Unit::Seconds,
            m.disk_load.clone(),
        );
        // Present from the start, so dashboards and rates have a series at zero.
        for tier in [HOST, DISK] {
            let t = [("tier", tier)];
            let _ = m.hits.get_or_create(&t);
            let _ = m.misses.get_or_create(&t);
            let _ = m.evictions.get_or_create(&t);
            let _ = m.loaded.get_or_create(&t);
            m.set_held(tier, 0, 0);
        }
        m
    }

    /// The templates a tier holds now, and their bytes.
    pub fn set_held(&self, tier: &'static str, entries: usize, bytes: u64) {
        self.entries
            .get_or_create(&[("tier", tier)])
            .set(entries as i64);
        self.bytes
            .get_or_create(&[("tier", tier)])
            .set(bytes as i64);
    }

    /// A use of a template in `tier`: found there or not.
    pub fn lookup(&self, tier: &'static str, found: bool) {
        let c = if found { &self.hits } else { &self.misses };
        c.get_or_create(&[("tier", tier)]).inc();
    }

    pub fn evicted(&self, tier: &'static str) {
        self.evictions.get_or_create(&[("tier", tier)]).inc();
    }

    /// A read from the disk tier that took `seconds` (whatever its outcome).
    pub fn disk_load(&self, seconds: f64) {
        self.disk_load.observe(seconds);
    }

    /// `bytes` loaded into `tier`.
    pub fn loaded(&self, tier: &'static str, bytes: u64) {
        self.loaded.get_or_create(&[("tier", tier)]).inc_by(bytes);
    }
}
