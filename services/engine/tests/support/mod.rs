//! What several of the engine's test suites share.
//!
//! Owns: converting a golden fixture (or any checkpoint directory) to an f32 artifact, as the
//! suites that compare against float references open it.
//! Must not touch: what a suite checks.

use std::path::Path;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};

/// The checkpoint in `fixture` converted with f32 experts and dense weights to the artifact
/// `artifact` (panics naming the fixture where it does not convert).
pub fn convert_f32(fixture: impl AsRef<Path>, artifact: &Path) {
    let fixture = fixture.as_ref();
    let options = ConvertOptions {
        experts_dtype: DType::F32,
        dense_dtype: DType::F32,
        ..ConvertOptions::new(fixture, artifact)
    };
    convert_checkpoint(&options, &NoProgress)
        .unwrap_or_else(|error| panic!("converting {}: {error}", fixture.display()));
}
