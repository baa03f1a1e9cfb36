//! `ninfer bench vision`: the Qwen3.5 vision tower's time for one square image at the released
//! vision widths (a synthetic tower: random weights, the shapes of Qwen3.6-35B-A3B's
//! `vision_config` unless flags say otherwise), in milliseconds per image, for the comparison
//! with `transformers` that `scripts/bench/vision_encoder.py` makes. The tower runs on the
//! engine's f32 host forward (its only path today).

use std::time::Instant;

use anyhow::{bail, Context};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::vision::weights::{LayerNorm, Linear, VisionBlock};
use ninfer_engine::vision::{encode_images, ImageGrid, VisionConfig, VisionWeights};

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
    let mut times = Vec::with_capacity(args.repeat);
    for run in 0..=args.repeat {
        let start = Instant::now();
        let output = encode_images(&weights, &pixels, &[grid]).context("encoding")?;
        if run > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        std::hint::black_box(output);
    }
    times.sort_by(f64::total_cmp);
    let (best, median) = (times[0], times[times.len() / 2]);
    let tokens = grid.patches() / config.merge_unit();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "device": "cpu (f32 host forward)",
                "image_size": args.image_size,
                "patches": grid.patches(),
                "image_tokens": tokens,
                "depth": args.depth,
                "best_ms": best,
                "median_ms": median,
                "runs": times.len(),
            })
        );
    } else {
        println!(
            "vision tower, {0}x{0} image ({1} patches, {tokens} tokens), depth {2}, width {3}: best {best:.1} ms, median {median:.1} ms over {4} runs (f32 host forward)",
            args.image_size,
            grid.patches(),
            args.depth,
            args.hidden,
            times.len()
        );
    }
    Ok(())
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
