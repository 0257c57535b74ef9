//! The router's metrics: HTTP requests by route and status, the stages of every
//! request, errors by class, the mask ratio of served edits, requests in flight, the
//! supervisor's process restarts, and the build.

use std::path::PathBuf;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::{DECISION_SECONDS, LATENCY_SECONDS, RATIO};
use crate::daemon::SupervisorStatus;
use crate::wire::StageTimings;

pub type RouteStatus = [(&'static str, String); 2];
pub type Label = [(&'static str, &'static str); 1];

#[derive(Clone)]
pub struct RouterMetrics {
    pub http_requests: Family<RouteStatus, Counter>,
    pub http_duration: Family<[(&'static str, String); 1], Histogram>,
    /// Of served edits, by stage: queue (waiting for a batch), preprocess, denoise,
    /// postprocess, and the whole request (`total`).
    pub stage: Family<Label, Histogram>,
    pub errors: Family<Label, Counter>,
    pub mask_ratio: Histogram,
    pub in_flight: Gauge,
    /// How long an edit waited for its template to come from disk after preprocessing.
    pub load_wait: Histogram,
    /// Routing to denoise workers: the policy's decision time, the wait for a worker
    /// with room, and the requests each worker was given, by policy.
    pub route_decision: Histogram,
    pub route_wait: Histogram,
    pub routed: Family<[(&'static str, String); 2], Counter>,
    /// Served edits' VAE passes, by half and pass (dense, sparse, sparse_traced).
    pub vae_passes: Family<[(&'static str, &'static str); 2], Counter>,
    /// Served edits' prompt-cache lookups in the preprocess workers, by result.
    pub prompt_cache: Family<[(&'static str, &'static str); 1], Counter>,
    /// Of served generations, by stage (as `stage` for edits).
    pub generation_stage: Family<Label, Histogram>,
    /// Served generations' approximate-cache lookups, by result (hit, miss, off), and
    /// the denoising steps the hits skipped.
    pub approx_lookups: Family<[(&'static str, &'static str); 1], Counter>,
    pub approx_skipped: Counter,
    /// Between pods (docs/cluster.md): edits forwarded to a peer, by pod and result;
    /// edits peers forwarded here; load reports received, by pod; peers seen up.
    pub pod_forwards: Family<[(&'static str, String); 2], Counter>,
    pub pod_forwarded_in: Counter,
    pub pod_reports: Family<[(&'static str, String); 1], Counter>,
    pub pods_up: Gauge,
    /// Template copies fetched from peers, by pod and result, and their bytes.
    pub pod_transfers: Family<[(&'static str, String); 2], Counter>,
    pub pod_transfer_bytes: Counter,
    /// Template edits routed between pods, by policy and the pod chosen (this one
    /// too); templates captured again from their recipes, by result; recipes kept.
    pub pod_routes: Family<[(&'static str, String); 2], Counter>,
    pub recaptures: Family<[(&'static str, &'static str); 1], Counter>,
    pub pod_recipes: Gauge,
    /// Events of forwarded edits, by direction: `out` to the pod each came from, `in`
    /// from the pod running it.
    pub pod_events: Family<[(&'static str, &'static str); 1], Counter>,
    /// Webhook tries, by outcome (`delivered`, `failed`: retried, or given up).
    pub webhooks: Family<[(&'static str, &'static str); 1], Counter>,
    /// Edits of uploaded images under `[templates] auto`, by outcome (`hit`, `miss`,
    /// `captured`).
    pub auto_templates: Family<[(&'static str, &'static str); 1], Counter>,
}

impl RouterMetrics {
    /// Registers the router's metrics in `r` (labelled with the router process), and
    /// the daemon's in `daemon` (unlabelled: the build, and the restarts of every
    /// process, read from the supervisor's status file at scrape time).
    pub fn register(r: &mut Registry, daemon: &mut Registry, status_file: PathBuf) -> Self {
        let latency = || Histogram::new(LATENCY_SECONDS.iter().copied());
        let m = RouterMetrics {
            http_requests: Family::default(),
            http_duration: Family::new_with_constructor(latency),
            stage: Family::new_with_constructor(latency),
            errors: Family::default(),
            mask_ratio: Histogram::new(RATIO.iter().copied()),
            in_flight: Gauge::default(),
            load_wait: latency(),
            route_decision: Histogram::new(DECISION_SECONDS.iter().copied()),
            route_wait: latency(),
            routed: Family::default(),
            vae_passes: Family::default(),
            prompt_cache: Family::default(),
            generation_stage: Family::new_with_constructor(latency),
            approx_lookups: Family::default(),
            approx_skipped: Counter::default(),
            pod_forwards: Family::default(),
            pod_forwarded_in: Counter::default(),
            pod_reports: Family::default(),
            pods_up: Gauge::default(),
            pod_transfers: Family::default(),
            pod_transfer_bytes: Counter::default(),
            pod_routes: Family::default(),
            recaptures: Family::default(),
            pod_recipes: Gauge::default(),
            pod_events: Family::default(),
            webhooks: Family::default(),
            auto_templates: Family::default(),
        };
        r.register(
            "auto_templates",
            "Edits of uploaded images with [templates] auto, by outcome (hit: an edit of the image's template; captured: this edit captured it; miss: a full run)",
            m.auto_templates.clone(),
        );
        r.register(
            "webhook_tries",
            "Webhook deliveries tried, by outcome (delivered: a 2xx; failed: another status or no answer, then retried until given up)",
            m.webhooks.clone(),
        );
        r.register(
            "pod_events",
            "Events of forwarded edits (status, step, preview), by direction: out (to the pod the edit came from), in (from the pod running it)",
            m.pod_events.clone(),
        );
        r.register(
            "pod_routes",
            "Template edits this router placed on a pod, by pod policy and pod (this pod's own name when it ran here)",
            m.pod_routes.clone(),
        );
        r.register(
            "template_recaptures",
            "Templates this pod captured again from their recipes (every pod that held them lost), by result (ok, error)",
            m.recaptures.clone(),
        );
        r.register(
            "pod_recipes",
            "Recipes (description and image) of its peers' templates this pod keeps, to capture them again",
            m.pod_recipes.clone(),
        );
        r.register(
            "pod_transfers",
            "Template copies this pod fetched from a peer, by pod and result (ok, error)",
            m.pod_transfers.clone(),
        );
        r.register_with_unit(
            "pod_transfer",
            "Bytes of template data this pod fetched from its peers",
            Unit::Bytes,
            m.pod_transfer_bytes.clone(),
        );
        r.register(
            "pod_forwards",
            "Edits this router forwarded whole to another pod, by pod and result (ok, error, refused: unavailable or overloaded there, tried elsewhere; lost: the pod went away)",
            m.pod_forwards.clone(),
        );
        r.register(
            "pod_forwarded_in",
            "Edits other pods forwarded to this one",
            m.pod_forwarded_in.clone(),
        );
        r.register(
            "pod_reports",
            "Reports received from each peer pod (its beats, and those asked of it)",
            m.pod_reports.clone(),
        );
        r.register(
            "pods_up",
            "Peer pods this router sees up",
            m.pods_up.clone(),
        );
        r.register(
            "http_requests",
            "HTTP requests answered, by route and status",
            m.http_requests.clone(),
        );
        r.register_with_unit(
            "http_request_duration",
            "Time from a request's arrival to its response, by route",
            Unit::Seconds,
            m.http_duration.clone(),
        );
        r.register_with_unit(
            "edit_stage_duration",
            "Time of each stage of a served edit: queue (waiting to join a denoise batch), preprocess, denoise, postprocess, total",
            Unit::Seconds,
            m.stage.clone(),
        );
        r.register(
            "errors",
            "Requests that failed, by class (bad_request, not_found, conflict, cancelled, too_large, overloaded, unavailable, timeout, internal)",
            m.errors.clone(),
        );
        r.register(
            "edit_mask_ratio",
            "Share of the image tokens a served edit computed",
            m.mask_ratio.clone(),
        );
        r.register_with_unit(
            "template_load_wait",
            "Time an edit of a template that was not in memory waited, after preprocessing, for it to come from the disk tier (its load started when the edit arrived)",
            Unit::Seconds,
            m.load_wait.clone(),
        );
        r.register_with_unit(
            "routing_decision",
            "Time the routing policy took to choose a denoise worker for a request",
            Unit::Seconds,
            m.route_decision.clone(),
        );
        r.register_with_unit(
            "routing_wait",
            "Time a request waited at the router for a denoise worker with room",
            Unit::Seconds,
            m.route_wait.clone(),
        );
        r.register(
            "routed_requests",
            "Requests sent to each denoise worker, by routing policy",
            m.routed.clone(),
        );
        r.register(
            "vae_passes",
            "VAE passes of served edits, by half (encode, decode) and pass: dense, sparse (against the template's trace), sparse_traced (after recording that trace with a dense pass)",
            m.vae_passes.clone(),
        );
        r.register(
            "prompt_cache_lookups",
            "Prompt-embedding cache lookups of served edits in the preprocess workers, by result (hit: the text encoders did not run, miss)",
            m.prompt_cache.clone(),
        );
        r.register_with_unit(
            "generation_stage_duration",
            "Time of each stage of a served text-to-image generation: queue, preprocess, denoise, postprocess, total",
            Unit::Seconds,
            m.generation_stage.clone(),
        );
        r.register(
            "approx_cache_lookups",
            "Approximate-cache lookups of served generations, by result (hit: it started from a cached noise state, miss, off: the request opted out)",
            m.approx_lookups.clone(),
        );
        r.register(
            "approx_cache_skipped_steps",
            "Denoising steps that approximate-cache hits skipped",
            m.approx_skipped.clone(),
        );
        r.register(
            "requests_in_flight",
            "Flows admitted and not yet finished (a request for n images is n flows)",
            m.in_flight.clone(),
        );
        daemon.register(
            "build",
            "The build: version and target",
            Info::new([
                ("version", env!("CARGO_PKG_VERSION")),
                ("target", std::env::consts::ARCH),
            ]),
        );
        daemon.register_collector(Box::new(Restarts(status_file)));
        m
    }
}

impl RouterMetrics {
    /// Records a routing decision: `worker` chosen by `policy` in `decision_s`, after
    /// `waited` at the router.
    pub fn observe_route(
        &self,
        worker: &str,
        policy: &str,
        decision_s: f64,
        waited: std::time::Duration,
    ) {
        self.route_decision.observe(decision_s);
        self.route_wait.observe(waited.as_secs_f64());
        self.routed
            .get_or_create(&[
                ("denoise_worker", worker.to_string()),
                ("policy", policy.to_string()),
            ])
            .inc();
    }

    /// Records a webhook try.
    pub fn webhook(&self, delivered: bool) {
        let outcome = if delivered { "delivered" } else { "failed" };
        self.webhooks.get_or_create(&[("outcome", outcome)]).inc();
    }

    /// Records a served edit: the time of each of its stages, its mask ratio
    /// (`active` of `tokens` computed), its VAE passes and its prompt-cache result.
    pub fn observe_edit(&self, t: &StageTimings, tokens: u32, active: u32) {
        observe_stages(&self.stage, t);
        if tokens > 0 {
            self.mask_ratio.observe(active as f64 / tokens as f64);
        }
        for (half, pass) in [("encode", t.vae_encode), ("decode", t.vae_decode)] {
            self.vae_passes
                .get_or_create(&[("half", half), ("pass", pass.as_str())])
                .inc();
        }
        self.prompt_cache
            .get_or_create(&[("result", t.prompt_cache.name())])
            .inc();
    }
}

/// What the approximate cache did for a generation, as its metrics count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApproxResult {
    Hit {
        skipped: u32,
    },
    Miss,
    /// The request opted out.
    Off,
}

impl RouterMetrics {
    /// Records a served generation: its stages and what the approximate cache did.
    pub fn observe_generation(&self, t: &StageTimings, approx: ApproxResult) {
        observe_stages(&self.generation_stage, t);
        let (result, skipped) = match approx {
            ApproxResult::Hit { skipped } => ("hit", skipped),
            ApproxResult::Miss => ("miss", 0),
            ApproxResult::Off => ("off", 0),
        };
        self.approx_lookups
            .get_or_create(&[("result", result)])
            .inc();
        self.approx_skipped.inc_by(skipped as u64);
    }
}

/// Each stage's time of a served request into `family`, by stage.
fn observe_stages(family: &Family<Label, Histogram>, t: &StageTimings) {
    for (stage, s) in t.stages() {
        family.get_or_create(&[("stage", stage)]).observe(s);
    }
}

/// Process restarts, as the supervisor counts them.
#[derive(Debug)]
struct Restarts(PathBuf);

impl Collector for Restarts {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = SupervisorStatus::read(&self.0);
        let mut m = e.encode_descriptor(
            "process_restarts",
            "Times the supervisor restarted a worker process, by role and worker.",
            None,
            MetricType::Counter,
        )?;
        for (worker, (role, n)) in &status.restarts {
            let labels = [("worker", worker.as_str()), ("role", role.as_str())];
            ConstCounter::new(*n).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
