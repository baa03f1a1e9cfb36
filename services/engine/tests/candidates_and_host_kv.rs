//! The logit-candidates op against the host computation, and `--host-kv-mib` (KV caches in
//! page-locked host memory) against device KV caches, on every backend.
//!
//! Both run on one shared backend per binary; only `host_kv_gives_the_same_logits` changes its
//! KV placement, which is why it lives in this binary and nowhere else.

use std::sync::Arc;

use ninfer_engine::backend::candidates::{row_candidates, LogitCandidates, MAX_CANDIDATES};
use ninfer_engine::backend::{DeviceKvShare, HostKvRequest};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::spec::MixerKind;
use ninfer_engine::testing::{
    max_abs_difference, write_tiny_model, TinyArchitecture, TinyModelOptions,
};
use ninfer_engine::{test_device, Backend, Model};

fn random_rows(seed: u64, rows: usize, cols: usize) -> Vec<f32> {
    let mut rng = Xoshiro256::seed_from_u64(seed);
    let mut values: Vec<f32> = (0..rows * cols)
        .map(|_| (rng.next_f64() * 40.0 - 20.0) as f32)
        .collect();
    // Ties (equal values: lower id first), −∞ (masked tokens) and ±0 in every row.
    for row in values.chunks_mut(cols) {
        let n = row.len();
        if n > 8 {
            row[n - 1] = row[1];
            row[n / 2] = row[1];
            row[3] = f32::NEG_INFINITY;
            row[4] = 0.0;
            row[5] = -0.0;
        }
    }
    values
}

fn check_row(label: &str, got: &LogitCandidates, expected: &LogitCandidates) {
    assert_eq!(got.vocab, expected.vocab, "{label}");
    assert_eq!(got.top, expected.top, "{label}: top");
    assert_eq!(got.extra, expected.extra, "{label}: extra");
    assert_eq!(got.max, expected.max, "{label}: max");
    let difference = (got.log_sum_exp - expected.log_sum_exp).abs();
    assert!(
        difference <= 1e-5 * expected.log_sum_exp.abs().max(1.0),
        "{label}: log-sum-exp {} vs {}",
        got.log_sum_exp,
        expected.log_sum_exp
    );
}

/// Top-k ids and values, max and extra logits exactly as the host computes them, the
/// log-sum-exp to f32 rounding; for short rows, Qwen3's vocabulary and the largest k.
fn logit_candidates_match_the_host<B: Backend>(backend: Arc<B>) {
    let shapes = [
        (1usize, 97usize, 64usize),
        (4, 40, 64),
        (3, 151_936, 64),
        (2, 5000, MAX_CANDIDATES),
        (5, 300, 7),
    ];
    for (seed, &(rows, cols, k)) in shapes.iter().enumerate() {
        let values = random_rows(seed as u64 + 1, rows, cols);
        let extra: Vec<Vec<u32>> = (0..rows)
            .map(|row| {
                (0..row * 3)
                    .map(|i| ((i * 7919 + row * 31) % cols) as u32)
                    .collect()
            })
            .collect();
        let logits = backend.upload(&values, rows, cols).unwrap();
        let got = backend.logit_candidates(&logits, k, &extra).unwrap();
        assert_eq!(got.len(), rows);
        for (row, got) in got.iter().enumerate() {
            let expected = row_candidates(&values[row * cols..(row + 1) * cols], k, &extra[row]);
            check_row(
                &format!("{} rows {rows}×{cols} k {k} row {row}", backend.name()),
                got,
                &expected,
            );
        }
        println!("{}: {rows}×{cols} k={k} ok", backend.name());
    }
    let logits = backend.upload(&random_rows(9, 2, 50), 2, 50).unwrap();
    assert!(backend
        .logit_candidates(&logits, 0, &[vec![], vec![]])
        .is_err());
    assert!(backend
        .logit_candidates(&logits, MAX_CANDIDATES + 1, &[vec![], vec![]])
        .is_err());
    assert!(backend.logit_candidates(&logits, 8, &[vec![]]).is_err());
    assert!(backend
        .logit_candidates(&logits, 8, &[vec![50], vec![]])
        .is_err());
}
test_device!(logit_candidates_match_the_host);

fn logits_of<B: Backend>(model: &Model<B>, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut state = model.new_sequence(prompt.len() + steps).unwrap();
    let mut out = vec![model.prefill(&mut state, prompt).unwrap()];
    for step in 0..steps {
        let next = (step as u32 * 13 + 5) % model.vocab_size() as u32;
        out.push(model.prefill(&mut state, &[next]).unwrap());
    }
    out
}

/// A tiny model's logits (prefill, then decode steps) with every attention layer's KV cache in
/// the host pool, and with the first layer on the GPU and the rest in the pool, equal those with
/// every cache on the GPU; the placement is visible in `kv_placement`. On the CPU backend the
/// request is ignored.
fn host_kv_gives_the_same_logits<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let no_pool = HostKvRequest {
        host_bytes: 0,
        device_share: DeviceKvShare::Bytes(0),
    };
    for architecture in [TinyArchitecture::Qwen3Moe, TinyArchitecture::Qwen3Next] {
        let path = directory.path().join(format!("{architecture:?}.ninfer"));
        write_tiny_model(&path, TinyModelOptions::new(architecture)).unwrap();
        let model = Model::open(Arc::clone(&backend), &path).unwrap();
        let attention_layers = model
            .spec()
            .mixers
            .iter()
            .filter(|m| **m == MixerKind::Attention)
            .count();
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 31 + 7) % 97).collect();
        backend.reserve_host_kv(&no_pool).unwrap();
        let expected = logits_of(&model, &prompt, 6);
        let context = prompt.len() + 6;

        // Every cache in the host pool, then the first on the GPU and the rest in the pool.
        let one_cache_bytes = {
            backend
                .reserve_host_kv(&HostKvRequest {
                    host_bytes: 64 << 20,
                    device_share: DeviceKvShare::Bytes(u64::MAX),
                })
                .unwrap();
            let state = model.new_sequence(context).unwrap();
            let placement = backend.kv_placement();
            drop(state);
            placement.map(|p| p.device_bytes / p.device_caches.max(1) as u64)
        };
        for (label, share, host_layers) in [
            ("all host", 0u64, attention_layers),
            (
                "first on the GPU",
                one_cache_bytes.unwrap_or(0),
                attention_layers - 1,
            ),
        ] {
            backend
                .reserve_host_kv(&HostKvRequest {
                    host_bytes: 64 << 20,
                    device_share: DeviceKvShare::Bytes(share),
                })
                .unwrap();
            let mut state = model.new_sequence(context).unwrap();
            match backend.kv_placement() {
                Some(placement) => {
                    println!("{architecture:?} {label}: {placement:?}");
                    assert_eq!(placement.host_caches, host_layers, "{label}");
                    assert_eq!(
                        placement.device_caches,
                        attention_layers - host_layers,
                        "{label}"
                    );
                }
                None => println!(
                    "{}: no host KV pool (KV caches already in host memory)",
                    backend.name()
                ),
            }
            let mut got = vec![model.prefill(&mut state, &prompt).unwrap()];
            for step in 0..6 {
                let next = (step as u32 * 13 + 5) % model.vocab_size() as u32;
                got.push(model.prefill(&mut state, &[next]).unwrap());
            }
            drop(state);
            for (step, (got, expected)) in got.iter().zip(&expected).enumerate() {
                let scale = expected.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                let difference = max_abs_difference(got, expected);
                assert!(
                    difference <= 1e-6 * scale,
                    "{architecture:?} {label} step {step}: max |Δlogit| {difference}"
                );
            }
            if let Some(placement) = backend.kv_placement() {
                assert_eq!(
                    placement.host_caches + placement.device_caches,
                    0,
                    "caches dropped"
                );
            }
        }
        backend.reserve_host_kv(&no_pool).unwrap();
    }
}
test_device!(host_kv_gives_the_same_logits);
