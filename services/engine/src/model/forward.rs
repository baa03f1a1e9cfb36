//! The batched forward pass: a batch checked and planned, every layer's mixer (attention or
//! Gated DeltaNet) and feed-forward (dense, offloaded or MoE) over all its sequences at once, the
//! head's logits, and the accounting of each forward.
//!
//! Owns: the order of a forward's ops. Must not touch: the ops themselves (the backend), how
//! routed experts are computed (`crate::moe`).

use std::time::Instant;

use ninfer_artifact::ExpertBank;

use crate::backend::{
    Backend, DeltaRuleForm, LayerInput, MultimodalRotation, ResidualNorm, Rotation, Segment,
};
use crate::error::EngineError;
use crate::model::layers::{
    layer_segments, state_mismatch, BatchPlan, DeltaRuleMix, FeedForward, LayerScratch, LayerState,
    LogitsSelection, Mixer, RowPositions, SequenceImages, SequenceInput, SequenceState,
};
use crate::model::qwen4_exp;
use crate::model::Model;
use crate::moe::expert_cache::ExpertCache;
use crate::moe::layer::DeferredRouting;
use crate::moe::ExpertBatch;
use crate::profile::{nanos, Phase, PhaseTotals};

impl<B: Backend> Model<B> {
    /// Prefill (or continue) one sequence; returns the logits of its last token.
    pub fn prefill(
        &self,
        state: &mut SequenceState<B>,
        tokens: &[u32],
    ) -> Result<Vec<f32>, EngineError> {
        let mut batch = [SequenceInput { state, tokens }];
        let mut logits = self.forward(&mut batch, LogitsSelection::Last)?;
        Ok(logits.pop().unwrap_or_default())
    }

    /// One forward over several sequences at once. Returns, per sequence, its logits
    /// (`[vocab]` for `Last`, `[new tokens · vocab]` for `All`).
    ///
    /// Input errors (too long, empty, unknown token) are found before any state changes, so the
    /// sequences stay usable. An error from the expert executor mid-forward leaves the states of
    /// this batch half-updated: their owners must drop them.
    pub fn forward(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        selection: LogitsSelection,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.vocab_size();
        let rows: Vec<usize> = batch
            .iter()
            .map(|item| match selection {
                LogitsSelection::Last => 1,
                LogitsSelection::All => item.tokens.len(),
            })
            .collect();
        let logits =
            self.forward_then(batch, selection, self.delta_rule_form, |backend, normed| {
                backend.download(&backend.matmul(&normed, self.head())?)
            })?;
        let mut out = Vec::with_capacity(rows.len());
        let mut row = 0;
        for rows in rows {
            let part = logits.get(row * vocab..(row + rows) * vocab);
            out.push(part.map(<[f32]>::to_vec).unwrap_or_default());
            row += rows;
        }
        Ok(out)
    }

    /// [`Model::forward`] with `LogitsSelection::Last`, the logits left on the backend
    /// (`[sequences, vocab]`): sampling reads back only what it needs
    /// ([`Backend::logit_candidates`]).
    pub fn forward_logits_on_backend(
        &self,
        batch: &mut [SequenceInput<'_, B>],
    ) -> Result<B::Tensor, EngineError> {
        if let Some(logits) = self.decode_through_step_graph(batch)? {
            return Ok(logits);
        }
        self.forward_then(
            batch,
            LogitsSelection::Last,
            self.delta_rule_form,
            |backend, normed| backend.matmul(&normed, self.head()),
        )
    }

    /// [`Model::forward`] with `LogitsSelection::All`, stopping before the head: every new
    /// row's last hidden state after the final norm (`[new tokens, hidden]`, sequences in batch
    /// order), what the head and the MTP head read. `delta_rule_form` overrides the model's
    /// (`Recurrent`: every row gets the bits a one-token forward gives it, as speculative
    /// verification needs).
    pub fn forward_hidden(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        delta_rule_form: Option<DeltaRuleForm>,
    ) -> Result<B::Tensor, EngineError> {
        let form = delta_rule_form.unwrap_or(self.delta_rule_form);
        self.forward_then(batch, LogitsSelection::All, form, |_, normed| Ok(normed))
    }

    /// The output projection (`lm_head`, or the embedding when they are tied).
    pub(in crate::model) fn head(&self) -> &B::Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The logits of final-normed hidden rows (`[rows · vocab]`).
    pub fn head_logits(&self, normed: &B::Tensor) -> Result<Vec<f32>, EngineError> {
        let backend = self.output_backend();
        backend.download(&backend.matmul(normed, self.head())?)
    }

    /// [`Model::head_logits`] left on the backend (`[rows, vocab]`).
    pub fn head_logits_on_backend(&self, normed: &B::Tensor) -> Result<B::Tensor, EngineError> {
        self.output_backend().matmul(normed, self.head())
    }

    /// Finishes the routings left on the backend during a forward and counts them.
    pub(in crate::model) fn finish_deferred_routing(
        &self,
        scratch: &mut LayerScratch<'_, B>,
    ) -> Result<(), EngineError> {
        for DeferredRouting { layer, pending } in scratch.deferred.drain(..) {
            let (routing, _) = self.layer_backend(layer).finish_routing(pending)?;
            if let Some(FeedForward::Moe(moe)) = self.moe_layer_at(layer) {
                moe.account_deferred_routing(
                    &scratch.moe_context,
                    layer,
                    &routing,
                    &mut scratch.tally,
                )?;
            }
        }
        Ok(())
    }

    /// The feed-forward of layer `index`: the decoder layers, then the MTP layer after them.
    pub(in crate::model) fn moe_layer_at(&self, index: usize) -> Option<&FeedForward<B>> {
        match self.layers.get(index) {
            Some(layer) => Some(&layer.feed_forward),
            None if index == self.layers.len() => {
                self.mtp.as_ref().map(|head| &head.layer.feed_forward)
            }
            None => None,
        }
    }

    /// A layer's feed-forward of its post-attention-normed input `x`.
    pub(in crate::model) fn feed_forward(
        &self,
        scratch: &mut LayerScratch<'_, B>,
        index: usize,
        feed_forward: &FeedForward<B>,
        x: &B::Tensor,
    ) -> Result<B::Tensor, EngineError> {
        let backend = self.layer_backend(index);
        match feed_forward {
            FeedForward::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => {
                // The activation inside the down projection where the backend can (one launch
                // fewer at decode on the GPU; the same values).
                backend.matmul_silu_mul(
                    &backend.matmul(x, gate_proj)?,
                    &backend.matmul(x, up_proj)?,
                    down_proj,
                )
            }
            FeedForward::OffloadedDense { bank } => {
                self.offloaded_dense_mlp(scratch, index, bank, x)
            }
            FeedForward::Moe(moe) => moe.forward(
                &scratch.moe_context,
                index,
                LayerInput::Normed(x),
                &mut scratch.tally,
                &mut scratch.deferred,
            ),
        }
    }

    /// An offloaded dense MLP: every token to the expert executor as expert 0 of the layer's
    /// one-expert bank with routing weight 1, which is the SwiGLU of the layer's MLP.
    pub(in crate::model) fn offloaded_dense_mlp(
        &self,
        scratch: &mut LayerScratch<'_, B>,
        index: usize,
        bank: &ExpertBank,
        x: &B::Tensor,
    ) -> Result<B::Tensor, EngineError> {
        let backend = self.layer_backend(index);
        let (rows, cols) = backend.shape(x);
        let copying = Instant::now();
        let hidden = backend.download(x)?;
        scratch.tally.transfer_nanos += nanos(copying.elapsed());
        let mut out = vec![0.0f32; hidden.len()];
        let waiting = Instant::now();
        self.experts.compute(
            &ExpertBatch {
                layer: index,
                bank,
                hidden_size: cols,
                intermediate_size: self.spec.common.intermediate_size,
                hidden: &hidden,
                experts_per_token: 1,
                expert_ids: &vec![0; rows],
                weights: &vec![1.0; rows],
            },
            &mut out,
        )?;
        scratch.tally.expert_wait_nanos += nanos(waiting.elapsed());
        let copying = Instant::now();
        let output = backend.upload(&out, rows, cols)?;
        scratch.tally.transfer_nanos += nanos(copying.elapsed());
        Ok(output)
    }

    /// Dense-MLP layers whose MLP the expert executor computes.
    pub fn offloaded_dense_mlp_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|layer| matches!(layer.feed_forward, FeedForward::OffloadedDense { .. }))
            .count()
    }

    /// The forward pass; `finish` takes the logits where [`Model::forward`] reads them back.
    pub(in crate::model) fn forward_then<T>(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        selection: LogitsSelection,
        delta_rule_form: DeltaRuleForm,
        finish: impl FnOnce(&B, B::Tensor) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let plan = self.batch_plan(batch)?;
        let started = Instant::now();
        self.expert_cache_between_steps()?;
        let handoff = self.ready_worker_handoff(plan.ids.len())?;
        // One stream per stage (the first stage's in the context; a crossing takes the next).
        let layerwise = self.layerwise_streams(plan.ids.len())?;
        let mut scratch = LayerScratch::new(self.moe_context_with(
            handoff.map(|h| h.handoff),
            layerwise.first().and_then(Option::as_ref),
        ));
        scratch.layerwise_by_stage = &layerwise;
        scratch.later_handoffs = handoff.map_or(&[], |h| h.later);
        let out = self.run_layers(
            batch,
            &plan,
            selection,
            delta_rule_form,
            &mut scratch,
            finish,
        )?;
        if let Some(handoff) = handoff {
            self.finish_worker_handoff(handoff, &mut scratch.tally)?;
        }
        self.finish_deferred_routing(&mut scratch)?;
        self.account_forward(batch, &plan, scratch.tally, started);
        Ok(out)
    }

    /// The expert cache's work between two steps (fills decided, finished fills put in the
    /// slot tables): before any op of the next step, outside any step graph. Nothing to do
    /// when the step before did it ahead ([`Model::expert_cache_upkeep_ahead`]).
    pub(in crate::model) fn expert_cache_between_steps(&self) -> Result<(), EngineError> {
        match &self.expert_cache {
            Some(cache) if !cache.take_upkept_ahead() => self.expert_cache_upkeep(cache, false),
            _ => Ok(()),
        }
    }

    /// The next step's expert cache work, done while the GPU runs a replayed step graph: its
    /// table changes and copies queue behind this step's graph, so they apply from the next
    /// step as before, but the host's driver calls (several per layer that fills, ~0.4 ms a
    /// step on a 40-layer model) leave the step's critical path. Fills decided here land a
    /// step later than fills decided between the steps.
    pub(in crate::model) fn expert_cache_upkeep_ahead(&self) -> Result<(), EngineError> {
        if let Some(cache) = self
            .expert_cache
            .as_ref()
            .filter(|cache| cache.options().upkeep_during_steps)
        {
            self.expert_cache_upkeep(cache, true)?;
            cache.mark_upkept_ahead();
        }
        Ok(())
    }

    fn expert_cache_upkeep(&self, cache: &ExpertCache, ahead: bool) -> Result<(), EngineError> {
        for (index, feed_forward) in self.feed_forwards().enumerate() {
            if let FeedForward::Moe(moe) = feed_forward {
                cache.between_steps(index, moe, &self.artifact, ahead)?;
            }
        }
        Ok(())
    }

    /// The token ids, row ranges and positions of a batch, once every input was checked: a
    /// batch that fails here leaves every sequence as it was.
    pub(in crate::model) fn batch_plan(
        &self,
        batch: &[SequenceInput<'_, B>],
    ) -> Result<BatchPlan, EngineError> {
        let vocab = self.vocab_size();
        let mut plan = BatchPlan::default();
        for item in batch.iter() {
            let state = &*item.state;
            if item.tokens.is_empty() {
                return Err(EngineError::EmptyInput {
                    what: "a sequence in the batch has no new tokens".into(),
                });
            }
            if state.layers.len() != self.layers.len() {
                return Err(EngineError::InvalidConfig {
                    problem: format!(
                        "sequence state has {} layers, the model {}",
                        state.layers.len(),
                        self.layers.len()
                    ),
                });
            }
            let end = state.position + item.tokens.len();
            if end > state.max_context {
                return Err(if state.position == 0 {
                    EngineError::PromptTooLong {
                        tokens: item.tokens.len(),
                        max_context: state.max_context,
                    }
                } else {
                    EngineError::ContextFull {
                        held: state.position,
                        added: item.tokens.len(),
                        max_context: state.max_context,
                    }
                });
            }
            if let Some(&token) = item.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::TokenOutOfVocabulary {
                    token,
                    vocab_size: vocab,
                });
            }
            let first = plan.ids.len();
            plan.ids.extend_from_slice(item.tokens);
            plan.ranges.push(first..plan.ids.len());
            match &state.images {
                None => plan.positions.extend(state.position..end),
                Some(images) => self.plan_image_rows(&mut plan, images, state.position..end, first),
            }
        }
        if plan.multimodal.is_some() {
            // Rows of sequences without images turn by their one position in every stream.
            let rows = plan.positions.len();
            if let Some((streams, _)) = plan.multimodal.as_mut() {
                streams.resize(rows, [usize::MAX; 3]);
                for (stream, &position) in streams.iter_mut().zip(&plan.positions) {
                    if stream[0] == usize::MAX {
                        *stream = [position; 3];
                    }
                }
            }
        }
        if plan.ids.is_empty() {
            return Err(EngineError::EmptyInput {
                what: "the batch has no sequences".into(),
            });
        }
        Ok(plan)
    }

    /// The rows of an image prompt's tokens `indices` (batch rows from `first`): their rotary
    /// positions, three streams where they differ, and the embeddings images replace.
    fn plan_image_rows(
        &self,
        plan: &mut BatchPlan,
        images: &std::sync::Arc<SequenceImages>,
        indices: std::ops::Range<usize>,
        first: usize,
    ) {
        for (offset, index) in indices.enumerate() {
            let row = first + offset;
            let streams = images.streams_at(index);
            plan.positions.push(streams[0]);
            if plan.multimodal.is_some() || streams[1..].iter().any(|&p| p != streams[0]) {
                let (all, _) = plan
                    .multimodal
                    .get_or_insert_with(|| (Vec::new(), images.section));
                // Rows skipped here turn by one position: filled in once the batch is planned.
                all.resize(row, [usize::MAX; 3]);
                all.push(streams);
            }
            if let Ok(embedding) = images.image_tokens.binary_search(&index) {
                plan.image_rows
                    .push((row, std::sync::Arc::clone(images), embedding));
            }
        }
    }

    /// The token embeddings of a batch with the image tokens' rows replaced by their images'
    /// embeddings (through the host: image prompts are prefills, once per prompt).
    fn embed_with_images(&self, plan: &BatchPlan) -> Result<B::Tensor, EngineError> {
        let backend = &*self.backend;
        let hidden_tensor = backend.embed(&self.embed_tokens, &plan.ids)?;
        if plan.image_rows.is_empty() {
            return Ok(hidden_tensor);
        }
        let (rows, hidden) = backend.shape(&hidden_tensor);
        let mut values = backend.download(&hidden_tensor)?;
        for (row, images, embedding) in &plan.image_rows {
            values[row * hidden..(row + 1) * hidden]
                .copy_from_slice(&images.embeddings[embedding * hidden..(embedding + 1) * hidden]);
        }
        backend.upload(&values, rows, hidden)
    }

    /// Every layer's ops and the final norm, then `finish`; the routings of all-resident MoE
    /// layers are left in `scratch.deferred`, and no sequence's position moves.
    pub(in crate::model) fn run_layers<'a, T>(
        &'a self,
        batch: &mut [SequenceInput<'_, B>],
        plan: &BatchPlan,
        selection: LogitsSelection,
        delta_rule_form: DeltaRuleForm,
        scratch: &mut LayerScratch<'a, B>,
        finish: impl FnOnce(&B, B::Tensor) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if let Some(graph) = &self.qwen4_exp {
            return self.run_qwen4_exp_layers(
                graph,
                batch,
                plan,
                selection,
                delta_rule_form,
                scratch,
                finish,
            );
        }
        let BatchPlan {
            ids,
            ranges,
            positions,
            multimodal,
            ..
        } = plan;
        let multimodal = multimodal
            .as_ref()
            .map(|(streams, section)| MultimodalRotation {
                streams,
                section: *section,
            });
        let eps = self.spec.eps();
        let style = self.spec.norm_style;
        let final_norm = self
            .final_norm
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: "the model has no final norm".into(),
            })?;
        // The first stage's (the only one's, unsplit): the embeddings and layer 0.
        let mut backend = &*self.backend;
        let mut hidden = if plan.image_rows.is_empty() {
            backend.embed(&self.embed_tokens, ids)?
        } else {
            self.embed_with_images(plan)?
        };
        // Each residual add goes with the norm after it: the first layer's input is normed here,
        // every later layer takes the feed-forward output before it (`carried`) as a residual
        // add and norm, which the backend may fold into the launch that reads the normed rows
        // (Backend::add_rms_norm_and_matmul3, …_and_start_routing_by_router).
        let first_normed = self
            .layers
            .first()
            .map(|layer| backend.rms_norm(&hidden, layer.input_norm()?, eps, style))
            .transpose()?;
        let mut carried: Option<B::Tensor> = None;
        for (index, layer) in self.layers.iter().enumerate() {
            let input = match (&carried, &first_normed) {
                (Some(fed), _) => LayerInput::AfterResidualAdd {
                    residual: &mut hidden,
                    delta: fed,
                    norm: ResidualNorm {
                        weight: layer.input_norm()?,
                        eps,
                        style,
                    },
                },
                (None, Some(normed)) => LayerInput::Normed(normed),
                (None, None) => {
                    return Err(EngineError::InvalidConfig {
                        problem: format!("layer {index} has no normed input"),
                    })
                }
            };
            let mixed = match &layer.mixer {
                Mixer::Attention { .. } => {
                    let rows = RowPositions {
                        positions,
                        multimodal,
                    };
                    self.attention(index, &layer.mixer, input, rows, batch, ranges)?
                }
                Mixer::GatedDeltaNet { .. } => self.gated_delta_net(
                    index,
                    &layer.mixer,
                    input,
                    batch,
                    ranges,
                    delta_rule_form,
                )?,
            };
            let post_attention_norm = ResidualNorm {
                weight: layer.post_attention_norm()?,
                eps,
                style,
            };
            // An MoE layer takes the residual add and its norm itself: the backend may fold
            // them into the router's launch.
            let mut fed = match &layer.feed_forward {
                FeedForward::Moe(moe) => moe.forward(
                    &scratch.moe_context,
                    index,
                    LayerInput::AfterResidualAdd {
                        residual: &mut hidden,
                        delta: &mixed,
                        norm: post_attention_norm,
                    },
                    &mut scratch.tally,
                    &mut scratch.deferred,
                )?,
                feed_forward => {
                    let x = backend.add_rms_norm(
                        &mut hidden,
                        &mixed,
                        post_attention_norm.weight,
                        eps,
                        style,
                    )?;
                    self.feed_forward(scratch, index, feed_forward, &x)?
                }
            };
            // A layer split: the next layer's stage takes the stream from here.
            if index + 1 < self.layers.len() {
                if let Some(next_stage) =
                    self.cross_to_next_stage(index, &mut [&mut hidden, &mut fed])?
                {
                    backend = next_stage.backend;
                    scratch.enter_stage(next_stage);
                }
            }
            carried = Some(fed);
        }
        if let Some(fed) = &carried {
            backend.add_assign(&mut hidden, fed)?;
        }

        let selected_rows: Vec<usize> = match selection {
            LogitsSelection::Last => ranges.iter().map(|r| r.end - 1).collect(),
            LogitsSelection::All => (0..ids.len()).collect(),
        };
        // Every row, in order (decode): no gather.
        let every_row = selected_rows.iter().copied().eq(0..ids.len());
        let normed = if every_row {
            backend.rms_norm(&hidden, final_norm, eps, style)?
        } else {
            let selected = backend.gather_rows(&hidden, &selected_rows)?;
            backend.rms_norm(&selected, final_norm, eps, style)?
        };
        finish(backend, normed)
    }

    /// After a forward's ops: every sequence moves past its new tokens, and the forward is
    /// counted in the profile.
    pub(in crate::model) fn account_forward(
        &self,
        batch: &mut [SequenceInput<'_, B>],
        plan: &BatchPlan,
        mut tally: PhaseTotals,
        started: Instant,
    ) {
        for (item, range) in batch.iter_mut().zip(&plan.ranges) {
            item.state.position += range.len();
        }
        tally.forwards = 1;
        tally.tokens = plan.ids.len() as u64;
        tally.forward_nanos = nanos(started.elapsed());
        let phase = if plan.ids.len() == batch.len() {
            Phase::Decode
        } else {
            Phase::Prefill
        };
        self.profile.record(phase, &tally);
    }

    pub(in crate::model) fn attention(
        &self,
        index: usize,
        mixer: &Mixer<B>,
        input: LayerInput<'_, B>,
        rows: RowPositions<'_>,
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
    ) -> Result<B::Tensor, EngineError> {
        let mut segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::Attention(cache) => Some(cache),
            _ => None,
        })?;
        self.attention_over(index, mixer, input, rows, &mut segments)
    }

    /// An attention mixer over rows whose caches the caller hands in (`positions` per row, or
    /// three streams per row for an image prompt).
    pub(in crate::model) fn attention_over(
        &self,
        index: usize,
        mixer: &Mixer<B>,
        input: LayerInput<'_, B>,
        rows: RowPositions<'_>,
        segments: &mut [Segment<'_, B::KvCache>],
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
        let [projected, k, v] = input.matmul3(backend, [q_proj, k_proj, v_proj])?;
        let (q, gate) = if self.spec.gated_attention {
            let (q, gate) =
                backend.split_interleaved(&projected, spec.heads, spec.head_dim, spec.head_dim)?;
            (q, Some(gate))
        } else {
            (projected, None)
        };
        let rotation = Rotation {
            positions: rows.positions,
            head_dim: spec.head_dim,
            rotary_dim: self.spec.common.rotary_dim,
            theta: self.spec.common.rope_theta,
            multimodal: rows.multimodal,
        };
        let (q, k) = backend.rms_norm_rope_pair(&q, q_norm, &k, k_norm, eps, style, &rotation)?;
        let output = backend.attention(&q, &k, &v, spec, segments)?;
        match gate {
            // The gate inside the output projection where the backend can (one launch fewer at
            // decode on the GPU; the same values).
            Some(gate) => backend.matmul_mul_sigmoid(&output, &gate, o_proj),
            None => backend.matmul(&output, o_proj),
        }
    }

    pub(in crate::model) fn gated_delta_net(
        &self,
        index: usize,
        mixer: &Mixer<B>,
        input: LayerInput<'_, B>,
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
        delta_rule_form: DeltaRuleForm,
    ) -> Result<B::Tensor, EngineError> {
        let (
            Mixer::GatedDeltaNet {
                in_proj_qkv,
                in_proj_z,
                in_proj_b,
                in_proj_a,
                conv1d,
                dt_bias,
                a_log,
                norm,
                out_proj,
            },
            Some(delta),
        ) = (mixer, &self.spec.delta_rule)
        else {
            return Err(state_mismatch(index));
        };
        let backend = self.layer_backend(index);
        // Three of the four input projections in one pass where the backend has one (one
        // launch instead of three at decode on the GPU; the same values), with the residual add
        // and norm before them where the backend folds those in too.
        let three = [in_proj_qkv, in_proj_z, in_proj_b];
        let normed_here;
        let (x, [qkv, z, b]) = match input {
            LayerInput::Normed(x) => (x, backend.matmul3(x, three)?),
            LayerInput::AfterResidualAdd {
                residual,
                delta,
                norm,
            } => {
                let (normed, projections) =
                    backend.add_rms_norm_and_matmul3(residual, delta, norm, three)?;
                normed_here = normed;
                (&normed_here, projections)
            }
        };
        let a = backend.matmul(x, in_proj_a)?;
        let mix = DeltaRuleMix {
            index,
            conv1d,
            a_log,
            dt_bias,
            delta,
            form: delta_rule_form,
        };
        let output = match self.mid_forward_capture_row(batch, ranges) {
            Some(split) => self.delta_rule_mix_with_capture(&mix, &qkv, &a, &b, batch, split)?,
            None => self.delta_rule_mix(&mix, &qkv, &a, &b, batch, ranges, 0)?,
        };
        // qwen4_exp may gate with a sigmoid, which the backend's gated norm does not: on the
        // CPU backend the host function (bit for bit what it always computed), elsewhere a
        // norm and a sigmoid gate as two ops.
        let sigmoid_norm = self
            .qwen4_exp
            .as_ref()
            .and_then(|graph| graph.sigmoid_gated_norm(index));
        let normed = match sigmoid_norm {
            Some(_) if !backend.computes_on_host() => {
                qwen4_exp::graph::sigmoid_gated_rms_norm_by_ops(
                    backend,
                    &output,
                    &z,
                    norm,
                    self.spec.eps(),
                )?
            }
            Some(weight) => {
                let (rows, cols) = backend.shape(&output);
                let normed = qwen4_exp::graph::sigmoid_gated_rms_norm(
                    &backend.download(&output)?,
                    &backend.download(&z)?,
                    weight,
                    self.spec.eps(),
                );
                backend.upload(&normed, rows, cols)?
            }
            None => backend.gated_rms_norm(&output, &z, norm, self.spec.eps())?,
        };
        backend.matmul(&normed, out_proj)
    }

    /// The short convolution and the delta rule of one Gated DeltaNet layer over the rows of
    /// `qkv`, `a`, `b` (every sequence of `batch` at its `ranges`, each starting
    /// `position_offset` tokens after its state's position).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn delta_rule_mix(
        &self,
        mix: &DeltaRuleMix<'_, B>,
        qkv: &B::Tensor,
        a: &B::Tensor,
        b: &B::Tensor,
        batch: &mut [SequenceInput<'_, B>],
        ranges: &[std::ops::Range<usize>],
        position_offset: usize,
    ) -> Result<B::Tensor, EngineError> {
        let index = mix.index;
        let backend = self.layer_backend(index);
        let delta = mix.delta;
        let mut conv_segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::GatedDeltaNet { conv, .. } => Some(conv),
            _ => None,
        })?;
        for segment in &mut conv_segments {
            segment.start_position += position_offset;
        }
        let key_width = delta.key_heads * delta.key_head_dim;
        let value_width = delta.value_heads * delta.value_head_dim;
        // The conv's output split into q, k and v (one launch on the GPU).
        let [q, k, v] = backend.causal_conv1d_silu_split3(
            qkv,
            mix.conv1d,
            &mut conv_segments,
            [key_width, key_width, value_width],
        )?;
        drop(conv_segments);
        let (g, beta) = backend.delta_rule_gates(a, b, mix.a_log, mix.dt_bias)?;

        let mut recurrent_segments = layer_segments(batch, ranges, index, |layer| match layer {
            LayerState::GatedDeltaNet { recurrent, .. } => Some(recurrent),
            _ => None,
        })?;
        for segment in &mut recurrent_segments {
            segment.start_position += position_offset;
        }
        backend.gated_delta_rule(
            &q,
            &k,
            &v,
            &g,
            &beta,
            delta,
            mix.form,
            &mut recurrent_segments,
        )
    }
}
