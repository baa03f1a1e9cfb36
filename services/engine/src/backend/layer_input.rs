//! A layer's input as the model hands it to the backend: normed rows, or the residual add and
//! RMSNorm that form them, so that a backend may fold the add and norm into the first launch
//! that reads the normed rows.
//!
//! Owns: [`LayerInput`] and [`ResidualNorm`]. Must not touch: which layer part comes first (the
//! model's forward decides), how a backend folds (its overrides of the `Backend` methods).

use super::{Backend, NormStyle};
use crate::error::EngineError;

/// The RMSNorm that follows a residual add ([`Backend::add_rms_norm_and_start_routing_by_router`],
/// [`Backend::add_rms_norm_and_matmul3`]).
#[derive(Debug, Clone, Copy)]
pub struct ResidualNorm<'w, W> {
    pub weight: &'w W,
    pub eps: f32,
    pub style: NormStyle,
}

/// What a layer's part (its mixer, its MoE block) computes from: its normed rows, or the residual
/// add and norm that form them, which the backend may fold into the first launch that reads them
/// ([`Backend::add_rms_norm_and_matmul3`], [`Backend::add_rms_norm_and_start_routing_by_router`]).
pub enum LayerInput<'a, B: Backend + ?Sized> {
    /// The normed rows.
    Normed(&'a B::Tensor),
    /// `residual += delta` (written back), then the norm of it is the input.
    AfterResidualAdd {
        residual: &'a mut B::Tensor,
        delta: &'a B::Tensor,
        norm: ResidualNorm<'a, B::Weight>,
    },
}

impl<B: Backend + ?Sized> LayerInput<'_, B> {
    /// Rows of the input.
    pub fn rows(&self, backend: &B) -> usize {
        match self {
            LayerInput::Normed(x) => backend.shape(x).0,
            LayerInput::AfterResidualAdd { delta, .. } => backend.shape(delta).0,
        }
    }

    /// [`Backend::matmul3`] of the input, through [`Backend::add_rms_norm_and_matmul3`] where
    /// the residual add is still to do (for a caller that needs nothing else of the normed rows).
    pub fn matmul3(
        self,
        backend: &B,
        weights: [&B::Weight; 3],
    ) -> Result<[B::Tensor; 3], EngineError> {
        match self {
            LayerInput::Normed(x) => backend.matmul3(x, weights),
            LayerInput::AfterResidualAdd {
                residual,
                delta,
                norm,
            } => Ok(backend
                .add_rms_norm_and_matmul3(residual, delta, norm, weights)?
                .1),
        }
    }
}
