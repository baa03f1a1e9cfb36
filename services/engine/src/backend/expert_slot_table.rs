//! The expert ↔ slot table of one set of expert slots: which expert each slot holds and which
//! slot holds each expert. Both backends' slot code keep their table in this type, and the model
//! reads it (through [`WithExpertSlotTable`]) to split a routing between the slots and the
//! expert executor.
//!
//! Owns: the two directions of the map and keeping them consistent when a slot is refilled
//! (the slot's previous expert loses its entry; an expert moved to another slot leaves its old
//! one empty).
//! [`ExpertSlotFills`] is the other half of the slots' interface: fills that run beside the
//! steps (the dynamic expert cache), entering the table only when the caller says.
//! Must not touch: slot storage (backends), which experts go to slots (placement), routing.

use std::sync::Arc;

use ninfer_artifact::{Artifact, ExpertBank};

use crate::error::EngineError;

/// The entry of an expert without a slot in [`ExpertSlotTable::slot_entries`], as the expert
/// kernels read it.
pub const NO_SLOT: i32 = -1;

/// Expert ↔ slot map of one set of expert slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSlotTable {
    /// Expert → slot, [`NO_SLOT`] where the expert has none: the form the GPU kernels read, so
    /// a device copy of the table is this slice.
    slot_of_expert: Vec<i32>,
    /// Slot → expert.
    expert_in_slot: Vec<Option<usize>>,
    /// Slots holding an expert (the cache asks every step whether one is free).
    occupied: usize,
}

/// A slot or expert index outside the table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expert slot {slot} / expert {expert} outside {slots} slots of {experts} experts")]
pub struct SlotOutOfRange {
    pub slot: usize,
    pub expert: usize,
    pub slots: usize,
    pub experts: usize,
}

impl ExpertSlotTable {
    /// An empty table for `num_experts` experts and `slots` slots.
    pub fn new(num_experts: usize, slots: usize) -> Self {
        ExpertSlotTable {
            slot_of_expert: vec![NO_SLOT; num_experts],
            expert_in_slot: vec![None; slots],
            occupied: 0,
        }
    }

    pub fn num_experts(&self) -> usize {
        self.slot_of_expert.len()
    }

    pub fn slot_count(&self) -> usize {
        self.expert_in_slot.len()
    }

    /// The slot holding `expert`, if any (`None` also for ids outside the table, such as
    /// `NO_EXPERT`).
    pub fn slot_of(&self, expert: usize) -> Option<usize> {
        self.slot_of_expert
            .get(expert)
            .and_then(|&slot| usize::try_from(slot).ok())
    }

    /// The expert in `slot`, if any.
    pub fn expert_in(&self, slot: usize) -> Option<usize> {
        self.expert_in_slot.get(slot).copied().flatten()
    }

    /// Whether `expert` has a slot.
    pub fn is_resident(&self, expert: usize) -> bool {
        self.slot_of(expert).is_some()
    }

    /// Whether every expert has a slot (then nothing is left for the expert executor).
    pub fn every_expert_resident(&self) -> bool {
        // Fewer slots than experts answer at once: the cache asks every step for every layer.
        self.expert_in_slot.len() >= self.slot_of_expert.len()
            && self.slot_of_expert.iter().all(|&slot| slot != NO_SLOT)
    }

    /// Whether no slot holds an expert.
    pub fn is_empty(&self) -> bool {
        self.occupied == 0
    }

    /// Whether some slot holds no expert.
    pub fn has_free_slot(&self) -> bool {
        self.occupied < self.expert_in_slot.len()
    }

    /// Whether [`Self::assign`] takes `slot` and `expert` (checked before the slot's storage is
    /// written). A slot index must also fit the kernels' `i32`.
    pub fn check(&self, slot: usize, expert: usize) -> Result<(), SlotOutOfRange> {
        if slot < self.expert_in_slot.len()
            && expert < self.slot_of_expert.len()
            && i32::try_from(slot).is_ok()
        {
            return Ok(());
        }
        Err(SlotOutOfRange {
            slot,
            expert,
            slots: self.expert_in_slot.len(),
            experts: self.slot_of_expert.len(),
        })
    }

    /// Records `expert` in `slot`: the slot's previous expert loses its entry, and an expert
    /// already in another slot leaves that one empty.
    pub fn assign(&mut self, slot: usize, expert: usize) -> Result<(), SlotOutOfRange> {
        self.check(slot, expert)?;
        let slot_entry = slot as i32; // fits: checked above
        if let Some(previous) = self.expert_in_slot[slot] {
            self.slot_of_expert[previous] = NO_SLOT;
            self.occupied -= 1;
        }
        if let Some(old_slot) = self.slot_of(expert) {
            self.expert_in_slot[old_slot] = None;
            self.occupied -= 1;
        }
        self.slot_of_expert[expert] = slot_entry;
        self.expert_in_slot[slot] = Some(expert);
        self.occupied += 1;
        Ok(())
    }

    /// Empties `slot`: its expert (if any) loses its entry. Returns that expert.
    pub fn clear(&mut self, slot: usize) -> Option<usize> {
        let previous = self.expert_in_slot.get_mut(slot)?.take()?;
        self.slot_of_expert[previous] = NO_SLOT;
        self.occupied -= 1;
        Some(previous)
    }

    /// `[num_experts]` slot per expert, [`NO_SLOT`] where none: the GPU copy of the table.
    pub fn slot_entries(&self) -> &[i32] {
        &self.slot_of_expert
    }
}

/// Expert slots that keep an [`ExpertSlotTable`]: the bound on `Backend::ExpertSlots` through
/// which the model sees which experts a set of slots holds.
pub trait WithExpertSlotTable {
    fn slot_table(&self) -> &ExpertSlotTable;
}

/// Expert slots refilled beside the steps (the dynamic expert cache): a fill is started after
/// one step and its expert enters the table only at [`ExpertSlotFills::complete_fills`], which
/// the caller makes at a fixed point (the start of a later step), so which experts are resident
/// in a step never depends on how long a copy took.
pub trait ExpertSlotFills {
    /// Starts copying expert `expert` of `bank` into `slot` without waiting for it: the slot's
    /// expert leaves the table now (no op from here on reads the slot), the new one enters it at
    /// the next [`ExpertSlotFills::complete_fills`]. On a GPU the copy runs on a copy stream,
    /// after the work already queued that may read the slot.
    fn start_fill(
        &mut self,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError>;

    /// Enters every started fill's expert in the table. Waits only for copies not yet landed
    /// (on a GPU the compute stream waits for the copy's event; the host does not).
    fn complete_fills(&mut self) -> Result<(), EngineError>;

    /// What the dynamic cache does between two steps: [`ExpertSlotFills::complete_fills`],
    /// then `decide` on the table with those fills entered, then
    /// [`ExpertSlotFills::start_fill`] of each (slot, expert) pair it returns, which it returns.
    /// A GPU makes it one table update and one pair of copy events for the layer.
    fn refresh_fills(
        &mut self,
        decide: &mut dyn FnMut(&ExpertSlotTable) -> Vec<(usize, usize)>,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<Vec<(usize, usize)>, EngineError>
    where
        Self: WithExpertSlotTable + Sized,
    {
        self.complete_fills()?;
        let fills = decide(self.slot_table());
        for &(slot, expert) in &fills {
            self.start_fill(slot, expert, artifact, bank)?;
        }
        Ok(fills)
    }

    /// Fills started and not yet completed (batch fills count one per expert).
    fn fills_in_flight(&self) -> usize;

    /// Starts copying `experts` of `bank` into the slots `first_slot..first_slot +
    /// experts.len()` as one batch (layerwise prefill: a whole layer's experts into one half
    /// of the double-buffered staging slots), without waiting for it. The slots leave the host
    /// table now; the caller computes nothing with them until the batch's
    /// [`ExpertSlotFills::complete_batch_fill`], whose table update reaches the device in
    /// order. On a GPU the copies run on the slots' copy stream after the work queued so far
    /// (which may read those slots), behind one event, so the compute stream keeps going.
    fn start_batch_fill(
        &mut self,
        first_slot: usize,
        experts: &[usize],
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError>;

    /// Enters the oldest started batch fill's experts in the table (batches complete in the
    /// order they started). Waits only for that batch's copies (on a GPU the compute stream
    /// waits for its event, the host does not); the batches behind it keep copying.
    fn complete_batch_fill(&mut self) -> Result<(), EngineError>;

    /// Copies experts that `source` holds (another set of slots of the same layout on the same
    /// device: layerwise prefill's staging slots, which hold a layer's streamed experts) into
    /// this set: each `(slot, source_slot)` pair puts the expert of `source_slot` into `slot`,
    /// evicting the slot's expert. Fills in flight are completed first. The copies are ordered
    /// after the work queued so far (which may read the slots' old experts) and before the work
    /// queued after; the table takes the new experts at once. On a GPU: device-to-device copies
    /// on the compute stream, no PCIe traffic.
    fn copy_from_slots(
        &mut self,
        pairs: &[(usize, usize)],
        source: &Self,
    ) -> Result<(), EngineError>
    where
        Self: Sized;
}

/// The experts `pairs` ((slot, source slot)) bring from `source`'s table, checked against
/// both tables before anything changes: both sets lay a slot out in the same bytes (`strides`:
/// this set's and the source's), every source slot holds an expert, every slot is in range,
/// and no slot or expert appears twice.
pub fn experts_copied_from_slots(
    table: &ExpertSlotTable,
    source: &ExpertSlotTable,
    pairs: &[(usize, usize)],
    strides: (usize, usize),
) -> Result<Vec<usize>, EngineError> {
    let invalid = |problem: String| EngineError::InvalidConfig { problem };
    if strides.0 != strides.1 {
        return Err(invalid(format!(
            "copying expert slots between layouts of {} and {} bytes a slot",
            strides.1, strides.0
        )));
    }
    let mut slot_taken = vec![false; table.slot_count()];
    let mut expert_taken = vec![false; table.num_experts()];
    let mut experts = Vec::with_capacity(pairs.len());
    for &(slot, source_slot) in pairs {
        let expert = source.expert_in(source_slot).ok_or_else(|| {
            invalid(format!(
                "copying expert slots: source slot {source_slot} holds no expert"
            ))
        })?;
        table
            .check(slot, expert)
            .map_err(|error| invalid(error.to_string()))?;
        if std::mem::replace(&mut slot_taken[slot], true)
            || std::mem::replace(&mut expert_taken[expert], true)
        {
            return Err(invalid(format!(
                "copying expert slots: slot {slot} or expert {expert} appears twice"
            )));
        }
        experts.push(expert);
    }
    Ok(experts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refilling_a_slot_keeps_both_directions_consistent() {
        let mut table = ExpertSlotTable::new(6, 2);
        assert!(table.is_empty() && !table.every_expert_resident() && table.has_free_slot());
        table.assign(0, 4).unwrap();
        table.assign(1, 2).unwrap();
        assert!(!table.has_free_slot());
        assert_eq!((table.slot_of(4), table.slot_of(2)), (Some(0), Some(1)));
        assert_eq!(table.slot_entries(), &[-1, -1, 1, -1, 0, -1]);
        // Slot 0 gets expert 5: expert 4 loses its slot.
        table.assign(0, 5).unwrap();
        assert_eq!((table.slot_of(4), table.expert_in(0)), (None, Some(5)));
        // Expert 5 moves to slot 1: slot 0 is empty, expert 2 has none.
        table.assign(1, 5).unwrap();
        assert_eq!(table.expert_in(0), None);
        assert!(table.has_free_slot() && !table.is_empty());
        assert_eq!(table.slot_of(2), None);
        assert_eq!(table.slot_of(5), Some(1));
        assert_eq!(table.slot_entries(), &[-1, -1, -1, -1, -1, 1]);
        assert!(!table.is_resident(u32::MAX as usize));
        assert!(table.assign(2, 0).is_err() && table.assign(0, 6).is_err());
        assert!(table.check(1, 5).is_ok() && table.check(2, 0).is_err());
        assert_eq!(table.clear(1), Some(5));
        assert_eq!((table.slot_of(5), table.expert_in(1)), (None, None));
        assert_eq!((table.clear(1), table.clear(7)), (None, None));
        assert!(table.is_empty());
    }

    #[test]
    fn a_table_with_every_expert_in_a_slot_says_so() {
        let mut table = ExpertSlotTable::new(3, 3);
        for expert in 0..3 {
            table.assign(expert, expert).unwrap();
        }
        assert!(table.every_expert_resident() && !table.is_empty());
    }
}
