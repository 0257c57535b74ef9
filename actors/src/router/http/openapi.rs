//! The OpenAPI document, generated from the code: every route is registered in
//! [`table`] together with its operation (`#[utoipa::path]` on its handler), so the
//! route table and the document cannot disagree; the request and reply types derive
//! their schemas. The document is served at `/openapi.json` and committed as
//! docs/openapi.json; a test fails when the committed one differs from the generated
//! one (`DENOISED_WRITE_OPENAPI=1 cargo test --release -p denoised-actors openapi`
//! rewrites it).

use std::sync::{Arc, OnceLock};

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::OpenApi as Document;
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{adapters, admin, edits, events, generations, images, jobs, openai, ops, templates};
use crate::router::state::Ctx;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "denoised",
        description = "HTTP API of the denoised daemon (its router process). Register a template image once, then send mask-aware edits of it that compute only the masked tokens; or edit any image in full, or generate from a prompt. Requests run synchronously or, with `async: true`, as jobs to poll. Errors are `{\"error\": {\"code\", \"message\"}}` (OpenAI's shape on the `/v1/images` routes). See docs/api.md.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    modifiers(&BearerToken),
    security(("bearer" = [])),
    tags(
        (name = "templates", description = "Template images and their cached activations."),
        (name = "edits", description = "Masked edits of templates and of inline images."),
        (name = "generations", description = "Text-to-image (FLUX.1-dev or -schnell)."),
        (name = "openai", description = "OpenAI's Images API, for its clients."),
        (name = "jobs", description = "Async requests: poll and cancel."),
        (name = "adapters", description = "LoRA adapters."),
        (name = "admin", description = "Operating a running daemon (always needs the token)."),
        (name = "operations", description = "Probes, metrics, this document."),
    ),
)]
struct ApiDoc;

/// The bearer token of `[server] api_token` (every `/v1` route needs it when set; the
/// `/admin` routes always).
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, doc: &mut Document) {
        let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearer", SecurityScheme::Http(scheme));
    }
}

/// The `Idempotency-Key` header of every POST that starts work
/// (`super::idempotency`), added to those operations once the route table has made
/// them ([`finished`]) rather than to each by hand.
struct IdempotencyKey;

impl Modify for IdempotencyKey {
    fn modify(&self, doc: &mut Document) {
        use utoipa::openapi::path::{ParameterBuilder, ParameterIn};
        use utoipa::openapi::{ObjectBuilder, Required, Type};
        for path in super::idempotency::WORK {
            let Some(op) = doc.paths.paths.get_mut(path).and_then(|p| p.post.as_mut()) else {
                continue;
            };
            let p = ParameterBuilder::new()
                .name("Idempotency-Key")
                .parameter_in(ParameterIn::Header)
                .required(Required::False)
                .description(Some(
                    "1-255 visible ASCII characters: the same request again with this key (within `[server] idempotency_window_seconds`) gets the first one's reply, marked `Idempotent-Replayed: true`, instead of a new job; the key with another request is a 409.",
                ))
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .build();
            op.parameters.get_or_insert_with(Vec::new).push(p);
        }
    }
}

/// Every route of the API with its operation.
pub fn table() -> OpenApiRouter<Arc<Ctx>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics))
        .routes(routes!(openapi_json))
        .routes(routes!(
            templates::list_templates,
            templates::create_template
        ))
        .routes(routes!(templates::get_template, templates::delete_template))
        .routes(routes!(edits::create_edit))
        .routes(routes!(generations::create_generation))
        .routes(routes!(openai::images_generations))
        .routes(routes!(openai::images_edits))
        .routes(routes!(images::get_image))
        .routes(routes!(jobs::get_job, jobs::cancel_job))
        .routes(routes!(events::job_events))
        .routes(routes!(adapters::list, adapters::upload))
        .routes(routes!(admin::get_routing, admin::put_routing))
}

/// The generated document.
pub fn document() -> Document {
    finished(table().into_openapi())
}

/// The route table's document with what is added to its operations.
fn finished(mut doc: Document) -> Document {
    IdempotencyKey.modify(&mut doc);
    doc
}

/// The document as `/openapi.json` serves it (pretty JSON, as committed).
pub fn document_json() -> String {
    pretty(&document())
}

fn pretty(doc: &Document) -> String {
    let mut s = doc
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}

static SERVED: OnceLock<String> = OnceLock::new();

/// Keeps the document the router serves (made once, with its route table).
pub(super) fn serve(doc: Document) {
    let _ = SERVED.set(pretty(&finished(doc)));
}

/// This API's OpenAPI document (the one docs/openapi.json holds).
#[utoipa::path(get, path = "/openapi.json", tag = "operations", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document.", body = Object)))]
pub(crate) async fn openapi_json() -> impl IntoResponse {
    let body = SERVED.get().cloned().unwrap_or_else(document_json);
    ([(header::CONTENT_TYPE, "application/json")], body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed_path() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json")
    }

    /// The drift test: the committed document is the generated one.
    #[test]
    fn the_committed_openapi_document_is_the_generated_one() {
        let generated = document_json();
        if std::env::var_os("DENOISED_WRITE_OPENAPI").is_some() {
            std::fs::write(committed_path(), &generated).unwrap();
        }
        let committed = std::fs::read_to_string(committed_path()).unwrap();
        assert!(
            committed == generated,
            "docs/openapi.json differs from the document the code generates: regenerate it with \
             `DENOISED_WRITE_OPENAPI=1 cargo test --release -p denoised-actors openapi`, and review the diff"
        );
    }

    /// Every route is in the document with its methods, and every operation documents
    /// its success and its errors with a body.
    #[test]
    fn every_route_is_documented() {
        let doc = document();
        let want = [
            ("/healthz", vec!["get"]),
            ("/readyz", vec!["get"]),
            ("/metrics", vec!["get"]),
            ("/openapi.json", vec!["get"]),
            ("/v1/templates", vec!["get", "post"]),
            ("/v1/templates/{id}", vec!["get", "delete"]),
            ("/v1/edits", vec!["post"]),
            ("/v1/generations", vec!["post"]),
            ("/v1/images/generations", vec!["post"]),
            ("/v1/images/edits", vec!["post"]),
            ("/v1/images/{id}", vec!["get"]),
            ("/v1/jobs/{id}", vec!["get", "delete"]),
            ("/v1/jobs/{id}/events", vec!["get"]),
            ("/v1/adapters", vec!["get", "post"]),
            ("/admin/routing", vec!["get", "put"]),
        ];
        let json: serde_json::Value = serde_json::from_str(&document_json()).unwrap();
        let paths = json["paths"].as_object().unwrap();
        assert_eq!(paths.len(), want.len(), "{:?}", paths.keys());
        assert_eq!(doc.paths.paths.len(), want.len());
        for (path, methods) in want {
            let item = paths[path].as_object().unwrap_or_else(|| panic!("{path}"));
            let mut have: Vec<&str> = item.keys().map(String::as_str).collect();
            have.retain(|k| *k != "parameters");
            have.sort();
            let mut methods = methods.clone();
            methods.sort();
            assert_eq!(have, methods, "{path}");
            for (m, op) in item {
                let responses = op["responses"].as_object().unwrap();
                assert!(
                    responses.keys().any(|s| s.starts_with('2')),
                    "{m} {path}: no success response"
                );
                for (status, r) in responses {
                    assert!(
                        r["content"].is_object(),
                        "{m} {path} {status}: no body described"
                    );
                }
            }
        }
    }
}
