//! The Qwen3.5 vision tower on the GPU (docs/MODELS.md §10.5, `kernels/vision.cu`): the same
//! forward as the f32 host reference (`crate::vision::encoder`), the residual stream, the
//! norms' statistics, the softmax and the biases in f32. A tower stored in bf16 (the released
//! checkpoints) runs every matrix product on the tensor cores with bf16 inputs and f32
//! accumulation — the linear layers through cuBLAS, attention within each image by
//! `vision_attention_*` (flash-attention-2, no n × n scores in memory); a tower stored in f32
//! runs them in f32 ([`VisionPrecision`]).
//!
//! Owns: [`CudaVisionTower`] (its weights on the GPU, its precision, the backend it runs on) and
//! the forward's order and buffers.
//! Must not touch: the index math of the grids (`crate::vision::grid`, computed on the host and
//! uploaded), the launches (`vision_launches.rs`), the weights' upload (`vision_weights.rs`).
//!
//! The engine runs the tower on a backend of its own (a second stream on the same GPU), so
//! encoding images never lands inside a decode step the scheduler is recording.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::CudaSlice;

use super::super::CudaError;
use super::vision_launches::{
    attention_shared_bytes, per_row, vision_attention_width, ValuesRef,
    DEFAULT_DYNAMIC_SHARED_BYTES, F32_ATTENTION_MAX_HEAD, VISION_ATTENTION_HEAD_WIDTHS,
};
use super::vision_weights::{DeviceVisionWeights, VisionPrecision};
use super::{driver_error, elementwise, int, CudaBackend};
use crate::error::EngineError;
use crate::vision::{
    patch_tables, ImageGrid, VisionConfig, VisionOutput, VisionTower, VisionWeights,
};

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
    precision: VisionPrecision,
    weights: DeviceVisionWeights,
    /// The width q, k and v are packed to per head: padded to the tensor-core kernel's (bf16),
    /// the head's own (f32).
    packed_width: usize,
}

impl CudaVisionTower {
    /// `weights` uploaded to `backend`'s GPU, to compute in `precision`. Needs cuBLAS (the
    /// linear layers' GEMMs) and heads of at most 128.
    pub fn new(
        backend: Arc<CudaBackend>,
        weights: &VisionWeights,
        precision: VisionPrecision,
    ) -> Result<Self, EngineError> {
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
        let head_dim = config.head_dim();
        let packed_width = match precision {
            VisionPrecision::F32 if head_dim <= F32_ATTENTION_MAX_HEAD => head_dim,
            VisionPrecision::F32 => {
                return Err(unsupported(format!(
                    "vision head width {head_dim} is wider than the f32 attention kernel's {F32_ATTENTION_MAX_HEAD}"
                )))
            }
            VisionPrecision::Bf16 => vision_attention_width(head_dim).ok_or_else(|| {
                unsupported(format!(
                    "vision head width {head_dim} is wider than the attention kernels' {}",
                    VISION_ATTENTION_HEAD_WIDTHS[VISION_ATTENTION_HEAD_WIDTHS.len() - 1]
                ))
            })?,
        };
        if precision == VisionPrecision::Bf16 {
            backend
                .allow_vision_attention(packed_width)
                .map_err(|error| match error {
                    CudaError::Unsupported { problem } => unsupported(problem),
                    other => EngineError::Device {
                        op: "vision tower",
                        source: other,
                    },
                })?;
        }
        let weights = backend
            .upload_vision_weights(weights, precision)
            .map_err(device("uploading the vision tower"))?;
        Ok(CudaVisionTower {
            backend,
            config,
            precision,
            weights,
            packed_width,
        })
    }

    pub fn precision(&self) -> VisionPrecision {
        self.precision
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

        // Patch embedding: the patch rows (as the products' inputs) through the GEMM, then its
        // bias and the positions.
        let precision = self.precision;
        let row_len = config.patch_row_len();
        let mut x = backend.alloc(rows * hidden)?;
        match precision {
            VisionPrecision::F32 => backend.vision_gemm(
                ValuesRef::F32(pixels),
                &weights.patch_embed,
                &mut x,
                rows,
                false,
            )?,
            VisionPrecision::Bf16 => {
                let mut pixels_bf16 = backend.alloc_values(rows * row_len, precision)?;
                let count = (rows * row_len) as i64;
                if let super::vision_weights::DeviceValues::Bf16(out) = &mut pixels_bf16 {
                    launch!(backend, "f32_to_bf16", elementwise(rows * row_len);
                        pixels, out, &count)?;
                }
                backend.vision_gemm(
                    pixels_bf16.as_ref(),
                    &weights.patch_embed,
                    &mut x,
                    rows,
                    false,
                )?;
            }
        }
        let hidden_arg = int(hidden, "hidden")?;
        launch!(backend, "vision_patch_positions", per_row(rows)?;
            &mut x, &weights.patch_embed.bias, &weights.position_embeddings, &tap_index,
            &tap_weight, &hidden_arg)?;

        let heads = config.num_heads;
        let width = self.packed_width;
        let intermediate = config.intermediate_size;
        let mut normed = backend.alloc_values(rows * hidden, precision)?;
        let mut qkv = backend.alloc(rows * 3 * hidden)?;
        let mut q = backend.alloc_values(heads * rows * width, precision)?;
        let mut k = backend.alloc_values(heads * rows * width, precision)?;
        let mut v = backend.alloc_values(heads * rows * width, precision)?;
        let mut attended = backend.alloc_values(rows * hidden, precision)?;
        let mut inner = backend.alloc(rows * intermediate)?;
        let mut activated = backend.alloc_values(rows * intermediate, precision)?;
        // The bias the next norm adds to the residual first: a GEMM that accumulated into the
        // residual left its own bias owed.
        let mut owed = &weights.zero_bias;
        for block in &weights.blocks {
            backend.vision_layer_norm(&mut x, owed, &block.norm1, &mut normed, rows, hidden)?;
            backend.vision_gemm(normed.as_ref(), &block.qkv, &mut qkv, rows, false)?;
            backend.vision_rope_pack(
                &qkv,
                &block.qkv.bias,
                (&cos, &sin),
                (&mut q, &mut k, &mut v),
                rows,
                heads,
                head_dim,
                width,
            )?;
            backend.vision_attention(
                (&q, &k, &v),
                (&first_key, &end_key),
                &mut attended,
                rows,
                heads,
                head_dim,
                width,
            )?;
            backend.vision_gemm(attended.as_ref(), &block.proj, &mut x, rows, true)?;
            backend.vision_layer_norm(
                &mut x,
                &block.proj.bias,
                &block.norm2,
                &mut normed,
                rows,
                hidden,
            )?;
            backend.vision_gemm(normed.as_ref(), &block.fc1, &mut inner, rows, false)?;
            backend.vision_bias_gelu(
                &inner,
                &block.fc1.bias,
                &mut activated,
                rows,
                intermediate,
                false,
            )?;
            backend.vision_gemm(activated.as_ref(), &block.fc2, &mut x, rows, true)?;
            owed = &block.fc2.bias;
        }
        drop((qkv, q, k, v, attended, inner, activated));

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
            normed.as_ref(),
            &weights.merger_fc1,
            &mut merger_inner,
            tokens,
            false,
        )?;
        let mut merger_activated = backend.alloc_values(tokens * merged_width, precision)?;
        backend.vision_bias_gelu(
            &merger_inner,
            &weights.merger_fc1.bias,
            &mut merger_activated,
            tokens,
            merged_width,
            true,
        )?;
        let out_hidden = weights.merger_fc2.outputs;
        let mut merged = backend.alloc(tokens * out_hidden)?;
        backend.vision_gemm(
            merger_activated.as_ref(),
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
        let products = match self.precision {
            VisionPrecision::Bf16 => "bf16 tensor cores",
            VisionPrecision::F32 => "f32",
        };
        format!(
            "cuda ({}, {products} products, f32 residual)",
            self.backend.info.name
        )
    }
}

impl CudaBackend {
    /// Lets the tensor-core attention kernel of `width` take its shared memory, or says why it
    /// cannot.
    fn allow_vision_attention(&self, width: usize) -> Result<(), CudaError> {
        let bytes = attention_shared_bytes(width);
        if bytes > self.info.shared_memory_per_block {
            return Err(CudaError::Unsupported {
                problem: format!(
                    "vision attention of head width {width} needs {bytes} bytes of shared memory per block, the limit is {}",
                    self.info.shared_memory_per_block
                ),
            });
        }
        if bytes <= DEFAULT_DYNAMIC_SHARED_BYTES {
            return Ok(());
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        self.vision_attention_function(width)?
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(driver_error(format!(
                "allowing `vision_attention_{width}` {bytes} bytes of shared memory"
            )))
    }
}
