//! The errors every reply carries: a kind (the HTTP edge maps each to a status) and a
//! message for the client.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The client's input is wrong (400/413/422).
    BadInput,
    /// The input is too large (413).
    TooLarge,
    /// An unknown template or job (404).
    NotFound,
    /// The request was cancelled (409 for a waiting client).
    Cancelled,
    /// The request conflicts with the current state, e.g. a template id that is
    /// taken (409).
    Conflict,
    /// A worker process went away while it held the request; the router retries.
    WorkerLost,
    /// A bug or a resource problem on our side (500).
    Internal,
    /// Not all worker groups are up yet (503).
    Unavailable,
    /// The server is at its admission limit; retry later (429 with Retry-After).
    Overloaded,
    /// A stage did not answer within its deadline (504).
    Timeout,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
}

impl WireError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        WireError {
            kind,
            message: message.into(),
        }
    }
    pub fn bad_input(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadInput, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
    /// Registering a template id that is taken (the router's check and the cache's
    /// own, which decides a race, give the same error).
    pub fn template_exists(id: &str) -> Self {
        Self::new(
            ErrorKind::Conflict,
            format!(
                "template `{id}` already exists; DELETE it first, or register with \"replace\": true"
            ),
        )
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for WireError {}
