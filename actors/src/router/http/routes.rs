//! The router's HTTP service (axum): the route table with the layers every route goes
//! through: the bearer-token check, the metrics and the access log.
//! docs/api.md documents the API and docs/openapi.json describes it (served at
//! `/openapi.json`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;

use super::error::{ApiError, ErrorClass};
use super::respond::REQUEST_ID;
use crate::router::state::Ctx;

/// The router's HTTP service: the route table (every route registered with its
/// OpenAPI operation, [`super::openapi::table`]) behind the token check, the metrics
/// layer and the body limit.
pub fn app(ctx: Arc<Ctx>) -> Router {
    let (routes, doc) = super::openapi::table().split_for_parts();
    super::openapi::serve(doc);
    routes
        // The playground page: public static files, not part of the API's document.
        .merge(super::page::router())
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed on this route",
            )
        })
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        // After the token check: a key is looked at only for an authorised request.
        .layer(middleware::from_fn_with_state(
            ctx.clone(),
            super::idempotency::idempotent,
        ))
        .layer(middleware::from_fn_with_state(ctx.clone(), auth))
        .layer(middleware::from_fn_with_state(ctx.clone(), observe))
        // Our own limit check (in `body`) gives the JSON error; axum's default 2 MiB
        // limit is lifted to the configured one.
        .layer(axum::extract::DefaultBodyLimit::max(
            ctx.config.server.max_body_bytes,
        ))
        .with_state(ctx)
}

/// Bearer-token check for /v1 routes when `[server] api_token` is set, and for /admin
/// routes always (403 on a daemon without a token: see `super::admin`).
async fn auth(State(ctx): State<Arc<Ctx>>, req: Request, next: Next) -> Response {
    let token = &ctx.config.server.api_token;
    let admin = req.uri().path().starts_with("/admin");
    if admin && token.is_empty() {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the admin API needs an API token: set [server] api_token (DENOISED_API_TOKEN)",
        )
        .into_response();
    }
    if !token.is_empty() && (admin || req.uri().path().starts_with("/v1")) {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .is_some_and(|(scheme, t)| {
                scheme.eq_ignore_ascii_case("bearer") && same(t.trim().as_bytes(), token.as_bytes())
            });
        if !ok {
            let mut r = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token",
            )
            .into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    next.run(req).await
}

/// Counts and times every response by route and status (and errors by class), and
/// writes one access-log line per request.
async fn observe(State(ctx): State<Arc<Ctx>>, req: Request, next: Next) -> Response {
    let t0 = std::time::Instant::now();
    let method = req.method().clone();
    // The route template, not the path: ids in paths would make one series each.
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let r = next.run(req).await;
    let seconds = t0.elapsed().as_secs_f64();
    let status = r.status().as_u16();
    let m = &ctx.metrics;
    m.http_requests
        .get_or_create(&[("route", route.clone()), ("status", status.to_string())])
        .inc();
    m.http_duration
        .get_or_create(&[("route", route.clone())])
        .observe(seconds);
    if let Some(ErrorClass(class)) = r.extensions().get::<ErrorClass>() {
        m.errors.get_or_create(&[("class", class)]).inc();
    }
    let id = r
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    if route != "/metrics" && route != "/readyz" && route != "/healthz" {
        let worker = crate::logging::worker();
        tracing::info!(target: "denoised::access", %id, %worker, %method, %route, status, seconds);
    }
    r
}

/// Compares in time independent of where the inputs differ (token checks).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
