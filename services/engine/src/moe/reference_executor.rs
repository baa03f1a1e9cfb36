//! The f32 reference expert executor: experts read straight from the mapped artifact and
//! computed with the reference kernels of `crate::weights`. Tests hold the other executors and
//! the backends' slotted experts equal to it.
//!
//! Owns: grouping a batch's tokens by expert so each expert's rows are decoded once per call.
//! Must not touch: routing, processes, the SIMD kernels.

use std::sync::Arc;

use ninfer_artifact::{Artifact, NO_EXPERT};

use crate::error::EngineError;
use crate::host_math::swiglu_halves;
use crate::moe::executor::{ExpertBatch, ExpertExecutor};
use crate::weights::WeightMatrix;

/// Reads experts straight from the mmapped artifact and computes them with the f32 reference
/// kernels of `crate::weights`. Tokens are grouped by expert so each expert's rows are decoded
/// once per call.
pub struct ReferenceExpertExecutor {
    artifact: Arc<Artifact>,
}

impl ReferenceExpertExecutor {
    pub fn new(artifact: Arc<Artifact>) -> Self {
        ReferenceExpertExecutor { artifact }
    }

    fn failure(&self, batch: &ExpertBatch<'_>, problem: String) -> EngineError {
        EngineError::ExpertExecutor {
            executor: self.name().to_string(),
            layer: batch.layer,
            problem,
        }
    }
}

impl ExpertExecutor for ReferenceExpertExecutor {
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
