//! The choices a [`CudaBackend`](super::CudaBackend) is opened with: the KV cache's element type
//! and which kernels may run where there is a choice ([`CudaOptions`]).
//!
//! Owns: the option types and their defaults.
//! Must not touch: how the options are applied (start-up, the op modules).

/// The element type of the KV cache (`--kv-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// Half the memory; keys and values are rounded to bf16 (nearest even) when appended.
    Bf16,
    /// Exactly the values the projections produced (the CPU backend's cache).
    F32,
}

impl KvDtype {
    /// Bytes per cached element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "bf16" => Ok(KvDtype::Bf16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("KV cache dtype `{other}`: expected bf16 or f32")),
        }
    }
}

/// How the backend computes where there is a choice. `Default`: bf16 KV cache, cuBLAS for bf16
/// prefill GEMMs when it loads, tensor-core prefill kernels, programmatic dependent launch.
/// [`CudaOptions::exact`]: f32 KV cache, the matmul kernel and the f32 SIMT kernels only,
/// which computes what the CPU backend computes to f32 rounding, batch invariant (the tests that
/// hold the GPU to the CPU backend's tolerances use it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    pub kv_dtype: KvDtype,
    /// Try cuBLAS at start-up (it is still only used if it loads and passes its check).
    pub cublas: bool,
    /// Run every attention through the reference kernel (one warp per row and head) instead of
    /// the split-K decode / tiled prefill kernels.
    pub reference_attention: bool,
    /// Run repeated decode steps of one batch as recorded CUDA graphs (device/step_graph.rs);
    /// the same bits as op by op.
    pub step_graphs: bool,
    /// The router kernel stores a MoE layer's routing (and a small batch's hidden states) into
    /// page-locked host memory mapped into the device, instead of the stream copying them
    /// back after it: no copy between the router and the expert kernels that follow it. The GPU
    /// suites hold it equal to the copies
    /// (`routing_stored_by_the_router_equals_routing_copied_back`).
    pub routing_stores: bool,
    /// MoE layers with experts on the CPU workers hand them off from the GPU itself
    /// (device/worker_handoff.rs): the GPU posts the requests into the workers' channels and
    /// waits for the answers, so no host thread takes part per layer and such steps record as
    /// step graphs. Off: the host reads the routing and posts (the reference path).
    pub worker_handoff: bool,
    /// Prefill-sized work on the tensor cores (`mma.sync`, bf16 inputs, f32 accumulation): the
    /// grouped routed-expert kernels for bf16 / int8 / int4 experts and causal attention over
    /// a bf16 KV cache (each after its start-up check). Activations (and the softmax weights)
    /// are rounded to bf16, so results move within bf16 tolerances and no longer equal the
    /// per-token (decode) kernels' bits; off, every op keeps the f32 SIMT kernels.
    pub tensor_core_prefill: bool,
    /// With `tensor_core_prefill`, the chunked gated delta rule (Gated DeltaNet prefill) on the
    /// tensor cores too (`gated_delta_rule_chunked_mma`, after its start-up check). Its
    /// operands are f16 hi + lo pairs with three products each, which keeps it near the f32
    /// kernel; single f16 operands (5e-4 of scale) had moved top-1 agreement on the
    /// qwen3_5_moe golden fixture under the CUDA bar. Off: the f32 chunked kernel.
    pub tensor_core_delta_rule: bool,
    /// A decode batch (one new token per sequence) takes one launch per op for all its
    /// sequences: the KV append, split attention and combine over every sequence at once (each
    /// row its own cache and position). The same bits as the per-sequence launches (off: the
    /// reference the tests compare against).
    pub batched_decode: bool,
    /// With `batched_decode`, routed experts of a decode batch read once per distinct expert
    /// for up to four of its rows (`expert_gate_up_by_expert`, `expert_down_by_expert`) instead
    /// of once per (row, expert) pair. Same bits either way. Off by default: at 8 sequences of
    /// Qwen3-30B-A3B shapes the per-pair kernels took 278 µs per layer and these 432 µs (op
    /// timing on an H200, uniform routing, where few experts are shared).
    pub decode_experts_by_expert: bool,
    /// The per-pair decode kernels compute the down projection and the sum over a token's
    /// choices in one launch (`expert_down_sum`) where a token's activations fit its shared
    /// memory: the bits of `expert_down` then `expert_pair_sum`. Off by default: it took 19.75
    /// µs against 10.41 + 2.36 in the kernel bench (one token, H100), and a whole step with it
    /// and `tensor_core_decode_attention` on was slower than without them.
    pub fused_expert_sum: bool,
    /// One token's quantized routed experts in one launch (`expert_decode_fused`: the gate/up
    /// task grid, then every output row's down projection and pair sum after a wait for all
    /// blocks of the grid, which fits the GPU at once), with the bits of the three launches it
    /// replaces. Off by default: a whole decode step measured it 8% slower than the three
    /// launches (H100, Qwen3-30B-A3B shapes, every expert on the GPU, 4K context).
    pub fused_decode_experts: bool,
    /// One token's router in one launch (`route_decode_fused`: every logit by the matmul
    /// kernel's warp body, then the last block out routes them as `route_top_k` does), for f32
    /// router weights, with the residual add and norm before it where the MoE layer follows
    /// attention (`route_decode_add_norm_fused`): the bits of the launches it replaces. On by
    /// default: with `fused_decode_qkv_norm` a whole decode step measured 4.9% faster (H100,
    /// Qwen3-30B-A3B shapes, every expert on the GPU, 4K context).
    pub fused_decode_router: bool,
    /// One token's first projections of a layer (an attention layer's q/k/v, a delta-rule
    /// layer's three fused input projections) with the residual add and RMSNorm before them in
    /// their launch (`add_norm_matmul3_bf16`: every block forms the normed row, the last block
    /// out stores the residual), for bf16 weights: the bits of the launches it replaces. On by
    /// default (measured with `fused_decode_router`).
    pub fused_decode_qkv_norm: bool,
    /// Decode attention over a bf16 cache in the kernels that spread a GQA group's q heads
    /// across the lanes (kernels/attention_decode.cu) where one serves the shape and fits the
    /// card; off: the split kernel everywhere (the reference the tests compare against). Not
    /// the same bits: the sums run in another order.
    pub group_decode_attention: bool,
    /// With `tensor_core_prefill` and `group_decode_attention`, decode attention over a bf16
    /// cache on the tensor cores (`attention_decode_mma_*`: the group's q heads as the rows of
    /// an mma tile, q and the softmax weights rounded to bf16) where the group is at most 16;
    /// checked at start with the tensor-core prefill kernel. Off by default: a whole step with
    /// it and `fused_expert_sum` on measured slower than without them (H100, 4K context).
    pub tensor_core_decode_attention: bool,
    /// One token's routed gate/up projections (quantized experts, hidden ≤ 2048) from a grid
    /// that fits the GPU at once, each warp walking (pair, column) tasks with the next one's
    /// rows in flight (`expert_gate_up_tasks`) instead of one block row per pair, whose second
    /// wave runs mostly empty. The same bits (off: the per-pair kernel).
    pub decode_gate_up_tasks: bool,
    /// The task grid of one token's gate/up projections also asks L2 for the down matrices the
    /// next launch reads (`prefetch.global.L2`), so they stream from HBM during its tail and
    /// the next launch's start. Timing only: the same bits (off: nothing asked ahead).
    pub decode_down_prefetch: bool,
    /// Under programmatic dependent launch, the matmul kernels of one row group (decode) ask
    /// L2 for their weights before they wait for the kernel before them, so the weights stream
    /// in while it finishes. Timing only: the same bits (off: nothing asked ahead).
    pub weight_prefetch: bool,
    /// Programmatic dependent launch (device/launch.rs): on an sm_90+ GPU whose driver has
    /// `cuLaunchKernelEx`, kernel launches (also those recorded into step graphs, from CUDA
    /// 12.3 on) let the next kernel's launch and block scheduling overlap the tail of the one
    /// before it; every kernel waits for its predecessor before it touches memory
    /// (kernels/common.cuh), so the bits are the same as plain launches (off: the reference).
    pub programmatic_dependent_launch: bool,
    /// Behave as if the GPU gave a block at most this many bytes of shared memory (static and
    /// dynamic together): every kernel then picks the variant that fits this limit, and a
    /// launch asking for more fails. For running a consumer card's paths (RTX 30/40/50 cards
    /// give 99 KB: 101,376 bytes) on a larger GPU. `None`: the GPU's own opt-in maximum, or
    /// `NINFER_CUDA_SHARED_MEMORY_CAP` when set (the GPU test suites use it).
    pub shared_memory_cap: Option<usize>,
    /// Behave as if the GPU had this many bytes of memory: [`memory_info`] reports at most this
    /// total and the free part of it. `None`: the GPU's own, or `NINFER_CUDA_MEMORY_CAP_GIB`
    /// when set.
    ///
    /// [`memory_info`]: super::CudaBackend::memory_info
    pub memory_cap_bytes: Option<u64>,
    /// Tensors crossing to a stage of the same card take the path between cards (a peer copy
    /// naming both contexts) instead of a copy within one context, so the split tests check
    /// that path on one GPU. The same bits either way.
    pub peer_stage_crossings: bool,
    /// Expert slot fills from page-locked banks copied by a kernel of this many blocks reading
    /// the mapped bank (a paced fill: few reads in flight on the bus, so the GPU's reads of the
    /// hand-off's answers do not queue behind a fill), instead of DMA copies (0).
    pub fill_copy_blocks: u32,
    /// The hand-off's collect reads the workers' answers with every piece of a thread in flight
    /// at once (one bus round trip per row) instead of one value per worker and round trip. The
    /// same bits; off until measured in a whole step.
    pub wide_handoff_reads: bool,
}

/// The environment variable that caps the shared memory per block of backends opened without
/// [`CudaOptions::shared_memory_cap`] (bytes, or KiB with a `K` suffix).
pub const SHARED_MEMORY_CAP_ENV: &str = "NINFER_CUDA_SHARED_MEMORY_CAP";
/// The environment variable that caps the memory of backends opened without
/// [`CudaOptions::memory_cap_bytes`] (GiB).
pub const MEMORY_CAP_ENV: &str = "NINFER_CUDA_MEMORY_CAP_GIB";

/// Shared memory per block of RTX 30/40/50 cards (sm_86, sm_89, sm_120): 99 KiB opt-in.
pub const CONSUMER_CARD_SHARED_MEMORY: usize = 99 * 1024;

/// `101376`, `99K` or `99KiB`: bytes of shared memory per block.
pub fn parse_shared_memory_bytes(text: &str) -> Result<usize, String> {
    let trimmed = text.trim();
    let (digits, unit) = match trimmed
        .strip_suffix("KiB")
        .or_else(|| trimmed.strip_suffix('K'))
    {
        Some(digits) => (digits, 1024),
        None => (trimmed, 1),
    };
    match digits.trim().parse::<usize>() {
        Ok(value) if value > 0 => Ok(value * unit),
        _ => Err(format!(
            "`{text}`: expected bytes of shared memory per block, e.g. 101376 or 99K"
        )),
    }
}

/// A positive number of GiB as bytes.
pub fn parse_memory_gib(text: &str) -> Result<u64, String> {
    match text.trim().parse::<f64>() {
        Ok(gib) if gib.is_finite() && gib > 0.0 => Ok((gib * (1u64 << 30) as f64) as u64),
        _ => Err(format!("`{text}`: expected a positive number of GiB")),
    }
}

/// `(free, total)` of a GPU as if it had only `cap` bytes: what is in use counts against the cap.
pub(super) fn capped_memory(free: usize, total: usize, cap: usize) -> (usize, usize) {
    if cap >= total {
        return (free, total);
    }
    let used = total.saturating_sub(free);
    (cap.saturating_sub(used), cap)
}

impl CudaOptions {
    /// The options with the caps of the environment filled in where the options set none; an
    /// unreadable value is an error naming the variable.
    pub fn with_environment_caps(mut self) -> Result<Self, String> {
        if self.shared_memory_cap.is_none() {
            if let Ok(text) = std::env::var(SHARED_MEMORY_CAP_ENV) {
                self.shared_memory_cap = Some(
                    parse_shared_memory_bytes(&text)
                        .map_err(|problem| format!("{SHARED_MEMORY_CAP_ENV}: {problem}"))?,
                );
            }
        }
        if self.memory_cap_bytes.is_none() {
            if let Ok(text) = std::env::var(MEMORY_CAP_ENV) {
                self.memory_cap_bytes = Some(
                    parse_memory_gib(&text)
                        .map_err(|problem| format!("{MEMORY_CAP_ENV}: {problem}"))?,
                );
            }
        }
        Ok(self)
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            kv_dtype: KvDtype::Bf16,
            cublas: true,
            reference_attention: false,
            step_graphs: true,
            routing_stores: true,
            worker_handoff: true,
            tensor_core_prefill: true,
            tensor_core_delta_rule: true,
            batched_decode: true,
            decode_experts_by_expert: false,
            fused_expert_sum: false,
            fused_decode_experts: false,
            fused_decode_router: true,
            fused_decode_qkv_norm: true,
            group_decode_attention: true,
            tensor_core_decode_attention: false,
            decode_gate_up_tasks: true,
            decode_down_prefetch: true,
            weight_prefetch: true,
            programmatic_dependent_launch: true,
            shared_memory_cap: None,
            memory_cap_bytes: None,
            peer_stage_crossings: false,
            fill_copy_blocks: 0,
            wide_handoff_reads: false,
        }
    }
}

impl CudaOptions {
    /// f32 KV cache, no cuBLAS: the CPU backend's math, batch invariant.
    pub fn exact() -> Self {
        CudaOptions {
            kv_dtype: KvDtype::F32,
            cublas: false,
            // The flash kernels are batch invariant and agree with the CPU to f32 rounding.
            reference_attention: false,
            step_graphs: true,
            routing_stores: false,
            worker_handoff: true,
            // Batch invariance: a token's bits must not depend on the kernel its batch took.
            tensor_core_prefill: false,
            tensor_core_delta_rule: false,
            batched_decode: true,
            decode_experts_by_expert: false,
            // The same bits as the two launches.
            fused_expert_sum: false,
            // The same bits as the three launches.
            fused_decode_experts: false,
            // The same bits as the two launches.
            fused_decode_router: false,
            // The same bits as the two launches.
            fused_decode_qkv_norm: false,
            // An f32 cache: the split kernel either way.
            group_decode_attention: true,
            // Batch invariance, as for prefill.
            tensor_core_decode_attention: false,
            // The same bits as the per-pair kernel.
            decode_gate_up_tasks: true,
            // Timing only: the same bits.
            decode_down_prefetch: true,
            weight_prefetch: true,
            // Launch timing only: the same bits as plain launches.
            programmatic_dependent_launch: true,
            shared_memory_cap: None,
            memory_cap_bytes: None,
            peer_stage_crossings: false,
            fill_copy_blocks: 0,
            wide_handoff_reads: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_sizes_read_as_bytes_or_kib() {
        assert_eq!(parse_shared_memory_bytes("101376"), Ok(101_376));
        assert_eq!(
            parse_shared_memory_bytes("99K"),
            Ok(CONSUMER_CARD_SHARED_MEMORY)
        );
        assert_eq!(parse_shared_memory_bytes("99KiB"), Ok(101_376));
        for bad in ["", "0", "-5", "99M", "lots"] {
            let error = parse_shared_memory_bytes(bad).unwrap_err();
            assert!(error.contains("shared memory per block"), "{error}");
        }
        assert_eq!(parse_memory_gib("16"), Ok(16 << 30));
        assert!(parse_memory_gib("0").is_err() && parse_memory_gib("NaN").is_err());
    }

    #[test]
    fn a_memory_cap_counts_what_is_in_use() {
        const GIB: usize = 1 << 30;
        // An 80 GiB card with 10 GiB in use, capped at 16 GiB: 6 GiB free of 16.
        assert_eq!(
            capped_memory(70 * GIB, 80 * GIB, 16 * GIB),
            (6 * GIB, 16 * GIB)
        );
        // More in use than the cap: nothing free.
        assert_eq!(capped_memory(60 * GIB, 80 * GIB, 16 * GIB), (0, 16 * GIB));
        // A cap above the card changes nothing.
        assert_eq!(
            capped_memory(70 * GIB, 80 * GIB, 96 * GIB),
            (70 * GIB, 80 * GIB)
        );
    }
}
