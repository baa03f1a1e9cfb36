//! One launch per op for a decode batch (`CudaOptions::batched_decode`): the KV append, split
//! (or group) attention and combine of up to [`DECODE_BATCH_ROWS`] one-row segments, each row
//! reading its own cache and position from [`DecodeRows`], a by-value kernel parameter.
//!
//! Owns: the batched launches and the row table's layout. Must not touch: which segments take
//! the batched path and the per-segment launches (device/attention.rs), the group kernels'
//! choice (device/attention_decode.rs).

use cudarc::driver::{DevicePtrMut, LaunchConfig};

use super::attention::{
    split_chunk, split_smem_bytes, COMBINE_WARPS, DECODE_BATCH_ROWS, SPLIT_HEADS, SPLIT_MAX_CHUNKS,
    SPLIT_THREADS,
};
use super::{elementwise, int, CudaBackend, CudaKvCache, CudaTensor, KvBuffer};
use crate::backend::cuda::CudaError;
use crate::backend::{AttentionSpec, Segment};

/// `DecodeRows` in `kernels/attention.cu`: the caches and positions of the rows of one batched
/// decode launch, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct DecodeRows {
    keys: [u64; DECODE_BATCH_ROWS],
    values: [u64; DECODE_BATCH_ROWS],
    positions: [i32; DECODE_BATCH_ROWS],
}

// SAFETY: `#[repr(C)]` plain integers laid out as the kernels' `DecodeRows` (u64 ↔ unsigned long
// long, i32 ↔ int, no padding between or after the arrays at this row count).
unsafe impl cudarc::driver::DeviceRepr for DecodeRows {}
// SAFETY: as above: `#[repr(C)]`, the kernels' `DecodeRows` field for field.
unsafe impl super::launch::KernelValue for DecodeRows {}

impl CudaBackend {
    /// The KV append, split attention and combine of up to [`DECODE_BATCH_ROWS`] one-row
    /// segments (rows `row_start ..`, in order), one launch each: each row reads its own cache
    /// and position (from `row_positions` in a step graph) and takes the chunk its own segment
    /// launch would take, so every row gets the bits of the per-segment launches.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_batched_decode_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CudaKvCache>],
        row_start: usize,
        out: &mut CudaTensor,
        in_step_graph: bool,
        row_positions: u64,
        tensor_cores: bool,
    ) -> Result<(), CudaError> {
        let n = segments.len();
        if n == 0 || n > DECODE_BATCH_ROWS {
            return Err(CudaError::Invalid {
                problem: format!(
                    "a batched decode launch takes 1 to {DECODE_BATCH_ROWS} rows, not {n}"
                ),
            });
        }
        let hd = spec.head_dim;
        let mut batch = DecodeRows {
            keys: [0; DECODE_BATCH_ROWS],
            values: [0; DECODE_BATCH_ROWS],
            positions: [0; DECODE_BATCH_ROWS],
        };
        let mut most_chunks = 1usize;
        let mut bf16 = false;
        for (t, segment) in segments.iter_mut().enumerate() {
            let cache = &mut *segment.state;
            batch.positions[t] = int(segment.start_position, "position")?;
            let chunk = split_chunk(segment.start_position);
            most_chunks = most_chunks.max(segment.start_position / chunk + 1);
            let (keys, values) = match (&mut *cache.keys, &mut *cache.values) {
                (KvBuffer::F32(keys), KvBuffer::F32(values)) => (
                    keys.device_ptr_mut(&self.stream).0,
                    values.device_ptr_mut(&self.stream).0,
                ),
                (KvBuffer::Bf16(keys), KvBuffer::Bf16(values)) => {
                    bf16 = true;
                    (
                        keys.device_ptr_mut(&self.stream).0,
                        values.device_ptr_mut(&self.stream).0,
                    )
                }
                _ => {
                    return Err(CudaError::Invalid {
                        problem: "attention: keys and values of one cache differ in dtype".into(),
                    })
                }
            };
            batch.keys[t] = keys;
            batch.values[t] = values;
            cache.len = segment.start_position + 1;
        }
        let width = segments[0].state.kv_width;
        let dtype = segments[0].state.dtype;
        // A step graph serves every position: its grid covers the most chunks a row can have,
        // and the kernels skip the chunks past each row's position.
        let chunks = if in_step_graph {
            SPLIT_MAX_CHUNKS
        } else {
            most_chunks
        };
        let entries = n * spec.heads * chunks;
        int(entries * hd, "split workspace")?;
        // Recycled buffers, not zeroed: the combine reads only the partials of non-empty
        // chunks, and the split kernel writes every one of those.
        let mut part_o = self.output_uninit(1, entries * hd)?;
        let mut part_ml = self.output_uninit(1, 2 * entries)?;
        let (q_data, k_data, v_data) = (&*q.data, &*k.data, &*v.data);
        let (row_start, rows, width_arg) = (
            int(row_start, "row")?,
            int(n, "rows")?,
            int(width, "kv width")?,
        );
        let (heads, kv_heads, head_dim) = (
            int(spec.heads, "heads")?,
            int(spec.kv_heads, "kv heads")?,
            int(hd, "head_dim")?,
        );
        let window = int(spec.sliding_window.unwrap_or(0), "sliding window")?;
        let scale = 1.0 / (hd as f32).sqrt();
        let (chunks_arg, part_base) = (int(chunks, "chunks")?, 0i32);
        if bf16 {
            launch!(self, "kv_append_batched_bf16", elementwise(n * width);
                k_data, v_data, &batch, &row_start, &rows, &width_arg, &row_positions)?;
        } else {
            launch!(self, "kv_append_batched", elementwise(n * width);
                k_data, v_data, &batch, &row_start, &rows, &width_arg, &row_positions)?;
        }
        let group = spec.heads / spec.kv_heads;
        let slices = group.div_ceil(SPLIT_HEADS);
        let config = LaunchConfig {
            grid_dim: (chunks as u32, (spec.kv_heads * slices) as u32, n as u32),
            block_dim: (SPLIT_THREADS, 1, 1),
            shared_mem_bytes: split_smem_bytes(hd, dtype) as u32,
        };
        let (part_o, part_ml) = (&mut *part_o.data, &mut *part_ml.data);
        if let Some(kernel) = self.decode_kernel(dtype, hd, group, tensor_cores) {
            let function = self.function(kernel.batched)?;
            let mut builder = super::launch::KernelArgs::new(&self.stream);
            builder
                .arg(q_data)
                .arg(&mut *part_o)
                .arg(&mut *part_ml)
                .arg(&batch)
                .arg(&row_start)
                .arg(&heads)
                .arg(&kv_heads)
                .arg(&head_dim)
                .arg(&window)
                .arg(&scale)
                .arg(&chunks_arg)
                .arg(&part_base)
                .arg(&row_positions);
            // SAFETY: the arguments match `attention_decode[_mma]_batched_bf16_*` in
            // kernels/attention_decode.cu, which take those of `attention_split_batched_bf16`
            // (types and order); every row's cache pointer is a bf16 cache (`decode_kernel`
            // answers only for bf16).
            unsafe {
                self.launch_kernel(
                    function,
                    kernel.config(chunks, spec.kv_heads, n),
                    &mut builder,
                )
            }?;
        } else if bf16 {
            launch!(self, "attention_split_batched_bf16", config;
                q_data, &mut *part_o, &mut *part_ml, &batch, &row_start, &heads, &kv_heads,
                &head_dim, &window, &scale, &chunks_arg, &part_base, &row_positions)?;
        } else {
            launch!(self, "attention_split_batched", config;
                q_data, &mut *part_o, &mut *part_ml, &batch, &row_start, &heads, &kv_heads,
                &head_dim, &window, &scale, &chunks_arg, &part_base, &row_positions)?;
        }
        let combine = LaunchConfig {
            grid_dim: ((n * spec.heads) as u32, hd.div_ceil(32) as u32, 1),
            block_dim: (32 * COMBINE_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "attention_combine_batched", combine;
            &*part_o, &*part_ml, &mut *out.data, &batch, &row_start, &rows, &heads, &head_dim,
            &window, &chunks_arg, &part_base, &row_positions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_rows_is_the_kernels_struct() {
        use crate::backend::cuda::kernels::kernel_define;
        assert_eq!(
            DECODE_BATCH_ROWS as i64,
            kernel_define("attention", "DECODE_BATCH_ROWS")
        );
        // Byte for byte (two pointer arrays, one int array).
        assert_eq!(
            std::mem::size_of::<DecodeRows>(),
            DECODE_BATCH_ROWS * (8 + 8 + 4)
        );
        assert_eq!(std::mem::align_of::<DecodeRows>(), 8);
        assert!(
            std::mem::size_of::<DecodeRows>() < 4096 - 256,
            "kernel parameters fit 4 KiB"
        );
    }
}
