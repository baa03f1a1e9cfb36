//! The Qwen3.5 vision tower on the GPU (docs/MODELS.md §10.5, `kernels/vision.cu`): the same
//! forward as the f32 host reference (`crate::vision::encoder`), with every matrix product on
//! the tensor cores — the linear layers through cuBLAS (bf16 inputs, f32 accumulation and
//! output), attention within each image by `vision_attention_*` (flash-attention-2, no n × n
//! scores in memory) — while the residual stream, the norms' statistics, the softmax and the
//! biases stay f32.
//!
//! Owns: [`CudaVisionTower`] (its weights on the GPU and the backend it runs on), the forward's
//! launch sequence and buffers, the choice of the attention kernel's padded head width.
//! Must not touch: the index math of the grids (`crate::vision::grid`, computed on the host and
//! uploaded), the weights' upload (`vision_weights.rs`), the decoder.
//!
//! The tower runs on a backend of its own (a second stream on the same GPU), so encoding images
//! never lands inside a decode step the scheduler is recording on its backend's stream.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::super::cublas::GemmOperands;
use super::super::CudaError;
use super::vision_weights::{DeviceLayerNorm, DeviceLinear, DeviceVisionWeights};
use super::{driver_error, elementwise, int, CudaBackend};
use crate::error::EngineError;
use crate::vision::{
    patch_tables, ImageGrid, VisionConfig, VisionOutput, VisionTower, VisionWeights,
};

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
/// `VLN_WARPS` in kernels/vision.cu: rows per LayerNorm block.
const LAYER_NORM_ROWS: u32 = 8;
/// LayerNorm's epsilon in every norm of the tower.
const LAYER_NORM_EPS: f32 = 1e-6;
/// The default dynamic shared memory a block may take without opting in.
const DEFAULT_DYNAMIC_SHARED_BYTES: usize = 48 * 1024;

/// Query rows of one attention block for heads padded to `width`.
fn attention_rows(width: usize) -> usize {
    let tiles = if width <= NARROW_HEAD_WIDTH {
        ATTENTION_TILES_NARROW
    } else {
        ATTENTION_TILES_WIDE
    };
    16 * ATTENTION_WARPS * tiles
}

/// Dynamic shared memory of one attention block for heads padded to `width`: its query rows,
/// a K tile and a V tile.
fn attention_shared_bytes(width: usize) -> usize {
    (attention_rows(width) + 2 * ATTENTION_KEYS) * (width + ATTENTION_PAD) * 2
}

/// The smallest padded width that holds a head of `head_dim`.
pub fn vision_attention_width(head_dim: usize) -> Option<usize> {
    VISION_ATTENTION_HEAD_WIDTHS
        .into_iter()
        .find(|&width| width >= head_dim)
}

/// Threads of a row-wise kernel's block (kernels/vision.cu: any count works, the threads
/// stride over the row).
const ROW_THREADS: u32 = 256;

/// One block per row.
fn per_row(rows: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(rows).map_err(|_| CudaError::Invalid {
                problem: format!("{rows} rows are too many for one launch"),
            })?,
            1,
            1,
        ),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn device(op: &'static str) -> impl FnOnce(CudaError) -> EngineError {
    move |source| EngineError::Device { op, source }
}

/// The tower's outputs, still on the GPU.
pub struct CudaVisionOutput {
    /// `[rows, hidden]`.
    pub last_hidden_state: CudaSlice<f32>,
    /// `[tokens, out_hidden]`.
    pub merged: CudaSlice<f32>,
    pub tokens_per_image: Vec<usize>,
}

/// The vision tower with its weights on one GPU.
pub struct CudaVisionTower {
    backend: Arc<CudaBackend>,
    config: VisionConfig,
    weights: DeviceVisionWeights,
    /// The head width the attention kernel pads to.
    attention_width: usize,
}

impl CudaVisionTower {
    /// `weights` uploaded to `backend`'s GPU. Needs cuBLAS (the linear layers' GEMMs) and a head
    /// width of at most the widest attention kernel's.
    pub fn new(backend: Arc<CudaBackend>, weights: &VisionWeights) -> Result<Self, EngineError> {
        let config = weights.config.clone();
        let unsupported = |problem: String| EngineError::Device {
            op: "vision tower",
            source: CudaError::Unsupported { problem },
        };
        if backend.cublas.is_none() {
            return Err(unsupported(
                "the vision tower on the GPU needs cuBLAS, which is off or did not load".into(),
            ));
        }
        let attention_width = vision_attention_width(config.head_dim()).ok_or_else(|| {
            unsupported(format!(
                "vision head width {} is wider than the attention kernels' {}",
                config.head_dim(),
                VISION_ATTENTION_HEAD_WIDTHS[VISION_ATTENTION_HEAD_WIDTHS.len() - 1]
            ))
        })?;
        let bytes = attention_shared_bytes(attention_width);
        if bytes > backend.info.shared_memory_per_block {
            return Err(unsupported(format!(
                "vision attention of head width {attention_width} needs {bytes} bytes of shared memory per block, the limit is {}",
                backend.info.shared_memory_per_block
            )));
        }
        if bytes > DEFAULT_DYNAMIC_SHARED_BYTES {
            backend
                .stream
                .context()
                .bind_to_thread()
                .map_err(driver_error("binding the CUDA context"))
                .and_then(|()| backend.attention_function(attention_width))
                .and_then(|kernel| {
                    kernel
                        .set_attribute(
                            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            bytes as i32,
                        )
                        .map_err(driver_error(format!(
                            "allowing `vision_attention_{attention_width}` {bytes} bytes of shared memory"
                        )))
                })
                .map_err(device("vision tower"))?;
        }
        let weights = backend
            .upload_vision_weights(weights)
            .map_err(device("uploading the vision tower"))?;
        Ok(CudaVisionTower {
            backend,
            config,
            weights,
            attention_width,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Checks `grids` against `pixel_count` values of patch rows; returns the row count.
    fn check_input(&self, pixel_count: usize, grids: &[ImageGrid]) -> Result<usize, EngineError> {
        for grid in grids {
            grid.check(self.config.spatial_merge_size)?;
        }
        let rows: usize = grids.iter().map(ImageGrid::patches).sum();
        if rows == 0 || pixel_count != rows * self.config.patch_row_len() {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "{pixel_count} pixel values for {rows} patch rows of {}",
                    self.config.patch_row_len()
                ),
            });
        }
        Ok(rows)
    }

    /// Patch rows copied to the GPU.
    pub fn upload_pixels(&self, pixel_rows: &[f32]) -> Result<CudaSlice<f32>, EngineError> {
        self.backend
            .upload_f32(pixel_rows)
            .map_err(device("copying patch rows to the GPU"))
    }

    /// The forward over patch rows already on the GPU, queued on the backend's stream; the
    /// outputs stay there.
    pub fn encode_on_device(
        &self,
        pixels: &CudaSlice<f32>,
        grids: &[ImageGrid],
    ) -> Result<CudaVisionOutput, EngineError> {
        let rows = self.check_input(pixels.len(), grids)?;
        self.forward(pixels, grids, rows)
            .map_err(device("vision tower"))
    }

    /// Waits for everything queued on the tower's stream.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        self.backend.synchronize().map_err(device("vision tower"))
    }

    fn forward(
        &self,
        pixels: &CudaSlice<f32>,
        grids: &[ImageGrid],
        rows: usize,
    ) -> Result<CudaVisionOutput, CudaError> {
        let backend = &*self.backend;
        let config = &self.config;
        let weights = &self.weights;
        let hidden = config.hidden_size;
        let head_dim = config.head_dim();
        let tables = patch_tables(
            grids,
            config.spatial_merge_size,
            config.position_grid_side(),
            head_dim,
            config.rope_theta(),
        )
        .map_err(|error| CudaError::Invalid {
            problem: error.to_string(),
        })?;
        let tap_index = backend.upload_u32(&tables.tap_index)?;
        let tap_weight = backend.upload_f32(&tables.tap_weight)?;
        let cos = backend.upload_f32(&tables.cos)?;
        let sin = backend.upload_f32(&tables.sin)?;
        let first_key = backend.upload_u32(&tables.first_key)?;
        let end_key = backend.upload_u32(&tables.end_key)?;

        // Patch embedding: bf16 patch rows through the GEMM, then its bias and the positions.
        let row_len = config.patch_row_len();
        let mut pixels_bf16 = backend.alloc_bf16(rows * row_len)?;
        let count = (rows * row_len) as i64;
        launch!(backend, "f32_to_bf16", elementwise(rows * row_len);
            pixels, &mut pixels_bf16, &count)?;
        let mut x = backend.alloc(rows * hidden)?;
        backend.vision_gemm(&pixels_bf16, &weights.patch_embed, &mut x, rows, false)?;
        drop(pixels_bf16);
        let (rows_arg, hidden_arg) = (int(rows, "patch rows")?, int(hidden, "hidden")?);
        launch!(backend, "vision_patch_positions", per_row(rows)?;
            &mut x, &weights.patch_embed.bias, &weights.position_embeddings, &tap_index,
            &tap_weight, &hidden_arg)?;

        let heads = config.num_heads;
        let width = self.attention_width;
        let intermediate = config.intermediate_size;
        let mut normed = backend.alloc_bf16(rows * hidden)?;
        let mut qkv = backend.alloc(rows * 3 * hidden)?;
        let mut q = backend.alloc_bf16(heads * rows * width)?;
        let mut k = backend.alloc_bf16(heads * rows * width)?;
        let mut v = backend.alloc_bf16(heads * rows * width)?;
        let mut attended = backend.alloc_bf16(rows * hidden)?;
        let mut inner = backend.alloc(rows * intermediate)?;
        let mut inner_bf16 = backend.alloc_bf16(rows * intermediate)?;
        let (heads_arg, head_dim_arg, width_arg) = (
            int(heads, "heads")?,
            int(head_dim, "head width")?,
            int(width, "padded head width")?,
        );
        let scale = 1.0 / (head_dim as f32).sqrt();
        let attention_config = LaunchConfig {
            grid_dim: (
                u32::try_from(rows.div_ceil(attention_rows(width))).map_err(|_| {
                    CudaError::Invalid {
                        problem: format!("{rows} patch rows are too many for one launch"),
                    }
                })?,
                heads as u32,
                1,
            ),
            block_dim: (32 * ATTENTION_WARPS as u32, 1, 1),
            shared_mem_bytes: attention_shared_bytes(width) as u32,
        };
        let tanh_gelu = 0i32;
        let intermediate_arg = int(intermediate, "intermediate")?;
        // The bias the next norm adds to the residual first: a GEMM that accumulated into the
        // residual left its own bias owed.
        let mut owed = &weights.zero_bias;
        for block in &weights.blocks {
            backend.vision_layer_norm(&mut x, owed, &block.norm1, &mut normed, rows, hidden)?;
            backend.vision_gemm(&normed, &block.qkv, &mut qkv, rows, false)?;
            launch!(backend, "vision_rope_pack", per_row(rows)?;
                &qkv, &block.qkv.bias, &cos, &sin, &mut q, &mut k, &mut v, &rows_arg,
                &heads_arg, &head_dim_arg, &width_arg)?;
            let kernel = backend.attention_function(width)?;
            let mut args = super::launch::KernelArgs::new(&backend.stream);
            args.arg(&q)
                .arg(&k)
                .arg(&v)
                .arg(&first_key)
                .arg(&end_key)
                .arg(&mut attended)
                .arg(&rows_arg)
                .arg(&heads_arg)
                .arg(&head_dim_arg)
                .arg(&scale);
            // SAFETY: the arguments match `vision_attention_*`'s C signature; q, k, v hold
            // heads · rows · width bf16, the key tables `rows` entries, `attended`
            // rows · heads · head_dim, and the grid covers rows × heads.
            unsafe { backend.launch_kernel(kernel, attention_config, &mut args) }?;
            drop(args);
            backend.vision_gemm(&attended, &block.proj, &mut x, rows, true)?;
            backend.vision_layer_norm(
                &mut x,
                &block.proj.bias,
                &block.norm2,
                &mut normed,
                rows,
                hidden,
            )?;
            backend.vision_gemm(&normed, &block.fc1, &mut inner, rows, false)?;
            launch!(backend, "vision_bias_gelu", per_row(rows)?;
                &inner, &block.fc1.bias, &mut inner_bf16, &intermediate_arg, &tanh_gelu)?;
            backend.vision_gemm(&inner_bf16, &block.fc2, &mut x, rows, true)?;
            owed = &block.fc2.bias;
        }
        drop((qkv, q, k, v, attended, inner, inner_bf16));

        // The merger: a norm per patch row (x is the last hidden state from here), each merge
        // block's rows side by side (consecutive rows: the same buffer), an MLP with exact GELU.
        backend.vision_layer_norm(
            &mut x,
            owed,
            &weights.merger_norm,
            &mut normed,
            rows,
            hidden,
        )?;
        let tokens = rows / config.merge_unit();
        let merged_width = weights.merger_fc1.outputs;
        let mut merger_inner = backend.alloc(tokens * merged_width)?;
        backend.vision_gemm(
            &normed,
            &weights.merger_fc1,
            &mut merger_inner,
            tokens,
            false,
        )?;
        let mut merger_inner_bf16 = backend.alloc_bf16(tokens * merged_width)?;
        let (merged_width_arg, exact_gelu) = (int(merged_width, "merged width")?, 1i32);
        launch!(backend, "vision_bias_gelu", per_row(tokens)?;
            &merger_inner, &weights.merger_fc1.bias, &mut merger_inner_bf16,
            &merged_width_arg, &exact_gelu)?;
        let out_hidden = weights.merger_fc2.outputs;
        let mut merged = backend.alloc(tokens * out_hidden)?;
        backend.vision_gemm(
            &merger_inner_bf16,
            &weights.merger_fc2,
            &mut merged,
            tokens,
            false,
        )?;
        let out_hidden_arg = int(out_hidden, "out")?;
        launch!(backend, "vision_add_bias", per_row(tokens)?;
            &mut merged, &weights.merger_fc2.bias, &out_hidden_arg)?;
        Ok(CudaVisionOutput {
            last_hidden_state: x,
            merged,
            tokens_per_image: grids
                .iter()
                .map(|grid| grid.patches() / config.merge_unit())
                .collect(),
        })
    }
}

impl VisionTower for CudaVisionTower {
    fn encode(&self, pixel_rows: &[f32], grids: &[ImageGrid]) -> Result<VisionOutput, EngineError> {
        self.check_input(pixel_rows.len(), grids)?;
        let pixels = self.upload_pixels(pixel_rows)?;
        let output = self.encode_on_device(&pixels, grids)?;
        let download = |buffer: &CudaSlice<f32>| {
            self.backend
                .stream
                .memcpy_dtov(buffer)
                .map_err(driver_error(
                    "copying the vision tower's output to the host",
                ))
                .map_err(device("vision tower"))
        };
        Ok(VisionOutput {
            last_hidden_state: download(&output.last_hidden_state)?,
            merged: download(&output.merged)?,
            tokens_per_image: output.tokens_per_image,
        })
    }

    fn describe(&self) -> String {
        format!(
            "cuda ({}, bf16 tensor cores, f32 residual)",
            self.backend.info.name
        )
    }
}

/// The tower's launches.
impl CudaBackend {
    fn alloc_bf16(&self, len: usize) -> Result<CudaSlice<u16>, CudaError> {
        self.stream
            .alloc_zeros::<u16>(len.max(1))
            .map_err(driver_error(format!(
                "allocating {len} bf16 values ({} bytes)",
                len * 2
            )))
    }

    fn attention_function(&self, width: usize) -> Result<&super::launch::Kernel, CudaError> {
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
    fn vision_gemm(
        &self,
        x: &CudaSlice<u16>,
        layer: &DeviceLinear,
        y: &mut CudaSlice<f32>,
        rows: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let cublas = self.cublas.as_ref().ok_or_else(|| CudaError::Unsupported {
            problem: "the vision tower on the GPU needs cuBLAS".into(),
        })?;
        cublas.linear_into(
            GemmOperands::Bf16 {
                x,
                w: &layer.weight,
            },
            y,
            rows,
            layer.inputs,
            layer.outputs,
            accumulate,
        )
    }

    /// `x += owed`, then `out = LayerNorm(x)` as bf16.
    fn vision_layer_norm(
        &self,
        x: &mut CudaSlice<f32>,
        owed: &CudaSlice<f32>,
        norm: &DeviceLayerNorm,
        out: &mut CudaSlice<u16>,
        rows: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from((rows as u64).div_ceil(u64::from(LAYER_NORM_ROWS))).map_err(
                    |_| CudaError::Invalid {
                        problem: format!("{rows} rows are too many for one launch"),
                    },
                )?,
                1,
                1,
            ),
            block_dim: (32 * LAYER_NORM_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, width, eps) = (int(rows, "rows")?, int(width, "width")?, LAYER_NORM_EPS);
        launch!(self, "vision_layer_norm", config;
            x, owed, &norm.weight, &norm.bias, out, &rows, &width, &eps)
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
    }

    #[test]
    fn each_kernel_takes_the_row_tiles_its_width_is_launched_with() {
        let source = include_str!("../../../../../../kernels/vision.cu");
        for width in VISION_ATTENTION_HEAD_WIDTHS {
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
    fn every_padded_width_has_its_kernel_and_holds_its_heads() {
        let source = include_str!("../../../../../../kernels/vision.cu");
        for width in VISION_ATTENTION_HEAD_WIDTHS {
            assert_eq!(width % 16, 0, "the tensor cores' k step");
            assert!(
                source.contains(&format!("vision_attention_{width}(")),
                "kernels/vision.cu defines vision_attention_{width}"
            );
        }
        assert_eq!(vision_attention_width(72), Some(80));
        assert_eq!(vision_attention_width(16), Some(16));
        assert_eq!(vision_attention_width(68), Some(80));
        assert_eq!(vision_attention_width(132), None);
        // The released widths (head 72) fit the default shared memory.
        assert!(attention_shared_bytes(80) <= DEFAULT_DYNAMIC_SHARED_BYTES);
    }
}
