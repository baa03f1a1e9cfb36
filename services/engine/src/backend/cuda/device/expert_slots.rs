//! GPU expert slots: routed experts of one MoE layer resident in GPU memory, computed by
//! `kernels/experts.cu`.
//!
//! Owns: the slot buffer (`slots × stride` bytes, each slot one expert exactly as its bank
//! stores it, so bf16 / int8 / int4 stay in their stored form and are dequantized in the
//! kernel), the expert → slot table on the GPU with its host mirror, page-locking the source
//! banks (`cuMemHostRegister`, read-only, on the artifact's shared file mapping) so slot fills
//! are asynchronous DMA, and the three launches of a layer's slotted experts.
//! Must not touch: which experts go to slots (the model's placement), routing, the CPU side.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_expert_kernels::{ExpertLayout, WeightDType};

use super::{driver_error, elementwise, int, present, present_mut, CudaBackend, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::Routing;
use crate::backend::{expert_bytes, slot_out_of_range};

/// Warps per block of `expert_gate_up` / `expert_down`: one output row per warp.
const EXPERT_WARPS: u32 = 8;
/// Pairs (token × choice) per launch: the grid's y dimension is limited to 65 535, and the
/// per-pair scratch (`pairs × (hidden + intermediate)` floats) stays bounded at prefill.
const MAX_PAIRS_PER_LAUNCH: usize = 16_384;

/// A host range pinned with `cuMemHostRegister`, unpinned on drop.
struct PinnedRange {
    context: Arc<CudaContext>,
    start: *mut std::ffi::c_void,
    // Keeps the mapping the range lies in alive while it is registered.
    _artifact: Arc<Artifact>,
}

// SAFETY: the pointer is an address inside the artifact's mapping, used only as a token for
// cuMemHostUnregister; the mapping is immutable and kept alive by `_artifact`.
unsafe impl Send for PinnedRange {}
// SAFETY: as above; nothing reads or writes through the pointer.
unsafe impl Sync for PinnedRange {}

impl Drop for PinnedRange {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: `start` is exactly the address a successful cuMemHostRegister took.
            unsafe {
                let _ = cudarc::driver::sys::cuMemHostUnregister(self.start);
            }
        }
    }
}

/// Experts of one MoE layer in GPU memory. See the module doc.
pub struct CudaExpertSlots {
    layout: ExpertLayout,
    num_experts: usize,
    slot_count: usize,
    storage: Option<CudaSlice<u8>>,
    /// Expert → slot (−1: not resident), read by the kernels.
    table: Option<CudaSlice<i32>>,
    slot_of_expert: Vec<i32>,
    expert_in_slot: Vec<Option<usize>>,
    /// Banks pinned for DMA (by bank prefix), or `None` when pinning failed (copies then go
    /// through the driver's staging buffer, synchronously).
    pinned: Vec<(String, Option<PinnedRange>)>,
    /// Artifacts whose bytes asynchronous copies read: kept alive as long as the slots.
    sources: Vec<Arc<Artifact>>,
    stream: Arc<CudaStream>,
}

impl Drop for CudaExpertSlots {
    fn drop(&mut self) {
        // A copy still in flight must land before its source is unpinned and unmapped.
        let _ = self.stream.synchronize();
    }
}

impl CudaExpertSlots {
    /// The slot holding `expert`, if any.
    pub fn slot_of(&self, expert: usize) -> Option<usize> {
        self.slot_of_expert
            .get(expert)
            .and_then(|&slot| usize::try_from(slot).ok())
    }

    /// GPU bytes of the slot buffer.
    pub fn device_bytes(&self) -> usize {
        self.slot_count * self.layout.stride
    }

    /// Whether fills of the banks seen so far are DMA from page-locked memory.
    pub fn banks_pinned(&self) -> bool {
        !self.pinned.is_empty() && self.pinned.iter().all(|(_, range)| range.is_some())
    }
}

fn dtype_code(dtype: WeightDType) -> i32 {
    // DTYPE_* in kernels/experts.cu.
    match dtype {
        WeightDType::F32 => 0,
        WeightDType::Bf16 => 1,
        WeightDType::Int8 => 2,
        WeightDType::Int4 => 3,
    }
}

fn long(value: usize) -> i64 {
    // Byte offsets of an expert are far below 2^63.
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl CudaBackend {
    /// `(free, total)` bytes of GPU memory now (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        cudarc::driver::result::mem_get_info().map_err(driver_error("reading free GPU memory"))
    }

    pub(super) fn try_new_expert_slots(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<CudaExpertSlots, CudaError> {
        let bytes = slots
            .checked_mul(layout.stride)
            .ok_or_else(|| CudaError::Invalid {
                problem: format!("{slots} expert slots of {} bytes overflow", layout.stride),
            })?;
        let storage = self
            .stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(driver_error(format!(
                "allocating {slots} expert slots ({:.1} MiB)",
                bytes as f64 / (1 << 20) as f64
            )))?;
        let empty = vec![-1i32; num_experts.max(1)];
        let table = self
            .stream
            .memcpy_stod(&empty)
            .map_err(driver_error("copying the expert slot table"))?;
        Ok(CudaExpertSlots {
            layout: *layout,
            num_experts,
            slot_count: slots,
            storage: Some(storage),
            table: Some(table),
            slot_of_expert: vec![-1; num_experts],
            expert_in_slot: vec![None; slots],
            pinned: Vec::new(),
            sources: Vec::new(),
            stream: Arc::clone(&self.stream),
        })
    }

    /// Page-locks `bank`'s bytes in `artifact`'s mapping, once per bank; a failure is logged
    /// and remembered (copies from that bank then go through pageable memory).
    fn pin_bank(&self, slots: &mut CudaExpertSlots, artifact: &Arc<Artifact>, bank: &ExpertBank) {
        if slots
            .pinned
            .iter()
            .any(|(prefix, _)| *prefix == bank.prefix)
        {
            return;
        }
        let bytes = artifact.bytes();
        let page = 4096usize;
        let start = usize::try_from(bank.offset).unwrap_or(usize::MAX);
        let length = usize::try_from(bank.num_experts.saturating_mul(bank.expert_stride))
            .unwrap_or(usize::MAX);
        let range = match start.checked_add(length) {
            Some(end) if end <= bytes.len() && length > 0 => {
                let aligned_start = start / page * page;
                let aligned_end = end.next_multiple_of(page).min(bytes.len());
                Some((aligned_start, aligned_end - aligned_start))
            }
            _ => None,
        };
        let pinned = range.and_then(|(offset, length)| {
            let pointer = bytes[offset..].as_ptr() as *mut std::ffi::c_void;
            // SAFETY: [pointer, pointer + length) lies inside the live mapping (checked above);
            // READ_ONLY because the mapping is read-only (the device only reads from it).
            let status = unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(
                    pointer,
                    length,
                    cudarc::driver::sys::CU_MEMHOSTREGISTER_READ_ONLY,
                )
            };
            if status == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                Some(PinnedRange {
                    context: Arc::clone(self.stream.context()),
                    start: pointer,
                    _artifact: Arc::clone(artifact),
                })
            } else {
                tracing::warn!(
                    bank = %bank.prefix,
                    "cuMemHostRegister (read-only) of {:.1} MiB failed ({status:?}); expert slot fills from this bank are synchronous copies",
                    length as f64 / (1 << 20) as f64
                );
                None
            }
        });
        slots.pinned.push((bank.prefix.clone(), pinned));
    }

    pub(super) fn try_fill_expert_slot(
        &self,
        slots: &mut CudaExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), CudaError> {
        let source = expert_bytes(artifact, bank, expert, &slots.layout).map_err(|error| {
            CudaError::Invalid {
                problem: error.to_string(),
            }
        })?;
        if slot >= slots.slot_count || expert >= slots.num_experts {
            return Err(CudaError::Invalid {
                problem: slot_out_of_range(slot, expert, slots.slot_count, slots.num_experts)
                    .to_string(),
            });
        }
        // The raw driver calls below (register, async copy) need the context on this thread;
        // cudarc's safe calls bind it themselves.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        self.pin_bank(slots, artifact, bank);
        if !slots
            .sources
            .iter()
            .any(|known| Arc::ptr_eq(known, artifact))
        {
            slots.sources.push(Arc::clone(artifact));
        }
        let pinned = slots
            .pinned
            .iter()
            .any(|(prefix, range)| *prefix == bank.prefix && range.is_some());
        let stride = slots.layout.stride;
        let storage = present_mut(&mut slots.storage)?;
        let mut destination = storage.slice_mut(slot * stride..(slot + 1) * stride);
        if pinned {
            let (pointer, _record) = destination.device_ptr_mut(&self.stream);
            // SAFETY: `source` is page-locked and lives in an artifact mapping that `slots`
            // keeps alive (`sources`) until the slots are dropped, after any queued copy; the
            // destination range is inside the slot buffer.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(pointer, source, self.stream.cu_stream())
            }
            .map_err(driver_error("copying an expert into its GPU slot"))?;
        } else {
            self.stream
                .memcpy_htod(source, &mut destination)
                .map_err(driver_error("copying an expert into its GPU slot"))?;
        }
        if let Some(previous) = slots.expert_in_slot[slot] {
            slots.slot_of_expert[previous] = -1;
        }
        if let Some(old_slot) = slots.slot_of(expert) {
            slots.expert_in_slot[old_slot] = None;
        }
        slots.slot_of_expert[expert] = slot as i32;
        slots.expert_in_slot[slot] = Some(expert);
        let table = present_mut(&mut slots.table)?;
        self.stream
            .memcpy_htod(&slots.slot_of_expert, table)
            .map_err(driver_error("updating the expert slot table"))?;
        Ok(())
    }

    pub(super) fn try_slotted_experts(
        &self,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        routing: &Routing,
    ) -> Result<CudaTensor, CudaError> {
        let layout = &slots.layout;
        let (hidden, intermediate) = (layout.hidden, layout.intermediate);
        let tokens = x.rows;
        let k = routing.experts_per_token;
        let mut out = self.output(tokens, x.cols)?;
        if x.cols != hidden
            || k == 0
            || tokens == 0
            || routing.expert_ids.len() != tokens * k
            || routing.weights.len() != tokens * k
        {
            // Same contract as the CPU backend: an inconsistent call leaves zeros.
            return Ok(out);
        }
        // Nothing resident for this batch: skip the launches (the common case at decode when
        // the slots hold few experts).
        if !routing
            .expert_ids
            .iter()
            .any(|&id| slots.slot_of(id as usize).is_some())
        {
            return Ok(out);
        }
        let input = present(&x.data)?;
        let storage = present(&slots.storage)?;
        let table = present(&slots.table)?;
        let chunk_tokens = (MAX_PAIRS_PER_LAUNCH / k).max(1);
        let chunk_pairs = chunk_tokens.min(tokens) * k;
        let mut activated = self.alloc(chunk_pairs * intermediate)?;
        let mut pair_out = self.alloc(chunk_pairs * hidden)?;
        let (hidden_arg, intermediate_arg) =
            (int(hidden, "hidden")?, int(intermediate, "intermediate")?);
        let (top_k, num_experts) = (int(k, "top-k")?, int(slots.num_experts, "experts")?);
        let stride = long(layout.stride);
        let dtype = dtype_code(layout.dtype);
        let gate_up_scales = long(layout.gate_up.scales_offset);
        let down_offset = long(layout.down_offset);
        let down_scales = long(layout.down.scales_offset);
        let output = present_mut(&mut out.data)?;
        let mut first = 0;
        while first < tokens {
            let count = chunk_tokens.min(tokens - first);
            let pairs = count * k;
            let ids = self.upload_u32(&routing.expert_ids[first * k..(first + count) * k])?;
            let weights = self.upload_f32(&routing.weights[first * k..(first + count) * k])?;
            let x_chunk = input.slice(first * hidden..(first + count) * hidden);
            let pairs_arg = u32::try_from(pairs).map_err(|_| CudaError::Invalid {
                problem: format!("{pairs} expert pairs in one launch"),
            })?;
            let gate_up_config = LaunchConfig {
                grid_dim: ((intermediate as u32).div_ceil(EXPERT_WARPS), pairs_arg, 1),
                block_dim: (32 * EXPERT_WARPS, 1, 1),
                shared_mem_bytes: (hidden * 4) as u32,
            };
            launch!(self, "expert_gate_up", gate_up_config;
                storage, table, &ids, &x_chunk, &mut activated, &top_k, &num_experts,
                &hidden_arg, &intermediate_arg, &stride, &dtype, &gate_up_scales)?;
            let down_config = LaunchConfig {
                grid_dim: ((hidden as u32).div_ceil(EXPERT_WARPS), pairs_arg, 1),
                block_dim: (32 * EXPERT_WARPS, 1, 1),
                shared_mem_bytes: (intermediate * 4) as u32,
            };
            launch!(self, "expert_down", down_config;
                storage, table, &ids, &weights, &activated, &mut pair_out, &num_experts,
                &hidden_arg, &intermediate_arg, &stride, &dtype, &down_offset, &down_scales)?;
            let mut out_chunk = output.slice_mut(first * hidden..(first + count) * hidden);
            let count_arg = int(count, "tokens")?;
            launch!(self, "expert_pair_sum", elementwise(count * hidden);
                &pair_out, &mut out_chunk, &count_arg, &top_k, &hidden_arg)?;
            first += count;
        }
        Ok(out)
    }
}
