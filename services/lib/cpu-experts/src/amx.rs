//! AMX-BF16 tile kernel (path `amx`, batches of at least `AMX_MIN_TOKENS` tokens per expert).
//!
//! Owns: one kernel that computes 16 weight rows against all tokens of an expert. The 16 rows
//! are dequantized once into a bf16 strip in the calling thread's buffer (A tiles, 16 rows × 32
//! features each); the activations were packed by `prepare` into B tiles (`[16 feature pairs]
//! [16 tokens]` of bf16 pairs); `tdpbf16ps` accumulates in f32 C tiles, two token blocks at a
//! time so each A tile is loaded once per 32 tokens. Int4 strips are in nibble order, matching
//! the B tiles.
//!
//! AMX intrinsics are not stable in Rust 1.95, so the few tile instructions are `asm!`. Tile
//! registers are not Rust-visible state, so no clobber list can name them: nothing else in this
//! process uses them, and every call loads its own configuration.

use std::arch::asm;
use std::arch::x86_64::*;

use crate::avx512::{
    float_weight, group_bytes, load_group, load_scales, D_BF16, D_F32, D_INT4, D_INT8,
};
use crate::kernel_shared::ThreadBuffers;
use crate::layout::{MatrixView, WeightDType, GROUP};
use crate::prepare::InputRows;

/// The 64-byte LDTILECFG operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// tmm0 = A (weights), tmm1 / tmm4 = B (two token blocks), tmm2 / tmm3 = C: all 16 × 64 B.
    fn new() -> Self {
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for tile in 0..5 {
            config.bytes_per_row[tile] = 64;
            config.rows[tile] = 16;
        }
        config
    }
}

/// Dequantizes row `row` into `strip` as bf16, `padded` features, zero past `cols`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")]
unsafe fn dequantize_row<const D: u8>(
    matrix: &MatrixView,
    row: usize,
    strip: *mut u16,
    padded: usize,
) {
    let cols = matrix.layout.cols;
    let quantized = D == D_INT8 || D == D_INT4;
    // Quantized rows decode every stored group (a last partial group's padding decodes to 0,
    // within `padded`, which is `cols` rounded up to 32).
    let full_groups = if quantized {
        matrix.layout.groups_per_row
    } else {
        cols / GROUP
    };
    let values = matrix.row_values(row);
    let mut scales = [1.0f32; 16];
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
            let (low, high) =
                load_group::<D>(values.add(g * group_bytes(D)), _mm512_set1_ps(scale));
            let packed: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(low));
            _mm256_storeu_si256(strip.add(g * GROUP).cast(), packed);
            let packed: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(high));
            _mm256_storeu_si256(strip.add(g * GROUP + 16).cast(), packed);
        }
        group += chunk;
    }
    for column in full_groups * GROUP..padded {
        let value = if column < cols && !quantized {
            float_weight(values, matrix.layout.dtype, column)
        } else {
            0.0
        };
        *strip.add(column) = half::bf16::from_f32(value).to_bits();
    }
}

/// Rows `first..first+16` of `matrix` against every token of `input` (which has AMX tiles).
///
/// # Safety
/// As `kernels::matmul_rows`, with 16 rows inside the matrix, `input.amx_base` set, AMX
/// permission granted and AVX-512 BF16 present.
pub(crate) unsafe fn rows16(
    matrix: &MatrixView,
    first: usize,
    input: &InputRows,
    out: *mut f32,
    token_stride: usize,
    buffers: &ThreadBuffers,
) {
    let padded = input.forms.amx_padded;
    for local in 0..16 {
        let strip = buffers.strip.add(local * padded);
        match matrix.layout.dtype {
            WeightDType::F32 => dequantize_row::<D_F32>(matrix, first + local, strip, padded),
            WeightDType::Bf16 => dequantize_row::<D_BF16>(matrix, first + local, strip, padded),
            WeightDType::Int8 => dequantize_row::<D_INT8>(matrix, first + local, strip, padded),
            WeightDType::Int4 => dequantize_row::<D_INT4>(matrix, first + local, strip, padded),
        }
    }
    let Some(base) = input.amx_base else {
        return;
    };
    let config = TileConfig::new();
    // SAFETY: the configuration is a valid palette-1 description of five 16×64-byte tiles.
    asm!("ldtilecfg [{}]", in(reg) &config as *const TileConfig, options(nostack, readonly));
    let pairs_per_block = padded / 2;
    let steps = padded / GROUP;
    let strip_stride = padded * 2;
    let tile_stride = 64usize;
    let blocks = input.tokens.div_ceil(16);
    let mut block = 0;
    while block < blocks {
        let both = block + 1 < blocks;
        let b0 = input.forms.amx.add(base + block * pairs_per_block * 16);
        let b1 = b0.add(pairs_per_block * 16);
        // SAFETY (all tile asm below): A rows lie in this thread's strip (16 × padded bf16),
        // B rows in the expert's packed tiles (pairs_per_block × 16 u32 per block), C goes to
        // this thread's two 16×16 f32 buffers.
        asm!("tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        for step in 0..steps {
            let a = buffers.strip.add(step * GROUP);
            let b = b0.add(step * 16 * 16);
            asm!(
                "tileloadd tmm0, [{a} + {sa}*1]",
                "tileloadd tmm1, [{b} + {sb}*1]",
                "tdpbf16ps tmm2, tmm0, tmm1",
                a = in(reg) a,
                sa = in(reg) strip_stride,
                b = in(reg) b,
                sb = in(reg) tile_stride,
                options(nostack, readonly),
            );
            if both {
                asm!(
                    "tileloadd tmm4, [{b} + {sb}*1]",
                    "tdpbf16ps tmm3, tmm0, tmm4",
                    b = in(reg) b1.add(step * 16 * 16),
                    sb = in(reg) tile_stride,
                    options(nostack, readonly),
                );
            }
        }
        asm!(
            "tilestored [{c} + {sc}*1], tmm2",
            "tilestored [{d} + {sc}*1], tmm3",
            c = in(reg) buffers.tiles,
            d = in(reg) buffers.tiles.add(256),
            sc = in(reg) tile_stride,
            options(nostack),
        );
        let valid = (input.tokens - block * 16).min(if both { 32 } else { 16 });
        for token in 0..valid {
            let tile = buffers.tiles.add((token / 16) * 256);
            let column = token % 16;
            let destination = out.add((block * 16 + token) * token_stride);
            for row in 0..16 {
                *destination.add(row) = *tile.add(row * 16 + column);
            }
        }
        block += 2;
    }
    asm!("tilerelease", options(nostack, nomem));
}
