//! Background fills of GPU expert slots (the dynamic expert cache and layerwise prefill's
//! staging slots): copies from the page-locked banks on the slots' own copy stream, ordered
//! after the kernels that may still read a slot's old expert, and the expert → slot table's
//! uploads, through a page-locked staging copy so the host never waits for the stream.
//!
//! Owns: [`ExpertSlotFills`] for [`CudaExpertSlots`] and the table upload. Must not touch: the
//! kernels, which experts are filled (the cache's policy), the start-up placement.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, DevicePtrMut};
use ninfer_artifact::{Artifact, ExpertBank};

use super::driver_error;
use super::expert_slots::CudaExpertSlots;
use crate::backend::cuda::CudaError;
use crate::backend::{
    expert_bytes, experts_copied_from_slots, slot_out_of_range, ExpertSlotFills, ExpertSlotTable,
};
use crate::error::EngineError;

/// Spare events kept per slot set: more than the three a cache's layer records per step.
const SPARE_EVENTS: usize = 8;

impl CudaExpertSlots {
    /// An event recorded on `stream` after the work queued so far: a spare one when there is
    /// one (recording it again does not affect the waits already queued on it).
    fn record_event_on(
        &mut self,
        stream: &CudaStream,
        what: &'static str,
    ) -> Result<CudaEvent, CudaError> {
        let event = match self.spare_events.pop() {
            Some(event) => event,
            None => stream
                .context()
                .new_event(None)
                .map_err(driver_error(what))?,
        };
        event.record(stream).map_err(driver_error(what))?;
        Ok(event)
    }

    /// Keeps `event` for a later [`CudaExpertSlots::record_event_on`] (every wait on it is
    /// queued or done).
    fn recycle_event(&mut self, event: CudaEvent) {
        if self.spare_events.len() < SPARE_EVENTS {
            self.spare_events.push(event);
        }
    }

    /// The table's device copy rewritten in place from the host table, on the compute stream
    /// (ordered between the kernels), from pageable memory: the driver first waits for the
    /// work queued on the stream. Layerwise prefill's batch fills use it (their uploads come a
    /// layer apart while the host runs ahead of the stream).
    fn upload_table(&mut self) -> Result<(), CudaError> {
        self.stream
            .memcpy_htod(self.slot_table.slot_entries(), &mut self.table)
            .map_err(driver_error("updating the expert slot table"))
    }

    /// [`CudaExpertSlots::upload_table`] through a page-locked staging copy: the host queues
    /// the copy and goes on. The dynamic cache's uploads come once per layer between two steps,
    /// so the previous upload from the staging copy has long landed when it is rewritten.
    fn upload_table_staged(&mut self) -> Result<(), CudaError> {
        // The previous upload must have read the staging before it is rewritten (it has, in
        // practice: it was queued a step ago).
        if let Some(uploaded) = self.table_uploaded.take() {
            uploaded
                .synchronize()
                .map_err(driver_error("waiting for the last slot table upload"))?;
            self.recycle_event(uploaded);
        }
        let entries = self.slot_table.slot_entries();
        if self.table_staging.is_none() {
            // SAFETY: written in full below before any copy reads it.
            let staging = unsafe { self.stream.context().alloc_pinned::<i32>(entries.len()) }
                .map_err(driver_error(
                    "allocating the expert slot table's staging copy",
                ))?;
            self.table_staging = Some(staging);
        }
        let Some(staging) = self.table_staging.as_mut() else {
            return Err(CudaError::Invalid {
                problem: "the slot table's staging copy is missing".into(),
            });
        };
        let staged = staging
            .as_mut_slice()
            .map_err(driver_error("writing the slot table's staging copy"))?;
        if staged.len() != entries.len() {
            return Err(CudaError::Invalid {
                problem: format!(
                    "the slot table has {} entries, its staging copy {}",
                    entries.len(),
                    staged.len()
                ),
            });
        }
        staged.copy_from_slice(entries);
        {
            let (pointer, _record) = self.table.device_ptr_mut(&self.stream);
            // SAFETY: the staging copy is page-locked, holds exactly the table's entries and is
            // not written again before `table_uploaded` (recorded right after) has completed;
            // the destination is the table's device buffer of the same length.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    pointer,
                    &*staged,
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver_error("updating the expert slot table"))?;
        }
        let stream = Arc::clone(&self.stream);
        let uploaded = self.record_event_on(&stream, "recording the slot table upload")?;
        self.table_uploaded = Some(uploaded);
        Ok(())
    }

    /// The copy stream of background and batch fills, made at the first one.
    pub(super) fn fill_stream(&mut self) -> Result<Arc<CudaStream>, CudaError> {
        if let Some(stream) = &self.copy_stream {
            return Ok(Arc::clone(stream));
        }
        let stream = self
            .stream
            .context()
            .new_stream()
            .map_err(driver_error("creating the expert fill stream"))?;
        self.copy_stream = Some(Arc::clone(&stream));
        Ok(stream)
    }

    fn batch_fill(
        &mut self,
        first_slot: usize,
        experts: &[usize],
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), CudaError> {
        let pairs = experts
            .iter()
            .enumerate()
            .map(|(offset, &expert)| (first_slot + offset, expert));
        let sources = self.checked_sources(pairs, artifact, bank)?;
        let pinned = self.ready_source(artifact, bank)?;
        let copy_stream = self.fill_stream()?;
        // No table upload here: the caller computes nothing with these slots before the
        // batch completes, and that upload, on the compute stream, carries this change too.
        for slot in first_slot..first_slot + experts.len() {
            self.slot_table.clear(slot);
        }
        // One ordering point for the whole batch: after every kernel queued so far (the
        // previous layer that used these slots among them).
        let copies = sources
            .into_iter()
            .enumerate()
            .map(|(offset, source)| (first_slot + offset, source));
        // Batch fills stream a layer's experts at the bus's full rate: DMA.
        let landed = self.copy_behind_queued_work(&copy_stream, pinned, None, copies)?;
        self.batch_fills
            .push_back((first_slot, experts.to_vec(), landed));
        Ok(())
    }

    /// Starts the copies of `fills` ((slot, expert) pairs) on the copy stream: their slots
    /// leave the table (one upload for all of them, after the fills completed just before are
    /// entered), and the copies wait for every kernel queued so far (they may read the slots'
    /// old experts) behind one event; one event after the last copy.
    fn background_fills(
        &mut self,
        fills: &[(usize, usize)],
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), CudaError> {
        let sources = self.checked_sources(fills.iter().copied(), artifact, bank)?;
        let pinned = self.ready_source(artifact, bank)?;
        let copy_stream = self.fill_stream()?;
        for &(slot, expert) in fills {
            self.slot_table.clear(slot);
            if let Some(old_slot) = self.slot_table.slot_of(expert) {
                self.slot_table.clear(old_slot);
            }
        }
        self.upload_table_staged()?;
        if fills.is_empty() {
            return Ok(());
        }
        let copies = fills.iter().map(|&(slot, _)| slot).zip(sources);
        let mapped = self.mapped_bank(bank);
        let landed = self.copy_behind_queued_work(&copy_stream, pinned, mapped, copies)?;
        self.fills_in_flight.push((fills.to_vec(), landed));
        Ok(())
    }

    /// The bank bytes of each (slot, expert) pair, each pair checked against the table.
    fn checked_sources<'a>(
        &self,
        pairs: impl Iterator<Item = (usize, usize)>,
        artifact: &'a Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<Vec<&'a [u8]>, CudaError> {
        let invalid = |problem: String| CudaError::Invalid { problem };
        pairs
            .map(|(slot, expert)| {
                let bytes = expert_bytes(artifact, bank, expert, &self.layout)
                    .map_err(|error| invalid(error.to_string()))?;
                self.slot_table
                    .check(slot, expert)
                    .map_err(|error| invalid(error.to_string()))?;
                Ok(bytes)
            })
            .collect()
    }

    /// Copies each (slot, bytes) of `copies` into its slot on `copy_stream`, all behind one
    /// event recorded on the compute stream after the work queued so far (which may still read
    /// the slots' old experts); returns the event after the last copy. `pinned`: the bytes are
    /// page-locked (asynchronous DMA), else the driver stages them. `mapped`: the bank's pinned
    /// range's host and device starts, when a [`MappedCopy`] kernel copies instead of DMA.
    ///
    /// [`MappedCopy`]: super::expert_slots::MappedCopy
    fn copy_behind_queued_work<'a>(
        &mut self,
        copy_stream: &Arc<CudaStream>,
        pinned: bool,
        mapped: Option<(usize, u64)>,
        copies: impl Iterator<Item = (usize, &'a [u8])>,
    ) -> Result<CudaEvent, CudaError> {
        let stream = Arc::clone(&self.stream);
        let queued = self.record_event_on(&stream, "recording the expert copies' start")?;
        copy_stream
            .wait(&queued)
            .map_err(driver_error("ordering the expert copies"))?;
        self.recycle_event(queued);
        let stride = self.layout.stride;
        let kernel = self.mapped_copy.zip(mapped).filter(|_| pinned);
        for (slot, source) in copies {
            let mut destination = self.storage.slice_mut(slot * stride..(slot + 1) * stride);
            if let Some((copy, (host_start, device_start))) = kernel {
                let (pointer, _record) = destination.device_ptr_mut(copy_stream);
                let offset = (source.as_ptr() as usize).checked_sub(host_start);
                let from = offset.map(|offset| device_start + offset as u64);
                // 16-byte pieces: both ends aligned and the length whole, else DMA below.
                if let Some(from) = from
                    .filter(|from| from % 16 == 0 && pointer % 16 == 0 && source.len() % 16 == 0)
                {
                    launch_mapped_copy(copy, from, pointer, source.len() / 16, copy_stream)?;
                    continue;
                }
            }
            if pinned {
                let (pointer, _record) = destination.device_ptr_mut(copy_stream);
                // SAFETY: `source` is page-locked and lives in an artifact mapping the slots
                // keep alive (`sources`) until they are dropped, after the copy stream is
                // synchronized; the destination range is inside the slot buffer.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        pointer,
                        source,
                        copy_stream.cu_stream(),
                    )
                }
                .map_err(driver_error("copying an expert into its GPU slot"))?;
            } else {
                copy_stream
                    .memcpy_htod(source, &mut destination)
                    .map_err(driver_error("copying an expert into its GPU slot"))?;
            }
        }
        self.record_event_on(copy_stream, "recording the expert copies' end")
    }

    /// Enters every started fill in the host table; the compute stream waits for their copies
    /// (the host does not). The device table is the caller's to upload.
    fn enter_landed_fills(&mut self) -> Result<(), EngineError> {
        for (fills, landed) in std::mem::take(&mut self.fills_in_flight) {
            self.stream
                .wait(&landed)
                .map_err(driver_error("waiting for expert fills"))
                .map_err(|source| EngineError::Device {
                    op: "complete_fills",
                    source,
                })?;
            self.recycle_event(landed);
            for (slot, expert) in fills {
                self.slot_table
                    .assign(slot, expert)
                    .map_err(slot_out_of_range)?;
            }
        }
        Ok(())
    }
}

/// One [`MappedCopy`] launch on `stream`: `pieces` 16-byte pieces from the mapped bank address
/// `from` to the slot address `to`.
///
/// [`MappedCopy`]: super::expert_slots::MappedCopy
fn launch_mapped_copy(
    copy: super::expert_slots::MappedCopy,
    from: u64,
    to: u64,
    pieces: usize,
    stream: &CudaStream,
) -> Result<(), CudaError> {
    let pieces = i64::try_from(pieces).map_err(|_| CudaError::Invalid {
        problem: format!("an expert of {pieces} 16-byte pieces is too large to copy"),
    })?;
    let (mut from, mut to, mut pieces) = (from, to, pieces);
    let mut params: [*mut std::ffi::c_void; 3] = [
        (&mut from as *mut u64).cast(),
        (&mut to as *mut u64).cast(),
        (&mut pieces as *mut i64).cast(),
    ];
    // SAFETY: `mapped_copy(const uint4*, uint4*, long long)` takes these three values; `from`
    // addresses `pieces` 16-byte pieces of a registered, mapped bank kept alive by the slots,
    // `to` as many in the slot buffer; the parameters outlive the call, which copies them.
    unsafe {
        cudarc::driver::result::launch_kernel(
            copy.function,
            (copy.blocks, 1, 1),
            (MAPPED_COPY_THREADS, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .map_err(driver_error(
        "copying an expert into its GPU slot (mapped copy)",
    ))
}

/// Threads of a `mapped_copy` block (kernels/handoff.cu: one 16-byte read in flight each).
const MAPPED_COPY_THREADS: u32 = 256;

impl ExpertSlotFills for CudaExpertSlots {
    fn start_fill(
        &mut self,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        self.background_fills(&[(slot, expert)], artifact, bank)
            .map_err(|source| EngineError::Device {
                op: "start_fill",
                source,
            })
    }

    fn complete_fills(&mut self) -> Result<(), EngineError> {
        while !self.batch_fills.is_empty() {
            self.complete_batch_fill()?;
        }
        if self.fills_in_flight.is_empty() {
            return Ok(());
        }
        self.enter_landed_fills()?;
        self.upload_table_staged()
            .map_err(|source| EngineError::Device {
                op: "complete_fills",
                source,
            })
    }

    /// One table upload for the fills completed and those started (the default makes one
    /// per fill and one for the completions), one event pair for the new copies.
    fn refresh_fills(
        &mut self,
        decide: &mut dyn FnMut(&ExpertSlotTable) -> Vec<(usize, usize)>,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<Vec<(usize, usize)>, EngineError> {
        while !self.batch_fills.is_empty() {
            self.complete_batch_fill()?;
        }
        let completed = !self.fills_in_flight.is_empty();
        self.enter_landed_fills()?;
        let fills = decide(&self.slot_table);
        if fills.is_empty() && !completed {
            return Ok(fills);
        }
        self.background_fills(&fills, artifact, bank)
            .map_err(|source| EngineError::Device {
                op: "refresh_fills",
                source,
            })?;
        Ok(fills)
    }

    fn fills_in_flight(&self) -> usize {
        self.fills_in_flight
            .iter()
            .map(|(fills, _)| fills.len())
            .sum::<usize>()
            + self
                .batch_fills
                .iter()
                .map(|(_, experts, _)| experts.len())
                .sum::<usize>()
    }

    fn start_batch_fill(
        &mut self,
        first_slot: usize,
        experts: &[usize],
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        self.batch_fill(first_slot, experts, artifact, bank)
            .map_err(|source| EngineError::Device {
                op: "start_batch_fill",
                source,
            })
    }

    fn complete_batch_fill(&mut self) -> Result<(), EngineError> {
        let device = |source| EngineError::Device {
            op: "complete_batch_fill",
            source,
        };
        let (first_slot, experts, landed) =
            self.batch_fills
                .pop_front()
                .ok_or_else(|| EngineError::InvalidConfig {
                    problem: "no expert batch fill to complete".into(),
                })?;
        // The compute stream waits for this batch's copies; the host does not.
        self.stream
            .wait(&landed)
            .map_err(driver_error("waiting for a batch fill"))
            .map_err(device)?;
        self.recycle_event(landed);
        for (offset, expert) in experts.into_iter().enumerate() {
            self.slot_table
                .assign(first_slot + offset, expert)
                .map_err(slot_out_of_range)?;
        }
        self.upload_table().map_err(device)
    }

    fn copy_from_slots(
        &mut self,
        pairs: &[(usize, usize)],
        source: &Self,
    ) -> Result<(), EngineError> {
        let device = |source| EngineError::Device {
            op: "copy_from_slots",
            source,
        };
        self.complete_fills()?;
        let experts = experts_copied_from_slots(
            &self.slot_table,
            &source.slot_table,
            pairs,
            (self.layout.stride, source.layout.stride),
        )?;
        let stride = self.layout.stride;
        if pairs.is_empty() {
            return Ok(());
        }
        let stream = Arc::clone(&self.stream);
        // The source's last writes (a batch fill on its copy stream) were waited for on the
        // compute stream when its batch completed; on another compute stream, order it too.
        if !Arc::ptr_eq(&stream, &source.stream) {
            let queued = source
                .stream
                .record_event(None)
                .map_err(driver_error("ordering slot copies"))
                .map_err(device)?;
            stream
                .wait(&queued)
                .map_err(driver_error("ordering slot copies"))
                .map_err(device)?;
        }
        for (&(slot, source_slot), expert) in pairs.iter().zip(experts) {
            let from = source
                .storage
                .slice(source_slot * stride..(source_slot + 1) * stride);
            let mut to = self.storage.slice_mut(slot * stride..(slot + 1) * stride);
            stream
                .memcpy_dtod(&from, &mut to)
                .map_err(driver_error("copying an expert between GPU slots"))
                .map_err(device)?;
            self.slot_table
                .assign(slot, expert)
                .map_err(slot_out_of_range)?;
        }
        // On the compute stream behind the copies: the kernels after see the new experts.
        self.upload_table_staged().map_err(device)
    }
}
