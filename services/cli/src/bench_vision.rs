//! `ninfer bench vision`: the Qwen3.5 vision tower's time for one square image at the released
//! vision widths (a synthetic tower: random weights, the shapes of Qwen3.6-35B-A3B's
//! `vision_config` unless flags say otherwise), in milliseconds per image, for the comparison
//! with `transformers` that `scripts/bench/vision_encoder.py` makes. `--device cpu` runs the
//! engine's f32 host forward, `--device cuda` the GPU tower the engine runs when it serves on
//! CUDA: timed from patch rows on the GPU to the outputs on the GPU (as the script times
//! `transformers`), the host↔GPU copies printed apart.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use ninfer_engine::backend::cuda::{CudaBackend, CudaVisionTower, VisionPrecision};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::vision::weights::{LayerNorm, Linear, VisionBlock};
use ninfer_engine::vision::{ImageGrid, VisionConfig, VisionTower, VisionWeights};

/// Where the tower runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum VisionDevice {
    /// The f32 host forward.
    Cpu,
    /// GPU 0 (bf16 tensor cores, f32 residual).
    Cuda,
}

#[derive(Debug, clap::Args)]
pub struct VisionBenchArgs {
    /// Side of the square image in pixels (after the processor's resize: a multiple of
    /// patch × merge).
    #[arg(long, default_value_t = 1024)]
    pub image_size: usize,
    /// Vision blocks (released: 27).
    #[arg(long, default_value_t = 27)]
    pub depth: usize,
    /// Vision width (released: 1152, 16 heads, MLP 4304).
    #[arg(long, default_value_t = 1152)]
    pub hidden: usize,
    #[arg(long, default_value_t = 16)]
    pub heads: usize,
    #[arg(long, default_value_t = 4304)]
    pub intermediate: usize,
    /// Width of the merged image tokens: the text model's hidden size (Qwen3.6-35B-A3B: 2048).
    #[arg(long, default_value_t = 2048)]
    pub out_hidden: usize,
    /// Where the tower runs.
    #[arg(long, value_enum, default_value_t = VisionDevice::Cpu)]
    pub device: VisionDevice,
    /// Timed runs after one untimed warm-up.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: VisionBenchArgs) -> anyhow::Result<()> {
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let config: VisionConfig = serde_json::from_value(serde_json::json!({
        "depth": args.depth,
        "hidden_size": args.hidden,
        "num_heads": args.heads,
        "intermediate_size": args.intermediate,
        "out_hidden_size": args.out_hidden,
    }))
    .context("vision settings")?;
    config.validate().context("vision settings")?;
    let unit = config.patch_size * config.spatial_merge_size;
    if args.image_size == 0 || args.image_size % unit != 0 {
        bail!("--image-size must be a positive multiple of {unit}");
    }
    let side = args.image_size / config.patch_size;
    let grid = ImageGrid {
        temporal: 1,
        height: side,
        width: side,
    };
    let mut rng = Xoshiro256::seed_from_u64(7);
    let weights = synthetic_weights(&config, &mut rng);
    let pixels = random_values(&mut rng, grid.patches() * config.patch_row_len(), 1.0);
    let (device, times, end_to_end) = match args.device {
        VisionDevice::Cpu => {
            let tower = ninfer_engine::vision::HostVisionTower { weights };
            let times = time_runs(args.repeat, || {
                std::hint::black_box(tower.encode(&pixels, &[grid]).context("encoding")?);
                Ok(())
            })?;
            (tower.describe(), times, None)
        }
        VisionDevice::Cuda => {
            let backend = CudaBackend::new(0).context("--device cuda: opening GPU 0")?;
            // A bf16 checkpoint's tower, as the released ones are.
            let tower = CudaVisionTower::new(Arc::new(backend), &weights, VisionPrecision::Bf16)
                .context("--device cuda: starting the vision tower")?;
            drop(weights);
            let on_device = tower.upload_pixels(&pixels).context("copying pixels")?;
            let times = time_runs(args.repeat, || {
                let output = tower
                    .encode_on_device(&on_device, &[grid])
                    .context("encoding")?;
                tower.synchronize().context("encoding")?;
                drop(output);
                Ok(())
            })?;
            // With the copies: host patch rows in, host embeddings out (what the engine does).
            let end_to_end = time_runs(args.repeat, || {
                std::hint::black_box(tower.encode(&pixels, &[grid]).context("encoding")?);
                Ok(())
            })?;
            (tower.describe(), times, Some(end_to_end[0]))
        }
    };
    let (best, median) = (times[0], times[times.len() / 2]);
    let tokens = grid.patches() / config.merge_unit();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "device": device,
                "image_size": args.image_size,
                "patches": grid.patches(),
                "image_tokens": tokens,
                "depth": args.depth,
                "best_ms": best,
                "median_ms": median,
                "with_copies_best_ms": end_to_end,
                "runs": times.len(),
            })
        );
    } else {
        let copies = end_to_end.map_or(String::new(), |ms| {
            format!("; with the host copies best {ms:.1} ms")
        });
        println!(
            "vision tower, {0}x{0} image ({1} patches, {tokens} tokens), depth {2}, width {3}: best {best:.1} ms, median {median:.1} ms over {4} runs{copies} ({device})",
            args.image_size,
            grid.patches(),
            args.depth,
            args.hidden,
            times.len()
        );
    }
    Ok(())
}

/// Milliseconds of `repeat` runs of `run` after one untimed warm-up, fastest first.
fn time_runs(
    repeat: usize,
    mut run: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(repeat);
    for index in 0..=repeat {
        let start = Instant::now();
        run()?;
        if index > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

/// Values uniform in `±scale`.
fn random_values(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

fn linear(rng: &mut Xoshiro256, outputs: usize, inputs: usize) -> Linear {
    Linear {
        weight: random_values(rng, outputs * inputs, 0.02),
        bias: random_values(rng, outputs, 0.02),
        outputs,
        inputs,
    }
}

fn layer_norm(width: usize) -> LayerNorm {
    LayerNorm {
        weight: vec![1.0; width],
        bias: vec![0.0; width],
    }
}

/// A tower of `config`'s shapes with random weights.
fn synthetic_weights(config: &VisionConfig, rng: &mut Xoshiro256) -> VisionWeights {
    let hidden = config.hidden_size;
    let merged = hidden * config.merge_unit();
    VisionWeights {
        config: config.clone(),
        patch_embed: linear(rng, hidden, config.patch_row_len()),
        position_embeddings: random_values(rng, config.num_position_embeddings * hidden, 0.02),
        blocks: (0..config.depth)
            .map(|_| VisionBlock {
                norm1: layer_norm(hidden),
                qkv: linear(rng, 3 * hidden, hidden),
                proj: linear(rng, hidden, hidden),
                norm2: layer_norm(hidden),
                fc1: linear(rng, config.intermediate_size, hidden),
                fc2: linear(rng, hidden, config.intermediate_size),
            })
            .collect(),
        merger_norm: layer_norm(hidden),
        merger_fc1: linear(rng, merged, merged),
        merger_fc2: linear(rng, config.out_hidden_size, merged),
    }
}
