//! `ninfer bench sampling`: host time to sample one token from a whole row of logits, the path
//! of every request the GPU's candidates cannot serve (no top-k, or guided decoding), per
//! sampling setting; beside it, the time to build the row's whole distribution (what
//! speculative decoding's verification needs per row) and the time to put the whole row in
//! order, which both paths took at every step before they did without sorting.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_engine::sampling::{
    filtered_distribution, filtered_distribution_unordered, Sampler, SamplingParams, Xoshiro256,
};

#[derive(Debug, clap::Args)]
pub struct SamplingBenchArgs {
    /// Logits per row (default: the Qwen vocabulary).
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Timed draws per setting.
    #[arg(long, default_value_t = 50)]
    pub draws: usize,
    /// Seed of the logits and of the draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// (temperature, top-k, top-p): without top-k (the whole row), then Qwen's recommended top-k 20
/// (served from the candidates on a GPU; here from the whole row) for comparison.
const SETTINGS: [(f32, usize, f32); 4] =
    [(1.0, 0, 1.0), (1.0, 0, 0.95), (0.7, 0, 0.8), (1.0, 20, 1.0)];

pub fn run(args: SamplingBenchArgs) -> anyhow::Result<()> {
    if args.vocab == 0 {
        bail!("--vocab must be at least 1");
    }
    if args.draws == 0 {
        bail!("--draws must be at least 1");
    }
    let logits = trained_like_logits(args.vocab, args.seed);
    println!(
        "one row of {} logits (seed {}), {} draws per setting; ms per draw, best and median",
        args.vocab, args.seed, args.draws
    );
    println!(
        " temperature  top-k  top-p |  sample: best   median | distribution: best   median | sort the row: best   median"
    );
    for (temperature, top_k, top_p) in SETTINGS {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: args.seed,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params.clone()).context("sampling settings")?;
        let mut sample_times = Vec::with_capacity(args.draws);
        let mut distribution_times = Vec::with_capacity(args.draws);
        let mut sort_times = Vec::with_capacity(args.draws);
        for _ in 0..args.draws {
            let start = Instant::now();
            let token = sampler.sample(&logits, &[]).context("sampling")?;
            sample_times.push(start.elapsed());
            std::hint::black_box(token);
            let start = Instant::now();
            std::hint::black_box(filtered_distribution_unordered(&logits, &params).len());
            distribution_times.push(start.elapsed());
            let start = Instant::now();
            std::hint::black_box(filtered_distribution(&logits, &params).len());
            sort_times.push(start.elapsed());
        }
        let (sample_best, sample_median) = best_and_median(&mut sample_times);
        let (distribution_best, distribution_median) = best_and_median(&mut distribution_times);
        let (sort_best, sort_median) = best_and_median(&mut sort_times);
        println!(
            " {temperature:>11.1}  {top_k:>5}  {top_p:>5.2} | {sample_best:>13.3}  {sample_median:>7.3} | {distribution_best:>18.3}  {distribution_median:>7.3} | {sort_best:>18.3}  {sort_median:>7.3}"
        );
    }
    println!(
        "sample = the engine's sampler on the whole row; distribution = the row's filtered \
         distribution in no particular order (speculative decoding's verification, per row); \
         sort the row = the same distribution with every token put in order (what both cost \
         before)."
    );
    Ok(())
}

/// Logits spread as a trained model's are: most tokens in a band of a few nats, a handful far
/// ahead, so that top-p stops after a few hundred tokens as it does on real text.
fn trained_like_logits(vocab: usize, seed: u64) -> Vec<f32> {
    let mut rng = Xoshiro256::seed_from_u64(seed);
    let mut logits: Vec<f32> = (0..vocab)
        .map(|_| {
            // The sum of four uniforms: a bell around 0, spread ±4.
            let bell: f64 = (0..4).map(|_| rng.next_f64() * 2.0 - 1.0).sum();
            bell as f32
        })
        .collect();
    let leaders = vocab.min(32);
    for rank in 0..leaders {
        let token = (rng.next_u64() % vocab as u64) as usize;
        logits[token] = 12.0 - rank as f32 * 0.25;
    }
    logits
}

fn best_and_median(times: &mut [Duration]) -> (f64, f64) {
    times.sort_unstable();
    let ms = |time: Duration| time.as_secs_f64() * 1e3;
    (
        times.first().copied().map(ms).unwrap_or(0.0),
        times.get(times.len() / 2).copied().map(ms).unwrap_or(0.0),
    )
}
