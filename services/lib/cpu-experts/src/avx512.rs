//! AVX-512 row kernels.
//!
//! Owns two families:
//! - `rows_float` (path `avx512`): each group of 32 weights is dequantized once to two zmm of
//!   f32 (scale applied) and multiplied with up to 8 tokens' f32 activations (FMA). Int4
//!   activations are read in nibble order so a loaded byte splits into its two nibbles without
//!   a shuffle.
//! - `rows_vnni` (path `avx512-vnni`): int8 / int4 weights against activations quantized to
//!   int8 per group of 32, two groups per `vpdpbusd`; bf16 weights with `vdpbf16ps` against
//!   bf16 activations; f32 weights fall back to `rows_float`.
//!
//! Per-group scales are applied in f32 after each integer dot product (lanes 0–7 of a zmm hold
//! group 2b, lanes 8–15 group 2b+1), so nothing needs a horizontal sum before the row's end.
//! Every function here requires the features in its `target_feature`; callers check with
//! `KernelIsa::is_supported` first.

use std::arch::x86_64::*;

use half::bf16;

use crate::kernel_shared::{prefetch_line, prefetch_row_scales};
use crate::layout::{MatrixView, WeightDType, GROUP};
use crate::prepare::InputRows;
use crate::tuning::Prefetch;

pub(crate) const D_F32: u8 = 0;
pub(crate) const D_BF16: u8 = 1;
pub(crate) const D_INT8: u8 = 2;
pub(crate) const D_INT4: u8 = 3;

/// Bytes of one group of 32 weights.
pub(crate) const fn group_bytes(dtype: u8) -> usize {
    match dtype {
        D_F32 => 128,
        D_BF16 => 64,
        D_INT8 => 32,
        _ => 16,
    }
}

/// Mask of the first `count` (≤ 16) lanes.
#[inline]
fn lane_mask(count: usize) -> u16 {
    if count >= 16 {
        u16::MAX
    } else {
        ((1u32 << count) - 1) as u16
    }
}

/// Up to 16 f16 scales starting at `scales`, as f32 (lanes past `count` are 0).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(crate) unsafe fn load_scales(scales: *const u16, count: usize) -> __m512 {
    // Masked-off lanes are not read, so the last row's scales never read past the matrix.
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(count), scales.cast()))
}

/// One group of 32 weights as two zmm of f32, times `scale` for int8 / int4. Int4 comes out in
/// nibble order (evens, then odds).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) unsafe fn load_group<const D: u8>(
    pointer: *const u8,
    scale: __m512,
) -> (__m512, __m512) {
    match D {
        D_F32 => (
            _mm512_loadu_ps(pointer.cast()),
            _mm512_loadu_ps(pointer.add(64).cast()),
        ),
        D_BF16 => {
            let low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(pointer.cast()));
            let high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(pointer.add(32).cast()));
            (
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(low)),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(high)),
            )
        }
        D_INT8 => {
            let low = _mm512_cvtepi8_epi32(_mm_loadu_si128(pointer.cast()));
            let high = _mm512_cvtepi8_epi32(_mm_loadu_si128(pointer.add(16).cast()));
            (
                _mm512_mul_ps(_mm512_cvtepi32_ps(low), scale),
                _mm512_mul_ps(_mm512_cvtepi32_ps(high), scale),
            )
        }
        _ => {
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(pointer.cast()));
            let even = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
            let odd = _mm512_srli_epi32::<4>(bytes);
            // (code − 8) · scale = code · scale − 8 · scale: one FMA.
            let offset = _mm512_mul_ps(scale, _mm512_set1_ps(-8.0));
            (
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), scale, offset),
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), scale, offset),
            )
        }
    }
}

/// Weight `column` of a float-typed row (the tail past the last full group).
#[inline]
pub(crate) unsafe fn float_weight(values: *const u8, dtype: WeightDType, column: usize) -> f32 {
    match dtype {
        WeightDType::F32 => f32::from_le_bytes(*values.add(column * 4).cast::<[u8; 4]>()),
        _ => bf16::from_le_bytes(*values.add(column * 2).cast::<[u8; 2]>()).to_f32(),
    }
}

/// Calls `$kernel::<.., N>` for token blocks of 8, 4, 2, 1.
macro_rules! token_blocks {
    ($input:expr, |$t0:ident, $n:ident| $body:expr) => {{
        let tokens = $input.tokens;
        let mut $t0 = 0usize;
        while tokens - $t0 >= 8 {
            {
                const $n: usize = 8;
                $body;
            }
            $t0 += 8;
        }
        if tokens - $t0 >= 4 {
            {
                const $n: usize = 4;
                $body;
            }
            $t0 += 4;
        }
        if tokens - $t0 >= 2 {
            {
                const $n: usize = 2;
                $body;
            }
            $t0 += 2;
        }
        if tokens - $t0 >= 1 {
            {
                const $n: usize = 1;
                $body;
            }
        }
    }};
}

/// Path `avx512`: see the module doc.
///
/// # Safety
/// As `kernels::matmul_rows`; AVX-512F/BW/VL, FMA and F16C present.
pub(crate) unsafe fn rows_float(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    match matrix.layout.dtype {
        WeightDType::F32 => {
            float_rows::<D_F32>(matrix, first, count, input, out, token_stride, prefetch)
        }
        WeightDType::Bf16 => {
            float_rows::<D_BF16>(matrix, first, count, input, out, token_stride, prefetch)
        }
        WeightDType::Int8 => {
            float_rows::<D_INT8>(matrix, first, count, input, out, token_stride, prefetch)
        }
        WeightDType::Int4 => {
            float_rows::<D_INT4>(matrix, first, count, input, out, token_stride, prefetch)
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn float_rows<const D: u8>(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    for local in 0..count {
        token_blocks!(input, |t0, N| float_row::<D, N>(
            matrix,
            first + local,
            input,
            t0,
            out.add(t0 * token_stride + local),
            token_stride,
            prefetch
        ));
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn float_row<const D: u8, const N: usize>(
    matrix: &MatrixView,
    row: usize,
    input: &InputRows,
    t0: usize,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
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
    let mut acc = [[_mm512_setzero_ps(); 2]; N];
    let mut scales = [1.0f32; 16];
    let into_l2 = prefetch.into_l2;
    let prefetch = prefetch.distance_bytes;
    if quantized {
        prefetch_row_scales(matrix, row, prefetch, into_l2);
    }
    let mut group = 0;
    while group < full_groups {
        let chunk = (full_groups - group).min(16);
        if quantized {
            _mm512_storeu_ps(
                scales.as_mut_ptr(),
                load_scales(matrix.row_scales(row).add(group), chunk),
            );
        }
        for (j, &scale) in scales.iter().enumerate().take(chunk) {
            let g = group + j;
            if prefetch > 0 {
                prefetch_line(values.wrapping_add(g * group_bytes(D) + prefetch), into_l2);
            }
            let (w0, w1) = load_group::<D>(values.add(g * group_bytes(D)), _mm512_set1_ps(scale));
            for t in 0..N {
                let xp = x[t].add(g * GROUP);
                acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc[t][0]);
                acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp.add(16)), acc[t][1]);
            }
        }
        group += chunk;
    }
    for (t, lanes) in acc.iter().enumerate() {
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(lanes[0], lanes[1]));
        if !quantized {
            let natural = input.f32_row(t0 + t);
            for column in full_groups * GROUP..cols {
                sum += float_weight(values, matrix.layout.dtype, column) * *natural.add(column);
            }
        }
        *out.add(t * token_stride) = sum;
    }
}

/// Path `avx512-vnni`: see the module doc.
///
/// # Safety
/// As `kernels::matmul_rows`; AVX-512F/BW/VL/VNNI/BF16, FMA and F16C present.
pub(crate) unsafe fn rows_vnni(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    match matrix.layout.dtype {
        WeightDType::F32 => {
            float_rows::<D_F32>(matrix, first, count, input, out, token_stride, prefetch)
        }
        WeightDType::Bf16 => bf16_rows(matrix, first, count, input, out, token_stride, prefetch),
        WeightDType::Int8 => {
            int_rows::<false>(matrix, first, count, input, out, token_stride, prefetch)
        }
        WeightDType::Int4 => {
            int_rows::<true>(matrix, first, count, input, out, token_stride, prefetch)
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn int_rows<const INT4: bool>(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    for local in 0..count {
        if INT4 {
            token_blocks!(input, |t0, N| int4_row::<N>(
                matrix,
                first + local,
                input,
                t0,
                out.add(t0 * token_stride + local),
                token_stride,
                prefetch
            ));
        } else {
            token_blocks!(input, |t0, N| int8_row::<N>(
                matrix,
                first + local,
                input,
                t0,
                out.add(t0 * token_stride + local),
                token_stride,
                prefetch
            ));
        }
    }
}

/// Int4 × int8 rows, four groups (64 weight bytes) per step: the low nibbles of all 64 bytes
/// meet the activations' even elements and the high nibbles the odd ones in two `vpdpbusd`
/// into one accumulator whose lanes 4k..4k+4 belong to group k, so one convert and one FMA
/// apply the scales of 128 weights.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn int4_row<const N: usize>(
    matrix: &MatrixView,
    row: usize,
    input: &InputRows,
    t0: usize,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    let groups = matrix.layout.groups_per_row;
    let blocks = groups.div_ceil(4);
    let values = matrix.row_values(row);
    let scales = matrix.row_scales(row);
    let zero = _mm512_setzero_si512();
    let low_nibbles = _mm512_set1_epi8(0x0f);
    let quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let scale_index: [__m512i; 4] =
        std::array::from_fn(|j| _mm512_add_epi32(quad, _mm512_set1_epi32(4 * j as i32)));
    let x_bytes: [*const u8; N] = std::array::from_fn(|t| input.int8_row(t0 + t));
    let x_scales: [*const f32; N] = std::array::from_fn(|t| input.lane_scale_row(t0 + t));
    let x_offsets: [*const f32; N] = std::array::from_fn(|t| input.group_offset_row(t0 + t));
    let mut acc = [_mm512_setzero_ps(); N];
    let mut offset_acc = [_mm512_setzero_ps(); N];
    let into_l2 = prefetch.into_l2;
    let prefetch = prefetch.distance_bytes;
    prefetch_row_scales(matrix, row, prefetch, into_l2);
    let mut block = 0;
    while block < blocks {
        let chunk = (blocks - block).min(4);
        let chunk_groups = (groups - 4 * block).min(16);
        let chunk_scales = load_scales(scales.add(4 * block), chunk_groups);
        for t in 0..N {
            // Σ_g scale_w · (−8 · scale_x · Σx): the +8 of every nibble, 16 groups per FMA.
            let offsets =
                _mm512_maskz_loadu_ps(lane_mask(chunk_groups), x_offsets[t].add(4 * block));
            offset_acc[t] = _mm512_fmadd_ps(chunk_scales, offsets, offset_acc[t]);
        }
        for (j, index) in scale_index.iter().enumerate().take(chunk) {
            let b = block + j;
            if prefetch > 0 {
                // Addresses past the matrix end are harmless: prefetches never fault.
                prefetch_line(values.wrapping_add(b * 64 + prefetch), into_l2);
            }
            let remaining = groups - 4 * b;
            let bytes = if remaining >= 4 {
                _mm512_loadu_si512(values.add(b * 64).cast())
            } else {
                // Masked-off bytes are neither read nor used: they load as zero weights.
                _mm512_maskz_loadu_epi8((1u64 << (remaining * 16)) - 1, values.add(b * 64).cast())
            };
            let low = _mm512_and_si512(bytes, low_nibbles);
            let high = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low_nibbles);
            let weight_scale = _mm512_permutexvar_ps(*index, chunk_scales);
            for t in 0..N {
                let x = x_bytes[t].add(b * 128);
                let dot = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(zero, low, _mm512_loadu_si512(x.cast())),
                    high,
                    _mm512_loadu_si512(x.add(64).cast()),
                );
                let scale = _mm512_mul_ps(weight_scale, _mm512_loadu_ps(x_scales[t].add(b * 16)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
            }
        }
        block += chunk;
    }
    for t in 0..N {
        *out.add(t * token_stride) = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], offset_acc[t]));
    }
}

/// `R` int4 rows against one token in one pass (decode): the rows are `R` independent weight
/// streams sharing every activation load, which multiplies the misses in flight per core and
/// divides the per-row overhead. The dispatch passes `R` = 2: a gate row and its up row, or
/// two 8-row halves of a `down` block (4 and 8 rows per pass measured no faster).
///
/// Decode at int4 is bound by instructions per weight byte on a busy core, so the inner step is
/// kept short: the weight × activation scales are multiplied once per 16 groups (compact
/// `group_scale`) and only permuted per block, and with GFNI the high nibbles take one affine
/// byte shift instead of a word shift and a mask.
///
/// # Safety
/// As `kernels::matmul_rows` for every row, with exactly one token; AVX-512 VNNI present.
pub(crate) unsafe fn int4_rows_one_token<const R: usize>(
    matrix: &MatrixView,
    rows: [usize; R],
    input: &InputRows,
    outs: [*mut f32; R],
    prefetch: Prefetch,
) {
    if std::arch::is_x86_feature_detected!("gfni") {
        int4_rows_one_token_gfni::<R>(matrix, rows, input, outs, prefetch)
    } else {
        int4_rows_one_token_shift::<R>(matrix, rows, input, outs, prefetch)
    }
}

/// The body of [`int4_rows_one_token`], with `$high` turning a zmm of weight bytes into their
/// high nibbles (one function per instruction set, each with its own `target_feature`).
macro_rules! int4_rows_one_token_body {
    ($matrix:ident, $rows:ident, $input:ident, $outs:ident, $prefetch:ident, $R:ident, |$bytes:ident| $high:expr) => {{
        let groups = $matrix.layout.groups_per_row;
        let blocks = groups.div_ceil(4);
        let values: [*const u8; $R] = std::array::from_fn(|r| $matrix.row_values($rows[r]));
        let scales: [*const u16; $R] = std::array::from_fn(|r| $matrix.row_scales($rows[r]));
        let zero = _mm512_setzero_si512();
        let low_nibbles = _mm512_set1_epi8(0x0f);
        let quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        let scale_index: [__m512i; 4] =
            std::array::from_fn(|j| _mm512_add_epi32(quad, _mm512_set1_epi32(4 * j as i32)));
        let x_bytes = $input.int8_row(0);
        let x_group_scales = $input.group_scale_row(0);
        let x_offsets = $input.group_offset_row(0);
        // The nibbles' offset terms go into the same accumulators: everything is summed.
        let mut acc = [_mm512_setzero_ps(); $R];
        let into_l2 = $prefetch.into_l2;
        let prefetch = $prefetch.distance_bytes;
        for &row in &$rows {
            prefetch_row_scales($matrix, row, prefetch, into_l2);
        }
        let mut block = 0;
        while block < blocks {
            let chunk = (blocks - block).min(4);
            let chunk_groups = (groups - 4 * block).min(16);
            let mask = lane_mask(chunk_groups);
            let offsets = _mm512_maskz_loadu_ps(mask, x_offsets.add(4 * block));
            let x_scales = _mm512_maskz_loadu_ps(mask, x_group_scales.add(4 * block));
            // Per row, the 16 groups' weight scale × activation scale, in one multiply.
            let chunk_scales: [__m512; $R] = std::array::from_fn(|r| {
                let row_scales = load_scales(scales[r].add(4 * block), chunk_groups);
                acc[r] = _mm512_fmadd_ps(row_scales, offsets, acc[r]);
                _mm512_mul_ps(row_scales, x_scales)
            });
            for (j, index) in scale_index.iter().enumerate().take(chunk) {
                let b = block + j;
                let remaining = groups - 4 * b;
                let x = x_bytes.add(b * 128);
                let x_even = _mm512_loadu_si512(x.cast());
                let x_odd = _mm512_loadu_si512(x.add(64).cast());
                for r in 0..$R {
                    if prefetch > 0 {
                        // Addresses past the matrix end are harmless: prefetches never fault.
                        prefetch_line(values[r].wrapping_add(b * 64 + prefetch), into_l2);
                    }
                    let $bytes = if remaining >= 4 {
                        _mm512_loadu_si512(values[r].add(b * 64).cast())
                    } else {
                        _mm512_maskz_loadu_epi8(
                            (1u64 << (remaining * 16)) - 1,
                            values[r].add(b * 64).cast(),
                        )
                    };
                    let low = _mm512_and_si512($bytes, low_nibbles);
                    let high = $high;
                    let dot =
                        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, x_even), high, x_odd);
                    let scale = _mm512_permutexvar_ps(*index, chunk_scales[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
                }
            }
            block += chunk;
        }
        let sums = sum_each::<$R>(&acc);
        for r in 0..$R {
            *$outs[r] = sums[r];
        }
    }};
}

/// The horizontal sum of each of `R` zmm.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn sum_each<const R: usize>(acc: &[__m512; R]) -> [f32; R] {
    let mut sums = [0.0f32; R];
    for (sum, &value) in sums.iter_mut().zip(acc) {
        *sum = _mm512_reduce_add_ps(value);
    }
    sums
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn int4_rows_one_token_shift<const R: usize>(
    matrix: &MatrixView,
    rows: [usize; R],
    input: &InputRows,
    outs: [*mut f32; R],
    prefetch: Prefetch,
) {
    int4_rows_one_token_body!(matrix, rows, input, outs, prefetch, R, |bytes| {
        _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), _mm512_set1_epi8(0x0f))
    })
}

/// GF(2⁸) affine matrix whose product with a byte is the byte shifted right by 4: output bit
/// `i` (matrix byte `7 − i`) takes input bit `i + 4` for `i < 4`, nothing above.
const SHIFT_RIGHT_4_AFFINE: i64 = 0x1020_4080_0000_0000;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,gfni")]
unsafe fn int4_rows_one_token_gfni<const R: usize>(
    matrix: &MatrixView,
    rows: [usize; R],
    input: &InputRows,
    outs: [*mut f32; R],
    prefetch: Prefetch,
) {
    int4_rows_one_token_body!(matrix, rows, input, outs, prefetch, R, |bytes| {
        _mm512_gf2p8affine_epi64_epi8::<0>(bytes, _mm512_set1_epi64(SHIFT_RIGHT_4_AFFINE))
    })
}

/// Two int8 rows against one token in one pass (decode); see [`int4_rows_one_token`].
///
/// # Safety
/// As `kernels::matmul_rows` for both rows, with exactly one token; AVX-512 VNNI present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn int8_row_pair(
    matrix: &MatrixView,
    row_a: usize,
    row_b: usize,
    input: &InputRows,
    out_a: *mut f32,
    out_b: *mut f32,
    prefetch: Prefetch,
) {
    let groups = matrix.layout.groups_per_row;
    let blocks = groups.div_ceil(2);
    let values = [matrix.row_values(row_a), matrix.row_values(row_b)];
    let scales = [matrix.row_scales(row_a), matrix.row_scales(row_b)];
    let zero = _mm512_setzero_si512();
    let ones = _mm512_set1_epi8(1);
    let pair_index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let scale_index: [__m512i; 8] =
        std::array::from_fn(|j| _mm512_add_epi32(pair_index, _mm512_set1_epi32(2 * j as i32)));
    let x_bytes = input.int8_row(0);
    let x_scales = input.lane_scale_row(0);
    let mut acc = [_mm512_setzero_ps(); 2];
    let into_l2 = prefetch.into_l2;
    let prefetch = prefetch.distance_bytes;
    prefetch_row_scales(matrix, row_a, prefetch, into_l2);
    prefetch_row_scales(matrix, row_b, prefetch, into_l2);
    let mut block = 0;
    while block < blocks {
        let chunk = (blocks - block).min(8);
        let chunk_groups = (groups - 2 * block).min(16);
        let chunk_scales: [__m512; 2] =
            std::array::from_fn(|r| load_scales(scales[r].add(2 * block), chunk_groups));
        for (j, index) in scale_index.iter().enumerate().take(chunk) {
            let b = block + j;
            let both = 2 * b + 1 < groups;
            let xq = _mm512_loadu_si512(x_bytes.add(b * 64).cast());
            let x_scale = _mm512_loadu_ps(x_scales.add(b * 16));
            for r in 0..2 {
                if prefetch > 0 {
                    // Addresses past the matrix end are harmless: prefetches never fault.
                    prefetch_line(values[r].wrapping_add(b * 64 + prefetch), into_l2);
                }
                let weights = if both {
                    _mm512_loadu_si512(values[r].add(b * 64).cast())
                } else {
                    _mm512_zextsi256_si512(_mm256_loadu_si256(values[r].add(b * 64).cast()))
                };
                let weight_sum_128 =
                    _mm512_slli_epi32::<7>(_mm512_dpbusd_epi32(zero, ones, weights));
                let dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xq, weights), weight_sum_128);
                let scale = _mm512_mul_ps(_mm512_permutexvar_ps(*index, chunk_scales[r]), x_scale);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            }
        }
        block += chunk;
    }
    *out_a = _mm512_reduce_add_ps(acc[0]);
    *out_b = _mm512_reduce_add_ps(acc[1]);
}

/// Int8 × int8 rows, two groups (64 weight bytes) per `vpdpbusd`: lanes 0–7 hold group 2b,
/// lanes 8–15 group 2b+1. Activations are stored as `x + 128` (unsigned), so `128 · Σw` per
/// lane is subtracted.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn int8_row<const N: usize>(
    matrix: &MatrixView,
    row: usize,
    input: &InputRows,
    t0: usize,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    let groups = matrix.layout.groups_per_row;
    let blocks = groups.div_ceil(2);
    let values = matrix.row_values(row);
    let scales = matrix.row_scales(row);
    let zero = _mm512_setzero_si512();
    let ones = _mm512_set1_epi8(1);
    // Lanes 0–7 take scale 2j, lanes 8–15 scale 2j+1.
    let pair_index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let scale_index: [__m512i; 8] =
        std::array::from_fn(|j| _mm512_add_epi32(pair_index, _mm512_set1_epi32(2 * j as i32)));
    let x_bytes: [*const u8; N] = std::array::from_fn(|t| input.int8_row(t0 + t));
    let x_scales: [*const f32; N] = std::array::from_fn(|t| input.lane_scale_row(t0 + t));
    let mut acc = [_mm512_setzero_ps(); N];
    let into_l2 = prefetch.into_l2;
    let prefetch = prefetch.distance_bytes;
    prefetch_row_scales(matrix, row, prefetch, into_l2);
    let mut block = 0;
    while block < blocks {
        let chunk = (blocks - block).min(8);
        let chunk_scales = load_scales(scales.add(2 * block), (groups - 2 * block).min(16));
        for (j, index) in scale_index.iter().enumerate().take(chunk) {
            let b = block + j;
            if prefetch > 0 {
                // Addresses past the matrix end are harmless: prefetches never fault.
                prefetch_line(values.wrapping_add(b * 64 + prefetch), into_l2);
            }
            let weights = if 2 * b + 1 < groups {
                _mm512_loadu_si512(values.add(b * 64).cast())
            } else {
                _mm512_zextsi256_si512(_mm256_loadu_si256(values.add(b * 64).cast()))
            };
            let weight_scale = _mm512_permutexvar_ps(*index, chunk_scales);
            let weight_sum_128 = _mm512_slli_epi32::<7>(_mm512_dpbusd_epi32(zero, ones, weights));
            for t in 0..N {
                let xq = _mm512_loadu_si512(x_bytes[t].add(b * 64).cast());
                let dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xq, weights), weight_sum_128);
                let scale = _mm512_mul_ps(weight_scale, _mm512_loadu_ps(x_scales[t].add(b * 16)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
            }
        }
        block += chunk;
    }
    for (t, sum) in acc.iter().enumerate() {
        *out.add(t * token_stride) = _mm512_reduce_add_ps(*sum);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")]
unsafe fn bf16_rows(
    matrix: &MatrixView,
    first: usize,
    count: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    for local in 0..count {
        token_blocks!(input, |t0, N| bf16_row::<N>(
            matrix,
            first + local,
            input,
            t0,
            out.add(t0 * token_stride + local),
            token_stride,
            prefetch
        ));
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")]
unsafe fn bf16_row<const N: usize>(
    matrix: &MatrixView,
    row: usize,
    input: &InputRows,
    t0: usize,
    out: *mut f32,
    token_stride: usize,
    prefetch: Prefetch,
) {
    let cols = matrix.layout.cols;
    let full_groups = cols / GROUP;
    let values = matrix.row_values(row);
    let x: [*const u16; N] = std::array::from_fn(|t| input.bf16_row(t0 + t));
    let mut acc = [_mm512_setzero_ps(); N];
    let into_l2 = prefetch.into_l2;
    let prefetch = prefetch.distance_bytes;
    for g in 0..full_groups {
        if prefetch > 0 {
            prefetch_line(values.wrapping_add(g * 64 + prefetch), into_l2);
        }
        let weights: __m512bh = std::mem::transmute(_mm512_loadu_si512(values.add(g * 64).cast()));
        for t in 0..N {
            let xb: __m512bh = std::mem::transmute(_mm512_loadu_si512(x[t].add(g * GROUP).cast()));
            acc[t] = _mm512_dpbf16_ps(acc[t], weights, xb);
        }
    }
    for (t, sum) in acc.iter().enumerate() {
        let mut total = _mm512_reduce_add_ps(*sum);
        let natural = input.f32_row(t0 + t);
        for column in full_groups * GROUP..cols {
            total += float_weight(values, WeightDType::Bf16, column) * *natural.add(column);
        }
        *out.add(t * token_stride) = total;
    }
}
