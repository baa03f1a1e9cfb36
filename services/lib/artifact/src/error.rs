//! Typed errors of the artifact library. Every variant names the file involved.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{}: {action}", file.display())]
    Io {
        file: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a .ninfer artifact (bad magic bytes)", file.display())]
    NotAnArtifact { file: PathBuf },
    #[error("{}: format version {found} is not supported (this build reads version {supported})", file.display())]
    UnsupportedVersion {
        file: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("{}: corrupt artifact: {problem}", file.display())]
    Corrupt { file: PathBuf, problem: String },
    #[error("{}: missing part file {} (the artifact has {part_count} parts)", file.display(), part.display())]
    MissingPart {
        file: PathBuf,
        part: PathBuf,
        part_count: u32,
    },
    #[error("{}: part file {} is {found} bytes, expected {expected}", file.display(), part.display())]
    PartSize {
        file: PathBuf,
        part: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("{}: checksum mismatch in {what}: stored {stored}, computed {computed}", file.display())]
    ChecksumMismatch {
        file: PathBuf,
        what: String,
        stored: String,
        computed: String,
    },
    #[error("{}: no tensor named `{name}`", file.display())]
    MissingTensor { file: PathBuf, name: String },
    #[error("tensor `{name}`: {problem}")]
    InvalidTensor { name: String, problem: String },
    #[error("{}: {problem}", file.display())]
    Write { file: PathBuf, problem: String },
}

impl ArtifactError {
    pub(crate) fn io(
        file: impl Into<PathBuf>,
        action: &'static str,
        source: std::io::Error,
    ) -> Self {
        ArtifactError::Io {
            file: file.into(),
            action,
            source,
        }
    }
}
