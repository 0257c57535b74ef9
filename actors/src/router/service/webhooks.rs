//! Webhooks: an async job that names a `webhook` URL gets its end posted there, as the
//! Standard Webhooks specification defines a delivery (standardwebhooks.com):
//!
//! - headers `webhook-id` (`msg_<job id>`: the same on every retry, so a receiver can
//!   drop duplicates), `webhook-timestamp` (Unix seconds) and `webhook-signature`
//!   (`v1,` and the base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` under the secret
//!   of `[webhooks] secret`, `whsec_` and base64);
//! - the body `{"type": "job.succeeded" | "job.failed" | "job.cancelled", "timestamp",
//!   "data": <the job as GET /v1/jobs/{id} describes it>}`;
//! - at least once: until the receiver answers 2xx, retried after 1, 2, 4, ... 128 s
//!   (nine tries over about four minutes), each try bounded by 10 s; redirects are not
//!   followed.
//!
//! Only hosts of `[webhooks] allowed_hosts` are called (checked when the job is
//! submitted, [`check`]), so a client cannot point the daemon into its network.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use hmac::{KeyInit, Mac};
use serde_json::json;

use crate::daemon::{job_name, unix_now};
use crate::router::state::jobs::{JobStatus, JobView};
use crate::router::state::Ctx;
use crate::wire::{JobId, WireError};

/// The waits before each retry.
const BACKOFF_S: [u64; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
/// One try's bound.
const TRY_TIMEOUT: Duration = Duration::from_secs(10);

/// A checked webhook URL.
#[derive(Clone, Debug)]
pub struct Hook(reqwest::Url);

/// `url` as a request's `webhook`: http(s), and a host of `[webhooks] allowed_hosts`
/// (an entry `host` allows any port; `host:port`, that one).
pub fn check(ctx: &Ctx, url: &str) -> Result<Hook, WireError> {
    let allowed = &ctx.config.webhooks.allowed_hosts;
    if allowed.is_empty() {
        return Err(WireError::bad_input(
            "`webhook`: webhooks are off on this daemon (set [webhooks] allowed_hosts)",
        ));
    }
    let u = reqwest::Url::parse(url)
        .map_err(|e| WireError::bad_input(format!("`webhook` {url:?}: not a URL: {e}")))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(WireError::bad_input(format!(
            "`webhook` {url:?}: http or https only"
        )));
    }
    let host = u.host_str().unwrap_or("").to_ascii_lowercase();
    let port = u.port_or_known_default().unwrap_or(0);
    let ok = allowed.iter().any(|a| {
        let a = a.to_ascii_lowercase();
        a == host || a == format!("{host}:{port}")
    });
    if !ok {
        return Err(WireError::bad_input(format!(
            "`webhook` {url:?}: host `{host}` is not in [webhooks] allowed_hosts"
        )));
    }
    Ok(Hook(u))
}

/// Posts job `job`'s end to `hook` once it ends, on a task of its own.
pub fn deliver_when_done(ctx: Arc<Ctx>, job: JobId, hook: Hook) {
    tokio::spawn(async move {
        let Some(view) = ended(&ctx, job).await else {
            tracing::warn!(job = %job_name(job), "webhook: the job left the table before it ended");
            return;
        };
        deliver(&ctx, &hook, &view).await;
    });
}

/// The job once it has ended (its events run out when it does).
async fn ended(ctx: &Ctx, job: JobId) -> Option<JobView> {
    let w = ctx.jobs.watch(job).await?;
    if let Some(mut events) = w.events {
        while events.recv().await.is_some() {}
    }
    ctx.jobs.get(job).await.filter(|v| v.status.is_final())
}

async fn deliver(ctx: &Ctx, hook: &Hook, view: &JobView) {
    let kind = match view.status {
        JobStatus::Succeeded => "job.succeeded",
        JobStatus::Cancelled => "job.cancelled",
        _ => "job.failed",
    };
    let timestamp = unix_now() as u64;
    let body = json!({"type": kind, "timestamp": timestamp, "data": view}).to_string();
    let msg = format!("msg_{}", view.id);
    let key = match ctx.config.webhooks.key() {
        Ok(k) => k,
        Err(e) => return tracing::error!("webhook not sent: {e}"),
    };
    let signature = sign(&key, &msg, timestamp, &body);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(TRY_TIMEOUT)
        .build()
        .expect("a plain HTTP client builds");
    for (attempt, wait) in std::iter::once(0).chain(BACKOFF_S).enumerate() {
        tokio::time::sleep(Duration::from_secs(wait)).await;
        let r = http
            .post(hook.0.clone())
            .header("content-type", "application/json")
            .header("webhook-id", &msg)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", &signature)
            .body(body.clone())
            .send()
            .await;
        let outcome = match r {
            Ok(r) if r.status().is_success() => {
                ctx.metrics.webhook(true);
                tracing::info!(job = %view.id, attempt = attempt + 1, "webhook delivered");
                return;
            }
            Ok(r) => format!("answered {}", r.status()),
            Err(e) => e.to_string(),
        };
        ctx.metrics.webhook(false);
        tracing::warn!(job = %view.id, attempt = attempt + 1, "webhook to {}: {outcome}", hook.0);
    }
    tracing::error!(job = %view.id, "webhook to {}: given up after {} tries", hook.0, BACKOFF_S.len() + 1);
}

/// Standard Webhooks' signature of a message: `v1,` and the base64 HMAC-SHA256 of
/// `{id}.{timestamp}.{body}`.
pub fn sign(key: &[u8], id: &str, timestamp: u64, body: &str) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes any key");
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    let tag = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks specification's own example (its reference libraries'
    /// test vector): this secret, id, timestamp and body give this signature.
    #[test]
    fn signatures_are_standard_webhooks_signatures() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let key = base64::engine::general_purpose::STANDARD
            .decode(secret.strip_prefix("whsec_").unwrap())
            .unwrap();
        let body = r#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }
}
