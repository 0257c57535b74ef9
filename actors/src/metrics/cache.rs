//! The host and disk tiers of the template cache, as the cache process counts them:
//! the same families as the denoise workers' device tier (`tier="device"`), with
//! `tier="host"` and `tier="disk"`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

type Tier = [(&'static str, &'static str); 1];

pub const HOST: &str = "host";
pub const DISK: &str = "disk";

#[derive(Clone, Default)]
pub struct CacheMetrics {
    entries: Family<Tier, Gauge>,
    bytes: Family<Tier, Gauge>,
    hits: Family<Tier, Counter>,
    misses: Family<Tier, Counter>,
    evictions: Family<Tier, Counter>,
    loaded: Family<Tier, Counter>,
}

impl CacheMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = CacheMetrics::default();
        r.register(
            "template_cache_entries",
            "Templates held in a tier of the template cache",
            m.entries.clone(),
        );
        r.register_with_unit(
            "template_cache",
            "Bytes of the templates held in a tier of the template cache",
            Unit::Bytes,
            m.bytes.clone(),
        );
        r.register(
            "template_cache_hits",
            "Uses of a template found in the tier",
            m.hits.clone(),
        );
        r.register(
            "template_cache_misses",
            "Uses of a template not in the tier (then loaded into it, or streamed)",
            m.misses.clone(),
        );
        r.register(
            "template_cache_evictions",
            "Templates evicted from the tier to make room",
            m.evictions.clone(),
        );
        r.register_with_unit(
            "template_cache_loaded",
            "Bytes loaded into the tier",
            Unit::Bytes,
            m.loaded.clone(),
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

    /// `bytes` loaded into `tier`.
    pub fn loaded(&self, tier: &'static str, bytes: u64) {
        self.loaded.get_or_create(&[("tier", tier)]).inc_by(bytes);
    }
}
