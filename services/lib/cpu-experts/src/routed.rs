//! Routed-expert computation of one MoE layer from the router's output: per-token expert ids and
//! routing weights → tokens grouped by expert → [`compute_layer`]. This is the one executor both
//! the engine's in-process path and the expert worker use, so the two give identical sums.
//!
//! Owns: grouping buffers sized once (no allocation per call), chunking of batches larger than
//! the scratch, validation of ids against the bank.
//! Must not touch: where the ids come from (router, channel) or who owns which expert.

use ninfer_artifact::NO_EXPERT;

use crate::layer::{compute_layer, ExpertTask, ExpertWeights, LayerScratch, ScratchCapacity};
use crate::layout::ExpertLayout;
use crate::pool::ThreadPool;
use crate::{KernelError, KernelIsa};

/// One layer's expert bank: the bytes from the bank offset, `num_experts · stride` long.
#[derive(Debug, Clone, Copy)]
pub struct BankView<'a> {
    pub bytes: &'a [u8],
    pub num_experts: usize,
}

/// Computes routed experts on a pinned pool with reusable scratch.
pub struct RoutedExpertComputer {
    pool: ThreadPool,
    scratch: LayerScratch,
    layout: ExpertLayout,
    max_tokens: usize,
    max_top_k: usize,
    // Grouping buffers, sized at construction.
    counts: Vec<usize>,
    starts: Vec<usize>,
    cursor: Vec<usize>,
    grouped_tokens: Vec<u32>,
    grouped_weights: Vec<f32>,
}

impl RoutedExpertComputer {
    /// `max_tokens` per call chunk, `max_top_k` experts per token, `num_experts` per layer.
    pub fn new(
        pool: ThreadPool,
        layout: ExpertLayout,
        isa: KernelIsa,
        num_experts: usize,
        max_tokens: usize,
        max_top_k: usize,
    ) -> Result<Self, KernelError> {
        let max_tokens = max_tokens.max(1);
        let capacity = ScratchCapacity {
            max_tasks: num_experts,
            max_pairs: max_tokens * max_top_k,
        };
        let scratch = LayerScratch::new(layout, isa, pool.threads(), capacity)?;
        Ok(RoutedExpertComputer {
            pool,
            scratch,
            layout,
            max_tokens,
            max_top_k,
            counts: vec![0; num_experts],
            starts: vec![0; num_experts + 1],
            cursor: vec![0; num_experts + 1],
            grouped_tokens: vec![0; max_tokens * max_top_k],
            grouped_weights: vec![0.0; max_tokens * max_top_k],
        })
    }

    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Writes `output[t] = Σ_j weights[t,j] · expert_{ids[t,j]}(hidden[t])` for `tokens` rows
    /// (`hidden`/`output` are `[tokens, H]`; ids/weights `[tokens, top_k]`; `NO_EXPERT` entries
    /// are skipped). Returns the number of weight bytes streamed (for statistics).
    #[allow(clippy::too_many_arguments)]
    pub fn compute(
        &mut self,
        bank: BankView<'_>,
        hidden: &[f32],
        tokens: usize,
        top_k: usize,
        expert_ids: &[u32],
        routing_weights: &[f32],
        output: &mut [f32],
    ) -> Result<u64, KernelError> {
        let h = self.layout.hidden;
        if top_k > self.max_top_k
            || expert_ids.len() != tokens * top_k
            || routing_weights.len() != tokens * top_k
        {
            return Err(KernelError::Input(format!(
                "{tokens} tokens × top-{top_k} (at most {}) with {} ids and {} weights",
                self.max_top_k,
                expert_ids.len(),
                routing_weights.len()
            )));
        }
        if hidden.len() < tokens * h || output.len() < tokens * h {
            return Err(KernelError::Input(format!(
                "hidden/output hold fewer than {tokens} × {h} values"
            )));
        }
        if bank.num_experts != self.counts.len()
            || bank.bytes.len() < bank.num_experts * self.layout.stride
        {
            return Err(KernelError::Input(format!(
                "bank of {} experts in {} bytes does not match {} experts of stride {}",
                bank.num_experts,
                bank.bytes.len(),
                self.counts.len(),
                self.layout.stride
            )));
        }
        if let Some(&bad) = expert_ids
            .iter()
            .find(|&&id| id != NO_EXPERT && id as usize >= bank.num_experts)
        {
            return Err(KernelError::Input(format!(
                "expert id {bad} outside the bank of {}",
                bank.num_experts
            )));
        }
        output[..tokens * h].iter_mut().for_each(|x| *x = 0.0);
        let mut streamed = 0u64;
        let mut first = 0;
        while first < tokens {
            let count = (tokens - first).min(self.max_tokens);
            streamed += self.compute_chunk(
                bank,
                &hidden[first * h..(first + count) * h],
                count,
                top_k,
                &expert_ids[first * top_k..(first + count) * top_k],
                &routing_weights[first * top_k..(first + count) * top_k],
                &mut output[first * h..(first + count) * h],
            )?;
            first += count;
        }
        Ok(streamed)
    }

    #[allow(clippy::too_many_arguments)]
    fn compute_chunk(
        &mut self,
        bank: BankView<'_>,
        hidden: &[f32],
        tokens: usize,
        top_k: usize,
        expert_ids: &[u32],
        routing_weights: &[f32],
        output: &mut [f32],
    ) -> Result<u64, KernelError> {
        // Counting sort of (token, weight) pairs by expert, in token order within an expert.
        self.counts.iter_mut().for_each(|c| *c = 0);
        for &id in expert_ids.iter().filter(|&&id| id != NO_EXPERT) {
            self.counts[id as usize] += 1;
        }
        let mut running = 0;
        for (expert, &count) in self.counts.iter().enumerate() {
            self.starts[expert] = running;
            running += count;
        }
        self.starts[self.counts.len()] = running;
        self.cursor.copy_from_slice(&self.starts);
        for token in 0..tokens {
            for j in 0..top_k {
                let id = expert_ids[token * top_k + j];
                if id == NO_EXPERT {
                    continue;
                }
                let at = self.cursor[id as usize];
                self.grouped_tokens[at] = token as u32;
                self.grouped_weights[at] = routing_weights[token * top_k + j];
                self.cursor[id as usize] += 1;
            }
        }
        let stride = self.layout.stride;
        let mut tasks: Vec<ExpertTask<'_>> =
            Vec::with_capacity(self.counts.iter().filter(|&&c| c > 0).count());
        for expert in 0..self.counts.len() {
            let (start, end) = (self.starts[expert], self.starts[expert + 1]);
            if start == end {
                continue;
            }
            let slot = &bank.bytes[expert * stride..(expert + 1) * stride];
            tasks.push(ExpertTask {
                weights: ExpertWeights::from_slot(slot, &self.layout)?,
                tokens: &self.grouped_tokens[start..end],
                routing_weights: &self.grouped_weights[start..end],
            });
        }
        let streamed = (tasks.len() * self.layout.streamed_bytes()) as u64;
        compute_layer(
            &self.pool,
            &mut self.scratch,
            hidden,
            tokens,
            &tasks,
            output,
        )?;
        Ok(streamed)
    }
}
