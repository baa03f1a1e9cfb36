//! GPU expert slots: the buffer that holds one MoE layer's resident routed experts, its
//! expert → slot table, and the page-locked source banks their fills copy from.
//!
//! Owns: the slot buffer (`slots × stride` bytes, each slot one expert exactly as its bank
//! stores it, so bf16 / int8 / int4 stay in their stored form and are dequantized in the
//! kernel), the expert → slot table on the GPU with its host mirror, page-locking the source
//! banks (`cuMemHostRegister`, read-only, on the artifact's shared file mapping) so slot fills
//! are asynchronous DMA, and the start-up fill of one slot. The slot buffer and the table's
//! device buffer are allocated once and only ever written in place (a captured CUDA graph holds
//! their addresses). Background fills are `expert_fills.rs`, the launches `experts.rs`.
//! Must not touch: which experts go to slots (the model's placement), the kernels, routing.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use super::{driver_error, CudaBackend};
use crate::backend::cuda::CudaError;
use crate::backend::{expert_bytes, slot_out_of_range, ExpertSlotTable, WithExpertSlotTable};
use crate::error::EngineError;

/// A host range pinned with `cuMemHostRegister`, unpinned on drop.
struct PinnedRange {
    context: Arc<CudaContext>,
    start: *mut std::ffi::c_void,
    /// Registered by this range (unregistered on drop), or found already registered by another
    /// slot set of the same bank (the prefill staging slots share the resident slots' banks).
    owned: bool,
    /// The range's start in the device's address space, where it is mapped for kernels to read
    /// ([`MappedCopy`] fills).
    device_start: Option<u64>,
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
        if self.owned && self.context.bind_to_thread().is_ok() {
            // SAFETY: `start` is exactly the address a successful cuMemHostRegister took.
            unsafe {
                let _ = cudarc::driver::sys::cuMemHostUnregister(self.start);
            }
        }
    }
}

/// The kernel that copies an expert from its mapped bank into a slot (`mapped_copy` in
/// kernels/handoff.cu) and its block count: fills paced by the kernel instead of DMA.
#[derive(Clone, Copy)]
pub(super) struct MappedCopy {
    pub(super) function: cudarc::driver::sys::CUfunction,
    pub(super) blocks: u32,
}

// SAFETY: a CUfunction is a handle valid in every thread while its module is loaded; the
// backend, which keeps the modules, outlives every fill (the model holds both).
unsafe impl Send for MappedCopy {}
// SAFETY: as above; the handle is only passed to launches.
unsafe impl Sync for MappedCopy {}

/// Experts of one MoE layer in GPU memory. See the module doc.
pub struct CudaExpertSlots {
    pub(super) layout: ExpertLayout,
    pub(super) storage: CudaSlice<u8>,
    /// The GPU copy of `slot_table` ([`ExpertSlotTable::slot_entries`]), read by the kernels.
    pub(super) table: CudaSlice<i32>,
    pub(super) slot_table: ExpertSlotTable,
    /// Banks pinned for DMA (by bank prefix), or `None` when pinning failed (copies then go
    /// through the driver's staging buffer, synchronously).
    pinned: Vec<(String, Option<PinnedRange>)>,
    /// Artifacts whose bytes asynchronous copies read: kept alive as long as the slots.
    pub(super) sources: Vec<Arc<Artifact>>,
    pub(super) stream: Arc<CudaStream>,
    /// The stream of background fills (`crate::backend::ExpertSlotFills`), made at the first one.
    pub(super) copy_stream: Option<Arc<CudaStream>>,
    /// Background fills started and not yet in the table, a batch per start: (slot, expert)
    /// pairs and the event after the batch's last copy.
    pub(super) fills_in_flight: Vec<(Vec<(usize, usize)>, CudaEvent)>,
    /// Batch fills (layerwise prefill) started and not yet in the table, oldest first: first
    /// slot, experts, the event after the batch's last copy.
    pub(super) batch_fills: std::collections::VecDeque<(usize, Vec<usize>, CudaEvent)>,
    /// Page-locked copy of the host table that table uploads read (an asynchronous copy, where
    /// one from pageable memory would make the host wait for the stream), made at the first.
    pub(super) table_staging: Option<cudarc::driver::PinnedHostSlice<i32>>,
    /// Recorded after the last upload from `table_staging`: the staging is rewritten only once
    /// it has landed.
    pub(super) table_uploaded: Option<CudaEvent>,
    /// Events whose waits are queued, kept to be recorded again: the cache records three per
    /// layer and step, and creating and destroying each costs the host two driver calls.
    pub(super) spare_events: Vec<CudaEvent>,
    /// Background fills by a kernel reading the mapped bank (`None`: DMA copies).
    pub(super) mapped_copy: Option<MappedCopy>,
}

impl Drop for CudaExpertSlots {
    fn drop(&mut self) {
        // A copy still in flight must land before its source is unpinned and unmapped.
        if let Some(copy_stream) = &self.copy_stream {
            let _ = copy_stream.synchronize();
        }
        let _ = self.stream.synchronize();
    }
}

impl CudaExpertSlots {
    /// The device address of the expert → slot table the kernels read (updated in place, so
    /// a recorded step graph reads the current table).
    pub(super) fn device_table_address(&self, stream: &CudaStream) -> u64 {
        self.table.device_ptr(stream).0
    }

    /// Pins `bank` and remembers `artifact` as a copy source; whether the bank is page-locked.
    pub(super) fn ready_source(
        &mut self,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<bool, CudaError> {
        // The raw driver calls (register, async copy) need the context on this thread.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        let stream = Arc::clone(&self.stream);
        pin_bank(&stream, self, artifact, bank);
        if !self
            .sources
            .iter()
            .any(|known| Arc::ptr_eq(known, artifact))
        {
            self.sources.push(Arc::clone(artifact));
        }
        Ok(self
            .pinned
            .iter()
            .any(|(prefix, range)| *prefix == bank.prefix && range.is_some()))
    }

    /// Where `bank`'s pinned range starts on the host and in the device's address space, when
    /// fills go through [`MappedCopy`] and the bank is mapped.
    pub(super) fn mapped_bank(&self, bank: &ExpertBank) -> Option<(usize, u64)> {
        self.mapped_copy?;
        self.pinned.iter().find_map(|(prefix, range)| {
            let range = range.as_ref().filter(|_| *prefix == bank.prefix)?;
            Some((range.start as usize, range.device_start?))
        })
    }
}

impl WithExpertSlotTable for CudaExpertSlots {
    fn slot_table(&self) -> &ExpertSlotTable {
        &self.slot_table
    }
}

impl CudaExpertSlots {
    /// GPU bytes of the slot buffer.
    pub fn device_bytes(&self) -> usize {
        self.slot_table.slot_count() * self.layout.stride
    }

    /// Whether fills of the banks seen so far are DMA from page-locked memory.
    pub fn banks_pinned(&self) -> bool {
        !self.pinned.is_empty() && self.pinned.iter().all(|(_, range)| range.is_some())
    }
}

/// [`CudaBackend::pin_bank`] for slots of the context of `stream`.
fn pin_bank(
    stream: &Arc<CudaStream>,
    slots: &mut CudaExpertSlots,
    artifact: &Arc<Artifact>,
    bank: &ExpertBank,
) {
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
    let length =
        usize::try_from(bank.num_experts.saturating_mul(bank.expert_stride)).unwrap_or(usize::MAX);
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
        // Mapped into the device's address space too when a kernel copies the fills.
        let flags = match slots.mapped_copy {
            Some(_) => {
                cudarc::driver::sys::CU_MEMHOSTREGISTER_READ_ONLY
                    | cudarc::driver::sys::CU_MEMHOSTREGISTER_DEVICEMAP
            }
            None => cudarc::driver::sys::CU_MEMHOSTREGISTER_READ_ONLY,
        };
        // SAFETY: [pointer, pointer + length) lies inside the live mapping (checked above);
        // READ_ONLY because the mapping is read-only (the device only reads from it).
        let status = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(pointer, length, flags) };
        let already =
            status == cudarc::driver::sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        if status == cudarc::driver::sys::CUresult::CUDA_SUCCESS || already {
            let mut device_start: cudarc::driver::sys::CUdeviceptr = 0;
            // SAFETY: `pointer` is registered (just now or before); the driver writes the one
            // address. A range registered without the device mapping answers an error: DMA.
            let mapped = slots.mapped_copy.is_some()
                && unsafe {
                    cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device_start, pointer, 0)
                } == cudarc::driver::sys::CUresult::CUDA_SUCCESS;
            Some(PinnedRange {
                context: Arc::clone(stream.context()),
                start: pointer,
                owned: !already,
                device_start: mapped.then_some(device_start),
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

impl CudaBackend {
    /// `(free, total)` bytes of GPU memory now (`cuMemGetInfo`); with
    /// [`CudaOptions::memory_cap_bytes`](super::CudaOptions::memory_cap_bytes), as if the GPU
    /// had only that much (what is in use counts against the cap).
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        let (free, total) = cudarc::driver::result::mem_get_info()
            .map_err(driver_error("reading free GPU memory"))?;
        Ok(match self.info.memory_cap_bytes {
            Some(cap) => super::options::capped_memory(
                free,
                total,
                usize::try_from(cap).unwrap_or(usize::MAX),
            ),
            None => (free, total),
        })
    }

    pub(super) fn allocate_expert_slots(
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
                "allocating {slots} expert slots ({bytes} bytes, {:.1} MiB)",
                bytes as f64 / (1 << 20) as f64
            )))?;
        let empty = vec![-1i32; num_experts.max(1)];
        let table = self
            .stream
            .memcpy_stod(&empty)
            .map_err(driver_error("copying the expert slot table"))?;
        Ok(CudaExpertSlots {
            layout: *layout,
            storage,
            table,
            slot_table: ExpertSlotTable::new(num_experts, slots),
            pinned: Vec::new(),
            sources: Vec::new(),
            stream: Arc::clone(&self.stream),
            copy_stream: None,
            fills_in_flight: Vec::new(),
            batch_fills: Default::default(),
            table_staging: None,
            table_uploaded: None,
            spare_events: Vec::new(),
            mapped_copy: match self.options.fill_copy_blocks {
                0 => None,
                blocks => Some(MappedCopy {
                    function: self.function("mapped_copy")?.function,
                    blocks,
                }),
            },
        })
    }

    /// Page-locks `bank`'s bytes in `artifact`'s mapping, once per bank; a failure is logged
    /// and remembered (copies from that bank then go through pageable memory).
    pub(super) fn pin_bank(
        &self,
        slots: &mut CudaExpertSlots,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) {
        pin_bank(&self.stream, slots, artifact, bank)
    }

    pub(super) fn copy_expert_into_slot(
        &self,
        slots: &mut CudaExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        let device = |source| EngineError::Device {
            op: "fill_expert_slot",
            source,
        };
        let source = expert_bytes(artifact, bank, expert, &slots.layout)?;
        slots
            .slot_table
            .check(slot, expert)
            .map_err(slot_out_of_range)?;
        // The raw driver calls below (register, async copy) need the context on this thread;
        // cudarc's safe calls bind it themselves.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))
            .map_err(device)?;
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
        let storage = &mut slots.storage;
        let mut destination = storage.slice_mut(slot * stride..(slot + 1) * stride);
        if pinned {
            let (pointer, _record) = destination.device_ptr_mut(&self.stream);
            // SAFETY: `source` is page-locked and lives in an artifact mapping that `slots`
            // keeps alive (`sources`) until the slots are dropped, after any queued copy; the
            // destination range is inside the slot buffer.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(pointer, source, self.stream.cu_stream())
            }
            .map_err(driver_error("copying an expert into its GPU slot"))
            .map_err(device)?;
        } else {
            self.stream
                .memcpy_htod(source, &mut destination)
                .map_err(driver_error("copying an expert into its GPU slot"))
                .map_err(device)?;
        }
        slots
            .slot_table
            .assign(slot, expert)
            .map_err(slot_out_of_range)?;
        self.stream
            .memcpy_htod(slots.slot_table.slot_entries(), &mut slots.table)
            .map_err(driver_error("updating the expert slot table"))
            .map_err(device)?;
        Ok(())
    }
}
