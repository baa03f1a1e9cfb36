//! The vision tower's launches (`kernels/vision.cu` and cuBLAS), one method per step of the
//! forward, each picking the kernel of the tower's precision from its buffers' type.
//!
//! Owns: the launch geometry of the vision kernels and the host mirrors of their constants;
//! each step is an op of `NINFER_CUDA_OP_TIMING` (named `vision …`).
//! Must not touch: the order of the forward (`vision.rs`), the weights' upload
//! (`vision_weights.rs`).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::super::cublas::GemmOperands;
use super::super::CudaError;
use super::vision_weights::{DeviceLayerNorm, DeviceLinear, DeviceValues, VisionPrecision};
use super::{driver_error, int, CudaBackend};

/// `VA_KEYS` in kernels/vision.cu: keys per staged tile.
const ATTENTION_KEYS: usize = 64;
/// `VA_WARPS` in kernels/vision.cu.
const ATTENTION_WARPS: usize = 4;
/// `VA_TILES_NARROW` / `VA_TILES_WIDE` in kernels/vision.cu: row tiles of 16 per warp for heads
/// padded to at most [`NARROW_HEAD_WIDTH`], and wider.
const ATTENTION_TILES_NARROW: usize = 2;
const ATTENTION_TILES_WIDE: usize = 1;
const NARROW_HEAD_WIDTH: usize = 80;
/// `VA_PAD` in kernels/vision.cu: bf16 of padding per staged row.
const ATTENTION_PAD: usize = 8;
/// The padded head widths `vision_attention_*` is compiled for.
pub const VISION_ATTENTION_HEAD_WIDTHS: [usize; 5] = [16, 32, 64, 80, 128];
/// `VAF_WARPS` / `VAF_DIMS_PER_LANE` in kernels/vision.cu: rows per block of the f32
/// attention kernel, and the widest head it takes (32 lanes of that many dims).
const F32_ATTENTION_ROWS: u32 = 8;
pub(super) const F32_ATTENTION_MAX_HEAD: usize = 32 * 4;
/// `VLN_WARPS` in kernels/vision.cu: rows per LayerNorm block.
const LAYER_NORM_ROWS: u32 = 8;
/// LayerNorm's epsilon in every norm of the tower.
const LAYER_NORM_EPS: f32 = 1e-6;
/// Threads of a row-wise kernel's block (kernels/vision.cu: any count works, the threads
/// stride over the row).
const ROW_THREADS: u32 = 256;
/// The default dynamic shared memory a block may take without opting in.
pub(super) const DEFAULT_DYNAMIC_SHARED_BYTES: usize = 48 * 1024;

/// Query rows of one tensor-core attention block for heads padded to `width`.
fn attention_rows(width: usize) -> usize {
    let tiles = if width <= NARROW_HEAD_WIDTH {
        ATTENTION_TILES_NARROW
    } else {
        ATTENTION_TILES_WIDE
    };
    16 * ATTENTION_WARPS * tiles
}

/// Dynamic shared memory of one tensor-core attention block for heads padded to `width`: its
/// query rows, a K tile and a V tile.
pub(super) fn attention_shared_bytes(width: usize) -> usize {
    (attention_rows(width) + 2 * ATTENTION_KEYS) * (width + ATTENTION_PAD) * 2
}

/// The smallest padded width that holds a head of `head_dim` on the tensor cores.
pub fn vision_attention_width(head_dim: usize) -> Option<usize> {
    VISION_ATTENTION_HEAD_WIDTHS
        .into_iter()
        .find(|&width| width >= head_dim)
}

fn grid_of(blocks: usize) -> Result<u32, CudaError> {
    u32::try_from(blocks).map_err(|_| CudaError::Invalid {
        problem: format!("{blocks} blocks are too many for one launch"),
    })
}

/// One block per row.
pub(super) fn per_row(rows: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (grid_of(rows)?, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn mixed_precision(step: &str) -> CudaError {
    CudaError::Invalid {
        problem: format!("vision {step}: buffers of different precisions"),
    }
}

/// A product's input borrowed from the caller.
pub(super) enum ValuesRef<'a> {
    Bf16(&'a CudaSlice<u16>),
    F32(&'a CudaSlice<f32>),
}

impl DeviceValues {
    pub(super) fn as_ref(&self) -> ValuesRef<'_> {
        match self {
            DeviceValues::Bf16(values) => ValuesRef::Bf16(values),
            DeviceValues::F32(values) => ValuesRef::F32(values),
        }
    }
}

impl CudaBackend {
    /// `len` values of a product's input in `precision` (zeros).
    pub(super) fn alloc_values(
        &self,
        len: usize,
        precision: VisionPrecision,
    ) -> Result<DeviceValues, CudaError> {
        Ok(match precision {
            VisionPrecision::F32 => DeviceValues::F32(self.alloc(len)?),
            VisionPrecision::Bf16 => {
                DeviceValues::Bf16(self.stream.alloc_zeros::<u16>(len.max(1)).map_err(
                    driver_error(format!("allocating {len} bf16 values ({} bytes)", len * 2)),
                )?)
            }
        })
    }

    /// The tensor-core attention kernel for heads padded to `width`.
    pub(super) fn vision_attention_function(
        &self,
        width: usize,
    ) -> Result<&super::launch::Kernel, CudaError> {
        match width {
            16 => self.function("vision_attention_16"),
            32 => self.function("vision_attention_32"),
            64 => self.function("vision_attention_64"),
            80 => self.function("vision_attention_80"),
            128 => self.function("vision_attention_128"),
            _ => Err(CudaError::Invalid {
                problem: format!("no vision attention kernel for head width {width}"),
            }),
        }
    }

    /// `y (+)= x · Wᵀ` over `rows` rows (the bias is the caller's), through cuBLAS.
    pub(super) fn vision_gemm(
        &self,
        x: ValuesRef<'_>,
        layer: &DeviceLinear,
        y: &mut CudaSlice<f32>,
        rows: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let _timer =
            self.op_timer_named(|| format!("vision gemm {}x{}", layer.outputs, layer.inputs));
        let cublas = self.cublas.as_ref().ok_or_else(|| CudaError::Unsupported {
            problem: "the vision tower on the GPU needs cuBLAS".into(),
        })?;
        let operands = match (x, &layer.weight) {
            (ValuesRef::Bf16(x), DeviceValues::Bf16(w)) => GemmOperands::Bf16 { x, w },
            (ValuesRef::F32(x), DeviceValues::F32(w)) => GemmOperands::F32 { x, w },
            _ => return Err(mixed_precision("linear layer")),
        };
        cublas.linear_into(operands, y, rows, layer.inputs, layer.outputs, accumulate)
    }

    /// `x += owed`, then `out = LayerNorm(x)` in `out`'s precision.
    pub(super) fn vision_layer_norm(
        &self,
        x: &mut CudaSlice<f32>,
        owed: &CudaSlice<f32>,
        norm: &DeviceLayerNorm,
        out: &mut DeviceValues,
        rows: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let _timer = self.op_timer("vision layer norm");
        let config = LaunchConfig {
            grid_dim: (grid_of(rows.div_ceil(LAYER_NORM_ROWS as usize))?, 1, 1),
            block_dim: (32 * LAYER_NORM_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, width, eps) = (int(rows, "rows")?, int(width, "width")?, LAYER_NORM_EPS);
        match out {
            DeviceValues::Bf16(out) => launch!(self, "vision_layer_norm", config;
                x, owed, &norm.weight, &norm.bias, out, &rows, &width, &eps),
            DeviceValues::F32(out) => launch!(self, "vision_layer_norm_f32", config;
                x, owed, &norm.weight, &norm.bias, out, &rows, &width, &eps),
        }
    }

    /// The qkv GEMM's output plus its bias, q and k rotated, packed as `[heads, rows, width]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn vision_rope_pack(
        &self,
        qkv: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        (cos, sin): (&CudaSlice<f32>, &CudaSlice<f32>),
        (q, k, v): (&mut DeviceValues, &mut DeviceValues, &mut DeviceValues),
        rows: usize,
        heads: usize,
        head_dim: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let _timer = self.op_timer("vision rope pack");
        let config = per_row(rows)?;
        let (rows, heads, head_dim, width) = (
            int(rows, "rows")?,
            int(heads, "heads")?,
            int(head_dim, "head width")?,
            int(width, "packed head width")?,
        );
        match (q, k, v) {
            (DeviceValues::Bf16(q), DeviceValues::Bf16(k), DeviceValues::Bf16(v)) => {
                launch!(self, "vision_rope_pack", config;
                    qkv, bias, cos, sin, q, k, v, &rows, &heads, &head_dim, &width)
            }
            (DeviceValues::F32(q), DeviceValues::F32(k), DeviceValues::F32(v)) => {
                launch!(self, "vision_rope_pack_f32", config;
                    qkv, bias, cos, sin, q, k, v, &rows, &heads, &head_dim, &width)
            }
            _ => Err(mixed_precision("rotary packing")),
        }
    }

    /// Attention within each image over packed q, k, v (`width` per head: padded for the
    /// tensor cores, the head itself in f32), into `out` `[rows, heads · head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn vision_attention(
        &self,
        (q, k, v): (&DeviceValues, &DeviceValues, &DeviceValues),
        (first_key, end_key): (&CudaSlice<u32>, &CudaSlice<u32>),
        out: &mut DeviceValues,
        rows: usize,
        heads: usize,
        head_dim: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let _timer = self.op_timer("vision attention");
        let scale = 1.0 / (head_dim as f32).sqrt();
        let heads_grid = grid_of(heads)?;
        // Blocks of `block_rows` rows × heads.
        let blocks = |block_rows: usize, threads: u32, shared_bytes: usize| {
            Ok::<_, CudaError>(LaunchConfig {
                grid_dim: (grid_of(rows.div_ceil(block_rows))?, heads_grid, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: shared_bytes as u32,
            })
        };
        let (rows_arg, heads, head_dim) = (
            int(rows, "rows")?,
            int(heads, "heads")?,
            int(head_dim, "head width")?,
        );
        match (q, k, v, out) {
            (
                DeviceValues::Bf16(q),
                DeviceValues::Bf16(k),
                DeviceValues::Bf16(v),
                DeviceValues::Bf16(out),
            ) => {
                let config = blocks(
                    attention_rows(width),
                    32 * ATTENTION_WARPS as u32,
                    attention_shared_bytes(width),
                )?;
                let kernel = self.vision_attention_function(width)?;
                let mut args = super::launch::KernelArgs::new(&self.stream);
                args.arg(q)
                    .arg(k)
                    .arg(v)
                    .arg(first_key)
                    .arg(end_key)
                    .arg(out)
                    .arg(&rows_arg)
                    .arg(&heads)
                    .arg(&head_dim)
                    .arg(&scale);
                // SAFETY: the arguments match `vision_attention_*`'s C signature; q, k, v hold
                // heads · rows · width bf16, the key tables `rows` entries, `out`
                // rows · heads · head_dim, and the grid covers rows × heads.
                unsafe { self.launch_kernel(kernel, config, &mut args) }
            }
            (
                DeviceValues::F32(q),
                DeviceValues::F32(k),
                DeviceValues::F32(v),
                DeviceValues::F32(out),
            ) => {
                let config = blocks(F32_ATTENTION_ROWS as usize, 32 * F32_ATTENTION_ROWS, 0)?;
                launch!(self, "vision_attention_f32", config;
                    q, k, v, first_key, end_key, out, &rows_arg, &heads, &head_dim, &scale)
            }
            _ => Err(mixed_precision("attention")),
        }
    }

    /// GELU (tanh form, or exact) of a GEMM's output plus its bias, into `out`'s precision.
    pub(super) fn vision_bias_gelu(
        &self,
        y: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        out: &mut DeviceValues,
        rows: usize,
        width: usize,
        exact: bool,
    ) -> Result<(), CudaError> {
        let _timer = self.op_timer("vision bias gelu");
        let config = per_row(rows)?;
        let (width, exact) = (int(width, "width")?, i32::from(exact));
        match out {
            DeviceValues::Bf16(out) => {
                launch!(self, "vision_bias_gelu", config; y, bias, out, &width, &exact)
            }
            DeviceValues::F32(out) => {
                launch!(self, "vision_bias_gelu_f32", config; y, bias, out, &width, &exact)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::kernel_define;

    #[test]
    fn the_host_mirrors_the_kernels_constants() {
        let define = |name| kernel_define("vision", name) as usize;
        assert_eq!(define("VA_KEYS"), ATTENTION_KEYS);
        assert_eq!(define("VA_WARPS"), ATTENTION_WARPS);
        assert_eq!(define("VA_THREADS"), 32 * ATTENTION_WARPS);
        assert_eq!(define("VA_TILES_NARROW"), ATTENTION_TILES_NARROW);
        assert_eq!(define("VA_TILES_WIDE"), ATTENTION_TILES_WIDE);
        assert_eq!(define("VA_PAD"), ATTENTION_PAD);
        assert_eq!(define("VLN_WARPS"), LAYER_NORM_ROWS as usize);
        assert_eq!(define("VAF_WARPS"), F32_ATTENTION_ROWS as usize);
        assert_eq!(32 * define("VAF_DIMS_PER_LANE"), F32_ATTENTION_MAX_HEAD);
    }

    #[test]
    fn each_kernel_takes_the_row_tiles_its_width_is_launched_with() {
        let source = include_str!("../../../../../../kernels/vision.cu");
        for width in VISION_ATTENTION_HEAD_WIDTHS {
            assert_eq!(width % 16, 0, "the tensor cores' k step");
            let tiles = if width <= NARROW_HEAD_WIDTH {
                "VA_TILES_NARROW"
            } else {
                "VA_TILES_WIDE"
            };
            assert!(
                source.contains(&format!("vision_attention_block<{width}, {tiles}>")),
                "vision_attention_{width} runs {tiles}"
            );
        }
        assert_eq!(attention_rows(80), 128);
        assert_eq!(attention_rows(128), 64);
    }

    #[test]
    fn heads_take_the_narrowest_kernel_that_holds_them() {
        assert_eq!(vision_attention_width(72), Some(80));
        assert_eq!(vision_attention_width(16), Some(16));
        assert_eq!(vision_attention_width(68), Some(80));
        assert_eq!(vision_attention_width(132), None);
        // The released widths (heads of 72) fit the default shared memory.
        assert!(attention_shared_bytes(80) <= DEFAULT_DYNAMIC_SHARED_BYTES);
    }
}
