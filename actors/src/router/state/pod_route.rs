//! Which pod runs an edit of a template (docs/cluster.md): this pod's report and its
//! peers' last ones, as the pure pod router ([`crate::routing::pods`]) sees them, priced
//! with the in-pod policy's cost model (the one the simulator's study uses). The
//! decision is [`super::pods::Pods::route`]; the edit flow acts on it.

use std::hash::{Hash, Hasher};

use denoised_models::flux::cost::StepShape;
use denoised_models::profile::Tier;

use crate::routing::pods::{pod_cost_s, Held, MissPrices, PodView};
use crate::routing::{Incoming, ProfileCost, Running, StepCost, TemplateNeed, WorkerView};
use crate::wire::pods::{PodReport, PodRun, PodTemplate};

/// A template id as the pure router's key (it knows templates by number).
fn key(id: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
}

fn running(r: &PodRun) -> Running {
    Running {
        shape: StepShape {
            text: r.text as usize,
            active: r.active as usize,
            image: r.image as usize,
        },
        steps_left: r.steps_left,
    }
}

/// A pod's report as the pure router's view of it. A template in the pod's memory is
/// in every worker's host tier (the cache process is the pod's, one for all its
/// workers); the device tier is left to the in-pod policy. A template on its way is
/// priced as a whole copy (a report does not say how far the copy is).
fn view(r: &PodReport, copy_s: f64) -> PodView {
    let tier = |f: fn(&PodTemplate) -> bool| -> Vec<u64> {
        r.templates
            .iter()
            .filter(|t| f(t))
            .map(|t| key(&t.id))
            .collect()
    };
    let host = tier(|t| t.host_bytes > 0);
    PodView {
        up: true,
        workers: r
            .workers
            .iter()
            .map(|w| WorkerView {
                room: w.running.len() < w.max_batch as usize,
                running: w.running.iter().map(running).collect(),
                device_templates: vec![],
                host_templates: host.clone(),
            })
            .collect(),
        queued: r.queued.iter().map(running).collect(),
        disk_templates: tier(|t| t.disk_bytes > 0),
        fetching: r.fetching.iter().map(|id| (key(id), copy_s)).collect(),
    }
}

/// What an edit of a template needs, wherever it runs: its size in bytes, image tokens
/// and steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TemplateSize {
    pub bytes: u64,
    pub tokens: u32,
    pub steps: u32,
}

impl TemplateSize {
    /// An edit of it as a pod's queue counts it (all its tokens, as [`choose`] prices it).
    pub fn run(&self, text: u32) -> PodRun {
        PodRun {
            text,
            active: self.tokens,
            image: self.tokens,
            steps_left: self.steps,
        }
    }

    /// Its size as the reports give it (the largest copy's), if any pod holds it.
    pub fn reported<'a>(id: &str, reports: impl Iterator<Item = &'a PodReport>) -> Option<Self> {
        reports
            .flat_map(|r| r.templates.iter().filter(|t| t.id == id))
            .map(|t| TemplateSize {
                bytes: t.host_bytes.max(t.disk_bytes),
                tokens: t.tokens,
                steps: t.steps,
            })
            .max_by_key(|s| s.bytes)
    }
}

/// What prices a template's miss: the served model and the routing profile (a step, a
/// load), and the MB a second a copy between pods moves at.
#[derive(Clone)]
pub struct Pricing {
    pub model: denoised_models::flux::FluxConfig,
    pub profile: std::sync::Arc<denoised_models::profile::Profile>,
    pub copy_mb_per_s: f64,
}

impl Pricing {
    fn cost(&self) -> ProfileCost<'_> {
        ProfileCost {
            config: &self.model,
            profile: &self.profile,
        }
    }

    /// The price of a template of `size` a pod lacks, for an edit of `text` prompt
    /// tokens: a copy (the whole file at the link), or a capture again (its steps of a
    /// full-image step; never, when its recipe is not known).
    pub fn miss(&self, size: TemplateSize, text: u32, recapture: bool) -> MissPrices {
        let shape = running(&size.run(text)).shape;
        MissPrices {
            fetch_s: size.bytes as f64 / (self.copy_mb_per_s * 1e6),
            recapture_s: match recapture {
                true => size.steps as f64 * self.cost().step_s(&[shape]),
                false => f64::INFINITY,
            },
        }
    }
}

/// The pod among `pods` (this one first) that should run an edit of template `id` of
/// `size` with `text` prompt tokens, by `router`'s policy. `recapture`: whether a pod
/// lacking it may capture it again (its recipe is known), else only copies count.
///
/// The edit is priced before its mask is read (that happens in the pod that runs it),
/// as if all the template's tokens were active: the upper bound, the same on every pod.
pub fn choose(
    router: &mut crate::routing::pods::PodRouter,
    pods: &[&PodReport],
    id: &str,
    (size, text, recapture): (TemplateSize, u32, bool),
    pricing: &Pricing,
) -> Option<usize> {
    let (cost, profile) = (pricing.cost(), &pricing.profile);
    let bytes = size.bytes as f64;
    let miss = pricing.miss(size, text, recapture);
    let copy_s = miss.fetch_s;
    let shape = running(&size.run(text)).shape;
    let req = Incoming {
        shape,
        steps: size.steps,
        template: Some(TemplateNeed {
            version: key(id),
            host_load_s: profile.load_s(Tier::Host, bytes),
            disk_load_s: profile.load_s(Tier::Disk, bytes),
        }),
    };
    let views: Vec<PodView> = pods.iter().map(|r| view(r, copy_s)).collect();
    let chosen = router.choose(&views, &req, miss, &cost);
    if tracing::enabled!(tracing::Level::DEBUG) {
        // Why an edit went where it did: each pod's price as template_aware sees it.
        let holders = views
            .iter()
            .filter(|v| v.holds(req.template.map_or(0, |t| t.version)) != Held::Absent)
            .count();
        let prices: Vec<String> = pods
            .iter()
            .zip(&views)
            .map(|(r, v)| {
                let peer = holders > usize::from(v.holds(key(id)) != Held::Absent);
                let s = pod_cost_s(v, &req, peer, miss, true, &cost);
                format!("{}: {s:.4} s", r.pod)
            })
            .collect();
        tracing::debug!(
            "template `{id}`: {} -> {:?}",
            prices.join(", "),
            chosen.map(|i| &pods[i].pod)
        );
    }
    chosen
}

/// The pod among `pods` (this one first) that should run work of this shape and
/// steps that reads no template (a generation), by `router`'s policy (template_aware
/// prices it as least_loaded does).
pub fn choose_load(
    router: &mut crate::routing::pods::PodRouter,
    pods: &[&PodReport],
    run: PodRun,
    pricing: &Pricing,
) -> Option<usize> {
    let r = running(&run);
    let req = Incoming {
        shape: r.shape,
        steps: r.steps_left,
        template: None,
    };
    let views: Vec<PodView> = pods.iter().map(|r| view(r, 0.0)).collect();
    let miss = pricing.miss(TemplateSize::default(), 0, false);
    router.choose(&views, &req, miss, &pricing.cost())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::pods::{PodPolicy, PodRouter};
    use crate::wire::pods::PodWorker;
    use denoised_models::flux::FluxConfig;
    use denoised_models::profile::Profile;

    fn pod(name: &str, templates: &[(&str, u64)], busy: usize) -> PodReport {
        let run = PodRun {
            text: 32,
            active: 256,
            image: 256,
            steps_left: 28,
        };
        PodReport {
            pod: name.into(),
            started_unix: 0.0,
            http: String::new(),
            ready: true,
            in_flight: busy as u32,
            limit: 64,
            templates: templates
                .iter()
                .map(|&(id, host)| PodTemplate {
                    id: id.into(),
                    version: 1,
                    host_bytes: host,
                    disk_bytes: 1 << 20,
                    tokens: 256,
                    steps: 28,
                })
                .collect(),
            listed: true,
            listing: 0,
            workers: vec![PodWorker {
                max_batch: 4,
                running: vec![run; busy.min(4)],
            }],
            queued: vec![run; busy.saturating_sub(4)],
            fetching: vec![],
        }
    }

    /// The live decision, through the reports' wire form, agrees with the pure router:
    /// an idle holder wins; a holder with a long queue loses to an idle pod that copies
    /// the template (cheap at 1250 MB/s) under template_aware; least_loaded ignores
    /// where it is; round_robin turns.
    #[test]
    fn reports_are_priced_like_the_simulator_prices_pods() {
        let pricing = Pricing {
            model: FluxConfig::named("flux-small").unwrap(),
            profile: std::sync::Arc::new(Profile::defaults("cpu")),
            copy_mb_per_s: 1250.0,
        };
        let size = TemplateSize::reported("t", [pod("a", &[("t", 1 << 20)], 0)].iter()).unwrap();
        assert_eq!(size.tokens, 256);
        let choose = |policy, pods: &[PodReport]| {
            let mut r = PodRouter::new(policy);
            let pods: Vec<&PodReport> = pods.iter().collect();
            choose(&mut r, &pods, "t", (size, 32, false), &pricing)
        };
        let me_idle = pod("me", &[], 0);
        let holder_idle = pod("a", &[("t", 1 << 20)], 0);
        let holder_busy = pod("a", &[("t", 1 << 20)], 12);
        let ta = PodPolicy::TemplateAware;
        // Idle everywhere: the holder (no copy to wait for).
        assert_eq!(choose(ta, &[me_idle.clone(), holder_idle.clone()]), Some(1));
        // The holder is 12 deep: a copy here is cheaper than its queue.
        assert_eq!(choose(ta, &[me_idle.clone(), holder_busy.clone()]), Some(0));
        // A copy priced at 1 MB/s for a 1 GB template: wait at the holder.
        let big = TemplateSize {
            bytes: 1 << 30,
            ..size
        };
        let mut r = PodRouter::new(ta);
        let slow = Pricing {
            copy_mb_per_s: 1.0,
            ..pricing.clone()
        };
        let both = [&me_idle, &holder_busy];
        assert_eq!(choose_with(&mut r, &both, big, &slow), Some(1));
        // A pod lacking it copies it, unless capturing it again costs less: a 1 MB
        // template at 1250 MB/s copies in 0.8 ms; at 0.001 MB/s, in 1000 s, beyond a
        // capture of its 28 steps.
        let m = pricing.miss(size, 32, true);
        assert!(m.fetch_s < 0.001 && m.fetch_s < m.recapture_s, "{m:?}");
        let crawl = Pricing {
            copy_mb_per_s: 0.001,
            ..pricing.clone()
        };
        let m = crawl.miss(size, 32, true);
        assert!(m.recapture_s < m.fetch_s, "{m:?}");
        assert_eq!(crawl.miss(size, 32, false).recapture_s, f64::INFINITY);
        // least_loaded: the idle pod even when the holder is idle too (ties: first).
        let ll = PodPolicy::LeastLoaded;
        assert_eq!(choose(ll, &[me_idle.clone(), holder_idle.clone()]), Some(0));
        // round_robin turns through them.
        let mut r = PodRouter::new(PodPolicy::RoundRobin);
        let both = [&me_idle, &holder_idle];
        let turns: Vec<_> = (0..3)
            .map(|_| choose_with(&mut r, &both, size, &pricing))
            .collect();
        assert_eq!(turns, [Some(0), Some(1), Some(0)]);
    }

    fn choose_with(
        r: &mut PodRouter,
        pods: &[&PodReport],
        size: TemplateSize,
        pricing: &Pricing,
    ) -> Option<usize> {
        choose(r, pods, "t", (size, 32, false), pricing)
    }
}
