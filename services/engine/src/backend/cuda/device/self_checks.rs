//! The cuBLAS start-up check: cuBLAS is used for prefill GEMMs only once it computes what the
//! matmul kernel computes on two test shapes. (The flash attention and chunked delta rule
//! checks live beside their launches, in `attention.rs` and `delta_rule.rs`.)
//!
//! Owns: the decision to keep cuBLAS, and its test shapes and tolerance.
//! Must not touch: the GEMM launches themselves (`matmul.rs`).

use super::super::cublas::Cublas;
use super::super::CudaError;
use super::matmul::CUBLAS_MIN_ROWS;
use super::{driver_error, CudaBackend, CudaTensor, CudaWeight, WeightData};

impl CudaBackend {
    /// cuBLAS if it loads and computes what the matmul kernel computes (to bf16 rounding of the
    /// activations) on two test shapes; otherwise `None`, with the reason logged: the kernel
    /// then does every matmul for the life of the process.
    pub(super) fn start_cublas(&self) -> Option<Cublas> {
        let cublas = match Cublas::load(&self.stream) {
            Ok(cublas) => cublas,
            Err(error @ CudaError::LibraryNotFound { .. }) => {
                tracing::info!("cuBLAS not found, the matmul kernel does every GEMM: {error}");
                return None;
            }
            Err(error) => {
                tracing::warn!("cuBLAS unusable, the matmul kernel does every GEMM: {error}");
                return None;
            }
        };
        match self.check_cublas(&cublas) {
            Ok(worst) => {
                tracing::info!(
                    cublas = %cublas.describe(),
                    "cuBLAS passed its start-up check (max |Δ| / scale {worst:.1e} vs the kernel); bf16 GEMMs of {CUBLAS_MIN_ROWS}+ rows use it"
                );
                Some(cublas)
            }
            Err(error) => {
                tracing::warn!(
                    cublas = %cublas.describe(),
                    "cuBLAS failed its start-up check, the matmul kernel does every GEMM: {error}"
                );
                // A failed check may have left an error on the stream: drain it.
                let _ = self.stream.synchronize();
                None
            }
        }
    }

    /// Odd (37×300 · 300×129: no tensor-core alignment) and aligned (64×256 · 256×160) bf16
    /// GEMMs through cuBLAS and through the kernel; the largest difference relative to the
    /// largest result must stay under 1e-2 (the activations' bf16 rounding gives ~1e-3).
    pub(super) fn check_cublas(&self, cublas: &Cublas) -> Result<f32, CudaError> {
        let mut next = self_check_values(0x9e37_79b9_7f4a_7c15);
        let mut worst = 0.0f32;
        for (n, k, m) in [(37usize, 300usize, 129usize), (64, 256, 160)] {
            let x: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let w: Vec<u16> = (0..m * k)
                .map(|_| half::bf16::from_f32(next()).to_bits())
                .collect();
            let tensor = CudaTensor::unpooled(n, k, self.upload_f32(&x)?);
            let w_data = self
                .stream
                .memcpy_stod(&w)
                .map_err(driver_error("copying the cuBLAS check's weight"))?;
            let got = self.matmul_cublas(cublas, &tensor, &w_data, m)?;
            let weight = CudaWeight {
                rows: m,
                cols: k,
                data: WeightData::Bf16(w_data),
            };
            let expected = self.matmul_kernel(&tensor, &weight)?;
            let read = |t: &CudaTensor| {
                self.stream
                    .memcpy_dtov(&*t.data)
                    .map_err(driver_error("reading the cuBLAS check back"))
            };
            let (expected, got) = (read(&expected)?, read(&got)?);
            let scale = expected.iter().fold(1.0f32, |a, v| a.max(v.abs()));
            let difference = expected
                .iter()
                .zip(&got)
                .take(n * m)
                .map(|(a, b)| (a - b).abs())
                .fold(
                    0.0f32,
                    |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) },
                )
                / scale;
            if difference.is_nan() || difference > 1e-2 {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "{n}×{k} · ({m}×{k})ᵀ differs from the kernel by {difference:.2e} of the largest value (allowed 1e-2)"
                    ),
                });
            }
            worst = worst.max(difference);
        }
        Ok(worst)
    }
}

/// Deterministic values in [-1, 1) for the start-up self-checks (xorshift64* from `seed`).
pub(super) fn self_check_values(mut state: u64) -> impl FnMut() -> f32 {
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let bits = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }
}
