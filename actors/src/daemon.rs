//! What every process of the daemon shares, below the router and the workers alike
//! (both import it; it imports neither): the clock, job names, the exit statuses the
//! supervisor reads, the stop signal, and the supervisor's status file.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::wire::JobId;

/// Seconds since the Unix epoch (0 on a clock before it).
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A job's name: its id in replies, URLs, the `x-request-id` header and every
/// process's log lines.
pub fn job_name(id: JobId) -> String {
    format!("job_{id:016x}")
}

/// The id a [`job_name`] names.
pub fn parse_job_name(s: &str) -> Option<JobId> {
    u64::from_str_radix(s.strip_prefix("job_")?, 16).ok()
}

/// A worker's exit status when it cannot load its model (sysexits' EX_CONFIG): at the
/// daemon's start the supervisor then stops instead of restarting it forever.
pub const EXIT_CANNOT_LOAD: i32 = 78;

/// Resolves when the process is asked to stop: SIGTERM from the supervisor (or from
/// the kernel when the supervisor dies). Workers ignore SIGINT: a Ctrl-C in a terminal
/// reaches the whole process group, and the supervisor alone decides the order of the
/// shutdown (the router drains first).
pub async fn terminated() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    term.recv().await;
}

/// Where the routers of a daemon keep their idempotency keys: beside the supervisor's
/// status file, so that they outlive a router and go with the daemon.
pub fn idempotency_file(status_file: &std::path::Path) -> std::path::PathBuf {
    status_file.with_extension("idempotency.jsonl")
}

/// What the supervisor tells the router (through `WorkerEnv::status_file`): the
/// worker slots it gave up restarting, and why (`/readyz` shows them), and how many
/// times it restarted each worker (a metric).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct SupervisorStatus {
    pub failed: std::collections::BTreeMap<String, String>,
    /// By worker name: its role, and its restarts.
    #[serde(default)]
    pub restarts: std::collections::BTreeMap<String, (String, u64)>,
}

impl SupervisorStatus {
    /// The status the supervisor last wrote (empty if none).
    pub fn read(path: &std::path::Path) -> SupervisorStatus {
        std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Written to a temporary file and renamed, so a reader never sees half of it.
    pub fn write(&self, path: &std::path::Path) {
        let tmp = path.with_extension("tmp");
        let r = serde_json::to_vec(self)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = r {
            tracing::error!("writing {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn job_names_round_trip() {
        for id in [0, 1, 0xdead_beef, u64::MAX] {
            assert_eq!(super::parse_job_name(&super::job_name(id)), Some(id));
        }
        assert_eq!(super::parse_job_name("job_zz"), None);
        assert_eq!(super::parse_job_name("0001"), None);
    }
}
