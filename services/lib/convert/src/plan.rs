//! The conversion plan: which artifact tensors to write, in which order, from which checkpoint
//! tensors and with which re-layout. Built (and shape-checked) before any byte is written, so a
//! missing or mis-shaped tensor fails fast with nothing left behind.
//!
//! This file holds the plan's types, the checkpoint's names and the planner that records each
//! tensor; the model's order is `plan_model.rs`, one layer's tensors `plan_layers.rs`.

use std::collections::{BTreeMap, BTreeSet};

use ninfer_artifact::{DType, TensorClass};

use crate::error::ConvertError;
use crate::safetensors_file::{Checkpoint, SourceTensor};

/// How an output tensor's rows are taken from one checkpoint tensor.
#[derive(Debug, Clone)]
pub enum RowSelection {
    /// The whole tensor (possibly reshaped, e.g. conv1d `[C,1,K]` → `[C,K]`).
    All,
    /// These rows of the tensor viewed as `[rows, row_len]`, in this order.
    Rows(Vec<usize>),
}

/// One output tensor and where it comes from.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub name: String,
    pub class: TensorClass,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub source: String,
    pub rows: RowSelection,
}

/// Where one expert's three matrices come from.
#[derive(Debug, Clone)]
pub enum ExpertSource {
    /// `experts.{e}.gate_proj/up_proj/down_proj.weight`.
    PerExpert {
        gate: String,
        up: String,
        down: String,
    },
    /// Slice `index` of fused `experts.gate_up_proj [E,2Im,H]` and `experts.down_proj [E,H,Im]`.
    Fused {
        gate_up: String,
        down: String,
        index: usize,
    },
}

/// The experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct PlannedBank {
    pub prefix: String,
    pub class: TensorClass,
    pub dtype: DType,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub experts: Vec<ExpertSource>,
}

#[derive(Debug, Clone)]
pub enum PlannedItem {
    Tensor(PlannedTensor),
    Bank(PlannedBank),
}

/// The whole plan plus what was deliberately left out.
#[derive(Debug, Clone)]
pub struct Plan {
    pub items: Vec<PlannedItem>,
    pub notes: Vec<String>,
    pub mtp_layers: usize,
}

/// Dtype choices of the user.
#[derive(Debug, Clone, Copy)]
pub struct DTypeChoice {
    pub experts: DType,
    pub dense: DType,
}

/// Checkpoint names with the multimodal `model.language_model.` prefix folded to `model.`.
pub struct SourceNames<'a> {
    pub(crate) checkpoint: &'a Checkpoint,
    pub(crate) canonical: BTreeMap<String, String>,
    pub(crate) used: BTreeSet<String>,
    /// The checkpoint spells its text model `model.language_model.*` (multimodal release).
    pub(crate) language_model_prefix: bool,
}

impl<'a> SourceNames<'a> {
    pub fn new(checkpoint: &'a Checkpoint) -> Self {
        let canonical = checkpoint
            .tensors
            .keys()
            .map(|name| {
                let short = match name.strip_prefix("model.language_model.") {
                    Some(rest) => format!("model.{rest}"),
                    None => name.clone(),
                };
                (short, name.clone())
            })
            .collect();
        let language_model_prefix = checkpoint
            .tensors
            .keys()
            .any(|name| name.starts_with("model.language_model."));
        SourceNames {
            checkpoint,
            canonical,
            used: BTreeSet::new(),
            language_model_prefix,
        }
    }

    /// A canonical name as this checkpoint would spell it (for messages about missing tensors).
    pub(crate) fn spelled(&self, canonical: &str) -> String {
        match canonical.strip_prefix("model.") {
            Some(rest) if self.language_model_prefix && !rest.starts_with("visual.") => {
                format!("model.language_model.{rest}")
            }
            _ => canonical.to_string(),
        }
    }

    pub(crate) fn find(&self, canonical: &str) -> Option<&'a SourceTensor> {
        let real = self.canonical.get(canonical)?;
        self.checkpoint.tensors.get(real)
    }

    pub(crate) fn has(&self, canonical: &str) -> bool {
        self.canonical.contains_key(canonical)
    }

    /// The real name of a required tensor whose shape must be `expected`.
    pub(crate) fn require(
        &mut self,
        canonical: &str,
        expected: &[u64],
    ) -> Result<String, ConvertError> {
        let tensor = self
            .find(canonical)
            .ok_or_else(|| ConvertError::MissingTensor {
                directory: self.checkpoint.directory.clone(),
                name: self.spelled(canonical),
            })?;
        if tensor.dtype == crate::safetensors_file::SourceDType::I64 {
            return Err(ConvertError::Input {
                file: self.checkpoint.shard_path(tensor).to_path_buf(),
                problem: format!(
                    "tensor `{}` holds integers where a weight is expected",
                    tensor.name
                ),
            });
        }
        if tensor.shape != expected {
            return Err(ConvertError::WrongShape {
                file: self.checkpoint.shard_path(tensor).to_path_buf(),
                name: tensor.name.clone(),
                found: tensor.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        self.used.insert(tensor.name.clone());
        Ok(tensor.name.clone())
    }

    pub(crate) fn mark_used(&mut self, real: &str) {
        self.used.insert(real.to_string());
    }

    /// Checkpoint tensors no planned item consumed.
    pub fn unused(&self) -> Vec<String> {
        self.checkpoint
            .tensors
            .keys()
            .filter(|name| !self.used.contains(*name))
            .cloned()
            .collect()
    }
}

pub(crate) struct Planner<'a, 'b> {
    pub(crate) names: &'b mut SourceNames<'a>,
    pub(crate) dtypes: DTypeChoice,
    pub(crate) items: Vec<PlannedItem>,
}

impl Planner<'_, '_> {
    pub(crate) fn matrix_dtype(&self, class: TensorClass) -> DType {
        match class {
            TensorClass::RoutedExpert => self.dtypes.experts,
            _ => self.dtypes.dense,
        }
    }

    /// A tensor copied whole; 1-D tensors are always stored f32.
    pub(crate) fn copy(
        &mut self,
        name: &str,
        class: TensorClass,
        source: &str,
        shape: &[u64],
    ) -> Result<(), ConvertError> {
        let real = self.names.require(source, shape)?;
        let dtype = if shape.len() == 1 {
            DType::F32
        } else {
            self.matrix_dtype(class)
        };
        self.push(name, class, dtype, shape.to_vec(), real, RowSelection::All);
        Ok(())
    }

    pub(crate) fn push(
        &mut self,
        name: &str,
        class: TensorClass,
        dtype: DType,
        shape: Vec<u64>,
        source: String,
        rows: RowSelection,
    ) {
        self.items.push(PlannedItem::Tensor(PlannedTensor {
            name: name.to_string(),
            class,
            dtype,
            shape,
            source,
            rows,
        }));
    }
}

pub(crate) fn u(values: &[usize]) -> Vec<u64> {
    values.iter().map(|&v| v as u64).collect()
}
