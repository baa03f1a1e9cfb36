//! Every ISA path this machine supports against the scalar reference, on random inputs of odd
//! sizes; the scalar path itself against a naive f64 SwiGLU on decoded weights.
//!
//! Tolerances (relative L2 error of the layer output, `‖y − y_scalar‖ / ‖y_scalar‖`):
//! - paths that multiply f32 activations (avx2, avx512; f32 weights on every path): 1e-4;
//! - paths that round activations to bf16 (bf16 weights on avx512-vnni; AMX tiles, which also
//!   round dequantized int8 / int4 weights to bf16): 1e-2;
//! - paths that quantize activations to int8 per group of 32 (int8 / int4 weights on
//!   avx512-vnni and on AMX below 16 tokens per expert): 2e-2 (each activation is off by at most
//!   max|group| / 254, twice: before `gate_up` and before `down`).

use ninfer_cpu_experts::layout::{decode_matrix, encode_matrix};
use ninfer_cpu_experts::{
    compute_layer, DownSplit, ExpertLayout, ExpertTask, ExpertWeights, KernelIsa, KernelTuning,
    LayerScratch, Prefetch, ScratchCapacity, ThreadPool, WeightDType,
};
use rand::{Rng, SeedableRng};
use std::io::Write;

struct Expert {
    gate_up: Vec<u8>,
    down: Vec<u8>,
}

fn random_vec(rng: &mut rand::rngs::StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn make_experts(layout: &ExpertLayout, count: usize, seed: u64) -> Vec<Expert> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let h = layout.hidden as f32;
            let im = layout.intermediate as f32;
            let gate_up = random_vec(
                &mut rng,
                layout.gate_up.rows * layout.gate_up.cols,
                2.0 / h.sqrt(),
            );
            let down = random_vec(
                &mut rng,
                layout.down.rows * layout.down.cols,
                2.0 / im.sqrt(),
            );
            Expert {
                gate_up: encode_matrix(&gate_up, &layout.gate_up).unwrap(),
                down: encode_matrix(&down, &layout.down).unwrap(),
            }
        })
        .collect()
}

/// Token lists: expert 0 gets every token, expert 1 every second one, expert 2 the first 17.
fn routing(tokens: usize, seed: u64) -> Vec<(Vec<u32>, Vec<f32>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let lists: Vec<Vec<u32>> = vec![
        (0..tokens as u32).collect(),
        (0..tokens as u32).step_by(2).collect(),
        (0..tokens.min(17) as u32).rev().collect(),
    ];
    lists
        .into_iter()
        .map(|list| {
            let weights = (0..list.len())
                .map(|_| rng.random_range(0.1f32..1.0))
                .collect();
            (list, weights)
        })
        .collect()
}

/// One layer's inputs: experts, routing, hidden states and the output's initial contents.
struct Case<'a> {
    layout: &'a ExpertLayout,
    experts: &'a [Expert],
    routes: &'a [(Vec<u32>, Vec<f32>)],
    hidden: &'a [f32],
    tokens: usize,
    initial: &'a [f32],
}

fn run_layer(pool: &ThreadPool, isa: KernelIsa, tuning: KernelTuning, case: &Case<'_>) -> Vec<f32> {
    let Case {
        layout,
        experts,
        routes,
        hidden,
        tokens,
        initial,
    } = *case;
    let tasks: Vec<ExpertTask<'_>> = experts
        .iter()
        .zip(routes)
        .map(|(expert, (list, weights))| ExpertTask {
            weights: ExpertWeights {
                gate_up: &expert.gate_up,
                down: &expert.down,
            },
            tokens: list,
            routing_weights: weights,
        })
        .collect();
    let capacity = ScratchCapacity {
        max_tasks: tasks.len(),
        max_pairs: routes.iter().map(|r| r.0.len()).sum(),
    };
    let mut scratch = LayerScratch::new(*layout, isa, pool.threads(), capacity)
        .unwrap()
        .with_tuning(tuning);
    let mut output = initial.to_vec();
    compute_layer(pool, &mut scratch, hidden, tokens, &tasks, &mut output).unwrap();
    // A second call on the same scratch must give the same increment (no stale state).
    let mut again = initial.to_vec();
    compute_layer(pool, &mut scratch, hidden, tokens, &tasks, &mut again).unwrap();
    assert_eq!(
        output, again,
        "{isa}: second call on the same scratch differs"
    );
    output
}

fn naive(
    layout: &ExpertLayout,
    experts: &[Expert],
    routes: &[(Vec<u32>, Vec<f32>)],
    hidden: &[f32],
    initial: &[f32],
) -> Vec<f32> {
    let (h, im) = (layout.hidden, layout.intermediate);
    let mut output: Vec<f64> = initial.iter().map(|&v| v as f64).collect();
    for (expert, (list, weights)) in experts.iter().zip(routes) {
        let gate_up = decode_matrix(&expert.gate_up, &layout.gate_up).unwrap();
        let down = decode_matrix(&expert.down, &layout.down).unwrap();
        for (&token, &weight) in list.iter().zip(weights) {
            let x = &hidden[token as usize * h..][..h];
            let dot = |row: &[f32], v: &[f64]| -> f64 {
                row.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum()
            };
            let xv: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let act: Vec<f64> = (0..im)
                .map(|i| {
                    let g = dot(&gate_up[i * h..][..h], &xv);
                    let u = dot(&gate_up[(im + i) * h..][..h], &xv);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for o in 0..h {
                output[token as usize * h + o] += weight as f64 * dot(&down[o * im..][..im], &act);
            }
        }
    }
    output.into_iter().map(|v| v as f32).collect()
}

fn relative_error(value: &[f32], reference: &[f32], initial: &[f32]) -> f64 {
    let mut diff = 0.0f64;
    let mut norm = 0.0f64;
    for ((&v, &r), &i) in value.iter().zip(reference).zip(initial) {
        assert!(v.is_finite(), "non-finite output");
        diff += ((v - r) as f64).powi(2);
        norm += ((r - i) as f64).powi(2);
    }
    (diff / norm.max(1e-30)).sqrt()
}

fn tolerance(isa: KernelIsa, dtype: WeightDType, tokens_per_expert_max: usize) -> f64 {
    match (isa, dtype) {
        (_, WeightDType::F32) if isa != KernelIsa::Amx || tokens_per_expert_max < 16 => 1e-4,
        (KernelIsa::Scalar | KernelIsa::Avx2 | KernelIsa::Avx512, _) => 1e-4,
        (KernelIsa::Avx512Vnni, WeightDType::Bf16) => 1e-2,
        (KernelIsa::Amx, _) if tokens_per_expert_max >= 16 => 2e-2,
        (_, WeightDType::Bf16) => 1e-2,
        _ => 2e-2,
    }
}

fn check_dtype(dtype: WeightDType, shapes: &[(usize, usize)]) {
    check_dtype_tuned(dtype, shapes, KernelTuning::default());
}

fn check_dtype_tuned(dtype: WeightDType, shapes: &[(usize, usize)], tuning: KernelTuning) {
    let pool = ThreadPool::new(3, &[], false).unwrap();
    let supported = KernelIsa::supported();
    for isa in KernelIsa::ALL {
        if !supported.contains(&isa) {
            // Straight to stderr, not `eprintln!`: the test harness captures the macros, and a
            // skipped path must show in a plain `cargo test` run.
            let _ = writeln!(
                std::io::stderr().lock(),
                "SKIPPED {dtype} on {isa}: this CPU lacks the features"
            );
        }
    }
    for (shape_index, &(hidden_size, intermediate)) in shapes.iter().enumerate() {
        let layout = ExpertLayout::new(dtype, hidden_size, intermediate).unwrap();
        let experts = make_experts(&layout, 3, 7 + shape_index as u64);
        for tokens in [1usize, 3, 8, 21, 40] {
            let seed = 1000 * shape_index as u64 + tokens as u64;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let hidden = random_vec(&mut rng, tokens * hidden_size, 1.0);
            let initial = random_vec(&mut rng, tokens * hidden_size, 0.5);
            let routes = routing(tokens, seed);
            let case = Case {
                layout: &layout,
                experts: &experts,
                routes: &routes,
                hidden: &hidden,
                tokens,
                initial: &initial,
            };
            let reference = run_layer(&pool, KernelIsa::Scalar, tuning, &case);
            if tokens <= 8 {
                let exact = naive(&layout, &experts, &routes, &hidden, &initial);
                let error = relative_error(&reference, &exact, &initial);
                assert!(
                    error < 1e-5,
                    "scalar {dtype} H={hidden_size} Im={intermediate} T={tokens}: {error:e}"
                );
            }
            for &isa in supported.iter().filter(|&&i| i != KernelIsa::Scalar) {
                let value = run_layer(&pool, isa, tuning, &case);
                let error = relative_error(&value, &reference, &initial);
                let limit = tolerance(isa, dtype, tokens);
                println!(
                    "{isa:>12} {dtype:>5} H={hidden_size:<4} Im={intermediate:<4} T={tokens:<3} rel.err {error:.2e} (limit {limit:.0e})"
                );
                assert!(
                    error <= limit,
                    "{isa} {dtype} H={hidden_size} Im={intermediate} T={tokens}: relative error {error:e} above {limit:e}"
                );
            }
        }
    }
}

#[test]
fn f32_paths_agree_with_scalar() {
    check_dtype(WeightDType::F32, &[(37, 19), (64, 48)]);
}

#[test]
fn bf16_paths_agree_with_scalar() {
    check_dtype(WeightDType::Bf16, &[(37, 19), (96, 40)]);
}

/// Widths not a multiple of the quantization group (`(H, Im)`: an expert width of 40 and of 72
/// as the `down` input, 40 and 72 as the `gate_up` input): the last group is padded with zero
/// codes, every path must still match the scalar path and the f64 loop on decoded weights.
const PADDED_GROUP_SHAPES: [(usize, usize); 3] = [(96, 40), (64, 72), (40, 72)];

#[test]
fn int8_paths_agree_with_scalar() {
    check_dtype(WeightDType::Int8, &[(96, 160), (64, 32)]);
    check_dtype(WeightDType::Int8, &PADDED_GROUP_SHAPES);
}

#[test]
fn int4_paths_agree_with_scalar() {
    check_dtype(WeightDType::Int4, &[(96, 160), (64, 32)]);
    check_dtype(WeightDType::Int4, &PADDED_GROUP_SHAPES);
}

/// Every combination of the tuning's choices computes the same layer.
#[test]
fn layer_tunings_agree_with_scalar() {
    for bits in 0..16u32 {
        let tuning = KernelTuning {
            steal: bits & 1 != 0,
            shared_decode_input: bits & 2 != 0,
            down_split: if bits & 4 != 0 {
                DownSplit::Rows
            } else {
                DownSplit::Auto
            },
            prefetch: if bits & 8 != 0 {
                Prefetch {
                    distance_bytes: 0,
                    into_l2: false,
                }
            } else {
                Prefetch::default()
            },
        };
        check_dtype_tuned(WeightDType::Int4, &[(96, 160)], tuning);
        check_dtype_tuned(WeightDType::Int8, &[(64, 32)], tuning);
    }
}

#[test]
fn rejects_bad_inputs() {
    let pool = ThreadPool::new(1, &[], false).unwrap();
    let layout = ExpertLayout::new(WeightDType::Int8, 64, 32).unwrap();
    let experts = make_experts(&layout, 1, 1);
    let capacity = ScratchCapacity {
        max_tasks: 1,
        max_pairs: 2,
    };
    let mut scratch = LayerScratch::new(layout, KernelIsa::Scalar, 1, capacity).unwrap();
    let hidden = vec![0.5f32; 2 * 64];
    let mut output = vec![0.0f32; 2 * 64];
    let weights = ExpertWeights {
        gate_up: &experts[0].gate_up,
        down: &experts[0].down,
    };
    let out_of_range = [ExpertTask {
        weights,
        tokens: &[2],
        routing_weights: &[1.0],
    }];
    assert!(compute_layer(&pool, &mut scratch, &hidden, 2, &out_of_range, &mut output).is_err());
    let too_many = [ExpertTask {
        weights,
        tokens: &[0, 1, 1],
        routing_weights: &[1.0; 3],
    }];
    assert!(compute_layer(&pool, &mut scratch, &hidden, 2, &too_many, &mut output).is_err());
    let short = ExpertWeights {
        gate_up: &experts[0].gate_up[..10],
        down: &experts[0].down,
    };
    let short_task = [ExpertTask {
        weights: short,
        tokens: &[0],
        routing_weights: &[1.0],
    }];
    assert!(compute_layer(&pool, &mut scratch, &hidden, 2, &short_task, &mut output).is_err());
}
