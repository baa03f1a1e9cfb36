//! Decode of several sequences in one batch: every sequence gets the tokens it gets decoded
//! alone (greedy, every backend, through step graphs and op by op), and on the GPU the batched
//! decode launches (one KV append, split attention and combine for the whole batch, routed
//! experts read once per distinct expert) give the bits of the per-sequence launches they
//! replace (`CudaOptions::batched_decode` off), for the model and for attention alone; the
//! fused down projection and pair sum give the bits of the two launches they replace.
//! The CUDA cases are skipped without a GPU (they fail instead under `NINFER_REQUIRE_GPU=1`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_engine::backend::cuda::{CudaBackend, CudaOptions};
use ninfer_engine::backend::{AttentionSpec, Segment};
use ninfer_engine::sampling::argmax;
use ninfer_engine::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};
use ninfer_engine::{test_device, Backend, Model, SequenceInput};

const ARCHITECTURES: [TinyArchitecture; 3] = [
    TinyArchitecture::Qwen3Moe,
    TinyArchitecture::Qwen3Next,
    TinyArchitecture::Qwen35Moe,
];

/// Decode steps of each run.
const STEPS: usize = 12;
/// Positions each sequence has room for.
const MAX_CONTEXT: usize = 96;

/// A tiny model of `architecture` with int8 experts and bf16 dense weights, written in
/// `directory`.
fn write_int8_model(directory: &Path, architecture: TinyArchitecture) -> PathBuf {
    write_model_with_experts(directory, architecture, DType::Int8)
}

/// A tiny model of `architecture` with `experts_dtype` experts and bf16 dense weights, written
/// in `directory`.
fn write_model_with_experts(
    directory: &Path,
    architecture: TinyArchitecture,
    experts_dtype: DType,
) -> PathBuf {
    let options = TinyModelOptions {
        experts_dtype,
        dense_dtype: DType::Bf16,
        ..TinyModelOptions::new(architecture)
    };
    let path = directory.join(format!("{architecture:?}-{experts_dtype}.ninfer"));
    write_tiny_model(&path, options).unwrap();
    path
}

/// The model at `path` with every routed expert resident (so decode steps fit a step graph),
/// step graphs on or off.
fn open_all_resident<B: Backend>(backend: &Arc<B>, path: &Path, graphs: bool) -> Model<B> {
    let mut model = Model::open(Arc::clone(backend), path).unwrap();
    let common = &model.spec().common;
    let every_expert: Vec<u32> = (0..common.num_experts as u32).collect();
    let placement: Vec<Vec<u32>> = common
        .moe_layers
        .iter()
        .map(|&moe| {
            if moe {
                every_expert.clone()
            } else {
                Vec::new()
            }
        })
        .collect();
    model.place_resident_experts(&placement).unwrap();
    model.set_step_graphs(graphs);
    model
}

/// `count` prompts of different lengths (so the batch's rows sit at different positions).
fn prompts(count: usize) -> Vec<Vec<u32>> {
    (0..count as u32)
        .map(|s| (0..3 + 5 * s).map(|i| (i * 31 + 7 * s + 3) % 97).collect())
        .collect()
}

/// Prefills each prompt alone, then decodes all of them together greedily for `steps` steps
/// through `forward_logits_on_backend` (the scheduler's call): each sequence's tokens and each
/// step's logits (all rows).
fn decode_together<B: Backend>(
    model: &Model<B>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut states: Vec<_> = prompts
        .iter()
        .map(|_| model.new_sequence(MAX_CONTEXT).unwrap())
        .collect();
    let mut next: Vec<u32> = states
        .iter_mut()
        .zip(prompts)
        .map(|(state, prompt)| argmax(&model.prefill(state, prompt).unwrap()))
        .collect();
    let vocab = model.vocab_size();
    let mut tokens: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let mut logits = Vec::new();
    for _ in 0..steps {
        let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<SequenceInput<'_, B>> = states
            .iter_mut()
            .zip(&inputs)
            .map(|(state, tokens)| SequenceInput { state, tokens })
            .collect();
        let step = model.forward_logits_on_backend(&mut batch).unwrap();
        let values = model.backend().download(&step).unwrap();
        next = values.chunks(vocab).map(argmax).collect();
        for (sequence, &token) in tokens.iter_mut().zip(&next) {
            sequence.push(token);
        }
        logits.push(values);
    }
    (tokens, logits)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn max_abs_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Batches of 2 and 8 sequences decode, greedily, the tokens each sequence decodes alone, with
/// step graphs (where the backend has them) and op by op; every row's logits stay within f32
/// rounding of its logits alone (on the GPU's exact options: the same bits).
fn batch_decode_gives_each_sequence_its_tokens_alone<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    for architecture in ARCHITECTURES {
        let path = write_int8_model(directory.path(), architecture);
        for graphs in [true, false] {
            let model = open_all_resident(&backend, &path, graphs);
            let vocab = model.vocab_size();
            let all = prompts(8);
            let alone: Vec<(Vec<u32>, Vec<Vec<f32>>)> = all
                .iter()
                .map(|prompt| {
                    let (mut tokens, logits) =
                        decode_together(&model, std::slice::from_ref(prompt), STEPS);
                    (tokens.remove(0), logits)
                })
                .collect();
            for batch in [2usize, 8] {
                let (tokens, logits) = decode_together(&model, &all[..batch], STEPS);
                let mut worst = 0.0f32;
                let mut bitwise = true;
                for (index, sequence_tokens) in tokens.iter().enumerate() {
                    assert_eq!(
                        sequence_tokens, &alone[index].0,
                        "{architecture:?}, graphs {graphs}, batch {batch}: sequence {index}'s tokens differ from its tokens alone"
                    );
                    for (step, step_logits) in logits.iter().enumerate() {
                        let row = &step_logits[index * vocab..(index + 1) * vocab];
                        let row_alone = &alone[index].1[step];
                        bitwise &= same_bits(row, row_alone);
                        worst = worst.max(max_abs_difference(row, row_alone));
                    }
                }
                println!(
                    "{} {architecture:?}, graphs {graphs}, batch {batch}: max |Δlogit| vs alone {worst:.2e}, bitwise {bitwise}; step graphs {:?}",
                    backend.name(),
                    model.step_graph_counts()
                );
                assert!(
                    worst < 1e-4,
                    "{architecture:?}, graphs {graphs}, batch {batch}: {worst}"
                );
            }
            if graphs && backend.name().starts_with("cuda") {
                let counts = model.step_graph_counts();
                assert_eq!(
                    counts.abandoned,
                    0,
                    "{architecture:?}: a recording failed: {:?}",
                    model.step_graph_last_abandoned()
                );
                assert!(counts.replayed > 0, "{architecture:?}: {counts:?}");
            }
        }
    }
}
test_device!(batch_decode_gives_each_sequence_its_tokens_alone);

/// The GPU value, or `None` after saying why the test is skipped (a panic instead under
/// `NINFER_REQUIRE_GPU=1`).
fn gpu_or_skip<T>(
    opened: Result<T, ninfer_engine::backend::cuda::CudaError>,
    test: &str,
) -> Option<T> {
    match opened {
        Ok(value) => Some(value),
        Err(error) => {
            if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("NINFER_REQUIRE_GPU=1 but the GPU is unusable: {error}");
            }
            println!("skipped `{test}` on cuda: {error}");
            None
        }
    }
}

/// A backend of this test's own with `options` and batched decode (attention and the
/// by-expert kernels) on or off.
fn backend_with(
    options: CudaOptions,
    batched_decode: bool,
) -> Result<Arc<CudaBackend>, ninfer_engine::backend::cuda::CudaError> {
    CudaBackend::with_options(
        0,
        CudaOptions {
            batched_decode,
            // The by-expert kernels are off by default (slower where few experts are shared);
            // held to the same bits here.
            decode_experts_by_expert: batched_decode,
            ..options
        },
    )
    .map(Arc::new)
}

/// Whole models: decode batches of 1, 3, 8 and (op by op) 70 sequences (more rows than one
/// batched attention launch takes) give every step's logits bit for bit with the batched decode
/// launches and with one launch per sequence, with step graphs and op by op, under the exact
/// and the default options (bf16 KV cache).
#[test]
fn batched_decode_launches_give_the_bits_of_per_sequence_launches() {
    let test = "batched_decode_launches_give_the_bits_of_per_sequence_launches";
    let directory = tempfile::tempdir().unwrap();
    for (label, options) in [
        ("exact", CudaOptions::exact()),
        ("default", CudaOptions::default()),
    ] {
        let backends = backend_with(options, true)
            .and_then(|batched| Ok((batched, backend_with(options, false)?)));
        let Some((batched, per_sequence)) = gpu_or_skip(backends, test) else {
            return;
        };
        for architecture in ARCHITECTURES {
            let path = write_int8_model(directory.path(), architecture);
            for graphs in [true, false] {
                let with_batched = open_all_resident(&batched, &path, graphs);
                let with_per_sequence = open_all_resident(&per_sequence, &path, graphs);
                // 70 rows only op by op: a step graph takes decode-sized batches (a bigger
                // batch's experts read their routing on the host).
                let batches: &[usize] = if graphs { &[1, 3, 8] } else { &[1, 3, 8, 70] };
                for &sequences in batches {
                    let all = prompts(sequences.min(8));
                    // Beyond 8 sequences the prompts repeat (shorter ones: every sequence fits
                    // MAX_CONTEXT).
                    let all: Vec<Vec<u32>> = (0..sequences)
                        .map(|index| all[index % all.len()].clone())
                        .collect();
                    let (tokens_a, logits_a) = decode_together(&with_batched, &all, STEPS);
                    let (tokens_b, logits_b) = decode_together(&with_per_sequence, &all, STEPS);
                    for (step, (a, b)) in logits_a.iter().zip(&logits_b).enumerate() {
                        assert!(
                            same_bits(a, b),
                            "{label}, {architecture:?}, graphs {graphs}, {sequences} sequences: step {step}'s logits differ between batched and per-sequence launches (max |Δ| {:e})",
                            max_abs_difference(a, b)
                        );
                    }
                    assert_eq!(tokens_a, tokens_b);
                }
                println!(
                    "{label} {architecture:?}, graphs {graphs}: step graphs batched {:?}, per sequence {:?}",
                    with_batched.step_graph_counts(),
                    with_per_sequence.step_graph_counts()
                );
                if graphs {
                    let counts = with_batched.step_graph_counts();
                    assert_eq!(
                        counts.abandoned,
                        0,
                        "{architecture:?}: a recording failed: {:?}",
                        with_batched.step_graph_last_abandoned()
                    );
                    assert!(counts.replayed > 0, "{architecture:?}: {counts:?}");
                }
            }
        }
    }
}

/// Every step's logits with `option` on equal those with it off, bit for bit, for experts of
/// each of `dtypes` and each batch of `sequence_counts` sequences, through step graphs and op by
/// op: the check of a kernel variant held to the kernels it replaces.
fn same_logits_with_and_without(
    test: &str,
    option: impl Fn(bool) -> CudaOptions,
    dtypes: &[DType],
    sequence_counts: &[usize],
    noted_kernels: &[&str],
) {
    let directory = tempfile::tempdir().unwrap();
    let open = |on| CudaBackend::with_options(0, option(on)).map(Arc::new);
    let backends = open(true).and_then(|with| Ok((with, open(false)?)));
    let Some((with, without)) = gpu_or_skip(backends, test) else {
        return;
    };
    for &dtype in dtypes {
        for architecture in ARCHITECTURES {
            let path = write_model_with_experts(directory.path(), architecture, dtype);
            for graphs in [true, false] {
                let model_with = open_all_resident(&with, &path, graphs);
                let model_without = open_all_resident(&without, &path, graphs);
                for &sequences in sequence_counts {
                    let all = prompts(sequences);
                    let (tokens_a, logits_a) = decode_together(&model_with, &all, STEPS);
                    let (tokens_b, logits_b) = decode_together(&model_without, &all, STEPS);
                    for (step, (a, b)) in logits_a.iter().zip(&logits_b).enumerate() {
                        assert!(
                            same_bits(a, b),
                            "{dtype} {architecture:?}, graphs {graphs}, {sequences} sequences: step {step}'s logits differ (max |Δ| {:e})",
                            max_abs_difference(a, b)
                        );
                    }
                    assert_eq!(tokens_a, tokens_b);
                }
            }
        }
    }
    for kernel in noted_kernels {
        assert!(
            with.kernel_choice_noted(kernel),
            "{test}: `{kernel}` never ran with the option on"
        );
        assert!(
            !without.kernel_choice_noted(kernel),
            "{test}: `{kernel}` ran with it off"
        );
    }
}

/// The routed experts' down projection and sum over a token's choices in one launch
/// (`fused_expert_sum`) give every step's logits bit for bit as the down launch and the pair sum
/// they replace: int8, int4 and bf16 experts (the register path and the plain one), decode batches of
/// 1, 3 and 8 sequences, through step graphs and op by op.
#[test]
fn fused_expert_sums_give_the_bits_of_down_then_pair_sum() {
    same_logits_with_and_without(
        "fused_expert_sums_give_the_bits_of_down_then_pair_sum",
        |fused_expert_sum| CudaOptions {
            fused_expert_sum,
            ..CudaOptions::default()
        },
        &[DType::Int8, DType::Int4, DType::Bf16],
        &[1, 3, 8],
        &[],
    );
}

/// One token's gate/up projections from the task grid (`decode_gate_up_tasks`) give every
/// step's logits bit for bit as the per-pair kernel they replace: int8 and int4 experts, one
/// sequence (where the task grid runs, asking L2 for the down matrices as it does by default)
/// and three (where it does not), through step graphs and op by op.
#[test]
fn gate_up_tasks_give_the_bits_of_the_per_pair_kernel() {
    same_logits_with_and_without(
        "gate_up_tasks_give_the_bits_of_the_per_pair_kernel",
        |decode_gate_up_tasks| CudaOptions {
            decode_gate_up_tasks,
            ..CudaOptions::default()
        },
        &[DType::Int8, DType::Int4],
        &[1, 3],
        &[],
    );
}

/// One token's quantized experts in one launch (`fused_decode_experts`: gate/up tasks, then
/// down and the pair sum after a wait for the whole grid) give every step's logits bit for bit
/// as the three launches they replace: int8 and int4 experts, one sequence (where it runs) and
/// three (where it does not), through step graphs and op by op.
#[test]
fn fused_decode_experts_give_the_bits_of_the_three_launches() {
    same_logits_with_and_without(
        "fused_decode_experts_give_the_bits_of_the_three_launches",
        |fused_decode_experts| CudaOptions {
            fused_decode_experts,
            ..CudaOptions::default()
        },
        &[DType::Int8, DType::Int4],
        &[1, 3],
        &[],
    );
}

/// One token's router in one launch (`fused_decode_router`: the residual add and the norm
/// before it formed by every block with the norm kernel's tree, the logits by the matmul
/// kernel's warp body, routed by the last block out, which also stores the residual) gives every
/// step's logits bit for bit as the add + norm, matmul and routing launches it replaces: one
/// sequence (where it runs) and three (where it does not), through step graphs (the same ticket
/// counter in every replay) and op by op.
#[test]
fn fused_decode_router_gives_the_bits_of_the_launches_it_replaces() {
    same_logits_with_and_without(
        "fused_decode_router_gives_the_bits_of_the_launches_it_replaces",
        |fused_decode_router| CudaOptions {
            fused_decode_router,
            ..CudaOptions::default()
        },
        &[DType::Int8],
        &[1, 3],
        &["route_decode_add_norm_fused"],
    );
}

/// One token's first projections of a layer with the residual add and norm before them in one
/// launch (`fused_decode_qkv_norm`: every block forms the normed row with the norm kernel's tree,
/// its warps take the three projections' tasks with the matmul kernel's warp body, the last block
/// out stores the residual) gives every step's logits bit for bit as the add + norm and
/// projection launches it replaces: attention layers' q/k/v and delta-rule layers' input
/// projections (whose fourth projection reads the stored normed row), one sequence (where it
/// runs) and three (where it does not), through step graphs and op by op.
#[test]
fn fused_decode_qkv_norm_gives_the_bits_of_the_launches_it_replaces() {
    same_logits_with_and_without(
        "fused_decode_qkv_norm_gives_the_bits_of_the_launches_it_replaces",
        |fused_decode_qkv_norm| CudaOptions {
            fused_decode_qkv_norm,
            ..CudaOptions::default()
        },
        &[DType::Int8],
        &[1, 3],
        &["add_norm_matmul3_bf16"],
    );
}

/// Deterministic values in [-scale, scale).
fn values(count: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Attention alone: 70 sequences prefilled to positions from 0 to past 4,096 (where the split
/// chunk grows beyond one tile), then decoded one row each for three steps, give the same bits
/// through the batched launches and through one launch per sequence; f32 and bf16 caches,
/// full causal and a sliding window, GQA 4 at head_dim 128 and GQA 2 at head_dim 64.
#[test]
fn batched_decode_attention_gives_the_bits_of_per_sequence_attention() {
    let test = "batched_decode_attention_gives_the_bits_of_per_sequence_attention";
    for options in [CudaOptions::exact(), CudaOptions::default()] {
        let backends = backend_with(options, true)
            .and_then(|batched| Ok((batched, backend_with(options, false)?)));
        let Some((batched, per_sequence)) = gpu_or_skip(backends, test) else {
            return;
        };
        for (heads, kv_heads, head_dim, window) in [(8, 2, 128, None), (4, 2, 64, Some(100usize))] {
            let spec = AttentionSpec {
                heads,
                kv_heads,
                head_dim,
                sliding_window: window,
            };
            let kv_width = kv_heads * head_dim;
            let lengths: Vec<usize> = (0..70)
                .map(|index| match index {
                    0 => 0,
                    1 => 4_200,
                    2 => 4_096,
                    3 => 31,
                    4 => 32,
                    _ => (index * 37) % 300,
                })
                .collect();
            let max_tokens = lengths.iter().max().copied().unwrap_or(0) + 4;
            let mut caches_a: Vec<_> = lengths
                .iter()
                .map(|_| batched.new_kv_cache(max_tokens, kv_width).unwrap())
                .collect();
            let mut caches_b: Vec<_> = lengths
                .iter()
                .map(|_| per_sequence.new_kv_cache(max_tokens, kv_width).unwrap())
                .collect();
            let mut positions = vec![0usize; lengths.len()];
            for step in 0..4 {
                // Step 0 prefills (a sequence of length 0 has nothing to prefill and joins at
                // step 1); steps 1.. decode one row per sequence.
                let new: Vec<usize> = if step == 0 {
                    lengths.clone()
                } else {
                    vec![1; lengths.len()]
                };
                let total: usize = new.iter().sum();
                let seed = 17 + step as u64;
                let q = values(total * heads * head_dim, seed, 1.5);
                let k = values(total * kv_width, seed + 100, 1.5);
                let v = values(total * kv_width, seed + 200, 1.0);
                let mut outputs = Vec::new();
                for (backend, caches) in [(&batched, &mut caches_a), (&per_sequence, &mut caches_b)]
                {
                    let (qt, kt, vt) = (
                        backend.upload(&q, total, heads * head_dim).unwrap(),
                        backend.upload(&k, total, kv_width).unwrap(),
                        backend.upload(&v, total, kv_width).unwrap(),
                    );
                    let mut row = 0;
                    let mut segments = Vec::new();
                    for ((cache, &n), &position) in caches.iter_mut().zip(&new).zip(&positions) {
                        if n > 0 {
                            segments.push(Segment {
                                rows: row..row + n,
                                start_position: position,
                                state: cache,
                            });
                        }
                        row += n;
                    }
                    let out = backend
                        .attention(&qt, &kt, &vt, &spec, &mut segments)
                        .unwrap();
                    outputs.push(backend.download(&out).unwrap());
                }
                assert!(
                    same_bits(&outputs[0], &outputs[1]),
                    "{:?} KV, heads {heads}/{kv_heads}, head_dim {head_dim}, window {window:?}, step {step}: batched attention differs from per-sequence attention (max |Δ| {:e})",
                    options.kv_dtype,
                    max_abs_difference(&outputs[0], &outputs[1])
                );
                for (position, n) in positions.iter_mut().zip(&new) {
                    *position += n;
                }
            }
        }
    }
}
