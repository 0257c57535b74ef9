//! The `Idempotency-Key` header on the POSTs that start work (edits, generations,
//! template captures, OpenAI's images): the first request with a key runs; the same
//! request again (same route and body) within `[server] idempotency_window_seconds`
//! gets the first one's reply (or, when that was too large to keep, its job as `GET
//! /v1/jobs/{id}` shows it), marked `Idempotent-Replayed: true`; the key with another
//! request is a 409, and so is a second request while the first is being answered.
//! The table is the router's state (`crate::router::state::idempotency`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::error::{ApiError, ApiResult};
use super::extract::body;
use super::respond::REQUEST_ID;
use crate::daemon::{parse_job_name, unix_now};
use crate::router::state::idempotency::{Entry, Found, Reply};
use crate::router::state::Ctx;

/// The header a client sends (Stripe's and the IETF draft's name).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The header on a replayed reply.
pub const REPLAYED: &str = "idempotent-replayed";

/// The routes whose POSTs start work.
pub(crate) const WORK: [&str; 5] = [
    "/v1/edits",
    "/v1/generations",
    "/v1/templates",
    "/v1/images/edits",
    "/v1/images/generations",
];

/// The layer: requests without a key (or not starting work) pass through untouched.
pub(crate) async fn idempotent(State(ctx): State<Arc<Ctx>>, req: Request, next: Next) -> Response {
    let key = req
        .headers()
        .get(IDEMPOTENCY_KEY)
        .map(|v| v.to_str().map(str::to_string));
    let starts_work = req.method() == Method::POST && WORK.contains(&req.uri().path());
    match key {
        Some(key) if starts_work => with_key(ctx, key.ok(), req, next)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        _ => next.run(req).await,
    }
}

async fn with_key(ctx: Arc<Ctx>, key: Option<String>, req: Request, next: Next) -> ApiResult {
    let key = key
        .filter(|k| (1..=255).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| ApiError::bad("`Idempotency-Key` must be 1-255 visible ASCII characters"))?;
    let (parts, b) = req.into_parts();
    let bytes = body(&ctx, Request::from_parts(parts.clone(), b)).await?;
    let digest = digest(&parts, &bytes).await;
    let now = unix_now();
    match ctx.keys.begin(&key, &digest, now) {
        Found::Mismatch => Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("`Idempotency-Key` {key:?} was used with another request (route or body): use a new key for a new request"),
        )),
        Found::InFlight => Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("a request with `Idempotency-Key` {key:?} is still being answered: retry when it has been"),
        )),
        Found::Replay(e) => Ok(replayed(&ctx, e).await),
        Found::New => {
            // On a task of its own, so that a client that goes away (the one that will
            // retry) does not stop the key from being recorded with its reply.
            let req = Request::from_parts(parts, Body::from(bytes));
            let run = tokio::spawn(async move {
                let r = next.run(req).await;
                first(&ctx, key, digest, now, r).await
            });
            run.await
                .map_err(|e| ApiError::internal(format!("the request's task failed: {e}")))
        }
    }
}

/// The key's record of a first reply: the job it started (its `x-request-id`), and the
/// reply itself unless it is a stream. A reply that started no job (refused before)
/// frees the key.
async fn first(ctx: &Ctx, key: String, digest: String, now: f64, r: Response) -> Response {
    let job = r
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_job_name);
    let Some(job) = job else {
        ctx.keys.release(&key);
        return r;
    };
    let content_type = r
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut entry = Entry {
        key,
        digest,
        job,
        created_unix: now,
        reply: None,
    };
    if content_type.starts_with("text/event-stream") {
        // A stream is not kept: a replay is the job, whose events are at its URL.
        record(ctx, entry);
        return r;
    }
    let (parts, b) = r.into_parts();
    let Ok(bytes) = axum::body::to_bytes(b, usize::MAX).await else {
        record(ctx, entry);
        return ApiError::internal("the reply could not be read back").into_response();
    };
    let headers = parts
        .headers
        .iter()
        .filter(|(n, _)| kept_header(n.as_str()))
        .filter_map(|(n, v)| Some((n.to_string(), v.to_str().ok()?.to_string())))
        .collect();
    entry.reply = Some(Reply {
        status: parts.status.as_u16(),
        content_type,
        headers,
        body: bytes.to_vec(),
    });
    record(ctx, entry);
    Response::from_parts(parts, Body::from(bytes))
}

fn record(ctx: &Ctx, e: Entry) {
    if let Err(err) = ctx.keys.record(e) {
        // The reply still goes: the key then holds only until this router ends.
        tracing::warn!("recording an idempotency key: {err}");
    }
}

fn kept_header(name: &str) -> bool {
    name == REQUEST_ID || name == "location" || name.starts_with("x-denoised-")
}

/// The first reply again, or the first request's job as `GET /v1/jobs/{id}` shows it.
async fn replayed(ctx: &Ctx, e: Entry) -> Response {
    let mut r = match e.reply {
        Some(reply) => {
            let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
            let mut r = (status, reply.body).into_response();
            let h = r.headers_mut();
            let headers = std::iter::once(("content-type".to_string(), reply.content_type))
                .chain(reply.headers);
            for (n, v) in headers {
                if let (Ok(n), Ok(v)) = (HeaderName::try_from(n), HeaderValue::try_from(v)) {
                    h.insert(n, v);
                }
            }
            r
        }
        None => super::jobs::describe(ctx, e.job)
            .await
            .map(|r| super::respond::with_id(e.job, r))
            .unwrap_or_else(IntoResponse::into_response),
    };
    r.headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    r
}

/// SHA-256 of the route and the body; of a multipart body, of its parts' names and
/// bytes (each client draws its own boundary, so a retried upload's bytes differ).
async fn digest(parts: &axum::http::request::Parts, bytes: &axum::body::Bytes) -> String {
    let mut h = Sha256::new();
    h.update(parts.uri.path().as_bytes());
    h.update([0]);
    let multipart = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("multipart/form-data"));
    let mut whole = true;
    if multipart {
        let req = Request::from_parts(parts.clone(), Body::from(bytes.clone()));
        if let Ok(mut mp) = Multipart::from_request(req, &()).await {
            let mut fields = Sha256::new();
            let mut ok = true;
            loop {
                match mp.next_field().await {
                    Ok(Some(f)) => {
                        let name = f.name().unwrap_or_default().to_string();
                        let Ok(data) = f.bytes().await else {
                            ok = false;
                            break;
                        };
                        for part in [name.as_bytes(), &data] {
                            fields.update((part.len() as u64).to_le_bytes());
                            fields.update(part);
                        }
                    }
                    Ok(None) => break,
                    Err(_) => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                h.update(fields.finalize());
                whole = false;
            }
        }
    }
    if whole {
        h.update(bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}
