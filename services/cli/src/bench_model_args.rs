//! The flags of `ninfer bench MODEL` and the parsing of its lists (prompt lengths, decode
//! batch sizes).
//!
//! Owns: [`ModelBenchArgs`]. Must not touch: the benchmark itself.

use std::path::PathBuf;

use anyhow::{bail, Context};

#[derive(Debug, clap::Args)]
pub struct ModelBenchArgs {
    /// The `.ninfer` artifact to benchmark (`ninfer bench MODEL`; a file named like a bench
    /// subcommand needs a path: `./memory`).
    #[arg(value_name = "MODEL")]
    pub model: Option<PathBuf>,
    /// Where the dense layers run: cpu, cuda or auto (the GPU when one opens).
    #[arg(long, default_value = "auto", value_parser = ["cpu", "cuda", "auto"])]
    pub device: String,
    /// Routed experts per MoE layer on the GPU: N, `half`, `all` or `auto` (as many as fit).
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<String>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
    /// The GPUs to use, by CUDA ordinal (as `ninfer serve --gpus`); several split the decoder
    /// layers over them.
    #[arg(long, value_name = "0,1")]
    pub gpus: Option<String>,
    /// Percent of the decoder layers per GPU of `--gpus` (default: by each card's memory).
    #[arg(long, value_name = "60,40")]
    pub gpu_split: Option<String>,
    /// Compute threads of the CPU experts (per worker, or in-process) and of the RAM
    /// bandwidth reference (default: one per physical core of the NUMA node).
    #[arg(long)]
    pub moe_threads: Option<usize>,
    /// Compute the routed experts inside the engine instead of in worker processes.
    #[arg(long)]
    pub no_workers: bool,
    /// Prompt lengths in tokens, comma-separated; each is one row.
    #[arg(long, default_value = "512,4096")]
    pub prompt_lengths: String,
    /// Tokens decoded (batch 1) after each prompt.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Runs per prompt length (a fresh sequence each time); rows report their totals, and each
    /// run's tok/s is listed so reproducibility shows.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Seed of the random prompts and of the sampling (temperature 1, top-k 20 as in Qwen's
    /// generation configs, so routing keeps changing as it does in real text; greedy decoding
    /// of a random model loops).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Buffer of the RAM bandwidth reference, GiB (as `bench memory --buffer-gib`).
    #[arg(long, default_value_t = 8.0)]
    pub ram_buffer_gib: f64,
    /// Timed passes of the RAM bandwidth reference.
    #[arg(long, default_value_t = 10)]
    pub ram_passes: usize,
    /// NUMA node of the RAM bandwidth reference's threads.
    #[arg(long, default_value_t = 0)]
    pub numa_node: usize,
    /// Seconds to wait for the engine (and workers) to load the model.
    #[arg(long, default_value_t = 900.0)]
    pub ready_timeout: f64,
    /// Also decode this many sequences at once (after the batch-1 runs): the aggregate decode
    /// rate while all of them decode, from the first prompt length. 1: batch 1 only.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Batch sizes of the batch-decode table, comma-separated (for example `1,8`): for each,
    /// that many sequences decode at once from the first prompt length, and the table gives
    /// their aggregate and per-sequence tok/s and the aggregate over batch 1's (when 1 is
    /// listed). Empty: no table.
    #[arg(long, value_name = "B,B,...", default_value = "")]
    pub decode_batch: String,
    /// Also measure one stream's decode alone, then while a second request's prompt of N
    /// tokens is prefilled beside it (until that prompt's first token): both tok/s, their
    /// ratio, the stream's step percentiles and longest gap, the long prompt's prefill tok/s
    /// and time to first token. The stream's prompt is the first of `--prompt-lengths`; the
    /// scheduler's prefill share and chunk are the engine's (`--engine-arg`).
    #[arg(long, value_name = "N")]
    pub decode_during_prefill: Option<usize>,
    /// Extra arguments for the engine (repeat the flag per argument).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The compute peak, TFLOP/s, that each prefill's share of the compute limit is taken
    /// against (e.g. a GPU's dense bf16 peak); default: the GPU expert rate the engine
    /// measured at start for layerwise prefill.
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
}

pub(crate) fn parse_lengths(text: &str) -> anyhow::Result<Vec<usize>> {
    let lengths: Vec<usize> = text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse::<usize>()
                .ok()
                // One token would make the prompt's forward look like a decode step.
                .filter(|&n| n >= 2)
                .with_context(|| {
                    format!("--prompt-lengths: `{item}` is not a length of at least 2 tokens")
                })
        })
        .collect::<Result<_, _>>()?;
    if lengths.is_empty() {
        bail!("--prompt-lengths names nothing");
    }
    Ok(lengths)
}

/// `--decode-batch`: batch sizes of at least 1, in the order given, without repeats.
pub(crate) fn parse_decode_batches(text: &str) -> anyhow::Result<Vec<usize>> {
    let mut batches: Vec<usize> = Vec::new();
    for item in text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
    {
        let batch = item
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .with_context(|| {
                format!("--decode-batch: `{item}` is not a batch size of at least 1")
            })?;
        if !batches.contains(&batch) {
            batches.push(batch);
        }
    }
    Ok(batches)
}

#[cfg(test)]
mod tests {
    use super::parse_decode_batches;

    #[test]
    fn decode_batches_parse_in_order_without_repeats_and_refuse_zero() {
        assert_eq!(parse_decode_batches("1,8").ok(), Some(vec![1, 8]));
        assert_eq!(parse_decode_batches(" 8, 1 ,8,").ok(), Some(vec![8, 1]));
        assert_eq!(parse_decode_batches("").ok(), Some(vec![]));
        assert!(parse_decode_batches("0").is_err());
        assert!(parse_decode_batches("1,x").is_err());
    }
}
