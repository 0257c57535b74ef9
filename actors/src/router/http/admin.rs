//! The admin API: operations on a running daemon, for its operators. Every `/admin`
//! route needs the API token, and is refused (403) on a daemon that has none: an
//! endpoint that changes how the daemon serves is never open (`http::auth`).
//!
//! - `GET /admin/routing`: the routing policy, the requests waiting for a denoise
//!   worker, and each worker's load as the router sees it;
//! - `PUT /admin/routing` `{"policy": "least_requests"}`: switches the policy for the
//!   requests routed from now on (none is moved). Not persisted: a restart reads
//!   `[server] routing_policy` again.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::error::{ApiError, ApiResult, ErrorBody};
use super::extract::{body, parse};
use crate::router::state::Ctx;
use crate::routing::Policy;

/// The routing policy, the requests waiting for a denoise worker, and each worker's
/// load as the router sees it.
#[utoipa::path(get, path = "/admin/routing", tag = "admin",
    responses(
        (status = 200, description = "The routing state.", body = Object),
        (status = 401, body = ErrorBody),
        (status = 403, description = "The daemon has no API token.", body = ErrorBody),
    ))]
pub(crate) async fn get_routing(State(ctx): State<Arc<Ctx>>) -> Response {
    Json(ctx.balancer.describe()).into_response()
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RoutingBody {
    /// A routing policy (`[server] routing_policy`'s values).
    policy: String,
}

/// Switches the routing policy for the requests routed from now on (not persisted).
#[utoipa::path(put, path = "/admin/routing", tag = "admin",
    request_body(content = RoutingBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The routing state.", body = Object),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, description = "The daemon has no API token.", body = ErrorBody),
    ))]
pub(crate) async fn put_routing(State(ctx): State<Arc<Ctx>>, req: Request) -> ApiResult {
    let b: RoutingBody = parse(&body(&ctx, req).await?)?;
    let policy: Policy = b.policy.parse().map_err(ApiError::bad)?;
    let before = ctx.balancer.policy();
    ctx.balancer.set_policy(policy);
    tracing::info!(
        "routing policy: {} -> {} (PUT /admin/routing)",
        before.name(),
        policy.name()
    );
    Ok(Json(ctx.balancer.describe()).into_response())
}
