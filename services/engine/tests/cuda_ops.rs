//! Op-level checks of the CUDA backend against the CPU backend (the reference) on random inputs:
//! every element-wise and norm op, matmul at several batch sizes, causal GQA attention over
//! lengths 1..4096 and GQA ratios 1..8 (prefill, decode, sliding window, two sequences in one
//! batch), the causal conv and the gated delta rule continuing from their states. These run on
//! the backend with `CudaOptions::exact` (f32 KV cache, matmul kernel only), held to f32
//! tolerances. The default options (bf16 KV cache, cuBLAS for bf16 prefill GEMMs) are checked
//! by `cublas_matmul_matches_a_host_reference` and
//! `bf16_kv_attention_matches_the_cpu_backend_over_lengths_and_gqa_ratios`.
//!
//! Without a GPU every test prints that it is skipped and passes (fails under
//! `NINFER_REQUIRE_GPU=1`). Run `cargo test -p ninfer-engine --test cuda_ops -- --nocapture` to
//! see the figures.

use std::sync::Arc;

use ninfer_engine::backend::cuda::{AttentionPath, CudaBackend, CudaTensor, CudaWeight, KvDtype};
use ninfer_engine::backend::{
    AttentionSpec, DeltaRuleForm, DeltaRuleSpec, NormStyle, Rotation, Segment,
};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{
    skip_without_cuda, write_tiny_model, TinyArchitecture, TinyModelOptions,
};
use ninfer_engine::{open_artifact, Backend, CpuBackend};

/// The exact backend (f32 KV cache, no cuBLAS), or `None` after printing why the test skips.
fn gpu(test: &str) -> Option<Arc<CudaBackend>> {
    skip_without_cuda(test, CudaBackend::shared_exact())
}

/// The backend with the default options (what `ninfer-engine --device cuda` runs).
fn gpu_default(test: &str) -> Option<Arc<CudaBackend>> {
    skip_without_cuda(test, CudaBackend::shared())
}

fn random(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// max |gpu − cpu| / max(1, max |cpu|), asserted under `tolerance`; NaN fails.
fn compare(what: &str, gpu: &[f32], cpu: &[f32], tolerance: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths differ");
    let scale = cpu.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let worst = gpu
        .iter()
        .zip(cpu)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0.0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        );
    println!("{what}: max |Δ| / scale = {:.2e}", worst / scale);
    assert!(
        worst / scale <= tolerance,
        "{what}: max |Δ| {worst} (scale {scale}) over tolerance {tolerance}"
    );
}

/// Element-wise, norm, matmul, embedding, routing and conv ops on the weights of a tiny
/// qwen3.5-MoE model, loaded by both backends.
#[test]
fn dense_ops_match_the_cpu_backend() {
    let Some(gpu) = gpu("dense_ops_match_the_cpu_backend") else {
        return;
    };
    let cpu = CpuBackend::new();
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("tiny.ninfer");
    write_tiny_model(&path, TinyModelOptions::new(TinyArchitecture::Qwen35Moe)).unwrap();
    let artifact = open_artifact(&path).unwrap();
    let mut rng = Xoshiro256::seed_from_u64(11);
    let up = |values: &[f32], rows, cols| {
        (
            gpu.upload(values, rows, cols).unwrap(),
            cpu.upload(values, rows, cols).unwrap(),
        )
    };

    // Embedding and matmuls at decode and prefill batch sizes (97 outputs: a partial tile).
    let ids: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 97).collect();
    let table = (
        gpu.load_matrix(&artifact, "embed_tokens").unwrap(),
        cpu.load_matrix(&artifact, "embed_tokens").unwrap(),
    );
    compare(
        "embed",
        &gpu.download(&gpu.embed(&table.0, &ids).unwrap()).unwrap(),
        &cpu.download(&cpu.embed(&table.1, &ids).unwrap()).unwrap(),
        0.0,
    );
    for name in [
        "lm_head",
        "layers.1.attn.q_proj",
        "layers.0.gdn.in_proj_qkv",
        "layers.0.gdn.in_proj_b",
        "layers.0.moe.shared_expert.down_proj",
    ] {
        let weight = (
            gpu.load_matrix(&artifact, name).unwrap(),
            cpu.load_matrix(&artifact, name).unwrap(),
        );
        let (_, cols) = cpu.weight_shape(&weight.1);
        for rows in [1usize, 5, 37] {
            let x = random(&mut rng, rows * cols, 1.0);
            let (xg, xc) = up(&x, rows, cols);
            compare(
                &format!("matmul {name} × {rows} rows"),
                &gpu.download(&gpu.matmul(&xg, &weight.0).unwrap()).unwrap(),
                &cpu.download(&cpu.matmul(&xc, &weight.1).unwrap()).unwrap(),
                1e-5,
            );
        }
    }

    // An input width that is not a multiple of 4 (the kernel's scalar path), against a plain
    // f64 loop.
    let (out_features, in_features) = (19usize, 37usize);
    let w = random(&mut rng, out_features * in_features, 0.5);
    let odd = gpu.weight_from_host(&w, out_features, in_features).unwrap();
    for rows in [1usize, 9] {
        let x = random(&mut rng, rows * in_features, 1.0);
        let expected: Vec<f32> = (0..rows * out_features)
            .map(|i| {
                let (r, o) = (i / out_features, i % out_features);
                (0..in_features)
                    .map(|c| f64::from(x[r * in_features + c]) * f64::from(w[o * in_features + c]))
                    .sum::<f64>() as f32
            })
            .collect();
        let xg = gpu.upload(&x, rows, in_features).unwrap();
        compare(
            &format!("matmul 19×37 (k % 4 ≠ 0) × {rows} rows"),
            &gpu.download(&gpu.matmul(&xg, &odd).unwrap()).unwrap(),
            &expected,
            1e-5,
        );
    }

    // Norms: per row (64) and per head (32 of 4·32 columns), both styles; gated (16).
    let x = random(&mut rng, 7 * 128, 2.0);
    for (name, cols) in [("layers.0.input_norm", 64), ("layers.1.attn.q_norm", 128)] {
        let weight = (
            gpu.load_parameter(&artifact, name).unwrap(),
            cpu.load_parameter(&artifact, name).unwrap(),
        );
        let rows = x.len() / cols;
        let (xg, xc) = up(&x, rows, cols);
        for style in [NormStyle::Plain, NormStyle::ZeroCentred] {
            compare(
                &format!("rms_norm {name} {style:?}"),
                &gpu.download(&gpu.rms_norm(&xg, &weight.0, 1e-6, style).unwrap())
                    .unwrap(),
                &cpu.download(&cpu.rms_norm(&xc, &weight.1, 1e-6, style).unwrap())
                    .unwrap(),
                1e-5,
            );
        }
    }
    // The residual add fused with the norm after it: the same bits as the two ops on the GPU
    // (same threads, same summation order), the CPU backend's values to rounding, and the sum
    // written back.
    let weight = (
        gpu.load_parameter(&artifact, "layers.0.input_norm")
            .unwrap(),
        cpu.load_parameter(&artifact, "layers.0.input_norm")
            .unwrap(),
    );
    let delta = random(&mut rng, 7 * 128, 1.0);
    for (rows, cols) in [(1usize, 64usize), (14, 64)] {
        let len = rows * cols;
        let (dg, dc) = up(&delta[..len], rows, cols);
        for style in [NormStyle::Plain, NormStyle::ZeroCentred] {
            let (mut fused_x, mut xc) = up(&x[..len], rows, cols);
            let fused = gpu
                .add_rms_norm(&mut fused_x, &dg, &weight.0, 1e-6, style)
                .unwrap();
            let mut split_x = gpu.upload(&x[..len], rows, cols).unwrap();
            gpu.add_assign(&mut split_x, &dg).unwrap();
            let split = gpu.rms_norm(&split_x, &weight.0, 1e-6, style).unwrap();
            let what = format!("add_rms_norm {rows}×{cols} {style:?}");
            assert_eq!(
                gpu.download(&fused).unwrap(),
                gpu.download(&split).unwrap(),
                "{what}: fused differs from add_assign + rms_norm"
            );
            assert_eq!(
                gpu.download(&fused_x).unwrap(),
                gpu.download(&split_x).unwrap(),
                "{what}: residual"
            );
            let expected = cpu
                .add_rms_norm(&mut xc, &dc, &weight.1, 1e-6, style)
                .unwrap();
            compare(
                &what,
                &gpu.download(&fused).unwrap(),
                &cpu.download(&expected).unwrap(),
                1e-5,
            );
            compare(
                &format!("{what} residual"),
                &gpu.download(&fused_x).unwrap(),
                &cpu.download(&xc).unwrap(),
                0.0,
            );
        }
    }

    let norm = (
        gpu.load_parameter(&artifact, "layers.0.gdn.norm").unwrap(),
        cpu.load_parameter(&artifact, "layers.0.gdn.norm").unwrap(),
    );
    let gate = random(&mut rng, 7 * 64, 3.0);
    let (xg, xc) = up(&x[..7 * 64], 7, 64);
    let (gg, gc) = up(&gate, 7, 64);
    compare(
        "gated_rms_norm",
        &gpu.download(&gpu.gated_rms_norm(&xg, &gg, &norm.0, 1e-6).unwrap())
            .unwrap(),
        &cpu.download(&cpu.gated_rms_norm(&xc, &gc, &norm.1, 1e-6).unwrap())
            .unwrap(),
        1e-5,
    );

    // RoPE: partial (8 of 32) and full, positions far apart.
    let positions: Vec<usize> = (0..7).map(|i| i * 977 + 3).collect();
    for rotary in [8usize, 32] {
        let (mut xg, mut xc) = up(&x, 7, 128);
        let rotation = Rotation {
            positions: &positions,
            head_dim: 32,
            rotary_dim: rotary,
            theta: 10_000_000.0,
            multimodal: None,
        };
        gpu.rope(&mut xg, &rotation).unwrap();
        cpu.rope(&mut xc, &rotation).unwrap();
        compare(
            &format!("rope rotary {rotary} of 32"),
            &gpu.download(&xg).unwrap(),
            &cpu.download(&xc).unwrap(),
            1e-4,
        );
    }

    // The per-head norm fused with the rotation after it: the CPU backend's two ops (its
    // default `rms_norm_rope`) and the GPU's own two ops, partial and full rotation, both styles.
    let q_norm = (
        gpu.load_parameter(&artifact, "layers.1.attn.q_norm")
            .unwrap(),
        cpu.load_parameter(&artifact, "layers.1.attn.q_norm")
            .unwrap(),
    );
    let head_dim = q_norm.0.rows * q_norm.0.cols;
    for rotary in [8usize, head_dim] {
        for style in [NormStyle::Plain, NormStyle::ZeroCentred] {
            let rotation = Rotation {
                positions: &positions,
                head_dim,
                rotary_dim: rotary,
                theta: 10_000_000.0,
                multimodal: None,
            };
            let (xg, xc) = up(&x, 7, 128);
            let fused = gpu
                .download(
                    &gpu.rms_norm_rope(&xg, &q_norm.0, 1e-6, style, &rotation)
                        .unwrap(),
                )
                .unwrap();
            let mut split = gpu.rms_norm(&xg, &q_norm.0, 1e-6, style).unwrap();
            gpu.rope(&mut split, &rotation).unwrap();
            let what = format!("rms_norm_rope rotary {rotary} of {head_dim} {style:?}");
            compare(&what, &fused, &gpu.download(&split).unwrap(), 1e-6);
            // q and k in one launch: each the bits of its own `rms_norm_rope`.
            let (kg, _) = up(&x[..7 * 64], 7, 64);
            let (pair_q, pair_k) = gpu
                .rms_norm_rope_pair(&xg, &q_norm.0, &kg, &q_norm.0, 1e-6, style, &rotation)
                .unwrap();
            let alone_k = gpu
                .download(
                    &gpu.rms_norm_rope(&kg, &q_norm.0, 1e-6, style, &rotation)
                        .unwrap(),
                )
                .unwrap();
            let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&gpu.download(&pair_q).unwrap()),
                bits(&fused),
                "{what}: pair q"
            );
            assert_eq!(
                bits(&gpu.download(&pair_k).unwrap()),
                bits(&alone_k),
                "{what}: pair k"
            );
            compare(
                &what,
                &fused,
                &cpu.download(
                    &cpu.rms_norm_rope(&xc, &q_norm.1, 1e-6, style, &rotation)
                        .unwrap(),
                )
                .unwrap(),
                1e-4,
            );
        }
    }

    // Element-wise ops and row / column shuffles.
    let a = random(&mut rng, 9 * 40, 4.0);
    let b = random(&mut rng, 9 * 40, 4.0);
    let (ag, ac) = up(&a, 9, 40);
    let (bg, bc) = up(&b, 9, 40);
    compare(
        "silu_mul",
        &gpu.download(&gpu.silu_mul(&ag, &bg).unwrap()).unwrap(),
        &cpu.download(&cpu.silu_mul(&ac, &bc).unwrap()).unwrap(),
        1e-6,
    );
    compare(
        "mul_sigmoid",
        &gpu.download(&gpu.mul_sigmoid(&ag, &bg).unwrap()).unwrap(),
        &cpu.download(&cpu.mul_sigmoid(&ac, &bc).unwrap()).unwrap(),
        1e-6,
    );
    compare(
        "silu_mul_halves",
        &gpu.download(&gpu.silu_mul_halves(&ag).unwrap()).unwrap(),
        &cpu.download(&cpu.silu_mul_halves(&ac).unwrap()).unwrap(),
        1e-6,
    );
    let (mut sum_g, mut sum_c) = up(&a, 9, 40);
    gpu.add_assign(&mut sum_g, &bg).unwrap();
    cpu.add_assign(&mut sum_c, &bc).unwrap();
    compare(
        "add_assign",
        &gpu.download(&sum_g).unwrap(),
        &cpu.download(&sum_c).unwrap(),
        0.0,
    );
    let gate_column = random(&mut rng, 9 * 3, 3.0);
    let (gcg, gcc) = up(&gate_column, 9, 3);
    gpu.add_sigmoid_scaled_rows(&mut sum_g, &bg, &gcg).unwrap();
    cpu.add_sigmoid_scaled_rows(&mut sum_c, &bc, &gcc).unwrap();
    compare(
        "add_sigmoid_scaled_rows",
        &gpu.download(&sum_g).unwrap(),
        &cpu.download(&sum_c).unwrap(),
        1e-6,
    );
    let rows = [8usize, 0, 3, 3];
    compare(
        "gather_rows",
        &gpu.download(&gpu.gather_rows(&ag, &rows).unwrap()).unwrap(),
        &cpu.download(&cpu.gather_rows(&ac, &rows).unwrap()).unwrap(),
        0.0,
    );
    compare(
        "columns",
        &gpu.download(&gpu.columns(&ag, 7..29).unwrap()).unwrap(),
        &cpu.download(&cpu.columns(&ac, 7..29).unwrap()).unwrap(),
        0.0,
    );
    // Three column ranges: the CPU's three `columns` copies, bit for bit (the
    // last range stops short of the row's end).
    let gpu_parts = gpu.split_columns3(&ag, [7, 13, 11]).unwrap();
    let cpu_parts = cpu.split_columns3(&ac, [7, 13, 11]).unwrap();
    for (part, (g, c)) in gpu_parts.iter().zip(&cpu_parts).enumerate() {
        compare(
            &format!("split_columns3 part {part}"),
            &gpu.download(g).unwrap(),
            &cpu.download(c).unwrap(),
            0.0,
        );
    }
    assert!(gpu.split_columns3(&ag, [20, 20, 20]).is_err());
    // The activation inside the down projection (silu_mul then matmul) and the gate inside the
    // output projection (mul_sigmoid then matmul), bit for bit, at the row counts of a decode
    // step, a decode batch and more.
    {
        // bf16 dense weights: the kernel that fuses the activation reads bf16 rows.
        let bf16_path = directory.path().join("tiny-bf16.ninfer");
        let mut bf16_options = TinyModelOptions::new(TinyArchitecture::Qwen35Moe);
        bf16_options.dense_dtype = ninfer_artifact::DType::Bf16;
        write_tiny_model(&bf16_path, bf16_options).unwrap();
        let bf16_artifact = open_artifact(&bf16_path).unwrap();
        let down_weight = gpu
            .load_matrix(&bf16_artifact, "layers.0.moe.shared_expert.down_proj")
            .unwrap();
        let (out_features, width) = gpu.weight_shape(&down_weight);
        assert!(out_features > 0 && width > 0);
        for rows in [1usize, 3, 9] {
            let gate_values = random(&mut rng, rows * width, 3.0);
            let up_values = random(&mut rng, rows * width, 2.0);
            let gate_g = gpu.upload(&gate_values, rows, width).unwrap();
            let up_g = gpu.upload(&up_values, rows, width).unwrap();
            let fused = gpu.matmul_silu_mul(&gate_g, &up_g, &down_weight).unwrap();
            let separate = gpu
                .matmul(&gpu.silu_mul(&gate_g, &up_g).unwrap(), &down_weight)
                .unwrap();
            compare(
                &format!("matmul_silu_mul, {rows} rows"),
                &gpu.download(&fused).unwrap(),
                &gpu.download(&separate).unwrap(),
                0.0,
            );
            let gated = gpu
                .matmul_mul_sigmoid(&gate_g, &up_g, &down_weight)
                .unwrap();
            let separate = gpu
                .matmul(&gpu.mul_sigmoid(&gate_g, &up_g).unwrap(), &down_weight)
                .unwrap();
            compare(
                &format!("matmul_mul_sigmoid, {rows} rows"),
                &gpu.download(&gated).unwrap(),
                &gpu.download(&separate).unwrap(),
                0.0,
            );
        }
    }
    let (g1, g2) = gpu.split_interleaved(&ag, 4, 6, 4).unwrap();
    let (c1, c2) = cpu.split_interleaved(&ac, 4, 6, 4).unwrap();
    compare(
        "split_interleaved first",
        &gpu.download(&g1).unwrap(),
        &cpu.download(&c1).unwrap(),
        0.0,
    );
    compare(
        "split_interleaved second",
        &gpu.download(&g2).unwrap(),
        &cpu.download(&c2).unwrap(),
        0.0,
    );

    // Router: softmax / top-k / renormalisation give the same experts and weights.
    let logits = random(&mut rng, 11 * 8, 3.0);
    let (lg, lc) = up(&logits, 11, 8);
    for normalize in [false, true] {
        let (rg, rc) = (
            gpu.route_top_k(&lg, 3, normalize).unwrap(),
            cpu.route_top_k(&lc, 3, normalize).unwrap(),
        );
        assert_eq!(rg.expert_ids, rc.expert_ids, "router ids");
        compare("route_top_k weights", &rg.weights, &rc.weights, 1e-6);
    }

    // Delta-rule gates.
    let nv = 4;
    let (av, bv) = (random(&mut rng, 9 * nv, 6.0), random(&mut rng, 9 * nv, 6.0));
    let (a_g, a_c) = up(&av, 9, nv);
    let (b_g, b_c) = up(&bv, 9, nv);
    let a_log = (
        gpu.load_parameter(&artifact, "layers.0.gdn.A_log").unwrap(),
        cpu.load_parameter(&artifact, "layers.0.gdn.A_log").unwrap(),
    );
    let dt_bias = (
        gpu.load_parameter(&artifact, "layers.0.gdn.dt_bias")
            .unwrap(),
        cpu.load_parameter(&artifact, "layers.0.gdn.dt_bias")
            .unwrap(),
    );
    let (gg, betag) = gpu
        .delta_rule_gates(&a_g, &b_g, &a_log.0, &dt_bias.0)
        .unwrap();
    let (gc, betac) = cpu
        .delta_rule_gates(&a_c, &b_c, &a_log.1, &dt_bias.1)
        .unwrap();
    compare(
        "delta_rule_gates g",
        &gpu.download(&gg).unwrap(),
        &cpu.download(&gc).unwrap(),
        1e-5,
    );
    compare(
        "delta_rule_gates beta",
        &gpu.download(&betag).unwrap(),
        &cpu.download(&betac).unwrap(),
        1e-6,
    );

    // Causal conv: two sequences in one batch, then each continued by one token.
    let taps = (
        gpu.load_parameter(&artifact, "layers.0.gdn.conv1d")
            .unwrap(),
        cpu.load_parameter(&artifact, "layers.0.gdn.conv1d")
            .unwrap(),
    );
    let (channels, kernel) = cpu.weight_shape(&taps.1);
    let mut states_g = [
        gpu.new_conv_state(channels, kernel).unwrap(),
        gpu.new_conv_state(channels, kernel).unwrap(),
    ];
    let mut states_c = [
        cpu.new_conv_state(channels, kernel).unwrap(),
        cpu.new_conv_state(channels, kernel).unwrap(),
    ];
    // The same sequences through the conv with its output split in three (one launch): the
    // unsplit conv's columns, bit for bit.
    let mut states_split = [
        gpu.new_conv_state(channels, kernel).unwrap(),
        gpu.new_conv_state(channels, kernel).unwrap(),
    ];
    let widths = [channels / 4, channels / 4, channels - 2 * (channels / 4)];
    for (step, lengths) in [[5usize, 2], [1, 1], [2, 9]].iter().enumerate() {
        let total = lengths[0] + lengths[1];
        let x = random(&mut rng, total * channels, 2.0);
        let (xg, xc) = up(&x, total, channels);
        let mut segments_g = two_segments(&mut states_g, *lengths, [0, 0]);
        let mut segments_c = two_segments(&mut states_c, *lengths, [0, 0]);
        let convolved = gpu
            .causal_conv1d_silu(&xg, &taps.0, &mut segments_g)
            .unwrap();
        compare(
            &format!("causal_conv1d_silu step {step} ({lengths:?} rows)"),
            &gpu.download(&convolved).unwrap(),
            &cpu.download(
                &cpu.causal_conv1d_silu(&xc, &taps.1, &mut segments_c)
                    .unwrap(),
            )
            .unwrap(),
            1e-5,
        );
        let mut segments_split = two_segments(&mut states_split, *lengths, [0, 0]);
        let parts = gpu
            .causal_conv1d_silu_split3(&xg, &taps.0, &mut segments_split, widths)
            .unwrap();
        let expected = gpu.split_columns3(&convolved, widths).unwrap();
        for (part, (got, want)) in parts.iter().zip(&expected).enumerate() {
            compare(
                &format!("causal_conv1d_silu_split3 step {step} part {part}"),
                &gpu.download(got).unwrap(),
                &gpu.download(want).unwrap(),
                0.0,
            );
        }
    }
    gpu.synchronize().unwrap();
}

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

fn round_to_bf16(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// The batch's segments: sequence 0's `new[0]` rows then sequence 1's, each at its position;
/// a sequence without new rows is left out.
fn two_segments<S>(
    caches: &mut [S; 2],
    new: [usize; 2],
    positions: [usize; 2],
) -> Vec<Segment<'_, S>> {
    let [c0, c1] = caches;
    let mut segments = Vec::new();
    if new[0] > 0 {
        segments.push(Segment {
            rows: 0..new[0],
            start_position: positions[0],
            state: c0,
        });
    }
    if new[1] > 0 {
        segments.push(Segment {
            rows: new[0]..new[0] + new[1],
            start_position: positions[1],
            state: c1,
        });
    }
    segments
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

/// The gated delta rule: a multi-token prefill (`Auto`: chunked on both backends, once the GPU's
/// chunked kernel passed its start-up check) of two sequences in one batch, then single-token
/// steps (recurrent) continuing from the states.
#[test]
fn gated_delta_rule_matches_the_cpu_backend() {
    let Some(gpu) = gpu("gated_delta_rule_matches_the_cpu_backend") else {
        return;
    };
    let cpu = CpuBackend::new();
    let mut rng = Xoshiro256::seed_from_u64(31);
    let specs = [
        DeltaRuleSpec {
            key_heads: 2,
            value_heads: 4,
            key_head_dim: 16,
            value_head_dim: 16,
        },
        DeltaRuleSpec {
            key_heads: 4,
            value_heads: 8,
            key_head_dim: 128,
            value_head_dim: 128,
        },
    ];
    for spec in specs {
        let (nk, nv, dk, dv) = (
            spec.key_heads,
            spec.value_heads,
            spec.key_head_dim,
            spec.value_head_dim,
        );
        let mut states_g = [
            gpu.new_recurrent_state(&spec).unwrap(),
            gpu.new_recurrent_state(&spec).unwrap(),
        ];
        let mut states_c = [
            cpu.new_recurrent_state(&spec).unwrap(),
            cpu.new_recurrent_state(&spec).unwrap(),
        ];
        for (step, lengths) in [[150usize, 70], [1, 1], [1, 1], [3, 65]].iter().enumerate() {
            let total = lengths[0] + lengths[1];
            let q = random(&mut rng, total * nk * dk, 1.0);
            let k = random(&mut rng, total * nk * dk, 1.0);
            let v = random(&mut rng, total * nv * dv, 1.0);
            let g: Vec<f32> = random(&mut rng, total * nv, 1.0)
                .iter()
                .map(|x| -x.abs() * 0.5)
                .collect();
            let beta: Vec<f32> = random(&mut rng, total * nv, 1.0)
                .iter()
                .map(|x| 0.5 + 0.5 * x)
                .collect();
            let tensors_g = (
                gpu.upload(&q, total, nk * dk).unwrap(),
                gpu.upload(&k, total, nk * dk).unwrap(),
                gpu.upload(&v, total, nv * dv).unwrap(),
                gpu.upload(&g, total, nv).unwrap(),
                gpu.upload(&beta, total, nv).unwrap(),
            );
            let tensors_c = (
                cpu.upload(&q, total, nk * dk).unwrap(),
                cpu.upload(&k, total, nk * dk).unwrap(),
                cpu.upload(&v, total, nv * dv).unwrap(),
                cpu.upload(&g, total, nv).unwrap(),
                cpu.upload(&beta, total, nv).unwrap(),
            );
            let [s0, s1] = &mut states_g;
            let mut segments_g = [
                Segment {
                    rows: 0..lengths[0],
                    start_position: 0,
                    state: s0,
                },
                Segment {
                    rows: lengths[0]..total,
                    start_position: 0,
                    state: s1,
                },
            ];
            let [c0, c1] = &mut states_c;
            let mut segments_c = [
                Segment {
                    rows: 0..lengths[0],
                    start_position: 0,
                    state: c0,
                },
                Segment {
                    rows: lengths[0]..total,
                    start_position: 0,
                    state: c1,
                },
            ];
            let out_g = gpu
                .download(
                    &gpu.gated_delta_rule(
                        &tensors_g.0,
                        &tensors_g.1,
                        &tensors_g.2,
                        &tensors_g.3,
                        &tensors_g.4,
                        &spec,
                        DeltaRuleForm::Auto,
                        &mut segments_g,
                    )
                    .unwrap(),
                )
                .unwrap();
            let out_c = cpu
                .download(
                    &cpu.gated_delta_rule(
                        &tensors_c.0,
                        &tensors_c.1,
                        &tensors_c.2,
                        &tensors_c.3,
                        &tensors_c.4,
                        &spec,
                        DeltaRuleForm::Auto,
                        &mut segments_c,
                    )
                    .unwrap(),
                )
                .unwrap();
            compare(
                &format!("gated_delta_rule nk {nk} nv {nv} dk {dk} dv {dv} step {step} ({lengths:?} rows)"),
                &out_g,
                &out_c,
                1e-4,
            );
        }
    }
    gpu.synchronize().unwrap();
}

/// Random inputs of one delta-rule step: `(q, k, v, g, beta)` for `total` tokens.
fn delta_rule_inputs(
    rng: &mut Xoshiro256,
    spec: &DeltaRuleSpec,
    total: usize,
) -> [(Vec<f32>, usize); 5] {
    let (nk, nv, dk, dv) = (
        spec.key_heads,
        spec.value_heads,
        spec.key_head_dim,
        spec.value_head_dim,
    );
    let g: Vec<f32> = random(rng, total * nv, 1.0)
        .iter()
        .map(|x| -x.abs() * 0.5)
        .collect();
    let beta: Vec<f32> = random(rng, total * nv, 1.0)
        .iter()
        .map(|x| 0.5 + 0.5 * x)
        .collect();
    [
        (random(rng, total * nk * dk, 1.0), nk * dk),
        (random(rng, total * nk * dk, 1.0), nk * dk),
        (random(rng, total * nv * dv, 1.0), nv * dv),
        (g, nv),
        (beta, nv),
    ]
}

/// One step of the delta rule on `backend` over segments of `lengths` tokens (one state each).
fn delta_rule_step<B: Backend>(
    backend: &B,
    inputs: &[(Vec<f32>, usize); 5],
    spec: &DeltaRuleSpec,
    form: DeltaRuleForm,
    lengths: &[usize],
    states: &mut [B::RecurrentState],
) -> Vec<f32> {
    let total: usize = lengths.iter().sum();
    let tensors: Vec<B::Tensor> = inputs
        .iter()
        .map(|(values, cols)| backend.upload(values, total, *cols).unwrap())
        .collect();
    let mut segments = Segment::consecutive_from_position_zero(states, lengths);
    backend
        .download(
            &backend
                .gated_delta_rule(
                    &tensors[0],
                    &tensors[1],
                    &tensors[2],
                    &tensors[3],
                    &tensors[4],
                    spec,
                    form,
                    &mut segments,
                )
                .unwrap(),
        )
        .unwrap()
}

/// The GPU's chunked kernel (`DeltaRuleForm::Chunked`) against the CPU's recurrent and chunked
/// forms: segments of 1, 63, 64, 65, 200 and 700 tokens (one-token, partial, exact and
/// multi-chunk), four sequences per batch, the second step continuing from the non-zero states
/// the first left, then two decode steps (`Auto`: recurrent) reading the chunked kernel's final
/// states; dk/dv 32..128, nk:nv 1:1 and 1:2. Tolerance 1e-4 of max(1, max |cpu|): the forms
/// differ only by f32 reassociation (~1e-7 measured on the CPU and in an emulation of the
/// kernel). Under `NINFER_REQUIRE_GPU=1` the chunked kernel must also have passed its start-up
/// check (`DeviceInfo::delta_rule_path == "chunked"`).
#[test]
fn chunked_delta_rule_matches_the_cpu_backend_over_lengths_and_head_ratios() {
    let Some(gpu) = gpu("chunked_delta_rule_matches_the_cpu_backend_over_lengths_and_head_ratios")
    else {
        return;
    };
    println!(
        "cuda delta rule path: {} (shared memory per block {} bytes)",
        gpu.info().delta_rule_path,
        gpu.info().shared_memory_per_block
    );
    if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        assert_eq!(
            gpu.info().delta_rule_path,
            "chunked",
            "the chunked delta rule kernel failed its start-up check (see the warning in the log)"
        );
    }
    let cpu = CpuBackend::new();
    let mut rng = Xoshiro256::seed_from_u64(37);
    let specs = [
        (2, 2, 32, 32),
        (1, 2, 64, 48),
        (2, 4, 128, 128),
        (2, 2, 96, 128),
    ];
    let steps: [(&[usize], DeltaRuleForm); 4] = [
        (&[64, 1, 200, 63], DeltaRuleForm::Chunked),
        (&[65, 700, 1, 64], DeltaRuleForm::Chunked),
        (&[1, 1, 1, 1], DeltaRuleForm::Auto),
        (&[1, 1, 1, 1], DeltaRuleForm::Auto),
    ];
    for (nk, nv, dk, dv) in specs {
        let spec = DeltaRuleSpec {
            key_heads: nk,
            value_heads: nv,
            key_head_dim: dk,
            value_head_dim: dv,
        };
        let mut states_g: Vec<_> = (0..4)
            .map(|_| gpu.new_recurrent_state(&spec).unwrap())
            .collect();
        let mut states_recurrent: Vec<_> = (0..4)
            .map(|_| cpu.new_recurrent_state(&spec).unwrap())
            .collect();
        let mut states_chunked: Vec<_> = (0..4)
            .map(|_| cpu.new_recurrent_state(&spec).unwrap())
            .collect();
        for (step, (lengths, form)) in steps.iter().enumerate() {
            let inputs = delta_rule_inputs(&mut rng, &spec, lengths.iter().sum());
            let out_g = delta_rule_step(&*gpu, &inputs, &spec, *form, lengths, &mut states_g);
            let cpu_form = if *form == DeltaRuleForm::Auto {
                DeltaRuleForm::Auto
            } else {
                DeltaRuleForm::Recurrent
            };
            let out_recurrent = delta_rule_step(
                &cpu,
                &inputs,
                &spec,
                cpu_form,
                lengths,
                &mut states_recurrent,
            );
            let out_chunked =
                delta_rule_step(&cpu, &inputs, &spec, *form, lengths, &mut states_chunked);
            let what = format!(
                "delta rule nk {nk} nv {nv} dk {dk} dv {dv} step {step} {lengths:?} ({form:?})"
            );
            compare(
                &format!("{what}: gpu vs cpu recurrent"),
                &out_g,
                &out_recurrent,
                1e-4,
            );
            compare(
                &format!("{what}: gpu vs cpu chunked"),
                &out_g,
                &out_chunked,
                1e-4,
            );
        }
    }
    gpu.synchronize().unwrap();
}

/// Not a check: prefill time of one 4096-token sequence through the chunked and the recurrent
/// kernels at Qwen3.5's shape (nk 16, nv 32, dk = dv = 128), one GDN layer (run by
/// `cuda_ops --ignored --nocapture delta_rule_prefill_figures`).
#[test]
#[ignore = "a figure, not a check; needs a GPU"]
fn delta_rule_prefill_figures() {
    let Some(gpu) = gpu("delta_rule_prefill_figures") else {
        return;
    };
    let spec = DeltaRuleSpec {
        key_heads: 16,
        value_heads: 32,
        key_head_dim: 128,
        value_head_dim: 128,
    };
    let tokens = 4096;
    let mut rng = Xoshiro256::seed_from_u64(53);
    let inputs = delta_rule_inputs(&mut rng, &spec, tokens);
    let tensors: Vec<_> = inputs
        .iter()
        .map(|(values, cols)| gpu.upload(values, tokens, *cols).unwrap())
        .collect();
    let mut times = Vec::new();
    for form in [DeltaRuleForm::Chunked, DeltaRuleForm::Recurrent] {
        let mut state = gpu.new_recurrent_state(&spec).unwrap();
        let run = |state: &mut _| {
            let mut segments = [Segment {
                rows: 0..tokens,
                start_position: 0,
                state,
            }];
            let _ = gpu
                .gated_delta_rule(
                    &tensors[0],
                    &tensors[1],
                    &tensors[2],
                    &tensors[3],
                    &tensors[4],
                    &spec,
                    form,
                    &mut segments,
                )
                .unwrap();
        };
        run(&mut state);
        gpu.synchronize().unwrap();
        let repeats = 3;
        let start = std::time::Instant::now();
        for _ in 0..repeats {
            run(&mut state);
        }
        gpu.synchronize().unwrap();
        let seconds = start.elapsed().as_secs_f64() / repeats as f64;
        times.push(seconds);
        println!(
            "delta rule prefill {tokens} tokens (nk 16, nv 32, dk 128, dv 128), {form:?} form (path {}): {:.3} ms, {:.0} tokens/s per layer",
            gpu.info().delta_rule_path,
            seconds * 1e3,
            tokens as f64 / seconds
        );
    }
    println!(
        "delta rule prefill: chunked is {:.1}× the recurrent kernel's speed",
        times[1] / times[0]
    );
}

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
