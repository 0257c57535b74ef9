//! Typed errors for loading and running models.
//!
//! Every variant names the thing that was wrong (a file, a tensor, a shape) so that an
//! operator reading a log line knows what to fix without a debugger.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {reason}")]
    BadSafetensors { path: PathBuf, reason: String },
    #[error(
        "{path}: truncated: tensor `{tensor}` needs bytes up to {needed} but the file has {actual}"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: usize,
        actual: usize,
    },
    #[error("{path}: not a valid GGUF file: {reason}")]
    BadGguf { path: PathBuf, reason: String },
    #[error("{path}: tensor `{tensor}` is {ty}: {ty} is not supported (supported: {supported})")]
    UnsupportedQuant {
        path: PathBuf,
        tensor: String,
        ty: String,
        supported: String,
    },
    #[error("{path}: cannot write: {reason}")]
    Write { path: PathBuf, reason: String },
    #[error("{path}: bad config: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error("tensor `{name}` is missing from {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?} (from the model config)")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {dtype}, expected one of F32, BF16, F16")]
    UnsupportedDType { name: String, dtype: String },
    #[error("{dir}: unexpected tensors not used by this model config: {names}")]
    UnexpectedTensors { dir: PathBuf, names: String },
    /// A checkpoint file whose contents do not make a model: unknown keys, a layout
    /// that is not recognised, a config its shapes cannot give.
    #[error("{path}: {reason}")]
    BadCheckpoint { path: PathBuf, reason: String },
    #[error("{path}: not a usable LoRA: {reason}")]
    BadAdapter { path: PathBuf, reason: String },
    #[error("shape error in {op}: {reason}")]
    Shape { op: &'static str, reason: String },
    #[error("{0}")]
    Invalid(String),
    #[error("device error: {0}")]
    Device(String),
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn shape(op: &'static str, reason: impl Into<String>) -> Self {
        Error::Shape {
            op,
            reason: reason.into(),
        }
    }
}
