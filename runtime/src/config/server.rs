//! The HTTP edge's keys: `[server]` (the API, its limits, the sizes it takes and the
//! replies it keeps) and `[webhooks]` (where jobs may call back).

use serde::{Deserialize, Serialize};

/// `[server]`: the HTTP API of the router process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address of the HTTP API. Loopback by default: exposing it is a deliberate choice.
    pub listen: String,
    /// Largest accepted request body in bytes (base64 images included).
    pub max_body_bytes: usize,
    /// Largest image computed, in pixels (width x height): a generation's size, and
    /// what the device budget is sized for.
    pub max_pixels: usize,
    /// Largest accepted uploaded image (or mask), in pixels: 413 above it.
    pub max_input_pixels: usize,
    /// The area an edit is computed at is capped to this many megapixels (of 1024 x
    /// 1024 FLUX.1 pixels, i.e. 4096 tokens of 16 pixels a megapixel: a model with
    /// smaller tokens is capped at the same tokens; and to `max_pixels`): a larger
    /// image is scaled down to it and its result back to its size
    /// (`denoised_models::pipeline::sizing`).
    pub max_megapixels: f64,
    /// Most denoising steps a request may ask for.
    pub max_steps: usize,
    /// When not empty, every /v1 request must carry `Authorization: Bearer <token>`.
    pub api_token: String,
    /// Finished async jobs are kept this long for `GET /v1/jobs/{id}`.
    pub job_ttl_seconds: u64,
    /// Most requests in flight (waiting or running); beyond it, 429 with Retry-After.
    pub max_queued_requests: usize,
    /// Most finished jobs kept for `GET /v1/jobs/{id}` (the oldest go first).
    pub max_finished_jobs: usize,
    /// Deadline of each stage of a request (one call to a worker: preprocess, the
    /// whole denoise including its wait for a batch slot, postprocess, the cache).
    pub stage_timeout_seconds: u64,
    /// On SIGTERM, how long requests in flight may take to finish before the daemon
    /// stops anyway.
    pub drain_timeout_seconds: u64,
    /// Log lines as `text`, or `json` (one object per line, for journald and log
    /// shippers).
    pub log_format: String,
    /// Which denoise worker takes each request (`mask_aware`, `least_requests`,
    /// `least_tokens`, `round_robin`; see `denoised_actors::routing`).
    pub routing_policy: String,
    /// How long an image given by URL (OpenAI's `response_format: "url"`) is kept.
    pub image_url_ttl_seconds: u64,
    /// Memory those images may take in the router (the oldest go first beyond it).
    pub image_store_bytes: u64,
    /// The base of those URLs as clients reach this daemon (`https://images.example`);
    /// empty: `http://` and the request's `Host`.
    pub public_url: String,
    /// How long an `Idempotency-Key` stands for its first request.
    pub idempotency_window_seconds: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:8080".into(),
            max_body_bytes: 32 << 20,
            max_pixels: 2048 * 2048,
            // 32 MiP: 8192 x 4096, above what phones and most cameras take.
            max_input_pixels: 32 << 20,
            // As diffusers' Kontext pipeline caps `max_area` (1024 ** 2).
            max_megapixels: 1.0,
            max_steps: 100,
            api_token: String::new(),
            job_ttl_seconds: 600,
            max_queued_requests: 256,
            max_finished_jobs: 1000,
            stage_timeout_seconds: 600,
            drain_timeout_seconds: 60,
            log_format: "text".into(),
            routing_policy: "mask_aware".into(),
            // OpenAI's URLs last an hour.
            image_url_ttl_seconds: 3600,
            image_store_bytes: 1 << 30,
            public_url: String::new(),
            // A day, as Stripe keeps its keys.
            idempotency_window_seconds: 86400,
        }
    }
}

impl ServerConfig {
    /// The most image tokens an edit is computed at: `max_megapixels` of FLUX.1's
    /// 16-pixel tokens (4096 a megapixel), within `max_pixels`. The cost of an edit is
    /// in its tokens, so a model with smaller tokens (the built-in one's are 4 pixels)
    /// gets the same bound, not 16 times as many tokens.
    pub fn max_edit_tokens(&self) -> usize {
        ((self.max_megapixels * (1 << 20) as f64) as usize).min(self.max_pixels) / 256
    }

    /// The keys' consistency, before any process starts.
    pub fn check(&self) -> Result<(), String> {
        if !(self.max_megapixels.is_finite() && self.max_edit_tokens() >= 1) {
            return Err(format!(
                "[server] max_megapixels {} (with max_pixels {}) leaves no 16 x 16 image to compute",
                self.max_megapixels, self.max_pixels
            ));
        }
        if self.max_input_pixels == 0 {
            return Err("[server] max_input_pixels must be above 0".into());
        }
        Ok(())
    }
}

/// `[webhooks]`: where async jobs may call back when they end (a request's `webhook`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebhooksConfig {
    /// The hosts a webhook may name (`host` or `host:port`); empty: webhooks are off.
    /// Nothing else is ever called, so a client cannot make the daemon reach into its
    /// network.
    pub allowed_hosts: Vec<String>,
    /// The signing secret, in Standard Webhooks' form: `whsec_` and base64 bytes.
    pub secret: String,
}

impl WebhooksConfig {
    /// The secret's bytes, or why it is not one.
    pub fn key(&self) -> Result<Vec<u8>, String> {
        use base64::Engine;
        let b64 = self
            .secret
            .strip_prefix("whsec_")
            .ok_or("[webhooks] secret must be `whsec_` and base64 (Standard Webhooks)")?;
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("[webhooks] secret: not base64 after `whsec_`: {e}"))
            .and_then(|k| match k.len() >= 24 {
                true => Ok(k),
                false => Err("[webhooks] secret: at least 24 bytes (Standard Webhooks)".into()),
            })
    }

    /// The keys' consistency, before any process starts.
    pub fn check(&self) -> Result<(), String> {
        if self.allowed_hosts.is_empty() {
            return Ok(());
        }
        self.key().map(|_| ())
    }
}
