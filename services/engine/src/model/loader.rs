//! The weight loader's handle: the backend and the artifact weights are loaded from (its
//! methods, by kind of weight, live beside what they load: `loading.rs`, `mtp.rs`, the
//! qwen4_exp graph).
//!
//! Owns: [`Loader`]. Must not touch: what is loaded.

use std::sync::Arc;

use ninfer_artifact::Artifact;

use crate::backend::Backend;

/// Loads weights by internal name and checks their shapes.
pub(in crate::model) struct Loader<'a, B: Backend> {
    pub(in crate::model) backend: &'a B,
    pub(in crate::model) artifact: &'a Arc<Artifact>,
}
