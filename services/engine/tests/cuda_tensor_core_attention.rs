//! The CUDA backend's tensor-core attention against the reference kernel and the f32 kernels
//! it replaces:
//! * causal GQA prefill attention over a bf16 cache (`attention_mma_*`) against the reference
//!   kernel and the tiled kernel: head_dim 64, 128 and 256, GQA 1 to 8, segments of 16 to 1000
//!   rows (none a multiple of the 64-row tile), a second prefill continuing each sequence, and a
//!   sliding window;
//! * decode attention with the group's q heads as the rows of an mma tile
//!   (`attention_decode_mma_*`, `--cuda-tensor-core-decode-attention on`): one-row steps (the
//!   batched launch) and few-row segments (one launch each), groups of 3 to 16, head_dim 64, 128
//!   and 256, a sliding window and contexts past the split kernel's one-tile chunks.
//!
//! Both are held to 2e-2 of the largest output (q and the softmax weights rounded to bf16; each
//! test prints its figure). Without a GPU every test prints that it is skipped and passes (fails
//! under `NINFER_REQUIRE_GPU=1`).

use ninfer_engine::backend::cuda::{AttentionPath, CudaBackend, CudaKvCache, CudaOptions, KvDtype};
use ninfer_engine::backend::{AttentionSpec, Segment};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{
    cuda_or_skip, cuda_with_options_or_skip, relative_difference, symmetric_uniform,
};
use ninfer_engine::Backend;

/// The largest difference from the reference, relative to its largest value, the tensor-core
/// kernels may show.
const TENSOR_CORE_TOLERANCE: f32 = 2e-2;

/// `(rows, start position)` of one sequence's segment.
type Piece = (usize, usize);

/// (heads, kv_heads, head_dim, first prefill of the two sequences, second prefill, window)
type AttentionCase = (usize, usize, usize, [usize; 2], [usize; 2], Option<usize>);

/// One attention call over `segments` through `path`, each segment on its own cache.
fn attention_call(
    gpu: &CudaBackend,
    path: AttentionPath,
    (q, k, v): (&[f32], &[f32], &[f32]),
    spec: &AttentionSpec,
    caches: &mut [CudaKvCache],
    segments: &[Piece],
) -> Vec<f32> {
    let total: usize = segments.iter().map(|s| s.0).sum();
    let kv_width = spec.kv_heads * spec.head_dim;
    let (qg, kg, vg) = (
        gpu.upload(q, total, spec.heads * spec.head_dim).unwrap(),
        gpu.upload(k, total, kv_width).unwrap(),
        gpu.upload(v, total, kv_width).unwrap(),
    );
    let mut row = 0;
    let mut batch: Vec<Segment<'_, _>> = Vec::new();
    for (cache, &(length, start_position)) in caches.iter_mut().zip(segments) {
        batch.push(Segment {
            rows: row..row + length,
            start_position,
            state: cache,
        });
        row += length;
    }
    let out = gpu
        .attention_with_path(path, &qg, &kg, &vg, spec, &mut batch)
        .unwrap();
    gpu.download(&out).unwrap()
}

#[test]
fn tensor_core_attention_matches_the_reference_and_tiled_kernels() {
    let test = "tensor_core_attention_matches_the_reference_and_tiled_kernels";
    let Some(gpu) = cuda_or_skip(test) else {
        return;
    };
    println!("attention path in use: {}", gpu.info().attention_path);
    if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        assert_eq!(
            gpu.info().attention_path,
            AttentionPath::TensorCore,
            "the tensor-core attention failed its start-up check (see the warning in the log)"
        );
    }
    assert_eq!(gpu.info().kv_dtype, KvDtype::Bf16);
    let mut rng = Xoshiro256::seed_from_u64(41);
    let cases: [AttentionCase; 5] = [
        (8, 2, 128, [77, 300], [33, 16], None),
        (32, 4, 128, [1000, 16], [65, 200], None),
        (16, 2, 256, [65, 130], [17, 64], None),
        (4, 4, 64, [129, 20], [100, 1], None),
        (8, 1, 64, [1000, 17], [70, 30], Some(100)),
    ];
    for (heads, kv_heads, hd, first, second, window) in cases {
        let spec = AttentionSpec {
            heads,
            kv_heads,
            head_dim: hd,
            sliding_window: window,
        };
        let kv_width = kv_heads * hd;
        let max_tokens = first[0].max(first[1]) + second[0].max(second[1]);
        let caches = || -> Vec<CudaKvCache> {
            (0..2)
                .map(|_| gpu.new_kv_cache(max_tokens, kv_width).unwrap())
                .collect()
        };
        let paths = [
            AttentionPath::TensorCore,
            AttentionPath::Reference,
            AttentionPath::Flash,
        ];
        let mut all_caches: Vec<Vec<CudaKvCache>> = paths.iter().map(|_| caches()).collect();
        for (step, lengths) in [first, second].into_iter().enumerate() {
            let starts = if step == 0 { [0, 0] } else { first };
            let total = lengths[0] + lengths[1];
            let q = symmetric_uniform(&mut rng, total * heads * hd, 1.5);
            let k = symmetric_uniform(&mut rng, total * kv_width, 1.5);
            let v = symmetric_uniform(&mut rng, total * kv_width, 1.0);
            let segments = [(lengths[0], starts[0]), (lengths[1], starts[1])];
            let outputs: Vec<Vec<f32>> = paths
                .iter()
                .zip(all_caches.iter_mut())
                .map(|(&path, caches)| {
                    attention_call(&gpu, path, (&q, &k, &v), &spec, caches, &segments)
                })
                .collect();
            let (vs_reference, vs_tiled) = (
                relative_difference(&outputs[0], &outputs[1]),
                relative_difference(&outputs[0], &outputs[2]),
            );
            println!(
                "attention heads {heads}/{kv_heads} hd {hd} window {window:?}, rows {lengths:?} at {starts:?}: tensor cores vs reference {vs_reference:.2e}, vs tiled {vs_tiled:.2e}"
            );
            assert!(
                vs_reference <= TENSOR_CORE_TOLERANCE && vs_tiled <= TENSOR_CORE_TOLERANCE,
                "heads {heads}/{kv_heads} hd {hd} window {window:?}, rows {lengths:?} at {starts:?}: tensor cores differ by {vs_reference:.2e} from the reference, {vs_tiled:.2e} from tiled"
            );
            if lengths.iter().all(|&n| n >= 16) {
                assert_ne!(outputs[0], outputs[2], "the tensor cores did not run");
            }
        }
    }
}

/// (heads, kv_heads, head_dim, the two sequences' prefill lengths, window)
type DecodeAttentionCase = (usize, usize, usize, [usize; 2], Option<usize>);

/// Decode attention on the tensor cores (`--cuda-tensor-core-decode-attention on`): two
/// sequences prefilled, then decode steps of one row each (the batched launch) and of a few rows
/// each (one launch per segment), against the reference kernel and the f32 decode kernels, at
/// groups of 3 to 16 q heads, head dims 64, 128 and 256, a sliding window and contexts past the
/// split kernel's 128 one-tile chunks.
#[test]
fn tensor_core_decode_attention_matches_the_reference_and_f32_kernels() {
    let test = "tensor_core_decode_attention_matches_the_reference_and_f32_kernels";
    let options = CudaOptions {
        tensor_core_prefill: true,
        tensor_core_decode_attention: true,
        ..CudaOptions::default()
    };
    let Some(gpu) = cuda_with_options_or_skip(test, options) else {
        return;
    };
    if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        assert_eq!(
            gpu.info().attention_path,
            AttentionPath::TensorCore,
            "the tensor-core attention failed its start-up check (see the warning in the log)"
        );
    }
    let mut rng = Xoshiro256::seed_from_u64(43);
    let cases: [DecodeAttentionCase; 5] = [
        (32, 4, 128, [4500, 37], None),
        (16, 2, 256, [700, 1200], None),
        (64, 4, 128, [300, 5], None),
        (12, 4, 128, [64, 129], None),
        (8, 1, 64, [1000, 50], Some(100)),
    ];
    for (heads, kv_heads, hd, prefill, window) in cases {
        let spec = AttentionSpec {
            heads,
            kv_heads,
            head_dim: hd,
            sliding_window: window,
        };
        let kv_width = kv_heads * hd;
        let steps: [[usize; 2]; 4] = [prefill, [1, 1], [3, 2], [1, 1]];
        let max_tokens = steps.iter().map(|s| s[0].max(s[1])).sum::<usize>();
        let paths = [
            AttentionPath::TensorCore,
            AttentionPath::Reference,
            AttentionPath::Flash,
        ];
        let mut all_caches: Vec<Vec<CudaKvCache>> = paths
            .iter()
            .map(|_| {
                (0..2)
                    .map(|_| gpu.new_kv_cache(max_tokens, kv_width).unwrap())
                    .collect()
            })
            .collect();
        let mut starts = [0usize; 2];
        for (step, lengths) in steps.into_iter().enumerate() {
            let total = lengths[0] + lengths[1];
            let q = symmetric_uniform(&mut rng, total * heads * hd, 1.5);
            let k = symmetric_uniform(&mut rng, total * kv_width, 1.5);
            let v = symmetric_uniform(&mut rng, total * kv_width, 1.0);
            let segments = [(lengths[0], starts[0]), (lengths[1], starts[1])];
            let outputs: Vec<Vec<f32>> = paths
                .iter()
                .zip(all_caches.iter_mut())
                .map(|(&path, caches)| {
                    attention_call(&gpu, path, (&q, &k, &v), &spec, caches, &segments)
                })
                .collect();
            if step > 0 {
                let (vs_reference, vs_f32) = (
                    relative_difference(&outputs[0], &outputs[1]),
                    relative_difference(&outputs[0], &outputs[2]),
                );
                println!(
                    "decode attention heads {heads}/{kv_heads} hd {hd} window {window:?}, rows {lengths:?} at {starts:?}: tensor cores vs reference {vs_reference:.2e}, vs f32 kernels {vs_f32:.2e}"
                );
                assert!(
                    vs_reference <= TENSOR_CORE_TOLERANCE && vs_f32 <= TENSOR_CORE_TOLERANCE,
                    "heads {heads}/{kv_heads} hd {hd} window {window:?}, rows {lengths:?} at {starts:?}: tensor cores differ by {vs_reference:.2e} from the reference, {vs_f32:.2e} from the f32 kernels"
                );
                assert_ne!(outputs[0], outputs[2], "the tensor cores did not run");
            }
            starts[0] += lengths[0];
            starts[1] += lengths[1];
        }
    }
}
