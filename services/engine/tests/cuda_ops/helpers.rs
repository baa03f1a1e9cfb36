//! What the files of this suite share: the two CUDA backends (or a printed skip), random
//! inputs, the scaled comparison with the CPU backend, bf16 rounding and the segments of a
//! two-sequence batch.

use std::sync::Arc;

use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::backend::Segment;
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::skip_without_cuda;

/// The exact backend (f32 KV cache, no cuBLAS), or `None` after printing why the test skips.
pub fn gpu(test: &str) -> Option<Arc<CudaBackend>> {
    skip_without_cuda(test, CudaBackend::shared_exact())
}

/// The backend with the default options (what `ninfer-engine --device cuda` runs).
pub fn gpu_default(test: &str) -> Option<Arc<CudaBackend>> {
    skip_without_cuda(test, CudaBackend::shared())
}

pub fn random(rng: &mut Xoshiro256, count: usize, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// max |gpu − cpu| / max(1, max |cpu|), asserted under `tolerance`; NaN fails.
pub fn compare(what: &str, gpu: &[f32], cpu: &[f32], tolerance: f32) {
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

pub fn round_to_bf16(values: &[f32]) -> Vec<f32> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// The batch's segments: sequence 0's `new[0]` rows then sequence 1's, each at its position;
/// a sequence without new rows is left out.
pub fn two_segments<S>(
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
