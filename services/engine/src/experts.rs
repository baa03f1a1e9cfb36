//! The expert executor interface and its in-process CPU implementation.
//!
//! Owns: the contract "hidden states + per-token expert ids + routing weights of one MoE layer →
//! weighted sum of the selected experts' SwiGLU outputs". The engine calls it once per MoE layer
//! per forward; the expert-worker work puts the same trait in front of a shared-memory channel,
//! and `ninfer-cpu-experts` will plug its SIMD kernels in behind it.
//! Must not touch: routing (the model decides ids and weights), the artifact byte layout.

use std::sync::Arc;

use ninfer_artifact::{Artifact, ExpertBank};

use crate::error::EngineError;
use crate::host_math::swiglu_halves;
use crate::weights::WeightMatrix;

/// One MoE layer's routed-expert work for a batch of tokens (all host memory, row-major).
pub struct ExpertBatch<'a> {
    /// Layer index in the model.
    pub layer: usize,
    /// The artifact's bank of this layer (prefix, offset, stride, count, dtype).
    pub bank: &'a ExpertBank,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// `[tokens, hidden_size]`.
    pub hidden: &'a [f32],
    pub experts_per_token: usize,
    /// `[tokens, experts_per_token]`.
    pub expert_ids: &'a [u32],
    /// `[tokens, experts_per_token]`.
    pub weights: &'a [f32],
}

impl ExpertBatch<'_> {
    pub fn tokens(&self) -> usize {
        self.hidden.len() / self.hidden_size.max(1)
    }
}

/// An expert id that selects nothing: the pair is computed elsewhere (e.g. by a GPU expert
/// slot) and adds nothing here.
pub use ninfer_cpu_experts::routed::NO_EXPERT;

/// Computes routed experts. Object-safe; one executor serves every layer and every thread.
pub trait ExpertExecutor: Send + Sync {
    /// Short name for errors and logs.
    fn name(&self) -> &str;
    /// Sees the full routing of a layer (`[tokens, k]` ids) before any expert is moved
    /// elsewhere; routing statistics count here, so they include experts the GPU computes.
    fn observe_routing(&self, _layer: usize, _expert_ids: &[u32], _tokens: usize) {}
    /// Writes `out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(hidden[t])` (`[tokens, hidden]`).
    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError>;
    /// Cumulative nanoseconds of expert computation proper, for executors that run it elsewhere
    /// and can tell it from the waiting (worker processes report theirs per request). `None`:
    /// all the time spent in [`Self::compute`] is computation (in-process executors).
    fn compute_nanos(&self) -> Option<u64> {
        None
    }
}

/// Reads experts straight from the mmapped artifact and computes them with the f32 reference
/// kernels of `crate::weights`. Tokens are grouped by expert so each expert's rows are decoded
/// once per call.
pub struct CpuExpertExecutor {
    artifact: Arc<Artifact>,
}

impl CpuExpertExecutor {
    pub fn new(artifact: Arc<Artifact>) -> Self {
        CpuExpertExecutor { artifact }
    }

    fn failure(&self, batch: &ExpertBatch<'_>, problem: String) -> EngineError {
        EngineError::ExpertExecutor {
            executor: self.name().to_string(),
            layer: batch.layer,
            problem,
        }
    }
}

impl ExpertExecutor for CpuExpertExecutor {
    fn name(&self) -> &str {
        "cpu-in-process"
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        let hidden_size = batch.hidden_size;
        let intermediate = batch.intermediate_size;
        let tokens = batch.tokens();
        let k = batch.experts_per_token;
        if batch.expert_ids.len() != tokens * k || batch.weights.len() != tokens * k {
            return Err(self.failure(
                batch,
                format!(
                    "{} expert ids and {} weights for {tokens} tokens × {k} experts",
                    batch.expert_ids.len(),
                    batch.weights.len()
                ),
            ));
        }
        if out.len() != tokens * hidden_size {
            return Err(self.failure(batch, format!("output holds {} values", out.len())));
        }
        out.iter_mut().for_each(|x| *x = 0.0);
        // expert → (token, weight) list.
        let mut assignments: Vec<Vec<(usize, f32)>> =
            vec![Vec::new(); batch.bank.num_experts as usize];
        for t in 0..tokens {
            for j in 0..k {
                let id = batch.expert_ids[t * k + j];
                if id == NO_EXPERT {
                    continue;
                }
                let expert = id as usize;
                let Some(list) = assignments.get_mut(expert) else {
                    return Err(self.failure(
                        batch,
                        format!(
                            "expert id {expert} outside the bank of {}",
                            batch.bank.num_experts
                        ),
                    ));
                };
                list.push((t, batch.weights[t * k + j]));
            }
        }
        for (expert, list) in assignments.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let gate_up_view = self
                .artifact
                .tensor(&format!("{}.{expert}.gate_up", batch.bank.prefix))?;
            let down_view = self
                .artifact
                .tensor(&format!("{}.{expert}.down", batch.bank.prefix))?;
            let gate_up = WeightMatrix::from_view(&gate_up_view)?;
            let down = WeightMatrix::from_view(&down_view)?;
            if (gate_up.rows, gate_up.cols) != (2 * intermediate, hidden_size)
                || (down.rows, down.cols) != (hidden_size, intermediate)
            {
                return Err(self.failure(
                    batch,
                    format!(
                        "expert {expert} has gate_up {}×{} and down {}×{}, expected {}×{hidden_size} and {hidden_size}×{intermediate}",
                        gate_up.rows, gate_up.cols, down.rows, down.cols, 2 * intermediate
                    ),
                ));
            }
            let n = list.len();
            let mut x = Vec::with_capacity(n * hidden_size);
            for &(t, _) in list {
                x.extend_from_slice(&batch.hidden[t * hidden_size..(t + 1) * hidden_size]);
            }
            let mut gu = vec![0.0f32; n * 2 * intermediate];
            gate_up.matmul(&x, n, &mut gu);
            let mut activated = vec![0.0f32; n * intermediate];
            for i in 0..n {
                swiglu_halves(
                    &gu[i * 2 * intermediate..(i + 1) * 2 * intermediate],
                    &mut activated[i * intermediate..(i + 1) * intermediate],
                );
            }
            let mut y = vec![0.0f32; n * hidden_size];
            down.matmul(&activated, n, &mut y);
            for (i, &(t, weight)) in list.iter().enumerate() {
                for (o, v) in out[t * hidden_size..(t + 1) * hidden_size]
                    .iter_mut()
                    .zip(&y[i * hidden_size..(i + 1) * hidden_size])
                {
                    *o += weight * v;
                }
            }
        }
        Ok(())
    }
}
