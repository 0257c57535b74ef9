//! Reading request bodies: every body is read as bytes and parsed here, so that even a
//! malformed body or one over `[server] max_body_bytes` gets the API's JSON error.

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Request};
use axum::http::{header, StatusCode};
use base64::Engine;

use super::error::{ApiError, ApiResult};
use crate::router::state::Ctx;

/// Reads a request body, mapping the size limit and transport errors to JSON errors.
pub(crate) async fn body(ctx: &Ctx, req: Request) -> ApiResult<Bytes> {
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

pub(crate) fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))
}

pub(crate) fn b64(field: &str, s: &str) -> ApiResult<Vec<u8>> {
    // No URL is ever fetched on input: the daemon does not reach out on a client's word.
    let lower = s.trim_start().get(..8).unwrap_or("").to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(ApiError::bad(format!(
            "{field}: a URL is not fetched (the daemon reaches no address a client names); send the image's bytes, base64 or as a data URL"
        )));
    }
    // Accept data URLs too (`data:image/png;base64,...`).
    let s = s.split_once(";base64,").map_or(s, |(_, d)| d);
    base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map_err(|e| ApiError::bad(format!("{field}: invalid base64: {e}")))
}

/// A multipart body's parts: those named in `files` as bytes, the others as text, in
/// order. Size and transport errors get the API's JSON errors.
pub(crate) async fn read_multipart(
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
