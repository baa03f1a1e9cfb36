//! The backend trait: every operation the model graphs need, over device-resident buffers.
//!
//! Owns: the contract between model code (`crate::model`) and compute backends. Activations are
//! `Backend::Tensor` (2-D, f32 semantics, `[rows, cols]`, one row per token); stored weights are
//! `Backend::Weight` handles loaded once from the artifact; per-sequence state lives in
//! `Backend::KvCache`, `Backend::ConvState` and `Backend::RecurrentState`. A backend keeps all of
//! these wherever it computes (host memory for `cpu`, GPU memory for `cuda`), so
//! the model code never moves data except where it says so (`download`, routing, experts).
//! Must not touch: model structure (which op follows which), the artifact byte layout.
//!
//! Errors: every op that touches the device returns a `Result`; a backend's own error travels
//! unchanged inside [`EngineError::Device`].
//!
//! Batched sequences: ops that mix tokens along time (attention, causal conv, delta rule) take the
//! whole batch tensor plus one [`Segment`] per sequence (its row range, first position and state),
//! a "varlen" interface that a GPU kernel can take in one launch.

pub mod candidates;
pub mod cpu;
pub mod cuda;
pub mod expert_slot_table;
pub mod kv_placement;
pub mod layer_input;
pub mod op_shapes;
pub mod qsa_host;
pub mod qsa_settings;
pub mod same_device;
pub mod step_graph_types;

use std::ops::Range;
use std::sync::Arc;

use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use crate::error::EngineError;

pub use candidates::LogitCandidates;
pub use expert_slot_table::{
    experts_copied_from_slots, ExpertSlotFills, ExpertSlotTable, SlotOutOfRange,
    WithExpertSlotTable,
};
pub use kv_placement::{DeviceKvShare, HostKvRequest, KvPlacement};
pub use layer_input::{LayerInput, ResidualNorm};
pub use op_shapes::{
    AttentionSpec, DeltaRuleForm, DeltaRuleSpec, MultimodalRotation, NormStyle, Rotation,
};
pub use qsa_settings::QsaSelectionSettings;
pub use step_graph_types::{FollowingStepGraph, StepGraphEnd, StepGraphRun};

/// One sequence's part of a batched op: its rows in the batch tensor, the position of its first
/// row, and its state for this layer.
pub struct Segment<'s, S> {
    pub rows: Range<usize>,
    pub start_position: usize,
    pub state: &'s mut S,
}

impl<'s, S> Segment<'s, S> {
    /// Sequences of `lengths` rows one after another in the batch, one state each, every one
    /// starting at position 0 (a prefill of fresh sequences).
    pub fn consecutive_from_position_zero(states: &'s mut [S], lengths: &[usize]) -> Vec<Self> {
        let mut start = 0;
        states
            .iter_mut()
            .zip(lengths)
            .map(|(state, &length)| {
                let rows = start..start + length;
                start += length;
                Segment {
                    rows,
                    start_position: 0,
                    state,
                }
            })
            .collect()
    }
}

/// Top-k routing of a batch: `experts_per_token` entries per token.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Routing {
    pub experts_per_token: usize,
    pub expert_ids: Vec<u32>,
    pub weights: Vec<f32>,
}

/// The stored bytes of expert `expert` of `bank` (its whole stride), checked against `layout`.
pub fn expert_bytes<'a>(
    artifact: &'a Artifact,
    bank: &ExpertBank,
    expert: usize,
    layout: &ExpertLayout,
) -> Result<&'a [u8], EngineError> {
    let invalid = |problem: String| EngineError::InvalidWeight {
        name: bank.prefix.clone(),
        problem,
    };
    if bank.expert_stride != layout.stride as u64 || layout.dtype.artifact_dtype() != bank.dtype {
        return Err(invalid(format!(
            "bank has stride {} and dtype {}, the slots expect {} and {}",
            bank.expert_stride,
            bank.dtype,
            layout.stride,
            layout.dtype.artifact_dtype()
        )));
    }
    if expert as u64 >= bank.num_experts {
        return Err(invalid(format!(
            "expert {expert} outside the bank of {}",
            bank.num_experts
        )));
    }
    let start = bank.offset + expert as u64 * bank.expert_stride;
    let end = start + bank.expert_stride;
    let bytes = artifact.bytes();
    let range = usize::try_from(start).ok().zip(usize::try_from(end).ok());
    match range {
        Some((start, end)) if end <= bytes.len() => Ok(&bytes[start..end]),
        _ => Err(invalid(format!(
            "expert {expert} ends at byte {end}, past the artifact's {} bytes",
            bytes.len()
        ))),
    }
}

/// The error for a slot or expert index outside the slots' tables.
/// A reshape of a `[from.0, from.1]` tensor to `[to.0, to.1]` keeps its element count (every
/// backend's `reshape` checks it the same way).
pub(crate) fn check_reshape(from: (usize, usize), to: (usize, usize)) -> Result<(), EngineError> {
    if to.0 * to.1 == from.0 * from.1 {
        return Ok(());
    }
    Err(EngineError::InvalidConfig {
        problem: format!("reshape of {}×{} to {}×{}", from.0, from.1, to.0, to.1),
    })
}

pub fn slot_out_of_range(error: SlotOutOfRange) -> EngineError {
    EngineError::InvalidConfig {
        problem: error.to_string(),
    }
}

/// A compute backend. Object safety is not needed (models are generic over the backend);
/// `Send + Sync` is, so one model can serve several threads.
pub trait Backend: Send + Sync + 'static {
    /// A 2-D activation buffer `[rows, cols]`.
    type Tensor: Send + Sync;
    /// A stored weight, resident where the backend computes.
    type Weight: Send + Sync;
    /// Keys and values of one attention layer of one sequence.
    type KvCache: Send + Sync;
    /// The last `Kc − 1` pre-conv inputs of one GDN layer of one sequence.
    type ConvState: Send + Sync;
    /// The fp32 delta-rule state `[nv, dk, dv]` of one GDN layer of one sequence.
    type RecurrentState: Send + Sync;
    /// Routed experts of one MoE layer resident where the backend computes ("GPU expert
    /// slots"): room for a fixed number of whole experts in their stored dtype, plus an
    /// expert → slot table the compute op reads, so which experts are resident can change
    /// between steps (the dynamic expert cache) without touching the model.
    type ExpertSlots: Send + Sync + WithExpertSlotTable + ExpertSlotFills;
    /// A routing computed by [`Backend::start_routing`] and not yet brought to the host.
    type PendingRouting: Send;
    /// One QSA attention layer of one sequence (qwen4_exp): its keys and values after norm and
    /// RoPE, its raw indexer keys and one pooled indexer key per completed block, where the
    /// backend computes, so a QSA layer never leaves the device.
    type QsaCache: Send + Sync;
    /// A decode step recorded once and replayed with new token ids and positions (CUDA
    /// graphs); an uninhabited type on a backend that runs every op as it comes.
    type StepGraph: Send;
    /// The expert workers' channels as this backend drives them itself (a GPU that posts a
    /// layer's requests and collects the answers through its own mapping of the channel
    /// memory); an uninhabited type on a backend without such a hand-off.
    type WorkerHandoff: Send + Sync;

    /// Short name for logs and test output (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// Whether tensors live in host memory, so a graph that does part of its math on the host
    /// between ops loses nothing by it (the CPU reference backend): there a graph may keep a
    /// host function where other backends compose ops (qwen4_exp's sigmoid-gated norm).
    fn computes_on_host(&self) -> bool {
        false
    }

    /// A weight used as a matrix (`[out, in]`, any dtype), read in place where possible.
    fn load_matrix(
        &self,
        artifact: &Arc<Artifact>,
        name: &str,
    ) -> Result<Self::Weight, EngineError>;
    /// A small parameter tensor (norm weights, conv taps, `A_log`, `dt_bias`).
    fn load_parameter(
        &self,
        artifact: &Arc<Artifact>,
        name: &str,
    ) -> Result<Self::Weight, EngineError>;
    /// A small parameter made on the host from stored ones at load (qwen4_exp's dilated PLE conv
    /// taps spread out with zeros into a plain conv's), `[rows, cols]`, kept as f32.
    fn parameter_from_values(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Self::Weight, EngineError>;
    /// `(rows, cols)` of a weight (a 1-D parameter is one row).
    fn weight_shape(&self, weight: &Self::Weight) -> (usize, usize);

    fn upload(&self, values: &[f32], rows: usize, cols: usize)
        -> Result<Self::Tensor, EngineError>;
    fn download(&self, tensor: &Self::Tensor) -> Result<Vec<f32>, EngineError>;
    fn shape(&self, tensor: &Self::Tensor) -> (usize, usize);
    /// A copy of `tensor` (of this backend) on `target`, another backend of the same type: the
    /// hidden state crossing from one pipeline stage to the next (`crate::model`'s layer
    /// split). This default goes through host memory (a download, then an upload, which waits
    /// for this backend's queued ops); the CUDA backend copies on the device (within a card's
    /// context, or peer to peer between cards; events order the two streams), with the same
    /// values.
    fn move_tensor_to(
        &self,
        tensor: &Self::Tensor,
        target: &Self,
    ) -> Result<Self::Tensor, EngineError>
    where
        Self: Sized,
    {
        let (rows, cols) = self.shape(tensor);
        target.upload(&self.download(tensor)?, rows, cols)
    }
    /// The same values with another shape (`rows · cols` must stay the same): row-major
    /// `[r, c]` read as `[r', c']`, without a copy where the backend can.
    fn reshape(
        &self,
        tensor: Self::Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Tensor, EngineError>;
    /// Copies of the given rows, in order.
    fn gather_rows(
        &self,
        tensor: &Self::Tensor,
        rows: &[usize],
    ) -> Result<Self::Tensor, EngineError>;
    /// Columns `range` of every row.
    fn columns(
        &self,
        tensor: &Self::Tensor,
        range: Range<usize>,
    ) -> Result<Self::Tensor, EngineError>;
    /// Columns `[0, w0)`, `[w0, w0 + w1)` and `[w0 + w1, w0 + w1 + w2)` of every row as three
    /// tensors (`widths` = `[w0, w1, w2]`): three [`Backend::columns`].
    fn split_columns3(
        &self,
        tensor: &Self::Tensor,
        widths: [usize; 3],
    ) -> Result<[Self::Tensor; 3], EngineError> {
        let [w0, w1, w2] = widths;
        Ok([
            self.columns(tensor, 0..w0)?,
            self.columns(tensor, w0..w0 + w1)?,
            self.columns(tensor, w0 + w1..w0 + w1 + w2)?,
        ])
    }
    /// Splits each row made of `groups` groups of `first + second` columns into the two parts,
    /// group-major: `[a_0 b_0 a_1 b_1 …] → ([a_0 a_1 …], [b_0 b_1 …])` (gated attention's q_proj).
    fn split_interleaved(
        &self,
        tensor: &Self::Tensor,
        groups: usize,
        first: usize,
        second: usize,
    ) -> Result<(Self::Tensor, Self::Tensor), EngineError>;

    /// Rows of an embedding table for the given token ids.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor, EngineError>;
    /// `x · Wᵀ`: `[n, in] × [out, in] → [n, out]`, f32 accumulation.
    fn matmul(&self, x: &Self::Tensor, weight: &Self::Weight) -> Result<Self::Tensor, EngineError>;
    /// `[a | b]`: the columns of `b` after those of `a`, row by row (the rows must agree).
    /// The default goes through the host; a backend may do it in place.
    fn concat_columns(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
    ) -> Result<Self::Tensor, EngineError> {
        let ((rows, a_cols), (b_rows, b_cols)) = (self.shape(a), self.shape(b));
        if rows != b_rows {
            return Err(EngineError::InvalidConfig {
                problem: format!("concat_columns of {rows} rows and {b_rows} rows"),
            });
        }
        let (a_values, b_values) = (self.download(a)?, self.download(b)?);
        let mut joined = Vec::with_capacity(rows * (a_cols + b_cols));
        for row in 0..rows {
            joined.extend_from_slice(&a_values[row * a_cols..(row + 1) * a_cols]);
            joined.extend_from_slice(&b_values[row * b_cols..(row + 1) * b_cols]);
        }
        self.upload(&joined, rows, a_cols + b_cols)
    }
    /// `[a; b]`: the rows of `b` after those of `a` (the columns must agree). The default goes
    /// through the host; a backend may copy on the device.
    fn concat_rows(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, EngineError> {
        let ((a_rows, cols), (b_rows, b_cols)) = (self.shape(a), self.shape(b));
        if cols != b_cols {
            return Err(EngineError::InvalidConfig {
                problem: format!("concat_rows of {cols} columns and {b_cols} columns"),
            });
        }
        let mut joined = self.download(a)?;
        joined.extend(self.download(b)?);
        self.upload(&joined, a_rows + b_rows, cols)
    }
    /// `x · wᵀ` for three weights of the same input (an attention layer's q, k and v
    /// projections), which a backend may do in one pass (the CUDA backend does at decode: one
    /// launch instead of three). Same values as three [`Backend::matmul`]s.
    fn matmul3(
        &self,
        x: &Self::Tensor,
        weights: [&Self::Weight; 3],
    ) -> Result<[Self::Tensor; 3], EngineError> {
        let [w0, w1, w2] = weights;
        Ok([
            self.matmul(x, w0)?,
            self.matmul(x, w1)?,
            self.matmul(x, w2)?,
        ])
    }
    /// [`Backend::add_rms_norm`] of the residual `x` and `delta`, then [`Backend::matmul3`] of the
    /// normed rows, which it returns with the projections: where the backend can, in one step
    /// with the same values (a GPU's one-token decode: a layer's first projections take the add
    /// and norm after the feed-forward before them into their launch). The default is the two
    /// calls.
    fn add_rms_norm_and_matmul3(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        norm: ResidualNorm<'_, Self::Weight>,
        weights: [&Self::Weight; 3],
    ) -> Result<(Self::Tensor, [Self::Tensor; 3]), EngineError> {
        let normed = self.add_rms_norm(x, delta, norm.weight, norm.eps, norm.style)?;
        let projections = self.matmul3(&normed, weights)?;
        Ok((normed, projections))
    }
    /// `silu(gate) · up`, then `· wᵀ` (an MLP's down projection of its activated rows), which a
    /// backend may do in one pass (the CUDA backend does at decode: one launch instead of two).
    /// Same values as [`Backend::silu_mul`] then [`Backend::matmul`].
    fn matmul_silu_mul(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        weight: &Self::Weight,
    ) -> Result<Self::Tensor, EngineError> {
        self.matmul(&self.silu_mul(gate, up)?, weight)
    }
    /// `(x · sigmoid(gate)) · wᵀ` (a gated attention's output projection), which a backend may do
    /// in one pass (the CUDA backend does at decode). Same values as [`Backend::mul_sigmoid`]
    /// then [`Backend::matmul`].
    fn matmul_mul_sigmoid(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        weight: &Self::Weight,
    ) -> Result<Self::Tensor, EngineError> {
        self.matmul(&self.mul_sigmoid(x, gate)?, weight)
    }
    /// RMSNorm over consecutive groups of `len(weight)` columns (so per-head norms take
    /// `[n, heads·hd]` with a `[hd]` weight).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
        style: NormStyle,
    ) -> Result<Self::Tensor, EngineError>;
    /// `x += delta`, then [`Backend::rms_norm`] of the new `x`: a residual add and the norm
    /// that follows it, which a backend may do in one pass (the CUDA backend does: one launch
    /// instead of two, twice per layer). Same values as the two ops.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
        style: NormStyle,
    ) -> Result<Self::Tensor, EngineError> {
        self.add_assign(x, delta)?;
        self.rms_norm(x, weight, eps, style)
    }
    /// [`Backend::rms_norm`] per head, then [`Backend::rope`] of the result: the q / k norms of
    /// an attention layer and their rotation, which a backend may do in one pass (the CUDA
    /// backend does when `len(weight)` is the head size: one launch instead of two, twice per
    /// layer). Same values as the two ops.
    fn rms_norm_rope(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
        style: NormStyle,
        rotation: &Rotation<'_>,
    ) -> Result<Self::Tensor, EngineError> {
        let mut out = self.rms_norm(x, weight, eps, style)?;
        self.rope(&mut out, rotation)?;
        Ok(out)
    }
    /// [`Backend::rms_norm_rope`] of an attention layer's q and k (the same rows and head size),
    /// which a backend may do in one pass (the CUDA backend does: one launch per layer instead
    /// of two). Same values as the two ops.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope_pair(
        &self,
        q: &Self::Tensor,
        q_weight: &Self::Weight,
        k: &Self::Tensor,
        k_weight: &Self::Weight,
        eps: f32,
        style: NormStyle,
        rotation: &Rotation<'_>,
    ) -> Result<(Self::Tensor, Self::Tensor), EngineError> {
        Ok((
            self.rms_norm_rope(q, q_weight, eps, style, rotation)?,
            self.rms_norm_rope(k, k_weight, eps, style, rotation)?,
        ))
    }
    /// GDN output norm: plain-weight RMSNorm per group of `len(weight)`, times `silu(gate)`.
    fn gated_rms_norm(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, EngineError>;
    /// Rotate-half RoPE on the first `rotary_dim` dims of each `head_dim` head; row `r` is at
    /// `positions[r]`.
    fn rope(&self, x: &mut Self::Tensor, rotation: &Rotation<'_>) -> Result<(), EngineError>;
    /// `a += b`.
    fn add_assign(&self, a: &mut Self::Tensor, b: &Self::Tensor) -> Result<(), EngineError>;
    /// `silu(gate) ⊙ up` where `gate_up` rows are `[gate ‖ up]` halves.
    fn silu_mul_halves(&self, gate_up: &Self::Tensor) -> Result<Self::Tensor, EngineError>;
    /// `silu(gate) ⊙ up`, same shapes.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor)
        -> Result<Self::Tensor, EngineError>;
    /// `x ⊙ sigmoid(gate)`, same shapes.
    fn mul_sigmoid(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
    ) -> Result<Self::Tensor, EngineError>;
    /// `a += sigmoid(gate[r, 0]) · b` per row (shared-expert gate).
    fn add_sigmoid_scaled_rows(
        &self,
        a: &mut Self::Tensor,
        b: &Self::Tensor,
        gate: &Self::Tensor,
    ) -> Result<(), EngineError>;

    /// RMSNorm over consecutive groups of `group` columns whose weight is as wide as a row (one
    /// weight per column, where [`Backend::rms_norm`] has one per place in a group): the
    /// grouped norm of qwen4_exp's residual streams, `[rows, n·H]` normed per stream of `H`
    /// with a weight per stream. The weight's length must be the row width, a multiple of
    /// `group`.
    fn row_weighted_rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        group: usize,
        eps: f32,
        style: NormStyle,
    ) -> Result<Self::Tensor, EngineError>;
    /// `silu(scale · x)`, element-wise.
    fn scaled_silu(&self, x: &Self::Tensor, scale: f32) -> Result<Self::Tensor, EngineError>;
    /// qwen4_exp's stream mix: `x` and `gate` are `[rows, streams·H]` (`streams` groups of
    /// `H` columns); `out[r, i] = scale · Σ_s sigmoid(gate[r, s·H + i]) · x[r, s·H + i]`, the
    /// sum in stream order. Returns `[rows, H]`.
    fn stream_mix(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        streams: usize,
        scale: f32,
    ) -> Result<Self::Tensor, EngineError>;
    /// qwen4_exp's injection of a block output into the residual streams:
    /// `streams[r, s·H + i] += 2·sigmoid(scale · shares[r, s]) · output[r, i]`, with `streams`
    /// `[rows, n·H]`, `output` `[rows, H]` and `shares` `[rows, n]`.
    fn inject_into_streams(
        &self,
        streams: &mut Self::Tensor,
        output: &Self::Tensor,
        shares: &Self::Tensor,
        scale: f32,
    ) -> Result<(), EngineError>;

    /// qwen4_exp's PLE gate: `keys` and `queries` are `[rows, streams·H]`, `values` `[rows, H]`;
    /// per row and stream, `d = scale · (keys · queries)` over the stream's `H` columns and
    /// `g = sign(d)·sqrt(max(|d|, 1e-6))` (0 where `d` is 0), and the output
    /// `[rows, streams·H]` is `sigmoid(g) · values` in each stream's columns.
    fn ple_gate(
        &self,
        keys: &Self::Tensor,
        queries: &Self::Tensor,
        values: &Self::Tensor,
        streams: usize,
        scale: f32,
    ) -> Result<Self::Tensor, EngineError>;

    /// Softmax over each row, top-k, optional renormalisation (fp32). Routing goes to the host:
    /// the expert executor (possibly another process) needs it there.
    fn route_top_k(
        &self,
        logits: &Self::Tensor,
        k: usize,
        normalize: bool,
    ) -> Result<Routing, EngineError>;

    /// Starts [`Backend::route_top_k`] of `logits` and, with `read_hidden`, the read-back of
    /// `hidden` (what the expert executor needs), without waiting: the routing is computed
    /// where the backend computes and stays there too, so work that needs it only there
    /// ([`Backend::slotted_experts_by_pending_routing`]) is queued before the host waits
    /// ([`Backend::finish_routing`]), and a layer whose experts are all resident need not wait
    /// at all until the forward's end. On a GPU the routing and the hidden states are copied to
    /// the host together, right behind the router, and finishing waits for those copies alone.
    fn start_routing(
        &self,
        logits: &Self::Tensor,
        k: usize,
        normalize: bool,
        hidden: &Self::Tensor,
        read_hidden: bool,
    ) -> Result<Self::PendingRouting, EngineError>;
    /// The router's logits `x · routerᵀ` and [`Backend::start_routing`] of them, with `x` as
    /// the hidden states: where the backend can, both in one step with the same values (a GPU's
    /// one-token decode: one launch instead of a matmul, a routing launch and the logits' round
    /// trip between them). The default is the two calls.
    fn start_routing_by_router(
        &self,
        x: &Self::Tensor,
        router: &Self::Weight,
        k: usize,
        normalize: bool,
        read_hidden: bool,
    ) -> Result<Self::PendingRouting, EngineError> {
        let logits = self.matmul(x, router)?;
        self.start_routing(&logits, k, normalize, x, read_hidden)
    }
    /// [`Backend::add_rms_norm`] of the residual `x` and `delta` (the norm's `weight`, `eps`,
    /// `style`), then [`Backend::start_routing_by_router`] of the normed rows, which it returns
    /// with the pending routing: where the backend can, all in one step with the same values (a
    /// GPU's one-token decode: the MoE layer after attention in one launch). The default is the
    /// two calls.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_and_start_routing_by_router(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        norm: ResidualNorm<'_, Self::Weight>,
        router: &Self::Weight,
        k: usize,
        normalize: bool,
        read_hidden: bool,
    ) -> Result<(Self::Tensor, Self::PendingRouting), EngineError> {
        let normed = self.add_rms_norm(x, delta, norm.weight, norm.eps, norm.style)?;
        let pending = self.start_routing_by_router(&normed, router, k, normalize, read_hidden)?;
        Ok((normed, pending))
    }
    /// [`Backend::slotted_experts`] with a routing [`Backend::start_routing`] started (same
    /// result; nothing waits for the routing's read-back on small batches).
    fn slotted_experts_by_pending_routing(
        &self,
        slots: &Self::ExpertSlots,
        x: &Self::Tensor,
        routing: &Self::PendingRouting,
    ) -> Result<Self::Tensor, EngineError>;
    /// The routing (and the hidden values, when asked) of a [`Backend::start_routing`], on
    /// the host.
    fn finish_routing(
        &self,
        routing: Self::PendingRouting,
    ) -> Result<(Routing, Vec<f32>), EngineError>;

    /// Empty KV cache with room for `max_tokens` positions of `kv_heads · head_dim` keys/values.
    fn new_kv_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
    ) -> Result<Self::KvCache, EngineError>;
    /// Appends each segment's `k`, `v` rows to its cache at its start position, then causal GQA
    /// attention of its `q` rows over everything cached. Returns `[n, heads·hd]`.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, Self::KvCache>],
    ) -> Result<Self::Tensor, EngineError>;

    /// Copies positions `from` of `source` to positions `to..` of `target`, keys and values bit
    /// for bit in the caches' dtype: how the prefix cache keeps a block of one sequence's cache
    /// and puts it back into another's. Both caches have the same width and dtype, and `target`
    /// has room for the rows.
    fn copy_kv_rows(
        &self,
        source: &Self::KvCache,
        from: Range<usize>,
        target: &mut Self::KvCache,
        to: usize,
    ) -> Result<(), EngineError>;
    /// Bytes a KV cache takes (its whole capacity).
    fn kv_cache_bytes(&self, cache: &Self::KvCache) -> usize;

    /// An empty QSA cache with room for `max_tokens` positions of `kv_width` keys/values and
    /// `settings.index_head_dim` indexer keys.
    fn new_qsa_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
        settings: &QsaSelectionSettings,
    ) -> Result<Self::QsaCache, EngineError>;
    /// Tokens a QSA cache holds.
    fn qsa_cache_tokens(&self, cache: &Self::QsaCache) -> usize;
    /// Forgets everything a QSA cache holds from token `tokens` on (a restored checkpoint: a
    /// speculative step's rejected tokens). A pooled key whose block loses a token is dropped
    /// and made again when the block completes again.
    fn truncate_qsa_cache(&self, cache: &mut Self::QsaCache, tokens: usize);
    /// [`Backend::copy_kv_rows`] for QSA caches: keys, values and raw indexer keys of positions
    /// `from` of `source` appended to `target`, which holds exactly `to` tokens, with the
    /// pooled keys of the blocks those rows complete, copied as they are (pooled at their
    /// positions in `source`: the prefix cache puts rows back where they were computed).
    /// `from.start` and `to` are multiples of the compression ratio.
    fn copy_qsa_rows(
        &self,
        source: &Self::QsaCache,
        from: Range<usize>,
        target: &mut Self::QsaCache,
        to: usize,
    ) -> Result<(), EngineError>;
    /// Bytes a QSA cache takes.
    fn qsa_cache_bytes(&self, cache: &Self::QsaCache) -> usize;
    /// Appends each segment's rows to its QSA cache at its start position: `k`, `v`
    /// (`[n, kv_width]`, after norm and RoPE) and the raw indexer key of each row, the last
    /// `index_head_dim` columns of `index_qk` (the indexer projection, `[n, (heads + 1)·Di]`).
    /// Every block completed by these rows is pooled once, here (mean of its raw keys,
    /// zero-centred RMSNorm with `key_norm`, RoPE at its first position:
    /// [`pooled_block_key`](crate::model::qwen4_exp::qsa_selection::pooled_block_key)). A
    /// segment that does not fit its cache fails the call before anything is appended.
    fn qsa_append(
        &self,
        k: &Self::Tensor,
        v: &Self::Tensor,
        index_qk: &Self::Tensor,
        key_norm: &Self::Weight,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, Self::QsaCache>],
    ) -> Result<(), EngineError>;
    /// The prepared indexer queries `[n, heads·Di]` of the first `heads·Di` columns of
    /// `index_qk`: each head zero-centred-RMS-normalised with `query_norm` and rotated at the
    /// row's position ([`prepare_index_query`](crate::model::qwen4_exp::qsa_selection::prepare_index_query)).
    fn qsa_index_queries(
        &self,
        index_qk: &Self::Tensor,
        query_norm: &Self::Weight,
        settings: &QsaSelectionSettings,
        positions: &[usize],
    ) -> Result<Self::Tensor, EngineError>;
    /// QSA attention of each segment's `q` rows (`[n, heads·hd]`, row `r` at position
    /// `start_position + r`) over the keys its indexer query selects from the segment's cache,
    /// which must already hold the rows' own keys ([`Backend::qsa_append`]): per row the
    /// blocks of [`select_tokens`](crate::model::qwen4_exp::qsa_selection::select_tokens) (all
    /// tokens in the dense regime; else the `budget / ratio` best-scoring complete blocks plus
    /// the tail), then GQA softmax attention over them in f32. Returns `[n, heads·hd]`.
    fn qsa_attention(
        &self,
        q: &Self::Tensor,
        index_queries: &Self::Tensor,
        spec: &AttentionSpec,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, Self::QsaCache>],
    ) -> Result<Self::Tensor, EngineError>;
    /// The token indices (ascending) each row of [`Backend::qsa_attention`] with these
    /// arguments would attend, read back to the host: the selection on its own, for tests and
    /// diagnostics.
    fn qsa_selected_tokens(
        &self,
        index_queries: &Self::Tensor,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, Self::QsaCache>],
    ) -> Result<Vec<Vec<usize>>, EngineError>;

    fn new_conv_state(
        &self,
        channels: usize,
        kernel: usize,
    ) -> Result<Self::ConvState, EngineError>;
    /// Depthwise causal conv1d (`weight` `[channels, Kc]`, last tap = current token) + SiLU, per
    /// segment, continuing from and updating each segment's conv state.
    fn causal_conv1d_silu(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        segments: &mut [Segment<'_, Self::ConvState>],
    ) -> Result<Self::Tensor, EngineError>;
    /// [`Backend::causal_conv1d_silu`] with its output split into channels `[0, w0)`,
    /// `[w0, w0 + w1)` and `[w0 + w1, w0 + w1 + w2)` (`widths`; a Gated DeltaNet layer's q, k and
    /// v), which a backend may do in one pass (the CUDA backend does: one launch instead of
    /// four). Same values as the conv then [`Backend::split_columns3`].
    fn causal_conv1d_silu_split3(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        segments: &mut [Segment<'_, Self::ConvState>],
        widths: [usize; 3],
    ) -> Result<[Self::Tensor; 3], EngineError> {
        let convolved = self.causal_conv1d_silu(x, weight, segments)?;
        self.split_columns3(&convolved, widths)
    }
    /// A copy of a conv state (a sequence's checkpoint).
    fn copy_conv_state(&self, state: &Self::ConvState) -> Result<Self::ConvState, EngineError>;
    /// A copy of a delta-rule state (a sequence's checkpoint).
    fn copy_recurrent_state(
        &self,
        state: &Self::RecurrentState,
    ) -> Result<Self::RecurrentState, EngineError>;
    /// `g = −exp(A_log) · softplus(a + dt_bias)`, `β = sigmoid(b)`; `a`, `b` are `[n, nv]`.
    fn delta_rule_gates(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Weight,
        dt_bias: &Self::Weight,
    ) -> Result<(Self::Tensor, Self::Tensor), EngineError>;
    fn new_recurrent_state(
        &self,
        spec: &DeltaRuleSpec,
    ) -> Result<Self::RecurrentState, EngineError>;
    /// The gated delta rule (q/k l2-normalised inside, q scaled by `dk^-0.5`, v-head `j` uses
    /// k-head `j / (nv/nk)`), continuing from and updating each segment's state.
    /// `q`, `k`: `[n, nk·dk]`, `v`: `[n, nv·dv]`, `g`, `beta`: `[n, nv]` → `[n, nv·dv]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        spec: &DeltaRuleSpec,
        form: DeltaRuleForm,
        segments: &mut [Segment<'_, Self::RecurrentState>],
    ) -> Result<Self::Tensor, EngineError>;

    /// `slots` empty places for experts of `layout` (one MoE layer with `num_experts` experts).
    fn new_expert_slots(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<Self::ExpertSlots, EngineError>;
    /// Copies expert `expert` of `bank` (its whole stride, straight from the artifact mapping)
    /// into `slot`; the expert that held the slot before leaves the table. May be asynchronous:
    /// the copy is ordered before any later op of this backend, and `artifact` is kept alive
    /// until it lands.
    fn fill_expert_slot(
        &self,
        slots: &mut Self::ExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError>;
    /// Readies `bank` in `artifact` as a source of later [`Backend::fill_expert_slot`] calls into
    /// `slots`, so the first fill does not pay for it (on a GPU: page-locks the bank's bytes now,
    /// at load, instead of inside the first long prompt's prefill). Failure to ready a bank is
    /// not an error: fills from it then take a slower path, as they would have anyway.
    fn prepare_expert_source(
        &self,
        _slots: &mut Self::ExpertSlots,
        _artifact: &Arc<Artifact>,
        _bank: &ExpertBank,
    ) {
    }
    /// `out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])` over the `(t, j)` whose expert is
    /// in a slot; the other pairs add nothing (their experts run elsewhere). `[tokens, hidden]`.
    fn slotted_experts(
        &self,
        slots: &Self::ExpertSlots,
        x: &Self::Tensor,
        routing: &Routing,
    ) -> Result<Self::Tensor, EngineError>;

    /// For each row of `logits` (`[rows, vocab]`): its `k` largest logits, max and log-sum-exp,
    /// and the logits of the ids in `extra[row]` (see [`LogitCandidates`]): what sampling needs
    /// instead of the whole row. `k` in `1..=candidates::MAX_CANDIDATES`; one `extra` list per
    /// row, every id inside the row.
    fn logit_candidates(
        &self,
        logits: &Self::Tensor,
        k: usize,
        extra: &[Vec<u32>],
    ) -> Result<Vec<LogitCandidates>, EngineError>;

    /// `--host-kv-mib`: KV caches made from now on go to a pool of page-locked host memory the
    /// GPU reads over PCIe once the device share is used up (whole caches: one attention layer
    /// of one sequence). Replaces an earlier request; caches already made stay where they are.
    /// Backends that keep KV caches in host memory anyway ignore it.
    fn reserve_host_kv(&self, request: &HostKvRequest) -> Result<(), EngineError> {
        let _ = request;
        Ok(())
    }

    /// Where the live KV caches are, for backends with a host KV pool (`None` otherwise).
    fn kv_placement(&self) -> Option<KvPlacement> {
        None
    }

    /// A step graph for decode steps of `rows` one-token sequences, or `None` where this
    /// backend does not replay steps (then the model runs every step op by op).
    fn new_step_graph(&self, rows: usize) -> Result<Option<Self::StepGraph>, EngineError> {
        let _ = rows;
        Ok(None)
    }

    /// Starts a decode step through `graph` with these token ids and positions (one per row).
    /// [`StepGraphRun::Replayed`]: the recorded step is queued and nothing else is needed.
    /// [`StepGraphRun::RunOps`]: the caller runs the step's ops now, exactly as it would without
    /// a graph, and then calls [`Backend::end_step_graph`]; the backend runs them in the graph's
    /// shape (positions read from device memory) or records them.
    fn begin_step_graph(
        &self,
        graph: &mut Self::StepGraph,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<StepGraphRun, EngineError>;

    /// Ends what [`Backend::begin_step_graph`] began with `RunOps`; `ops_succeeded` says whether
    /// every op of the step returned `Ok`.
    fn end_step_graph(
        &self,
        graph: &mut Self::StepGraph,
        ops_succeeded: bool,
    ) -> Result<StepGraphEnd, EngineError>;

    /// [`Backend::begin_step_graph`] for a model split over pipeline stages: this backend runs
    /// the first stage, `followers` the later ones in order. One recording spans every stage's
    /// ops and a replay is one launch here. An error leaves nothing run and no graph active (the
    /// caller then runs the step op by op). This default has no such graphs.
    fn begin_split_step_graph(
        &self,
        graph: &mut Self::StepGraph,
        followers: &mut [FollowingStepGraph<'_, Self>],
        ids: &[u32],
        positions: &[usize],
    ) -> Result<StepGraphRun, EngineError>
    where
        Self: Sized,
    {
        let _ = (graph, followers, ids, positions);
        Err(EngineError::InvalidConfig {
            problem: format!("{} records no step graph over several stages", self.name()),
        })
    }

    /// Ends what [`Backend::begin_split_step_graph`] began with `RunOps`, with the same
    /// `followers`.
    fn end_split_step_graph(
        &self,
        graph: &mut Self::StepGraph,
        followers: &mut [FollowingStepGraph<'_, Self>],
        ops_succeeded: bool,
    ) -> Result<StepGraphEnd, EngineError>
    where
        Self: Sized,
    {
        let _ = (graph, followers, ops_succeeded);
        Err(EngineError::InvalidConfig {
            problem: format!("{} records no step graph over several stages", self.name()),
        })
    }

    /// Waits until every queued op has run.
    fn wait_for_queued_ops(&self) -> Result<(), EngineError> {
        Ok(())
    }

    /// The routing of `pending` as its copies left it, without finishing it: a step graph
    /// keeps its pending routings and refreshes them at every replay.
    fn peek_routing(&self, pending: &Self::PendingRouting) -> Result<Routing, EngineError>;

    /// The hand-off this backend drives itself to the expert workers whose channels are
    /// `channels` (in worker order; the segments stay mapped while `keep_alive` lives), or
    /// `None` where the backend has none (then the host hands every layer off).
    fn new_worker_handoff(
        &self,
        channels: &[ninfer_channel::SegmentMemory],
        num_experts: usize,
        keep_alive: Box<dyn Send + Sync>,
    ) -> Result<Option<Self::WorkerHandoff>, EngineError> {
        let _ = (channels, num_experts, keep_alive);
        Ok(None)
    }

    /// Which worker owns which experts (disjoint ranges, in worker order), for the steps
    /// queued after this call.
    fn set_worker_handoff_owners(
        &self,
        handoff: &Self::WorkerHandoff,
        owned: &[Range<usize>],
    ) -> Result<(), EngineError>;

    /// Queues the posting of a MoE layer's routed experts of `pending` that are not in
    /// `resident` to the workers owning them, with the rows of `x` (layer `layer`).
    fn post_to_workers(
        &self,
        handoff: &Self::WorkerHandoff,
        layer: usize,
        x: &Self::Tensor,
        pending: &Self::PendingRouting,
        resident: Option<&Self::ExpertSlots>,
    ) -> Result<(), EngineError>;

    /// Queues the wait for the answers to the last [`Backend::post_to_workers`] and returns
    /// their sum (`[rows, hidden]`, worker order from 0.0: the host hand-off's additions).
    fn collect_from_workers(
        &self,
        handoff: &Self::WorkerHandoff,
        rows: usize,
    ) -> Result<Self::Tensor, EngineError>;

    /// Waits for every queued op and says whether a hand-off since the last call failed (its
    /// sums are then zeros and the step must not be used). The wait sleeps rather than spins:
    /// the workers compute on every core meanwhile.
    fn take_worker_handoff_failure(
        &self,
        handoff: &Self::WorkerHandoff,
    ) -> Result<Option<WorkerHandoffFailure>, EngineError>;
}

/// Why a hand-off the backend drove failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerHandoffFailure {
    /// The worker (index in worker order) refused layer `layer`'s request (its channel says
    /// why).
    Refused { worker: usize, layer: usize },
    /// The wait was given up: the worker did not come back within the engine's timeout.
    Abandoned { worker: usize, layer: usize },
}
