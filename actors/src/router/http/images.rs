//! OpenAI's output options on the `/v1/images` routes (`output_format`,
//! `output_compression`, `response_format`), and `GET /v1/images/{id}`, which serves
//! the images a `response_format: "url"` reply points at (the router's image store,
//! `crate::router::state::images`).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, ApiResult, ErrorBody};
use super::inputs::check_compression;
use crate::router::service::encode_b64;
use crate::router::state::Ctx;
use crate::wire::ImageFormat;

/// How a request's images come back, by OpenAI's fields.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Output {
    pub format: ImageFormat,
    /// `output_compression` (0-100): a JPEG's or WebP's quality.
    pub compression: Option<u8>,
    /// `response_format: "url"`: URLs to the store instead of base64.
    pub url: bool,
}

impl Output {
    /// OpenAI's `output_format` (`png`, `jpeg`, `webp`; default `png`),
    /// `output_compression` and `response_format` (`b64_json` or `url`).
    pub(crate) fn of(
        format: Option<&str>,
        compression: Option<u8>,
        response_format: Option<&str>,
    ) -> ApiResult<Output> {
        let format = match format.unwrap_or("png") {
            "png" => ImageFormat::Png,
            "jpeg" | "jpg" => ImageFormat::Jpeg,
            "webp" => ImageFormat::Webp,
            other => {
                return Err(ApiError::bad(format!(
                    "`output_format`: {other:?} is not png, jpeg or webp"
                )))
            }
        };
        check_compression(compression)?;
        let url = match response_format.unwrap_or("b64_json") {
            "b64_json" => false,
            "url" => true,
            other => {
                return Err(ApiError::bad(format!(
                    "`response_format`: {other:?} is not b64_json or url"
                )))
            }
        };
        Ok(Output {
            format,
            compression,
            url,
        })
    }

    /// One image as OpenAI's `data` entry has it: `(b64_json, url)`, one of them.
    pub(crate) fn entry(
        &self,
        ctx: &Ctx,
        base: &str,
        image: &[u8],
    ) -> ApiResult<(Option<String>, Option<String>)> {
        if !self.url {
            return Ok((Some(encode_b64(image)), None));
        }
        let id = ctx.images.put(image.to_vec(), self.format).ok_or_else(|| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                "the image is larger than [server] image_store_bytes: ask for b64_json",
            )
        })?;
        Ok((None, Some(format!("{base}/v1/images/{id}"))))
    }
}

/// The base of this daemon's URLs for a request: `[server] public_url`, else the
/// scheme a proxy forwarded (`X-Forwarded-Proto`, else `http`) and the `Host`.
pub(crate) fn base_url(ctx: &Ctx, headers: &HeaderMap) -> String {
    let public = ctx.config.server.public_url.trim_end_matches('/');
    if !public.is_empty() {
        return public.to_string();
    }
    let get = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let scheme = get("x-forwarded-proto").unwrap_or("http");
    let host = get(header::HOST.as_str()).unwrap_or("localhost");
    format!("{scheme}://{host}")
}

/// An image a `response_format: "url"` reply gave, while it is kept.
#[utoipa::path(get, path = "/v1/images/{id}", tag = "openai",
    params(("id" = String, Path, description = "The image's id (`img_<16 hex>`), from a reply's `url`.")),
    responses(
        (status = 200, description = "The image's bytes.",
            content((Vec<u8> = "image/png"), (Vec<u8> = "image/jpeg"), (Vec<u8> = "image/webp"))),
        (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown, or expired (`[server] image_url_ttl_seconds`).", body = ErrorBody),
    ))]
pub(crate) async fn get_image(State(ctx): State<Arc<Ctx>>, Path(id): Path<String>) -> ApiResult {
    let s = ctx.images.get(&id).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no image `{id}`: unknown, or expired (kept [server] image_url_ttl_seconds)"),
        )
    })?;
    let r: Response = (
        StatusCode::OK,
        [(header::CONTENT_TYPE, s.format.mime())],
        s.bytes.as_ref().clone(),
    )
        .into_response();
    Ok(r)
}
