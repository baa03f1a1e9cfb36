//! The Qwen4-Exp forward over the model's layers: the hyper-connection streams around each
//! layer, QSA sparse attention, the PLE blocks and the final stream mixer.
//!
//! Owns: the order of a Qwen4-Exp forward. Must not touch: the weights' loading and layout
//! (`graph.rs`).

use super::{Indexer, Ple, Qwen4ExpGraph};
use crate::backend::NormStyle;
use crate::backend::{Backend, DeltaRuleForm, LayerInput, Rotation, Segment};
use crate::error::EngineError;
use crate::model::layers::{
    layer_segments, state_mismatch, BatchPlan, FeedForward, LayerScratch, LayerState,
    LogitsSelection, Mixer, SequenceInput,
};
use crate::model::qwen4_exp::ple_state::PleState;
use crate::model::Model;

impl<B: Backend> Model<B> {
    /// The Qwen4-Exp layers over a checked batch, then the final mixer and `finish`.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn run_qwen4_exp_layers<'a, T>(
        &'a self,
        graph: &Qwen4ExpGraph<B>,
        batch: &mut [SequenceInput<'_, B>],
        plan: &BatchPlan,
        selection: LogitsSelection,
        delta_rule_form: DeltaRuleForm,
        scratch: &mut LayerScratch<'a, B>,
        finish: impl FnOnce(&B, B::Tensor) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        // The first stage's (the only one's, unsplit): the embeddings and layer 0.
        let mut backend = &*self.backend;
        let BatchPlan {
            ids,
            ranges,
            positions,
            ..
        } = plan;
        let (count, hidden) = (graph.streams(), graph.hidden());
        let rows = ids.len();
        let width = count * hidden;
        let scale = 1.0 / count as f32;
        // Every stream starts as the token's embedding: each id looked up `n` times in a row
        // gives `[rows·n, H]`, which is `[rows, n·H]` read row by row.
        let repeated_ids: Vec<u32> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n(id, count))
            .collect();
        let mut streams = backend.reshape(
            backend.embed(&self.embed_tokens, &repeated_ids)?,
            rows,
            width,
        )?;
        for (index, layer) in self.layers.iter().enumerate() {
            let extras = graph
                .layers
                .get(index)
                .ok_or_else(|| state_mismatch(index))?;
            if let Some(ple) = &extras.ple {
                self.ple_block(graph, ple, index, &mut streams, batch, ranges, ids)?;
            }
            let (x, shares) = extras.attn_hc.mix(backend, graph, &streams)?;
            let shares = shares.ok_or_else(|| state_mismatch(index))?;
            let mixed = match (&layer.mixer, &extras.indexer) {
                (Mixer::Attention { .. }, Some(indexer)) => self.sparse_attention(
                    graph,
                    indexer,
                    index,
                    &layer.mixer,
                    &x,
                    positions,
                    batch,
                    ranges,
                )?,
                (Mixer::GatedDeltaNet { .. }, None) => self.gated_delta_net(
                    index,
                    &layer.mixer,
                    LayerInput::Normed(&x),
                    batch,
                    ranges,
                    delta_rule_form,
                )?,
                _ => return Err(state_mismatch(index)),
            };
            backend.inject_into_streams(&mut streams, &mixed, &shares, scale)?;
            let (x, shares) = extras.mlp_hc.mix(backend, graph, &streams)?;
            let shares = shares.ok_or_else(|| state_mismatch(index))?;
            let fed = match &layer.feed_forward {
                feed_forward @ FeedForward::Moe(_) => {
                    self.feed_forward(scratch, index, feed_forward, &x)?
                }
                FeedForward::Dense { .. } | FeedForward::OffloadedDense { .. } => {
                    return Err(state_mismatch(index))
                }
            };
            backend.inject_into_streams(&mut streams, &fed, &shares, scale)?;
            // A layer split: the next layer's stage takes the streams from here.
            if let Some(next_stage) = self.cross_to_next_stage(index, &mut [&mut streams])? {
                backend = next_stage.backend;
                scratch.enter_stage(next_stage);
            }
        }
        let selected = match selection {
            LogitsSelection::All => streams,
            LogitsSelection::Last => {
                let last_rows: Vec<usize> = ranges.iter().map(|range| range.end - 1).collect();
                backend.gather_rows(&streams, &last_rows)?
            }
        };
        let (output, _) = graph.mixer.mix(backend, graph, &selected)?;
        finish(backend, output)
    }

    /// Adds a PLE layer's block to the streams: each token's hashed n-gram rows (carried
    /// context of its sequence first), a value gated per stream by the streams' similarity to
    /// the rows' keys, plus a dilated causal conv over the normalised gated values.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn ple_block(
        &self,
        graph: &Qwen4ExpGraph<B>,
        ple: &Ple<B>,
        index: usize,
        streams: &mut B::Tensor,
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
        ids: &[u32],
    ) -> Result<(), EngineError> {
        let backend = self.layer_backend(index);
        let hash = graph.hash.as_ref().ok_or_else(|| state_mismatch(index))?;
        let (count, hidden, eps) = (graph.streams(), graph.hidden(), graph.eps());
        let rows = ids.len();
        let embed_width = graph.config.ple_embed_dim;
        // The rows come from the host-RAM tables: gathered on the host, one upload.
        let mut embeddings = Vec::with_capacity(rows * embed_width);
        for (item, range) in batch.iter_mut().zip(ranges) {
            let state = ple_state(item, index)?;
            let row_ids = ple
                .hash
                .row_ids(hash, &state.context, &ids[range.clone()])?;
            ple.table
                .gather(&self.artifact, &row_ids, &mut embeddings)?;
        }
        let embedded = backend.upload(&embeddings, rows, embed_width)?;
        let style = NormStyle::ZeroCentred;
        let keys = backend.row_weighted_rms_norm(
            &backend.matmul(&embedded, &ple.key_proj)?,
            &ple.norm_key,
            hidden,
            eps,
            style,
        )?;
        let values = backend.matmul(&embedded, &ple.value_proj)?;
        let queries =
            backend.row_weighted_rms_norm(streams, &ple.norm_query, hidden, eps, style)?;
        let scale = 1.0 / (hidden as f32).sqrt();
        let mut gated = backend.ple_gate(&keys, &queries, &values, count, scale)?;
        let normed = backend.row_weighted_rms_norm(&gated, &ple.norm_conv, hidden, eps, style)?;
        let mut segments = Vec::with_capacity(batch.len());
        for (item, range) in batch.iter_mut().zip(ranges) {
            let start_position = item.state.position;
            let state = ple_state(item, index)?;
            segments.push(Segment {
                rows: range.clone(),
                start_position,
                state: &mut state.conv,
            });
        }
        let convolved = backend.causal_conv1d_silu(&normed, &ple.conv, &mut segments)?;
        drop(segments);
        // streams += gated + silu(conv), the sum of the two first as transformers adds them.
        backend.add_assign(&mut gated, &convolved)?;
        backend.add_assign(streams, &gated)?;
        for (item, range) in batch.iter_mut().zip(ranges) {
            let state = ple_state(item, index)?;
            let mut history: Vec<u32> = state.context.clone();
            history.extend_from_slice(&ids[range.clone()]);
            state.context = history[history.len() - state.context.len()..].to_vec();
        }
        Ok(())
    }

    /// A QSA attention layer: gated attention whose queries each attend the tokens their
    /// indexer selects (all of them up to the dense limit), over the sequences' host caches.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn sparse_attention(
        &self,
        graph: &Qwen4ExpGraph<B>,
        indexer: &Indexer<B>,
        index: usize,
        mixer: &Mixer<B>,
        x: &B::Tensor,
        positions: &[usize],
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
    ) -> Result<B::Tensor, EngineError> {
        let Mixer::Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
        } = mixer
        else {
            return Err(state_mismatch(index));
        };
        let backend = self.layer_backend(index);
        let spec = &self.spec.attention;
        let (eps, style) = (self.spec.eps(), self.spec.norm_style);
        let (heads, head_dim) = (spec.heads, spec.head_dim);
        let [projected, k, v] = backend.matmul3(x, [q_proj, k_proj, v_proj])?;
        let (q, gate) = backend.split_interleaved(&projected, heads, head_dim, head_dim)?;
        let rotation = Rotation {
            positions,
            head_dim,
            rotary_dim: self.spec.common.rotary_dim,
            theta: self.spec.common.rope_theta,
            multimodal: None,
        };
        let (q, k) = backend.rms_norm_rope_pair(&q, q_norm, &k, k_norm, eps, style, &rotation)?;
        let settings = &graph.qsa;
        let index_qk = backend.matmul(x, &indexer.qk_proj)?;
        let mut segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::SparseAttention(cache) => Some(cache),
            _ => None,
        })?;
        // The rows' own keys first (a query sees itself), pooling the blocks they complete.
        backend.qsa_append(
            &k,
            &v,
            &index_qk,
            &indexer.key_norm,
            settings,
            &mut segments,
        )?;
        let index_queries =
            backend.qsa_index_queries(&index_qk, &indexer.query_norm, settings, positions)?;
        let attended = backend.qsa_attention(&q, &index_queries, spec, settings, &mut segments)?;
        drop(segments);
        backend.matmul_mul_sigmoid(&attended, &gate, o_proj)
    }
}

/// The PLE state of layer `index` in `item`'s sequence.
fn ple_state<'s, B: Backend>(
    item: &'s mut SequenceInput<'_, B>,
    index: usize,
) -> Result<&'s mut PleState<B>, EngineError> {
    item.state
        .ple
        .get_mut(index)
        .and_then(Option::as_mut)
        .ok_or_else(|| state_mismatch(index))
}
