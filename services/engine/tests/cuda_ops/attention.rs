//! Causal GQA attention against the CPU backend over lengths and GQA ratios (f32 and bf16 KV
//! caches), and the flash kernels against the reference kernel on long contexts; with the
//! decode-time figures.

use ninfer_engine::backend::cuda::{AttentionPath, CudaBackend, KvDtype};
use ninfer_engine::backend::{AttentionSpec, Segment};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::{Backend, CpuBackend};

use crate::helpers::{compare, gpu, gpu_default, random, round_to_bf16, two_segments};

/// (heads, kv_heads, head_dim, prefill lengths of the two sequences, decode steps, window)
type AttentionCase = (usize, usize, usize, [usize; 2], usize, Option<usize>);

/// Causal GQA attention over lengths 1..4096 and GQA ratios 1..8: a prefill, then decode steps,
/// for two sequences batched together; one case with a sliding window. f32 KV cache.
#[test]
fn attention_matches_the_cpu_backend_over_lengths_and_gqa_ratios() {
    let Some(gpu) = gpu("attention_matches_the_cpu_backend_over_lengths_and_gqa_ratios") else {
        return;
    };
    assert_eq!(gpu.info().kv_dtype, KvDtype::F32);
    attention_cases(&gpu);
}

/// The same cases with the default bf16 KV cache (half the bytes). The CPU reference gets the
/// keys and values already rounded to bf16 (nearest even, as the append kernel rounds), so the
/// check stays tight (2e-5, or 2e-2 with tensor-core prefill); the difference from the
/// unrounded reference is printed and held to 2e-2.
#[test]
fn bf16_kv_attention_matches_the_cpu_backend_over_lengths_and_gqa_ratios() {
    let Some(gpu) =
        gpu_default("bf16_kv_attention_matches_the_cpu_backend_over_lengths_and_gqa_ratios")
    else {
        return;
    };
    assert_eq!(
        gpu.info().kv_dtype,
        KvDtype::Bf16,
        "bf16 is the default KV dtype"
    );
    let cache = gpu.new_kv_cache(100, 3 * 64).unwrap();
    assert_eq!(
        cache.device_bytes(),
        2 * 100 * 3 * 64 * 2,
        "bf16 cache not 2 bytes a value"
    );
    attention_cases(&gpu);
    gpu.synchronize().unwrap();
}

/// Runs the attention cases on `gpu` against the CPU backend, with the CPU's keys and values
/// rounded to bf16 when the GPU's cache is bf16.
fn attention_cases(gpu: &CudaBackend) {
    require_flash_attention(gpu);
    let bf16 = gpu.info().kv_dtype == KvDtype::Bf16;
    let cpu = CpuBackend::new();
    let mut rng = Xoshiro256::seed_from_u64(21);
    let cases: [AttentionCase; 6] = [
        (4, 4, 32, [1, 1], 3, None),
        (8, 2, 64, [17, 5], 4, None),
        (8, 1, 128, [300, 33], 2, None),
        (16, 2, 256, [129, 64], 2, None),
        (8, 4, 128, [700, 1], 2, Some(256)),
        (8, 1, 64, [4096, 0], 1, None),
    ];
    for (heads, kv_heads, hd, lengths, decode_steps, window) in cases {
        let spec = AttentionSpec {
            heads,
            kv_heads,
            head_dim: hd,
            sliding_window: window,
        };
        let max_tokens = lengths[0].max(lengths[1]) + decode_steps;
        let kv_width = kv_heads * hd;
        let mut caches_g = [
            gpu.new_kv_cache(max_tokens, kv_width).unwrap(),
            gpu.new_kv_cache(max_tokens, kv_width).unwrap(),
        ];
        let mut caches_c = [
            cpu.new_kv_cache(max_tokens, kv_width).unwrap(),
            cpu.new_kv_cache(max_tokens, kv_width).unwrap(),
        ];
        // The unrounded reference of the bf16 case (how far bf16 K/V move the result).
        let mut caches_u = [
            cpu.new_kv_cache(max_tokens, kv_width).unwrap(),
            cpu.new_kv_cache(max_tokens, kv_width).unwrap(),
        ];
        let mut drift = 0.0f32;
        let mut positions = [0usize, 0];
        let mut worst = 0.0f32;
        for step in 0..=decode_steps {
            let new = if step == 0 { lengths } else { [1, 1] };
            // A sequence with nothing to prefill (length 0) joins at its first decode step.
            let total = new[0] + new[1];
            let q = random(&mut rng, total * heads * hd, 1.5);
            let k = random(&mut rng, total * kv_width, 1.5);
            let v = random(&mut rng, total * kv_width, 1.0);
            let (qg, kg, vg) = (
                gpu.upload(&q, total, heads * hd).unwrap(),
                gpu.upload(&k, total, kv_width).unwrap(),
                gpu.upload(&v, total, kv_width).unwrap(),
            );
            let (k_ref, v_ref) = if bf16 {
                (round_to_bf16(&k), round_to_bf16(&v))
            } else {
                (k.clone(), v.clone())
            };
            let (qc, kc, vc) = (
                cpu.upload(&q, total, heads * hd).unwrap(),
                cpu.upload(&k_ref, total, kv_width).unwrap(),
                cpu.upload(&v_ref, total, kv_width).unwrap(),
            );
            let (ku, vu) = (
                cpu.upload(&k, total, kv_width).unwrap(),
                cpu.upload(&v, total, kv_width).unwrap(),
            );
            let out_g = {
                let mut segments = two_segments(&mut caches_g, new, positions);
                gpu.download(&gpu.attention(&qg, &kg, &vg, &spec, &mut segments).unwrap())
                    .unwrap()
            };
            let out_c = {
                let mut segments = two_segments(&mut caches_c, new, positions);
                cpu.download(&cpu.attention(&qc, &kc, &vc, &spec, &mut segments).unwrap())
                    .unwrap()
            };
            let out_u = {
                let mut segments = two_segments(&mut caches_u, new, positions);
                cpu.download(&cpu.attention(&qc, &ku, &vu, &spec, &mut segments).unwrap())
                    .unwrap()
            };
            let what = format!(
                "attention ({} KV) heads {heads}/{kv_heads} hd {hd} lengths {lengths:?} window {window:?} step {step}",
                gpu.info().kv_dtype
            );
            // Tensor-core prefill rounds q and the softmax weights to bf16
            // (tests/cuda_tensor_core_attention.rs holds it to the other kernels).
            let tolerance = if gpu.info().attention_path == AttentionPath::TensorCore {
                2e-2
            } else {
                2e-5
            };
            compare(&what, &out_g, &out_c, tolerance);
            if bf16 {
                compare(&format!("{what} vs unrounded K/V"), &out_g, &out_u, 2e-2);
            }
            let scale_u = out_u.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            drift = out_g
                .iter()
                .zip(&out_u)
                .fold(drift, |m, (a, b)| m.max((a - b).abs() / scale_u));
            let scale = out_c.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            worst = out_g
                .iter()
                .zip(&out_c)
                .fold(worst, |m, (a, b)| m.max((a - b).abs() / scale));
            positions[0] += new[0];
            positions[1] += new[1];
        }
        println!(
            "attention ({} KV) heads {heads}/{kv_heads} (GQA ratio {}) hd {hd} lengths {lengths:?}: worst {worst:.2e} (vs unrounded K/V {drift:.2e})",
            gpu.info().kv_dtype,
            heads / kv_heads
        );
    }
}

/// Prints the attention path; under `NINFER_REQUIRE_GPU=1` it must be the flash kernels, with
/// tensor-core prefill where the options ask for it (anything else means a start-up self-check
/// failed: the log says why).
fn require_flash_attention(gpu: &CudaBackend) {
    println!(
        "attention path ({} KV): {}",
        gpu.info().kv_dtype,
        gpu.info().attention_path
    );
    if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        let expected = if gpu.options().tensor_core_prefill {
            AttentionPath::TensorCore
        } else {
            AttentionPath::Flash
        };
        assert_eq!(
            gpu.info().attention_path,
            expected,
            "the flash attention kernels failed their start-up check (see the warning in the log)"
        );
    }
}

/// Runs one attention call over `segments` (rows in order, `(length, start position)` each)
/// through `path`, each segment on its own cache.
fn attention_through(
    gpu: &CudaBackend,
    path: AttentionPath,
    (q, k, v): (&[f32], &[f32], &[f32]),
    spec: &AttentionSpec,
    caches: &mut [ninfer_engine::backend::cuda::CudaKvCache],
    segments: &[(usize, usize)],
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

/// The flash kernels (split-K decode, tiled prefill) against the reference kernel on long
/// contexts: segments of 1, 255, 256, 257, 1000 and 4096 rows prefilled in one batch, then a
/// second batch continuing them from their different start positions (split rows and tiled
/// rows), then a decode step of every segment; GQA 1, 2, 4, 8 at head_dim 64, 128, 256, and a
/// sliding window. f32 KV (exact backend) within 1e-5 of the largest value, bf16 KV (default
/// backend) within 2e-5. Also checks batch invariance: a segment's rows computed alone equal
/// (bit for bit) the same rows computed in the batch.
#[test]
fn flash_attention_matches_the_reference_kernel_on_long_contexts() {
    let test = "flash_attention_matches_the_reference_kernel_on_long_contexts";
    let Some(exact) = gpu(test) else {
        return;
    };
    let Some(default) = gpu_default(test) else {
        return;
    };
    let mut rng = Xoshiro256::seed_from_u64(77);
    let prefill = [1usize, 255, 256, 257, 1000, 4096];
    let more = [300usize, 1, 8, 9, 3, 33];
    let mut configs: Vec<(usize, usize, usize, Option<usize>)> = Vec::new();
    for hd in [64usize, 128, 256] {
        for ratio in [1usize, 2, 4, 8] {
            configs.push((2 * ratio, 2, hd, None));
        }
    }
    configs.push((8, 2, 128, Some(300)));
    configs.push((16, 1, 64, Some(1)));
    for (gpu, tolerance) in [(&exact, 1e-5f32), (&default, 2e-5)] {
        require_flash_attention(gpu);
        for &(heads, kv_heads, hd, window) in &configs {
            let spec = AttentionSpec {
                heads,
                kv_heads,
                head_dim: hd,
                sliding_window: window,
            };
            let kv_width = kv_heads * hd;
            let max_tokens = 4096 + 300 + 40;
            let new_caches = || -> Vec<_> {
                (0..prefill.len())
                    .map(|_| gpu.new_kv_cache(max_tokens, kv_width).unwrap())
                    .collect()
            };
            let (mut flash, mut reference) = (new_caches(), new_caches());
            let mut positions = [0usize; 6];
            let mut worst = 0.0f32;
            for (step, lengths) in [prefill, more, [1; 6]].into_iter().enumerate() {
                let segments: Vec<(usize, usize)> =
                    lengths.iter().copied().zip(positions).collect();
                let total: usize = lengths.iter().sum();
                let q = random(&mut rng, total * heads * hd, 1.5);
                let k = random(&mut rng, total * kv_width, 1.5);
                let v = random(&mut rng, total * kv_width, 1.0);
                let inputs = (&q[..], &k[..], &v[..]);
                let got = attention_through(
                    gpu,
                    AttentionPath::Flash,
                    inputs,
                    &spec,
                    &mut flash,
                    &segments,
                );
                let expected = attention_through(
                    gpu,
                    AttentionPath::Reference,
                    inputs,
                    &spec,
                    &mut reference,
                    &segments,
                );
                let what = format!(
                    "flash vs reference ({} KV) heads {heads}/{kv_heads} hd {hd} window {window:?} step {step} segments {segments:?}",
                    gpu.info().kv_dtype
                );
                let scale = expected.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                let difference =
                    got.iter()
                        .zip(&expected)
                        .map(|(a, b)| (a - b).abs())
                        .fold(
                            0.0f32,
                            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
                        );
                assert!(
                    difference / scale <= tolerance,
                    "{what}: max |Δ| {difference} (scale {scale}) over {tolerance}"
                );
                worst = worst.max(difference / scale);
                // Batch invariance: the 1000-row sequence (index 4) alone. Its cache already
                // holds these keys and values; appending them again rewrites the same values.
                let width = heads * hd;
                let before: usize = lengths[..4].iter().sum();
                let rows = before..before + lengths[4];
                let alone = attention_through(
                    gpu,
                    AttentionPath::Flash,
                    (
                        &q[rows.start * width..rows.end * width],
                        &k[rows.start * kv_width..rows.end * kv_width],
                        &v[rows.start * kv_width..rows.end * kv_width],
                    ),
                    &spec,
                    &mut flash[4..5],
                    &segments[4..5],
                );
                assert!(
                    alone
                        .iter()
                        .zip(&got[rows.start * width..rows.end * width])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: the 1000-token sequence alone differs from it in the batch"
                );
                for (position, length) in positions.iter_mut().zip(lengths) {
                    *position += length;
                }
            }
            println!(
                "flash vs reference ({} KV) heads {heads}/{kv_heads} (GQA {}) hd {hd} window {window:?}: worst {worst:.2e}",
                gpu.info().kv_dtype,
                heads / kv_heads
            );
        }
        gpu.synchronize().unwrap();
    }
}

/// Not a check: time per decode step (one attention call) at a 4096-token context, reference
/// kernel vs flash (split-K), for 1 and 16 sequences, f32 and bf16 KV (run by hand:
/// `cuda_ops -- --ignored attention_decode_figures --nocapture`).
#[test]
#[ignore = "a figure, not a check; needs a GPU"]
fn attention_decode_figures() {
    let test = "attention_decode_figures";
    let Some(exact) = gpu(test) else {
        return;
    };
    let Some(default) = gpu_default(test) else {
        return;
    };
    let context = 4096usize;
    let mut rng = Xoshiro256::seed_from_u64(99);
    for gpu in [&exact, &default] {
        println!("attention path in use: {}", gpu.info().attention_path);
        // (heads, kv_heads, head_dim): Qwen3-30B-A3B and Qwen3-Next / Qwen3.5 shapes.
        for (heads, kv_heads, hd) in [(32usize, 4usize, 128usize), (16, 2, 256)] {
            let spec = AttentionSpec {
                heads,
                kv_heads,
                head_dim: hd,
                sliding_window: None,
            };
            let kv_width = kv_heads * hd;
            for sequences in [1usize, 16] {
                let mut caches: Vec<_> = (0..sequences)
                    .map(|_| gpu.new_kv_cache(context, kv_width).unwrap())
                    .collect();
                // Fill the caches (flash prefill, the same keys for every sequence), then time
                // the decode step at the last position.
                let rows = context - 1;
                let (pq, pk, pv) = (
                    gpu.upload(&random(&mut rng, rows * heads * hd, 1.0), rows, heads * hd)
                        .unwrap(),
                    gpu.upload(&random(&mut rng, rows * kv_width, 1.0), rows, kv_width)
                        .unwrap(),
                    gpu.upload(&random(&mut rng, rows * kv_width, 1.0), rows, kv_width)
                        .unwrap(),
                );
                for cache in caches.iter_mut() {
                    let mut batch = vec![Segment {
                        rows: 0..rows,
                        start_position: 0,
                        state: cache,
                    }];
                    let _ = gpu
                        .attention_with_path(AttentionPath::Flash, &pq, &pk, &pv, &spec, &mut batch)
                        .unwrap();
                }
                let (q, k, v) = (
                    gpu.upload(
                        &random(&mut rng, sequences * heads * hd, 1.0),
                        sequences,
                        heads * hd,
                    )
                    .unwrap(),
                    gpu.upload(
                        &random(&mut rng, sequences * kv_width, 1.0),
                        sequences,
                        kv_width,
                    )
                    .unwrap(),
                    gpu.upload(
                        &random(&mut rng, sequences * kv_width, 1.0),
                        sequences,
                        kv_width,
                    )
                    .unwrap(),
                );
                let mut timings = Vec::new();
                for path in [AttentionPath::Reference, AttentionPath::Flash] {
                    let mut step = || {
                        let mut batch: Vec<Segment<'_, _>> = caches
                            .iter_mut()
                            .enumerate()
                            .map(|(i, cache)| Segment {
                                rows: i..i + 1,
                                start_position: context - 1,
                                state: cache,
                            })
                            .collect();
                        let _ = gpu
                            .attention_with_path(path, &q, &k, &v, &spec, &mut batch)
                            .unwrap();
                    };
                    step();
                    gpu.synchronize().unwrap();
                    let repeats = 50;
                    let start = std::time::Instant::now();
                    for _ in 0..repeats {
                        step();
                    }
                    gpu.synchronize().unwrap();
                    timings.push(start.elapsed().as_secs_f64() / repeats as f64);
                }
                let bytes =
                    (2 * sequences * context * kv_width * gpu.info().kv_dtype.bytes()) as f64;
                println!(
                    "attention decode ({} KV) heads {heads}/{kv_heads} hd {hd}, {sequences} sequence(s) at {context} tokens: reference {:.3} ms, flash {:.3} ms ({:.1}×; K/V read at {:.0} GB/s)",
                    gpu.info().kv_dtype,
                    timings[0] * 1e3,
                    timings[1] * 1e3,
                    timings[0] / timings[1],
                    bytes / timings[1] / 1e9
                );
            }
        }
    }
}
