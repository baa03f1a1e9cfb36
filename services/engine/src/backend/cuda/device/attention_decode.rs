//! Decode attention with a GQA group's q heads across the lanes or as the rows of a tensor-core
//! tile (`kernels/attention_decode.cu`): which kernel serves a (head_dim, group) shape, its
//! shared memory and its launch geometry.
//!
//! Owns: the choice between these kernels and the split kernel for a bf16 cache. The kernels
//! take the split kernel's arguments and write its partials at the same indices, so the split
//! workspace, the chunking and the combine (device/attention.rs) are unchanged.
//! Must not touch: the segments, the workspace or the combine.

use cudarc::driver::LaunchConfig;

use super::{CudaBackend, KvDtype};
use crate::backend::cuda::CudaError;

/// `DECODE_THREADS` in `kernels/attention_decode.cu`.
const DECODE_THREADS: u32 = 128;
/// `DECODE_WARPS` in `kernels/attention_decode.cu`.
const DECODE_WARPS: usize = 4;
/// `DECODE_TILE_BYTES` in `kernels/attention_decode.cu`: bytes of K staged per tile.
const DECODE_TILE_BYTES: usize = 8192;

/// `DM_WARPS` and `DM_WARPS_256` in `kernels/attention_decode.cu`: chunks per tensor-core block
/// (one per warp) at head dims 64 and 128, and at 256.
const DECODE_MMA_WARPS: usize = 4;
const DECODE_MMA_WARPS_256: usize = 2;
/// `DM_KEYS` in `kernels/attention_decode.cu`: keys per staged sub-tile of a warp.
const DECODE_MMA_KEYS: usize = 16;
/// `DM_PAD` in `kernels/attention_decode.cu`: bf16 of padding per staged row.
const DECODE_MMA_PAD: usize = 8;
/// The most q heads per kv head the tensor-core kernel takes (the rows of one mma tile).
const DECODE_MMA_MAX_GROUP: usize = 16;
/// Every `DECODE_MMA_KERNELS(HD)` of `kernels/attention_decode.cu`: (head_dim, segment kernel,
/// batched kernel).
const DECODE_MMA_HEAD_DIMS: [(usize, &str, &str); 3] = [
    (
        64,
        "attention_decode_mma_bf16_64",
        "attention_decode_mma_batched_bf16_64",
    ),
    (
        128,
        "attention_decode_mma_bf16_128",
        "attention_decode_mma_batched_bf16_128",
    ),
    (
        256,
        "attention_decode_mma_bf16_256",
        "attention_decode_mma_batched_bf16_256",
    ),
];

/// One instantiated kernel pair: (head_dim, dims per lane, segment kernel, batched kernel).
type DecodeShape = (usize, usize, &'static str, &'static str);

/// Every `DECODE_KERNELS(HD, DPL)` of `kernels/attention_decode.cu`.
const DECODE_SHAPES: [DecodeShape; 5] = [
    (
        64,
        16,
        "attention_decode_bf16_64_16",
        "attention_decode_batched_bf16_64_16",
    ),
    (
        64,
        32,
        "attention_decode_bf16_64_32",
        "attention_decode_batched_bf16_64_32",
    ),
    (
        128,
        16,
        "attention_decode_bf16_128_16",
        "attention_decode_batched_bf16_128_16",
    ),
    (
        128,
        32,
        "attention_decode_bf16_128_32",
        "attention_decode_batched_bf16_128_32",
    ),
    (
        256,
        32,
        "attention_decode_bf16_256_32",
        "attention_decode_batched_bf16_256_32",
    ),
];

/// The kernel pair for one attention shape and what a launch needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DecodeKernel {
    /// Over one segment's rows: the signature of `attention_split_bf16`.
    pub segment: &'static str,
    /// Over a batch of one-row segments: the signature of `attention_split_batched_bf16`.
    pub batched: &'static str,
    /// Dynamic shared memory of a block.
    pub shared_memory_bytes: usize,
    /// Chunks of a row one block takes (1 for the lanes kernels, one per warp on the tensor
    /// cores).
    pub chunks_per_block: usize,
    /// Threads per block.
    pub threads: u32,
}

impl DecodeKernel {
    /// Grid (chunk blocks, kv heads, rows): one block per `chunks_per_block` chunks, kv head and
    /// row, serving the kv head's whole group.
    pub fn config(&self, chunks: usize, kv_heads: usize, rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                chunks.div_ceil(self.chunks_per_block) as u32,
                kv_heads as u32,
                rows as u32,
            ),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: self.shared_memory_bytes as u32,
        }
    }
}

/// The tensor-core kernel for `head_dim` and `group` q heads per kv head (at most the 16 rows of
/// an mma tile), if one is instantiated.
pub(super) fn decode_mma_kernel_for_shape(head_dim: usize, group: usize) -> Option<DecodeKernel> {
    if group == 0 || group > DECODE_MMA_MAX_GROUP {
        return None;
    }
    let (_, segment, batched) = DECODE_MMA_HEAD_DIMS
        .iter()
        .find(|(hd, _, _)| *hd == head_dim)?;
    let warps = if head_dim == 256 {
        DECODE_MMA_WARPS_256
    } else {
        DECODE_MMA_WARPS
    };
    // q (16 rows), then per warp two stages of K and V sub-tiles, rows of head_dim + pad bf16.
    let rows = 16 + warps * 2 * 2 * DECODE_MMA_KEYS;
    Some(DecodeKernel {
        segment,
        batched,
        shared_memory_bytes: rows * (head_dim + DECODE_MMA_PAD) * 2,
        chunks_per_block: warps,
        threads: 32 * warps as u32,
    })
}

/// The kernel for `head_dim` and a group of `group` q heads per kv head, if one is instantiated:
/// lane l serves head l / L, L = 32 / (group rounded up to a power of two), with head_dim / L
/// dims per lane.
pub(super) fn decode_kernel_for_shape(head_dim: usize, group: usize) -> Option<DecodeKernel> {
    if group == 0 || group > 32 {
        return None;
    }
    let group_lanes = group.next_power_of_two();
    let lanes_per_head = 32 / group_lanes;
    if head_dim % lanes_per_head != 0 {
        return None;
    }
    let dims_per_lane = head_dim / lanes_per_head;
    let (_, _, segment, batched) = DECODE_SHAPES
        .iter()
        .find(|(hd, dpl, _, _)| *hd == head_dim && *dpl == dims_per_lane)?;
    // Two stages of K and V tiles; the end reuses them for the warps' states (o, then max and
    // sum, per warp and head lane).
    let stages = 4 * DECODE_TILE_BYTES;
    let states = (DECODE_WARPS * group_lanes * head_dim + 2 * DECODE_WARPS * group_lanes) * 4;
    Some(DecodeKernel {
        segment,
        batched,
        shared_memory_bytes: stages.max(states),
        chunks_per_block: 1,
        threads: DECODE_THREADS,
    })
}

impl CudaBackend {
    /// With `--cuda-tensor-core-decode-attention on`: every tensor-core decode kernel that fits
    /// this card gets the dynamic shared memory it needs (more than the 48 KB a launch gets
    /// without asking). Those that do not fit are left alone: `decode_kernel` does not pick them.
    pub(super) fn allow_tensor_core_decode_shared_memory(&self) -> Result<(), CudaError> {
        if !self.options.tensor_core_decode_attention {
            return Ok(());
        }
        for (head_dim, _, _) in DECODE_MMA_HEAD_DIMS {
            let Some(kernel) = decode_mma_kernel_for_shape(head_dim, 1) else {
                continue;
            };
            let bytes = kernel.shared_memory_bytes;
            if bytes > self.info.shared_memory_per_block {
                continue;
            }
            for name in [kernel.segment, kernel.batched] {
                self.allow_shared_memory(name, bytes)?;
            }
        }
        Ok(())
    }

    /// The decode kernel for a cache of `dtype` with `head_dim` and `group` q heads per kv head,
    /// when the option is on, the cache is bf16 and the block fits this card's shared memory
    /// (else the split kernel serves): on the tensor cores when the option asks for it,
    /// `tensor_cores` (the path that passed its bf16-tolerance check) and the shape has a
    /// kernel, else with the heads across the lanes. Logs the choice once per shape and path.
    pub(super) fn decode_kernel(
        &self,
        dtype: KvDtype,
        head_dim: usize,
        group: usize,
        tensor_cores: bool,
    ) -> Option<DecodeKernel> {
        if !self.options.group_decode_attention || dtype != KvDtype::Bf16 {
            return None;
        }
        let limit = self.info.shared_memory_per_block;
        if tensor_cores && self.options.tensor_core_decode_attention {
            let mma = decode_mma_kernel_for_shape(head_dim, group)
                .filter(|kernel| kernel.shared_memory_bytes <= limit);
            if let Some(kernel) = mma {
                if self.note_kernel_choice(("tensor-core decode attention", head_dim, group)) {
                    tracing::info!(
                        "decode attention, head_dim {head_dim}, {group} q heads per kv head: {}",
                        kernel.segment
                    );
                }
                return Some(kernel);
            }
        }
        let kernel = decode_kernel_for_shape(head_dim, group);
        let fitting = kernel.filter(|kernel| kernel.shared_memory_bytes <= limit);
        if self.note_kernel_choice(("decode attention", head_dim, group)) {
            match (kernel, fitting) {
                (Some(kernel), Some(_)) => tracing::info!(
                    "decode attention, head_dim {head_dim}, {group} q heads per kv head: {}",
                    kernel.segment
                ),
                (Some(kernel), None) => tracing::info!(
                    "decode attention, head_dim {head_dim}, {group} q heads per kv head: the split kernel ({} needs {} bytes; the limit is {limit} bytes of shared memory per block)",
                    kernel.segment,
                    kernel.shared_memory_bytes
                ),
                (None, _) => tracing::info!(
                    "decode attention, head_dim {head_dim}, {group} q heads per kv head: the split kernel (no kernel with the heads across the lanes serves this shape)"
                ),
            }
        }
        fitting
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::{kernel_define, KERNEL_SOURCES};

    #[test]
    fn constants_match_the_kernel_file() {
        let define = |name| kernel_define("attention_decode", name);
        assert_eq!(i64::from(DECODE_THREADS), define("DECODE_THREADS"));
        assert_eq!(DECODE_WARPS as i64, define("DECODE_WARPS"));
        assert_eq!(DECODE_TILE_BYTES as i64, define("DECODE_TILE_BYTES"));
        assert_eq!(define("DECODE_WARPS") * 32, define("DECODE_THREADS"));
        assert_eq!(DECODE_MMA_WARPS as i64, define("DM_WARPS"));
        assert_eq!(DECODE_MMA_WARPS_256 as i64, define("DM_WARPS_256"));
        assert_eq!(DECODE_MMA_KEYS as i64, define("DM_KEYS"));
        assert_eq!(DECODE_MMA_PAD as i64, define("DM_PAD"));
    }

    /// Every shape the host may pick is instantiated in the file and listed for loading, and
    /// every instantiation is reachable.
    #[test]
    fn every_shape_is_a_kernel_of_the_file() {
        let file = KERNEL_SOURCES
            .iter()
            .find(|source| source.name == "attention_decode")
            .expect("attention_decode is a kernel file");
        for (hd, dpl, segment, batched) in DECODE_SHAPES {
            assert!(
                file.source
                    .contains(&format!("// DECODE_KERNELS({hd}, {dpl})")),
                "{hd}/{dpl}"
            );
            assert!(file.functions.contains(&segment), "{segment}");
            assert!(file.functions.contains(&batched), "{batched}");
            assert_eq!(segment, format!("attention_decode_bf16_{hd}_{dpl}"));
            assert_eq!(batched, format!("attention_decode_batched_bf16_{hd}_{dpl}"));
        }
        for (hd, segment, batched) in DECODE_MMA_HEAD_DIMS {
            assert!(
                file.source
                    .contains(&format!("// DECODE_MMA_KERNELS({hd})")),
                "{hd}"
            );
            assert!(file.functions.contains(&segment), "{segment}");
            assert!(file.functions.contains(&batched), "{batched}");
            assert_eq!(segment, format!("attention_decode_mma_bf16_{hd}"));
            assert_eq!(batched, format!("attention_decode_mma_batched_bf16_{hd}"));
        }
        assert_eq!(
            file.functions.len(),
            2 * DECODE_SHAPES.len() + 2 * DECODE_MMA_HEAD_DIMS.len()
        );
    }

    #[test]
    fn tensor_core_decode_serves_groups_up_to_sixteen() {
        // Qwen3-30B-A3B (128, 8); Qwen3-Next / Qwen3.5 / 3.6 (256, 8), which the lanes kernels
        // leave to the split kernel; Qwen3-235B-A22B (128, 16).
        for (hd, group) in [(128, 8), (256, 8), (128, 16), (64, 4), (256, 1)] {
            let kernel = decode_mma_kernel_for_shape(hd, group).expect("a kernel");
            assert_eq!(kernel.segment, format!("attention_decode_mma_bf16_{hd}"));
            let warps = if hd == 256 {
                DECODE_MMA_WARPS_256
            } else {
                DECODE_MMA_WARPS
            };
            assert_eq!(kernel.chunks_per_block, warps);
            assert_eq!(kernel.threads as usize, 32 * warps);
            // Within an RTX card's 99 KB per block.
            assert!(
                kernel.shared_memory_bytes <= 99 * 1024,
                "{hd}: {}",
                kernel.shared_memory_bytes
            );
        }
        assert_eq!(decode_mma_kernel_for_shape(128, 32), None);
        assert_eq!(decode_mma_kernel_for_shape(96, 8), None);
        assert_eq!(decode_mma_kernel_for_shape(128, 0), None);
        // Chunk blocks: the last block's spare warps skip (c >= chunks).
        let kernel = decode_mma_kernel_for_shape(128, 8).expect("a kernel");
        assert_eq!(kernel.config(129, 4, 2).grid_dim, (33, 4, 2));
    }

    #[test]
    fn shapes_of_the_released_models_have_a_kernel() {
        // (head_dim, group): Qwen3-30B-A3B, a group of 6 (the lanes of 8), small groups.
        for (hd, group, dpl) in [
            (128, 8, 32),
            (128, 6, 32),
            (128, 4, 16),
            (256, 4, 32),
            (64, 16, 32),
        ] {
            let kernel = decode_kernel_for_shape(hd, group).expect("a kernel");
            assert_eq!(kernel.segment, format!("attention_decode_bf16_{hd}_{dpl}"));
            // Within an RTX card's 99 KB per block.
            assert!(kernel.shared_memory_bytes <= 99 * 1024);
        }
        // 64 dims per lane or more (Qwen3-235B-A22B's group of 16, Qwen3-Next / Qwen3.5 / 3.6's
        // head dim 256 with 8), or a head dim the lanes do not divide: the split kernel.
        assert_eq!(decode_kernel_for_shape(128, 16), None);
        assert_eq!(decode_kernel_for_shape(256, 8), None);
        assert_eq!(decode_kernel_for_shape(256, 16), None);
        assert_eq!(decode_kernel_for_shape(96, 8), None);
        assert_eq!(decode_kernel_for_shape(128, 64), None);
        assert_eq!(decode_kernel_for_shape(128, 0), None);
    }
}
