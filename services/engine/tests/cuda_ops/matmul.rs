//! bf16 weights and matmuls against the CPU backend and a host reference (the kernel and cuBLAS
//! paths), and `matmul3` against three `matmul`s; with the bandwidth figures.

use ninfer_engine::backend::cuda::{CudaBackend, CudaTensor, CudaWeight};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};
use ninfer_engine::{open_artifact, Backend, CpuBackend};

use crate::helpers::{compare, gpu, gpu_default, random, round_to_bf16};

/// bf16 matrices stay bf16 on the GPU (half the bytes) and compute what the CPU backend
/// computes from the same stored weights.
#[test]
fn bf16_weights_match_the_cpu_backend() {
    let Some(gpu) = gpu("bf16_weights_match_the_cpu_backend") else {
        return;
    };
    let cpu = CpuBackend::new();
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("tiny-bf16.ninfer");
    let options = TinyModelOptions {
        dense_dtype: ninfer_artifact::DType::Bf16,
        ..TinyModelOptions::new(TinyArchitecture::Qwen3Next)
    };
    write_tiny_model(&path, options).unwrap();
    let artifact = open_artifact(&path).unwrap();
    let mut rng = Xoshiro256::seed_from_u64(41);
    let ids: Vec<u32> = (0..23).map(|i| (i * 7 + 2) % 97).collect();
    let table = (
        gpu.load_matrix(&artifact, "embed_tokens").unwrap(),
        cpu.load_matrix(&artifact, "embed_tokens").unwrap(),
    );
    assert_eq!(
        table.0.device_bytes(),
        97 * 64 * 2,
        "bf16 table not kept as bf16"
    );
    compare(
        "embed bf16",
        &gpu.download(&gpu.embed(&table.0, &ids).unwrap()).unwrap(),
        &cpu.download(&cpu.embed(&table.1, &ids).unwrap()).unwrap(),
        0.0,
    );
    for rows in [1usize, 23] {
        let x = random(&mut rng, rows * 64, 1.0);
        let (xg, xc) = (
            gpu.upload(&x, rows, 64).unwrap(),
            cpu.upload(&x, rows, 64).unwrap(),
        );
        // Tied embeddings: the table is also the lm_head.
        compare(
            &format!("matmul bf16 tied lm_head × {rows} rows"),
            &gpu.download(&gpu.matmul(&xg, &table.0).unwrap()).unwrap(),
            &cpu.download(&cpu.matmul(&xc, &table.1).unwrap()).unwrap(),
            1e-5,
        );
        let weight = (
            gpu.load_matrix(&artifact, "layers.1.attn.q_proj").unwrap(),
            cpu.load_matrix(&artifact, "layers.1.attn.q_proj").unwrap(),
        );
        compare(
            &format!("matmul bf16 q_proj × {rows} rows"),
            &gpu.download(&gpu.matmul(&xg, &weight.0).unwrap()).unwrap(),
            &cpu.download(&cpu.matmul(&xc, &weight.1).unwrap()).unwrap(),
            1e-5,
        );
    }
    gpu.synchronize().unwrap();
}

/// bf16 matmuls on the default backend: odd shapes (no tensor-core alignment) and aligned ones,
/// at 1, 9, 64 and 300 rows. Rows at or above the cuBLAS threshold go through cuBLAS when it
/// loaded (the activations are rounded to bf16 first), fewer through the kernel; each is held
/// tightly (2e-5) to an f64 host reference (the CPU backend's math, on the host) on exactly the
/// operands that path multiplies, and to 1e-2 against the unrounded activations. Prints which
/// path each case took; `NINFER_REQUIRE_CUBLAS=1` fails it when cuBLAS is not in use.
#[test]
fn cublas_matmul_matches_a_host_reference() {
    let Some(gpu) = gpu_default("cublas_matmul_matches_a_host_reference") else {
        return;
    };
    println!(
        "cuBLAS: {}",
        gpu.info()
            .cublas_library
            .as_deref()
            .unwrap_or("not in use (not found or failed its start-up check; see the log)")
    );
    if std::env::var("NINFER_REQUIRE_CUBLAS").is_ok_and(|v| v == "1") {
        assert!(
            gpu.info().cublas_library.is_some(),
            "NINFER_REQUIRE_CUBLAS=1 but cuBLAS is not in use"
        );
    }
    let mut rng = Xoshiro256::seed_from_u64(61);
    for (out_features, in_features) in [(129usize, 300usize), (19, 37), (97, 64), (256, 512)] {
        let w = round_to_bf16(&random(&mut rng, out_features * in_features, 0.5));
        let weight = gpu
            .weight_from_host_bf16(&w, out_features, in_features)
            .unwrap();
        assert_eq!(weight.device_bytes(), out_features * in_features * 2);
        for rows in [1usize, 9, 64, 300] {
            let x = random(&mut rng, rows * in_features, 1.0);
            let through_cublas = gpu.uses_cublas_for(rows);
            // The cuBLAS path multiplies x as two bf16 terms, hi = bf16(x), lo = bf16(x − hi).
            let multiplied = if through_cublas {
                let hi = round_to_bf16(&x);
                let rest: Vec<f32> = x.iter().zip(&hi).map(|(v, h)| v - h).collect();
                let lo = round_to_bf16(&rest);
                hi.iter().zip(&lo).map(|(h, l)| h + l).collect()
            } else {
                x.clone()
            };
            let reference = |x: &[f32]| -> Vec<f32> {
                (0..rows * out_features)
                    .map(|i| {
                        let (r, o) = (i / out_features, i % out_features);
                        (0..in_features)
                            .map(|c| {
                                f64::from(x[r * in_features + c])
                                    * f64::from(w[o * in_features + c])
                            })
                            .sum::<f64>() as f32
                    })
                    .collect()
            };
            let got = gpu
                .download(
                    &gpu.matmul(&gpu.upload(&x, rows, in_features).unwrap(), &weight)
                        .unwrap(),
                )
                .unwrap();
            let path = if through_cublas { "cuBLAS" } else { "kernel" };
            let what = format!("matmul bf16 {out_features}×{in_features} × {rows} rows ({path})");
            compare(&what, &got, &reference(&multiplied), 2e-5);
            compare(
                &format!("{what} vs f32 activations"),
                &got,
                &reference(&x),
                1e-4,
            );
        }
    }
    gpu.synchronize().unwrap();
}

/// Mean seconds of `x · weightᵀ` over 20 calls, after one warm-up.
fn seconds_per_matmul(gpu: &CudaBackend, x: &CudaTensor, weight: &CudaWeight) -> f64 {
    let _ = gpu.matmul(x, weight).unwrap();
    gpu.synchronize().unwrap();
    let repeats = 20;
    let start = std::time::Instant::now();
    for _ in 0..repeats {
        let _ = gpu.matmul(x, weight).unwrap();
    }
    gpu.synchronize().unwrap();
    start.elapsed().as_secs_f64() / repeats as f64
}

/// Three projections of one input in one launch (`Backend::matmul3`, the CUDA backend's
/// `matmul3_bf16` at decode sizes) against three `matmul`s: 1, 3 and 8 rows (the kernel) and 20
/// (cuBLAS, three calls), k on the 8-wide, 4-wide and scalar paths, a small third matrix.
#[test]
fn matmul3_equals_three_matmuls() {
    let Some(gpu) = gpu_default("matmul3_equals_three_matmuls") else {
        return;
    };
    let mut rng = Xoshiro256::seed_from_u64(33);
    for k in [256usize, 100, 98] {
        let features = [512usize, 64, 24];
        let weights: Vec<_> = features
            .iter()
            .map(|&m| {
                gpu.weight_from_host(&random(&mut rng, m * k, 0.1), m, k)
                    .unwrap()
            })
            .collect();
        for rows in [1usize, 3, 8, 20] {
            let x = gpu
                .upload(&random(&mut rng, rows * k, 1.0), rows, k)
                .unwrap();
            let fused = gpu
                .matmul3(&x, [&weights[0], &weights[1], &weights[2]])
                .unwrap();
            for (index, (out, weight)) in fused.iter().zip(&weights).enumerate() {
                let (got, expected) = (
                    gpu.download(out).unwrap(),
                    gpu.download(&gpu.matmul(&x, weight).unwrap()).unwrap(),
                );
                let what = format!("matmul3 k {k} rows {rows} projection {index}");
                compare(&what, &got, &expected, 1e-6);
                let identical = got
                    .iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                println!("{what}: bit-identical to matmul: {identical}");
            }
        }
    }
    gpu.synchronize().unwrap();
}

/// Not a check: prints the matmul kernel's achieved weight bandwidth at decode and small-batch
/// shapes (run by `scripts/gpu_tests.sh run`: `cuda_ops --ignored matmul_bandwidth_figures`).
#[test]
#[ignore = "a figure, not a check; needs a GPU"]
fn matmul_bandwidth_figures() {
    let Some(gpu) = gpu("matmul_bandwidth_figures") else {
        return;
    };
    let (out_features, in_features) = (14336usize, 4096usize);
    let mut rng = Xoshiro256::seed_from_u64(51);
    let values = random(&mut rng, out_features * in_features, 0.02);
    let weight = gpu
        .weight_from_host(&values, out_features, in_features)
        .unwrap();
    for rows in [1usize, 8, 64, 512] {
        let x = gpu
            .upload(
                &random(&mut rng, rows * in_features, 1.0),
                rows,
                in_features,
            )
            .unwrap();
        let seconds = seconds_per_matmul(&gpu, &x, &weight);
        let bytes = (out_features * in_features * 4) as f64;
        let flops = 2.0 * (rows * out_features * in_features) as f64;
        println!(
            "matmul f32 {rows}×{in_features} · ({out_features}×{in_features})ᵀ: {:.3} ms, weights at {:.0} GB/s, {:.2} TFLOP/s",
            seconds * 1e3,
            bytes / seconds / 1e9,
            flops / seconds / 1e12
        );
    }
    // bf16 weights on the default backend: the kernel at decode sizes, cuBLAS above.
    let Some(gpu) = gpu_default("matmul_bandwidth_figures") else {
        return;
    };
    let weight = gpu
        .weight_from_host_bf16(&values, out_features, in_features)
        .unwrap();
    for rows in [1usize, 8, 64, 512, 2048] {
        let x = gpu
            .upload(
                &random(&mut rng, rows * in_features, 1.0),
                rows,
                in_features,
            )
            .unwrap();
        let seconds = seconds_per_matmul(&gpu, &x, &weight);
        let bytes = (out_features * in_features * 2) as f64;
        let flops = 2.0 * (rows * out_features * in_features) as f64;
        let path = if gpu.uses_cublas_for(rows) {
            "cuBLAS"
        } else {
            "kernel"
        };
        println!(
            "matmul bf16 ({path}) {rows}×{in_features} · ({out_features}×{in_features})ᵀ: {:.3} ms, weights at {:.0} GB/s, {:.2} TFLOP/s",
            seconds * 1e3,
            bytes / seconds / 1e9,
            flops / seconds / 1e12
        );
    }
}
