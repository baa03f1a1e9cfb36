//! A model's sequences: a new sequence's state sized from its max context, checkpoints and
//! restores of it, and the delta rule's form.
//!
//! Owns: creating, copying and restoring [`SequenceState`]s. Must not touch: the forward.

use crate::backend::{Backend, DeltaRuleForm};
use crate::error::EngineError;
use crate::model::layers::{LayerState, SequenceCheckpoint, SequenceState};
use crate::model::qwen4_exp::ple_state::PleState;
use crate::model::step_graphs;
use crate::model::Model;
use crate::spec::MixerKind;

impl<B: Backend> Model<B> {
    /// Forces one form of the gated delta rule (tests compare the two).
    pub fn set_delta_rule_form(&mut self, form: DeltaRuleForm) {
        self.delta_rule_form = form;
    }

    /// Empty state for a sequence of at most `max_context` tokens.
    pub fn new_sequence(&self, max_context: usize) -> Result<SequenceState<B>, EngineError> {
        let kv_width = self.spec.attention.kv_heads * self.spec.attention.head_dim;
        let layers = self
            .spec
            .mixers
            .iter()
            .enumerate()
            .map(|(index, mixer)| {
                let backend = self.layer_backend(index);
                Ok(match (mixer, &self.spec.delta_rule) {
                    (MixerKind::GatedDeltaNet, Some(delta)) => {
                        let channels = 2 * delta.key_heads * delta.key_head_dim
                            + delta.value_heads * delta.value_head_dim;
                        LayerState::GatedDeltaNet {
                            conv: backend.new_conv_state(channels, self.spec.conv_kernel)?,
                            recurrent: backend.new_recurrent_state(delta)?,
                        }
                    }
                    _ => match &self.qwen4_exp {
                        Some(graph) => LayerState::SparseAttention(backend.new_qsa_cache(
                            max_context,
                            kv_width,
                            graph.qsa_settings(),
                        )?),
                        None => LayerState::Attention(backend.new_kv_cache(max_context, kv_width)?),
                    },
                })
            })
            .collect::<Result<_, EngineError>>()?;
        let ple = match &self.qwen4_exp {
            Some(graph) => graph.new_ple_states(|index| self.layer_backend(index))?,
            None => Vec::new(),
        };
        Ok(SequenceState {
            max_context,
            position: 0,
            layers,
            ple,
            graph_key: step_graphs::new_graph_key(),
            images: None,
            capture: None,
        })
    }

    /// What [`Model::restore`] needs to put `state` back where it is now: its position, and a
    /// copy of every Gated DeltaNet state (attention caches are cut back by position alone).
    pub fn checkpoint(
        &self,
        state: &SequenceState<B>,
    ) -> Result<SequenceCheckpoint<B>, EngineError> {
        let layers = state
            .layers
            .iter()
            .enumerate()
            .map(|(index, layer)| match layer {
                // Caches are cut back by position alone.
                LayerState::Attention(_) | LayerState::SparseAttention(_) => Ok(None),
                LayerState::GatedDeltaNet { conv, recurrent } => {
                    let backend = self.layer_backend(index);
                    Ok(Some((
                        backend.copy_conv_state(conv)?,
                        backend.copy_recurrent_state(recurrent)?,
                    )))
                }
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(SequenceCheckpoint {
            position: state.position,
            layers,
            ple: self.copy_ple_states(&state.ple)?,
        })
    }

    /// Copies of a sequence's PLE states, each on its layer's backend.
    pub(in crate::model) fn copy_ple_states(
        &self,
        ple: &[Option<PleState<B>>],
    ) -> Result<Vec<Option<PleState<B>>>, EngineError> {
        ple.iter()
            .enumerate()
            .map(|(index, ple)| {
                ple.as_ref()
                    .map(|ple| ple.copy(self.layer_backend(index)))
                    .transpose()
            })
            .collect()
    }

    /// Puts `state` back to `checkpoint` (taken from it by [`Model::checkpoint`]): what it
    /// processed after that is forgotten.
    pub fn restore(
        &self,
        state: &mut SequenceState<B>,
        checkpoint: SequenceCheckpoint<B>,
    ) -> Result<(), EngineError> {
        if checkpoint.layers.len() != state.layers.len() || checkpoint.position > state.position {
            return Err(EngineError::InvalidConfig {
                problem: "a checkpoint restored into a sequence it was not taken from".into(),
            });
        }
        let mut replaced_buffers = false;
        for (index, layer) in state.layers.iter_mut().enumerate() {
            if let LayerState::SparseAttention(cache) = layer {
                self.layer_backend(index)
                    .truncate_qsa_cache(cache, checkpoint.position);
            }
        }
        state.ple = checkpoint.ple;
        for (layer, saved) in state.layers.iter_mut().zip(checkpoint.layers) {
            if let (LayerState::GatedDeltaNet { conv, recurrent }, Some((saved_conv, saved))) =
                (layer, saved)
            {
                *conv = saved_conv;
                *recurrent = saved;
                replaced_buffers = true;
            }
        }
        state.position = checkpoint.position;
        if replaced_buffers {
            // New Gated DeltaNet buffers: no recorded step may write the old ones. (Attention
            // caches are cut back by position alone and keep their buffers.)
            state.graph_key = step_graphs::new_graph_key();
        }
        Ok(())
    }
}
