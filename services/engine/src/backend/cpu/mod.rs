//! The CPU backend: straightforward f32 loops, weights read in place from the mmapped artifact.
//!
//! Owns: the reference implementation of every [`Backend`] op. It is the numerical yardstick the
//! CUDA backend is checked against, so clarity wins over speed here; only the matmul (in
//! `crate::weights`) is blocked and threaded.
//! Must not touch: model structure, the artifact byte layout.

// Index loops mirror the formulas of MODELS.md one to one; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

mod attention;
mod delta_rule;
mod elementwise;
mod expert_slots;
mod qsa;
mod tensors;

use std::ops::Range;
use std::sync::Arc;

use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use super::qsa_host::HostQsaCache;
use super::{
    AttentionSpec, Backend, DeltaRuleForm, DeltaRuleSpec, NormStyle, Rotation, Routing, Segment,
};
use crate::error::EngineError;
use crate::host_math::{route_top_k_host, sigmoid, silu, swiglu_halves};
use crate::model::qwen4_exp::qsa_selection::QsaSelectionSettings;
use crate::weights::StoredWeight;

pub use delta_rule::DELTA_RULE_CHUNK;
pub use expert_slots::CpuExpertSlots;
use tensors::matmul_into;
pub use tensors::{CpuBackend, CpuConvState, CpuKvCache, CpuRecurrentState, CpuTensor, CpuWeight};

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

    fn concat_rows(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor, EngineError> {
        if a.cols != b.cols {
            return Err(EngineError::InvalidConfig {
                problem: format!("concat_rows of {} columns and {} columns", a.cols, b.cols),
            });
        }
        let mut data = Vec::with_capacity(a.data.len() + b.data.len());
        data.extend_from_slice(&a.data);
        data.extend_from_slice(&b.data);
        Ok(CpuTensor {
            rows: a.rows + b.rows,
            cols: a.cols,
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
        self.rms_norm_on_host(x, weight, eps, style)
    }

    fn gated_rms_norm(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        weight: &CpuWeight,
        eps: f32,
    ) -> Result<CpuTensor, EngineError> {
        self.gated_rms_norm_on_host(x, gate, weight, eps)
    }

    fn rope(&self, x: &mut CpuTensor, rotation: &Rotation<'_>) -> Result<(), EngineError> {
        self.rope_on_host(x, rotation)
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
        self.add_sigmoid_scaled_rows_on_host(a, b, gate)
    }

    fn row_weighted_rms_norm(
        &self,
        x: &CpuTensor,
        weight: &CpuWeight,
        group: usize,
        eps: f32,
        style: NormStyle,
    ) -> Result<CpuTensor, EngineError> {
        self.row_weighted_rms_norm_on_host(x, weight, group, eps, style)
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
        self.stream_mix_on_host(x, gate, streams, scale)
    }

    fn inject_into_streams(
        &self,
        streams: &mut CpuTensor,
        output: &CpuTensor,
        shares: &CpuTensor,
        scale: f32,
    ) -> Result<(), EngineError> {
        self.inject_into_streams_on_host(streams, output, shares, scale)
    }

    fn ple_gate(
        &self,
        keys: &CpuTensor,
        queries: &CpuTensor,
        values: &CpuTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CpuTensor, EngineError> {
        self.ple_gate_on_host(keys, queries, values, streams, scale)
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
        self.copy_kv_rows_on_host(source, from, target, to)
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
        self.attention_on_host(q, k, v, spec, segments)
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
        self.qsa_append_on_host(k, v, index_qk, key_norm, settings, segments)
    }

    fn qsa_index_queries(
        &self,
        index_qk: &CpuTensor,
        query_norm: &CpuWeight,
        settings: &QsaSelectionSettings,
        positions: &[usize],
    ) -> Result<CpuTensor, EngineError> {
        self.qsa_index_queries_on_host(index_qk, query_norm, settings, positions)
    }

    fn qsa_attention(
        &self,
        q: &CpuTensor,
        index_queries: &CpuTensor,
        spec: &AttentionSpec,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<CpuTensor, EngineError> {
        self.qsa_attention_on_host(q, index_queries, spec, settings, segments)
    }

    fn qsa_selected_tokens(
        &self,
        index_queries: &CpuTensor,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, HostQsaCache>],
    ) -> Result<Vec<Vec<usize>>, EngineError> {
        self.qsa_selected_tokens_on_host(index_queries, settings, segments)
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
        self.causal_conv1d_silu_on_host(x, weight, segments)
    }

    fn delta_rule_gates(
        &self,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &CpuWeight,
        dt_bias: &CpuWeight,
    ) -> Result<(CpuTensor, CpuTensor), EngineError> {
        self.delta_rule_gates_on_host(a, b, a_log, dt_bias)
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
        self.gated_delta_rule_on_host(q, k, v, g, beta, spec, form, segments)
    }

    fn new_expert_slots(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<CpuExpertSlots, EngineError> {
        self.new_expert_slots_on_host(layout, num_experts, slots)
    }

    fn fill_expert_slot(
        &self,
        slots: &mut CpuExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        self.fill_expert_slot_on_host(slots, slot, expert, artifact, bank)
    }

    fn slotted_experts(
        &self,
        slots: &CpuExpertSlots,
        x: &CpuTensor,
        routing: &Routing,
    ) -> Result<CpuTensor, EngineError> {
        self.slotted_experts_on_host(slots, x, routing)
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

#[cfg(test)]
mod tests {
    use super::delta_rule::{delta_rule_chunked, delta_rule_recurrent, l2_normalize_into};
    use super::*;
    use crate::host_math::rope_inverse_frequencies;
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
            multimodal: None,
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
