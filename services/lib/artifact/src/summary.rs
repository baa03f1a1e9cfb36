//! Parameter and byte counts of an artifact, grouped by tensor class and dtype (`ninfer inspect`).

use std::collections::BTreeMap;

use crate::header::{DType, Header, TensorClass};

/// Totals for one (class, dtype) pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassTotals {
    pub tensors: u64,
    pub parameters: u64,
    pub bytes: u64,
}

/// Totals per (class, dtype), in a stable order.
pub fn totals_by_class_and_dtype(header: &Header) -> BTreeMap<(TensorClass, DType), ClassTotals> {
    let mut totals: BTreeMap<(TensorClass, DType), ClassTotals> = BTreeMap::new();
    for tensor in &header.tensors {
        let entry = totals.entry((tensor.class, tensor.dtype)).or_default();
        entry.tensors += 1;
        entry.parameters += tensor.element_count();
        entry.bytes += tensor.length;
    }
    totals
}
