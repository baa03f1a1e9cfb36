//! The gated delta rule against the CPU backend: a prefill then decode steps continuing from the
//! states, and the chunked kernel over lengths and head ratios; with the prefill-time figures.

use ninfer_engine::backend::{DeltaRuleForm, DeltaRuleSpec, Segment};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::{Backend, CpuBackend};

use crate::helpers::{compare, gpu, random};

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
