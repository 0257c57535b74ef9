//! The HTTP API (axum) of the router process. docs/api.md documents it and
//! docs/openapi.json describes it (served at `/openapi.json`).
//!
//! Every error is JSON, `{"error": {"code", "message"}}`, with the matching status:
//! bad input 400, unknown template or job 404, cancelled 409, too large 413, workers
//! not up 503. Bodies are read as bytes and parsed here, so that even a malformed body
//! or one over the size limit gets that shape. (The OpenAI-compatible routes answer in
//! OpenAI's error shape instead: `super::openai`.)

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

use super::adapters::{resolve, LoraRef};
use super::flow::{self, Ctx, TemplateInput};
use super::jobs::{job_name, parse_job_name, Status};
use crate::wire::{ErrorKind, WireError};

const OPENAPI: &str = include_str!("../../../docs/openapi.json");

/// A JSON error response.
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    pub(super) fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    pub(super) fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl From<WireError> for ApiError {
    fn from(e: WireError) -> Self {
        let (status, code) = match e.kind {
            ErrorKind::BadInput => (StatusCode::BAD_REQUEST, "bad_request"),
            ErrorKind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::Cancelled => (StatusCode::CONFLICT, "cancelled"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::WorkerLost | ErrorKind::Unavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ErrorKind::Overloaded => (StatusCode::TOO_MANY_REQUESTS, "overloaded"),
            ErrorKind::Timeout => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        };
        ApiError::new(status, code, e.message)
    }
}

/// An error response's class, for the metrics (see [`observe`]).
#[derive(Clone, Copy)]
pub(super) struct ErrorClass(pub(super) &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        let mut r = (self.status, Json(body)).into_response();
        r.extensions_mut().insert(ErrorClass(self.code));
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(super::admission::RETRY_AFTER_S),
            );
        }
        r
    }
}

pub(super) type ApiResult<T = Response> = Result<T, ApiError>;

pub fn app(ctx: Arc<Ctx>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(
            "/openapi.json",
            get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
        )
        .route("/v1/templates", get(list_templates).post(create_template))
        .route(
            "/v1/templates/{id}",
            get(get_template).delete(delete_template),
        )
        .route("/v1/edits", axum::routing::post(super::edits::create_edit))
        .route(
            "/v1/adapters",
            get(super::adapters::list).post(super::adapters::upload),
        )
        .route(
            "/v1/generations",
            axum::routing::post(super::generations::create_generation),
        )
        .route(
            "/v1/images/generations",
            axum::routing::post(super::generations::images_generations),
        )
        .route(
            "/v1/images/edits",
            axum::routing::post(super::openai::images_edits),
        )
        .route("/v1/jobs/{id}", get(get_job).delete(cancel_job))
        .route(
            "/admin/routing",
            get(super::admin::get_routing).put(super::admin::put_routing),
        )
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed on this route",
            )
        })
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
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

/// The header that carries a request's id (its job name), on the responses of the
/// routes that create one; log lines of every process name the request by it.
pub const REQUEST_ID: &str = "x-request-id";

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

/// `GET /metrics`: every process's metrics (docs/metrics.md), as OpenMetrics when the
/// scraper asks for it (Prometheus does), else in the Prometheus text format.
async fn metrics(State(ctx): State<Arc<Ctx>>, req: Request) -> Response {
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

/// Runs a request's flow on its own task, inside its span (so every log line of it
/// names the request), and sets the request id header on what `respond` makes of it.
pub(super) fn spawn_request<T: Send + 'static>(
    job: u64,
    run: impl std::future::Future<Output = Result<T, WireError>> + Send + 'static,
) -> tokio::task::JoinHandle<Result<T, WireError>> {
    use tracing::Instrument;
    let worker = crate::logging::worker();
    tokio::spawn(run.instrument(tracing::info_span!("request", id = %job_name(job), %worker)))
}

pub(super) fn with_id(job: u64, mut r: Response) -> Response {
    if let Ok(v) = header::HeaderValue::from_str(&job_name(job)) {
        r.headers_mut().insert(REQUEST_ID, v);
    }
    r
}

/// Compares in time independent of where the inputs differ (token checks).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn readyz(State(ctx): State<Arc<Ctx>>) -> Response {
    let groups = ctx.ready();
    let draining = ctx.admission.is_draining();
    let ready = !draining && groups.iter().all(|(_, have, want)| have >= want);
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
    let failed = crate::supervisor::Status::read(&ctx.status_file).failed;
    let mut body = json!({"ready": ready, "workers": detail, "processes": processes});
    if draining {
        body["draining"] = json!(true);
    }
    if !failed.is_empty() {
        body["failed"] = json!(failed);
    }
    (status, Json(body)).into_response()
}

/// Reads a request body, mapping the size limit and transport errors to JSON errors.
pub(super) async fn body(ctx: &Ctx, req: Request) -> ApiResult<Bytes> {
    let limit = ctx.config.server.max_body_bytes;
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        if len > limit {
            // Read (and drop) a moderately oversized body before answering: a client
            // still sending it would otherwise see the connection close under its
            // upload instead of our 413. Far larger bodies are cut off at once.
            if len <= limit.saturating_mul(8) {
                let mut b = req.into_body();
                while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut b).await {}
            }
            return Err(too_large(len, limit));
        }
    }
    Bytes::from_request(req, &())
        .await
        .map_err(|e| match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => too_large(0, limit),
            s => ApiError::new(s, "bad_request", e.body_text()),
        })
}

fn too_large(len: usize, limit: usize) -> ApiError {
    let got = if len > 0 {
        format!("{len} bytes")
    } else {
        "the body".to_string()
    };
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        format!("{got} exceeds the limit of {limit} bytes ([server] max_body_bytes)"),
    )
}

pub(super) fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))
}

pub(super) fn b64(field: &str, s: &str) -> ApiResult<Vec<u8>> {
    // Accept data URLs too (`data:image/png;base64,...`).
    let s = s.split_once(";base64,").map_or(s, |(_, d)| d);
    base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map_err(|e| ApiError::bad(format!("{field}: invalid base64: {e}")))
}

pub(super) fn encode_b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

pub(super) fn check_steps(ctx: &Ctx, steps: Option<u32>) -> ApiResult<()> {
    let max = ctx.config.server.max_steps as u32;
    match steps {
        Some(s) if s == 0 || s > max => {
            Err(ApiError::bad(format!("steps {s} out of range 1..={max}")))
        }
        _ => Ok(()),
    }
}

pub(super) fn check_guidance(g: Option<f32>) -> ApiResult<()> {
    match g {
        Some(g) if !(g.is_finite() && (0.0..=100.0).contains(&g)) => {
            Err(ApiError::bad(format!("guidance {g} out of range 0..=100")))
        }
        _ => Ok(()),
    }
}

pub(super) fn check_seq_len(n: u32) -> ApiResult<()> {
    if n == 0 || n > 512 {
        return Err(ApiError::bad(format!(
            "max_sequence_length {n} out of range 1..=512"
        )));
    }
    Ok(())
}

pub(super) fn default_seq_len() -> u32 {
    512
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateBody {
    image: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    prompt: String,
    steps: Option<u32>,
    guidance: Option<f32>,
    #[serde(default)]
    seed: u64,
    #[serde(default = "default_seq_len")]
    max_sequence_length: u32,
    #[serde(default, rename = "async")]
    run_async: bool,
    /// Replace a template of the same id (409 without it).
    #[serde(default)]
    replace: bool,
    /// `kv` or `y`; the default is `[cache] mode`.
    #[serde(default)]
    cache_mode: Option<String>,
    #[serde(default)]
    loras: Vec<LoraRef>,
}

/// `POST /v1/templates`: JSON with a base64 image, or multipart with an `image` file
/// and the other fields as text parts.
async fn create_template(State(ctx): State<Arc<Ctx>>, req: Request) -> ApiResult {
    let permit = super::submit::admit(&ctx)?;
    let is_multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let (image, b) = if is_multipart {
        multipart_template(&ctx, req).await?
    } else {
        let b: TemplateBody = parse(&body(&ctx, req).await?)?;
        (b64("image", &b.image)?, b)
    };
    check_steps(&ctx, b.steps)?;
    check_guidance(b.guidance)?;
    check_seq_len(b.max_sequence_length)?;
    let id = match b.id {
        Some(id) => {
            if id.is_empty()
                || id.len() > 64
                || !id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(ApiError::bad(format!(
                    "template id `{id}`: use 1-64 characters of [A-Za-z0-9_-]"
                )));
            }
            // Checked before the capture runs (the cache checks again when storing, so
            // two registrations racing for one id cannot both win).
            if !b.replace && ctx.template(&id).await.is_ok() {
                return Err(ApiError::from(flow::exists(&id)));
            }
            id
        }
        None => format!("tpl_{:016x}", ctx.next_job()),
    };
    let cache_mode = b
        .cache_mode
        .as_deref()
        .unwrap_or(&ctx.config.cache.mode)
        .parse()
        .map_err(ApiError::bad)?;
    let input = TemplateInput {
        id,
        image,
        prompt: b.prompt,
        steps: b.steps.unwrap_or(28),
        guidance: b.guidance.unwrap_or(30.0),
        seed: b.seed,
        max_sequence_length: b.max_sequence_length,
        replace: b.replace,
        cache_mode,
        step_stride: ctx.config.cache.kv_step_stride,
        loras: resolve(&ctx, &b.loras, true)?,
    };
    let steps = input.steps;
    let super::submit::Submitted { job, task } = super::submit::submit(
        &ctx,
        permit,
        "template",
        steps,
        move |ctx, job| async move { flow::capture(&ctx, job, &input).await },
        |_, info| json!(info),
    );
    if b.run_async {
        return Ok(accepted(job));
    }
    match joined(task).await {
        Ok(info) => Ok(with_id(
            job,
            (StatusCode::CREATED, Json(json!(info))).into_response(),
        )),
        Err(e) => Ok(with_id(job, e.into_response())),
    }
}

/// A multipart body's parts: those named in `files` as bytes, the others as text, in
/// order. Size and transport errors get the API's JSON errors.
pub(super) async fn read_multipart(
    ctx: &Ctx,
    req: Request,
    files: &[&str],
) -> ApiResult<(Vec<(String, Vec<u8>)>, Vec<(String, String)>)> {
    let mut mp = Multipart::from_request(req, &())
        .await
        .map_err(|e| ApiError::bad(format!("multipart: {}", e.body_text())))?;
    let (mut bin, mut text) = (Vec::new(), Vec::new());
    let limit = ctx.config.server.max_body_bytes;
    while let Some(field) = mp
        .next_field()
        .await
        .map_err(|e| ApiError::bad(format!("multipart: {e}")))?
    {
        let name = field.name().unwrap_or_default().to_string();
        let data = field.bytes().await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large(0, limit)
            } else {
                ApiError::bad(format!("multipart field `{name}`: {e}"))
            }
        })?;
        if files.contains(&name.as_str()) {
            bin.push((name, data.to_vec()));
        } else {
            text.push((name, String::from_utf8_lossy(&data).to_string()));
        }
    }
    Ok((bin, text))
}

async fn multipart_template(ctx: &Ctx, req: Request) -> ApiResult<(Vec<u8>, TemplateBody)> {
    let (bin, text) = read_multipart(ctx, req, &["image"]).await?;
    let mut fields = serde_json::Map::new();
    for (name, text) in text {
        let v = match name.as_str() {
            "prompt" | "id" | "cache_mode" => Value::String(text),
            "async" | "replace" => Value::Bool(text == "true" || text == "1"),
            _ => serde_json::from_str(&text).unwrap_or(Value::String(text)),
        };
        fields.insert(name, v);
    }
    let image = bin
        .into_iter()
        .next()
        .map(|(_, b)| b)
        .ok_or_else(|| ApiError::bad("multipart: no `image` part"))?;
    fields.insert("image".into(), Value::String(String::new()));
    let b: TemplateBody = serde_json::from_value(Value::Object(fields))
        .map_err(|e| ApiError::bad(format!("multipart fields: {e}")))?;
    Ok((image, b))
}

/// Awaits a request's task. Requests run on their own task so that a client that
/// disconnects does not cancel the flow half-way (which would strand its job and its
/// shared-memory slices); the flow finishes and cleans up either way.
pub(super) async fn joined<T>(task: tokio::task::JoinHandle<Result<T, WireError>>) -> ApiResult<T> {
    match task.await {
        Ok(r) => r.map_err(ApiError::from),
        Err(e) => Err(ApiError::from(WireError::internal(format!(
            "request task failed: {e}"
        )))),
    }
}

pub(super) fn accepted(job: u64) -> Response {
    let id = job_name(job);
    let r = (
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/v1/jobs/{id}"))],
        Json(json!({"id": id, "status": "queued", "url": format!("/v1/jobs/{id}")})),
    )
        .into_response();
    with_id(job, r)
}

async fn list_templates(State(ctx): State<Arc<Ctx>>) -> ApiResult {
    let list = ctx.templates().await?;
    Ok(Json(json!({"templates": list})).into_response())
}

async fn get_template(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(json!(ctx.template(&id).await?.info)).into_response())
}

async fn delete_template(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(json!(ctx.delete_template(&id).await?)).into_response())
}

fn job_id(s: &str) -> ApiResult<u64> {
    parse_job_name(s).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("unknown job `{s}`"),
        )
    })
}

async fn get_job(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let job = job_id(&id)?;
    let Some(view) = ctx.jobs.get(job).await else {
        if ctx.lost_jobs.as_ref().is_some_and(|r| r.contains(&job)) {
            // A job of a router that died: whatever it was doing is gone.
            let e = ApiError::from(WireError::new(
                ErrorKind::Unavailable,
                "the router restarted while this job ran (or after it ended), and the job was lost with it: submit it again",
            ));
            let v = json!({"id": id, "status": "failed", "error": {"code": e.code, "message": e.message}});
            return Ok(Json(v).into_response());
        }
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("unknown job `{id}`"),
        ));
    };
    let mut v = json!(view);
    if let Some(e) = view.error {
        let e = ApiError::from(e);
        v["error"] = json!({"code": e.code, "message": e.message});
    }
    Ok(Json(v).into_response())
}

/// `DELETE /v1/jobs/{id}`: cancels a running job (it stops at the next step boundary).
async fn cancel_job(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let job = job_id(&id)?;
    let (before, worker) = ctx.jobs.cancel(job).await.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("unknown job `{id}`"),
        )
    })?;
    if before.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "job `{id}` already {}",
                json!(before).as_str().unwrap_or("finished")
            ),
        ));
    }
    if let (Status::Denoising, Some(w)) = (before, worker) {
        crate::node::tell(&w, crate::wire::DenoiseMsg::Cancel(crate::wire::Wire(job)));
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"id": id, "status": "cancelling"})),
    )
        .into_response())
}
