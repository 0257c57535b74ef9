//! The operations routes: the liveness and readiness probes and `/metrics` (open even
//! when `[server] api_token` is set, for probes and scrapers).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use crate::router::state::Ctx;

/// The liveness probe's answer.
#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
}

/// Liveness: the router answers.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses((status = 200, body = Health)))]
pub(crate) async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

/// Readiness: every worker group has its live members, and the daemon is not
/// draining. Lists the processes and any worker slots the supervisor gave up on.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Ready.", body = Object),
        (status = 503, description = "Not ready (starting, draining, or a group short of workers).", body = Object),
    ))]
pub(crate) async fn readyz(State(ctx): State<Arc<Ctx>>) -> Response {
    let groups = ctx.ready();
    let draining = ctx.admission.is_draining();
    // With a template registry, not before this pod's templates are reconciled with it.
    let registry = ctx.template_registry();
    let reconciled = registry.is_none_or(|r| r.reconciled());
    let ready = !draining && reconciled && groups.iter().all(|(_, have, want)| have >= want);
    let detail: Value = groups
        .iter()
        .map(|(g, have, want)| (g.to_string(), json!({"live": have, "want": want})))
        .collect::<serde_json::Map<_, _>>()
        .into();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let processes: Vec<_> = ctx
        .processes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .cloned()
        .collect();
    // Worker slots the supervisor gave up restarting (crash loops), with the reason.
    let failed = crate::daemon::SupervisorStatus::read(&ctx.status_file).failed;
    // The requests admitted and not yet answered, against the limit (a 429 beyond it).
    let queue = json!({"in_flight": ctx.admission.in_flight(), "limit": ctx.admission.limit()});
    let mut body =
        json!({"ready": ready, "workers": detail, "processes": processes, "queue": queue});
    if draining {
        body["draining"] = json!(true);
    }
    if !failed.is_empty() {
        body["failed"] = json!(failed);
    }
    // A pod of a cluster: its name and the peers it sees (a peer down does not make
    // this pod unready; its edits go to the other holders of their templates).
    if let Some(pods) = &ctx.pods {
        body["pod"] = json!(pods.me);
        body["pods"] = json!(pods.status());
    }
    // Whether its reads of the registry are within their lease (edits of templates are
    // refused otherwise; the pod stays ready for the rest).
    if let Some(r) = registry {
        body["registry"] = json!({"at": r.describe(), "reconciled": reconciled,
            "confirmed": r.confirmed()});
    }
    (status, Json(body)).into_response()
}

/// Every process's metrics (docs/metrics.md), as OpenMetrics when the scraper asks for
/// it (Prometheus does), else in the Prometheus text format.
#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses((status = 200, description = "The metrics.", body = String,
        content_type = "text/plain")))]
pub(crate) async fn metrics(State(ctx): State<Arc<Ctx>>, req: Request) -> Response {
    let openmetrics = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let text = ctx.scrape(std::time::Duration::from_secs(2)).await;
    let (kind, body) = if openmetrics {
        (crate::metrics::OPENMETRICS, text)
    } else {
        (
            crate::metrics::PROMETHEUS_TEXT,
            crate::metrics::to_prometheus_text(&text),
        )
    };
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}
