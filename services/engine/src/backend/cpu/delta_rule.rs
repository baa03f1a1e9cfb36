//! The CPU backend's Gated DeltaNet ops: the causal conv1d, the gates, and the delta rule in its
//! recurrent and chunked forms (transformers' `torch_recurrent_gated_delta_rule` and
//! `torch_chunk_gated_delta_rule`).
//!
//! Owns: those ops. Must not touch: the layer's projections (the model graph).

use super::tensors::{CpuBackend, CpuConvState, CpuRecurrentState, CpuTensor, CpuWeight};
use crate::backend::{DeltaRuleForm, DeltaRuleSpec, Segment};
use crate::error::EngineError;
use crate::host_math::{sigmoid, silu, softplus};
use crate::weights::dot;

/// Chunk length of the chunked delta rule (transformers' `chunk_size`).
pub const DELTA_RULE_CHUNK: usize = 64;

/// `x · rsqrt(Σx² + 1e-6)` (the delta rule's fixed-eps l2 norm), times `scale`.
pub(super) fn l2_normalize_into(x: &[f32], scale: f32, out: &mut [f32]) {
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
    /// [`Backend::causal_conv1d_silu`](crate::backend::Backend::causal_conv1d_silu) on the host.
    pub(super) fn causal_conv1d_silu_on_host(
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

    /// [`Backend::delta_rule_gates`](crate::backend::Backend::delta_rule_gates) on the host.
    pub(super) fn delta_rule_gates_on_host(
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

    /// [`Backend::gated_delta_rule`](crate::backend::Backend::gated_delta_rule) on the host.
    // The trait op's arguments, passed on unchanged.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_delta_rule_on_host(
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
}
