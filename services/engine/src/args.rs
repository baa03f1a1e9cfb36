//! The engine's command-line flags ([`Args`]) and their parsers, and the GPU backend's options
//! they give.
//!
//! Owns: every flag's name, default and help text. Must not touch: what the flags start (main.rs).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use ninfer_engine::backend::cuda::{parse_shared_memory_bytes, CudaOptions, KvDtype};
use ninfer_engine::moe::expert_cache::{DEFAULT_EVICTION_MARGIN, DEFAULT_FILL_COST_CHOICES};
use ninfer_engine::moe::placement::{gib_to_bytes, GpuExpertCount};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Speculation {
    /// The model's own multi-token-prediction head (`mtp.*` tensors).
    Mtp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Device {
    Cpu,
    Cuda,
    Auto,
}

#[derive(Debug, Parser)]
#[command(name = "ninfer-engine", version, about = "The NInfer-Offload engine")]
pub(crate) struct Args {
    /// The `.ninfer` artifact.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Where the dense layers run.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) device: Device,
    /// Expert workers (`unix:PATH` or `HOST:PORT`, comma-separated; one per NUMA node). Without
    /// it the routed experts run in this process.
    #[arg(long, value_delimiter = ',')]
    pub(crate) experts: Vec<String>,
    /// Dense models: the dense MLPs of this many layers (the last ones) stay in host RAM and
    /// are computed by the expert workers (or in this process without `--experts`) as one
    /// expert per layer with routing weight 1, for a GPU smaller than the model.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub(crate) dense_mlp_offload_layers: usize,
    /// gRPC address for the gateway: `unix:PATH` or `HOST:PORT`.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub(crate) listen: String,
    /// Name the API reports (default: the artifact's file stem).
    #[arg(long)]
    pub(crate) model_name: Option<String>,
    /// Longest prompt + completion per sequence, in tokens (default: min(model limit, 8192)).
    #[arg(long)]
    pub(crate) max_context: Option<usize>,
    /// Sequences decoded together; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 32)]
    pub(crate) max_sequences: usize,
    /// Threads of the in-process expert kernels.
    #[arg(long, default_value_t = 0)]
    pub(crate) moe_threads: usize,
    /// Force a kernel path for in-process experts.
    #[arg(long)]
    pub(crate) kernel_isa: Option<String>,
    /// Fail requests held for a missing expert worker after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) worker_timeout: f64,
    /// A worker without a heartbeat for this many milliseconds counts as hung (workers beat
    /// every 10 ms; with the registrar's 100 ms check a hang is noticed well within a second).
    #[arg(long, default_value_t = 500)]
    pub(crate) worker_hang_ms: u64,
    /// Tokens per activation-channel request (bigger batches go in chunks).
    #[arg(long, default_value_t = 256)]
    pub(crate) channel_max_tokens: usize,
    /// Write routing statistics (per layer, per expert) to this JSON file every 10 s and at exit.
    #[arg(long)]
    pub(crate) moe_record_stats: Option<PathBuf>,
    /// Routing statistics of earlier runs (`ninfer-expert-stats-v1`, written by
    /// `--moe-record-stats` or the gateway's state directory) for static expert placement.
    #[arg(long)]
    pub(crate) moe_expert_stats: Option<PathBuf>,
    /// KV cache element type on the GPU: `bf16` (half the memory; the default) or `f32`. The CPU
    /// backend always keeps an f32 cache.
    #[arg(long, value_name = "bf16|f32")]
    pub(crate) kv_dtype: Option<KvDtype>,
    /// Decode steps whose host has no part inside the forward (every routed expert on the GPU)
    /// run as recorded CUDA graphs: `on` (the default) or `off` (every op launched by the
    /// host; the same tokens).
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_graphs: bool,
    /// `on` (the default): the router kernel stores each MoE layer's routing (and a decode
    /// step's hidden states) straight into page-locked host memory instead of the stream copying
    /// them back after it. `off`: copies. The same values either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_routing_stores: bool,
    /// `on` (the default): MoE layers with experts on the CPU workers hand them off from the GPU
    /// itself (it posts into the workers' channels and waits for their answers), so a decode
    /// step has no host round trip per layer and runs as a CUDA graph. `off`: the host reads
    /// each layer's routing and posts it. The same tokens either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_worker_handoff: bool,
    /// `on`: the hand-off's collect has all of a thread's reads of the workers' answers in
    /// flight at once (16-byte loads: one round trip over the bus per row instead of one per
    /// value and worker). The same tokens either way; `off` (the default) until measured.
    #[arg(long, default_value = "off", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_handoff_wide_reads: bool,
    /// `on` (the default): prefill-sized grouped routed experts (bf16 / int8 / int4) and causal
    /// prefill attention over a bf16 KV cache run on the tensor cores (bf16 inputs, f32
    /// accumulation; within bf16 tolerances of the f32 kernels). `off`: the f32 SIMT kernels.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_tensor_cores: bool,
    /// `on` (the default): with `--cuda-tensor-cores on`, the Gated DeltaNet prefill (chunked
    /// delta rule) on the tensor cores too (operands as f16 hi + lo pairs, within ~1e-6 of the
    /// f32 kernel). `off`: the f32 chunked kernel.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_tensor_core_delta_rule: bool,
    /// `on` (the default): a decode batch takes one launch per op for all its sequences (one
    /// KV append, split attention and combine over every sequence's own cache and position;
    /// routed experts read once per distinct expert for every row that chose it). `off`: one
    /// launch per sequence (the reference). The same tokens either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_batched_decode: bool,
    /// `on`: a decode step's routed experts compute their down projection and the sum over each
    /// token's choices in one launch. `off` (the default): a down launch, then the sum. The same
    /// tokens either way.
    #[arg(long, default_value = "off", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_fused_expert_sum: bool,
    /// `on`: one token's quantized routed experts (gate/up, down and the sum over its choices)
    /// in one launch. `off` (the default): three launches. The same tokens either way.
    #[arg(long, default_value = "off", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_fused_decode_experts: bool,
    /// `on` (the default): one token's router (f32 weights) computes its logits and routes them
    /// in one launch, with the residual add and norm before it after attention. `off`: the
    /// add + norm, the matmul, then the routing launch. The same tokens either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_fused_decode_router: bool,
    /// `on` (the default): one token's first projections of a layer (q/k/v, or a delta-rule
    /// layer's input projections; bf16 weights) take the residual add and norm before them into
    /// their launch. `off`: the add + norm launch, then the projections. The same tokens either
    /// way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_fused_decode_qkv_norm: bool,
    /// `on` (the default): decode attention over a bf16 cache spreads each GQA group's q heads
    /// across a warp's lanes (q and the sums in registers). `off`: the split kernel, one key per
    /// lane. Near-equal tokens (the sums run in another order).
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_group_decode_attention: bool,
    /// `on`: with `--cuda-tensor-cores on`, decode attention over a bf16 cache on the tensor
    /// cores for GQA groups of up to 16 q heads (q and the softmax weights rounded to bf16;
    /// within bf16 tolerances). `off` (the default): the f32 kernels of
    /// `--cuda-group-decode-attention`.
    #[arg(long, default_value = "off", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_tensor_core_decode_attention: bool,
    /// `on` (the default): one token's routed gate/up projections from a grid that fits the GPU
    /// at once (quantized experts). `off`: one block row per (token, expert) pair. The same
    /// tokens either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_decode_gate_up_tasks: bool,
    /// `on` (the default): one token's gate/up task grid also asks L2 for the down matrices
    /// the next launch reads. `off`: nothing asked ahead. The same tokens either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_decode_down_prefetch: bool,
    /// `on` (the default): under programmatic dependent launch, decode's matmul kernels ask L2
    /// for their weights before waiting for the kernel before them. `off`: nothing asked ahead.
    /// The same tokens either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_weight_prefetch: bool,
    /// `on` (the default): on an sm_90+ GPU, kernels are launched with programmatic dependent
    /// launch, so each one's launch and block scheduling overlap the end of the one before it
    /// (each still waits for its predecessor before touching memory). `off`: plain launches.
    /// The same tokens either way; the start-up log says whether it is in use and why not.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) cuda_pdl: bool,
    /// Behave as if the GPU gave a block at most this much shared memory (bytes, or `99K`):
    /// every kernel takes the variant that fits, a launch that would not fit fails, and the log
    /// says which variant each op takes. For running an RTX 30/40/50 card's paths (99K) on a
    /// larger GPU. Default: the GPU's own limit (or `NINFER_CUDA_SHARED_MEMORY_CAP`).
    #[arg(long, value_name = "BYTES", value_parser = parse_shared_memory_bytes)]
    pub(crate) cuda_shared_memory_cap: Option<usize>,
    /// Routed experts per MoE layer kept in GPU expert slots and computed on the GPU while the
    /// CPU computes the rest: a number, `half`, `all` (an error when they do not fit) or `auto`
    /// (as many as fit). Which ones: the most used in `--moe-expert-stats`, else the first N.
    #[arg(long, default_value = "0", value_name = "N|half|all|auto")]
    pub(crate) moe_gpu_experts: GpuExpertCount,
    /// Keep the start-up placement of `--moe-gpu-experts` for the whole run. Without it the
    /// slots follow the routing (the dynamic expert cache) whenever some experts of a layer
    /// are in slots and some are not.
    #[arg(long)]
    pub(crate) moe_static_experts: bool,
    /// Dynamic expert cache: at most this many experts copied into each MoE layer's slots per
    /// step (from the page-locked banks, beside the steps; 0 acts as `--moe-static-experts`).
    /// Default: 2 without `--moe-expert-stats`; with them the placement they give stays (static
    /// placement by statistics measured faster than the cache seeded by them, and the cache
    /// faster than static placement without them: docs/BENCHMARKS.md), unless this is given.
    #[arg(long, value_name = "N")]
    pub(crate) moe_cache_fills_per_layer: Option<usize>,
    /// Dynamic expert cache: how much more than a fill's cost (in routed choices over the
    /// recent window) a missed expert must be expected to save over the resident one it would
    /// evict; against two experts taking turns in a slot.
    #[arg(long, default_value_t = DEFAULT_EVICTION_MARGIN, value_name = "CHOICES")]
    pub(crate) moe_cache_eviction_margin: f64,
    /// Dynamic expert cache: what one fill costs, in routed choices the CPU would compute (a
    /// copy over PCIe against the CPU reading the expert from RAM); a missed expert is copied
    /// only when it is expected to save more, and the copies per step are budgeted by it.
    /// 0: fills are free (no admission bar, no copy budget).
    #[arg(long, default_value_t = DEFAULT_FILL_COST_CHOICES, value_name = "CHOICES")]
    pub(crate) moe_cache_fill_cost: f64,
    /// Dynamic expert cache: `on` (the default) decides the next step's fills and starts their
    /// copies while the GPU runs this step; `off` does it between the steps (in series, but
    /// never on a core an expert worker is computing on).
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) moe_cache_upkeep_during_steps: bool,
    /// Dynamic expert cache: `on` (the default) lets a long prompt, whose layers' experts are
    /// streamed to the GPU for layerwise prefill anyway, re-place each layer's slots by the
    /// prompt's routing with device copies from the streamed experts (no PCIe traffic); `off`
    /// leaves the slots to the fills between steps.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub(crate) moe_cache_prompt_placement: bool,
    /// Dynamic expert cache: 0 (the default) copies experts into GPU slots by DMA; N copies
    /// them with a kernel of N blocks reading the page-locked bank over the bus, which keeps
    /// few reads in flight, so the GPU's reads of the CPU workers' answers do not wait behind
    /// a fill (a paced fill; `scripts/bench/pcie_contention.py` measures both on a machine).
    #[arg(long, default_value_t = 0, value_name = "BLOCKS")]
    pub(crate) moe_cache_fill_copy_blocks: u32,
    /// Routed experts in host RAM, computed by the CPU, the GPU holding `--moe-gpu-experts` of
    /// them per layer: how the engine always runs; accepted for command lines written for the
    /// seeds' tool.
    #[arg(long)]
    pub(crate) moe_offload: bool,
    /// Behave as if the GPU had this many GiB (to stand in for a 16 or 24 GB card): expert
    /// slots get what is left after the dense weights, the KV caches of `--max-sequences` full
    /// contexts and 1 GiB of working memory.
    #[arg(long, value_name = "GiB")]
    pub(crate) gpu_mem_budget: Option<f64>,
    /// The GPUs to use, by CUDA ordinal among the visible ones (`CUDA_VISIBLE_DEVICES`
    /// applies), comma separated. Default: the first visible GPU. Several GPUs named split the
    /// decoder layers between them as a pipeline (each card its own contiguous layers, their KV
    /// caches and expert slots; `ninfer run --dry-run` prints the plan). A split records each
    /// decode step as one CUDA graph over all its cards (`--cuda-graphs`), and refuses
    /// `--spec mtp` and `--host-kv-mib`.
    #[arg(long, value_name = "0,1")]
    pub(crate) gpus: Option<String>,
    /// Percent of the decoder layers per GPU of `--gpus` (or per stage of
    /// `--pipeline-stages-on-one-device`), in order, summing to 100 (default: in proportion to
    /// each card's usable memory; equal stages on one device).
    #[arg(long, value_name = "60,40")]
    pub(crate) gpu_split: Option<String>,
    /// Split the decoder layers over N backends of the one device the engine runs on (the CPU,
    /// or the one GPU chosen), exactly as a split over N GPUs runs: the layer split checked on
    /// a machine without several GPUs. On a GPU the stages share the card (each fills its
    /// expert slots from an equal part of its free memory); each has its own stream.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub(crate) pipeline_stages_on_one_device: usize,
    /// Reserve this many MiB of page-locked, device-mapped host memory for KV caches: attention
    /// layers' caches go to the GPU first and, once its share (free memory, within
    /// `--gpu-mem-budget`, less 1 GiB) is used up, to this pool, which the attention kernels
    /// read over PCIe. 0: every KV cache on the GPU. The CPU backend ignores it.
    #[arg(long, default_value_t = 0, value_name = "MiB")]
    pub(crate) host_kv_mib: u64,
    /// Keep what prompts computed, by blocks of 256 tokens, within this many GiB, so a later
    /// prompt that starts the same way computes only the rest (attention KV rows, and for
    /// Gated DeltaNet layers their states at checkpoints; least recently used blocks go
    /// first). On the GPU the blocks are KV caches like the sequences' (GPU first, then the
    /// `--host-kv-mib` pool) and the expert slots leave them room. 0: off (`ninfer run` and
    /// `ninfer serve` pass their plan's figure).
    #[arg(long, default_value_t = 0.0, value_name = "GiB")]
    pub(crate) prefix_cache_gib: f64,
    /// On the GPU: batches of at least this many tokens (long prompts) copy the routed experts
    /// they need over PCIe into one layer-sized set of staging slots and compute them on the
    /// GPU instead of the expert workers (0: never). The default is about where PCIe wins:
    /// one layer's experts cross PCIe in ~12 ms (qwen3-30b-a3b int8, ~55 GB/s) while the CPU
    /// needs ~60 µs per token per layer (AMX).
    #[arg(long, default_value_t = 256, value_name = "TOKENS")]
    pub(crate) moe_prefill_gpu_min_tokens: usize,
    /// On the GPU: batches of at least this many tokens prefill layerwise (0: never): each MoE
    /// layer's experts stream over PCIe into one half of two layer-sized sets of staging slots
    /// while the layer before computes. From 256 tokens a batch routes to nearly every expert,
    /// so streaming them all wastes almost nothing (an agent's ~600-token turn: 210–230 ms
    /// streamed against 316–336 ms copied after each routing, synthetic Qwen3.5-35B-A3B on an
    /// H100).
    #[arg(long, default_value_t = 256, value_name = "TOKENS")]
    pub(crate) moe_prefill_layerwise_min_tokens: usize,
    /// Layerwise prefill: the expert workers' rate measured at start is taken as this share of
    /// itself when a layer is split between the GPU and the workers (0, the default: streamed
    /// layers leave the workers nothing). The start-up measurement runs the workers alone;
    /// beside the copies they share the RAM's bandwidth and ran several times slower than
    /// estimated in every measured case.
    #[arg(long, default_value_t = 0.0, value_name = "SHARE")]
    pub(crate) moe_prefill_cpu_rate_share: f64,
    /// While other sequences are generating, a prompt longer than this is fed this many tokens
    /// per scheduler step (each step also runs the others' decode), so a long prompt delays
    /// them by one chunk's forward at a time, not its whole prefill (0: whole prompts).
    #[arg(long, default_value_t = ninfer_engine::service::scheduler::DEFAULT_PREFILL_CHUNK_TOKENS, value_name = "TOKENS")]
    pub(crate) prefill_chunk_tokens: usize,
    /// While other sequences are generating, the most of the wall time that prompt work (the
    /// chunks of `--prefill-chunk-tokens`, and steps a prompt's rest joins) may take, in (0, 1]:
    /// after each, prompts wait while the others' decode steps take (1 − share) / share of its
    /// time, so a stream keeps at least about 1 − share of its solo decode speed during a long
    /// prefill (the first chunk runs at once). 1: a chunk every step, however long it takes.
    #[arg(long, default_value_t = ninfer_engine::service::scheduler::DEFAULT_PREFILL_TIME_SHARE, value_name = "SHARE", value_parser = parse_time_share)]
    pub(crate) prefill_time_share: f64,
    /// File holding the shared secret every caller must send (`authorization: Bearer SECRET`);
    /// also `NINFER_CONTROL_SECRET_FILE` or `NINFER_CONTROL_SECRET`. Needed when `--listen` is
    /// TCP and other users can reach it; a `unix:PATH` socket is owner-only without it.
    #[arg(long, value_name = "FILE")]
    pub(crate) control_secret_file: Option<PathBuf>,
    /// Serve on a non-loopback TCP `--listen` without a control secret (refused otherwise:
    /// anyone reaching the port could use the engine).
    #[arg(long)]
    pub(crate) insecure_listen: bool,
    /// Speculative decoding: `mtp` drafts tokens with the model's MTP head and verifies them in
    /// one batched forward (the output is the same token for token, greedy or seeded sampled).
    /// Requests may ask for fewer drafts or none.
    #[arg(long, value_enum)]
    pub(crate) spec: Option<Speculation>,
    /// With `--spec mtp`: most drafts per step and sequence (1..=8); a sequence whose drafts
    /// are rejected drafts fewer, down to none.
    #[arg(long, default_value_t = 1, requires = "spec", value_name = "N")]
    pub(crate) draft_tokens: usize,
    /// Log as JSON lines.
    #[arg(long)]
    pub(crate) log_json: bool,
}

/// `on` or `off`.
pub(crate) fn parse_on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("`{other}`: expected on or off")),
    }
}

/// `--prefill-time-share`: a number in (0, 1].
pub(crate) fn parse_time_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(share) if share > 0.0 && share <= 1.0 => Ok(share),
        _ => Err(format!("`{text}`: expected a share of the time in (0, 1]")),
    }
}

/// The GPU backend's options from the `--kv-dtype` and `--cuda-*` flags.
pub(crate) fn cuda_options(args: &Args) -> CudaOptions {
    CudaOptions {
        kv_dtype: args.kv_dtype.unwrap_or(CudaOptions::default().kv_dtype),
        step_graphs: args.cuda_graphs,
        routing_stores: args.cuda_routing_stores,
        worker_handoff: args.cuda_worker_handoff,
        tensor_core_prefill: args.cuda_tensor_cores,
        tensor_core_delta_rule: args.cuda_tensor_core_delta_rule,
        batched_decode: args.cuda_batched_decode,
        fused_expert_sum: args.cuda_fused_expert_sum,
        fused_decode_experts: args.cuda_fused_decode_experts,
        fused_decode_router: args.cuda_fused_decode_router,
        fused_decode_qkv_norm: args.cuda_fused_decode_qkv_norm,
        group_decode_attention: args.cuda_group_decode_attention,
        tensor_core_decode_attention: args.cuda_tensor_core_decode_attention,
        decode_gate_up_tasks: args.cuda_decode_gate_up_tasks,
        decode_down_prefetch: args.cuda_decode_down_prefetch,
        weight_prefetch: args.cuda_weight_prefetch,
        programmatic_dependent_launch: args.cuda_pdl,
        shared_memory_cap: args.cuda_shared_memory_cap,
        // The backend reports at most the budget's memory, so every user of the free memory
        // (expert slots, KV placement) sees the same smaller card.
        memory_cap_bytes: args.gpu_mem_budget.map(gib_to_bytes),
        fill_copy_blocks: args.moe_cache_fill_copy_blocks,
        wide_handoff_reads: args.cuda_handoff_wide_reads,
        ..CudaOptions::default()
    }
}
