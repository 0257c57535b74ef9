//! The playground: a small static page at `GET /` (its script and style beside it)
//! to try edits in a browser. The files are compiled into the binary, so the daemon
//! stays one file and the page needs no build step.
//!
//! The page is public (it holds no data, only code that calls the API), so these
//! routes sit outside `/v1` and the token check; the API calls the page makes still
//! need the token, which the page asks for when the API answers 401. The routes are
//! not part of the API, so they are not in the OpenAPI document.

use std::sync::Arc;

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::router::state::Ctx;

const HTML: &str = include_str!("page/index.html");
const JS: &str = include_str!("page/app.js");
const CSS: &str = include_str!("page/app.css");

/// The page's routes: `/`, `/page/app.js` and `/page/app.css`.
pub fn router() -> Router<Arc<Ctx>> {
    Router::new()
        .route("/", get(|| file("text/html; charset=utf-8", HTML)))
        .route(
            "/page/app.js",
            get(|| file("text/javascript; charset=utf-8", JS)),
        )
        .route(
            "/page/app.css",
            get(|| file("text/css; charset=utf-8", CSS)),
        )
}

async fn file(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // A daemon upgrade changes the files under the same names: revalidate.
            (header::CACHE_CONTROL, "no-cache"),
            // The page only talks to its own origin; nothing else may run in it.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; img-src 'self' data: blob:; connect-src 'self'",
            ),
        ],
        body,
    )
}
