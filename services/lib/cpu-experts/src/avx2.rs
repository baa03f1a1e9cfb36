//! AVX2 + FMA + F16C row kernels (path `avx2`, the x86-64 baseline).
//!
//! Owns: the 8-lane version of the float path: each group of 32 weights is dequantized once to
//! four ymm of f32 (scale applied) and multiplied with up to 4 tokens' f32 activations. Int4
//! activations are read in nibble order (see `prepare`), so nibbles need no shuffle.

use std::arch::x86_64::*;

use crate::avx512::{float_weight, group_bytes, D_BF16, D_F32, D_INT4, D_INT8};
use crate::layout::{MatrixView, WeightDType, GROUP};
use crate::prepare::InputRows;

/// # Safety
/// As `kernels::matmul_rows`; AVX2, FMA and F16C present.
pub(crate) unsafe fn rows(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
) {
    match matrix.layout.dtype {
        WeightDType::F32 => rows_of::<D_F32>(matrix, first, count, input, out, token_stride),
        WeightDType::Bf16 => rows_of::<D_BF16>(matrix, first, count, input, out, token_stride),
        WeightDType::Int8 => rows_of::<D_INT8>(matrix, first, count, input, out, token_stride),
        WeightDType::Int4 => rows_of::<D_INT4>(matrix, first, count, input, out, token_stride),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_group<const D: u8>(pointer: *const u8, scale: __m256) -> [__m256; 4] {
    match D {
        D_F32 => std::array::from_fn(|i| _mm256_loadu_ps(pointer.add(32 * i).cast())),
        D_BF16 => std::array::from_fn(|i| {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(pointer.add(16 * i).cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }),
        D_INT8 => std::array::from_fn(|i| {
            let wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(pointer.add(8 * i).cast()));
            _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale)
        }),
        _ => {
            let first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(pointer.cast()));
            let second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(pointer.add(8).cast()));
            let mask = _mm256_set1_epi32(0x0f);
            let offset = _mm256_mul_ps(scale, _mm256_set1_ps(-8.0));
            // Nibble order: evens of bytes 0–7, evens of 8–15, odds of 0–7, odds of 8–15.
            let codes = [
                _mm256_and_si256(first, mask),
                _mm256_and_si256(second, mask),
                _mm256_srli_epi32::<4>(first),
                _mm256_srli_epi32::<4>(second),
            ];
            codes.map(|code| _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), scale, offset))
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const D: u8>(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
) {
    for local in 0..count {
        let tokens = input.tokens;
        let mut t0 = 0;
        while tokens - t0 >= 4 {
            row::<D, 4>(
                matrix,
                first + local,
                input,
                t0,
                out.add(t0 * token_stride + local),
                token_stride,
            );
            t0 += 4;
        }
        if tokens - t0 >= 2 {
            row::<D, 2>(
                matrix,
                first + local,
                input,
                t0,
                out.add(t0 * token_stride + local),
                token_stride,
            );
            t0 += 2;
        }
        if tokens - t0 >= 1 {
            row::<D, 1>(
                matrix,
                first + local,
                input,
                t0,
                out.add(t0 * token_stride + local),
                token_stride,
            );
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row<const D: u8, const N: usize>(
    matrix: &MatrixView,
    row: usize,
    input: &InputRows,
    t0: usize,
    out: *mut f32,
    token_stride: usize,
) {
    let cols = matrix.layout.cols;
    let quantized = D == D_INT8 || D == D_INT4;
    // Quantized rows run over every stored group: a last partial group is padded with code 0
    // and its activations are zero-padded (`prepare`), so the padding adds exactly 0.
    let full_groups = if quantized {
        matrix.layout.groups_per_row
    } else {
        cols / GROUP
    };
    let values = matrix.row_values(row);
    let x: [*const f32; N] = std::array::from_fn(|t| {
        if D == D_INT4 {
            input.f32_nibble_row(t0 + t)
        } else {
            input.f32_row(t0 + t)
        }
    });
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for g in 0..full_groups {
        let scale = if quantized {
            _mm256_set1_ps(f16_to_f32(*matrix.row_scales(row).add(g)))
        } else {
            _mm256_set1_ps(1.0)
        };
        let w = load_group::<D>(values.add(g * group_bytes(D)), scale);
        for t in 0..N {
            let xp = x[t].add(g * GROUP);
            // Two accumulators per token: two independent FMA chains hide the latency.
            acc[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), acc[t][1]);
            acc[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), acc[t][1]);
        }
    }
    for (t, lanes) in acc.iter().enumerate() {
        let mut sum = hsum(_mm256_add_ps(lanes[0], lanes[1]));
        if !quantized {
            let natural = input.f32_row(t0 + t);
            for column in full_groups * GROUP..cols {
                sum += float_weight(values, matrix.layout.dtype, column) * *natural.add(column);
            }
        }
        *out.add(t * token_stride) = sum;
    }
}
