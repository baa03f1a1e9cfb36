//! The figures of `ninfer bench MODEL` and how they are printed: the per-length rows with the
//! decode time split and roofline ratio, the prefill limits, the expert cache, the batch and
//! concurrent decode tables, and the RAM bandwidth line (`bench memory` prints it too).
//!
//! Owns: the report's types (its JSON) and the table. Must not touch: the measurement that
//! fills them (`bench_model_measure.rs`).

use std::time::Duration;

use ninfer_cpu_experts::bench::BandwidthResult;
use ninfer_cpu_experts::ThreadPool;
use ninfer_protocol::v1::EngineStatus;
use serde::Serialize;

use crate::bench_during_prefill::{self, DecodeDuringPrefill};
use crate::bench_tokens::StepLatency;

/// How much arithmetic one prompt token costs, from the model's config and tensor sizes.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct PrefillArithmetic {
    /// `2 ·` the dense matrix parameters (attention, routers, shared experts, dense MLPs;
    /// not the embedding table, not the output head, which a prefill runs for its last token
    /// only).
    pub(crate) dense_flops_per_token: f64,
    /// `6 · hidden · moe_intermediate · top-k ·` MoE layers.
    pub(crate) expert_flops_per_token: f64,
    /// Causal attention: `4 · heads · head_dim` FLOPs per (query, key) pair (scores and the
    /// weighted sum) per full-attention layer, `L (L + 1) / 2` pairs for a prompt of `L`.
    pub(crate) attention_flops_per_pair: f64,
}

impl PrefillArithmetic {
    pub(crate) fn of(artifact: &ninfer_artifact::Artifact) -> Self {
        let config = artifact.config();
        let common = config.common();
        let dense_parameters: u64 = artifact
            .header()
            .tensors
            .iter()
            .filter(|tensor| {
                matches!(
                    tensor.class,
                    ninfer_artifact::TensorClass::Dense | ninfer_artifact::TensorClass::DenseMlp
                ) && !tensor.name.starts_with("lm_head")
            })
            .map(|tensor| tensor.element_count())
            .sum();
        let moe_layers = common.moe_layers.iter().filter(|&&moe| moe).count();
        let attention_layers = config.hybrid().map_or(common.num_hidden_layers, |hybrid| {
            hybrid
                .layer_types
                .iter()
                .filter(|&&kind| kind == ninfer_artifact::LayerType::FullAttention)
                .count()
        });
        PrefillArithmetic {
            dense_flops_per_token: 2.0 * dense_parameters as f64,
            expert_flops_per_token: 6.0
                * (common.hidden_size * common.moe_intermediate_size) as f64
                * (common.num_experts_per_tok * moe_layers) as f64,
            attention_flops_per_pair: 4.0
                * (common.num_attention_heads * common.head_dim * attention_layers) as f64,
        }
    }

    /// FLOPs of one prompt of `length` tokens.
    pub(crate) fn prompt_flops(&self, length: usize) -> f64 {
        let pairs = length as f64 * (length as f64 + 1.0) / 2.0;
        length as f64 * (self.dense_flops_per_token + self.expert_flops_per_token)
            + pairs * self.attention_flops_per_pair
    }
}

/// How close a prefill came to the two limits of layerwise prefill (per prompt length, all
/// repeats).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PrefillLimits {
    /// Expert bytes streamed into the staging slots (all repeats).
    pub(crate) streamed_expert_bytes: u64,
    /// `streamed_expert_bytes` / the engine's measured pinned host-to-device rate (ms).
    pub(crate) pcie_limit_ms: Option<f64>,
    /// `pcie_limit_ms` / the prefill's wall time: 1 = the prefill ran at the speed of its copies.
    pub(crate) pcie_share: Option<f64>,
    /// The prompts' FLOPs ([`PrefillArithmetic`]).
    pub(crate) flops: f64,
    /// `flops` / the compute peak (ms).
    pub(crate) compute_limit_ms: Option<f64>,
    /// `compute_limit_ms` / the prefill's wall time.
    pub(crate) compute_share: Option<f64>,
}

/// Decode time per token, split (milliseconds). The parts add up to `engine_forward` and
/// `engine_forward + other` = the measured time per token.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Split {
    /// Forward time outside the MoE layers' expert wait and copies: attention, dense layers,
    /// routers, shared experts, GPU-resident experts not hidden behind the CPU, the head.
    pub(crate) gpu_dense: f64,
    /// CPU expert computation (as the workers report it; in-process: all of the expert wait).
    pub(crate) cpu_experts: f64,
    /// Expert wait minus expert computation: the channel round trip and the slowest-worker wait.
    pub(crate) channel_wait: f64,
    /// Host ↔ device copies of the MoE input and the CPU experts' sum (on a GPU, including the
    /// wait for the work queued before the download).
    pub(crate) transfers: f64,
    /// Outside the engine's forwards: sampling, scheduling, gRPC to the client.
    pub(crate) other: f64,
}

/// Figures of one phase over all repeats of one prompt length.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PhaseFigures {
    pub(crate) tokens: u64,
    pub(crate) forwards: u64,
    /// Client-side wall time of the phase, all repeats (ms).
    pub(crate) wall_ms: f64,
    pub(crate) tok_per_s: f64,
    /// Each repeat's tok/s.
    pub(crate) tok_per_s_per_repeat: Vec<f64>,
    /// Engine forward time per token (ms).
    pub(crate) engine_forward_ms_per_token: f64,
    /// Wall time per token at the client (ms).
    pub(crate) ms_per_token: f64,
    pub(crate) split_ms_per_token: Split,
    /// Distinct experts per token computed on the CPU side, summed over MoE layers.
    pub(crate) cpu_experts_per_token: f64,
    /// … and from GPU-resident slots.
    pub(crate) gpu_experts_per_token: f64,
    /// `cpu_experts_per_token` × expert stride: expert weight bytes read from RAM.
    pub(crate) cpu_expert_bytes_per_token: f64,
    /// Resident expert bytes read from device memory per token.
    pub(crate) gpu_expert_bytes_per_token: f64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pub(crate) prompt_tokens: usize,
    pub(crate) decode_tokens: usize,
    pub(crate) repeats: usize,
    pub(crate) prefill: PhaseFigures,
    pub(crate) prefill_limits: PrefillLimits,
    pub(crate) decode: PhaseFigures,
    /// Each repeat's decode split (ms per token), in run order.
    pub(crate) decode_split_per_repeat: Vec<Split>,
    /// Time between consecutive decoded tokens at the client, all repeats pooled.
    pub(crate) decode_step_ms: StepLatency,
    /// … per repeat, in run order.
    pub(crate) decode_step_ms_per_repeat: Vec<StepLatency>,
    /// Prefill tok/s at the client (prompt tokens ÷ time to the first token).
    pub(crate) prefill_tok_s: f64,
    /// Decode tok/s at the client (batch 1).
    pub(crate) decode_tok_s: f64,
    /// Bytes a decoded token must move from RAM and from device memory, and the time that
    /// takes at the measured bandwidths (ms).
    pub(crate) ram_bytes_per_token: f64,
    pub(crate) device_bytes_per_token: f64,
    pub(crate) ideal_ms_per_token: Option<f64>,
    /// ideal ÷ measured time per decoded token (1 = at the bandwidth limit).
    pub(crate) roofline_ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Report {
    /// `--concurrency` above 1: the aggregate decode of that many sequences at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) concurrent_decode: Option<ConcurrentDecode>,
    /// `--decode-batch`: the aggregate decode of each batch size.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) decode_batches: Vec<BatchDecodeRow>,
    /// `--decode-during-prefill`: one stream's decode alone and beside a long prompt's prefill.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) decode_during_prefill: Option<DecodeDuringPrefill>,
    pub(crate) model: String,
    pub(crate) architecture: String,
    pub(crate) device: String,
    pub(crate) expert_executor: String,
    pub(crate) moe_gpu_experts: String,
    pub(crate) gpu_mem_budget_gib: Option<f64>,
    /// `--gpus` (several: the layers split over them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) gpus: Option<String>,
    /// Routed experts per MoE layer the engine placed in GPU slots (`moe_gpu_experts` resolved).
    pub(crate) gpu_experts_per_layer: u32,
    pub(crate) expert_stride_bytes: u64,
    pub(crate) dense_weight_bytes_per_forward: u64,
    pub(crate) expert_compute_reported_by_workers: bool,
    pub(crate) ram_bandwidth: BandwidthResult,
    /// `2 · size / time` of a device-to-device copy on the GPU (null on the CPU device).
    pub(crate) device_bandwidth_gbps: Option<f64>,
    pub(crate) device_bandwidth_error: Option<String>,
    pub(crate) roofline: RooflineBasis,
    /// The rates layerwise prefill measured at start (null when it is off) and the limits
    /// each prefill is compared with.
    pub(crate) prefill_basis: PrefillBasis,
    pub(crate) results: Vec<Row>,
    /// The dynamic expert cache over the measured runs (null without GPU expert slots).
    pub(crate) expert_cache: Option<ExpertCacheFigures>,
}

/// The engine's expert cache counters (`GetStatus`) over the measured runs.
#[derive(Debug, Serialize)]
pub(crate) struct ExpertCacheFigures {
    pub(crate) gpu_expert_slots: u32,
    /// Routed choices whose expert was in a GPU slot / was not.
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) hit_rate: f64,
    /// The same from each run's first token to its end (decode only).
    pub(crate) decode_hits: u64,
    pub(crate) decode_misses: u64,
    pub(crate) decode_hit_rate: f64,
    pub(crate) fills: u64,
    /// Bytes the fills copied per second of measured time (the PCIe load the cache adds).
    pub(crate) fill_gb_per_s: f64,
}

impl ExpertCacheFigures {
    pub(crate) fn between(
        before: &EngineStatus,
        after: &EngineStatus,
        decode: CacheCounts,
        stride: u64,
        elapsed: Duration,
    ) -> Option<Self> {
        if after.gpu_expert_slots == 0 {
            return None;
        }
        let CacheCounts { hits, misses } = CacheCounts::between(before, after);
        let fills = after
            .expert_slot_refills_total
            .saturating_sub(before.expert_slot_refills_total);
        Some(ExpertCacheFigures {
            gpu_expert_slots: after.gpu_expert_slots,
            hits,
            misses,
            hit_rate: hits as f64 / (hits + misses).max(1) as f64,
            decode_hits: decode.hits,
            decode_misses: decode.misses,
            decode_hit_rate: decode.hits as f64 / (decode.hits + decode.misses).max(1) as f64,
            fills,
            fill_gb_per_s: (fills * stride) as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9,
        })
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct PrefillBasis {
    /// The engine's pinned host-to-device copy rate into the staging slots, GB/s.
    pub(crate) pcie_gbps: Option<f64>,
    /// The GPU's and the expert executor's routed-expert rates, TFLOP/s, as measured.
    pub(crate) gpu_expert_tflops: Option<f64>,
    pub(crate) cpu_expert_tflops: Option<f64>,
    /// The peak the compute limit is taken against, TFLOP/s, and where it comes from.
    pub(crate) compute_peak_tflops: Option<f64>,
    pub(crate) compute_peak: String,
    pub(crate) arithmetic: PrefillArithmetic,
    pub(crate) pcie_limit: &'static str,
    pub(crate) compute_limit: &'static str,
}

#[derive(Debug, Serialize)]
pub(crate) struct RooflineBasis {
    pub(crate) ratio: &'static str,
    pub(crate) denominator: &'static str,
    pub(crate) ideal: String,
}

/// One row of the batch-decode table.
#[derive(Debug, Serialize)]
pub(crate) struct BatchDecodeRow {
    #[serde(flatten)]
    pub(crate) decode: ConcurrentDecode,
    /// Aggregate tok/s over batch 1's (null when batch 1 was not measured).
    pub(crate) aggregate_over_batch_1: Option<f64>,
    /// Weight bytes one decode step read, averaged over the run's decode steps: the dense
    /// weights and the distinct routed experts of every MoE layer, from RAM and from the
    /// device's memory (all RAM on the CPU device).
    pub(crate) ram_bytes_per_step: f64,
    pub(crate) device_bytes_per_step: f64,
    /// Those bytes at the measured bandwidths, per step (null without a device bandwidth).
    pub(crate) ideal_ms_per_step: Option<f64>,
    /// The ideal step time over the measured one (sequences / aggregate tok/s): the batch's
    /// share of the byte roofline, comparable with batch 1's whatever the batch size (more
    /// rows touch more distinct experts, so the bytes per step grow with the batch).
    pub(crate) roofline_ratio: Option<f64>,
}

impl BatchDecodeRow {
    /// The row of `decode`, whose decode steps read `bytes` per step (RAM, device) and at most
    /// `ideal_ms` per step at the measured bandwidths.
    pub(crate) fn new(decode: ConcurrentDecode, bytes: (f64, f64), ideal_ms: Option<f64>) -> Self {
        let measured_ms = 1e3 * decode.sequences as f64 / decode.aggregate_tok_s;
        let roofline_ratio = ideal_ms
            .filter(|_| measured_ms.is_finite() && measured_ms > 0.0)
            .map(|ideal| ideal / measured_ms);
        BatchDecodeRow {
            decode,
            aggregate_over_batch_1: None,
            ram_bytes_per_step: bytes.0,
            device_bytes_per_step: bytes.1,
            ideal_ms_per_step: ideal_ms,
            roofline_ratio,
        }
    }
}

/// Decode of several sequences at once, from the client's token arrival times.
#[derive(Debug, Serialize)]
pub(crate) struct ConcurrentDecode {
    pub(crate) sequences: usize,
    pub(crate) prompt_tokens: usize,
    /// Tokens of every sequence over the window in which all of them were decoding (from the
    /// last first token to the first last token), per second.
    pub(crate) aggregate_tok_s: f64,
    /// Per sequence in that window.
    pub(crate) per_sequence_tok_s: f64,
    /// Time between consecutive tokens of a sequence, every sequence's steps that ended in
    /// that window.
    pub(crate) step_ms: StepLatency,
}

/// Routed choices served from a GPU slot and not.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CacheCounts {
    pub(crate) hits: u64,
    pub(crate) misses: u64,
}

impl CacheCounts {
    pub(crate) fn between(before: &EngineStatus, after: &EngineStatus) -> Self {
        CacheCounts {
            hits: after
                .expert_cache_hits_total
                .saturating_sub(before.expert_cache_hits_total),
            misses: after
                .expert_cache_misses_total
                .saturating_sub(before.expert_cache_misses_total),
        }
    }

    pub(crate) fn add(&mut self, other: CacheCounts) {
        self.hits += other.hits;
        self.misses += other.misses;
    }
}

pub(crate) fn print_report(report: &Report) {
    let mb = |bytes: f64| bytes / 1e6;
    println!(
        "model {} ({}), device {}{}, experts {}{}, GPU experts per layer: {}{}: {} placed",
        report.model,
        report.architecture,
        report.device,
        report
            .gpus
            .as_deref()
            .map(|gpus| format!(" (GPUs {gpus})"))
            .unwrap_or_default(),
        report.expert_executor,
        if report.expert_compute_reported_by_workers {
            " (compute time reported by the workers)"
        } else {
            ""
        },
        report.moe_gpu_experts,
        report
            .gpu_mem_budget_gib
            .map(|gib| format!(" (budget {gib} GiB)"))
            .unwrap_or_default(),
        report.gpu_experts_per_layer
    );
    println!(
        "dense weights {:.1} MB per forward; one expert {:.2} MB",
        mb(report.dense_weight_bytes_per_forward as f64),
        mb(report.expert_stride_bytes as f64)
    );
    let basis = &report.prefill_basis;
    let optional = |value: Option<f64>, digits: usize| {
        value
            .map(|v| format!("{v:.digits$}"))
            .unwrap_or_else(|| "-".into())
    };
    println!(
        "prefill limits: PCIe {} GB/s (pinned host-to-device, measured by the engine), GPU experts {} TFLOP/s, CPU experts {} TFLOP/s; compute peak {} TFLOP/s ({})",
        optional(basis.pcie_gbps, 1),
        optional(basis.gpu_expert_tflops, 1),
        optional(basis.cpu_expert_tflops, 2),
        optional(basis.compute_peak_tflops, 1),
        basis.compute_peak
    );
    for row in &report.results {
        let limits = &row.prefill_limits;
        let share = |value: Option<f64>| {
            value
                .map(|v| format!("{:.0}%", 100.0 * v))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "  prompt {:>6}: prefill {:>9.1} tok/s, streamed {:.2} GB, PCIe limit {} ms ({} reached), compute limit {} ms ({} reached)",
            row.prompt_tokens,
            row.prefill_tok_s,
            limits.streamed_expert_bytes as f64 / 1e9,
            optional(limits.pcie_limit_ms, 1),
            share(limits.pcie_share),
            optional(limits.compute_limit_ms, 1),
            share(limits.compute_share),
        );
    }
    println!("  PCIe limit = {}.", basis.pcie_limit);
    println!("  compute limit = {}.", basis.compute_limit);
    if let Some(batch) = &report.concurrent_decode {
        println!(
            "{} sequences at once (prompts of {} tokens): aggregate decode {:.1} tok/s, {:.1} tok/s per sequence, step p50 {:.2} ms, p99 {:.2} ms",
            batch.sequences,
            batch.prompt_tokens,
            batch.aggregate_tok_s,
            batch.per_sequence_tok_s,
            batch.step_ms.p50_ms,
            batch.step_ms.p99_ms
        );
    }
    if !report.decode_batches.is_empty() {
        println!(
            "batch decode (prompts of {} tokens; tok/s over the window in which every sequence decodes):",
            report.decode_batches[0].decode.prompt_tokens
        );
        println!(
            "{:>6} {:>14} {:>16} {:>16} {:>9} {:>9} {:>12} {:>12} {:>9}",
            "batch",
            "aggregate tok/s",
            "per-seq tok/s",
            "× batch 1",
            "p50 ms",
            "p99 ms",
            "RAM MB/step",
            "GPU MB/step",
            "roofline"
        );
        for row in &report.decode_batches {
            println!(
                "{:>6} {:>14.1} {:>16.1} {:>16} {:>9.2} {:>9.2} {:>12.1} {:>12.1} {:>9}",
                row.decode.sequences,
                row.decode.aggregate_tok_s,
                row.decode.per_sequence_tok_s,
                row.aggregate_over_batch_1
                    .map(|ratio| format!("{ratio:.2}"))
                    .unwrap_or_else(|| "-".into()),
                row.decode.step_ms.p50_ms,
                row.decode.step_ms.p99_ms,
                row.ram_bytes_per_step / 1e6,
                row.device_bytes_per_step / 1e6,
                row.roofline_ratio
                    .map(|ratio| format!("{:.0}%", 100.0 * ratio))
                    .unwrap_or_else(|| "-".into())
            );
        }
        println!(
            "RAM / GPU MB/step: weight bytes one step read (dense weights and each MoE layer's distinct routed experts), averaged over the run's decode steps. roofline = those bytes at the measured bandwidths / the measured step (sequences / aggregate tok/s): batch sizes compare by it, since more rows read more distinct experts."
        );
    }
    if let Some(figures) = &report.decode_during_prefill {
        bench_during_prefill::print(figures);
    }
    if let Some(cache) = &report.expert_cache {
        println!(
            "expert cache ({} GPU slots): hit rate {:.1}% ({} hits, {} misses), decode only {:.1}% ({} hits, {} misses), {} fills, fill bandwidth {:.2} GB/s",
            cache.gpu_expert_slots,
            100.0 * cache.hit_rate,
            cache.hits,
            cache.misses,
            100.0 * cache.decode_hit_rate,
            cache.decode_hits,
            cache.decode_misses,
            cache.fills,
            cache.fill_gb_per_s
        );
    }
    println!(
        "{:>7} {:>9} {:>8} {:>8} {:>7} {:>7} | {:>9} {:>8} {:>8} {:>9} {:>7} | {:>9} {:>9} {:>8} {:>8}",
        "prompt",
        "prefill",
        "decode",
        "ms/tok",
        "p50 ms",
        "p99 ms",
        "gpu/dense",
        "cpu exp",
        "channel",
        "transfers",
        "other",
        "RAM MB/t",
        "GPU MB/t",
        "ideal ms",
        "roofline"
    );
    for row in &report.results {
        let split = &row.decode.split_ms_per_token;
        println!(
            "{:>7} {:>9.1} {:>8.2} {:>8.2} {:>7.2} {:>7.2} | {:>9.2} {:>8.2} {:>8.2} {:>9.2} {:>7.2} | {:>9.1} {:>9.1} {:>8} {:>8}",
            row.prompt_tokens,
            row.prefill_tok_s,
            row.decode_tok_s,
            row.decode.ms_per_token,
            row.decode_step_ms.p50_ms,
            row.decode_step_ms.p99_ms,
            split.gpu_dense,
            split.cpu_experts,
            split.channel_wait,
            split.transfers,
            split.other,
            mb(row.ram_bytes_per_token),
            mb(row.device_bytes_per_token),
            row.ideal_ms_per_token
                .map(|ms| format!("{ms:.2}"))
                .unwrap_or_else(|| "-".into()),
            row.roofline_ratio
                .map(|r| format!("{:.0}%", 100.0 * r))
                .unwrap_or_else(|| "-".into()),
        );
        if row.repeats > 1 {
            let list = |rates: &[f64]| {
                rates
                    .iter()
                    .map(|r| format!("{r:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let splits = |part: fn(&Split) -> f64| {
                row.decode_split_per_repeat
                    .iter()
                    .map(|split| format!("{:.2}", part(split)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let steps = row
                .decode_step_ms_per_repeat
                .iter()
                .map(|step| format!("{:.2}/{:.2}", step.p50_ms, step.p99_ms))
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "        per run: prefill {} tok/s; decode {} tok/s; step p50/p99 ms {}; decode \
                 ms/tok: gpu/dense {}, cpu exp {}, channel {}",
                list(&row.prefill.tok_per_s_per_repeat),
                list(&row.decode.tok_per_s_per_repeat),
                steps,
                splits(|split| split.gpu_dense),
                splits(|split| split.cpu_experts),
                splits(|split| split.channel_wait),
            );
        }
    }
    println!(
        "prefill/decode: tok/s at the client (decode at batch 1, {} tokens after the prompt). \
         p50/p99 ms: time between consecutive decoded tokens at the client. Columns after \
         p99 ms: decode time per token in ms. roofline = {}; measured = {}; ideal = {}.",
        report.results.first().map(|r| r.decode_tokens).unwrap_or(0),
        report.roofline.ratio,
        report.roofline.denominator,
        report.roofline.ideal
    );
}

/// Bytes per GiB, for the bandwidth line.
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

pub(crate) fn print_bandwidth(result: &BandwidthResult, pool: &ThreadPool) {
    let huge_pages = match result.huge_page_bytes {
        Some(bytes) => format!(
            ", {:.1} GiB of the process on 2 MiB pages{}",
            bytes as f64 / GIB,
            std::env::var(ninfer_cpu_experts::buffer::HUGE_PAGES_VARIABLE)
                .map(|policy| format!(
                    " ({}={policy})",
                    ninfer_cpu_experts::buffer::HUGE_PAGES_VARIABLE
                ))
                .unwrap_or_default()
        ),
        None => String::new(),
    };
    println!(
        "read bandwidth: {:.1} GB/s best, {:.1} GB/s median ({} threads on cpus {}, {:.1} GiB buffer, {} passes{huge_pages})",
        result.best_gbps,
        result.median_gbps,
        result.threads,
        cpu_summary(pool.cpus()),
        result.buffer_bytes as f64 / GIB,
        result.passes
    );
}

pub(crate) fn cpu_summary(cpus: &[usize]) -> String {
    match (cpus.first(), cpus.last()) {
        (Some(first), Some(last)) if cpus.len() == last - first + 1 => format!("{first}-{last}"),
        _ => format!("{cpus:?}"),
    }
}
