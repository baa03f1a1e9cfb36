//! On every backend: the hyper-connection ops and the PLE gate against host loops, and the
//! sigmoid-gated Gated DeltaNet output norm as backend ops against the host function.

use std::sync::Arc;

use ninfer_artifact::Artifact;
use ninfer_engine::backend::NormStyle;
use ninfer_engine::model::qwen4_exp::graph::{
    sigmoid_gated_rms_norm, sigmoid_gated_rms_norm_by_ops,
};
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{golden_fixture_dir, max_abs_difference};
use ninfer_engine::{open_artifact, test_device, Backend};

use crate::helpers::random_values;
use crate::support;

/// The qwen4_exp fixture converted with f32 weights (the directory it lives in goes with it).
fn converted_fixture() -> (tempfile::TempDir, Arc<Artifact>) {
    let fixture = golden_fixture_dir("qwen4_exp");
    let work = tempfile::tempdir().unwrap();
    let path = work.path().join("qwen4_exp-f32.ninfer");
    support::convert_f32(fixture, &path);
    let artifact = open_artifact(&path).unwrap();
    (work, artifact)
}

fn host_sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Asserts `got` is within `1e-5` of `expected`, relative to the largest expected value.
fn assert_close(what: &str, backend: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let scale = expected.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let worst = max_abs_difference(got, expected);
    println!("{what} on {backend}: max |Δ| = {worst:.3e} of max |value| {scale:.3}");
    assert!(
        worst / scale < 1e-5,
        "{what} on {backend}: differs by {worst}"
    );
}

/// The hyper-connection ops (the streams' grouped norm with a weight per stream, the scaled
/// SiLU, the stream mix, the injection into the streams, the reshape that makes them) against plain host loops written
/// here from the model's formulas, with the fixture's own mixer norm weight (three streams of
/// 64) over random values; rows in odd numbers so no launch shape divides them evenly.
fn hyper_connection_ops_match_host_loops<B: Backend>(backend: Arc<B>) {
    let (_work, artifact) = converted_fixture();
    let name = "layers.0.attn_hc.norm";
    let host_weight = artifact.get(name).expect("the mixer norm").to_f32_vec();
    let weight = backend.load_parameter(&artifact, name).unwrap();
    let (rows, streams, eps) = (5, 3, 1e-6f32);
    let width = host_weight.len();
    let hidden = width / streams;
    let scale = 1.0 / streams as f32;
    let on = backend.name();
    let mut rng = Xoshiro256::seed_from_u64(17);
    let x = random_values(&mut rng, rows * width, 2.0);

    let mut expected = Vec::with_capacity(x.len());
    for row in x.chunks_exact(width) {
        for (stream, features) in row.chunks_exact(hidden).enumerate() {
            let mean_square = features.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
            let inverse = 1.0 / (mean_square + eps).sqrt();
            let weights = &host_weight[stream * hidden..(stream + 1) * hidden];
            expected.extend(
                features
                    .iter()
                    .zip(weights)
                    .map(|(v, w)| v * inverse * (1.0 + w)),
            );
        }
    }
    let x_tensor = backend.upload(&x, rows, width).unwrap();
    let normed = backend
        .row_weighted_rms_norm(&x_tensor, &weight, hidden, eps, NormStyle::ZeroCentred)
        .unwrap();
    assert_eq!(backend.shape(&normed), (rows, width));
    assert_close(
        "row_weighted_rms_norm",
        &on,
        &backend.download(&normed).unwrap(),
        &expected,
    );
    assert!(backend
        .row_weighted_rms_norm(&x_tensor, &weight, 7, eps, NormStyle::ZeroCentred)
        .is_err());

    let expected: Vec<f32> = x
        .iter()
        .map(|v| {
            let s = v * scale;
            s / (1.0 + (-s).exp())
        })
        .collect();
    let silu = backend.scaled_silu(&x_tensor, scale).unwrap();
    assert_close(
        "scaled_silu",
        &on,
        &backend.download(&silu).unwrap(),
        &expected,
    );

    let gate = random_values(&mut rng, rows * width, 3.0);
    let mut expected = vec![0.0f32; rows * hidden];
    for row in 0..rows {
        for stream in 0..streams {
            for i in 0..hidden {
                let at = row * width + stream * hidden + i;
                expected[row * hidden + i] += host_sigmoid(gate[at]) * x[at];
            }
        }
    }
    expected.iter_mut().for_each(|v| *v *= scale);
    let gate_tensor = backend.upload(&gate, rows, width).unwrap();
    let mixed = backend
        .stream_mix(&x_tensor, &gate_tensor, streams, scale)
        .unwrap();
    assert_eq!(backend.shape(&mixed), (rows, hidden));
    assert_close(
        "stream_mix",
        &on,
        &backend.download(&mixed).unwrap(),
        &expected,
    );

    let output = random_values(&mut rng, rows * hidden, 1.5);
    let shares = random_values(&mut rng, rows * streams, 4.0);
    let mut expected = x.clone();
    for row in 0..rows {
        for stream in 0..streams {
            let share = 2.0 * host_sigmoid(shares[row * streams + stream] * scale);
            for i in 0..hidden {
                expected[row * width + stream * hidden + i] += share * output[row * hidden + i];
            }
        }
    }
    let mut streams_tensor = backend.upload(&x, rows, width).unwrap();
    backend
        .inject_into_streams(
            &mut streams_tensor,
            &backend.upload(&output, rows, hidden).unwrap(),
            &backend.upload(&shares, rows, streams).unwrap(),
            scale,
        )
        .unwrap();
    assert_close(
        "inject_into_streams",
        &on,
        &backend.download(&streams_tensor).unwrap(),
        &expected,
    );

    // The streams are made as `[rows·n, H]` and read as `[rows, n·H]`.
    let reshaped = backend
        .reshape(
            backend.upload(&x, rows * streams, hidden).unwrap(),
            rows,
            width,
        )
        .unwrap();
    assert_eq!(backend.shape(&reshaped), (rows, width));
    assert_eq!(backend.download(&reshaped).unwrap(), x);
    assert!(backend
        .reshape(backend.upload(&x, rows, width).unwrap(), rows, hidden)
        .is_err());
}
test_device!(hyper_connection_ops_match_host_loops);

/// The PLE gate op against a host loop of the model's formula, on random keys, queries and
/// values of three streams, one row's keys zero (torch's sign(0) = 0: a gate of exactly 1/2)
/// and one row's dot products tiny (the `1e-6` floor under the square root).
fn ple_gate_matches_the_host_loop<B: Backend>(backend: Arc<B>) {
    let (rows, streams, hidden) = (6, 3, 40);
    let width = streams * hidden;
    let scale = 1.0 / (hidden as f32).sqrt();
    let mut rng = Xoshiro256::seed_from_u64(23);
    let mut keys = random_values(&mut rng, rows * width, 1.5);
    let queries = random_values(&mut rng, rows * width, 1.5);
    let values = random_values(&mut rng, rows * hidden, 2.0);
    keys[..width].iter_mut().for_each(|k| *k = 0.0);
    keys[width..2 * width].iter_mut().for_each(|k| *k *= 1e-6);
    let mut expected = Vec::with_capacity(rows * width);
    for row in 0..rows {
        for stream in 0..streams {
            let base = row * width + stream * hidden;
            let dot = (0..hidden)
                .map(|i| keys[base + i] * queries[base + i])
                .sum::<f32>()
                * scale;
            let signed_root = if dot == 0.0 {
                0.0
            } else {
                dot.signum() * dot.abs().max(1e-6).sqrt()
            };
            let gate = host_sigmoid(signed_root);
            expected.extend((0..hidden).map(|i| gate * values[row * hidden + i]));
        }
    }
    let gated = backend
        .ple_gate(
            &backend.upload(&keys, rows, width).unwrap(),
            &backend.upload(&queries, rows, width).unwrap(),
            &backend.upload(&values, rows, hidden).unwrap(),
            streams,
            scale,
        )
        .unwrap();
    assert_eq!(backend.shape(&gated), (rows, width));
    let got = backend.download(&gated).unwrap();
    assert_close("ple_gate", &backend.name(), &got, &expected);
    // The zero row's gate is exactly one half.
    for (got, value) in got[..hidden].iter().zip(&values[..hidden]) {
        assert_eq!(*got, 0.5 * value);
    }
}
test_device!(ple_gate_matches_the_host_loop);

/// The sigmoid-gated Gated DeltaNet output norm as a device backend computes it (a plain-weight
/// norm per value head, then a sigmoid gate, as two backend ops) against the host function the
/// CPU backend uses, with the fixture's own norm weight over random activations.
fn sigmoid_gated_norm_by_ops_matches_the_host_function<B: Backend>(backend: Arc<B>) {
    let (_work, artifact) = converted_fixture();
    // Layer 0 is a Gated DeltaNet layer in the fixture; its norm is one value head wide.
    let name = "layers.0.gdn.norm";
    let host_weight = artifact.get(name).expect("the norm weight").to_f32_vec();
    let weight = backend.load_parameter(&artifact, name).unwrap();
    let (rows, value_heads, eps) = (7, 4, 1e-6f32);
    let width = value_heads * host_weight.len();
    let mut rng = Xoshiro256::seed_from_u64(91);
    let x = random_values(&mut rng, rows * width, 3.0);
    let gate = random_values(&mut rng, rows * width, 4.0);
    let expected = sigmoid_gated_rms_norm(&x, &gate, &host_weight, eps);
    let by_ops = sigmoid_gated_rms_norm_by_ops(
        &*backend,
        &backend.upload(&x, rows, width).unwrap(),
        &backend.upload(&gate, rows, width).unwrap(),
        &weight,
        eps,
    )
    .unwrap();
    assert_eq!(backend.shape(&by_ops), (rows, width));
    let got = backend.download(&by_ops).unwrap();
    let scale = expected.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let worst = max_abs_difference(&got, &expected);
    println!(
        "sigmoid-gated norm on {}: max |Δ| = {worst:.3e} of max |value| {scale:.3}",
        backend.name()
    );
    assert!(worst / scale < 1e-5, "the two forms differ by {worst}");
}
test_device!(sigmoid_gated_norm_by_ops_matches_the_host_function);
