//! The element-wise, norm, matmul, embedding, routing and conv ops, and the fused ops, on the
//! weights of a tiny qwen3.5-MoE model against the CPU backend.

use ninfer_engine::backend::{NormStyle, Rotation};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};
use ninfer_engine::{open_artifact, Backend, CpuBackend};

use crate::helpers::{compare, gpu, random, two_segments};

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
