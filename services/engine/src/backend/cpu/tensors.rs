//! The CPU backend's types: the backend itself, its tensors, weights, KV caches and recurrent
//! states, and the matmul into a tensor.
//!
//! Owns: the types every op family of the CPU backend works on. Must not touch: the ops.

use std::ops::Range;
use std::time::Duration;

use crate::backend::DeltaRuleSpec;
use crate::error::EngineError;
use crate::weights::{StoredWeight, WeightMatrix};

/// The CPU backend. Stateless: every op allocates its output.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    /// Added to every [`ExpertSlotFills::start_fill`] copy (tests: a slow PCIe copy).
    pub(super) expert_fill_delay: Duration,
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// A backend whose background expert slot fills ([`ExpertSlotFills::start_fill`]) each take
    /// at least `delay`: stands in for a slow copy in tests that a fill never holds up a step.
    pub fn with_expert_fill_delay(delay: Duration) -> Self {
        CpuBackend {
            expert_fill_delay: delay,
        }
    }
}

/// Refuses a segment whose rows run past a tensor's.
pub(super) fn check_segment_rows(
    rows: &Range<usize>,
    tensor_rows: usize,
    op: &str,
) -> Result<(), EngineError> {
    if rows.start > rows.end || rows.end > tensor_rows {
        return Err(EngineError::InvalidConfig {
            problem: format!("{op}: segment rows {rows:?} of a {tensor_rows}-row tensor"),
        });
    }
    Ok(())
}

/// A row-major `[rows, cols]` f32 buffer in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    pub fn row(&self, row: usize) -> &[f32] {
        &self.data[row * self.cols..(row + 1) * self.cols]
    }

    pub fn row_mut(&mut self, row: usize) -> &mut [f32] {
        &mut self.data[row * self.cols..(row + 1) * self.cols]
    }
}

/// A weight: matrices stay in the mapping; small parameters are decoded once to f32.
pub struct CpuWeight {
    pub(super) stored: Option<StoredWeight>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) parameter: Option<Vec<f32>>,
}

impl CpuWeight {
    /// A parameter that does not come from an artifact (op unit tests).
    #[cfg(test)]
    pub(super) fn from_parameter(values: Vec<f32>, rows: usize, cols: usize) -> Self {
        CpuWeight {
            stored: None,
            rows,
            cols,
            parameter: Some(values),
        }
    }

    pub(super) fn parameter(&self) -> &[f32] {
        self.parameter.as_deref().unwrap_or(&[])
    }
}

/// Keys and values of one attention layer of one sequence, `[max_tokens, kv_width]` each.
pub struct CpuKvCache {
    pub max_tokens: usize,
    pub kv_width: usize,
    pub len: usize,
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
}

/// The last `kernel − 1` pre-conv input rows, oldest first.
pub struct CpuConvState {
    pub channels: usize,
    pub kernel: usize,
    pub history: Vec<f32>,
}

/// The delta-rule state: `[nv, dk, dv]`, row index = key dim.
pub struct CpuRecurrentState {
    pub spec: DeltaRuleSpec,
    pub state: Vec<f32>,
}

impl CpuBackend {
    pub(super) fn map(&self, x: &CpuTensor, f: impl Fn(f32) -> f32) -> CpuTensor {
        CpuTensor {
            rows: x.rows,
            cols: x.cols,
            data: x.data.iter().map(|&v| f(v)).collect(),
        }
    }

    pub(super) fn zip(
        &self,
        a: &CpuTensor,
        b: &CpuTensor,
        f: impl Fn(f32, f32) -> f32,
    ) -> CpuTensor {
        debug_assert_eq!((a.rows, a.cols), (b.rows, b.cols));
        CpuTensor {
            rows: a.rows,
            cols: a.cols,
            data: a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
        }
    }
}

/// `out = x · Wᵀ`.
pub(super) fn matmul_into(matrix: &WeightMatrix<'_>, x: &CpuTensor, out: &mut CpuTensor) {
    if x.cols != matrix.cols {
        // Shapes are validated at model load; an inconsistent call leaves zeros.
        return;
    }
    matrix.matmul(&x.data, x.rows, &mut out.data);
}
