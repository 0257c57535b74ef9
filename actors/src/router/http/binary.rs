//! Content negotiation of the routes that make images: by `Accept`, a reply is JSON
//! (the default) or the image's own bytes with the reply's other fields in
//! `x-denoised-*` headers (`POST /v1/edits`, `POST /v1/generations`, `GET
//! /v1/jobs/{id}`).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::wire::ImageFormat;

/// What a synchronous reply's body is, by the request's `Accept`: JSON (the default,
/// and for `*/*`), or the image's own bytes (`image/png`, `image/jpeg`, `image/webp`;
/// `image/*`: in the request's `format`). The first range it names that is one of these decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    Json,
    Image(Option<ImageFormat>),
}

impl Body {
    pub(crate) fn of(headers: &header::HeaderMap) -> Body {
        let accept = headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|r| {
                r.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        for range in accept {
            match range.as_str() {
                "application/json" | "*/*" => return Body::Json,
                "image/png" => return Body::Image(Some(ImageFormat::Png)),
                "image/jpeg" => return Body::Image(Some(ImageFormat::Jpeg)),
                "image/webp" => return Body::Image(Some(ImageFormat::Webp)),
                "image/*" => return Body::Image(None),
                _ => {}
            }
        }
        Body::Json
    }

    /// The format the image is made in: the one `Accept` names, else the request's.
    pub(crate) fn format(self, asked: ImageFormat) -> ImageFormat {
        match self {
            Body::Image(Some(f)) => f,
            _ => asked,
        }
    }

    /// The reply: `reply` as JSON, or `image` (encoded as `format`) with `reply`'s
    /// fields in `x-denoised-*` headers (a field that is an object or a list, as
    /// compact JSON).
    pub(crate) fn reply<T: Serialize>(
        self,
        reply: &T,
        image: &[u8],
        format: ImageFormat,
    ) -> Response {
        if self == Body::Json {
            return Json(reply).into_response();
        }
        let mut r = (
            StatusCode::OK,
            [(header::CONTENT_TYPE, format.mime())],
            image.to_vec(),
        )
            .into_response();
        let fields = serde_json::to_value(reply).unwrap_or_default();
        for (k, v) in fields.as_object().into_iter().flatten() {
            let value = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => continue,
                other => other.to_string(),
            };
            let name = format!("x-denoised-{}", k.replace('_', "-"));
            if let (Ok(n), Ok(v)) = (
                header::HeaderName::try_from(name),
                header::HeaderValue::from_str(&value),
            ) {
                r.headers_mut().insert(n, v);
            }
        }
        r
    }
}
