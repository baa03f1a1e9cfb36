//! `ninfer bench MODEL`: end-to-end prefill and decode speed of the real pipeline (expert
//! workers + engine, as `ninfer serve` starts them, no gateway), with the decode time per token
//! split into its parts and the roofline ratio against this machine's measured bandwidths.
//!
//! This file checks the flags, measures the RAM bandwidth reference and places the pipeline
//! (the engine's sequences, context and expert placement flags), then hands over to the
//! measurement (`bench_model_measure.rs`) and prints its report (`bench_model_report.rs`);
//! the flags are `bench_model_args.rs`.
//! Owns: the benchmark's run from flags to report. Must not touch: the counters themselves
//! (`ninfer_engine::profile`), the RAM bandwidth measurement
//! (`ninfer_cpu_experts::bench::measure_read_bandwidth`, as `bench memory`) or the device one
//! (`CudaBackend::measure_copy_bandwidth`, run by the engine).

use anyhow::{bail, Context};
use ninfer_cpu_experts::bench::measure_read_bandwidth;
use ninfer_cpu_experts::ThreadPool;

use crate::bench_during_prefill;
use crate::bench_model_args::{parse_decode_batches, parse_lengths, ModelBenchArgs};
use crate::bench_model_measure::measure;
use crate::bench_model_report::{print_bandwidth, print_report, PrefillArithmetic};
use crate::serve::{plan_for, resolve_model, start_pipeline, EngineFlags};
use crate::supervisor::{install_stop_handler, Supervisor};

pub fn run(args: ModelBenchArgs) -> anyhow::Result<()> {
    let Some(model_arg) = args.model.clone() else {
        bail!("name a MODEL (`ninfer bench MODEL`) or a subcommand (memory, experts, channel)");
    };
    let lengths = parse_lengths(&args.prompt_lengths)?;
    let decode_batches = parse_decode_batches(&args.decode_batch)?;
    if args.decode_tokens == 0 {
        bail!("--decode-tokens must be at least 1");
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if args.moe_threads == Some(0) {
        bail!("--moe-threads must be at least 1");
    }
    if !(args.ram_buffer_gib.is_finite() && args.ram_buffer_gib > 0.0) {
        bail!("--ram-buffer-gib must be a positive number of GiB");
    }
    if !(model_arg.exists()) {
        bail!(
            "{}: no such model file (make one with `ninfer convert`)",
            model_arg.display()
        );
    }
    let model = resolve_model(&model_arg)?;
    let artifact = ninfer_artifact::Artifact::open(&model)
        .with_context(|| format!("opening {}", model.display()))?;
    let architecture = artifact.config().architecture().to_string();
    let arithmetic = PrefillArithmetic::of(&artifact);
    let model_context = artifact.config().common().max_position_embeddings;
    drop(artifact);
    if args
        .peak_tflops
        .is_some_and(|peak| !(peak.is_finite() && peak > 0.0))
    {
        bail!("--peak-tflops must be a positive number");
    }
    let longest = lengths.iter().copied().max().unwrap_or(1);
    let mut max_context = longest + args.decode_tokens + 1;
    // The stream of `--decode-during-prefill` asks for every position the context leaves it,
    // up to the model's limit, so it outlasts the long prompt's prefill by a wide margin.
    let mut stream_max_new_tokens = 0;
    if let Some(prompt) = args.decode_during_prefill {
        if prompt < 2 {
            bail!("--decode-during-prefill must be a prompt of at least 2 tokens");
        }
        if prompt >= model_context {
            bail!(
                "--decode-during-prefill {prompt}: the prompt and its first token need {} \
                 positions; the model holds {model_context}",
                prompt + 1
            );
        }
        let wanted = lengths[0].saturating_add(bench_during_prefill::stream_tokens_wanted(
            args.decode_tokens,
            prompt,
        ));
        max_context = max_context.max(prompt + 1).max(wanted.min(model_context));
        stream_max_new_tokens = max_context.saturating_sub(lengths[0]);
        if stream_max_new_tokens
            < args.decode_tokens + 2 + bench_during_prefill::TOKENS_AFTER_PREFILL
        {
            bail!(
                "--decode-during-prefill: the stream's prompt (the first --prompt-lengths entry, \
                 {} tokens) leaves it only {stream_max_new_tokens} of the model's \
                 {model_context} positions",
                lengths[0]
            );
        }
    }

    // The reference first, while nothing else runs; its pool is gone before the workers pin
    // their threads.
    let ram_bandwidth = {
        let pool = ThreadPool::for_numa_node(args.numa_node, args.moe_threads)
            .context("starting the RAM bandwidth threads")?;
        let bytes = (args.ram_buffer_gib * (1u64 << 30) as f64) as usize;
        let result = measure_read_bandwidth(&pool, bytes, args.ram_passes.max(1))
            .context("measuring RAM read bandwidth")?;
        if !args.json {
            print_bandwidth(&result, &pool);
        }
        result
    };

    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    let mut engine_args = vec![
        "--device".to_string(),
        args.device.clone(),
        // One sequence's KV cache per sequence decoded at once, so `--gpu-mem-budget` leaves
        // the rest to experts.
        "--max-sequences".into(),
        decode_batches
            .iter()
            .copied()
            .chain([args.concurrency])
            // The stream and the long prompt.
            .chain(args.decode_during_prefill.map(|_| 2))
            .max()
            .unwrap_or(1)
            .max(1)
            .to_string(),
    ];
    engine_args.extend(args.engine_args.iter().cloned());
    let flags = EngineFlags {
        moe_threads: args.moe_threads,
        max_context: Some(max_context),
        no_workers: args.no_workers,
        // Exactly what was asked (0 when not given): the benchmark's figures name it.
        moe_gpu_experts: Some(args.moe_gpu_experts.clone().unwrap_or_else(|| "0".into())),
        gpu_mem_budget: args.gpu_mem_budget,
        gpus: args.gpus.clone(),
        gpu_split: args.gpu_split.clone(),
        engine_args,
        ..EngineFlags::default()
    };
    let (_, plan) = plan_for(&model, &flags, &flags.request(None), false)?;
    let listen = supervisor.socket("engine");
    let address = start_pipeline(&mut supervisor, &model, &listen, &flags, &plan)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(measure(
        &args,
        &lengths,
        &decode_batches,
        stream_max_new_tokens,
        &address,
        &mut supervisor,
        ram_bandwidth,
        model.display().to_string(),
        architecture,
        arithmetic,
    ));
    supervisor.stop_all();
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}
