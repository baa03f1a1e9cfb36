//! The measurement of `ninfer bench MODEL` against a running pipeline: each prompt length's
//! prefill and decode timed at the client and split by the engine's profile counters, the
//! concurrent and batched decode windows, the expert cache's counters over the runs.
//!
//! Owns: the generations, timings and the arithmetic from counters to figures. Must not touch:
//! starting the pipeline (`bench_model.rs`), printing (`bench_model_report.rs`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{
    EngineProfile, EngineStatus, EngineStatusRequest, FinishReason, ModelInfoRequest, PhaseProfile,
    ProfileRequest,
};
use tonic::transport::Channel;

use crate::bench_during_prefill;
use crate::bench_model_args::ModelBenchArgs;
use crate::bench_model_report::{
    BatchDecodeRow, CacheCounts, ConcurrentDecode, ExpertCacheFigures, PhaseFigures,
    PrefillArithmetic, PrefillBasis, PrefillLimits, Report, RooflineBasis, Row, Split,
};
use crate::bench_tokens::{bench_request, gaps, random_tokens, StepLatency};
use crate::serve::connect_when_ready;
use crate::supervisor::{stop_requested, Supervisor};
use ninfer_cpu_experts::bench::BandwidthResult;

async fn engine_status(client: &mut EngineClient<Channel>) -> anyhow::Result<EngineStatus> {
    Ok(client
        .get_status(EngineStatusRequest {})
        .await
        .context("reading the engine's status (GetStatus)")?
        .into_inner())
}

/// Client-side times of one generation.
struct Timing {
    prefill: Duration,
    decode: Duration,
    decoded: usize,
    /// The gaps between consecutive tokens (the decode steps as the client sees them).
    steps: Vec<Duration>,
    /// The expert cache's hits and misses from the first token to the end: the decode's
    /// routing without the prompt's (whose thousands of tokens dominate the whole-run counts).
    /// The status is read beside the stream when the first token arrives, so a decode step or
    /// two may fall before it.
    decode_cache: CacheCounts,
}

async fn generate(
    client: &mut EngineClient<Channel>,
    prompt: Vec<u32>,
    new_tokens: usize,
    seed: u64,
) -> anyhow::Result<Timing> {
    let request = bench_request(
        format!("bench-{seed}-{}", prompt.len()),
        prompt,
        new_tokens,
        seed,
    );
    let started = Instant::now();
    let mut stream = client
        .generate(request)
        .await
        .context("starting a generation")?
        .into_inner();
    let mut arrivals = Vec::with_capacity(new_tokens);
    let mut status_at_first_token = None;
    while let Some(message) = stream.message().await.context("generating")? {
        if !message.no_token {
            arrivals.push(Instant::now());
            if arrivals.len() == 1 {
                // Beside the stream, so reading it does not delay the next tokens' arrival.
                let mut status_client = client.clone();
                status_at_first_token = Some(tokio::spawn(async move {
                    engine_status(&mut status_client).await
                }));
            }
        }
        let reason =
            FinishReason::try_from(message.finish_reason).unwrap_or(FinishReason::Unspecified);
        if reason != FinishReason::Unspecified && reason != FinishReason::Length {
            bail!(
                "the generation ended early ({reason:?}) after {} tokens",
                arrivals.len()
            );
        }
    }
    let (Some(&first), Some(&last)) = (arrivals.first(), arrivals.last()) else {
        bail!("the engine produced no token");
    };
    if arrivals.len() != new_tokens {
        bail!(
            "asked for {new_tokens} tokens, the engine produced {}",
            arrivals.len()
        );
    }
    let decode_cache = match status_at_first_token {
        Some(task) => {
            let at_first_token = task
                .await
                .context("reading the engine's status at the first token")??;
            CacheCounts::between(&at_first_token, &engine_status(client).await?)
        }
        None => CacheCounts::default(),
    };
    Ok(Timing {
        prefill: first - started,
        decode: last - first,
        decoded: arrivals.len() - 1,
        steps: gaps(&arrivals),
        decode_cache,
    })
}

/// The arrival time of every token of one generation.
async fn token_arrivals(
    mut client: EngineClient<Channel>,
    prompt: Vec<u32>,
    new_tokens: usize,
    seed: u64,
) -> anyhow::Result<Vec<Instant>> {
    let request = bench_request(format!("bench-concurrent-{seed}"), prompt, new_tokens, seed);
    let mut stream = client
        .generate(request)
        .await
        .context("starting a generation")?
        .into_inner();
    let mut arrivals = Vec::with_capacity(new_tokens);
    while let Some(message) = stream.message().await.context("generating")? {
        if !message.no_token {
            arrivals.push(Instant::now());
        }
    }
    if arrivals.len() != new_tokens {
        bail!(
            "asked for {new_tokens} tokens, the engine produced {}",
            arrivals.len()
        );
    }
    Ok(arrivals)
}

/// `sequences` generations at once: the decode rate over the window in which every one of
/// them was decoding.
async fn measure_concurrent_decode(
    client: &EngineClient<Channel>,
    sequences: usize,
    prompt_tokens: usize,
    decode_tokens: usize,
    vocab: u32,
    seed: u64,
) -> anyhow::Result<ConcurrentDecode> {
    let runs: Vec<_> = (0..sequences)
        .map(|index| {
            let seed = seed.wrapping_mul(7_919).wrapping_add(index as u64);
            tokio::spawn(token_arrivals(
                client.clone(),
                random_tokens(prompt_tokens, vocab, seed),
                decode_tokens + 1,
                seed,
            ))
        })
        .collect();
    let mut arrivals = Vec::with_capacity(sequences);
    for run in runs {
        arrivals.push(run.await.context("a concurrent generation's task")??);
    }
    let (start, end) = common_decode_window(&arrivals, decode_tokens)?;
    let tokens: usize = arrivals
        .iter()
        .map(|a| a.iter().filter(|&&t| t > start && t <= end).count())
        .sum();
    let steps: Vec<Duration> = arrivals
        .iter()
        .flat_map(|a| {
            a.windows(2)
                .filter(|pair| pair[1] > start && pair[1] <= end)
                .map(|pair| pair[1] - pair[0])
        })
        .collect();
    let seconds = (end - start).as_secs_f64();
    Ok(ConcurrentDecode {
        sequences,
        prompt_tokens,
        aggregate_tok_s: tokens as f64 / seconds,
        per_sequence_tok_s: tokens as f64 / seconds / sequences as f64,
        step_ms: StepLatency::of(&steps),
    })
}

/// The window in which every concurrent generation was decoding: from the last one's first
/// token to the first one's last. Where there is none (the prompts prefilled one after the
/// other, and an early sequence finished its `decode_tokens` before a late one began), the error
/// says how many decode tokens would have made them overlap, at the early sequence's own pace.
fn common_decode_window(
    arrivals: &[Vec<Instant>],
    decode_tokens: usize,
) -> anyhow::Result<(Instant, Instant)> {
    if arrivals.is_empty() || arrivals.iter().any(Vec::is_empty) {
        bail!("a concurrent generation produced no token");
    }
    let start = arrivals.iter().filter_map(|a| a.first()).max().copied();
    let end = arrivals.iter().filter_map(|a| a.last()).min().copied();
    let (Some(start), Some(end)) = (start, end) else {
        bail!("a concurrent generation produced no token");
    };
    if end > start {
        return Ok((start, end));
    }
    let gap = start - end;
    // The sequence that finished first, and its time per token.
    let per_token = arrivals
        .iter()
        .filter(|a| a.last() == Some(&end) && a.len() > 1)
        .find_map(|a| {
            let (first, last) = (a.first()?, a.last()?);
            Some((*last - *first).as_secs_f64() / (a.len() - 1) as f64)
        })
        .filter(|&seconds| seconds > 0.0);
    let advice = match per_token {
        Some(seconds) => {
            // A quarter more than the bare overlap, so the window holds a few steps of all.
            let needed = decode_tokens as f64 + 1.25 * gap.as_secs_f64() / seconds;
            format!(
                "; ask for at least {} decode tokens (--decode-tokens) so that all overlap",
                needed.ceil() as u64
            )
        }
        None => String::new(),
    };
    bail!(
        "the {} concurrent generations never decoded at the same time: the last one's first token came {:.2} s after the first one's last{advice}",
        arrivals.len(),
        gap.as_secs_f64()
    )
}

async fn profile(
    client: &mut EngineClient<Channel>,
    reset: bool,
    measure_device_bandwidth: bool,
) -> anyhow::Result<EngineProfile> {
    Ok(client
        .get_profile(ProfileRequest {
            reset,
            measure_device_bandwidth,
        })
        .await
        .context("reading the engine's profile (GetProfile)")?
        .into_inner())
}

fn add_phase(total: &mut PhaseProfile, part: &PhaseProfile) {
    total.forwards += part.forwards;
    total.tokens += part.tokens;
    total.forward_nanos += part.forward_nanos;
    total.expert_wait_nanos += part.expert_wait_nanos;
    total.expert_compute_nanos += part.expert_compute_nanos;
    total.transfer_nanos += part.transfer_nanos;
    total.moe_layer_calls += part.moe_layer_calls;
    total.cpu_experts += part.cpu_experts;
    total.resident_experts += part.resident_experts;
    total.cpu_expert_bytes += part.cpu_expert_bytes;
    total.resident_expert_bytes += part.resident_expert_bytes;
    total.streamed_experts += part.streamed_experts;
    total.streamed_expert_bytes += part.streamed_expert_bytes;
}

/// The figures of a phase: `counters` from the engine, `wall` at the client for `tokens`.
fn phase_figures(
    counters: &PhaseProfile,
    tokens: u64,
    wall: Duration,
    per_repeat: Vec<f64>,
) -> PhaseFigures {
    let per_token = |nanos: u64| nanos as f64 / 1e6 / tokens.max(1) as f64;
    let forward = per_token(counters.forward_nanos);
    // The client's window cannot be shorter than the engine's computing; when it is, the
    // stream delivered several tokens together (sub-millisecond tokens on a busy machine) and
    // the engine's forward time is the better measure.
    let wall = wall.max(Duration::from_nanos(counters.forward_nanos));
    let ms_per_token = wall.as_secs_f64() * 1e3 / tokens.max(1) as f64;
    let wait = per_token(counters.expert_wait_nanos);
    let compute = per_token(
        counters
            .expert_compute_nanos
            .min(counters.expert_wait_nanos),
    );
    let transfers = per_token(counters.transfer_nanos);
    let count = |value: u64| value as f64 / tokens.max(1) as f64;
    PhaseFigures {
        tokens,
        forwards: counters.forwards,
        wall_ms: wall.as_secs_f64() * 1e3,
        tok_per_s: tokens as f64 / wall.as_secs_f64().max(1e-12),
        tok_per_s_per_repeat: per_repeat,
        engine_forward_ms_per_token: forward,
        ms_per_token,
        split_ms_per_token: Split {
            gpu_dense: (forward - wait - transfers).max(0.0),
            cpu_experts: compute,
            channel_wait: wait - compute,
            transfers,
            other: (ms_per_token - forward).max(0.0),
        },
        cpu_experts_per_token: count(counters.cpu_experts),
        gpu_experts_per_token: count(counters.resident_experts),
        cpu_expert_bytes_per_token: count(counters.cpu_expert_bytes),
        gpu_expert_bytes_per_token: count(counters.resident_expert_bytes),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) async fn measure(
    args: &ModelBenchArgs,
    lengths: &[usize],
    decode_batches: &[usize],
    stream_max_new_tokens: usize,
    address: &str,
    supervisor: &mut Supervisor,
    ram_bandwidth: BandwidthResult,
    model: String,
    architecture: String,
    arithmetic: PrefillArithmetic,
) -> anyhow::Result<Report> {
    let mut client = connect_when_ready(
        address,
        supervisor,
        Duration::from_secs_f64(args.ready_timeout.clamp(1.0, 86_400.0)),
    )
    .await?;
    let vocab = client
        .get_model_info(ModelInfoRequest {})
        .await
        .context("reading the model's info")?
        .into_inner()
        .vocab_size;
    let first = profile(&mut client, false, false).await?;
    let on_gpu = first.device == "cuda";
    let (device_bandwidth_gbps, device_bandwidth_error) = if on_gpu {
        let measured = profile(&mut client, false, true).await?;
        if measured.device_copy_bytes_per_second > 0.0 {
            (Some(measured.device_copy_bytes_per_second / 1e9), None)
        } else {
            (None, Some(measured.device_bandwidth_error))
        }
    } else {
        (None, None)
    };
    if !args.json {
        match (device_bandwidth_gbps, &device_bandwidth_error) {
            (Some(gbps), _) => println!("device copy bandwidth: {gbps:.1} GB/s (2 · size / time)"),
            (None, Some(problem)) => println!("device copy bandwidth: not measured: {problem}"),
            (None, None) => {}
        }
    }
    // Warm-up, not measured: one whole run of the first measured shape (prompt and every
    // decoded token). First touches of weights and kernels, and the growth of the engine's
    // buffer pools and KV cache up to that shape, are not the steady state: with a 16-token
    // warm-up the first of two measured runs decoded 6–9% slower than the second in every
    // pair.
    generate(
        &mut client,
        random_tokens(lengths[0], vocab, args.seed ^ 0xa5a5),
        args.decode_tokens + 1,
        args.seed,
    )
    .await
    .context("warm-up generation")?;
    profile(&mut client, true, false).await?;

    let ram_bytes_per_second = ram_bandwidth.best_gbps * 1e9;
    let positive = |value: f64| (value > 0.0).then_some(value);
    let pcie_bytes_per_second = positive(first.prefill_copy_bytes_per_second);
    let gpu_expert_flops =
        positive(first.prefill_gpu_pairs_per_second * first.expert_flops_per_pair);
    let cpu_expert_flops =
        positive(first.prefill_executor_pairs_per_second * first.expert_flops_per_pair);
    let compute_peak = args
        .peak_tflops
        .map(|peak| peak * 1e12)
        .or(gpu_expert_flops);
    let status_before = engine_status(&mut client).await?;
    let measuring = Instant::now();
    let mut decode_cache = CacheCounts::default();
    let mut rows = Vec::new();
    let mut last = first;
    for &length in lengths {
        let (mut prefill, mut decode) = (PhaseProfile::default(), PhaseProfile::default());
        let (mut prefill_wall, mut decode_wall) = (Duration::ZERO, Duration::ZERO);
        let (mut prefill_rates, mut decode_rates) = (Vec::new(), Vec::new());
        let mut decoded = 0u64;
        let mut decode_split_per_repeat = Vec::new();
        let (mut decode_steps, mut decode_step_ms_per_repeat) = (Vec::new(), Vec::new());
        for repeat in 0..args.repeats {
            if stop_requested() {
                bail!("interrupted");
            }
            let seed = args
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add((length as u64) << 8 | repeat as u64);
            let prompt = random_tokens(length, vocab, seed);
            // One token more than decoded: the first comes from the prefill forward.
            let timing = generate(&mut client, prompt, args.decode_tokens + 1, seed)
                .await
                .with_context(|| format!("prompt of {length} tokens, run {}", repeat + 1))?;
            let counters = profile(&mut client, true, false).await?;
            add_phase(&mut prefill, &counters.prefill.unwrap_or_default());
            add_phase(&mut decode, &counters.decode.unwrap_or_default());
            decode_cache.add(timing.decode_cache);
            prefill_wall += timing.prefill;
            decode_wall += timing.decode;
            decoded += timing.decoded as u64;
            prefill_rates.push(length as f64 / timing.prefill.as_secs_f64().max(1e-12));
            decode_rates.push(timing.decoded as f64 / timing.decode.as_secs_f64().max(1e-12));
            decode_step_ms_per_repeat.push(StepLatency::of(&timing.steps));
            decode_steps.extend_from_slice(&timing.steps);
            // Each run's own split shows which part moves when two runs differ.
            let run_decode = counters.decode.unwrap_or_default();
            decode_split_per_repeat.push(
                phase_figures(
                    &run_decode,
                    timing.decoded as u64,
                    timing.decode,
                    Vec::new(),
                )
                .split_ms_per_token,
            );
            last = counters;
        }
        let prompt_tokens = (length * args.repeats) as u64;
        let streamed_expert_bytes = prefill.streamed_expert_bytes;
        let prefill = phase_figures(&prefill, prompt_tokens, prefill_wall, prefill_rates);
        let prefill_seconds = prefill.wall_ms / 1e3;
        let flops = arithmetic.prompt_flops(length) * args.repeats as f64;
        let pcie_limit = pcie_bytes_per_second
            .filter(|_| streamed_expert_bytes > 0)
            .map(|rate| streamed_expert_bytes as f64 / rate);
        let compute_limit = compute_peak.map(|peak| flops / peak);
        let prefill_limits = PrefillLimits {
            streamed_expert_bytes,
            pcie_limit_ms: pcie_limit.map(|s| s * 1e3),
            pcie_share: pcie_limit.map(|s| s / prefill_seconds.max(1e-12)),
            flops,
            compute_limit_ms: compute_limit.map(|s| s * 1e3),
            compute_share: compute_limit.map(|s| s / prefill_seconds.max(1e-12)),
        };
        let decode = phase_figures(&decode, decoded, decode_wall, decode_rates);
        let dense = last.dense_weight_bytes_per_forward as f64;
        // Where each byte of a decoded token is read from: CPU experts from RAM; dense
        // weights and resident experts from the device's memory (RAM on the CPU device).
        let (ram_bytes, device_bytes) = if on_gpu {
            (
                decode.cpu_expert_bytes_per_token,
                dense + decode.gpu_expert_bytes_per_token,
            )
        } else {
            (
                decode.cpu_expert_bytes_per_token + dense + decode.gpu_expert_bytes_per_token,
                0.0,
            )
        };
        let ideal_seconds = match device_bandwidth_gbps {
            _ if !on_gpu => Some(ram_bytes / ram_bytes_per_second),
            Some(gbps) => Some(ram_bytes / ram_bytes_per_second + device_bytes / (gbps * 1e9)),
            None => None,
        };
        let ideal_ms = ideal_seconds.map(|s| s * 1e3);
        rows.push(Row {
            prompt_tokens: length,
            decode_tokens: args.decode_tokens,
            repeats: args.repeats,
            prefill_tok_s: prefill.tok_per_s,
            decode_tok_s: decode.tok_per_s,
            ram_bytes_per_token: ram_bytes,
            device_bytes_per_token: device_bytes,
            roofline_ratio: ideal_ms.map(|ideal| ideal / decode.ms_per_token.max(1e-12)),
            ideal_ms_per_token: ideal_ms,
            prefill,
            prefill_limits,
            decode,
            decode_split_per_repeat,
            decode_step_ms: StepLatency::of(&decode_steps),
            decode_step_ms_per_repeat,
        });
    }
    let concurrent_decode = if args.concurrency > 1 {
        let figures = measure_concurrent_decode(
            &client,
            args.concurrency,
            lengths[0],
            args.decode_tokens,
            vocab,
            args.seed,
        )
        .await
        .with_context(|| format!("decoding {} sequences at once", args.concurrency))?;
        profile(&mut client, true, false).await?;
        Some(figures)
    } else {
        None
    };
    let mut decode_batch_rows: Vec<BatchDecodeRow> = Vec::with_capacity(decode_batches.len());
    if !decode_batches.is_empty() {
        // Each batch's decode counters from zero.
        profile(&mut client, true, false).await?;
    }
    for &batch in decode_batches {
        let decode = measure_concurrent_decode(
            &client,
            batch,
            lengths[0],
            args.decode_tokens,
            vocab,
            args.seed.wrapping_add(batch as u64),
        )
        .await
        .with_context(|| format!("decoding a batch of {batch} sequences"))?;
        let counters = profile(&mut client, true, false).await?;
        let steps = counters.decode.as_ref().map_or(0, |phase| phase.forwards);
        let per_step = |bytes: u64| bytes as f64 / steps.max(1) as f64;
        let (cpu_bytes, resident_bytes) = counters.decode.as_ref().map_or((0.0, 0.0), |phase| {
            (
                per_step(phase.cpu_expert_bytes),
                per_step(phase.resident_expert_bytes),
            )
        });
        let dense = counters.dense_weight_bytes_per_forward as f64;
        let (ram_bytes, device_bytes) = if on_gpu {
            (cpu_bytes, dense + resident_bytes)
        } else {
            (cpu_bytes + dense + resident_bytes, 0.0)
        };
        let ideal_ms = match device_bandwidth_gbps {
            _ if steps == 0 => None,
            _ if !on_gpu => Some(ram_bytes / ram_bytes_per_second),
            Some(gbps) => Some(ram_bytes / ram_bytes_per_second + device_bytes / (gbps * 1e9)),
            None => None,
        }
        .map(|seconds| seconds * 1e3);
        decode_batch_rows.push(BatchDecodeRow::new(
            decode,
            (ram_bytes, device_bytes),
            ideal_ms,
        ));
    }
    let batch_1 = decode_batch_rows
        .iter()
        .find(|row| row.decode.sequences == 1)
        .map(|row| row.decode.aggregate_tok_s);
    if let Some(batch_1) = batch_1.filter(|&rate| rate > 0.0) {
        for row in &mut decode_batch_rows {
            row.aggregate_over_batch_1 = Some(row.decode.aggregate_tok_s / batch_1);
        }
    }
    let decode_during_prefill = match args.decode_during_prefill {
        Some(prompt) => {
            let figures = bench_during_prefill::measure(
                &client,
                prompt,
                lengths[0],
                stream_max_new_tokens,
                args.decode_tokens,
                vocab,
                args.seed.wrapping_add(0xdec0de),
            )
            .await
            .with_context(|| format!("decoding during a prefill of {prompt} tokens"))?;
            profile(&mut client, true, false).await?;
            Some(figures)
        }
        None => None,
    };
    let expert_cache = ExpertCacheFigures::between(
        &status_before,
        &engine_status(&mut client).await?,
        decode_cache,
        last.expert_stride_bytes,
        measuring.elapsed(),
    );
    Ok(Report {
        concurrent_decode,
        decode_batches: decode_batch_rows,
        decode_during_prefill,
        expert_cache,
        model,
        architecture,
        device: last.device.clone(),
        expert_executor: last.expert_executor.clone(),
        moe_gpu_experts: args
            .moe_gpu_experts
            .clone()
            .unwrap_or_else(|| "0".into()),
        gpu_mem_budget_gib: args.gpu_mem_budget,
        gpus: args.gpus.clone(),
        gpu_experts_per_layer: last.gpu_experts_per_layer,
        expert_stride_bytes: last.expert_stride_bytes,
        dense_weight_bytes_per_forward: last.dense_weight_bytes_per_forward,
        expert_compute_reported_by_workers: last.expert_compute_reported,
        ram_bandwidth,
        device_bandwidth_gbps,
        device_bandwidth_error,
        roofline: RooflineBasis {
            ratio: "ideal time per decoded token / measured time per decoded token (1 = at the bandwidth limit)",
            denominator: "wall time per decoded token at the client (batch 1, gRPC stream, sampling included; never less than the engine's forward time, which it replaces when the stream delivered tokens together)",
            ideal: if on_gpu {
                "CPU expert bytes / RAM bandwidth (best of the reference) + (dense bytes + resident expert bytes) / device copy bandwidth".into()
            } else {
                "(CPU expert bytes + dense bytes) / RAM bandwidth (best of the reference); the CPU device reads every weight from RAM".into()
            },
        },
        prefill_basis: PrefillBasis {
            pcie_gbps: pcie_bytes_per_second.map(|rate| rate / 1e9),
            gpu_expert_tflops: gpu_expert_flops.map(|rate| rate / 1e12),
            cpu_expert_tflops: cpu_expert_flops.map(|rate| rate / 1e12),
            compute_peak_tflops: compute_peak.map(|rate| rate / 1e12),
            compute_peak: match (args.peak_tflops, gpu_expert_flops) {
                (Some(_), _) => "--peak-tflops".into(),
                (None, Some(_)) => "the GPU expert rate the engine measured at start (grouped expert kernels over 4096 rows of uniform routing)".into(),
                (None, None) => "none (layerwise prefill off and no --peak-tflops)".into(),
            },
            arithmetic,
            pcie_limit: "expert bytes streamed into the staging slots / the engine's measured pinned host-to-device rate; share = that time / the prefill's wall time",
            compute_limit: "prompt FLOPs (2 · dense matrix parameters + 6 · hidden · moe_intermediate · top-k · MoE layers per token, + 4 · heads · head_dim per causal (query, key) pair per full-attention layer) / the compute peak; share = that time / the prefill's wall time",
        },
        results: rows,
    })
}

#[cfg(test)]
mod tests {
    use super::common_decode_window;
    use std::time::{Duration, Instant};

    /// Arrival times at `offsets` milliseconds after `zero`.
    fn at(zero: Instant, offsets: &[u64]) -> Vec<Instant> {
        offsets
            .iter()
            .map(|&ms| zero + Duration::from_millis(ms))
            .collect()
    }

    #[test]
    fn the_common_window_runs_from_the_last_first_token_to_the_first_last_one() {
        let zero = Instant::now();
        let arrivals = [at(zero, &[0, 10, 20, 30]), at(zero, &[5, 15, 25, 35, 45])];
        let (start, end) = common_decode_window(&arrivals, 4).unwrap();
        assert_eq!(start, zero + Duration::from_millis(5));
        assert_eq!(end, zero + Duration::from_millis(30));
    }

    #[test]
    fn generations_that_never_overlap_are_told_how_many_tokens_would() {
        let zero = Instant::now();
        // The first decodes 3 tokens 10 ms apart and is done at 30 ms; the second starts at
        // 130 ms: 100 ms = 10 of the first's tokens too few, 12.5 with the margin.
        let arrivals = [at(zero, &[0, 10, 20, 30]), at(zero, &[130, 140, 150, 160])];
        let error = common_decode_window(&arrivals, 3).unwrap_err().to_string();
        assert!(error.contains("came 0.10 s after"), "{error}");
        assert!(error.contains("at least 16 decode tokens"), "{error}");
        assert!(common_decode_window(&[Vec::new(), at(zero, &[1])], 1)
            .unwrap_err()
            .to_string()
            .contains("produced no token"));
    }
}
