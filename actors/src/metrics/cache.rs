//! The host tier of the template cache, as the cache process counts it: the same
//! families as the denoise workers' device tier (`tier="device"`), with `tier="host"`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use prometheus_client::metrics::family::Family;

type Tier = [(&'static str, &'static str); 1];
const HOST: Tier = [("tier", "host")];

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
        let _ = m.hits.get_or_create(&HOST);
        let _ = m.misses.get_or_create(&HOST);
        let _ = m.evictions.get_or_create(&HOST);
        let _ = m.loaded.get_or_create(&HOST);
        m.set_held(0, 0);
        m
    }

    /// The templates held now, and their bytes.
    pub fn set_held(&self, entries: usize, bytes: u64) {
        self.entries.get_or_create(&HOST).set(entries as i64);
        self.bytes.get_or_create(&HOST).set(bytes as i64);
    }

    /// A lookup for an edit: found or not.
    pub fn lookup(&self, found: bool) {
        let c = if found { &self.hits } else { &self.misses };
        c.get_or_create(&HOST).inc();
    }

    /// A template of `bytes` stored.
    pub fn loaded(&self, bytes: u64) {
        self.loaded.get_or_create(&HOST).inc_by(bytes);
    }
}
