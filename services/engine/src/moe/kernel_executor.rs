//! In-process expert executor on the SIMD kernels of `ninfer-cpu-experts` — the same
//! `RoutedExpertComputer` an expert worker runs, so the in-process engine and engine + workers
//! produce identical sums (same kernel path, same thread count).
//!
//! Owns: one pinned pool and scratch, shared by all layers behind a mutex (the model computes one
//! layer at a time).
//! Must not touch: routing, processes.

use std::sync::{Arc, Mutex};

use ninfer_artifact::Artifact;
use ninfer_cpu_experts::routed::{BankView, RoutedExpertComputer};
use ninfer_cpu_experts::{ExpertLayout, KernelIsa, ThreadPool};

use crate::error::EngineError;
use crate::moe::executor::{ExpertBatch, ExpertExecutor};

/// Experts computed with the SIMD kernels in this process.
pub struct KernelExpertExecutor {
    artifact: Arc<Artifact>,
    computer: Mutex<RoutedExpertComputer>,
}

impl KernelExpertExecutor {
    /// `threads` pinned to `cpus` (may be empty: unpinned), kernel path `isa`.
    pub fn new(
        artifact: Arc<Artifact>,
        threads: usize,
        cpus: &[usize],
        isa: KernelIsa,
        max_tokens: usize,
    ) -> Result<Self, EngineError> {
        let common = artifact.config().common().clone();
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        // A model without MoE layers serves its dense MLPs' one-expert banks (offloaded
        // dense MLPs: one expert per layer, routing weight 1).
        let has_moe_layers = common.moe_layers.iter().any(|&moe| moe);
        let (bank_name, num_experts, top_k, intermediate) = if has_moe_layers {
            (
                "moe.experts",
                common.num_experts,
                common.num_experts_per_tok,
                common.moe_intermediate_size,
            )
        } else {
            ("mlp.experts", 1, 1, common.intermediate_size)
        };
        let bank = (0..common.num_hidden_layers)
            .find_map(|layer| artifact.expert_bank(&format!("layers.{layer}.{bank_name}")))
            .ok_or_else(|| invalid("the model has no expert bank".into()))?;
        let layout = ExpertLayout::for_bank(bank, common.hidden_size, intermediate)
            .map_err(|e| invalid(e.to_string()))?;
        let pool = ThreadPool::new(threads, cpus, false).map_err(|e| invalid(e.to_string()))?;
        let computer = RoutedExpertComputer::new(pool, layout, isa, num_experts, max_tokens, top_k)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(KernelExpertExecutor {
            artifact,
            computer: Mutex::new(computer),
        })
    }
}

impl ExpertExecutor for KernelExpertExecutor {
    fn name(&self) -> &str {
        "cpu-kernels-in-process"
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        let failure = |problem: String| EngineError::ExpertExecutor {
            executor: "cpu-kernels-in-process".into(),
            layer: batch.layer,
            problem,
        };
        let start = batch.bank.offset as usize;
        let length = (batch.bank.num_experts * batch.bank.expert_stride) as usize;
        let bytes = self
            .artifact
            .bytes()
            .get(start..start + length)
            .ok_or_else(|| failure("expert bank outside the artifact".into()))?;
        let view = BankView {
            bytes,
            num_experts: batch.bank.num_experts as usize,
        };
        let mut computer = self
            .computer
            .lock()
            .map_err(|_| failure("a previous call panicked".into()))?;
        computer
            .compute(
                view,
                batch.hidden,
                batch.tokens(),
                batch.experts_per_token,
                batch.expert_ids,
                batch.weights,
                out,
            )
            .map(|_| ())
            .map_err(|e| failure(e.to_string()))
    }
}
