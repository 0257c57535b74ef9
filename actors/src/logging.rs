//! Logs: to stderr (journald under systemd), as text lines or JSON objects
//! (`[server] log_format`), filtered by `DENOISED_LOG` (tracing's env-filter syntax,
//! `info` by default).
//!
//! Every line about a request runs inside a `request` span whose `id` is the request's
//! id (the job name the API returns, `x-request-id`) and whose `worker` is the process,
//! in every process: the router's flow, the preprocess and postprocess compute
//! threads, the denoise worker's event thread. So `grep job_...` (or a JSON query on `span.id`) follows one request through
//! the daemon. The router also writes one access-log line per HTTP request (target
//! `denoised::access`: id, method, route, status, seconds).
//!
//! The format is chosen after the configuration is read (the supervisor's file and
//! flags, a worker's environment), so the subscriber is installed first with text and
//! switched once ([`set_format`]).

use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Layer, Registry};

type Formatter = Box<dyn Layer<Registry> + Send + Sync>;

static HANDLE: OnceLock<reload::Handle<Formatter, Registry>> = OnceLock::new();
static WORKER: OnceLock<String> = OnceLock::new();

/// Names this process (`router0`, `denoise1`, ...) in the `request` spans it opens.
pub fn set_worker(name: String) {
    let _ = WORKER.set(name);
}

/// This process's name (`-` before [`set_worker`]).
pub fn worker() -> &'static str {
    WORKER.get().map_or("-", String::as_str)
}

/// `DENOISED_LOG`, default `info`. ractor_cluster logs every connection and, when a
/// peer process stops, errors about its sessions; those stay quiet unless the filter
/// names ractor explicitly. hnsw_rs logs each graph's parameters at info: warnings only,
/// unless named.
fn filter() -> EnvFilter {
    let spec = std::env::var("DENOISED_LOG").unwrap_or_else(|_| "info".into());
    let spec = if spec.contains("ractor") {
        spec
    } else {
        format!("{spec},ractor=error,ractor_cluster=off")
    };
    let spec = if spec.contains("hnsw_rs") {
        spec
    } else {
        format!("{spec},hnsw_rs=warn")
    };
    EnvFilter::try_new(&spec).unwrap_or_else(|_| EnvFilter::new("info"))
}

fn layer(format: &str) -> Formatter {
    let base = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        "json" => base
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
        _ => base
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
    }
}

/// Installs the subscriber, in text until [`set_format`] says otherwise.
pub fn init() {
    let (fmt, handle) = reload::Layer::new(layer("text"));
    let _ = HANDLE.set(handle);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(filter())
        .try_init();
}

/// Switches to `text` or `json`.
pub fn set_format(format: &str) -> Result<(), String> {
    if !matches!(format, "text" | "json") {
        return Err(format!("log_format `{format}`: use text or json"));
    }
    if let Some(h) = HANDLE.get() {
        h.reload(layer(format)).map_err(|e| e.to_string())?;
    }
    Ok(())
}
