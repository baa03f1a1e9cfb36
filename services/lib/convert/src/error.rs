//! Typed conversion errors; each names the file (or checkpoint directory) and the problem.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{}: {action}", file.display())]
    Io {
        file: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {problem}", file.display())]
    Input { file: PathBuf, problem: String },
    #[error("{}: unknown model_type `{model_type}` (supported: qwen3_moe, qwen3_next, qwen3_5_moe, qwen3_5_moe_text)", file.display())]
    UnknownModelType { file: PathBuf, model_type: String },
    #[error("{}: field `{field}`: {problem}", file.display())]
    ConfigField {
        file: PathBuf,
        field: String,
        problem: String,
    },
    #[error("{}: missing tensor `{name}`", directory.display())]
    MissingTensor { directory: PathBuf, name: String },
    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", file.display())]
    WrongShape {
        file: PathBuf,
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("{}: {count} tensor(s) this converter does not know, e.g. {examples}", directory.display())]
    UnknownTensors {
        directory: PathBuf,
        count: usize,
        examples: String,
    },
    #[error("{option}: {problem}")]
    InvalidOption {
        option: &'static str,
        problem: String,
    },
    /// Ctrl-C or SIGTERM: a plain conversion leaves no output, a resumable one keeps its
    /// partial files for the next run.
    #[error("conversion interrupted")]
    Interrupted,
    /// Reading a remote checkpoint failed (after the source's own retries).
    #[error("{}: {problem}", file.display())]
    Fetch { file: PathBuf, problem: String },
    #[error(transparent)]
    Artifact(#[from] ninfer_artifact::ArtifactError),
}

impl ConvertError {
    /// Whether a later run of the same conversion could get further (a network failure or an
    /// interruption), so a resumable conversion keeps its partial output for it.
    pub fn is_resumable(&self) -> bool {
        matches!(self, ConvertError::Fetch { .. } | ConvertError::Interrupted)
    }

    pub(crate) fn io(
        file: impl Into<PathBuf>,
        action: &'static str,
        source: std::io::Error,
    ) -> Self {
        ConvertError::Io {
            file: file.into(),
            action,
            source,
        }
    }
}
