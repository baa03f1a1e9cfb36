//! The CPU backend: straightforward f32 loops, weights read in place from the mmapped artifact.
//!
//! Owns: the reference implementation of every [`Backend`] op. It is the numerical yardstick the
//! CUDA backend is checked against, so clarity wins over speed here; only the matmul (in
//! `crate::weights`) is blocked and threaded.
//! Must not touch: model structure, the artifact byte layout.

// Index loops mirror the formulas of MODELS.md one to one; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use super::qsa_host::{AttendShape, HostQsaCache};
use super::{
    expert_bytes, slot_out_of_range, AttentionSpec, Backend, DeltaRuleForm, DeltaRuleSpec,
    ExpertSlotFills, ExpertSlotTable, NormStyle, Rotation, Routing, Segment, WithExpertSlotTable,
};
use crate::error::EngineError;
use crate::host_math::{
    rope_inverse_frequencies, route_top_k_host, sigmoid, silu, softplus, swiglu_halves,
};
use crate::model::qwen4_exp::qsa_selection::{prepare_index_query, QsaSelectionSettings};
use crate::weights::{dot, StoredWeight, WeightMatrix};

/// Chunk length of the chunked delta rule (transformers' `chunk_size`).
pub const DELTA_RULE_CHUNK: usize = 64;

/// The CPU backend. Stateless: every op allocates its output.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    /// Added to every [`ExpertSlotFills::start_fill`] copy (tests: a slow PCIe copy).
    expert_fill_delay: Duration,
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
fn check_segment_rows(
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
    stored: Option<StoredWeight>,
    rows: usize,
    cols: usize,
    parameter: Option<Vec<f32>>,
}

impl CpuWeight {
    /// A parameter that does not come from an artifact (op unit tests).
    #[cfg(test)]
    fn from_parameter(values: Vec<f32>, rows: usize, cols: usize) -> Self {
        CpuWeight {
            stored: None,
            rows,
            cols,
            parameter: Some(values),
        }
    }

    fn parameter(&self) -> &[f32] {
        self.parameter.as_deref().unwrap_or(&[])
    }
}

/// Keys and values of one attention layer of one sequence, `[max_tokens, kv_width]` each.
pub struct CpuKvCache {
    pub max_tokens: usize,
    pub kv_width: usize,
    pub len: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
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

/// Expert slots in host memory: each slot a private copy of one expert's stored bytes. The
/// CPU backend has no faster memory to copy to; the copies exist so the slot logic (table,
/// placement, split of the routed sum) is exercised and tested the same way on every backend.
pub struct CpuExpertSlots {
    layout: ExpertLayout,
    /// `slots` × `layout.stride` bytes.
    storage: Vec<u8>,
    table: ExpertSlotTable,
    /// Background fills: a thread copies the expert's bytes (the CPU's stand-in for a DMA), the
    /// slot takes them at [`ExpertSlotFills::complete_fills`].
    fills_in_flight: Vec<CpuSlotFill>,
    /// Batch fills (layerwise prefill), oldest first: one thread copies the whole batch.
    batch_fills: std::collections::VecDeque<CpuBatchFill>,
    /// [`CpuBackend::with_expert_fill_delay`].
    fill_delay: Duration,
}

/// One batch fill of consecutive CPU expert slots: the experts' bytes back to back.
struct CpuBatchFill {
    first_slot: usize,
    experts: Vec<usize>,
    copy: JoinHandle<Vec<u8>>,
}

/// One background fill of a CPU expert slot.
struct CpuSlotFill {
    slot: usize,
    expert: usize,
    copy: JoinHandle<Vec<u8>>,
}

impl WithExpertSlotTable for CpuExpertSlots {
    fn slot_table(&self) -> &ExpertSlotTable {
        &self.table
    }
}

impl ExpertSlotFills for CpuExpertSlots {
    fn start_fill(
        &mut self,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        let source = expert_bytes(artifact, bank, expert, &self.layout)?;
        self.table.check(slot, expert).map_err(slot_out_of_range)?;
        // The source's place in the mapping, so the copying thread can hold the artifact.
        let start = source.as_ptr() as usize - artifact.bytes().as_ptr() as usize;
        let range = start..start + source.len();
        self.table.clear(slot);
        if let Some(old_slot) = self.table.slot_of(expert) {
            self.table.clear(old_slot);
        }
        let (artifact, delay) = (Arc::clone(artifact), self.fill_delay);
        let copy = std::thread::Builder::new()
            .name("expert-slot-fill".into())
            .spawn(move || {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                artifact.bytes()[range].to_vec()
            })
            .map_err(|error| EngineError::InvalidConfig {
                problem: format!("starting an expert slot fill: {error}"),
            })?;
        self.fills_in_flight
            .push(CpuSlotFill { slot, expert, copy });
        Ok(())
    }

    fn complete_fills(&mut self) -> Result<(), EngineError> {
        while !self.batch_fills.is_empty() {
            self.complete_batch_fill()?;
        }
        let stride = self.layout.stride;
        for fill in std::mem::take(&mut self.fills_in_flight) {
            let bytes = fill.copy.join().map_err(|_| EngineError::InvalidConfig {
                problem: format!("the fill of expert slot {} panicked", fill.slot),
            })?;
            self.storage[fill.slot * stride..(fill.slot + 1) * stride].copy_from_slice(&bytes);
            self.table
                .assign(fill.slot, fill.expert)
                .map_err(slot_out_of_range)?;
        }
        Ok(())
    }

    fn fills_in_flight(&self) -> usize {
        self.fills_in_flight.len()
            + self
                .batch_fills
                .iter()
                .map(|fill| fill.experts.len())
                .sum::<usize>()
    }

    fn start_batch_fill(
        &mut self,
        first_slot: usize,
        experts: &[usize],
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        // Every source range, checked before anything changes.
        let mut ranges = Vec::with_capacity(experts.len());
        for (offset, &expert) in experts.iter().enumerate() {
            let source = expert_bytes(artifact, bank, expert, &self.layout)?;
            self.table
                .check(first_slot + offset, expert)
                .map_err(slot_out_of_range)?;
            let start = source.as_ptr() as usize - artifact.bytes().as_ptr() as usize;
            ranges.push(start..start + source.len());
        }
        for slot in first_slot..first_slot + experts.len() {
            self.table.clear(slot);
        }
        let (artifact, delay) = (Arc::clone(artifact), self.fill_delay);
        // The CPU's stand-in for the copy stream: the copy runs beside the forward.
        let copy = std::thread::Builder::new()
            .name("expert-batch-fill".into())
            .spawn(move || {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                let bytes = artifact.bytes();
                let mut copied = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum());
                for range in ranges {
                    copied.extend_from_slice(&bytes[range]);
                }
                copied
            })
            .map_err(|error| EngineError::InvalidConfig {
                problem: format!("starting an expert batch fill: {error}"),
            })?;
        self.batch_fills.push_back(CpuBatchFill {
            first_slot,
            experts: experts.to_vec(),
            copy,
        });
        Ok(())
    }

    fn complete_batch_fill(&mut self) -> Result<(), EngineError> {
        let Some(fill) = self.batch_fills.pop_front() else {
            return Err(EngineError::InvalidConfig {
                problem: "no expert batch fill to complete".into(),
            });
        };
        let bytes = fill.copy.join().map_err(|_| EngineError::InvalidConfig {
            problem: format!("the batch fill into slot {} panicked", fill.first_slot),
        })?;
        let stride = self.layout.stride;
        let start = fill.first_slot * stride;
        let target = self
            .storage
            .get_mut(start..start + bytes.len())
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: format!(
                    "a batch fill from slot {} overruns the slots",
                    fill.first_slot
                ),
            })?;
        target.copy_from_slice(&bytes);
        for (offset, &expert) in fill.experts.iter().enumerate() {
            self.table
                .assign(fill.first_slot + offset, expert)
                .map_err(slot_out_of_range)?;
        }
        Ok(())
    }
}

impl CpuExpertSlots {
    fn expert_matrices(
        &self,
        slot: usize,
    ) -> Result<(WeightMatrix<'_>, WeightMatrix<'_>), EngineError> {
        let layout = &self.layout;
        let bytes = &self.storage[slot * layout.stride..(slot + 1) * layout.stride];
        let dtype = layout.dtype.artifact_dtype();
        let gate_up = WeightMatrix::from_raw(
            dtype,
            layout.gate_up.rows,
            layout.gate_up.cols,
            &bytes[..layout.gate_up.total_bytes],
        )?;
        let down = WeightMatrix::from_raw(
            dtype,
            layout.down.rows,
            layout.down.cols,
            &bytes[layout.down_offset..],
        )?;
        Ok((gate_up, down))
    }
}

/// `x · rsqrt(Σx² + 1e-6)` (the delta rule's fixed-eps l2 norm), times `scale`.
fn l2_normalize_into(x: &[f32], scale: f32, out: &mut [f32]) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let inverse = 1.0 / (sum + 1e-6).sqrt();
    for (o, v) in out.iter_mut().zip(x) {
        *o = v * inverse * scale;
    }
}

/// Recurrent gated delta rule for one head over `n` steps. `q`, `k`: `[n, dk]` (already
/// normalised/scaled), `v`: `[n, dv]`, `state`: `[dk, dv]`, `out`: `[n, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dk: usize,
    dv: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    let mut delta = vec![0.0f32; dv];
    for t in 0..g.len() {
        let decay = g[t].exp();
        state.iter_mut().for_each(|s| *s *= decay);
        let kt = &k[t * dk..(t + 1) * dk];
        let qt = &q[t * dk..(t + 1) * dk];
        delta.copy_from_slice(&v[t * dv..(t + 1) * dv]);
        for (i, &ki) in kt.iter().enumerate() {
            let row = &state[i * dv..(i + 1) * dv];
            for (d, s) in delta.iter_mut().zip(row) {
                *d -= s * ki;
            }
        }
        delta.iter_mut().for_each(|d| *d *= beta[t]);
        let ot = &mut out[t * dv..(t + 1) * dv];
        ot.iter_mut().for_each(|o| *o = 0.0);
        for i in 0..dk {
            let row = &mut state[i * dv..(i + 1) * dv];
            for (s, d) in row.iter_mut().zip(&delta) {
                *s += kt[i] * d;
            }
            for (o, s) in ot.iter_mut().zip(row.iter()) {
                *o += s * qt[i];
            }
        }
    }
}

/// Chunked gated delta rule (MODELS.md §1.5.4, chunks of [`DELTA_RULE_CHUNK`]); same contract as
/// [`delta_rule_recurrent`]. The last chunk is simply shorter (padding steps would be no-ops).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dk: usize,
    dv: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    let n = g.len();
    let mut chunk_start = 0;
    while chunk_start < n {
        let m = DELTA_RULE_CHUNK.min(n - chunk_start);
        let q = &q[chunk_start * dk..(chunk_start + m) * dk];
        let k = &k[chunk_start * dk..(chunk_start + m) * dk];
        let v = &v[chunk_start * dv..(chunk_start + m) * dv];
        let g = &g[chunk_start..chunk_start + m];
        let beta = &beta[chunk_start..chunk_start + m];
        let out = &mut out[chunk_start * dv..(chunk_start + m) * dv];

        let mut gamma = vec![0.0f32; m];
        let mut running = 0.0f32;
        for i in 0..m {
            running += g[i];
            gamma[i] = running;
        }
        let key = |i: usize| &k[i * dk..(i + 1) * dk];
        // A[i][j] (j < i) = β_i (k_i·k_j) e^{γ_i − γ_j}.
        let mut a = vec![0.0f32; m * m];
        for i in 0..m {
            for j in 0..i {
                a[i * m + j] = beta[i] * dot(key(i), key(j)) * (gamma[i] - gamma[j]).exp();
            }
        }
        // U = T⁻¹ (β V), W = T⁻¹ (β K e^γ) with T = I + strictly_lower(A): forward substitution.
        let mut u = vec![0.0f32; m * dv];
        let mut w = vec![0.0f32; m * dk];
        for i in 0..m {
            for c in 0..dv {
                u[i * dv + c] = beta[i] * v[i * dv + c];
            }
            let scale = beta[i] * gamma[i].exp();
            for c in 0..dk {
                w[i * dk + c] = scale * k[i * dk + c];
            }
            for j in 0..i {
                let coefficient = a[i * m + j];
                if coefficient == 0.0 {
                    continue;
                }
                let (done, current) = u.split_at_mut(i * dv);
                for (x, y) in current[..dv].iter_mut().zip(&done[j * dv..(j + 1) * dv]) {
                    *x -= coefficient * y;
                }
                let (done, current) = w.split_at_mut(i * dk);
                for (x, y) in current[..dk].iter_mut().zip(&done[j * dk..(j + 1) * dk]) {
                    *x -= coefficient * y;
                }
            }
        }
        // V' = U − W S.
        let mut v_new = u;
        for i in 0..m {
            let row = &mut v_new[i * dv..(i + 1) * dv];
            for d in 0..dk {
                let wd = w[i * dk + d];
                let state_row = &state[d * dv..(d + 1) * dv];
                for (x, s) in row.iter_mut().zip(state_row) {
                    *x -= wd * s;
                }
            }
        }
        // O_i = e^{γ_i} q_i S + Σ_{j≤i} (q_i·k_j) e^{γ_i−γ_j} V'_j.
        for i in 0..m {
            let qi = &q[i * dk..(i + 1) * dk];
            let oi = &mut out[i * dv..(i + 1) * dv];
            oi.iter_mut().for_each(|o| *o = 0.0);
            let decay = gamma[i].exp();
            for d in 0..dk {
                let factor = qi[d] * decay;
                let state_row = &state[d * dv..(d + 1) * dv];
                for (o, s) in oi.iter_mut().zip(state_row) {
                    *o += factor * s;
                }
            }
            for j in 0..=i {
                let factor = dot(qi, key(j)) * (gamma[i] - gamma[j]).exp();
                for (o, x) in oi.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                    *o += factor * x;
                }
            }
        }
        // S ← e^{γ_last} S + Σ_j e^{γ_last − γ_j} k_j ⊗ V'_j.
        let last = gamma[m - 1];
        let decay = last.exp();
        state.iter_mut().for_each(|s| *s *= decay);
        for j in 0..m {
            let factor = (last - gamma[j]).exp();
            let kj = key(j);
            let vj = &v_new[j * dv..(j + 1) * dv];
            for d in 0..dk {
                let scale = factor * kj[d];
                let state_row = &mut state[d * dv..(d + 1) * dv];
                for (s, x) in state_row.iter_mut().zip(vj) {
                    *s += scale * x;
                }
            }
        }
        chunk_start += m;
    }
}

impl CpuBackend {
    fn map(&self, x: &CpuTensor, f: impl Fn(f32) -> f32) -> CpuTensor {
        CpuTensor {
            rows: x.rows,
            cols: x.cols,
            data: x.data.iter().map(|&v| f(v)).collect(),
        }
    }

    fn zip(&self, a: &CpuTensor, b: &CpuTensor, f: impl Fn(f32, f32) -> f32) -> CpuTensor {
        debug_assert_eq!((a.rows, a.cols), (b.rows, b.cols));
        CpuTensor {
            rows: a.rows,
            cols: a.cols,
            data: a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
        }
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type KvCache = CpuKvCache;
    type ConvState = CpuConvState;
    type RecurrentState = CpuRecurrentState;
    type ExpertSlots = CpuExpertSlots;
    /// The host reference itself.
    type QsaCache = HostQsaCache;
    /// Computed at once: the host is where this backend computes.
    type PendingRouting = (Routing, Vec<f32>);
    /// The CPU runs every op as it comes: it has no step graphs.
    type StepGraph = std::convert::Infallible;
    type WorkerHandoff = std::convert::Infallible;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn computes_on_host(&self) -> bool {
        true
    }

    fn load_matrix(&self, artifact: &Arc<Artifact>, name: &str) -> Result<CpuWeight, EngineError> {
        let stored = StoredWeight::new(artifact, name)?;
        let (rows, cols) = stored.shape();
        Ok(CpuWeight {
            stored: Some(stored),
            rows,
            cols,
            parameter: None,
        })
    }

    fn parameter_from_values(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CpuWeight, EngineError> {
        if values.len() != rows * cols {
            return Err(EngineError::InvalidConfig {
                problem: format!("a parameter of {} values for {rows}×{cols}", values.len()),
            });
        }
        Ok(CpuWeight {
            stored: None,
            rows,
            cols,
            parameter: Some(values.to_vec()),
        })
    }

    fn reshape(
        &self,
        mut tensor: CpuTensor,
        rows: usize,
        cols: usize,
    ) -> Result<CpuTensor, EngineError> {
        crate::backend::check_reshape((tensor.rows, tensor.cols), (rows, cols))?;
        tensor.rows = rows;
        tensor.cols = cols;
        Ok(tensor)
    }

    fn load_parameter(
        &self,
        artifact: &Arc<Artifact>,
        name: &str,
    ) -> Result<CpuWeight, EngineError> {
        let stored = StoredWeight::new(artifact, name)?;
        let (rows, cols) = stored.shape();
        let values = stored.matrix().to_f32_vec();
        Ok(CpuWeight {
            stored: Some(stored),
            rows,
            cols,
            parameter: Some(values),
        })
    }

    fn weight_shape(&self, weight: &CpuWeight) -> (usize, usize) {
        (weight.rows, weight.cols)
    }

    fn upload(&self, values: &[f32], rows: usize, cols: usize) -> Result<CpuTensor, EngineError> {
        Ok(CpuTensor {
            rows,
            cols,
            data: values.to_vec(),
        })
    }

    fn download(&self, tensor: &CpuTensor) -> Result<Vec<f32>, EngineError> {
        Ok(tensor.data.clone())
    }

    fn shape(&self, tensor: &CpuTensor) -> (usize, usize) {
        (tensor.rows, tensor.cols)
    }

    fn gather_rows(&self, tensor: &CpuTensor, rows: &[usize]) -> Result<CpuTensor, EngineError> {
        let mut data = Vec::with_capacity(rows.len() * tensor.cols);
        for &row in rows {
            data.extend_from_slice(tensor.row(row));
        }
        Ok(CpuTensor {
            rows: rows.len(),
            cols: tensor.cols,
            data,
        })
    }

    fn columns(&self, tensor: &CpuTensor, range: Range<usize>) -> Result<CpuTensor, EngineError> {
        let mut data = Vec::with_capacity(tensor.rows * range.len());
        for row in 0..tensor.rows {
            data.extend_from_slice(&tensor.row(row)[range.clone()]);
        }
        Ok(CpuTensor {
            rows: tensor.rows,
            cols: range.len(),
            data,
        })
    }

    fn split_interleaved(
        &self,
        tensor: &CpuTensor,
        groups: usize,
        first: usize,
        second: usize,
    ) -> Result<(CpuTensor, CpuTensor), EngineError> {
        let mut a = CpuTensor::zeros(tensor.rows, groups * first);
        let mut b = CpuTensor::zeros(tensor.rows, groups * second);
        for row in 0..tensor.rows {
            let source = tensor.row(row);
            for group in 0..groups {
                let base = group * (first + second);
                a.row_mut(row)[group * first..(group + 1) * first]
                    .copy_from_slice(&source[base..base + first]);
                b.row_mut(row)[group * second..(group + 1) * second]
                    .copy_from_slice(&source[base + first..base + first + second]);
            }
        }
        Ok((a, b))
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor, EngineError> {
        let mut out = CpuTensor::zeros(ids.len(), table.cols);
        if let Some(matrix) = table.stored.as_ref().map(StoredWeight::matrix) {
            for (row, &id) in ids.iter().enumerate() {
                // Ids are checked against the vocabulary by the model before any op runs.
                if (id as usize) < matrix.rows {
                    matrix.decode_rows(id as usize, 1, out.row_mut(row));
                }
            }
        }
        Ok(out)
    }

    fn matmul(&self, x: &CpuTensor, weight: &CpuWeight) -> Result<CpuTensor, EngineError> {
        let mut out = CpuTensor::zeros(x.rows, weight.rows);
        if let Some(matrix) = weight.stored.as_ref().map(StoredWeight::matrix) {
            matmul_into(&matrix, x, &mut out);
        }
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        weight: &CpuWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CpuTensor, EngineError> {
        let w = weight.parameter();
        let group = w.len().max(1);
        let offset = match style {
            NormStyle::Plain => 0.0,
            NormStyle::ZeroCentred => 1.0,
        };
        let mut out = x.clone();
        for chunk in out.data.chunks_mut(group) {
            let mean_square = chunk.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inverse = 1.0 / (mean_square + eps).sqrt();
            for (value, wi) in chunk.iter_mut().zip(w) {
                *value = *value * inverse * (offset + wi);
            }
        }
        Ok(out)
    }

    fn gated_rms_norm(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        weight: &CpuWeight,
        eps: f32,
    ) -> Result<CpuTensor, EngineError> {
        let normed = self.rms_norm(x, weight, eps, NormStyle::Plain)?;
        Ok(self.zip(&normed, gate, |value, z| value * silu(z)))
    }

    fn rope(&self, x: &mut CpuTensor, rotation: &Rotation<'_>) -> Result<(), EngineError> {
        let (positions, head_dim) = (rotation.positions, rotation.head_dim);
        let (rotary_dim, theta) = (rotation.rotary_dim, rotation.theta);
        let inverse_frequencies = rope_inverse_frequencies(rotary_dim, theta);
        let half = rotary_dim / 2;
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        for (row, &position) in positions.iter().enumerate().take(x.rows) {
            for i in 0..half {
                let angle = position as f32 * inverse_frequencies[i];
                cos[i] = angle.cos();
                sin[i] = angle.sin();
            }
            for head in x.row_mut(row).chunks_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
        Ok(())
    }

    fn add_assign(&self, a: &mut CpuTensor, b: &CpuTensor) -> Result<(), EngineError> {
        for (x, y) in a.data.iter_mut().zip(&b.data) {
            *x += y;
        }
        Ok(())
    }

    fn silu_mul_halves(&self, gate_up: &CpuTensor) -> Result<CpuTensor, EngineError> {
        let half = gate_up.cols / 2;
        let mut out = CpuTensor::zeros(gate_up.rows, half);
        for row in 0..gate_up.rows {
            let source = gate_up.row(row);
            swiglu_halves(&source[..2 * half], out.row_mut(row));
        }
        Ok(out)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor, EngineError> {
        Ok(self.zip(gate, up, |g, u| silu(g) * u))
    }

    fn mul_sigmoid(&self, x: &CpuTensor, gate: &CpuTensor) -> Result<CpuTensor, EngineError> {
        Ok(self.zip(x, gate, |v, g| v * sigmoid(g)))
    }

    fn add_sigmoid_scaled_rows(
        &self,
        a: &mut CpuTensor,
        b: &CpuTensor,
        gate: &CpuTensor,
    ) -> Result<(), EngineError> {
        for row in 0..a.rows {
            let scale = sigmoid(gate.data[row * gate.cols]);
            let source = b.row(row).to_vec();
            for (x, y) in a.row_mut(row).iter_mut().zip(&source) {
                *x += scale * y;
            }
        }
        Ok(())
    }

    fn row_weighted_rms_norm(
        &self,
        x: &CpuTensor,
        weight: &CpuWeight,
        group: usize,
        eps: f32,
        style: NormStyle,
    ) -> Result<CpuTensor, EngineError> {
        let w = weight.parameter();
        if group == 0 || w.len() != x.cols || x.cols % group != 0 {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "row_weighted_rms_norm: groups of {group} with a weight of {} over rows of {}",
                    w.len(),
                    x.cols
                ),
            });
        }
        let offset = match style {
            NormStyle::Plain => 0.0,
            NormStyle::ZeroCentred => 1.0,
        };
        let mut out = x.clone();
        for row in out.data.chunks_exact_mut(x.cols) {
            for (chunk, weights) in row.chunks_exact_mut(group).zip(w.chunks_exact(group)) {
                let mean_square = chunk.iter().map(|v| v * v).sum::<f32>() / group as f32;
                let inverse = 1.0 / (mean_square + eps).sqrt();
                for (value, wi) in chunk.iter_mut().zip(weights) {
                    *value = *value * inverse * (offset + wi);
                }
            }
        }
        Ok(out)
    }

    fn scaled_silu(&self, x: &CpuTensor, scale: f32) -> Result<CpuTensor, EngineError> {
        Ok(self.map(x, |v| silu(v * scale)))
    }

    fn stream_mix(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CpuTensor, EngineError> {
        if streams == 0 || x.cols % streams != 0 || (gate.rows, gate.cols) != (x.rows, x.cols) {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "stream_mix: {streams} streams over {}×{} with a gate of {}×{}",
                    x.rows, x.cols, gate.rows, gate.cols
                ),
            });
        }
        let width = x.cols / streams;
        let mut out = CpuTensor::zeros(x.rows, width);
        for row in 0..x.rows {
            let (values, gates) = (x.row(row), gate.row(row));
            let mixed = out.row_mut(row);
            for stream in 0..streams {
                let base = stream * width;
                for (i, value) in mixed.iter_mut().enumerate() {
                    *value += sigmoid(gates[base + i]) * values[base + i];
                }
            }
            for value in mixed.iter_mut() {
                *value *= scale;
            }
        }
        Ok(out)
    }

    fn inject_into_streams(
        &self,
        streams: &mut CpuTensor,
        output: &CpuTensor,
        shares: &CpuTensor,
        scale: f32,
    ) -> Result<(), EngineError> {
        let count = shares.cols;
        if count == 0
            || shares.rows != streams.rows
            || output.rows != streams.rows
            || streams.cols != count * output.cols
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "inject_into_streams: streams {}×{}, output {}×{}, shares {}×{}",
                    streams.rows, streams.cols, output.rows, output.cols, shares.rows, shares.cols
                ),
            });
        }
        let width = output.cols;
        for row in 0..streams.rows {
            let out = output.row(row);
            let row_shares = shares.row(row);
            let target = streams.row_mut(row);
            for (stream, share) in row_shares.iter().enumerate() {
                let share = 2.0 * sigmoid(share * scale);
                for (value, o) in target[stream * width..(stream + 1) * width]
                    .iter_mut()
                    .zip(out)
                {
                    *value += share * o;
                }
            }
        }
        Ok(())
    }

    fn ple_gate(
        &self,
        keys: &CpuTensor,
        queries: &CpuTensor,
        values: &CpuTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CpuTensor, EngineError> {
        let width = values.cols;
        if (keys.rows, keys.cols) != (queries.rows, queries.cols)
            || keys.rows != values.rows
            || keys.cols != streams * width
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "ple_gate: keys {}×{}, queries {}×{}, values {}×{}, {streams} streams",
                    keys.rows, keys.cols, queries.rows, queries.cols, values.rows, values.cols
                ),
            });
        }
        let mut out = Vec::with_capacity(keys.rows * keys.cols);
        for row in 0..keys.rows {
            let (key_row, query_row, value) = (keys.row(row), queries.row(row), values.row(row));
            for stream in 0..streams {
                let base = stream * width;
                let dot: f32 = key_row[base..base + width]
                    .iter()
                    .zip(&query_row[base..base + width])
                    .map(|(k, q)| k * q)
                    .sum::<f32>()
                    * scale;
                // sign(g)·sqrt(max(|g|, 1e-6)), with sign(0) = 0 as in torch.
                let gate = if dot == 0.0 {
                    0.0
                } else {
                    dot.signum() * dot.abs().max(1e-6).sqrt()
                };
                let gate = sigmoid(gate);
                out.extend(value.iter().map(|v| gate * v));
            }
        }
        Ok(CpuTensor {
            rows: keys.rows,
            cols: keys.cols,
            data: out,
        })
    }

    fn route_top_k(
        &self,
        logits: &CpuTensor,
        k: usize,
        normalize: bool,
    ) -> Result<Routing, EngineError> {
        Ok(route_top_k_host(&logits.data, logits.cols, k, normalize))
    }

    fn start_routing(
        &self,
        logits: &CpuTensor,
        k: usize,
        normalize: bool,
        hidden: &CpuTensor,
        read_hidden: bool,
    ) -> Result<(Routing, Vec<f32>), EngineError> {
        let routing = self.route_top_k(logits, k, normalize)?;
        let values = if read_hidden {
            hidden.data.clone()
        } else {
            Vec::new()
        };
        Ok((routing, values))
    }

    fn slotted_experts_by_pending_routing(
        &self,
        slots: &CpuExpertSlots,
        x: &CpuTensor,
        routing: &(Routing, Vec<f32>),
    ) -> Result<CpuTensor, EngineError> {
        self.slotted_experts(slots, x, &routing.0)
    }

    fn finish_routing(
        &self,
        routing: (Routing, Vec<f32>),
    ) -> Result<(Routing, Vec<f32>), EngineError> {
        Ok(routing)
    }

    fn peek_routing(&self, pending: &(Routing, Vec<f32>)) -> Result<Routing, EngineError> {
        Ok(pending.0.clone())
    }

    fn set_worker_handoff_owners(
        &self,
        handoff: &Self::WorkerHandoff,
        _owned: &[std::ops::Range<usize>],
    ) -> Result<(), EngineError> {
        match *handoff {}
    }

    fn post_to_workers(
        &self,
        handoff: &Self::WorkerHandoff,
        _layer: usize,
        _x: &CpuTensor,
        _pending: &Self::PendingRouting,
        _resident: Option<&Self::ExpertSlots>,
    ) -> Result<(), EngineError> {
        match *handoff {}
    }

    fn collect_from_workers(
        &self,
        handoff: &Self::WorkerHandoff,
        _rows: usize,
    ) -> Result<CpuTensor, EngineError> {
        match *handoff {}
    }

    fn take_worker_handoff_failure(
        &self,
        handoff: &Self::WorkerHandoff,
    ) -> Result<Option<crate::backend::WorkerHandoffFailure>, EngineError> {
        match *handoff {}
    }

    fn begin_step_graph(
        &self,
        graph: &mut Self::StepGraph,
        _ids: &[u32],
        _positions: &[usize],
    ) -> Result<crate::backend::StepGraphRun, EngineError> {
        match *graph {}
    }

    fn end_step_graph(
        &self,
        graph: &mut Self::StepGraph,
        _ops_succeeded: bool,
    ) -> Result<crate::backend::StepGraphEnd, EngineError> {
        match *graph {}
    }

    fn new_kv_cache(&self, max_tokens: usize, kv_width: usize) -> Result<CpuKvCache, EngineError> {
        Ok(CpuKvCache {
            max_tokens,
            kv_width,
            len: 0,
            keys: vec![0.0; max_tokens * kv_width],
            values: vec![0.0; max_tokens * kv_width],
        })
    }

    fn copy_kv_rows(
        &self,
        source: &CpuKvCache,
        from: Range<usize>,
        target: &mut CpuKvCache,
        to: usize,
    ) -> Result<(), EngineError> {
        let width = source.kv_width;
        let end = to + from.len();
        if target.kv_width != width || from.end > source.max_tokens || end > target.max_tokens {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "copy_kv_rows: positions {from:?} of a {}-position cache of width {width} to {to}.. of a {}-position cache of width {}",
                    source.max_tokens, target.max_tokens, target.kv_width
                ),
            });
        }
        let (source_rows, target_rows) = (
            from.start * width..from.end * width,
            to * width..end * width,
        );
        target.keys[target_rows.clone()].copy_from_slice(&source.keys[source_rows.clone()]);
        target.values[target_rows].copy_from_slice(&source.values[source_rows]);
        target.len = target.len.max(end);
        Ok(())
    }

    fn kv_cache_bytes(&self, cache: &CpuKvCache) -> usize {
        (cache.keys.len() + cache.values.len()) * std::mem::size_of::<f32>()
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CpuKvCache>],
    ) -> Result<CpuTensor, EngineError> {
        let hd = spec.head_dim;
        let group = spec.heads / spec.kv_heads.max(1);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = CpuTensor::zeros(q.rows, spec.heads * hd);
        for segment in segments.iter_mut() {
            let cache = &mut *segment.state;
            let width = cache.kv_width;
            let end = segment.start_position + segment.rows.len();
            if end > cache.max_tokens {
                return Err(EngineError::ContextFull {
                    held: segment.start_position,
                    added: segment.rows.len(),
                    max_context: cache.max_tokens,
                });
            }
            for (offset, row) in segment.rows.clone().enumerate() {
                let at = (segment.start_position + offset) * width;
                cache.keys[at..at + width].copy_from_slice(k.row(row));
                cache.values[at..at + width].copy_from_slice(v.row(row));
            }
            cache.len = end;
            let mut scores = vec![0.0f32; end];
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = segment.start_position + offset;
                let first_key = match spec.sliding_window {
                    Some(window) => (position + 1).saturating_sub(window),
                    None => 0,
                };
                for head in 0..spec.heads {
                    let kv_head = head / group.max(1);
                    let query = &q.row(row)[head * hd..(head + 1) * hd];
                    let mut max_score = f32::NEG_INFINITY;
                    for key_position in first_key..=position {
                        let at = key_position * width + kv_head * hd;
                        let score = dot(query, &cache.keys[at..at + hd]) * scale;
                        scores[key_position] = score;
                        max_score = max_score.max(score);
                    }
                    let mut total = 0.0f32;
                    for score in &mut scores[first_key..=position] {
                        *score = (*score - max_score).exp();
                        total += *score;
                    }
                    let output = &mut out.row_mut(row)[head * hd..(head + 1) * hd];
                    for key_position in first_key..=position {
                        let weight = scores[key_position] / total;
                        let at = key_position * width + kv_head * hd;
                        for (o, value) in output.iter_mut().zip(&cache.values[at..at + hd]) {
                            *o += weight * value;
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    fn new_qsa_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
        settings: &QsaSelectionSettings,
    ) -> Result<HostQsaCache, EngineError> {
        HostQsaCache::new(max_tokens, kv_width, settings)
    }

    fn qsa_cache_tokens(&self, cache: &HostQsaCache) -> usize {
        cache.tokens()
    }

    fn truncate_qsa_cache(&self, cache: &mut HostQsaCache, tokens: usize) {
        cache.truncate(tokens);
    }

    fn copy_qsa_rows(
        &self,
        source: &HostQsaCache,
        from: Range<usize>,
        target: &mut HostQsaCache,
        to: usize,
    ) -> Result<(), EngineError> {
        target.append_rows_of(source, from, to)
    }

    fn qsa_cache_bytes(&self, cache: &HostQsaCache) -> usize {
        cache.bytes()
    }

    fn qsa_append(
        &self,
        k: &CpuTensor,
        v: &CpuTensor,
        index_qk: &CpuTensor,
        key_norm: &CpuWeight,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<(), EngineError> {
        let width = settings.index_head_dim;
        let raw_start = settings.index_heads * width;
        if index_qk.cols != raw_start + width || k.rows != v.rows || k.rows != index_qk.rows {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "qsa_append: index projection {}×{} (expected {} columns), k {} rows, v {} rows",
                    index_qk.rows,
                    index_qk.cols,
                    raw_start + width,
                    k.rows,
                    v.rows
                ),
            });
        }
        for segment in segments.iter() {
            let cache = &*segment.state;
            let end = segment.start_position + segment.rows.len();
            check_segment_rows(&segment.rows, k.rows, "qsa_append")?;
            if end > cache.max_tokens {
                return Err(EngineError::ContextFull {
                    held: segment.start_position,
                    added: segment.rows.len(),
                    max_context: cache.max_tokens,
                });
            }
        }
        for segment in segments.iter_mut() {
            let cache = &mut *segment.state;
            // Appending at the start position: a cache that holds more is cut back first.
            cache.truncate(segment.start_position);
            if cache.tokens() != segment.start_position {
                return Err(EngineError::InvalidConfig {
                    problem: format!(
                        "qsa_append at position {} of a cache holding {} tokens",
                        segment.start_position,
                        cache.tokens()
                    ),
                });
            }
            for row in segment.rows.clone() {
                cache.push(
                    k.row(row),
                    v.row(row),
                    &index_qk.row(row)[raw_start..],
                    key_norm.parameter(),
                    settings,
                )?;
            }
        }
        Ok(())
    }

    fn qsa_index_queries(
        &self,
        index_qk: &CpuTensor,
        query_norm: &CpuWeight,
        settings: &QsaSelectionSettings,
        positions: &[usize],
    ) -> Result<CpuTensor, EngineError> {
        let width = settings.index_heads * settings.index_head_dim;
        if index_qk.cols < width
            || positions.len() != index_qk.rows
            || query_norm.parameter().len() != settings.index_head_dim
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "qsa_index_queries: projection {}×{}, {} positions, a query norm of {} for {} heads of {}",
                    index_qk.rows,
                    index_qk.cols,
                    positions.len(),
                    query_norm.parameter().len(),
                    settings.index_heads,
                    settings.index_head_dim
                ),
            });
        }
        let mut data = Vec::with_capacity(index_qk.rows * width);
        for (row, &position) in positions.iter().enumerate() {
            data.extend(prepare_index_query(
                &index_qk.row(row)[..width],
                query_norm.parameter(),
                position,
                settings,
            ));
        }
        Ok(CpuTensor {
            rows: index_qk.rows,
            cols: width,
            data,
        })
    }

    fn qsa_attention(
        &self,
        q: &CpuTensor,
        index_queries: &CpuTensor,
        spec: &AttentionSpec,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<CpuTensor, EngineError> {
        let width = spec.heads * spec.head_dim;
        if q.cols != width || q.rows != index_queries.rows || spec.kv_heads == 0 {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "qsa_attention: q {}×{} for {} heads of {}, {} index query rows",
                    q.rows, q.cols, spec.heads, spec.head_dim, index_queries.rows
                ),
            });
        }
        let shape = AttendShape {
            heads: spec.heads,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
        };
        let mut out = CpuTensor::zeros(q.rows, width);
        for segment in segments.iter() {
            check_segment_rows(&segment.rows, q.rows, "qsa_attention")?;
            let cache = &*segment.state;
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = segment.start_position + offset;
                let selected = cache.select(index_queries.row(row), position, settings)?;
                cache.attend(q.row(row), &selected, shape, out.row_mut(row));
            }
        }
        Ok(out)
    }

    fn qsa_selected_tokens(
        &self,
        index_queries: &CpuTensor,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<Vec<Vec<usize>>, EngineError> {
        let mut selected = vec![Vec::new(); index_queries.rows];
        for segment in segments.iter() {
            check_segment_rows(&segment.rows, index_queries.rows, "qsa_selected_tokens")?;
            for (offset, row) in segment.rows.clone().enumerate() {
                let position = segment.start_position + offset;
                let tokens = segment
                    .state
                    .select(index_queries.row(row), position, settings)?;
                if let Some(slot) = selected.get_mut(row) {
                    *slot = tokens;
                }
            }
        }
        Ok(selected)
    }

    fn new_conv_state(&self, channels: usize, kernel: usize) -> Result<CpuConvState, EngineError> {
        Ok(CpuConvState {
            channels,
            kernel,
            history: vec![0.0; kernel.saturating_sub(1) * channels],
        })
    }

    fn causal_conv1d_silu(
        &self,
        x: &CpuTensor,
        weight: &CpuWeight,
        segments: &mut [Segment<'_, CpuConvState>],
    ) -> Result<CpuTensor, EngineError> {
        let taps = weight.parameter();
        let channels = x.cols;
        let mut out = CpuTensor::zeros(x.rows, channels);
        for segment in segments.iter_mut() {
            let state = &mut *segment.state;
            let kernel = state.kernel;
            let context = kernel - 1;
            // History rows then this segment's rows: output t sees rows t .. t+kernel-1.
            let mut extended = state.history.clone();
            for row in segment.rows.clone() {
                extended.extend_from_slice(x.row(row));
            }
            for (offset, row) in segment.rows.clone().enumerate() {
                let output = out.row_mut(row);
                for c in 0..channels {
                    let mut sum = 0.0f32;
                    for j in 0..kernel {
                        sum += taps[c * kernel + j] * extended[(offset + j) * channels + c];
                    }
                    output[c] = silu(sum);
                }
            }
            let total_rows = extended.len() / channels;
            state.history = extended[(total_rows - context) * channels..].to_vec();
        }
        Ok(out)
    }

    fn delta_rule_gates(
        &self,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &CpuWeight,
        dt_bias: &CpuWeight,
    ) -> Result<(CpuTensor, CpuTensor), EngineError> {
        let a_log = a_log.parameter();
        let dt_bias = dt_bias.parameter();
        let mut g = CpuTensor::zeros(a.rows, a.cols);
        for row in 0..a.rows {
            let source = a.row(row);
            for (h, value) in g.row_mut(row).iter_mut().enumerate() {
                *value = -a_log[h].exp() * softplus(source[h] + dt_bias[h]);
            }
        }
        Ok((g, self.map(b, sigmoid)))
    }

    fn copy_conv_state(&self, state: &CpuConvState) -> Result<CpuConvState, EngineError> {
        Ok(CpuConvState {
            channels: state.channels,
            kernel: state.kernel,
            history: state.history.clone(),
        })
    }

    fn copy_recurrent_state(
        &self,
        state: &CpuRecurrentState,
    ) -> Result<CpuRecurrentState, EngineError> {
        Ok(CpuRecurrentState {
            spec: state.spec,
            state: state.state.clone(),
        })
    }

    fn new_recurrent_state(&self, spec: &DeltaRuleSpec) -> Result<CpuRecurrentState, EngineError> {
        Ok(CpuRecurrentState {
            spec: *spec,
            state: vec![0.0; spec.value_heads * spec.key_head_dim * spec.value_head_dim],
        })
    }

    fn gated_delta_rule(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        g: &CpuTensor,
        beta: &CpuTensor,
        spec: &DeltaRuleSpec,
        form: DeltaRuleForm,
        segments: &mut [Segment<'_, CpuRecurrentState>],
    ) -> Result<CpuTensor, EngineError> {
        let (dk, dv, nv) = (spec.key_head_dim, spec.value_head_dim, spec.value_heads);
        let ratio = (nv / spec.key_heads.max(1)).max(1);
        let scale = 1.0 / (dk as f32).sqrt();
        let mut out = CpuTensor::zeros(q.rows, nv * dv);
        for segment in segments.iter_mut() {
            let n = segment.rows.len();
            let chunked = match form {
                DeltaRuleForm::Auto => n > 1,
                DeltaRuleForm::Chunked => true,
                DeltaRuleForm::Recurrent => false,
            };
            let mut qh = vec![0.0f32; n * dk];
            let mut kh = vec![0.0f32; n * dk];
            let mut vh = vec![0.0f32; n * dv];
            let mut gh = vec![0.0f32; n];
            let mut bh = vec![0.0f32; n];
            let mut oh = vec![0.0f32; n * dv];
            for head in 0..nv {
                let key_head = head / ratio;
                for (t, row) in segment.rows.clone().enumerate() {
                    let keys = key_head * dk..(key_head + 1) * dk;
                    l2_normalize_into(
                        &q.row(row)[keys.clone()],
                        scale,
                        &mut qh[t * dk..(t + 1) * dk],
                    );
                    l2_normalize_into(&k.row(row)[keys], 1.0, &mut kh[t * dk..(t + 1) * dk]);
                    vh[t * dv..(t + 1) * dv]
                        .copy_from_slice(&v.row(row)[head * dv..(head + 1) * dv]);
                    gh[t] = g.row(row)[head];
                    bh[t] = beta.row(row)[head];
                }
                let state = &mut segment.state.state[head * dk * dv..(head + 1) * dk * dv];
                if chunked {
                    delta_rule_chunked(&qh, &kh, &vh, &gh, &bh, dk, dv, state, &mut oh);
                } else {
                    delta_rule_recurrent(&qh, &kh, &vh, &gh, &bh, dk, dv, state, &mut oh);
                }
                for (t, row) in segment.rows.clone().enumerate() {
                    out.row_mut(row)[head * dv..(head + 1) * dv]
                        .copy_from_slice(&oh[t * dv..(t + 1) * dv]);
                }
            }
        }
        Ok(out)
    }

    fn new_expert_slots(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<CpuExpertSlots, EngineError> {
        let bytes = slots
            .checked_mul(layout.stride)
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: format!("{slots} expert slots of {} bytes overflow", layout.stride),
            })?;
        Ok(CpuExpertSlots {
            layout: *layout,
            storage: vec![0; bytes],
            table: ExpertSlotTable::new(num_experts, slots),
            fills_in_flight: Vec::new(),
            batch_fills: Default::default(),
            fill_delay: self.expert_fill_delay,
        })
    }

    fn fill_expert_slot(
        &self,
        slots: &mut CpuExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        let source = expert_bytes(artifact, bank, expert, &slots.layout)?;
        let stride = slots.layout.stride;
        slots.table.check(slot, expert).map_err(slot_out_of_range)?;
        slots.storage[slot * stride..(slot + 1) * stride].copy_from_slice(source);
        slots
            .table
            .assign(slot, expert)
            .map_err(slot_out_of_range)?;
        Ok(())
    }

    fn slotted_experts(
        &self,
        slots: &CpuExpertSlots,
        x: &CpuTensor,
        routing: &Routing,
    ) -> Result<CpuTensor, EngineError> {
        let hidden = slots.layout.hidden;
        let intermediate = slots.layout.intermediate;
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        let k = routing.experts_per_token;
        if x.cols != hidden || routing.expert_ids.len() != x.rows * k {
            // Shapes are validated at model load; an inconsistent call leaves zeros.
            return Ok(out);
        }
        // Each slot's matrix views once per call, not once per (token, choice).
        let matrices: Vec<_> = (0..slots.table.slot_count())
            .map(|slot| slots.expert_matrices(slot).ok())
            .collect();
        let mut gate_up = vec![0.0f32; 2 * intermediate];
        let mut activated = vec![0.0f32; intermediate];
        let mut y = vec![0.0f32; hidden];
        for t in 0..x.rows {
            for j in 0..k {
                let expert = routing.expert_ids[t * k + j] as usize;
                let Some((gate_up_matrix, down_matrix)) = slots
                    .table
                    .slot_of(expert)
                    .and_then(|slot| matrices.get(slot).copied().flatten())
                else {
                    continue;
                };
                gate_up_matrix.matmul(x.row(t), 1, &mut gate_up);
                swiglu_halves(&gate_up, &mut activated);
                down_matrix.matmul(&activated, 1, &mut y);
                let weight = routing.weights[t * k + j];
                for (o, v) in out.row_mut(t).iter_mut().zip(&y) {
                    *o += weight * v;
                }
            }
        }
        Ok(out)
    }

    fn logit_candidates(
        &self,
        logits: &CpuTensor,
        k: usize,
        extra: &[Vec<u32>],
    ) -> Result<Vec<super::LogitCandidates>, EngineError> {
        super::candidates::check_candidate_request(logits.rows, logits.cols, k, extra)?;
        super::candidates::host_candidates(&logits.data, logits.cols, k, extra)
    }

    fn reserve_host_kv(&self, request: &super::HostKvRequest) -> Result<(), EngineError> {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        if request.host_bytes > 0 {
            LOGGED.call_once(|| {
                tracing::info!(
                    "--host-kv-mib is for the GPU; the CPU backend keeps every KV cache in host memory"
                )
            });
        }
        Ok(())
    }
}

/// `out = x · Wᵀ`.
fn matmul_into(matrix: &WeightMatrix<'_>, x: &CpuTensor, out: &mut CpuTensor) {
    if x.cols != matrix.cols {
        // Shapes are validated at model load; an inconsistent call leaves zeros.
        return;
    }
    matrix.matmul(&x.data, x.rows, &mut out.data);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Xoshiro256;

    fn random(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
        (0..count)
            .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
            .collect()
    }

    fn normalised_rows(rng: &mut Xoshiro256, rows: usize, width: usize, scale: f32) -> Vec<f32> {
        let raw = random(rng, rows * width, 1.0);
        let mut out = vec![0.0; rows * width];
        for r in 0..rows {
            l2_normalize_into(
                &raw[r * width..(r + 1) * width],
                scale,
                &mut out[r * width..(r + 1) * width],
            );
        }
        out
    }

    /// The chunked and recurrent forms agree over several chunks, from a non-zero state, and
    /// leave the same state behind.
    #[test]
    fn chunked_and_recurrent_delta_rule_agree() {
        let (n, dk, dv) = (150, 16, 12);
        let mut rng = Xoshiro256::seed_from_u64(3);
        let q = normalised_rows(&mut rng, n, dk, 1.0 / (dk as f32).sqrt());
        let k = normalised_rows(&mut rng, n, dk, 1.0);
        let v = random(&mut rng, n * dv, 1.0);
        let g: Vec<f32> = random(&mut rng, n, 1.0)
            .iter()
            .map(|x| -x.abs() * 0.3)
            .collect();
        let beta: Vec<f32> = random(&mut rng, n, 1.0)
            .iter()
            .map(|x| sigmoid(*x * 3.0))
            .collect();
        let initial = random(&mut rng, dk * dv, 0.5);

        let mut state_recurrent = initial.clone();
        let mut out_recurrent = vec![0.0; n * dv];
        delta_rule_recurrent(
            &q,
            &k,
            &v,
            &g,
            &beta,
            dk,
            dv,
            &mut state_recurrent,
            &mut out_recurrent,
        );
        let mut state_chunked = initial.clone();
        let mut out_chunked = vec![0.0; n * dv];
        delta_rule_chunked(
            &q,
            &k,
            &v,
            &g,
            &beta,
            dk,
            dv,
            &mut state_chunked,
            &mut out_chunked,
        );

        let max_out = out_recurrent
            .iter()
            .zip(&out_chunked)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let max_state = state_recurrent
            .iter()
            .zip(&state_chunked)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("delta rule chunked vs recurrent: max |Δout| = {max_out:.2e}, max |Δstate| = {max_state:.2e}");
        assert!(max_out < 1e-5, "outputs differ by {max_out}");
        assert!(max_state < 1e-5, "states differ by {max_state}");
    }

    /// A straightforward loop for one step of the recurrence, written from the formula
    /// `S_t = e^{g}(I − β k kᵀ) S + β k vᵀ`, `o = Sᵀ q`.
    #[test]
    fn recurrent_step_matches_the_closed_form() {
        let (dk, dv) = (4, 3);
        let mut rng = Xoshiro256::seed_from_u64(9);
        let q = random(&mut rng, dk, 1.0);
        let k = random(&mut rng, dk, 1.0);
        let v = random(&mut rng, dv, 1.0);
        let (g, beta) = (-0.2f32, 0.7f32);
        let s0 = random(&mut rng, dk * dv, 1.0);
        let mut expected_state = vec![0.0f32; dk * dv];
        for i in 0..dk {
            for j in 0..dv {
                let mut projected = 0.0;
                for l in 0..dk {
                    let identity = if i == l { 1.0 } else { 0.0 };
                    projected += (identity - beta * k[i] * k[l]) * s0[l * dv + j];
                }
                expected_state[i * dv + j] = g.exp() * projected + beta * k[i] * v[j];
            }
        }
        let mut state = s0.clone();
        let mut out = vec![0.0; dv];
        delta_rule_recurrent(&q, &k, &v, &[g], &[beta], dk, dv, &mut state, &mut out);
        for (a, b) in state.iter().zip(&expected_state) {
            assert!((a - b).abs() < 1e-5);
        }
        for j in 0..dv {
            let expected: f32 = (0..dk).map(|i| expected_state[i * dv + j] * q[i]).sum();
            assert!((out[j] - expected).abs() < 1e-5);
        }
    }

    #[test]
    fn router_softmax_top_k_and_renormalisation() {
        let logits = [0.0f32, 2.0, 1.0, 2.0];
        let plain = route_top_k_host(&logits, 4, 2, false);
        assert_eq!(plain.expert_ids, vec![1, 3]);
        let total: f32 = logits.iter().map(|x| x.exp()).sum();
        assert!((plain.weights[0] - 2f32.exp() / total).abs() < 1e-6);
        let normalised = route_top_k_host(&logits, 4, 2, true);
        assert!((normalised.weights[0] - 0.5).abs() < 1e-6);
        assert!((normalised.weights[1] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_half_apart_and_leaves_the_rest() {
        let backend = CpuBackend::new();
        let mut x = CpuTensor {
            rows: 1,
            cols: 8,
            data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        };
        // rotary_dim 4 of head_dim 8: pairs (0,2), (1,3); dims 4..8 untouched.
        let rotation = Rotation {
            positions: &[3],
            head_dim: 8,
            rotary_dim: 4,
            theta: 10000.0,
        };
        backend.rope(&mut x, &rotation).unwrap();
        let inverse = rope_inverse_frequencies(4, 10000.0);
        let (c0, s0) = ((3.0 * inverse[0]).cos(), (3.0 * inverse[0]).sin());
        assert!((x.data[0] - (1.0 * c0 - 3.0 * s0)).abs() < 1e-6);
        assert!((x.data[2] - (3.0 * c0 + 1.0 * s0)).abs() < 1e-6);
        assert_eq!(&x.data[4..], &[5.0, 6.0, 7.0, 8.0]);
    }

    /// Feeding a conv in two pieces (state carried) equals feeding it at once.
    #[test]
    fn causal_conv_continues_from_its_state() {
        let backend = CpuBackend::new();
        let (channels, kernel, n) = (3, 4, 7);
        let mut rng = Xoshiro256::seed_from_u64(5);
        let x = CpuTensor {
            rows: n,
            cols: channels,
            data: random(&mut rng, n * channels, 1.0),
        };
        let taps = random(&mut rng, channels * kernel, 1.0);
        let weight = CpuWeight::from_parameter(taps, channels, kernel);
        let mut whole_state = backend.new_conv_state(channels, kernel).unwrap();
        let whole = backend
            .causal_conv1d_silu(
                &x,
                &weight,
                &mut [Segment {
                    rows: 0..n,
                    start_position: 0,
                    state: &mut whole_state,
                }],
            )
            .unwrap();
        let mut split_state = backend.new_conv_state(channels, kernel).unwrap();
        let first = backend
            .causal_conv1d_silu(
                &backend.gather_rows(&x, &[0, 1]).unwrap(),
                &weight,
                &mut [Segment {
                    rows: 0..2,
                    start_position: 0,
                    state: &mut split_state,
                }],
            )
            .unwrap();
        let rest: Vec<usize> = (2..n).collect();
        let second = backend
            .causal_conv1d_silu(
                &backend.gather_rows(&x, &rest).unwrap(),
                &weight,
                &mut [Segment {
                    rows: 0..n - 2,
                    start_position: 2,
                    state: &mut split_state,
                }],
            )
            .unwrap();
        let mut joined = first.data.clone();
        joined.extend_from_slice(&second.data);
        assert_eq!(joined, whole.data);
        assert_eq!(split_state.history, whole_state.history);
        // First output only sees the current token (zero history): silu(w[c, Kc-1] · x).
        let expected = silu(taps_last(&weight, 0, kernel) * x.data[0]);
        assert!((whole.data[0] - expected).abs() < 1e-6);
    }

    fn taps_last(weight: &CpuWeight, channel: usize, kernel: usize) -> f32 {
        weight.parameter()[channel * kernel + kernel - 1]
    }
}
