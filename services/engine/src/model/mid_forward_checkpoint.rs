//! A checkpoint from the middle of a forward: one sequence's tokens go through the model in one
//! forward, and the Gated DeltaNet layers copy their states where the sequence passes a given
//! position, so a prompt that should be checkpointed at a block end does not pay a second
//! forward for the tokens after it (each forward of a model with experts in RAM streams or
//! computes most of its experts, whatever its length).
//!
//! Owns: the split of a layer's convolution and delta rule at the checkpoint's row and the
//! checkpoint it makes. Must not touch: the other ops of the forward, which see every row at
//! once as in any forward.

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::layers::{
    DeltaRuleMix, LayerState, MidForwardCapture, SequenceCheckpoint, SequenceInput, SequenceState,
};
use crate::model::Model;

impl<B: Backend> Model<B> {
    /// Whether [`Model::forward_hidden_with_checkpoint`] can take this model's checkpoints (its
    /// checkpoints hold Gated DeltaNet states only: not qwen4_exp's PLE states).
    pub fn checkpoints_mid_forward(&self) -> bool {
        self.qwen4_exp.is_none()
    }

    /// Asks the sequence's next forward to take its checkpoint at `position` as its rows pass
    /// it ([`Model::take_checkpoint_taken`] hands it over after). The forward must run the
    /// sequence alone and have rows on both sides of `position`; any other forward leaves the
    /// request unserved. `false` for a model that cannot take checkpoints mid-forward.
    pub fn request_checkpoint_at(&self, state: &mut SequenceState<B>, position: usize) -> bool {
        if !self.checkpoints_mid_forward() {
            return false;
        }
        state.capture = Some(MidForwardCapture {
            position,
            layers: (0..state.layers.len()).map(|_| None).collect(),
        });
        true
    }

    /// The checkpoint a forward took for [`Model::request_checkpoint_at`], once the sequence
    /// has passed it and every Gated DeltaNet layer copied its states there; `None` (and the
    /// request dropped) otherwise. The request is kept while the sequence has not reached it.
    pub fn take_checkpoint_taken(
        &self,
        state: &mut SequenceState<B>,
    ) -> Option<SequenceCheckpoint<B>> {
        let position = state.capture.as_ref()?.position;
        if position > state.position {
            return None;
        }
        let capture = state.capture.take()?;
        let every_layer_taken = state
            .layers
            .iter()
            .zip(&capture.layers)
            .all(|(layer, taken)| {
                matches!(layer, LayerState::GatedDeltaNet { .. }) == taken.is_some()
            });
        every_layer_taken.then(|| SequenceCheckpoint {
            position,
            layers: capture.layers,
            ple: state.ple.iter().map(|_| None).collect(),
        })
    }

    /// [`Model::forward_hidden`] of one sequence's `tokens`, which also returns the checkpoint
    /// [`Model::checkpoint`] would have taken after a forward of the first `at` of them alone:
    /// the same states, without a second forward for the rest. `at` must leave tokens on both
    /// sides.
    pub fn forward_hidden_with_checkpoint(
        &self,
        state: &mut SequenceState<B>,
        tokens: &[u32],
        at: usize,
    ) -> Result<(B::Tensor, SequenceCheckpoint<B>), EngineError> {
        let refused = |what: &str| EngineError::InvalidConfig {
            problem: format!(
                "a checkpoint after {at} of {} tokens {what} mid-forward",
                tokens.len()
            ),
        };
        if at == 0 || at >= tokens.len() {
            return Err(refused("cannot be taken"));
        }
        let position = state.position + at;
        if !self.request_checkpoint_at(state, position) {
            return Err(refused("cannot be taken"));
        }
        let mut batch = [SequenceInput {
            state: &mut *state,
            tokens,
        }];
        let hidden = self.forward_hidden(&mut batch, None);
        let taken = self.take_checkpoint_taken(state);
        state.capture = None;
        let hidden = hidden?;
        let taken = taken.ok_or_else(|| refused("was not taken"))?;
        Ok((hidden, taken))
    }

    /// The row of a batch's mix where its one sequence's capture falls, when it asked for one
    /// inside this forward's rows.
    pub(in crate::model) fn mid_forward_capture_row(
        &self,
        batch: &[SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
    ) -> Option<usize> {
        let ([item], [range]) = (batch, ranges) else {
            return None;
        };
        let capture = item.state.capture.as_ref()?;
        let row = capture.position.checked_sub(item.state.position)?;
        (row > 0 && row < range.len()).then_some(range.start + row)
    }

    /// [`Model::delta_rule_mix`] of a batch of one sequence in two parts, split at `split`: the
    /// layer's states after the first part are copied into the sequence's capture.
    pub(in crate::model) fn delta_rule_mix_with_capture(
        &self,
        mix: &DeltaRuleMix<'_, B>,
        qkv: &B::Tensor,
        a: &B::Tensor,
        b: &B::Tensor,
        batch: &mut [SequenceInput<'_, B>],
        split: usize,
    ) -> Result<B::Tensor, EngineError> {
        let backend = self.layer_backend(mix.index);
        let rows = backend.shape(qkv).0;
        let first: Vec<usize> = (0..split).collect();
        let rest: Vec<usize> = (split..rows).collect();
        let part = |tensor: &B::Tensor, rows: &[usize]| backend.gather_rows(tensor, rows);
        let head = self.delta_rule_mix(
            mix,
            &part(qkv, &first)?,
            &part(a, &first)?,
            &part(b, &first)?,
            batch,
            std::slice::from_ref(&(0..split)),
            0,
        )?;
        let [item] = batch else {
            return Err(EngineError::InvalidConfig {
                problem: "a mid-forward checkpoint of a batch of several sequences".into(),
            });
        };
        let taken = match &item.state.layers[mix.index] {
            LayerState::GatedDeltaNet { conv, recurrent } => (
                backend.copy_conv_state(conv)?,
                backend.copy_recurrent_state(recurrent)?,
            ),
            _ => return Err(crate::model::layers::state_mismatch(mix.index)),
        };
        if let Some(slot) = item
            .state
            .capture
            .as_mut()
            .and_then(|capture| capture.layers.get_mut(mix.index))
        {
            *slot = Some(taken);
        }
        let tail = self.delta_rule_mix(
            mix,
            &part(qkv, &rest)?,
            &part(a, &rest)?,
            &part(b, &rest)?,
            batch,
            std::slice::from_ref(&(0..rows - split)),
            split,
        )?;
        backend.concat_rows(&head, &tail)
    }
}
