//! The CPU backend's routed-expert slots: the slot table, background fills (with the test
//! delay that stands in for a slow copy), and the slotted experts' SwiGLU.
//!
//! Owns: [`CpuExpertSlots`] and the expert-slot ops. Must not touch: routing, placement.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use super::tensors::{CpuBackend, CpuTensor};
use crate::backend::{
    expert_bytes, experts_copied_from_slots, slot_out_of_range, ExpertSlotFills, ExpertSlotTable,
    Routing, WithExpertSlotTable,
};
use crate::error::EngineError;
use crate::host_math::swiglu_halves;
use crate::weights::WeightMatrix;

/// Expert slots in host memory: each slot a private copy of one expert's stored bytes. The
/// CPU backend has no faster memory to copy to; the copies exist so the slot logic (table,
/// placement, split of the routed sum) is exercised and tested the same way on every backend.
pub struct CpuExpertSlots {
    pub(super) layout: ExpertLayout,
    /// `slots` × `layout.stride` bytes.
    pub(super) storage: Vec<u8>,
    pub(super) table: ExpertSlotTable,
    /// Background fills: a thread copies the expert's bytes (the CPU's stand-in for a DMA), the
    /// slot takes them at [`ExpertSlotFills::complete_fills`].
    pub(super) fills_in_flight: Vec<CpuSlotFill>,
    /// Batch fills (layerwise prefill), oldest first: one thread copies the whole batch.
    pub(super) batch_fills: std::collections::VecDeque<CpuBatchFill>,
    /// [`CpuBackend::with_expert_fill_delay`].
    pub(super) fill_delay: Duration,
}

/// One batch fill of consecutive CPU expert slots: the experts' bytes back to back.
pub(super) struct CpuBatchFill {
    pub(super) first_slot: usize,
    pub(super) experts: Vec<usize>,
    pub(super) copy: JoinHandle<Vec<u8>>,
}

/// One background fill of a CPU expert slot.
pub(super) struct CpuSlotFill {
    pub(super) slot: usize,
    pub(super) expert: usize,
    pub(super) copy: JoinHandle<Vec<u8>>,
}

impl WithExpertSlotTable for CpuExpertSlots {
    fn slot_table(&self) -> &ExpertSlotTable {
        &self.table
    }
}

impl ExpertSlotFills for CpuExpertSlots {
    fn start_fill(
        &mut self,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        let source = expert_bytes(artifact, bank, expert, &self.layout)?;
        self.table.check(slot, expert).map_err(slot_out_of_range)?;
        // The source's place in the mapping, so the copying thread can hold the artifact.
        let start = source.as_ptr() as usize - artifact.bytes().as_ptr() as usize;
        let range = start..start + source.len();
        self.table.clear(slot);
        if let Some(old_slot) = self.table.slot_of(expert) {
            self.table.clear(old_slot);
        }
        let (artifact, delay) = (Arc::clone(artifact), self.fill_delay);
        let copy = std::thread::Builder::new()
            .name("expert-slot-fill".into())
            .spawn(move || {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                artifact.bytes()[range].to_vec()
            })
            .map_err(|error| EngineError::InvalidConfig {
                problem: format!("starting an expert slot fill: {error}"),
            })?;
        self.fills_in_flight
            .push(CpuSlotFill { slot, expert, copy });
        Ok(())
    }

    fn complete_fills(&mut self) -> Result<(), EngineError> {
        while !self.batch_fills.is_empty() {
            self.complete_batch_fill()?;
        }
        let stride = self.layout.stride;
        for fill in std::mem::take(&mut self.fills_in_flight) {
            let bytes = fill.copy.join().map_err(|_| EngineError::InvalidConfig {
                problem: format!("the fill of expert slot {} panicked", fill.slot),
            })?;
            self.storage[fill.slot * stride..(fill.slot + 1) * stride].copy_from_slice(&bytes);
            self.table
                .assign(fill.slot, fill.expert)
                .map_err(slot_out_of_range)?;
        }
        Ok(())
    }

    fn fills_in_flight(&self) -> usize {
        self.fills_in_flight.len()
            + self
                .batch_fills
                .iter()
                .map(|fill| fill.experts.len())
                .sum::<usize>()
    }

    fn start_batch_fill(
        &mut self,
        first_slot: usize,
        experts: &[usize],
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        // Every source range, checked before anything changes.
        let mut ranges = Vec::with_capacity(experts.len());
        for (offset, &expert) in experts.iter().enumerate() {
            let source = expert_bytes(artifact, bank, expert, &self.layout)?;
            self.table
                .check(first_slot + offset, expert)
                .map_err(slot_out_of_range)?;
            let start = source.as_ptr() as usize - artifact.bytes().as_ptr() as usize;
            ranges.push(start..start + source.len());
        }
        for slot in first_slot..first_slot + experts.len() {
            self.table.clear(slot);
        }
        let (artifact, delay) = (Arc::clone(artifact), self.fill_delay);
        // The CPU's stand-in for the copy stream: the copy runs beside the forward.
        let copy = std::thread::Builder::new()
            .name("expert-batch-fill".into())
            .spawn(move || {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                let bytes = artifact.bytes();
                let mut copied = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum());
                for range in ranges {
                    copied.extend_from_slice(&bytes[range]);
                }
                copied
            })
            .map_err(|error| EngineError::InvalidConfig {
                problem: format!("starting an expert batch fill: {error}"),
            })?;
        self.batch_fills.push_back(CpuBatchFill {
            first_slot,
            experts: experts.to_vec(),
            copy,
        });
        Ok(())
    }

    fn complete_batch_fill(&mut self) -> Result<(), EngineError> {
        let Some(fill) = self.batch_fills.pop_front() else {
            return Err(EngineError::InvalidConfig {
                problem: "no expert batch fill to complete".into(),
            });
        };
        let bytes = fill.copy.join().map_err(|_| EngineError::InvalidConfig {
            problem: format!("the batch fill into slot {} panicked", fill.first_slot),
        })?;
        let stride = self.layout.stride;
        let start = fill.first_slot * stride;
        let target = self
            .storage
            .get_mut(start..start + bytes.len())
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: format!(
                    "a batch fill from slot {} overruns the slots",
                    fill.first_slot
                ),
            })?;
        target.copy_from_slice(&bytes);
        for (offset, &expert) in fill.experts.iter().enumerate() {
            self.table
                .assign(fill.first_slot + offset, expert)
                .map_err(slot_out_of_range)?;
        }
        Ok(())
    }

    fn copy_from_slots(
        &mut self,
        pairs: &[(usize, usize)],
        source: &Self,
    ) -> Result<(), EngineError> {
        self.complete_fills()?;
        let experts = experts_copied_from_slots(
            &self.table,
            &source.table,
            pairs,
            (self.layout.stride, source.layout.stride),
        )?;
        let stride = self.layout.stride;
        for (&(slot, source_slot), expert) in pairs.iter().zip(experts) {
            let from = source
                .storage
                .get(source_slot * stride..(source_slot + 1) * stride)
                .ok_or_else(|| EngineError::InvalidConfig {
                    problem: format!("source expert slot {source_slot} outside its slots"),
                })?;
            self.storage[slot * stride..(slot + 1) * stride].copy_from_slice(from);
            self.table.assign(slot, expert).map_err(slot_out_of_range)?;
        }
        Ok(())
    }
}

impl CpuExpertSlots {
    pub(super) fn expert_matrices(
        &self,
        slot: usize,
    ) -> Result<(WeightMatrix<'_>, WeightMatrix<'_>), EngineError> {
        let layout = &self.layout;
        let bytes = &self.storage[slot * layout.stride..(slot + 1) * layout.stride];
        let dtype = layout.dtype.artifact_dtype();
        let gate_up = WeightMatrix::from_raw(
            dtype,
            layout.gate_up.rows,
            layout.gate_up.cols,
            &bytes[..layout.gate_up.total_bytes],
        )?;
        let down = WeightMatrix::from_raw(
            dtype,
            layout.down.rows,
            layout.down.cols,
            &bytes[layout.down_offset..],
        )?;
        Ok((gate_up, down))
    }
}

impl CpuBackend {
    /// [`Backend::new_expert_slots`](crate::backend::Backend::new_expert_slots) on the host.
    pub(super) fn new_expert_slots_on_host(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<CpuExpertSlots, EngineError> {
        let bytes = slots
            .checked_mul(layout.stride)
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: format!("{slots} expert slots of {} bytes overflow", layout.stride),
            })?;
        Ok(CpuExpertSlots {
            layout: *layout,
            storage: vec![0; bytes],
            table: ExpertSlotTable::new(num_experts, slots),
            fills_in_flight: Vec::new(),
            batch_fills: Default::default(),
            fill_delay: self.expert_fill_delay,
        })
    }

    /// [`Backend::fill_expert_slot`](crate::backend::Backend::fill_expert_slot) on the host.
    pub(super) fn fill_expert_slot_on_host(
        &self,
        slots: &mut CpuExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        let source = expert_bytes(artifact, bank, expert, &slots.layout)?;
        let stride = slots.layout.stride;
        slots.table.check(slot, expert).map_err(slot_out_of_range)?;
        slots.storage[slot * stride..(slot + 1) * stride].copy_from_slice(source);
        slots
            .table
            .assign(slot, expert)
            .map_err(slot_out_of_range)?;
        Ok(())
    }

    /// [`Backend::slotted_experts`](crate::backend::Backend::slotted_experts) on the host.
    pub(super) fn slotted_experts_on_host(
        &self,
        slots: &CpuExpertSlots,
        x: &CpuTensor,
        routing: &Routing,
    ) -> Result<CpuTensor, EngineError> {
        let hidden = slots.layout.hidden;
        let intermediate = slots.layout.intermediate;
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        let k = routing.experts_per_token;
        if x.cols != hidden || routing.expert_ids.len() != x.rows * k {
            // Shapes are validated at model load; an inconsistent call leaves zeros.
            return Ok(out);
        }
        // Each slot's matrix views once per call, not once per (token, choice).
        let matrices: Vec<_> = (0..slots.table.slot_count())
            .map(|slot| slots.expert_matrices(slot).ok())
            .collect();
        let mut gate_up = vec![0.0f32; 2 * intermediate];
        let mut activated = vec![0.0f32; intermediate];
        let mut y = vec![0.0f32; hidden];
        for t in 0..x.rows {
            for j in 0..k {
                let expert = routing.expert_ids[t * k + j] as usize;
                let Some((gate_up_matrix, down_matrix)) = slots
                    .table
                    .slot_of(expert)
                    .and_then(|slot| matrices.get(slot).copied().flatten())
                else {
                    continue;
                };
                gate_up_matrix.matmul(x.row(t), 1, &mut gate_up);
                swiglu_halves(&gate_up, &mut activated);
                down_matrix.matmul(&activated, 1, &mut y);
                let weight = routing.weights[t * k + j];
                for (o, v) in out.row_mut(t).iter_mut().zip(&y) {
                    *o += weight * v;
                }
            }
        }
        Ok(out)
    }
}
